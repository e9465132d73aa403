//! Rungs 5 and 6 on the GPU: FlashDecoding (Dao, Haziza, Massa, Sizov 2023) and FlashDecoding++
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
//!    rescaled, and the combine is a plain sum: `O = Σ_s acc_s / Σ_s l_s`, `lse = φ + ln Σ_s l_s`
//!    (the CPU rung `ladder_reference::flash_decoding_pp`, with a given `φ`). `φ` is a property
//!    of the model, not of the call: the paper sets it per model from offline statistics of the
//!    softmax inputs, and so should a caller (the default, [`DEFAULT_PHI`] = 0, suits scores within
//!    a few units of 0). A row whose largest score `s` has `s − φ` outside the safe window
//!    ([`DecodeOptions::safe_range`], by default `±ln(MAX)/2` of the element type:
//!    [`default_safe_range`], ±5.5 for fp16, ±44 for bf16), or whose sum is infinite or zero, is
//!    flagged by the combine and recomputed by FlashDecoding's kernels, which then run only the
//!    blocks holding a flagged row (the others exit at once) and write only the flagged rows:
//!    the result is always right, and such a row is FlashDecoding's, bit for bit. The rule is the
//!    CPU rung's: rows that see no key (`O = 0`, `lse = −∞`) and rows with a NaN score (NaN) are
//!    not fallbacks. [`forward_with_stats`] counts the fallback rows (copying one flag per row to
//!    the host); [`forward`] does not wait for them. The check costs a launch per call even when
//!    no row falls back.
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
//! **Head dimension 256.** The same kernels with `d = 256`: 16 rows per block (FlashDecoding) or 8
//! (the flat GEMM), and 200 KB of shared memory on Hopper (the Q tile and three K/V stages of 64
//! keys; 136 KB with the two stages of older GPUs), so one block per SM, where `d ≤ 128` fits two;
//! the split count counts one block per SM for a paged cache too ([`Workload::blocks_per_sm`]).
//! GPUs that allow a block 99 KB (sm_86, sm_89, sm_120) cannot run it: such a call is a
//! [`KernelError::SharedMemory`] ([`head_dim_fits`] says beforehand).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Output, grid};
use crate::tensor::{DType, Tensor};

mod dispatch;
mod pp;

pub use dispatch::{
    FLAT_GEMM_MAX_ROWS, GEMV_MAX_ROWS, PAGED_BLOCKS_PER_SM, PAGED_MIN_SPLIT_TILES, PP_IN_AUTO,
    PP_MIN_KEYS, Plan, Strategy, Workload, blocks_per_split, dispatch, plan, split_count,
};
pub use pp::default_safe_range;
use pp::{PpKernel, PpParams, Window};

const SRC: &str = include_str!("../cuda/flash_decoding.cu");

/// Head dimensions with a FlashDecoding kernel.
pub const HEAD_DIMS: &[usize] = &[64, 128, 256];
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

/// Output rows per block of FlashDecoding++'s combine kernel (one warp each).
const COMBINE_ROWS_PER_BLOCK: usize = 4;

/// A contiguous KV cache: K and V `[batch, heads_kv, capacity, d]`, and the number of valid
/// tokens per sequence (the new tokens included: they are the last `n_new` valid entries).
#[derive(Clone, Copy, Debug)]
pub struct KvCache<'a> {
    /// Keys, `[batch, heads_kv, capacity, d]`.
    pub k: &'a Tensor,
    /// Values, `[batch, heads_kv, capacity, d]`.
    pub v: &'a Tensor,
    /// Valid entries of each sequence, each at most `capacity` (0 allowed).
    pub lengths: &'a [usize],
}

/// A paged KV cache: K and V in pages of `page_size` tokens, `[num_pages, heads_kv, page_size,
/// d]` (FlashInfer's `HND` layout: each page holds every kv head, each head's tokens
/// contiguous), and a [`PageTable`] whose row `b` lists the pages of sequence `b` in order: key
/// `j` of sequence `b` is slot `j % page_size` of page `page_table[b][j / page_size]`.
///
/// `page_size` is `k_pages.shape()[2]`, one of [`PAGE_SIZES`]. Sequence `b` reads the first
/// `ceil(lengths[b] / page_size)` entries of its row; entries past those are never read (pad
/// them with anything, e.g. −1). Sequences may share pages (a common prefix).
#[derive(Clone, Copy, Debug)]
pub struct PagedKvCache<'a> {
    /// Keys, `[num_pages, heads_kv, page_size, d]`.
    pub k_pages: &'a Tensor,
    /// Values, `[num_pages, heads_kv, page_size, d]`.
    pub v_pages: &'a Tensor,
    /// The pages of each sequence, `[batch, max_pages]`.
    pub page_table: &'a PageTable,
    /// Valid entries of each sequence (the new tokens included), each at most
    /// `max_pages · page_size` (0 allowed).
    pub lengths: &'a [usize],
}

/// The KV cache of a decoding call, contiguous or paged. [`forward`] takes either (or a reference
/// to either) through `Into<Cache>`.
#[derive(Clone, Copy, Debug)]
pub enum Cache<'a> {
    /// One buffer per sequence and kv head.
    Contiguous(KvCache<'a>),
    /// Pages and a page table.
    Paged(PagedKvCache<'a>),
}

impl<'a> Cache<'a> {
    /// Valid entries of each sequence.
    pub fn lengths(&self) -> &[usize] {
        match self {
            Cache::Contiguous(c) => c.lengths,
            Cache::Paged(c) => c.lengths,
        }
    }

    /// K, V, and the page table of a paged cache.
    fn buffers(&self) -> (&'a Tensor, &'a Tensor, Option<&'a PageTable>) {
        match *self {
            Cache::Contiguous(c) => (c.k, c.v, None),
            Cache::Paged(c) => (c.k_pages, c.v_pages, Some(c.page_table)),
        }
    }
}

impl<'a> From<KvCache<'a>> for Cache<'a> {
    fn from(cache: KvCache<'a>) -> Cache<'a> {
        Cache::Contiguous(cache)
    }
}

impl<'a> From<&KvCache<'a>> for Cache<'a> {
    fn from(cache: &KvCache<'a>) -> Cache<'a> {
        Cache::Contiguous(*cache)
    }
}

impl<'a> From<PagedKvCache<'a>> for Cache<'a> {
    fn from(cache: PagedKvCache<'a>) -> Cache<'a> {
        Cache::Paged(cache)
    }
}

impl<'a> From<&PagedKvCache<'a>> for Cache<'a> {
    fn from(cache: &PagedKvCache<'a>) -> Cache<'a> {
        Cache::Paged(*cache)
    }
}

/// The page table of a paged cache on the device: `[batch, max_pages]` page indices, `i32`, row
/// by row (vLLM's `block_tables`, FlashAttention's `block_table`).
///
/// A table made by [`PageTable::upload`] keeps a host copy of its entries, so that every call
/// checks the entries it will read: an entry that is not a page of the cache is a
/// [`KernelError::PageTable`]. A table that already lives on the device
/// ([`PageTable::from_cuda_slice`], no copy) cannot be checked without copying it back, so it is
/// not: the kernel still never follows an entry outside the cache, and instead makes every output
/// row of that sequence NaN (never an out-of-bounds read, never a plausible wrong number).
/// [`PageTable::with_host_copy`] copies it back once to get the checks.
#[derive(Debug)]
pub struct PageTable {
    table: CudaSlice<i32>,
    info: TableInfo,
}

impl PageTable {
    /// Upload `entries` (`[batch, max_pages]`, row-major) and keep a host copy for the checks.
    pub fn upload(gpu: &Gpu, entries: &[i32], batch: usize, max_pages: usize) -> Result<PageTable> {
        let mut info = TableInfo::new(batch, max_pages)?;
        info.host = Some(HostEntries::new(entries, batch, max_pages)?);
        let table = gpu
            .stream()
            .clone_htod(entries)
            .map_err(KernelError::alloc(std::mem::size_of_val(entries)))?;
        Ok(PageTable { table, info })
    }

    /// Wrap a table already on the device (no copy): `batch · max_pages` entries. Its entries are
    /// not checked on the host (see the type's docs); [`PageTable::with_host_copy`] adds the
    /// checks.
    pub fn from_cuda_slice(
        table: CudaSlice<i32>,
        batch: usize,
        max_pages: usize,
    ) -> Result<PageTable> {
        let info = TableInfo::new(batch, max_pages)?;
        if table.len() != batch * max_pages {
            return Err(KernelError::Shape(format!(
                "a page table of {} entries cannot be [{batch}, {max_pages}]",
                table.len()
            )));
        }
        Ok(PageTable { table, info })
    }

    /// Copy the entries to the host (once; it waits for the work queued on the table's stream), so
    /// that every call checks them as for a table made by [`PageTable::upload`].
    pub fn with_host_copy(mut self) -> Result<PageTable> {
        let entries = self
            .table
            .stream()
            .clone_dtoh(&self.table)
            .map_err(KernelError::driver("copying a page table to the host"))?;
        self.info.host = Some(HostEntries::new(&entries, self.info.batch, self.info.max_pages)?);
        Ok(self)
    }

    /// Whether the entries are checked on the host at every call.
    pub fn has_host_copy(&self) -> bool {
        self.info.host.is_some()
    }

    /// `[batch, max_pages]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.info.batch, self.info.max_pages]
    }

    /// The device buffer, borrowed.
    pub fn as_cuda_slice(&self) -> &CudaSlice<i32> {
        &self.table
    }

    /// Hand the device buffer back (no copy).
    pub fn into_cuda_slice(self) -> CudaSlice<i32> {
        self.table
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.table.stream()
    }
}

/// What the checks know of a page table: its shape, and its entries if they were seen on the host.
#[derive(Clone, Debug, PartialEq)]
struct TableInfo {
    batch: usize,
    max_pages: usize,
    host: Option<HostEntries>,
}

impl TableInfo {
    fn new(batch: usize, max_pages: usize) -> Result<TableInfo> {
        if batch == 0 || max_pages == 0 {
            return Err(KernelError::Shape(format!(
                "a page table [{batch}, {max_pages}] needs at least one row and one column"
            )));
        }
        // The kernel indexes a row's entries with 32-bit ints.
        if max_pages > i32::MAX as usize || batch.checked_mul(max_pages).is_none() {
            return Err(KernelError::Shape(format!(
                "a page table [{batch}, {max_pages}] is too large"
            )));
        }
        Ok(TableInfo { batch, max_pages, host: None })
    }

    /// Checks that sequence `b` of length `lengths[b]` finds its `ceil(len / page_size)` pages in
    /// its row, and, when the entries are known, that each of them is a page of the cache
    /// (`0 ≤ entry < num_pages`).
    fn check(&self, lengths: &[usize], page_size: usize, num_pages: usize) -> Result<()> {
        if lengths.len() != self.batch {
            return Err(KernelError::Shape(format!(
                "{} lengths given for a page table of {} rows",
                lengths.len(),
                self.batch
            )));
        }
        for (b, &len) in lengths.iter().enumerate() {
            let needed = len.div_ceil(page_size);
            if needed > self.max_pages {
                return Err(KernelError::PageTable(format!(
                    "lengths[{b}] = {len} needs {needed} pages of {page_size} tokens, but the \
                     table has {} per sequence",
                    self.max_pages
                )));
            }
            if let (Some(host), true) = (&self.host, needed > 0) {
                host.check_row(b, needed, num_pages)?;
            }
        }
        Ok(())
    }
}

/// A host copy of a page table's entries, and for each entry the largest entry of its row up to
/// it (negative entries counting as larger than any page), so that checking the first `n` entries
/// of a row against the cache's page count is one comparison.
#[derive(Clone, Debug, PartialEq)]
struct HostEntries {
    entries: Vec<i32>,
    prefix_max: Vec<i32>,
    max_pages: usize,
}

impl HostEntries {
    fn new(entries: &[i32], batch: usize, max_pages: usize) -> Result<HostEntries> {
        if entries.len() != batch * max_pages {
            return Err(KernelError::Shape(format!(
                "{} page-table entries given for [{batch}, {max_pages}]",
                entries.len()
            )));
        }
        let mut prefix_max = Vec::with_capacity(entries.len());
        for row in entries.chunks(max_pages) {
            let mut running = i32::MIN;
            for &e in row {
                running = running.max(if e < 0 { i32::MAX } else { e });
                prefix_max.push(running);
            }
        }
        Ok(HostEntries { entries: entries.to_vec(), prefix_max, max_pages })
    }

    /// Whether the first `needed` (≥ 1) entries of row `b` are pages of a cache of `num_pages`.
    fn check_row(&self, b: usize, needed: usize, num_pages: usize) -> Result<()> {
        let row = b * self.max_pages;
        // num_pages ≤ i32::MAX (checked with the cache's shape), and a negative entry counts as
        // i32::MAX, so it fails too.
        if (self.prefix_max[row + needed - 1] as usize) < num_pages {
            return Ok(());
        }
        let (i, page) = self.entries[row..row + needed]
            .iter()
            .enumerate()
            .find(|&(_, &e)| e < 0 || e as usize >= num_pages)
            .map(|(i, &e)| (i, e))
            .unwrap_or((needed - 1, self.prefix_max[row + needed - 1]));
        Err(KernelError::PageTable(format!(
            "page_table[{b}][{i}] = {page} is not a page of the cache (0 ≤ page < {num_pages}); \
             sequence {b} reads its first {needed} entries"
        )))
    }
}

/// The unified max `φ` of FlashDecoding++ when none is given: 0, in the units of the scores
/// (`scale · q·k`, natural log). Right for scores within a few units of 0 (unit-variance `q` and
/// `k` at the default scale `1/√d` give scores of standard deviation about 1); a model's `φ`
/// should come from statistics of its own scores, as the paper sets it per model.
pub const DEFAULT_PHI: f32 = 0.0;

/// Options of [`forward`].
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// `[lo, hi]` is recomputed by FlashDecoding. `None`: `±ln(MAX)/2` of the element type
    /// ([`default_safe_range`]: ±5.55 for fp16, ±44.4 for bf16); `hi` may be at most `ln(MAX)`.
    pub safe_range: Option<(f32, f32)>,
}

impl Default for DecodeOptions {
    fn default() -> DecodeOptions {
        DecodeOptions {
            scale: None,
            splits: None,
            strategy: Strategy::Auto,
            phi: DEFAULT_PHI,
            safe_range: None,
        }
    }
}

/// What [`forward_with_stats`] reports besides the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeStats {
    /// The kernel that ran and its split count.
    pub plan: Plan,
    /// FlashDecoding++: the rows whose scores left `φ`'s safe window and were recomputed by
    /// FlashDecoding (as `ladder_reference::RunStats::fallback_rows` counts them); `None` when
    /// FlashDecoding ran.
    pub fallback_rows: Option<usize>,
}

/// Whether `gpu` gives a block enough shared memory for the decoding kernels at head dimension
/// `d` (every `d` in [`HEAD_DIMS`] on sm_80 and sm_90; `d = 256` needs 136 KB with two K/V stages,
/// 200 KB with Hopper's three, more than the 99 KB of sm_86, sm_89 and sm_120).
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

/// The kernels' variant (both entry points live in one module) for head dimension `d`, element
/// type `dtype`, `m_tiles` 16-row mma tiles of rows, `stages` K/V stages, and a contiguous or a
/// paged cache.
pub(crate) fn variant(
    d: usize,
    dtype: DType,
    m_tiles: usize,
    stages: usize,
    paged: bool,
) -> Variant {
    Variant {
        file: "flash_decoding",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FD_D", d.to_string()),
            ("FD_MT", m_tiles.to_string()),
            ("FD_BC", BC.to_string()),
            ("FD_WARPS", WARPS.to_string()),
            ("FD_STAGES", stages.to_string()),
            ("FD_PAGED", u8::from(paged).to_string()),
            ("FD_MAX_BATCH", MAX_BATCH_PER_LAUNCH.to_string()),
        ],
    }
}

/// Dynamic shared memory of the split kernel in bytes: the Q tile and `stages` stages of K and V
/// (16-bit), or, if larger, the f32 buffer that merges the warps' states at the end (it reuses
/// the same memory; rows padded by 8 floats).
pub(crate) fn split_shared_bytes(d: usize, m_tiles: usize, stages: usize) -> usize {
    let rows = 16 * m_tiles;
    let tiles = (rows + 2 * stages * BC) * d * 2;
    let merge = WARPS * rows * (d + 8 + 2) * 4;
    tiles.max(merge)
}

/// Every variant of rungs 5 and 6, for the compile check.
#[cfg(test)]
pub(crate) fn variants() -> Vec<Variant> {
    let mut all = pp::variants();
    for &dtype in DTYPES {
        for &d in HEAD_DIMS {
            for m_tiles in 1..=rows_per_block(d) / 16 {
                for stages in [2, 3] {
                    for paged in [false, true] {
                        all.push(variant(d, dtype, m_tiles, stages, paged));
                    }
                }
            }
        }
    }
    all
}

/// Mirror of `FdParams` in `cuda/flash_decoding.cu` (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    q: u64,
    k: u64,
    v: u64,
    page_table: u64,
    o_part: u64,
    lse_part: u64,
    o: u64,
    lse: u64,
    fallback: u64,
    counters: u64,
    heads_q: i32,
    heads_kv: i32,
    n_new: i32,
    capacity: i32,
    max_pages: i32,
    num_pages: i32,
    log2_page: i32,
    splits: i32,
    row_blocks: i32,
    scale_log2: f32,
    lengths: [i32; MAX_BATCH_PER_LAUNCH],
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror.
unsafe impl DeviceRepr for Params {}

/// What the checks need of a tensor: its shape and element type.
#[derive(Clone, Copy, Debug)]
struct Desc<'a> {
    shape: &'a [usize],
    dtype: DType,
}

impl<'a> Desc<'a> {
    fn of(t: &'a Tensor) -> Desc<'a> {
        Desc { shape: t.shape(), dtype: t.dtype() }
    }
}

/// A cache as the checks see it (shapes, types, the page table's shape and known entries).
#[derive(Clone, Copy, Debug)]
enum CacheDesc<'a> {
    Contiguous { k: Desc<'a>, v: Desc<'a>, lengths: &'a [usize] },
    Paged { k: Desc<'a>, v: Desc<'a>, table: &'a TableInfo, lengths: &'a [usize] },
}

impl<'a> CacheDesc<'a> {
    fn of(cache: &Cache<'a>) -> CacheDesc<'a> {
        match *cache {
            Cache::Contiguous(c) => {
                CacheDesc::Contiguous { k: Desc::of(c.k), v: Desc::of(c.v), lengths: c.lengths }
            }
            Cache::Paged(c) => CacheDesc::Paged {
                k: Desc::of(c.k_pages),
                v: Desc::of(c.v_pages),
                table: &c.page_table.info,
                lengths: c.lengths,
            },
        }
    }
}

/// How a checked cache is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `[batch, heads_kv, capacity, d]`.
    Contiguous { capacity: usize },
    /// `[num_pages, heads_kv, page_size, d]` and a `[batch, max_pages]` table.
    Paged { page_size: usize, num_pages: usize, max_pages: usize },
}

/// The checked dimensions of one decoding call.
#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    n_new: usize,
    d: usize,
    dtype: DType,
    scale: f32,
    layout: Layout,
    /// FlashDecoding++'s `φ` and safe window (checked for every call, whatever the strategy).
    window: Window,
}

impl Shape {
    /// Every check of a call that needs no device: shapes, element types, lengths, the page
    /// table against the cache, the options.
    fn check(q: Desc, cache: &CacheDesc, opts: &DecodeOptions) -> Result<Shape> {
        let dims = |t: Desc, what: &str| -> Result<[usize; 4]> {
            <[usize; 4]>::try_from(t.shape)
                .map_err(|_| KernelError::Shape(format!("{what}, got shape {:?}", t.shape)))
        };
        let [batch, heads_q, n_new, d] = dims(q, "q must be [batch, heads_q, n_new, head_dim]")?;
        let (k, v, lengths) = match *cache {
            CacheDesc::Contiguous { k, v, lengths } => (k, v, lengths),
            CacheDesc::Paged { k, v, lengths, .. } => (k, v, lengths),
        };
        let (layout, heads_kv, kd) = match *cache {
            CacheDesc::Contiguous { .. } => {
                let [kb, heads_kv, capacity, kd] =
                    dims(k, "k must be [batch, heads_kv, capacity, head_dim]")?;
                if kb != batch {
                    return Err(KernelError::Shape(format!(
                        "q {:?} and the cache {:?} differ in batch",
                        q.shape, k.shape
                    )));
                }
                (Layout::Contiguous { capacity }, heads_kv, kd)
            }
            CacheDesc::Paged { table, .. } => {
                let [num_pages, heads_kv, page_size, kd] =
                    dims(k, "k_pages must be [num_pages, heads_kv, page_size, head_dim]")?;
                if table.batch != batch {
                    return Err(KernelError::Shape(format!(
                        "the page table has {} rows for a batch of {batch}",
                        table.batch
                    )));
                }
                (Layout::Paged { page_size, num_pages, max_pages: table.max_pages }, heads_kv, kd)
            }
        };
        if v.shape != k.shape {
            return Err(KernelError::Shape(format!(
                "v has shape {:?} but k has {:?}",
                v.shape, k.shape
            )));
        }
        if kd != d {
            return Err(KernelError::Shape(format!(
                "q {:?} and the cache {:?} differ in head_dim",
                q.shape, k.shape
            )));
        }
        if q.shape.contains(&0) || k.shape.contains(&0) {
            return Err(KernelError::Shape(format!(
                "every dimension must be at least 1 (q {:?}, cache {:?})",
                q.shape, k.shape
            )));
        }
        if heads_q % heads_kv != 0 {
            return Err(KernelError::Shape(format!(
                "heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv}"
            )));
        }
        if n_new > MAX_NEW_TOKENS {
            return Err(KernelError::Shape(format!(
                "n_new = {n_new} new tokens per sequence; decoding takes 1 to {MAX_NEW_TOKENS}"
            )));
        }
        if lengths.len() != batch {
            return Err(KernelError::Shape(format!(
                "{} lengths given for a batch of {batch}",
                lengths.len()
            )));
        }
        if let Some((b, &len)) = lengths.iter().enumerate().find(|&(_, &l)| l > MAX_LENGTH) {
            return Err(KernelError::Shape(format!(
                "lengths[{b}] = {len} exceeds the kernels' limit {MAX_LENGTH}"
            )));
        }
        // The kernels take these counts as 32-bit ints.
        let limit = i32::MAX as usize;
        match layout {
            Layout::Contiguous { capacity } => {
                if let Some((b, &len)) = lengths.iter().enumerate().find(|&(_, &l)| l > capacity) {
                    return Err(KernelError::Shape(format!(
                        "lengths[{b}] = {len} exceeds the cache capacity {capacity}"
                    )));
                }
                if capacity > limit {
                    return Err(KernelError::Shape(format!("cache {:?} too large", k.shape)));
                }
            }
            Layout::Paged { page_size, num_pages, .. } => {
                if !PAGE_SIZES.contains(&page_size) {
                    return Err(KernelError::Config(format!(
                        "flash_decoding: pages of {page_size} tokens (k_pages {:?}); the paged \
                         kernel takes {PAGE_SIZES:?}",
                        k.shape
                    )));
                }
                if num_pages > limit {
                    return Err(KernelError::Shape(format!(
                        "{num_pages} pages (k_pages {:?}) is too many",
                        k.shape
                    )));
                }
                if let CacheDesc::Paged { table, .. } = *cache {
                    table.check(lengths, page_size, num_pages)?;
                }
            }
        }
        if k.dtype != q.dtype || v.dtype != q.dtype {
            return Err(KernelError::DType(format!(
                "q, k, v must share a dtype (got {}, {}, {})",
                q.dtype, k.dtype, v.dtype
            )));
        }
        let dtype = q.dtype;
        if !DTYPES.contains(&dtype) {
            return Err(KernelError::UnsupportedDtype {
                rung: "flash_decoding",
                dtype,
                supported: "fp16, bf16",
            });
        }
        if !HEAD_DIMS.contains(&d) {
            return Err(KernelError::UnsupportedHeadDim {
                rung: "flash_decoding",
                d,
                supported: HEAD_DIMS,
            });
        }
        if batch.saturating_mul(heads_q).saturating_mul(n_new) > limit {
            return Err(KernelError::Shape(format!("q {:?} too large", q.shape)));
        }
        let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
        crate::problem::check_scale(scale)?;
        let window = Window::new(opts.phi, opts.safe_range, dtype)?;
        Ok(Shape { batch, heads_q, heads_kv, n_new, d, dtype, scale, layout, window })
    }

    /// Rows of the split kernel per kv head: query heads per kv head times new tokens.
    fn rows_per_kv_head(&self) -> usize {
        self.heads_q / self.heads_kv * self.n_new
    }

    /// Output rows: `batch · heads_q · n_new`.
    fn rows(&self) -> usize {
        self.batch * self.heads_q * self.n_new
    }

    /// `O`'s shape, `q`'s: `[batch, heads_q, n_new, d]` (`lse`'s is its first three).
    fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.n_new, self.d]
    }

    /// Caller-owned outputs ([`forward_into`]) of the call's shapes and types.
    fn check_output(&self, out: &Output) -> Result<()> {
        let o_shape = self.o_shape();
        if out.o.shape() != o_shape || out.lse.shape() != &o_shape[..3] {
            return Err(KernelError::Shape(format!(
                "decode: outputs O {:?} and lse {:?}, expected {o_shape:?} and {:?}",
                out.o.shape(),
                out.lse.shape(),
                &o_shape[..3]
            )));
        }
        if out.o.dtype() != self.dtype || out.lse.dtype() != DType::F32 {
            return Err(KernelError::DType(format!(
                "decode: outputs O in {} and lse in {}, expected {} (q's) and f32",
                out.o.dtype(),
                out.lse.dtype(),
                self.dtype
            )));
        }
        if !out.o.is_contiguous() || !out.lse.is_contiguous() {
            return Err(KernelError::Shape(
                "decode: the outputs O and lse must be contiguous tensors".into(),
            ));
        }
        Ok(())
    }
}

/// Attention of `q`'s new tokens against the cache: `softmax(scale · Q Kᵀ + mask) V` and its
/// log-sum-exp, for each sequence over its first `lengths[b]` keys, causal among the new tokens
/// (see the module docs). The cache is a [`KvCache`], a [`PagedKvCache`] or a [`Cache`] (or a
/// reference to one).
///
/// `q` is `[batch, heads_q, n_new, d]` with `n_new` in `1 ..= 16`, fp16 or bf16, `d` 64, 128 or 256,
/// `heads_q` a multiple of `heads_kv` (any group: past [`rows_per_block`]`(d)` rows per kv head the
/// rows are shared by several blocks). Returns `O` as `q` (`[batch, heads_q, n_new, d]`, `q`'s
/// dtype) and `lse` `[batch, heads_q, n_new]` (`f32`, natural log).
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
    let mut out = call.new_output(gpu)?;
    launch(gpu, q, cache, &call, &mut out)?;
    Ok(out)
}

/// [`forward`] into `O` and `lse` tensors the caller owns, as a serving loop keeps them from one
/// decoding step to the next: `out.o` `[batch, heads_q, n_new, d]` in `q`'s dtype and `out.lse`
/// `[batch, heads_q, n_new]` in `f32`, made on this `Gpu`'s stream; every element is overwritten.
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
    launch(gpu, q, cache, &call, out).map(|_| ())
}

/// [`forward`], and what it did: the kernel and split count that ran, and for FlashDecoding++ the
/// number of rows recomputed by the FlashDecoding fallback.
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
    let mut out = call.new_output(gpu)?;
    let fallback = launch(gpu, q, cache, &call, &mut out)?;
    let fallback_rows = match &fallback {
        None => None,
        Some(flags) => {
            let flags = flags
                .stream()
                .clone_dtoh(flags)
                .map_err(KernelError::driver("copying the fallback flags to the host"))?;
            Some(flags.iter().filter(|&&f| f != 0).count())
        }
    };
    Ok((out, DecodeStats { plan: call.plan, fallback_rows }))
}

/// A call that passed its checks: its shapes and its plan (kernel and split count).
struct Call {
    shape: Shape,
    plan: Plan,
    /// K/V stages of the kernels' pipeline on this `Gpu` (2 to 16).
    stages: usize,
}

/// A call's checks, before anything is allocated or launched: the inputs on this `Gpu`'s stream,
/// the shapes and options, and the plan.
fn check_call(gpu: &Gpu, q: &Tensor, cache: &Cache<'_>, opts: &DecodeOptions) -> Result<Call> {
    let (k, v, table) = cache.buffers();
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        gpu.check_context(t, name)?;
        if !t.is_contiguous() {
            return Err(KernelError::Shape(format!(
                "{name} has strides {:?}: the decoding kernels take contiguous tensors only",
                t.strides()
            )));
        }
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
    let shape = Shape::check(Desc::of(q), &CacheDesc::of(cache), opts)?;
    let work = Workload {
        rows_per_kv_head: shape.rows_per_kv_head(),
        max_len: cache.lengths().iter().copied().max().unwrap_or(0),
        batch_heads_kv: shape.batch * shape.heads_kv,
        head_dim: shape.d,
        paged: table.is_some(),
    };
    let plan = plan(opts.strategy, opts.splits, &work, gpu.sm_count() as usize)?;
    Ok(Call { shape, plan, stages })
}

impl Call {
    /// `O` and `lse` for the call, uninitialised (NaN when outputs are poisoned).
    fn new_output(&self, gpu: &Gpu) -> Result<Output> {
        let o_shape = self.shape.o_shape();
        let o = gpu.output(&o_shape, self.shape.dtype)?;
        Ok(Output { o, lse: gpu.output(&o_shape[..3], DType::F32)? })
    }
}

/// The launches of one checked call ([`check_call`]), into `out` (checked here); returns
/// FlashDecoding++'s fallback flags when it ran (one `i32` per output row, 1 where FlashDecoding
/// recomputed the row):
///
/// - FlashDecoding: `flash_decoding_split` (whose last block per group of splits combines them);
/// - FlashDecoding++: `flash_decoding_pp_split`, `flash_decoding_pp_combine` (which flags the rows
///   that fall back), then `flash_decoding_split` given the flags, which runs only the blocks
///   holding a flagged row and writes only the flagged rows. No host round trip: when no row falls
///   back, that launch is blocks that exit at once.
///
/// Both kernel families write their partials into the same workspaces (FlashDecoding's `O_s`,
/// `lse_s` where FlashDecoding++ had `acc_s`, `l_s`): the fallback runs after FlashDecoding++'s
/// combine has read them, in stream order.
fn launch(
    gpu: &Gpu,
    q: &Tensor,
    cache: Cache<'_>,
    Call { shape: p, plan, stages }: &Call,
    out: &mut Output,
) -> Result<Option<CudaSlice<i32>>> {
    for (name, t) in [("o", &out.o), ("lse", &out.lse)] {
        gpu.check_context(t, name)?;
    }
    p.check_output(out)?;
    let (k, v, table) = cache.buffers();
    let lengths = cache.lengths();
    let r = p.rows_per_kv_head();
    let splits = plan.splits;
    let too_many = || KernelError::Config(format!("flash_decoding: {splits} splits is too many"));
    let splits_i = i32::try_from(splits).map_err(|_| too_many())?;
    let stages = *stages;
    let paged = table.is_some();

    // FlashDecoding's kernels: the whole call, or FlashDecoding++'s fallback.
    let (m_tiles, fd_row_blocks) = (m_tiles(r, p.d), row_blocks(r, p.d));
    let fd_blocks_x = splits.checked_mul(fd_row_blocks).ok_or_else(too_many)?;
    let fd = variant(p.d, p.dtype, m_tiles, stages, paged);
    let fd_split = Kernel { variant: fd, entry: "flash_decoding_split" };
    let fd_smem = split_shared_bytes(p.d, m_tiles, stages);
    gpu.prepare(&fd_split, fd_smem)?;
    // FlashDecoding++'s, when it runs.
    let pp_kernel = match plan.strategy {
        Strategy::Gemv => Some(PpKernel::Gemv),
        Strategy::FlatGemm => Some(PpKernel::flat(r, p.d)),
        _ => None,
    };
    let pp_launch = match pp_kernel {
        None => None,
        Some(kernel) => {
            let variant = pp::variant(p.d, p.dtype, kernel, stages, paged);
            let split = Kernel { variant: variant.clone(), entry: "flash_decoding_pp_split" };
            let combine = Kernel { variant, entry: "flash_decoding_pp_combine" };
            let smem = pp::shared_bytes(p.d, kernel, stages);
            gpu.prepare(&split, smem)?;
            gpu.prepare(&combine, 0)?;
            let row_blocks = r.div_ceil(kernel.rows_per_block());
            let blocks_x = splits.checked_mul(row_blocks).ok_or_else(too_many)?;
            Some((split, combine, smem, row_blocks, blocks_x))
        }
    };

    // Workspaces, f32, in the Gpu's scratch memory (kept from call to call): O_s (FlashDecoding)
    // or acc_s (FlashDecoding++) [batch, heads_q, n_new, splits, d], lse_s or l_s [batch, heads_q,
    // n_new, splits]; FlashDecoding++ also the sum of P as rounded and the largest exponent per
    // split [batch, heads_q, n_new, splits] each. Every element a kernel reads was written
    // earlier in the call. FlashDecoding with one split writes O and lse directly: none.
    let rows = p.rows();
    let parts = if splits > 1 || pp_kernel.is_some() { rows * splits } else { 0 };
    let pp_parts = if pp_kernel.is_some() { 2 * parts } else { 0 };
    let workspace = parts * (p.d + 1) + pp_parts;
    // FlashDecoding++'s fallback flags, one per row (copied back by forward_with_stats).
    let mut flags = match pp_kernel {
        None => None,
        // SAFETY: flash_decoding_pp_combine writes every row's flag before anything reads it.
        Some(_) => Some(
            unsafe { gpu.stream().alloc::<i32>(rows) }
                .map_err(KernelError::alloc(rows * std::mem::size_of::<i32>()))?,
        ),
    };
    let s = gpu.stream();
    let (q_ptr, _g0) = q.read_ptr(s);
    let (k_ptr, _g1) = k.read_ptr(s);
    let (v_ptr, _g2) = v.read_ptr(s);
    let (o_ptr, _g5) = out.o.write_ptr(s);
    let (lse_ptr, _g6) = out.lse.write_ptr(s);
    let (table_ptr, _g7) = match table {
        Some(t) => {
            let (ptr, guard) = t.table.device_ptr(s);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    let (flags_ptr, _g9) = match &mut flags {
        Some(f) => {
            let (ptr, guard) = f.device_ptr_mut(s);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    // The layout's numbers: a contiguous cache's capacity, or the pages' count and size (the
    // size a power of two, checked) and the table's row length.
    let (capacity, max_pages, num_pages, log2_page) = match p.layout {
        Layout::Contiguous { capacity } => (capacity, 0, 0, 0),
        Layout::Paged { page_size, num_pages, max_pages } => {
            (0, max_pages, num_pages, page_size.trailing_zeros())
        }
    };
    // Batches of more than MAX_BATCH_PER_LAUNCH sequences go in chunks: Q, O, the workspaces, the
    // flags, a contiguous cache and the page table are batch-major, so a chunk is the same call
    // on pointers advanced by its first sequence (pages are shared by all sequences: not
    // advanced).
    let rows_per_seq = p.heads_q * p.n_new;
    let elem = p.dtype.size();
    let combine_threads = 32 * COMBINE_ROWS_PER_BLOCK as u32;
    // The split kernel's counters: one per (sequence, kv head, row block) of a launch.
    let counters = fd_row_blocks * p.heads_kv * p.batch.min(MAX_BATCH_PER_LAUNCH);
    gpu.with_scratch(counters, workspace, |scratch| {
        // The workspaces' addresses, in the order listed above.
        let o_part_ptr = scratch.floats;
        let lse_part_ptr = o_part_ptr + (4 * parts * p.d) as u64;
        let lr_part_ptr = lse_part_ptr + (4 * parts) as u64;
        let max_part_ptr = lr_part_ptr + (4 * parts) as u64;
        for first in (0..p.batch).step_by(MAX_BATCH_PER_LAUNCH) {
            let n = (p.batch - first).min(MAX_BATCH_PER_LAUNCH);
            let (row0, chunk_rows) = (first * rows_per_seq, n * rows_per_seq);
            let kv0 = first * p.heads_kv * capacity * p.d;
            let mut chunk_lengths = [0i32; MAX_BATCH_PER_LAUNCH];
            // Each length is at most MAX_LENGTH, which fits in i32 (checked above).
            for (dst, &len) in chunk_lengths.iter_mut().zip(&lengths[first..first + n]) {
                *dst = len as i32;
            }
            let at = |ptr: u64, elements: usize, size: usize| ptr + (elements * size) as u64;
            let fallback = if pp_kernel.is_some() { at(flags_ptr, row0, 4) } else { 0 };
            let params = Params {
                q: at(q_ptr, row0 * p.d, elem),
                k: at(k_ptr, kv0, elem),
                v: at(v_ptr, kv0, elem),
                page_table: if table.is_some() { at(table_ptr, first * max_pages, 4) } else { 0 },
                o_part: at(o_part_ptr, row0 * splits * p.d, 4),
                lse_part: at(lse_part_ptr, row0 * splits, 4),
                o: at(o_ptr, row0 * p.d, elem),
                lse: at(lse_ptr, row0, 4),
                fallback,
                counters: scratch.counters,
                heads_q: p.heads_q as i32,
                heads_kv: p.heads_kv as i32,
                n_new: p.n_new as i32,
                // Each at most i32::MAX (checked above).
                capacity: capacity as i32,
                max_pages: max_pages as i32,
                num_pages: num_pages as i32,
                log2_page: log2_page as i32,
                splits: splits_i,
                row_blocks: fd_row_blocks as i32,
                scale_log2: p.scale * std::f32::consts::LOG2_E,
                lengths: chunk_lengths,
            };
            let combine_grid = grid(chunk_rows.div_ceil(COMBINE_ROWS_PER_BLOCK), 1, 1)?;
            if let Some((split, combine, smem, row_blocks, blocks_x)) = &pp_launch {
                let w = p.window;
                let pp_params = PpParams {
                    q: params.q,
                    k: params.k,
                    v: params.v,
                    page_table: params.page_table,
                    acc_part: params.o_part,
                    l_part: params.lse_part,
                    lr_part: at(lr_part_ptr, row0 * splits, 4),
                    max_part: at(max_part_ptr, row0 * splits, 4),
                    o: params.o,
                    lse: params.lse,
                    fallback,
                    heads_q: params.heads_q,
                    heads_kv: params.heads_kv,
                    n_new: params.n_new,
                    capacity: params.capacity,
                    max_pages: params.max_pages,
                    num_pages: params.num_pages,
                    log2_page: params.log2_page,
                    splits: splits_i,
                    row_blocks: *row_blocks as i32,
                    rows: chunk_rows as i32,
                    scale_log2: params.scale_log2,
                    phi: w.phi,
                    phi_log2: w.phi_log2,
                    lo_log2: w.lo_log2,
                    hi_log2: w.hi_log2,
                    lengths: chunk_lengths,
                };
                gpu.launch(
                    split,
                    grid(*blocks_x, p.heads_kv, n)?,
                    32 * WARPS as u32,
                    *smem,
                    &pp_params,
                )?;
                gpu.launch(combine, combine_grid, combine_threads, 0, &pp_params)?;
            }
            // FlashDecoding: the call itself, or (fallback set) the rows FlashDecoding++ flagged.
            // Programmatic: its blocks start during the previous kernel's tail (pdl.cuh).
            gpu.launch_programmatic(
                &fd_split,
                grid(fd_blocks_x, p.heads_kv, n)?,
                32 * WARPS as u32,
                fd_smem,
                &params,
            )?;
        }
        Ok(())
    })?;
    drop((_g0, _g1, _g2, _g5, _g6, _g7, _g9));
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_splits_fills_the_device() {
        // batch · heads_kv = 32 on 132 SMs, 128 key blocks: one wave would be a quarter full.
        let s = num_splits(32, 128, 132, MAX_SPLITS);
        assert!(s >= 4, "{s}");
        assert_eq!(s, 4); // 128 blocks: 97 % of a wave
        // Enough blocks already.
        assert_eq!(num_splits(2048, 128, 132, MAX_SPLITS), 1);
        assert_eq!(num_splits(106, 128, 132, MAX_SPLITS), 1); // ≥ 0.8 · 132
        // Never more splits than key blocks, than asked, or than 128; at least 1.
        assert_eq!(num_splits(1, 3, 132, MAX_SPLITS), 3);
        // One block: efficiency grows with s, so the smallest s within 95 % of the largest.
        assert_eq!(num_splits(1, 1000, 132, 16), 16);
        assert_eq!(num_splits(1, 1000, 132, 20), 19);
        // 8 kv heads (batch 1, GQA 32/8), 128 key blocks: 16 splits fill 97 % of a wave; 15
        // (91 %) would be within FlashAttention's 85 %.
        assert_eq!(num_splits(8, 128, 132, MAX_SPLITS), 16);
        assert!(num_splits(1, 1000, 132, MAX_SPLITS) <= MAX_SPLITS);
        assert_eq!(num_splits(8, 0, 132, MAX_SPLITS), 1);
        assert_eq!(num_splits(8, 100, 0, MAX_SPLITS), 1);
        // A split count that gives each split as many key blocks as the one before is skipped:
        // with 10 key blocks, 6 … 9 splits give 2 blocks each like 5, so after 5 comes 10.
        assert_eq!(num_splits(1, 10, 132, MAX_SPLITS), 10);
        assert_eq!(num_splits(1, 10, 132, 9), 5);
    }

    #[test]
    fn shared_memory_covers_tiles_and_the_merge() {
        // d = 128, 32 rows: Q (8 KB) + three stages of K and V (96 KB), or two (64 KB).
        assert_eq!(split_shared_bytes(128, 2, 3), (32 + 384) * 128 * 2);
        assert_eq!(split_shared_bytes(128, 2, 2), (32 + 256) * 128 * 2);
        // d = 64, 32 rows, two stages: the f32 merge buffer is the larger.
        assert_eq!(split_shared_bytes(64, 2, 2), 4 * 32 * (64 + 10) * 4);
        assert!(split_shared_bytes(64, 2, 2) > (32 + 256) * 64 * 2);
        // d = 256, 16 rows: Q (8 KB) + three stages (192 KB).
        assert_eq!(split_shared_bytes(256, 1, 3), (16 + 384) * 256 * 2);
        for &d in HEAD_DIMS {
            for mt in 1..=rows_per_block(d) / 16 {
                // As many blocks per SM as the paged heuristic counts (Workload::blocks_per_sm:
                // two up to d = 128, one at d = 256) fit on sm_80 (164 KB) and sm_90 (228 KB,
                // 1 KB per block reserved).
                let work = Workload {
                    rows_per_kv_head: 16 * mt,
                    max_len: 1,
                    batch_heads_kv: 1,
                    head_dim: d,
                    paged: true,
                };
                let blocks = work.blocks_per_sm();
                assert!(blocks * split_shared_bytes(d, mt, stages("sm_80")) <= 164 * 1024);
                assert!(
                    blocks * (split_shared_bytes(d, mt, stages("sm_90a")) + 1024) <= 228 * 1024
                );
            }
        }
    }

    #[test]
    fn rows_past_32_go_to_more_blocks() {
        // Up to 16 rows: one tile; up to 32: two tiles, one block; then a block per 32 rows.
        for d in [64, 128] {
            assert_eq!((m_tiles(1, d), row_blocks(1, d)), (1, 1));
            assert_eq!((m_tiles(16, d), row_blocks(16, d)), (1, 1));
            assert_eq!((m_tiles(17, d), row_blocks(17, d)), (2, 1));
            assert_eq!((m_tiles(32, d), row_blocks(32, d)), (2, 1));
            assert_eq!((m_tiles(33, d), row_blocks(33, d)), (2, 2));
            assert_eq!((m_tiles(128, d), row_blocks(128, d)), (2, 4)); // GQA 8 × 16 tokens
            assert_eq!(row_blocks(0, d), 1);
        }
        // d = 256: one tile of 16 rows per block.
        assert_eq!((m_tiles(16, 256), row_blocks(16, 256)), (1, 1));
        assert_eq!((m_tiles(17, 256), row_blocks(17, 256)), (1, 2));
        assert_eq!((m_tiles(128, 256), row_blocks(128, 256)), (1, 8));
        let work = |batch: usize, heads_kv: usize, rows, max_len, head_dim, paged| Workload {
            rows_per_kv_head: rows,
            max_len,
            batch_heads_kv: batch * heads_kv,
            head_dim,
            paged,
        };
        let splits = |batch, heads_kv, rows, max_len, paged| {
            default_splits(&work(batch, heads_kv, rows, max_len, 128, paged), 132)
        };
        // The heuristic counts the row blocks: 4 of them on 8 kv heads are 32 blocks per split.
        assert_eq!(splits(1, 8, 128, 128 * BC, false), num_splits(32, 128, 132, MAX_SPLITS));
        assert_eq!(splits(1, 8, 4, 128 * BC, false), num_splits(8, 128, 132, MAX_SPLITS));
        // … 8 of them at d = 256.
        assert_eq!(
            default_splits(&work(1, 8, 128, 128 * BC, 256, false), 132),
            num_splits(64, 128, 132, MAX_SPLITS)
        );
        // A paged cache fills two blocks per SM: batch 16, 8 kv heads (128 blocks) takes 2
        // splits, where a contiguous one takes 1; batch 1, 32 kv heads, 8 splits instead of 4.
        assert_eq!(splits(16, 8, 4, 512 * BC, false), 1);
        assert_eq!(splits(16, 8, 4, 512 * BC, true), 2);
        assert_eq!(splits(1, 32, 1, 128 * BC, false), 4);
        assert_eq!(splits(1, 32, 1, 128 * BC, true), 8);
        // … but not below 16 tiles per split: batch 1, 8 kv heads, 8k keys keeps 16 splits.
        assert_eq!(splits(1, 8, 4, 128 * BC, true), 16);
        assert_eq!(splits(1, 8, 4, 128 * BC, false), 16);
        // … and not at d = 256, where one block fills an SM's shared memory.
        assert_eq!(default_splits(&work(1, 32, 1, 128 * BC, 256, true), 132), 4);
        assert_eq!(work(1, 32, 1, 128 * BC, 256, true).blocks_per_sm(), 1);
    }

    #[test]
    fn params_are_laid_out_like_the_cuda_struct() {
        // 10 pointers, 9 ints, a float, then the lengths; 8-byte aligned.
        assert_eq!(std::mem::offset_of!(Params, heads_q), 80);
        assert_eq!(std::mem::offset_of!(Params, scale_log2), 116);
        assert_eq!(std::mem::offset_of!(Params, lengths), 120);
        assert_eq!(std::mem::size_of::<Params>(), 1144);
    }

    fn desc(shape: &[usize], dtype: DType) -> Desc<'_> {
        Desc { shape, dtype }
    }

    /// A host-checked page table of `rows`, each padded with −1 to `max_pages`.
    fn table(rows: &[&[i32]], max_pages: usize) -> TableInfo {
        let mut entries = Vec::new();
        for row in rows {
            entries.extend_from_slice(row);
            entries.resize(entries.len() + max_pages - row.len(), -1);
        }
        let mut info = TableInfo::new(rows.len(), max_pages).unwrap();
        info.host = Some(HostEntries::new(&entries, rows.len(), max_pages).unwrap());
        info
    }

    fn check_paged(
        q: &[usize],
        pages: &[usize],
        info: &TableInfo,
        lengths: &[usize],
    ) -> Result<Shape> {
        let f16 = DType::F16;
        let cache =
            CacheDesc::Paged { k: desc(pages, f16), v: desc(pages, f16), table: info, lengths };
        Shape::check(desc(q, f16), &cache, &DecodeOptions::default())
    }

    #[test]
    fn a_good_paged_cache_passes_the_checks() {
        // Two sequences in pages of 16: 40 keys (3 pages) and 16 keys (1 page); 2 kv heads.
        let info = table(&[&[4, 0, 2], &[1]], 4);
        let p = check_paged(&[2, 8, 2, 64], &[5, 2, 16, 64], &info, &[40, 16]).unwrap();
        assert_eq!(p.layout, Layout::Paged { page_size: 16, num_pages: 5, max_pages: 4 });
        assert_eq!((p.batch, p.heads_q, p.heads_kv, p.n_new, p.d), (2, 8, 2, 2, 64));
        assert_eq!(p.rows_per_kv_head(), 8);
        // Empty sequences read no entry: a row of −1 is fine.
        let empty = table(&[&[-1], &[3]], 1);
        assert!(check_paged(&[2, 8, 1, 64], &[5, 2, 16, 64], &empty, &[0, 9]).is_ok());
        // A device-only table (entries unknown) is checked for its shape only.
        let unseen = TableInfo::new(2, 3).unwrap();
        assert!(check_paged(&[2, 8, 1, 64], &[5, 2, 16, 64], &unseen, &[48, 1]).is_ok());
        // Every page size of PAGE_SIZES.
        for &page in PAGE_SIZES {
            let one = table(&[&[0]], 1);
            assert!(check_paged(&[1, 4, 1, 128], &[1, 1, page, 128], &one, &[page]).is_ok());
        }
    }

    #[test]
    fn bad_page_tables_are_errors() {
        let pages = [5, 2, 16, 64];
        let q = [2, 8, 1, 64];
        let page_err = |r: Result<Shape>, needle: &str| match r {
            Err(KernelError::PageTable(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("expected a page-table error with {needle:?}, got {other:?}"),
        };
        // Too short for a length: 49 keys need 4 pages of 16, the table has 3 per sequence.
        let info = table(&[&[0, 1, 2], &[3]], 3);
        page_err(check_paged(&q, &pages, &info, &[49, 1]), "needs 4 pages");
        // So is a device-only table of the same shape.
        let unseen = TableInfo::new(2, 3).unwrap();
        page_err(check_paged(&q, &pages, &unseen, &[49, 1]), "needs 4 pages");
        // An entry past the last page, and a negative one, among the entries a sequence reads.
        let info = table(&[&[0, 5, 1], &[3]], 3);
        page_err(check_paged(&q, &pages, &info, &[33, 1]), "page_table[0][1] = 5");
        let info = table(&[&[0, 1, 2], &[3, -1]], 3);
        page_err(check_paged(&q, &pages, &info, &[48, 17]), "page_table[1][1] = -1");
        // The same entries past what the lengths read are never read: fine.
        assert!(check_paged(&q, &pages, &table(&[&[0, 5, 1], &[3]], 3), &[16, 1]).is_ok());
        // Rows and lengths that do not match the batch.
        let three = table(&[&[0], &[1], &[2]], 1);
        let r = check_paged(&q, &pages, &three, &[1, 1]);
        assert!(matches!(&r, Err(KernelError::Shape(m)) if m.contains("3 rows")), "{r:?}");
        let r = check_paged(&q, &pages, &table(&[&[0], &[1]], 1), &[1, 1, 1]);
        assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
        // A table with no entries, and host entries that do not fill the shape.
        assert!(matches!(TableInfo::new(0, 4), Err(KernelError::Shape(_))));
        assert!(matches!(TableInfo::new(2, 0), Err(KernelError::Shape(_))));
        assert!(matches!(HostEntries::new(&[0, 1, 2], 2, 2), Err(KernelError::Shape(_))));
    }

    #[test]
    fn page_sizes_and_shapes_are_checked() {
        let q = [1, 8, 1, 64];
        let one = table(&[&[0, 1, 2, 3]], 4);
        // Not a power of two, too small, too large: a configuration error naming the sizes.
        for page in [48, 8, 512, 100] {
            let r = check_paged(&q, &[4, 2, page, 64], &one, &[1]);
            assert!(matches!(&r, Err(KernelError::Config(m)) if m.contains("16, 32")), "{r:?}");
        }
        let f16 = DType::F16;
        let check = |q: Desc, k: Desc, v: Desc| {
            let cache = CacheDesc::Paged { k, v, table: &one, lengths: &[10] };
            Shape::check(q, &cache, &DecodeOptions::default())
        };
        let pages = [4, 2, 16, 64];
        // v unlike k, head dims differing, heads not a multiple, zero pages, rank 3.
        let shape_errors = [
            (desc(&q, f16), desc(&pages, f16), desc(&[4, 2, 32, 64], f16)),
            (desc(&q, f16), desc(&[4, 2, 16, 128], f16), desc(&[4, 2, 16, 128], f16)),
            (desc(&q, f16), desc(&[4, 3, 16, 64], f16), desc(&[4, 3, 16, 64], f16)),
            (desc(&q, f16), desc(&[0, 2, 16, 64], f16), desc(&[0, 2, 16, 64], f16)),
            (desc(&q, f16), desc(&[2, 16, 64], f16), desc(&[2, 16, 64], f16)),
        ];
        for (i, (q, k, v)) in shape_errors.into_iter().enumerate() {
            let r = check(q, k, v);
            assert!(matches!(r, Err(KernelError::Shape(_))), "case {i}: {r:?}");
        }
        // Pages of another dtype than q, and an element type without a kernel.
        let bf = DType::BF16;
        let r = check(desc(&q, f16), desc(&pages, bf), desc(&pages, bf));
        assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
        let r = check(desc(&q, f16), desc(&pages, f16), desc(&pages, bf));
        assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
        let f32_ = DType::F32;
        let r = check(desc(&q, f32_), desc(&pages, f32_), desc(&pages, f32_));
        assert!(matches!(r, Err(KernelError::UnsupportedDtype { .. })), "{r:?}");
    }

    #[test]
    fn contiguous_checks_take_any_number_of_rows() {
        let f16 = DType::F16;
        let check = |q: &[usize], kv: &[usize], lengths: &[usize]| {
            let cache = CacheDesc::Contiguous { k: desc(kv, f16), v: desc(kv, f16), lengths };
            Shape::check(desc(q, f16), &cache, &DecodeOptions::default())
        };
        // GQA 8 × 16 tokens = 128 rows per kv head, and 32 × 16 = 512 (MQA).
        let p = check(&[1, 16, 16, 128], &[1, 2, 300, 128], &[300]).unwrap();
        assert_eq!((p.rows_per_kv_head(), p.layout), (128, Layout::Contiguous { capacity: 300 }));
        assert_eq!(
            check(&[1, 32, 16, 64], &[1, 1, 30, 64], &[30]).unwrap().rows_per_kv_head(),
            512
        );
        // A length past the capacity, the wrong number of lengths, 17 tokens, batch differing.
        for (q, kv, lengths) in [
            (&[1, 8, 1, 64][..], &[1, 2, 30, 64][..], &[31][..]),
            (&[1, 8, 1, 64], &[1, 2, 30, 64], &[3, 3]),
            (&[1, 8, 17, 64], &[1, 2, 30, 64], &[30]),
            (&[2, 8, 1, 64], &[1, 2, 30, 64], &[3, 3]),
        ] {
            let r = check(q, kv, lengths);
            assert!(matches!(r, Err(KernelError::Shape(_))), "{q:?} {kv:?} {lengths:?}: {r:?}");
        }
        let r = check(&[1, 8, 1, 96], &[1, 2, 30, 96], &[30]);
        assert!(matches!(r, Err(KernelError::UnsupportedHeadDim { d: 96, .. })), "{r:?}");
    }

    #[test]
    fn flash_decoding_pp_options_are_checked_with_the_shapes() {
        let f16 = DType::F16;
        let (q, kv) = ([1, 8, 1, 64], [1, 2, 30, 64]);
        let check = |dtype: DType, opts: DecodeOptions| {
            let cache =
                CacheDesc::Contiguous { k: desc(&kv, dtype), v: desc(&kv, dtype), lengths: &[30] };
            Shape::check(desc(&q, dtype), &cache, &opts)
        };
        // The defaults: φ = 0 and the element type's window, whatever the strategy.
        for strategy in Strategy::ALL {
            let p = check(f16, DecodeOptions { strategy, ..DecodeOptions::default() }).unwrap();
            assert_eq!(p.window.phi, DEFAULT_PHI);
            let (lo, hi) = default_safe_range(f16);
            let log2e = std::f32::consts::LOG2_E;
            assert_eq!((p.window.lo_log2, p.window.hi_log2), (lo * log2e, hi * log2e));
        }
        // bf16 takes a window fp16 cannot (e^40 overflows fp16).
        let wide = DecodeOptions { safe_range: Some((-40.0, 40.0)), ..DecodeOptions::default() };
        assert!(check(DType::BF16, wide).is_ok());
        for bad in [
            DecodeOptions { phi: f32::NAN, ..DecodeOptions::default() },
            DecodeOptions { phi: f32::NEG_INFINITY, ..DecodeOptions::default() },
            DecodeOptions { safe_range: Some((0.0, 0.0)), ..DecodeOptions::default() },
            wide,
        ] {
            let r = check(f16, bad);
            assert!(matches!(r, Err(KernelError::Config(_))), "{bad:?}: {r:?}");
        }
    }

    #[test]
    fn host_entries_keep_prefix_maxima() {
        let h = HostEntries::new(&[3, 1, 7, -1, 0, 2, 2, 9], 2, 4).unwrap();
        assert_eq!(h.prefix_max, [3, 3, 7, i32::MAX, 0, 2, 2, 9]);
        assert!(h.check_row(0, 3, 8).is_ok());
        assert!(h.check_row(0, 3, 7).is_err(), "7 is not a page of 7");
        assert!(h.check_row(0, 4, 100).is_err(), "−1 is read");
        assert!(h.check_row(1, 3, 3).is_ok());
        let e = h.check_row(1, 4, 3).unwrap_err().to_string();
        assert!(e.contains("page_table[1][3] = 9"), "{e}");
    }
}
