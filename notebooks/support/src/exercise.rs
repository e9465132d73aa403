//! The exercise checks: a property run over random cases, with proptest's shrinking.
//!
//! Each notebook's check cell calls [`property`] with one of the project's strategies (usually
//! [`ladder_compare::cases`]) and a closure that runs the learner's function on the case and
//! compares it with the reference rung, returning `Err` (or panicking) when they disagree.
//! On the first failure proptest shrinks the case to the smallest one that still fails, and that
//! is what the learner sees.
//!
//! The runner is the one under `ladder_compare::check` (the API anyone checks their own kernel
//! with, and the equivalence suite uses): [`property`] only fixes its settings for the notebooks
//! (proptest's standard deterministic stream, so the committed outputs are the same draws on
//! every run) and prints the notebook's one-line verdict.

use std::fmt::Debug;

use ladder_compare::check::{self, PropertyFailure, Runs, Seed};
use proptest::strategy::Strategy;
use proptest::test_runner::TestCaseError;

use crate::Failure;

/// Runs `test` on `cases` values drawn from `strategy` (the same draws on every run).
///
/// Prints `pass: …` and returns `Ok(())`, or returns the shrunk counterexample and the reason as
/// a [`Failure`]. A panic in the learner's code (a `todo!()`, an index out of bounds) counts as
/// a failure of that case; its message and location are reported, not printed once per case.
pub fn property<S>(
    name: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Result<(), Failure>
where
    S: Strategy,
    S::Value: Debug,
{
    let runs = Runs { cases: Some(cases), seed: Seed::Standard, regressions: None };
    match check::property(&runs, strategy, test) {
        Ok(_) => {
            println!("pass: {name} agrees with the reference on {cases} random cases");
            Ok(())
        }
        Err(PropertyFailure::Failed { reason, value, .. }) => Err(Failure(format!(
            "FAIL: {name}\n{reason}\n\nsmallest failing case proptest found (after shrinking):\n{value:#?}"
        ))),
        Err(PropertyFailure::GaveUp(reason)) => {
            Err(Failure(format!("FAIL: {name}: the check gave up: {reason}")))
        }
    }
}

/// A failed case, with `why` (an error of the reference, say) as its message.
pub fn fail(why: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(why.to_string())
}

/// `Err` with `message` unless `ok`: the `prop_assert!` of a check written as a plain function.
pub fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if ok { Ok(()) } else { Err(TestCaseError::fail(message())) }
}
