//! The float64 oracle and the tolerances a rung is held to on one problem.
//!
//! [`Expected::new`] runs the oracle (the naive rung in `f64` on the same inputs) and the naive
//! rung in the precision under test; the latter's error sets the tolerance
//! ([`crate::metrics`]). [`Expected::fp8`] does the same for the FP8 path, with the FA3 paper's
//! baseline FP8 attention (one scale per tensor, [`fp8_baseline`]) in place of the naive rung.

use ladder_reference::fp8::{Fp8Scaling, Fp8Tensor, round_e4m3};
use ladder_reference::{
    AttentionOptions, AttentionOutput, AttentionShape, Element, Gradients, Mask, Result, naive,
};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, Array4, ArrayView4, s};

use crate::cases::Inputs;
use crate::metrics::{
    ErrorStats, Floor, Tolerance, error, error_between, l2_norm, logit_bound, max_abs,
};

/// Converts a tensor to `f64` (exactly).
pub fn to_f64<T: Element, D: ndarray::Dimension>(
    x: &ndarray::Array<T, D>,
) -> ndarray::Array<f64, D> {
    x.mapv(|v| v.as_f64())
}

/// The oracle's output for a problem, and the tolerances of a rung's output and lse.
#[derive(Debug, Clone)]
pub struct Expected {
    pub oracle: AttentionOutput<f64>,
    /// Tolerance on `O` (relative L2 / max abs against the oracle).
    pub o: Tolerance,
    /// Tolerance on the finite entries of `lse`.
    pub lse: Tolerance,
    /// The baseline's own error (naive in `T`, or baseline FP8), for reports.
    pub baseline: ErrorStats,
}

/// How a rung's result compares with the oracle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    pub o: ErrorStats,
    pub lse: ErrorStats,
    pub pass: bool,
}

impl Expected {
    /// Oracle and tolerances for a rung computing in `T`.
    pub fn new<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        let naive = naive::attention(inputs.q.view(), inputs.k.view(), inputs.v.view(), attention)?;
        Self::with_baseline(inputs, attention, &naive, T::UNIT_ROUNDOFF)
    }

    /// Oracle and tolerances for the FP8 path: twice the relative L2 error of per-tensor FP8
    /// attention ([`fp8_baseline`]), plus the rounding floor of the `T` arithmetic the FP8
    /// products accumulate in.
    ///
    /// Only the relative L2 error is bounded (the RMSE-like statistic the FA3 paper reports).
    /// With a 3-bit mantissa the *maximum* error is the extreme of many independent roundings,
    /// and two equally good FP8 schemes routinely differ by 2× in it on the same problem; it is
    /// reported, not asserted.
    pub fn fp8<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        let baseline = fp8_baseline(inputs.q.view(), inputs.k.view(), inputs.v.view(), attention)?;
        let mut expected = Self::with_baseline(inputs, attention, &baseline, T::UNIT_ROUNDOFF)?;
        expected.o.max_abs = f64::INFINITY;
        expected.lse.max_abs = f64::INFINITY;
        Ok(expected)
    }

    fn with_baseline<T: Element>(
        inputs: &Inputs<T>,
        attention: &AttentionOptions,
        baseline: &AttentionOutput<T>,
        unit_roundoff: f64,
    ) -> Result<Self> {
        let (q, k, v) = (to_f64(&inputs.q), to_f64(&inputs.k), to_f64(&inputs.v));
        let oracle = naive::attention(q.view(), k.view(), v.view(), attention)?;
        let shape = AttentionShape::of(&q.view(), &k.view(), &v.view())?;
        let scale = attention.resolve_scale(&shape)?;
        let bound = logit_bound(q.view(), k.view(), scale);
        let o_floor = Floor::new(
            unit_roundoff,
            shape.d,
            bound,
            max_abs(&v),
            oracle.o.len(),
            l2_norm(&oracle.o),
        );
        let lse_floor = Floor::new(
            unit_roundoff,
            shape.d,
            bound + max_abs(&oracle.lse),
            1.0,
            oracle.lse.len(),
            l2_norm(&oracle.lse),
        );
        let o_err = error(&baseline.o, &oracle.o);
        let lse_err = error(&baseline.lse, &oracle.lse);
        Ok(Self {
            o: Tolerance::from_baseline(o_err, o_floor),
            lse: Tolerance::from_baseline(lse_err, lse_floor),
            baseline: o_err,
            oracle,
        })
    }

    /// Compares a rung's output with the oracle.
    pub fn judge<T: Element>(&self, out: &AttentionOutput<T>) -> Verdict {
        let o = error(&out.o, &self.oracle.o);
        let lse = error(&out.lse, &self.oracle.lse);
        Verdict { o, lse, pass: self.o.admits(o) && self.lse.admits(lse) }
    }
}

/// Compares two rungs' outputs with each other; each may be off the oracle by its own
/// tolerance, so together they may differ by the sum.
pub fn judge_between<T: Element>(
    out: &AttentionOutput<T>,
    previous: &AttentionOutput<T>,
    expected: &Expected,
    expected_previous: &Expected,
) -> Verdict {
    let o = error_between(&out.o, &previous.o);
    let lse = error_between(&out.lse, &previous.lse);
    let pass = expected.o.plus(expected_previous.o).admits(o)
        && expected.lse.plus(expected_previous.lse).admits(lse);
    Verdict { o, lse, pass }
}

/// The FA3 paper's baseline FP8 attention, written the naive way: `Q, K, V` rounded to e4m3
/// with one scale per tensor, `S` and `P̃ = exp(S − m)` materialised, `P̃` rounded to e4m3
/// for the product with `V`, the rest in `T`.
pub fn fp8_baseline<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    attention: &AttentionOptions,
) -> Result<AttentionOutput<T>> {
    let shape = AttentionShape::of(&q, &k, &v)?;
    let scale = T::of(attention.resolve_scale(&shape)?);
    let mask = Mask::new(attention.causal, shape.n_q, shape.n_kv);
    let dequantised =
        |x: ArrayView4<T>| Fp8Tensor::quantize(x, x.dim().2, Fp8Scaling::PerTensor).dequantize();
    let (q, k, v) = (dequantised(q), dequantised(k), dequantised(v));
    let mut o = Array4::zeros(shape.q_dims());
    let mut lse = Array3::zeros((shape.batch, shape.heads_q, shape.n_q));
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kh = shape.kv_head(h);
            let (q, k, v) =
                (q.slice(s![b, h, .., ..]), k.slice(s![b, kh, .., ..]), v.slice(s![b, kh, .., ..]));
            let mut p = Array2::zeros((shape.n_q, shape.n_kv));
            general_mat_mul(scale, &q, &k.t(), T::zero(), &mut p);
            for (i, row) in p.rows().into_iter().enumerate() {
                let end = mask.visible_end(i);
                let m = row.slice(s![..end]).iter().fold(T::neg_infinity(), |m, &x| m.max(x));
                let l: T = row.slice(s![..end]).iter().map(|&x| (x - m).exp()).sum();
                let mut o_row = o.slice_mut(s![b, h, i, ..]);
                if end == 0 || !m.is_finite() {
                    lse[[b, h, i]] = if end == 0 { T::neg_infinity() } else { T::nan() };
                    o_row.fill(if end == 0 { T::zero() } else { T::nan() });
                    continue;
                }
                for j in 0..end {
                    o_row.scaled_add(round_e4m3((row[j] - m).exp()) / l, &v.row(j));
                }
                lse[[b, h, i]] = m + l.ln();
            }
        }
    }
    Ok(AttentionOutput { o, lse, stats: Default::default() })
}

/// Oracle gradients and the tolerances of a backward rung's `dQ, dK, dV`.
#[derive(Debug, Clone)]
pub struct ExpectedGradients {
    pub oracle: Gradients<f64>,
    pub tolerances: [Tolerance; 3],
}

impl ExpectedGradients {
    /// Runs the naive backward pass in `f64` (oracle) and in `T` (baseline).
    pub fn new<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        let (q, k, v, d_o) =
            (to_f64(&inputs.q), to_f64(&inputs.k), to_f64(&inputs.v), to_f64(&inputs.d_o));
        let oracle = naive::backward(q.view(), k.view(), v.view(), d_o.view(), attention)?;
        let baseline = naive::backward(
            inputs.q.view(),
            inputs.k.view(),
            inputs.v.view(),
            inputs.d_o.view(),
            attention,
        )?;
        let shape = AttentionShape::of(&q.view(), &k.view(), &v.view())?;
        let bound = logit_bound(q.view(), k.view(), attention.resolve_scale(&shape)?);
        let magnitudes = term_magnitudes(&q, &k, &v, &d_o, attention)?;
        let pairs =
            [(&baseline.dq, &oracle.dq), (&baseline.dk, &oracle.dk), (&baseline.dv, &oracle.dv)];
        let tolerances = std::array::from_fn(|t| {
            let (base, reference) = pairs[t];
            let floor = Floor::new(
                T::UNIT_ROUNDOFF,
                shape.d,
                bound,
                magnitudes[t],
                reference.len(),
                l2_norm(reference),
            );
            Tolerance::from_baseline(error(base, reference), floor)
        });
        Ok(Self { oracle, tolerances })
    }

    /// Errors of `dQ, dK, dV` against the oracle and whether all three pass.
    pub fn judge<T: Element>(&self, grads: &Gradients<T>) -> ([ErrorStats; 3], bool) {
        let errs = [
            error(&grads.dq, &self.oracle.dq),
            error(&grads.dk, &self.oracle.dk),
            error(&grads.dv, &self.oracle.dv),
        ];
        let pass = errs.iter().zip(&self.tolerances).all(|(e, t)| t.admits(*e));
        (errs, pass)
    }
}

/// The largest sum of absolute terms behind an entry of `dQ`, `dK` and `dV`: the magnitude the
/// rounding errors of the backward pass scale with. Gradients cancel (with a single key,
/// `dQ = dK = 0` exactly), so the entries themselves can be far smaller than their errors.
///
/// With `G_ij = |dOᵢ|·|vⱼ|` bounding `|dP_ij|`, `Dᵢ^abs = Σⱼ P_ij G_ij` bounding `|Dᵢ|` and
/// `dS^abs = P ∘ (G + D^abs)`: `dQ ~ scale · dS^abs |K|`, `dK ~ scale · dS^absᵀ |Q|`,
/// `dV ~ Pᵀ |dO|` (summed over the q heads of a GQA group).
fn term_magnitudes(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    d_o: &Array4<f64>,
    attention: &AttentionOptions,
) -> Result<[f64; 3]> {
    let p = naive::weights(q.view(), k.view(), v.view(), attention)?;
    let shape = AttentionShape::of(&q.view(), &k.view(), &v.view())?;
    let scale = attention.resolve_scale(&shape)?.abs();
    let (abs_q, abs_k, abs_v, abs_do) =
        (q.mapv(f64::abs), k.mapv(f64::abs), v.mapv(f64::abs), d_o.mapv(f64::abs));
    let mut mags = [0.0f64; 3];
    let mut dk_abs = Array4::<f64>::zeros(shape.kv_dims());
    let mut dv_abs = Array4::<f64>::zeros(shape.kv_dims());
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kh = shape.kv_head(h);
            let p = p.slice(s![b, h, .., ..]);
            let (k, v) = (abs_k.slice(s![b, kh, .., ..]), abs_v.slice(s![b, kh, .., ..]));
            let (q, d_o) = (abs_q.slice(s![b, h, .., ..]), abs_do.slice(s![b, h, .., ..]));
            let g = d_o.dot(&v.t());
            let d_abs = (&p * &g).sum_axis(ndarray::Axis(1));
            let ds_abs = &p * &(&g + &d_abs.insert_axis(ndarray::Axis(1)));
            mags[0] = mags[0].max(max_abs(&(ds_abs.dot(&k) * scale)));
            let mut dk = dk_abs.slice_mut(s![b, kh, .., ..]);
            dk += &(ds_abs.t().dot(&q) * scale);
            let mut dv = dv_abs.slice_mut(s![b, kh, .., ..]);
            dv += &p.t().dot(&d_o);
        }
    }
    mags[1] = max_abs(&dk_abs);
    mags[2] = max_abs(&dv_abs);
    Ok(mags)
}

/// Checks `out` against the oracle and, when given, against the previous rung's output; the
/// error message names what was compared and by how much it missed.
pub fn check<T: Element>(
    label: &str,
    out: &AttentionOutput<T>,
    expected: &Expected,
    previous: Option<(&str, &AttentionOutput<T>, &Expected)>,
) -> std::result::Result<(), String> {
    let verdict = expected.judge(out);
    if !verdict.pass {
        return Err(format!(
            "{label} ({}) vs oracle: O {} (tol {}), lse {} (tol {})",
            T::NAME,
            verdict.o,
            expected.o,
            verdict.lse,
            expected.lse
        ));
    }
    if let Some((prev_label, prev_out, prev_expected)) = previous {
        let pair = judge_between(out, prev_out, expected, prev_expected);
        if !pair.pass {
            return Err(format!(
                "{label} ({}) vs {prev_label}: O {} (tol {}), lse {} (tol {})",
                T::NAME,
                pair.o,
                expected.o.plus(prev_expected.o),
                pair.lse,
                expected.lse.plus(prev_expected.lse)
            ));
        }
    }
    Ok(())
}
