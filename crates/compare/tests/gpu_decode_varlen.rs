//! Packed new tokens (`ladder_kernels::decode::forward_varlen`): the new tokens of every sequence
//! of a decoding call in one `[total_new, heads_q, d]` tensor, each sequence with its own count
//! (0 … 16), as a serving engine batches speculative and ordinary decoding.
//!
//! Each sequence's rows are computed by the same kernels as a call of that sequence alone (its
//! own blocks, its own rows), so with the same split count and strategy they are bit for bit what
//! `decode::forward` gives it alone; and each is checked against the float64 oracle of its own
//! problem (its tokens, causal bottom-right, against its first `lengths[b]` keys) with the
//! tolerance the other GPU decoding tests use.
//!
//! - Drawn batches (proptest): 1–5 sequences of 0–16 new tokens and 0 … capacity cache entries,
//!   GQA groups 1–4, every head dimension, fp16 or bf16, a contiguous or paged cache, Q packed or
//!   as slot 0 of a `[total, 3, heads, d]` buffer whose other slots are NaN, FlashDecoding and
//!   both FlashDecoding++ kernels forced, 1–9 splits: against the alone calls (bits) and the
//!   oracle; with the heuristic's split count, against the oracle.
//! - More sequences than one launch takes (the launch's lengths and token offsets travel in the
//!   parameter struct, 256 sequences at a time), `forward_varlen_into` with a strided `O`.
//! - Bad input: errors, never a panic.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` a missing GPU
//! fails them. `LADDER_GPU_CASES` sets the number of drawn cases (default 32).

mod decoding;

use decoding::*;
use ladder_compare::cases::pseudo_random;
use ladder_compare::gpu_check;
use ladder_kernels::decode::{self, DecodeOptions, KvCache, Strategy as DecodeStrategy};
use ladder_kernels::{DType, Gpu, KernelError, Output, Tensor};
use ndarray::{Array3, Array4, s};
use proptest::prelude::*;

/// A packed call: a case whose `n_new` is the most new tokens of any sequence, and each
/// sequence's own count.
#[derive(Clone, Debug)]
struct Packed {
    case: Case,
    new_tokens: Vec<usize>,
}

impl Packed {
    fn total(&self) -> usize {
        self.new_tokens.iter().sum()
    }

    /// Each sequence's first row of the packed Q.
    fn starts(&self) -> Vec<usize> {
        self.new_tokens.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect()
    }

    /// The packed Q `[total, heads_q, d]`: sequence `b`'s first `new_tokens[b]` tokens of the
    /// case's `[batch, heads_q, n_new, d]` inputs, in order; on the device packed, or as slot 0
    /// of a `[total, 3, heads_q, d]` buffer whose other slots are NaN.
    fn upload_q(&self, gpu: &Gpu, x: &HostInputs, slot: bool) -> Tensor {
        let (hq, d) = (self.case.heads_q, self.case.d);
        let slots = if slot { 3 } else { 1 };
        let mut values = vec![f32::NAN; self.total() * slots * hq * d];
        for (b, (&n, start)) in self.new_tokens.iter().zip(self.starts()).enumerate() {
            for t in 0..n {
                for h in 0..hq {
                    let dst = ((start + t) * slots * hq + h) * d;
                    let src = x.q.slice(s![b, h, t, ..]);
                    values[dst..dst + d].iter_mut().zip(src).for_each(|(o, &v)| *o = v);
                }
            }
        }
        let buffer = gpu.upload(&values, &[values.len()], self.case.dtype).expect("upload q");
        buffer.as_strided(&[self.total(), hq, d], &[slots * hq * d, d, 1]).expect("q in its buffer")
    }

    /// Sequence `b` alone: its tokens as a `[1, heads_q, n, d]` Q.
    fn alone_q(&self, gpu: &Gpu, x: &HostInputs, b: usize) -> Tensor {
        let q = x.q.slice(s![b..b + 1, .., ..self.new_tokens[b], ..]);
        let values: Vec<f32> = q.iter().copied().collect();
        gpu.upload(&values, q.shape(), self.case.dtype).expect("upload")
    }
}

/// `O` `[total, heads_q, d]` and `lse` `[heads_q, total]` on the host.
fn packed_to_host(p: &Packed, out: &Output) -> (Array3<f32>, ndarray::Array2<f32>) {
    let (total, hq, d) = (p.total(), p.case.heads_q, p.case.d);
    let o = Array3::from_shape_vec((total, hq, d), out.o.to_f32_vec().expect("o")).expect("o");
    let lse = ndarray::Array2::from_shape_vec((hq, total), out.lse.to_f32_vec().expect("lse"))
        .expect("lse");
    (o, lse)
}

/// The `n` rows from `start` of a packed output (one sequence's) as `[1, heads_q, n, d]` and
/// `[1, heads_q, n]`.
fn rows_of(
    (o, lse): &(Array3<f32>, ndarray::Array2<f32>),
    start: usize,
    n: usize,
) -> (Array4<f32>, Array3<f32>) {
    let o = o.slice(s![start..start + n, .., ..]).permuted_axes([1, 0, 2]).to_owned();
    let lse = lse.slice(s![.., start..start + n]).to_owned();
    (o.insert_axis(ndarray::Axis(0)), lse.insert_axis(ndarray::Axis(0)))
}

fn bits<D: ndarray::Dimension>(a: &ndarray::Array<f32, D>) -> Vec<u32> {
    a.iter().map(|v| v.to_bits()).collect()
}

/// One packed call with `strategy` and `splits` against each sequence alone (bit for bit, when
/// the split count is given: the heuristic sees the whole batch) and against each sequence's
/// oracle.
fn check_packed(
    gpu: &Gpu,
    p: &Packed,
    layout: Layout,
    slot: bool,
    strategy: DecodeStrategy,
    splits: Option<usize>,
) -> Result<(), TestCaseError> {
    let case = &p.case;
    let x = case.inputs();
    let dev = upload(gpu, case, &x, layout);
    let q = p.upload_q(gpu, &x, slot);
    let opts = case.decode_options(strategy, splits, 0.0);
    let out = decode::forward_varlen(gpu, &q, &p.new_tokens, dev.cache(&case.lengths), &opts)
        .map_err(|e| TestCaseError::fail(format!("{p:?}: {e}")))?;
    prop_assert_eq!(out.o.shape(), &[p.total(), case.heads_q, case.d][..]);
    prop_assert_eq!(out.lse.shape(), &[case.heads_q, p.total()][..]);
    let host = packed_to_host(p, &out);
    // The alone calls (only with a given split count) read a contiguous cache, one sequence of it
    // at a time: the call's own when it is contiguous.
    let uploaded = (layout != Layout::Contiguous && splits.is_some())
        .then(|| upload(gpu, case, &x, Layout::Contiguous));
    let contiguous = uploaded.as_ref().unwrap_or(&dev);
    let starts = p.starts();
    for (b, &n) in p.new_tokens.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let what =
            format!("{p:?} {layout:?} slot {slot} {strategy} splits {splits:?}, sequence {b}");
        let (o, lse) = rows_of(&host, starts[b], n);
        if case.lengths[b] == 0 {
            prop_assert!(o.iter().all(|&v| v == 0.0), "{what}: O ≠ 0 without keys");
            prop_assert!(lse.iter().all(|&v| v == f32::NEG_INFINITY), "{what}: lse ≠ −inf");
            continue;
        }
        let got = ladder_reference::AttentionOutput {
            o: o.clone(),
            lse: lse.clone(),
            stats: Default::default(),
        };
        let (inputs, oracle) = problem_of_tokens(case, &x, b, n);
        let expected = gpu_check::expected_forward(&oracle, &inputs, case.dtype)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let verdict = expected.judge(&got);
        prop_assert!(
            verdict.pass,
            "{what} vs oracle: O {} (tol {}), lse {} (tol {})",
            verdict.o,
            expected.o,
            verdict.lse,
            expected.lse
        );
        if splits.is_some() {
            let k = contiguous.k.narrow(0, b, 1).expect("k");
            let v = contiguous.v.narrow(0, b, 1).expect("v");
            let lengths = [case.lengths[b]];
            let alone = decode::forward(
                gpu,
                &p.alone_q(gpu, &x, b),
                KvCache { k: &k, v: &v, lengths: &lengths },
                &opts,
            )
            .map_err(|e| TestCaseError::fail(format!("{what} alone: {e}")))?;
            let (hq, d) = (case.heads_q, case.d);
            let want_o =
                Array4::from_shape_vec((1, hq, n, d), alone.o.to_f32_vec().expect("o")).expect("o");
            let want_lse = Array3::from_shape_vec((1, hq, n), alone.lse.to_f32_vec().expect("lse"))
                .expect("lse");
            prop_assert!(bits(&o) == bits(&want_o), "{what}: O is not the alone call's bits");
            prop_assert!(bits(&lse) == bits(&want_lse), "{what}: lse is not the alone call's bits");
        }
    }
    Ok(())
}

/// One drawn packed call.
#[derive(Clone, Debug)]
struct Drawn {
    packed: Packed,
    layout: Layout,
    slot: bool,
    strategy: DecodeStrategy,
    splits: Option<usize>,
}

/// 1–5 sequences of 0–16 new tokens (at least one in all) and 0 … capacity cache entries (often
/// full), 1–2 kv heads, GQA groups 1–4, every head dim, fp16 or bf16, a contiguous cache or pages
/// of 16 or 64, Q packed or a slot of a wider buffer, FlashDecoding or either FlashDecoding++
/// kernel forced, the heuristic's split count or 1–9.
fn drawn() -> impl Strategy<Value = Drawn> {
    let fits = |d: &usize| shared_gpu_fits(*d);
    let dims: Vec<usize> = decode::HEAD_DIMS.iter().copied().filter(fits).collect();
    let strategies =
        vec![DecodeStrategy::FlashDecoding, DecodeStrategy::Gemv, DecodeStrategy::FlatGemm];
    (
        (1..=5usize, 1..=2usize, 1..=4usize, 1..=300usize),
        (prop::sample::select(dims), prop::sample::select(vec![DType::F16, DType::BF16])),
        (
            prop::sample::select(vec![None, Some(16), Some(64)]),
            any::<bool>(),
            prop::sample::select(strategies),
            prop_oneof![Just(None), (1..=9usize).prop_map(Some)],
            any::<u64>(),
        ),
    )
        .prop_flat_map(|((batch, heads_kv, group, cap), types, rest)| {
            let length = prop_oneof![Just(cap), 0..=cap];
            let tokens = prop_oneof![Just(0usize), 1..=4usize, 1..=16usize];
            (
                Just((heads_kv, group, cap, types, rest)),
                prop::collection::vec(length, batch),
                prop::collection::vec(tokens, batch),
            )
        })
        .prop_filter("at least one new token", |(_, _, tokens)| tokens.iter().any(|&n| n > 0))
        .prop_map(|((heads_kv, group, cap, (d, dtype), rest), lengths, new_tokens)| {
            let (page, slot, strategy, splits, seed) = rest;
            let case = Case {
                heads_q: heads_kv * group,
                heads_kv,
                n_new: new_tokens.iter().copied().max().unwrap_or(1),
                d,
                capacity: cap,
                lengths,
                dtype,
                seed: seed >> 2,
            };
            let layout = match page {
                None => Layout::Contiguous,
                Some(page) => Layout::Paged { page, device_only: false },
            };
            Drawn { packed: Packed { case, new_tokens }, layout, slot, strategy, splits }
        })
}

/// Whether the GPU (if any) gives a block the decoding kernels' shared memory at head dim `d`.
fn shared_gpu_fits(d: usize) -> bool {
    gpu().is_none_or(|g| decode::head_dim_fits(g, d))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(32)))]

    #[test]
    fn gpu_decode_varlen_drawn_batches_match_each_sequence_alone_and_the_oracle(d in drawn()) {
        let Some(gpu) = gpu() else { return Ok(()) };
        check_packed(gpu, &d.packed, d.layout, d.slot, d.strategy, d.splits)?;
    }
}

/// 300 sequences, more than one launch takes: the second launch's token offsets start from its
/// first sequence's, its pointers advanced to it. Every sequence is its alone call's bits. Then
/// the same batch with no new token past the first launch's sequences: the second launch has
/// nothing to do (and makes no launch of zero blocks).
#[test]
fn gpu_decode_varlen_more_sequences_than_one_launch() {
    let Some(gpu) = gpu() else { return };
    let batch = 300;
    for new_tokens in [
        (0..batch).map(|b| (b * 5) % 4).collect::<Vec<usize>>(),
        (0..batch).map(|b| if b < 256 { 1 + b % 3 } else { 0 }).collect(),
    ] {
        check_batch(gpu, new_tokens);
    }
}

/// A batch of short caches with `new_tokens` per sequence, every sequence against its alone call.
fn check_batch(gpu: &Gpu, new_tokens: Vec<usize>) {
    let batch = new_tokens.len();
    let lengths: Vec<usize> = (0..batch).map(|b| (b * 7) % 71).collect();
    let case = Case {
        heads_q: 4,
        heads_kv: 2,
        n_new: 3,
        d: 64,
        capacity: 70,
        lengths,
        dtype: DType::F16,
        seed: 40,
    };
    let p = Packed { case, new_tokens };
    for strategy in [DecodeStrategy::FlashDecoding, DecodeStrategy::FlatGemm] {
        check_packed(gpu, &p, Layout::Contiguous, false, strategy, Some(2))
            .unwrap_or_else(|e| panic!("{strategy}: {e}"));
    }
}

/// `forward_varlen_into` writes `forward_varlen`'s bits into a caller's `O` of other strides (a
/// slot of a wider buffer) and a contiguous `lse`.
#[test]
fn gpu_decode_varlen_into_equals_varlen() {
    let Some(gpu) = gpu() else { return };
    let case = Case {
        heads_q: 8,
        heads_kv: 2,
        n_new: 5,
        d: 96,
        capacity: 200,
        lengths: vec![200, 3, 150],
        dtype: DType::BF16,
        seed: 41,
    };
    let p = Packed { case, new_tokens: vec![5, 0, 2] };
    let x = p.case.inputs();
    let dev = upload(gpu, &p.case, &x, Layout::Contiguous);
    let q = p.upload_q(gpu, &x, false);
    let opts = DecodeOptions::default();
    let want = decode::forward_varlen(gpu, &q, &p.new_tokens, dev.cache(&p.case.lengths), &opts)
        .expect("varlen");
    let (total, hq, d) = (p.total(), p.case.heads_q, p.case.d);
    let wide = gpu.zeros(&[total, 2, hq, d], DType::BF16).expect("o");
    let mut out = Output {
        o: wide.as_strided(&[total, hq, d], &[2 * hq * d, d, 1]).expect("o"),
        lse: gpu.zeros(&[hq, total], DType::F32).expect("lse"),
    };
    decode::forward_varlen_into(
        gpu,
        &q,
        &p.new_tokens,
        dev.cache(&p.case.lengths),
        &opts,
        &mut out,
    )
    .expect("into");
    assert!(bytes(&out) == bytes(&want), "forward_varlen_into is not forward_varlen's bits");
}

#[test]
fn gpu_decode_varlen_bad_input_is_an_error_not_a_panic() {
    let Some(gpu) = gpu() else { return };
    let t = |shape: &[usize]| {
        gpu.upload(&pseudo_random(9, shape.iter().product()), shape, DType::F16).expect("upload")
    };
    let kv = t(&[2, 2, 50, 64]);
    let run = |q: &Tensor, new_tokens: &[usize], lengths: &[usize]| {
        let cache = KvCache { k: &kv, v: &kv, lengths };
        decode::forward_varlen(gpu, q, new_tokens, cache, &DecodeOptions::default())
    };
    let q = t(&[5, 8, 64]);
    assert!(run(&q, &[1, 4], &[50, 30]).is_ok());
    // Q not [total, heads, d]; rows not the tokens' sum; a count per sequence missing or extra;
    // 17 tokens; no token at all.
    let q4 = t(&[1, 8, 5, 64]);
    let q17 = t(&[18, 8, 64]);
    let q0 = t(&[0, 8, 64]);
    for (what, q, new_tokens) in [
        ("rank 4", &q4, &[1, 4][..]),
        ("sum", &q, &[1, 3][..]),
        ("counts", &q, &[5][..]),
        ("counts", &q, &[1, 2, 2][..]),
        ("17 tokens", &q17, &[17, 1][..]),
        ("no token", &q0, &[0, 0][..]),
    ] {
        let r = run(q, new_tokens, &[50, 30]);
        assert!(matches!(r, Err(KernelError::Shape(_))), "{what}: {r:?}");
    }
    // Outputs of the wrong shape.
    let mut out = Output {
        o: gpu.zeros(&[5, 8, 64], DType::F16).expect("o"),
        lse: gpu.zeros(&[5, 8], DType::F32).expect("lse"),
    };
    let cache = KvCache { k: &kv, v: &kv, lengths: &[50, 30] };
    let r =
        decode::forward_varlen_into(gpu, &q, &[1, 4], cache, &DecodeOptions::default(), &mut out);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
}
