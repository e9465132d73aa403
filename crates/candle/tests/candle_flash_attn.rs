//! candle-flash-attn's own test cases (its `tests/flash_attn_tests.rs`), ported onto this crate's
//! ops: the same shapes, inputs, calls and reference (attention written with candle's ops in
//! f32, rounded to the inputs' type), on candle's CPU device. Their bound is the output type's
//! rounding: an output may land one f16 ulp from the reference's where candle-flash-attn's CUDA
//! kernel happened to round as the reference did (its tests ask for 1e-5 on these values).
//!
//! Not ported: the paged varlen cases (`flash_attn_varlen_paged_windowed` with a block table and
//! multimodal prefix ranges), an API this crate does not have yet.

use candle_core::{D, DType, Device, IndexOp, Result, Tensor};

/// candle-flash-attn's reference: `softmax(q kᵀ · scale) v` in f32, optionally softcapped.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let (q, k, v) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
    let mut att = (q.matmul(&k.t()?)? * f64::from(scale))?;
    if let Some(cap) = softcap {
        att = ((att / f64::from(cap))?.tanh()? * f64::from(cap))?;
    }
    let att = candle_nn::ops::softmax(&att, D::Minus1)?;
    att.matmul(&v.contiguous()?)?.to_dtype(dtype)
}

/// The largest difference, and the bound: one ulp of f16 at the output's magnitude.
fn within_an_f16_ulp(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let diff = (&a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let size = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((diff, 2f32.powi(-10) * size.max(2f32.powi(-14))))
}

/// The inputs of their `flash_attn_acausal`: `arange` in f16, `[1, heads, seq, d]`, scaled.
fn arange_inputs(dims: (usize, usize, usize, usize)) -> Result<(Tensor, Tensor, Tensor)> {
    let n = dims.0 * dims.1 * dims.2 * dims.3;
    let q = Tensor::arange(0u32, n as u32, &Device::Cpu)?.to_dtype(DType::F16)?.reshape(dims)?;
    Ok(((&q / 30.)?, (&q / 40.)?, (&q / 50.)?))
}

#[test]
fn flash_attn_acausal() -> Result<()> {
    let (q, k, v) = arange_inputs((1, 3, 2, 8))?;
    let ys1 = reference(&q, &k, &v, 0.5, None)?.i(0)?;
    let ys2 = {
        let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
        ladder_candle::flash_attn(&q, &k, &v, 0.5, false)?.transpose(1, 2)?
    }
    .i(0)?;
    assert_eq!(ys2.dims(), &[3, 2, 8]);
    let (diff, bound) = within_an_f16_ulp(&ys2, &ys1)?;
    assert!(diff <= bound, "{diff} > {bound}");
    Ok(())
}

#[test]
fn flash_attn_acausal_softcap() -> Result<()> {
    let (q, k, v) = arange_inputs((1, 3, 5, 8))?;
    let softcap = 5.0f32;
    let ys1 = reference(&q, &k, &v, 1.0, Some(softcap))?.i(0)?;
    let ys2 = {
        let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
        ladder_candle::flash_attn_alibi_windowed_softcap(
            &q, &k, &v, None, 1.0, None, None, softcap,
        )?
        .transpose(1, 2)?
    }
    .i(0)?;
    assert_eq!(ys2.dims(), &[3, 5, 8]);
    let (diff, bound) = within_an_f16_ulp(&ys2, &ys1)?;
    assert!(diff <= bound, "{diff} > {bound}");
    Ok(())
}

#[test]
fn flash_attn_varlen() -> Result<()> {
    let (q, k, v) = arange_inputs((1, 3, 2, 8))?;
    let (q, k, v) = (q.squeeze(0)?, k.squeeze(0)?, v.squeeze(0)?);
    let seqlens_q = Tensor::new(&[0u32, 2u32], &Device::Cpu)?;
    let seqlens_k = Tensor::new(&[0u32, 2u32], &Device::Cpu)?;
    let ys = {
        let (q, k, v) = (q.transpose(0, 1)?, k.transpose(0, 1)?, v.transpose(0, 1)?);
        ladder_candle::flash_attn_varlen(&q, &k, &v, &seqlens_q, &seqlens_k, 32, 32, 0.5, false)?
            .transpose(0, 1)?
    };
    assert_eq!(ys.dims(), &[3, 2, 8]);
    // One sequence of 2 tokens: the acausal case's result.
    let want = reference(&q.unsqueeze(0)?, &k.unsqueeze(0)?, &v.unsqueeze(0)?, 0.5, None)?.i(0)?;
    let (diff, bound) = within_an_f16_ulp(&ys, &want)?;
    assert!(diff <= bound, "{diff} > {bound}");
    Ok(())
}
