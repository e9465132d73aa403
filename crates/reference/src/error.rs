//! Errors: every bad input is a value, never a panic.

use thiserror::Error;

/// What went wrong with the inputs or options of a rung.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LadderError {
    /// A tensor has a dimension of size zero.
    #[error(
        "{tensor} has a zero-sized dimension: shape {shape:?} (every dimension must be at least 1)"
    )]
    EmptyDimension { tensor: &'static str, shape: Vec<usize> },
    /// Tensors that must agree do not.
    #[error("shape mismatch: {0}")]
    ShapeMismatch(String),
    /// Grouped-query attention needs `heads_q` to be a multiple of `heads_kv`.
    #[error("heads_q ({heads_q}) is not a multiple of heads_kv ({heads_kv})")]
    HeadsNotMultiple { heads_q: usize, heads_kv: usize },
    /// An option is out of its domain (a zero block size, a NaN scale...).
    #[error("invalid option `{name}`: {reason}")]
    InvalidOption { name: &'static str, reason: String },
}

/// `Result` with a [`LadderError`].
pub type Result<T, E = LadderError> = std::result::Result<T, E>;

pub(crate) fn invalid(name: &'static str, reason: impl Into<String>) -> LadderError {
    LadderError::InvalidOption { name, reason: reason.into() }
}
