//! Rung 3 on the GPU: FlashAttention-1 (Dao et al. 2022, Algorithm 1), written to be read.
//!
//! The outer loop runs over K/V tiles, the inner over Q tiles, and the running output `O` and the
//! softmax statistics `l`, `m` go back to global memory after every inner step. One thread block
//! per (batch, head) walks the outer loop; its warps share the independent Q tiles of each step.
//! Scalar `f32` arithmetic, no tensor cores: the gap to [`crate::fa2`] is the lesson. Kernel:
//! `cuda/fa1.cu`.

use cudarc::driver::DeviceRepr;

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Options, Output, Problem, grid};
use crate::tensor::{DType, Tensor};

pub(crate) const SRC: &str = include_str!("../cuda/fa1.cu");

/// Head dimensions with an FA1 kernel (its K/V tiles live in 48 KB of static shared memory).
pub const HEAD_DIMS: &[usize] = &[32, 64, 128];
/// Element types of the FA1 kernel.
pub const DTYPES: &[DType] = &[DType::F16, DType::BF16, DType::F32];
/// Keys per K/V tile (`B_c` of Algorithm 1).
pub const BC: usize = 32;
/// Query rows per Q tile (`B_r` of Algorithm 1): one per lane of a warp.
pub const BR: usize = 32;
/// Warps per block; each takes Q tiles of `BR` rows.
pub const WARPS: usize = 8;

/// The kernel variant for head dimension `d` and element type `dtype`.
pub(crate) fn variant(d: usize, dtype: DType) -> Result<Variant> {
    if !HEAD_DIMS.contains(&d) {
        return Err(KernelError::UnsupportedHeadDim { rung: "fa1", d, supported: HEAD_DIMS });
    }
    Ok(Variant {
        file: "fa1",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FA1_D", d.to_string()),
            ("FA1_BC", BC.to_string()),
            ("FA1_WARPS", WARPS.to_string()),
        ],
        generated: Vec::new(),
    })
}

/// Every variant of this rung, for the compile check.
#[cfg(test)]
pub(crate) fn variants() -> Vec<Variant> {
    let mut all = Vec::new();
    for &dtype in DTYPES {
        for &d in HEAD_DIMS {
            all.extend(variant(d, dtype));
        }
    }
    all
}

/// Mirror of `Fa1Params` in `cuda/fa1.cu` (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    o_acc: u64,
    l_acc: u64,
    m_acc: u64,
    heads_q: i32,
    heads_kv: i32,
    n_q: i32,
    n_kv: i32,
    scale: f32,
    causal: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror.
unsafe impl DeviceRepr for Params {}

/// `softmax(scale · Q Kᵀ + mask) V` and its log-sum-exp, the FA1 way. fp16, bf16 or f32 inputs;
/// head dim 32, 64 or 128; any lengths, bottom-right causal, grouped-query attention.
pub fn forward(gpu: &Gpu, q: &Tensor, k: &Tensor, v: &Tensor, opts: &Options) -> Result<Output> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    p.require_no_mask_mod("fa1")?;
    p.require_contiguous("fa1")?;
    p.require_no_window("fa1")?;
    p.require_no_score_mod("fa1")?;
    p.require_no_sinks("fa1")?;
    p.require_dtype("fa1", DTYPES, "fp16, bf16, f32")?;
    let kernel = Kernel { variant: variant(p.d, p.dtype)?, entry: "fa1_forward" };
    gpu.prepare(&kernel, 0)?;
    let mut o = gpu.output(&p.o_shape(), p.dtype)?;
    let mut lse = gpu.output(&p.lse_shape(), DType::F32)?;
    // The "HBM" copies of O, l and m that Algorithm 1 reads and writes at every step (the kernel
    // initialises them itself, as line 2 does).
    let mut o_acc = gpu.output(&p.o_shape(), DType::F32)?;
    let mut l_acc = gpu.output(&p.lse_shape(), DType::F32)?;
    let mut m_acc = gpu.output(&p.lse_shape(), DType::F32)?;
    {
        let s = gpu.stream();
        let (q_ptr, _g0) = q.read_ptr(s);
        let (k_ptr, _g1) = k.read_ptr(s);
        let (v_ptr, _g2) = v.read_ptr(s);
        let (o_ptr, _g3) = o.write_ptr(s)?;
        let (lse_ptr, _g4) = lse.write_ptr(s)?;
        let (o_acc_ptr, _g5) = o_acc.write_ptr(s)?;
        let (l_acc_ptr, _g6) = l_acc.write_ptr(s)?;
        let (m_acc_ptr, _g7) = m_acc.write_ptr(s)?;
        let [hq, hkv, nq, nkv] = p.dims_i32();
        let params = Params {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            o: o_ptr,
            lse: lse_ptr,
            o_acc: o_acc_ptr,
            l_acc: l_acc_ptr,
            m_acc: m_acc_ptr,
            heads_q: hq,
            heads_kv: hkv,
            n_q: nq,
            n_kv: nkv,
            scale: p.scale,
            causal: p.causal as i32,
        };
        gpu.launch(&kernel, grid(1, p.heads_q, p.batch)?, 32 * WARPS as u32, 0, &params)?;
    }
    Ok(Output { o, lse })
}
