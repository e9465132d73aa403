//! The GPU rungs run live, when the machine has a GPU: the notebook's "on the GPU" section first
//! runs the kernel on a small problem and checks it against the float64 oracle, with the same
//! rule as the GPU tests (`crates/compare/tests/gpu.rs`); without a GPU it says so, and the cell
//! after it shows the figures measured on the H200.

use ladder_compare::cases::Case;
use ladder_compare::gpu_check;
use ladder_compare::gpu_rungs::GpuRung;
use ladder_compare::oracle::{GradientOracle, Oracle};
use ladder_compare::results::Direction;
use ladder_kernels::DType;
use ladder_reference::{AttentionShape, TileSizes};

use crate::Failure;

/// Runs GPU `rung` (`"fa1"`, `"fa2"`, whose backward pass runs too, or `"fa3"` on Hopper) on a causal grouped-query
/// problem in fp16 and checks it against the float64 oracle. `Ok` without a GPU (after saying so);
/// an error when a kernel is outside its tolerance.
pub fn gpu_live(rung: &str) -> Result<(), Failure> {
    let gpu = match ladder_compare::gpu_check::open_gpu() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("No GPU on this machine ({e}).");
            println!(
                "The kernels are not run here; the next cell shows what they did on the H200."
            );
            return Ok(());
        }
    };
    let Some(forward) = GpuRung::find(rung, Direction::Fwd) else {
        return Err(Failure(format!("no GPU kernel for {rung:?}")));
    };
    if !forward.available_on(&gpu) {
        println!(
            "{} ({}) cannot run {rung}: it needs a Hopper GPU (sm_90a). The next cell shows what \
             it did on the H200.",
            gpu.name(),
            gpu.arch()
        );
        return Ok(());
    }
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let shape = AttentionShape::new(1, 8, 2, 500, 700, 64).map_err(|e| fail(&e))?;
    let tiles = TileSizes::new(64, 64).map_err(|e| fail(&e))?;
    let case = Case { shape, causal: true, logit_std: 1.0, tiles, splits: 1, seed: 2024 };
    let dtype = DType::F16;
    let x = gpu_check::device_inputs(&case, dtype);
    let (attention, opts) = gpu_check::options(&case.attention(), shape.d);
    println!(
        "{} ({}), fp16, batch 1, 8 query heads over 2 kv heads, n_q 500, n_kv 700, d 64, causal",
        gpu.name(),
        gpu.arch()
    );

    let (out, elapsed) =
        gpu_check::forward(&gpu, forward, &x, &opts, dtype).map_err(|e| fail(&e))?;
    let oracle = Oracle::new(&x, &attention).map_err(|e| fail(&e))?;
    let expected = gpu_check::expected_forward(&oracle, &x, dtype).map_err(|e| fail(&e))?;
    let verdict = expected.judge(&out);
    println!(
        "{rung} forward: O vs oracle {} (tolerance {}), {:.3} ms (first call includes compiling the kernel)",
        verdict.o,
        expected.o,
        elapsed.as_secs_f64() * 1e3
    );
    if !verdict.pass {
        return Err(Failure(format!("{rung} forward on the GPU is out of tolerance")));
    }
    if let Some(backward) = GpuRung::find(rung, Direction::Bwd) {
        let (grads, elapsed) =
            gpu_check::backward(&gpu, backward, &x, &opts, dtype).map_err(|e| fail(&e))?;
        let oracle = GradientOracle::new(&x, &attention).map_err(|e| fail(&e))?;
        let expected = gpu_check::expected_backward(&oracle, &x, dtype).map_err(|e| fail(&e))?;
        let (errs, pass) = expected.judge(&grads);
        println!(
            "{rung} backward: dQ {} dK {} dV {} vs oracle, {:.3} ms",
            errs[0],
            errs[1],
            errs[2],
            elapsed.as_secs_f64() * 1e3
        );
        if !pass {
            return Err(Failure(format!("{rung} backward on the GPU is out of tolerance")));
        }
    }
    println!("ok: within tolerance");
    Ok(())
}
