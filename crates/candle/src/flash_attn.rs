//! `flash_attn` and its windowed, ALiBi and softcap forms: candle-flash-attn's functions, with a
//! backward pass.
//!
//! The op is a [`CustomOp3`] on `(q, k, v)`, `[batch, seq, heads, d]` each (GQA: `k` and `v` with
//! fewer heads). Its forward pass keeps each row's log-sum-exp, which its backward pass reads to
//! recompute the probabilities tile by tile (FlashAttention-2's backward; `ladder_reference::fa2`
//! on the CPU), so `loss.backward()` reaches `q`, `k` and `v` through it.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, bail};
use ladder_reference::{AttentionOptions, Element, Fa2Options, ScoreMod, Window, fa2};
use ndarray::{Array4, Ix3, Ix4};

#[cfg(feature = "cuda")]
use crate::cuda;
use crate::layout::{array, array_tensor, storage, tensor_arrays};
use crate::op::{self, Saved, err};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// What an attention call computes beyond `softmax(scale · Q Kᵀ) V`, in candle-flash-attn's
/// terms: a window `(left, right)` of keys around each query's diagonal (bottom-right aligned;
/// `(None, Some(0))` is the causal mask), ALiBi slopes (one per query head, flash-attention's
/// convention) and a softcap (`cap · tanh(s / cap)`, applied before ALiBi).
#[derive(Clone, Debug)]
pub(crate) struct Modifiers {
    pub(crate) softmax_scale: f32,
    pub(crate) alibi_slopes: Option<Tensor>,
    pub(crate) window_size_left: Option<usize>,
    pub(crate) window_size_right: Option<usize>,
    pub(crate) softcap: Option<f32>,
}

impl Modifiers {
    /// The CPU rungs' options for these settings (`op` names the op in errors).
    pub(crate) fn options(&self, op: &str) -> Result<AttentionOptions> {
        if !(self.softmax_scale.is_finite() && self.softmax_scale > 0.0) {
            bail!("{op}: softmax_scale must be positive and finite, got {}", self.softmax_scale);
        }
        let window = Window { left: self.window_size_left, right: self.window_size_right };
        let mut opts = AttentionOptions {
            scale: Some(f64::from(self.softmax_scale)),
            ..AttentionOptions::default()
        }
        .with_window(window);
        if let Some(cap) = self.softcap {
            opts = opts.with_softcap(f64::from(cap)).map_err(|e| err(op, e))?;
        }
        if let Some(slopes) = &self.alibi_slopes {
            if slopes.rank() != 1 {
                bail!("{op}: alibi_slopes must be [num_heads_q], got shape {:?}", slopes.dims());
            }
            let slopes: Vec<f64> = slopes.to_dtype(DType::F64)?.to_vec1()?;
            opts = opts.with_score_mod(ScoreMod::alibi(slopes).map_err(|e| err(op, e))?);
        }
        Ok(opts)
    }

    /// The GPU rungs' options for these settings (`op` names the op in errors).
    #[cfg(feature = "cuda")]
    pub(crate) fn gpu_options(&self, op: &str) -> Result<ladder_kernels::Options> {
        use ladder_kernels::ScoreMod;
        if !(self.softmax_scale.is_finite() && self.softmax_scale > 0.0) {
            bail!("{op}: softmax_scale must be positive and finite, got {}", self.softmax_scale);
        }
        // flash-attention's `(left, 0)` is the causal mask with `left` keys before the diagonal.
        let causal = self.window_size_right == Some(0);
        let right = if causal { None } else { self.window_size_right };
        let mut score_mod = match self.softcap {
            Some(cap) if cap != 0.0 => Some(ScoreMod::softcap(cap).map_err(|e| err(op, e))?),
            _ => None,
        };
        if let Some(slopes) = &self.alibi_slopes {
            if slopes.rank() != 1 {
                bail!("{op}: alibi_slopes must be [num_heads_q], got shape {:?}", slopes.dims());
            }
            let alibi =
                ScoreMod::alibi(slopes.to_dtype(DType::F32)?.to_vec1()?).map_err(|e| err(op, e))?;
            score_mod = Some(match score_mod {
                Some(softcap) => softcap.then(alibi),
                None => alibi,
            });
        }
        Ok(ladder_kernels::Options {
            causal,
            scale: Some(self.softmax_scale),
            window: ladder_kernels::Window { left: self.window_size_left, right },
            score_mod,
            ..ladder_kernels::Options::default()
        })
    }
}

/// The attention op on `(q, k, v)`, `[batch, seq, heads, d]` each.
pub struct FlashAttn {
    modifiers: Modifiers,
    /// The forward pass's log-sum-exp `[batch, heads_q, seq_q]`, for the backward pass.
    lse: Saved<Ix3>,
}

/// `[b, s, h, d]` ↔ `[b, h, s, d]`: candle-flash-attn's layout and the rungs' (its own inverse).
const BSHD: Ix4 = Ix4(0, 2, 1, 3);
/// [`BSHD`] as the GPU path takes it.
#[cfg(feature = "cuda")]
const BSHD_AXES: [usize; 4] = [0, 2, 1, 3];

impl op::Attention for FlashAttn {
    const NAME: &'static str = "ladder-flash-attn";
    const AXES: &'static str = "batch, seq, heads, head_dim";

    fn forward<T: Element>(
        &self,
        (q, q_l): (&CpuStorage, &Layout),
        (k, k_l): (&CpuStorage, &Layout),
        (v, v_l): (&CpuStorage, &Layout),
        out_dtype: DType,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v): (Array4<T>, Array4<T>, Array4<T>) =
            (array(q, q_l, BSHD)?, array(k, k_l, BSHD)?, array(v, v_l, BSHD)?);
        let opts = Fa2Options::new(self.modifiers.options(Self::NAME)?);
        let out =
            fa2::forward(q.view(), k.view(), v.view(), &opts).map_err(|e| err(Self::NAME, e))?;
        self.lse.keep(&out.lse);
        storage(&out.o, BSHD, out_dtype)
    }

    fn gradients<T: Element>(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let [q_a, k_a, v_a, o_a, do_a]: [Array4<T>; 5] = tensor_arrays([q, k, v, o, d_o], BSHD)?;
        let opts = Fa2Options::new(self.modifiers.options(Self::NAME)?);
        let rung = |e| err(Self::NAME, e);
        // The forward pass's lse (recomputed if this op never ran forward).
        let lse = match self.lse.get::<T>() {
            Some(lse) => lse,
            None => fa2::forward(q_a.view(), k_a.view(), v_a.view(), &opts).map_err(rung)?.lse,
        };
        let (qv, kv, vv) = (q_a.view(), k_a.view(), v_a.view());
        let g =
            fa2::backward(qv, kv, vv, o_a.view(), do_a.view(), lse.view(), &opts).map_err(rung)?;
        let back =
            |a: &Array4<T>, like: &Tensor| array_tensor(a, BSHD, like.dtype(), like.device());
        Ok((back(&g.dq, q)?, back(&g.dk, k)?, back(&g.dv, v)?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        (q, q_l): (&CudaStorage, &Layout),
        (k, k_l): (&CudaStorage, &Layout),
        (v, v_l): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (gpu, [q_t, k_t, v_t]) =
            cuda::lend_qkv(Self::NAME, [(q, q_l), (k, k_l), (v, v_l)], &BSHD_AXES)?;
        let opts = self.modifiers.gpu_options(Self::NAME)?;
        let out = cuda::forward(&gpu, (&q_t, &k_t, &v_t), &opts).map_err(|e| err(Self::NAME, e))?;
        self.lse.keep_device(out.lse);
        cuda::to_storage(Self::NAME, out.o, &BSHD_AXES, &q.device)
    }

    #[cfg(feature = "cuda")]
    fn cuda_gradients(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = q.device().as_cuda_device()?;
        let gpu = cuda::gpu(Self::NAME, dev)?;
        let d_o = cuda::without_broadcast(d_o)?; // (the gradient of a sum is a broadcast)
        let guards = [q, k, v, o, &d_o].map(Tensor::storage_and_layout);
        let [q_t, k_t, v_t, o_t, do_t] = cuda::lend_all(Self::NAME, &guards, &BSHD_AXES)?;
        let opts = self.modifiers.gpu_options(Self::NAME)?;
        let rung = |e| err(Self::NAME, e);
        let qkv = (&*q_t, &*k_t, &*v_t);
        // The forward pass's lse (recomputed if this op never ran forward on the GPU).
        let lse = match self.lse.get_device() {
            Some(lse) => lse,
            None => cuda::forward(&gpu, qkv, &opts).map_err(rung)?.lse,
        };
        let out = ladder_kernels::Output { o: o_t.alias()?, lse };
        let g = cuda::backward(&gpu, qkv, &out, &do_t, &opts).map_err(rung)?;
        let back = |t| cuda::to_tensor(Self::NAME, t, &BSHD_AXES, dev);
        Ok((back(g.dq)?, back(g.dk)?, back(g.dv)?))
    }
}

op::custom_op3!(FlashAttn);

/// Applies the attention op with `modifiers` to `(q, k, v)`.
fn apply(q: &Tensor, k: &Tensor, v: &Tensor, modifiers: Modifiers) -> Result<Tensor> {
    let op = FlashAttn { modifiers, lse: Saved::default() };
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        let (k, v) = (cuda::without_broadcast(k)?, cuda::without_broadcast(v)?);
        return cuda::in_axis_order(q)?.apply_op3(&k, &v, op);
    }
    q.apply_op3(k, v, op)
}

/// `softmax(scale · Q Kᵀ) V` with candle-flash-attn's signature: `q` `[batch, seq_q, heads_q,
/// d]`, `k` and `v` `[batch, seq_kv, heads_kv, d]` (`heads_q` a multiple of `heads_kv`), the
/// result `[batch, seq_q, heads_q, d]`. `causal` masks bottom-right (query `i` sees keys
/// `j ≤ i + seq_kv − seq_q`, the KV-cache convention of flash-attention ≥ 2.1). Differentiable:
/// its backward pass is FlashAttention-2's.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_windowed(q, k, v, softmax_scale, None, causal.then_some(0))
}

/// [`flash_attn`] within a window: query `i` sees keys `i + seq_kv − seq_q − left ..= i + seq_kv −
/// seq_q + right`, `None` leaving a side open; `(None, Some(0))` is the causal mask.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let modifiers = Modifiers {
        softmax_scale,
        alibi_slopes: None,
        window_size_left,
        window_size_right,
        softcap: None,
    };
    apply(q, k, v, modifiers)
}

/// [`flash_attn`] with ALiBi: `alibi_slopes` `[heads_q]`, the penalty `slope_h · |j − (i + seq_kv −
/// seq_q)|` subtracted from each score (flash-attention's convention).
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_alibi_windowed(q, k, v, alibi_slopes, softmax_scale, None, causal.then_some(0))
}

/// [`flash_attn_windowed`] with ALiBi ([`flash_attn_alibi`]).
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let modifiers = Modifiers {
        softmax_scale,
        alibi_slopes: Some(alibi_slopes.clone()),
        window_size_left,
        window_size_right,
        softcap: None,
    };
    apply(q, k, v, modifiers)
}

/// Every modifier at once: optional ALiBi slopes, a window and Gemma-2's softcap (`cap · tanh(s
/// / cap)` on each scaled score, before ALiBi; a cap of 0 is none, as in flash-attention).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let modifiers = Modifiers {
        softmax_scale,
        alibi_slopes: alibi_slopes.cloned(),
        window_size_left,
        window_size_right,
        softcap: Some(softcap),
    };
    apply(q, k, v, modifiers)
}
