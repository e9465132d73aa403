//! # ladder-notebook: the plumbing of the attention-ladder notebooks
//!
//! The notebooks keep the lesson in their own cells: the rung, the check against the rung before,
//! the plots. What is the same in every notebook lives here, where it can be read once:
//!
//! - [`exercise`]: runs a property over random cases drawn by the project's proptest strategies,
//!   prints `pass` or returns the shrunk counterexample as a cell error;
//! - [`live`]: runs a GPU rung live and checks it against the oracle, when there is a GPU;
//! - [`results`]: reads the GPU measurements committed under `docs/results/history/h200/` and charts them,
//!   or says plainly that none are committed yet;
//! - [`backward`]: notebook 10's exercise check (the learner's `D` and `dS` inside the FA2
//!   backward pass) and the H200 backward figures beside the Triton tutorial's;
//! - [`source`]: excerpts of the kernels and the CPU rungs, chosen by their section markers and
//!   names, for reading a kernel beside its rung;
//! - [`pipeline`]: the FA3 kernel's K/V pipeline simulated (mbarriers, parities, a producer,
//!   consumer warps and a copy engine interleaved at random), notebook 13's exercise check;
//! - [`block_program`]: a block-program emulator (program ids, masked tile loads and stores,
//!   bytes counted) and the check that holds a block program to the oracle and to FA2's memory
//!   model.
//!
//! [`Failure`] is the error every check returns: evcxr prints a cell's error with `{:?}`, so its
//! `Debug` writes the message as it is, line breaks and all.

use std::fmt;

pub mod backward;
pub mod block_program;
pub mod exercise;
pub mod live;
pub mod pipeline;
pub mod results;
pub mod source;

/// A check that did not pass. Returned with `?` from a notebook cell, it turns the cell red and
/// prints the message; `.ci/notebooks` fails on it.
pub struct Failure(pub String);

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Failure {}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure(message)
    }
}

/// `Ok(())` after printing `ok`, or the error as a [`Failure`]: the end of a "does this rung
/// agree with the one before?" cell.
pub fn agree(what: &str, result: Result<(), String>) -> Result<(), Failure> {
    match result {
        Ok(()) => {
            println!("✓ {what}");
            Ok(())
        }
        Err(why) => Err(Failure(format!("✗ {what}: DISAGREE\n{why}"))),
    }
}
