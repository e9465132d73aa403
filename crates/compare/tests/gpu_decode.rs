//! The GPU FlashDecoding rung (`ladder_kernels::decode`) against the float64 oracle.
//!
//! Each sequence `b` of a decoding call is the full-attention problem of its `n_new` new tokens
//! against its first `lengths[b]` cache entries, causal bottom-right (the project's convention
//! with `n_q = n_new`, `n_kv = lengths[b]`): the oracle and the tolerance (twice the error of
//! the naive algorithm with the kernel's 16-bit roundings, plus the f32 floor) are built per
//! sequence exactly as for the GPU FA2 forward. Cache entries past each length are NaN, so a
//! kernel that reads one fails; outputs are poisoned with NaN, so an element it forgets to write
//! fails too. Every split count (the heuristic, 1, 3, 7, and more splits than key tiles) must
//! pass the oracle and agree with the others within the sum of their tolerances.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` a missing GPU
//! fails them.

use ladder_compare::Inputs;
use ladder_compare::cases::pseudo_random;
use ladder_compare::gpu_check::{self, shared_gpu};
use ladder_compare::oracle::{Expected, Oracle, judge_between};
use ladder_kernels::decode::{self, DecodeOptions, KvCache};
use ladder_kernels::{DType, Gpu, KernelError, Tensor, round_to};
use ladder_reference::{AttentionOptions, AttentionOutput};
use ndarray::{Array3, Array4, s};

fn gpu() -> Option<&'static Gpu> {
    shared_gpu("GPU decode tests")
}

/// One decoding call: shapes, lengths and element type.
#[derive(Clone, Debug)]
struct Case {
    heads_q: usize,
    heads_kv: usize,
    n_new: usize,
    d: usize,
    capacity: usize,
    lengths: Vec<usize>,
    dtype: DType,
    seed: u64,
}

/// The host copies of a case's inputs, rounded to its dtype (the cache NaN past each length).
struct HostInputs {
    q: Array4<f32>,
    k: Array4<f32>,
    v: Array4<f32>,
}

impl Case {
    fn batch(&self) -> usize {
        self.lengths.len()
    }

    fn inputs(&self) -> HostInputs {
        let (b, hq, hkv, n, d, cap) =
            (self.batch(), self.heads_q, self.heads_kv, self.n_new, self.d, self.capacity);
        let q = pseudo_random(self.seed, b * hq * n * d);
        let mut k = pseudo_random(self.seed + 1, b * hkv * cap * d);
        let mut v = pseudo_random(self.seed + 2, b * hkv * cap * d);
        // Entries past each sequence's length must never be read.
        for (bi, &len) in self.lengths.iter().enumerate() {
            for h in 0..hkv {
                let start = ((bi * hkv + h) * cap + len) * d;
                let end = ((bi * hkv + h) * cap + cap) * d;
                k[start..end].fill(f32::NAN);
                v[start..end].fill(f32::NAN);
            }
        }
        let arr = |x: Vec<f32>, shape: [usize; 4]| {
            Array4::from_shape_vec(shape, round_to(&x, self.dtype)).expect("shape")
        };
        HostInputs {
            q: arr(q, [b, hq, n, d]),
            k: arr(k, [b, hkv, cap, d]),
            v: arr(v, [b, hkv, cap, d]),
        }
    }

    /// The softmax scale as the kernel gets it, and the oracle's options with the same `f32`.
    fn options(&self) -> (AttentionOptions, f32) {
        let (attention, opts) = gpu_check::options(&AttentionOptions::causal(), self.d);
        (attention, opts.scale.expect("options() sets the scale"))
    }
}

/// Runs the kernel on `x` with `splits`; returns `O` and `lse` on the host.
fn run(
    gpu: &Gpu,
    case: &Case,
    x: &HostInputs,
    splits: Option<usize>,
) -> (Array4<f32>, Array3<f32>) {
    let up = |a: &Array4<f32>| {
        let values: Vec<f32> = a.iter().copied().collect();
        gpu.upload(&values, a.shape(), case.dtype).expect("upload")
    };
    let (q, k, v) = (up(&x.q), up(&x.k), up(&x.v));
    let cache = KvCache { k: &k, v: &v, lengths: &case.lengths };
    let opts = DecodeOptions { scale: Some(case.options().1), splits };
    let out = decode::forward(gpu, &q, cache, &opts)
        .unwrap_or_else(|e| panic!("{case:?} splits {splits:?}: {e}"));
    let (b, hq, n, d) = x.q.dim();
    let o = Array4::from_shape_vec((b, hq, n, d), out.o.to_f32_vec().expect("copy")).expect("o");
    let lse = Array3::from_shape_vec((b, hq, n), out.lse.to_f32_vec().expect("copy")).expect("lse");
    (o, lse)
}

/// The oracle and tolerances of sequence `b`: its new tokens against its first `len` keys.
fn expected_for(case: &Case, x: &HostInputs, b: usize) -> Expected {
    let len = case.lengths[b];
    let wide = |a: ndarray::ArrayView4<f32>| a.mapv(f64::from);
    let q = wide(x.q.slice(s![b..b + 1, .., .., ..]));
    let inputs = Inputs {
        d_o: Array4::zeros(q.dim()),
        q,
        k: wide(x.k.slice(s![b..b + 1, .., ..len, ..])),
        v: wide(x.v.slice(s![b..b + 1, .., ..len, ..])),
    };
    let (attention, _) = case.options();
    let oracle = Oracle::new(&inputs, &attention).expect("oracle");
    gpu_check::expected_forward(&oracle, &inputs, case.dtype).expect("tolerance")
}

fn sequence(o: &Array4<f32>, lse: &Array3<f32>, b: usize) -> AttentionOutput<f32> {
    AttentionOutput {
        o: o.slice(s![b..b + 1, .., .., ..]).to_owned(),
        lse: lse.slice(s![b..b + 1, .., ..]).to_owned(),
        stats: Default::default(),
    }
}

/// The split counts every case runs with: the heuristic, 1, 3, 7, and more than key tiles.
const SPLITS: [Option<usize>; 5] = [None, Some(1), Some(3), Some(7), Some(64)];

fn check_case(case: &Case) {
    let Some(gpu) = gpu() else { return };
    let x = case.inputs();
    let runs: Vec<(Option<usize>, Array4<f32>, Array3<f32>)> = SPLITS
        .iter()
        .map(|&splits| {
            let (o, lse) = run(gpu, case, &x, splits);
            (splits, o, lse)
        })
        .collect();
    for (b, &len) in case.lengths.iter().enumerate() {
        if len == 0 {
            // No key at all: O = 0 and lse = −inf exactly, whatever the splits.
            for (splits, o, lse) in &runs {
                let seq = sequence(o, lse, b);
                assert!(seq.o.iter().all(|&v| v == 0.0), "{case:?} splits {splits:?} b {b}: O ≠ 0");
                assert!(
                    seq.lse.iter().all(|&v| v == f32::NEG_INFINITY),
                    "{case:?} splits {splits:?} b {b}: lse ≠ −inf"
                );
            }
            continue;
        }
        let expected = expected_for(case, &x, b);
        for (splits, o, lse) in &runs {
            let seq = sequence(o, lse, b);
            let verdict = expected.judge(&seq);
            assert!(
                verdict.pass,
                "{case:?} splits {splits:?}, sequence {b} (length {len}) vs oracle: O {} (tol {}), \
                 lse {} (tol {})",
                verdict.o, expected.o, verdict.lse, expected.lse
            );
        }
        // Every split count agrees with one split within the sum of both tolerances.
        let (_, o1, lse1) = &runs[1];
        let one = sequence(o1, lse1, b);
        for (splits, o, lse) in &runs {
            let pair = judge_between(&sequence(o, lse, b), &one, &expected, &expected);
            assert!(
                pair.pass,
                "{case:?} splits {splits:?} vs 1 split, sequence {b}: O {}, lse {}",
                pair.o, pair.lse
            );
        }
    }
}

fn cases(dtype: DType) -> Vec<Case> {
    let case = |heads_q, heads_kv, n_new, d, capacity, lengths: &[usize], seed| Case {
        heads_q,
        heads_kv,
        n_new,
        d,
        capacity,
        lengths: lengths.to_vec(),
        dtype,
        seed,
    };
    vec![
        // Multi-head, one token, a full cache (length = capacity).
        case(8, 8, 1, 128, 1000, &[1000], 1),
        // GQA 4:1, 4 tokens (16 rows per block), a length-1 sequence (3 of its tokens see nothing).
        case(8, 2, 4, 64, 777, &[777, 1], 2),
        // GQA 4:1, one token, an empty sequence and lengths that are multiples of nothing.
        case(32, 8, 1, 128, 530, &[530, 0, 3, 333], 3),
        // 32 rows per block (two mma tiles): GQA 8:1 × 4 tokens.
        case(16, 2, 4, 128, 200, &[200, 37], 4),
        case(32, 8, 4, 64, 300, &[2, 299, 0], 5),
        // 16 new tokens, one of the sequences shorter than that.
        case(2, 2, 16, 64, 100, &[100, 10], 6),
        // 100 keys: 64 splits is more splits than key tiles (and than keys per split).
        case(8, 2, 1, 128, 100, &[100], 7),
        // A long cache: many tiles per split.
        case(32, 8, 1, 128, 4099, &[4099, 2500], 8),
        // More sequences than one launch takes (their lengths travel in the parameter struct,
        // 256 at a time): the batch is launched in chunks.
        case(4, 2, 1, 64, 70, &(0..300).map(|b| (b * 7) % 71).collect::<Vec<_>>(), 9),
    ]
}

#[test]
fn gpu_decode_fp16_matches_the_oracle_for_every_split_count() {
    for case in cases(DType::F16) {
        check_case(&case);
    }
}

#[test]
fn gpu_decode_bf16_matches_the_oracle_for_every_split_count() {
    for case in cases(DType::BF16) {
        check_case(&case);
    }
}

#[test]
fn gpu_decode_bad_input_is_an_error_not_a_panic() {
    let Some(gpu) = gpu() else { return };
    let t = |shape: &[usize], dtype: DType| {
        gpu.upload(&pseudo_random(9, shape.iter().product()), shape, dtype).expect("upload")
    };
    let f16 = DType::F16;
    let run = |q: &Tensor, k: &Tensor, v: &Tensor, lengths: &[usize], splits: Option<usize>| {
        let cache = KvCache { k, v, lengths };
        decode::forward(gpu, q, cache, &DecodeOptions { scale: None, splits })
    };
    let q = t(&[2, 8, 1, 64], f16);
    let kv = t(&[2, 2, 50, 64], f16);

    // Sanity: the valid call works.
    assert!(run(&q, &kv, &kv, &[50, 3], None).is_ok());

    // More than 32 rows per kv head is no error: 16 query heads per kv head × 4 tokens.
    let q64 = t(&[1, 16, 4, 64], f16);
    let kv1 = t(&[1, 1, 50, 64], f16);
    assert!(run(&q64, &kv1, &kv1, &[50], None).is_ok());
    // Splits = 0.
    let r = run(&q, &kv, &kv, &[50, 3], Some(0));
    assert!(matches!(r, Err(KernelError::Config(_))), "{r:?}");
    // A length past the capacity; the wrong number of lengths.
    for lengths in [&[51, 3][..], &[50][..], &[50, 3, 1][..]] {
        let r = run(&q, &kv, &kv, lengths, None);
        assert!(matches!(r, Err(KernelError::Shape(_))), "{lengths:?}: {r:?}");
    }
    // Shapes: v unlike k, rank 3, batch or head dim differing, heads not a multiple, too many
    // new tokens, zero dimensions.
    let shape_cases: Vec<(&str, Tensor, Tensor, Tensor)> = vec![
        ("v unlike k", t(&[2, 8, 1, 64], f16), t(&[2, 2, 50, 64], f16), t(&[2, 2, 49, 64], f16)),
        ("rank 3", t(&[8, 1, 64], f16), t(&[2, 2, 50, 64], f16), t(&[2, 2, 50, 64], f16)),
        ("batch differs", t(&[2, 8, 1, 64], f16), t(&[1, 2, 50, 64], f16), t(&[1, 2, 50, 64], f16)),
        (
            "head dims differ",
            t(&[2, 8, 1, 64], f16),
            t(&[2, 2, 50, 128], f16),
            t(&[2, 2, 50, 128], f16),
        ),
        (
            "heads not a multiple",
            t(&[2, 8, 1, 64], f16),
            t(&[2, 3, 50, 64], f16),
            t(&[2, 3, 50, 64], f16),
        ),
        (
            "17 new tokens",
            t(&[2, 1, 17, 64], f16),
            t(&[2, 1, 50, 64], f16),
            t(&[2, 1, 50, 64], f16),
        ),
        ("no new token", t(&[2, 8, 0, 64], f16), t(&[2, 2, 50, 64], f16), t(&[2, 2, 50, 64], f16)),
        ("zero capacity", t(&[2, 8, 1, 64], f16), t(&[2, 2, 0, 64], f16), t(&[2, 2, 0, 64], f16)),
    ];
    for (what, q, k, v) in &shape_cases {
        let r = run(q, k, v, &[0, 0], None);
        assert!(matches!(r, Err(KernelError::Shape(_))), "{what}: {r:?}");
    }
    // Element types: mixed, and f32 (no kernel).
    let kv_bf = t(&[2, 2, 50, 64], DType::BF16);
    let r = run(&q, &kv_bf, &kv, &[50, 3], None);
    assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
    let r = run(&q, &kv, &kv_bf, &[50, 3], None);
    assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
    let (q32, kv32) = (t(&[2, 8, 1, 64], DType::F32), t(&[2, 2, 50, 64], DType::F32));
    let r = run(&q32, &kv32, &kv32, &[50, 3], None);
    assert!(matches!(r, Err(KernelError::UnsupportedDtype { .. })), "{r:?}");
    // Head dimension without a kernel.
    let (q96, kv96) = (t(&[2, 8, 1, 96], f16), t(&[2, 2, 50, 96], f16));
    let r = run(&q96, &kv96, &kv96, &[50, 3], None);
    assert!(matches!(r, Err(KernelError::UnsupportedHeadDim { d: 96, .. })), "{r:?}");
}

/// The harness itself, without a GPU: the CPU FlashDecoding rung, run per sequence on the same
/// rounded inputs with the same split counts, passes the same oracle checks (so a GPU failure
/// points at the kernel, not at how the per-sequence problems and tolerances are built).
#[test]
fn the_harness_accepts_the_cpu_flash_decoding_rung() {
    use ladder_reference::{FlashDecodingOptions, flash_decoding};
    for case in cases(DType::F16).into_iter().chain(cases(DType::BF16)) {
        let x = case.inputs();
        let (attention, _) = case.options();
        for (b, &len) in case.lengths.iter().enumerate() {
            if len == 0 {
                continue;
            }
            let expected = expected_for(&case, &x, b);
            for splits in [1, 3, 7, 64] {
                let opts =
                    FlashDecodingOptions::new(attention).with_splits(splits).expect("splits");
                let out = flash_decoding::forward(
                    x.q.slice(s![b..b + 1, .., .., ..]),
                    x.k.slice(s![b..b + 1, .., ..len, ..]),
                    x.v.slice(s![b..b + 1, .., ..len, ..]),
                    &opts,
                )
                .expect("cpu rung");
                let verdict = expected.judge(&out);
                assert!(verdict.pass, "{case:?} b {b} splits {splits}: {verdict:?}");
            }
        }
    }
}
