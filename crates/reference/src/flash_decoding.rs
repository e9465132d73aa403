//! Rung 6: FlashDecoding, split K/V so that decoding fills the machine.
//!
//! When decoding, `n_q` is one token (or a few) and `n_kv` is the whole context. FA2 parallelises
//! over `batch × heads × query blocks`: at batch 1 that is a handful of thread blocks on a GPU with
//! 132 SMs, each streaming the entire KV cache alone. FlashDecoding (Dao, Haziza, Massa, Sizov
//! 2023) also splits the keys:
//!
//! ```text
//! phase 1, in parallel over (batch, head, split s):
//!     (O_s, lse_s) = FA2 over the keys of chunk s          (O_s normalised within the chunk)
//! phase 2, per row:
//!     lse = log Σ_s exp(lse_s),   O = Σ_s exp(lse_s − lse) · O_s
//! ```
//!
//! The combine is exact because each partial carries its own log-sum-exp. Any number of splits
//! works, including more splits than keys: an empty chunk contributes `lse_s = −∞`, weight 0.

use std::ops::Range;

use ndarray::parallel::prelude::*;
use ndarray::{
    Array3, Array4, ArrayView1, ArrayView2, ArrayView4, ArrayViewMut1, ArrayViewMut2, s,
};

use crate::element::Element;
use crate::error::{Result, invalid};
use crate::options::{AttentionOptions, TileSizes};
use crate::output::{AttentionOutput, Counters};
use crate::problem::{Head, Problem};
use crate::tile::{blocks, nan_max};

/// Options of the FlashDecoding rung.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashDecodingOptions {
    pub attention: AttentionOptions,
    pub tiles: TileSizes,
    /// Number of chunks the keys are split into (at least 1).
    pub splits: usize,
}

impl FlashDecodingOptions {
    /// Default tiles and 8 splits.
    pub fn new(attention: AttentionOptions) -> Self {
        Self { attention, tiles: TileSizes::default(), splits: 8 }
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
}

pub(crate) fn check_splits(splits: usize) -> Result<()> {
    if splits == 0 {
        return Err(invalid("splits", "the number of K/V splits must be at least 1"));
    }
    Ok(())
}

/// The key ranges of the splits: split `s` covers `s·n/S .. (s+1)·n/S`, so chunk lengths differ
/// by at most one and some are empty when `S > n`.
pub fn split_ranges(n_kv: usize, splits: usize) -> Vec<Range<usize>> {
    (0..splits).map(|s| s * n_kv / splits..(s + 1) * n_kv / splits).collect()
}

/// FlashDecoding forward pass: parallel partials over K/V splits, then a log-sum-exp combine.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &FlashDecodingOptions,
) -> Result<AttentionOutput<T>> {
    check_splits(opts.splits)?;
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    let (n_q, d, splits) = (shape.n_q, shape.d, opts.splits);
    let ranges = split_ranges(shape.n_kv, splits);
    let counters = Counters::new(size_of::<T>());

    // Phase 1: one task per (batch, head, split); the partials go to HBM.
    let heads = shape.batch * shape.heads_q;
    let mut part_o = Array4::from_elem((heads, splits, n_q, d), T::nan());
    let mut part_lse = Array3::from_elem((heads, splits, n_q), T::nan());
    part_o.outer_iter_mut().into_par_iter().zip(part_lse.outer_iter_mut()).enumerate().for_each(
        |(i, (mut o_h, mut lse_h))| {
            let head = problem.head(i / shape.heads_q, i % shape.heads_q);
            o_h.outer_iter_mut().into_par_iter().zip(lse_h.outer_iter_mut()).zip(&ranges).for_each(
                |((mut o_s, mut lse_s), cols)| {
                    for rows in blocks(n_q, opts.tiles.br()) {
                        let (o_rows, lse_rows) = (
                            o_s.slice_mut(s![rows.clone(), ..]),
                            lse_s.slice_mut(s![rows.clone()]),
                        );
                        partial(
                            &head,
                            rows,
                            cols.clone(),
                            opts.tiles.bc(),
                            &counters,
                            o_rows,
                            lse_rows,
                        );
                    }
                },
            );
        },
    );

    // Phase 2: combine the partials of each row.
    let (o, lse) = problem.per_head(|head, mut o, mut lse| {
        let i = head.b * shape.heads_q + head.h;
        for r in 0..n_q {
            let (lse_s, o_s) = (part_lse.slice(s![i, .., r]), part_o.slice(s![i, .., r, ..]));
            lse[r] = combine_row(lse_s, o_s, o.row_mut(r), head.sink);
        }
        counters.read(n_q * splits * (d + 1));
        counters.write(n_q * (d + 1));
    });
    let work_items = heads * splits * n_q.div_ceil(opts.tiles.br());
    Ok(AttentionOutput { o, lse, stats: counters.stats(work_items) })
}

/// Phase 1 for one chunk: the partial output (normalised within the chunk) and lse of the query
/// rows `rows` over the keys `cols`, written to `o` and `lse`.
pub(crate) fn partial<T: Element>(
    head: &Head<'_, T>,
    rows: Range<usize>,
    cols: Range<usize>,
    bc: usize,
    counters: &Counters,
    o: ArrayViewMut2<T>,
    lse: ArrayViewMut1<T>,
) {
    counters.read(rows.len() * head.q.ncols());
    let n = rows.len();
    // The sink joins the combine, once per row, not every chunk's softmax.
    head.attend(rows, cols, bc, counters).finish_into(o, lse, None);
    counters.write(n * (head.v.ncols() + 1));
}

/// Phase 2 for one row: `lse = log Σ_s exp(lse_s)` and `O = Σ_s exp(lse_s − lse) O_s`, written
/// to `o`; returns `lse`. A sink is one more partial, of `lse_s = σ` and `O_s = 0`
/// ([`crate::sinks`]). A row whose partials are all empty (`−∞`) and has no sink gets zeros and
/// `−∞`.
pub(crate) fn combine_row<T: Element>(
    lse_s: ArrayView1<T>,
    o_s: ArrayView2<T>,
    mut o: ArrayViewMut1<T>,
    sink: Option<T>,
) -> T {
    let sink = sink.unwrap_or(T::neg_infinity());
    let m = lse_s.iter().fold(sink, |m, &x| nan_max(m, x));
    o.fill(T::zero());
    if m == T::neg_infinity() {
        return T::neg_infinity();
    }
    let weights = lse_s.mapv(|x| (x - m).exp());
    let total: T = weights.sum() + (sink - m).exp();
    for (&w, o_part) in weights.iter().zip(o_s.rows()) {
        if w != T::zero() {
            let w = w / total;
            o.zip_mut_with(&o_part, |o, &x| *o = *o + w * x);
        }
    }
    m + total.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_keys_once() {
        for (n, s) in [(10, 3), (3, 7), (1, 1), (8, 8)] {
            let ranges = split_ranges(n, s);
            assert_eq!(ranges.len(), s);
            assert_eq!(ranges.first().unwrap().start, 0);
            assert_eq!(ranges.last().unwrap().end, n);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            assert!(ranges.iter().all(|r| r.len() <= n.div_ceil(s)));
        }
    }
}
