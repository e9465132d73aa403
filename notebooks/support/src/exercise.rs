//! The exercise checks: a property run over random cases, with proptest's shrinking.
//!
//! Each notebook's check cell calls [`property`] with one of the project's strategies (usually
//! [`ladder_compare::cases`]) and a closure that runs the learner's function on the case and
//! compares it with the reference rung, returning `Err` (or panicking) when they disagree.
//! On the first failure proptest shrinks the case to the smallest one that still fails, and that
//! is what the learner sees.

use std::fmt::Debug;
use std::panic;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use crate::Failure;

/// Runs `test` on `cases` values drawn from `strategy` (the same draws on every run).
///
/// Prints `pass: …` and returns `Ok(())`, or returns the shrunk counterexample and the reason as
/// a [`Failure`]. A panic in the learner's code (a `todo!()`, an index out of bounds) counts as
/// a failure of that case; its message is reported, not printed once per case.
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
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let mut runner = TestRunner::new_with_rng(config, rng);
    // Shrinking replays many failing cases: keep their panic messages out of the output.
    let hook = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let outcome = runner.run(&strategy, test);
    panic::set_hook(hook);
    match outcome {
        Ok(()) => {
            println!("pass: {name} agrees with the reference on {cases} random cases");
            Ok(())
        }
        Err(TestError::Fail(reason, value)) => Err(Failure(format!(
            "FAIL: {name}\n{reason}\n\nsmallest failing case proptest found (after shrinking):\n{value:#?}"
        ))),
        Err(TestError::Abort(reason)) => {
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
