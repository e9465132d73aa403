//! The ops on candle's CUDA device (the `cuda` feature): ladder-kernels' GPU rungs
//! (FlashAttention-3 on Hopper, FlashAttention-2 elsewhere, FlashDecoding for the cache) on
//! candle's own buffers, held to the ladder's rule for 16-bit results: within twice the error of
//! the same attention written with candle's ops in the same precision (matmuls in 16 bits,
//! softmax in f32) of the float64 reference, plus half an ulp. Forward and backward, GQA, causal
//! with `seq_q ≠ seq_kv`, windows, ALiBi, softcap, packed sequences, the KV cache; views of a fused
//! projection run in place; bad inputs are errors.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` they fail.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, IndexOp, Result, Tensor, Var};
use common::{Case, Mods, attention_in, cuda, inputs, max_diff, meets_the_rule, reference, tensor};
use ladder_candle::{
    KvCache, flash_attn, flash_attn_alibi_windowed_softcap, flash_attn_varlen, flash_attn_windowed,
};

const CASES: [Case; 5] = [
    Case { b: 1, sq: 3, skv: 3, hq: 2, hkv: 2, d: 64 },
    Case { b: 2, sq: 77, skv: 200, hq: 4, hkv: 2, d: 128 },
    // More queries than keys: the first rows of a causal problem see nothing.
    Case { b: 1, sq: 150, skv: 90, hq: 3, hkv: 1, d: 64 },
    Case { b: 2, sq: 130, skv: 130, hq: 2, hkv: 1, d: 96 },
    Case { b: 1, sq: 64, skv: 257, hq: 8, hkv: 8, d: 256 },
];

/// `(q, k, v)` copied to `dev`.
fn on(dev: &Device, (q, k, v): &(Tensor, Tensor, Tensor)) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?))
}

#[test]
fn flash_attn_meets_the_rule() -> Result<()> {
    let Some(dev) = cuda("flash_attn_meets_the_rule") else { return Ok(()) };
    for dtype in [DType::F16, DType::BF16] {
        for c in &CASES {
            let cpu = inputs(c, dtype)?;
            let (q, k, v) = on(&dev, &cpu)?;
            let scale = (c.d as f32).powf(-0.5);
            for causal in [false, true] {
                let ours = flash_attn(&q, &k, &v, scale, causal)?;
                assert_eq!((ours.dims(), ours.dtype()), (q.dims(), dtype));
                assert!(ours.device().is_cuda());
                let mods = Mods { right: causal.then_some(0), ..Mods::default() };
                let baseline = attention_in(dtype, &q, &k, &v, f64::from(scale), &mods)?;
                let want = reference(&cpu.0, &cpu.1, &cpu.2, f64::from(scale), &mods)?;
                let (holds, figures) = meets_the_rule(&ours, &baseline, &want, dtype)?;
                assert!(holds, "{dtype:?} {c:?} causal {causal}: {figures}");
            }
        }
    }
    Ok(())
}

#[test]
fn windows_alibi_and_softcap_meet_the_rule() -> Result<()> {
    let Some(dev) = cuda("windows_alibi_and_softcap_meet_the_rule") else { return Ok(()) };
    let c = &CASES[1];
    let dtype = DType::F16;
    let cpu = inputs(c, dtype)?;
    let (q, k, v) = on(&dev, &cpu)?;
    let slopes = vec![0.5, 0.25, 0.125, 0.0625];
    let slopes_t = Tensor::new(slopes.iter().map(|&s| s as f32).collect::<Vec<_>>(), &dev)?;
    let cases = [
        (Mods { left: Some(40), right: Some(0), ..Mods::default() }, false, 0.0),
        (Mods { left: Some(20), right: Some(30), ..Mods::default() }, false, 0.0),
        (Mods { right: Some(0), slopes: Some(slopes.clone()), ..Mods::default() }, true, 0.0),
        (Mods { softcap: Some(5.0), ..Mods::default() }, false, 5.0),
        (
            Mods {
                left: Some(64),
                right: Some(0),
                slopes: Some(slopes.clone()),
                softcap: Some(3.0),
            },
            true,
            3.0,
        ),
    ];
    for (mods, alibi, cap) in cases {
        let scale = 0.7f32;
        let ours = if !alibi && cap == 0.0 {
            flash_attn_windowed(&q, &k, &v, scale, mods.left, mods.right)?
        } else {
            let slopes = alibi.then_some(&slopes_t);
            flash_attn_alibi_windowed_softcap(
                &q, &k, &v, slopes, scale, mods.left, mods.right, cap as f32,
            )?
        };
        let mods = Mods { softcap: mods.softcap.map(|c| f64::from(c as f32)), ..mods };
        let baseline = attention_in(dtype, &q, &k, &v, f64::from(scale), &mods)?;
        let want = reference(&cpu.0, &cpu.1, &cpu.2, f64::from(scale), &mods)?;
        let (holds, figures) = meets_the_rule(&ours, &baseline, &want, dtype)?;
        assert!(holds, "{mods:?}: {figures}");
    }
    Ok(())
}

/// `Σ o · d_o` of `attention` on Vars of `(q, k, v)` on `dev`, and the gradients of q, k, v.
fn gradients(
    dev: &Device,
    (q, k, v): &(Tensor, Tensor, Tensor),
    d_o: &Tensor,
    attention: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<[Tensor; 3]> {
    let vars = [q, k, v].map(|t| t.to_device(dev).and_then(|t| Var::from_tensor(&t)));
    let [q, k, v] = vars;
    let (q, k, v) = (q?, k?, v?);
    let o = attention(&q, &k, &v)?;
    let work = if o.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let loss = (o.to_dtype(work)? * d_o.to_device(dev)?.to_dtype(work)?)?.sum_all()?;
    let grads = loss.backward()?;
    let get =
        |x: &Var| grads.get(x).cloned().ok_or_else(|| candle_core::Error::Msg("no grad".into()));
    Ok([get(&q)?, get(&k)?, get(&v)?])
}

/// FlashAttention's backward pass on the GPU (FA3's on Hopper without a window, FA2's with one)
/// against candle's autograd of the reference in f64 and of the 16-bit baseline.
#[test]
fn gradients_meet_the_rule() -> Result<()> {
    let Some(dev) = cuda("gradients_meet_the_rule") else { return Ok(()) };
    for dtype in [DType::F16, DType::BF16] {
        for c in &CASES[1..4] {
            let cpu = inputs(c, dtype)?;
            let d_o = tensor(&[c.b, c.sq, c.hq, c.d], 9, dtype)?;
            let scale = (c.d as f32).powf(-0.5);
            for (left, right) in [(None, None), (None, Some(0)), (Some(33), Some(0))] {
                let mods = Mods { left, right, ..Mods::default() };
                let ours = gradients(&dev, &cpu, &d_o, |q, k, v| {
                    flash_attn_windowed(q, k, v, scale, left, right)
                })?;
                let baseline = gradients(&dev, &cpu, &d_o, |q, k, v| {
                    attention_in(dtype, q, k, v, f64::from(scale), &mods)
                })?;
                let f64_inputs = (
                    cpu.0.to_dtype(DType::F64)?,
                    cpu.1.to_dtype(DType::F64)?,
                    cpu.2.to_dtype(DType::F64)?,
                );
                let want = gradients(&Device::Cpu, &f64_inputs, &d_o, |q, k, v| {
                    reference(q, k, v, f64::from(scale), &mods)
                })?;
                for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                    let (holds, figures) = meets_the_rule(&ours[i], &baseline[i], &want[i], dtype)?;
                    assert!(
                        holds,
                        "{dtype:?} {c:?} window ({left:?}, {right:?}) {name}: {figures}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Q, K and V as views of one fused `[batch, seq, heads_q + 2·heads_kv, d]` projection run in
/// place and give bitwise what contiguous copies give; a query laid out `[batch, heads, seq, d]`
/// in memory gives the same too.
#[test]
fn views_give_what_copies_give() -> Result<()> {
    let Some(dev) = cuda("views_give_what_copies_give") else { return Ok(()) };
    let (b, s, hq, hkv, d) = (2, 100, 4, 2, 64);
    let qkv = tensor(&[b, s, hq + 2 * hkv, d], 5, DType::F16)?.to_device(&dev)?;
    let (q, k, v) = (qkv.narrow(2, 0, hq)?, qkv.narrow(2, hq, hkv)?, qkv.narrow(2, hq + hkv, hkv)?);
    assert!(!q.is_contiguous() && !k.is_contiguous());
    let (qc, kc, vc) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    for causal in [false, true] {
        let viewed = flash_attn(&q, &k, &v, 0.125, causal)?;
        let copied = flash_attn(&qc, &kc, &vc, 0.125, causal)?;
        assert_eq!(max_diff(&viewed, &copied)?.0, 0.0, "causal {causal}");
        let q_bhsd = qc.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
        let reordered = flash_attn(&q_bhsd, &kc, &vc, 0.125, causal)?;
        assert_eq!(max_diff(&reordered, &copied)?.0, 0.0, "causal {causal}, q in bhsd order");
    }
    Ok(())
}

/// A packed batch's attention computed one sequence at a time by `attention` (`lens`: each
/// sequence's query and key rows), packed back: what a packed call must equal.
fn per_sequence<'a>(
    lens: &'a [(usize, usize)],
    attention: &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + 'a {
    move |q, k, v| {
        let (mut at_q, mut at_k, mut outs) = (0, 0, Vec::new());
        for &(nq, nk) in lens {
            let one = |t: &Tensor, at: usize, n: usize| t.narrow(0, at, n)?.unsqueeze(0);
            let o = attention(&one(q, at_q, nq)?, &one(k, at_k, nk)?, &one(v, at_k, nk)?)?;
            outs.push(o.squeeze(0)?);
            (at_q, at_k) = (at_q + nq, at_k + nk);
        }
        Tensor::cat(&outs, 0)
    }
}

/// Packed sequences (`flash_attn_varlen`), forward and backward, each sequence held to the rule
/// against the reference and baseline run on it alone.
#[test]
fn varlen_meets_the_rule_on_every_sequence() -> Result<()> {
    let Some(dev) = cuda("varlen_meets_the_rule_on_every_sequence") else { return Ok(()) };
    let dtype = DType::F16;
    let (hq, hkv, d) = (4, 2, 64);
    let (lens_q, lens_k) = ([37usize, 1, 130], [50usize, 1, 130]);
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    let lens: Vec<(usize, usize)> = lens_q.into_iter().zip(lens_k).collect();
    let cpu = (
        tensor(&[tq, hq, d], 11, dtype)?,
        tensor(&[tk, hkv, d], 12, dtype)?,
        tensor(&[tk, hkv, d], 13, dtype)?,
    );
    let d_o = tensor(&[tq, hq, d], 14, dtype)?;
    let offsets = |lens: &[usize]| -> Result<Tensor> {
        let mut cu = vec![0u32];
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l as u32);
        }
        Tensor::new(cu, &dev)
    };
    let (cu_q, cu_k) = (offsets(&lens_q)?, offsets(&lens_k)?);
    let scale = 0.125f32;
    for causal in [false, true] {
        let mods = Mods { right: causal.then_some(0), ..Mods::default() };
        let ours = |q: &Tensor, k: &Tensor, v: &Tensor| {
            flash_attn_varlen(q, k, v, &cu_q, &cu_k, 130, 130, scale, causal)
        };
        let base = |q: &Tensor, k: &Tensor, v: &Tensor| {
            attention_in(dtype, q, k, v, f64::from(scale), &mods)
        };
        let exact =
            |q: &Tensor, k: &Tensor, v: &Tensor| reference(q, k, v, f64::from(scale), &mods);
        let gpu = on(&dev, &cpu)?;
        let (o, o_base) =
            (ours(&gpu.0, &gpu.1, &gpu.2)?, per_sequence(&lens, &base)(&gpu.0, &gpu.1, &gpu.2)?);
        let o_want = per_sequence(&lens, &exact)(&cpu.0, &cpu.1, &cpu.2)?;
        let (holds, figures) = meets_the_rule(&o, &o_base, &o_want, dtype)?;
        assert!(holds, "causal {causal}, forward: {figures}");
        let g = gradients(&dev, &cpu, &d_o, ours)?;
        let g_base = gradients(&dev, &cpu, &d_o, per_sequence(&lens, &base))?;
        let f64_inputs =
            (cpu.0.to_dtype(DType::F64)?, cpu.1.to_dtype(DType::F64)?, cpu.2.to_dtype(DType::F64)?);
        let g_want = gradients(&Device::Cpu, &f64_inputs, &d_o, per_sequence(&lens, &exact))?;
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            let (holds, figures) = meets_the_rule(&g[i], &g_base[i], &g_want[i], dtype)?;
            assert!(holds, "causal {causal}, {name}: {figures}");
        }
    }
    Ok(())
}

/// The cache on the GPU: appended tokens, attended by the new ones (FlashDecoding), meet the rule
/// against causal attention on each sequence's cached keys; a sequence without keys gives zeros.
#[test]
fn the_kv_cache_meets_the_rule() -> Result<()> {
    let Some(dev) = cuda("the_kv_cache_meets_the_rule") else { return Ok(()) };
    let dtype = DType::BF16;
    let (hq, hkv, d, n_new) = (8, 2, 128, 2);
    let lens = [7usize, 300, 0];
    let mut cache = KvCache::new(3, 400, hkv, d, dtype, &dev)?;
    let mut keys = Vec::new();
    for (b, &n) in lens.iter().enumerate() {
        let k = tensor(&[n.max(1), hkv, d], 20 + b as u64, dtype)?.narrow(0, 0, n)?;
        let v = tensor(&[n.max(1), hkv, d], 30 + b as u64, dtype)?.narrow(0, 0, n)?;
        // In two appends, as a prefill and a step would (an empty sequence gets none).
        let half = n / 2;
        let (kg, vg) = (k.to_device(&dev)?, v.to_device(&dev)?);
        if n > 0 {
            cache.append(b, &kg.narrow(0, 0, half)?, &vg.narrow(0, 0, half)?)?;
            cache.append(b, &kg.narrow(0, half, n - half)?, &vg.narrow(0, half, n - half)?)?;
        }
        keys.push((k, v));
    }
    assert_eq!(cache.lengths(), &lens);
    let q = tensor(&[3, n_new, hq, d], 40, dtype)?;
    let q_gpu = q.to_device(&dev)?;
    let scale = 0.09f32;
    for window in [None, Some(100)] {
        let o = cache.attend(&q_gpu, scale, window)?;
        assert!(o.device().is_cuda());
        for (b, (k, v)) in keys.iter().enumerate() {
            let got = o.i(b)?;
            if lens[b] == 0 {
                assert_eq!(max_diff(&got, &got.zeros_like()?)?.0, 0.0, "an empty sequence");
                continue;
            }
            let mods = Mods { left: window, right: Some(0), ..Mods::default() };
            let (qb, kb, vb) = (q.i(b..b + 1)?, k.unsqueeze(0)?, v.unsqueeze(0)?);
            let want = reference(&qb, &kb, &vb, f64::from(scale), &mods)?.squeeze(0)?;
            let gpu = on(&dev, &(qb, kb, vb))?;
            let base =
                attention_in(dtype, &gpu.0, &gpu.1, &gpu.2, f64::from(scale), &mods)?.squeeze(0)?;
            let (holds, figures) = meets_the_rule(&got, &base, &want, dtype)?;
            assert!(holds, "sequence {b}, window {window:?}: {figures}");
        }
    }
    Ok(())
}

/// Bad inputs on the GPU: candle errors, never a panic or a wrong answer.
#[test]
fn bad_inputs_are_errors_on_the_gpu() -> Result<()> {
    let Some(dev) = cuda("bad_inputs_are_errors_on_the_gpu") else { return Ok(()) };
    let q = tensor(&[1, 16, 2, 64], 1, DType::F16)?.to_device(&dev)?;
    let expect_err = |r: Result<Tensor>, what: &str, needle: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: accepted")).to_string();
        assert!(e.contains(needle), "{what}: {e}");
    };
    let q32 = q.to_dtype(DType::F32)?;
    expect_err(flash_attn(&q32, &q32, &q32, 1.0, false), "f32 on the GPU", "f16 or bf16");
    let on_cpu = q.to_device(&Device::Cpu)?;
    assert!(flash_attn(&q, &on_cpu, &on_cpu, 1.0, false).is_err(), "k and v on another device");
    let wide = tensor(&[1, 16, 2, 264], 2, DType::F16)?.to_device(&dev)?;
    expect_err(flash_attn(&wide, &wide, &wide, 1.0, false), "d = 264", "head dim");
    // d = 256 runs forward, but no backward kernel takes it: an error from `backward`.
    let big = Var::from_tensor(&tensor(&[1, 16, 2, 256], 3, DType::F16)?.to_device(&dev)?)?;
    let o = flash_attn(&big, &big, &big, 1.0, true)?;
    assert!(o.to_dtype(DType::F32)?.sum_all()?.backward().is_err(), "backward at d = 256");
    let cache = KvCache::new(1, 8, 2, 64, DType::F32, &dev)?;
    assert!(cache.attend(&q32.narrow(1, 0, 1)?, 1.0, None).is_err(), "an f32 cache on the GPU");
    Ok(())
}

/// A broadcast gradient (`o.sum_all()`'s, one element seen everywhere) and broadcast inputs are
/// copied before the kernels read them: the same gradients as from contiguous ones.
#[test]
fn broadcast_tensors_are_taken() -> Result<()> {
    let Some(dev) = cuda("broadcast_tensors_are_taken") else { return Ok(()) };
    let q = Var::from_tensor(&tensor(&[1, 40, 4, 64], 6, DType::F16)?.to_device(&dev)?)?;
    // One key/value head's row broadcast over the sequence.
    let kv = tensor(&[1, 1, 2, 64], 7, DType::F16)?.to_device(&dev)?;
    let k = kv.broadcast_as((1, 40, 2, 64))?;
    let o = flash_attn(&q, &k, &k, 0.125, true)?;
    let by_sum = o.sum_all()?.backward()?;
    let ones = o.ones_like()?;
    let o = flash_attn(&q, &k.contiguous()?, &k.contiguous()?, 0.125, true)?;
    let by_product = (o * ones)?.sum_all()?.backward()?;
    let (a, b) = (by_sum.get(&q).expect("dq"), by_product.get(&q).expect("dq"));
    assert_eq!(max_diff(a, b)?.0, 0.0);
    Ok(())
}
