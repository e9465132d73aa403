//! Packed variable-length batches on the GPU: sequences of different lengths laid back to back,
//! as a serving engine batches ragged prompts (FlashAttention's `flash_attn_varlen_func`).
//!
//! Q is `[total_q, heads_q, d]` and K, V are `[total_k, heads_kv, d]` (any strides but the last:
//! a `[total, 3, heads, d]` QKV projection's slices need no copy). Sequence `b` owns rows
//! `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` of Q and `cu_seqlens_k[b] .. cu_seqlens_k[b + 1]` of K
//! and V ([`SeqLens`], `batch + 1` int32 offsets each, on the device), and is an attention problem
//! of its own: its own tails, its own bottom-right causal diagonal, GQA as in the fixed-length
//! rungs. O comes back `[total_q, heads_q, d]` (laid out like Q) and lse `[heads_q, total_q]`,
//! FlashAttention's varlen layouts. A sequence without keys gets `O = 0`, `lse = −∞`; one without
//! queries costs nothing.
//!
//! **No tile of padding.** The kernels do not launch `batch × ceil(longest / br)` blocks and let
//! the ones past a sequence's end return: the host lists the query blocks that exist, as
//! (sequence, block) pairs in the order they should run, and each thread block (FA2) or each
//! step of a persistent block's walk (FA3) takes the pair its index names (`cuda/varlen.cuh`).
//! The list is longest sequence first and, under the causal mask, each sequence's last (longest)
//! query block first, so that the last wave is made of short blocks; it is built once per tile
//! height and mask and kept with the offsets.
//!
//! The backward ([`crate::fa2::backward_varlen`]) lists key blocks the same way
//! ([`key_tile_order`]) for its main kernel, one thread block per key block of one sequence, and
//! query blocks for its deterministic dQ pass.
//!
//! Rungs: [`crate::fa2::forward_varlen`] and [`crate::fa2::backward_varlen`],
//! [`crate::fa3::forward_varlen`] and [`crate::fa3::fp8::forward_varlen`] (which quantises each
//! sequence on its own). The CPU rungs' definition of the same batches is
//! `ladder_reference::varlen`.
//!
//! ```no_run
//! use ladder_kernels::{DType, Gpu, Options, fa2, varlen::SeqLens};
//!
//! let gpu = Gpu::new()?;
//! // Three prompts of 5, 300 and 40 tokens, attending to themselves.
//! let lens = SeqLens::from_lengths(&gpu, &[5, 300, 40], &[5, 300, 40])?;
//! let (total, heads, d) = (345, 8, 96);
//! let x = vec![0.1f32; total * heads * d];
//! let q = gpu.upload(&x, &[total, heads, d], DType::F16)?;
//! let k = gpu.upload(&x, &[total, heads, d], DType::F16)?;
//! let v = gpu.upload(&x, &[total, heads, d], DType::F16)?;
//! let out = fa2::forward_varlen(&gpu, &q, &k, &v, &lens, &Options::causal())?;
//! assert_eq!((out.o.shape(), out.lse.shape()), (&[total, heads, d][..], &[heads, total][..]));
//! # Ok::<(), ladder_kernels::KernelError>(())
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, SyncOnDrop};

use crate::error::{KernelError, Result};
use crate::gpu::Gpu;

/// The offsets of a packed batch's sequences, on the device for the kernels and on the host for
/// the checks (made by [`SeqLens::upload`], [`SeqLens::from_lengths`], or
/// [`SeqLens::from_cuda_slices`], which copies device offsets back once to check them).
///
/// Checked once, when it is made: `batch + 1` offsets each for Q and K (`batch ≥ 1`), starting at
/// 0, never decreasing (a sequence may be empty), below 2³¹. Each call checks that the last ones
/// are the tensors' token counts.
#[derive(Debug)]
pub struct SeqLens {
    cu_q: CudaSlice<i32>,
    cu_k: CudaSlice<i32>,
    host_q: Vec<usize>,
    host_k: Vec<usize>,
    /// The tile tables made so far.
    tables: Mutex<HashMap<TableKey, Arc<TileTable>>>,
}

/// What a tile table depends on: whether its blocks are of keys, rows per block, and the mask.
type TableKey = (bool, usize, bool);

/// The query blocks (or key blocks) of a packed batch in the order they run: `(sequence, block)`
/// pairs, `i32`.
#[derive(Debug)]
pub(crate) struct TileTable {
    pairs: CudaSlice<i32>,
    len: usize,
}

impl SeqLens {
    /// Uploads `cu_seqlens_q` and `cu_seqlens_k` (`batch + 1` offsets each), checked.
    pub fn upload(gpu: &Gpu, cu_seqlens_q: &[i32], cu_seqlens_k: &[i32]) -> Result<SeqLens> {
        let host = host_offsets(cu_seqlens_q, cu_seqlens_k)?;
        let upload = |values: &[i32]| {
            gpu.stream()
                .clone_htod(values)
                .map_err(KernelError::alloc(std::mem::size_of_val(values)))
        };
        Ok(SeqLens::from_parts((upload(cu_seqlens_q)?, upload(cu_seqlens_k)?), host))
    }

    /// The offsets of sequences with `q_lens[b]` queries and `k_lens[b]` keys.
    pub fn from_lengths(gpu: &Gpu, q_lens: &[usize], k_lens: &[usize]) -> Result<SeqLens> {
        let prefix = |name: &str, lens: &[usize]| -> Result<Vec<i32>> {
            let mut cu = Vec::with_capacity(lens.len() + 1);
            let mut total = 0usize;
            cu.push(0);
            for &len in lens {
                total = total.saturating_add(len);
                cu.push(i32::try_from(total).map_err(|_| {
                    KernelError::Shape(format!(
                        "{name}: {total} tokens exceed the kernels' 32-bit offsets"
                    ))
                })?);
            }
            Ok(cu)
        };
        SeqLens::upload(gpu, &prefix("q_lens", q_lens)?, &prefix("k_lens", k_lens)?)
    }

    /// Offsets already on the device (no copy for the kernels), with the longest lengths the
    /// caller planned for (`max_seqlen_q`, `max_seqlen_k`, as FlashAttention takes them). The
    /// offsets are copied to the host once, to be checked (it waits for the work queued on their
    /// stream): an offset list that is not increasing, or a sequence longer than its longest
    /// length, is an error here rather than a wrong answer later.
    pub fn from_cuda_slices(
        cu_seqlens_q: CudaSlice<i32>,
        cu_seqlens_k: CudaSlice<i32>,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<SeqLens> {
        let download = |name: &str, s: &CudaSlice<i32>| {
            s.stream()
                .clone_dtoh(s)
                .map_err(KernelError::driver(format!("copying {name} to the host")))
        };
        let (host_q, host_k) = host_offsets(
            &download("cu_seqlens_q", &cu_seqlens_q)?,
            &download("cu_seqlens_k", &cu_seqlens_k)?,
        )?;
        for (name, cu, max) in [("q", &host_q, max_seqlen_q), ("k", &host_k, max_seqlen_k)] {
            if let Some(b) = cu.windows(2).position(|w| w[1] - w[0] > max) {
                return Err(KernelError::Shape(format!(
                    "max_seqlen_{name} = {max}, but sequence {b} has {} {}",
                    cu[b + 1] - cu[b],
                    if name == "q" { "queries" } else { "keys" }
                )));
            }
        }
        Ok(SeqLens::from_parts((cu_seqlens_q, cu_seqlens_k), (host_q, host_k)))
    }

    /// The offsets on the device and their checked host copies ([`host_offsets`]).
    fn from_parts(
        (cu_q, cu_k): (CudaSlice<i32>, CudaSlice<i32>),
        (host_q, host_k): (Vec<usize>, Vec<usize>),
    ) -> SeqLens {
        SeqLens { cu_q, cu_k, host_q, host_k, tables: Mutex::default() }
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.host_q.len() - 1
    }

    /// `(total_q, total_k)`: the token counts of Q and of K, V.
    pub fn totals(&self) -> (usize, usize) {
        (self.host_q[self.batch()], self.host_k[self.batch()])
    }

    /// `(longest query length, longest key length)`.
    pub fn max_lengths(&self) -> (usize, usize) {
        let longest = |cu: &[usize]| cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        (longest(&self.host_q), longest(&self.host_k))
    }

    /// Rows of Q (and O) of sequence `b`.
    pub fn q_range(&self, b: usize) -> Range<usize> {
        self.host_q[b]..self.host_q[b + 1]
    }

    /// Rows of K and V of sequence `b`.
    pub fn k_range(&self, b: usize) -> Range<usize> {
        self.host_k[b]..self.host_k[b + 1]
    }

    /// The device offsets, `(cu_seqlens_q, cu_seqlens_k)`.
    pub fn as_cuda_slices(&self) -> (&CudaSlice<i32>, &CudaSlice<i32>) {
        (&self.cu_q, &self.cu_k)
    }

    /// The checked host copies of the offsets: `cu_seqlens_q`, `cu_seqlens_k`.
    pub(crate) fn offsets(&self) -> (&[usize], &[usize]) {
        (&self.host_q, &self.host_k)
    }

    /// Fails unless the offsets live where `gpu` runs.
    pub(crate) fn check_context(&self, gpu: &Gpu) -> Result<()> {
        gpu.check_stream(self.cu_q.stream(), "cu_seqlens_q")?;
        gpu.check_stream(self.cu_k.stream(), "cu_seqlens_k")
    }

    /// The query blocks of `rows` rows in the order they should run ([`tile_order`]): made on
    /// the first call for these `rows` and mask, then kept.
    pub(crate) fn tiles(&self, gpu: &Gpu, rows: usize, causal: bool) -> Result<Arc<TileTable>> {
        self.table(gpu, (false, rows, causal))
    }

    /// The key blocks of `keys` keys in the order they should run ([`key_tile_order`]), kept as
    /// [`SeqLens::tiles`] keeps its tables.
    pub(crate) fn key_tiles(&self, gpu: &Gpu, keys: usize, causal: bool) -> Result<Arc<TileTable>> {
        self.table(gpu, (true, keys, causal))
    }

    fn table(&self, gpu: &Gpu, key: TableKey) -> Result<Arc<TileTable>> {
        let mut tables = self.tables.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(table) = tables.get(&key) {
            return Ok(table.clone());
        }
        let (of_keys, rows, causal) = key;
        let order = if of_keys {
            key_tile_order(&self.host_q, &self.host_k, rows, causal)
        } else {
            tile_order(&self.host_q, &self.host_k, rows, causal)
        };
        let len = order.len();
        if len > i32::MAX as usize {
            return Err(KernelError::Shape(format!(
                "{len} blocks exceed the kernels' 32-bit tile index"
            )));
        }
        // Both below 2^31: sequences are counted by i32 offsets, blocks by the check above.
        let pairs: Vec<i32> =
            order.iter().flat_map(|&(b, block)| [b as i32, block as i32]).collect();
        let pairs = gpu
            .stream()
            .clone_htod(&pairs)
            .map_err(KernelError::alloc(std::mem::size_of_val(&pairs[..])))?;
        let table = Arc::new(TileTable { pairs, len });
        tables.insert(key, table.clone());
        Ok(table)
    }
}

/// The query blocks of `rows` rows of the sequences at offsets `cu_q`, `cu_k` (`batch + 1` each),
/// as `(sequence, block)` pairs in the order the kernels run them: sequences by their work (score
/// entries computed), most first; within one, under the mask, the last query block (the most
/// keys) first. A sequence without queries has no block. (What [`crate::fa2::forward_varlen`]
/// and [`crate::fa3::forward_varlen`] launch, for `rows` their query tile: 128 for FA2 at d ≤ 128
/// and FA3 at d > 64, see their tile tables.)
pub fn tile_order(
    cu_q: &[usize],
    cu_k: &[usize],
    rows: usize,
    causal: bool,
) -> Vec<(usize, usize)> {
    let blocks = |b: usize| len(cu_q, b).div_ceil(rows);
    let work = |b: usize, block: usize| -> usize {
        let (n_q, n_kv) = (len(cu_q, b), len(cu_k, b));
        let last_row = (block * rows + rows - 1).min(n_q - 1);
        if causal { (last_row + 1 + n_kv).saturating_sub(n_q).min(n_kv) } else { n_kv }
    };
    by_work(cu_q.len() - 1, blocks, work, causal)
}

/// The key blocks of `keys` keys of the same sequences, in the order the backward's main kernel
/// ([`crate::fa2::backward_varlen`]) runs them: as [`tile_order`], sequences by their work, most
/// first; within one, in order, which under the mask is the most work first (a key block's work
/// is the query rows that see it: all but those before the diagonal reaches it). A sequence
/// without keys has no block; one without queries has its blocks (they write zero gradients).
pub fn key_tile_order(
    cu_q: &[usize],
    cu_k: &[usize],
    keys: usize,
    causal: bool,
) -> Vec<(usize, usize)> {
    let blocks = |b: usize| len(cu_k, b).div_ceil(keys);
    let work = |b: usize, block: usize| -> usize {
        let (n_q, n_kv) = (len(cu_q, b), len(cu_k, b));
        // Query i sees key j when j <= i + n_kv − n_q: the block's first key, from row
        // first − (n_kv − n_q) on.
        let first_row = (block * keys + n_q).saturating_sub(n_kv);
        if causal { n_q.saturating_sub(first_row) } else { n_q }
    };
    by_work(cu_k.len() - 1, blocks, work, false)
}

/// Length of sequence `b` of the offsets `cu`.
fn len(cu: &[usize], b: usize) -> usize {
    cu[b + 1] - cu[b]
}

/// `(sequence, block)` pairs of `batch` sequences with `blocks(b)` blocks each: sequences by their
/// summed `work`, most first (ties by index); within one, blocks in order or (`last_first`) in
/// reverse.
fn by_work(
    batch: usize,
    blocks: impl Fn(usize) -> usize,
    work: impl Fn(usize, usize) -> usize,
    last_first: bool,
) -> Vec<(usize, usize)> {
    let mut sequences: Vec<(usize, usize)> = (0..batch)
        .filter(|&b| blocks(b) > 0)
        .map(|b| (b, (0..blocks(b)).map(|block| work(b, block)).sum()))
        .collect();
    sequences.sort_by_key(|&(b, total)| (std::cmp::Reverse(total), b));
    let mut pairs = Vec::new();
    for (b, _) in sequences {
        for i in 0..blocks(b) {
            pairs.push((b, if last_first { blocks(b) - 1 - i } else { i }));
        }
    }
    pairs
}

impl TileTable {
    /// Number of query blocks.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Mirror of `Varlen` in `cuda/varlen.cuh` (device pointers as `u64`; all zero for a
/// fixed-length batch, which never reads them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct VarlenParams {
    cu_q: u64,
    cu_k: u64,
    tiles: u64,
    n_tiles: i32,
    total_q: i32,
    total_k: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers, laid out as its CUDA mirror.
unsafe impl DeviceRepr for VarlenParams {}

impl VarlenParams {
    /// The kernels' view of a packed batch's offsets and tile table, with the guards that order
    /// the launch after their uploads (and their eventual frees after the launch): keep them
    /// until the kernel is queued. For a fixed-length batch (`None`), zeros, which its kernel
    /// never reads, and no guards.
    pub(crate) fn of<'a>(
        gpu: &'a Gpu,
        packed: Option<(&'a SeqLens, &'a TileTable)>,
    ) -> (VarlenParams, Option<[SyncOnDrop<'a>; 3]>) {
        let Some((lens, table)) = packed else { return (VarlenParams::default(), None) };
        let s = gpu.stream();
        let (cu_q, g0) = lens.cu_q.device_ptr(s);
        let (cu_k, g1) = lens.cu_k.device_ptr(s);
        let (tiles, g2) = table.pairs.device_ptr(s);
        // Both counts are below 2^31: the offsets are i32, the table's length is checked.
        let n_tiles = table.len as i32;
        let (total_q, total_k) = lens.totals();
        let (total_q, total_k) = (total_q as i32, total_k as i32);
        (VarlenParams { cu_q, cu_k, tiles, n_tiles, total_q, total_k }, Some([g0, g1, g2]))
    }
}

/// Checked offsets `cu` (named `name`), widened.
fn offsets(name: &str, cu: &[i32]) -> Result<Vec<usize>> {
    if cu.len() < 2 {
        return Err(KernelError::Shape(format!(
            "{name} has {} entries: it needs batch + 1 (at least 2)",
            cu.len()
        )));
    }
    if cu[0] != 0 {
        return Err(KernelError::Shape(format!("{name} starts at {}, not 0", cu[0])));
    }
    if let Some(b) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(KernelError::Shape(format!(
            "{name} decreases at sequence {b}: {} then {}",
            cu[b],
            cu[b + 1]
        )));
    }
    Ok(cu.iter().map(|&x| x as usize).collect())
}

/// Both offset lists checked ([`offsets`]) and of one batch, widened.
fn host_offsets(cu_q: &[i32], cu_k: &[i32]) -> Result<(Vec<usize>, Vec<usize>)> {
    let (q, k) = (offsets("cu_seqlens_q", cu_q)?, offsets("cu_seqlens_k", cu_k)?);
    same_batch(&q, &k)?;
    Ok((q, k))
}

fn same_batch(q: &[usize], k: &[usize]) -> Result<()> {
    if q.len() == k.len() {
        Ok(())
    } else {
        Err(KernelError::Shape(format!(
            "cu_seqlens_q has {} entries and cu_seqlens_k {}: batch + 1 each",
            q.len(),
            k.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`tile_order`] of sequences of `q` queries and `k` keys, as pairs.
    fn order(q: &[usize], k: &[usize], rows: usize, causal: bool) -> Vec<(i32, i32)> {
        let prefix = |lens: &[usize]| -> Vec<usize> {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |t, &l| {
                    *t += l;
                    Some(*t)
                }))
                .collect()
        };
        let pairs = tile_order(&prefix(q), &prefix(k), rows, causal);
        pairs.into_iter().map(|(b, block)| (b as i32, block as i32)).collect()
    }

    #[test]
    fn offsets_are_checked() {
        assert!(offsets("cu", &[0, 3, 5]).is_ok());
        assert!(offsets("cu", &[0, 3, 3, 5]).is_ok(), "an empty sequence is allowed");
        for (bad, says) in [
            (&[0][..], "at least 2"),
            (&[1, 3][..], "starts at 1"),
            (&[0, 5, 3][..], "decreases at sequence 1"),
        ] {
            let e = offsets("cu", bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        assert!(same_batch(&[0, 1], &[0, 1, 2]).unwrap_err().to_string().contains("batch + 1"));
    }

    #[test]
    fn tiles_run_longest_first_and_skip_empty_sequences() {
        // Sequences of 300, 0, 1000 and 64 queries (self-attention), 128-row blocks.
        let lens = [300, 0, 1000, 64];
        let causal = order(&lens, &lens, 128, true);
        let blocks = |s: i32| causal.iter().filter(|t| t.0 == s).count();
        assert_eq!((blocks(0), blocks(1), blocks(2), blocks(3)), (3, 0, 8, 1));
        assert_eq!(causal.len(), 12, "no block for padding");
        // Most work first, and each sequence's last block (the most keys) first.
        assert_eq!(&causal[..3], &[(2, 7), (2, 6), (2, 5)]);
        assert_eq!(causal[8..], [(0, 2), (0, 1), (0, 0), (3, 0)]);
        let full = order(&lens, &lens, 128, false);
        assert_eq!(&full[..2], &[(2, 0), (2, 1)]);
        assert_eq!(full.last(), Some(&(3, 0)));
        // Keys without queries, and queries without keys: the latter still run (they write O = 0
        // and lse = −inf), last.
        let keyless = order(&[10, 5], &[0, 7], 64, true);
        assert_eq!(keyless, vec![(1, 0), (0, 0)]);
    }

    #[test]
    fn key_blocks_run_most_work_first_and_skip_keyless_sequences() {
        let prefix = |lens: &[usize]| -> Vec<usize> {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |t, &l| {
                    *t += l;
                    Some(*t)
                }))
                .collect()
        };
        // Sequences of (queries, keys) (300, 300), (5, 0), (0, 200), (1000, 1000); 128-key blocks.
        let (q, k) = (prefix(&[300, 5, 0, 1000]), prefix(&[300, 0, 200, 1000]));
        let causal = key_tile_order(&q, &k, 128, true);
        let blocks = |s: usize| causal.iter().filter(|t| t.0 == s).count();
        assert_eq!((blocks(0), blocks(1), blocks(2), blocks(3)), (3, 0, 2, 8));
        // The longest sequence first, its first block (seen by every query) first; the keys
        // without queries last (no work, but their zero gradients are written).
        assert_eq!(&causal[..2], &[(3, 0), (3, 1)]);
        assert_eq!(&causal[8..], &[(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]);
        // Causal work of a key block: the rows from where the diagonal reaches its first key.
        let one = key_tile_order(&prefix(&[256, 10]), &prefix(&[256, 300]), 128, true);
        assert_eq!(one, vec![(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]);
        assert_eq!(key_tile_order(&q, &k, 128, false).len(), 13);
    }
}
