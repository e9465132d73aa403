//! What a rung returns: the output, the log-sum-exp, and what the run cost under its memory model.

use std::sync::atomic::{AtomicU64, Ordering};

use ndarray::{Array1, Array3, Array4};

/// The result of a forward rung.
#[derive(Debug, Clone)]
pub struct AttentionOutput<T> {
    /// `O`, shape `[batch, heads_q, n_q, d]`.
    pub o: Array4<T>,
    /// Natural-log log-sum-exp of each row's scaled scores, shape `[batch, heads_q, n_q]`;
    /// `−∞` for a row that sees no key.
    pub lse: Array3<T>,
    pub stats: RunStats,
}

/// The result of a backward rung: gradients of a loss with respect to `Q, K, V` (and the
/// sinks, when the problem has them).
#[derive(Debug, Clone)]
pub struct Gradients<T> {
    pub dq: Array4<T>,
    pub dk: Array4<T>,
    pub dv: Array4<T>,
    /// `∂L/∂σ_h`, one per query head ([`crate::sinks`]); `None` without sinks.
    pub dsinks: Option<Array1<T>>,
    pub stats: RunStats,
}

/// What a run did, counted as it ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Bytes moved between HBM and SRAM under the rung's memory model.
    pub hbm: HbmTraffic,
    /// Tiles computed, masked and skipped (blocked rungs only).
    pub tiles: TileCounts,
    /// Independent units of work, the thread blocks a GPU would launch
    /// (for a split rung: those of its first, parallel phase).
    pub work_items: usize,
    /// Rows recomputed by the fallback path (FlashDecoding++ only).
    pub fallback_rows: Option<usize>,
}

impl RunStats {
    /// These counts with `other`'s added (the runs of a batch, one sequence after another):
    /// traffic, tiles, work items and fallback rows.
    pub fn add(&mut self, other: &RunStats) {
        self.hbm.read_bytes += other.hbm.read_bytes;
        self.hbm.written_bytes += other.hbm.written_bytes;
        self.tiles.full += other.tiles.full;
        self.tiles.partial += other.tiles.partial;
        self.tiles.skipped += other.tiles.skipped;
        self.work_items += other.work_items;
        self.fallback_rows = match (self.fallback_rows, other.fallback_rows) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
    }
}

/// Bytes read from and written to HBM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HbmTraffic {
    pub read_bytes: u64,
    pub written_bytes: u64,
}

impl HbmTraffic {
    pub fn total_bytes(&self) -> u64 {
        self.read_bytes + self.written_bytes
    }
}

/// How the tiles of a blocked rung met the mask.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileCounts {
    /// Tiles computed without a mask.
    pub full: u64,
    /// Tiles computed and then masked (on the causal diagonal, a window's edge, where a mask
    /// modifier hides some of their pairs).
    pub partial: u64,
    /// Tiles the masks hide entirely (above the diagonal, outside a window, between documents),
    /// not computed at all.
    pub skipped: u64,
}

impl TileCounts {
    pub fn computed(&self) -> u64 {
        self.full + self.partial
    }
}

/// Thread-safe counters the rungs bump as they run (tiles are processed in parallel).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    elem_bytes: u64,
    read: AtomicU64,
    written: AtomicU64,
    full: AtomicU64,
    partial: AtomicU64,
    skipped: AtomicU64,
}

impl Counters {
    /// Counters for tensors whose elements take `elem_bytes` bytes in HBM.
    pub fn new(elem_bytes: usize) -> Self {
        Self { elem_bytes: elem_bytes as u64, ..Self::default() }
    }

    /// Counts `elems` elements read from HBM.
    pub fn read(&self, elems: usize) {
        self.read.fetch_add(elems as u64 * self.elem_bytes, Ordering::Relaxed);
    }

    /// Counts `elems` elements written to HBM.
    pub fn write(&self, elems: usize) {
        self.written.fetch_add(elems as u64 * self.elem_bytes, Ordering::Relaxed);
    }

    /// Counts raw bytes read (for tensors stored in another precision, such as FP8).
    pub fn read_bytes(&self, bytes: usize) {
        self.read.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn tile(&self, kind: crate::TileKind) {
        let counter = match kind {
            crate::TileKind::Full => &self.full,
            crate::TileKind::Partial => &self.partial,
            crate::TileKind::Skip => &self.skipped,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self, work_items: usize) -> RunStats {
        RunStats {
            hbm: HbmTraffic {
                read_bytes: self.read.load(Ordering::Relaxed),
                written_bytes: self.written.load(Ordering::Relaxed),
            },
            tiles: TileCounts {
                full: self.full.load(Ordering::Relaxed),
                partial: self.partial.load(Ordering::Relaxed),
                skipped: self.skipped.load(Ordering::Relaxed),
            },
            work_items,
            fallback_rows: None,
        }
    }
}
