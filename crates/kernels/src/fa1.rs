//! Rung 2 on the GPU: FlashAttention-1 (Dao et al. 2022, Algorithm 1), written to be read.
//!
//! The outer loop runs over K/V tiles, the inner over Q tiles, and the running output `O` and the
//! softmax statistics `l`, `m` go back to global memory after every inner step. One thread block
//! per (batch, head) walks the outer loop; its warps share the independent Q tiles of each step.
//! Scalar `f32` arithmetic, no tensor cores: the gap to [`crate::fa2`] is the lesson. Kernel:
//! `cuda/fa1.cu`.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::Gpu;
use crate::problem::{Options, Output, Problem, grid};
use crate::tensor::DType;

const SRC: &str = include_str!("../cuda/fa1.cu");

/// Head dimensions with an FA1 kernel (its K/V tiles live in 48 KB of static shared memory).
pub const HEAD_DIMS: &[usize] = &[32, 64, 128];
/// Keys per K/V tile (`B_c` of Algorithm 1).
pub const BLOCK_N: usize = 32;
/// Warps per block; each takes Q tiles of 32 rows (`B_r`).
pub const WARPS: usize = 8;

/// The kernel variant for head dimension `d` and element type `dtype`.
pub fn variant(d: usize, dtype: DType) -> Result<Variant> {
    if !HEAD_DIMS.contains(&d) {
        return Err(KernelError::UnsupportedHeadDim { rung: "fa1", d, supported: HEAD_DIMS });
    }
    Ok(Variant {
        file: "fa1",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FA1_D", d.to_string()),
            ("FA1_BC", BLOCK_N.to_string()),
            ("FA1_WARPS", WARPS.to_string()),
        ],
    })
}

/// `softmax(scale · Q Kᵀ + mask) V` and its log-sum-exp, the FA1 way. fp16, bf16 or f32 inputs;
/// head dim 32, 64 or 128; any lengths, bottom-right causal, grouped-query attention.
pub fn forward(
    gpu: &Gpu,
    q: &crate::Tensor,
    k: &crate::Tensor,
    v: &crate::Tensor,
    opts: &Options,
) -> Result<Output> {
    let p = Problem::new(q, k, v, opts)?;
    let f = gpu.function(&variant(p.d, p.dtype)?, "fa1_forward", 0)?;
    let o = gpu.output(&p.o_shape(), p.dtype)?;
    let lse = gpu.output(&p.lse_shape(), DType::F32)?;
    // The "HBM" copies of O, l and m that Algorithm 1 reads and writes at every step (the kernel
    // initialises them itself, as line 2 does).
    let o_acc = gpu.output(&p.o_shape(), DType::F32)?;
    let l_acc = gpu.output(&p.lse_shape(), DType::F32)?;
    let m_acc = gpu.output(&p.lse_shape(), DType::F32)?;
    let cfg = LaunchConfig {
        grid_dim: grid(1, p.heads_q, p.batch)?,
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (hq, hkv, nq, nkv) = (p.heads_q as i32, p.heads_kv as i32, p.n_q as i32, p.n_kv as i32);
    let causal = p.causal as i32;
    let mut launch = gpu.stream().launch_builder(&f);
    launch
        .arg(&q.data)
        .arg(&k.data)
        .arg(&v.data)
        .arg(&o.data)
        .arg(&lse.data)
        .arg(&o_acc.data)
        .arg(&l_acc.data)
        .arg(&m_acc.data)
        .arg(&hq)
        .arg(&hkv)
        .arg(&nq)
        .arg(&nkv)
        .arg(&p.scale)
        .arg(&causal);
    // SAFETY: the arguments match fa1_forward's signature and every buffer is sized as indexed.
    gpu.check_launch(unsafe { launch.launch(cfg) }.map(|_| ()), "fa1_forward", &cfg)?;
    Ok(Output { o, lse })
}
