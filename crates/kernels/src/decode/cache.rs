//! The KV caches a decoding call reads: contiguous ([`KvCache`]), or in pages through a page
//! table ([`PagedKvCache`], [`PageTable`]), and what the checks know of a table's entries.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::*;

/// A contiguous KV cache: K and V `[batch, heads_kv, capacity, d]`, and the number of valid
/// tokens per sequence (the new tokens included: they are the last `n_new` valid entries).
///
/// K and V take any batch, head and token strides with the head dimension contiguous (multiples
/// of 8 elements), the same for both: FlashAttention's `k_cache` `[batch, capacity, heads_kv, d]`
/// is `Tensor::transpose(1, 2)` of it, and K and V may be two slots of one buffer.
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
/// d]`, and a [`PageTable`] whose row `b` lists the pages of sequence `b` in order: key `j` of
/// sequence `b` is slot `j % page_size` of page `page_table[b][j / page_size]`.
///
/// The pages take any strides with the head dimension contiguous, the same for K and V: in
/// memory FlashInfer's `HND` (`[num_pages, heads_kv, page_size, d]`, each head's tokens
/// contiguous) as it is, vLLM's and FlashAttention's `NHD` (`[num_pages, page_size, heads_kv,
/// d]`) through `Tensor::transpose(1, 2)`.
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
    pub(super) fn buffers(&self) -> (&'a Tensor, &'a Tensor, Option<&'a PageTable>) {
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
    pub(super) table: CudaSlice<i32>,
    pub(super) info: TableInfo,
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

    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        self.table.stream()
    }
}

/// What the checks know of a page table: its shape, and its entries if they were seen on the host.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct TableInfo {
    pub(super) batch: usize,
    pub(super) max_pages: usize,
    pub(super) host: Option<HostEntries>,
}

impl TableInfo {
    pub(super) fn new(batch: usize, max_pages: usize) -> Result<TableInfo> {
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
    pub(super) fn check(
        &self,
        lengths: &[usize],
        page_size: usize,
        num_pages: usize,
    ) -> Result<()> {
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
pub(super) struct HostEntries {
    pub(super) entries: Vec<i32>,
    pub(super) prefix_max: Vec<i32>,
    pub(super) max_pages: usize,
}

impl HostEntries {
    pub(super) fn new(entries: &[i32], batch: usize, max_pages: usize) -> Result<HostEntries> {
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
    pub(super) fn check_row(&self, b: usize, needed: usize, num_pages: usize) -> Result<()> {
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
