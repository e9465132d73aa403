//! Baselines for the GPU rungs, which read 16-bit inputs, multiply 16-bit operands with `f32`
//! accumulation, and write 16-bit outputs.
//!
//! The ladder's rule (`docs/conventions.md`, "Tolerances") is that a rung may be off the oracle by about twice the error of the naive
//! algorithm *in the same precision*. For a 16-bit GPU kernel "the same precision" means: the
//! probabilities `P` rounded to 16 bits before they multiply `V` (they are a tensor-core operand),
//! and `O` rounded to 16 bits when it is stored; products and sums are `f32` or better. These
//! functions compute that naive algorithm exactly (in `f64`) apart from those roundings, the way
//! FlashAttention's own tests compare against PyTorch run in the low precision.

use half::{bf16, f16};
use ladder_reference::{
    AttentionOptions, AttentionOutput, Gradients, LadderError, ScoreIndex, naive,
};
use ndarray::{Array1, Array2, Array4, ArrayView2, ArrayView4, Axis, s};

/// A 16-bit storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// IEEE binary16 (11-bit significand).
    F16,
    /// bfloat16 (8-bit significand).
    BF16,
}

impl Half {
    /// Round `x` to this format (nearest, ties to even) and back.
    pub fn round(self, x: f64) -> f64 {
        match self {
            Half::F16 => f16::from_f64(x).to_f64(),
            Half::BF16 => bf16::from_f64(x).to_f64(),
        }
    }

    /// Round every entry.
    pub fn round_all<D: ndarray::Dimension>(
        self,
        x: &ndarray::Array<f64, D>,
    ) -> ndarray::Array<f64, D> {
        x.mapv(|v| self.round(v))
    }
}

/// Naive attention with `P` and `O` rounded to `half` (everything else exact), on inputs that are
/// already `half` values. `lse` is exact.
pub fn attention(
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
    opts: &AttentionOptions,
    half: Half,
) -> Result<AttentionOutput<f64>, LadderError> {
    let mut out = naive::attention(q, k, v, opts)?;
    let p = half.round_all(&naive::weights(q, k, v, opts)?);
    let (batch, heads_q, _, _) = q.dim();
    let group = heads_q / k.dim().1;
    for b in 0..batch {
        for h in 0..heads_q {
            let pv = p.slice(s![b, h, .., ..]).dot(&v.slice(s![b, h / group, .., ..]));
            out.o.slice_mut(s![b, h, .., ..]).assign(&pv.mapv(|x| half.round(x)));
        }
    }
    Ok(out)
}

/// `∂t/∂s` of the score modifier at every score of head `(b, h)` (ones without a modifier): the
/// factor from the logits' gradient to the scores'.
fn slopes(
    opts: &AttentionOptions,
    (q, k): (ArrayView2<f64>, ArrayView2<f64>),
    scale: f64,
    (b, h): (usize, usize),
) -> Array2<f64> {
    let (n_q, n_kv) = (q.nrows(), k.nrows());
    let Some(m) = &opts.score_mod else { return Array2::ones((n_q, n_kv)) };
    let s = q.dot(&k.t()) * scale;
    Array2::from_shape_fn((n_q, n_kv), |(i, j)| {
        let at = ScoreIndex { batch: b, head: h, q: i, kv: j, n_q, n_kv };
        m.derivative(s[[i, j]], m.apply(s[[i, j]], &at), &at)
    })
}

/// The naive backward pass with the 16-bit roundings of a tensor-core kernel: `P` and
/// `dS = P ∘ (dP − D)` (times the score modifier's `∂t/∂s`) rounded to `half` (they are matmul
/// operands), `D = rowsum(dO ∘ O)` from the
/// forward's output as it is stored — `O = P V` with `P` rounded to `half` as the forward kernel's
/// operand, then `O` rounded ([`attention`]'s) — (FlashAttention's `D`: where `dP − D` nearly
/// cancels, O's roundings are most of dS), the gradients rounded to `half` when stored; `dP` and
/// the sums exact. (With `O` from the exact `P`, a bf16 case of 25 queries against 184 keys at
/// d = 16 put the GPU's dK at 2.6× this baseline's largest error; with the forward's rounding of
/// `P`, this baseline reproduces the GPU's errors to two digits.)
pub fn backward(
    q: ArrayView4<f64>,
    k: ArrayView4<f64>,
    v: ArrayView4<f64>,
    d_o: ArrayView4<f64>,
    opts: &AttentionOptions,
    half: Half,
) -> Result<Gradients<f64>, LadderError> {
    let exact = naive::backward(q, k, v, d_o, opts)?;
    let p = naive::weights(q, k, v, opts)?;
    let (batch, heads_q, _, d) = q.dim();
    let group = heads_q / k.dim().1;
    let scale = opts.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mut dq = Array4::zeros(q.dim());
    let mut dk = Array4::zeros(k.dim());
    let mut dv = Array4::zeros(v.dim());
    // The sinks' gradient as the kernels take it: −Σᵢ exp(σ − lseᵢ) Dᵢ, D from the stored O.
    let lse = match &opts.sinks {
        Some(_) => Some(naive::attention(q, k, v, opts)?.lse),
        None => None,
    };
    let mut dsinks = opts.sinks.as_ref().map(|s| Array1::<f64>::zeros(s.len()));
    for b in 0..batch {
        for h in 0..heads_q {
            let kv = h / group;
            let (q_h, k_h, v_h) =
                (q.slice(s![b, h, .., ..]), k.slice(s![b, kv, .., ..]), v.slice(s![b, kv, .., ..]));
            let do_h = d_o.slice(s![b, h, .., ..]);
            let p_h = p.slice(s![b, h, .., ..]);
            let dp = do_h.dot(&v_h.t());
            let p_r = p_h.mapv(|x| half.round(x));
            let o_r = p_r.dot(&v_h).mapv(|x| half.round(x));
            let rowsum = (&do_h * &o_r).sum_axis(Axis(1)).insert_axis(Axis(1));
            if let (Some(sinks), Some(lse), Some(dsinks)) = (&opts.sinks, &lse, &mut dsinks) {
                let p_sink = lse.slice(s![b, h, ..]).mapv(|l| (sinks[h] - l).exp());
                dsinks[h] -= p_sink.dot(&rowsum.column(0));
            }
            let ds = &p_h * &(&dp - &rowsum) * &slopes(opts, (q_h, k_h), scale, (b, h));
            let ds = ds.mapv(|x| half.round(x));
            let mut dv_h = dv.slice_mut(s![b, kv, .., ..]);
            dv_h += &p_r.t().dot(&do_h);
            let mut dk_h = dk.slice_mut(s![b, kv, .., ..]);
            dk_h += &(ds.t().dot(&q_h) * scale);
            dq.slice_mut(s![b, h, .., ..]).assign(&(ds.dot(&k_h) * scale));
        }
    }
    Ok(Gradients {
        dq: half.round_all(&dq),
        dk: half.round_all(&dk),
        dv: half.round_all(&dv),
        dsinks,
        stats: exact.stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cases::{Case, CaseSpace};
    use crate::metrics::error;

    #[test]
    fn rounded_naive_is_close_to_exact_but_not_equal() {
        let case = Case {
            shape: ladder_reference::AttentionShape::new(1, 2, 1, 33, 47, 16).unwrap(),
            causal: true,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: ladder_reference::TileSizes::new(8, 8).unwrap(),
            splits: 1,
            seed: 7,
        };
        let _ = CaseSpace::cpu();
        let x = case.inputs::<f64>();
        let x = [&x.q, &x.k, &x.v, &x.d_o].map(|t| Half::F16.round_all(t));
        let opts = case.attention();
        let exact = naive::attention(x[0].view(), x[1].view(), x[2].view(), &opts).unwrap();
        let low = attention(x[0].view(), x[1].view(), x[2].view(), &opts, Half::F16).unwrap();
        let err = error(&low.o, &exact.o);
        // fp16 rounding of P and O: relative errors of order 2^-11 ≈ 4.9e-4.
        assert!(err.rel_l2 > 1e-5 && err.rel_l2 < 1e-3, "{err:?}");
        let g_exact =
            naive::backward(x[0].view(), x[1].view(), x[2].view(), x[3].view(), &opts).unwrap();
        let g_low =
            backward(x[0].view(), x[1].view(), x[2].view(), x[3].view(), &opts, Half::F16).unwrap();
        for (a, b) in [(&g_low.dq, &g_exact.dq), (&g_low.dk, &g_exact.dk), (&g_low.dv, &g_exact.dv)]
        {
            let e = error(a, b);
            assert!(e.rel_l2 > 1e-5 && e.rel_l2 < 1e-2, "{e:?}");
        }
        // BF16 keeps 3 fewer bits than fp16: its rounding error is ~8x larger.
        let low_bf = attention(x[0].view(), x[1].view(), x[2].view(), &opts, Half::BF16).unwrap();
        assert!(error(&low_bf.o, &exact.o).rel_l2 > 4.0 * err.rel_l2);
    }
}
