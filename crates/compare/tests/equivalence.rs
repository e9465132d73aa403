//! The equivalence suite: every rung against the rung before it and against the float64 oracle,
//! over random shapes and options (GQA, causal with n_q ≠ n_kv, lengths that are not multiples
//! of the blocks, blocks of 1, more splits than keys, logits up to the ±10⁴ range).
//!
//! Each rung is held to the oracle with `ladder_compare::check`, the API anyone can check their
//! own kernel with: every case runs in `f32` (held to twice the naive rung's `f32` error) and in
//! `f64` (where the same rule pins every rung to the oracle within ~10⁻¹³: the algorithm itself is
//! exact). A failure prints the shrunk case: its shape, options and seed reproduce it
//! (`Check::run_case`). The properties about statistics other than the answer (fallback rows,
//! work items) are plain proptest properties.

use ladder_compare::check::{Check, CheckError, Output, Precision, Problem};
use ladder_compare::oracle::{Expected, check};
use ladder_compare::{Case, CaseSpace, Rung, RungConfig, cases};
use ladder_reference::{
    Element, Fa2Options, FlashDecodingPpOptions, LadderError, Mask, Phi, fa2, flash_decoding,
    flash_decoding_pp,
};
use proptest::prelude::*;

const CASES: u32 = 512;

fn config(case: &Case) -> RungConfig {
    RungConfig {
        attention: case.attention(),
        tiles: case.tiles,
        splits: case.splits,
        ..RungConfig::default()
    }
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// The check every rung passes: `CASES` problems from `space`, each in `f32` and `f64`, against
/// the float64 oracle and the rung before; failures are saved next to this file and replayed.
fn suite(name: &str, space: CaseSpace) -> Check {
    Check::new(name).space(space).cases(CASES).regressions(file!())
}

/// `rung` on `space`, against the oracle and the rung before it.
fn ladder(rung: Rung, space: CaseSpace) -> Result<(), CheckError> {
    // Every CPU rung takes a sliding window, a score modifier and a mask modifier: a quarter of
    // the cases draw each.
    let check = suite(rung.name(), space.with_windows().with_score_mods().with_mask_mods());
    let check = match rung.previous() {
        Some(previous) => check.against(previous),
        None => check,
    };
    check.run(|x| x.run(rung))?;
    Ok(())
}

#[test]
fn rung0_naive_matches_the_oracle() -> Result<(), CheckError> {
    ladder(Rung::Naive, CaseSpace::cpu())
}

#[test]
fn rung1_online_softmax_matches_naive() -> Result<(), CheckError> {
    ladder(Rung::OnlineSoftmax, CaseSpace::cpu())
}

#[test]
fn rung2_fa1_matches_online_softmax() -> Result<(), CheckError> {
    ladder(Rung::Fa1, CaseSpace::cpu())
}

#[test]
fn rung3_fa2_matches_fa1() -> Result<(), CheckError> {
    ladder(Rung::Fa2, CaseSpace::cpu())
}

#[test]
fn rung4_fa3_matches_fa2() -> Result<(), CheckError> {
    ladder(Rung::Fa3, CaseSpace::cpu())
}

#[test]
fn rung5_flash_decoding_matches_fa3() -> Result<(), CheckError> {
    ladder(Rung::FlashDecoding, CaseSpace::cpu())
}

#[test]
fn rung5_flash_decoding_on_decode_shapes() -> Result<(), CheckError> {
    ladder(Rung::FlashDecoding, CaseSpace::decode())
}

#[test]
fn rung6_flash_decoding_pp_matches_flash_decoding() -> Result<(), CheckError> {
    ladder(Rung::FlashDecodingPp, CaseSpace::cpu())
}

#[test]
fn rung6_flash_decoding_pp_on_decode_shapes() -> Result<(), CheckError> {
    ladder(Rung::FlashDecodingPp, CaseSpace::decode())
}

/// The FP8 path against an FP8 tolerance: within 2× the relative error of the FA3 paper's
/// baseline (per-tensor FP8) on the same inputs, and against FA2 in `f32`. Shapes have at least
/// 32 × 16 outputs per head, enough for that statistic to mean something (a handful of e4m3
/// roundings is a coin toss), and logits are moderate: at ±10⁴ an e4m3 logit is off by hundreds
/// and no FP8 attention is meaningful. A fixed sample: the FP8 tolerance is a statistical
/// statement (twice the error of an independent rounding of the same numbers), so this test is a
/// reproducible measurement over 256 problems rather than a fresh draw on every run.
#[test]
fn rung4_fa3_fp8_within_fp8_tolerance() -> Result<(), CheckError> {
    let space = CaseSpace {
        n_q: 32..=64,
        n_kv: 32..=128,
        head_dims: (16..=64).collect(),
        ..CaseSpace::cpu().moderate_logits()
    };
    suite("fa3-fp8", space)
        .precisions([Precision::Fp8(RungConfig::default().fp8)])
        .cases(256)
        .seed(0x00f8_e4e3)
        .against(Rung::Fa2)
        .run(|x| x.run(Rung::Fa3Fp8))?;
    Ok(())
}

/// FA2's forward and backward pass in the problem's precision, with the gradients.
fn fa2_with_gradients(x: &Problem) -> Result<Output, LadderError> {
    fn run<T: Element>(x: &Problem) -> Result<Output, LadderError> {
        let i = x.inputs::<T>();
        let opts = Fa2Options { attention: x.attention.clone(), tiles: x.case.tiles };
        let (q, k, v, d_o) = (i.q.view(), i.k.view(), i.v.view(), i.d_o.view());
        let fwd = fa2::forward(q, k, v, &opts)?;
        let g = fa2::backward(q, k, v, fwd.o.view(), d_o, fwd.lse.view(), &opts)?;
        Ok(Output::from(fwd).with_gradients(g.dq, g.dk, g.dv))
    }
    match x.precision {
        Precision::F64 => run::<f64>(x),
        _ => run::<f32>(x),
    }
}

/// The FA2 backward pass against the oracle's gradients, within twice the naive backward pass's
/// error in the same precision.
#[test]
fn rung3_fa2_backward_matches_naive_backward() -> Result<(), CheckError> {
    let space = CaseSpace::cpu().with_score_mods().with_mask_mods();
    let passed = suite("fa2 backward", space).run(fa2_with_gradients)?;
    assert_eq!(passed.gradients, passed.runs, "every run checked its gradients");
    Ok(())
}

/// FA3 only reorders *when* each operation is issued: element by element it performs the same
/// floating-point operations as FA2, so the results are bit-identical.
#[test]
fn rung4_fa3_is_bitwise_fa2() -> Result<(), CheckError> {
    let space = CaseSpace::cpu().with_score_mods().with_mask_mods();
    let check = suite("fa3 (bit for bit fa2)", space).precisions([Precision::F32]);
    check.against(Rung::Fa2).run(|x| {
        let fa3 = x.run(Rung::Fa3).map_err(|e| e.to_string())?;
        let fa2 = x.run(Rung::Fa2).map_err(|e| e.to_string())?;
        let same = |(a, b): (&f64, &f64)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        if !fa3.o().iter().zip(fa2.o()).all(same) || !fa3.lse().iter().zip(fa2.lse()).all(same) {
            return Err("FA3 and FA2 differ in some bits".to_string());
        }
        Ok(fa3)
    })?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// A φ far from every score sends each row that sees a key down the fallback path, on the
    /// overflow side (φ ≪ scores) and on the underflow side (φ ≫ scores); the answer stays exact.
    #[test]
    fn rung6_fallback_rows_are_recomputed_exactly(case in cases(CaseSpace::decode()), high in any::<bool>()) {
        let inputs = case.inputs::<f64>();
        let cfg = config(&case);
        let expected = Expected::new(&inputs, &cfg.attention).map_err(fail)?;
        let phi = if high { 1e6 } else { -1e6 };
        let opts = FlashDecodingPpOptions { tiles: case.tiles, splits: case.splits, ..FlashDecodingPpOptions::new(cfg.attention) }
            .with_phi(Phi::Given(phi));
        let out = flash_decoding_pp::forward(inputs.q.view(), inputs.k.view(), inputs.v.view(), &opts).map_err(fail)?;
        let s = case.shape;
        let mask = Mask::new(case.causal, s.n_q, s.n_kv);
        let seeing = (0..s.n_q).filter(|&i| !mask.visible(i).is_empty()).count() * s.batch * s.heads_q;
        prop_assert_eq!(out.stats.fallback_rows, Some(seeing));
        check("flash-decoding-pp (all rows fall back)", &out, &expected, None).map_err(fail)?;
    }

    /// With moderate logits the estimated φ is close enough that no row falls back: the fast,
    /// rescale-free path is what the suite above exercised.
    #[test]
    fn rung6_estimated_phi_needs_no_fallback_on_moderate_logits(case in cases(CaseSpace::decode().moderate_logits())) {
        let inputs = case.inputs::<f32>();
        let cfg = config(&case);
        let out = Rung::FlashDecodingPp.forward(inputs.q.view(), inputs.k.view(), inputs.v.view(), &cfg).map_err(fail)?;
        prop_assert_eq!(out.stats.fallback_rows, Some(0));
    }

    /// FlashDecoding's parallelism: one work item per (batch, head, split, query block).
    #[test]
    fn rung5_work_items_grow_with_splits(case in cases(CaseSpace::decode())) {
        let inputs = case.inputs::<f32>();
        let cfg = config(&case);
        let fd = flash_decoding::forward(inputs.q.view(), inputs.k.view(), inputs.v.view(),
            &ladder_reference::FlashDecodingOptions { attention: cfg.attention, tiles: case.tiles, splits: case.splits }).map_err(fail)?;
        let s = case.shape;
        prop_assert_eq!(fd.stats.work_items, s.batch * s.heads_q * case.splits * s.n_q.div_ceil(case.tiles.br()));
    }
}

/// Logits in the thousands make every softmax row one-hot: the float64 oracle's gradients are
/// ~1e-161 and the f32 rung's are rounding noise ~1e-4. The relative error between them used to
/// overflow to infinity (squares of 1e-161 underflow); it is finite now and within the floor.
#[test]
fn fa2_backward_with_one_hot_rows() -> Result<(), CheckError> {
    let case = Case {
        shape: ladder_reference::AttentionShape::new(1, 1, 1, 3, 8, 2).unwrap(),
        causal: false,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std: 994.6665468482463,
        tiles: ladder_reference::TileSizes::new(1, 1).unwrap(),
        splits: 1,
        seed: 15351642243685541010,
    };
    let passed = Check::new("fa2 backward").run_case(&case, fa2_with_gradients)?;
    assert_eq!(passed.gradients, 2);
    Ok(())
}
