//! Rungs 6 and 7 on the GPU: FlashDecoding (Dao, Haziza, Massa, Sizov 2023) and FlashDecoding++
//! (Hong et al. 2024), attention of a few new tokens against a KV cache, with the keys split
//! across thread blocks. [`forward`] runs either, chosen by [`DecodeOptions::strategy`]
//! (automatically by default: [`dispatch`]); [`forward_with_stats`] also says which ran and how
//! many rows FlashDecoding++ handed back to FlashDecoding.
//!
//! Decoding is memory-bound: a step reads the whole cache (K and V) for `n_new` = 1 … 16 new
//! query tokens per sequence. FA2 gives one block to each (query block, head, batch), which at
//! batch 1 is a few dozen blocks on a GPU with 132 SMs, each streaming a whole cache alone. Here
//! the keys of each sequence are split into `splits` chunks handled by separate blocks, and the
//! partial results are combined by their log-sum-exp, as the CPU rung
//! (`ladder_reference::flash_decoding`) does:
//!
//! ```text
//! flash_decoding_split, grid (splits · row_blocks, heads_kv, batch):
//!   phase 1, every block:
//!     (O_s, lse_s) = FA2 over the keys of chunk s        (O_s normalised within the chunk, f32)
//!   phase 2, the last block of each group of splits to finish:
//!     lse = ln Σ_s exp(lse_s),   O = Σ_s exp(lse_s − lse) · O_s     (O in the inputs' dtype)
//! ```
//!
//! One launch per call: the blocks of a group count themselves in on a counter the `Gpu` keeps
//! (zeroed once; the last block puts it back to zero), and the one that finishes last merges the
//! others' partials, which it reads from L2. With one split the block writes `O` and `lse` itself.
//!
//! **GQA packing.** The blocks of a kv head handle every query head of that kv head and every new
//! token: `R = group · n_new` rows, row `r` being query head `kv_head · group + r / n_new`, token
//! `r % n_new`. K and V are read once per block, not once per query head.
//!
//! **Row blocks.** A block holds at most [`ROWS_PER_BLOCK`] = 32 of those rows: each of its warps
//! keeps the output of every row in registers (`d` floats per lane at 32 rows, 128 at d = 128),
//! and two 16-row tiles are what fits beside the rest; at `d = 256` one tile of 16 rows
//! ([`rows_per_block`]) is already 128 floats per lane. More rows per kv head (GQA 8 × 16
//! speculative tokens = 128) are shared by [`row_blocks`]`(R, d)` blocks of 32 consecutive rows
//! (16 at `d = 256`), each reading the
//! chunk's K and V. They sit next to each other in the grid, so they run together and all but the
//! first find the tiles in L2: one HBM read of the cache, `row_blocks`-fold L2 traffic. The
//! alternative, one block with more 16-row tiles whose warps split the rows instead of the keys
//! (FA2's forward layout), reads K and V once from L2 too, but needs a second warp layout in the
//! kernel; at R ≤ 32 (16 at `d = 256`), the shapes of ordinary and speculative decoding with
//! GQA ≤ 8 × 4 tokens, both are the same one block.
//!
//! **Chunks.** Split `s` of sequence `b` owns keys `[s·chunk, min((s+1)·chunk, len_b))` with
//! `chunk = ceil(len_b / splits)` rounded up to a multiple of [`BC`]: chunks follow each
//! sequence's own length, and splits past its end are empty (`lse_s = −∞`, weight 0).
//!
//! **Masking.** The new tokens are the last `n_new` entries of each sequence (already in the
//! cache) and are causal among themselves, bottom-right: token `t` of sequence `b` sees keys
//! `j ≤ lengths[b] − n_new + t`. Keys at or past `lengths[b]` are never read. A row that sees
//! no key (`lengths[b] = 0`, or `lengths[b] < n_new`) gets `O = 0`, `lse = −∞`.
//!
//! **Modifiers.** [`DecodeOptions`] takes a sliding window (its left side: token `t` sees keys
//! `lengths[b] − n_new + t − left ..= lengths[b] − n_new + t`), a score modifier compiled into the
//! kernel ([`ScoreMod`]: softcap, ALiBi, your own; `q_idx` is the new token, `kv_idx` the key, of
//! `n_q = n_new` and `n_kv = lengths[b]`) and attention sinks ([`Sinks`]), as the CPU rung takes
//! them. FlashDecoding runs such a call: the combine takes a sink as one more split (`lse_s = σ`,
//! `O_s = 0`), and a window narrows the keys the splits share out to those some new token sees.
//!
//! **The cache** ([`Cache`]) is contiguous ([`KvCache`]: K and V `[batch, heads_kv, capacity, d]`)
//! or paged ([`PagedKvCache`]: K and V `[num_pages, heads_kv, page_size, d]`, and a [`PageTable`]
//! `[batch, max_pages]` of `i32` page indices, vLLM's `block_tables` / FlashAttention's
//! `block_table`; the page layout is FlashInfer's `HND`). Pages hold 16, 32, 64, 128 or 256 tokens
//! ([`PAGE_SIZES`]): a power of two, as vLLM's block sizes, so that a key's page and slot are a
//! shift and a mask; at least 16, so that the 16 keys a warp reads per tile (one mma k-step)
//! never straddle two pages. With pages of 64 or more a 64-key tile lies in one page; with 16 or
//! 32 the copy of a tile gathers from 4 or 2. The paged kernel is the contiguous one with another
//! address helper (a compile-time switch), so both compute the same bits on the same data.
//!
//! Kernel: `cuda/flash_decoding.cu`; the cache addressing, split chunks and tile copy it shares
//! with FlashDecoding++ are in `cuda/kv_cache.cuh`.
//!
//! # FlashDecoding++
//!
//! The paper's three ideas, carried onto attention (kernels: `cuda/flash_decoding_pp.cu`):
//!
//! 1. **Asynchronous softmax with a unified max.** Every split subtracts the same `φ`
//!    ([`DecodeOptions::phi`]) before `exp`, so no split tracks a running max, nothing is
//!    rescaled, and the combine (in the last split block of each row group to finish, one launch)
//!    is a plain sum: `O = Σ_s acc_s / Σ_s l_s`, `lse = φ + ln Σ_s l_s`
//!    (the CPU rung `ladder_reference::flash_decoding_pp`, with a given `φ`). `φ` is a property
//!    of the model, not of the call: the paper sets it per model from offline statistics of the
//!    softmax inputs, and so should a caller ([`calibrate_phi`] takes a sample of the model's row
//!    maxima and returns the `φ` that sends the fewest of them back, and that fraction; the
//!    default, [`DEFAULT_PHI`] = 0, suits scores within a few units of 0). A row whose largest score `s` has `s − φ` outside the safe window
//!    ([`DecodeOptions::safe_range`], by default `±ln(MAX)/2` of the element type:
//!    [`default_safe_range`], ±5.5 for fp16, ±44 for bf16), or whose sum is infinite or zero, is
//!    flagged by the combine and recomputed by the same block in the same launch: it walks the
//!    whole sequence once more, the row subtracting its own largest score (an exact softmax, as
//!    FlashDecoding's), so the result is always right. The rule is the CPU rung's: rows that see
//!    no key (`O = 0`, `lse = −∞`) and rows with a NaN score (NaN) are not fallbacks.
//!    [`forward_with_stats`] counts the fallback rows (copying one flag per row to the host);
//!    [`forward`] does not wait for them. A call in which no row falls back is one kernel, like
//!    FlashDecoding's; a `φ` that misses every row costs about a FlashDecoding call with one split.
//! 2. **Flat GEMM.** With `R = group · n_new ≤ 16` rows per kv head, FlashDecoding's 16-row mma
//!    tiles are mostly padding. [`Strategy::FlatGemm`] swaps the operands, `Sᵀ = K·Qᵀ` and
//!    `Oᵀ = Vᵀ·Pᵀ`, so that the keys are the mma's M and the rows pad only to n = 8 (two 8-row
//!    tiles per block at most; more rows go to more blocks), with Qᵀ in registers for the whole
//!    walk and K/V streamed through FlashDecoding's cp.async pipeline; `Pᵀ` reaches the second
//!    product through `movmatrix` transposes in registers. [`Strategy::Gemv`] is the CUDA-core
//!    path for one row (multi-head attention, one new token): each warp dots its 16 keys with `q`
//!    two lanes per key, and sums the 16 rows of V weighted by `p_j`.
//! 3. **Heuristic dataflow.** [`dispatch`] picks FlashDecoding, the GEMV or the flat GEMM, and
//!    the split count, from the rows per kv head, the longest sequence, `batch · heads_kv` and
//!    the SM count; its crossovers are the constants [`GEMV_MAX_ROWS`], [`FLAT_GEMM_MAX_ROWS`] and
//!    [`PP_MIN_KEYS`]. Measured on the H200, FlashDecoding++'s kernels never beat FlashDecoding
//!    there (they tie at the bandwidth limit and lose on short calls), so [`PP_IN_AUTO`] keeps
//!    the automatic choice on FlashDecoding; forcing [`Strategy::FlashDecodingPp`] runs them.
//!
//! Both caches work with every strategy (the address helper is shared). All strategies agree
//! within the tolerance rule, not bit for bit: they sum in different orders and FlashDecoding++
//! rounds `2^(s − φ)` to 16 bits where FlashDecoding rounds `2^(s − m)` (the GEMV keeps `P` in
//! `f32`). A call gives the same bits every time, and the same as its strategy forced.
//!
//! **Every head dimension.** The kernels are compiled for the head dimension of the call, any
//! multiple of 8 up to 256 (`cuda/decode.cuh`): the products run over `d` rounded up to the
//! tensor cores' 16-wide k-steps, the shared tiles have rows of `d` rounded up to 64 elements (the
//! swizzle permutes the eight 16-byte chunks of each 64 columns), and the copies fill the padding
//! with zeros without reading memory; only the `d` real columns are read or written. Past
//! `d = 128`: 16 rows per block (FlashDecoding) or 8 (the flat GEMM), and up to 200 KB of shared
//! memory on Hopper at `d > 192` (the Q tile and three K/V stages of 64 keys of 256 columns;
//! 136 KB with the two stages of older GPUs), so one block per SM, where `d ≤ 128` fits two; the
//! split count counts one block per SM for a paged cache too ([`Workload::blocks_per_sm`]). GPUs
//! that allow a block 99 KB (sm_86, sm_89, sm_120) cannot run `d > 128` (104 KB from 136 up):
//! such a call is a [`KernelError::SharedMemory`] ([`head_dim_fits`] says beforehand).
//!
//! **Strides.** Q, O and the cache take any batch, head and token strides with the head dimension
//! contiguous, so a projection's `[batch, n_new, heads, d]`, FlashAttention's `k_cache` and
//! vLLM's NHD pages work without a copy (`Tensor::transpose(1, 2)`). The kernels find each row of
//! Q and O from the strides (`HeadRows` in `cuda/decode.cuh`) and each group of 16 keys from the
//! cache's (`CacheRows` in `cuda/kv_cache.cuh`); K and V share one set of strides, since one
//! offset per group addresses both.

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Output, Strides, grid};
use crate::score_mod::ScoreMod;
use crate::sinks::Sinks;
use crate::tensor::{DType, Tensor};

mod cache;
mod calibrate;
mod dispatch;
mod launch;
mod pp;
mod shape;
#[cfg(test)]
mod tests;

/// FlashDecoding++'s kernel file (`cuda/flash_decoding_pp.cu`), for [`crate::kernel_source`].
pub(crate) const PP_SRC: &str = pp::SRC;

use cache::TableInfo;
pub use cache::{Cache, KvCache, PageTable, PagedKvCache};
pub use calibrate::{Calibration, calibrate_phi};
#[cfg(test)]
pub(crate) use launch::variants;
use launch::{launch, split_shared_bytes};
use shape::{CacheDesc, Desc, Layout, Shape};

pub use dispatch::{
    FLAT_GEMM_MAX_ROWS, GEMV_MAX_ROWS, PAGED_BLOCKS_PER_SM, PAGED_MIN_SPLIT_TILES, PP_IN_AUTO,
    PP_MIN_KEYS, Plan, Strategy, Workload, blocks_per_split, dispatch, plan, split_count,
};
pub use pp::default_safe_range;
use pp::{AtomicSums, PpKernel, PpParams, Window};

pub(crate) const SRC: &str = include_str!("../cuda/flash_decoding.cu");

/// Head dimensions with a FlashDecoding kernel: every multiple of 8 from 8 to 256 (each compiled
/// for itself, padded to the tensor cores' 16-wide k-steps in registers and to 64-element rows in
/// shared memory; the padding is never read from or written to memory).
pub const HEAD_DIMS: &[usize] = &crate::problem::multiples::<32>(8);
/// Element types of the FlashDecoding kernels.
pub const DTYPES: &[DType] = &[DType::F16, DType::BF16];
/// Keys per K/V tile of the split kernel (16 per warp).
pub const BC: usize = 64;
/// Warps per block of the split kernel.
pub const WARPS: usize = 4;
/// The most new tokens per sequence.
pub const MAX_NEW_TOKENS: usize = 16;
/// The most rows (query heads per kv head times new tokens) one block of the split kernel holds
/// at `d` ≤ 128 ([`rows_per_block`]); a kv head with more is shared by several blocks
/// ([`row_blocks`]).
pub const ROWS_PER_BLOCK: usize = 32;
/// Tokens per page a paged cache may have ([`PagedKvCache`]).
pub const PAGE_SIZES: &[usize] = &[16, 32, 64, 128, 256];
/// The most splits a call takes, and the heuristic picks ([`num_splits`]): a limit of the host,
/// not of the kernel. The last block of a group reads every split's partials from L2, 16 splits
/// per round trip, so its work grows with the count (8 round trips at 128), while chunks of a
/// long sequence past 128 splits are a tile or two: more splits only add to the combine.
pub const MAX_SPLITS: usize = 128;
/// Sequences per launch: their lengths travel inside the parameter struct (no host-to-device copy
/// per call); larger batches are launched in chunks of this many.
pub const MAX_BATCH_PER_LAUNCH: usize = 256;
/// The longest sequence: the kernels count keys in 32-bit ints, with a few tiles of headroom past
/// a sequence's end.
pub const MAX_LENGTH: usize = i32::MAX as usize - 1024;
/// K/V tiles in shared memory per block of the split kernel on architecture `arch`: a decoding
/// block does little arithmetic per byte, so it wants many copies in flight. Hopper gets three
/// stages (two copies in flight while one tile is read; up to d = 128 two blocks of ≤ 104 KB fit
/// its 228 KB); older GPUs two, so that two such blocks still fit their 164 KB. (At d = 256 one
/// block takes 200 or 136 KB: one per SM.)
pub fn stages(arch: &str) -> usize {
    if arch.starts_with("sm_90") { 3 } else { 2 }
}
/// The K/V stages the kernels use on `gpu`: [`stages`] of its architecture, or the count its
/// configuration sets ([`Stages`]).
fn stages_on(gpu: &Gpu) -> usize {
    gpu.config().tuned::<Stages>().map_or_else(|| stages(gpu.arch()), |s| s.0)
}

/// K/V stages of the decoding kernels' shared-memory pipeline, instead of [`stages`] (set on a
/// [`crate::GpuConfig`] with `.tune(Stages(n))`; for tuning experiments; a count whose shared
/// memory does not fit the device is an error at the call). The split heuristic still assumes
/// the default's occupancy (two blocks per SM for a paged cache up to d = 128), which four stages
/// or more no longer give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stages(pub usize);

impl crate::Tuning for Stages {}

/// The unified max `φ` of FlashDecoding++ when none is given: 0, in the units of the scores
/// (`scale · q·k`, natural log). Right for scores within a few units of 0 (unit-variance `q` and
/// `k` at the default scale `1/√d` give scores of standard deviation about 1); a model's `φ`
/// should come from statistics of its own scores, as the paper sets it per model.
pub const DEFAULT_PHI: f32 = 0.0;

/// Options of [`forward`].
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeOptions {
    /// Softmax scale, positive, with `scale · log2 e` a normal f32 (another is an error: the
    /// kernels find each row's max on the raw scores, which only a positive scale keeps, and flush
    /// subnormal numbers); `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Number of chunks the keys of each sequence are split into (1 to [`MAX_SPLITS`]); `None` lets
    /// [`plan`] choose from the shape, the kernel and the device ([`default_splits`] for
    /// FlashDecoding).
    pub splits: Option<usize>,
    /// Which kernel runs the call: [`Strategy::Auto`] (the default) lets [`dispatch`] choose; the
    /// others force one (for teaching, tests and measurements).
    pub strategy: Strategy,
    /// FlashDecoding++'s unified max `φ`, in the units of the scores `scale · q·k` (natural log):
    /// the value every split subtracts before `exp`. A property of the model, not of the call:
    /// the paper fixes it per model from offline statistics of the softmax inputs. Default
    /// [`DEFAULT_PHI`]. Ignored by FlashDecoding.
    pub phi: f32,
    /// FlashDecoding++'s safe window `(lo, hi)`: a row whose largest score `s` has `s − φ` outside
    /// `[lo, hi]` is recomputed against its own largest score. `None`: `±ln(MAX)/2` of the
    /// element type ([`default_safe_range`]: ±5.55 for fp16, ±44.4 for bf16); `hi` may be at most
    /// `ln(MAX)`.
    pub safe_range: Option<(f32, f32)>,
    /// A sliding window ([`crate::Window`]; none by default): each new token sees the `left`
    /// keys before its own position and itself, Mistral's and Gemma's local layers with
    /// `Window::left(w − 1)`. Decoding is causal, so the right side is `None` or `Some(0)`. The
    /// splits share out only the keys some new token sees: a window of `w` keys reads about `w`
    /// keys of each sequence, whatever its length.
    pub window: crate::Window,
    /// A function of each scaled score applied before the softmax ([`ScoreMod`]: softcap, ALiBi,
    /// your own CUDA), compiled into the kernel, as in [`crate::fa2`]; its `q_idx` is the new
    /// token (of `n_q = n_new`), its `kv_idx` the key (of `n_kv` = the sequence's length).
    pub score_mod: Option<ScoreMod>,
    /// Attention sinks ([`Sinks`]: one logit per query head in every row's softmax, gpt-oss).
    pub sinks: Option<Sinks>,
    /// How FlashDecoding++ adds its splits' partials up: `false` (the default) in split order,
    /// through a workspace the last block reads, so that a call gives the same bits every time;
    /// `true` as the paper does, each split adding its partials into one sum per row with atomics
    /// as it finishes, the last block reading one row of sums instead of one per split (the order
    /// of the additions, and so the last bits of O, may change from call to call). Ignored by
    /// FlashDecoding, whose combine must first find the largest of the splits' maxima.
    pub atomic_sums: bool,
}

impl DecodeOptions {
    /// These options within a sliding window (see [`DecodeOptions::window`]).
    pub fn with_window(self, window: crate::Window) -> DecodeOptions {
        DecodeOptions { window, ..self }
    }

    /// These options with `score_mod` applied after any modifier they already have.
    pub fn with_score_mod(self, score_mod: ScoreMod) -> DecodeOptions {
        let score_mod = Some(match self.score_mod {
            Some(first) => first.then(score_mod),
            None => score_mod,
        });
        DecodeOptions { score_mod, ..self }
    }

    /// These options with Gemma-2's logit softcap ([`ScoreMod::softcap`]); a cap of 0 is no
    /// softcap, a negative or non-finite one an error.
    pub fn with_softcap(self, cap: f32) -> Result<DecodeOptions> {
        if cap == 0.0 {
            return Ok(self);
        }
        Ok(self.with_score_mod(ScoreMod::softcap(cap)?))
    }

    /// These options with attention sinks.
    pub fn with_sinks(self, sinks: Sinks) -> DecodeOptions {
        DecodeOptions { sinks: Some(sinks), ..self }
    }

    /// Whether the options carry a window, a score modifier or sinks: FlashDecoding runs such a
    /// call (FlashDecoding++'s kernels take none).
    fn modified(&self) -> bool {
        self.window.left.is_some() || self.score_mod.is_some() || self.sinks.is_some()
    }
}

impl Default for DecodeOptions {
    fn default() -> DecodeOptions {
        DecodeOptions {
            scale: None,
            splits: None,
            strategy: Strategy::Auto,
            phi: DEFAULT_PHI,
            safe_range: None,
            window: crate::Window::default(),
            score_mod: None,
            sinks: None,
            atomic_sums: false,
        }
    }
}

/// What [`forward_with_stats`] reports besides the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeStats {
    /// The kernel that ran and its split count.
    pub plan: Plan,
    /// FlashDecoding++: the rows whose scores left `φ`'s safe window and were recomputed, in the
    /// same launch, against their own largest score (as `ladder_reference::RunStats::fallback_rows`
    /// counts them); `None` when FlashDecoding ran.
    pub fallback_rows: Option<usize>,
}

/// Whether `gpu` gives a block enough shared memory for the decoding kernels at head dimension
/// `d` (every `d` in [`HEAD_DIMS`] on sm_80 and sm_90; past `d = 128` a block needs 104 KB or
/// more with two K/V stages, up to 200 KB with Hopper's three, more than the 99 KB of sm_86, sm_89
/// and sm_120).
pub fn head_dim_fits(gpu: &Gpu, d: usize) -> bool {
    let stages = stages_on(gpu);
    let fd = split_shared_bytes(d, rows_per_block(d) / 16, stages);
    let pp = pp::PpKernel::all(d).into_iter().map(|k| pp::shared_bytes(d, k, stages)).max();
    fd.max(pp.unwrap_or(0)) <= gpu.max_shared_memory_per_block()
}

/// The most rows one block of the split kernel holds at head dimension `d`: every warp keeps the
/// output of all of them in registers (`16 · d / 32` floats per lane and 16-row tile), so two
/// 16-row tiles ([`ROWS_PER_BLOCK`] = 32) up to `d` = 128, one (16 rows) at `d` = 256.
pub fn rows_per_block(d: usize) -> usize {
    if d > 128 { 16 } else { ROWS_PER_BLOCK }
}

/// Blocks of the split kernel per (split, kv head, sequence) for `rows_per_kv_head` rows (query
/// heads per kv head times new tokens) at head dimension `d`: one up to [`rows_per_block`]`(d)`,
/// then one per that many rows.
pub fn row_blocks(rows_per_kv_head: usize, d: usize) -> usize {
    rows_per_kv_head.div_ceil(16 * m_tiles(rows_per_kv_head, d)).max(1)
}

/// 16-row mma tiles of a block's Q tile: one for up to 16 rows, else as many as
/// [`rows_per_block`] allows.
fn m_tiles(rows_per_kv_head: usize, d: usize) -> usize {
    if rows_per_kv_head <= 16 { 1 } else { rows_per_block(d) / 16 }
}

/// The split count [`forward`] uses when [`DecodeOptions::splits`] is `None` for FlashDecoding:
/// [`split_count`] with `batch · heads_kv · row_blocks` blocks per split, the longest
/// sequence's key tiles and the blocks per SM the cache wants ([`Workload::blocks_per_sm`]).
pub fn default_splits(work: &Workload, sm_count: usize) -> usize {
    dispatch::splits_for(Strategy::FlashDecoding, work, sm_count)
}

/// How many splits fill the device: FlashAttention's `num_splits_heuristic` (wave efficiency).
///
/// `batch_heads_kv` blocks per split (one per kv head and sequence, times [`row_blocks`]),
/// `key_blocks` tiles of [`BC`] keys in the longest sequence. With enough blocks already (at least
/// 80 % of a wave) it is 1. `slots` blocks make a wave: the SM count, or twice it where a paged
/// cache needs two blocks per SM to keep the memory busy and two fit (d ≤ 128:
/// [`Workload::blocks_per_sm`], [`split_count`]). Otherwise, for `s`
/// in `1 ..= min(max_splits, key_blocks, 128)`, the last wave of `batch_heads_kv · s` blocks is
/// `efficiency(s) = n / ceil(n)` full (`n = batch_heads_kv · s / slots` waves); the answer is
/// the smallest `s` within [`SPLIT_EFFICIENCY`] of the best efficiency. As in FlashAttention, an
/// `s` that gives each split as many key blocks as `s − 1` does is skipped (it is `s − 1` splits
/// with an empty one).
pub fn num_splits(
    batch_heads_kv: usize,
    key_blocks: usize,
    slots: usize,
    max_splits: usize,
) -> usize {
    if slots == 0 || batch_heads_kv as f64 >= 0.8 * slots as f64 {
        return 1;
    }
    let max_splits = max_splits.min(key_blocks).min(MAX_SPLITS);
    let eligible = |s: usize| s == 1 || key_blocks.div_ceil(s) != key_blocks.div_ceil(s - 1);
    let efficiency = |s: usize| {
        let waves = (batch_heads_kv * s) as f64 / slots as f64;
        waves / waves.ceil()
    };
    let best = (1..=max_splits).filter(|&s| eligible(s)).map(efficiency).fold(0.0, f64::max);
    (1..=max_splits).find(|&s| eligible(s) && efficiency(s) >= SPLIT_EFFICIENCY * best).unwrap_or(1)
}

/// How close to the best wave efficiency [`num_splits`] must come. FlashAttention takes 85 %,
/// which favours fewer splits (a cheaper combine); with the combine in the split kernel's last
/// block, a fuller wave pays more on the H200: at batch 1, 32/8 heads, 8k keys, 15 splits (91 % of
/// a wave) read 2.00 TB/s and 16 (97 %) 2.36 (docs/perf-notes.md, FlashDecoding v3).
pub const SPLIT_EFFICIENCY: f64 = 0.95;

/// Attention of `q`'s new tokens against the cache: `softmax(scale · Q Kᵀ + mask) V` and its
/// log-sum-exp, for each sequence over its first `lengths[b]` keys, causal among the new tokens
/// (see the module docs). The cache is a [`KvCache`], a [`PagedKvCache`] or a [`Cache`] (or a
/// reference to one).
///
/// `q` is `[batch, heads_q, n_new, d]` with `n_new` in `1 ..= 16`, fp16 or bf16, `d` any multiple
/// of 8 from 8 to 256 ([`HEAD_DIMS`]), `heads_q` a multiple of `heads_kv` (any group: past
/// [`rows_per_block`]`(d)` rows per kv head the rows are shared by several blocks), any batch,
/// head and token strides with the head dimension contiguous (a projection's `[batch, n_new,
/// heads_q, d]` through `Tensor::transpose(1, 2)`); the cache's strides are its own (see
/// [`KvCache`] and [`PagedKvCache`]). Returns `O` (`[batch, heads_q, n_new, d]`, `q`'s dtype, its
/// axes in memory in `q`'s order) and `lse` `[batch, heads_q, n_new]` (`f32`, natural log).
///
/// The kernels are FlashDecoding's or FlashDecoding++'s, as [`DecodeOptions::strategy`] says
/// ([`Strategy::Auto`]: [`dispatch`] picks); see the module docs. Errors: shapes, element types,
/// lengths, the page table, a split count outside `1..=`[`MAX_SPLITS`], a `φ` that is not finite or a
/// bad safe window.
///
/// ```no_run
/// use ladder_kernels::{DType, Gpu, decode};
///
/// let gpu = Gpu::new()?;
/// let (b, hq, hkv, cap, d) = (2, 32, 8, 4096, 128);
/// let q = gpu.zeros(&[b, hq, 1, d], DType::BF16)?;
/// let k = gpu.zeros(&[b, hkv, cap, d], DType::BF16)?;
/// let v = gpu.zeros(&[b, hkv, cap, d], DType::BF16)?;
/// let cache = decode::KvCache { k: &k, v: &v, lengths: &[1000, 4096] };
/// let out = decode::forward(&gpu, &q, cache, &decode::DecodeOptions::default())?;
///
/// // The same lengths in pages of 64 tokens: sequence 0 (16 pages) in pages 15, 14, …, 0,
/// // sequence 1 (64 pages) in pages 16 … 79; entries past a sequence's pages are never read.
/// let (num_pages, page, max_pages) = (80, 64, 64);
/// let k_pages = gpu.zeros(&[num_pages, hkv, page, d], DType::BF16)?;
/// let v_pages = gpu.zeros(&[num_pages, hkv, page, d], DType::BF16)?;
/// let mut table = vec![-1i32; b * max_pages];
/// for i in 0..16 {
///     table[i] = 15 - i as i32;
/// }
/// for i in 0..64 {
///     table[max_pages + i] = 16 + i as i32;
/// }
/// let page_table = decode::PageTable::upload(&gpu, &table, b, max_pages)?;
/// let paged = decode::PagedKvCache {
///     k_pages: &k_pages,
///     v_pages: &v_pages,
///     page_table: &page_table,
///     lengths: &[1000, 4096],
/// };
/// let out = decode::forward(&gpu, &q, paged, &decode::DecodeOptions::default())?;
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
pub fn forward<'a>(
    gpu: &Gpu,
    q: &Tensor,
    cache: impl Into<Cache<'a>>,
    opts: &DecodeOptions,
) -> Result<Output> {
    let cache = cache.into();
    let call = check_call(gpu, q, &cache, opts)?;
    let mut out = call.new_output(gpu, q)?;
    launch(gpu, q, cache, &call, &mut out, false)?;
    Ok(out)
}

/// [`forward`] into `O` and `lse` tensors the caller owns, as a serving loop keeps them from one
/// decoding step to the next: `out.o` `[batch, heads_q, n_new, d]` in `q`'s dtype (any strides
/// with the head dimension contiguous) and `out.lse` `[batch, heads_q, n_new]` in `f32`
/// (contiguous), made on this `Gpu`'s stream; every element is overwritten.
/// It saves the two allocations and frees of a [`forward`] call, a few microseconds of host time
/// against a step of ~10 µs at batch 1.
///
/// ```no_run
/// use ladder_kernels::{DType, Gpu, Output, decode};
///
/// let gpu = Gpu::new()?;
/// let q = gpu.zeros(&[1, 32, 1, 128], DType::F16)?;
/// let k = gpu.zeros(&[1, 8, 8192, 128], DType::F16)?;
/// let v = gpu.zeros(&[1, 8, 8192, 128], DType::F16)?;
/// let mut out = Output {
///     o: gpu.zeros(&[1, 32, 1, 128], DType::F16)?,
///     lse: gpu.zeros(&[1, 32, 1], DType::F32)?,
/// };
/// for step in 1..=8 {
///     let cache = decode::KvCache { k: &k, v: &v, lengths: &[8184 + step] };
///     decode::forward_into(&gpu, &q, cache, &Default::default(), &mut out)?;
/// }
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
pub fn forward_into<'a>(
    gpu: &Gpu,
    q: &Tensor,
    cache: impl Into<Cache<'a>>,
    opts: &DecodeOptions,
    out: &mut Output,
) -> Result<()> {
    let cache = cache.into();
    let call = check_call(gpu, q, &cache, opts)?;
    launch(gpu, q, cache, &call, out, false).map(|_| ())
}

/// [`forward`], and what it did: the kernel and split count that ran, and for FlashDecoding++ the
/// number of rows that fell back (recomputed against their own largest score).
///
/// Counting the fallback rows copies one flag per output row back to the host, so this call
/// waits for the GPU to finish it; [`forward`] does not wait.
///
/// ```no_run
/// use ladder_kernels::{DType, Gpu, decode};
/// use ladder_kernels::decode::{DecodeOptions, Strategy};
///
/// let gpu = Gpu::new()?;
/// let q = gpu.zeros(&[1, 8, 1, 128], DType::F16)?;
/// let k = gpu.zeros(&[1, 8, 4096, 128], DType::F16)?;
/// let v = gpu.zeros(&[1, 8, 4096, 128], DType::F16)?;
/// let cache = decode::KvCache { k: &k, v: &v, lengths: &[4096] };
/// // FlashDecoding++ with the model's unified max (here 2.0) and the default safe window.
/// let opts = DecodeOptions { strategy: Strategy::FlashDecodingPp, phi: 2.0, ..Default::default() };
/// let (out, stats) = decode::forward_with_stats(&gpu, &q, cache, &opts)?;
/// assert_eq!(stats.plan.strategy, Strategy::Gemv); // one row per kv head
/// println!("{:?} rows fell back", stats.fallback_rows);
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
pub fn forward_with_stats<'a>(
    gpu: &Gpu,
    q: &Tensor,
    cache: impl Into<Cache<'a>>,
    opts: &DecodeOptions,
) -> Result<(Output, DecodeStats)> {
    let cache = cache.into();
    let call = check_call(gpu, q, &cache, opts)?;
    let mut out = call.new_output(gpu, q)?;
    let fallback_rows = launch(gpu, q, cache, &call, &mut out, true)?;
    Ok((out, DecodeStats { plan: call.plan, fallback_rows }))
}

/// [`forward`] with the new tokens of every sequence packed into one tensor, as a serving engine
/// batches sequences that decode different numbers of tokens (speculative decoding with a
/// different number of drafts per sequence, a prompt's last chunk beside single tokens):
/// `q` is `[total_new, heads_q, d]`, sequence `b`'s `new_tokens[b]` tokens (0 to 16) being its
/// rows `new_tokens[..b].sum() …` in order, any strides with the head dimension contiguous.
/// They are the last `new_tokens[b]` entries of its cache and causal among themselves, as in
/// [`forward`]; a sequence with no new token is in the batch and computes nothing. Returns `O`
/// `[total_new, heads_q, d]` (laid out like `q`) and `lse` `[heads_q, total_new]` (the packed
/// layout of [`crate::varlen`]).
///
/// The kernels are [`forward`]'s: each sequence's blocks take its own number of rows (the grid
/// has the row blocks of the sequence with the most, and blocks past a sequence's rows leave at
/// once), so a call gives every sequence the bits [`forward`] gives it alone with the same split
/// count and strategy (the automatic choice sees the whole batch: its rows per kv head are the
/// longest sequence's).
///
/// ```no_run
/// use ladder_kernels::{DType, Gpu, decode};
///
/// let gpu = Gpu::new()?;
/// let (hq, hkv, cap, d) = (32, 8, 4096, 128);
/// // Three sequences decoding 1, 4 (speculative) and 1 tokens: 6 rows of Q.
/// let new_tokens = [1, 4, 1];
/// let q = gpu.zeros(&[6, hq, d], DType::F16)?;
/// let k = gpu.zeros(&[3, hkv, cap, d], DType::F16)?;
/// let v = gpu.zeros(&[3, hkv, cap, d], DType::F16)?;
/// let cache = decode::KvCache { k: &k, v: &v, lengths: &[1000, 4096, 17] };
/// let out = decode::forward_varlen(&gpu, &q, &new_tokens, cache, &Default::default())?;
/// assert_eq!((out.o.shape(), out.lse.shape()), (&[6, hq, d][..], &[hq, 6][..]));
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
pub fn forward_varlen<'a>(
    gpu: &Gpu,
    q: &Tensor,
    new_tokens: &[usize],
    cache: impl Into<Cache<'a>>,
    opts: &DecodeOptions,
) -> Result<Output> {
    let cache = cache.into();
    let call = check_any(gpu, q, Some(new_tokens), &cache, opts)?;
    let mut out = call.new_output(gpu, q)?;
    launch(gpu, q, cache, &call, &mut out, false)?;
    Ok(out)
}

/// [`forward_varlen`] into `O` (`[total_new, heads_q, d]`, any strides with the head dimension
/// contiguous) and `lse` (`[heads_q, total_new]`, contiguous) tensors the caller owns.
pub fn forward_varlen_into<'a>(
    gpu: &Gpu,
    q: &Tensor,
    new_tokens: &[usize],
    cache: impl Into<Cache<'a>>,
    opts: &DecodeOptions,
    out: &mut Output,
) -> Result<()> {
    let cache = cache.into();
    let call = check_any(gpu, q, Some(new_tokens), &cache, opts)?;
    launch(gpu, q, cache, &call, out, false).map(|_| ())
}

/// A call that passed its checks: its shapes, strides, modifiers and plan (kernel and split
/// count).
struct Call {
    shape: Shape,
    /// The score modifier and the sinks (FlashDecoding only).
    score_mod: Option<ScoreMod>,
    sinks: Option<Sinks>,
    plan: Plan,
    /// K/V stages of the kernels' pipeline on this `Gpu` (2 to 16).
    stages: usize,
    /// Where Q's rows lie (batch, head, token).
    q_strides: Strides,
    /// Where the cache's rows lie (batch or page, kv head, key), K's and V's alike.
    kv_strides: Strides,
    /// Packed new tokens ([`forward_varlen`]): each sequence's first row of Q, and one past the
    /// last (`batch + 1` entries).
    new_starts: Option<Vec<usize>>,
    /// FlashDecoding++ adds its splits' partials with atomics ([`DecodeOptions::atomic_sums`]).
    atomic_sums: bool,
}

/// A call's checks, before anything is allocated or launched: the inputs on this `Gpu`'s stream,
/// the shapes and options, and the plan.
fn check_call(gpu: &Gpu, q: &Tensor, cache: &Cache<'_>, opts: &DecodeOptions) -> Result<Call> {
    check_any(gpu, q, None, cache, opts)
}

/// [`check_call`] for either form of Q: `[batch, heads_q, n_new, d]`, or packed new tokens
/// `[total_new, heads_q, d]` with `new_tokens[b]` rows for sequence `b`, which the shape checks
/// see as `[batch, heads_q, max new_tokens, d]`.
fn check_any(
    gpu: &Gpu,
    q: &Tensor,
    new_tokens: Option<&[usize]>,
    cache: &Cache<'_>,
    opts: &DecodeOptions,
) -> Result<Call> {
    let (k, v, table) = cache.buffers();
    let (k_name, v_name) = if table.is_some() { ("k_pages", "v_pages") } else { ("k", "v") };
    for (name, t) in [("q", q), (k_name, k), (v_name, v)] {
        gpu.check_context(t, name)?;
    }
    if let Some(table) = table {
        gpu.check_stream(table.stream(), "page_table")?;
    }
    let stages = stages_on(gpu);
    if !(2..=16).contains(&stages) {
        return Err(KernelError::Config(format!(
            "flash_decoding: {stages} K/V stages; expected 2 to 16"
        )));
    }
    let (shape, q_strides, new_starts) = match new_tokens {
        None => {
            (Shape::check(Desc::of(q), &CacheDesc::of(cache), opts)?, Strides::of(q, "q")?, None)
        }
        Some(new_tokens) => {
            let [total, heads_q, d] =
                crate::problem::dims(q.shape(), "q must be [total_new, heads_q, head_dim]")?;
            let mut starts: Vec<usize> = Vec::with_capacity(new_tokens.len() + 1);
            starts.push(0);
            for &n in new_tokens {
                starts.push(starts.last().copied().unwrap_or(0).saturating_add(n));
            }
            if starts.last() != Some(&total) {
                return Err(KernelError::Shape(format!(
                    "q has {total} rows but new_tokens {new_tokens:?} add up to {}",
                    starts.last().copied().unwrap_or(0)
                )));
            }
            // The shape checks see the tokens as [batch, heads_q, the most of any sequence, d].
            let most = new_tokens.iter().copied().max().unwrap_or(0);
            let seen = [new_tokens.len(), heads_q, most, d];
            let mut shape =
                Shape::check(Desc { shape: &seen, dtype: q.dtype() }, &CacheDesc::of(cache), opts)?;
            if total > i32::MAX as usize {
                return Err(KernelError::Shape(format!("q {:?} too large", q.shape())));
            }
            shape.total_new = Some(total);
            (shape, Strides::of_packed(q, "q")?, Some(starts))
        }
    };
    // Any strides with the head dimension contiguous; K and V are addressed with one offset per
    // group of keys (kv_cache.cuh), so theirs must agree.
    let kv_strides = Strides::of(k, k_name)?;
    if Strides::of(v, v_name)? != kv_strides {
        return Err(KernelError::Shape(format!(
            "{k_name} has strides {:?} and {v_name} {:?}: the decoding kernels take K and V laid \
             out alike",
            k.strides(),
            v.strides()
        )));
    }
    // The keys a call reads: under a window, those the window reaches.
    let longest = cache.lengths().iter().copied().max().unwrap_or(0);
    let work = Workload {
        rows_per_kv_head: shape.rows_per_kv_head(),
        max_len: shape.window_left.map_or(longest, |left| longest.min(left + shape.n_new)),
        batch_heads_kv: shape.batch * shape.heads_kv,
        head_dim: shape.d,
        paged: table.is_some(),
    };
    // A window, a score modifier or sinks: FlashDecoding's kernel, the one that takes them.
    let strategy = match opts.strategy {
        Strategy::Auto if opts.modified() => Strategy::FlashDecoding,
        Strategy::Auto | Strategy::FlashDecoding => opts.strategy,
        forced if opts.modified() => {
            return Err(KernelError::Config(format!(
                "flash_decoding: {forced:?} takes no window, score modifier or sinks; \
                 FlashDecoding (Strategy::FlashDecoding, or Auto) does"
            )));
        }
        forced => forced,
    };
    let plan = plan(strategy, opts.splits, &work, gpu.sm_count() as usize)?;
    let (score_mod, sinks) = (opts.score_mod.clone(), opts.sinks.clone());
    let atomic_sums = opts.atomic_sums;
    Ok(Call {
        shape,
        score_mod,
        sinks,
        plan,
        stages,
        q_strides,
        kv_strides,
        new_starts,
        atomic_sums,
    })
}

impl Call {
    /// `O` and `lse` for the call, uninitialised (NaN when outputs are poisoned), `O` laid out
    /// like `q` (its axes in memory in q's order).
    fn new_output(&self, gpu: &Gpu, q: &Tensor) -> Result<Output> {
        let o = gpu.output_like(q, self.shape.dtype)?;
        Ok(Output { o, lse: gpu.output(&self.shape.lse_shape(), DType::F32)? })
    }
}
