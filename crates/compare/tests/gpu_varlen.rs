//! Packed variable-length batches on the GPU rungs (`fa2::forward_varlen`, `fa3::forward_varlen`).
//!
//! Each case draws a ragged batch (lengths 0, 1, a tile ± 1 for the kernels' 64-, 128- and
//! 176-row tiles, and anything up to a few tiles; sequences with no queries or no keys), GQA, a
//! head dim from every multiple of 8, causal or not, and Q, K, V either packed `[total, heads, d]`
//! or one slot of a `[total, 2, heads, d]` buffer whose other slot holds NaN (rows with gaps, where
//! a read outside the view poisons the result). The kernel's outputs are poisoned before launch.
//! Every sequence's rows of the packed O and lse are then held, as in `gpu.rs`, to the float64
//! oracle run on that sequence alone and to the rung's CPU counterpart; rows that see no key
//! must be O = 0, lse = −∞. A batch of equal lengths must give bitwise the fixed-length kernel's
//! result.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` (the GPU
//! bundle) a missing GPU fails them.

use ladder_compare::gpu_check::{expected_forward, narrow, options, shared_gpu};
use ladder_compare::gpu_rungs::VarlenForwardFn;
use ladder_compare::oracle::{Expected, Oracle, check};
use ladder_compare::packed as packed_rows;
use ladder_compare::{GpuRung, RungConfig};
use ladder_kernels::varlen::SeqLens;
use ladder_kernels::{DType, Gpu, KernelError, Options, Tensor, fa2, fa3};
use ladder_reference::AttentionOptions;
use ndarray::Array3;
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

fn cases_per_property() -> u32 {
    std::env::var("LADDER_GPU_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(32)
}

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
    gaps: bool,
    seed: u64,
}

fn batches() -> impl Strategy<Value = Batch> {
    let dims: Vec<usize> = (1..=32).map(|i| 8 * i).collect();
    (
        prop::collection::vec((length(), length()), 1..=6),
        1usize..=2,
        1usize..=3,
        prop::sample::select(dims),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_filter("some queries and some keys", |(lens, ..)| {
            lens.iter().any(|l| l.0 > 0) && lens.iter().any(|l| l.1 > 0)
        })
        .prop_map(|(lens, heads_kv, group, d, causal, gaps, seed)| Batch {
            lens,
            heads_kv,
            group,
            d,
            causal,
            gaps,
            seed,
        })
}

/// Runs `rung`'s varlen forward on `batch` and checks every sequence.
fn check_varlen(rung: GpuRung, batch: &Batch, dtype: DType) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    if !rung.available_on(gpu) {
        eprintln!("{rung} skipped: {} is {}", gpu.name(), gpu.arch());
        return Ok(());
    }
    let Batch { heads_kv, group, d, causal, gaps, seed, .. } = *batch;
    let heads_q = heads_kv * group;
    let (q_lens, k_lens): (Vec<usize>, Vec<usize>) = batch.lens.iter().copied().unzip();
    let lens = SeqLens::from_lengths(gpu, &q_lens, &k_lens).map_err(fail)?;
    let (total_q, total_k) = lens.totals();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let q = packed((total_q, heads_q, d), dtype, &mut rng);
    let k = packed((total_k, heads_kv, d), dtype, &mut rng);
    let v = packed((total_k, heads_kv, d), dtype, &mut rng);
    let [qt, kt, vt] = [&q, &k, &v].map(|x| upload(gpu, x, dtype, gaps));
    let (qt, kt, vt) = (qt.map_err(fail)?, kt.map_err(fail)?, vt.map_err(fail)?);
    let (attention, opts) = options(&AttentionOptions { causal, scale: None }, d);
    let out = varlen_forward(rung)(gpu, &qt, &kt, &vt, &lens, &opts).map_err(fail)?;
    prop_assert_eq!(out.o.shape(), &[total_q, heads_q, d][..]);
    prop_assert_eq!(out.lse.shape(), &[heads_q, total_q][..]);
    let o = Array3::from_shape_vec((total_q, heads_q, d), out.o.to_f32_vec().map_err(fail)?)
        .map_err(fail)?;
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
        let x = packed_rows::inputs((&q, &k, &v), None, rows, keys);
        let oracle = Oracle::new(&x, &attention).map_err(fail)?;
        let expected = expected_forward(&oracle, &x, dtype).map_err(fail)?;
        let x32 = narrow(&x);
        let config = RungConfig { attention, ..RungConfig::default() };
        let cpu = rung.cpu().forward(x32.q.view(), x32.k.view(), x32.v.view(), &config);
        let cpu = cpu.map_err(fail)?;
        let cpu_expected = Expected::from_oracle(&oracle, &x32).map_err(fail)?;
        let label = format!("{} varlen ({dtype}), sequence {b} of {:?}", rung.label(), batch.lens);
        let cpu_label = format!("{} (CPU)", rung.cpu_label());
        check(&label, &got, &expected, Some((&cpu_label, &cpu, &cpu_expected))).map_err(fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases_per_property()))]

    #[test]
    fn gpu_fa2_varlen_fp16_meets_the_oracle_on_every_sequence(batch in batches()) {
        check_varlen(GpuRung::Fa2, &batch, DType::F16)?;
    }

    #[test]
    fn gpu_fa2_varlen_bf16_meets_the_oracle_on_every_sequence(batch in batches()) {
        check_varlen(GpuRung::Fa2, &batch, DType::BF16)?;
    }

    #[test]
    fn gpu_fa3_varlen_fp16_meets_the_oracle_on_every_sequence(batch in batches()) {
        check_varlen(GpuRung::Fa3, &batch, DType::F16)?;
    }

    #[test]
    fn gpu_fa3_varlen_bf16_meets_the_oracle_on_every_sequence(batch in batches()) {
        check_varlen(GpuRung::Fa3, &batch, DType::BF16)?;
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
            // O: [b, h, s, d] laid out [b, s, h, d] is [b·s, h, d] in memory.
            assert_eq!(
                got.o.to_bytes().unwrap(),
                want.o.transpose(1, 2).unwrap().to_bytes().unwrap(),
                "{rung} {opts:?}: O"
            );
            // lse: [b, h, s] against [h, b·s].
            let (want_lse, got_lse) =
                (want.lse.to_f32_vec().unwrap(), got.lse.to_f32_vec().unwrap());
            for ((bi, hi), si) in (0..b)
                .flat_map(|bi| (0..h).map(move |hi| (bi, hi)))
                .flat_map(|p| (0..s).map(move |si| (p, si)))
            {
                assert_eq!(
                    want_lse[(bi * h + hi) * s + si].to_bits(),
                    got_lse[hi * b * s + bi * s + si].to_bits(),
                    "{rung} {opts:?}: lse of sequence {bi}, head {hi}, row {si}"
                );
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
}
