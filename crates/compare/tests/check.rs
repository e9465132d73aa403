//! Tests of the checker itself (`ladder_compare::check`): a checker that cannot fail is a defect.
//!
//! A user's implementation (one-pass online softmax, written the way a kernel author would) is
//! checked with each of a list of planted bugs — the rescale factor α left out, the causal mask
//! aligned top-left instead of bottom-right, the GQA head mapping off by one, `lse` off by
//! `ln 2`, NaN instead of zeros in rows that see no key — and each must fail, shrunk to a
//! problem of a few rows that shows the bug. Without the bugs it must pass, in every precision.

use std::f64::consts::LN_2;

use ladder_compare::check::{
    Check, CheckError, Counterexample, Found, Mismatch, Output, Precision, Problem,
};
use ladder_compare::low_precision::{self, Half};
use ladder_compare::{CaseSpace, Rung};
use ladder_reference::{Element, Fp8Options, LadderError, naive};
use ndarray::{Array3, Array4, s};

/// Bugs to plant in [`attention`].
#[derive(Debug, Clone, Copy, Default)]
struct Bugs {
    /// Leave out α = exp(m_old − m_new): the running sum and accumulator are not rescaled when
    /// the row's maximum grows.
    no_rescale: bool,
    /// Align the causal mask top-left (query i sees keys j ≤ i), as PyTorch's `is_causal` does.
    top_left_causal: bool,
    /// Read kv head `(h + 1) / group` instead of `h / group`.
    gqa_off_by_one: bool,
    /// Return `lse + ln 2`.
    lse_off_by_ln2: bool,
    /// Divide by the row sum even when it is 0 (a row that sees no key): `O = 0/0 = NaN`.
    nan_in_empty_rows: bool,
}

/// Attention by the online softmax, one query row at a time, computing in `T`.
fn attention<T: Element>(x: &Problem, bugs: Bugs) -> Output {
    let i = x.inputs::<T>();
    let s = x.shape();
    let scale = T::of(x.scale());
    let group = s.heads_q / s.heads_kv;
    let mut o = Array4::<T>::zeros(s.q_dims());
    let mut lse = Array3::<T>::zeros((s.batch, s.heads_q, s.n_q));
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            let kv =
                if bugs.gqa_off_by_one { ((h + 1) / group).min(s.heads_kv - 1) } else { h / group };
            for r in 0..s.n_q {
                let end = match (x.causal(), bugs.top_left_causal) {
                    (false, _) => s.n_kv,
                    (true, true) => (r + 1).min(s.n_kv),
                    (true, false) => (r + 1 + s.n_kv).saturating_sub(s.n_q).min(s.n_kv),
                };
                let (mut m, mut l) = (T::neg_infinity(), T::zero());
                let mut acc = vec![T::zero(); s.d];
                for j in 0..end {
                    let q = i.q.slice(s![b, h, r, ..]);
                    let score = scale * q.dot(&i.k.slice(s![b, kv, j, ..]));
                    let m_new = m.max(score);
                    let alpha = if bugs.no_rescale { T::one() } else { (m - m_new).exp() };
                    let p = (score - m_new).exp();
                    l = l * alpha + p;
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = *a * alpha + p * i.v[[b, kv, j, c]];
                    }
                    m = m_new;
                }
                if l > T::zero() || bugs.nan_in_empty_rows {
                    for (c, a) in acc.iter().enumerate() {
                        o[[b, h, r, c]] = *a / l;
                    }
                    lse[[b, h, r]] = m + l.ln();
                } else {
                    lse[[b, h, r]] = T::neg_infinity();
                }
                if bugs.lse_off_by_ln2 {
                    lse[[b, h, r]] = lse[[b, h, r]] + T::of(LN_2);
                }
            }
        }
    }
    Output::new(o, lse)
}

/// [`attention`] in the problem's precision (`f64` for `F64`, `f32` otherwise).
fn mine(bugs: Bugs) -> impl Fn(&Problem) -> Result<Output, LadderError> {
    move |x| match x.precision {
        Precision::F64 => Ok(attention::<f64>(x, bugs)),
        _ => Ok(attention::<f32>(x, bugs)),
    }
}

/// Runs `check` on `bugs`, which must fail; returns the counterexample.
fn caught(check: &Check, bugs: Bugs) -> Counterexample {
    match check.run(mine(bugs)) {
        Err(CheckError::Failed(c)) => {
            eprintln!("{c}");
            *c
        }
        other => panic!("{bugs:?} was not caught: {other:?}"),
    }
}

/// The shrunk problem is a few rows: one batch, one or two heads, at most two rows and two keys.
fn assert_small(c: &Counterexample) {
    let s = c.case.shape;
    assert!(
        s.batch == 1 && s.heads_q <= 2 && s.n_q <= 2 && s.n_kv <= 2 && s.d <= 2,
        "not shrunk to a few rows: {c}"
    );
    assert!(matches!(c.found, Found::Drawn { shrink_steps, .. } if shrink_steps > 0), "{c}");
}

fn out_of_tolerance(c: &Counterexample) -> (&'static str, f64, f64) {
    match &c.mismatch {
        Mismatch::OutOfTolerance(miss) => {
            let w = miss.worst.as_ref().expect("a worst entry");
            (miss.what, w.got, w.want)
        }
        other => panic!("expected an out-of-tolerance failure with a worst entry, got {other}"),
    }
}

const SEEDS: [u64; 3] = [1, 2, 3];

#[test]
fn the_bug_free_implementation_passes_in_f32_and_f64() {
    let passed = Check::new("online softmax").cases(256).seed(11).run(mine(Bugs::default()));
    let passed = passed.unwrap();
    assert_eq!((passed.cases, passed.runs, passed.gradients), (256, 512, 0));
    assert!(passed.to_string().starts_with("pass: online softmax: O and lse within tolerance"));
}

#[test]
fn catches_a_missing_rescale() {
    for seed in SEEDS {
        let c =
            caught(&Check::new("no α").seed(seed), Bugs { no_rescale: true, ..Bugs::default() });
        assert_small(&c);
        // Only a row whose maximum grows needs α: two keys at least.
        assert!(c.case.shape.n_kv == 2, "{c}");
        assert_eq!(out_of_tolerance(&c).0, "O", "{c}");
    }
}

#[test]
fn catches_a_causal_mask_aligned_top_left() {
    for seed in SEEDS {
        let c = caught(
            &Check::new("top-left causal").seed(seed),
            Bugs { top_left_causal: true, ..Bugs::default() },
        );
        assert_small(&c);
        // The alignments differ only on causal problems with n_q ≠ n_kv.
        assert!(c.case.causal && c.case.shape.n_q != c.case.shape.n_kv, "{c}");
    }
    // Restricted to square problems, the two alignments agree: the bug is invisible there.
    let square = Check::new("top-left causal, square").lengths(7..=7, 7..=7).seed(4);
    square.run(mine(Bugs { top_left_causal: true, ..Bugs::default() })).unwrap();
}

#[test]
fn catches_a_gqa_head_mapping_off_by_one() {
    for seed in SEEDS {
        let c = caught(
            &Check::new("GQA off by one").seed(seed),
            Bugs { gqa_off_by_one: true, ..Bugs::default() },
        );
        assert_small(&c);
        assert!(c.case.shape.heads_kv == 2, "{c}");
        assert_eq!(out_of_tolerance(&c).0, "O", "{c}");
    }
}

#[test]
fn catches_lse_off_by_ln_2() {
    for seed in SEEDS {
        let c = caught(
            &Check::new("lse + ln 2").seed(seed),
            Bugs { lse_off_by_ln2: true, ..Bugs::default() },
        );
        assert_small(&c);
        let (what, got, want) = out_of_tolerance(&c);
        assert_eq!(what, "lse", "O is right, lse is not: {c}");
        assert!((got - want - LN_2).abs() < 1e-5, "{c}");
    }
}

#[test]
fn catches_nan_in_rows_that_see_no_key() {
    for seed in SEEDS {
        let c = caught(
            &Check::new("NaN in empty rows").seed(seed),
            Bugs { nan_in_empty_rows: true, ..Bugs::default() },
        );
        assert_small(&c);
        // Only causal problems with more queries than keys have rows that see nothing.
        assert!(c.case.causal && c.case.shape.n_q > c.case.shape.n_kv, "{c}");
        let (what, got, want) = out_of_tolerance(&c);
        assert!(what == "O" && got.is_nan() && want == 0.0, "{c}");
    }
}

#[test]
fn the_report_names_the_case_its_seed_and_the_worst_entry() {
    let check = Check::new("no α").seed(1).cases(64);
    let c = caught(&check, Bugs { no_rescale: true, ..Bugs::default() });
    let report = CheckError::Failed(Box::new(c.clone())).to_string();
    for part in [
        "FAIL: no α (f32): O is out of tolerance against the float64 oracle",
        "worst entry: O[0, 0, 0, 0] = ",
        "shrunk case: batch 1, heads 1 q / 1 kv, n_q 1, n_kv 2, d 1",
        "tensors' seed ",
        "of 64, shrunk in ",
        "Check::seed(1) or PROPTEST_RNG_SEED=1 repeats the run",
    ] {
        assert!(report.contains(part), "{part:?} missing from\n{report}");
    }
    // The same seed finds the same counterexample; `run_case` reproduces it alone.
    assert_eq!(caught(&check, Bugs { no_rescale: true, ..Bugs::default() }), c);
    let again = check.run_case(&c.case, mine(Bugs { no_rescale: true, ..Bugs::default() }));
    let again = again.unwrap_err();
    let again = again.counterexample().unwrap();
    assert_eq!((&again.mismatch, again.found), (&c.mismatch, Found::Given));
    check.run_case(&c.case, mine(Bugs::default())).unwrap();
}

#[test]
fn an_f32_answer_to_an_f64_problem_fails_with_a_hint() {
    let c = Check::new("f32 only")
        .seed(5)
        .run(|x| Ok::<_, LadderError>(attention::<f32>(x, Bugs::default())));
    let c = c.unwrap_err();
    let c = c.counterexample().unwrap();
    assert_eq!(c.precision, Precision::F64);
    assert!(c.to_string().contains("note: O came back as f32 values"), "{c}");
    // Restricted to f32, the same implementation passes.
    let f32_only = Check::new("f32 only").precisions([Precision::F32]).seed(5);
    f32_only.run(|x| Ok::<_, LadderError>(attention::<f32>(x, Bugs::default()))).unwrap();
}

#[test]
fn errors_panics_and_wrong_shapes_fail_their_case() {
    let check = Check::new("picky").precisions([Precision::F32]).seed(6);
    // An error from the implementation fails the case; shrinking finds the smallest that errs.
    let c = check.run(|x| {
        if x.shape().n_kv > 3 {
            return Err(format!("n_kv = {} is not supported", x.shape().n_kv));
        }
        Ok(attention::<f32>(x, Bugs::default()))
    });
    let c = c.unwrap_err();
    let c = c.counterexample().unwrap();
    assert_eq!(c.mismatch, Mismatch::Error("n_kv = 4 is not supported".into()));
    assert_eq!(c.case.shape.n_kv, 4);
    // A panic is caught, with its message and where it happened.
    let c = check.run(|x| {
        let keys = [0.0f32; 3];
        let _ = keys[x.shape().n_kv - 1];
        Ok::<_, LadderError>(attention::<f32>(x, Bugs::default()))
    });
    let c = c.unwrap_err();
    let c = c.counterexample().unwrap();
    match &c.mismatch {
        Mismatch::Panic(p) => {
            assert!(p.contains("index out of bounds") && p.contains("tests/check.rs"), "{p}")
        }
        other => panic!("{other}"),
    }
    assert_eq!(c.case.shape.n_kv, 4);
    // An O of the wrong shape is a failure that names both shapes.
    let c = check.run(|x| {
        let out = attention::<f32>(x, Bugs::default());
        Ok::<_, LadderError>(Output::new(
            out.o().slice(s![.., .., .., ..1]).to_owned(),
            out.lse().clone(),
        ))
    });
    let c = c.unwrap_err();
    let c = c.counterexample().unwrap();
    assert!(matches!(&c.mismatch, Mismatch::Shape { what: "O", .. }), "{c}");
    assert_eq!(c.case.shape.d, 2, "the smallest head dim that a 1-wide O gets wrong");
}

#[test]
fn settings_that_cannot_draw_or_check_anything_are_errors() {
    let ok = |x: &Problem| Ok::<_, LadderError>(attention::<f32>(x, Bugs::default()));
    for check in [
        Check::new("no dims").head_dims([]),
        Check::new("zero dim").head_dims([0, 4]),
        Check::new("no rows").lengths(0..=3, 1..=3),
        #[allow(clippy::reversed_empty_ranges)]
        Check::new("empty range").lengths(3..=2, 1..=3),
        Check::new("no precision").precisions([]),
        Check::new("no cases").cases(0),
        Check::new("no logits").space(CaseSpace { max_logit_std: 0.0, ..CaseSpace::cpu() }),
    ] {
        let err = check.run(ok).unwrap_err();
        assert!(matches!(err, CheckError::Settings(_)), "{}: {err}", check.name());
    }
}

#[test]
fn the_space_restricts_what_is_drawn() {
    let passed = Check::new("restricted")
        .head_dims([3, 5])
        .lengths(2..=4, 5..=6)
        .gqa(2..=2, 3..=3)
        .batch(1..=1)
        .causal(true)
        .cases(32)
        .seed(8)
        .run(|x| {
            let s = x.shape();
            let ok = [3, 5].contains(&s.d)
                && (2..=4).contains(&s.n_q)
                && (5..=6).contains(&s.n_kv)
                && (s.heads_kv, s.heads_q, s.batch) == (2, 6, 1)
                && x.causal();
            if !ok {
                return Err(format!("drawn outside the space: {:?}", x.case));
            }
            mine(Bugs::default())(x).map_err(|e| e.to_string())
        });
    assert_eq!(passed.unwrap().cases, 32);
}

#[test]
fn without_settings_the_proptest_variables_decide() {
    let passed = Check::new("defaults").precisions([Precision::F32]).run(mine(Bugs::default()));
    let passed = passed.unwrap();
    assert_eq!(passed.cases, proptest::test_runner::Config::default().cases);
    assert!(passed.seed.is_some(), "a seed is drawn and reported");
}

/// A 16-bit kernel, emulated: naive attention with `P` and `O` rounded to 16 bits (what a
/// tensor-core kernel does), returned as `half` values.
fn sixteen_bit(x: &Problem, rescale: bool) -> Result<Output, LadderError> {
    let half = match x.precision {
        Precision::F16 => Half::F16,
        Precision::Bf16 => Half::BF16,
        other => panic!("not a 16-bit precision: {other}"),
    };
    let i = x.inputs::<f64>();
    let out = low_precision::attention(i.q.view(), i.k.view(), i.v.view(), &x.attention, half)?;
    let mut o = out.o;
    if !rescale {
        // The missing-rescale bug, to 16-bit precision: O as if from the f32 kernel without α.
        o = attention::<f32>(x, Bugs { no_rescale: true, ..Bugs::default() }).o().clone();
    }
    Ok(match half {
        Half::F16 => Output::new(o.mapv(half::f16::from_f64), out.lse.mapv(|v| v as f32)),
        Half::BF16 => Output::new(o.mapv(half::bf16::from_f64), out.lse.mapv(|v| v as f32)),
    })
}

#[test]
fn sixteen_bit_results_are_held_to_the_sixteen_bit_naive_rung() {
    let check = Check::new("16-bit")
        .precisions([Precision::F16, Precision::Bf16])
        .moderate_logits()
        .seed(9);
    let passed = check.run(|x| sixteen_bit(x, true)).unwrap();
    assert_eq!(passed.precisions, [Precision::F16, Precision::Bf16]);
    // The inputs are 16-bit values, the scale an f32 one.
    check
        .run(|x| {
            let i = x.inputs::<f64>();
            let exact = i.q.iter().all(|&v| match x.precision {
                Precision::F16 => half::f16::from_f64(v).to_f64() == v,
                _ => half::bf16::from_f64(v).to_f64() == v,
            });
            if !exact || x.scale() as f32 as f64 != x.scale() {
                return Err(LadderError::ShapeMismatch("inputs not rounded".into()));
            }
            sixteen_bit(x, true)
        })
        .unwrap();
    // f32 answers are more precise than 16-bit ones: they pass the 16-bit rule too.
    check.run(mine(Bugs::default())).unwrap();
    let c = check.run(|x| sixteen_bit(x, false)).unwrap_err();
    let c = c.counterexample().unwrap();
    assert_small(c);
    assert_eq!(out_of_tolerance(c).0, "O");
}

#[test]
fn the_fp8_rung_passes_the_fp8_rule_and_a_wrong_scale_does_not() {
    let fp8 = Fp8Options { incoherent: Some(0), ..Fp8Options::default() };
    let check = Check::new("fa3-fp8")
        .space(CaseSpace {
            n_q: 32..=48,
            n_kv: 32..=64,
            head_dims: (16..=32).collect(),
            ..CaseSpace::cpu().moderate_logits()
        })
        .precisions([Precision::Fp8(fp8)])
        .cases(24)
        .seed(0x00f8_e4e3);
    check.clone().against(Rung::Fa2).run(|x| x.run(Rung::Fa3Fp8)).unwrap();
    // The rule's tolerance on these small problems is 9–13 % relative L2 (twice per-tensor FP8's
    // error), so the planted bug is V's scale off by a quarter (O × 1.25), twice the largest of
    // them: a wrong scale of that size must fail.
    let c = check
        .run(|x| {
            let out = x.run(Rung::Fa3Fp8)?;
            Ok::<_, LadderError>(Output::new(out.o() * 1.25, out.lse().clone()))
        })
        .unwrap_err();
    assert_eq!(out_of_tolerance(c.counterexample().unwrap()).0, "O");
}

/// Naive backward in `T`, with a planted bug: `dV` of a GQA group takes only its last query
/// head's contribution instead of the sum.
fn with_gradients<T: Element>(x: &Problem, sum_the_group: bool) -> Result<Output, LadderError> {
    let i = x.inputs::<T>();
    let (q, k, v, d_o) = (i.q.view(), i.k.view(), i.v.view(), i.d_o.view());
    let out = naive::attention(q, k, v, &x.attention)?;
    let mut g = naive::backward(q, k, v, d_o, &x.attention)?;
    if !sum_the_group {
        let s = x.shape();
        let group = s.heads_q / s.heads_kv;
        let last_heads = i.q.slice(s![.., group - 1..;group, .., ..]).to_owned();
        let one = x.attention.clone();
        let (k1, v1) = (k.to_owned(), v.to_owned());
        let d_o1 = i.d_o.slice(s![.., group - 1..;group, .., ..]).to_owned();
        g.dv = naive::backward(last_heads.view(), k1.view(), v1.view(), d_o1.view(), &one)?.dv;
    }
    Ok(Output::from(out).with_gradients(g.dq, g.dk, g.dv))
}

#[test]
fn gradients_are_checked_when_returned() {
    let check = Check::new("naive backward").cases(64).seed(10);
    let passed = check
        .run(|x| match x.precision {
            Precision::F64 => with_gradients::<f64>(x, true),
            _ => with_gradients::<f32>(x, true),
        })
        .unwrap();
    assert_eq!((passed.runs, passed.gradients), (128, 128), "every run checked its gradients");
    assert!(passed.to_string().ends_with("gradients too"), "{passed}");
    let c = check
        .run(|x| match x.precision {
            Precision::F64 => with_gradients::<f64>(x, false),
            _ => with_gradients::<f32>(x, false),
        })
        .unwrap_err();
    let c = c.counterexample().unwrap();
    assert_eq!(out_of_tolerance(c).0, "dV", "{c}");
    assert!(c.case.shape.heads_q / c.case.shape.heads_kv == 2, "a group of two shows it: {c}");
}

#[test]
fn our_rungs_pass_against_the_rung_before() {
    for rung in [Rung::OnlineSoftmax, Rung::Fa1, Rung::Fa2, Rung::FlashDecoding] {
        let previous = rung.previous().unwrap();
        let passed =
            Check::new(rung.name()).against(previous).cases(32).seed(12).run(|x| x.run(rung));
        assert!(passed.unwrap().to_string().contains(&format!("and of {previous}")));
    }
}

/// A GPU kernel under the check: `ladder-kernels`' FA2 forward in fp16 and bf16, on the head
/// dims it supports, against the oracle and the CPU FA2. Skipped without a GPU; fails under
/// `LADDER_REQUIRE_GPU=1`.
#[test]
fn gpu_fa2_passes_the_check() {
    use ladder_compare::GpuRung;
    use ladder_compare::gpu_check::{options, shared_gpu};
    use ladder_kernels::fa2;

    let Some(gpu) = shared_gpu("gpu_fa2_passes_the_check") else { return };
    let check = Check::new("ladder-kernels fa2")
        .head_dims(GpuRung::Fa2.head_dims().iter().copied())
        .lengths(1..=200, 1..=200)
        .moderate_logits()
        .precisions([Precision::F16, Precision::Bf16])
        .against(Rung::Fa2)
        .cases(24);
    let passed = check.run(|x| -> anyhow::Result<Output> {
        let dtype = x.precision.kernel_dtype().ok_or_else(|| anyhow::anyhow!("no dtype"))?;
        let i = x.inputs::<f32>();
        let upload =
            |a: &Array4<f32>| gpu.upload(&a.iter().copied().collect::<Vec<_>>(), a.shape(), dtype);
        let (q, k, v) = (upload(&i.q)?, upload(&i.k)?, upload(&i.v)?);
        let (_, opts) = options(&x.attention, x.shape().d);
        let out = fa2::forward(gpu, &q, &k, &v, &opts)?;
        Ok(Output::from_flat(x, &out.o.to_f32_vec()?, &out.lse.to_f32_vec()?)?)
    });
    println!("{}", passed.unwrap());
}

/// A `[batch, seq, heads, d]` kernel: it takes its inputs in that layout
/// (`Problem::inputs_in`), returns O in it, and says so (`Output::in_layout`); with the layout
/// said it passes, and a kernel that reads the layout as `[batch, heads, seq, d]` is caught.
#[test]
fn a_bshd_kernel_is_checked_in_its_own_layout() {
    use ladder_compare::check::Layout;
    // naive attention on [b, s, h, d] tensors: swap to [b, h, s, d] and back, as a kernel would
    // index them; `misread` takes the [b, s, h, d] buffers as if they were [b, h, s, d].
    let kernel = |misread: bool| {
        move |x: &Problem| {
            let i = x.inputs_in::<f64>(Layout::Bshd);
            let as_bhsd = |a: &Array4<f64>| {
                if misread {
                    let (b, s, h, d) = a.dim();
                    a.clone().into_shape_with_order((b, h, s, d)).unwrap()
                } else {
                    a.view().permuted_axes([0, 2, 1, 3]).to_owned()
                }
            };
            let out = naive::attention(
                as_bhsd(&i.q).view(),
                as_bhsd(&i.k).view(),
                as_bhsd(&i.v).view(),
                &x.attention,
            )?;
            let o_bshd = out.o.view().permuted_axes([0, 2, 1, 3]).to_owned();
            Ok::<_, LadderError>(Output::new(o_bshd, out.lse).in_layout(Layout::Bshd))
        }
    };
    let check = Check::new("a [b, s, h, d] kernel").precisions([Precision::F64]).cases(32).seed(5);
    let passed = check.run(kernel(false)).expect("the layout is said: it passes");
    assert_eq!(passed.cases, 32);
    let check =
        Check::new("a kernel that misreads [b, s, h, d]").precisions([Precision::F64]).cases(64);
    assert!(check.run(kernel(true)).is_err(), "reading the axes in the wrong order is caught");
}
