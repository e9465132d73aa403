//! Rung 1: naive attention, the way it is written on a blackboard.
//!
//! For each `(batch, head)`:
//!
//! 1. `S = scale · Q Kᵀ` is materialised in full: `n_q × n_kv` numbers.
//! 2. Safe softmax in three passes over each row of `S`: the row max `m`, then
//!    `l = Σ exp(s − m)`, then `P = exp(S − m) / l`.
//! 3. `O = P V`.
//!
//! This is the "standard attention implementation" of the FlashAttention paper (Dao et al. 2022,
//! Algorithm 0): `S` and `P` go to HBM and back, so memory and traffic grow as `N²`. Run in `f64`
//! it is the oracle every other rung is measured against. [`backward`] is the textbook backward
//! pass through the same materialised `P`, and the oracle of the FA2 backward rung.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array1, Array2, Array3, Array4, ArrayView4, ArrayViewMut1, Axis, Zip, s};

use crate::element::Element;
use crate::error::Result;
use crate::options::AttentionOptions;
use crate::output::{AttentionOutput, Counters, Gradients};
use crate::problem::{Head, Problem};
use crate::tile::{add_pv, nan_max, shift_of};

/// Naive forward attention: materialises `S` and `P` (`n_q × n_kv` each).
pub fn attention<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &AttentionOptions,
) -> Result<AttentionOutput<T>> {
    let problem = Problem::new(q, k, v, opts)?;
    let shape = problem.shape;
    let (n_q, n_kv, d) = (shape.n_q, shape.n_kv, shape.d);
    let counters = Counters::new(size_of::<T>());

    let (o, lse) = problem.per_head(|head, mut o, mut lse| {
        let p = probabilities(&head, lse.view_mut());
        // HBM model: read Q, K; write S; read S, write P; read P, V; write O and lse.
        counters.read(n_q * d + n_kv * d);
        counters.write(n_q * n_kv);
        counters.read(n_q * n_kv);
        counters.write(n_q * n_kv);
        counters.read(n_q * n_kv + n_kv * d);
        counters.write(n_q * d + n_q);

        o.fill(T::zero());
        if opts.causal || opts.window.is_some() || opts.mask_mod.is_some() {
            // Each row multiplies only the V rows it sees: a NaN in a masked V row stays out.
            let limits: Vec<_> = (0..n_q).map(|i| head.row_runs(i)).collect();
            add_pv(&mut o, T::one(), p.view(), head.v, Some(&limits));
        } else {
            general_mat_mul(T::one(), &p, &head.v, T::zero(), &mut o);
        }
    });
    Ok(AttentionOutput { o, lse, stats: counters.stats(shape.batch * shape.heads_q) })
}

/// The attention weights `P = softmax(scale · Q Kᵀ + mask)`, shape `[batch, heads_q, n_q, n_kv]`,
/// masked entries exactly 0 (a row that sees no key is all zeros). Useful for plots, and for
/// the magnitudes of the backward pass's terms.
pub fn weights<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &AttentionOptions,
) -> Result<Array4<T>> {
    let problem = Problem::new(q, k, v, opts)?;
    let shape = problem.shape;
    let mut p = Array4::zeros((shape.batch, shape.heads_q, shape.n_q, shape.n_kv));
    let mut lse = Array1::zeros(shape.n_q);
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            p.slice_mut(s![b, h, .., ..])
                .assign(&probabilities(&problem.head(b, h), lse.view_mut()));
        }
    }
    Ok(p)
}

/// The normalised attention probabilities `P = softmax(scale · Q Kᵀ + mask)` of one head, with
/// masked entries exactly 0, written the naive way: materialise `S`, then three passes per row.
/// Writes each row's log-sum-exp into `lse`.
pub(crate) fn probabilities<T: Element>(
    head: &Head<'_, T>,
    mut lse: ArrayViewMut1<T>,
) -> Array2<T> {
    let mut p = Array2::zeros((head.q.nrows(), head.k.nrows()));
    general_mat_mul(head.scale, &head.q, &head.k.t(), T::zero(), &mut p);
    head.modify(&mut p, 0, 0);
    for (i, mut row) in p.rows_mut().into_iter().enumerate() {
        let seen = head.mask.visible(i);
        row.slice_mut(s![..seen.start]).fill(T::zero());
        row.slice_mut(s![seen.end..]).fill(T::zero());
        // Inside the band, the pairs a mask modifier hides are −∞ logits: P = 0 after pass 2.
        if head.mask_mod.is_some() {
            for j in seen.clone().filter(|&j| !head.sees(i, j)) {
                row[j] = T::neg_infinity();
            }
        }
        let mut visible = row.slice_mut(s![seen]);
        // A sink is one more logit in the row, whose probability multiplies a value of zero.
        let sink = head.sink.unwrap_or(T::neg_infinity());
        // Pass 1: the row max (NaN-propagating, so a NaN score poisons its row, as it should).
        let m = visible.iter().fold(sink, |m, &x| nan_max(m, x));
        // Pass 2: exponentials and their sum.
        let shift = shift_of(m);
        visible.mapv_inplace(|x| (x - shift).exp());
        let l: T = visible.iter().copied().sum::<T>() + (sink - shift).exp();
        // Pass 3: normalise. A row with nothing to attend to (and no sink) gets P = 0 and
        // lse = −∞.
        if l == T::zero() {
            visible.fill(T::zero());
            lse[i] = T::neg_infinity();
        } else {
            let inv = l.recip();
            visible.mapv_inplace(|x| x * inv);
            lse[i] = m + l.ln();
        }
    }
    p
}

/// The textbook backward pass: given the upstream gradient `dO`, returns `dQ, dK, dV`.
///
/// With `P` recomputed as in the forward pass and `dS = P ∘ (dP − D)` where `dP = dO Vᵀ` and
/// `D_i = Σ_j P_ij dP_ij`:
/// `dV = Pᵀ dO`, `dQ = scale · dS K`, `dK = scale · dSᵀ Q`. With grouped-query attention the
/// gradients of the q heads that share a kv head are summed into that head's `dK, dV`. With a
/// score modifier `t = score_mod(s)`, `dS` is the logits' gradient times `∂t/∂s`. With sinks,
/// `P` is the forward's (the sink in every row's sum) and the sinks get their gradient
/// ([`crate::sinks`]).
pub fn backward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    d_o: ArrayView4<T>,
    opts: &AttentionOptions,
) -> Result<Gradients<T>> {
    let problem = Problem::backward(q, k, v, opts)?;
    let shape = problem.shape;
    shape.expect_like_q("dO", &d_o)?;
    let (n_q, n_kv, d, group) = (shape.n_q, shape.n_kv, shape.d, shape.group());
    let counters = Counters::new(size_of::<T>());

    let kv_heads = shape.batch * shape.heads_kv;
    let mut dq = Array4::zeros((kv_heads, group, n_q, d));
    let mut dk = Array3::zeros((kv_heads, n_kv, d));
    let mut dv = Array3::zeros((kv_heads, n_kv, d));
    Zip::indexed(dq.outer_iter_mut())
        .and(dk.outer_iter_mut())
        .and(dv.outer_iter_mut())
        .par_for_each(|i, mut dq, mut dk, mut dv| {
            let (b, kh) = (i / shape.heads_kv, i % shape.heads_kv);
            for g in 0..group {
                let h = kh * group + g;
                let head = problem.head(b, h);
                let d_o = d_o.slice(s![b, h, .., ..]);
                let mut lse = Array1::zeros(n_q);
                let p = probabilities(&head, lse.view_mut());
                let (q, k, v, scale) = (head.q, head.k, head.v, head.scale);
                // dV += Pᵀ dO
                general_mat_mul(T::one(), &p.t(), &d_o, T::one(), &mut dv);
                // dP = dO Vᵀ, then dS = P ∘ (dP − D) in place.
                let mut ds = Array2::zeros((n_q, n_kv));
                general_mat_mul(T::one(), &d_o, &v.t(), T::zero(), &mut ds);
                for (mut ds_row, p_row) in ds.rows_mut().into_iter().zip(p.rows()) {
                    let d_i =
                        Zip::from(&ds_row).and(&p_row).fold(T::zero(), |acc, &dp, &p| acc + dp * p);
                    Zip::from(&mut ds_row).and(&p_row).for_each(|ds, &p| *ds = p * (*ds - d_i));
                }
                chain_score_mod(&head, &mut ds, 0, 0);
                general_mat_mul(scale, &ds, &k, T::zero(), &mut dq.index_axis_mut(Axis(0), g));
                general_mat_mul(scale, &ds.t(), &q, T::one(), &mut dk);
                // HBM model: recompute S and P as the forward does, then P, dP, dS round-trip.
                counters.read(2 * n_q * d + n_kv * d + n_q * n_kv);
                counters.write(2 * n_q * n_kv);
                counters.read(3 * n_q * n_kv + 2 * n_q * d + 2 * n_kv * d);
                counters.write(2 * n_q * n_kv + n_q * d);
            }
            counters.write(2 * n_kv * d);
        });
    // The sinks' gradient, by its definition: −Σᵢ P_i,sink · Dᵢ with Dᵢ = dOᵢ · Oᵢ.
    let dsinks = match problem.sinks {
        Some(sinks) => {
            let out = attention(q, k, v, opts)?;
            let delta = (&out.o * &d_o).sum_axis(Axis(3));
            Some(crate::sinks::gradient(sinks, out.lse.view(), delta.view()))
        }
        None => None,
    };
    Ok(Gradients {
        dq: dq.into_shape_with_order(shape.q_dims()).expect("standard layout"),
        dk: dk.into_shape_with_order(shape.kv_dims()).expect("standard layout"),
        dv: dv.into_shape_with_order(shape.kv_dims()).expect("standard layout"),
        dsinks,
        stats: counters.stats(kv_heads),
    })
}

/// `dS ∘= ∂t/∂s` on the tile of rows `rows_start …` and keys `cols_start …` of `head`, for its
/// score modifier `t = score_mod(s)` (nothing without one): the chain rule from the logits'
/// gradient to the scores'. The scores are recomputed, as a backward kernel would.
pub(crate) fn chain_score_mod<T: Element>(
    head: &Head<'_, T>,
    ds: &mut Array2<T>,
    rows_start: usize,
    cols_start: usize,
) {
    let Some(score_mod) = head.score_mod else { return };
    let (rows, cols) = ds.dim();
    let mut s = Array2::zeros((rows, cols));
    let q = head.q.slice(s![rows_start..rows_start + rows, ..]);
    let k = head.k.slice(s![cols_start..cols_start + cols, ..]);
    general_mat_mul(head.scale, &q, &k.t(), T::zero(), &mut s);
    Zip::indexed(ds).and(&s).for_each(|(r, c), ds, &s| {
        if *ds != T::zero() {
            let at = head.index(rows_start + r, cols_start + c);
            let t = score_mod.apply(s.as_f64(), &at);
            *ds = *ds * T::of(score_mod.derivative(s.as_f64(), t, &at));
        }
    });
}
