//! Rung 3: FlashAttention-2, a CPU emulation of Algorithms 1 and 2 of Dao 2023.
//!
//! FA1 keeps key blocks in the outer loop, so every query block's `O, l, m` round-trips through
//! HBM and `O` is renormalised at every step. FA2 swaps the loops:
//!
//! ```text
//! for each query block i (in parallel: one thread block each, no communication):
//!     load Q_i; acc = 0, m = −∞, l = 0                  (kept on chip)
//!     for each key block j (skipping tiles above the causal diagonal):
//!         S = scale · Q_i K_jᵀ                           (masked only on diagonal tiles)
//!         m_new = max(m, rowmax S),  P = exp(S − m_new)
//!         l   = e^(m − m_new) l + rowsum P
//!         acc = diag(e^(m − m_new)) acc + P V_j           (unnormalised: no division here)
//!     O_i = diag(l)⁻¹ acc,  lse_i = m + ln l               (one division, written once)
//! ```
//!
//! Fewer non-matmul FLOPs (one division per row instead of one per tile), no HBM round trips,
//! parallelism over the sequence, and the stored `lse` lets the backward pass ([`backward`])
//! recompute `P = exp(S − lse)` tile by tile without a second softmax.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, Array4, ArrayView3, ArrayView4, Axis, Zip, s};

use crate::element::Element;
use crate::error::Result;
use crate::options::TiledOptions;
use crate::output::{AttentionOutput, Counters, Gradients};
use crate::problem::Problem;
use crate::shape::TileKind;
use crate::tile::{blocks, score_tile};

/// Options of the FA2 rung: the problem and the tile sizes.
pub type Fa2Options = TiledOptions;

/// FlashAttention-2 forward pass: one task per `(batch, head, query block)`, all in parallel.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &Fa2Options,
) -> Result<AttentionOutput<T>> {
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    let (br, bc, d) = (opts.tiles.br(), opts.tiles.bc(), shape.d);
    let counters = Counters::new(size_of::<T>());

    Ok(problem.per_query_block(br, &counters, |head, rows| {
        counters.read(rows.len() * d);
        head.attend(rows, 0..shape.n_kv, bc, &counters)
    }))
}

/// FlashAttention-2 backward pass (Algorithm 2): `dQ, dK, dV` from `Q, K, V, O, dO` and the
/// forward pass's `lse`, without storing `P`.
///
/// ```text
/// D = rowsum(dO ∘ O)                                   (a pre-pass over the rows)
/// for each key block j (in parallel on a GPU):
///     dK_j = dV_j = 0
///     for each query block i (skipping tiles above the diagonal):
///         P    = exp(scale · Q_i K_jᵀ − lse_i)          (recomputed, already normalised)
///         dV_j += Pᵀ dO_i
///         dP   = dO_i V_jᵀ,   dS = P ∘ (dP − D_i)
///         dQ_i += scale · dS K_j                       (atomic add in HBM on a GPU)
///         dK_j += scale · dSᵀ Q_i
/// ```
///
/// The key-outer order keeps `dK_j, dV_j` on chip; only `dQ` needs accumulation across blocks.
/// Here one task handles one `(batch, kv head)`, so the q heads of a GQA group add into the same
/// `dK_j, dV_j` without atomics.
pub fn backward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    o: ArrayView4<T>,
    d_o: ArrayView4<T>,
    lse: ArrayView3<T>,
    opts: &Fa2Options,
) -> Result<Gradients<T>> {
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    shape.expect_like_q("o", &o)?;
    shape.expect_like_q("dO", &d_o)?;
    shape.expect_lse(&lse)?;
    let scale = problem.scale;
    let (br, bc, d, group) = (opts.tiles.br(), opts.tiles.bc(), shape.d, shape.group());
    let counters = Counters::new(size_of::<T>());

    // Pre-pass: D_i = Σ_c dO_ic O_ic.
    let delta = delta(o, d_o);
    counters.read(2 * o.len());
    counters.write(delta.len());

    let kv_heads = shape.batch * shape.heads_kv;
    let mut dq = Array4::zeros((kv_heads, group, shape.n_q, d));
    let mut dk = Array3::zeros((kv_heads, shape.n_kv, d));
    let mut dv = Array3::zeros((kv_heads, shape.n_kv, d));
    Zip::indexed(dq.outer_iter_mut())
        .and(dk.outer_iter_mut())
        .and(dv.outer_iter_mut())
        .par_for_each(|idx, mut dq, mut dk, mut dv| {
            let (b, kh) = (idx / shape.heads_kv, idx % shape.heads_kv);
            for cols in blocks(shape.n_kv, bc) {
                let (k_j, v_j) = (
                    problem.k.slice(s![b, kh, cols.clone(), ..]),
                    problem.v.slice(s![b, kh, cols.clone(), ..]),
                );
                counters.read(2 * cols.len() * d);
                let mut dk_j = Array2::zeros((cols.len(), d));
                let mut dv_j = Array2::zeros((cols.len(), d));
                for g in 0..group {
                    let h = kh * group + g;
                    let head = problem.head(b, h);
                    for rows in blocks(shape.n_q, br) {
                        let (kind, limits) = head.classify(&rows, &cols);
                        counters.tile(kind);
                        if kind == TileKind::Skip {
                            continue;
                        }
                        let q_i = head.q.slice(s![rows.clone(), ..]);
                        let do_i = d_o.slice(s![b, h, rows.clone(), ..]);
                        // Q_i, dO_i, lse_i, D_i in; dQ_i read and written (the atomic add).
                        counters.read(3 * rows.len() * d + 2 * rows.len());
                        counters.write(rows.len() * d);

                        let mut p = score_tile(q_i, k_j, scale, limits.as_deref());
                        for (mut p_row, i) in p.rows_mut().into_iter().zip(rows.clone()) {
                            let lse_i = lse[[b, h, i]];
                            if lse_i == T::neg_infinity() {
                                p_row.fill(T::zero()); // the row saw no key: no gradient flows
                            } else {
                                p_row.mapv_inplace(|x| (x - lse_i).exp());
                            }
                        }
                        general_mat_mul(T::one(), &p.t(), &do_i, T::one(), &mut dv_j);
                        let mut ds = Array2::zeros(p.dim());
                        general_mat_mul(T::one(), &do_i, &v_j.t(), T::zero(), &mut ds);
                        for ((mut ds_row, p_row), i) in
                            ds.rows_mut().into_iter().zip(p.rows()).zip(rows.clone())
                        {
                            let d_i = delta[[b, h, i]];
                            Zip::from(&mut ds_row)
                                .and(&p_row)
                                .for_each(|ds, &p| *ds = p * (*ds - d_i));
                        }
                        let mut dq_i = dq.slice_mut(s![g, rows.clone(), ..]);
                        general_mat_mul(scale, &ds, &k_j, T::one(), &mut dq_i);
                        general_mat_mul(scale, &ds.t(), &q_i, T::one(), &mut dk_j);
                    }
                }
                dk.slice_mut(s![cols.clone(), ..]).assign(&dk_j);
                dv.slice_mut(s![cols.clone(), ..]).assign(&dv_j);
                counters.write(2 * cols.len() * d);
            }
        });
    Ok(Gradients {
        dq: dq.into_shape_with_order(shape.q_dims()).expect("standard layout"),
        dk: dk.into_shape_with_order(shape.kv_dims()).expect("standard layout"),
        dv: dv.into_shape_with_order(shape.kv_dims()).expect("standard layout"),
        stats: counters.stats(shape.batch * shape.heads_kv * shape.n_kv.div_ceil(bc)),
    })
}

/// `D_i = rowsum(dO ∘ O)_i`: the term that replaces the softmax Jacobian in the backward pass.
fn delta<T: Element>(o: ArrayView4<T>, d_o: ArrayView4<T>) -> Array3<T> {
    Zip::from(o.lanes(Axis(3))).and(d_o.lanes(Axis(3))).map_collect(|o, d_o| o.dot(&d_o))
}
