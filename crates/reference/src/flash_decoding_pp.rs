//! Rung 7: FlashDecoding++, the asynchronous softmax with a unified max.
//!
//! FlashDecoding's chunks each track their own running max, and the combine must rescale every
//! partial by `exp(lse_s − lse)`. FlashDecoding++ (Hong et al. 2024, §3) removes that dependency:
//! every chunk subtracts the *same* value `φ`, fixed before the pass,
//!
//! ```text
//! phase 1, in parallel over (batch, head, split s), no rescaling anywhere:
//!     acc_s = Σ_{j∈s} exp(s_j − φ) v_j,    l_s = Σ_{j∈s} exp(s_j − φ),    max_s = max_{j∈s} s_j
//! phase 2, per row:
//!     O = Σ_s acc_s / Σ_s l_s,   lse = φ + ln Σ_s l_s
//! ```
//!
//! which is exact as long as `exp(s − φ)` neither overflows nor underflows. Each chunk also
//! reports its largest score (a reduction, not a dependency); a row whose largest score leaves
//! the safe range `φ + [lo, hi]` — or whose sums came out non-finite — is recomputed with the
//! FlashDecoding path (rung 6), so the result is always right and [`crate::RunStats`] reports
//! how many rows fell back.
//!
//! The default safe range is `±ln(MAX)/2` of the element type (±44 for `f32`): `e⁴⁴ ≈ 1.3·10¹⁹`
//! leaves room for sums over 2³² keys of values up to 10⁹ before overflow, and `e⁻⁴⁴` keeps the
//! largest term far from the subnormals. The paper fixes `φ` from offline statistics of the
//! model; here it is either given or estimated per head from the scores of a sample of keys
//! ([`Phi::Estimate`]).

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use ndarray::parallel::prelude::*;
use ndarray::{Array1, Array2, Array3, Array4, ArrayView4, Axis, s};

use crate::element::Element;
use crate::error::{Result, invalid};
use crate::flash_decoding::{check_splits, combine_row, partial, split_ranges};
use crate::options::{AttentionOptions, TileSizes};
use crate::output::{AttentionOutput, Counters};
use crate::problem::{Head, Problem};
use crate::tile::{add_pv, blocks, nan_max, normalise_row};

/// How the unified max `φ` is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Phi {
    /// The same `φ` for every head (the paper's static value).
    Given(f64),
    /// Per `(batch, head)`: the largest score of every query row against `samples` keys spread
    /// evenly over the sequence.
    Estimate { samples: usize },
}

impl Default for Phi {
    fn default() -> Self {
        Phi::Estimate { samples: 64 }
    }
}

/// Options of the FlashDecoding++ rung.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashDecodingPpOptions {
    pub attention: AttentionOptions,
    pub tiles: TileSizes,
    /// Number of chunks the keys are split into (at least 1).
    pub splits: usize,
    pub phi: Phi,
    /// `(lo, hi)`: a row falls back unless `lo ≤ max_j s_j − φ ≤ hi`. `None`: `±ln(MAX)/2`.
    pub safe_range: Option<(f64, f64)>,
}

impl FlashDecodingPpOptions {
    /// Default tiles, 8 splits, estimated `φ`, default safe range.
    pub fn new(attention: AttentionOptions) -> Self {
        Self {
            attention,
            tiles: TileSizes::default(),
            splits: 8,
            phi: Phi::default(),
            safe_range: None,
        }
    }

    /// Sets the number of splits (at least 1; more splits than keys is allowed).
    pub fn with_splits(self, splits: usize) -> Result<Self> {
        check_splits(splits)?;
        Ok(Self { splits, ..self })
    }

    /// Sets the tile sizes (`br` query rows by `bc` key columns).
    pub fn with_tiles(self, br: usize, bc: usize) -> Result<Self> {
        Ok(Self { tiles: TileSizes::new(br, bc)?, ..self })
    }

    /// Sets how `φ` is chosen.
    pub fn with_phi(self, phi: Phi) -> Self {
        Self { phi, ..self }
    }

    fn validate<T: Element>(&self) -> Result<(f64, f64)> {
        check_splits(self.splits)?;
        match self.phi {
            Phi::Given(phi) if !phi.is_finite() => {
                return Err(invalid("phi", format!("must be finite, got {phi}")));
            }
            Phi::Estimate { samples: 0 } => {
                return Err(invalid("phi", "the estimate needs at least 1 sample key"));
            }
            _ => {}
        }
        let half = T::max_value().as_f64().ln() / 2.0;
        let (lo, hi) = self.safe_range.unwrap_or((-half, half));
        if !(lo.is_finite() && hi.is_finite() && lo < hi) {
            return Err(invalid("safe_range", format!("needs finite lo < hi, got ({lo}, {hi})")));
        }
        Ok((lo, hi))
    }
}

/// FlashDecoding++ forward pass. `stats.fallback_rows` says how many rows were recomputed.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &FlashDecodingPpOptions,
) -> Result<AttentionOutput<T>> {
    let (lo, hi) = opts.validate::<T>()?;
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    let (n_q, d, splits) = (shape.n_q, shape.d, opts.splits);
    let (br, bc) = (opts.tiles.br(), opts.tiles.bc());
    let ranges = split_ranges(shape.n_kv, splits);
    let counters = Counters::new(size_of::<T>());
    let heads = shape.batch * shape.heads_q;

    let phis = head_phis(&problem, opts.phi, &counters);

    // Phase 1: independent sums per (batch, head, split). No max, no rescale, no dependency.
    let mut part_acc = Array4::zeros((heads, splits, n_q, d));
    let mut part_l = Array3::zeros((heads, splits, n_q));
    let mut part_max = Array3::from_elem((heads, splits, n_q), T::neg_infinity());
    part_acc
        .outer_iter_mut()
        .into_par_iter()
        .zip(part_l.outer_iter_mut())
        .zip(part_max.outer_iter_mut())
        .enumerate()
        .for_each(|(i, ((mut acc_h, mut l_h), mut max_h))| {
            let head = problem.head(i / shape.heads_q, i % shape.heads_q);
            acc_h
                .outer_iter_mut()
                .into_par_iter()
                .zip(l_h.outer_iter_mut())
                .zip(max_h.outer_iter_mut())
                .zip(&ranges)
                .for_each(|(((mut acc, mut l), mut mx), cols)| {
                    for rows in blocks(n_q, br) {
                        counters.read(rows.len() * d);
                        let (a, s, m) = unified_max_rows(
                            &head,
                            rows.clone(),
                            cols.clone(),
                            bc,
                            phis[i],
                            &counters,
                        );
                        acc.slice_mut(s![rows.clone(), ..]).assign(&a);
                        l.slice_mut(s![rows.clone()]).assign(&s);
                        mx.slice_mut(s![rows.clone()]).assign(&m);
                        counters.write(rows.len() * (d + 2));
                    }
                });
        });

    // Phase 2: sum the partials; rows outside the safe range are recomputed by FlashDecoding.
    let fallbacks = AtomicUsize::new(0);
    let (o, lse) = problem.per_head(|head, mut o, mut lse| {
        let i = head.b * shape.heads_q + head.h;
        counters.read(n_q * splits * (d + 2));
        counters.write(n_q * (d + 1));
        for r in 0..n_q {
            let row_max =
                part_max.slice(s![i, .., r]).iter().fold(T::neg_infinity(), |m, &x| nan_max(m, x));
            let l: T = part_l.slice(s![i, .., r]).sum();
            let offset = (row_max - phis[i]).as_f64();
            let in_range = offset >= lo && offset <= hi && l.is_finite() && l > T::zero();
            // Rows that saw nothing (l = 0, zeros and −∞) or a NaN need no recomputation.
            if in_range || row_max == T::neg_infinity() || row_max.is_nan() {
                o.row_mut(r).assign(&part_acc.slice(s![i, .., r, ..]).sum_axis(Axis(0)));
                lse[r] = normalise_row(o.row_mut(r), phis[i], l, head.sink);
            } else {
                fallbacks.fetch_add(1, Ordering::Relaxed);
                lse[r] = recompute_row(&head, r, &ranges, bc, &counters, o.row_mut(r));
            }
        }
    });
    let mut stats = counters.stats(heads * splits * n_q.div_ceil(br));
    stats.fallback_rows = Some(fallbacks.into_inner());
    Ok(AttentionOutput { o, lse, stats })
}

/// The unified max `φ` that [`forward`] uses for each `(batch, query head)`, shape
/// `[batch, heads_q]`: the given value everywhere, or each head's estimate from its sampled keys.
pub fn unified_max<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &FlashDecodingPpOptions,
) -> Result<Array2<T>> {
    opts.validate::<T>()?;
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    let phis = head_phis(&problem, opts.phi, &Counters::new(size_of::<T>()));
    Ok(Array2::from_shape_vec((shape.batch, shape.heads_q), phis).expect("one per head"))
}

/// `φ` of every `(batch, query head)`, in that order.
fn head_phis<T: Element>(problem: &Problem<'_, T>, phi: Phi, counters: &Counters) -> Vec<T> {
    let shape = problem.shape;
    (0..shape.batch * shape.heads_q)
        .into_par_iter()
        .map(|i| {
            let head = problem.head(i / shape.heads_q, i % shape.heads_q);
            match phi {
                Phi::Given(phi) => T::of(phi),
                Phi::Estimate { samples } => estimate_phi(&head, samples, counters),
            }
        })
        .collect()
}

/// The largest score the softmax sees (`score_mod(scale · q·k)`, over the keys each row may see)
/// of every query row of `q` against `k`, `[batch, heads_q, n_q]` in order, leaving out the rows
/// that see no key: the statistic FlashDecoding++'s `φ` is calibrated from (the paper fixes `φ`
/// per model from such samples of real calls; `ladder_kernels::decode::calibrate_phi` takes them).
pub fn row_maxima<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    opts: &AttentionOptions,
) -> Result<Vec<T>> {
    let problem = Problem::new(q, k, k, opts)?;
    let shape = problem.shape;
    let mut maxima = Vec::with_capacity(shape.batch * shape.heads_q * shape.n_q);
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let head = problem.head(b, h);
            for (i, q_row) in head.q.rows().into_iter().enumerate() {
                let seen = head.row_runs(i).into_iter().flatten();
                let scores = seen.map(|j| head.logit(head.scale * q_row.dot(&head.k.row(j)), i, j));
                if let Some(m) = scores.reduce(nan_max) {
                    maxima.push(m);
                }
            }
        }
    }
    Ok(maxima)
}

/// Phase 1 for one chunk: `acc = Σ exp(s − φ) v`, `l = Σ exp(s − φ)` and the largest score of
/// each of the query rows `rows` over the keys `cols`.
fn unified_max_rows<T: Element>(
    head: &Head<'_, T>,
    rows: Range<usize>,
    cols: Range<usize>,
    bc: usize,
    phi: T,
    counters: &Counters,
) -> (Array2<T>, Array1<T>, Array1<T>) {
    let mut acc = Array2::zeros((rows.len(), head.v.ncols()));
    let mut l = Array1::zeros(rows.len());
    let mut row_max = Array1::from_elem(rows.len(), T::neg_infinity());
    head.for_each_tile(&rows, cols, bc, counters, |mut p, v, limits| {
        for (r, mut p_row) in p.rows_mut().into_iter().enumerate() {
            row_max[r] = p_row.iter().fold(row_max[r], |m, &x| nan_max(m, x));
            p_row.mapv_inplace(|x| (x - phi).exp());
            l[r] = l[r] + p_row.sum();
        }
        add_pv(&mut acc.view_mut(), T::one(), p.view(), v, limits);
    });
    (acc, l, row_max)
}

/// The fallback: row `r` recomputed with FlashDecoding's per-chunk max and log-sum-exp combine.
fn recompute_row<T: Element>(
    head: &Head<'_, T>,
    r: usize,
    ranges: &[Range<usize>],
    bc: usize,
    counters: &Counters,
    o: ndarray::ArrayViewMut1<T>,
) -> T {
    let (splits, d) = (ranges.len(), head.v.ncols());
    let mut part_o = Array2::zeros((splits, d));
    let mut part_lse = Array1::zeros(splits);
    for (s, cols) in ranges.iter().enumerate() {
        let (o_s, lse_s) = (part_o.slice_mut(s![s..s + 1, ..]), part_lse.slice_mut(s![s..s + 1]));
        partial(head, r..r + 1, cols.clone(), bc, counters, o_s, lse_s);
    }
    combine_row(part_lse.view(), part_o.view(), o, head.sink)
}

/// `φ` for one head: the largest score of any query row against `samples` keys spread evenly
/// over the sequence (only keys the row may see; 0 if none is visible).
fn estimate_phi<T: Element>(head: &Head<'_, T>, samples: usize, counters: &Counters) -> T {
    let n_kv = head.k.nrows();
    let picks: Vec<usize> = (0..samples.min(n_kv)).map(|t| t * n_kv / samples.min(n_kv)).collect();
    counters.read((head.q.nrows() + picks.len()) * head.q.ncols());
    let mut phi = T::neg_infinity();
    for (i, q_row) in head.q.rows().into_iter().enumerate() {
        for &j in picks.iter().filter(|&&j| head.sees(i, j)) {
            let score = head.logit(head.scale * q_row.dot(&head.k.row(j)), i, j);
            if score.is_finite() {
                phi = phi.max(score);
            }
        }
    }
    if phi == T::neg_infinity() { T::zero() } else { phi }
}

#[cfg(test)]
mod tests {
    use ndarray::Array4;

    use super::*;

    #[test]
    fn the_unified_max_is_given_or_estimated_from_sampled_keys() {
        // Batch 1, 2 query heads over 1 kv head, 3 queries, 100 keys, d = 2, non-causal.
        let q = Array4::from_shape_fn((1, 2, 3, 2), |(_, h, i, c)| (h + i + c) as f64 * 0.5 - 1.0);
        let k = Array4::from_shape_fn((1, 1, 100, 2), |(_, _, j, c)| {
            ((j * 7 + c * 3) % 11) as f64 - 5.0
        });
        let v = k.clone();
        let opts = FlashDecodingPpOptions::new(AttentionOptions::default());
        let given =
            unified_max(q.view(), k.view(), v.view(), &opts.clone().with_phi(Phi::Given(2.5)))
                .unwrap();
        assert_eq!(given.shape(), &[1, 2]);
        assert!(given.iter().all(|&p| p == 2.5));
        let scale = 1.0 / 2f64.sqrt();
        for samples in [1, 10, 100] {
            let phi = unified_max(
                q.view(),
                k.view(),
                v.view(),
                &opts.clone().with_phi(Phi::Estimate { samples }),
            )
            .unwrap();
            for h in 0..2 {
                let scores: Vec<f64> = (0..3)
                    .flat_map(|i| (0..100).map(move |j| (i, j)))
                    .map(|(i, j)| {
                        scale * (0..2).map(|c| q[[0, h, i, c]] * k[[0, 0, j, c]]).sum::<f64>()
                    })
                    .collect();
                let all_max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                // Key 0 is always sampled; the estimate never exceeds the true largest score,
                // and with every key sampled it is the largest score.
                let first = (0..3).map(|i| scores[i * 100]).fold(f64::NEG_INFINITY, f64::max);
                assert!(first <= phi[[0, h]] && phi[[0, h]] <= all_max, "{samples} samples");
                if samples == 100 {
                    assert_eq!(phi[[0, h]], all_max);
                }
            }
        }
    }
}
