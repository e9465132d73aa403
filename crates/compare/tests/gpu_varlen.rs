//! Packed variable-length batches on the GPU rungs (`fa2::forward_varlen`, `fa3::forward_varlen`,
//! `fa3::fp8::forward_varlen`, `fa2::backward_varlen`).
//!
//! Each case draws a ragged batch (lengths 0, 1, a tile ± 1 for the kernels' 64-, 128- and
//! 176-row tiles, and anything up to a few tiles; sequences with no queries or no keys), GQA, a
//! head dim from every multiple of 8, causal or not, and Q, K, V either packed `[total, heads, d]`
//! or one slot of a `[total, 2, heads, d]` buffer whose other slot holds NaN (rows with gaps, where
//! a read outside the view poisons the result). The kernel's outputs are poisoned before launch.
//! Every sequence's rows of the packed O and lse are then held, as in `gpu.rs`, to the float64
//! oracle run on that sequence alone and to the rung's CPU counterpart; rows that see no key
//! must be O = 0, lse = −∞. The FP8 path is held to the FP8 tolerance of each sequence's oracle
//! and to the CPU `fa3-fp8` rung run on that sequence alone, whose e4m3 operands and scales the
//! packed quantisation must reproduce bit for bit. The backward's gradients are held to the oracle's gradients of each
//! sequence and the CPU FA2 backward the same way (dO drawn and packed like Q); rows of a sequence
//! without keys, and keys of one without queries, must get exactly zero. A batch of equal lengths
//! must give bitwise the fixed-length kernels' results.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` (the GPU
//! bundle) a missing GPU fails them.

use ladder_compare::gpu_check::{
    self, expected_backward, expected_forward, narrow, options, shared_gpu, vs_cpu_backward,
};
use ladder_compare::gpu_rungs::VarlenForwardFn;
use ladder_compare::oracle::{Expected, GradientOracle, Oracle, check};
use ladder_compare::packed as packed_rows;
use ladder_compare::{GpuRung, Inputs, Rung, RungConfig, cases};
use ladder_kernels::fa3::fp8;
use ladder_kernels::varlen::SeqLens;
use ladder_kernels::{DType, Gpu, KernelError, Options, Tensor, fa2, fa3};
use ladder_reference::fp8::{Fp8Scaling, Fp8Tensor, RandomHadamard};
use ladder_reference::{AttentionOptions, AttentionOutput, Fp8Options, Gradients, Window};
use ndarray::Array3;
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

fn gpu() -> Option<&'static Gpu> {
    shared_gpu("GPU varlen tests")
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// A sequence length: empty, one, a tile ± 1 of the kernels' tiles, or anything up to a few tiles.
fn length() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0),
        Just(1),
        63usize..=65,
        127usize..=129,
        175usize..=177,
        191usize..=193,
        0usize..=420,
    ]
}

/// Packed `[total, heads, d]` values, rounded to `dtype`, in f64.
fn packed(shape: (usize, usize, usize), dtype: DType, rng: &mut ChaCha8Rng) -> Array3<f64> {
    let round = |x: f64| ladder_kernels::round_to(&[x as f32], dtype)[0] as f64;
    Array3::from_shape_simple_fn(shape, || round(StandardNormal.sample(rng)))
}

/// Uploads `x` (`[total, heads, d]`) as `dtype`: packed, or (`gaps`) slot 0 of a
/// `[total, 2, heads, d]` buffer whose slot 1 is NaN.
fn upload(gpu: &Gpu, x: &Array3<f64>, dtype: DType, gaps: bool) -> Result<Tensor, KernelError> {
    let (total, heads, d) = x.dim();
    if !gaps {
        let values: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        return gpu.upload(&values, &[total, heads, d], dtype);
    }
    let mut values = vec![f32::NAN; total * 2 * heads * d];
    for ((t, h, c), &v) in x.indexed_iter() {
        values[(t * 2 * heads + h) * d + c] = v as f32;
    }
    gpu.upload(&values, &[values.len()], dtype)?
        .as_strided(&[total, heads, d], &[2 * heads * d, d, 1])
}

/// The rung's varlen entry point.
fn varlen_forward(rung: GpuRung) -> VarlenForwardFn {
    rung.varlen_forward().expect("the varlen tests run rungs with a packed entry point")
}

/// A drawn case: the sequences' `(queries, keys)`, heads, head dim, mask, dtype, layout.
#[derive(Debug, Clone)]
struct Batch {
    lens: Vec<(usize, usize)>,
    heads_kv: usize,
    group: usize,
    d: usize,
    causal: bool,
    window: Window,
    gaps: bool,
    seed: u64,
}

impl Batch {
    /// The batch's mask as the CPU rungs and the oracle take it, and as the kernels do.
    fn options(&self) -> (AttentionOptions, Options) {
        options(
            &AttentionOptions {
                causal: self.causal,
                scale: None,
                window: self.window,
                ..Default::default()
            },
            self.d,
        )
    }
}

/// Ragged batches with head dims up to `max_d` (every multiple of 8), with sliding windows
/// (sides up to a few tiles) when `windows`.
fn batches(max_d: usize, windows: bool) -> impl Strategy<Value = Batch> {
    let dims: Vec<usize> = (1..=max_d / 8).map(|i| 8 * i).collect();
    (
        prop::collection::vec((length(), length()), 1..=6),
        1usize..=2,
        1usize..=3,
        prop::sample::select(dims),
        (any::<bool>(), cases::windows(windows, 430)),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_filter("some queries and some keys", |(lens, ..)| {
            lens.iter().any(|l| l.0 > 0) && lens.iter().any(|l| l.1 > 0)
        })
        .prop_map(|(lens, heads_kv, group, d, (causal, window), gaps, seed)| Batch {
            lens,
            heads_kv,
            group,
            d,
            causal,
            window,
            gaps,
            seed,
        })
}

/// A drawn batch's offsets and its packed Q, K, V, dO (in f64, rounded to the type) with Q, K, V
/// and dO on the device (packed, or with gaps as `batch.gaps` says).
struct Drawn {
    lens: SeqLens,
    x: [Array3<f64>; 4],
    t: [Tensor; 4],
}

fn draw(gpu: &Gpu, batch: &Batch, dtype: DType) -> Result<Drawn, TestCaseError> {
    let heads_q = batch.heads_kv * batch.group;
    let (q_lens, k_lens): (Vec<usize>, Vec<usize>) = batch.lens.iter().copied().unzip();
    let lens = SeqLens::from_lengths(gpu, &q_lens, &k_lens).map_err(fail)?;
    let (total_q, total_k) = lens.totals();
    let mut rng = ChaCha8Rng::seed_from_u64(batch.seed);
    let (q_shape, kv_shape) = ((total_q, heads_q, batch.d), (total_k, batch.heads_kv, batch.d));
    let x = [q_shape, kv_shape, kv_shape, q_shape].map(|shape| packed(shape, dtype, &mut rng));
    let [q, k, v, d_o] = [0, 1, 2, 3].map(|i| upload(gpu, &x[i], dtype, batch.gaps));
    let t = [q.map_err(fail)?, k.map_err(fail)?, v.map_err(fail)?, d_o.map_err(fail)?];
    Ok(Drawn { lens, x, t })
}

/// Checks a packed forward's `out` on the batch `lens` of packed `q, k, v` sequence by sequence:
/// O `[total_q, heads_q, d]` and lse `[heads_q, total_q]`, the rows of a sequence without keys
/// O = 0 and lse = −∞, and every other sequence's rows by `judge`, given the sequence's index,
/// its inputs alone and its rows of the output.
fn check_sequences(
    lens: &SeqLens,
    (q, k, v): (&Array3<f64>, &Array3<f64>, &Array3<f64>),
    out: &ladder_kernels::Output,
    mut judge: impl FnMut(usize, &Inputs<f64>, &AttentionOutput<f32>) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    let (total_q, heads_q, d) = q.dim();
    prop_assert_eq!(out.o.shape(), &[total_q, heads_q, d][..]);
    prop_assert_eq!(out.lse.shape(), &[heads_q, total_q][..]);
    let o = download3(&out.o, (total_q, heads_q, d))?;
    let lse =
        ndarray::Array2::from_shape_vec((heads_q, total_q), out.lse.to_f32_vec().map_err(fail)?)
            .map_err(fail)?;
    for b in 0..lens.batch() {
        let (rows, keys) = (lens.q_range(b), lens.k_range(b));
        if rows.is_empty() {
            continue;
        }
        let got = packed_rows::output(&o, &lse, rows.clone());
        if keys.is_empty() {
            let zero = got.o.iter().all(|&x| x == 0.0);
            let none = got.lse.iter().all(|&x| x == f32::NEG_INFINITY);
            prop_assert!(zero && none, "sequence {} has no keys: O must be 0, lse -inf", b);
            continue;
        }
        judge(b, &packed_rows::inputs((q, k, v), None, rows, keys), &got)?;
    }
    Ok(())
}

/// Runs `rung`'s varlen forward on `batch` and checks every sequence against its oracle and the
/// rung's CPU counterpart.
fn check_varlen(rung: GpuRung, batch: &Batch, dtype: DType) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    if !rung.available_on(gpu) {
        eprintln!("{rung} skipped: {} is {}", gpu.name(), gpu.arch());
        return Ok(());
    }
    let Drawn { lens, x: [q, k, v, _], t: [qt, kt, vt, _] } = draw(gpu, batch, dtype)?;
    let (attention, opts) = batch.options();
    let out = varlen_forward(rung)(gpu, &qt, &kt, &vt, &lens, &opts).map_err(fail)?;
    check_sequences(&lens, (&q, &k, &v), &out, |b, x, got| {
        let oracle = Oracle::new(x, &attention).map_err(fail)?;
        let expected = expected_forward(&oracle, x, dtype).map_err(fail)?;
        let x32 = narrow(x);
        let config = RungConfig { attention: attention.clone(), ..RungConfig::default() };
        let cpu = rung.cpu().forward(x32.q.view(), x32.k.view(), x32.v.view(), &config);
        let cpu = cpu.map_err(fail)?;
        let cpu_expected = Expected::from_oracle(&oracle, &x32).map_err(fail)?;
        let label = format!("{} varlen ({dtype}), sequence {b} of {:?}", rung.label(), batch.lens);
        let cpu_label = format!("{} (CPU)", rung.cpu_label());
        check(&label, got, &expected, Some((&cpu_label, &cpu, &cpu_expected))).map_err(fail)
    })
}

/// Ragged batches at the FP8 path's head dims (multiples of 16), a rotation seed or none.
fn fp8_batches() -> impl Strategy<Value = (Batch, Option<u64>)> {
    (batches(256, true), any::<bool>()).prop_map(|(batch, rotate)| {
        let d = batch.d.next_multiple_of(16);
        let seed = batch.seed;
        (Batch { d, ..batch }, rotate.then_some(seed))
    })
}

/// Runs the FP8 path on `batch` (rotated by the map of `incoherent`, if any) and checks every
/// sequence against its oracle (the FP8 tolerance) and the CPU `fa3-fp8` rung on it alone, with
/// the GPU's tiles.
fn check_varlen_fp8(
    batch: &Batch,
    dtype: DType,
    incoherent: Option<u64>,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    if !GpuRung::Fa3Fp8.available_on(gpu) {
        eprintln!("fa3-fp8 skipped: {} is {}", gpu.name(), gpu.arch());
        return Ok(());
    }
    let Drawn { lens, x: [q, k, v, _], t: [qt, kt, vt, _] } = draw(gpu, batch, dtype)?;
    let (attention, opts) = batch.options();
    let fp8 = Fp8Options { incoherent, ..RungConfig::default().fp8 };
    let gpu_fp8 = gpu_check::gpu_fp8(&fp8);
    let out = fp8::forward_varlen(gpu, &qt, &kt, &vt, &lens, &opts, &gpu_fp8).map_err(fail)?;
    let tiles =
        gpu_check::fp8_cpu_tiles(gpu, batch.d, lens.max_lengths().1, batch.window).map_err(fail)?;
    check_sequences(&lens, (&q, &k, &v), &out, |b, x, got| {
        let oracle = Oracle::new(x, &attention).map_err(fail)?;
        let x32 = narrow(x);
        let expected = Expected::fp8_from_oracle(&oracle, &x32, &fp8).map_err(fail)?;
        let config =
            RungConfig { attention: attention.clone(), tiles, fp8, ..RungConfig::default() };
        let cpu = Rung::Fa3Fp8.forward(x32.q.view(), x32.k.view(), x32.v.view(), &config);
        let cpu = cpu.map_err(fail)?;
        let label = format!("fa3-fp8-gpu varlen ({dtype}), sequence {b} of {:?}", batch.lens);
        check(&label, got, &expected, Some(("fa3-fp8 (CPU)", &cpu, &expected))).map_err(fail)
    })
}

/// Packed `[total, heads, d]` f32 values downloaded from `t`.
fn download3(t: &Tensor, shape: (usize, usize, usize)) -> Result<Array3<f32>, TestCaseError> {
    Array3::from_shape_vec(shape, t.to_f32_vec().map_err(fail)?).map_err(fail)
}

/// Runs the FA2 forward and backward on `batch` (dO drawn like Q) and checks every sequence's
/// gradients against the oracle and the CPU FA2 backward.
fn check_varlen_backward(
    batch: &Batch,
    dtype: DType,
    deterministic: bool,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let (d, heads_kv) = (batch.d, batch.heads_kv);
    let heads_q = heads_kv * batch.group;
    let Drawn { lens, x: [q, k, v, d_o], t: [qt, kt, vt, dot] } = draw(gpu, batch, dtype)?;
    let (total_q, total_k) = lens.totals();
    let (attention, opts) = batch.options();
    let opts = Options { deterministic, ..opts };
    let out = fa2::forward_varlen(gpu, &qt, &kt, &vt, &lens, &opts).map_err(fail)?;
    let g = fa2::backward_varlen(gpu, &qt, &kt, &vt, &out, &dot, &lens, &opts).map_err(fail)?;
    prop_assert_eq!(g.dq.shape(), &[total_q, heads_q, d][..]);
    prop_assert_eq!(g.dk.shape(), &[total_k, heads_kv, d][..]);
    let dq = download3(&g.dq, (total_q, heads_q, d))?;
    let dk = download3(&g.dk, (total_k, heads_kv, d))?;
    let dv = download3(&g.dv, (total_k, heads_kv, d))?;
    let mode = if deterministic { "deterministic" } else { "atomic" };
    for b in 0..lens.batch() {
        let (rows, keys) = (lens.q_range(b), lens.k_range(b));
        if rows.is_empty() || keys.is_empty() {
            // Nothing flows: this sequence's query rows (or keys) get exactly zero gradients.
            let zero = |x: &Array3<f32>, r: std::ops::Range<usize>| {
                packed_rows::rows(x, r).iter().all(|&x| x == 0.0)
            };
            prop_assert!(zero(&dq, rows.clone()), "sequence {} without keys: dQ must be 0", b);
            prop_assert!(
                zero(&dk, keys.clone()) && zero(&dv, keys),
                "sequence {}: dK, dV must be 0",
                b
            );
            continue;
        }
        let x = packed_rows::inputs((&q, &k, &v), Some(&d_o), rows.clone(), keys.clone());
        let got = Gradients {
            dq: packed_rows::rows(&dq, rows),
            dk: packed_rows::rows(&dk, keys.clone()),
            dv: packed_rows::rows(&dv, keys),
            dsinks: None,
            stats: Default::default(),
        };
        let oracle = GradientOracle::new(&x, &attention).map_err(fail)?;
        let expected = expected_backward(&oracle, &x, dtype).map_err(fail)?;
        let (errs, pass) = expected.judge(&got);
        let [tq, tk, tv] = expected.tolerances;
        prop_assert!(
            pass,
            "fa2 varlen backward ({dtype}, {mode}), sequence {b} of {:?}: dQ {} dK {} dV {} \
             (tol {tq} / {tk} / {tv})",
            batch.lens,
            errs[0],
            errs[1],
            errs[2]
        );
        let pairs = vs_cpu_backward(&oracle, &narrow(&x), &got, &expected).map_err(fail)?;
        for (t, (err, tol)) in pairs.into_iter().enumerate() {
            prop_assert!(
                tol.admits(err),
                "fa2 varlen backward ({dtype}, {mode}), sequence {b}: gradient {t} vs CPU fa2 {err} \
                 (tol {tol})"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(32)))]

    #[test]
    fn gpu_fa2_varlen_backward_fp16_meets_the_oracle_on_every_sequence(batch in batches(128, true)) {
        check_varlen_backward(&batch, DType::F16, false)?;
    }

    #[test]
    fn gpu_fa2_varlen_backward_bf16_meets_the_oracle_on_every_sequence(batch in batches(128, true)) {
        check_varlen_backward(&batch, DType::BF16, false)?;
    }

    #[test]
    fn gpu_fa2_varlen_deterministic_backward_meets_the_oracle_on_every_sequence(batch in batches(128, true), bf16 in any::<bool>()) {
        check_varlen_backward(&batch, if bf16 { DType::BF16 } else { DType::F16 }, true)?;
    }

    #[test]
    fn gpu_fa2_varlen_fp16_meets_the_oracle_on_every_sequence(batch in batches(256, true)) {
        check_varlen(GpuRung::Fa2, &batch, DType::F16)?;
    }

    #[test]
    fn gpu_fa2_varlen_bf16_meets_the_oracle_on_every_sequence(batch in batches(256, true)) {
        check_varlen(GpuRung::Fa2, &batch, DType::BF16)?;
    }

    #[test]
    fn gpu_fa3_varlen_fp16_meets_the_oracle_on_every_sequence(batch in batches(256, true)) {
        check_varlen(GpuRung::Fa3, &batch, DType::F16)?;
    }

    #[test]
    fn gpu_fa3_varlen_bf16_meets_the_oracle_on_every_sequence(batch in batches(256, true)) {
        check_varlen(GpuRung::Fa3, &batch, DType::BF16)?;
    }

    #[test]
    fn gpu_fa3_fp8_varlen_meets_the_oracle_and_cpu_fa3_fp8_on_every_sequence((batch, incoherent) in fp8_batches(), bf16 in any::<bool>()) {
        let dtype = if bf16 { DType::BF16 } else { DType::F16 };
        check_varlen_fp8(&batch, dtype, incoherent)?;
    }
}

/// The packed output `got` of `b` sequences of `s` rows and `h` heads is, bit for bit, the
/// fixed-length `want` computed on the same buffer seen as `[b, s, h, d]`: O (`[b, h, s, d]` laid
/// out `[b, s, h, d]` is `[b·s, h, d]` in memory) and lse (`[b, h, s]` against `[h, b·s]`).
fn assert_packed_is_fixed(
    label: &str,
    got: &ladder_kernels::Output,
    want: ladder_kernels::Output,
    (b, s, h): (usize, usize, usize),
) {
    let want_o = want.o.transpose(1, 2).unwrap().to_bytes().unwrap();
    assert_eq!(got.o.to_bytes().unwrap(), want_o, "{label}: O");
    let (want_lse, got_lse) = (want.lse.to_f32_vec().unwrap(), got.lse.to_f32_vec().unwrap());
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                assert_eq!(
                    want_lse[(bi * h + hi) * s + si].to_bits(),
                    got_lse[hi * b * s + bi * s + si].to_bits(),
                    "{label}: lse of sequence {bi}, head {hi}, row {si}"
                );
            }
        }
    }
}

/// Sequences of one length are a fixed-length batch: packed `[b·s, h, d]` must give bitwise what
/// the fixed-length kernel gives on the same buffer seen as `[b, s, h, d]`.
#[test]
fn gpu_varlen_of_equal_lengths_is_the_fixed_length_kernel() {
    let Some(gpu) = gpu() else { return };
    let (b, s, h, d) = (3, 333, 4, 128);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let x = packed((b * s, h, d), DType::F16, &mut rng);
    let values: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let lens = SeqLens::from_lengths(gpu, &[s; 3], &[s; 3]).unwrap();
    let rungs = [GpuRung::Fa2, GpuRung::Fa3];
    for rung in rungs.into_iter().filter(|r| r.available_on(gpu)) {
        for opts in [Options::full(), Options::causal()] {
            let fixed = || gpu.upload(&values, &[b, s, h, d], DType::F16)?.transpose(1, 2);
            let (q, k, v) = (fixed().unwrap(), fixed().unwrap(), fixed().unwrap());
            let run = rung.forward().expect("a forward rung");
            let want = run(gpu, &q, &k, &v, &opts).unwrap();
            let flat = || gpu.upload(&values, &[b * s, h, d], DType::F16);
            let (q, k, v) = (flat().unwrap(), flat().unwrap(), flat().unwrap());
            let got = varlen_forward(rung)(gpu, &q, &k, &v, &lens, &opts).unwrap();
            assert_packed_is_fixed(&format!("{rung} {opts:?}"), &got, want, (b, s, h));
        }
    }
}

/// The backward of sequences of one length is the fixed-length backward: bitwise, in both modes
/// (dQ only in deterministic mode: atomic mode adds its key tiles' shares in no fixed order), at
/// a head dim where both take the same tiles (past d = 64 the packed one steps 32 query rows).
#[test]
fn gpu_varlen_backward_of_equal_lengths_is_the_fixed_length_kernel() {
    let Some(gpu) = gpu() else { return };
    let (b, s, h, d) = (3, 333, 4, 64);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let x = packed((b * s, h, d), DType::F16, &mut rng);
    let g = packed((b * s, h, d), DType::F16, &mut rng);
    let (values, grad): (Vec<f32>, Vec<f32>) =
        (x.iter().map(|&v| v as f32).collect(), g.iter().map(|&v| v as f32).collect());
    let lens = SeqLens::from_lengths(gpu, &[s; 3], &[s; 3]).unwrap();
    for deterministic in [false, true] {
        for opts in [Options::full(), Options::causal()] {
            let opts = Options { deterministic, ..opts };
            let fixed = |v: &[f32]| gpu.upload(v, &[b, s, h, d], DType::F16)?.transpose(1, 2);
            let (q, d_o) = (fixed(&values).unwrap(), fixed(&grad).unwrap());
            let out = fa2::forward(gpu, &q, &q, &q, &opts).unwrap();
            let want = fa2::backward(gpu, &q, &q, &q, &out, &d_o, &opts).unwrap();
            let flat = |v: &[f32]| gpu.upload(v, &[b * s, h, d], DType::F16);
            let (q, d_o) = (flat(&values).unwrap(), flat(&grad).unwrap());
            let out = fa2::forward_varlen(gpu, &q, &q, &q, &lens, &opts).unwrap();
            let got = fa2::backward_varlen(gpu, &q, &q, &q, &out, &d_o, &lens, &opts).unwrap();
            let bytes = |t: &Tensor| t.to_bytes().unwrap();
            let fixed_bytes = |t: Tensor| t.transpose(1, 2).unwrap().to_bytes().unwrap();
            let label = format!("deterministic = {deterministic}, {opts:?}");
            assert_eq!(bytes(&got.dk), fixed_bytes(want.dk), "{label}: dK");
            assert_eq!(bytes(&got.dv), fixed_bytes(want.dv), "{label}: dV");
            if deterministic {
                assert_eq!(bytes(&got.dq), fixed_bytes(want.dq), "{label}: dQ");
            }
        }
    }
}

/// The FP8 path on sequences of one length is its fixed-length path, bit for bit: each sequence's
/// tiles and scales are those of one batch entry.
#[test]
fn gpu_fp8_varlen_of_equal_lengths_is_the_fixed_length_kernel() {
    let Some(gpu) = gpu() else { return };
    if !GpuRung::Fa3Fp8.available_on(gpu) {
        return;
    }
    let (b, s, h, d) = (3, 333, 4, 96);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let x = packed((b * s, h, d), DType::F16, &mut rng);
    let values: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let lens = SeqLens::from_lengths(gpu, &[s; 3], &[s; 3]).unwrap();
    let rotation = fp8::Fp8Options { incoherent: Some(4) };
    for opts in [Options::full(), Options::causal()] {
        let fixed = || gpu.upload(&values, &[b, s, h, d], DType::F16)?.transpose(1, 2);
        let (q, k, v) = (fixed().unwrap(), fixed().unwrap(), fixed().unwrap());
        let want = fp8::forward(gpu, &q, &k, &v, &opts, &rotation).unwrap();
        let flat = || gpu.upload(&values, &[b * s, h, d], DType::F16);
        let (q, k, v) = (flat().unwrap(), flat().unwrap(), flat().unwrap());
        let got = fp8::forward_varlen(gpu, &q, &k, &v, &lens, &opts, &rotation).unwrap();
        assert_packed_is_fixed(&format!("fa3-fp8 {opts:?}"), &got, want, (b, s, h));
    }
}

/// The packed quantisation is the CPU rung's on each sequence alone, bit for bit: its e4m3 values
/// (rotated or not) at its rows, its tiles' scales at their slots (`start / rows + b` on), on
/// ragged sequences with outliers (so that the tiles' scales differ), empty ones among them.
#[test]
fn gpu_fp8_varlen_quantisation_is_the_cpu_rungs_on_each_sequence() {
    let Some(gpu) = gpu() else { return };
    if !GpuRung::Fa3Fp8.available_on(gpu) {
        return;
    }
    let lens = [(5, 300), (200, 1), (0, 77), (333, 260), (129, 0), (64, 1200)];
    for (dtype, d, incoherent, gaps) in [
        (DType::BF16, 96, Some(3), false),
        (DType::F16, 128, None, true),
        (DType::F16, 80, Some(8), true),
    ] {
        let batch = Batch {
            lens: lens.to_vec(),
            heads_kv: 2,
            group: 2,
            d,
            causal: false,
            window: Window::default(),
            gaps,
            seed: 17,
        };
        let (q_lens, k_lens): (Vec<usize>, Vec<usize>) = lens.iter().copied().unzip();
        let seqlens = SeqLens::from_lengths(gpu, &q_lens, &k_lens).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        let outliers = |x: Array3<f64>, rng: &mut ChaCha8Rng| {
            let round = |v: f64| ladder_kernels::round_to(&[v as f32], dtype)[0] as f64;
            x.mapv(|v| if rand::RngExt::random::<f64>(rng) < 0.003 { round(v * 30.0) } else { v })
        };
        let (total_q, total_k) = seqlens.totals();
        let x = [(total_q, 4), (total_k, 2), (total_k, 2)].map(|(rows, heads)| {
            let values = packed((rows, heads, d), dtype, &mut rng);
            outliers(values, &mut rng)
        });
        let t = x.clone().map(|a| upload(gpu, &a, dtype, batch.gaps).unwrap());
        let opts = Options::full();
        let inputs = fp8::quantize_varlen(
            gpu,
            &t[0],
            &t[1],
            &t[2],
            &seqlens,
            &opts,
            &fp8::Fp8Options { incoherent },
        )
        .unwrap();
        let [gq, gk, gv] = inputs.to_bytes().unwrap();
        let scales = inputs.scales().unwrap();
        let (br, bc) = (inputs.tiles().br(), inputs.tiles().bc);
        let decode = |b: u8| float8::F8E4M3::from_bits(b).to_f32();
        let what = format!("{dtype}, d = {d}, incoherent {incoherent:?}, gaps {gaps}");
        for (i, (name, total, heads, rows, bytes)) in
            [("q", total_q, 4, br, &gq), ("k", total_k, 2, bc, &gk), ("v", total_k, 2, bc, &gv)]
                .into_iter()
                .enumerate()
        {
            let slots = total / rows + lens.len();
            assert_eq!(scales[i].len(), heads * slots, "{name} scale slots, {what}");
            let mut start = 0;
            for (b, &(n_q, n_k)) in lens.iter().enumerate() {
                let len = if i == 0 { n_q } else { n_k };
                let seq = packed_rows::rows(&x[i].mapv(|v| v as f32), start..start + len);
                let seq = match incoherent {
                    Some(seed) if i < 2 => RandomHadamard::new(d, seed).apply(seq.view()),
                    _ => seq,
                };
                // V in one block per sequence and head, its scale in each of its tiles' slots.
                let block = if i == 2 { len.max(1) } else { rows };
                let cpu = Fp8Tensor::quantize(seq.view(), block, Fp8Scaling::PerBlock);
                for h in 0..heads {
                    for tile in 0..len.div_ceil(rows) {
                        let got = scales[i][h * slots + start / rows + b + tile];
                        let want = cpu.scales[[0, h, tile * rows / block]];
                        assert_eq!(
                            got, want,
                            "{name} scale, sequence {b}, head {h}, tile {tile}, {what}"
                        );
                    }
                    for r in 0..len {
                        for c in 0..d {
                            let got = decode(bytes[(h * total + start + r) * d + c]);
                            let want = cpu.values[[0, h, r, c]];
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{name}, sequence {b}, head {h}, row {r}, column {c}, {what}"
                            );
                        }
                    }
                }
                start += len;
            }
        }
    }
}

/// Bad offsets and shapes are one-line errors, never a panic or a wrong answer.
#[test]
fn gpu_varlen_rejects_bad_input() {
    let Some(gpu) = gpu() else { return };
    let err = |r: ladder_kernels::Result<SeqLens>| r.unwrap_err().to_string();
    assert!(err(SeqLens::upload(gpu, &[1, 4], &[0, 4])).contains("starts at 1"));
    assert!(err(SeqLens::upload(gpu, &[0, 4, 2], &[0, 4, 5])).contains("decreases at sequence 1"));
    assert!(err(SeqLens::upload(gpu, &[0, 4], &[0, 4, 5])).contains("batch + 1"));
    assert!(err(SeqLens::upload(gpu, &[0], &[0])).contains("at least 2"));
    let device = |v: &[i32]| gpu.stream().clone_htod(v).unwrap();
    let e = err(SeqLens::from_cuda_slices(device(&[0, 3, 10]), device(&[0, 3, 10]), 5, 7));
    assert!(e.contains("max_seqlen_q = 5, but sequence 1 has 7 queries"), "{e}");
    assert!(SeqLens::from_cuda_slices(device(&[0, 3, 10]), device(&[0, 3, 10]), 7, 7).is_ok());

    let lens = SeqLens::from_lengths(gpu, &[3, 5], &[3, 5]).unwrap();
    let t = |shape: &[usize]| {
        gpu.upload(&vec![0.5; shape.iter().product()], shape, DType::F16).unwrap()
    };
    let rungs: [VarlenForwardFn; 2] = [fa2::forward_varlen, fa3::forward_varlen];
    for (i, run) in rungs.into_iter().enumerate() {
        if i == 1 && !GpuRung::Fa3.available_on(gpu) {
            continue;
        }
        let call = |q: &Tensor, k: &Tensor| {
            run(gpu, q, k, k, &lens, &Options::causal()).unwrap_err().to_string()
        };
        let e = call(&t(&[9, 2, 64]), &t(&[8, 2, 64]));
        assert!(e.contains("q has 9 tokens and k 8, but cu_seqlens_q ends at 8"), "{e}");
        let e = call(&t(&[1, 8, 2, 64]), &t(&[8, 2, 64]));
        assert!(e.contains("q must be [total_q, heads, head_dim]"), "{e}");
        let e = call(&t(&[8, 2, 100]), &t(&[8, 2, 100]));
        assert!(e.contains("multiples of 8 from 8 to 256"), "{e}");
        let e = call(&t(&[8, 3, 64]), &t(&[8, 2, 64]));
        assert!(e.contains("not a multiple"), "{e}");
        let cols = t(&[8, 64, 2]).transpose(1, 2).unwrap();
        let e = call(&cols, &t(&[8, 2, 64]));
        assert!(e.contains("must be contiguous (stride 1)"), "{e}");
    }

    // The backward checks the forward's output and dO against the packed shapes.
    let (q, k) = (t(&[8, 2, 64]), t(&[8, 2, 64]));
    let opts = Options::causal();
    let out = fa2::forward_varlen(gpu, &q, &k, &k, &lens, &opts).unwrap();
    let backward = |out: &ladder_kernels::Output, d_o: &Tensor| {
        fa2::backward_varlen(gpu, &q, &k, &k, out, d_o, &lens, &opts).unwrap_err().to_string()
    };
    let e = backward(&out, &t(&[8, 2, 32]));
    assert!(e.contains("d_o has shape [8, 2, 32], expected [8, 2, 64]"), "{e}");
    let fixed_out =
        fa2::forward(gpu, &t(&[1, 2, 8, 64]), &t(&[1, 2, 8, 64]), &t(&[1, 2, 8, 64]), &opts);
    let e = backward(&fixed_out.unwrap(), &t(&[8, 2, 64]));
    assert!(e.contains("out.o has shape [1, 2, 8, 64], expected [8, 2, 64]"), "{e}");
    let (q, k) = (t(&[8, 2, 136]), t(&[8, 2, 136]));
    let out = fa2::forward_varlen(gpu, &q, &k, &k, &lens, &opts).unwrap();
    let e = fa2::backward_varlen(gpu, &q, &k, &k, &out, &q, &lens, &opts).unwrap_err().to_string();
    assert!(e.contains("multiples of 8 from 8 to 128"), "{e}");
}
