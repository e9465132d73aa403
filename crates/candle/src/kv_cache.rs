//! A KV cache for generation and the decoding op that reads it.
//!
//! A generating model appends each step's keys and values to a cache and attends its few new
//! queries to everything cached: decoding, where the keys are many and the queries few. The
//! ladder's rung for it is FlashDecoding (the keys split into chunks attended in parallel, the
//! partial results combined by their log-sum-exp); [`KvCache::attend`] runs it on the cache's first
//! `lengths[b]` keys of each sequence (`ladder_reference::flash_decoding` on the CPU).

use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor, bail};
use ladder_reference::{AttentionOptions, Element, FlashDecodingOptions, Window, flash_decoding};
use ndarray::{Array4, Ix4, s};

#[cfg(feature = "cuda")]
use crate::cuda;
use crate::layout::{array, storage};
use crate::op::{self, err};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// Keys and values of a batch of sequences, `[batch, capacity, heads_kv, head_dim]` each (the
/// layout of flash-attention's `k_cache`), with a length per sequence: sequence `b`'s keys are
/// rows `0 .. lengths()[b]`.
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    lengths: Vec<usize>,
}

impl KvCache {
    /// An empty cache of `capacity` tokens per sequence.
    pub fn new(
        batch: usize,
        capacity: usize,
        heads_kv: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let k = Tensor::zeros((batch, capacity, heads_kv, head_dim), dtype, device)?;
        let v = Tensor::zeros((batch, capacity, heads_kv, head_dim), dtype, device)?;
        Ok(KvCache { k, v, lengths: vec![0; batch] })
    }

    /// The keys, `[batch, capacity, heads_kv, head_dim]` (rows past a sequence's length are
    /// not its keys).
    pub fn k(&self) -> &Tensor {
        &self.k
    }

    /// The values, laid out as the keys.
    pub fn v(&self) -> &Tensor {
        &self.v
    }

    /// Each sequence's cached tokens.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Appends `k_new` and `v_new`, `[n, heads_kv, head_dim]` each, to sequence `b`; an error past
    /// the capacity, or for tensors that do not fit the cache.
    pub fn append(&mut self, b: usize, k_new: &Tensor, v_new: &Tensor) -> Result<()> {
        let (batch, capacity, heads_kv, d) = self.k.dims4()?;
        let Some(&len) = self.lengths.get(b) else {
            bail!("kv cache: sequence {b} of a batch of {batch}");
        };
        for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
            let dims = t.dims();
            if dims.len() != 3 || dims[1..] != [heads_kv, d] {
                bail!("kv cache: {name} must be [n, {heads_kv}, {d}], got {dims:?}");
            }
        }
        let n = k_new.dim(0)?;
        if v_new.dim(0)? != n {
            bail!("kv cache: k_new has {n} tokens and v_new {}", v_new.dim(0)?);
        }
        if len + n > capacity {
            bail!("kv cache: sequence {b} holds {len} of {capacity} tokens; {n} more do not fit");
        }
        for (cache, new) in [(&self.k, k_new), (&self.v, v_new)] {
            let new = new.to_dtype(cache.dtype())?.contiguous()?.unsqueeze(0)?;
            cache.narrow(0, b, 1)?.slice_set(&new, 1, len)?;
        }
        self.lengths[b] = len + n;
        Ok(())
    }

    /// Attention of `q`, `[batch, n_new, heads_q, head_dim]`, to each sequence's cached keys:
    /// the new tokens are the last `n_new` cached ones (append them first) and causal among
    /// themselves, bottom-right, within a window of `window_size_left` keys before each one's
    /// position (none: all). Returns `[batch, n_new, heads_q, head_dim]`; a sequence without keys
    /// gives zeros. Inference only (no backward pass).
    pub fn attend(
        &self,
        q: &Tensor,
        softmax_scale: f32,
        window_size_left: Option<usize>,
    ) -> Result<Tensor> {
        let op = Decode { lengths: self.lengths.clone(), softmax_scale, window_size_left };
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            return crate::cuda::in_axis_order(q)?.apply_op3_no_bwd(&self.k, &self.v, &op);
        }
        q.apply_op3_no_bwd(&self.k, &self.v, &op)
    }
}

/// FlashDecoding of `(q, k_cache, v_cache)` over each sequence's first `lengths[b]` keys.
struct Decode {
    lengths: Vec<usize>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
}

/// `[b, s, h, d]` ↔ `[b, h, s, d]`.
const BSHD: Ix4 = Ix4(0, 2, 1, 3);

impl op::Attention for Decode {
    const NAME: &'static str = "ladder-kv-cache-attend";
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
        let batch = q.dim().0;
        if k.dim().0 != batch || self.lengths.len() != batch {
            let (cache, lengths) = (k.dim().0, self.lengths.len());
            bail!(
                "{}: q has {batch} sequences, the cache {cache} and {lengths} lengths",
                Self::NAME
            );
        }
        let attention = AttentionOptions {
            causal: true,
            scale: Some(f64::from(self.softmax_scale)),
            window: Window { left: self.window_size_left, right: None },
            ..AttentionOptions::default()
        };
        let opts = FlashDecodingOptions::new(attention);
        let mut o = Array4::zeros(q.dim());
        for (b, &len) in self.lengths.iter().enumerate().filter(|(_, len)| **len > 0) {
            let (k_b, v_b) =
                (k.slice(s![b..b + 1, .., ..len, ..]), v.slice(s![b..b + 1, .., ..len, ..]));
            let out = flash_decoding::forward(q.slice(s![b..b + 1, .., .., ..]), k_b, v_b, &opts)
                .map_err(|e| err(Self::NAME, e))?;
            o.slice_mut(s![b..b + 1, .., .., ..]).assign(&out.o);
        }
        // (A sequence without keys keeps O = 0.)
        storage(&o, BSHD, out_dtype)
    }

    fn gradients<T: Element>(
        &self,
        _: (&Tensor, &Tensor, &Tensor),
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        bail!("{}: decoding is inference only (no backward pass)", Self::NAME)
    }

    /// FlashDecoding on the GPU (`ladder_kernels::decode`, its dispatcher choosing the kernel and
    /// the splits), the cache read in place: `[batch, capacity, heads_kv, d]` is the kernels'
    /// `[batch, heads_kv, capacity, d]` with its middle axes swapped.
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        (q, q_l): (&CudaStorage, &Layout),
        (k, k_l): (&CudaStorage, &Layout),
        (v, v_l): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        use ladder_kernels::decode;
        const AXES: [usize; 4] = [0, 2, 1, 3];
        let (batch, cache) = (q_l.dims()[0], k_l.dims()[0]);
        if cache != batch || self.lengths.len() != batch {
            let lengths = self.lengths.len();
            bail!(
                "{}: q has {batch} sequences, the cache {cache} and {lengths} lengths",
                Self::NAME
            );
        }
        let (gpu, [q_t, k_t, v_t]) =
            cuda::lend_qkv(Self::NAME, [(q, q_l), (k, k_l), (v, v_l)], &AXES)?;
        let opts = decode::DecodeOptions {
            scale: Some(self.softmax_scale),
            window: ladder_kernels::Window { left: self.window_size_left, right: None },
            ..decode::DecodeOptions::default()
        };
        let cache = decode::KvCache { k: &k_t, v: &v_t, lengths: &self.lengths };
        let out = decode::forward(&gpu, &q_t, cache, &opts).map_err(|e| err(Self::NAME, e))?;
        cuda::to_storage(Self::NAME, out.o, &AXES, &q.device)
    }

    #[cfg(feature = "cuda")]
    fn cuda_gradients(
        &self,
        qkv: (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.gradients::<f32>(qkv, o, d_o)
    }
}

op::custom_op3!(Decode);
