//! The ops against attention written with candle's own tensor ops (`softmax(Q Kᵀ · scale + mask)
//! V` in f64, candle's autograd for the gradients), on candle's CPU device: every dtype, causal
//! and not with `seq_q ≠ seq_kv`, GQA, windows, ALiBi, softcap, strided inputs, packed sequences,
//! the KV cache; and bad inputs, which are errors.
//!
//! Tolerances: the ops compute in `f32` (`f64` for `f64` tensors) and round the output to the
//! inputs' type, so against the f64 reference on the same (already rounded) inputs an output is off
//! by its own rounding, half an ulp of its type at its magnitude, plus the `f32` arithmetic's
//! error, a few `f32` ulps per term summed (`d` and `seq_kv` of them).

mod common;

use candle_core::{DType, Device, IndexOp, Result, Tensor, Var};
use common::{Case, Mods, inputs, max_diff, reference, tensor};
use ladder_candle::{
    KvCache, flash_attn, flash_attn_alibi_windowed_softcap, flash_attn_varlen,
    flash_attn_varlen_windowed, flash_attn_windowed,
};

/// The bound on |ours − reference| for an output of `dtype` computed in f32 (f64) over `terms`
/// summed terms, of magnitude up to `size`: half an ulp of the output type plus the f32 sums'.
fn tolerance(dtype: DType, size: f64, terms: usize) -> f64 {
    let (out_ulp, work_ulp) = match dtype {
        DType::F64 => (f64::EPSILON, f64::EPSILON),
        DType::F32 => (f32::EPSILON as f64, f32::EPSILON as f64),
        DType::F16 => (2f64.powi(-10), f32::EPSILON as f64),
        _ => (2f64.powi(-7), f32::EPSILON as f64), // bf16
    };
    0.5 * out_ulp * size.max(1.0) + 4.0 * work_ulp * terms as f64 * size.max(1.0)
}

const CASES: [Case; 4] = [
    Case { b: 1, sq: 3, skv: 3, hq: 2, hkv: 2, d: 8 },
    Case { b: 2, sq: 5, skv: 9, hq: 4, hkv: 2, d: 16 },
    // More queries than keys: the first rows of a causal problem see nothing.
    Case { b: 1, sq: 7, skv: 4, hq: 3, hkv: 1, d: 8 },
    Case { b: 2, sq: 33, skv: 70, hq: 2, hkv: 1, d: 32 },
];

#[test]
fn flash_attn_matches_candle_attention_in_every_dtype() -> Result<()> {
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        for c in &CASES {
            let (q, k, v) = inputs(c, dtype)?;
            let scale = (c.d as f64).powf(-0.5);
            for causal in [false, true] {
                let ours = flash_attn(&q, &k, &v, scale as f32, causal)?;
                assert_eq!((ours.dims(), ours.dtype()), (q.dims(), dtype));
                let mods = Mods { right: causal.then_some(0), ..Mods::default() };
                // The reference with the f32 scale the op takes.
                let want = reference(&q, &k, &v, f64::from(scale as f32), &mods)?;
                let (diff, size) = max_diff(&ours, &want)?;
                let tol = tolerance(dtype, size, c.d + c.skv);
                assert!(
                    diff <= tol,
                    "{dtype:?} b{} sq{} skv{} causal {causal}: {diff} > {tol}",
                    c.b,
                    c.sq,
                    c.skv
                );
            }
        }
    }
    Ok(())
}

#[test]
fn windows_alibi_and_softcap_match_their_definitions() -> Result<()> {
    let c = &CASES[1];
    let (q, k, v) = inputs(c, DType::F32)?;
    let slopes = vec![0.5, 0.25, 0.125, 0.0625];
    let slopes_t = Tensor::new(slopes.iter().map(|&s| s as f32).collect::<Vec<_>>(), &Device::Cpu)?;
    let cases = [
        (Mods { left: Some(2), right: Some(0), ..Mods::default() }, None, 0.0),
        (Mods { left: Some(1), right: Some(3), ..Mods::default() }, None, 0.0),
        (
            Mods { left: None, right: Some(0), slopes: Some(slopes.clone()), ..Mods::default() },
            Some(&slopes_t),
            0.0,
        ),
        (Mods { softcap: Some(0.5), ..Mods::default() }, None, 0.5),
        (
            Mods {
                left: Some(4),
                right: Some(0),
                slopes: Some(slopes.clone()),
                softcap: Some(0.3),
            },
            Some(&slopes_t),
            0.3,
        ),
    ];
    for (mods, alibi, cap) in cases {
        let scale = 0.7f32;
        let ours = if alibi.is_none() && cap == 0.0 {
            flash_attn_windowed(&q, &k, &v, scale, mods.left, mods.right)?
        } else {
            flash_attn_alibi_windowed_softcap(
                &q, &k, &v, alibi, scale, mods.left, mods.right, cap as f32,
            )?
        };
        let mods = Mods { softcap: mods.softcap.map(|c| f64::from(c as f32)), ..mods };
        let want = reference(&q, &k, &v, f64::from(scale), &mods)?;
        let (diff, size) = max_diff(&ours, &want)?;
        let tol = tolerance(DType::F32, size, c.d + c.skv);
        assert!(diff <= tol, "{mods:?}: {diff} > {tol}");
    }
    Ok(())
}

#[test]
fn strided_inputs_give_the_contiguous_result() -> Result<()> {
    let c = &CASES[1];
    let (q, k, v) = inputs(c, DType::F32)?;
    // The same tensors as transposed views of [b, h, s, d] buffers.
    let view = |t: &Tensor| t.transpose(1, 2)?.contiguous()?.transpose(1, 2);
    let (qs, ks, vs) = (view(&q)?, view(&k)?, view(&v)?);
    assert!(!qs.is_contiguous());
    let a = flash_attn(&q, &k, &v, 0.5, true)?;
    let b = flash_attn(&qs, &ks, &vs, 0.5, true)?;
    assert_eq!(max_diff(&a, &b)?.0, 0.0);
    Ok(())
}

/// The op's gradients against candle's autograd of the reference, in f64 (the algorithm: to
/// ~1e-12) and in f32.
#[test]
fn gradients_match_candle_autograd() -> Result<()> {
    for dtype in [DType::F64, DType::F32] {
        for c in &CASES[1..] {
            for causal in [false, true] {
                let (q, k, v) = inputs(c, dtype)?;
                let (q, k, v) =
                    (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
                let d_o = tensor(&[c.b, c.sq, c.hq, c.d], 9, dtype)?;
                let scale = (c.d as f32).powf(-0.5);
                let ours = flash_attn(&q, &k, &v, scale, causal)?;
                let g_ours = (ours.to_dtype(DType::F64)? * d_o.to_dtype(DType::F64)?)?
                    .sum_all()?
                    .backward()?;
                let mods = Mods { right: causal.then_some(0), ..Mods::default() };
                let want = reference(&q, &k, &v, f64::from(scale), &mods)?;
                let g_want = (want * d_o.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
                for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
                    let (a, b) = (g_ours.get(x).expect("ours"), g_want.get(x).expect("reference"));
                    let (diff, size) = max_diff(a, b)?;
                    let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 }
                        * size.max(1.0)
                        * (c.skv as f64);
                    assert!(
                        diff <= tol,
                        "{dtype:?} {name} sq{} skv{} causal {causal}: {diff} > {tol}",
                        c.sq,
                        c.skv
                    );
                }
            }
        }
    }
    Ok(())
}

/// Packed sequences: each is `flash_attn` on its own rows, forward and backward.
#[test]
fn varlen_is_flash_attn_per_sequence() -> Result<()> {
    let (hq, hkv, d) = (4, 2, 16);
    let (lens_q, lens_k) = ([3usize, 1, 6], [5usize, 1, 6]);
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    let q = Var::from_tensor(&tensor(&[tq, hq, d], 11, DType::F64)?)?;
    let k = Var::from_tensor(&tensor(&[tk, hkv, d], 12, DType::F64)?)?;
    let v = Var::from_tensor(&tensor(&[tk, hkv, d], 13, DType::F64)?)?;
    let offsets = |lens: &[usize]| -> Result<Tensor> {
        let mut cu = vec![0u32];
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l as u32);
        }
        Tensor::new(cu, &Device::Cpu)
    };
    let (cu_q, cu_k) = (offsets(&lens_q)?, offsets(&lens_k)?);
    for causal in [false, true] {
        let packed = flash_attn_varlen(&q, &k, &v, &cu_q, &cu_k, 6, 6, 0.4, causal)?;
        let g_packed = packed.sqr()?.sum_all()?.backward()?;
        let (mut at_q, mut at_k) = (0, 0);
        let mut g_each = Vec::new();
        for (&nq, &nk) in lens_q.iter().zip(&lens_k) {
            let one = |t: &Tensor, at: usize, n: usize| t.narrow(0, at, n)?.unsqueeze(0);
            let o = flash_attn(
                &one(&q, at_q, nq)?,
                &one(&k, at_k, nk)?,
                &one(&v, at_k, nk)?,
                0.4,
                causal,
            )?;
            let (diff, _) = max_diff(&packed.narrow(0, at_q, nq)?, &o.squeeze(0)?)?;
            assert!(diff < 1e-14, "causal {causal}: a packed sequence differs by {diff}");
            g_each.push(o.sqr()?.sum_all()?);
            at_q += nq;
            at_k += nk;
        }
        let total = g_each.into_iter().reduce(|a, b| (a + b).expect("sum")).expect("sequences");
        let g_total = total.backward()?;
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let (diff, _) =
                max_diff(g_packed.get(x).expect("packed"), g_total.get(x).expect("each"))?;
            assert!(diff < 1e-12, "causal {causal}: {name} differs by {diff}");
        }
    }
    // A window per sequence.
    let w = flash_attn_varlen_windowed(&q, &k, &v, &cu_q, &cu_k, 6, 6, 0.4, Some(1), Some(0))?;
    let first = flash_attn_windowed(
        &q.narrow(0, 0, 3)?.unsqueeze(0)?,
        &k.narrow(0, 0, 5)?.unsqueeze(0)?,
        &v.narrow(0, 0, 5)?.unsqueeze(0)?,
        0.4,
        Some(1),
        Some(0),
    )?;
    assert!(max_diff(&w.narrow(0, 0, 3)?, &first.squeeze(0)?)?.0 < 1e-14);
    Ok(())
}

/// The cache: appended tokens, attended by the new ones, is `flash_attn` (causal, bottom-right)
/// on each sequence's cached keys; a sequence without keys gives zeros.
#[test]
fn the_kv_cache_attends_like_flash_attn() -> Result<()> {
    let (hq, hkv, d) = (4, 2, 8);
    let mut cache = KvCache::new(3, 20, hkv, d, DType::F32, &Device::Cpu)?;
    let lens = [7usize, 12, 0];
    let mut keys = Vec::new();
    for (b, &n) in lens.iter().enumerate() {
        let k = tensor(&[n.max(1), hkv, d], 20 + b as u64, DType::F32)?.narrow(0, 0, n)?;
        let v = tensor(&[n.max(1), hkv, d], 30 + b as u64, DType::F32)?.narrow(0, 0, n)?;
        // In two appends, as a prefill and a step would.
        let half = n / 2;
        cache.append(b, &k.narrow(0, 0, half)?, &v.narrow(0, 0, half)?)?;
        cache.append(b, &k.narrow(0, half, n - half)?, &v.narrow(0, half, n - half)?)?;
        keys.push((k, v));
    }
    assert_eq!(cache.lengths(), &lens);
    let q = tensor(&[3, 2, hq, d], 40, DType::F32)?;
    for window in [None, Some(3)] {
        let o = cache.attend(&q, 0.5, window)?;
        for (b, (k, v)) in keys.iter().enumerate() {
            let got = o.i(b)?;
            if lens[b] == 0 {
                assert_eq!(max_diff(&got, &got.zeros_like()?)?.0, 0.0);
                continue;
            }
            let want = flash_attn_windowed(
                &q.i(b..b + 1)?,
                &k.unsqueeze(0)?,
                &v.unsqueeze(0)?,
                0.5,
                window,
                Some(0),
            )?;
            let (diff, size) = max_diff(&got, &want.squeeze(0)?)?;
            assert!(
                diff <= tolerance(DType::F32, size, d + lens[b]),
                "sequence {b}, window {window:?}: {diff}"
            );
        }
    }
    let too_many = tensor(&[14, hkv, d], 50, DType::F32)?;
    assert!(cache.append(0, &too_many, &too_many).is_err(), "7 + 14 tokens in a cache of 20");
    assert_eq!(cache.lengths()[0], 7, "a refused append leaves the sequence as it was");
    Ok(())
}

/// Bad inputs: candle errors, never a panic or a wrong answer.
#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let q = tensor(&[1, 4, 2, 8], 1, DType::F32)?;
    let k = tensor(&[1, 4, 2, 8], 2, DType::F32)?;
    let expect_err = |r: Result<Tensor>, what: &str, needle: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: accepted")).to_string();
        assert!(e.contains(needle), "{what}: {e}");
    };
    expect_err(
        flash_attn(
            &q.to_dtype(DType::U32)?,
            &k.to_dtype(DType::U32)?,
            &k.to_dtype(DType::U32)?,
            1.0,
            false,
        ),
        "u32",
        "f16, bf16, f32 or f64",
    );
    expect_err(
        flash_attn(&q, &k.to_dtype(DType::F64)?, &k, 1.0, false),
        "mixed dtypes",
        "one dtype",
    );
    expect_err(
        flash_attn(&q.squeeze(0)?, &k.squeeze(0)?, &k.squeeze(0)?, 1.0, false),
        "rank 3",
        "must be [batch, seq, heads, head_dim]",
    );
    expect_err(
        flash_attn(&q.transpose(2, 3)?, &k.transpose(2, 3)?, &k.transpose(2, 3)?, 1.0, false),
        "strided head dim",
        "contiguous last axis",
    );
    let k3 = tensor(&[1, 4, 3, 8], 3, DType::F32)?;
    expect_err(flash_attn(&q, &k3, &k3, 1.0, false), "heads 2 over 3", "multiple");
    expect_err(
        flash_attn(&q, &k, &tensor(&[1, 5, 2, 8], 4, DType::F32)?, 1.0, false),
        "k and v differ",
        "must be equal",
    );
    expect_err(flash_attn(&q, &k, &k, f32::NAN, false), "NaN scale", "softmax_scale");
    expect_err(
        flash_attn_alibi_windowed_softcap(&q, &k, &k, None, 1.0, None, None, -1.0),
        "negative softcap",
        "softcap",
    );
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125], &Device::Cpu)?;
    expect_err(
        flash_attn_alibi_windowed_softcap(&q, &k, &k, Some(&slopes), 1.0, None, None, 0.0),
        "3 slopes for 2 heads",
        "heads",
    );
    let (q3, k3) = (q.squeeze(0)?, k.squeeze(0)?);
    let cu = Tensor::new(&[0u32, 4], &Device::Cpu)?;
    expect_err(
        flash_attn_varlen(&q3, &k3, &k3, &cu, &cu, 3, 4, 1.0, true),
        "max_seqlen_q too small",
        "max_seqlen",
    );
    expect_err(
        flash_attn_varlen(
            &q3,
            &k3,
            &k3,
            &Tensor::new(&[0u32, 3], &Device::Cpu)?,
            &cu,
            4,
            4,
            1.0,
            true,
        ),
        "totals",
        "end at",
    );
    expect_err(
        flash_attn_varlen(
            &q3,
            &k3,
            &k3,
            &Tensor::new(&[0i64, 4], &Device::Cpu)?,
            &cu,
            4,
            4,
            1.0,
            true,
        ),
        "i64 offsets",
        "u32",
    );
    expect_err(
        flash_attn_varlen(
            &q3,
            &k3,
            &k3,
            &Tensor::new(&[0u32, 3, 2, 4], &Device::Cpu)?,
            &Tensor::new(&[0u32, 1, 2, 4], &Device::Cpu)?,
            4,
            4,
            1.0,
            true,
        ),
        "decreasing",
        "decreases",
    );
    let mut cache = KvCache::new(1, 4, 2, 8, DType::F32, &Device::Cpu)?;
    let five = tensor(&[5, 2, 8], 5, DType::F32)?;
    assert!(cache.append(0, &five, &five).is_err(), "past the capacity");
    assert!(
        cache.append(1, &five.narrow(0, 0, 1)?, &five.narrow(0, 0, 1)?).is_err(),
        "sequence 1 of 1"
    );
    assert!(
        cache.append(0, &tensor(&[1, 3, 8], 6, DType::F32)?, &five.narrow(0, 0, 1)?).is_err(),
        "heads"
    );
    Ok(())
}
