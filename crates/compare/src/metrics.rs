//! Error metrics against the float64 oracle, and the tolerances derived from them.
//!
//! Every comparison is made against the `f64` oracle ([`ladder_reference::naive`] run in
//! `f64`): the relative L2 error `‖out − ref‖ / ‖ref‖` and the max absolute error.
//!
//! A rung passes when its error is no worse than about twice the error of the naive algorithm
//! run in the same precision (how FlashAttention's own tests set their tolerances; the rule is
//! written out in `docs/conventions.md`), plus a floor for problems where the naive algorithm happens to be exact (a
//! single key, say, or any problem in `f64`, where naive *is* the oracle) while a reordered
//! computation is not:
//!
//! ```text
//! tol = 2 · err(naive in T) + floor,    floor = 2 · u · (d + n + 1) · (1 + L) · M
//! ```
//!
//! with `u` the unit roundoff of `T`, `n` the length of the sums over keys (or rows, for
//! `dK, dV`), `L = scale · maxᵢ‖qᵢ‖ · maxⱼ‖kⱼ‖` a bound on every logit, and `M` the size of the
//! terms an entry is summed from (for `O`, `Σⱼ Pᵢⱼ |vⱼ|`): the first-order worst-case rounding
//! error of the computation ([`Floor::new`]). In `f32` it matters only for small problems; in
//! `f64` it is the whole tolerance, ~10⁻¹³ relative, which pins every rung to the algorithm:
//! each property runs in both precisions, so an algorithmic mistake cannot hide in `f32` noise.

use std::fmt;

use ladder_reference::Element;
use ndarray::{ArrayBase, ArrayView4, Data, Dimension, IntoDimension, Zip};

/// How far an output is from a reference.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ErrorStats {
    /// `‖out − ref‖₂ / ‖ref‖₂` (absolute when the reference is all zeros).
    pub rel_l2: f64,
    /// `max |out − ref|`.
    pub max_abs: f64,
}

impl ErrorStats {
    /// The larger of each metric.
    pub fn worst(self, other: Self) -> Self {
        Self { rel_l2: self.rel_l2.max(other.rel_l2), max_abs: self.max_abs.max(other.max_abs) }
    }
}

impl fmt::Display for ErrorStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2e} / {:.2e}", self.rel_l2, self.max_abs)
    }
}

/// The error of `out` against `reference`, element by element.
///
/// Non-finite entries must match exactly: where both are NaN, or both the same infinity (a row
/// with no key has `lse = −∞`), the entry counts as exact; any other mismatch makes both metrics
/// infinite.
pub fn error<A, B, D>(out: &ArrayBase<A, D>, reference: &ArrayBase<B, D>) -> ErrorStats
where
    A: Data,
    A::Elem: Element,
    B: Data<Elem = f64>,
    D: Dimension,
{
    assert_eq!(out.shape(), reference.shape(), "error(): shapes differ");
    let (mut diffs, mut refs) = (Vec::new(), Vec::new());
    let mut mismatch = false;
    Zip::from(out).and(reference).for_each(|&o, &r| {
        let o = o.as_f64();
        if o.is_finite() && r.is_finite() {
            diffs.push((o - r).abs());
            refs.push(r);
        } else if !(o.is_nan() && r.is_nan() || o == r) {
            mismatch = true;
        }
    });
    if mismatch {
        return ErrorStats { rel_l2: f64::INFINITY, max_abs: f64::INFINITY };
    }
    let max_abs = diffs.iter().fold(0.0f64, |m, &e| m.max(e));
    let (diff_norm, ref_norm) =
        (scaled_norm(diffs.iter().copied()), scaled_norm(refs.iter().copied()));
    let rel_l2 = if ref_norm > 0.0 { diff_norm / ref_norm } else { diff_norm };
    ErrorStats { rel_l2, max_abs }
}

/// One entry of an output next to its reference: where a comparison is worst.
#[derive(Debug, Clone, PartialEq)]
pub struct Worst {
    /// The entry's index: `[b, h, i, c]` for `O`, `[b, h, i]` for `lse`.
    pub index: Vec<usize>,
    /// The value compared.
    pub got: f64,
    /// The reference's value there.
    pub want: f64,
}

impl fmt::Display for Worst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let index: Vec<String> = self.index.iter().map(usize::to_string).collect();
        write!(
            f,
            "[{}] = {} where the reference has {}",
            index.join(", "),
            number(self.got),
            number(self.want)
        )
    }
}

/// A number for a report: six decimals in the usual range, scientific notation outside it.
pub fn number(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 { "+inf".into() } else { "-inf".into() }
    } else if x == 0.0 || (1e-3..1e5).contains(&x.abs()) {
        format!("{x:.6}")
    } else {
        format!("{x:.4e}")
    }
}

/// The entry of `out` furthest from `reference`, under the rule of [`error`]: a non-finite
/// mismatch (a NaN where the reference has a number, an infinity it does not have) comes first,
/// since it alone fails the comparison; otherwise the largest absolute difference. `None` when
/// every entry matches exactly.
pub fn worst_entry<A, B, D>(out: &ArrayBase<A, D>, reference: &ArrayBase<B, D>) -> Option<Worst>
where
    A: Data,
    A::Elem: Element,
    B: Data<Elem = f64>,
    D: Dimension,
{
    assert_eq!(out.shape(), reference.shape(), "worst_entry(): shapes differ");
    let mut worst: Option<(f64, Worst)> = None;
    for ((index, &o), &r) in out.indexed_iter().zip(reference.iter()) {
        let o: f64 = o.as_f64();
        let badness = if o.is_finite() && r.is_finite() {
            (o - r).abs()
        } else if o.is_nan() && r.is_nan() || o == r {
            0.0
        } else {
            f64::INFINITY
        };
        let beaten = worst.as_ref().is_none_or(|(b, _)| badness > *b);
        if badness > 0.0 && beaten {
            let index = index.into_dimension().slice().to_vec();
            worst = Some((badness, Worst { index, got: o, want: r }));
        }
    }
    worst.map(|(_, w)| w)
}

/// The error of `out` against `other`, both in the precision under test, relative to `other`'s
/// norm (used for "against the rung before").
pub fn error_between<A, D>(out: &ArrayBase<A, D>, other: &ArrayBase<A, D>) -> ErrorStats
where
    A: Data,
    A::Elem: Element,
    D: Dimension,
{
    error(out, &other.mapv(|x| x.as_f64()))
}

/// The error of `out` against `other`, relative to the norm of `oracle`: the unit of tolerances
/// measured against the oracle, so that two results each within its tolerance of the oracle are
/// within the sum of both of each other (the triangle inequality), even where the oracle is
/// (nearly) zero and `other` is rounding noise — e.g. `dQ` with a single key, which is 0 exactly.
pub fn error_between_in_units_of<A, D>(
    out: &ArrayBase<A, D>,
    other: &ArrayBase<A, D>,
    oracle: &ArrayBase<impl Data<Elem = f64>, D>,
) -> ErrorStats
where
    A: Data,
    A::Elem: Element,
    D: Dimension,
{
    let raw = error_between(out, other);
    if !raw.rel_l2.is_finite() {
        return raw;
    }
    let other_norm = l2_norm(&other.mapv(|x| x.as_f64()));
    let oracle_norm = l2_norm(oracle);
    let diff = if other_norm > 0.0 { raw.rel_l2 * other_norm } else { raw.rel_l2 };
    let rel_l2 = if oracle_norm > 0.0 { diff / oracle_norm } else { diff };
    ErrorStats { rel_l2, max_abs: raw.max_abs }
}

/// Bounds on [`ErrorStats`] that a result must stay within.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub rel_l2: f64,
    pub max_abs: f64,
}

impl Tolerance {
    /// `2 · baseline + floor`: the baseline is the naive algorithm's error in the same precision.
    pub fn from_baseline(baseline: ErrorStats, floor: Floor) -> Self {
        Self {
            rel_l2: 2.0 * baseline.rel_l2 + floor.rel_l2,
            max_abs: 2.0 * baseline.max_abs + floor.abs,
        }
    }

    /// Whether `err` is within the bounds (a NaN error never is).
    pub fn admits(&self, err: ErrorStats) -> bool {
        err.rel_l2 <= self.rel_l2 && err.max_abs <= self.max_abs
    }

    /// The tolerance for comparing two results that each satisfy one of these: their sum.
    pub fn plus(self, other: Self) -> Self {
        Self { rel_l2: self.rel_l2 + other.rel_l2, max_abs: self.max_abs + other.max_abs }
    }
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2e} / {:.2e}", self.rel_l2, self.max_abs)
    }
}

/// The rounding floor of a comparison (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Floor {
    pub abs: f64,
    pub rel_l2: f64,
}

impl Floor {
    /// The floor for a reference `reference` whose entries are sums of terms of absolute size
    /// `magnitudes` (entry by entry), computed through dot products and sums of `sum_len`
    /// terms in all (`d + n`), with logits bounded by `logit_bound`. To first order each entry's
    /// rounding error is at most `2 · u · (sum_len + 1) · (1 + L) · magnitude`: every logit
    /// carries up to `d · u · L` (a dot product of length `d`), `exp` passes it on, and each of
    /// up to `n` accumulation and rescaling steps adds `u · (1 + 2L)`. The absolute floor takes
    /// the largest magnitude, the relative one `‖magnitudes‖ / ‖reference‖`.
    pub fn new<S, R, D>(
        unit_roundoff: f64,
        sum_len: usize,
        logit_bound: f64,
        magnitudes: &ArrayBase<S, D>,
        reference: &ArrayBase<R, D>,
    ) -> Self
    where
        S: Data<Elem = f64>,
        R: Data<Elem = f64>,
        D: Dimension,
    {
        let c = 2.0 * unit_roundoff * (sum_len as f64 + 1.0) * (1.0 + logit_bound);
        let ref_norm = l2_norm(reference);
        let mag_norm = l2_norm(magnitudes);
        let rel_l2 = if ref_norm > 0.0 { c * mag_norm / ref_norm } else { c * mag_norm };
        Self { abs: c * max_abs(magnitudes), rel_l2 }
    }
}

/// `L = scale · maxᵢ‖qᵢ‖ · maxⱼ‖kⱼ‖`: a bound on every logit's magnitude (Cauchy–Schwarz).
pub fn logit_bound<T: Element>(q: ArrayView4<T>, k: ArrayView4<T>, scale: f64) -> f64 {
    let max_norm = |x: ArrayView4<T>| {
        x.rows()
            .into_iter()
            .map(|r| r.iter().map(|v| v.as_f64().powi(2)).sum::<f64>().sqrt())
            .fold(0.0, f64::max)
    };
    scale.abs() * max_norm(q) * max_norm(k)
}

/// `max |x|` over the finite entries.
pub fn max_abs<S: Data, D: Dimension>(x: &ArrayBase<S, D>) -> f64
where
    S::Elem: Element,
{
    x.iter().map(|v| v.as_f64().abs()).filter(|v| v.is_finite()).fold(0.0, f64::max)
}

/// `‖x‖₂` over the finite entries.
pub fn l2_norm<S: Data, D: Dimension>(x: &ArrayBase<S, D>) -> f64
where
    S::Elem: Element,
{
    scaled_norm(x.iter().map(|v| v.as_f64()).filter(|v| v.is_finite()))
}

/// `sqrt(Σ x²)` without underflow or overflow: the sum is taken of `(x / max|x|)²`. Gradients of
/// one-hot softmax rows are ~1e-160 in the float64 oracle, whose squares underflow to subnormals
/// (and a ratio of two such sums overflows); scaled, their norm is exact to rounding.
fn scaled_norm(values: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = values.clone().fold(0.0f64, |m, v| m.max(v.abs()));
    if max == 0.0 || !max.is_finite() {
        return max;
    }
    max * values.map(|v| (v / max).powi(2)).sum::<f64>().sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn errors_are_relative_and_non_finite_entries_must_match() {
        let r = array![3.0f64, 4.0, f64::NEG_INFINITY];
        let e = error(&array![3.0f32, 4.5, f32::NEG_INFINITY], &r);
        assert!((e.rel_l2 - 0.1).abs() < 1e-12 && (e.max_abs - 0.5).abs() < 1e-12);
        assert_eq!(error(&array![3.0f32, 4.0, 0.0], &r).rel_l2, f64::INFINITY);
        assert_eq!(error(&array![f64::NAN], &array![f64::NAN]).max_abs, 0.0);
        assert_eq!(error(&array![f64::NAN], &array![1.0]).max_abs, f64::INFINITY);
    }

    #[test]
    fn the_worst_entry_is_a_non_finite_mismatch_or_the_largest_difference() {
        let r = array![[1.0f64, 2.0], [0.0, f64::NEG_INFINITY]];
        let w = worst_entry(&array![[1.5f32, 2.0], [0.25, f32::NEG_INFINITY]], &r).unwrap();
        assert_eq!((w.index, w.got, w.want), (vec![0, 0], 1.5, 1.0));
        let w = worst_entry(&array![[1.5f32, 2.0], [f32::NAN, f32::NEG_INFINITY]], &r).unwrap();
        assert_eq!(w.index, vec![1, 0]);
        assert!(w.got.is_nan() && w.want == 0.0);
        assert_eq!(worst_entry(&r.clone(), &r), None);
        assert_eq!(w.to_string(), "[1, 0] = NaN where the reference has 0.000000");
        assert_eq!(number(-2.5e-7), "-2.5000e-7");
    }

    #[test]
    fn norms_neither_underflow_nor_overflow() {
        // The squares of 1e-161 underflow; their ratio to a 1e-4 difference would overflow.
        let tiny = array![1e-161, -2e-161];
        assert!((l2_norm(&tiny) - 5f64.sqrt() * 1e-161).abs() < 1e-175);
        let e = error(&array![1e-4, 0.0], &tiny);
        assert!(
            e.rel_l2.is_finite() && (e.rel_l2 / (1e-4 / (5f64.sqrt() * 1e-161)) - 1.0).abs() < 1e-9
        );
        assert_eq!(error(&array![3.0, 4.0], &array![0.0, 0.0]).rel_l2, 5.0);
    }

    #[test]
    fn tolerance_admits_twice_the_baseline_plus_the_floor() {
        let floor = Floor { abs: 1e-9, rel_l2: 1e-9 };
        let tol = Tolerance::from_baseline(ErrorStats { rel_l2: 1e-6, max_abs: 1e-5 }, floor);
        assert!(tol.admits(ErrorStats { rel_l2: 2e-6, max_abs: 2e-5 }));
        assert!(!tol.admits(ErrorStats { rel_l2: 2.1e-6, max_abs: 1e-5 }));
        assert!(!tol.admits(ErrorStats { rel_l2: f64::NAN, max_abs: 0.0 }));
    }
}
