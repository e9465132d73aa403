//! FlashDecoding++'s third idea, the heuristic dataflow: which kernel runs a decoding call, and
//! with how many splits.
//!
//! [`Strategy`] names the choices (forced through [`super::DecodeOptions::strategy`], or
//! [`Strategy::Auto`]); [`dispatch`] is the decision table of an automatic call and [`plan`] what
//! a call with given options runs. The crossovers are the constants [`GEMV_MAX_ROWS`],
//! [`FLAT_GEMM_MAX_ROWS`], [`PP_MIN_KEYS`] and [`PP_IN_AUTO`], here and nowhere else; they are first guesses, to
//! be replaced by the crossovers measured on the H200 (`ladder bench --direction decode` with
//! `--rung flash-decoding,flash-decoding-pp` and `--pp-kernel`).

use std::fmt;
use std::str::FromStr;

use super::{BC, MAX_SPLITS, num_splits, row_blocks};
use crate::error::{KernelError, Result};

/// How a decoding call is computed.
///
/// The names are the paper's (Hong et al. 2024): FlashDecoding's split-KV kernel with its running
/// max, or FlashDecoding++'s unified max `φ` with one of its two GEMM shapes for few rows, the
/// *flat GEMM* (tensor cores, the query rows padded to 8 instead of 16) and the *GEMV* (CUDA
/// cores, one query row). All of them compute the same attention within the tolerance rule; a
/// FlashDecoding++ row whose scores leave `φ`'s safe window is recomputed against its own
/// largest score.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// The heuristic dataflow picks one of the others ([`dispatch`]).
    #[default]
    Auto,
    /// FlashDecoding: m16 tensor-core tiles, online softmax, log-sum-exp combine
    /// (`flash_decoding.cu`).
    FlashDecoding,
    /// FlashDecoding++ with the GEMM shape picked by the rows per kv head: [`Strategy::Gemv`]
    /// for one row, [`Strategy::FlatGemm`] otherwise.
    FlashDecodingPp,
    /// FlashDecoding++ on CUDA cores, one query row per block (`flash_decoding_pp.cu`,
    /// `FDPP_GEMV = 1`); meant for one row per kv head (multi-head attention, one new token).
    Gemv,
    /// FlashDecoding++ with the flat GEMM: `Sᵀ = K·Qᵀ` on the tensor cores, the keys as the mma's
    /// M and the query rows padded to 8 (16 rows per block at most; `flash_decoding_pp.cu`).
    FlatGemm,
}

impl Strategy {
    /// Every strategy, `Auto` first.
    pub const ALL: [Strategy; 5] = [
        Strategy::Auto,
        Strategy::FlashDecoding,
        Strategy::FlashDecodingPp,
        Strategy::Gemv,
        Strategy::FlatGemm,
    ];

    /// The name in flags and tables: `auto`, `flash-decoding`, `flash-decoding-pp`, `gemv`,
    /// `flat-gemm`.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::FlashDecoding => "flash-decoding",
            Strategy::FlashDecodingPp => "flash-decoding-pp",
            Strategy::Gemv => "gemv",
            Strategy::FlatGemm => "flat-gemm",
        }
    }

    /// Whether it is one of FlashDecoding++'s (unified max, fallback rows).
    pub fn is_pp(self) -> bool {
        matches!(self, Strategy::FlashDecodingPp | Strategy::Gemv | Strategy::FlatGemm)
    }

    /// The kernel it runs for `work`: `Auto` is resolved by [`dispatch`], `FlashDecodingPp` by
    /// the rows; the others are themselves.
    fn kernel(self, work: &Workload, sm_count: usize) -> Strategy {
        match self {
            Strategy::Auto => dispatch(work, sm_count).strategy,
            Strategy::FlashDecodingPp if work.rows_per_kv_head <= GEMV_MAX_ROWS => Strategy::Gemv,
            Strategy::FlashDecodingPp => Strategy::FlatGemm,
            other => other,
        }
    }
}

impl fmt::Display for Strategy {
    /// The [`Strategy::name`], padded as the format asks (`{:>15}`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Strategy {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Strategy> {
        Strategy::ALL.into_iter().find(|x| x.name() == s.trim()).ok_or_else(|| {
            let names: Vec<&str> = Strategy::ALL.iter().map(|x| x.name()).collect();
            KernelError::Config(format!("no decoding strategy `{s}` (known: {})", names.join(", ")))
        })
    }
}

// ---- the crossovers -----------------------------------------------------------------------------

/// Rows per kv head (query heads per kv head × new tokens) up to which the automatic choice is the
/// GEMV: one row, where even the flat GEMM's 8-row tile is 7/8 padding.
pub const GEMV_MAX_ROWS: usize = 1;
/// Rows per kv head up to which the automatic choice is the flat GEMM (two 8-row tiles per
/// block; one at d = 256, where 16 rows take two flat blocks that each read the cache); past it
/// FlashDecoding's 16-row tiles are full and its 32-row blocks (16 at d = 256) read the cache
/// once per block.
pub const FLAT_GEMM_MAX_ROWS: usize = 16;
/// Cache entries per call (longest length × batch × kv heads) below which the automatic choice is
/// FlashDecoding whatever the rows: such a call moves a few MB in a few microseconds, where the
/// rescaling FlashDecoding++ saves is worth less than its larger workspace (two sums and a maximum
/// per split). `1 << 16` entries are 32 MB of K and V at `d = 128` in fp16 (about 7 µs at
/// 4.8 TB/s).
pub const PP_MIN_KEYS: usize = 1 << 16;

/// Whether the automatic choice ever takes FlashDecoding++'s kernels. Measured on the H200
/// (`examples/decode_bandwidth.rs`, every strategy and split count on the five reference decode
/// shapes, 2026-11-30): they tie FlashDecoding where the card's bandwidth is the limit (4.49 vs
/// 4.52 TB/s at B1 32/32 128k, 4.62 vs 4.63 at B16 32/32 32k) and lose on short calls (3.13 vs
/// 3.44 at B1 32/32 8k, 1.23 vs 2.16 at B1 32/8 8k), so `Auto` stays with FlashDecoding on this
/// card. With FlashDecoding++'s fallback moved into its one launch (H100, 2026-12-06,
/// `docs/results/history/h100-fdpp-in-launch`) it ties FlashDecoding (0.96–1.00× on the reference
/// shapes with one new token) but still wins nowhere, and loses 21 % with 16 rows per kv head at
/// batch 1: still off. The table below is what it would do with this switched on (and what
/// [`Strategy::FlashDecodingPp`] picks between its two kernels).
pub const PP_IN_AUTO: bool = false;

/// What the heuristics see of a decoding call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Query heads per kv head times new tokens.
    pub rows_per_kv_head: usize,
    /// The longest sequence's length.
    pub max_len: usize,
    /// `batch · heads_kv`.
    pub batch_heads_kv: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Whether the cache is paged.
    pub paged: bool,
}

impl Workload {
    /// Blocks per SM the split count fills ([`split_count`]): [`PAGED_BLOCKS_PER_SM`] for a
    /// paged cache where that many blocks fit on an SM (`head_dim` ≤ 128 with the default K/V
    /// stages: a block of `head_dim` = 256 takes 200 KB of shared memory, the Q tile and three
    /// 64-key stages), otherwise one.
    pub fn blocks_per_sm(&self) -> usize {
        if self.paged && self.head_dim <= 128 { PAGED_BLOCKS_PER_SM } else { 1 }
    }
}

/// The kernel and split count of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// [`Strategy::FlashDecoding`], [`Strategy::Gemv`] or [`Strategy::FlatGemm`] (never `Auto` or
    /// `FlashDecodingPp`, which resolve to one of those).
    pub strategy: Strategy,
    /// Splits of each sequence's keys.
    pub splits: usize,
}

impl Plan {
    /// Whether a call of this plan asked for [`super::DecodeOptions::atomic_sums`] adds its
    /// splits' partials with atomics: FlashDecoding++ with more than one split (with one there is
    /// nothing to add, and the workspace's round trip costs the same as the sums').
    pub fn sums_atomically(self, atomic_sums: bool) -> bool {
        atomic_sums && self.strategy.is_pp() && self.splits > 1
    }
}

/// The heuristic dataflow: the kernel and split count of an automatic call, from the rows per kv
/// head (query heads per kv head × new tokens), the longest sequence, `batch · heads_kv`, the
/// head dimension and whether the cache is paged ([`Workload`]), and the device's SM count.
///
/// With [`PP_IN_AUTO`] off (as measured on the H200): FlashDecoding, always. With it on:
///
/// | rows per kv head | `max_len · batch · heads_kv` | kernel |
/// |---|---|---|
/// | any | below [`PP_MIN_KEYS`] | FlashDecoding |
/// | above [`FLAT_GEMM_MAX_ROWS`] (16) | any | FlashDecoding |
/// | up to [`GEMV_MAX_ROWS`] (1) | from [`PP_MIN_KEYS`] | FlashDecoding++, GEMV |
/// | 2 … 16 | from [`PP_MIN_KEYS`] | FlashDecoding++, flat GEMM |
///
/// The split count is then [`split_count`] over the kernel's blocks per split
/// ([`blocks_per_split`]) and the longest sequence's tiles of [`BC`] keys: the SM count and the
/// layout enter there, the wave-efficiency heuristic being the same for every kernel.
pub fn dispatch(work: &Workload, sm_count: usize) -> Plan {
    let rows = work.rows_per_kv_head;
    let keys = work.max_len.saturating_mul(work.batch_heads_kv);
    let strategy = if !PP_IN_AUTO || keys < PP_MIN_KEYS || rows > FLAT_GEMM_MAX_ROWS {
        Strategy::FlashDecoding
    } else if rows <= GEMV_MAX_ROWS {
        Strategy::Gemv
    } else {
        Strategy::FlatGemm
    };
    Plan { strategy, splits: splits_for(strategy, work, sm_count) }
}

/// What a call with `strategy` and `splits` (both from [`super::DecodeOptions`]) runs: the
/// strategy resolved ([`dispatch`] for `Auto`, the rows for `FlashDecodingPp`) and the given split
/// count, or [`split_count`] over that kernel's blocks. A split count of 0 or more than
/// [`MAX_SPLITS`] is an error.
pub fn plan(
    strategy: Strategy,
    splits: Option<usize>,
    work: &Workload,
    sm_count: usize,
) -> Result<Plan> {
    let strategy = strategy.kernel(work, sm_count);
    let splits = match splits {
        Some(s) if s == 0 || s > MAX_SPLITS => {
            return Err(KernelError::Config(format!(
                "flash_decoding: {s} splits; expected 1 to {MAX_SPLITS}"
            )));
        }
        Some(s) => s,
        None => splits_for(strategy, work, sm_count),
    };
    Ok(Plan { strategy, splits })
}

/// Blocks of `strategy`'s split kernel per (split, kv head, sequence) for `rows_per_kv_head` rows
/// at head dimension `d`: FlashDecoding's [`row_blocks`] (32 rows per block, 16 at `d` = 256),
/// the flat GEMM's 8 or 16 rows per block, the GEMV's one. `Auto` and `FlashDecodingPp` count as
/// the kernel they resolve to by the rows alone (FlashDecoding past [`FLAT_GEMM_MAX_ROWS`] rows).
pub fn blocks_per_split(strategy: Strategy, rows_per_kv_head: usize, d: usize) -> usize {
    let rows = rows_per_kv_head.max(1);
    match strategy {
        Strategy::FlashDecoding => row_blocks(rows, d),
        Strategy::Gemv => rows,
        Strategy::FlatGemm => rows.div_ceil(flat_rows_per_block(rows, d)),
        Strategy::FlashDecodingPp if rows <= GEMV_MAX_ROWS => rows,
        Strategy::FlashDecodingPp => rows.div_ceil(flat_rows_per_block(rows, d)),
        Strategy::Auto if !PP_IN_AUTO || rows > FLAT_GEMM_MAX_ROWS => row_blocks(rows, d),
        Strategy::Auto => blocks_per_split(Strategy::FlashDecodingPp, rows, d),
    }
}

/// Rows per block of the flat GEMM at head dimension `d`: one 8-row tile up to 8 rows, else two,
/// except at `d` = 256, where a warp's `Oᵀ` of two tiles would not fit in its registers.
pub(crate) fn flat_rows_per_block(rows_per_kv_head: usize, d: usize) -> usize {
    if rows_per_kv_head <= 8 || d > 128 { 8 } else { 16 }
}

/// [`split_count`] for `strategy`'s kernel: its blocks per split ([`blocks_per_split`]) over
/// `batch_heads_kv`, the longest sequence's tiles of [`BC`] keys, and the blocks per SM the
/// cache wants ([`Workload::blocks_per_sm`]).
pub(crate) fn splits_for(strategy: Strategy, work: &Workload, sm_count: usize) -> usize {
    let per_split = blocks_per_split(strategy, work.rows_per_kv_head, work.head_dim);
    let blocks = work.batch_heads_kv.saturating_mul(per_split);
    split_count(blocks, work.max_len.div_ceil(BC), sm_count, work.blocks_per_sm())
}

/// The split count for `blocks` blocks per split and `key_blocks` tiles of [`BC`] keys in the
/// longest sequence, filling `blocks_per_sm` blocks per SM: [`num_splits`] with one block per
/// SM, or, with more (a paged cache: [`Workload::blocks_per_sm`]), with that many while each
/// split keeps at least [`PAGED_MIN_SPLIT_TILES`] tiles.
pub fn split_count(
    blocks: usize,
    key_blocks: usize,
    sm_count: usize,
    blocks_per_sm: usize,
) -> usize {
    let one = num_splits(blocks, key_blocks, sm_count, MAX_SPLITS);
    if blocks_per_sm <= 1 {
        return one;
    }
    let more = num_splits(blocks, key_blocks, sm_count.saturating_mul(blocks_per_sm), MAX_SPLITS);
    if key_blocks.div_ceil(more) >= PAGED_MIN_SPLIT_TILES { more } else { one }
}

/// Blocks per SM the split count fills for a paged cache ([`Workload::blocks_per_sm`]): two, the
/// kernel's occupancy up to `d` = 128 (one for a contiguous cache, and at `d` = 256).
///
/// One block per SM keeps enough of a contiguous cache in flight to stream it at full speed (its
/// tiles are runs of 16 KB): 4.47 TB/s at batch 16, 32/8 heads, 32k keys, 128 blocks. A paged
/// cache's tiles are runs of one page (4 KB with pages of 16 tokens), each behind a page-table
/// read, and one block per SM reads it at 3.56 TB/s, two (two splits) at 4.33–4.38. A contiguous
/// cache gains nothing from the second block (docs/perf-notes.md, FlashDecoding v4).
pub const PAGED_BLOCKS_PER_SM: usize = 2;

/// The fewest tiles of [`BC`] keys a split keeps when [`split_count`] fills more than one block
/// per SM for a paged cache: shorter splits pay more in their fixed costs (first loads, partials, the
/// combine) than the second block gains. At batch 1, 32/8 heads, 8k keys (128 tiles), 16 splits
/// read pages of 16 at 2.27 TB/s and 32 splits (4 tiles each) at 2.15; at 32/32 heads, 4 splits
/// read 3.09 and 8 (16 tiles each) 3.53.
pub const PAGED_MIN_SPLIT_TILES: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    /// A contiguous cache at d = 128.
    fn work(rows_per_kv_head: usize, max_len: usize, batch_heads_kv: usize) -> Workload {
        Workload { rows_per_kv_head, max_len, batch_heads_kv, head_dim: 128, paged: false }
    }

    /// The same, paged.
    fn paged(rows_per_kv_head: usize, max_len: usize, batch_heads_kv: usize) -> Workload {
        Workload { paged: true, ..work(rows_per_kv_head, max_len, batch_heads_kv) }
    }

    #[test]
    fn atomic_sums_only_for_flash_decoding_pp_with_splits_to_add() {
        let plan = |strategy, splits| Plan { strategy, splits };
        assert!(plan(Strategy::FlatGemm, 2).sums_atomically(true));
        assert!(plan(Strategy::Gemv, 16).sums_atomically(true));
        assert!(!plan(Strategy::Gemv, 16).sums_atomically(false));
        assert!(!plan(Strategy::FlatGemm, 1).sums_atomically(true));
        assert!(!plan(Strategy::FlashDecoding, 16).sums_atomically(true));
    }

    #[test]
    fn the_decision_table() {
        let sms = 132;
        let big = PP_MIN_KEYS; // e.g. one kv head of 65536 keys, or 8 of 8192
        let auto = |rows, len, heads| dispatch(&work(rows, len, heads), sms).strategy;
        let pp = |rows, len, heads| {
            plan(Strategy::FlashDecodingPp, None, &work(rows, len, heads), sms).unwrap().strategy
        };
        for (rows, len, heads) in [(1, 8192, 8), (2, 8192, 8), (16, 8192, 8), (4, big, 1)] {
            // Long enough caches: the rows pick FlashDecoding++'s kernel (Auto too when it may).
            let kernel = if rows == 1 { Strategy::Gemv } else { Strategy::FlatGemm };
            assert_eq!(pp(rows, len, heads), kernel);
            let want = if PP_IN_AUTO { kernel } else { Strategy::FlashDecoding };
            assert_eq!(auto(rows, len, heads), want, "{rows} rows, {len} × {heads}");
        }
        // More rows than a flat block holds, or short calls: FlashDecoding.
        assert_eq!(auto(17, 8192, 8), Strategy::FlashDecoding);
        assert_eq!(auto(128, 8192, 8), Strategy::FlashDecoding);
        assert_eq!(auto(1, big - 1, 1), Strategy::FlashDecoding);
        assert_eq!(auto(4, 1000, 8), Strategy::FlashDecoding);
        assert_eq!(auto(1, 0, 8), Strategy::FlashDecoding);
        // No overflow on absurd sizes.
        assert_eq!(pp(1, usize::MAX, usize::MAX), Strategy::Gemv);
        let _ = auto(1, usize::MAX, usize::MAX);
    }

    #[test]
    fn the_split_count_follows_the_kernels_blocks() {
        let sms = 132;
        // Batch 1, 32 kv heads, one row each, 8k keys: 32 blocks per split whatever the kernel,
        // so the same count as FlashDecoding's heuristic.
        let p = plan(Strategy::FlashDecodingPp, None, &work(1, 8192, 32), sms).unwrap();
        assert_eq!(p, Plan { strategy: Strategy::Gemv, splits: num_splits(32, 128, sms, 128) });
        assert_eq!(dispatch(&work(1, 8192, 32), sms).splits, num_splits(32, 128, sms, 128));
        // 8 kv heads × 16 rows: one flat block per kv head, as FlashDecoding's.
        let p = plan(Strategy::FlashDecodingPp, None, &work(16, 8192, 8), sms).unwrap();
        assert_eq!(p.splits, num_splits(8, 128, sms, 128));
        // Forced GEMV with 4 rows: 4 blocks per kv head per split.
        let p = plan(Strategy::Gemv, None, &work(4, 8192, 8), sms).unwrap();
        assert_eq!(p, Plan { strategy: Strategy::Gemv, splits: num_splits(32, 128, sms, 128) });
        // A paged cache: two blocks per SM while splits keep 16 tiles (batch 1, 32 kv heads, 8k
        // keys: 8 splits of 16 tiles, where a contiguous cache takes 4) …
        assert_eq!(dispatch(&paged(1, 8192, 32), sms).splits, 8);
        assert_eq!(dispatch(&work(1, 8192, 32), sms).splits, 4);
        assert_eq!(split_count(32, 128, sms, 2), num_splits(32, 128, 2 * sms, 128));
        assert_eq!(split_count(8, 128, sms, 2), split_count(8, 128, sms, 1));
        // … up to d = 128: one block of d = 256 fills an SM.
        let wide = Workload { head_dim: 256, ..paged(1, 8192, 32) };
        assert_eq!((wide.blocks_per_sm(), paged(1, 8192, 32).blocks_per_sm()), (1, 2));
        assert_eq!(dispatch(&wide, sms).splits, 4);
        // Forced flat GEMM with 40 rows: blocks of 16, 3 per kv head (blocks of 8 at d = 256).
        assert_eq!(blocks_per_split(Strategy::FlatGemm, 40, 128), 3);
        assert_eq!(blocks_per_split(Strategy::FlatGemm, 40, 256), 5);
        assert_eq!(blocks_per_split(Strategy::FlatGemm, 8, 128), 1);
        assert_eq!(blocks_per_split(Strategy::FlatGemm, 9, 128), 1);
        assert_eq!(blocks_per_split(Strategy::FlashDecoding, 40, 128), 2);
        assert_eq!(blocks_per_split(Strategy::FlashDecoding, 40, 256), 3);
        assert_eq!(blocks_per_split(Strategy::Gemv, 0, 128), 1);
        // A given split count is kept; 0 and more than MAX_SPLITS are errors.
        let p = plan(Strategy::Auto, Some(7), &work(1, 100, 1), sms).unwrap();
        assert_eq!(p, Plan { strategy: Strategy::FlashDecoding, splits: 7 });
        assert_eq!(
            plan(Strategy::Auto, Some(MAX_SPLITS), &work(1, 100, 1), sms).unwrap().splits,
            128
        );
        for bad in [0, MAX_SPLITS + 1] {
            assert!(matches!(
                plan(Strategy::Gemv, Some(bad), &work(1, 100, 1), sms),
                Err(KernelError::Config(_))
            ));
        }
    }

    #[test]
    fn forced_strategies_resolve_to_a_kernel() {
        let sms = 132;
        for rows in [1, 2, 8, 16, 17, 128] {
            for (len, heads) in [(10, 1), (100_000, 8)] {
                for s in Strategy::ALL {
                    let p = plan(s, Some(3), &work(rows, len, heads), sms).unwrap();
                    assert!(
                        matches!(
                            p.strategy,
                            Strategy::FlashDecoding | Strategy::Gemv | Strategy::FlatGemm
                        ),
                        "{s} {rows}: {p:?}"
                    );
                    match s {
                        Strategy::Auto => {
                            assert_eq!(p.strategy, dispatch(&work(rows, len, heads), sms).strategy)
                        }
                        Strategy::FlashDecodingPp => assert_eq!(
                            p.strategy,
                            if rows == 1 { Strategy::Gemv } else { Strategy::FlatGemm }
                        ),
                        forced => assert_eq!(p.strategy, forced),
                    }
                }
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
            assert_eq!(s.to_string(), s.name());
            assert_eq!(
                s.is_pp(),
                s.name().contains("gemv") || s.name().contains("pp") || s.name().contains("flat")
            );
        }
        assert!(
            matches!("fd++".parse::<Strategy>(), Err(KernelError::Config(m)) if m.contains("flat-gemm"))
        );
        assert_eq!(Strategy::default(), Strategy::Auto);
    }
}
