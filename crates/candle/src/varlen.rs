//! `flash_attn_varlen`: sequences of different lengths packed back to back, no padding
//! (candle-flash-attn's and flash-attention's `varlen` functions), with a backward pass.
//!
//! `q` is `[total_q, heads_q, d]`, `k` and `v` `[total_kv, heads_kv, d]`; `seqlens_q` and
//! `seqlens_k` (`u32`, `batch + 1` entries) are the offsets of each sequence's first row, from 0 to
//! the total. Each sequence is its own attention problem, with its own bottom-right causal mask;
//! `ladder_reference::varlen` runs the FA2 rung on each in turn.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, bail};
use ladder_reference::varlen::{self, SeqLens};
use ladder_reference::{Element, Fa2Options, fa2};
use ndarray::{Array3, Ix2, Ix3};

#[cfg(feature = "cuda")]
use crate::cuda;
use crate::flash_attn::Modifiers;
use crate::layout::{array, array_tensor, storage, tensor_arrays};
use crate::op::{self, Saved, err};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// The packed attention op on `(q, k, v)`, `[total, heads, d]` each.
pub struct FlashAttnVarLen {
    modifiers: Modifiers,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    /// The forward pass's log-sum-exp `[heads_q, total_q]`, for the backward pass.
    lse: Saved<Ix2>,
}

/// The packed tensors' axes as they are.
const SAME: Ix3 = Ix3(0, 1, 2);
/// [`SAME`] as the GPU path takes it.
#[cfg(feature = "cuda")]
const SAME_AXES: [usize; 3] = [0, 1, 2];
const NAME: &str = "ladder-flash-attn-varlen";

impl FlashAttnVarLen {
    /// The sequences' offsets, checked against each other, the totals and the maxima given.
    fn seqlens(&self, total_q: usize, total_k: usize) -> Result<SeqLens> {
        Ok(self.offsets(total_q, total_k)?.0)
    }

    /// [`FlashAttnVarLen::seqlens`], and the offsets as given (`seqlens_q`, `seqlens_k`).
    fn offsets(&self, total_q: usize, total_k: usize) -> Result<(SeqLens, Vec<usize>, Vec<usize>)> {
        let offsets = |t: &Tensor, name: &str| -> Result<Vec<usize>> {
            if t.rank() != 1 || t.dtype() != DType::U32 {
                bail!(
                    "{NAME}: {name} must be a u32 tensor [batch + 1], got {:?} {:?}",
                    t.dtype(),
                    t.dims()
                );
            }
            Ok(t.to_vec1::<u32>()?.into_iter().map(|x| x as usize).collect())
        };
        let (cu_q, cu_k) =
            (offsets(&self.seqlens_q, "seqlens_q")?, offsets(&self.seqlens_k, "seqlens_k")?);
        let lens = SeqLens::new(&cu_q, &cu_k).map_err(|e| err(NAME, e))?;
        if lens.totals() != (total_q, total_k) {
            bail!(
                "{NAME}: seqlens_q and seqlens_k end at {:?}, but q has {total_q} rows and k {total_k}",
                lens.totals()
            );
        }
        let (longest_q, longest_k) = lens.max_lengths();
        if longest_q > self.max_seqlen_q || longest_k > self.max_seqlen_k {
            bail!(
                "{NAME}: max_seqlen_q = {}, max_seqlen_k = {}, but the longest sequence has {longest_q} \
                 queries and {longest_k} keys",
                self.max_seqlen_q,
                self.max_seqlen_k
            );
        }
        Ok((lens, cu_q, cu_k))
    }

    /// The offsets uploaded for the GPU rungs, checked as [`FlashAttnVarLen::seqlens`] checks them.
    #[cfg(feature = "cuda")]
    fn gpu_seqlens(
        &self,
        gpu: &ladder_kernels::Gpu,
        total_q: usize,
        total_k: usize,
    ) -> Result<ladder_kernels::varlen::SeqLens> {
        let (_, cu_q, cu_k) = self.offsets(total_q, total_k)?;
        let narrow = |cu: Vec<usize>| -> Result<Vec<i32>> {
            cu.into_iter()
                .map(|x| i32::try_from(x).map_err(|_| err(NAME, format!("offset {x} past i32"))))
                .collect()
        };
        ladder_kernels::varlen::SeqLens::upload(gpu, &narrow(cu_q)?, &narrow(cu_k)?)
            .map_err(|e| err(NAME, e))
    }
}

impl op::Attention for FlashAttnVarLen {
    const NAME: &'static str = NAME;
    const AXES: &'static str = "total, heads, head_dim";

    fn forward<T: Element>(
        &self,
        (q, q_l): (&CpuStorage, &Layout),
        (k, k_l): (&CpuStorage, &Layout),
        (v, v_l): (&CpuStorage, &Layout),
        out_dtype: DType,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v): (Array3<T>, Array3<T>, Array3<T>) =
            (array(q, q_l, SAME)?, array(k, k_l, SAME)?, array(v, v_l, SAME)?);
        let lens = self.seqlens(q.dim().0, k.dim().0)?;
        let opts = Fa2Options::new(self.modifiers.options(NAME)?);
        let out = varlen::forward(q.view(), k.view(), v.view(), &lens, |q, k, v| {
            fa2::forward(q, k, v, &opts)
        })
        .map_err(|e| err(NAME, e))?;
        self.lse.keep(&out.lse);
        storage(&out.o, SAME, out_dtype)
    }

    fn gradients<T: Element>(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let [q_a, k_a, v_a, o_a, do_a]: [Array3<T>; 5] = tensor_arrays([q, k, v, o, d_o], SAME)?;
        let lens = self.seqlens(q_a.dim().0, k_a.dim().0)?;
        let opts = Fa2Options::new(self.modifiers.options(NAME)?);
        let rung = |e| err(NAME, e);
        let lse = match self.lse.get::<T>() {
            Some(lse) => lse,
            None => {
                let (qv, kv, vv) = (q_a.view(), k_a.view(), v_a.view());
                varlen::forward(qv, kv, vv, &lens, |q, k, v| fa2::forward(q, k, v, &opts))
                    .map_err(rung)?
                    .lse
            }
        };
        let g = varlen::backward(
            (q_a.view(), k_a.view(), v_a.view()),
            (o_a.view(), lse.view()),
            do_a.view(),
            &lens,
            false,
            |s| fa2::backward(s.q, s.k, s.v, s.o, s.d_o, s.lse, &opts),
        )
        .map_err(rung)?;
        let back =
            |a: &Array3<T>, like: &Tensor| array_tensor(a, SAME, like.dtype(), like.device());
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
            cuda::lend_qkv(NAME, [(q, q_l), (k, k_l), (v, v_l)], &SAME_AXES)?;
        let lens = self.gpu_seqlens(&gpu, q_l.dims()[0], k_l.dims()[0])?;
        let opts = self.modifiers.gpu_options(NAME)?;
        let out = cuda::forward_varlen(&gpu, (&q_t, &k_t, &v_t), &lens, &opts)
            .map_err(|e| err(NAME, e))?;
        self.lse.keep_device(out.lse);
        cuda::to_storage(NAME, out.o, &SAME_AXES, &q.device)
    }

    #[cfg(feature = "cuda")]
    fn cuda_gradients(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = q.device().as_cuda_device()?;
        let gpu = cuda::gpu(NAME, dev)?;
        let lens = self.gpu_seqlens(&gpu, q.dim(0)?, k.dim(0)?)?;
        let d_o = cuda::without_broadcast(d_o)?; // (the gradient of a sum is a broadcast)
        let guards = [q, k, v, o, &d_o].map(Tensor::storage_and_layout);
        let [q_t, k_t, v_t, o_t, do_t] = cuda::lend_all(NAME, &guards, &SAME_AXES)?;
        let opts = self.modifiers.gpu_options(NAME)?;
        let rung = |e| err(NAME, e);
        let lse = match self.lse.get_device() {
            Some(lse) => lse,
            None => cuda::forward_varlen(&gpu, (&q_t, &k_t, &v_t), &lens, &opts).map_err(rung)?.lse,
        };
        let out = ladder_kernels::Output { o: o_t.alias()?, lse };
        // (FlashAttention-3 has no packed backward pass: FlashAttention-2's runs it.)
        let g =
            ladder_kernels::fa2::backward_varlen(&gpu, &q_t, &k_t, &v_t, &out, &do_t, &lens, &opts)
                .map_err(rung)?;
        let back = |t| cuda::to_tensor(NAME, t, &SAME_AXES, dev);
        Ok((back(g.dq)?, back(g.dk)?, back(g.dv)?))
    }
}

op::custom_op3!(FlashAttnVarLen);

/// Packed attention with candle-flash-attn's signature: `q` `[total_q, heads_q, d]`, `k` and `v`
/// `[total_kv, heads_kv, d]`, `seqlens_q` and `seqlens_k` the `u32` offsets of each sequence's first
/// row (`batch + 1` entries, `0, len_0, len_0 + len_1, …`), `max_seqlen_q` and `max_seqlen_k` at
/// least the longest sequence's. The result is `[total_q, heads_q, d]`; each sequence is its own
/// problem (its own bottom-right causal mask). Differentiable.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let window_right = causal.then_some(0);
    flash_attn_varlen_windowed(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        window_right,
    )
}

/// [`flash_attn_varlen`] within a window of keys around each query's diagonal
/// ([`crate::flash_attn_windowed`]'s convention, per sequence).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let op = FlashAttnVarLen {
        modifiers: Modifiers {
            softmax_scale,
            alibi_slopes: None,
            window_size_left,
            window_size_right,
            softcap: None,
        },
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        max_seqlen_q,
        max_seqlen_k,
        lse: Saved::default(),
    };
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        let (k, v) = (cuda::without_broadcast(k)?, cuda::without_broadcast(v)?);
        return cuda::in_axis_order(q)?.apply_op3(&k, &v, op);
    }
    q.apply_op3(k, v, op)
}
