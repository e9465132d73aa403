//! Notebook 10 (the FlashAttention-2 backward pass): the exercise's check, and the H200 figures
//! of the backward pass beside the Triton tutorial's.
//!
//! The exercise asks for the two steps of the backward pass that are not matrix products, `D`
//! and `dS`; [`check_steps`] runs them inside the rung's backward pass
//! ([`ladder_reference::fa2::backward_with`]) and holds the gradients to the float64 oracle and
//! to the textbook backward pass (`naive-bwd` in `ladder verify`), with the project's tolerance
//! rule. [`gpu_determinism`] reruns the GPU kernel in both of its modes, when there is a GPU;
//! [`h200_backward_table`] reads the committed same-run measurements.

use std::fmt::Write as _;

use ladder_compare::metrics::{error, error_between_in_units_of, worst_entry};
use ladder_compare::oracle::{ExpectedGradients, GradientOracle};
use ladder_compare::results::Direction;
use ladder_compare::{Case, GpuRung, gpu_check};
use ladder_kernels::{DType, Gpu};
use ladder_reference::fa2::{self, BackwardSteps};
use ladder_reference::{AttentionShape, Fa2Options, Gradients, TileSizes, naive};
use ndarray::{Array1, Array2, Array4, ArrayView1, ArrayView2, s};
use proptest::test_runner::TestCaseError;

use crate::Failure;
use crate::exercise::fail;
use crate::results::{self, Row};

/// The exercise's property for one drawn case: the learner's `steps` inside the FA2 backward
/// pass, in `f32`, on the case's inputs, tiles and mask.
///
/// Each of `dQ, dK, dV` must be within its tolerance of the float64 oracle (twice the error of
/// the naive backward pass in `f32`, plus the rounding floor: the rule every rung is held to),
/// and within the sum of both tolerances of that naive backward pass itself. On a failure the
/// message names the gradient, its worst entry, and which of the two steps to look at: it
/// compares the learner's `D` with `rowsum(dO ∘ O)` on the same case.
pub fn check_steps<D, S>(case: &Case, steps: &BackwardSteps<D, S>) -> Result<(), TestCaseError>
where
    D: Fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>) -> Array1<f32> + Sync,
    S: Fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>, ArrayView1<'_, f32>) -> Array2<f32> + Sync,
{
    let x = case.inputs::<f32>();
    let attention = case.attention();
    let opts = Fa2Options { attention: attention.clone(), tiles: case.tiles };
    let (q, k, v, d_o) = (x.q.view(), x.k.view(), x.v.view(), x.d_o.view());
    let forward = fa2::forward(q, k, v, &opts).map_err(fail)?;
    let (o, lse) = (forward.o.view(), forward.lse.view());
    let mine = fa2::backward_with(q, k, v, o, d_o, lse, &opts, steps).map_err(fail)?;
    let oracle = GradientOracle::new(&x, &attention).map_err(fail)?;
    let textbook = naive::backward(q, k, v, d_o, &attention).map_err(fail)?;
    let expected = ExpectedGradients::from_baseline(&oracle, &textbook);

    let names = ["dQ", "dK", "dV"];
    let grads = |g: &Gradients<f32>| [g.dq.clone(), g.dk.clone(), g.dv.clone()];
    let (mine, textbook) = (grads(&mine), grads(&textbook));
    let reference = [&expected.oracle.dq, &expected.oracle.dk, &expected.oracle.dv];
    for t in 0..3 {
        let tolerance = expected.tolerances[t];
        let err = error(&mine[t], reference[t]);
        if !tolerance.admits(err) {
            let worst = worst_entry(&mine[t], reference[t])
                .map(|w| format!("\n  worst entry: {}{w}", names[t]))
                .unwrap_or_default();
            return Err(TestCaseError::fail(format!(
                "{} is off the float64 oracle by {err} (rel L2 / max abs), tolerance \
                 {tolerance}{worst}\n  {}",
                names[t],
                which_step(case, steps),
            )));
        }
        let both = tolerance.plus(tolerance);
        let apart = error_between_in_units_of(&mine[t], &textbook[t], reference[t]);
        if !both.admits(apart) {
            return Err(TestCaseError::fail(format!(
                "{} is off naive-bwd (the textbook backward pass in f32) by {apart}, tolerance \
                 {both}\n  {}",
                names[t],
                which_step(case, steps),
            )));
        }
    }
    Ok(())
}

/// Where to look after a failure: whether the learner's `D` agrees with `rowsum(dO ∘ O)` on the
/// case's forward output (to `f32` rounding), so that a wrong `D` is told from a wrong `dS`.
fn which_step<D, S>(case: &Case, steps: &BackwardSteps<D, S>) -> String
where
    D: Fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>) -> Array1<f32>,
{
    let x = case.inputs::<f32>();
    let opts = Fa2Options { attention: case.attention(), tiles: case.tiles };
    let Ok(forward) = fa2::forward(x.q.view(), x.k.view(), x.v.view(), &opts) else {
        return String::new();
    };
    let sh = case.shape;
    for b in 0..sh.batch {
        for h in 0..sh.heads_q {
            let (o, d_o) = (forward.o.slice(s![b, h, .., ..]), x.d_o.slice(s![b, h, .., ..]));
            let (mine, ours) = ((steps.delta)(o, d_o), fa2::delta_rows(o, d_o));
            if mine.len() != ours.len() {
                return format!(
                    "look at your delta: it returned {} values for {} rows",
                    mine.len(),
                    ours.len()
                );
            }
            for i in 0..ours.len() {
                // Each D_i is a sum of d products: f32 rounding allows ~d·u of Σ|O·dO|.
                let size: f32 = o.row(i).iter().zip(d_o.row(i)).map(|(a, b)| (a * b).abs()).sum();
                let slack = 1e-5 * (sh.d as f32) * size + f32::MIN_POSITIVE;
                // Written so that a NaN counts as a disagreement.
                let close = (mine[i] - ours[i]).abs() <= slack;
                if !close {
                    return format!(
                        "look at your delta first: at [{b}, {h}, {i}] it gives {} where \
                         rowsum(dO ∘ O) is {}",
                        mine[i], ours[i]
                    );
                }
            }
        }
    }
    "your delta agrees with rowsum(dO ∘ O) on this case: look at your ds".into()
}

/// Runs the FA2 backward kernel on the GPU twice in each mode, `dQ` by atomics and
/// deterministic (`Options::deterministic()`: the separate `fa2_backward_dq` pass), and counts
/// the entries of `dQ, dK, dV` whose bits differ between the two runs: the atomic mode may differ
/// from one run to the next, the deterministic one must not (an error if it does). Without a GPU
/// it says so and returns `Ok`.
///
/// The problem is the one the performance notes measured the atomics on (batch 4, 16 query heads
/// over 4 kv heads, n = 2048, d = 128, causal, bf16); `live::gpu_live("fa2")` checks the
/// gradients themselves against the float64 oracle.
pub fn gpu_determinism() -> Result<(), Failure> {
    let Some(gpu) = crate::live::gpu_for("fa2-determinism", GpuRung::Fa2Backward, None) else {
        return Ok(());
    };
    let mut report = crate::live::Report::default();
    let checked = check_determinism(&gpu, &mut report);
    print!("{}", report.0);
    checked
}

/// [`gpu_determinism`]'s runs on `gpu`, into `report` (what `record-live` records).
pub fn check_determinism(gpu: &Gpu, report: &mut crate::live::Report) -> Result<(), Failure> {
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let shape = AttentionShape::new(4, 16, 4, 2048, 2048, 128).map_err(|e| fail(&e))?;
    let tiles = TileSizes::new(64, 128).map_err(|e| fail(&e))?;
    let case = Case {
        shape,
        causal: true,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std: 1.0,
        tiles,
        splits: 1,
        seed: 2048,
    };
    let dtype = DType::BF16;
    let x = gpu_check::device_inputs(&case, dtype);
    let (_, opts) = gpu_check::options(&case.attention(), shape.d);
    report.say(format_args!(
        "{} ({}), bf16, batch 4, 16 query heads over 4 kv heads, n 2048, d 128, causal",
        gpu.name(),
        gpu.arch()
    ));
    for (mode, name) in [("dQ by atomics", "fa2"), ("deterministic", "fa2-det")] {
        let Some(rung) = GpuRung::find(name, Direction::Bwd) else {
            return Err(Failure(format!("no GPU backward kernel {name:?}")));
        };
        if !rung.available_on(gpu) {
            report.say(format_args!("{mode}: not available on {}", gpu.arch()));
            continue;
        }
        // The first call compiles the kernels (untimed here); the next two are compared.
        gpu_check::backward(gpu, rung, &x, &opts, dtype).map_err(|e| fail(&e))?;
        let (a, ms_a) = gpu_check::backward(gpu, rung, &x, &opts, dtype).map_err(|e| fail(&e))?;
        let (b, ms_b) = gpu_check::backward(gpu, rung, &x, &opts, dtype).map_err(|e| fail(&e))?;
        let differ = |x: &Array4<f32>, y: &Array4<f32>| {
            x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits()).count()
        };
        let counts = [differ(&a.dq, &b.dq), differ(&a.dk, &b.dk), differ(&a.dv, &b.dv)];
        report.say(format_args!(
            "{mode:<14} {:.3} ms, {:.3} ms; entries whose bits differ between the two runs: dQ \
             {} of {}, dK {}, dV {}",
            ms_a.as_secs_f64() * 1e3,
            ms_b.as_secs_f64() * 1e3,
            counts[0],
            a.dq.len(),
            counts[1],
            counts[2]
        ));
        if name == "fa2-det" && counts.iter().any(|&c| c > 0) {
            return Err(Failure("the deterministic backward pass gave different bits".into()));
        }
    }
    Ok(())
}

/// The FA2 backward pass (dQ by atomics) beside the Triton tutorial's (dQ by a separate loop)
/// and PyTorch's SDPA back-ends, measured on the H200 in one run (`docs/results/history/h200`,
/// `bench.csv` and `peers.csv`): TFLOP/s per head dimension and length, causal (the only mask
/// the tutorial's backward pass supports) and not. A line saying so when nothing is committed.
pub fn h200_backward_table() -> String {
    let results = match results::load_from(&results::results_dir_named("h200")) {
        Ok(Some(r)) => r,
        Ok(None) => {
            return "No measurements in docs/results/history/h200 (run `ladder bench`).".into();
        }
        Err(e) => return format!("The committed results could not be read: {e}"),
    };
    let impls = ["fa2", "triton", "sdpa-flash", "sdpa-cudnn"];
    let bwd: Vec<&Row> = results.rows.iter().filter(|r| r.direction == "bwd").collect();
    let find = |imp: &str, r: &Row| {
        bwd.iter()
            .find(|x| {
                x.implementation == imp && x.causal == r.causal && x.d == r.d && x.n_q == r.n_q
            })
            .map(|x| x.tflops)
    };
    let mut cases: Vec<&Row> = bwd.iter().copied().filter(|r| r.implementation == "fa2").collect();
    cases.sort_by_key(|r| (!r.causal, r.d, r.n_q));
    let mut out = format!(
        "{}\nbackward, fp16, TFLOP/s (fa2: ours, dQ by atomics; triton: the tutorial, dQ by a \
         separate loop)\n",
        results.provenance()
    );
    let _ = writeln!(
        out,
        "{:<7} {:>4} {:>6} {:>8} {:>8} {:>11} {:>11} {:>13}",
        "mask", "d", "n", impls[0], impls[1], impls[2], impls[3], "fa2 / triton"
    );
    for r in cases {
        let cell = |imp: &str| find(imp, r).map_or("-".into(), |t| format!("{t:.1}"));
        let ratio = match (find("fa2", r), find("triton", r)) {
            (Some(a), Some(b)) => format!("{:.2}", a / b),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "{:<7} {:>4} {:>6} {:>8} {:>8} {:>11} {:>11} {:>13}",
            if r.causal { "causal" } else { "none" },
            r.d,
            r.n_q,
            cell("fa2"),
            cell("triton"),
            cell("sdpa-flash"),
            cell("sdpa-cudnn"),
            ratio
        );
    }
    out.push_str("(\"-\": not run; the tutorial's backward pass is causal only)");
    out
}

pub use crate::results::committed_charts;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exercise;
    use ladder_compare::{CaseSpace, cases};

    type Delta = fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>) -> Array1<f32>;
    type Ds = fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>, ArrayView1<'_, f32>) -> Array2<f32>;

    fn ours() -> BackwardSteps<Delta, Ds> {
        BackwardSteps::new(fa2::delta_rows::<f32>, fa2::ds_tile::<f32>)
    }

    /// The exercise's check, as the notebook runs it.
    fn run<D, S>(steps: &BackwardSteps<D, S>) -> Result<(), crate::Failure>
    where
        D: Fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>) -> Array1<f32> + Sync,
        S: Fn(ArrayView2<'_, f32>, ArrayView2<'_, f32>, ArrayView1<'_, f32>) -> Array2<f32> + Sync,
    {
        exercise::property("delta and ds", 64, cases(CaseSpace::cpu()), |case| {
            check_steps(&case, steps)
        })
    }

    #[test]
    fn our_steps_pass() {
        run(&ours()).unwrap();
    }

    #[test]
    fn a_forgotten_delta_fails_and_points_at_delta() {
        let steps = BackwardSteps::new(
            |o: ArrayView2<'_, f32>, _: ArrayView2<'_, f32>| Array1::zeros(o.nrows()),
            fa2::ds_tile::<f32>,
        );
        let why = run(&steps).unwrap_err().0;
        assert!(why.contains("FAIL: delta and ds"), "{why}");
        assert!(why.contains("look at your delta first"), "{why}");
        assert!(why.contains("smallest failing case"), "{why}");
    }

    #[test]
    fn a_delta_with_the_wrong_sign_fails() {
        let steps = BackwardSteps::new(
            |o: ArrayView2<'_, f32>, d_o: ArrayView2<'_, f32>| -fa2::delta_rows(o, d_o),
            fa2::ds_tile::<f32>,
        );
        let why = run(&steps).unwrap_err().0;
        assert!(why.contains("look at your delta first"), "{why}");
    }

    #[test]
    fn a_ds_without_the_shift_by_d_fails_and_points_at_ds() {
        let steps = BackwardSteps::new(
            fa2::delta_rows::<f32>,
            |p: ArrayView2<'_, f32>, dp: ArrayView2<'_, f32>, _: ArrayView1<'_, f32>| &p * &dp,
        );
        let why = run(&steps).unwrap_err().0;
        assert!(why.contains("is off the float64 oracle"), "{why}");
        assert!(why.contains("look at your ds"), "{why}");
    }

    #[test]
    fn a_ds_without_the_factor_p_fails() {
        let steps = BackwardSteps::new(
            fa2::delta_rows::<f32>,
            |_: ArrayView2<'_, f32>, dp: ArrayView2<'_, f32>, d: ArrayView1<'_, f32>| {
                &dp - &d.insert_axis(ndarray::Axis(1))
            },
        );
        assert!(run(&steps).unwrap_err().0.contains("look at your ds"));
    }

    /// A transposed tile is the wrong shape on most cases (an error of `backward_with`), and
    /// wrong values on the 1 × 1 case shrinking ends at.
    #[test]
    fn a_transposed_ds_fails() {
        let steps = BackwardSteps::new(
            fa2::delta_rows::<f32>,
            |p: ArrayView2<'_, f32>, _: ArrayView2<'_, f32>, _: ArrayView1<'_, f32>| {
                p.t().to_owned()
            },
        );
        let why = run(&steps).unwrap_err().0;
        assert!(why.contains("look at your ds"), "{why}");
        assert!(why.contains("n_q: 1,") && why.contains("n_kv: 1,"), "{why}");
    }

    #[test]
    fn a_todo_is_a_failure_not_a_crash() {
        let steps = BackwardSteps::new(
            |_: ArrayView2<'_, f32>, _: ArrayView2<'_, f32>| -> Array1<f32> { todo!("your code") },
            fa2::ds_tile::<f32>,
        );
        let why = run(&steps).unwrap_err().0;
        assert!(why.contains("your code"), "{why}");
    }

    /// Without a GPU it says so; with one, the deterministic mode must repeat its bits.
    #[test]
    fn the_determinism_rerun_passes_here() {
        gpu_determinism().unwrap();
    }

    #[test]
    fn the_committed_backward_figures_have_both_kernels() {
        let table = h200_backward_table();
        assert!(table.contains("Measured on NVIDIA H200"), "{table}");
        // A causal row has a Triton figure and a ratio; a row without the mask has neither.
        let causal = table.lines().find(|l| l.starts_with("causal") && l.contains(" 16384 "));
        let causal = causal.expect("causal n = 16384 row");
        assert_eq!(causal.split_whitespace().filter(|w| *w == "-").count(), 0, "{causal}");
        let full = table.lines().find(|l| l.starts_with("none") && l.contains(" 16384 "));
        assert_eq!(full.expect("unmasked row").split_whitespace().filter(|w| *w == "-").count(), 2);
        let charts = committed_charts("h200", &["bwd-fp16-d128-causal.svg", "missing.svg"]);
        assert_eq!(charts.0.len(), 1);
        assert!(charts.0[0].starts_with("<svg") && charts.0[0].contains("triton"));
    }
}
