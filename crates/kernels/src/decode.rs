//! Rung 5 on the GPU: FlashDecoding (Dao, Haziza, Massa, Sizov 2023), attention of a few new
//! tokens against a KV cache, with the keys split across thread blocks.
//!
//! Decoding is memory-bound: a step reads the whole cache (K and V) for `n_new` = 1 … 16 new
//! query tokens per sequence. FA2 gives one block to each (query block, head, batch), which at
//! batch 1 is a few dozen blocks on a GPU with 132 SMs, each streaming a whole cache alone. Here
//! the keys of each sequence are split into `splits` chunks handled by separate blocks, and the
//! partial results are combined by their log-sum-exp, as the CPU rung
//! (`ladder_reference::flash_decoding`) does:
//!
//! ```text
//! phase 1, flash_decoding_split, grid (splits, heads_kv, batch):
//!     (O_s, lse_s) = FA2 over the keys of chunk s        (O_s normalised within the chunk, f32)
//! phase 2, flash_decoding_combine, one warp per output row:
//!     lse = ln Σ_s exp(lse_s),   O = Σ_s exp(lse_s − lse) · O_s     (O in the inputs' dtype)
//! ```
//!
//! **GQA packing.** One block of phase 1 handles every query head of its kv head and every new
//! token: `R = group · n_new` rows, row `r` being query head `kv_head · group + r / n_new`, token
//! `r % n_new`. K and V are read once per kv head, not once per query head.
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
//! Kernel: `cuda/flash_decoding.cu`. Not in this step: a paged cache, FlashDecoding++ (a fixed
//! softmax maximum), `group · n_new > 32` rows per kv head, head dimension 256.

use cudarc::driver::DeviceRepr;

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Output, grid};
use crate::tensor::{DType, Tensor};

const SRC: &str = include_str!("../cuda/flash_decoding.cu");

/// Head dimensions with a FlashDecoding kernel.
pub const HEAD_DIMS: &[usize] = &[64, 128];
/// Element types of the FlashDecoding kernels.
pub const DTYPES: &[DType] = &[DType::F16, DType::BF16];
/// Keys per K/V tile of the split kernel (16 per warp).
pub const BC: usize = 64;
/// Warps per block of the split kernel.
pub const WARPS: usize = 4;
/// The most new tokens per sequence.
pub const MAX_NEW_TOKENS: usize = 16;
/// The most rows (`group · n_new`, query heads per kv head times new tokens) one block handles.
pub const MAX_ROWS: usize = 32;
/// The most splits the heuristic picks ([`num_splits`]).
pub const MAX_SPLITS: usize = 128;
/// Sequences per launch: their lengths travel inside the parameter struct (no host-to-device copy
/// per call); larger batches are launched in chunks of this many.
pub const MAX_BATCH_PER_LAUNCH: usize = 256;
/// K/V tiles in shared memory per block of the split kernel on architecture `arch`: a decoding
/// block does little arithmetic per byte, so it wants many copies in flight. Hopper gets three
/// stages (two copies in flight while one tile is read; two blocks of ≤ 104 KB fit its 228 KB);
/// older GPUs two, so that two blocks still fit their 164 KB.
pub fn stages(arch: &str) -> usize {
    if arch.starts_with("sm_90") { 3 } else { 2 }
}
/// Output rows per block of the combine kernel (one warp each).
const COMBINE_ROWS_PER_BLOCK: usize = 4;

/// A KV cache: K and V `[batch, heads_kv, capacity, d]`, and the number of valid tokens per
/// sequence (the new tokens included: they are the last `n_new` valid entries).
#[derive(Clone, Copy, Debug)]
pub struct KvCache<'a> {
    /// Keys, `[batch, heads_kv, capacity, d]`.
    pub k: &'a Tensor,
    /// Values, `[batch, heads_kv, capacity, d]`.
    pub v: &'a Tensor,
    /// Valid entries of each sequence, each at most `capacity` (0 allowed).
    pub lengths: &'a [usize],
}

/// Options of [`forward`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeOptions {
    /// Softmax scale; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Number of chunks the keys of each sequence are split into (at least 1); `None` lets
    /// [`num_splits`] choose from the shape and the device.
    pub splits: Option<usize>,
}

/// How many splits fill the device: FlashAttention's `num_splits_heuristic` (wave efficiency).
///
/// `batch_heads_kv` blocks per split (one per kv head and sequence), `key_blocks` tiles of
/// [`BC`] keys in the longest sequence. With enough blocks already (at least 80 % of the SMs)
/// it is 1. Otherwise, for `s` in `1 ..= min(max_splits, key_blocks, 128)`, the last wave of
/// `batch_heads_kv · s` blocks on `sm_count` SMs is `efficiency(s) = n / ceil(n)` full
/// (`n = batch_heads_kv · s / sm_count` waves); the answer is the smallest `s` within 85 % of
/// the best efficiency. As in FlashAttention, an `s` that gives each split as many key blocks as
/// `s − 1` does is skipped (it is `s − 1` splits with an empty one).
pub fn num_splits(
    batch_heads_kv: usize,
    key_blocks: usize,
    sm_count: usize,
    max_splits: usize,
) -> usize {
    if sm_count == 0 || batch_heads_kv as f64 >= 0.8 * sm_count as f64 {
        return 1;
    }
    let max_splits = max_splits.min(key_blocks).min(MAX_SPLITS);
    let eligible = |s: usize| s == 1 || key_blocks.div_ceil(s) != key_blocks.div_ceil(s - 1);
    let efficiency = |s: usize| {
        let waves = (batch_heads_kv * s) as f64 / sm_count as f64;
        waves / waves.ceil()
    };
    let best = (1..=max_splits).filter(|&s| eligible(s)).map(efficiency).fold(0.0, f64::max);
    (1..=max_splits).find(|&s| eligible(s) && efficiency(s) >= 0.85 * best).unwrap_or(1)
}

/// The kernels' variant (both entry points live in one module) for head dimension `d`, element
/// type `dtype` and `m_tiles` 16-row mma tiles of rows.
pub(crate) fn variant(d: usize, dtype: DType, m_tiles: usize, stages: usize) -> Variant {
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

/// Every variant of this rung, for the compile check.
#[cfg(test)]
pub(crate) fn variants() -> Vec<Variant> {
    let mut all = Vec::new();
    for &dtype in DTYPES {
        for &d in HEAD_DIMS {
            for m_tiles in [1, 2] {
                for stages in [2, 3] {
                    all.push(variant(d, dtype, m_tiles, stages));
                }
            }
        }
    }
    all
}

/// Mirror of `FdParams` in `cuda/flash_decoding.cu` (device pointers as `u64`); both kernels
/// take it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params {
    q: u64,
    k: u64,
    v: u64,
    o_part: u64,
    lse_part: u64,
    o: u64,
    lse: u64,
    heads_q: i32,
    heads_kv: i32,
    n_new: i32,
    capacity: i32,
    splits: i32,
    rows: i32,
    scale_log2: f32,
    lengths: [i32; MAX_BATCH_PER_LAUNCH],
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror.
unsafe impl DeviceRepr for Params {}

/// The checked dimensions of one decoding call.
#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    n_new: usize,
    capacity: usize,
    d: usize,
    dtype: DType,
    scale: f32,
}

impl Shape {
    fn new(gpu: &Gpu, q: &Tensor, cache: &KvCache, opts: &DecodeOptions) -> Result<Shape> {
        for (name, t) in [("q", q), ("k", cache.k), ("v", cache.v)] {
            gpu.check_context(t, name)?;
        }
        let dims = |t: &Tensor, what: &str| -> Result<[usize; 4]> {
            <[usize; 4]>::try_from(t.shape())
                .map_err(|_| KernelError::Shape(format!("{what}, got shape {:?}", t.shape())))
        };
        let [batch, heads_q, n_new, d] = dims(q, "q must be [batch, heads_q, n_new, head_dim]")?;
        let [kb, heads_kv, capacity, kd] =
            dims(cache.k, "k must be [batch, heads_kv, capacity, head_dim]")?;
        if cache.v.shape() != cache.k.shape() {
            return Err(KernelError::Shape(format!(
                "v has shape {:?} but k has {:?}",
                cache.v.shape(),
                cache.k.shape()
            )));
        }
        if kb != batch || kd != d {
            return Err(KernelError::Shape(format!(
                "q {:?} and the cache {:?} differ in batch or head_dim",
                q.shape(),
                cache.k.shape()
            )));
        }
        if [batch, heads_q, n_new, d, heads_kv, capacity].contains(&0) {
            return Err(KernelError::Shape(format!(
                "every dimension must be at least 1 (q {:?}, cache {:?})",
                q.shape(),
                cache.k.shape()
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
        if cache.lengths.len() != batch {
            return Err(KernelError::Shape(format!(
                "{} lengths given for a batch of {batch}",
                cache.lengths.len()
            )));
        }
        if let Some((b, &len)) = cache.lengths.iter().enumerate().find(|&(_, &l)| l > capacity) {
            return Err(KernelError::Shape(format!(
                "lengths[{b}] = {len} exceeds the cache capacity {capacity}"
            )));
        }
        if cache.k.dtype() != q.dtype() || cache.v.dtype() != q.dtype() {
            return Err(KernelError::DType(format!(
                "q, k, v must share a dtype (got {}, {}, {})",
                q.dtype(),
                cache.k.dtype(),
                cache.v.dtype()
            )));
        }
        let dtype = q.dtype();
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
        let rows = heads_q / heads_kv * n_new;
        if rows > MAX_ROWS {
            return Err(KernelError::Config(format!(
                "flash_decoding: {} query heads per kv head × {n_new} new tokens = {rows} rows per \
                 kv head; this kernel packs at most {MAX_ROWS}",
                heads_q / heads_kv
            )));
        }
        // The kernels index rows and keys with 32-bit ints and offsets with 64 bits.
        let limit = i32::MAX as usize;
        if capacity > limit || batch.saturating_mul(heads_q).saturating_mul(n_new) > limit {
            return Err(KernelError::Shape(format!(
                "q {:?} / cache {:?} too large",
                q.shape(),
                cache.k.shape()
            )));
        }
        let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
        if !scale.is_finite() {
            return Err(KernelError::Shape(format!("scale {scale} is not finite")));
        }
        Ok(Shape { batch, heads_q, heads_kv, n_new, capacity, d, dtype, scale })
    }

    /// Rows per block of the split kernel: query heads per kv head times new tokens.
    fn rows_per_kv_head(&self) -> usize {
        self.heads_q / self.heads_kv * self.n_new
    }

    /// Output rows: `batch · heads_q · n_new`.
    fn rows(&self) -> usize {
        self.batch * self.heads_q * self.n_new
    }
}

/// Attention of `q`'s new tokens against the cache: `softmax(scale · Q Kᵀ + mask) V` and its
/// log-sum-exp, for each sequence over its first `lengths[b]` keys, causal among the new tokens
/// (see the module docs).
///
/// `q` is `[batch, heads_q, n_new, d]` with `n_new` in `1 ..= 16`, fp16 or bf16, `d` 64 or 128,
/// `heads_q` a multiple of `heads_kv` with `heads_q / heads_kv · n_new ≤ 32`. Returns `O` as `q`
/// (`[batch, heads_q, n_new, d]`, `q`'s dtype) and `lse` `[batch, heads_q, n_new]` (`f32`,
/// natural log).
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
/// let out = decode::forward(&gpu, &q, &cache, &decode::DecodeOptions::default())?;
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
pub fn forward(gpu: &Gpu, q: &Tensor, cache: &KvCache, opts: &DecodeOptions) -> Result<Output> {
    let p = Shape::new(gpu, q, cache, opts)?;
    let max_len = cache.lengths.iter().copied().max().unwrap_or(0);
    let splits = match opts.splits {
        Some(0) => {
            return Err(KernelError::Config(
                "flash_decoding: splits must be at least 1".to_string(),
            ));
        }
        Some(s) => s,
        None => num_splits(
            p.batch * p.heads_kv,
            max_len.div_ceil(BC),
            gpu.sm_count() as usize,
            MAX_SPLITS,
        ),
    };
    let splits_i = i32::try_from(splits)
        .map_err(|_| KernelError::Config(format!("flash_decoding: {splits} splits is too many")))?;
    let r = p.rows_per_kv_head();
    let m_tiles = r.div_ceil(16);
    let stages = stages(gpu.arch());
    let v = variant(p.d, p.dtype, m_tiles, stages);
    let split_kernel = Kernel { variant: v.clone(), entry: "flash_decoding_split" };
    let combine_kernel = Kernel { variant: v, entry: "flash_decoding_combine" };
    let smem = split_shared_bytes(p.d, m_tiles, stages);
    gpu.prepare(&split_kernel, smem)?;
    gpu.prepare(&combine_kernel, 0)?;

    let o_shape = [p.batch, p.heads_q, p.n_new, p.d];
    let mut o = gpu.output(&o_shape, p.dtype)?;
    let mut lse = gpu.output(&o_shape[..3], DType::F32)?;
    // Workspaces: O_s [batch, heads_q, n_new, splits, d] and lse_s [batch, heads_q, n_new, splits].
    let rows = p.rows();
    let mut o_part = gpu.output(&[rows, splits, p.d], DType::F32)?;
    let mut lse_part = gpu.output(&[rows, splits], DType::F32)?;
    let s = gpu.stream();
    let (q_ptr, _g0) = q.read_ptr(s);
    let (k_ptr, _g1) = cache.k.read_ptr(s);
    let (v_ptr, _g2) = cache.v.read_ptr(s);
    let (o_part_ptr, _g3) = o_part.write_ptr(s);
    let (lse_part_ptr, _g4) = lse_part.write_ptr(s);
    let (o_ptr, _g5) = o.write_ptr(s);
    let (lse_ptr, _g6) = lse.write_ptr(s);
    // Batches of more than MAX_BATCH_PER_LAUNCH sequences go in chunks: every tensor is
    // batch-major, so a chunk is the same call on pointers advanced by its first sequence.
    let rows_per_seq = p.heads_q * p.n_new;
    let elem = p.dtype.size();
    for first in (0..p.batch).step_by(MAX_BATCH_PER_LAUNCH) {
        let n = (p.batch - first).min(MAX_BATCH_PER_LAUNCH);
        let (row0, chunk_rows) = (first * rows_per_seq, n * rows_per_seq);
        let kv0 = first * p.heads_kv * p.capacity * p.d;
        let mut lengths = [0i32; MAX_BATCH_PER_LAUNCH];
        // Each length is at most the capacity, which fits in i32 (checked above).
        for (dst, &len) in lengths.iter_mut().zip(&cache.lengths[first..first + n]) {
            *dst = len as i32;
        }
        let at = |ptr: u64, elements: usize, size: usize| ptr + (elements * size) as u64;
        let params = Params {
            q: at(q_ptr, row0 * p.d, elem),
            k: at(k_ptr, kv0, elem),
            v: at(v_ptr, kv0, elem),
            o_part: at(o_part_ptr, row0 * splits * p.d, 4),
            lse_part: at(lse_part_ptr, row0 * splits, 4),
            o: at(o_ptr, row0 * p.d, elem),
            lse: at(lse_ptr, row0, 4),
            heads_q: p.heads_q as i32,
            heads_kv: p.heads_kv as i32,
            n_new: p.n_new as i32,
            capacity: p.capacity as i32,
            splits: splits_i,
            rows: chunk_rows as i32,
            scale_log2: p.scale * std::f32::consts::LOG2_E,
            lengths,
        };
        let split_grid = grid(splits, p.heads_kv, n)?;
        let combine_grid = grid(chunk_rows.div_ceil(COMBINE_ROWS_PER_BLOCK), 1, 1)?;
        gpu.launch(&split_kernel, split_grid, 32 * WARPS as u32, smem, &params)?;
        gpu.launch(&combine_kernel, combine_grid, 32 * COMBINE_ROWS_PER_BLOCK as u32, 0, &params)?;
    }
    drop((_g0, _g1, _g2, _g3, _g4, _g5, _g6));
    Ok(Output { o, lse })
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
        // One block: efficiency grows with s, so the smallest s within 85 % of the largest.
        assert_eq!(num_splits(1, 1000, 132, 16), 14);
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
        for d in HEAD_DIMS {
            for mt in [1, 2] {
                // Two blocks per SM fit on sm_80 (164 KB) and sm_90 (228 KB, 1 KB per block
                // reserved).
                assert!(2 * split_shared_bytes(*d, mt, stages("sm_80")) <= 164 * 1024);
                assert!(2 * (split_shared_bytes(*d, mt, stages("sm_90a")) + 1024) <= 228 * 1024);
            }
        }
    }
}
