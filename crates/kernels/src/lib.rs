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
//! # Ok::<(), ladder_kernels::KernelError>(())
//! ```
//!
//! Kernels are compiled once per process and cached on disk (see [`compile::cache_dir`]).

pub mod compile;
mod error;
pub mod fa1;
pub mod fa2;
mod gpu;
mod problem;
mod tensor;
pub mod testing;

pub use error::{KernelError, Result};
pub use gpu::Gpu;
pub use problem::{Gradients, Options, Output, Problem};
pub use tensor::{DType, Tensor, round_to};

/// Every kernel variant the crate can launch on architecture `arch`: what CI compiles to check
/// that all of them build and what ptxas makes of them.
pub fn variants(arch: &str) -> Vec<compile::Variant> {
    let mut all = Vec::new();
    for dtype in [DType::F16, DType::F32] {
        for &d in fa1::HEAD_DIMS {
            all.extend(fa1::variant(d, dtype));
        }
    }
    for dtype in [DType::F16, DType::BF16] {
        for &d in fa2::HEAD_DIMS {
            for causal in [false, true] {
                all.extend(fa2::forward_variant(d, dtype, causal, arch));
                if fa2::BACKWARD_HEAD_DIMS.contains(&d) {
                    for deterministic in [false, true] {
                        all.extend(fa2::backward_variant(d, dtype, causal, deterministic));
                    }
                }
            }
        }
    }
    all
}
