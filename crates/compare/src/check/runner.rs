//! The property runner under every check: proptest's `TestRunner` with the case count and seed
//! taken from the check (or proptest's variables), panics turned into failures with their message
//! and location, and the failing case shrunk. [`Check::run`](super::Check::run) uses it with the
//! project's strategies; the notebooks' exercise checks call it directly with theirs.

use std::cell::{Cell, RefCell};
use std::fmt::Debug;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use proptest::strategy::Strategy;
use proptest::test_runner::{
    Config, RngAlgorithm, RngSeed, TestCaseError, TestError, TestRng, TestRunner,
};

/// Which random stream a property draws its cases from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Seed {
    /// `PROPTEST_RNG_SEED` when it is set, else a fresh random seed; either way the seed is
    /// reported, so that a failing run can be repeated.
    #[default]
    FromEnv,
    /// This seed: the stream `PROPTEST_RNG_SEED=seed` would give (ChaCha seeded from it).
    Fixed(u64),
    /// proptest's standard deterministic stream (`TestRng::deterministic_rng`): the same draws
    /// on every run and every machine, with no seed to report. The notebooks' exercises use it.
    Standard,
}

/// How many cases a property runs, from which stream, and where failures are remembered.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Runs {
    /// Cases to run; `None` takes `PROPTEST_CASES`, or proptest's default of 256.
    pub cases: Option<u32>,
    pub seed: Seed,
    /// Save every failing case's seed to `proptest-regressions/…` next to this source file (pass
    /// `file!()`) and replay the saved ones first, as `proptest!` tests do; `None` saves nothing.
    pub regressions: Option<&'static str>,
}

impl Runs {
    /// The number of cases these settings run.
    pub fn case_count(&self) -> u32 {
        self.cases.unwrap_or_else(|| Config::default().cases)
    }

    /// The seed these settings draw from (`None` for [`Seed::Standard`]); for [`Seed::FromEnv`]
    /// without `PROPTEST_RNG_SEED`, a fresh one on every call.
    fn resolve_seed(&self) -> Option<u64> {
        match self.seed {
            Seed::Fixed(seed) => Some(seed),
            Seed::Standard => None,
            Seed::FromEnv => match Config::default().rng_seed {
                RngSeed::Fixed(seed) => Some(seed),
                RngSeed::Random => Some(rand::random()),
            },
        }
    }
}

/// A property that held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ran {
    /// Cases run (persisted regressions not counted).
    pub cases: u32,
    /// The seed of the stream (`None` for [`Seed::Standard`]).
    pub seed: Option<u64>,
}

/// A property that did not hold.
#[derive(Debug, Clone, PartialEq)]
pub enum PropertyFailure<V> {
    /// A case failed; `value` is the smallest failing case shrinking found.
    Failed {
        /// Why the shrunk case fails (the test's error, or the panic with its location).
        reason: String,
        value: V,
        /// Which call of the test failed first, counting from 1 (replayed regressions included).
        found_at: u32,
        /// Simpler cases tried while shrinking.
        shrink_steps: u32,
        /// The seed of the stream (`None` for [`Seed::Standard`]).
        seed: Option<u64>,
    },
    /// proptest gave up (too many rejected cases) before running enough.
    GaveUp(String),
}

/// Runs `test` on cases drawn from `strategy` and shrinks the first failure.
///
/// A panic in `test` fails its case like an `Err`; the panic's message and location become the
/// reason and are not printed (shrinking replays a failing case many times). `PROPTEST_CASES`,
/// `PROPTEST_RNG_SEED`, `PROPTEST_MAX_SHRINK_ITERS` and proptest's other variables apply where
/// `runs` leaves them open; forking and timeouts (`PROPTEST_FORK`, `PROPTEST_TIMEOUT`) do not.
///
/// ```
/// use ladder_compare::check::{Runs, Seed, property};
/// use proptest::test_runner::TestCaseError;
///
/// let runs = Runs { cases: Some(64), seed: Seed::Fixed(1), regressions: None };
/// let ok = property(&runs, 0u32..1000, |n| {
///     if n * 2 >= n { Ok(()) } else { Err(TestCaseError::fail("doubling shrank")) }
/// });
/// assert_eq!(ok.unwrap().cases, 64);
///
/// // Fails from 500 on: shrinking finds exactly 500.
/// let failed = property(&runs, 0u32..1000, |n| {
///     if n < 500 { Ok(()) } else { Err(TestCaseError::fail(format!("{n} is too large"))) }
/// });
/// match failed {
///     Err(ladder_compare::check::PropertyFailure::Failed { value, reason, .. }) => {
///         assert_eq!((value, reason.as_str()), (500, "500 is too large"));
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
pub fn property<S>(
    runs: &Runs,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Result<Ran, PropertyFailure<S::Value>>
where
    S: Strategy,
    S::Value: Debug,
{
    let cases = runs.case_count();
    let seed = runs.resolve_seed();
    let mut config = Config { cases, ..Config::default() };
    config.fork = false;
    config.timeout = 0;
    match runs.regressions {
        Some(file) => config.source_file = Some(file),
        None => config.failure_persistence = None,
    }
    let mut runner = match seed {
        Some(seed) => TestRunner::new(Config { rng_seed: RngSeed::Fixed(seed), ..config }),
        None => TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha)),
    };
    let calls = Cell::new(0u32);
    let first_failure = Cell::new(None::<u32>);
    let outcome = capturing_panics(|| {
        runner.run(&strategy, |value| {
            calls.set(calls.get() + 1);
            let result =
                catch(|| test(value)).unwrap_or_else(|panic| Err(TestCaseError::fail(panic)));
            if result.is_err() && first_failure.get().is_none() {
                first_failure.set(Some(calls.get()));
            }
            result
        })
    });
    match outcome {
        Ok(()) => Ok(Ran { cases, seed }),
        Err(TestError::Fail(reason, value)) => {
            let found_at = first_failure.get().unwrap_or(calls.get());
            Err(PropertyFailure::Failed {
                reason: reason.message().to_string(),
                value,
                found_at,
                shrink_steps: calls.get() - found_at,
                seed,
            })
        }
        Err(TestError::Abort(reason)) => Err(PropertyFailure::GaveUp(reason.message().to_string())),
    }
}

thread_local! {
    /// Whether panics on this thread are being captured (see [`capturing_panics`]).
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
    /// The last captured panic's message and location.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's panics recorded for [`catch`] instead of printed. Other threads
/// keep the panic hook they had: a global hook that checks a thread-local flag is installed once
/// and hands every other panic to the hook it replaced.
pub(crate) fn capturing_panics<R>(f: impl FnOnce() -> R) -> R {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if CAPTURING.with(Cell::get) {
                let at = info.location().map(|l| format!(" at {l}")).unwrap_or_default();
                let message = payload_message(info.payload());
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("panicked{at}: {message}")));
            } else {
                previous(info);
            }
        }));
    });
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            CAPTURING.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CAPTURING.with(|c| c.replace(true)));
    f()
}

/// Calls `f`; a panic becomes `Err` with its message and, when captured on this thread, its
/// location.
pub(crate) fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    LAST_PANIC.with(|p| p.borrow_mut().take());
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        LAST_PANIC
            .with(|p| p.borrow_mut().take())
            .unwrap_or_else(|| format!("panicked: {}", payload_message(payload.as_ref())))
    })
}

fn payload_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_a_failure_with_its_message_and_location() {
        let runs = Runs { cases: Some(16), seed: Seed::Fixed(3), regressions: None };
        let Err(PropertyFailure::Failed { reason, value, found_at, .. }) =
            property(&runs, 0usize..100, |n| {
                let v = [0; 10];
                assert!(v[n.min(20)] == 0);
                Ok(())
            })
        else {
            panic!("an index out of bounds must fail the property");
        };
        assert_eq!(value, 10, "shrunk to the first index out of bounds");
        assert!(reason.starts_with("panicked at ") && reason.contains("runner.rs"), "{reason}");
        assert!(reason.contains("index out of bounds"), "{reason}");
        assert!(found_at >= 1);
    }

    #[test]
    fn the_same_seed_draws_the_same_cases_and_the_standard_stream_is_fixed() {
        let draws = |seed| {
            let seen = RefCell::new(Vec::new());
            let runs = Runs { cases: Some(20), seed, regressions: None };
            property(&runs, 0u64..u64::MAX, |n| {
                seen.borrow_mut().push(n);
                Ok(())
            })
            .unwrap();
            seen.into_inner()
        };
        assert_eq!(draws(Seed::Fixed(5)), draws(Seed::Fixed(5)));
        assert_ne!(draws(Seed::Fixed(5)), draws(Seed::Fixed(6)));
        assert_eq!(draws(Seed::Standard), draws(Seed::Standard));
        // `Seed::Fixed(5)` draws what a proptest runner with `PROPTEST_RNG_SEED=5` draws.
        let theirs = RefCell::new(Vec::new());
        let config = Config {
            cases: 20,
            rng_seed: RngSeed::Fixed(5),
            failure_persistence: None,
            ..Config::default()
        };
        TestRunner::new(config)
            .run(&(0u64..u64::MAX), |n| {
                theirs.borrow_mut().push(n);
                Ok(())
            })
            .unwrap();
        assert_eq!(draws(Seed::Fixed(5)), theirs.into_inner());
    }
}
