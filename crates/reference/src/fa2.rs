//! Rung 4: FlashAttention-2, a CPU emulation of Algorithms 1 and 2 of Dao 2023.
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

use std::sync::OnceLock;

use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array1, Array2, Array3, Array4, ArrayView1, ArrayView2, ArrayView3, ArrayView4, Zip, s,
};

use crate::element::Element;
use crate::error::{LadderError, Result};
use crate::naive::chain_score_mod;
use crate::options::{TileSizes, TiledOptions};
use crate::output::{AttentionOutput, Counters, Gradients, HbmTraffic};
use crate::problem::Problem;
use crate::shape::{AttentionShape, Mask, TileKind};
use crate::tile::blocks;

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
///
/// This is [`backward_with`] with our own two element-wise steps, [`delta_rows`] and [`ds_tile`].
pub fn backward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    o: ArrayView4<T>,
    d_o: ArrayView4<T>,
    lse: ArrayView3<T>,
    opts: &Fa2Options,
) -> Result<Gradients<T>> {
    let steps = BackwardSteps::new(delta_rows::<T>, ds_tile::<T>);
    backward_with(q, k, v, o, d_o, lse, opts, &steps)
}

/// The two steps of the backward pass that are not matrix products, as functions that
/// [`backward_with`] calls in place of ours: `D` for the rows of one head, and `dS` for one tile.
///
/// Everything else (the loops, `P` recomputed from `lse`, the five products, the mask, the HBM
/// counters) stays the rung's, so a notebook exercise can ask for exactly these two formulas and
/// check them through the whole backward pass. Build it with [`BackwardSteps::new`], which lets
/// closures infer their argument types.
#[derive(Debug, Clone, Copy)]
pub struct BackwardSteps<D, S> {
    /// `(O, dO)` of one head's query rows, both `[n_q, d]`, to `D` (`[n_q]`):
    /// `D_i = Σ_c dO_ic O_ic`.
    pub delta: D,
    /// `(P, dP, D_i)` of one tile, `P` and `dP = dO_i V_jᵀ` `[rows, cols]` and `D_i` `[rows]`, to
    /// `dS = P ∘ (dP − D_i)` (`[rows, cols]`). Masked entries of `P` are exactly 0.
    pub ds: S,
}

impl<D, S> BackwardSteps<D, S> {
    /// The two steps, as functions of views (`fn` items or closures).
    pub fn new<T>(delta: D, ds: S) -> Self
    where
        D: Fn(ArrayView2<'_, T>, ArrayView2<'_, T>) -> Array1<T>,
        S: Fn(ArrayView2<'_, T>, ArrayView2<'_, T>, ArrayView1<'_, T>) -> Array2<T>,
    {
        Self { delta, ds }
    }
}

/// `D_i = rowsum(dO ∘ O)_i` for the rows of one head (`o`, `d_o`: `[n_q, d]`): the term that
/// replaces the softmax Jacobian in the backward pass. Since `O_i = Σ_j P_ij v_j`,
/// `D_i = Σ_j P_ij (dO_i · v_j) = Σ_j P_ij dP_ij`, but this form needs neither `P` nor `dP`.
pub fn delta_rows<T: Element>(o: ArrayView2<T>, d_o: ArrayView2<T>) -> Array1<T> {
    Zip::from(o.rows()).and(d_o.rows()).map_collect(|o, d_o| o.dot(&d_o))
}

/// `dS = P ∘ (dP − D_i)` for one tile (`p`, `dp`: `[rows, cols]`, `d`: `[rows]`): the gradient
/// of the scores through the softmax, row `i` shifted by its `D_i`.
pub fn ds_tile<T: Element>(p: ArrayView2<T>, dp: ArrayView2<T>, d: ArrayView1<T>) -> Array2<T> {
    let mut ds = dp.to_owned();
    Zip::from(ds.rows_mut()).and(p.rows()).and(&d).for_each(|mut ds_row, p_row, &d_i| {
        Zip::from(&mut ds_row).and(&p_row).for_each(|ds, &p| *ds = p * (*ds - d_i));
    });
    ds
}

/// [`backward`] with the two element-wise steps given by `steps` (see [`BackwardSteps`]): the
/// hook a notebook exercise uses to have the learner write `D` and `dS` while the rest of the
/// backward pass is the rung's.
///
/// `steps.delta` is called once per `(batch, q head)`, before the loop; `steps.ds` once per
/// computed tile, from several threads at once (hence `Sync`). A step that returns the wrong
/// shape is an error ([`LadderError::ShapeMismatch`]), not a panic.
#[allow(clippy::too_many_arguments)] // backward's seven inputs, and the steps
pub fn backward_with<T, D, S>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    o: ArrayView4<T>,
    d_o: ArrayView4<T>,
    lse: ArrayView3<T>,
    opts: &Fa2Options,
    steps: &BackwardSteps<D, S>,
) -> Result<Gradients<T>>
where
    T: Element,
    D: Fn(ArrayView2<'_, T>, ArrayView2<'_, T>) -> Array1<T> + Sync,
    S: Fn(ArrayView2<'_, T>, ArrayView2<'_, T>, ArrayView1<'_, T>) -> Array2<T> + Sync,
{
    let problem = Problem::backward(q, k, v, &opts.attention)?;
    let shape = problem.shape;
    shape.expect_like_q("o", &o)?;
    shape.expect_like_q("dO", &d_o)?;
    shape.expect_lse(&lse)?;
    let scale = problem.scale;
    let (br, bc, d, group) = (opts.tiles.br(), opts.tiles.bc(), shape.d, shape.group());
    let counters = Counters::new(size_of::<T>());

    // Pre-pass: D_i = Σ_c dO_ic O_ic, one head at a time.
    let mut delta = Array3::zeros((shape.batch, shape.heads_q, shape.n_q));
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let rows = (steps.delta)(o.slice(s![b, h, .., ..]), d_o.slice(s![b, h, .., ..]));
            if rows.len() != shape.n_q {
                return Err(LadderError::ShapeMismatch(format!(
                    "the delta step returned {} values for the {} rows of a head",
                    rows.len(),
                    shape.n_q
                )));
            }
            delta.slice_mut(s![b, h, ..]).assign(&rows);
        }
    }
    counters.read(2 * o.len());
    counters.write(delta.len());

    // A dS step of the wrong shape: the first such error, reported after the parallel loop.
    let bad_ds = OnceLock::new();
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

                        let mut p = head.score_tile(q_i, &rows, &cols, scale, limits.as_deref());
                        for (mut p_row, i) in p.rows_mut().into_iter().zip(rows.clone()) {
                            let lse_i = lse[[b, h, i]];
                            if lse_i == T::neg_infinity() {
                                p_row.fill(T::zero()); // the row saw no key: no gradient flows
                            } else {
                                p_row.mapv_inplace(|x| (x - lse_i).exp());
                            }
                        }
                        general_mat_mul(T::one(), &p.t(), &do_i, T::one(), &mut dv_j);
                        let mut dp = Array2::zeros(p.dim());
                        general_mat_mul(T::one(), &do_i, &v_j.t(), T::zero(), &mut dp);
                        let d_i = delta.slice(s![b, h, rows.clone()]);
                        let mut ds = (steps.ds)(p.view(), dp.view(), d_i);
                        if ds.dim() != p.dim() {
                            let _ = bad_ds.set(format!(
                                "the dS step returned shape {:?} for a tile of {:?}",
                                ds.shape(),
                                p.shape()
                            ));
                            continue;
                        }
                        chain_score_mod(&head, &mut ds, rows.start, cols.start);
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
    if let Some(why) = bad_ds.into_inner() {
        return Err(LadderError::ShapeMismatch(why));
    }
    // The sinks' gradient from lse (which includes them) and D: nothing else to recompute.
    let dsinks = problem.sinks.map(|sinks| crate::sinks::gradient(sinks, lse, delta.view()));
    Ok(Gradients {
        dq: dq.into_shape_with_order(shape.q_dims()).expect("standard layout"),
        dk: dk.into_shape_with_order(shape.kv_dims()).expect("standard layout"),
        dv: dv.into_shape_with_order(shape.kv_dims()).expect("standard layout"),
        dsinks,
        stats: counters.stats(shape.batch * shape.heads_kv * shape.n_kv.div_ceil(bc)),
    })
}

/// Where `dQ` is summed, for [`backward_traffic`]: the three ways a backward pass can split its
/// work between blocks that run in parallel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DqStrategy {
    /// Key-outer loop (Algorithm 2, [`backward`]): `dK_j, dV_j` stay on chip, and every
    /// computed tile adds its share of `dQ_i` in HBM (a read and a write per tile here; float
    /// atomics on a GPU, the default of `fa2_backward.cu`).
    Atomic,
    /// Key-outer loop for `dK, dV` without `dQ`, then a second, query-outer loop that recomputes
    /// `S, P, dP, dS` and sums `dQ_i` on chip, writing it once: the Triton tutorial's
    /// `_attn_bwd_dq`, and `fa2_backward_dq` (`Options::deterministic()`) on our GPU. No
    /// accumulation in HBM, seven matrix products per tile instead of five.
    SeparatePass,
    /// Query-outer loop, as in the forward pass: `dQ_i` stays on chip, but `dK_j` and `dV_j`
    /// are then summed across blocks, two tensors instead of one (the order FA2 did not choose).
    QueryOuter,
}

/// HBM traffic of each part of a backward pass under the rung's memory model (every access
/// counted, no cache), and the FLOPs of its matrix products. From [`backward_traffic`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackwardTraffic {
    /// The pre-pass: `O` and `dO` read, `D` written.
    pub prep: HbmTraffic,
    /// `K_j` and `V_j` tiles read.
    pub kv: HbmTraffic,
    /// `Q_i`, `dO_i`, `lse_i` and `D_i` tiles read.
    pub rows: HbmTraffic,
    /// Gradients summed across blocks in HBM: `dQ` (atomic) or `dK, dV` (query-outer), read and
    /// written once per computed tile.
    pub accumulate: HbmTraffic,
    /// Gradients written once, finished on chip.
    pub gradients: HbmTraffic,
    /// FLOPs of the tile matrix products (`2·rows·cols·d` each).
    pub flops: u64,
}

impl BackwardTraffic {
    /// All parts together.
    pub fn total(&self) -> HbmTraffic {
        self.parts().iter().fold(HbmTraffic::default(), |sum, (_, t)| HbmTraffic {
            read_bytes: sum.read_bytes + t.read_bytes,
            written_bytes: sum.written_bytes + t.written_bytes,
        })
    }

    /// The parts with a short name each, in the order of the pass.
    pub fn parts(&self) -> [(&'static str, HbmTraffic); 5] {
        [
            ("D pre-pass (O, dO in; D out)", self.prep),
            ("K, V tiles", self.kv),
            ("Q, dO, lse, D tiles", self.rows),
            ("summed across blocks", self.accumulate),
            ("gradients written once", self.gradients),
        ]
    }
}

/// The HBM traffic of each part of the FA2 backward pass on a problem of `shape`, with `tiles`
/// (`br` query rows by `bc` keys for every loop) and `dQ` summed by `strategy`, counting
/// `elem_bytes` per element — without computing anything, so it runs at any size.
///
/// It walks the tiles the rung walks ([`crate::Mask::tile`]: skipped tiles move nothing) and
/// counts what each loop reads and writes, by the memory model of [`backward`]: for
/// [`DqStrategy::Atomic`] its total is exactly `backward(…).stats.hbm` (tested). The other two
/// strategies apply the same rules to their loops. A model, not a measurement: a GPU's L2 cache
/// serves part of these reads, and its atomics accumulate in `f32` whatever the inputs' type.
pub fn backward_traffic(
    shape: &AttentionShape,
    causal: bool,
    tiles: TileSizes,
    strategy: DqStrategy,
    elem_bytes: usize,
) -> BackwardTraffic {
    let mask = Mask::new(causal, shape.n_q, shape.n_kv);
    // Sums over the computed tiles of one q head (all heads share the mask).
    let (mut tile_rows, mut tile_cols, mut tile_area) = (0u64, 0u64, 0u64);
    for rows in blocks(shape.n_q, tiles.br()) {
        for cols in blocks(shape.n_kv, tiles.bc()) {
            if mask.tile(rows.clone(), cols.clone()) != TileKind::Skip {
                tile_rows += rows.len() as u64;
                tile_cols += cols.len() as u64;
                tile_area += (rows.len() * cols.len()) as u64;
            }
        }
    }
    let (d, n_q, n_kv) = (shape.d as u64, shape.n_q as u64, shape.n_kv as u64);
    let q_heads = (shape.batch * shape.heads_q) as u64;
    let kv_heads = (shape.batch * shape.heads_kv) as u64;
    let bytes = elem_bytes as u64;
    // Element counts to bytes: `read` and `written` per q head (or per kv head, given `heads`).
    let traffic = |heads: u64, read: u64, written: u64| HbmTraffic {
        read_bytes: heads * read * bytes,
        written_bytes: heads * written * bytes,
    };
    let plus = |a: HbmTraffic, b: HbmTraffic| HbmTraffic {
        read_bytes: a.read_bytes + b.read_bytes,
        written_bytes: a.written_bytes + b.written_bytes,
    };
    // Per computed tile: Q_i, dO_i (rows × d each) and lse_i, D_i (one number per row).
    let tile_row_reads = 2 * tile_rows * d + 2 * tile_rows;
    // A whole pass over the query rows, each read once: the same for every row.
    let all_row_reads = 2 * n_q * d + 2 * n_q;
    let products = |per_tile: u64| q_heads * per_tile * 2 * tile_area * d;

    let prep = traffic(q_heads, 2 * n_q * d, n_q);
    match strategy {
        DqStrategy::Atomic => BackwardTraffic {
            prep,
            // K_j, V_j once per kv head (its q heads share them); dK_j, dV_j written once.
            kv: traffic(kv_heads, 2 * n_kv * d, 0),
            rows: traffic(q_heads, tile_row_reads, 0),
            accumulate: traffic(q_heads, tile_rows * d, tile_rows * d),
            gradients: traffic(kv_heads, 0, 2 * n_kv * d),
            flops: products(5),
        },
        DqStrategy::SeparatePass => BackwardTraffic {
            prep,
            // The dK/dV loop as above, then the dQ loop streams K_j, V_j for every query block.
            kv: plus(traffic(kv_heads, 2 * n_kv * d, 0), traffic(q_heads, 2 * tile_cols * d, 0)),
            rows: traffic(q_heads, tile_row_reads + all_row_reads, 0),
            accumulate: HbmTraffic::default(),
            gradients: plus(traffic(kv_heads, 0, 2 * n_kv * d), traffic(q_heads, 0, n_q * d)),
            // dK/dV loop: S, dV, dP, dK; dQ loop: S, dP, dQ.
            flops: products(7),
        },
        DqStrategy::QueryOuter => BackwardTraffic {
            prep,
            kv: traffic(q_heads, 2 * tile_cols * d, 0),
            rows: traffic(q_heads, all_row_reads, 0),
            accumulate: traffic(q_heads, 2 * tile_cols * d, 2 * tile_cols * d),
            gradients: traffic(q_heads, 0, n_q * d),
            flops: products(5),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AttentionOptions;

    /// Inputs of `shape` with entries spread over roughly [-1.5, 1.5], the same on every run.
    fn inputs(shape: &AttentionShape, seed: f64) -> [Array4<f64>; 4] {
        let fill = |dims: [usize; 4], k: f64| {
            Array4::from_shape_fn(dims, |(b, h, i, c)| {
                let x = (b * 131 + h * 31 + i * 7 + c) as f64;
                1.5 * (x * 0.37 + k + seed).sin()
            })
        };
        [
            fill(shape.q_dims(), 0.1),
            fill(shape.kv_dims(), 1.3),
            fill(shape.kv_dims(), 2.9),
            fill(shape.q_dims(), 4.2),
        ]
    }

    fn run(
        shape: &AttentionShape,
        causal: bool,
        tiles: (usize, usize),
    ) -> (Fa2Options, [Array4<f64>; 4], AttentionOutput<f64>) {
        let opts = Fa2Options::new(AttentionOptions { causal, ..Default::default() })
            .with_tiles(tiles.0, tiles.1)
            .unwrap();
        let x = inputs(shape, 0.0);
        let out = forward(x[0].view(), x[1].view(), x[2].view(), &opts).unwrap();
        (opts, x, out)
    }

    fn max_diff(a: &Array4<f64>, b: &Array4<f64>) -> f64 {
        Zip::from(a).and(b).fold(0.0, |m, x, y| f64::max(m, (x - y).abs()))
    }

    #[test]
    fn steps_written_with_loops_give_the_gradients_of_backward() {
        let shape = AttentionShape::new(2, 4, 2, 9, 13, 5).unwrap();
        let (opts, [q, k, v, d_o], out) = run(&shape, true, (4, 3));
        let ours =
            backward(q.view(), k.view(), v.view(), out.o.view(), d_o.view(), out.lse.view(), &opts)
                .unwrap();
        let loops = BackwardSteps::new(
            |o: ArrayView2<'_, f64>, d_o: ArrayView2<'_, f64>| {
                Array1::from_shape_fn(o.nrows(), |i| {
                    (0..o.ncols()).map(|c| o[[i, c]] * d_o[[i, c]]).sum()
                })
            },
            |p: ArrayView2<'_, f64>, dp: ArrayView2<'_, f64>, d: ArrayView1<'_, f64>| {
                Array2::from_shape_fn(p.dim(), |(i, j)| p[[i, j]] * (dp[[i, j]] - d[i]))
            },
        );
        let theirs = backward_with(
            q.view(),
            k.view(),
            v.view(),
            out.o.view(),
            d_o.view(),
            out.lse.view(),
            &opts,
            &loops,
        )
        .unwrap();
        for (a, b) in [(&ours.dq, &theirs.dq), (&ours.dk, &theirs.dk), (&ours.dv, &theirs.dv)] {
            assert!(max_diff(a, b) < 1e-12, "{}", max_diff(a, b));
        }
        assert_eq!(ours.stats, theirs.stats);
    }

    #[test]
    fn a_wrong_delta_or_ds_moves_dq_and_dk_but_not_dv() {
        let shape = AttentionShape::new(1, 2, 1, 7, 7, 4).unwrap();
        let (opts, [q, k, v, d_o], out) = run(&shape, false, (3, 2));
        let (o, lse) = (out.o.view(), out.lse.view());
        let ours = backward(q.view(), k.view(), v.view(), o, d_o.view(), lse, &opts).unwrap();
        // D forgotten (zero), and dS without the shift by D: the same mistake seen from each step.
        let zero_delta = BackwardSteps::new(
            |o: ArrayView2<'_, f64>, _: ArrayView2<'_, f64>| Array1::zeros(o.nrows()),
            ds_tile::<f64>,
        );
        let unshifted_ds = BackwardSteps::new(
            delta_rows::<f64>,
            |p: ArrayView2<'_, f64>, dp: ArrayView2<'_, f64>, _: ArrayView1<'_, f64>| &p * &dp,
        );
        let wrong_zero =
            backward_with(q.view(), k.view(), v.view(), o, d_o.view(), lse, &opts, &zero_delta)
                .unwrap();
        let wrong_unshifted =
            backward_with(q.view(), k.view(), v.view(), o, d_o.view(), lse, &opts, &unshifted_ds)
                .unwrap();
        for wrong in [&wrong_zero, &wrong_unshifted] {
            assert_eq!(wrong.dv, ours.dv, "dV = Pᵀ dO needs neither D nor dS");
            assert!(max_diff(&wrong.dq, &ours.dq) > 1e-2);
            assert!(max_diff(&wrong.dk, &ours.dk) > 1e-2);
        }
        assert!(max_diff(&wrong_zero.dq, &wrong_unshifted.dq) < 1e-12, "the same mistake");
    }

    #[test]
    fn a_step_of_the_wrong_shape_is_an_error() {
        let shape = AttentionShape::new(1, 1, 1, 5, 6, 3).unwrap();
        let (opts, [q, k, v, d_o], out) = run(&shape, true, (2, 4));
        let (o, lse) = (out.o.view(), out.lse.view());
        let long_delta = BackwardSteps::new(
            |o: ArrayView2<'_, f64>, _: ArrayView2<'_, f64>| Array1::zeros(o.nrows() + 1),
            ds_tile::<f64>,
        );
        let err =
            backward_with(q.view(), k.view(), v.view(), o, d_o.view(), lse, &opts, &long_delta)
                .unwrap_err();
        assert!(
            matches!(&err, LadderError::ShapeMismatch(m) if m.contains("delta step returned 6 values for the 5 rows")),
            "{err}"
        );
        let transposed_ds = BackwardSteps::new(
            delta_rows::<f64>,
            |p: ArrayView2<'_, f64>, _: ArrayView2<'_, f64>, _: ArrayView1<'_, f64>| {
                p.t().to_owned()
            },
        );
        let err =
            backward_with(q.view(), k.view(), v.view(), o, d_o.view(), lse, &opts, &transposed_ds)
                .unwrap_err();
        assert!(
            matches!(&err, LadderError::ShapeMismatch(m) if m.contains("dS step returned shape")),
            "{err}"
        );
    }

    #[test]
    fn the_traffic_model_counts_what_the_rung_counts() {
        let problems = [
            (AttentionShape::new(1, 1, 1, 8, 8, 4).unwrap(), false, (4, 4)),
            (AttentionShape::new(2, 6, 2, 13, 29, 5).unwrap(), true, (4, 7)),
            (AttentionShape::new(1, 3, 1, 30, 11, 2).unwrap(), true, (1, 3)),
            (AttentionShape::new(2, 2, 2, 17, 17, 8).unwrap(), false, (17, 5)),
        ];
        for (shape, causal, tiles) in problems {
            let (opts, [q, k, v, d_o], out) = run(&shape, causal, tiles);
            let rung = backward(
                q.view(),
                k.view(),
                v.view(),
                out.o.view(),
                d_o.view(),
                out.lse.view(),
                &opts,
            )
            .unwrap();
            let model = backward_traffic(&shape, causal, opts.tiles, DqStrategy::Atomic, 8);
            assert_eq!(model.total(), rung.stats.hbm, "{shape:?} causal {causal} tiles {tiles:?}");
            // Five products per computed tile, each 2·rows·cols·d FLOPs.
            let computed = rung.stats.tiles.computed() as usize;
            assert!(computed > 0);
            if !causal && shape.n_q % tiles.0 == 0 && shape.n_kv % tiles.1 == 0 {
                let per_tile = 5 * 2 * tiles.0 * tiles.1 * shape.d;
                assert_eq!(model.flops as usize, computed * per_tile);
            }
        }
    }

    #[test]
    fn key_outer_sums_one_tensor_across_blocks_query_outer_two_and_the_separate_pass_none() {
        let shape = AttentionShape::new(2, 4, 4, 256, 256, 64).unwrap();
        let tiles = TileSizes::new(64, 64).unwrap();
        for causal in [false, true] {
            let model = |s| backward_traffic(&shape, causal, tiles, s, 2);
            let (atomic, separate, query_outer) = (
                model(DqStrategy::Atomic),
                model(DqStrategy::SeparatePass),
                model(DqStrategy::QueryOuter),
            );
            // Square tiles: the atomic pass moves dQ_i (rows × d) per tile, the query-outer
            // pass dK_j and dV_j (2 · cols × d).
            assert_eq!(2 * atomic.accumulate.total_bytes(), query_outer.accumulate.total_bytes());
            assert_eq!(separate.accumulate, HbmTraffic::default());
            assert_eq!(5 * separate.flops, 7 * atomic.flops);
            assert_eq!(atomic.flops, query_outer.flops);
            // The separate pass streams K and V a second time instead of moving dQ.
            assert!(separate.kv.read_bytes > atomic.kv.read_bytes);
            assert_eq!(atomic.prep, separate.prep);
        }
        // The causal mask skips nearly half the tiles, and with them their traffic.
        let full = backward_traffic(&shape, false, tiles, DqStrategy::Atomic, 2);
        let causal = backward_traffic(&shape, true, tiles, DqStrategy::Atomic, 2);
        let ratio = causal.rows.read_bytes as f64 / full.rows.read_bytes as f64;
        assert!((ratio - 10.0 / 16.0).abs() < 1e-12, "{ratio}");
    }
}
