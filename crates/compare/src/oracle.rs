//! The float64 oracle and the tolerances a rung is held to on one problem.
//!
//! [`Oracle`] holds the float64 answers for a problem (the naive rung run in `f64` on the same
//! inputs) and the magnitudes the tolerances scale with; it is computed once and serves every
//! rung in every precision. [`Expected`] adds the tolerance for one precision: the error of the
//! naive rung in that precision sets it ([`crate::metrics`]). [`Expected::fp8_from_oracle`] does
//! the same for the FP8 path, with the FA3 paper's baseline FP8 attention (one scale per
//! tensor, [`fp8_baseline`]) in place of the naive rung. [`GradientOracle`] and
//! [`ExpectedGradients`] are the same for the backward pass.

use ladder_reference::fp8::{Fp8Scaling, Fp8Tensor, RandomHadamard, round_e4m3};
use ladder_reference::{
    AttentionOptions, AttentionOutput, AttentionShape, Element, Fp8Options, Gradients, Result,
    ScoreIndex, naive,
};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array1, Array2, Array3, Array4, ArrayView4, Axis, s};

use crate::cases::Inputs;
use crate::metrics::{
    ErrorStats, Floor, Tolerance, error, error_between, logit_bound, max_abs, worst_entry,
};

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

/// The float64 answer to one problem, and what its tolerances scale with.
#[derive(Debug, Clone)]
pub struct Oracle {
    pub attention: AttentionOptions,
    pub shape: AttentionShape,
    pub out: AttentionOutput<f64>,
    /// `Σⱼ Pᵢⱼ |vⱼ|`: the size of the terms behind each entry of `O`.
    o_terms: Array4<f64>,
    /// A bound on every logit ([`logit_bound`]).
    logit_bound: f64,
}

impl Oracle {
    /// Runs the naive rung in `f64` on `inputs` (widened exactly).
    pub fn new<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        let Inputs { q, k, v, .. } = inputs.widen();
        let out = naive::attention(q.view(), k.view(), v.view(), attention)?;
        let shape = AttentionShape::of(&q.view(), &k.view(), &v.view())?;
        let bound = modified_logit_bound(&q, &k, attention, &shape)?;
        // The terms behind O: attention over |V|.
        let o_terms = naive::attention(q.view(), k.view(), v.mapv(f64::abs).view(), attention)?.o;
        Ok(Self { attention: attention.clone(), shape, out, o_terms, logit_bound: bound })
    }
}

impl Expected {
    /// Oracle and tolerances for a rung computing in `T` (computes the [`Oracle`]).
    pub fn new<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        Self::from_oracle(&Oracle::new(inputs, attention)?, inputs)
    }

    /// Tolerances for a rung computing in `T` on the oracle's inputs.
    pub fn from_oracle<T: Element>(oracle: &Oracle, inputs: &Inputs<T>) -> Result<Self> {
        let naive =
            naive::attention(inputs.q.view(), inputs.k.view(), inputs.v.view(), &oracle.attention)?;
        Ok(Self::with_baseline::<T>(oracle, &naive))
    }

    /// Like [`Expected::fp8_from_oracle`], computing the [`Oracle`].
    pub fn fp8<T: Element>(
        inputs: &Inputs<T>,
        attention: &AttentionOptions,
        fp8: &Fp8Options,
    ) -> Result<Self> {
        Self::fp8_from_oracle(&Oracle::new(inputs, attention)?, inputs, fp8)
    }

    /// Tolerances for the FP8 path with options `fp8`: twice the relative L2 error of
    /// per-tensor FP8 attention ([`fp8_baseline`]) on the same inputs — rotated by the same
    /// random Hadamard map when the path uses incoherent processing, so that the two see the
    /// same numbers and differ only in block scales, tiling and schedule — plus the rounding
    /// floor of the `T` arithmetic the FP8 products accumulate in. (What the rotation itself
    /// buys is measured separately, on inputs with outliers.)
    ///
    /// Only the relative L2 error of `O` is bounded (the RMSE-like statistic the FA3 paper
    /// reports). With a 3-bit mantissa, two equally good FP8 schemes round the same numbers
    /// independently (a different scale shifts every mantissa), so their errors are two
    /// random draws: over the `n_q · d` entries of `O` the ratio stays within ~1.3, but the
    /// *maximum* error, and `lse` (one number per row, set by its few largest logits), are
    /// extremes or small samples whose ratio reaches 2 on equally good results. Both are
    /// reported, not asserted.
    pub fn fp8_from_oracle<T: Element>(
        oracle: &Oracle,
        inputs: &Inputs<T>,
        fp8: &Fp8Options,
    ) -> Result<Self> {
        let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
        let baseline = match fp8.incoherent {
            Some(seed) => {
                let rotation = RandomHadamard::new(q.dim().3, seed);
                fp8_baseline(
                    rotation.apply(q).view(),
                    rotation.apply(k).view(),
                    v,
                    &oracle.attention,
                )?
            }
            None => fp8_baseline(q, k, v, &oracle.attention)?,
        };
        let mut expected = Self::with_baseline::<T>(oracle, &baseline);
        expected.o.max_abs = f64::INFINITY;
        expected.lse = Tolerance { rel_l2: f64::INFINITY, max_abs: f64::INFINITY };
        Ok(expected)
    }

    /// Tolerances for a rung whose arithmetic is `T` but whose operands and outputs are rounded
    /// to a 16-bit format: `baseline` is the naive algorithm with those roundings
    /// ([`crate::low_precision::attention`]), whose error sets the tolerance, and the floor is
    /// that of `T` (the accumulation precision).
    pub fn from_baseline<T: Element>(oracle: &Oracle, baseline: &AttentionOutput<T>) -> Self {
        Self::with_baseline(oracle, baseline)
    }

    fn with_baseline<T: Element>(oracle: &Oracle, baseline: &AttentionOutput<T>) -> Self {
        let (shape, u, bound) = (oracle.shape, T::UNIT_ROUNDOFF, oracle.logit_bound);
        let keys = shape.d + shape.n_kv;
        let o_floor = Floor::new(u, keys, bound, &oracle.o_terms, &oracle.out.o);
        // lse = m + ln l: the logit error plus a rounding of |lse| itself.
        let ones = oracle.out.lse.mapv(|_| 1.0);
        let lse_floor =
            Floor::new(u, keys, bound + max_abs(&oracle.out.lse), &ones, &oracle.out.lse);
        let o_err = error(&baseline.o, &oracle.out.o);
        let lse_err = error(&baseline.lse, &oracle.out.lse);
        Self {
            o: Tolerance::from_baseline(o_err, o_floor),
            lse: Tolerance::from_baseline(lse_err, lse_floor),
            baseline: o_err,
            oracle: oracle.out.clone(),
        }
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
    // Q and K may be wider than V (after a rotation padded to a power of two): check the
    // shape on V's head dim, the scale on the original one.
    let (b, hq, nq, width) = q.dim();
    let (_, hkv, nkv, d) = v.dim();
    if k.dim() != (b, hkv, nkv, width) {
        return Err(ladder_reference::LadderError::ShapeMismatch(format!(
            "fp8 baseline: q {:?}, k {:?}, v {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        )));
    }
    let shape = AttentionShape::new(b, hq, hkv, nq, nkv, d)?;
    let scale = T::of(attention.resolve_scale(&shape)?);
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
                let at = |j| ScoreIndex { batch: b, head: h, q: i, kv: j, n_q: nq, n_kv: nkv };
                let keys: Vec<usize> = (0..nkv).filter(|&j| attention.sees(&at(j))).collect();
                let m = keys.iter().fold(T::neg_infinity(), |m, &j| m.max(row[j]));
                let l: T = keys.iter().map(|&j| (row[j] - m).exp()).sum();
                let mut o_row = o.slice_mut(s![b, h, i, ..]);
                if keys.is_empty() || !m.is_finite() {
                    lse[[b, h, i]] = if keys.is_empty() { T::neg_infinity() } else { T::nan() };
                    o_row.fill(if keys.is_empty() { T::zero() } else { T::nan() });
                    continue;
                }
                for j in keys {
                    o_row.scaled_add(round_e4m3((row[j] - m).exp()) / l, &v.row(j));
                }
                lse[[b, h, i]] = m + l.ln();
            }
        }
    }
    Ok(AttentionOutput { o, lse, stats: Default::default() })
}

/// A bound on every logit ([`logit_bound`]), and with a score modifier, plus the largest modified
/// logit `|score_mod(s)|` of a visible pair: the modifier's own arithmetic (ALiBi's subtraction of
/// a bias that grows with the distance) rounds in proportion to it.
fn modified_logit_bound(
    q: &Array4<f64>,
    k: &Array4<f64>,
    attention: &AttentionOptions,
    shape: &AttentionShape,
) -> Result<f64> {
    let scale = attention.resolve_scale(shape)?;
    let bound = logit_bound(q.view(), k.view(), scale);
    let Some(score_mod) = &attention.score_mod else { return Ok(bound) };
    let mut largest = 0f64;
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let (q, k) = (q.slice(s![b, h, .., ..]), k.slice(s![b, shape.kv_head(h), .., ..]));
            for i in 0..shape.n_q {
                let (n_q, n_kv) = (shape.n_q, shape.n_kv);
                let pairs =
                    (0..n_kv).map(|j| ScoreIndex { batch: b, head: h, q: i, kv: j, n_q, n_kv });
                for at in pairs.filter(|at| attention.sees(at)) {
                    let j = at.kv;
                    let t = score_mod.apply(scale * q.row(i).dot(&k.row(j)), &at);
                    if t.is_finite() {
                        largest = largest.max(t.abs());
                    }
                }
            }
        }
    }
    Ok(bound + largest)
}

/// Oracle gradients and the tolerances of a backward rung's `dQ, dK, dV`.
/// The float64 gradients of one problem, and what their tolerances scale with.
#[derive(Debug, Clone)]
pub struct GradientOracle {
    pub attention: AttentionOptions,
    pub shape: AttentionShape,
    pub grads: Gradients<f64>,
    /// The size of the terms behind each entry of `dQ, dK, dV` ([`term_magnitudes`]).
    magnitudes: [Array4<f64>; 3],
    /// The same for the sinks' gradient ([`sink_magnitudes`]; `None` without sinks).
    sink_magnitudes: Option<Array1<f64>>,
    logit_bound: f64,
}

impl GradientOracle {
    /// Runs the naive backward pass in `f64` on `inputs` (widened exactly).
    pub fn new<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        let Inputs { q, k, v, d_o } = inputs.widen();
        let grads = naive::backward(q.view(), k.view(), v.view(), d_o.view(), attention)?;
        let shape = AttentionShape::of(&q.view(), &k.view(), &v.view())?;
        let logit_bound = modified_logit_bound(&q, &k, attention, &shape)?;
        let (magnitudes, d_abs) = term_magnitudes(&q, &k, &v, &d_o, attention)?;
        let sink_magnitudes = match &attention.sinks {
            Some(sinks) => {
                let lse = naive::attention(q.view(), k.view(), v.view(), attention)?.lse;
                Some(sink_magnitudes(sinks, &lse, &d_abs))
            }
            None => None,
        };
        let attention = attention.clone();
        Ok(Self { attention, shape, grads, magnitudes, sink_magnitudes, logit_bound })
    }
}

/// Oracle gradients and the tolerances of a backward rung's `dQ, dK, dV` in one precision.
#[derive(Debug, Clone)]
pub struct ExpectedGradients {
    pub oracle: Gradients<f64>,
    pub tolerances: [Tolerance; 3],
    /// The tolerance of the sinks' gradient (`None` without sinks).
    pub dsinks: Option<Tolerance>,
}

impl ExpectedGradients {
    /// Like [`ExpectedGradients::from_oracle`], computing the [`GradientOracle`].
    pub fn new<T: Element>(inputs: &Inputs<T>, attention: &AttentionOptions) -> Result<Self> {
        Self::from_oracle(&GradientOracle::new(inputs, attention)?, inputs)
    }

    /// Runs the naive backward pass in `T` (the baseline) against the oracle's gradients.
    pub fn from_oracle<T: Element>(oracle: &GradientOracle, inputs: &Inputs<T>) -> Result<Self> {
        let (q, k, v, d_o) = (inputs.q.view(), inputs.k.view(), inputs.v.view(), inputs.d_o.view());
        let baseline = naive::backward(q, k, v, d_o, &oracle.attention)?;
        Ok(Self::from_baseline(oracle, &baseline))
    }

    /// Tolerances from a given baseline's gradients (for GPU rungs: the naive backward pass with
    /// 16-bit roundings, [`crate::low_precision::backward`]), with the rounding floor of `T`.
    pub fn from_baseline<T: Element>(oracle: &GradientOracle, baseline: &Gradients<T>) -> Self {
        let shape = oracle.shape;
        let reference = &oracle.grads;
        let pairs = [
            (&baseline.dq, &reference.dq),
            (&baseline.dk, &reference.dk),
            (&baseline.dv, &reference.dv),
        ];
        let tolerances = std::array::from_fn(|t| {
            let (base, reference) = pairs[t];
            // dQ sums over keys; dK and dV over the rows of every q head of the group.
            let n = if t == 0 { shape.n_kv } else { shape.n_q * shape.group() };
            let floor = Floor::new(
                T::UNIT_ROUNDOFF,
                shape.d + n,
                oracle.logit_bound,
                &oracle.magnitudes[t],
                reference,
            );
            Tolerance::from_baseline(error(base, reference), floor)
        });
        // dσ sums over every row of every batch entry, each term through lse and D.
        let dsinks = match (&baseline.dsinks, &reference.dsinks, &oracle.sink_magnitudes) {
            (Some(base), Some(reference), Some(magnitudes)) => {
                let terms = shape.batch * shape.n_q + shape.d + shape.n_kv;
                let floor =
                    Floor::new(T::UNIT_ROUNDOFF, terms, oracle.logit_bound, magnitudes, reference);
                Some(Tolerance::from_baseline(error(base, reference), floor))
            }
            _ => None,
        };
        Self { oracle: oracle.grads.clone(), tolerances, dsinks }
    }

    /// Errors of `dQ, dK, dV` against the oracle and whether all three pass (and the sinks'
    /// gradient, [`ExpectedGradients::judge_sinks`], where the problem has sinks).
    pub fn judge<T: Element>(&self, grads: &Gradients<T>) -> ([ErrorStats; 3], bool) {
        let errs = [
            error(&grads.dq, &self.oracle.dq),
            error(&grads.dk, &self.oracle.dk),
            error(&grads.dv, &self.oracle.dv),
        ];
        let pass = errs.iter().zip(&self.tolerances).all(|(e, t)| t.admits(*e));
        let sinks_pass = self.judge_sinks(grads).is_none_or(|(_, _, pass)| pass);
        (errs, pass && sinks_pass)
    }

    /// The sinks' gradient against the oracle's: its error, its tolerance and whether it passes
    /// (`None` without sinks; a rung that returns no gradient for them fails).
    pub fn judge_sinks<T: Element>(
        &self,
        grads: &Gradients<T>,
    ) -> Option<(ErrorStats, Tolerance, bool)> {
        let (reference, tol) = (self.oracle.dsinks.as_ref()?, self.dsinks?);
        let err = match &grads.dsinks {
            Some(got) => error(got, reference),
            None => ErrorStats { rel_l2: f64::INFINITY, max_abs: f64::INFINITY },
        };
        Some((err, tol, tol.admits(err)))
    }
}

/// The largest sum of absolute terms behind an entry of `dQ`, `dK` and `dV`: the magnitude the
/// rounding errors of the backward pass scale with. Gradients cancel (with a single key,
/// `dQ = dK = 0` exactly), so the entries themselves can be far smaller than their errors.
///
/// With `G_ij = |dOᵢ|·|vⱼ|` bounding `|dP_ij|`, `Dᵢ^abs = Σⱼ P_ij G_ij` bounding `|Dᵢ|` and
/// `dS^abs = P ∘ (G + D^abs)`: `dQ ~ scale · dS^abs |K|`, `dK ~ scale · dS^absᵀ |Q|`,
/// `dV ~ Pᵀ |dO|` (summed over the q heads of a GQA group). Also returns `D^abs`,
/// `[batch, heads_q, n_q]`.
fn term_magnitudes(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    d_o: &Array4<f64>,
    attention: &AttentionOptions,
) -> Result<([Array4<f64>; 3], Array3<f64>)> {
    let p = naive::weights(q.view(), k.view(), v.view(), attention)?;
    let shape = AttentionShape::of(&q.view(), &k.view(), &v.view())?;
    let scale = attention.resolve_scale(&shape)?.abs();
    let (abs_q, abs_k, abs_v, abs_do) =
        (q.mapv(f64::abs), k.mapv(f64::abs), v.mapv(f64::abs), d_o.mapv(f64::abs));
    let mut dq_abs = Array4::<f64>::zeros(shape.q_dims());
    let mut dk_abs = Array4::<f64>::zeros(shape.kv_dims());
    let mut dv_abs = Array4::<f64>::zeros(shape.kv_dims());
    let mut d_abs_all = Array3::<f64>::zeros((shape.batch, shape.heads_q, shape.n_q));
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kh = shape.kv_head(h);
            let p = p.slice(s![b, h, .., ..]);
            let (k, v) = (abs_k.slice(s![b, kh, .., ..]), abs_v.slice(s![b, kh, .., ..]));
            let (q, d_o) = (abs_q.slice(s![b, h, .., ..]), abs_do.slice(s![b, h, .., ..]));
            let g = d_o.dot(&v.t());
            let d_abs = (&p * &g).sum_axis(Axis(1));
            d_abs_all.slice_mut(s![b, h, ..]).assign(&d_abs);
            let ds_abs = &p * &(&g + &d_abs.insert_axis(Axis(1)));
            dq_abs.slice_mut(s![b, h, .., ..]).assign(&(ds_abs.dot(&k) * scale));
            let mut dk = dk_abs.slice_mut(s![b, kh, .., ..]);
            dk += &(ds_abs.t().dot(&q) * scale);
            let mut dv = dv_abs.slice_mut(s![b, kh, .., ..]);
            dv += &p.t().dot(&d_o);
        }
    }
    Ok(([dq_abs, dk_abs, dv_abs], d_abs_all))
}

/// The size of the terms behind the sinks' gradient, `Σ_{b,i} P_i,sink · Dᵢ^abs` per head, with
/// `P_i,sink = e^(σ_h − lseᵢ)` and [`term_magnitudes`]'s `D^abs` bounding `|Dᵢ|`.
fn sink_magnitudes(sinks: &[f64], lse: &Array3<f64>, d_abs: &Array3<f64>) -> Array1<f64> {
    Array1::from_shape_fn(sinks.len(), |h| {
        let p_sink = lse.slice(s![.., h, ..]).mapv(|l| (sinks[h] - l).exp());
        (&p_sink * &d_abs.slice(s![.., h, ..])).sum()
    })
}

/// Checks `out` against the oracle and, when given, against the previous rung's output; the
/// error message names what was compared, by how much it missed and its worst entry.
pub fn check<T: Element>(
    label: &str,
    out: &AttentionOutput<T>,
    expected: &Expected,
    previous: Option<(&str, &AttentionOutput<T>, &Expected)>,
) -> std::result::Result<(), String> {
    let verdict = expected.judge(out);
    if !verdict.pass {
        let worst = worst_note(out, &expected.oracle.o, &expected.oracle.lse, expected.o, verdict);
        return Err(format!(
            "{label} ({}) vs oracle: O {} (tol {}), lse {} (tol {}){worst}",
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
            let wide = |x: &AttentionOutput<T>| (x.o.mapv(T::as_f64), x.lse.mapv(T::as_f64));
            let (prev_o, prev_lse) = wide(prev_out);
            let tol = expected.o.plus(prev_expected.o);
            let worst = worst_note(out, &prev_o, &prev_lse, tol, pair);
            return Err(format!(
                "{label} ({}) vs {prev_label}: O {} (tol {}), lse {} (tol {}){worst}",
                T::NAME,
                pair.o,
                tol,
                pair.lse,
                expected.lse.plus(prev_expected.lse)
            ));
        }
    }
    Ok(())
}

/// `"; worst O[b, h, i, c] = … where the reference has …"` for `O` if it fails `o_tol`, else
/// for `lse`.
fn worst_note<T: Element>(
    out: &AttentionOutput<T>,
    o: &Array4<f64>,
    lse: &Array3<f64>,
    o_tol: Tolerance,
    verdict: Verdict,
) -> String {
    let worst = if o_tol.admits(verdict.o) {
        worst_entry(&out.lse, lse).map(|w| format!("; worst lse{w}"))
    } else {
        worst_entry(&out.o, o).map(|w| format!("; worst O{w}"))
    };
    worst.unwrap_or_default()
}
