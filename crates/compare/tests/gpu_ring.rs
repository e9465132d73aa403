//! Ring attention on the GPU (`ladder_kernels::ring`, the ranks simulated on one GPU) against
//! the float64 oracle on the whole sequence and against the single-GPU kernel on the same
//! sequence (`ladder_kernels::attention`: FA3 on Hopper where it takes the call, FA2 otherwise).
//!
//! Each case draws a sequence of 1 to 300 tokens (mostly lengths that neither the ranks nor `2P`
//! divide; now and then shorter than `2P`, so that some chunks are empty), 1 to 5 ranks, the zigzag or the
//! contiguous sharding, causal or not, GQA, every head dimension FA2 takes (FA3 declines some,
//! and those chunk pairs run on FA2), sinks or none, Q, K and V in any of the checks' layouts, fp16
//! and bf16. The outputs are poisoned before every launch, so a row the finish never writes
//! shows as NaN (a pair the merge misses leaves its rows short of that pair's keys, which the
//! oracle's comparison catches). The backward pass (head dimensions up to 128) is held the same way: its
//! dQ, dK, dV (and the sinks' gradient) to the float64 oracle's and to the whole sequence's
//! backward on one GPU.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` (the GPU
//! bundle) a missing GPU fails them.

use ladder_compare::gpu_check::{self, Layout, device_inputs, shared_gpu, upload_in};
use ladder_compare::metrics::error_between_in_units_of;
use ladder_compare::oracle::{GradientOracle, Oracle, check};
use ladder_compare::{CaseSpace, GpuRung, cases};
use ladder_kernels::ring::{self, RingOptions, Sharding};
use ladder_kernels::{DType, Gpu, KernelError, Options, Output, Sinks, Tensor, Window, attention};
use ladder_reference::{AttentionOutput, Gradients};
use ndarray::{Array1, Array3, Array4};
use proptest::prelude::*;

fn gpu() -> Option<&'static Gpu> {
    shared_gpu("GPU ring tests")
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// `out` on the host, `[batch, heads_q, n, d]` and `[batch, heads_q, n]`.
fn download(out: &Output, dims: [usize; 4]) -> anyhow::Result<AttentionOutput<f32>> {
    Ok(AttentionOutput {
        o: Array4::from_shape_vec(dims, out.o.to_f32_vec()?)?,
        lse: Array3::from_shape_vec([dims[0], dims[1], dims[2]], out.lse.to_f32_vec()?)?,
        stats: Default::default(),
    })
}

/// The case's options for the oracle and the kernels, with one sink per query head if `sinks`.
fn options(
    case: &ladder_compare::Case,
    sinks: bool,
) -> Result<(ladder_reference::AttentionOptions, Options), TestCaseError> {
    let (attention, opts) = gpu_check::case_options(case);
    if !sinks {
        return Ok((attention, opts));
    }
    let values: Vec<f32> = (0..case.shape.heads_q).map(|h| h as f32 * 0.5 - 1.0).collect();
    let attention = attention.with_sinks(values.iter().map(|&s| f64::from(s)).collect());
    Ok((attention, opts.with_sinks(Sinks::new(values).map_err(fail)?)))
}

/// The ring on `ranks` simulated ranks against the oracle and the single-GPU kernel.
fn check_ring(
    case: &ladder_compare::Case,
    ranks: usize,
    sharding: Sharding,
    sinks: bool,
    dtype: DType,
    layout: Layout,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let x = device_inputs(case, dtype);
    let (attention, opts) = options(case, sinks)?;
    let upload = |a: &Array4<f64>| upload_in(gpu, a, dtype, layout).map_err(fail);
    let (q, k, v): (Tensor, Tensor, Tensor) = (upload(&x.q)?, upload(&x.k)?, upload(&x.v)?);
    let ring_opts = RingOptions::new(ranks).with_sharding(sharding);
    let got = ring::forward(gpu, &q, &k, &v, &opts, &ring_opts).map_err(fail)?;
    let whole = attention::forward(gpu, &q, &k, &v, &opts).map_err(fail)?;
    let s = case.shape;
    let dims = [s.batch, s.heads_q, s.n_q, s.d];
    let (got, whole) = (download(&got, dims).map_err(fail)?, download(&whole, dims).map_err(fail)?);
    let oracle = Oracle::new(&x, &attention).map_err(fail)?;
    let expected = gpu_check::expected_forward(&oracle, &x, dtype).map_err(fail)?;
    let label = format!("ring, {ranks} ranks, {sharding:?} ({dtype}, {layout:?})");
    check(&label, &got, &expected, Some(("attention on the whole sequence", &whole, &expected)))
        .map_err(fail)
}

/// `g` on the host, each gradient in the shape of its input.
fn download_grads(g: &ladder_kernels::Gradients) -> anyhow::Result<Gradients<f32>> {
    let four = |t: &Tensor| -> anyhow::Result<Array4<f32>> {
        let [a, b, c, d] = t.shape() else { anyhow::bail!("a gradient of rank 4") };
        Ok(Array4::from_shape_vec([*a, *b, *c, *d], t.to_f32_vec()?)?)
    };
    Ok(Gradients {
        dq: four(&g.dq)?,
        dk: four(&g.dk)?,
        dv: four(&g.dv)?,
        dsinks: match &g.dsinks {
            Some(t) => Some(Array1::from(t.to_f32_vec()?)),
            None => None,
        },
        stats: Default::default(),
    })
}

/// The ring's backward pass on `ranks` simulated ranks against the oracle's gradients and the
/// whole sequence's backward on one GPU.
fn check_ring_backward(
    case: &ladder_compare::Case,
    ranks: usize,
    sharding: Sharding,
    sinks: bool,
    layout: Layout,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let dtype = DType::F16;
    let x = device_inputs(case, dtype);
    let (attention, opts) = options(case, sinks)?;
    let upload = |a: &Array4<f64>| upload_in(gpu, a, dtype, layout).map_err(fail);
    let (q, k, v, d_o) = (upload(&x.q)?, upload(&x.k)?, upload(&x.v)?, upload(&x.d_o)?);
    let ring_opts = RingOptions::new(ranks).with_sharding(sharding);
    let out = ring::forward(gpu, &q, &k, &v, &opts, &ring_opts).map_err(fail)?;
    let got = ring::backward(gpu, &q, &k, &v, &out, &d_o, &opts, &ring_opts).map_err(fail)?;
    let whole_out = attention::forward(gpu, &q, &k, &v, &opts).map_err(fail)?;
    let whole = attention::backward(gpu, &q, &k, &v, &whole_out, &d_o, &opts).map_err(fail)?;
    let (got, whole) = (download_grads(&got).map_err(fail)?, download_grads(&whole).map_err(fail)?);
    let oracle = GradientOracle::new(&x, &attention).map_err(fail)?;
    let expected = gpu_check::expected_backward(&oracle, &x, dtype).map_err(fail)?;
    let label = format!("ring backward, {ranks} ranks, {sharding:?} ({layout:?})");
    let (errs, pass) = expected.judge(&got);
    let [tq, tk, tv] = expected.tolerances;
    let sink_note = || {
        expected
            .judge_sinks(&got)
            .map_or(String::new(), |(e, t, _)| format!(", dsinks {e} (tol {t})"))
    };
    if !pass {
        return Err(fail(format!(
            "{label} vs oracle: dQ {} dK {} dV {} (tol {tq} / {tk} / {tv}){}",
            errs[0],
            errs[1],
            errs[2],
            sink_note()
        )));
    }
    if let Some((err, tol, ok)) = expected.judge_sinks(&got) {
        prop_assert!(ok, "{label}: dsinks {err} (tol {tol})");
    }
    // Against the whole sequence's backward: each within its tolerance of the oracle.
    let oracle_grads = [&oracle.grads.dq, &oracle.grads.dk, &oracle.grads.dv];
    let pairs = [(&got.dq, &whole.dq), (&got.dk, &whole.dk), (&got.dv, &whole.dv)];
    for (t, (a, b)) in pairs.into_iter().enumerate() {
        let err = error_between_in_units_of(a, b, oracle_grads[t]);
        let tol = expected.tolerances[t].plus(expected.tolerances[t]);
        prop_assert!(
            tol.admits(err),
            "{label} vs the whole sequence, gradient {t}: {err} (tol {tol})"
        );
    }
    Ok(())
}

/// One sequence shared by the ranks (as many keys as queries), every head dimension FA2 takes,
/// no window or modifier (the ring refuses them).
fn space() -> CaseSpace {
    CaseSpace {
        batch: 1..=2,
        heads_kv: 1..=2,
        group: 1..=3,
        n_q: 1..=300,
        n_kv: 1..=1,
        head_dims: GpuRung::Fa2.head_dims().to_vec(),
        ..CaseSpace::cpu().moderate_logits()
    }
}

/// [`space`] with the head dimensions the backward kernels take.
fn backward_space() -> CaseSpace {
    CaseSpace { head_dims: GpuRung::Fa2Backward.head_dims().to_vec(), ..space() }
}

/// A drawn case with `n_kv = n_q`.
fn square(case: ladder_compare::Case) -> ladder_compare::Case {
    let mut shape = case.shape;
    shape.n_kv = shape.n_q;
    ladder_compare::Case { shape, ..case }
}

fn sharding() -> impl Strategy<Value = Sharding> {
    prop::sample::select(vec![Sharding::Zigzag, Sharding::Contiguous])
}

fn layouts() -> impl Strategy<Value = Layout> {
    prop::sample::select(Layout::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(32)))]

    #[test]
    fn gpu_ring_fp16_matches_the_oracle_and_the_whole_sequence(case in cases(space()).prop_map(square), ranks in 1..=5usize, sharding in sharding(), sinks in any::<bool>(), layout in layouts()) {
        check_ring(&case, ranks, sharding, sinks, DType::F16, layout)?;
    }

    #[test]
    fn gpu_ring_backward_fp16_matches_the_oracle_and_the_whole_sequence(case in cases(backward_space()).prop_map(square), ranks in 1..=4usize, sharding in sharding(), sinks in any::<bool>(), layout in layouts()) {
        check_ring_backward(&case, ranks, sharding, sinks, layout)?;
    }

    #[test]
    fn gpu_ring_bf16_matches_the_oracle_and_the_whole_sequence(case in cases(space()).prop_map(square), ranks in 1..=5usize, sharding in sharding(), sinks in any::<bool>(), layout in layouts()) {
        check_ring(&case, ranks, sharding, sinks, DType::BF16, layout)?;
    }
}

/// A long causal sequence over 8 ranks, the shape the ring is for, in both shardings.
#[test]
fn gpu_ring_on_a_long_causal_sequence() {
    for sharding in [Sharding::Zigzag, Sharding::Contiguous] {
        let case = ladder_compare::Case {
            shape: ladder_reference::AttentionShape::new(1, 4, 2, 2051, 2051, 128).expect("shape"),
            causal: true,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: Default::default(),
            splits: 1,
            seed: 28,
        };
        check_ring(&case, 8, sharding, false, DType::BF16, Layout::Bhsd)
            .unwrap_or_else(|e| panic!("{sharding:?}: {e}"));
    }
}

#[test]
fn what_the_ring_does_not_take_is_an_error() {
    let Some(gpu) = gpu() else { return };
    let t = |n: usize, dtype| gpu.zeros(&[1, 2, n, 64], dtype).expect("alloc");
    let (x, short) = (t(64, DType::F16), t(48, DType::F16));
    let ring = RingOptions::new(2);
    let run = |k: &Tensor, opts: &Options, ring: &RingOptions| {
        ring::forward(gpu, &x, k, k, opts, ring).expect_err("refused").to_string()
    };
    assert!(run(&x, &Options::causal(), &RingOptions::new(0)).contains("ranks, got 0"));
    let too_many = RingOptions::new(ring::MAX_RANKS + 1);
    assert!(run(&x, &Options::causal(), &too_many).contains("ranks, got"));
    assert!(run(&short, &Options::causal(), &ring).contains("n_q = n_kv"));
    let windowed = Options::causal().with_window(Window::left(8));
    assert!(run(&x, &windowed, &ring).contains("ring"));
    let x32 = t(64, DType::F32);
    let r = ring::forward(gpu, &x32, &x32, &x32, &Options::causal(), &ring);
    assert!(matches!(r, Err(KernelError::UnsupportedDtype { rung: "ring", .. })), "{r:?}");
    // The backward kernels stop at d = 128: refused before the walk, naming the ring.
    let wide = gpu.zeros(&[1, 2, 64, 136], DType::F16).expect("alloc");
    let o = gpu.zeros(&[1, 2, 64, 136], DType::F16).expect("alloc");
    let out = Output { o, lse: gpu.zeros(&[1, 2, 64], DType::F32).expect("alloc") };
    let r = ring::backward(gpu, &wide, &wide, &wide, &out, &wide, &Options::causal(), &ring);
    assert!(
        matches!(r, Err(KernelError::UnsupportedHeadDim { rung: "ring", d: 136, .. })),
        "{r:?}"
    );
}
