//! What the tests of the ops share: deterministic inputs, attention written with candle's own
//! ops (the reference, and a model's eager path in 16 bits), and the error measure.
#![allow(dead_code)] // each test file uses its own part

use candle_core::{D, DType, Device, Result, Tensor};

pub mod model;

/// Deterministic inputs in [-1, 1), `dims`, rounded to `dtype`.
pub fn tensor(dims: &[usize], seed: u64, dtype: DType) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let values: Vec<f64> = (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(values, dims, &Device::Cpu)?.to_dtype(dtype)
}

/// A problem's shape: batch, query and key lengths, query and key/value heads, head dimension.
#[derive(Debug)]
pub struct Case {
    pub b: usize,
    pub sq: usize,
    pub skv: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
}

/// The inputs of case `c` on the CPU, `[batch, seq, heads, d]`, rounded to `dtype`.
pub fn inputs(c: &Case, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        tensor(&[c.b, c.sq, c.hq, c.d], 1 + c.d as u64, dtype)?,
        tensor(&[c.b, c.skv, c.hkv, c.d], 2 + c.d as u64, dtype)?,
        tensor(&[c.b, c.skv, c.hkv, c.d], 3 + c.d as u64, dtype)?,
    ))
}

/// What a call computes: a window `(left, right)`, ALiBi slopes, a softcap.
#[derive(Clone, Debug, Default)]
pub struct Mods {
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub slopes: Option<Vec<f64>>,
    pub softcap: Option<f64>,
}

/// `softmax(modified(scale · q kᵀ) + mask) v` in f64 with candle's ops, `[b, s, h, d]` in and out;
/// differentiable through candle's autograd. A row that sees no key gives zeros.
pub fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, m: &Mods) -> Result<Tensor> {
    attention_in(DType::F64, q, k, v, scale, m)
}

/// [`reference`] as a model written with candle's ops computes it in `dtype`: the two matmuls in
/// `dtype`, the scores' modifiers, mask and softmax in f32 (f64 for f64), the probabilities
/// rounded to `dtype`; on the inputs' device.
pub fn attention_in(
    dtype: DType,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    m: &Mods,
) -> Result<Tensor> {
    let (b, sq, hq, d) = q.dims4()?;
    let (_, skv, hkv, _) = k.dims4()?;
    let group = hq / hkv;
    let work = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let to = |t: &Tensor| t.to_dtype(dtype)?.transpose(1, 2)?.contiguous();
    // GQA: each kv head repeated for its group of query heads.
    let repeat = |t: Tensor| -> Result<Tensor> {
        let t = t.unsqueeze(2)?.broadcast_as((b, hkv, group, skv, d))?;
        t.reshape((b, hq, skv, d))
    };
    let (q, k, v) = (to(q)?, repeat(to(k)?)?, repeat(to(v)?)?);
    let mut s = (q.matmul(&k.t()?)?.to_dtype(work)? * scale)?;
    if let Some(cap) = m.softcap {
        s = ((s / cap)?.tanh()? * cap)?;
    }
    let shift = skv as i64 - sq as i64;
    let visible = |i: usize, j: usize| {
        let from_diagonal = j as i64 - (i as i64 + shift);
        m.right.is_none_or(|r| from_diagonal <= r as i64)
            && m.left.is_none_or(|l| -from_diagonal <= l as i64)
    };
    // The mask and ALiBi as one bias; a row that sees no key gets a bias of 0 (so that its
    // softmax is defined) and then probabilities of 0.
    let mut bias = vec![0f64; hq * sq * skv];
    let mut sees = vec![0f64; sq];
    for i in 0..sq {
        sees[i] = if (0..skv).any(|j| visible(i, j)) { 1.0 } else { 0.0 };
        for h in 0..hq {
            for j in (0..skv).filter(|_| sees[i] == 1.0) {
                let from_diagonal = j as i64 - (i as i64 + shift);
                let alibi = m.slopes.as_ref().map_or(0.0, |s| -s[h] * from_diagonal.abs() as f64);
                bias[(h * sq + i) * skv + j] =
                    if visible(i, j) { alibi } else { f64::NEG_INFINITY };
            }
        }
    }
    let dev = q.device();
    let bias = Tensor::from_vec(bias, (1, hq, sq, skv), dev)?.to_dtype(work)?;
    let sees = Tensor::from_vec(sees, (1, 1, sq, 1), dev)?.to_dtype(work)?;
    let p = candle_nn::ops::softmax(&s.broadcast_add(&bias)?, D::Minus1)?.broadcast_mul(&sees)?;
    p.to_dtype(dtype)?.matmul(&v)?.transpose(1, 2)
}

/// The largest |a − b| and |b| (on the CPU, in f64).
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let diff = (&a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let size = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok((diff, size))
}

/// The ladder's rule for a 16-bit result: `ours` is within twice the error of `baseline` (the
/// same computation written with candle's ops in the same precision) of `reference` (float64),
/// plus half an ulp of `dtype` at the reference's magnitude. Returns whether it holds and the
/// figures, for the failure message.
pub fn meets_the_rule(
    ours: &Tensor,
    baseline: &Tensor,
    reference: &Tensor,
    dtype: DType,
) -> Result<(bool, String)> {
    let (error, size) = max_diff(ours, reference)?;
    let (baseline_error, _) = max_diff(baseline, reference)?;
    let ulp = match dtype {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F32 => f64::from(f32::EPSILON),
        _ => f64::EPSILON,
    };
    let tolerance = 2.0 * baseline_error + 0.5 * ulp * size;
    let figures = format!(
        "error {error:.3e}, the baseline's {baseline_error:.3e}, tolerance {tolerance:.3e} \
         (largest |reference| {size:.3e})"
    );
    Ok((error <= tolerance, figures))
}

/// candle's CUDA device 0, or `None` with a notice where there is none (the test then passes
/// without running); with `LADDER_REQUIRE_GPU=1` a missing device fails the test instead.
#[cfg(feature = "cuda")]
pub fn cuda(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) if std::env::var("LADDER_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{test}: LADDER_REQUIRE_GPU=1 but no CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("{test}: skipped, no CUDA device ({e})");
            None
        }
    }
}
