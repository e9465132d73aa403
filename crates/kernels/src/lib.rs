//! # ladder-kernels: the GPU rungs of attention-ladder
//!
//! FlashAttention kernels written in CUDA C++, compiled at run time with NVRTC for the GPU found
//! (`sm_90a` on Hopper, `sm_80`+ elsewhere), behind a small safe Rust API. Each rung is one module
//! and one `.cu` file, checked by the workspace's `ladder-compare` crate against its CPU rung and a
//! float64 oracle.
//!
//! ```no_run
//! use ladder_kernels::{DType, Gpu, Options, fa2};
//!
//! let gpu = Gpu::new()?; // Err(NoCuda) on a machine without a GPU, never a panic
//! let (b, h, n, d) = (1, 8, 1000, 128);
//! let x: Vec<f32> = (0..b * h * n * d).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
//! let q = gpu.upload(&x, &[b, h, n, d], DType::F16)?;
//! let k = gpu.upload(&x, &[b, h, n, d], DType::F16)?;
//! let v = gpu.upload(&x, &[b, h, n, d], DType::F16)?;
//! let out = fa2::forward(&gpu, &q, &k, &v, &Options::causal())?;
//! let o: Vec<f32> = out.o.to_f32_vec()?;
//!
//! let d_o = gpu.upload(&x, &[b, h, n, d], DType::F16)?;
//! let grads = fa2::backward(&gpu, &q, &k, &v, &out, &d_o, &Options::causal().deterministic())?;
//! # Ok::<(), ladder_kernels::KernelError>(())
//! ```
//!
//! FlashAttention-3 on Hopper ([`fa3::forward`]) and its FP8 path ([`fa3::fp8::forward`]: e4m3
//! operands with block scales and incoherent processing).
//!
//! **Score modifiers.** Softcap, ALiBi, or any `score_mod` you write in CUDA ([`ScoreMod`]),
//! compiled into the kernels: [`Options::with_score_mod`].
//!
//! Decoding against a KV cache, contiguous or paged (a few new tokens per sequence, the keys
//! split across blocks), with FlashDecoding or FlashDecoding++ (a unified max, a flat GEMM, a
//! GEMV, and a dispatcher that picks): [`decode::forward`].
//!
//! **Attention, whichever rung fits** ([`attention::forward`], [`attention::backward`]): FA3 on
//! Hopper where it takes the call, FA2 otherwise. **Ring attention** ([`ring::forward`]): the
//! sequence shared among ranks whose K/V slices travel round a ring, on simulated ranks of one GPU.
//!
//! **Your own buffers.** [`Tensor::from_cuda_slice`] wraps a cudarc `CudaSlice` (no copy) and
//! [`Tensor::into_cuda_slice`] hands it back; [`Gpu::from_stream`] runs the kernels on a stream you
//! already have, in order with your own work.
//!
//! **Configuration.** The library reads no environment variables: the device, synchronous
//! launches, NVRTC options, the kernel cache and tile overrides are fields of [`GpuConfig`].
//! Kernels are compiled once per process and cached on disk ([`KernelCache`]). A kernel file
//! can be compiled from edited text instead of the crate's ([`GpuConfig::kernel_source`], with
//! the original from [`kernel_source`]): every rung that launches it then runs the edit.
//! [`inspect`] compiles a rung's kernel (the crate's or an edit) without a GPU and reports what
//! ptxas made of it: registers, spills, and the machine code's instruction mix.

#![warn(missing_docs)]

pub mod attention;
mod compile;
pub mod decode;
mod error;
pub mod fa1;
pub mod fa2;
pub mod fa3;
mod gpu;
pub mod inspect;
pub mod mask_mod;
mod problem;
pub mod ring;
pub mod score_mod;
pub mod sinks;
mod tensor;
pub mod varlen;

pub use compile::{KERNEL_FILES, kernel_source};
pub use error::{KernelError, Result};
pub use gpu::{Gpu, GpuConfig, KernelCache, Tuning};
pub use mask_mod::MaskMod;
pub use problem::{Gradients, Options, Output, Packed, Problem, Window};
pub use score_mod::ScoreMod;
pub use sinks::Sinks;
pub use tensor::{DType, Element, Tensor, round_to};

/// Re-exported so that callers can name the buffer types of [`Tensor::from_cuda_slice`] and
/// [`Gpu::from_stream`] without depending on the same `cudarc` version themselves.
pub use cudarc;

/// Whether the CUDA driver library (`libcuda.so`) can be used. With the default
/// `dynamic-loading` feature cudarc opens it on first use and panics without it, so this asks
/// first (only opening it); with `dynamic-linking` the program could not have started without it.
pub fn driver_library_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    // SAFETY: only probes whether the library can be opened.
    return unsafe { cudarc::driver::sys::is_culib_present() };
    #[cfg(not(feature = "dynamic-loading"))]
    return true;
}

/// Whether NVRTC (`libnvrtc.so`) can be used, as [`driver_library_present`] asks of the driver.
pub fn nvrtc_library_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    // SAFETY: only probes whether the library can be opened.
    return unsafe { cudarc::nvrtc::sys::is_culib_present() };
    #[cfg(not(feature = "dynamic-loading"))]
    return true;
}

/// Every kernel variant the crate can launch on architecture `arch`: what the compile check
/// (`.ci/kernels`) builds to see that all of them compile and what ptxas makes of them.
#[cfg(test)]
pub(crate) fn variants(arch: &str) -> Vec<compile::Variant> {
    let mut all = fa1::variants();
    all.extend(fa2::variants(arch));
    all.extend(fa3::variants(arch));
    all.extend(fa3::fp8::variants(arch));
    all.extend(fa3::backward::variants(arch));
    all.extend(decode::variants());
    all.extend(ring::variants());
    all
}
