//! # ladder-candle: the attention ladder's attention as candle ops
//!
//! [candle](https://github.com/huggingface/candle)'s flash attention, `candle-flash-attn`, is
//! flash-attention 2's CUDA sources compiled by nvcc at build time, forward only. This crate gives
//! the same functions with the same signatures — [`flash_attn`], [`flash_attn_windowed`],
//! [`flash_attn_alibi`], [`flash_attn_alibi_windowed`], [`flash_attn_alibi_windowed_softcap`],
//! [`flash_attn_varlen`], [`flash_attn_varlen_windowed`] — so that switching is a change of the
//! crate's name, and adds what candle-flash-attn lacks: a **backward pass** through candle's
//! autograd (`loss.backward()` reaches `q`, `k` and `v`), and a **KV cache** for generation
//! ([`KvCache`]). [`qwen2`] is a Qwen2-architecture decoder built on them.
//!
//! Tensors are candle-flash-attn's: `q` `[batch, seq_q, heads_q, head_dim]`, `k` and `v`
//! `[batch, seq_kv, heads_kv, head_dim]` with `heads_q` a multiple of `heads_kv` (grouped-query
//! attention), any strides with the head dimension contiguous; f16, bf16, f32 or f64. A causal mask
//! is aligned bottom-right (query `i` sees keys `j ≤ i + seq_kv − seq_q`, flash-attention ≥ 2.1 and
//! the KV-cache convention). A bad input (rank, dtype, heads, a strided head dimension, a
//! device) is a candle error, never a panic.
//!
//! On candle's CPU device the ops run the ladder's CPU FlashAttention-2 rung
//! (`ladder_reference::fa2`, in `f32`, or `f64` for `f64` tensors) and its backward pass. With the
//! `cuda` feature, on candle's CUDA device they run `ladder-kernels` (FlashAttention-3 on Hopper,
//! FlashAttention-2 elsewhere, FlashDecoding for the cache; f16 and bf16) on candle's own buffers,
//! without copies; without it a CUDA tensor is an error naming the op.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//!
//! let dev = Device::Cpu;
//! // One sequence of 5 tokens, 4 query heads over 2 kv heads, head dim 8.
//! let q = Var::randn(0f32, 1., (1, 5, 4, 8), &dev)?;
//! let k = Tensor::randn(0f32, 1., (1, 5, 2, 8), &dev)?;
//! let v = Tensor::randn(0f32, 1., (1, 5, 2, 8), &dev)?;
//! let o = ladder_candle::flash_attn(&q, &k, &v, 8f32.powf(-0.5), true)?;
//! assert_eq!(o.dims(), &[1, 5, 4, 8]);
//! // The backward pass: gradients reach q through the op.
//! let grads = o.sqr()?.sum_all()?.backward()?;
//! assert_eq!(grads.get(&q).expect("q's gradient").dims(), &[1, 5, 4, 8]);
//! # Ok::<(), candle_core::Error>(())
//! ```

#[cfg(feature = "cuda")]
mod cuda;
mod flash_attn;
mod kv_cache;
mod layout;
mod op;
pub mod qwen2;
mod varlen;

pub use flash_attn::{
    FlashAttn, flash_attn, flash_attn_alibi, flash_attn_alibi_windowed,
    flash_attn_alibi_windowed_softcap, flash_attn_windowed,
};
pub use kv_cache::KvCache;
pub use varlen::{FlashAttnVarLen, flash_attn_varlen, flash_attn_varlen_windowed};
