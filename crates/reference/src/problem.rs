//! One validated attention problem, and the loop over its heads that every rung runs.

use std::ops::Range;

use ndarray::parallel::prelude::*;
use ndarray::{
    Array2, Array3, Array4, ArrayView2, ArrayView4, ArrayViewMut1, ArrayViewMut2, Axis, s,
};

use crate::element::Element;
use crate::error::Result;
use crate::mask_mod::{self, MaskMod};
use crate::modifiers::{ScoreIndex, ScoreMod};
use crate::options::AttentionOptions;
use crate::output::{AttentionOutput, Counters};
use crate::shape::{AttentionShape, Mask, TileKind};
use crate::tile::{OnlineRows, RowSpans, Runs, blocks, mask_row, score_tile};

/// `Q, K, V` with their checked shape, the resolved scale, the masks and the score modifier.
#[derive(Clone, Copy)]
pub(crate) struct Problem<'a, T> {
    pub q: ArrayView4<'a, T>,
    pub k: ArrayView4<'a, T>,
    pub v: ArrayView4<'a, T>,
    pub shape: AttentionShape,
    pub scale: T,
    pub mask: Mask,
    pub mask_mod: Option<&'a MaskMod>,
    pub score_mod: Option<&'a ScoreMod>,
    pub sinks: Option<&'a [f64]>,
}

impl<'a, T: Element> Problem<'a, T> {
    /// Checks the shapes and the options of a forward pass.
    pub fn new(
        q: ArrayView4<'a, T>,
        k: ArrayView4<'a, T>,
        v: ArrayView4<'a, T>,
        opts: &'a AttentionOptions,
    ) -> Result<Self> {
        Self::checked(q, k, v, opts, false)
    }

    /// Checks the shapes and the options of a backward pass (a score modifier needs its
    /// derivative).
    pub fn backward(
        q: ArrayView4<'a, T>,
        k: ArrayView4<'a, T>,
        v: ArrayView4<'a, T>,
        opts: &'a AttentionOptions,
    ) -> Result<Self> {
        Self::checked(q, k, v, opts, true)
    }

    fn checked(
        q: ArrayView4<'a, T>,
        k: ArrayView4<'a, T>,
        v: ArrayView4<'a, T>,
        opts: &'a AttentionOptions,
        backward: bool,
    ) -> Result<Self> {
        let shape = AttentionShape::of(&q, &k, &v)?;
        let scale = T::of(opts.resolve_scale(&shape)?);
        let mask = opts.mask(shape.n_q, shape.n_kv);
        if let Some(score_mod) = &opts.score_mod {
            score_mod.check(&shape, backward)?;
        }
        if let Some(mask_mod) = &opts.mask_mod {
            mask_mod.check(&shape)?;
        }
        if let Some(sinks) = &opts.sinks {
            crate::sinks::check(sinks, shape.heads_q)?;
        }
        let (score_mod, sinks) = (opts.score_mod.as_ref(), opts.sinks.as_deref());
        let mask_mod = opts.mask_mod.as_ref();
        Ok(Self { q, k, v, shape, scale, mask, mask_mod, score_mod, sinks })
    }

    /// The 2-D views of q head `h` of batch `b` and of the kv head it reads.
    pub fn head(&self, b: usize, h: usize) -> Head<'_, T> {
        let kh = self.shape.kv_head(h);
        Head {
            b,
            h,
            kh,
            q: self.q.slice(s![b, h, .., ..]),
            k: self.k.slice(s![b, kh, .., ..]),
            v: self.v.slice(s![b, kh, .., ..]),
            scale: self.scale,
            mask: self.mask,
            mask_mod: self.mask_mod,
            score_mod: self.score_mod,
            sink: self.sinks.map(|s| T::of(s[h])),
            n_q: self.shape.n_q,
            n_kv: self.shape.n_kv,
        }
    }

    /// Allocates `O` and `lse` and fills them one `(batch, q head)` at a time, in parallel:
    /// `f(head, o, lse)`. The buffers start as NaN, so a row a rung forgets to write shows up.
    pub fn per_head<F>(&self, f: F) -> (Array4<T>, Array3<T>)
    where
        F: Fn(Head<'_, T>, ArrayViewMut2<T>, ArrayViewMut1<T>) + Sync + Send,
    {
        let shape = self.shape;
        let heads = shape.batch * shape.heads_q;
        let mut o = Array3::from_elem((heads, shape.n_q, shape.d), T::nan());
        let mut lse = Array2::from_elem((heads, shape.n_q), T::nan());
        o.axis_iter_mut(Axis(0))
            .into_par_iter()
            .zip(lse.axis_iter_mut(Axis(0)))
            .enumerate()
            .for_each(|(i, (o, lse))| f(self.head(i / shape.heads_q, i % shape.heads_q), o, lse));
        let o = o.into_shape_with_order(shape.q_dims()).expect("standard layout");
        let lse = lse
            .into_shape_with_order((shape.batch, shape.heads_q, shape.n_q))
            .expect("standard layout");
        (o, lse)
    }

    /// FA2's decomposition: one task per `(batch, q head, block of br query rows)`, all in
    /// parallel, each a work item. `f(head, rows)` returns the block's running state; the
    /// driver normalises it and writes `O` and `lse` (counted as HBM writes).
    pub fn per_query_block<F>(&self, br: usize, counters: &Counters, f: F) -> AttentionOutput<T>
    where
        F: Fn(&Head<'_, T>, Range<usize>) -> OnlineRows<T> + Sync + Send,
    {
        let (n_q, d) = (self.shape.n_q, self.shape.d);
        let (o, lse) = self.per_head(|head, mut o, mut lse| {
            o.axis_chunks_iter_mut(Axis(0), br)
                .into_par_iter()
                .zip(lse.axis_chunks_iter_mut(Axis(0), br))
                .enumerate()
                .for_each(|(i, (o_i, lse_i))| {
                    let rows = i * br..(i * br + br).min(n_q);
                    f(&head, rows.clone()).finish_into(o_i, lse_i, head.sink);
                    counters.write(rows.len() * (d + 1));
                });
        });
        let work_items = self.shape.batch * self.shape.heads_q * n_q.div_ceil(br);
        AttentionOutput { o, lse, stats: counters.stats(work_items) }
    }
}

/// One `(batch, q head)`: the views a GPU thread block would index.
pub(crate) struct Head<'a, T> {
    /// Batch index, q head and the kv head it reads.
    pub b: usize,
    pub h: usize,
    pub kh: usize,
    pub q: ArrayView2<'a, T>,
    pub k: ArrayView2<'a, T>,
    pub v: ArrayView2<'a, T>,
    pub scale: T,
    pub mask: Mask,
    /// The mask modifier, which hides pairs inside the band ([`crate::mask_mod`]).
    pub mask_mod: Option<&'a MaskMod>,
    pub score_mod: Option<&'a ScoreMod>,
    /// This head's sink logit ([`crate::sinks`]), if the problem has sinks.
    pub sink: Option<T>,
    pub n_q: usize,
    pub n_kv: usize,
}

impl<T: Element> Head<'_, T> {
    /// Where score `(i, j)` of this head sits, for the score modifier.
    pub fn index(&self, i: usize, j: usize) -> ScoreIndex {
        ScoreIndex { batch: self.b, head: self.h, q: i, kv: j, n_q: self.n_q, n_kv: self.n_kv }
    }

    /// Whether query `i` sees key `j`: inside the band and kept by the mask modifier.
    pub fn sees(&self, i: usize, j: usize) -> bool {
        self.mask.visible(i).contains(&j) && self.mask_mod.is_none_or(|m| m.sees(&self.index(i, j)))
    }

    /// The keys query `i` sees, as runs of key indices.
    pub fn row_runs(&self, i: usize) -> Runs {
        let all = 0..self.n_kv;
        let mut spans =
            mask_mod::row_spans(&self.mask, self.mask_mod, self.index(0, 0), &(i..i + 1), &all);
        spans.pop().unwrap_or_default()
    }

    /// The score the softmax sees for query `i` and key `j`: `score_mod(s)` for the scaled
    /// score `s = scale · q_i·k_j` (`s` itself without a modifier).
    pub fn logit(&self, s: T, i: usize, j: usize) -> T {
        match self.score_mod {
            None => s,
            Some(m) => T::of(m.apply(s.as_f64(), &self.index(i, j))),
        }
    }

    /// Applies the score modifier to the scaled scores `s` of rows `rows.start …` and keys
    /// `cols_start …` in place.
    pub fn modify(&self, s: &mut Array2<T>, rows_start: usize, cols_start: usize) {
        if self.score_mod.is_some() {
            s.indexed_iter_mut()
                .for_each(|((r, c), x)| *x = self.logit(*x, rows_start + r, cols_start + c));
        }
    }

    /// `score_mod(scale · Q Kᵀ)` for the tile of query rows `rows` (`q_i`: those rows of Q, or
    /// a transform of them) and key columns `cols`, each key scaled by `factor` (the softmax
    /// scale, or the FP8 path's dequantising product); on a partial tile, row `r` keeps the
    /// columns of `limits[r]` and the rest become `−∞`.
    pub fn score_tile(
        &self,
        q_i: ArrayView2<'_, T>,
        rows: &Range<usize>,
        cols: &Range<usize>,
        factor: T,
        limits: Option<&[Runs]>,
    ) -> Array2<T> {
        if self.score_mod.is_none() {
            return score_tile(q_i, self.k.slice(s![cols.clone(), ..]), factor, limits);
        }
        let mut s = score_tile(q_i, self.k.slice(s![cols.clone(), ..]), factor, None);
        self.modify(&mut s, rows.start, cols.start);
        if let Some(limits) = limits {
            for (row, seen) in s.rows_mut().into_iter().zip(limits) {
                mask_row(row, seen);
            }
        }
        s
    }

    /// How tile `rows × cols` meets the masks (the band and the mask modifier: the tile's entry
    /// of the [`crate::BlockMask`]), and the columns each row sees when it must be masked.
    pub fn classify(
        &self,
        rows: &Range<usize>,
        cols: &Range<usize>,
    ) -> (TileKind, Option<RowSpans>) {
        mask_mod::classify(&self.mask, self.mask_mod, self.index(0, 0), rows, cols)
    }

    /// Walks the key tiles of `cols` (`bc` keys each) for the query rows `rows`, skipping the
    /// tiles the mask hides, and hands `f` each masked score tile `S = scale · Q Kᵀ` with its
    /// `V` tile and the columns each row sees. Counts tiles and K/V reads.
    pub fn for_each_tile(
        &self,
        rows: &Range<usize>,
        cols: Range<usize>,
        bc: usize,
        counters: &Counters,
        mut f: impl FnMut(Array2<T>, ArrayView2<'_, T>, Option<&[Runs]>),
    ) {
        let q_i = self.q.slice(s![rows.clone(), ..]);
        for tile in blocks(cols.len(), bc) {
            let tile = cols.start + tile.start..cols.start + tile.end;
            let (kind, limits) = self.classify(rows, &tile);
            counters.tile(kind);
            if kind == TileKind::Skip {
                continue;
            }
            counters.read(2 * tile.len() * self.k.ncols());
            let s = self.score_tile(q_i, rows, &tile, self.scale, limits.as_deref());
            f(s, self.v.slice(s![tile, ..]), limits.as_deref());
        }
    }

    /// FA2's inner loop: query rows `rows` against the keys `cols`, in key tiles of `bc`,
    /// skipping tiles the mask hides. Returns the unnormalised running state.
    pub fn attend(
        &self,
        rows: Range<usize>,
        cols: Range<usize>,
        bc: usize,
        counters: &Counters,
    ) -> OnlineRows<T> {
        let mut state = OnlineRows::new(rows.len(), self.v.ncols());
        self.for_each_tile(&rows, cols, bc, counters, |s, v, limits| state.update(s, v, limits));
        state
    }
}
