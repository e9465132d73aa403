//! Rung 4 on the GPU: FlashAttention-2 (Dao 2023), forward and backward on tensor cores.
//!
//! The loop swap of FA2 (Algorithm 1): each thread block owns `br` query rows and walks K/V once,
//! `bc` keys per tile, keeping the softmax statistics and the *unnormalised* output in registers;
//! the output is divided by the row sum once at the end, and `lse = m + log l` is stored for the
//! backward pass. Causal tiles entirely above the diagonal are skipped, and only diagonal and
//! tail tiles are masked. Kernel: `cuda/fa2_forward.cu` (mma.sync m16n8k16, ldmatrix, cp.async
//! double buffering).
//!
//! The backward pass (Algorithm 2) recomputes `P` from `lse` tile by tile: one block per K/V tile
//! accumulates `dK, dV` in registers while walking the query tiles. `dQ` is added with atomics by
//! those blocks, or, with [`Options::deterministic`], computed by a separate pass with one block
//! per query tile that walks the key tiles (bitwise reproducible). Kernels: `cuda/fa2_backward.cu`.
//!
//! **Any head dimension, any layout.** A kernel is compiled for the head dimension it is given,
//! any multiple of 8 up to 256 (backward: 128). Its products run over the head dimension rounded
//! up to the instruction's 16-wide k-step, its shared tiles are padded to whole 64-element rows
//! (the swizzle's span); the copies zero-fill the padding columns and never read or write them in
//! memory (`cuda/layout.cuh`). Q, K, V, O and dO take any batch, head and sequence strides with
//! the head dimension contiguous ([`Tensor::transpose`], [`Tensor::from_cuda_slice_strided`]), and
//! the outputs are laid out in the order of their inputs' axes.
//!
//! **Packed batches** of sequences of different lengths ([`forward_varlen`], [`crate::varlen`]):
//! one thread block per query block that exists, the sequence's offsets and lengths looked up
//! from the host's list (`cuda/varlen.cuh`).

use cudarc::driver::DeviceRepr;

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, GpuConfig, Kernel, parse_counts};
use crate::mask_mod::{MaskArgs, Walk, mask_args};
use crate::problem::{
    Band, Gradients, Masking, Options, Output, Packed, Problem, Strides, grid, multiples,
};
use crate::score_mod::ModifierArgs;
use crate::tensor::{DType, Tensor};
use crate::varlen::{SeqLens, VarlenParams};

pub(crate) const FORWARD_SRC: &str = include_str!("../cuda/fa2_forward.cu");
pub(crate) const BACKWARD_SRC: &str = include_str!("../cuda/fa2_backward.cu");

/// Head dimensions of the FA2 forward kernel: every multiple of 8 from 8 to 256.
pub const HEAD_DIMS: &[usize] = &multiples::<32>(8);
/// Head dimensions of the FA2 backward kernels: every multiple of 8 from 8 to 128. Past 128 the
/// dK and dV accumulators of a warp's 16 keys (d / 2 registers each per thread) and the two score
/// tiles no longer fit in 255 registers: d = 256 would take all of them for dK and dV alone.
pub const BACKWARD_HEAD_DIMS: &[usize] = &multiples::<16>(8);
/// Element types of the FA2 kernels.
pub const DTYPES: &[DType] = &[DType::F16, DType::BF16];

/// Threads of `fa2_backward_sinks` (`SINK_THREADS` in `cuda/fa2_backward.cu`).
const SINK_THREADS: u32 = 256;

/// Tile configuration of the forward kernel: `br = warps · m_tiles · 16` query rows per block,
/// `bc` keys per K/V tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardTiles {
    /// 16-row mma tiles per warp (1 or 2).
    pub m_tiles: usize,
    /// Keys per K/V tile (a multiple of 16).
    pub bc: usize,
    /// Warps per block.
    pub warps: usize,
}

/// Set on a [`crate::GpuConfig`] (`.tune(tiles)`), the tiles of the forward kernel for every head
/// dimension, instead of [`ForwardTiles::for_head_dim`]'s (for tuning experiments).
impl crate::Tuning for ForwardTiles {}

impl ForwardTiles {
    /// Checked tiles: `m_tiles` 1 or 2, `bc` a positive multiple of 16 up to 256, 1 to 16 warps.
    pub fn new(m_tiles: usize, bc: usize, warps: usize) -> Result<ForwardTiles> {
        if !(1..=2).contains(&m_tiles)
            || bc == 0
            || bc % 16 != 0
            || bc > 256
            || !(1..=16).contains(&warps)
        {
            return Err(KernelError::Config(format!(
                "FA2 forward tiles m_tiles={m_tiles}, bc={bc}, warps={warps}: expected m_tiles 1 or \
                 2, bc a multiple of 16 in 16..=256, warps in 1..=16"
            )));
        }
        Ok(ForwardTiles { m_tiles, bc, warps })
    }

    /// The tuned tiles for head dimension `d` on architecture `arch` (`sm_90a`, `sm_80`, ...),
    /// one row per range of head dimensions: what limits a tile is the registers of the output
    /// accumulator (d / 2 per thread and mma tile) beside the score tile (`bc` / 2), so a head
    /// dimension takes the tiles of the largest one of its range. Each warp owns 32 query rows
    /// (two mma tiles) where the registers allow, which halves the shared-memory reads per FLOP.
    ///
    /// | d | m_tiles | bc | warps | why |
    /// |---|---|---|---|---|
    /// | 8 … 64 | 2 | 128 (sm_80: 64) | 4 | d = 64's: 128 keys fit Hopper's register allocation without spilling; sm_80's spills there |
    /// | 72 … 128 | 2 | 64 | 4 | d = 128's: the accumulator takes 128 registers |
    /// | 136 … 256 | 1 | 64 | 4 | d = 256's: one mma tile per warp, or the accumulator alone would fill the registers |
    pub fn for_head_dim(d: usize, arch: &str) -> Result<ForwardTiles> {
        if !HEAD_DIMS.contains(&d) {
            return Err(KernelError::UnsupportedHeadDim { rung: "fa2", d, supported: HEAD_DIMS });
        }
        let hopper = arch.starts_with("sm_90");
        Ok(match d {
            ..=64 => ForwardTiles { m_tiles: 2, bc: if hopper { 128 } else { 64 }, warps: 4 },
            65..=128 => ForwardTiles { m_tiles: 2, bc: 64, warps: 4 },
            _ => ForwardTiles { m_tiles: 1, bc: 64, warps: 4 },
        })
    }

    /// The tiles the forward pass takes under `config` on architecture `arch`: the
    /// configuration's (`GpuConfig::tune(tiles)`) where one is set, otherwise
    /// [`ForwardTiles::for_head_dim`].
    pub(crate) fn for_config(config: &GpuConfig, d: usize, arch: &str) -> Result<ForwardTiles> {
        match config.tuned::<ForwardTiles>() {
            Some(t) => Ok(t),
            None => ForwardTiles::for_head_dim(d, arch),
        }
    }

    /// The tiles under a score modifier, whose arithmetic needs registers the tuned tiles leave
    /// none of (softcap then ALiBi spilled 8–104 bytes at d = 64 and 128 with them): 32 keys per
    /// tile, which halves the score tiles and keeps each warp's 32 query rows (at d = 128 on the
    /// H200, softcap 251 TFLOP/s and ALiBi 276 against 203 and 233 with one 16-row tile per warp;
    /// docs/perf-notes.md).
    pub fn with_score_mod(self) -> ForwardTiles {
        ForwardTiles { bc: 32, ..self }
    }

    /// Query rows per block.
    pub fn br(&self) -> usize {
        self.warps * self.m_tiles * 16
    }

    /// Threads per block.
    pub fn threads(&self) -> usize {
        32 * self.warps
    }

    /// Dynamic shared memory in bytes for head dimension `d`: the Q tile plus two stages of K and
    /// V, 16-bit elements, rows of [`tile_cols`]`(d)`.
    pub fn shared_bytes(&self, d: usize) -> usize {
        (self.br() + 4 * self.bc) * tile_cols(d) * 2
    }
}

impl std::str::FromStr for ForwardTiles {
    type Err = KernelError;

    /// `m_tiles,bc,warps`, e.g. `2,64,4`.
    fn from_str(spec: &str) -> Result<ForwardTiles> {
        match parse_counts(spec) {
            Some([m_tiles, bc, warps]) => ForwardTiles::new(m_tiles, bc, warps),
            None => Err(KernelError::Config(format!(
                "FA2 forward tiles {spec:?}: expected m_tiles,bc,warps (e.g. 2,64,4)"
            ))),
        }
    }
}

/// The row length of the kernels' shared tiles for head dimension `d`: `d` rounded up to 64
/// elements, the span of their swizzle (`HeadDim::COLS` in `cuda/layout.cuh`).
pub fn tile_cols(d: usize) -> usize {
    d.next_multiple_of(64)
}

/// Tile configuration of the backward kernels (fixed per head dimension: tuned on the H200, see
/// docs/perf-notes.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardTiles {
    /// Query rows per step of the main kernel's walk over the query tiles.
    pub br: usize,
    /// Warps of the main kernel; each owns 16 keys of the block's K/V tile.
    pub warps: usize,
    /// 16-row mma tiles per warp of the deterministic dQ pass.
    pub dq_m_tiles: usize,
    /// Warps of the deterministic dQ pass; each owns `16 · dq_m_tiles` query rows.
    pub dq_warps: usize,
    /// Keys per K/V tile of the deterministic dQ pass.
    pub dq_bc: usize,
}

impl BackwardTiles {
    /// The tiles for head dimension `d` ([`BACKWARD_HEAD_DIMS`]). Up to d = 64 the dQ pass's
    /// warps take 32 rows each (two mma tiles; half the shared-memory reads per FLOP); past it the
    /// registers allow 16.
    pub fn for_head_dim(d: usize) -> Result<BackwardTiles> {
        if !BACKWARD_HEAD_DIMS.contains(&d) {
            return Err(KernelError::UnsupportedHeadDim {
                rung: "fa2 backward",
                d,
                supported: BACKWARD_HEAD_DIMS,
            });
        }
        Ok(BackwardTiles {
            br: 64,
            warps: 8,
            dq_m_tiles: if d <= 64 { 2 } else { 1 },
            dq_warps: 4,
            dq_bc: 64,
        })
    }

    /// The tiles for a packed batch ([`backward_varlen`]) at head dimension `d`: those of
    /// [`BackwardTiles::for_head_dim`], but past d = 64 with query steps of 32 rows. The packed
    /// main kernel keeps its sequence's offsets beside everything the fixed-length one holds, and
    /// at 64 rows and d = 128 that spills; 32 rows halve the score tiles `Pᵀ` and `dPᵀ`.
    pub fn for_packed(d: usize) -> Result<BackwardTiles> {
        let t = BackwardTiles::for_head_dim(d)?;
        Ok(if d > 64 { BackwardTiles { br: 32, ..t } } else { t })
    }

    /// The tiles of a packed batch ([`BackwardTiles::for_packed`]) or a fixed-length one, with a
    /// sliding window or not. A window's band adds its two sides to the per-entry mask test, and
    /// that too spills at 64 rows and d = 128 (so it takes the packed batch's 32-row steps) and,
    /// in a packed batch's dQ pass, at 32 rows per warp (so 16). A score modifier (`modified`)
    /// keeps its slopes `∂t/∂s` beside the score tiles, which at the tuned tiles spilled 64–108
    /// bytes in the main kernel at d = 128 and 320–340 in the dQ pass at d = 64: it takes 32-row
    /// steps and 16 rows per warp of the dQ pass. So does a mask modifier (`modified` too), whose
    /// per-entry test on partial tiles runs beside the same tiles (not tried at the tuned ones).
    pub fn of(d: usize, packed: bool, windowed: bool, modified: bool) -> Result<BackwardTiles> {
        let t = if packed || windowed || modified {
            BackwardTiles::for_packed(d)?
        } else {
            BackwardTiles::for_head_dim(d)?
        };
        let narrow_dq = (packed && windowed) || modified;
        Ok(if narrow_dq { BackwardTiles { dq_m_tiles: 1, ..t } } else { t })
    }

    /// Keys per block of the main kernel (16 per warp).
    pub fn bc(&self) -> usize {
        16 * self.warps
    }

    /// Query rows per block of the deterministic dQ pass.
    pub fn dq_br(&self) -> usize {
        16 * self.dq_m_tiles * self.dq_warps
    }

    /// Dynamic shared memory of the main kernel in bytes: K and V of the block's key tile, two
    /// stages of Q and dO tiles (16-bit), two stages of the tile's lse and D (f32), and, when dQ is
    /// added atomically, the dSᵀ tile it is computed from.
    pub fn shared_bytes(&self, d: usize, deterministic: bool) -> usize {
        let (br, bc) = (self.br, self.bc());
        // (rows of dSᵀ at least 64 elements long, the swizzle's span)
        let ds = if deterministic { 0 } else { bc * br.max(64) * 2 };
        (2 * bc + 4 * br) * tile_cols(d) * 2 + ds + 4 * br * 4
    }

    /// Dynamic shared memory of the deterministic dQ pass in bytes: the block's Q and dO tiles and
    /// two stages of K and V (16-bit).
    pub fn dq_shared_bytes(&self, d: usize) -> usize {
        (2 * self.dq_br() + 4 * self.dq_bc) * tile_cols(d) * 2
    }
}

/// The forward kernel variant for head dimension `d`, element type `dtype`, masking and tiles,
/// and the layout: the row strides of Q, K, V and O (all `d` when contiguous) and whether V's
/// batch and head strides differ from K's. The kernel compiles these in
/// (`cuda/fa2_forward.cu` says why), so each layout is a variant of its own.
pub(crate) fn forward_variant(
    d: usize,
    dtype: DType,
    mask: Masking,
    t: ForwardTiles,
    rows: [i64; 4],
    v_strides_differ: bool,
    packed: bool,
) -> Variant {
    let mut defines = vec![
        ("LADDER_DTYPE", dtype.code().to_string()),
        ("FA2_D", d.to_string()),
        ("FA2_MT", t.m_tiles.to_string()),
        ("FA2_BC", t.bc.to_string()),
        ("FA2_WARPS", t.warps.to_string()),
        ("FA2_CAUSAL", (mask.causal as u32).to_string()),
    ];
    if rows.iter().any(|&x| x != d as i64) {
        let names = ["FA2_Q_ROW", "FA2_K_ROW", "FA2_V_ROW", "FA2_O_ROW"];
        defines.extend(names.into_iter().zip(rows.map(|x| x.to_string())));
    }
    if v_strides_differ {
        defines.push(("FA2_V_STRIDES", "1".into()));
    }
    if packed {
        defines.push(("FA2_VARLEN", "1".into()));
    }
    if mask.windowed {
        defines.push(("FA2_WINDOW", "1".into()));
    }
    Variant::new("fa2_forward", FORWARD_SRC, defines)
}

/// The backward kernels' variant (the entry points live in one module), for a packed batch or
/// not, with a sliding window or not, with a score modifier compiled in or not (it changes the
/// tiles: [`BackwardTiles::of`]).
pub(crate) fn backward_variant(
    d: usize,
    dtype: DType,
    mask: Masking,
    (deterministic, packed): (bool, bool),
    (score_mod, mask_mod): (Option<&crate::ScoreMod>, Option<&crate::MaskMod>),
) -> Result<Variant> {
    let modified = score_mod.is_some() || mask_mod.is_some();
    let t = BackwardTiles::of(d, packed, mask.windowed, modified)?;
    let mut defines = vec![
        ("LADDER_DTYPE", dtype.code().to_string()),
        ("FA2_D", d.to_string()),
        ("FA2_BR", t.br.to_string()),
        ("FA2_WARPS", t.warps.to_string()),
        ("FA2_CAUSAL", (mask.causal as u32).to_string()),
        ("FA2_DETERMINISTIC", (deterministic as u32).to_string()),
        ("FA2_HOST_PARAMS_BYTES", std::mem::size_of::<BackwardParams>().to_string()),
    ];
    if deterministic {
        defines.push(("FA2_DQ_MT", t.dq_m_tiles.to_string()));
        defines.push(("FA2_DQ_WARPS", t.dq_warps.to_string()));
        defines.push(("FA2_DQ_BC", t.dq_bc.to_string()));
    }
    if packed {
        defines.push(("FA2_VARLEN", "1".into()));
    }
    if mask.windowed {
        defines.push(("FA2_WINDOW", "1".into()));
    }
    let variant = Variant::new("fa2_backward", BACKWARD_SRC, defines);
    Ok(variant.with_score_mod(score_mod).with_mask_mod(mask_mod))
}

/// Mirror of `Fa2ForwardParams` in `cuda/fa2_forward.cu` (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ForwardParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    q_strides: Strides,
    k_strides: Strides,
    v_strides: Strides,
    o_strides: Strides,
    heads_q: i32,
    heads_kv: i32,
    n_q: i32,
    n_kv: i32,
    scale_log2: f32,
    band: Band,
    varlen: VarlenParams,
    mods: ModifierArgs,
    mask: MaskArgs,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror.
unsafe impl DeviceRepr for ForwardParams {}

/// `softmax(scale · Q Kᵀ + mask) V` and its log-sum-exp. fp16 or bf16; any head dim in
/// [`HEAD_DIMS`]; any strides with the head dim contiguous (O is laid out like Q); any lengths,
/// `n_q != n_kv` (bottom-right causal), grouped-query attention.
pub fn forward(gpu: &Gpu, q: &Tensor, k: &Tensor, v: &Tensor, opts: &Options) -> Result<Output> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    forward_problem(gpu, &p, (q, k, v), None)
}

/// [`forward`] on a packed variable-length batch ([`crate::varlen`]): Q `[total_q, heads_q, d]`,
/// K and V `[total_k, heads_kv, d]` (any strides with the head dim contiguous), sequence `b`'s
/// rows as `lens` gives them; O `[total_q, heads_q, d]` laid out like Q, lse `[heads_q, total_q]`.
/// One thread block per query block that exists (no padding), longest first.
pub fn forward_varlen(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &SeqLens,
    opts: &Options,
) -> Result<Output> {
    let p = Problem::packed(gpu, (q, k, v), lens, opts)?;
    p.require_no_mask_mod("fa2 (packed)")?;
    forward_problem(gpu, &p, (q, k, v), Some(lens))
}

/// The forward kernel on the checked problem `p` (packed when `lens` is given).
fn forward_problem(
    gpu: &Gpu,
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    lens: Option<&SeqLens>,
) -> Result<Output> {
    p.require_dtype("fa2", DTYPES, "fp16, bf16")?;
    if !HEAD_DIMS.contains(&p.d) {
        return Err(KernelError::UnsupportedHeadDim { rung: "fa2", d: p.d, supported: HEAD_DIMS });
    }
    let mut tiles = ForwardTiles::for_config(gpu.config(), p.d, gpu.arch())?;
    let modified = p.score_mod.is_some() || p.mask_mod.is_some();
    if modified && gpu.config().tuned::<ForwardTiles>().is_none() {
        tiles = tiles.with_score_mod();
    }
    let mut o = gpu.output_like(q, p.dtype)?;
    let o_strides = p.strides_of(&o, "o")?;
    let [qs, ks, vs] = p.strides;
    let rows = [qs.row, ks.row, vs.row, o_strides.row];
    let v_strides_differ = (vs.batch, vs.head) != (ks.batch, ks.head);
    let packed = lens.is_some();
    let mask = Masking::of(p);
    let variant = forward_variant(p.d, p.dtype, mask, tiles, rows, v_strides_differ, packed)
        .with_score_mod(p.score_mod.as_ref())
        .with_mask_mod(p.mask_mod.as_ref());
    let kernel = Kernel { variant, entry: "fa2_forward" };
    let smem = tiles.shared_bytes(p.d);
    gpu.prepare(&kernel, smem)?;
    let mut lse = gpu.output(&p.lse_shape(), DType::F32)?;
    let table = lens.map(|lens| lens.tiles(gpu, tiles.br(), p.causal)).transpose()?;
    // The mask modifier's block mask, at this kernel's tiles (kept until the launch is queued).
    let (mask_args, _blocks) = mask_args(gpu, p, (tiles.br(), tiles.bc), Walk::KeysOfQueryTile)?;
    {
        let s = gpu.stream();
        let (q_ptr, _g0) = q.read_ptr(s);
        let (k_ptr, _g1) = k.read_ptr(s);
        let (v_ptr, _g2) = v.read_ptr(s);
        let (o_ptr, _g3) = o.write_ptr(s)?;
        let (lse_ptr, _g4) = lse.write_ptr(s)?;
        let [hq, hkv, nq, nkv] = p.dims_i32();
        let packed_batch = lens.zip(table.as_deref());
        let (varlen, _g_varlen) = VarlenParams::of(gpu, packed_batch);
        let mods = p.modifier_args(gpu)?;
        let params = ForwardParams {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            o: o_ptr,
            lse: lse_ptr,
            q_strides: p.strides[0],
            k_strides: p.strides[1],
            v_strides: p.strides[2],
            o_strides,
            heads_q: hq,
            heads_kv: hkv,
            n_q: nq,
            n_kv: nkv,
            scale_log2: p.scale_log2(),
            band: p.band(),
            varlen,
            mods,
            mask: mask_args,
        };
        let grid = match &table {
            Some(table) => grid(table.len(), p.heads_q, 1)?,
            None => grid(p.n_q.div_ceil(tiles.br()), p.heads_q, p.batch)?,
        };
        gpu.launch(&kernel, grid, tiles.threads() as u32, smem, &params)?;
    }
    Ok(Output { o, lse })
}

/// Mirror of `BackwardParams` in `cuda/backward.cuh`: one struct for the backward's entry points,
/// FA2's and FA3's main kernel alike.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BackwardParams {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    o: u64,
    pub(crate) d_o: u64,
    lse: u64,
    delta: u64,
    lse2: u64,
    pub(crate) dq_acc: u64,
    dk_acc: u64,
    dv_acc: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    dsinks: u64,
    batch: i32,
    heads_q: i32,
    heads_kv: i32,
    n_q: i32,
    n_kv: i32,
    n_q_pad: i32,
    dkv_written: i32,
    scale: f32,
    scale_log2: f32,
    band: Band,
    q_strides: Strides,
    k_strides: Strides,
    v_strides: Strides,
    o_strides: Strides,
    pub(crate) d_o_strides: Strides,
    dq_strides: Strides,
    dk_strides: Strides,
    dv_strides: Strides,
    varlen: VarlenParams,
    mods: ModifierArgs,
    mask: MaskArgs,
    mask_dq: MaskArgs,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror.
unsafe impl DeviceRepr for BackwardParams {}

/// Gradients of [`forward`]: given the forward's [`Output`] (`O` and `lse`) and the upstream
/// gradient `dO`, returns `dQ, dK, dV` (with GQA, `dK, dV` summed over each group's query heads).
/// fp16 or bf16, any head dim in [`BACKWARD_HEAD_DIMS`], the same tensors and options as the
/// forward; `out.o` and `d_o` in any strides (the head dim contiguous), the gradients laid out like
/// their inputs.
/// `opts.deterministic` makes the result bitwise reproducible (see the module docs).
pub fn backward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Output,
    d_o: &Tensor,
    opts: &Options,
) -> Result<Gradients> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    p.require_score_mod_derivative()?;
    backward_problem(gpu, &p, (q, k, v), (out, d_o), None, opts.deterministic, None)
}

/// [`backward`] on a packed variable-length batch: the inputs of [`forward_varlen`], its
/// [`Output`] (O `[total_q, heads_q, d]`, lse `[heads_q, total_q]`) and `d_o` packed like Q; dQ
/// comes back `[total_q, heads_q, d]`, dK and dV `[total_k, heads_kv, d]`, each laid out like its
/// input. The main kernel runs one thread block per key block that exists, the dQ pass
/// (deterministic mode) one per query block.
#[allow(clippy::too_many_arguments)] // the forward's inputs, its output and dO: as `backward`
pub fn backward_varlen(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Output,
    d_o: &Tensor,
    lens: &SeqLens,
    opts: &Options,
) -> Result<Gradients> {
    let p = Problem::packed(gpu, (q, k, v), lens, opts)?;
    p.require_no_mask_mod("fa2 backward (packed)")?;
    p.require_score_mod_derivative()?;
    backward_problem(gpu, &p, (q, k, v), (out, d_o), Some(lens), opts.deterministic, None)
}

/// Another rung's main kernel in place of FA2's (FA3's, `crate::fa3::backward`): it takes the
/// same parameter block and fills the same accumulators, between FA2's preparation and finish.
pub(crate) struct MainPass<'a> {
    /// Query rows per step of its walk (lse2 and D are padded to whole tiles of them) and keys
    /// per block: the tiles of its block mask.
    pub(crate) tiles: (usize, usize),
    /// Launches it (after the preparation, on the same stream). Without GQA it writes dK and dV
    /// itself, scaled and in 16 bits (`dkv_written`), as FA3's does.
    pub(crate) launch: &'a dyn Fn(&BackwardParams) -> Result<()>,
}

/// The backward kernels on the checked problem `p` (packed when `lens` is given), with FA2's
/// main kernel or `main`'s.
pub(crate) fn backward_problem(
    gpu: &Gpu,
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (out, d_o): (&Output, &Tensor),
    lens: Option<&SeqLens>,
    deterministic: bool,
    main_pass: Option<MainPass>,
) -> Result<Gradients> {
    p.require_dtype("fa2 backward", DTYPES, "fp16, bf16")?;
    p.require_like(gpu, "out.o", &out.o, q.shape(), p.dtype)?;
    p.require_like(gpu, "d_o", d_o, q.shape(), p.dtype)?;
    p.require_like(gpu, "out.lse", &out.lse, &p.lse_shape(), DType::F32)?;
    let batching = (deterministic, lens.is_some());
    let modifiers = (p.score_mod.as_ref(), p.mask_mod.as_ref());
    let variant = backward_variant(p.d, p.dtype, Masking::of(p), batching, modifiers)?;
    let entry = |entry| Kernel { variant: variant.clone(), entry };
    let (prep, main, dq_pass, finish, sinks) = (
        entry("fa2_backward_prep"),
        entry("fa2_backward"),
        entry("fa2_backward_dq"),
        entry("fa2_backward_finish"),
        entry("fa2_backward_sinks"),
    );
    let modified = p.score_mod.is_some() || p.mask_mod.is_some();
    let t = BackwardTiles::of(p.d, lens.is_some(), p.window.is_some(), modified)?;
    let smem = t.shared_bytes(p.d, deterministic);
    let dq_smem = t.dq_shared_bytes(p.d);
    gpu.prepare(&prep, 0)?;
    if main_pass.is_none() {
        gpu.prepare(&main, smem)?;
    }
    if deterministic {
        gpu.prepare(&dq_pass, dq_smem)?;
    }
    gpu.prepare(&finish, 0)?;
    if p.sinks.is_some() {
        gpu.prepare(&sinks, 0)?;
    }

    // The kernels see a packed batch as one batch entry of all its rows (`cuda/fa2_backward.cu`).
    let (batch, n_q, n_kv) = match p.packed {
        Some(Packed { total_q, total_k }) => (1, total_q, total_k),
        None => (p.batch, p.n_q, p.n_kv),
    };
    let heads = batch * p.heads_q;
    // Query rows padded to whole tiles of both passes, so that a fixed-length batch's tiles of
    // lse2 and D are copied without checks.
    let pad = t.br.max(t.dq_br()).max(main_pass.as_ref().map_or(1, |m| m.tiles.0));
    let n_q_pad = n_q.div_ceil(pad) * pad;
    let n_q_pad_i = i32::try_from(n_q_pad)
        .map_err(|_| KernelError::Shape(format!("{n_q} query rows are too many")))?;
    let mut delta = gpu.output(&[heads * n_q_pad], DType::F32)?;
    let mut lse2 = gpu.output(&[heads * n_q_pad], DType::F32)?;
    // f32 accumulators: dQ gathers the key tiles' shares (atomically, or from the dQ pass); dK, dV
    // are per query head and summed over the group by the finishing kernel, except where another
    // rung's main kernel (FA3's) writes them itself, without a GQA group to sum.
    let mut dq_acc = gpu.output(&[heads, n_q, p.d], DType::F32)?;
    let dkv_written = p.heads_q == p.heads_kv && main_pass.is_some();
    let kv_per_q_head = if dkv_written { [0, 0, 0] } else { [heads, n_kv, p.d] };
    let mut dk_acc = gpu.output(&kv_per_q_head, DType::F32)?;
    let mut dv_acc = gpu.output(&kv_per_q_head, DType::F32)?;
    let mut dq = gpu.output_like(q, p.dtype)?;
    let mut dk = gpu.output_like(k, p.dtype)?;
    let mut dv = gpu.output_like(v, p.dtype)?;
    let mut dsinks = p.sinks.as_ref().map(|_| gpu.output(&[p.heads_q], DType::F32)).transpose()?;
    let [o_strides, d_o_strides] = [p.strides_of(&out.o, "out.o")?, p.strides_of(d_o, "d_o")?];
    let [dq_strides, dk_strides, dv_strides] =
        [p.strides_of(&dq, "dq")?, p.strides_of(&dk, "dk")?, p.strides_of(&dv, "dv")?];
    // A packed batch's blocks: key blocks for the main kernel, query blocks for the dQ pass.
    let key_table = lens.map(|lens| lens.key_tiles(gpu, t.bc(), p.causal)).transpose()?;
    let query_table = match lens {
        Some(lens) if deterministic => Some(lens.tiles(gpu, t.dq_br(), p.causal)?),
        _ => None,
    };
    {
        let s = gpu.stream();
        let (q_ptr, _g0) = q.read_ptr(s);
        let (k_ptr, _g1) = k.read_ptr(s);
        let (v_ptr, _g2) = v.read_ptr(s);
        let (o_ptr, _g3) = out.o.read_ptr(s);
        let (d_o_ptr, _g4) = d_o.read_ptr(s);
        let (lse_ptr, _g5) = out.lse.read_ptr(s);
        let (delta_ptr, _g6) = delta.write_ptr(s)?;
        let (lse2_ptr, _g7) = lse2.write_ptr(s)?;
        let (dq_acc_ptr, _g8) = dq_acc.write_ptr(s)?;
        let (dk_acc_ptr, _g9) = dk_acc.write_ptr(s)?;
        let (dv_acc_ptr, _g10) = dv_acc.write_ptr(s)?;
        let (dq_ptr, _g11) = dq.write_ptr(s)?;
        let (dk_ptr, _g12) = dk.write_ptr(s)?;
        let (dv_ptr, _g13) = dv.write_ptr(s)?;
        let (dsinks_ptr, _g16) = match &mut dsinks {
            Some(t) => {
                let (ptr, guard) = t.write_ptr(s)?;
                (ptr, Some(guard))
            }
            None => (0, None),
        };
        let (main_varlen, _g14) = VarlenParams::of(gpu, lens.zip(key_table.as_deref()));
        let (dq_varlen, _g15) = VarlenParams::of(gpu, lens.zip(query_table.as_deref()));
        let mods = p.modifier_args(gpu)?;
        // The mask modifier's block masks: the main kernel walks a key tile's query tiles, the
        // dQ pass a query tile's key tiles (kept until the launches are queued).
        let main_tiles = main_pass.as_ref().map_or((t.br, t.bc()), |m| m.tiles);
        let (mask, _blocks) = mask_args(gpu, p, main_tiles, Walk::QueriesOfKeyTile)?;
        let (mask_dq, _dq_blocks) = if deterministic {
            mask_args(gpu, p, (t.dq_br(), t.dq_bc), Walk::KeysOfQueryTile)?
        } else {
            (MaskArgs::default(), None)
        };
        // In range: the rows by Problem's checks, the totals by SeqLens's 32-bit offsets.
        let params = BackwardParams {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            o: o_ptr,
            d_o: d_o_ptr,
            lse: lse_ptr,
            delta: delta_ptr,
            lse2: lse2_ptr,
            dq_acc: dq_acc_ptr,
            dk_acc: dk_acc_ptr,
            dv_acc: dv_acc_ptr,
            dq: dq_ptr,
            dk: dk_ptr,
            dv: dv_ptr,
            dsinks: dsinks_ptr,
            batch: batch as i32,
            heads_q: p.heads_q as i32,
            heads_kv: p.heads_kv as i32,
            n_q: n_q as i32,
            n_kv: n_kv as i32,
            n_q_pad: n_q_pad_i,
            dkv_written: dkv_written as i32,
            scale: p.scale,
            scale_log2: p.scale_log2(),
            band: p.band(),
            q_strides: p.strides[0],
            k_strides: p.strides[1],
            v_strides: p.strides[2],
            o_strides,
            d_o_strides,
            dq_strides,
            dk_strides,
            dv_strides,
            varlen: main_varlen,
            mods,
            mask,
            mask_dq,
        };

        // 1. D = rowsum(dO ∘ O), lse in base 2, dQ accumulator zeroed: one warp per padded row,
        //    8 warps per block.
        gpu.launch(&prep, grid((heads * n_q_pad).div_ceil(8), 1, 1)?, 256, 0, &params)?;

        // 1b. The sinks' gradient from lse and D: one block per query head.
        if p.sinks.is_some() {
            gpu.launch(&sinks, grid(p.heads_q, 1, 1)?, SINK_THREADS, 0, &params)?;
        }

        // 2. dK, dV (and, atomically, dQ): one block per (key block, query head[, batch]).
        let main_grid = match &key_table {
            Some(table) => grid(table.len(), p.heads_q, 1)?,
            None => grid(p.n_kv.div_ceil(t.bc()), p.heads_q, p.batch)?,
        };
        match &main_pass {
            Some(pass) => (pass.launch)(&params)?,
            None => gpu.launch(&main, main_grid, 32 * t.warps as u32, smem, &params)?,
        }

        // 2b. Deterministic dQ: one block per (query block, query head[, batch]).
        if deterministic {
            let dq_grid = match &query_table {
                Some(table) => grid(table.len(), p.heads_q, 1)?,
                None => grid(p.n_q.div_ceil(t.dq_br()), p.heads_q, p.batch)?,
            };
            let dq_params = BackwardParams { varlen: dq_varlen, ..params };
            gpu.launch(&dq_pass, dq_grid, 32 * t.dq_warps as u32, dq_smem, &dq_params)?;
        }

        // 3. Scale, sum the GQA groups, convert: a warp per row, grid-stride over the rows of the
        //    larger of dQ and dK (dQ's alone where the main kernel wrote dK and dV).
        let dkv_rows = if dkv_written { 0 } else { batch * p.heads_kv * n_kv };
        let finish_rows = (heads * n_q).max(dkv_rows);
        let blocks = finish_rows.div_ceil(8).min(gpu.sm_count() as usize * 16);
        gpu.launch(&finish, grid(blocks, 1, 1)?, 256, 0, &params)?;
    }
    Ok(Gradients { dq, dk, dv, dsinks })
}

/// Every variant of this rung for `arch`, for the compile check.
#[cfg(test)]
pub(crate) fn variants(arch: &str) -> Vec<Variant> {
    // Every head dimension would be 256 variants per architecture: the compile check takes the
    // three the tiles were tuned for in both types, and in fp16 the ends of each row of the tile
    // table and head dims whose rows need the copy's general path (not a whole number of 16-byte
    // chunks per thread) and the padding to 16 and to 64 columns.
    let dims = |dtype| match dtype {
        DType::F16 => &[8, 40, 64, 72, 96, 128, 136, 200, 256][..],
        _ => &[64, 128, 256][..],
    };
    let mut all = Vec::new();
    // Score modifiers (softcap then ALiBi, the heaviest built-in composition) at the tuned head
    // dims, with and without a window.
    let mods = crate::ScoreMod::softcap(30.0)
        .expect("a valid cap")
        .then(crate::ScoreMod::alibi(vec![0.5; 8]).expect("valid slopes"));
    let masks = crate::MaskMod::document_lengths(&[100, 28])
        .expect("valid ids")
        .or(crate::MaskMod::prefix_lm(16).expect("a valid prefix"));
    for d in [64, 128, 256] {
        for (causal, windowed) in [(false, false), (true, false), (true, true)] {
            let mask = Masking { causal, windowed };
            for deterministic in [false, true] {
                for packed in [false, true] {
                    let batching = (deterministic, packed);
                    all.extend(backward_variant(
                        d,
                        DType::F16,
                        mask,
                        batching,
                        (Some(&mods), None),
                    ));
                    if !packed {
                        // A mask modifier, alone and under the score modifiers.
                        let masked = (None, Some(&masks));
                        all.extend(backward_variant(d, DType::F16, mask, batching, masked));
                        let both = (Some(&mods), Some(&masks));
                        all.extend(backward_variant(d, DType::F16, mask, batching, both));
                    }
                }
            }
            if let Ok(tiles) = ForwardTiles::for_head_dim(d, arch) {
                let tiles = tiles.with_score_mod();
                let mask = Masking { causal, windowed };
                let v = forward_variant(d, DType::F16, mask, tiles, [d as i64; 4], false, false);
                all.push(v.clone().with_score_mod(Some(&mods)));
                // A mask modifier (a document mask and a prefix-LM mask, the built-ins' heaviest
                // composition) alone and under the score modifiers.
                all.push(v.clone().with_mask_mod(Some(&masks)));
                all.push(v.with_score_mod(Some(&mods)).with_mask_mod(Some(&masks)));
                all.push(crate::mask_mod::block_mask_variant(&masks, tiles.br(), tiles.bc));
            }
        }
    }
    for &dtype in DTYPES {
        for &d in dims(dtype) {
            for causal in [false, true] {
                // Windows at the tuned head dims; the band adds registers to every variant alike.
                let windows: &[bool] =
                    if matches!(d, 64 | 128) { &[false, true] } else { &[false] };
                for &windowed in windows {
                    let mask = Masking { causal, windowed };
                    if let Ok(tiles) = ForwardTiles::for_head_dim(d, arch) {
                        let dense = [d as i64; 4];
                        all.push(forward_variant(d, dtype, mask, tiles, dense, false, false));
                        if d == 128 {
                            // [b, s, h, d] with 8 query and 2 kv heads, and a packed batch of them
                            let rows = [8 * 128, 2 * 128, 2 * 128, 8 * 128];
                            all.push(forward_variant(d, dtype, mask, tiles, rows, false, false));
                            all.push(forward_variant(d, dtype, mask, tiles, rows, false, true));
                        }
                        if d == 64 || d == 256 {
                            let rows = [8 * d as i64, 2 * d as i64, 2 * d as i64, 8 * d as i64];
                            all.push(forward_variant(d, dtype, mask, tiles, rows, false, true));
                        }
                    }
                    for deterministic in [false, true] {
                        all.extend(backward_variant(
                            d,
                            dtype,
                            mask,
                            (deterministic, false),
                            (None, None),
                        ));
                        if d == 64 || d == 128 {
                            all.extend(backward_variant(
                                d,
                                dtype,
                                mask,
                                (deterministic, true),
                                (None, None),
                            ));
                        }
                    }
                }
            }
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_parse_and_reject_bad_specs() {
        let t: ForwardTiles = "2, 64, 4".parse().unwrap();
        assert_eq!(t, ForwardTiles { m_tiles: 2, bc: 64, warps: 4 });
        assert_eq!((t.br(), t.threads(), t.shared_bytes(128)), (128, 128, (128 + 256) * 256));
        for bad in ["", "2,64", "3,64,4", "2,60,4", "2,64,0", "a,b,c", "2,64,4,1"] {
            assert!(
                matches!(bad.parse::<ForwardTiles>(), Err(KernelError::Config(_))),
                "{bad:?} should be rejected"
            );
        }
        for bad in [0, 4, 100, 264] {
            assert!(matches!(
                ForwardTiles::for_head_dim(bad, "sm_90a"),
                Err(KernelError::UnsupportedHeadDim { d, .. }) if d == bad
            ));
        }
        // A head dim takes the tiles of the largest one of its range, and its shared tiles are
        // padded to whole 64-element rows.
        let tiles = |d| ForwardTiles::for_head_dim(d, "sm_90a").unwrap();
        assert_eq!((tiles(40), tiles(96), tiles(160)), (tiles(64), tiles(128), tiles(256)));
        assert_eq!(
            (tile_cols(8), tile_cols(64), tile_cols(72), tile_cols(256)),
            (64, 64, 128, 256)
        );
        assert_eq!(tiles(96).shared_bytes(96), tiles(128).shared_bytes(128));
        let err = ForwardTiles::for_head_dim(100, "sm_90a").unwrap_err().to_string();
        assert!(err.contains("multiples of 8 from 8 to 256"), "{err}");
        assert_eq!((HEAD_DIMS.len(), BACKWARD_HEAD_DIMS.last()), (32, Some(&128)));
    }

    #[test]
    fn backward_shared_memory_drops_the_ds_tile_when_deterministic() {
        let t64 = || BackwardTiles::for_head_dim(64).unwrap();
        let t = BackwardTiles::for_head_dim(128).unwrap();
        assert_eq!((t.bc(), t.dq_br()), (128, 64));
        assert_eq!(BackwardTiles::for_head_dim(64).unwrap().dq_br(), 128);
        // The sizes the kernels' comments give.
        assert_eq!((t.shared_bytes(128, false), t.shared_bytes(128, true)), (148480, 132096));
        assert_eq!(t.dq_shared_bytes(128), 98304);
        assert_eq!(t.shared_bytes(128, false) - t.shared_bytes(128, true), 128 * 64 * 2);
        assert!(t.shared_bytes(128, false) <= 227 * 1024);
        assert!(matches!(
            backward_variant(
                136,
                DType::F16,
                Masking { causal: false, windowed: false },
                (false, false),
                (None, None)
            ),
            Err(KernelError::UnsupportedHeadDim { d: 136, .. })
        ));
        assert_eq!(
            BackwardTiles::for_head_dim(40).unwrap(),
            BackwardTiles::for_head_dim(64).unwrap()
        );
        // A packed batch's main kernel takes 32-row query steps past d = 64.
        let packed = |d| BackwardTiles::for_packed(d).unwrap();
        assert_eq!((packed(64), packed(72).br, packed(128).br), (t64(), 32, 32));
        assert_eq!(
            packed(128).shared_bytes(128, false),
            (2 * 128 + 4 * 32) * 128 * 2 + 128 * 64 * 2 + 4 * 32 * 4
        );
    }
}
