//! Judging one output against the float64 oracle (and, optionally, one of our rungs), with the
//! tolerance rule of `docs/conventions.md` for the problem's precision.

use std::fmt;

use ndarray::{Array, Dimension};

use super::{Output, Precision, Problem};
use crate::gpu_check;
use crate::metrics::{ErrorStats, Tolerance, Worst, error, worst_entry};
use crate::oracle::{Expected, ExpectedGradients, GradientOracle, Oracle};
use crate::rungs::Rung;

/// Why an implementation's result for one problem is not accepted.
#[derive(Debug, Clone, PartialEq)]
pub enum Mismatch {
    /// The implementation returned an error (its message).
    Error(String),
    /// The implementation panicked (the message and where).
    Panic(String),
    /// An output has the wrong shape.
    Shape { what: &'static str, got: Vec<usize>, want: Vec<usize> },
    /// An output is further from the reference than its tolerance allows.
    OutOfTolerance(Box<OutOfTolerance>),
    /// The rung compared against could not run on the problem.
    Rung(String),
    /// Something the tolerance rule does not cover (gradients in FP8).
    Unsupported(String),
}

/// An output further from the reference than its tolerance allows.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfTolerance {
    /// `"O"`, `"lse"`, `"dQ"`, `"dK"` or `"dV"`.
    pub what: &'static str,
    /// What it was compared with: `"the float64 oracle"`, or one of our rungs.
    pub against: String,
    pub error: ErrorStats,
    pub tolerance: Tolerance,
    /// The entry furthest from the reference.
    pub worst: Option<Worst>,
    /// A likely cause the check can see (an `f64` problem answered in `f32`, say).
    pub hint: Option<String>,
}

impl Mismatch {
    /// The entry furthest from the reference, for a tolerance failure.
    pub fn worst(&self) -> Option<&Worst> {
        match self {
            Mismatch::OutOfTolerance(miss) => miss.worst.as_ref(),
            _ => None,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Error(e) => write!(f, "the implementation returned an error: {e}"),
            Mismatch::Panic(p) => write!(f, "the implementation {p}"),
            Mismatch::Shape { what, got, want } => {
                write!(f, "{what} has shape {got:?}, expected {want:?}")
            }
            Mismatch::OutOfTolerance(miss) => {
                let OutOfTolerance { what, against, error, tolerance, worst, hint } = &**miss;
                write!(
                    f,
                    "{what} is out of tolerance against {against}: error {error} (rel L2 / max \
                     abs), tolerance {tolerance}"
                )?;
                if let Some(w) = worst {
                    write!(f, "\n  worst entry: {what}{w}")?;
                }
                if let Some(h) = hint {
                    write!(f, "\n  note: {h}")?;
                }
                Ok(())
            }
            Mismatch::Rung(e) => write!(f, "{e}"),
            Mismatch::Unsupported(e) => write!(f, "{e}"),
        }
    }
}

/// Judges `out` on `problem`: shapes, `O` and `lse` against the oracle, against `against` when
/// given, and the gradients when `out` has them. `Ok(true)` when gradients were checked too.
pub(crate) fn judge(
    problem: &Problem,
    out: &Output,
    against: Option<Rung>,
) -> Result<bool, Mismatch> {
    let shape = problem.shape();
    let q_dims = shape.q_dims().to_vec();
    let lse_dims = vec![shape.batch, shape.heads_q, shape.n_q];
    check_shape("O", out.o.shape(), &q_dims)?;
    check_shape("lse", out.lse.shape(), &lse_dims)?;

    let oracle_error = |e: String| Mismatch::Rung(format!("the check's own oracle failed: {e}"));
    let x = problem.inputs_f64();
    let oracle = Oracle::new(x, &problem.attention).map_err(|e| oracle_error(e.to_string()))?;
    let expected = expected(problem, &oracle).map_err(oracle_error)?;
    let reference = "the float64 oracle".to_string();
    let hint = precision_hint(problem, out);
    compare("O", &out.o, &expected.oracle.o, expected.o, &reference, hint.clone())?;
    compare("lse", &out.lse, &expected.oracle.lse, expected.lse, &reference, hint.clone())?;

    if let Some(rung) = against {
        let theirs = problem.run(rung).map_err(|e| {
            Mismatch::Rung(format!("{rung}, the rung compared against, failed: {e}"))
        })?;
        let theirs_expected = rung_expected(problem, &oracle).map_err(oracle_error)?;
        // Each is within its own tolerance of the oracle, so the two within the sum.
        let name = format!("{rung} ({})", problem.rung_element());
        compare("O", &out.o, &theirs.o, expected.o.plus(theirs_expected.o), &name, None)?;
        let lse_tol = expected.lse.plus(theirs_expected.lse);
        compare("lse", &out.lse, &theirs.lse, lse_tol, &name, None)?;
    }

    let Some(grads) = &out.grads else { return Ok(false) };
    if let Precision::Fp8(_) = problem.precision {
        return Err(Mismatch::Unsupported(
            "gradients were returned for an FP8 problem, and the ladder has no FP8 gradient \
             tolerance: return them only in other precisions"
                .into(),
        ));
    }
    let kv_dims = shape.kv_dims().to_vec();
    for (what, g, dims) in
        [("dQ", &grads[0], &q_dims), ("dK", &grads[1], &kv_dims), ("dV", &grads[2], &kv_dims)]
    {
        check_shape(what, g.shape(), dims)?;
    }
    let grad_oracle =
        GradientOracle::new(x, &problem.attention).map_err(|e| oracle_error(e.to_string()))?;
    let expected = expected_gradients(problem, &grad_oracle).map_err(oracle_error)?;
    let oracle = [&expected.oracle.dq, &expected.oracle.dk, &expected.oracle.dv];
    for (t, what) in ["dQ", "dK", "dV"].into_iter().enumerate() {
        compare(what, &grads[t], oracle[t], expected.tolerances[t], &reference, hint.clone())?;
    }
    Ok(true)
}

fn check_shape(what: &'static str, got: &[usize], want: &[usize]) -> Result<(), Mismatch> {
    if got == want {
        return Ok(());
    }
    Err(Mismatch::Shape { what, got: got.to_vec(), want: want.to_vec() })
}

fn compare<D: Dimension>(
    what: &'static str,
    got: &Array<f64, D>,
    want: &Array<f64, D>,
    tolerance: Tolerance,
    against: &str,
    hint: Option<String>,
) -> Result<(), Mismatch> {
    let err = error(got, want);
    if tolerance.admits(err) {
        return Ok(());
    }
    Err(Mismatch::OutOfTolerance(Box::new(OutOfTolerance {
        what,
        against: against.to_string(),
        error: err,
        tolerance,
        worst: worst_entry(got, want),
        hint,
    })))
}

/// An `f64` problem answered with `f32` numbers can only meet the `f64` floor by luck.
fn precision_hint(problem: &Problem, out: &Output) -> Option<String> {
    (problem.precision == Precision::F64 && out.element != "f64").then(|| {
        format!(
            "O came back as {} values, but an f64 problem is held to the f64 rounding floor \
             (~1e-13): compute in f64 when `precision` is F64, or leave F64 out of \
             `Check::precisions`",
            out.element
        )
    })
}

/// The tolerances of `O` and `lse` for the problem's precision (`docs/conventions.md`).
fn expected(problem: &Problem, oracle: &Oracle) -> Result<Expected, String> {
    let x = problem.inputs_f64();
    let text = |e: ladder_reference::LadderError| e.to_string();
    match problem.precision {
        Precision::F64 => Expected::from_oracle(oracle, x).map_err(text),
        Precision::F32 => Expected::from_oracle(oracle, &problem.inputs::<f32>()).map_err(text),
        Precision::F16 | Precision::Bf16 => {
            let dtype = problem.precision.kernel_dtype().ok_or("no 16-bit dtype")?;
            gpu_check::expected_forward(oracle, x, dtype).map_err(|e| e.to_string())
        }
        Precision::Fp8(fp8) => {
            Expected::fp8_from_oracle(oracle, &problem.inputs::<f32>(), &fp8).map_err(text)
        }
    }
}

/// The tolerances of the rung compared against, as [`Problem::run`] runs it.
fn rung_expected(problem: &Problem, oracle: &Oracle) -> Result<Expected, String> {
    let expected = match problem.precision {
        Precision::F64 => Expected::from_oracle(oracle, problem.inputs_f64()),
        _ => Expected::from_oracle(oracle, &problem.inputs::<f32>()),
    };
    expected.map_err(|e| e.to_string())
}

fn expected_gradients(
    problem: &Problem,
    oracle: &GradientOracle,
) -> Result<ExpectedGradients, String> {
    let x = problem.inputs_f64();
    let expected = match problem.precision {
        Precision::F64 => ExpectedGradients::from_oracle(oracle, x),
        Precision::F16 | Precision::Bf16 => {
            let dtype = problem.precision.kernel_dtype().ok_or("no 16-bit dtype")?;
            return gpu_check::expected_backward(oracle, x, dtype).map_err(|e| e.to_string());
        }
        _ => ExpectedGradients::from_oracle(oracle, &problem.inputs::<f32>()),
    };
    expected.map_err(|e| e.to_string())
}
