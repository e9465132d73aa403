//! The GPU decoding rungs (`ladder_kernels::decode`: FlashDecoding and FlashDecoding++) against
//! the float64 oracle and the CPU rungs, with a contiguous and a paged KV cache.
//!
//! Each sequence `b` of a decoding call is the full-attention problem of its `n_new` new tokens
//! against its first `lengths[b]` cache entries, causal bottom-right (the project's convention
//! with `n_q = n_new`, `n_kv = lengths[b]`): the oracle and the tolerance (twice the error of
//! the naive algorithm with the kernel's 16-bit roundings, plus the f32 floor) are built per
//! sequence exactly as for the GPU FA2 forward. Cache entries past each length are NaN, and so
//! are the pages no sequence owns, so a kernel that reads one fails; outputs are poisoned with
//! NaN, so an element it forgets to write fails too.
//!
//! - Fixed cases: every split count (the heuristic, 1, 3, 7, and more splits than key tiles) must
//!   pass the oracle and agree with the others within the sum of their tolerances; more than 32
//!   rows per kv head (GQA 8 × 16 tokens; 16 at d = 256) run in several row blocks.
//! - Paged: the same data in pages of 16, 64 and 256 tokens, in shuffled order, gives the same
//!   bits as the contiguous cache with the same split count.
//! - Strided: Q and the cache in `[b, s, h, d]` memory order (vLLM's NHD pages) or as a slot of a
//!   packed buffer give the row-major tensors' bits; `O` is laid out like `q`.
//! - Drawn shapes (proptest): GQA groups 1–8 × 1–16 new tokens (up to 128 rows per kv head),
//!   per-sequence lengths from 0 to the capacity, every head dimension (8 … 256), contiguous or
//!   paged, Q and the cache in each memory layout, against the oracle and the CPU rung
//!   `ladder_reference::flash_decoding` with the same split count.
//! - `forward_into` (caller-owned outputs) gives `forward`'s bits; a call gives the same bits
//!   whatever ran before it (the split kernel's counters are left at zero).
//! - Bad input: errors, never a panic; a page table that lives only on the device and points
//!   outside the cache makes exactly its sequence's rows NaN (FlashDecoding and FlashDecoding++).
//!
//! FlashDecoding++ and the dispatcher (`DecodeOptions::strategy`):
//!
//! - Every strategy (auto, FlashDecoding, FlashDecoding++ by the rows, its GEMV and its flat GEMM
//!   forced) on the fixed cases and two large enough for the dispatcher to pick FlashDecoding++:
//!   within tolerance of the oracle and of the automatic choice. Bit for bit only where the same
//!   kernels run with the same split count: auto and the strategy it picked, paged and contiguous
//!   caches. Different kernels sum in different orders and round `P` differently, so they agree
//!   within the sum of their tolerances.
//! - Forced fallbacks: `φ` ±100 (every row that sees a key falls back), logit spikes past the
//!   safe window (score 60; and 20, past fp16's ±5.5 but inside bf16's ±44), a window of ±0.2
//!   (rows on both sides in one call): the count is the one predicted from the float64 scores by
//!   the CPU rung's rule; the rows that fell back are written in the same launch (an output of
//!   NaN gets the same bits) and agree with FlashDecoding's within both tolerances.
//! - Drawn shapes for every strategy against the oracle, the automatic choice and the CPU rung of
//!   the kernel that ran (rung 7 with the same `φ`, window and split count, and its fallback
//!   count); drawn shapes with `φ` ±100.
//! - Bad `φ`, window or split count: configuration errors.
//!
//! The cases, inputs and launches are in `decoding/mod.rs`, shared with `gpu_decode_varlen.rs`
//! (packed new tokens). Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` a missing GPU
//! fails them. `LADDER_GPU_CASES` sets the number of drawn cases (default 48).

mod decoding;

use decoding::*;
use ladder_compare::cases::pseudo_random;
use ladder_compare::gpu_check::{self, Layout as Axes, narrow};
use ladder_compare::oracle::{Expected, judge_between};
use ladder_kernels::decode::{
    self, DecodeOptions, DecodeStats, KvCache, PageTable, PagedKvCache, Strategy as DecodeStrategy,
};
use ladder_kernels::{DType, Gpu, KernelError, Output, Tensor, round_to};
use ladder_reference::{
    AttentionOptions, FlashDecodingOptions, FlashDecodingPpOptions, Phi, flash_decoding,
    flash_decoding_pp,
};
use ndarray::{Array3, Array4, s};
use proptest::prelude::*;

/// The split counts every fixed case runs with: the heuristic, 1, 3, 7, and more than key tiles.
const SPLITS: [Option<usize>; 5] = [None, Some(1), Some(3), Some(7), Some(64)];

fn check_case(case: &Case) {
    let Some(gpu) = gpu() else { return };
    let x = case.inputs();
    let runs: Vec<(Option<usize>, Array4<f32>, Array3<f32>)> = SPLITS
        .iter()
        .map(|&splits| {
            let (o, lse) = run(gpu, case, &x, Layout::Contiguous, splits);
            (splits, o, lse)
        })
        .collect();
    for (b, &len) in case.lengths.iter().enumerate() {
        if len == 0 {
            // No key at all: O = 0 and lse = −inf exactly, whatever the splits.
            for (splits, o, lse) in &runs {
                assert_empty(&format!("{case:?} splits {splits:?}"), o, lse, b);
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

/// A call is one launch: the blocks of each group of splits count themselves in on counters the
/// `Gpu` keeps, and the last one combines the group, so every call must leave the counters at
/// zero. With calls of other split counts and shapes in between (including one split, which
/// does not count, and more splits than key tiles), the same call gives the same bits.
#[test]
fn gpu_decode_gives_the_same_bits_whatever_ran_before() {
    let Some(gpu) = gpu() else { return };
    let all = cases(DType::F16);
    let (a, b) = (&all[2], &all[9]);
    let (xa, xb) = (a.inputs(), b.inputs());
    let dev_a = upload(gpu, a, &xa, Layout::Contiguous);
    let dev_b = upload(gpu, b, &xb, Layout::Contiguous);
    let first = bytes(&launch(gpu, a, &dev_a, Some(3)));
    for splits in [Some(7), None, Some(1), Some(64), Some(3)] {
        launch(gpu, b, &dev_b, splits);
        let again = bytes(&launch(gpu, a, &dev_a, Some(3)));
        assert!(again == first, "after a call with {splits:?} splits on another shape");
    }
}

/// A NaN in one query row makes that row's `O` and `lse` NaN, as in the CPU rung, for every split
/// count: one split writes the row itself, more go through the combine, whose max must not skip a
/// split's NaN `lse_s`. Every other row keeps its bits.
#[test]
fn gpu_decode_a_nan_query_row_is_nan_for_every_split_count() {
    let Some(gpu) = gpu() else { return };
    for case in [&cases(DType::F16)[0], &cases(DType::BF16)[3]] {
        let x = case.inputs();
        let dev = upload(gpu, case, &x, Layout::Contiguous);
        // Query head 1, new token 0 of sequence 0 gets a NaN in one column.
        let mut q = x.q.clone();
        q[[0, 1, 0, 5]] = f32::NAN;
        let nan_q =
            upload_values(gpu, &q.iter().copied().collect::<Vec<_>>(), q.shape(), case.dtype);
        // 40 splits: the combine reads them in batches of 16, the NaN split in the first.
        for splits in [Some(1), Some(3), Some(40), None] {
            let opts = case.decode_options(DecodeStrategy::FlashDecoding, splits, 0.0);
            let call = |q: &Tensor| {
                let out =
                    decode::forward(gpu, q, dev.cache(&case.lengths), &opts).expect("forward");
                to_host(case, &out)
            };
            let ((o_want, lse_want), (o, lse)) = (call(&dev.q), call(&nan_q));
            let what = format!("{case:?} splits {splits:?}");
            assert!(
                o.slice(s![0, 1, 0, ..]).iter().all(|v| v.is_nan()),
                "{what}: O of the NaN row"
            );
            assert!(lse[[0, 1, 0]].is_nan(), "{what}: lse of the NaN row is {}", lse[[0, 1, 0]]);
            let bits = |a: &[f32]| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for ((index, got), want) in o.indexed_iter().zip(o_want.iter()) {
                let (b, h, t, _) = index;
                if (b, h, t) != (0, 1, 0) {
                    assert_eq!(got.to_bits(), want.to_bits(), "{what}: O{index:?} changed");
                }
            }
            let (mut lse, mut lse_want) = (lse.clone(), lse_want.clone());
            lse[[0, 1, 0]] = 0.0;
            lse_want[[0, 1, 0]] = 0.0;
            assert_eq!(bits(lse.as_slice().unwrap()), bits(lse_want.as_slice().unwrap()), "{what}");
        }
    }
}

/// `decode::forward_into` writes what `forward` returns, bit for bit and every element (its
/// outputs are NaN first), call after call into the same tensors; outputs of another shape or
/// dtype are errors.
#[test]
fn gpu_decode_forward_into_equals_forward() {
    let Some(gpu) = gpu() else { return };
    for dtype in [DType::F16, DType::BF16] {
        let all = cases(dtype);
        for case in [&all[2], &all[9], &all[10]] {
            let x = case.inputs();
            let dev = upload(gpu, case, &x, Layout::Contiguous);
            let o_shape = [case.batch(), case.heads_q, case.n_new, case.d];
            let nan = |shape: &[usize], dtype| nan_tensor(gpu, shape, dtype);
            let mut out = Output { o: nan(&o_shape, dtype), lse: nan(&o_shape[..3], DType::F32) };
            for splits in [Some(3), None, Some(1), Some(64)] {
                // NaN before every call, so that an element the call leaves alone cannot match.
                gpu.fill_bytes(&mut out.o, 0xff).expect("fill");
                gpu.fill_bytes(&mut out.lse, 0xff).expect("fill");
                let opts = case.decode_options(DecodeStrategy::FlashDecoding, splits, 0.0);
                let cache = dev.cache(&case.lengths);
                decode::forward_into(gpu, &dev.q, cache, &opts, &mut out).expect("forward_into");
                let want = bytes(&launch(gpu, case, &dev, splits));
                assert!(bytes(&out) == want, "{case:?} splits {splits:?}: not forward's bits");
            }
            let opts = DecodeOptions::default();
            let mut bad = [
                Output { o: nan(&[1, 1, 1, case.d], dtype), lse: nan(&o_shape[..3], DType::F32) },
                Output { o: nan(&o_shape, dtype), lse: nan(&o_shape, DType::F32) },
                Output { o: nan(&o_shape, DType::F32), lse: nan(&o_shape[..3], DType::F32) },
                Output { o: nan(&o_shape, dtype), lse: nan(&o_shape[..3], dtype) },
            ];
            for (i, out) in bad.iter_mut().enumerate() {
                let r = decode::forward_into(gpu, &dev.q, dev.cache(&case.lengths), &opts, out);
                let right = matches!(
                    (i, &r),
                    (0 | 1, Err(KernelError::Shape(_))) | (2 | 3, Err(KernelError::DType(_)))
                );
                assert!(right, "bad outputs {i}: {r:?}");
            }
        }
    }
}

/// Calls launched back to back, each reading as its query what the call before it wrote: on
/// Hopper the split kernel (FlashDecoding's, and FlashDecoding++'s two kernels, also with every
/// row falling back) is launched programmatically (`GpuConfig::programmatic_launch`, on by
/// default), so its blocks start while the previous call finishes, and must wait for it before
/// reading. The chain runs on a `Gpu` of its own (its own stream, no poisoning, no synchronising
/// launches: nothing between two calls but the calls), issued from a thread that has not used the
/// GPU before (the launch must bind the context itself). Every output is NaN until written (a
/// read that came too early would carry NaN or stale values down the chain), and the chain must
/// give the bits of the same chain with the host waiting for each call to finish.
#[test]
fn gpu_decode_a_call_reads_what_the_call_before_it_wrote() {
    let Some(gpu) = gpu() else { return };
    let stream = gpu.context().new_stream().expect("stream");
    let config = gpu_check::gpu_config_from_env().expect("config");
    let own = Gpu::from_stream(stream, config).expect("gpu");
    if own.arch().starts_with("sm_9") {
        assert!(
            own.programmatic_launches(),
            "Hopper launches the decoding kernel programmatically"
        );
    }
    let all = cases(DType::F16);
    for case in [&all[2], &all[9]] {
        let x = case.inputs();
        let dev = upload(&own, case, &x, Layout::Contiguous);
        let o_shape = [case.batch(), case.heads_q, case.n_new, case.d];
        let nan = |shape: &[usize], dtype| nan_tensor(&own, shape, dtype);
        let outputs = || -> Vec<Output> {
            let outs = (0..8)
                .map(|_| Output {
                    o: nan(&o_shape, case.dtype),
                    lse: nan(&o_shape[..3], DType::F32),
                })
                .collect();
            own.synchronize().expect("sync");
            outs
        };
        let runs = [
            (DecodeStrategy::FlashDecoding, 0.0),
            (DecodeStrategy::Gemv, 0.0),
            (DecodeStrategy::FlatGemm, 0.0),
            (DecodeStrategy::FlatGemm, 100.0),
        ];
        for ((strategy, phi), splits) in runs.into_iter().flat_map(|r| [(r, Some(1)), (r, Some(5))])
        {
            let what = format!("{case:?} {strategy} φ {phi} splits {splits:?}");
            let opts = case.decode_options(strategy, splits, phi);
            let chain = |outs: &mut Vec<Output>, wait: bool| {
                for i in 0..outs.len() {
                    let (done, rest) = outs.split_at_mut(i);
                    let q = done.last().map_or(&dev.q, |prev| &prev.o);
                    decode::forward_into(&own, q, dev.cache(&case.lengths), &opts, &mut rest[0])
                        .expect("forward_into");
                    if wait {
                        own.synchronize().expect("sync");
                    }
                }
            };
            let mut waited = outputs();
            chain(&mut waited, true);
            let mut fast = outputs();
            std::thread::scope(|s| s.spawn(|| chain(&mut fast, false)).join().expect("thread"));
            own.synchronize().expect("sync");
            for (i, (a, b)) in fast.iter().zip(&waited).enumerate() {
                let (a, b) = (bytes(a), bytes(b));
                assert!(a == b, "{what}: call {i} of the chain differs");
            }
            // Not a chain of NaN: the last call's output is finite.
            let o = waited[7].o.to_f32_vec().expect("download");
            assert!(o.iter().all(|v| v.is_finite()), "{what}: NaN in the chain");
        }
    }
}

/// The paged kernel is the contiguous one with another address helper: on the same data, with
/// the same split count, it gives the same bits, for pages of 16 (a 64-key tile gathered from 4
/// pages), 64 (one page per tile) and 256 (4 tiles per page), in shuffled order, with the table
/// checked on the host or living on the device only.
#[test]
fn gpu_decode_paged_equals_contiguous_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    for dtype in [DType::F16, DType::BF16] {
        for case in cases(dtype) {
            let x = case.inputs();
            let contiguous = upload(gpu, &case, &x, Layout::Contiguous);
            for page in [16, 64, 256] {
                for device_only in [false, true] {
                    let paged = upload(gpu, &case, &x, Layout::Paged { page, device_only });
                    for splits in [None, Some(1), Some(3)] {
                        // The heuristic may fill more blocks per SM for a paged cache
                        // (decode::split_count): the contiguous call takes the paged one's count.
                        let same = Some(case.splits_used(gpu, splits, true));
                        let want = bytes(&launch(gpu, &case, &contiguous, same));
                        let got = bytes(&launch(gpu, &case, &paged, splits));
                        assert!(
                            got.0 == want.0 && got.1 == want.1,
                            "{case:?}: pages of {page} (device-only table: {device_only}), \
                             splits {splits:?}: not the contiguous cache's bits"
                        );
                    }
                }
            }
        }
    }
}

/// Q and the cache laid out `[b, s, h, d]` in memory (a projection's Q, FlashAttention's
/// `k_cache`, vLLM's NHD pages) or as slot 0 of a packed buffer whose other slots are NaN give the
/// row-major tensors' bits (the kernels compute the same sums, only the addresses differ), with a
/// contiguous and a paged cache, for FlashDecoding and FlashDecoding++. `O` comes back laid out
/// like `q`, and `forward_into` writes a caller's `O` of other strides.
#[test]
fn gpu_decode_strided_inputs_give_the_row_major_bits() {
    let Some(gpu) = gpu() else { return };
    let bf16 = cases(DType::BF16).into_iter().filter(|c| [64, 96, 200].contains(&c.d));
    for case in cases(DType::F16).into_iter().chain(bf16) {
        let x = case.inputs();
        for layout in [Layout::Contiguous, Layout::Paged { page: 32, device_only: false }] {
            let dense = upload(gpu, &case, &x, layout);
            for strategy in [DecodeStrategy::FlashDecoding, DecodeStrategy::FlashDecodingPp] {
                let opts = case.decode_options(strategy, None, 0.0);
                let want = bytes(&launch_with(gpu, &case, &dense, &opts).0);
                for axes in [Axes::Bshd, Axes::Packed] {
                    let dev = upload_as(gpu, &case, &x, layout, axes);
                    let (out, _) = launch_with(gpu, &case, &dev, &opts);
                    let what = format!("{case:?} {layout:?} {strategy} {axes:?}");
                    assert!(bytes(&out) == want, "{what}: not the row-major tensors' bits");
                    if axes == Axes::Bshd {
                        assert_eq!(
                            out.o.strides(),
                            dev.q.strides(),
                            "{what}: O not laid out like q"
                        );
                    }
                }
            }
        }
        // A caller's O in [b, s, h, d] order for row-major inputs.
        let dense = upload(gpu, &case, &x, Layout::Contiguous);
        let (b, hq, n, d) = (case.batch(), case.heads_q, case.n_new, case.d);
        let mut out = Output {
            o: gpu.zeros(&[b, n, hq, d], case.dtype).expect("o").transpose(1, 2).expect("o"),
            lse: gpu.zeros(&[b, hq, n], DType::F32).expect("lse"),
        };
        let opts = case.decode_options(DecodeStrategy::FlashDecoding, None, 0.0);
        let want = bytes(&launch_with(gpu, &case, &dense, &opts).0);
        decode::forward_into(gpu, &dense.q, dense.cache(&case.lengths), &opts, &mut out)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        assert!(bytes(&out) == want, "{case:?}: a strided O is not forward's bits");
    }
}

/// One drawn call: a case, its cache's layout, where its rows lie and a split count.
#[derive(Clone, Debug)]
struct Drawn {
    case: Case,
    layout: Layout,
    axes: Axes,
    splits: Option<usize>,
}

/// GQA groups 1–8 × 1–16 new tokens (up to 128 rows per kv head), 1–2 kv heads, 1–3 sequences
/// with lengths from 0 to the capacity (often full), every head dimension (8 … 256), fp16 or
/// bf16, contiguous or paged (every page size), Q and the cache in each of the three layouts, the
/// heuristic's split count or 1–9.
fn drawn() -> impl Strategy<Value = Drawn> {
    let page = prop::sample::select(vec![None, Some(16), Some(32), Some(64), Some(128), Some(256)]);
    let splits = prop_oneof![Just(None), (1..=9usize).prop_map(Some)];
    (
        (1..=3usize, 1..=2usize, 1..=8usize, 1..=16usize, 1..=600usize),
        (prop::sample::select(head_dims()), prop::sample::select(Axes::ALL.to_vec())),
        prop::sample::select(vec![DType::F16, DType::BF16]),
        (page, any::<bool>(), splits, any::<u64>()),
    )
        .prop_flat_map(|((batch, heads_kv, group, n_new, cap), (d, axes), dtype, rest)| {
            let length = prop_oneof![Just(cap), 0..=cap];
            (
                Just((heads_kv, group, n_new, cap, d, axes, dtype, rest)),
                prop::collection::vec(length, batch),
            )
        })
        .prop_map(|((heads_kv, group, n_new, cap, d, axes, dtype, rest), lengths)| {
            let (page, device_only, splits, seed) = rest;
            let case = Case {
                heads_q: heads_kv * group,
                heads_kv,
                n_new,
                d,
                capacity: cap,
                lengths,
                dtype,
                seed: seed >> 2,
            };
            let layout = match page {
                None => Layout::Contiguous,
                Some(page) => Layout::Paged { page, device_only },
            };
            Drawn { case, layout, axes, splits }
        })
}

/// A drawn call against the oracle and against the CPU rung with the same split count.
fn check_drawn(drawn: &Drawn) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let Drawn { case, layout, axes, splits } = drawn;
    let x = case.inputs();
    let (o, lse) = run_as(gpu, case, &x, *layout, *axes, *splits);
    let (attention, _) = case.options();
    let cpu_opts = FlashDecodingOptions::new(attention)
        .with_splits(case.splits_used(gpu, *splits, matches!(layout, Layout::Paged { .. })))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (b, &len) in case.lengths.iter().enumerate() {
        if len == 0 {
            assert_empty(&format!("{drawn:?}"), &o, &lse, b);
            continue;
        }
        let (inputs, oracle) = problem_of(case, &x, b);
        let expected = gpu_check::expected_forward(&oracle, &inputs, case.dtype)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got = sequence(&o, &lse, b);
        let verdict = expected.judge(&got);
        prop_assert!(
            verdict.pass,
            "{drawn:?}, sequence {b} vs oracle: O {} (tol {}), lse {} (tol {})",
            verdict.o,
            expected.o,
            verdict.lse,
            expected.lse
        );
        let x32 = narrow(&inputs);
        let cpu = flash_decoding::forward(x32.q.view(), x32.k.view(), x32.v.view(), &cpu_opts)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let cpu_expected =
            Expected::from_oracle(&oracle, &x32).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let pair = judge_between(&got, &cpu, &expected, &cpu_expected);
        prop_assert!(
            pair.pass,
            "{drawn:?}, sequence {b} vs the CPU rung: O {} (tol {}), lse {} (tol {})",
            pair.o,
            expected.o.plus(cpu_expected.o),
            pair.lse,
            expected.lse.plus(cpu_expected.lse)
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(48)))]

    #[test]
    fn gpu_decode_drawn_shapes_match_the_oracle_and_the_cpu_rung(drawn in drawn()) {
        check_drawn(&drawn)?;
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
        decode::forward(gpu, q, cache, &DecodeOptions { splits, ..DecodeOptions::default() })
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
    // A scale that is not positive and finite (the row max is taken on the raw scores).
    for scale in [0.0, -0.5, f32::NAN, f32::INFINITY] {
        let cache = KvCache { k: &kv, v: &kv, lengths: &[50, 3] };
        let r = decode::forward(
            gpu,
            &q,
            cache,
            &DecodeOptions { scale: Some(scale), ..DecodeOptions::default() },
        );
        assert!(matches!(r, Err(KernelError::Shape(_))), "scale {scale}: {r:?}");
    }
    // Head dimensions without a kernel: not a multiple of 8, past 256. The error says what is.
    for d in [100, 264] {
        let (qd, kvd) = (t(&[2, 8, 1, d], f16), t(&[2, 2, 50, d], f16));
        let r = run(&qd, &kvd, &kvd, &[50, 3], None);
        assert!(
            matches!(r, Err(KernelError::UnsupportedHeadDim { d: got, .. }) if got == d),
            "{r:?}"
        );
        let message = r.expect_err("d").to_string();
        assert!(message.contains("multiples of 8 from 8 to 256"), "{message}");
    }
    // Strides: the head dimension not contiguous; a sequence stride that is not a whole number of
    // 16-byte chunks; K and V laid out differently (the kernels address both with one offset).
    let strided = |shape: &[usize], strides: &[usize], len: usize| {
        t(&[len], f16).as_strided(shape, strides).expect("in the buffer")
    };
    let q_gaps = strided(&[2, 8, 1, 64], &[8 * 128, 128, 128, 2], 2 * 8 * 128);
    let r = run(&q_gaps, &kv, &kv, &[50, 3], None);
    assert!(matches!(&r, Err(KernelError::Shape(m)) if m.contains("contiguous")), "{r:?}");
    let kv_odd = strided(&[2, 2, 50, 64], &[2 * 50 * 68, 50 * 68, 68, 1], 2 * 2 * 50 * 68);
    let r = run(&q, &kv_odd, &kv_odd, &[50, 3], None);
    assert!(matches!(&r, Err(KernelError::Shape(m)) if m.contains("multiples of 8")), "{r:?}");
    let kv_bshd = t(&[2, 50, 2, 64], f16).transpose(1, 2).expect("transpose");
    let r = run(&q, &kv_bshd, &kv, &[50, 3], None);
    assert!(matches!(&r, Err(KernelError::Shape(m)) if m.contains("alike")), "{r:?}");
    assert!(run(&q, &kv_bshd, &kv_bshd, &[50, 3], None).is_ok());
    // forward_into: an lse that is not contiguous (two tokens, so that its transposed axes both
    // count).
    let q2 = t(&[2, 8, 2, 64], f16);
    let mut out = Output {
        o: gpu.zeros(&[2, 8, 2, 64], f16).expect("o"),
        lse: gpu.zeros(&[2, 2, 8], DType::F32).expect("lse").transpose(1, 2).expect("lse"),
    };
    let cache = KvCache { k: &kv, v: &kv, lengths: &[50, 3] };
    let r = decode::forward_into(gpu, &q2, cache, &DecodeOptions::default(), &mut out);
    assert!(matches!(&r, Err(KernelError::Shape(m)) if m.contains("lse")), "{r:?}");
}

/// A paged cache with a bad table or bad pages is an error value when the table's entries are
/// known on the host. A table that lives only on the device is not read back: an entry outside
/// the cache makes every row of its sequence NaN (the kernel never follows it), and the other
/// sequences are exactly as with a good table. The same for FlashDecoding and both FlashDecoding++
/// kernels (a NaN row does not fall back).
#[test]
fn gpu_decode_bad_page_tables_are_errors_or_nan_rows() {
    let Some(gpu) = gpu() else { return };
    let case = Case {
        heads_q: 8,
        heads_kv: 2,
        n_new: 2,
        d: 64,
        capacity: 100,
        lengths: vec![100, 40],
        dtype: DType::F16,
        seed: 21,
    };
    let x = case.inputs();
    let pages = paginate(&case, &x, 16); // 7 pages per sequence, 17 in all
    let upload_pages =
        |values: &[f32], dtype: DType| gpu.upload(values, &pages.shape, dtype).expect("upload");
    let (k, v) = (upload_pages(&pages.k, case.dtype), upload_pages(&pages.v, case.dtype));
    let q = upload_values(gpu, &x.q.iter().copied().collect::<Vec<_>>(), x.q.shape(), case.dtype);
    for strategy in [DecodeStrategy::FlashDecoding, DecodeStrategy::Gemv, DecodeStrategy::FlatGemm]
    {
        bad_page_tables(gpu, &case, &pages, (&q, &k, &v), strategy, 2);
    }
    // One split: FlashDecoding's block writes O and lse itself, with no combine.
    bad_page_tables(gpu, &case, &pages, (&q, &k, &v), DecodeStrategy::FlashDecoding, 1);
}

/// [`gpu_decode_bad_page_tables_are_errors_or_nan_rows`] with one strategy and split count.
fn bad_page_tables(
    gpu: &Gpu,
    case: &Case,
    pages: &HostPages,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    strategy: DecodeStrategy,
    splits: usize,
) {
    let upload_pages =
        |values: &[f32], dtype: DType| gpu.upload(values, &pages.shape, dtype).expect("upload");
    let opts = DecodeOptions { splits: Some(splits), strategy, ..DecodeOptions::default() };
    let call = |k: &Tensor, v: &Tensor, table: &PageTable, lengths: &[usize]| {
        let cache = PagedKvCache { k_pages: k, v_pages: v, page_table: table, lengths };
        decode::forward_with_stats(gpu, q, cache, &opts).map(|(out, stats)| {
            assert_eq!(stats.fallback_rows.unwrap_or(0), 0, "{strategy}: no row falls back");
            out
        })
    };
    let good = PageTable::upload(gpu, &pages.entries, 2, pages.max_pages).expect("table");
    let reference = call(k, v, &good, &case.lengths).expect("a good table");
    let (o_ref, lse_ref) = to_host(case, &reference);

    // Host-checked tables: an entry past the last page or negative, where sequence 1 reads it
    // (its third page of three), and a table too short for a length.
    let num_pages = pages.shape[0] as i32;
    for bad in [num_pages, num_pages + 1000, -1, i32::MIN] {
        let mut entries = pages.entries.clone();
        entries[pages.max_pages + 2] = bad;
        let table = PageTable::upload(gpu, &entries, 2, pages.max_pages).expect("table");
        let r = call(k, v, &table, &case.lengths);
        assert!(
            matches!(&r, Err(KernelError::PageTable(m)) if m.contains("page_table[1][2]")),
            "entry {bad}: {r:?}"
        );
    }
    let r = call(k, v, &good, &[100, 7 * 16 + 1]);
    assert!(matches!(&r, Err(KernelError::PageTable(m)) if m.contains("needs 8 pages")), "{r:?}");
    // Entries past what a length reads are never read, checked or not: garbage there is fine.
    let mut padded = pages.entries.clone();
    padded[pages.max_pages + 5] = 1 << 30;
    for device_only in [false, true] {
        let table = upload_table(gpu, &padded, 2, device_only);
        let out = call(k, v, &table, &case.lengths).expect("entries past the length");
        assert_eq!(bytes(&out), bytes(&reference), "device-only table: {device_only}");
    }
    // Page sizes the kernel does not take, pages of another dtype, v unlike k, a table of
    // another batch, pages of another head dim.
    for page in [8, 48, 512] {
        let shape = [4, 2, page, 64];
        let kp = gpu.zeros(&shape, DType::F16).expect("zeros");
        let r = call(&kp, &kp, &good, &[1, 1]);
        assert!(matches!(r, Err(KernelError::Config(_))), "pages of {page}: {r:?}");
    }
    let k_bf = upload_pages(&pages.k, DType::BF16);
    let r = call(&k_bf, v, &good, &case.lengths);
    assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
    let fewer = gpu.zeros(&[5, 2, 16, 64], DType::F16).expect("zeros");
    let r = call(k, &fewer, &good, &case.lengths);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    let three = PageTable::upload(gpu, &[0; 3], 3, 1).expect("table");
    let r = call(k, v, &three, &case.lengths);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    let wide = gpu.zeros(&[17, 2, 16, 128], DType::F16).expect("zeros");
    let r = call(&wide, &wide, &good, &case.lengths);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");

    // A device-only table pointing outside the cache in sequence 1: sequence 1 is NaN (O and lse),
    // sequence 0 the same bits as with the good table. Once copied to the host, it is an error.
    for bad in [num_pages, -1] {
        let mut entries = pages.entries.clone();
        entries[pages.max_pages + 1] = bad;
        let table = upload_table(gpu, &entries, 2, true);
        let out = call(k, v, &table, &case.lengths).expect("not checked on the host");
        let (o, lse) = to_host(case, &out);
        assert!(o.slice(s![1, .., .., ..]).iter().all(|v| v.is_nan()), "entry {bad}: O");
        assert!(lse.slice(s![1, .., ..]).iter().all(|v| v.is_nan()), "entry {bad}: lse");
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let row0 = |a: &Array4<f32>| a.slice(s![0, .., .., ..]).iter().copied().collect::<Vec<_>>();
        assert!(same(&row0(&o), &row0(&o_ref)), "entry {bad}: sequence 0 changed");
        let lse0 = |a: &Array3<f32>| a.slice(s![0, .., ..]).iter().copied().collect::<Vec<_>>();
        assert!(same(&lse0(&lse), &lse0(&lse_ref)), "entry {bad}: sequence 0's lse changed");
        let checked = table.with_host_copy().expect("copy back");
        assert!(checked.has_host_copy());
        let r = call(k, v, &checked, &case.lengths);
        assert!(matches!(r, Err(KernelError::PageTable(_))), "entry {bad}: {r:?}");
    }
}

// ---- FlashDecoding++ and the dispatcher ---------------------------------------------------------

/// FlashDecoding++ with the kernel the rows call for, and each of its kernels forced.
const PP: [DecodeStrategy; 3] =
    [DecodeStrategy::FlashDecodingPp, DecodeStrategy::Gemv, DecodeStrategy::FlatGemm];

/// The default safe window of `dtype` in the CPU rung's `f64`.
fn window(dtype: DType) -> (f64, f64) {
    let (lo, hi) = decode::default_safe_range(dtype);
    (f64::from(lo), f64::from(hi))
}

/// What FlashDecoding++ must do with one output row, by the CPU rung's rule on the float64 scores
/// of the rounded inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RowFate {
    /// No visible key: `O = 0`, `lse = −∞`, no fallback.
    NoKey,
    /// The largest score minus `φ` lies inside the window: kept.
    Kept,
    /// Outside the window: recomputed against its own largest score.
    FallsBack,
    /// Within 10⁻³ (relative) of an edge of the window: the kernel's `f32` scores may go either
    /// way.
    Edge,
}

/// The fate of every output row of `case` on `x`, in `[batch, heads_q, n_new]` order, for `φ` and
/// the window `(lo, hi)` of `max_j s_j − φ`.
fn row_fates(case: &Case, x: &HostInputs, phi: f64, (lo, hi): (f64, f64)) -> Vec<RowFate> {
    let scale = f64::from(case.options().1);
    let group = case.heads_q / case.heads_kv;
    let mut fates = Vec::new();
    for (b, &len) in case.lengths.iter().enumerate() {
        for h in 0..case.heads_q {
            for t in 0..case.n_new {
                // Token t sees keys j ≤ len − n_new + t.
                let visible = (len + t + 1).saturating_sub(case.n_new);
                if visible == 0 {
                    fates.push(RowFate::NoKey);
                    continue;
                }
                let q = x.q.slice(s![b, h, t, ..]);
                let score = |j: usize| {
                    let k = x.k.slice(s![b, h / group, j, ..]);
                    scale * q.iter().zip(k).map(|(&a, &c)| f64::from(a) * f64::from(c)).sum::<f64>()
                };
                let offset = (0..visible).map(score).fold(f64::NEG_INFINITY, f64::max) - phi;
                let margin = 1e-3 * (1.0 + offset.abs());
                fates.push(if (offset - lo).abs() < margin || (offset - hi).abs() < margin {
                    RowFate::Edge
                } else if offset < lo || offset > hi {
                    RowFate::FallsBack
                } else {
                    RowFate::Kept
                });
            }
        }
    }
    fates
}

/// A fallback count against the fates: at least every row that falls back, at most those and the
/// rows on an edge.
fn assert_fallback_count(what: &str, rows: Option<usize>, fates: &[RowFate]) {
    let count = |f: RowFate| fates.iter().filter(|&&x| x == f).count();
    let (sure, edge) = (count(RowFate::FallsBack), count(RowFate::Edge));
    let n = rows.unwrap_or_else(|| panic!("{what}: FlashDecoding++ reports its fallback rows"));
    assert!(
        sure <= n && n <= sure + edge,
        "{what}: {n} rows fell back, expected {sure} (+ up to {edge} on the window's edges)"
    );
}

/// Cases large enough (at least `decode::PP_MIN_KEYS` cache entries) for the dispatcher to pick
/// FlashDecoding++: one row per kv head (the GEMV) and eight (the flat GEMM).
fn large_cases(dtype: DType) -> Vec<Case> {
    let case = |heads_q, heads_kv, n_new, capacity, lengths: &[usize], seed| Case {
        heads_q,
        heads_kv,
        n_new,
        d: 128,
        capacity,
        lengths: lengths.to_vec(),
        dtype,
        seed,
    };
    vec![case(8, 8, 1, 8200, &[8200], 31), case(32, 8, 2, 8200, &[8200, 5000], 32)]
}

/// Every strategy on `case` with the heuristic's split count and with 3 splits: each within
/// tolerance of the oracle and of the automatic choice (different kernels sum in different orders
/// and round `P` differently, so they agree within the sum of their tolerances, not bit for bit);
/// the automatic call gives the same bits as the strategy it picked, forced; FlashDecoding++
/// reports the predicted fallback rows (none here: every score lies within a few units of
/// `φ = 0`), FlashDecoding none at all.
fn check_strategies(case: &Case) {
    let Some(gpu) = gpu() else { return };
    let x = case.inputs();
    let dev = upload(gpu, case, &x, Layout::Contiguous);
    let fates = row_fates(case, &x, 0.0, window(case.dtype));
    for splits in [None, Some(3)] {
        let runs: Vec<(DecodeStrategy, Output, DecodeStats)> = DecodeStrategy::ALL
            .iter()
            .map(|&strategy| {
                let (out, stats) =
                    launch_with(gpu, case, &dev, &case.decode_options(strategy, splits, 0.0));
                (strategy, out, stats)
            })
            .collect();
        let auto = &runs[0];
        assert_eq!(auto.0, DecodeStrategy::Auto);
        let picked = auto.2.plan.strategy;
        let forced = runs.iter().find(|r| r.0 == picked).expect("auto picks a kernel");
        assert_eq!(
            bytes(&auto.1),
            bytes(&forced.1),
            "{case:?} splits {splits:?}: auto ({:?}) is not the same bits as {picked} forced",
            auto.2.plan
        );
        for (strategy, _, stats) in &runs {
            let what = format!("{case:?} {strategy} splits {splits:?}");
            assert_eq!(stats.fallback_rows.is_some(), stats.plan.strategy.is_pp(), "{what}");
            if stats.plan.strategy.is_pp() {
                assert_fallback_count(&what, stats.fallback_rows, &fates);
            }
            if let Some(s) = splits {
                assert_eq!(stats.plan.splits, s, "{what}");
            }
        }
        let host: Vec<_> = runs.iter().map(|(s, out, _)| (*s, to_host(case, out))).collect();
        for (b, &len) in case.lengths.iter().enumerate() {
            if len == 0 {
                for (strategy, (o, lse)) in &host {
                    assert_empty(&format!("{case:?} {strategy} splits {splits:?}"), o, lse, b);
                }
                continue;
            }
            let expected = expected_for(case, &x, b);
            let auto = sequence(&host[0].1.0, &host[0].1.1, b);
            for (strategy, (o, lse)) in &host {
                let seq = sequence(o, lse, b);
                let verdict = expected.judge(&seq);
                assert!(
                    verdict.pass,
                    "{case:?} {strategy} splits {splits:?}, sequence {b} (length {len}) vs oracle: \
                     O {} (tol {}), lse {} (tol {})",
                    verdict.o, expected.o, verdict.lse, expected.lse
                );
                let pair = judge_between(&seq, &auto, &expected, &expected);
                assert!(
                    pair.pass,
                    "{case:?} {strategy} vs auto ({picked}) splits {splits:?}, sequence {b}: O {}, \
                     lse {}",
                    pair.o, pair.lse
                );
            }
        }
    }
}

#[test]
fn gpu_decode_fp16_every_strategy_matches_the_oracle_and_auto() {
    for case in cases(DType::F16).into_iter().chain(large_cases(DType::F16)) {
        check_strategies(&case);
    }
}

#[test]
fn gpu_decode_bf16_every_strategy_matches_the_oracle_and_auto() {
    for case in cases(DType::BF16).into_iter().chain(large_cases(DType::BF16)) {
        check_strategies(&case);
    }
}

/// The automatic choice on the large cases is FlashDecoding++ (the dispatcher's table), on the
/// small ones FlashDecoding.
#[test]
fn gpu_decode_auto_follows_the_decision_table() {
    let Some(gpu) = gpu() else { return };
    let sms = gpu.sm_count() as usize;
    for case in cases(DType::F16).into_iter().chain(large_cases(DType::F16)) {
        let x = case.inputs();
        let dev = upload(gpu, &case, &x, Layout::Contiguous);
        let (_, stats) =
            launch_with(gpu, &case, &dev, &case.decode_options(DecodeStrategy::Auto, None, 0.0));
        let want = decode::dispatch(&case.workload(false), sms);
        assert_eq!(stats.plan, want, "{case:?}");
    }
    let large = large_cases(DType::F16);
    // FlashDecoding++ picks its kernel by the rows (and Auto does the same where it may take
    // FlashDecoding++ at all: decode::PP_IN_AUTO).
    let plan = |c: &Case| {
        let work = decode::Workload { max_len: c.capacity, ..c.workload(false) };
        let pp = decode::plan(DecodeStrategy::FlashDecodingPp, None, &work, sms);
        (pp.expect("plan").strategy, decode::dispatch(&work, sms).strategy)
    };
    let auto = |kernel| if decode::PP_IN_AUTO { kernel } else { DecodeStrategy::FlashDecoding };
    assert_eq!(plan(&large[0]), (DecodeStrategy::Gemv, auto(DecodeStrategy::Gemv)));
    assert_eq!(plan(&large[1]), (DecodeStrategy::FlatGemm, auto(DecodeStrategy::FlatGemm)));
}

/// FlashDecoding++'s kernels read a paged cache through FlashDecoding's address helper: on the same
/// data, with the same split count (the paged call's), pages of 16, 64 and 256 give the contiguous
/// cache's bits and fallback count.
#[test]
fn gpu_decode_pp_paged_equals_contiguous_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    for dtype in [DType::F16, DType::BF16] {
        for case in cases(dtype) {
            let x = case.inputs();
            let contiguous = upload(gpu, &case, &x, Layout::Contiguous);
            for page in [16, 64, 256] {
                for device_only in [false, true] {
                    let paged = upload(gpu, &case, &x, Layout::Paged { page, device_only });
                    for strategy in [DecodeStrategy::Gemv, DecodeStrategy::FlatGemm] {
                        for splits in [None, Some(3)] {
                            let opts = case.decode_options(strategy, splits, 0.0);
                            let (got, got_stats) = launch_with(gpu, &case, &paged, &opts);
                            // The paged call's split count (the heuristic may fill more blocks
                            // per SM for a paged cache: decode::split_count).
                            let same = Some(got_stats.plan.splits);
                            let opts = case.decode_options(strategy, same, 0.0);
                            let (want, want_stats) = launch_with(gpu, &case, &contiguous, &opts);
                            assert!(
                                bytes(&got) == bytes(&want) && got_stats == want_stats,
                                "{case:?}: {strategy}, pages of {page} (device-only table: \
                                 {device_only}), splits {splits:?}: not the contiguous cache's \
                                 bits ({got_stats:?} vs {want_stats:?})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// One FlashDecoding++ scenario: `x` with `φ` and `safe_range`. For each FlashDecoding++ strategy
/// (and the heuristic's and 3 splits): the fallback count is the predicted one; the call writes
/// every row, fallback rows included, in its one launch (into NaN: the same bits); every sequence
/// is within tolerance of the oracle and of FlashDecoding with the same split count.
fn check_fallbacks(
    gpu: &Gpu,
    case: &Case,
    x: &HostInputs,
    phi: f32,
    safe_range: Option<(f32, f32)>,
    layout: Layout,
) -> Result<(), TestCaseError> {
    let range = safe_range.map_or(window(case.dtype), |(lo, hi)| (f64::from(lo), f64::from(hi)));
    let fates = row_fates(case, x, f64::from(phi), range);
    let dev = upload(gpu, case, x, layout);
    let expected: Vec<Option<Expected>> = (0..case.batch())
        .map(|b| (case.lengths[b] > 0).then(|| expected_for(case, x, b)))
        .collect();
    for strategy in PP {
        for splits in [None, Some(3)] {
            let opts = DecodeOptions { safe_range, ..case.decode_options(strategy, splits, phi) };
            let what = format!("{case:?} {strategy} splits {splits:?} φ {phi} window {range:?}");
            let (out, stats) = launch_with(gpu, case, &dev, &opts);
            assert_fallback_count(&what, stats.fallback_rows, &fates);
            // Into an output of NaN the caller keeps, the call leaves forward_with_stats' bits (whose
            // outputs the test Gpu poisons too): a row the launch never wrote stays NaN and fails
            // the oracle's check below.
            let o_shape = [case.batch(), case.heads_q, case.n_new, case.d];
            let mut poisoned = Output {
                o: nan_tensor(gpu, &o_shape, case.dtype),
                lse: nan_tensor(gpu, &o_shape[..3], DType::F32),
            };
            decode::forward_into(gpu, &dev.q, dev.cache(&case.lengths), &opts, &mut poisoned)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            prop_assert!(bytes(&poisoned) == bytes(&out), "{}: not forward_with_stats' bits", what);
            // FlashDecoding with the same split count: a row that fell back is an exact softmax
            // again, within both kernels' tolerances of FlashDecoding's row.
            let fd_opts =
                case.decode_options(DecodeStrategy::FlashDecoding, Some(stats.plan.splits), phi);
            let (fd, _) = launch_with(gpu, case, &dev, &fd_opts);
            let (fd_o, fd_lse) = to_host(case, &fd);
            let (o, lse) = to_host(case, &out);
            for (b, expected) in expected.iter().enumerate() {
                let Some(expected) = expected else { continue };
                let pair = judge_between(
                    &sequence(&o, &lse, b),
                    &sequence(&fd_o, &fd_lse, b),
                    expected,
                    expected,
                );
                prop_assert!(
                    pair.pass,
                    "{}, sequence {} vs FlashDecoding: O {}, lse {}",
                    what,
                    b,
                    pair.o,
                    pair.lse
                );
            }
            for (b, expected) in expected.iter().enumerate() {
                let Some(expected) = expected else {
                    assert_empty(&what, &o, &lse, b);
                    continue;
                };
                let verdict = expected.judge(&sequence(&o, &lse, b));
                prop_assert!(
                    verdict.pass,
                    "{}, sequence {} vs oracle: O {} (tol {}), lse {} (tol {})",
                    what,
                    b,
                    verdict.o,
                    expected.o,
                    verdict.lse,
                    expected.lse
                );
            }
        }
    }
    Ok(())
}

/// `x` with logit spikes in sequence 0: every query row of a kv head's group is the group's first
/// row `u`, and key 0 of the kv head is `c·u` with `scale · c · |u|² = spike`, so every row of
/// the sequence that sees a key has a score of `spike` (the others stay within a few units of 0).
fn spiked(case: &Case, x: &HostInputs, spike: f64) -> HostInputs {
    let (mut q, mut k) = (x.q.clone(), x.k.clone());
    let scale = f64::from(case.options().1);
    let group = case.heads_q / case.heads_kv;
    for kv in 0..case.heads_kv {
        let u = q.slice(s![0, kv * group, 0, ..]).to_owned();
        for h in kv * group..(kv + 1) * group {
            for t in 0..case.n_new {
                q.slice_mut(s![0, h, t, ..]).assign(&u);
            }
        }
        let norm2: f64 = u.iter().map(|&a| f64::from(a) * f64::from(a)).sum();
        let c = spike / (scale * norm2);
        let key: Vec<f32> = u.iter().map(|&a| (f64::from(a) * c) as f32).collect();
        let key = round_to(&key, case.dtype);
        if case.capacity > 0 {
            k.slice_mut(s![0, kv, 0, ..]).iter_mut().zip(key).for_each(|(d, s)| *d = s);
        }
    }
    HostInputs { q, k, v: x.v.clone() }
}

/// Forced fallbacks on the fixed cases: `φ` far above and far below every score (every row that
/// sees a key falls back), logit spikes past both windows (the spiked sequence falls back, the
/// others not), a spike inside bf16's window but past fp16's, and a window so narrow that rows
/// fall on both sides of it in one call.
#[test]
fn gpu_decode_pp_fallback_rows_are_flash_decodings() {
    let Some(gpu) = gpu() else { return };
    for dtype in [DType::F16, DType::BF16] {
        for case in cases(dtype) {
            let x = case.inputs();
            let run = |x: &HostInputs, phi, range| {
                check_fallbacks(gpu, &case, x, phi, range, Layout::Contiguous)
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            run(&x, 100.0, None);
            run(&x, -100.0, None);
            run(&spiked(&case, &x, 60.0), 0.0, None);
            run(&spiked(&case, &x, 20.0), 0.0, None);
            run(&x, 0.0, Some((-0.2, 0.2)));
        }
    }
}

/// FlashDecoding++ with atomic sums (`DecodeOptions::atomic_sums`: each split adds its partials
/// into one sum per row as it finishes): every call within tolerance of the oracle and of the
/// split-order sums, with the same plan and fallback count, for each kernel and split count
/// (40 splits: more than a combine batch); rows that all fall back (`φ` = 100) the split order's
/// bits, recomputed. The sums live from call to call and each call clears what it added: the calls
/// alternate shapes, orders and `φ`, and every one is checked, so sums a call left behind would
/// show in the next.
#[test]
fn gpu_decode_pp_atomic_sums_match_the_split_order() {
    let Some(gpu) = gpu() else { return };
    for dtype in [DType::F16, DType::BF16] {
        for case in cases(dtype).into_iter().chain(large_cases(dtype)) {
            let x = case.inputs();
            let dev = upload(gpu, &case, &x, Layout::Contiguous);
            let expected: Vec<Option<Expected>> = (0..case.batch())
                .map(|b| (case.lengths[b] > 0).then(|| expected_for(&case, &x, b)))
                .collect();
            for strategy in [DecodeStrategy::Gemv, DecodeStrategy::FlatGemm] {
                for splits in [None, Some(3), Some(40)] {
                    for phi in [0.0, 100.0] {
                        let ordered = case.decode_options(strategy, splits, phi);
                        let atomic = DecodeOptions { atomic_sums: true, ..ordered.clone() };
                        let what = format!("{case:?} {strategy} splits {splits:?} φ {phi}");
                        let (want, want_stats) = launch_with(gpu, &case, &dev, &ordered);
                        let want_host = to_host(&case, &want);
                        for call in 0..2 {
                            let what = format!("{what}, atomic sums, call {call}");
                            let (got, stats) = launch_with(gpu, &case, &dev, &atomic);
                            assert_eq!(stats, want_stats, "{what}");
                            if phi == 100.0 {
                                assert!(bytes(&got) == bytes(&want), "{what}: not the same bits");
                            }
                            let (o, lse) = to_host(&case, &got);
                            for (b, expected) in expected.iter().enumerate() {
                                let Some(expected) = expected else {
                                    assert_empty(&what, &o, &lse, b);
                                    continue;
                                };
                                let seq = sequence(&o, &lse, b);
                                let verdict = expected.judge(&seq);
                                assert!(
                                    verdict.pass,
                                    "{what}, sequence {b} vs oracle: O {} (tol {}), lse {} \
                                     (tol {})",
                                    verdict.o, expected.o, verdict.lse, expected.lse
                                );
                                let order = sequence(&want_host.0, &want_host.1, b);
                                let pair = judge_between(&seq, &order, expected, expected);
                                assert!(
                                    pair.pass,
                                    "{what}, sequence {b} vs split order: O {}, lse {}",
                                    pair.o, pair.lse
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The fallback count is the CPU rung's on the same problem: with `φ` far away every row that
/// sees a key falls back, on drawn shapes and layouts.
fn check_drawn_fallbacks(drawn: &Drawn, phi: f32) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let x = drawn.case.inputs();
    check_fallbacks(gpu, &drawn.case, &x, phi, None, drawn.layout)
}

/// A drawn call of `strategy` against the oracle, the automatic choice, and the CPU rung of the
/// kernel that ran (FlashDecoding, or FlashDecoding++ with the same `φ`, window and split count,
/// whose fallback count it must also report).
fn check_drawn_strategy(drawn: &Drawn, strategy: DecodeStrategy) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let Drawn { case, layout, axes, splits } = drawn;
    let x = case.inputs();
    let dev = upload_as(gpu, case, &x, *layout, *axes);
    let (out, stats) = launch_with(gpu, case, &dev, &case.decode_options(strategy, *splits, 0.0));
    let auto_opts = case.decode_options(DecodeStrategy::Auto, *splits, 0.0);
    let (auto, _) = launch_with(gpu, case, &dev, &auto_opts);
    let ((o, lse), (auto_o, auto_lse)) = (to_host(case, &out), to_host(case, &auto));
    let (attention, _) = case.options();
    let (lo, hi) = window(case.dtype);
    let pp_opts = FlashDecodingPpOptions {
        safe_range: Some((lo, hi)),
        ..FlashDecodingPpOptions::new(attention.clone())
            .with_phi(Phi::Given(0.0))
            .with_splits(stats.plan.splits)
            .map_err(|e| TestCaseError::fail(e.to_string()))?
    };
    let fd_opts = FlashDecodingOptions::new(attention)
        .with_splits(stats.plan.splits)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut cpu_fallbacks = 0;
    for (b, &len) in case.lengths.iter().enumerate() {
        if len == 0 {
            assert_empty(&format!("{drawn:?} {strategy}"), &o, &lse, b);
            continue;
        }
        let (inputs, oracle) = problem_of(case, &x, b);
        let expected = gpu_check::expected_forward(&oracle, &inputs, case.dtype)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got = sequence(&o, &lse, b);
        let verdict = expected.judge(&got);
        prop_assert!(
            verdict.pass,
            "{:?} {}, sequence {} vs oracle: O {} (tol {}), lse {} (tol {})",
            drawn,
            strategy,
            b,
            verdict.o,
            expected.o,
            verdict.lse,
            expected.lse
        );
        let pair = judge_between(&got, &sequence(&auto_o, &auto_lse, b), &expected, &expected);
        prop_assert!(
            pair.pass,
            "{:?} {} vs auto, sequence {}: O {}, lse {}",
            drawn,
            strategy,
            b,
            pair.o,
            pair.lse
        );
        let x32 = narrow(&inputs);
        let (q, k, v) = (x32.q.view(), x32.k.view(), x32.v.view());
        let cpu = if stats.plan.strategy.is_pp() {
            flash_decoding_pp::forward(q, k, v, &pp_opts)
        } else {
            flash_decoding::forward(q, k, v, &fd_opts)
        }
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        cpu_fallbacks += cpu.stats.fallback_rows.unwrap_or(0);
        let cpu_expected =
            Expected::from_oracle(&oracle, &x32).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let pair = judge_between(&got, &cpu, &expected, &cpu_expected);
        prop_assert!(
            pair.pass,
            "{:?} {}, sequence {} vs the CPU rung: O {} (tol {}), lse {} (tol {})",
            drawn,
            strategy,
            b,
            pair.o,
            expected.o.plus(cpu_expected.o),
            pair.lse,
            expected.lse.plus(cpu_expected.lse)
        );
    }
    if stats.plan.strategy.is_pp() {
        let fates = row_fates(case, &x, 0.0, (lo, hi));
        assert_fallback_count(&format!("{drawn:?} {strategy}"), stats.fallback_rows, &fates);
        assert_fallback_count(
            &format!("{drawn:?} {strategy}, CPU rung"),
            Some(cpu_fallbacks),
            &fates,
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(48)))]

    #[test]
    fn gpu_decode_drawn_strategies_match_the_oracle_auto_and_the_cpu_rungs(
        drawn in drawn(),
        strategy in prop::sample::select(DecodeStrategy::ALL.to_vec()),
    ) {
        check_drawn_strategy(&drawn, strategy)?;
    }

    #[test]
    fn gpu_decode_drawn_fallback_rows_are_flash_decodings(
        drawn in drawn(),
        phi in prop::sample::select(vec![-100.0f32, 100.0]),
    ) {
        check_drawn_fallbacks(&drawn, phi)?;
    }
}

/// FlashDecoding++'s options are checked for every call: `φ` finite, a window of finite
/// `lo < hi ≤ ln(MAX)`; a split count of 0 is an error whatever the strategy.
#[test]
fn gpu_decode_pp_bad_options_are_errors() {
    let Some(gpu) = gpu() else { return };
    let t = |shape: &[usize]| {
        gpu.upload(&pseudo_random(3, shape.iter().product()), shape, DType::F16).expect("upload")
    };
    let (q, kv) = (t(&[1, 4, 1, 64]), t(&[1, 4, 40, 64]));
    let cache = KvCache { k: &kv, v: &kv, lengths: &[40] };
    for strategy in DecodeStrategy::ALL {
        let base = DecodeOptions { strategy, ..DecodeOptions::default() };
        assert!(decode::forward(gpu, &q, cache, &base).is_ok(), "{strategy}");
        for bad in [
            DecodeOptions { phi: f32::NAN, ..base.clone() },
            DecodeOptions { phi: f32::INFINITY, ..base.clone() },
            DecodeOptions { safe_range: Some((1.0, -1.0)), ..base.clone() },
            DecodeOptions { safe_range: Some((-1.0, f32::NAN)), ..base.clone() },
            DecodeOptions { safe_range: Some((-1.0, 12.0)), ..base.clone() }, // past ln(65504) = 11.09
            DecodeOptions { splits: Some(0), ..base.clone() },
            DecodeOptions { splits: Some(decode::MAX_SPLITS + 1), ..base.clone() },
        ] {
            let r = decode::forward(gpu, &q, cache, &bad);
            assert!(matches!(r, Err(KernelError::Config(_))), "{bad:?}: {r:?}");
        }
    }
}

/// The harness itself, without a GPU: the CPU FlashDecoding rung, run per sequence on the same
/// rounded inputs with the same split counts, passes the same oracle checks (so a GPU failure
/// points at the kernel, not at how the per-sequence problems and tolerances are built); and the
/// paged copy of a cache holds every key where its table says.
#[test]
fn the_harness_accepts_the_cpu_flash_decoding_rung() {
    for case in cases(DType::F16).into_iter().chain(cases(DType::BF16)) {
        let x = case.inputs();
        let (attention, _) = case.options();
        for (b, &len) in case.lengths.iter().enumerate() {
            if len == 0 {
                continue;
            }
            let expected = expected_for(&case, &x, b);
            for splits in [1, 3, 7, 64] {
                let opts = FlashDecodingOptions::new(attention.clone())
                    .with_splits(splits)
                    .expect("splits");
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

/// Inputs, `φ` and a safe window (`None`: the element type's).
type Scenario = (HostInputs, f64, Option<(f64, f64)>);

/// The FlashDecoding++ harness without a GPU: the CPU rung 7, run per sequence with the GPU's `φ`,
/// window and a fixed split count on every scenario of
/// [`gpu_decode_pp_fallback_rows_are_flash_decodings`], passes the oracle checks and falls back on
/// exactly the rows [`row_fates`] predicts (so the GPU tests' expected counts follow the CPU
/// rung's rule).
#[test]
fn the_harness_accepts_the_cpu_flash_decoding_pp_rung() {
    for case in cases(DType::F16).into_iter().chain(cases(DType::BF16)) {
        let x = case.inputs();
        let (attention, _) = case.options();
        let scenarios: [Scenario; 6] = [
            (case.inputs(), 0.0, None),
            (case.inputs(), 100.0, None),
            (case.inputs(), -100.0, None),
            (spiked(&case, &x, 60.0), 0.0, None),
            (spiked(&case, &x, 20.0), 0.0, None),
            (case.inputs(), 0.0, Some((-0.2, 0.2))),
        ];
        for (x, phi, range) in scenarios {
            let range = range.unwrap_or(window(case.dtype));
            let fates = row_fates(&case, &x, phi, range);
            let opts = FlashDecodingPpOptions {
                safe_range: Some(range),
                ..FlashDecodingPpOptions::new(attention.clone())
                    .with_phi(Phi::Given(phi))
                    .with_splits(3)
                    .expect("splits")
            };
            let mut fallbacks = 0;
            for (b, &len) in case.lengths.iter().enumerate() {
                if len == 0 {
                    continue;
                }
                let expected = expected_for(&case, &x, b);
                let out = flash_decoding_pp::forward(
                    x.q.slice(s![b..b + 1, .., .., ..]),
                    x.k.slice(s![b..b + 1, .., ..len, ..]),
                    x.v.slice(s![b..b + 1, .., ..len, ..]),
                    &opts,
                )
                .expect("cpu rung");
                fallbacks += out.stats.fallback_rows.expect("rung 7 counts its fallbacks");
                let verdict = expected.judge(&out);
                assert!(verdict.pass, "{case:?} b {b} φ {phi} window {range:?}: {verdict:?}");
            }
            let what = format!("{case:?} φ {phi} window {range:?}, CPU rung 7");
            assert_fallback_count(&what, Some(fallbacks), &fates);
            // The scenarios do what they say: far φ sends every row with a key down the fallback.
            if phi.abs() == 100.0 {
                assert!(fates.iter().all(|f| matches!(f, RowFate::NoKey | RowFate::FallsBack)));
            }
        }
    }
}

#[test]
fn paginate_puts_every_key_where_the_table_says() {
    let case = Case {
        heads_q: 4,
        heads_kv: 2,
        n_new: 1,
        d: 64,
        capacity: 70,
        lengths: vec![70, 33, 0],
        dtype: DType::F16,
        seed: 5,
    };
    let x = case.inputs();
    for page in [16, 64, 256] {
        let p = paginate(&case, &x, page);
        let max_pages = 70usize.div_ceil(page);
        assert_eq!((p.max_pages, p.shape), (max_pages, [3 * max_pages + 3, 2, page, 64]));
        let mut used = Vec::new();
        for (b, &len) in case.lengths.iter().enumerate() {
            let row = &p.entries[b * max_pages..(b + 1) * max_pages];
            for (i, &e) in row.iter().enumerate() {
                // Entries past the pages a length needs are −1.
                assert_eq!(e < 0, i >= len.div_ceil(page), "page {page} b {b} entry {i}");
            }
            for j in 0..len {
                let e = row[j / page] as usize;
                used.push(e);
                for h in 0..2 {
                    let at = ((e * 2 + h) * page + j % page) * 64;
                    let want = x.k.slice(s![b, h, j, ..]);
                    assert!(p.k[at..at + 64].iter().zip(want).all(|(a, b)| a == b));
                    let want = x.v.slice(s![b, h, j, ..]);
                    assert!(p.v[at..at + 64].iter().zip(want).all(|(a, b)| a == b));
                }
            }
        }
        // Sequences do not share pages, and the pages are scattered (not 0, 1, 2, …).
        used.sort_unstable();
        used.dedup();
        assert_eq!(used.len(), 70usize.div_ceil(page) + 33usize.div_ceil(page));
        assert!(
            p.entries[..max_pages.min(4)].windows(2).any(|w| w[1] != w[0] + 1) || max_pages == 1
        );
    }
}

/// `ladder verify` on a GPU has a `flash-decoding-gpu` and a `flash-decoding-pp-gpu` row for each
/// decoding-step case (at most 16 queries, the last tokens of a full cache), within tolerance of
/// the oracle and the CPU rung (FlashDecoding++'s note giving its fallback rows), and none for a
/// case of more queries.
#[test]
fn verify_has_a_flash_decoding_gpu_row() {
    use ladder_compare::RungConfig;
    use ladder_compare::verify::{self, VerifyCase};
    use ladder_reference::AttentionShape;
    let Some(gpu) = gpu() else { return };
    let shape = |b, hq, hkv, n_q, n_kv, d| AttentionShape::new(b, hq, hkv, n_q, n_kv, d).unwrap();
    let cases = [
        VerifyCase::decode(),
        VerifyCase { name: "speculative".into(), shape: shape(1, 16, 2, 4, 300, 128) },
        VerifyCase { name: "long".into(), shape: shape(1, 4, 2, 17, 40, 64) },
    ];
    let config = RungConfig { attention: AttentionOptions::causal(), ..RungConfig::default() };
    let rows = verify::gpu_rows(gpu, &cases, &config, 7, |_, _| {}).expect("gpu rows");
    for (label, cpu) in
        [("flash-decoding-gpu", "flash-decoding"), ("flash-decoding-pp-gpu", "flash-decoding-pp")]
    {
        let decode_rows: Vec<_> = rows.iter().filter(|r| r.label == label).collect();
        let names: Vec<&str> = decode_rows.iter().map(|r| r.case.as_str()).collect();
        assert_eq!(names, ["decode", "speculative"], "{label}");
        for row in decode_rows {
            assert!(row.pass && row.err_over_tol <= 1.0, "{row:?}");
            let (vs, _) = row.vs_previous.as_ref().expect("against the CPU rung");
            assert_eq!(vs, &format!("{cpu}, CPU"));
            assert!(row.note.contains("8 splits"), "{}", row.note);
            let pp = label == "flash-decoding-pp-gpu";
            assert_eq!(row.note.contains(" fallback rows"), pp, "{}", row.note);
        }
    }
}
