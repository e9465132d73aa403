//! Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax
//! with a value of zero.
//!
//! ```text
//! P_ij = exp(s_ij) / (Σ_k exp(s_ik) + exp(σ_h)),   lse_i = ln(Σ_j exp(s_ij) + exp(σ_h))
//! ```
//!
//! (`s` the scaled, modified scores.) The forward kernels fold the sink into each row's max and
//! sum once, in the epilogue (`fold_sink` in `cuda/softmax.cuh`), so a sink costs nothing per
//! score; a row that the mask empties keeps it (`O = 0`, `lse = σ_h`, never `−∞`). The backward
//! pass needs nothing new for dQ, dK, dV (the lse it is given includes the sink); the sinks' own
//! gradient, `∂L/∂σ_h = −Σ_i exp(σ_h − lse_i) · D_i` over every row of every batch entry, is one
//! small kernel beside the preparation (`fa2_backward_sinks`), which sums in a fixed order:
//! the same bits every run, deterministic mode or not.

use std::sync::Arc;

use crate::error::{KernelError, Result};

/// One logit per query head, in the units of the scaled scores (`scale · q·k`, after any score
/// modifier), copied to the device on first use and kept there while a clone lives. Cheap to clone.
#[derive(Clone, Debug, PartialEq)]
pub struct Sinks {
    values: Arc<[f32]>,
}

impl Sinks {
    /// The sinks `values[h]` for query head `h`; every one must be finite.
    pub fn new(values: Vec<f32>) -> Result<Sinks> {
        if let Some(bad) = values.iter().find(|s| !s.is_finite()) {
            return Err(KernelError::Shape(format!("every sink must be finite, got {bad}")));
        }
        Ok(Sinks { values: values.into() })
    }

    /// The logits, one per query head.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// One logit per query head of the problem.
    pub(crate) fn check(&self, heads_q: usize) -> Result<()> {
        if self.values.len() == heads_q {
            Ok(())
        } else {
            Err(KernelError::Shape(format!(
                "sinks: one logit per query head, {} given for {heads_q} heads",
                self.values.len()
            )))
        }
    }

    /// The logits as the host shares them (the key of their device copy, `Gpu::table`).
    pub(crate) fn shared(&self) -> &Arc<[f32]> {
        &self.values
    }
}
