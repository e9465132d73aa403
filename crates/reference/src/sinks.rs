//! Attention sinks: a learned logit per head that joins every row's softmax and carries no value.
//!
//! Xiao et al. (2024, "Efficient Streaming Language Models with Attention Sinks") observed that
//! softmax attention parks the probability a row does not want to spend on some key (often the
//! first); gpt-oss gives every head a learned logit `σ_h` for it instead, a key that every query
//! sees and whose value is zero:
//!
//! ```text
//! P_ij = exp(s_ij) / (Σ_k exp(s_ik) + exp(σ_h)),   O_i = Σ_j P_ij v_j,
//! lse_i = ln(Σ_j exp(s_ij) + exp(σ_h))
//! ```
//!
//! (`s` the scaled, modified scores). The rows' weights now sum to `1 − P_i,sink`, and a row that
//! a mask empties still has the sink: `O = 0` and `lse = σ_h`, never `−∞`. A rung adds the sink
//! once, where it normalises a row (`fold`): `m ← max(m, σ)`, `l ← l·e^(m_old − m) + e^(σ − m)`,
//! the accumulator rescaled like any other tile's. Since `lse` includes the sink, the backward
//! pass recomputes the right `P` from it unchanged; the sink's own gradient is
//!
//! ```text
//! ∂L/∂σ_h = Σ_i P_i,sink · (0 − D_i) = −Σ_i exp(σ_h − lse_i) · D_i,   D_i = dO_i · O_i
//! ```
//!
//! summed over the rows of every batch entry (`gradient`): the sink's value is zero, so its
//! `dP` is 0 and `dS = P ∘ (dP − D)` leaves `−P·D`.

use ndarray::{Array1, ArrayView3, ArrayViewMut1};

use crate::element::Element;
use crate::error::{Result, invalid};
use crate::tile::{exp_diff, nan_max};

/// Checks the sinks against the problem: one finite logit per query head.
pub(crate) fn check(sinks: &[f64], heads_q: usize) -> Result<()> {
    if sinks.len() != heads_q {
        return Err(invalid(
            "sinks",
            format!("one logit per query head: {} given for {heads_q} heads", sinks.len()),
        ));
    }
    if let Some(bad) = sinks.iter().find(|s| !s.is_finite()) {
        return Err(invalid("sinks", format!("every sink must be finite, got {bad}")));
    }
    Ok(())
}

/// Folds the sink `sink` into a row's running state `(acc, m, l)` (the accumulator
/// `Σ_j e^(s_j − m) v_j`, its max and sum): returns the new `(m, l)` and rescales `acc` to the
/// new max. A row with nothing accumulated (`l = 0`: it saw no key, whatever `m` its sum is
/// relative to, FlashDecoding++'s `φ` included) gets `m = σ`, `l = 1` and a zero accumulator; a
/// NaN row stays NaN.
pub(crate) fn fold<T: Element>(mut acc: ArrayViewMut1<T>, m: T, l: T, sink: T) -> (T, T) {
    // (Relative to a finite m far above σ, e^(σ − m) would underflow to an empty row.)
    let m = if l == T::zero() { T::neg_infinity() } else { m };
    let m_new = nan_max(m, sink);
    let alpha = exp_diff(m, m_new);
    if alpha != T::one() {
        acc.mapv_inplace(|x| x * alpha);
    }
    (m_new, alpha * l + (sink - m_new).exp())
}

/// [`fold`] for a row already normalised, `o = acc / l` (FA1 keeps its output so in HBM):
/// rescales `o` by `e^(m_old − m)·l_old / l` and returns the new `(m, l)`.
pub(crate) fn fold_normalised<T: Element>(mut o: ArrayViewMut1<T>, m: T, l: T, sink: T) -> (T, T) {
    let (m_new, l_new) = fold(o.view_mut(), m, l, sink);
    let factor = l / l_new;
    o.mapv_inplace(|x| x * factor);
    (m_new, l_new)
}

/// `∂L/∂σ_h = −Σ_{b,i} exp(σ_h − lse_bhi) · D_bhi` for each query head, from the forward's `lse`
/// (which includes the sinks) and `D = rowsum(dO ∘ O)`, both `[batch, heads_q, n_q]`.
pub(crate) fn gradient<T: Element>(
    sinks: &[f64],
    lse: ArrayView3<T>,
    delta: ArrayView3<T>,
) -> Array1<T> {
    Array1::from_shape_fn(sinks.len(), |h| {
        let sink = T::of(sinks[h]);
        let mut sum = T::zero();
        for b in 0..lse.dim().0 {
            for i in 0..lse.dim().2 {
                sum = sum + (sink - lse[[b, h, i]]).exp() * delta[[b, h, i]];
            }
        }
        -sum
    })
}
