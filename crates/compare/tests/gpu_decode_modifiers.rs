//! FlashDecoding on the GPU with the modifiers serving needs (`DecodeOptions::window`,
//! `score_mod`, `sinks`): a sliding window, softcap, ALiBi, attention sinks, and all of them at
//! once, against the float64 oracle computed with the same modifiers (the CPU rungs' definition)
//! and the CPU FlashDecoding rung.
//!
//! Each sequence of a call is checked as in `gpu_decode.rs`: its new tokens against its first
//! `lengths[b]` keys, the tolerance from the naive algorithm with the kernel's roundings. Cache
//! entries past each length are NaN. Every split count (the heuristic, 1, 3 and more splits than
//! key tiles) must pass; a window narrows the keys the splits share out, so small windows, windows
//! wider than the sequence and one of 0 (each token sees only itself) are all drawn. A sequence
//! without keys has `O = 0` and `lse = −∞`, or `lse = σ_h` with sinks. The paged cache gives the
//! contiguous cache's bits. The automatic strategy picks FlashDecoding for a modified call, and a
//! forced FlashDecoding++ kernel, a window with keys after the diagonal, and sinks or slopes of
//! the wrong length are errors.

mod decoding;

use decoding::*;
use ladder_compare::gpu_check;
use ladder_compare::modifiers::{Cap, ModifierSpec, sink_values};
use ladder_kernels::decode::{self, DecodeOptions, Strategy as DecodeStrategy};
use ladder_kernels::{DType, KernelError, ScoreMod, Sinks};
use ladder_reference::{AttentionOptions, FlashDecodingOptions, flash_decoding};
use ndarray::s;

/// One set of modifiers: a window's left side, a score modifier, sinks.
#[derive(Clone, Copy, Debug)]
struct Mods {
    window: Option<usize>,
    score_mod: Option<ModifierSpec>,
    sinks: bool,
}

/// The modifiers every case runs with.
fn all_mods() -> Vec<Mods> {
    let none = Mods { window: None, score_mod: None, sinks: false };
    let cap = Cap::new(0.5).expect("a cap");
    vec![
        Mods { window: Some(0), ..none },
        Mods { window: Some(5), ..none },
        Mods { window: Some(100), ..none },
        Mods { score_mod: Some(ModifierSpec::Softcap(cap)), ..none },
        Mods { score_mod: Some(ModifierSpec::Alibi), ..none },
        Mods { sinks: true, ..none },
        Mods { window: Some(37), score_mod: Some(ModifierSpec::SoftcapAlibi(cap)), sinks: true },
    ]
}

impl Mods {
    /// The oracle's and the CPU rung's options: the case's (causal, its scale) with these.
    fn cpu(&self, case: &Case) -> AttentionOptions {
        let mut opts = case.options().0;
        if let Some(left) = self.window {
            opts = opts.with_window(ladder_reference::Window::left(left));
        }
        if let Some(spec) = self.score_mod {
            opts = spec.apply_cpu(opts, case.heads_q);
        }
        if self.sinks {
            opts = opts.with_sinks(sink_values(case.heads_q));
        }
        opts
    }

    /// The kernel's options with `splits`, the strategy left to the dispatcher.
    fn gpu(&self, case: &Case, splits: Option<usize>) -> DecodeOptions {
        let mut opts = case.decode_options(DecodeStrategy::Auto, splits, 0.0);
        if let Some(left) = self.window {
            opts = opts.with_window(ladder_kernels::Window::left(left));
        }
        if let Some(spec) = self.score_mod {
            opts = opts.with_score_mod(spec.gpu(case.heads_q).expect("a score modifier"));
        }
        if self.sinks {
            let sinks = sink_values(case.heads_q).into_iter().map(|s| s as f32).collect();
            opts = opts.with_sinks(Sinks::new(sinks).expect("finite"));
        }
        opts
    }
}

/// The cases: GQA with 4 tokens and a sequence of length 1, an empty sequence among ragged
/// lengths, two mma tiles of rows, a long cache, 128 rows in four row blocks, and d = 256.
fn modifier_cases(dtype: DType) -> Vec<Case> {
    let keep = [2, 3, 4, 8, 10, 13];
    cases(dtype).into_iter().filter(|c| keep.contains(&c.seed)).collect()
}

const SPLITS: [Option<usize>; 4] = [None, Some(1), Some(3), Some(64)];

fn check_modifiers(dtype: DType) {
    let Some(gpu) = gpu() else { return };
    for case in modifier_cases(dtype) {
        let x = case.inputs();
        let contiguous = upload(gpu, &case, &x, Layout::Contiguous);
        let paged = upload(gpu, &case, &x, Layout::Paged { page: 16, device_only: false });
        for mods in all_mods() {
            let attention = mods.cpu(&case);
            let what = |splits: Option<usize>| format!("{case:?} {mods:?} splits {splits:?}");
            for splits in SPLITS {
                let opts = mods.gpu(&case, splits);
                let (out, stats) = launch_with(gpu, &case, &contiguous, &opts);
                assert_eq!(stats.plan.strategy, DecodeStrategy::FlashDecoding, "{}", what(splits));
                let (o, lse) = to_host(&case, &out);
                // The paged cache: the same bits.
                let (paged_o, paged_lse) =
                    to_host(&case, &launch_with(gpu, &case, &paged, &opts).0);
                let bits =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    bits(o.as_slice().unwrap(), paged_o.as_slice().unwrap())
                        && bits(lse.as_slice().unwrap(), paged_lse.as_slice().unwrap()),
                    "{}: paged differs from contiguous",
                    what(splits)
                );
                for (b, &len) in case.lengths.iter().enumerate() {
                    if len == 0 {
                        let seq = sequence(&o, &lse, b);
                        assert!(
                            seq.o.iter().all(|&v| v == 0.0),
                            "{}, sequence {b}: O ≠ 0",
                            what(splits)
                        );
                        for h in 0..case.heads_q {
                            let want = if mods.sinks {
                                sink_values(case.heads_q)[h] as f32
                            } else {
                                f32::NEG_INFINITY
                            };
                            let got = seq.lse.slice(s![0, h, ..]);
                            assert!(
                                got.iter().all(|&l| l == want
                                    || (l - want).abs() <= 1e-6 * want.abs().max(1.0)),
                                "{}, sequence {b} head {h}: lse {got} for no key, expected {want}",
                                what(splits)
                            );
                        }
                        continue;
                    }
                    let (inputs, oracle) = problem_with(&case, &x, b, case.n_new, &attention);
                    let expected = gpu_check::expected_forward(&oracle, &inputs, case.dtype)
                        .expect("tolerance");
                    let verdict = expected.judge(&sequence(&o, &lse, b));
                    assert!(
                        verdict.pass,
                        "{}, sequence {b} (length {len}) vs oracle: O {} (tol {}), lse {} (tol {})",
                        what(splits),
                        verdict.o,
                        expected.o,
                        verdict.lse,
                        expected.lse
                    );
                    // The CPU FlashDecoding rung with the same modifiers and split count.
                    let used = stats.plan.splits;
                    let x32 = gpu_check::narrow(&inputs);
                    let rung = FlashDecodingOptions::new(attention.clone())
                        .with_splits(used)
                        .expect("splits ≥ 1");
                    let cpu =
                        flash_decoding::forward(x32.q.view(), x32.k.view(), x32.v.view(), &rung)
                            .expect("the CPU rung");
                    let pair = ladder_compare::oracle::judge_between(
                        &sequence(&o, &lse, b),
                        &cpu,
                        &expected,
                        &expected,
                    );
                    assert!(
                        pair.pass,
                        "{}, sequence {b}: GPU vs the CPU rung: O {}, lse {}",
                        what(splits),
                        pair.o,
                        pair.lse
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_decode_modifiers_fp16_match_the_oracle_and_the_cpu_rung() {
    check_modifiers(DType::F16);
}

#[test]
fn gpu_decode_modifiers_bf16_match_the_oracle_and_the_cpu_rung() {
    check_modifiers(DType::BF16);
}

/// What the kernels refuse: FlashDecoding++'s kernels with a modifier, a window with keys after
/// the diagonal, sinks or ALiBi slopes of the wrong length, a softcap that is not positive.
#[test]
fn gpu_decode_bad_modifiers_are_errors() {
    let case = modifier_cases(DType::F16).into_iter().next().expect("a case");
    let base = case.decode_options(DecodeStrategy::Auto, None, 0.0);
    let window = base.clone().with_window(ladder_kernels::Window::left(8));
    assert!(matches!(
        DecodeOptions::default().with_softcap(-1.0),
        Err(KernelError::Config(_) | KernelError::Shape(_))
    ));
    let wrong = [
        ("a forced GEMV", DecodeOptions { strategy: DecodeStrategy::Gemv, ..window.clone() }),
        (
            "a forced FlashDecoding++",
            DecodeOptions { strategy: DecodeStrategy::FlashDecodingPp, ..window },
        ),
        ("keys after the diagonal", base.clone().with_window(ladder_kernels::Window::new(4, 2))),
        ("sinks of one head", base.clone().with_sinks(Sinks::new(vec![0.5]).expect("finite"))),
        (
            "slopes of one head",
            base.clone().with_score_mod(ScoreMod::alibi(vec![0.5]).expect("finite")),
        ),
    ];
    let Some(gpu) = gpu() else { return };
    let x = case.inputs();
    let dev = upload(gpu, &case, &x, Layout::Contiguous);
    for (what, opts) in wrong {
        let r = decode::forward(gpu, &dev.q, dev.cache(&case.lengths), &opts);
        assert!(r.is_err(), "{what}: accepted");
        let message = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(!message.is_empty(), "{what}");
    }
    // A right side of 0 is the causal mask itself: accepted, and the call is unmodified.
    let causal = base.clone().with_window(ladder_kernels::Window::new(1 << 20, 0));
    let (a, _) = to_host(&case, &launch_with(gpu, &case, &dev, &causal).0);
    let (b, _) = to_host(&case, &launch_with(gpu, &case, &dev, &base).0);
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())),
        "a window wider than every sequence changed the output"
    );
}
