//! Check a GPU kernel against the ladder: `ladder-kernels`' FlashAttention-2 forward pass, in fp16
//! and bf16, on the head dimensions it supports, held to the float64 oracle (within twice the
//! error of the naive algorithm with a tensor core's 16-bit roundings) and to our CPU FA2.
//!
//! ```sh
//! cargo run --release -p ladder-compare --example check_gpu_kernel
//! ```
//!
//! Without a GPU it says so and exits with status 0; with `LADDER_REQUIRE_GPU=1` a missing GPU
//! fails it. The output buffers are poisoned with NaN before each launch (`gpu_or_skip`), so an
//! element the kernel forgets to write fails the check. `LADDER_DEVICE` and the other `LADDER_*`
//! variables of `ladder_compare::gpu_check` apply.

use std::process::ExitCode;

use anyhow::Context;
use ladder_compare::GpuRung;
use ladder_compare::check::{Check, Output, Precision, Problem, Rung};
use ladder_compare::gpu_check::gpu_or_skip;
use ladder_kernels::{Gpu, Options, fa2};
use ndarray::Array4;

// ANCHOR: gpu
/// Uploads the problem's inputs (already rounded to its 16-bit type), runs the kernel and
/// downloads `O` (fp16 or bf16, read back as `f32`) and `lse` (`f32`).
fn fa2_on_the_gpu(gpu: &Gpu, x: &Problem) -> anyhow::Result<Output> {
    let dtype = x.precision.kernel_dtype().context("a precision the kernels take")?;
    let inputs = x.inputs::<f32>();
    let upload = |t: &Array4<f32>| {
        let values: Vec<f32> = t.iter().copied().collect();
        gpu.upload(&values, t.shape(), dtype)
    };
    let (q, k, v) = (upload(&inputs.q)?, upload(&inputs.k)?, upload(&inputs.v)?);
    // The problem's scale is an f32 value for 16-bit precisions: the kernel sees the same one.
    let scale = x.scale() as f32;
    let opts = Options {
        causal: x.causal(),
        scale: Some(scale),
        deterministic: false,
        ..Options::default()
    };
    let out = fa2::forward(gpu, &q, &k, &v, &opts)?;
    Ok(Output::from_flat(x, &out.o.to_f32_vec()?, &out.lse.to_f32_vec()?)?)
}

fn main() -> ExitCode {
    // No GPU: a notice and `None`; `LADDER_REQUIRE_GPU=1` turns that into a failure.
    let Some(gpu) = gpu_or_skip("check_gpu_kernel") else { return ExitCode::SUCCESS };
    let check = Check::new(format!("ladder-kernels fa2 on {}", gpu.name()))
        .head_dims(GpuRung::Fa2.head_dims().iter().copied())
        .lengths(1..=300, 1..=300)
        .moderate_logits()
        .precisions([Precision::F16, Precision::Bf16])
        .against(Rung::Fa2)
        .cases(64);
    match check.run(|x| fa2_on_the_gpu(&gpu, x)) {
        Ok(passed) => {
            println!("{passed}");
            ExitCode::SUCCESS
        }
        Err(failed) => {
            println!("{failed}");
            ExitCode::FAILURE
        }
    }
}
// ANCHOR_END: gpu
