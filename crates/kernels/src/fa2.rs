//! Rung 3 on the GPU: FlashAttention-2 (Dao 2023), forward on tensor cores.
//!
//! The loop swap of FA2: each thread block owns a tile of query rows and walks K/V once, keeping the
//! softmax statistics and the *unnormalised* output in registers; the output is divided by the row
//! sum once at the end, and `lse = m + log l` is stored for the backward pass. Causal tiles entirely
//! above the diagonal are skipped, and only diagonal and tail tiles are masked. Kernel:
//! `cuda/fa2_forward.cu` (mma.sync m16n8k16, ldmatrix, cp.async double buffering).
//!
//! The backward pass (Algorithm 2) recomputes `P` from `lse` tile by tile: one block per K/V tile
//! accumulates `dK, dV` in registers while walking the query tiles, and adds its share of `dQ`
//! with atomics. Kernels: `cuda/fa2_backward.cu`.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::Gpu;
use crate::problem::{Gradients, Options, Output, Problem, grid};
use crate::tensor::{DType, Tensor};

const FORWARD_SRC: &str = include_str!("../cuda/fa2_forward.cu");
const BACKWARD_SRC: &str = include_str!("../cuda/fa2_backward.cu");

/// Head dimensions with an FA2 forward kernel.
pub const HEAD_DIMS: &[usize] = &[64, 128, 256];
/// Head dimensions with an FA2 backward kernel (at d = 256 the dK and dV accumulators of a warp's
/// 16 keys alone would take all 255 registers).
pub const BACKWARD_HEAD_DIMS: &[usize] = &[64, 128];
/// Query rows per step of the backward kernel's inner loop.
pub const BACKWARD_BLOCK_M: usize = 64;
/// Warps of the backward kernel; each owns 16 keys of the K/V tile.
pub const BACKWARD_WARPS: usize = 8;

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
    /// The tiles used for head dimension `d` on architecture `arch` (`sm_90a`, `sm_80`, ...).
    /// Each warp owns 32 query rows (two mma tiles) where the registers allow, which halves the
    /// shared-memory reads per FLOP. `LADDER_FA2_TILES=m_tiles,block_n,warps` overrides them, for
    /// tuning experiments.
    pub fn for_head_dim(d: usize, arch: &str) -> Result<ForwardTiles> {
        let hopper = arch.starts_with("sm_90");
        let default = match d {
            // At d = 64, 128 keys per tile fit Hopper's register allocation without spilling;
            // sm_80's allocation spills there, so it gets 64.
            64 => ForwardTiles { m_tiles: 2, block_n: if hopper { 128 } else { 64 }, warps: 4 },
            128 => ForwardTiles { m_tiles: 2, block_n: 64, warps: 4 },
            256 => ForwardTiles { m_tiles: 1, block_n: 64, warps: 4 },
            _ => {
                return Err(KernelError::UnsupportedHeadDim {
                    rung: "fa2",
                    d,
                    supported: HEAD_DIMS,
                });
            }
        };
        let Ok(spec) = std::env::var("LADDER_FA2_TILES") else { return Ok(default) };
        let parts: Vec<usize> = spec.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        match parts[..] {
            [m_tiles, block_n, warps]
                if (1..=2).contains(&m_tiles) && block_n % 16 == 0 && block_n > 0 && warps > 0 =>
            {
                Ok(ForwardTiles { m_tiles, block_n, warps })
            }
            _ => Err(KernelError::Shape(format!(
                "LADDER_FA2_TILES={spec:?}: expected m_tiles (1 or 2),block_n (multiple of 16),warps"
            ))),
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

/// The forward kernel variant for head dimension `d`, element type `dtype`, masking and
/// architecture.
pub fn forward_variant(d: usize, dtype: DType, causal: bool, arch: &str) -> Result<Variant> {
    let t = ForwardTiles::for_head_dim(d, arch)?;
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
    let tiles = ForwardTiles::for_head_dim(p.d, gpu.arch())?;
    let smem = tiles.shared_bytes(p.d) as u32;
    let f =
        gpu.function(&forward_variant(p.d, p.dtype, p.causal, gpu.arch())?, "fa2_forward", smem)?;

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

/// The backward kernel variant (its entry points live in one module). `deterministic` computes
/// dQ with `fa2_backward_dq` (no atomics, the same result on every run) instead of atomics in
/// `fa2_backward`.
pub fn backward_variant(
    d: usize,
    dtype: DType,
    causal: bool,
    deterministic: bool,
) -> Result<Variant> {
    if !BACKWARD_HEAD_DIMS.contains(&d) {
        return Err(KernelError::UnsupportedHeadDim {
            rung: "fa2 backward",
            d,
            supported: BACKWARD_HEAD_DIMS,
        });
    }
    let mut defines = vec![
        ("LADDER_DTYPE", dtype.code().to_string()),
        ("FA2_D", d.to_string()),
        ("FA2_BR", BACKWARD_BLOCK_M.to_string()),
        ("FA2_WARPS", BACKWARD_WARPS.to_string()),
        ("FA2_CAUSAL", (causal as u32).to_string()),
        ("FA2_DETERMINISTIC", (deterministic as u32).to_string()),
    ];
    if deterministic {
        // fa2_backward_dq: 16-row mma tiles per warp, warps, keys per K/V tile; query rows per
        // block = 16 · FA2_DQ_MT · FA2_DQ_WARPS.
        let dq_mt = if d == 64 { 2 } else { 1 };
        defines.push(("FA2_DQ_MT", dq_mt.to_string()));
        defines.push(("FA2_DQ_WARPS", 4.to_string()));
        defines.push(("FA2_DQ_BC", 64.to_string()));
    }
    Ok(Variant { file: "fa2_backward", source: BACKWARD_SRC, defines })
}

/// Gradients of [`forward`]: given the forward's `O` and `lse` and the upstream gradient `dO`,
/// returns `dQ, dK, dV` (with GQA, `dK, dV` summed over each group's query heads). fp16 or bf16,
/// head dim 64 or 128, the same shapes and options as the forward.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    opts: &Options,
) -> Result<Gradients> {
    let p = Problem::new(q, k, v, opts)?;
    p.require_dtype("fa2 backward", &[DType::F16, DType::BF16], "fp16, bf16")?;
    for (name, t) in [("o", o), ("d_o", d_o)] {
        if t.shape() != p.o_shape() || t.dtype() != p.dtype {
            return Err(KernelError::Shape(format!(
                "{name} is {:?} {}, expected {:?} {} (like q)",
                t.shape(),
                t.dtype(),
                p.o_shape(),
                p.dtype
            )));
        }
    }
    if lse.shape() != p.lse_shape() || lse.dtype() != DType::F32 {
        return Err(KernelError::Shape(format!(
            "lse is {:?} {}, expected {:?} f32",
            lse.shape(),
            lse.dtype(),
            p.lse_shape()
        )));
    }
    let variant = backward_variant(p.d, p.dtype, p.causal, false)?;
    let (bm, bn) = (BACKWARD_BLOCK_M, 16 * BACKWARD_WARPS);
    let smem = ((2 * bn + 4 * bm) * p.d * 2 + bn * bm * 2 + 4 * bm * 4) as u32;
    let prep = gpu.function(&variant, "fa2_backward_prep", 0)?;
    let main = gpu.function(&variant, "fa2_backward", smem)?;
    let finish = gpu.function(&variant, "fa2_backward_finish", 0)?;

    let heads = p.batch * p.heads_q;
    let n_q_pad = p.n_q.div_ceil(bm) * bm;
    let delta = gpu.output(&[heads * n_q_pad], DType::F32)?;
    let lse2 = gpu.output(&[heads * n_q_pad], DType::F32)?;
    // f32 accumulators: dQ gathers atomic adds from every K/V tile (prep zeroes it); dK, dV are
    // per query head and summed over the group by the finishing kernel.
    let dq_acc = gpu.output(&p.o_shape(), DType::F32)?;
    let kv_per_q_head = [p.batch, p.heads_q, p.n_kv, p.d];
    let dk_acc = gpu.output(&kv_per_q_head, DType::F32)?;
    let dv_acc = gpu.output(&kv_per_q_head, DType::F32)?;
    let dq = gpu.output(&p.o_shape(), p.dtype)?;
    let dk = gpu.output(&p.kv_shape(), p.dtype)?;
    let dv = gpu.output(&p.kv_shape(), p.dtype)?;

    let (hq, hkv, nq, nkv) = (p.heads_q as i32, p.heads_kv as i32, p.n_q as i32, p.n_kv as i32);
    let n_q_pad_i = n_q_pad as i32;

    // 1. D = rowsum(dO ∘ O), lse in base 2, dQ accumulator zeroed: one warp per (padded) row.
    let rows_total = heads * n_q_pad;
    let rows_i = i32::try_from(rows_total)
        .map_err(|_| KernelError::Shape(format!("{rows_total} query rows is too many")))?;
    let cfg = LaunchConfig {
        grid_dim: (rows_total.div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream().launch_builder(&prep);
    launch
        .arg(&o.data)
        .arg(&d_o.data)
        .arg(&lse.data)
        .arg(&delta.data)
        .arg(&lse2.data)
        .arg(&dq_acc.data)
        .arg(&nq)
        .arg(&n_q_pad_i)
        .arg(&rows_i);
    // SAFETY: arguments match fa2_backward_prep; buffers are sized for rows_total rows.
    gpu.check_launch(unsafe { launch.launch(cfg) }.map(|_| ()), "fa2_backward_prep", &cfg)?;

    // 2. The main kernel: one block per (K/V tile, query head, batch).
    let cfg = LaunchConfig {
        grid_dim: grid(p.n_kv.div_ceil(bn), p.heads_q, p.batch)?,
        block_dim: (32 * BACKWARD_WARPS as u32, 1, 1),
        shared_mem_bytes: smem,
    };
    let scale_log2 = p.scale * std::f32::consts::LOG2_E;
    let mut launch = gpu.stream().launch_builder(&main);
    launch
        .arg(&q.data)
        .arg(&k.data)
        .arg(&v.data)
        .arg(&d_o.data)
        .arg(&lse2.data)
        .arg(&delta.data)
        .arg(&dq_acc.data)
        .arg(&dk_acc.data)
        .arg(&dv_acc.data)
        .arg(&hq)
        .arg(&hkv)
        .arg(&nq)
        .arg(&nkv)
        .arg(&n_q_pad_i)
        .arg(&scale_log2);
    // SAFETY: arguments match fa2_backward; every buffer is sized as the kernel indexes it.
    gpu.check_launch(unsafe { launch.launch(cfg) }.map(|_| ()), "fa2_backward", &cfg)?;

    // 3. Scale, sum the GQA groups, convert.
    let dq_len = (heads * p.n_q * p.d) as i64;
    let dkv_len = (p.batch * p.heads_kv * p.n_kv * p.d) as i64;
    let group = (p.heads_q / p.heads_kv) as i32;
    let head_len = (p.n_kv * p.d) as i64;
    let blocks = (dq_len.max(dkv_len) as usize).div_ceil(256).min(gpu.sm_count() as usize * 16);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream().launch_builder(&finish);
    launch
        .arg(&dq_acc.data)
        .arg(&dk_acc.data)
        .arg(&dv_acc.data)
        .arg(&dq.data)
        .arg(&dk.data)
        .arg(&dv.data)
        .arg(&dq_len)
        .arg(&dkv_len)
        .arg(&group)
        .arg(&head_len)
        .arg(&p.scale);
    // SAFETY: arguments match fa2_backward_finish; lengths are those of the buffers.
    gpu.check_launch(unsafe { launch.launch(cfg) }.map(|_| ()), "fa2_backward_finish", &cfg)?;
    Ok(Gradients { dq, dk, dv })
}
