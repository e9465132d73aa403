//! The GPU rungs against their CPU rungs and the float64 oracle.
//!
//! Every case draws fresh random tensors (the shared proptest strategies: GQA, causal with
//! n_q ≠ n_kv, lengths that are not multiples of any tile), rounds them to the kernel's 16-bit
//! type (or keeps f32), runs the kernel with its output buffers poisoned with NaN (an element the
//! kernel forgets to write fails the check), and holds the result to LADDER.md's rule: within twice
//! the error of the naive algorithm in the same precision ([`low_precision`]), and within the sum
//! of both tolerances of the CPU rung.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` (set by the GPU
//! bundle) a missing GPU fails them.

use std::sync::OnceLock;

use ladder_compare::low_precision::{self, Half};
use ladder_compare::oracle::{Expected, ExpectedGradients, GradientOracle, Oracle, check};
use ladder_compare::{Case, CaseSpace, Inputs, cases};
use ladder_kernels::{DType, Gpu, KernelError, Options, Tensor, fa1, fa2, testing};
use ladder_reference::{
    AttentionOptions, AttentionOutput, Fa1Options, Fa2Options, Gradients, naive,
};
use ndarray::{Array3, Array4};
use proptest::prelude::*;

/// Random cases per property; `LADDER_GPU_CASES` lowers it (e.g. under compute-sanitizer).
fn cases_per_property() -> u32 {
    std::env::var("LADDER_GPU_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48)
}

fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Option<Gpu>> = OnceLock::new();
    GPU.get_or_init(|| testing::gpu_or_skip("GPU rung tests")).as_ref()
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Shapes for the GPU: longer sequences than the CPU suite (several tiles and a tail), the
/// head dimensions the rung supports, logits in a trained model's range.
fn space(head_dims: &[usize]) -> CaseSpace {
    CaseSpace {
        batch: 1..=2,
        heads_kv: 1..=2,
        group: 1..=3,
        n_q: 1..=300,
        n_kv: 1..=300,
        head_dims: head_dims.to_vec(),
        ..CaseSpace::cpu().moderate_logits()
    }
}

fn half_of(dtype: DType) -> Option<Half> {
    match dtype {
        DType::F16 => Some(Half::F16),
        DType::BF16 => Some(Half::BF16),
        DType::F32 => None,
    }
}

/// The case's tensors as the device will hold them (rounded to `dtype`), in f64.
fn device_inputs(case: &Case, dtype: DType) -> Inputs<f64> {
    let x = case.inputs::<f64>();
    let round = |t: &Array4<f64>| match half_of(dtype) {
        Some(h) => h.round_all(t),
        None => t.mapv(|v| v as f32 as f64),
    };
    Inputs { q: round(&x.q), k: round(&x.k), v: round(&x.v), d_o: round(&x.d_o) }
}

fn upload(gpu: &Gpu, x: &Array4<f64>, dtype: DType) -> Result<Tensor, KernelError> {
    let values: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    gpu.upload(&values, x.shape(), dtype)
}

fn download4(t: &Tensor, dims: [usize; 4]) -> Result<Array4<f32>, TestCaseError> {
    Array4::from_shape_vec(dims, t.to_f32_vec().map_err(fail)?).map_err(fail)
}

fn download3(t: &Tensor, dims: [usize; 3]) -> Result<Array3<f32>, TestCaseError> {
    Array3::from_shape_vec(dims, t.to_f32_vec().map_err(fail)?).map_err(fail)
}

/// Options with the scale the kernel will really use (f32).
fn options(case: &Case) -> (AttentionOptions, Options) {
    let scale = case.scale() as f32;
    (
        AttentionOptions { causal: case.causal, scale: Some(scale as f64) },
        Options { causal: case.causal, scale: Some(scale) },
    )
}

type GpuForward =
    fn(&Gpu, &Tensor, &Tensor, &Tensor, &Options) -> ladder_kernels::Result<ladder_kernels::Output>;

/// The CPU rung a GPU rung is checked against.
type CpuForward = fn(&Inputs<f32>, &Case) -> AttentionOutput<f32>;

/// Runs a GPU forward rung on `case` and checks it against the oracle and `cpu_rung` (in f32).
fn check_forward(
    rung: &str,
    kernel: GpuForward,
    cpu_rung: (&str, CpuForward),
    case: &Case,
    dtype: DType,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let x = device_inputs(case, dtype);
    let (attention, opts) = options(case);
    let q = upload(gpu, &x.q, dtype).map_err(fail)?;
    let k = upload(gpu, &x.k, dtype).map_err(fail)?;
    let v = upload(gpu, &x.v, dtype).map_err(fail)?;
    let out = kernel(gpu, &q, &k, &v, &opts).map_err(fail)?;
    let s = case.shape;
    let got = AttentionOutput {
        o: download4(&out.o, s.q_dims())?,
        lse: download3(&out.lse, [s.batch, s.heads_q, s.n_q])?,
        stats: Default::default(),
    };

    let oracle = Oracle::new(&x, &attention).map_err(fail)?;
    let x32 = Inputs {
        q: x.q.mapv(|v| v as f32),
        k: x.k.mapv(|v| v as f32),
        v: x.v.mapv(|v| v as f32),
        d_o: x.d_o.mapv(|v| v as f32),
    };
    // The same precision as the kernel: f32 arithmetic, with P and O rounded to 16 bits when the
    // kernel rounds them.
    let naive32 =
        naive::attention(x32.q.view(), x32.k.view(), x32.v.view(), &attention).map_err(fail)?;
    let baseline = match half_of(dtype) {
        Some(h) => {
            let low = low_precision::attention(x.q.view(), x.k.view(), x.v.view(), &attention, h)
                .map_err(fail)?;
            AttentionOutput { o: low.o.mapv(|v| v as f32), ..naive32 }
        }
        None => naive32,
    };
    let expected = Expected::from_baseline(&oracle, &baseline);
    let cpu_out = (cpu_rung.1)(&x32, case);
    let cpu_expected = Expected::from_oracle(&oracle, &x32).map_err(fail)?;
    check(rung, &got, &expected, Some((cpu_rung.0, &cpu_out, &cpu_expected))).map_err(fail)
}

fn cpu_fa1(x: &Inputs<f32>, case: &Case) -> AttentionOutput<f32> {
    let opts = Fa1Options::new(options(case).0);
    ladder_reference::fa1::forward(x.q.view(), x.k.view(), x.v.view(), &opts)
        .expect("CPU FA1 on a valid case")
}

fn cpu_fa2(x: &Inputs<f32>, case: &Case) -> AttentionOutput<f32> {
    let opts = Fa2Options::new(options(case).0);
    ladder_reference::fa2::forward(x.q.view(), x.k.view(), x.v.view(), &opts)
        .expect("CPU FA2 on a valid case")
}

/// Runs the GPU FA2 forward and backward on `case` and checks `dQ, dK, dV` against the float64
/// oracle (within twice the 16-bit naive backward's error) and against the CPU FA2 backward.
fn check_backward(case: &Case, dtype: DType) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let half = half_of(dtype).expect("a 16-bit type");
    let x = device_inputs(case, dtype);
    let (attention, opts) = options(case);
    let [q, k, v, d_o] = [&x.q, &x.k, &x.v, &x.d_o].map(|t| upload(gpu, t, dtype));
    let (q, k, v, d_o) = (q.map_err(fail)?, k.map_err(fail)?, v.map_err(fail)?, d_o.map_err(fail)?);
    let out = fa2::forward(gpu, &q, &k, &v, &opts).map_err(fail)?;
    let g = fa2::backward(gpu, &q, &k, &v, &out.o, &out.lse, &d_o, &opts).map_err(fail)?;
    let s = case.shape;
    let got = Gradients {
        dq: download4(&g.dq, s.q_dims())?,
        dk: download4(&g.dk, s.kv_dims())?,
        dv: download4(&g.dv, s.kv_dims())?,
        stats: Default::default(),
    };

    let oracle = GradientOracle::new(&x, &attention).map_err(fail)?;
    let low =
        low_precision::backward(x.q.view(), x.k.view(), x.v.view(), x.d_o.view(), &attention, half)
            .map_err(fail)?;
    let to32 = |a: &Array4<f64>| a.mapv(|v| v as f32);
    let baseline =
        Gradients { dq: to32(&low.dq), dk: to32(&low.dk), dv: to32(&low.dv), stats: low.stats };
    let expected = ExpectedGradients::from_baseline(&oracle, &baseline);
    let (errs, pass) = expected.judge(&got);
    if !pass {
        return Err(fail(format!(
            "fa2 backward (GPU, {dtype}) vs oracle: dQ {} dK {} dV {} (tol {} / {} / {})",
            errs[0],
            errs[1],
            errs[2],
            expected.tolerances[0],
            expected.tolerances[1],
            expected.tolerances[2]
        )));
    }
    // Against the CPU rung: each within its own tolerance of the oracle, so within the sum.
    let x32 = Inputs { q: to32(&x.q), k: to32(&x.k), v: to32(&x.v), d_o: to32(&x.d_o) };
    let cpu_opts = Fa2Options::new(attention);
    let cpu_fwd =
        ladder_reference::fa2::forward(x32.q.view(), x32.k.view(), x32.v.view(), &cpu_opts)
            .map_err(fail)?;
    let cpu = ladder_reference::fa2::backward(
        x32.q.view(),
        x32.k.view(),
        x32.v.view(),
        cpu_fwd.o.view(),
        x32.d_o.view(),
        cpu_fwd.lse.view(),
        &cpu_opts,
    )
    .map_err(fail)?;
    let cpu_expected = ExpectedGradients::from_oracle(&oracle, &x32).map_err(fail)?;
    for (t, (gpu_t, cpu_t)) in
        [(&got.dq, &cpu.dq), (&got.dk, &cpu.dk), (&got.dv, &cpu.dv)].into_iter().enumerate()
    {
        let err = ladder_compare::metrics::error_between(gpu_t, cpu_t);
        let tol = expected.tolerances[t].plus(cpu_expected.tolerances[t]);
        if !tol.admits(err) {
            return Err(fail(format!(
                "fa2 backward (GPU, {dtype}) vs CPU fa2 backward, gradient {t}: {err} (tol {tol})"
            )));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases_per_property()))]

    #[test]
    fn gpu_fa2_backward_fp16_matches_the_oracle_and_cpu_fa2(case in cases(space(fa2::BACKWARD_HEAD_DIMS))) {
        check_backward(&case, DType::F16)?;
    }

    #[test]
    fn gpu_fa2_backward_bf16_matches_the_oracle_and_cpu_fa2(case in cases(space(fa2::BACKWARD_HEAD_DIMS))) {
        check_backward(&case, DType::BF16)?;
    }

    #[test]
    fn gpu_fa1_fp16_matches_cpu_fa1_and_the_oracle(case in cases(space(fa1::HEAD_DIMS))) {
        check_forward("fa1 (GPU, fp16)", fa1::forward, ("fa1 (CPU)", cpu_fa1), &case, DType::F16)?;
    }

    #[test]
    fn gpu_fa1_f32_matches_cpu_fa1_and_the_oracle(case in cases(space(fa1::HEAD_DIMS))) {
        check_forward("fa1 (GPU, f32)", fa1::forward, ("fa1 (CPU)", cpu_fa1), &case, DType::F32)?;
    }

    #[test]
    fn gpu_fa2_fp16_matches_cpu_fa2_and_the_oracle(case in cases(space(fa2::HEAD_DIMS))) {
        check_forward("fa2 (GPU, fp16)", fa2::forward, ("fa2 (CPU)", cpu_fa2), &case, DType::F16)?;
    }

    #[test]
    fn gpu_fa2_bf16_matches_cpu_fa2_and_the_oracle(case in cases(space(fa2::HEAD_DIMS))) {
        check_forward("fa2 (GPU, bf16)", fa2::forward, ("fa2 (CPU)", cpu_fa2), &case, DType::BF16)?;
    }
}

/// One larger problem per head dimension: many tiles, GQA, causal with n_q < n_kv (a KV cache).
#[test]
fn gpu_fa2_long_sequences() {
    for (d, causal) in [(64, true), (128, false), (128, true), (256, true)] {
        let case = Case {
            shape: ladder_reference::AttentionShape::new(1, 4, 2, 700, 1500, d).unwrap(),
            causal,
            logit_std: 1.0,
            tiles: ladder_reference::TileSizes::new(64, 64).unwrap(),
            splits: 1,
            seed: 1000 + d as u64,
        };
        check_forward("fa2 (GPU, fp16)", fa2::forward, ("fa2 (CPU)", cpu_fa2), &case, DType::F16)
            .unwrap_or_else(|e| panic!("d = {d}, causal = {causal}: {e}"));
    }
}

/// Backward on a longer problem: many K/V and query tiles, GQA, causal with n_q < n_kv.
#[test]
fn gpu_fa2_backward_long_sequences() {
    for (d, causal) in [(64, true), (128, false), (128, true)] {
        let case = Case {
            shape: ladder_reference::AttentionShape::new(1, 4, 2, 300, 700, d).unwrap(),
            causal,
            logit_std: 1.0,
            tiles: ladder_reference::TileSizes::new(64, 64).unwrap(),
            splits: 1,
            seed: 2000 + d as u64,
        };
        check_backward(&case, DType::F16)
            .unwrap_or_else(|e| panic!("d = {d}, causal = {causal}: {e}"));
    }
}

/// Bad input is an error naming the problem, never a panic or a wrong answer.
#[test]
fn gpu_rungs_reject_bad_input() {
    let Some(gpu) = gpu() else { return };
    let t = |shape: &[usize], dtype| {
        let n: usize = shape.iter().product();
        gpu.upload(&vec![0.5; n], shape, dtype).unwrap()
    };
    let q = t(&[1, 2, 8, 96], DType::F16);
    let err = fa2::forward(gpu, &q, &q, &q, &Options::full()).unwrap_err();
    assert!(matches!(err, KernelError::UnsupportedHeadDim { d: 96, .. }), "{err}");
    let q32 = t(&[1, 2, 8, 64], DType::F32);
    let err = fa2::forward(gpu, &q32, &q32, &q32, &Options::full()).unwrap_err();
    assert!(matches!(err, KernelError::UnsupportedDtype { .. }), "{err}");
    let (q, k) = (t(&[1, 3, 8, 64], DType::F16), t(&[1, 2, 8, 64], DType::F16));
    let err = fa2::forward(gpu, &q, &k, &k, &Options::full()).unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
    let v = t(&[1, 2, 9, 64], DType::F16);
    let err = fa1::forward(gpu, &k, &k, &v, &Options::causal()).unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)), "{err}");
    let q = t(&[1, 2, 8, 256], DType::F16);
    let out = fa2::forward(gpu, &q, &q, &q, &Options::full()).unwrap();
    let err = fa2::backward(gpu, &q, &q, &q, &out.o, &out.lse, &q, &Options::full()).unwrap_err();
    assert!(matches!(err, KernelError::UnsupportedHeadDim { d: 256, .. }), "{err}");
    let err = gpu.upload(&[1.0; 3], &[2, 2], DType::F16).unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)), "{err}");
}
