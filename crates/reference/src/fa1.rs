//! Rung 3: FlashAttention-1, a CPU emulation of Algorithm 1 of Dao et al. 2022.
//!
//! The online softmax of rung 2 still reads every key once per query row. FlashAttention tiles
//! the problem so that a block of keys, once loaded into on-chip SRAM, serves a whole block of
//! queries:
//!
//! ```text
//! for each key block j (outer loop):               load K_j, V_j into SRAM
//!     for each query block i (inner loop):         load Q_i, O_i, l_i, m_i from HBM
//!         S_ij = scale · Q_i K_jᵀ                   (masked on the causal diagonal)
//!         m̃ = rowmax(S_ij),  P̃ = exp(S_ij − m̃),  l̃ = rowsum(P̃)
//!         m_new = max(m_i, m̃),  l_new = e^(m_i − m_new) l_i + e^(m̃ − m_new) l̃
//!         O_i ← diag(l_new)⁻¹ (diag(l_i) e^(m_i − m_new) O_i + e^(m̃ − m_new) P̃ V_j)
//!         write O_i, l_i ← l_new, m_i ← m_new back to HBM
//! ```
//!
//! Because the outer loop runs over keys, the partial results `O, l, m` of every query block make
//! a round trip through HBM at every step, and `O` is renormalised each time. Its traffic is
//! `Θ(N² d² / M)` for an SRAM of `M` elements, against `Θ(N d + N²)` for the naive rung; the
//! emulation counts it as it runs ([`crate::RunStats::hbm`]). Algorithm 1 has no mask; the
//! paper's Algorithm 2 (the same loop with masking and dropout) masks every tile's scores and
//! skips nothing, and so does this rung under a causal mask: tiles above the diagonal are
//! computed too (counted as partial). FlashAttention-2 ([`crate::fa2`]) swaps the loops to
//! remove the round trips, and skips those tiles.

use ndarray::{Array1, Array2, ArrayView4, s};

use crate::element::Element;
use crate::error::Result;
use crate::options::TiledOptions;
use crate::output::{AttentionOutput, Counters};
use crate::problem::Problem;
use crate::shape::TileKind;
use crate::tile::{add_pv, blocks, exp_diff, lse_of, nan_max, shift_of};

/// Options of the FA1 rung: the problem and the tile sizes.
pub type Fa1Options = TiledOptions;

/// FlashAttention-1 forward pass (Algorithm 1), one `(batch, head)` per thread.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &Fa1Options,
) -> Result<AttentionOutput<T>> {
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    let (br, bc, d) = (opts.tiles.br(), opts.tiles.bc(), shape.d);
    let counters = Counters::new(size_of::<T>());

    let (o, lse) = problem.per_head(|head, mut o, mut lse| {
        // Line 2: O = 0, l = 0, m = −∞ in HBM.
        o.fill(T::zero());
        let mut l = Array1::<T>::zeros(shape.n_q);
        let mut m = Array1::from_elem(shape.n_q, T::neg_infinity());
        counters.write(shape.n_q * d + 2 * shape.n_q);

        for cols in blocks(shape.n_kv, bc) {
            let v_j = head.v.slice(s![cols.clone(), ..]);
            counters.read(2 * cols.len() * d);
            for rows in blocks(shape.n_q, br) {
                let (kind, limits) = match head.classify(&rows, &cols) {
                    // The paper masks a hidden tile (its Algorithm 2) but does not skip it.
                    (TileKind::Skip, _) => (TileKind::Partial, Some(vec![vec![]; rows.len()])),
                    classified => classified,
                };
                counters.tile(kind);
                counters.read(2 * rows.len() * d + 2 * rows.len());

                let q_i = head.q.slice(s![rows.clone(), ..]);
                let mut p = head.score_tile(q_i, &rows, &cols, head.scale, limits.as_deref());
                let mut pv = Array2::zeros((rows.len(), d));
                let mut row_max = Array1::from_elem(rows.len(), T::neg_infinity());
                let mut row_sum = Array1::zeros(rows.len());
                for (r, mut p_row) in p.rows_mut().into_iter().enumerate() {
                    row_max[r] = p_row.iter().fold(T::neg_infinity(), |a, &x| nan_max(a, x));
                    let shift = shift_of(row_max[r]);
                    p_row.mapv_inplace(|x| (x - shift).exp());
                    row_sum[r] = p_row.sum();
                }
                add_pv(&mut pv.view_mut(), T::one(), p.view(), v_j, limits.as_deref());

                for (r, i) in rows.clone().enumerate() {
                    let m_new = nan_max(m[i], row_max[r]);
                    let (old, new) = (exp_diff(m[i], m_new), exp_diff(row_max[r], m_new));
                    let l_new = old * l[i] + new * row_sum[r];
                    let mut o_row = o.row_mut(i);
                    if l_new == T::zero() {
                        o_row.fill(T::zero());
                    } else {
                        let (carry, fresh) = (l[i] * old / l_new, new / l_new);
                        o_row.zip_mut_with(&pv.row(r), |o, &x| *o = carry * *o + fresh * x);
                    }
                    (l[i], m[i]) = (l_new, m_new);
                }
                counters.write(rows.len() * d + 2 * rows.len());
            }
        }
        for i in 0..shape.n_q {
            if let Some(sink) = head.sink {
                (m[i], l[i]) = crate::sinks::fold_normalised(o.row_mut(i), m[i], l[i], sink);
            }
            lse[i] = lse_of(m[i], l[i]);
        }
        counters.write(shape.n_q);
    });
    Ok(AttentionOutput { o, lse, stats: counters.stats(shape.batch * shape.heads_q) })
}
