//! Rung 3 on the GPU: FlashAttention-2 (Dao 2023), forward on tensor cores.
//!
//! The loop swap of FA2: each thread block owns a tile of query rows and walks K/V once, keeping the
//! softmax statistics and the *unnormalised* output in registers; the output is divided by the row
//! sum once at the end, and `lse = m + log l` is stored for the backward pass. Causal tiles entirely
//! above the diagonal are skipped, and only diagonal and tail tiles are masked. Kernel:
//! `cuda/fa2_forward.cu` (mma.sync m16n8k16, ldmatrix, cp.async double buffering).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::Gpu;
use crate::problem::{Options, Output, Problem, grid};
use crate::tensor::{DType, Tensor};

const FORWARD_SRC: &str = include_str!("../cuda/fa2_forward.cu");

/// Head dimensions with an FA2 kernel.
pub const HEAD_DIMS: &[usize] = &[64, 128, 256];

/// Tile configuration of the forward kernel for one head dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardTiles {
    /// 16-row mma tiles per warp.
    pub m_tiles: usize,
    /// Keys per K/V tile.
    pub block_n: usize,
    /// Warps per block.
    pub warps: usize,
}

impl ForwardTiles {
    /// The tiles used for head dimension `d`.
    pub fn for_head_dim(d: usize) -> Result<ForwardTiles> {
        match d {
            64 => Ok(ForwardTiles { m_tiles: 2, block_n: 128, warps: 4 }),
            128 => Ok(ForwardTiles { m_tiles: 2, block_n: 64, warps: 4 }),
            256 => Ok(ForwardTiles { m_tiles: 1, block_n: 64, warps: 4 }),
            _ => Err(KernelError::UnsupportedHeadDim { rung: "fa2", d, supported: HEAD_DIMS }),
        }
    }

    /// Query rows per block.
    pub fn block_m(&self) -> usize {
        self.warps * self.m_tiles * 16
    }

    /// Dynamic shared memory: Q tile plus two stages of K and V, 16-bit elements.
    pub fn shared_bytes(&self, d: usize) -> usize {
        (self.block_m() + 4 * self.block_n) * d * 2
    }
}

/// The kernel variant for head dimension `d`, element type `dtype` and masking.
pub fn forward_variant(d: usize, dtype: DType, causal: bool) -> Result<Variant> {
    let t = ForwardTiles::for_head_dim(d)?;
    Ok(Variant {
        file: "fa2_forward",
        source: FORWARD_SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FA2_D", d.to_string()),
            ("FA2_MT", t.m_tiles.to_string()),
            ("FA2_BC", t.block_n.to_string()),
            ("FA2_WARPS", t.warps.to_string()),
            ("FA2_CAUSAL", (causal as u32).to_string()),
        ],
    })
}

/// `softmax(scale · Q Kᵀ + mask) V` and its log-sum-exp. fp16 or bf16; head dim 64, 128 or 256;
/// any lengths, `n_q != n_kv` (bottom-right causal), grouped-query attention.
pub fn forward(gpu: &Gpu, q: &Tensor, k: &Tensor, v: &Tensor, opts: &Options) -> Result<Output> {
    let p = Problem::new(q, k, v, opts)?;
    p.require_dtype("fa2", &[DType::F16, DType::BF16], "fp16, bf16")?;
    let tiles = ForwardTiles::for_head_dim(p.d)?;
    let smem = tiles.shared_bytes(p.d) as u32;
    let f = gpu.function(&forward_variant(p.d, p.dtype, p.causal)?, "fa2_forward", smem)?;

    let o = gpu.output(&p.o_shape(), p.dtype)?;
    let lse = gpu.output(&p.lse_shape(), DType::F32)?;
    let cfg = LaunchConfig {
        grid_dim: grid(p.n_q.div_ceil(tiles.block_m()), p.heads_q, p.batch)?,
        block_dim: (32 * tiles.warps as u32, 1, 1),
        shared_mem_bytes: smem,
    };
    let (hq, hkv, nq, nkv) = (p.heads_q as i32, p.heads_kv as i32, p.n_q as i32, p.n_kv as i32);
    let scale_log2 = p.scale * std::f32::consts::LOG2_E;
    let mut launch = gpu.stream().launch_builder(&f);
    launch
        .arg(&q.data)
        .arg(&k.data)
        .arg(&v.data)
        .arg(&o.data)
        .arg(&lse.data)
        .arg(&hq)
        .arg(&hkv)
        .arg(&nq)
        .arg(&nkv)
        .arg(&scale_log2);
    // SAFETY: the argument list matches fa2_forward's signature; every buffer has the size the
    // kernel indexes (checked by Problem::new and allocated above).
    gpu.check_launch(unsafe { launch.launch(cfg) }.map(|_| ()), "fa2_forward", &cfg)?;
    Ok(Output { o, lse })
}
