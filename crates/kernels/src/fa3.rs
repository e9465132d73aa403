//! Rung 5 on the GPU: FlashAttention-3 (Shah et al. 2024), forward, on Hopper (`sm_90a`).
//!
//! The same arithmetic as FA2 ([`crate::fa2`]), scheduled for Hopper's asynchronous hardware
//! (the paper's §3; kernel `cuda/fa3_forward.cu`):
//!
//! - **TMA**: a producer warpgroup copies whole Q, K, V tiles with single instructions, described
//!   by tensor maps built here on the host (`cuTensorMapEncodeTiled`); the copy engine fills rows
//!   past a sequence's end with zeros. Where O's tile fits in shared memory
//!   ([`Fa3Tiles::o_in_shared`]) the consumers write O there and the copy engine stores it too.
//! - **wgmma**: the consumer warpgroups (64 query rows each) multiply from shared memory
//!   asynchronously: `S = Q Kᵀ` with both operands in shared memory, `O += P V` with `P` in
//!   registers.
//! - **Warp specialisation**: the producer hands most of its registers to the consumers
//!   (`setmaxnreg`); an mbarrier pipeline of [`Fa3Tiles::stages`] shared-memory stages connects
//!   them.
//! - **Ping-pong** ([`Schedule::pingpong`]): the consumer warpgroups take turns issuing their
//!   products, so that one's softmax runs under the other's matrix products.
//! - **Intra-warpgroup overlap** ([`Schedule::overlap`], Algorithm 2): the softmax of tile `j`
//!   runs while the product `P_{j-1} V_{j-1}` is computed.
//!
//! The CPU rung `ladder_reference::fa3` runs the loop of Algorithm 2 in the same order, and
//! `ladder_reference::fa3_schedule` simulates the schedules that [`Schedule`] switches between.
//!
//! **Any head dim, any layout.** The kernel is compiled for the head dim it is given (every
//! multiple of 8 up to 256): its shared tiles are rows of whole 128-byte blocks, the copy engine
//! fills the columns past `d` with zeros (they lie outside the tensor map, so nothing is read for
//! them), `S = Q Kᵀ` runs over `d` rounded up to the 16-wide k-step and `O += P V` is exactly
//! `d` wide (wgmma's N takes every multiple of 8). The tensor maps carry Q's, K's, V's and O's
//! own strides, so `[b, s, h, d]` or views into a packed QKV buffer need no copy.
//! [`Fa3Tiles::for_head_dim`] is the table of tiles per head dim, with the reason for each row.
//!
//! **Packed batches** of sequences of different lengths ([`forward_varlen`], [`crate::varlen`]):
//! the persistent blocks walk the host's list of query blocks for every head; the producer looks
//! each tile up and hands it to the consumers in shared memory.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::{
    CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle, cuTensorMapEncodeTiled,
};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, GpuConfig, Kernel, parse_counts};
use crate::mask_mod::{MaskArgs, Walk, mask_args};
use crate::problem::{Band, Masking, Options, Output, Problem, Strides, grid, multiples};
use crate::score_mod::ModifierArgs;
use crate::tensor::{DType, Tensor};
use crate::varlen::{SeqLens, VarlenParams};

pub mod backward;
pub mod fp8;

pub use backward::{BACKWARD_HEAD_DIMS, backward};

pub(crate) const SRC: &str = include_str!("../cuda/fa3_forward.cu");

/// Head dimensions with an FA3 kernel: every multiple of 8 from 8 to 256 (the kernel is compiled
/// for the one it is given).
pub const HEAD_DIMS: &[usize] = &multiples::<32>(8);
/// Element types of the FA3 kernels.
pub const DTYPES: &[DType] = &[DType::F16, DType::BF16];
/// The architecture the kernels need (wgmma and setmaxnreg exist only in `sm_90a`).
pub const ARCH: &str = "sm_90a";

/// Dynamic shared memory a block may opt in to on Hopper (227 KiB).
pub const MAX_SHARED_BYTES: usize = 227 * 1024;

/// The packed variant's `Tile` slot in shared memory (ten `int`s, at the 8-byte
/// alignment of the mbarriers before it), where the producer hands the consumers their tiles.
const TILE_SLOT_BYTES: usize = 40;

/// The longest problem (keys) that takes the short-problem tiles ([`Fa3Tiles::for_problem`]: d
/// = 128 with or without the mask, d = 64 causal).
pub const SHORT_KEYS: usize = 2048;

/// Tile configuration of the FA3 forward kernel: `64 · consumers` query rows per block, `bc`
/// keys per K/V tile, `stages` K/V tiles in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fa3Tiles {
    /// Keys per K/V tile (a multiple of 16, at most 256).
    pub bc: usize,
    /// Consumer warpgroups, 64 query rows each (2 or 3).
    pub consumers: usize,
    /// Shared-memory stages of the K/V pipeline (2 or more).
    pub stages: usize,
}

impl Fa3Tiles {
    /// Checked tiles: `bc` a multiple of 16 in 16..=256, 1 to 3 consumer warpgroups, 2 to 8
    /// stages (whether they fit the device's shared memory is checked at launch).
    pub fn new(bc: usize, consumers: usize, stages: usize) -> Result<Fa3Tiles> {
        if bc == 0 || bc % 16 != 0 || bc > 256 || !(1..=3).contains(&consumers) {
            return Err(KernelError::Config(format!(
                "FA3 tiles bc={bc}, consumers={consumers}, stages={stages}: expected bc a \
                 multiple of 16 in 16..=256, 1 to 3 consumers, 2 to 8 stages"
            )));
        }
        if !(2..=8).contains(&stages) {
            return Err(KernelError::Config(format!(
                "FA3 tiles: {stages} stages (expected 2 to 8)"
            )));
        }
        Ok(Fa3Tiles { bc, consumers, stages })
    }

    /// The tiles for head dim `d` (any of [`HEAD_DIMS`]), by the width of its shared rows
    /// ([`tile_cols`]: `d` rounded up to 64), which sets what fits in shared memory. FA3's own
    /// choices (paper §4.1, `hopper/tile_size.h`) tuned on the H200 (docs/perf-notes.md):
    ///
    /// | d | tiles (br × bc, stages) | why |
    /// |---|---|---|
    /// | 8 … 64 | 192 × 128, 4 | three consumer warpgroups: at 160 registers each S, P and a narrow O fit; four stages (d = 64 causal n = 4k +9 %) |
    /// | 72 … 128 | 128 × 176, 2 | two warpgroups at 240 registers; 176 keys beat FA3's 128 under the mask too (625 against 542 TFLOP/s at d = 128, n = 16k) |
    /// | 136 … 192 | 128 × 112, 2 | 192-element rows: two stages of 112 keys are what fits beside Q (222 KB of 227) |
    /// | 200 … 256 | 128 × 80, 2 | 256-element rows: 80 keys fit |
    /// The mask does not change them (short problems and mask modifiers do:
    /// [`Fa3Tiles::for_problem`]).
    pub fn for_head_dim(d: usize, _causal: bool) -> Result<Fa3Tiles> {
        if !HEAD_DIMS.contains(&d) {
            return Err(KernelError::UnsupportedHeadDim { rung: "fa3", d, supported: HEAD_DIMS });
        }
        Ok(match tile_cols(d) {
            64 => Fa3Tiles { bc: 128, consumers: 3, stages: 4 },
            128 => Fa3Tiles { bc: 176, consumers: 2, stages: 2 },
            192 => Fa3Tiles { bc: 112, consumers: 2, stages: 2 },
            _ => Fa3Tiles { bc: 80, consumers: 2, stages: 2 },
        })
    }

    /// The tiles [`forward`] uses for a problem of head dimension `d`, the mask, and `n_kv` keys:
    /// [`Fa3Tiles::for_head_dim`], except for short problems, at most [`SHORT_KEYS`] keys
    /// (H200, docs/perf-notes.md):
    ///
    /// - d = 72 … 128, causal: FA3's own 128 keys per tile instead of 176, which waste less on the
    ///   diagonal's masked scores (+12 %, +9 %, +3 % at n = 512, 1k, 2k; level at 4k; −7 % at
    ///   16k); without the mask too, where 128-key tiles leave room for O's tile in shared memory
    ///   ([`Fa3Tiles::o_in_shared`]; +11 %, +5 % at n = 512, 1k, level at 2k and 4k);
    /// - d = 8 … 64, causal: 128 query rows (two consumer warpgroups) instead of 192 (+10 %,
    ///   +16 %, +2 % at n = 512, 1k, 2k; level at 4k).
    ///
    /// (Measured at d = 64 and 128; the head dims that share their shared rows take the same.) A
    /// mask modifier takes these tiles at every length ([`forward`]).
    pub fn for_problem(d: usize, causal: bool, n_kv: usize) -> Result<Fa3Tiles> {
        let tiles = Fa3Tiles::for_head_dim(d, causal)?;
        Ok(match (tile_cols(d), causal) {
            (128, _) if n_kv <= SHORT_KEYS => Fa3Tiles { bc: 128, consumers: 2, stages: 2 },
            (64, true) if n_kv <= SHORT_KEYS => Fa3Tiles { bc: 128, consumers: 2, stages: 4 },
            _ => tiles,
        })
    }

    /// The tiles [`forward`] takes on `gpu` for a problem of head dimension `d`, the mask and
    /// `n_kv` keys: the configuration's (`GpuConfig::tune(tiles)`) where one is set,
    /// otherwise [`Fa3Tiles::for_problem`]. (The FP8 path's: [`fp8::tiles_on`].)
    pub fn on(gpu: &Gpu, d: usize, causal: bool, n_kv: usize) -> Result<Fa3Tiles> {
        Fa3Tiles::for_config(gpu.config(), d, causal, n_kv)
    }

    /// [`Fa3Tiles::on`] for a configuration, without a device (what `inspect` compiles).
    pub(crate) fn for_config(
        config: &GpuConfig,
        d: usize,
        causal: bool,
        n_kv: usize,
    ) -> Result<Fa3Tiles> {
        match config.tuned::<Fa3Tiles>() {
            Some(t) => Ok(t),
            None => Fa3Tiles::for_problem(d, causal, n_kv),
        }
    }

    /// The tiles under a score modifier: two consumer warpgroups where there were three (d ≤ 64),
    /// whose 160 registers a modifier's arithmetic overflows (ALiBi after softcap spills 72–92
    /// bytes there; at 240 registers none does).
    pub fn with_score_mod(self) -> Fa3Tiles {
        Fa3Tiles { consumers: self.consumers.min(2), ..self }
    }

    /// Query rows per block.
    pub fn br(&self) -> usize {
        64 * self.consumers
    }

    /// Threads per block: the producer warpgroup and the consumers.
    pub fn threads(&self) -> usize {
        128 * (self.consumers + 1)
    }

    /// Dynamic shared memory in bytes for head dim `d` and operands of `operand_bytes` bytes (2
    /// for fp16/bf16, 1 for e4m3): the Q tile, `stages` K and V tiles, the pipeline's mbarriers
    /// (Q full/empty, K and V full/empty per stage), 1024 bytes to align the tiles for the
    /// 128-byte swizzle, and O's tile (16-bit) where it fits ([`Fa3Tiles::o_in_shared`]).
    pub fn shared_bytes(&self, d: usize, operand_bytes: usize) -> usize {
        shared_bytes(*self, d, operand_bytes, self.o_in_shared(d, operand_bytes), false)
    }

    /// Whether the kernel writes O through shared memory with a TMA store instead of from
    /// registers (`FA3_O_SMEM`): where O's tile fits beside the pipeline's and `d` > 64, that is
    /// d = 72 … 128 with 128-key tiles and FP8; not d = 128 with 176-key tiles or past 128 in 16
    /// bits (no room). Measured on the H200 (docs/perf-notes.md, FA3 v8): +9–12 % at d = 128
    /// causal, n = 512 … 2k, up to +13 % in FP8; at d = 64, where a warpgroup's O is 16 stores
    /// per thread from registers, −5 % and −7 % causal at n = 1k and 2k, +2 % unmasked, so not
    /// there.
    pub fn o_in_shared(&self, d: usize, operand_bytes: usize) -> bool {
        d > 64 && self.pipeline_bytes(d, operand_bytes) + self.o_bytes(d) <= MAX_SHARED_BYTES
    }

    /// The Q tile, the K/V stages, the mbarriers and the alignment slack. Rows of Q and K are
    /// whole 128-byte blocks (the kernel's `COLS`); so are V's in 16 bits, while e4m3's
    /// transposed V has `d` rows of whole 128-key column blocks (the kernel's `VT_KEYS`).
    fn pipeline_bytes(&self, d: usize, operand_bytes: usize) -> usize {
        let cols = d.next_multiple_of(128 / operand_bytes);
        let v_stage = if operand_bytes == 1 {
            d * self.bc.next_multiple_of(128)
        } else {
            self.bc * cols * operand_bytes
        };
        (self.br() + self.stages * self.bc) * cols * operand_bytes
            + self.stages * v_stage
            + 8 * (2 + 4 * self.stages)
            + 1024
    }

    /// O's tile, `br` rows of [`tile_cols`]`(d)` 16-bit elements.
    fn o_bytes(&self, d: usize) -> usize {
        self.br() * tile_cols(d) * 2
    }
}

/// The row length of the 16-bit kernel's shared tiles for head dim `d`: `d` rounded up to whole
/// 128-byte blocks of 64 elements (the swizzle's span, and the copy engine's box).
pub fn tile_cols(d: usize) -> usize {
    d.next_multiple_of(64)
}

/// Set on a [`crate::GpuConfig`] (`.tune(tiles)`), the tiles for every head dimension and mask,
/// instead of FA3's own choices (for tuning experiments; the FP8 path's too, where they suit it).
impl crate::Tuning for Fa3Tiles {}

/// Set on a [`crate::GpuConfig`] (`.tune(schedule)`), the schedule of [`forward`] and
/// [`fp8::forward`] instead of [`Schedule::for_head_dim`]'s (the ablation of FA3's ideas).
impl crate::Tuning for Schedule {}

/// K and V bytes the causal tile order keeps in L2 at a time, instead of [`L2_SECTION_BYTES`]
/// (set on a [`crate::GpuConfig`] with `.tune(L2Section(bytes))`; for tuning, and for tests of the
/// order: the order never changes a result).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L2Section(pub usize);

impl crate::Tuning for L2Section {}

impl std::str::FromStr for Fa3Tiles {
    type Err = KernelError;

    /// `bc,consumers,stages`, e.g. `176,2,2`.
    fn from_str(spec: &str) -> Result<Fa3Tiles> {
        match parse_counts(spec) {
            Some([bc, consumers, stages]) => Fa3Tiles::new(bc, consumers, stages),
            None => Err(KernelError::Config(format!(
                "FA3 tiles {spec:?}: expected bc,consumers,stages (e.g. 176,2,2)"
            ))),
        }
    }
}

/// Which of FA3's scheduling ideas the kernel uses ([`Schedule::default`]: all on; what
/// [`forward`] uses: [`Schedule::for_head_dim`]): switching one off runs a variant without it,
/// for the paper's ablation (§4.2). Every variant computes the same result, bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Consumer warpgroups take turns issuing their products (named barriers).
    pub pingpong: bool,
    /// The softmax of tile `j` overlaps the product `P_{j-1} V_{j-1}` (Algorithm 2); off, a
    /// warpgroup waits for both of its products before its softmax.
    pub overlap: bool,
    /// One block per SM walks many query tiles, loading the next tile while it finishes the last
    /// (off: one block per query tile, scheduled by the hardware).
    pub persistent: bool,
    /// An experiment, off by default: under a sliding window and without `overlap`, the blocks
    /// take their tiles past the first wave from a counter instead of the static order (FA3's
    /// dynamic tile scheduler). Measured on the H200: the SMs finish together, but the calls
    /// were not faster (docs/perf-notes.md, seventeenth session). Ignored elsewhere.
    pub dynamic: bool,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule { pingpong: true, overlap: true, persistent: true, dynamic: false }
    }
}

impl Schedule {
    /// The schedule [`forward`] and [`fp8::forward`] use for head dimension `d` (e4m3 operands
    /// when `fp8`): every idea on, except the intra-warpgroup overlap at d = 72 … 128 in 16 bits
    /// (the head dims with d = 128's tiles).
    /// Measured on the H200 (docs/perf-notes.md, FA3 v9), against the sequential round: FP8
    /// d = 128 +9–18 % (its exponentials take as long as its products), FP8 d = 256 level,
    /// 16-bit d = 256 +2–7 % (−4 % causal at n = 512), d = 64 +2 %, 16-bit d = 128 −2 % on
    /// average (ping-pong already hides its softmax; P in flight beside S and O costs the
    /// scheduler registers).
    pub fn for_head_dim(d: usize, fp8: bool) -> Schedule {
        Schedule { overlap: fp8 || tile_cols(d) != 128, ..Schedule::default() }
    }

    /// The schedule `gpu` runs at head dimension `d` (e4m3 operands when `fp8`): its
    /// configuration's (`GpuConfig::tune(schedule)`, the ablation) where one is set, otherwise
    /// [`Schedule::for_head_dim`].
    pub fn on(gpu: &Gpu, d: usize, fp8: bool) -> Schedule {
        Schedule::for_config(gpu.config(), d, fp8)
    }

    /// [`Schedule::on`] for a configuration, without a device (what `inspect` compiles).
    pub(crate) fn for_config(config: &GpuConfig, d: usize, fp8: bool) -> Schedule {
        config.tuned::<Schedule>().unwrap_or(Schedule::for_head_dim(d, fp8))
    }

    /// `full`, or the ideas switched off (and the experiment switched on) joined by commas
    /// (`no-pingpong,no-overlap`, `no-overlap,dynamic`): the form [`std::str::FromStr`] reads.
    pub fn label(&self) -> String {
        let off: Vec<&str> = [
            (self.pingpong, "no-pingpong"),
            (self.overlap, "no-overlap"),
            (self.persistent, "no-persistent"),
            (!self.dynamic, "dynamic"),
        ]
        .into_iter()
        .filter(|(on, _)| !on)
        .map(|(_, name)| name)
        .collect();
        if off.is_empty() { "full".to_string() } else { off.join(",") }
    }
}

impl std::str::FromStr for Schedule {
    type Err = KernelError;

    /// `full`, or a comma-separated list of `no-pingpong`, `no-overlap`, `no-persistent`,
    /// `dynamic`.
    fn from_str(spec: &str) -> Result<Schedule> {
        let mut s = Schedule::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty() && *p != "full") {
            match part {
                "no-pingpong" => s.pingpong = false,
                "no-overlap" => s.overlap = false,
                "no-persistent" => s.persistent = false,
                "dynamic" => s.dynamic = true,
                other => {
                    return Err(KernelError::Config(format!(
                        "FA3 schedule {spec:?}: unknown part {other:?} (expected full, or any of \
                         no-pingpong, no-overlap, no-persistent, dynamic)"
                    )));
                }
            }
        }
        Ok(s)
    }
}

/// Bytes per element of Q, K and V in the kernel: 1 for e4m3 (`fp8`), else 2.
fn operand_bytes(fp8: bool) -> usize {
    if fp8 { 1 } else { 2 }
}

/// The kernel variant for head dimension `d`, element type, masking (the causal mask compiled in,
/// a window's band in the parameters), tiles and schedule, with 16-bit or (`fp8`) e4m3 operands,
/// for a fixed-length or a `packed` batch.
pub(crate) fn variant(
    d: usize,
    dtype: DType,
    mask: Masking,
    (t, s): (Fa3Tiles, Schedule),
    fp8: bool,
    packed: bool,
) -> Variant {
    let operand_bytes = operand_bytes(fp8);
    let o_smem = o_through_shared(t, d, operand_bytes, packed);
    let dynamic = dynamic_tiles(mask, s);
    Variant {
        file: "fa3_forward",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FA3_D", d.to_string()),
            ("FA3_BC", t.bc.to_string()),
            ("FA3_CONSUMERS", t.consumers.to_string()),
            ("FA3_STAGES", t.stages.to_string()),
            ("FA3_CAUSAL", (mask.causal as u32).to_string()),
            ("FA3_WINDOW", (mask.windowed as u32).to_string()),
            ("FA3_DYNAMIC", (dynamic as u32).to_string()),
            ("FA3_OVERLAP", (s.overlap as u32).to_string()),
            ("FA3_PINGPONG", (s.pingpong as u32).to_string()),
            ("FA3_FP8", (fp8 as u32).to_string()),
            ("FA3_O_SMEM", (o_smem as u32).to_string()),
            ("FA3_VARLEN", (packed as u32).to_string()),
            // Checked against the kernel's own sizes when it compiles.
            (
                "FA3_HOST_SHARED_BYTES",
                shared_bytes(t, d, operand_bytes, o_smem, packed || dynamic).to_string(),
            ),
            ("FA3_HOST_PARAMS_BYTES", std::mem::size_of::<ForwardParams>().to_string()),
        ],
        generated: Vec::new(),
    }
}

/// Whether the kernel's blocks take their tiles from a counter (the kernel's `dynamic`): where the
/// schedule asks for it ([`Schedule::dynamic`]), under a window, without the overlap.
fn dynamic_tiles(mask: Masking, schedule: Schedule) -> bool {
    schedule.dynamic && mask.windowed && !schedule.overlap
}

/// Whether O goes through shared memory: where it fits ([`Fa3Tiles::o_in_shared`]), and not for a
/// packed batch, whose 64-row boxes would reach into the next sequence's rows.
fn o_through_shared(t: Fa3Tiles, d: usize, operand_bytes: usize, packed: bool) -> bool {
    !packed && t.o_in_shared(d, operand_bytes)
}

/// The launch's dynamic shared memory: the pipeline's, O's tile if `o_smem`, and the slot in
/// which the producer hands each tile to the consumers (`tile_slot`: a packed batch's, and one
/// whose tiles come from a counter, [`Schedule::dynamic`]).
fn shared_bytes(t: Fa3Tiles, d: usize, operand_bytes: usize, o_smem: bool, slot: bool) -> usize {
    t.pipeline_bytes(d, operand_bytes)
        + if o_smem { t.o_bytes(d) } else { 0 }
        + if slot { TILE_SLOT_BYTES } else { 0 }
}

/// Mirror of `Fa3ForwardParams` in `cuda/fa3_forward.cu`: four tensor maps (128-byte aligned,
/// as the kernel's `TensorMap`), then the output pointers, the FP8 scales and the sizes.
#[repr(C)]
#[derive(Clone, Copy)]
struct ForwardParams {
    q: CUtensorMap,
    k: CUtensorMap,
    v: CUtensorMap,
    o_map: CUtensorMap,
    o: u64,
    lse: u64,
    scales: Fp8Scales,
    batch: i32,
    heads_q: i32,
    heads_kv: i32,
    n_q: i32,
    n_kv: i32,
    scale_log2: f32,
    band: Band,
    section_heads: i32,
    o_strides: Strides,
    varlen: VarlenParams,
    tile_counter: u64,
    mods: ModifierArgs,
    mask: MaskArgs,
}

/// Device addresses of the FP8 path's scales (`q, k, p, o` in the kernel's order); zero on the
/// 16-bit path, which never reads them.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Fp8Scales {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) p: u64,
    pub(crate) o: u64,
}

// SAFETY: a plain #[repr(C)] struct (opaque tensor-map words, integers, floats), laid out as its
// CUDA mirror: CUtensorMap is 128 bytes aligned to 128 in both (cudarc's cuda-13000 binding and
// the kernel's TensorMap).
unsafe impl DeviceRepr for ForwardParams {}

/// What a TMA tensor map describes: a 4-d tensor at device address `ptr` with dimensions `dims`
/// (innermost first, the first contiguous) of `elem` bytes each, the others `strides` elements
/// apart, read in boxes of 128 bytes × `rows` rows with the 128-byte swizzle.
pub(crate) struct MapSpec {
    pub(crate) name: &'static str,
    pub(crate) ptr: u64,
    pub(crate) dims: [usize; 4],
    pub(crate) strides: [usize; 3],
    pub(crate) dtype: CUtensorMapDataType,
    pub(crate) elem: usize,
    pub(crate) rows: usize,
}

/// The strides of a row-major tensor of dimensions `dims` (innermost first), as [`MapSpec`]
/// takes them.
pub(crate) fn dense_strides(dims: [usize; 4]) -> [usize; 3] {
    [dims[0], dims[0] * dims[1], dims[0] * dims[1] * dims[2]]
}

/// The TMA tensor map of `spec`.
pub(crate) fn tensor_map(spec: &MapSpec) -> Result<CUtensorMap> {
    let MapSpec { name, ptr, dims, strides, dtype, elem, rows } = *spec;
    if ptr % 16 != 0 {
        return Err(KernelError::Shape(format!(
            "{name} must start at a 16-byte aligned device address for TMA (got {ptr:#x})"
        )));
    }
    let elem = elem as u64;
    let sizes = dims.map(|x| x as u64);
    // Strides::of keeps each a whole number of 16-byte chunks below 2^32 of them, inside the
    // copy engine's limits (multiples of 16 bytes, below 2^40).
    let strides = strides.map(|x| x as u64 * elem);
    let boxes = [(128 / elem) as u32, rows as u32, 1, 1];
    let element_strides = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    // SAFETY: every array has the length the rank (4) implies (strides: rank − 1), `map` is valid
    // for writes, and `ptr` is a device address of the tensor's elements; the driver only
    // records it.
    unsafe {
        cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            4,
            ptr as *mut c_void,
            sizes.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(KernelError::driver(format!("building the TMA tensor map of {name} {dims:?}")))?;
    // SAFETY: cuTensorMapEncodeTiled succeeded and wrote the whole map (it was zeroed before).
    Ok(unsafe { map.assume_init() })
}

/// The map of a `[batch, heads, n, d]` 16-bit tensor (`shape`, `dtype`) at `ptr` whose rows lie
/// at `strides` ([`Strides::of`] of it), in tiles of `rows` rows.
pub(crate) fn tensor_map_16(
    name: &'static str,
    (shape, dtype): (&[usize], DType),
    strides: Strides,
    ptr: u64,
    rows: usize,
) -> Result<CUtensorMap> {
    let dtype = match dtype {
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        other => {
            return Err(KernelError::UnsupportedDtype {
                rung: "fa3",
                dtype: other,
                supported: "fp16, bf16",
            });
        }
    };
    let dims = [shape[3], shape[2], shape[1], shape[0]];
    let Strides { batch, head, row } = strides;
    let strides = [row, head, batch].map(|x| x as usize);
    tensor_map(&MapSpec { name, ptr, dims, strides, dtype, elem: 2, rows })
}

/// `softmax(scale · Q Kᵀ + mask) V` and its log-sum-exp, as [`crate::fa2::forward`] computes
/// them (fp16 or bf16; any head dim in [`HEAD_DIMS`]; any batch, head and sequence strides with
/// the head dim contiguous, O laid out like Q; any lengths, `n_q != n_kv` with bottom-right
/// causal, GQA), on a Hopper GPU, with [`Schedule::for_head_dim`] (or the `Gpu` configuration's,
/// `GpuConfig::tune(schedule)`). Other GPUs get [`KernelError::UnsupportedArch`]. FP8:
/// [`fp8::forward`].
pub fn forward(gpu: &Gpu, q: &Tensor, k: &Tensor, v: &Tensor, opts: &Options) -> Result<Output> {
    let d = q.shape().last().copied().unwrap_or(0);
    forward_with(gpu, q, k, v, opts, Schedule::on(gpu, d, false))
}

/// Fails with [`KernelError::UnsupportedArch`] unless `gpu` is a Hopper GPU.
pub(crate) fn require_hopper(gpu: &Gpu, rung: &'static str) -> Result<()> {
    if gpu.arch() == ARCH {
        Ok(())
    } else {
        Err(KernelError::UnsupportedArch { rung, arch: gpu.arch().to_string(), needed: ARCH })
    }
}

/// [`forward`] with some of FA3's scheduling ideas switched off (the ablation).
pub fn forward_with(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &Options,
    schedule: Schedule,
) -> Result<Output> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    forward_problem(gpu, &p, (q, k, v), schedule, None)
}

/// [`forward`] on a packed variable-length batch ([`crate::varlen`]): Q `[total_q, heads_q, d]`,
/// K and V `[total_k, heads_kv, d]` (any strides with the head dim contiguous), sequence `b`'s
/// rows as `lens` gives them; O `[total_q, heads_q, d]` laid out like Q, lse `[heads_q, total_q]`.
/// The persistent blocks walk the query blocks that exist, longest first (under the mask, the
/// heads of one query block side by side). O is stored from registers ([`Fa3Tiles::o_in_shared`]
/// does not apply). The copy engine reads whole tiles, so a sequence's last K/V tile holds the
/// next sequence's first keys: they are masked out of S, but a NaN or infinity among them still
/// reaches O through `0 · V` (as in FlashAttention-3); [`crate::fa2::forward_varlen`] zero-fills
/// them instead, and so does the FP8 path ([`fp8::forward_varlen`]), whose quantiser pads each
/// sequence's last V tile with zeros.
pub fn forward_varlen(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &SeqLens,
    opts: &Options,
) -> Result<Output> {
    let p = Problem::packed(gpu, (q, k, v), lens, opts)?;
    p.require_no_mask_mod("fa3 (packed)")?;
    forward_problem(gpu, &p, (q, k, v), Schedule::on(gpu, p.d, false), Some(lens))
}

/// The 16-bit forward kernel on the checked problem `p` (packed when `lens` is given).
fn forward_problem(
    gpu: &Gpu,
    p: &Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    schedule: Schedule,
    lens: Option<&SeqLens>,
) -> Result<Output> {
    require_hopper(gpu, "fa3")?;
    p.require_dtype("fa3", DTYPES, "fp16, bf16")?;
    if !HEAD_DIMS.contains(&p.d) {
        return Err(KernelError::UnsupportedHeadDim { rung: "fa3", d: p.d, supported: HEAD_DIMS });
    }
    // A mask modifier takes the short problems' tiles at every length: 128 keys (d = 72 … 128)
    // line up with the block mask's documents and prefixes where 176 cut across them, and waste
    // less on its partial tiles (H100, 16 documents in 16k: 207 against 141 TFLOP/s).
    let n_kv = if p.mask_mod.is_some() { p.n_kv.min(SHORT_KEYS) } else { p.n_kv };
    let mut tiles = Fa3Tiles::on(gpu, p.d, p.causal, n_kv)?;
    if p.score_mod.is_some() || p.mask_mod.is_some() {
        tiles = tiles.with_score_mod();
    }
    let o = gpu.output_like(q, p.dtype)?;
    let s = gpu.stream();
    let (q_ptr, _g0) = q.read_ptr(s);
    let (k_ptr, _g1) = k.read_ptr(s);
    let (v_ptr, _g2) = v.read_ptr(s);
    let [qs, ks, vs] = p.strides;
    let maps = [
        tensor_map_16("q", (&p.kernel_dims(q), q.dtype()), qs, q_ptr, tiles.br())?,
        tensor_map_16("k", (&p.kernel_dims(k), k.dtype()), ks, k_ptr, tiles.bc)?,
        tensor_map_16("v", (&p.kernel_dims(v), v.dtype()), vs, v_ptr, tiles.bc)?,
    ];
    launch(gpu, p, Launch { tiles, schedule, maps, fp8: None, lens }, o)
}

/// What [`launch`] launches: the tiles and schedule, Q, K, V's tensor maps (16-bit, or e4m3 with
/// their `fp8` scales), and the offsets of a packed batch.
pub(crate) struct Launch<'a> {
    pub(crate) tiles: Fa3Tiles,
    pub(crate) schedule: Schedule,
    pub(crate) maps: [CUtensorMap; 3],
    pub(crate) fp8: Option<Fp8Scales>,
    pub(crate) lens: Option<&'a SeqLens>,
}

/// K and V bytes the causal tile order keeps in L2 at a time (the kernel's `tile_at`), unless
/// the configuration sets an [`L2Section`]. Measured on the H200 at d = 128
/// (docs/perf-notes.md, "FA3 causal tile order"): sections of 12 MB beat 24 and 48 MB at
/// n = 512 … 4k, by 9–21 % over one section of every head.
pub const L2_SECTION_BYTES: usize = 12 << 20;

/// Sections are used only for problems of at most this many query blocks per head, and where at
/// least [`MIN_SECTION_HEADS`] heads fit the L2 budget; otherwise the order walks every head at
/// once. A section's tiles are all the query blocks of its heads,
/// longest first, and the blocks take them in a static (snake) order: with many query blocks
/// the tiles of one wave vary in length too much for every block's share to come out even.
/// Measured on the H200: −33 % at d = 64, n = 8k (43 query blocks of 192 rows, sections of 6
/// heads); at n = 16k, d = 128, −28 % with one head per section and −12 % with three.
pub const MAX_SECTION_QUERY_BLOCKS: usize = 32;
/// See [`MAX_SECTION_QUERY_BLOCKS`] (d = 256 at n = 4k, 3 heads of 4 MB in 12 MB, walks every
/// head at once, as tuned).
pub const MIN_SECTION_HEADS: usize = 4;

/// How evenly a section size may share the work out and still be taken: within this of the most
/// even one ([`section_heads`]).
const BALANCE_SLACK: f64 = 0.02;

/// How many (head, batch) pairs the causal tile order walks together, for query blocks of `br`
/// rows, K/V tiles of `bc` keys and `grid` persistent blocks: at most as many as whose K and V
/// fit in `budget` bytes (q heads of one GQA group share theirs), and of those the largest whose
/// static share-out of the tiles comes out within [`BALANCE_SLACK`] of the most even one
/// ([`TileOrder::balance`]). All of them past [`MAX_SECTION_QUERY_BLOCKS`] or when fewer than
/// [`MIN_SECTION_HEADS`] fit.
/// Without the mask, or under a mask modifier (whose block mask orders the tiles), the order
/// ignores it, and none is worked out.
///
/// The share-out matters as much as the L2: at d = 96, n = 4k, 64 heads, the 8 heads that fit
/// in 12 MB leave the busiest block with 1.6 × the mean's work (balance 0.62), and the kernel ran
/// at 315 TFLOP/s; 6 heads (balance 0.98) is what d = 128 takes (docs/perf-notes.md).
fn section_heads(
    p: &Problem,
    (br, bc): (usize, usize),
    grid: usize,
    operand_bytes: usize,
    budget: usize,
) -> i32 {
    let group = (p.heads_q / p.heads_kv.max(1)).max(1);
    let kv_per_head = (2 * p.n_kv * p.d * operand_bytes).div_ceil(group).max(1);
    let heads = (p.heads_q * p.batch).max(1);
    let fit = (budget / kv_per_head).min(heads);
    let q_blocks = p.n_q.div_ceil(br.max(1));
    // (Under a mask modifier the block mask's order replaces the causal one: nothing to work out.)
    let causal_order = p.causal && p.mask_mod.is_none();
    let section = if !causal_order || fit < MIN_SECTION_HEADS || q_blocks > MAX_SECTION_QUERY_BLOCKS
    {
        heads
    } else {
        let order =
            TileOrder { heads, q_blocks, br, bc: bc.max(1), n_q: p.n_q, n_kv: p.n_kv, grid };
        most_even_section(order, fit)
    };
    section.min(i32::MAX as usize) as i32
}

/// The causal tile order of the kernel (`tile_at`, `next_tile` in `cuda/fa3_forward.cu`) for
/// `heads` (head, batch) pairs of `q_blocks` query blocks each, walked by `grid` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TileOrder {
    heads: usize,
    q_blocks: usize,
    br: usize,
    bc: usize,
    n_q: usize,
    n_kv: usize,
    grid: usize,
}

impl TileOrder {
    /// K/V tiles of query block `q_block` under the causal mask (the end of the kernel's
    /// `kv_span`).
    fn key_tiles(&self, q_block: usize) -> usize {
        let last_key = (q_block * self.br + self.br - 1 + self.n_kv) as i64 - self.n_q as i64;
        if last_key < 0 {
            0
        } else {
            self.n_kv.div_ceil(self.bc).min(last_key as usize / self.bc + 1)
        }
    }

    /// The mean over the busiest of the blocks' work, counted as K/V tiles plus one per query
    /// tile (its Q load and epilogue), with sections of `section` pairs: 1 when every block gets
    /// the same.
    fn balance(&self, section: usize) -> f64 {
        let (blocks, grid) = (self.q_blocks, self.grid.max(1));
        let total = self.heads * blocks;
        let work = |index: usize| {
            let first = index / (section * blocks) * section;
            let in_section = section.min(self.heads - first);
            let r = index - first * blocks;
            self.key_tiles(blocks - 1 - r / in_section) + 1
        };
        let mut loads = vec![0usize; grid];
        for (round, start) in (0..total).step_by(grid).enumerate() {
            for (lane, load) in loads.iter_mut().enumerate() {
                let block = if round % 2 == 0 { lane } else { grid - 1 - lane };
                if start + block < total {
                    *load += work(start + block);
                }
            }
        }
        let max = loads.iter().copied().max().unwrap_or(0).max(1);
        loads.iter().sum::<usize>() as f64 / grid as f64 / max as f64
    }
}

/// The largest section of at most `fit` pairs whose [`TileOrder::balance`] is within
/// [`BALANCE_SLACK`] of the best of them; remembered per order, since serving and training call
/// the same shapes again and again.
fn most_even_section(order: TileOrder, fit: usize) -> usize {
    static CHOSEN: OnceLock<Mutex<HashMap<(TileOrder, usize), usize>>> = OnceLock::new();
    let chosen = CHOSEN.get_or_init(Default::default);
    if let Some(&section) = chosen.lock().ok().and_then(|m| m.get(&(order, fit)).copied()).as_ref()
    {
        return section;
    }
    let balances: Vec<f64> = (1..=fit).map(|section| order.balance(section)).collect();
    let best = balances.iter().copied().fold(0.0, f64::max);
    let section = (1..=fit).rev().find(|&s| balances[s - 1] >= best - BALANCE_SLACK).unwrap_or(fit);
    if let Ok(mut m) = chosen.lock() {
        m.insert((order, fit), section);
    }
    section
}

/// Launches the forward kernel ([`Launch`]) and returns O (written into `o`, `[batch, heads_q,
/// n_q, d]` in any strides, or packed `[total_q, heads_q, d]`) and lse. The variant and its
/// shared memory come from the same flag, so that they agree on whether O's tile is in shared
/// memory ([`Fa3Tiles::o_in_shared`]).
pub(crate) fn launch(gpu: &Gpu, p: &Problem, l: Launch, mut o: Tensor) -> Result<Output> {
    let Launch { tiles, schedule, maps, fp8, lens } = l;
    let scales = fp8.unwrap_or_default();
    let fp8 = fp8.is_some();
    let operand_bytes = operand_bytes(fp8);
    let packed = lens.is_some();
    let mask = Masking::of(p);
    let kernel = Kernel {
        variant: variant(p.d, p.dtype, mask, (tiles, schedule), fp8, packed)
            .with_score_mod(p.score_mod.as_ref())
            .with_mask_mod(p.mask_mod.as_ref()),
        entry: "fa3_forward",
    };
    let o_smem = o_through_shared(tiles, p.d, operand_bytes, packed);
    let dynamic = dynamic_tiles(mask, schedule);
    let smem = shared_bytes(tiles, p.d, operand_bytes, o_smem, packed || dynamic);
    gpu.prepare(&kernel, smem)?;
    let o_strides = p.strides_of(&o, "o")?;
    let o_layout = (p.kernel_dims(&o), o.dtype());
    let mut lse = gpu.output(&p.lse_shape(), DType::F32)?;
    let table = lens.map(|lens| lens.tiles(gpu, tiles.br(), p.causal)).transpose()?;
    // The mask modifier's block mask, at this kernel's tiles (kept until the launch is queued).
    let (mut mask_args, block_mask) =
        mask_args(gpu, p, (tiles.br(), tiles.bc), Walk::KeysOfQueryTile)?;
    {
        let s = gpu.stream();
        let (o_ptr, _g3) = o.write_ptr(s)?;
        let (lse_ptr, _g4) = lse.write_ptr(s)?;
        let [hq, hkv, nq, nkv] = p.dims_i32();
        let [q, k, v] = maps;
        // O in boxes of 64 rows, one consumer warpgroup's (used where O goes through shared
        // memory).
        let o_map = tensor_map_16("o", (&o_layout.0, o_layout.1), o_strides, o_ptr, 64)?;
        // Persistent blocks, one per SM, each walking the tiles (query block, head, batch); or one
        // block per tile (the kernel's tile loop then runs once).
        let work = match &table {
            Some(table) => table.len() * p.heads_q,
            None => p.n_q.div_ceil(tiles.br()) * p.heads_q * p.batch,
        };
        if work > i32::MAX as usize {
            return Err(KernelError::Shape(format!(
                "{work} query tiles of {} rows exceed the kernel's 32-bit tile index",
                tiles.br()
            )));
        }
        let grid_blocks =
            if schedule.persistent { work.min(gpu.sm_count() as usize) } else { work };
        // Under a mask modifier the blocks take the query tiles in the order its block mask's
        // counts give (mask_mod::tile_order).
        if let Some(block_mask) = &block_mask {
            block_mask.set_tile_order(gpu, (p.batch, p.heads_q, grid_blocks), &mut mask_args)?;
        }
        let packed_batch = lens.zip(table.as_deref());
        let (varlen, _g_varlen) = VarlenParams::of(gpu, packed_batch);
        let mods = p.modifier_args(gpu)?;
        let params = |tile_counter: u64| ForwardParams {
            q,
            k,
            v,
            o_map,
            o: o_ptr,
            lse: lse_ptr,
            scales,
            batch: p.batch as i32,
            heads_q: hq,
            heads_kv: hkv,
            n_q: nq,
            n_kv: nkv,
            scale_log2: p.scale_log2(),
            band: p.band(),
            section_heads: section_heads(
                p,
                (tiles.br(), tiles.bc),
                grid_blocks,
                operand_bytes,
                gpu.config().tuned::<L2Section>().map_or(L2_SECTION_BYTES, |s| s.0),
            ),
            o_strides,
            varlen,
            tile_counter,
            mods,
            mask: mask_args,
        };
        // With Schedule::dynamic, a windowed problem's blocks take their tiles from two counters
        // (the kernel's next_dynamic_tile), zero at launch and left zero by its last block.
        let shape = (grid(grid_blocks, 1, 1)?, tiles.threads() as u32, smem);
        if dynamic {
            gpu.with_scratch(2, 0, |scratch| {
                gpu.launch(&kernel, shape.0, shape.1, shape.2, &params(scratch.counters))
            })?;
        } else {
            gpu.launch(&kernel, shape.0, shape.1, shape.2, &params(0))?;
        }
    }
    Ok(Output { o, lse })
}

/// Every variant of this rung for `arch` (none before Hopper), for the compile check: the tuned
/// head dims (64, 128, 256) in each dtype and mask with their default schedule, one head dim of
/// every other tile row and off the 64-element blocks (8, 40, 96, 160, 192, 224), the short
/// problems' tiles, and the ablation variants at d = 128.
#[cfg(test)]
pub(crate) fn variants(arch: &str) -> Vec<Variant> {
    let mut all = Vec::new();
    if arch != ARCH {
        return all;
    }
    let mut push = |d, dtype, causal, t: Fa3Tiles| {
        let mask = Masking { causal, windowed: false };
        all.push(variant(d, dtype, mask, (t, Schedule::for_head_dim(d, false)), false, false))
    };
    for &dtype in DTYPES {
        for d in [64, 128, 256] {
            for causal in [false, true] {
                push(d, dtype, causal, Fa3Tiles::for_head_dim(d, causal).expect("d has tiles"));
            }
        }
    }
    for (d, causal) in [(8, true), (40, false), (96, false), (96, true), (160, true), (192, false)]
    {
        push(d, DType::F16, causal, Fa3Tiles::for_head_dim(d, causal).expect("d has tiles"));
    }
    push(224, DType::BF16, true, Fa3Tiles::for_head_dim(224, true).expect("d has tiles"));
    push(96, DType::F16, true, Fa3Tiles::for_problem(96, true, SHORT_KEYS).expect("d has tiles"));
    for &dtype in DTYPES {
        for (d, causal) in [(64, true), (128, true), (128, false)] {
            push(d, dtype, causal, Fa3Tiles::for_problem(d, causal, SHORT_KEYS).expect("tiles"));
        }
    }
    // Score modifiers at the tuned head dims: softcap, ALiBi, and both (FA3's ALU-heavy softmax
    // is where a modifier's arithmetic costs the most), and softcap under a window.
    let softcap = crate::ScoreMod::softcap(30.0).expect("a valid cap");
    let alibi = crate::ScoreMod::alibi(vec![0.5; 8]).expect("valid slopes");
    let both = softcap.clone().then(alibi.clone());
    for d in [64, 128, 256] {
        for causal in [false, true] {
            let t = Fa3Tiles::for_head_dim(d, causal).expect("d has tiles").with_score_mod();
            let schedule = Schedule::for_head_dim(d, false);
            for m in [&softcap, &alibi, &both] {
                let mask = Masking { causal, windowed: false };
                let v = variant(d, DType::F16, mask, (t, schedule), false, false);
                all.push(v.with_score_mod(Some(m)));
            }
        }
        let t = Fa3Tiles::for_head_dim(d, true).expect("d has tiles").with_score_mod();
        let mask = Masking { causal: true, windowed: true };
        let v = variant(d, DType::BF16, mask, (t, Schedule::for_head_dim(d, false)), false, false);
        all.push(v.with_score_mod(Some(&softcap)));
    }
    // Mask modifiers (a document mask and a prefix-LM mask, the built-ins' heaviest composition)
    // at the tuned head dims, alone and under softcap, under a causal window, and at the short
    // problems' tiles (d = 128); with their block masks.
    let masks = crate::MaskMod::document_lengths(&[64, 64])
        .expect("valid documents")
        .or(crate::MaskMod::prefix_lm(16).expect("a valid prefix"));
    for d in [64, 128, 256] {
        for (causal, windowed) in [(false, false), (true, false), (true, true)] {
            let schedule = Schedule::for_head_dim(d, false);
            // The tiles a mask takes (the short problems'), and at d = 128 the long ones too
            // (a configuration may set them).
            let mut tiles = vec![Fa3Tiles::for_problem(d, causal, 1).expect("d has tiles")];
            if d == 128 && !windowed {
                tiles.push(Fa3Tiles::for_head_dim(d, causal).expect("d has tiles"));
            }
            for t in tiles {
                let t = t.with_score_mod();
                let mask = Masking { causal, windowed };
                let v = variant(d, DType::F16, mask, (t, schedule), false, false);
                all.push(v.clone().with_mask_mod(Some(&masks)));
                if !windowed {
                    all.push(v.with_score_mod(Some(&softcap)).with_mask_mod(Some(&masks)));
                }
                all.push(crate::mask_mod::block_mask_variant(&masks, t.br(), t.bc));
            }
        }
    }
    // Packed variable-length batches (O from registers), with the long and the short tiles.
    for d in [64, 128, 256] {
        for causal in [false, true] {
            for t in [Fa3Tiles::for_head_dim(d, causal), Fa3Tiles::for_problem(d, causal, 1)] {
                let t = t.expect("d has tiles");
                let schedule = Schedule::for_head_dim(d, false);
                let mask = Masking { causal, windowed: false };
                all.push(variant(d, DType::F16, mask, (t, schedule), false, true));
            }
        }
    }
    for (pingpong, overlap) in [(true, true), (false, true), (true, false), (false, false)] {
        let schedule = Schedule { pingpong, overlap, ..Schedule::default() };
        if schedule == Schedule::for_head_dim(128, false) {
            continue; // compiled above
        }
        for causal in [false, true] {
            let t = Fa3Tiles::for_head_dim(128, causal).expect("d = 128 has tiles");
            let mask = Masking { causal, windowed: false };
            all.push(variant(128, DType::F16, mask, (t, schedule), false, false));
        }
    }
    // Sliding windows (the band in the parameters), fixed-length and packed.
    for (d, dtype, packed) in [
        (64, DType::F16, false),
        (128, DType::F16, false),
        (128, DType::BF16, false),
        (256, DType::F16, false),
        (128, DType::F16, true),
    ] {
        for causal in [false, true] {
            let t = Fa3Tiles::for_head_dim(d, causal).expect("d has tiles");
            let mask = Masking { causal, windowed: true };
            all.push(variant(d, dtype, mask, (t, Schedule::for_head_dim(d, false)), false, packed));
        }
    }
    // The dynamic tile order (an experiment, Schedule::dynamic), fixed-length and packed.
    for packed in [false, true] {
        let t = Fa3Tiles::for_head_dim(128, true).expect("d = 128 has tiles");
        let mask = Masking { causal: true, windowed: true };
        let s = Schedule { dynamic: true, ..Schedule::for_head_dim(128, false) };
        all.push(variant(128, DType::F16, mask, (t, s), false, packed));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_follow_the_paper_and_fit_shared_memory() {
        let t = Fa3Tiles::for_head_dim(128, false).unwrap();
        assert_eq!((t.br(), t.bc, t.threads()), (128, 176, 384));
        assert_eq!(Fa3Tiles::for_head_dim(64, true).unwrap().br(), 192);
        // The Hopper opt-in limit is 227 KiB per block, for every head dim and short problem.
        for &d in HEAD_DIMS {
            for causal in [false, true] {
                for n_kv in [512, SHORT_KEYS + 1] {
                    let t = Fa3Tiles::for_problem(d, causal, n_kv).unwrap();
                    assert!(
                        t.shared_bytes(d, 2) <= MAX_SHARED_BYTES,
                        "d = {d}: {}",
                        t.shared_bytes(d, 2)
                    );
                }
            }
        }
        // A head dim takes the tiles of its shared rows' width: d = 96 d = 128's, 160 and 192
        // 112 keys, 224 d = 256's; the rows are whole 64-element blocks.
        let tiles = |d| Fa3Tiles::for_head_dim(d, true).unwrap();
        assert_eq!((tiles(96), tiles(8), tiles(224)), (tiles(128), tiles(64), tiles(256)));
        assert_eq!(tiles(160).bc, 112);
        assert_eq!(
            (tile_cols(8), tile_cols(96), tile_cols(136), tile_cols(256)),
            (64, 128, 192, 256)
        );
        // d = 192: Q (128 × 192) and two stages of K and V (112 × 192), 16-bit.
        let t = Fa3Tiles::for_head_dim(192, false).unwrap();
        assert_eq!(t.shared_bytes(192, 2), (128 + 4 * 112) * 384 + 80 + 1024);
        // d = 96 pads its rows to 128 elements: the shared memory of d = 128.
        let t = Fa3Tiles::for_head_dim(96, false).unwrap();
        assert_eq!(t.shared_bytes(96, 2), t.shared_bytes(128, 2));
        // d = 256: Q (128 × 256) and two stages of K and V (80 × 256), 16-bit; no room for O.
        let t = Fa3Tiles::for_head_dim(256, false).unwrap();
        assert_eq!(t.shared_bytes(256, 2), (128 + 4 * 80) * 512 + 80 + 1024);
        assert!(!t.o_in_shared(256, 2) && t.o_in_shared(256, 1));
        // d = 128: 176-key tiles leave no room for O either, 128-key tiles do; d = 64 keeps O in
        // registers.
        assert!(!Fa3Tiles::for_head_dim(128, false).unwrap().o_in_shared(128, 2));
        let t = Fa3Tiles::for_head_dim(64, false).unwrap();
        assert_eq!(t.shared_bytes(64, 2), (192 + 8 * 128) * 128 + 144 + 1024);
        assert!(!t.o_in_shared(64, 2));
        for d in [0, 4, 100, 264] {
            assert!(matches!(
                Fa3Tiles::for_head_dim(d, false),
                Err(KernelError::UnsupportedHeadDim { .. })
            ));
        }
        // Short problems: 128-key tiles at d = 128 (both masks, O through shared memory), 128
        // query rows at d = 64 causal, up to SHORT_KEYS keys; longer ones, and the rest,
        // keep the head dim's tiles.
        let short = |d, causal, n| Fa3Tiles::for_problem(d, causal, n).unwrap();
        assert_eq!(short(128, true, SHORT_KEYS).bc, 128);
        assert_eq!(short(128, false, SHORT_KEYS).bc, 128);
        assert_eq!(short(64, true, SHORT_KEYS).br(), 128);
        assert_eq!(short(64, true, 512).shared_bytes(64, 2), (128 + 8 * 128) * 128 + 144 + 1024);
        let t = short(128, false, 512);
        assert!(t.o_in_shared(128, 2));
        assert_eq!(t.shared_bytes(128, 2), (128 + 4 * 128) * 256 + 80 + 1024 + 128 * 256);
        for d in [64, 128, 256] {
            for causal in [false, true] {
                assert_eq!(
                    short(d, causal, SHORT_KEYS + 1),
                    Fa3Tiles::for_head_dim(d, causal).unwrap()
                );
            }
        }
        // d = 96's short tiles are d = 128's, O through shared memory too.
        assert_eq!(short(96, true, 512), short(128, true, 512));
        assert!(short(96, true, 512).o_in_shared(96, 2));
        assert_eq!(short(64, false, 512), Fa3Tiles::for_head_dim(64, false).unwrap());
        assert_eq!(short(256, true, 512), Fa3Tiles::for_head_dim(256, true).unwrap());
    }

    #[test]
    fn schedules_parse_and_print() {
        assert_eq!("full".parse::<Schedule>().unwrap(), Schedule::default());
        let s: Schedule = "no-pingpong, no-persistent".parse().unwrap();
        assert_eq!(s, Schedule { pingpong: false, persistent: false, ..Schedule::default() });
        assert_eq!(s.label(), "no-pingpong,no-persistent");
        assert_eq!(s.label().parse::<Schedule>().unwrap(), s);
        let experiment: Schedule = "no-overlap,dynamic".parse().unwrap();
        assert!(experiment.dynamic && !experiment.overlap && !Schedule::default().dynamic);
        assert_eq!(experiment.label(), "no-overlap,dynamic");
        // The counter is used under a window without the overlap, and nowhere else.
        let (windowed, plain) =
            (Masking { causal: true, windowed: true }, Masking { causal: true, windowed: false });
        assert!(dynamic_tiles(windowed, experiment) && !dynamic_tiles(plain, experiment));
        assert!(!dynamic_tiles(windowed, Schedule { dynamic: true, ..Schedule::default() }));
        assert!(!dynamic_tiles(windowed, Schedule::for_head_dim(128, false)));
        assert_eq!(Schedule::default().label(), "full");
        assert!(matches!("no-tma".parse::<Schedule>(), Err(KernelError::Config(_))));
    }

    #[test]
    fn tiles_parse_and_reject_bad_specs() {
        let t: Fa3Tiles = "176, 2, 2".parse().unwrap();
        assert_eq!(t, Fa3Tiles { bc: 176, consumers: 2, stages: 2 });
        for bad in ["", "176,2", "170,2,2", "176,4,2", "176,2,1", "0,2,2", "272,2,2", "a,b,c"] {
            assert!(
                matches!(bad.parse::<Fa3Tiles>(), Err(KernelError::Config(_))),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn causal_sections_follow_the_l2_budget_within_their_limits() {
        let problem = |batch, heads_q, heads_kv, n, d| Problem {
            batch,
            heads_q,
            heads_kv,
            n_q: n,
            n_kv: n,
            d,
            dtype: DType::F16,
            scale: 1.0,
            causal: true,
            window: Default::default(),
            score_mod: None,
            sinks: None,
            mask_mod: None,
            strides: Default::default(),
            contiguous: true,
            packed: None,
        };
        let budget = L2_SECTION_BYTES;
        let sections = |p: &Problem, tiles: (usize, usize), bytes| {
            let work = p.n_q.div_ceil(tiles.0) * p.heads_q * p.batch;
            section_heads(p, tiles, work.min(132), bytes, budget)
        };
        // n = 512, d = 128: 256 KB of K and V per head, 48 of 512 heads per section.
        assert_eq!(sections(&problem(32, 16, 16, 512, 128), (128, 128), 2), 48);
        // GQA 4: four q heads share one kv head's K and V, so 192 fit; 178 share the work out
        // more evenly (balance 0.97 against 0.92).
        assert_eq!(sections(&problem(32, 16, 4, 512, 128), (128, 128), 2), 178);
        // Fewer heads than fit: one section.
        assert_eq!(sections(&problem(1, 16, 16, 512, 128), (128, 128), 2), 16);
        // n = 4k: 32 query blocks of 128 rows, 6 heads of 2 MB each.
        assert_eq!(sections(&problem(4, 16, 16, 4096, 128), (128, 176), 2), 6);
        // d = 96: 8 heads of 1.5 MB fit, but share the work out badly (0.62); 6 do not (0.98).
        let d96 = problem(4, 16, 16, 4096, 96);
        assert_eq!(sections(&d96, (128, 176), 2), 6);
        let order = |heads, bc| TileOrder {
            heads,
            q_blocks: 32,
            br: 128,
            bc,
            n_q: 4096,
            n_kv: 4096,
            grid: 132,
        };
        assert!(order(64, 176).balance(8) < 0.65 && order(64, 176).balance(6) > 0.97);
        // d = 192: 4 heads of 3 MB fit; 3 share the work out evenly.
        assert_eq!(sections(&problem(4, 16, 16, 4096, 192), (128, 112), 2), 3);
        // Every block the same work: balance 1.
        assert_eq!(order(132, 176).balance(132), 1.0);
        // More query blocks than MAX_SECTION_QUERY_BLOCKS, or fewer heads fit than
        // MIN_SECTION_HEADS: every head at once.
        assert_eq!(sections(&problem(2, 32, 32, 8192, 64), (192, 128), 2), 64);
        assert_eq!(sections(&problem(1, 16, 16, 16384, 128), (128, 176), 2), 16);
        assert_eq!(sections(&problem(2, 16, 16, 4096, 256), (128, 80), 2), 32);
        // e4m3 operands take half the bytes: twice the heads fit, 89 of them share out best.
        assert_eq!(sections(&problem(32, 16, 16, 512, 128), (128, 128), 1), 89);
    }

    #[test]
    fn params_are_laid_out_as_the_kernel_expects() {
        // Four 128-byte maps (Q, K, V, O), then the pointers at byte 512: o, lse, four scales,
        // the sizes, the window's band, O's strides.
        assert_eq!(std::mem::align_of::<ForwardParams>(), 128);
        assert_eq!(std::mem::offset_of!(ForwardParams, o_map), 384);
        assert_eq!(std::mem::offset_of!(ForwardParams, o), 512);
        assert_eq!(std::mem::offset_of!(ForwardParams, scales), 512 + 16);
        assert_eq!(std::mem::offset_of!(ForwardParams, scale_log2), 512 + 16 + 32 + 20);
        assert_eq!(std::mem::offset_of!(ForwardParams, band), 512 + 16 + 32 + 24);
        assert_eq!(std::mem::offset_of!(ForwardParams, section_heads), 512 + 16 + 32 + 32);
        assert_eq!(std::mem::offset_of!(ForwardParams, o_strides), 512 + 16 + 32 + 40);
    }
}
