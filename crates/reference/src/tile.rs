//! The pieces the blocked rungs are built from, written once.
//!
//! A blocked rung keeps, for a block of query rows, an unnormalised accumulator `acc`, the running
//! row max `m` and the running row sum `l` ([`OnlineRows`]). For each key tile it forms the scores
//! `S = scale · Q Kᵀ` ([`score_tile`]), turns them into `P = exp(S − m_new)` while updating `m` and
//! `l` ([`OnlineRows::softmax_step`]), rescales `acc` by `exp(m_old − m_new)` and adds `P V`
//! ([`add_pv`]). At the end `O = acc / l` and `lse = m + ln l` ([`normalise_row`]).
//!
//! Three details keep this exact on every input:
//! - the running max propagates NaN ([`nan_max`]), so a NaN score cannot be silently skipped;
//! - `exp(m_old − m_new)` is 0, not NaN, while a row has seen nothing (`m = −∞`) ([`exp_diff`]);
//! - on a partial tile (the causal diagonal, a window's edge, a mask modifier's) each row
//!   multiplies only the `V` rows it may see, so a NaN in a masked `V` row cannot leak through
//!   `0 · NaN`.

use std::ops::Range;

use ndarray::linalg::general_mat_mul;
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut1, ArrayViewMut2, s};

use crate::element::Element;

/// `max(a, b)`, but NaN if either is NaN (`f32::max` would drop the NaN).
pub(crate) fn nan_max<T: Element>(a: T, b: T) -> T {
    if a.is_nan() || b.is_nan() { T::nan() } else { a.max(b) }
}

/// `exp(a − b)`, or 0 when `a = −∞`: the factor that carries what was accumulated under the
/// old max `a` over to the new max `b` (nothing was accumulated while the max was `−∞`).
pub(crate) fn exp_diff<T: Element>(a: T, b: T) -> T {
    if a == T::neg_infinity() { T::zero() } else { (a - b).exp() }
}

/// The value subtracted before `exp`: the row max, or 0 while it is `−∞` so that masked
/// scores give `exp(−∞) = 0` instead of `exp(−∞ + ∞) = NaN`.
pub(crate) fn shift_of<T: Element>(m: T) -> T {
    if m == T::neg_infinity() { T::zero() } else { m }
}

/// The keys one row sees: runs of consecutive key columns, in order and disjoint (one run for a
/// band mask, several where a mask modifier hides keys inside the band, none for a row that sees
/// nothing).
pub(crate) type Runs = Vec<Range<usize>>;

/// The key columns each row of a partial tile sees, relative to the tile's first key, one
/// [`Runs`] per row ([`crate::mask_mod`]'s `classify`).
pub(crate) type RowSpans = Vec<Runs>;

/// `S = scale · Q Kᵀ` for one tile; on a partial tile, row `r` keeps the columns of `limits[r]`
/// and the rest become `−∞`.
pub(crate) fn score_tile<T: Element>(
    q: ArrayView2<T>,
    k: ArrayView2<T>,
    scale: T,
    limits: Option<&[Runs]>,
) -> Array2<T> {
    let mut s = Array2::zeros((q.nrows(), k.nrows()));
    general_mat_mul(scale, &q, &k.t(), T::zero(), &mut s);
    if let Some(limits) = limits {
        for (row, seen) in s.rows_mut().into_iter().zip(limits) {
            mask_row(row, seen);
        }
    }
    s
}

/// Sets the entries of `row` outside the runs `seen` to `−∞`.
pub(crate) fn mask_row<T: Element>(mut row: ArrayViewMut1<T>, seen: &[Range<usize>]) {
    let mut next = 0;
    for run in seen {
        row.slice_mut(s![next..run.start]).fill(T::neg_infinity());
        next = run.end;
    }
    row.slice_mut(s![next..]).fill(T::neg_infinity());
}

/// `acc += alpha · P V`; on a partial tile each row sums only over its visible keys.
pub(crate) fn add_pv<T: Element>(
    acc: &mut ArrayViewMut2<T>,
    alpha: T,
    p: ArrayView2<T>,
    v: ArrayView2<T>,
    limits: Option<&[Runs]>,
) {
    match limits {
        None => general_mat_mul(alpha, &p, &v, T::one(), acc),
        Some(limits) => {
            // A 1-row matrix product reads V row by row, which is faster than a strided gemv.
            for (r, runs) in limits.iter().enumerate() {
                for seen in runs.iter().filter(|run| !run.is_empty()) {
                    let pr = p.slice(s![r..r + 1, seen.clone()]);
                    let mut out = acc.slice_mut(s![r..r + 1, ..]);
                    let v = v.slice(s![seen.clone(), ..]);
                    general_mat_mul(alpha, &pr, &v, T::one(), &mut out);
                }
            }
        }
    }
}

/// `lse = m + ln l`, or `−∞` for a row with `l = 0`: it saw no key (or only `−∞` scores).
pub(crate) fn lse_of<T: Element>(m: T, l: T) -> T {
    if l == T::zero() { T::neg_infinity() } else { m + l.ln() }
}

/// Turns an accumulated row into the output row `acc / l` in place and returns its
/// `lse = m + ln l`, with the head's sink in the softmax first when it has one
/// ([`crate::sinks::fold`]). A row with `l = 0` saw no key (or only `−∞` scores) and no sink:
/// zeros and `−∞`.
pub(crate) fn normalise_row<T: Element>(
    mut acc: ArrayViewMut1<T>,
    m: T,
    l: T,
    sink: Option<T>,
) -> T {
    let (m, l) = match sink {
        Some(sink) => crate::sinks::fold(acc.view_mut(), m, l, sink),
        None => (m, l),
    };
    if l == T::zero() {
        acc.fill(T::zero());
    } else {
        let inv = l.recip();
        acc.mapv_inplace(|x| x * inv);
    }
    lse_of(m, l)
}

/// The running state of a block of query rows: the registers of an FA2 thread block.
pub(crate) struct OnlineRows<T> {
    /// Unnormalised output, `Σ_j exp(s_j − m) v_j`.
    pub acc: Array2<T>,
    /// Running row max.
    pub m: Array1<T>,
    /// Running row sum, `Σ_j exp(s_j − m)`.
    pub l: Array1<T>,
}

impl<T: Element> OnlineRows<T> {
    pub fn new(rows: usize, d: usize) -> Self {
        Self {
            acc: Array2::zeros((rows, d)),
            m: Array1::from_elem(rows, T::neg_infinity()),
            l: Array1::zeros(rows),
        }
    }

    /// The online-softmax step on one score tile: overwrites `S` with `P = exp(S − m_new)`,
    /// updates `m` and `l`, and returns `alpha = exp(m_old − m_new)`, the factor the
    /// accumulator must be rescaled by (the caller decides when: FA2 at once, FA3 later).
    pub fn softmax_step(&mut self, s: &mut Array2<T>) -> Array1<T> {
        let mut alpha = Array1::zeros(self.m.len());
        for (r, mut row) in s.rows_mut().into_iter().enumerate() {
            let m_old = self.m[r];
            let m_new = row.iter().fold(m_old, |m, &x| nan_max(m, x));
            let shift = shift_of(m_new);
            let mut sum = T::zero();
            row.mapv_inplace(|x| {
                let p = (x - shift).exp();
                sum = sum + p;
                p
            });
            alpha[r] = exp_diff(m_old, m_new);
            self.l[r] = alpha[r] * self.l[r] + sum;
            self.m[r] = m_new;
        }
        alpha
    }

    /// `acc ← diag(alpha) · acc`.
    pub fn rescale(&mut self, alpha: &Array1<T>) {
        for (mut row, &a) in self.acc.rows_mut().into_iter().zip(alpha) {
            if a != T::one() {
                row.mapv_inplace(|x| x * a);
            }
        }
    }

    /// FA2's whole step on one tile: softmax, rescale, accumulate `P V`.
    pub fn update(&mut self, mut s: Array2<T>, v: ArrayView2<T>, limits: Option<&[Runs]>) {
        let alpha = self.softmax_step(&mut s);
        self.rescale(&alpha);
        add_pv(&mut self.acc.view_mut(), T::one(), s.view(), v, limits);
    }

    /// Writes `O = acc / l` and `lse = m + ln l`, with the head's sink (if any) in the softmax.
    pub fn finish_into(
        mut self,
        mut o: ArrayViewMut2<T>,
        mut lse: ArrayViewMut1<T>,
        sink: Option<T>,
    ) {
        for r in 0..self.m.len() {
            lse[r] = normalise_row(self.acc.row_mut(r), self.m[r], self.l[r], sink);
        }
        o.assign(&self.acc);
    }
}

/// The ranges `0..size, size..2·size, …` covering `0..n`; the last may be short.
pub(crate) fn blocks(n: usize, size: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n).step_by(size).map(move |start| start..(start + size).min(n))
}
