//! Mask modifiers: which keys a query sees, as a function of where the pair sits, and the block
//! mask that lets a tiled rung skip what a mask empties.
//!
//! The band masks ([`crate::Mask`]: causal, a sliding window) are the masks whose rows each see
//! one run of keys around the diagonal. The masks of packed training and of prefix language
//! models are not: a *document mask* lets a token see only the keys of its own document, a
//! *prefix-LM mask* lets every token see a whole prefix and the rest causally. FlexAttention
//! (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
//! Kernels") made the mask a function the user writes, `mask_mod(b, h, q_idx, kv_idx) -> bool`
//! (true: the query sees the key), and so does this module ([`MaskMod`]):
//!
//! ```text
//! O = softmax(score_mod(scale · Q Kᵀ) + band + mask_mod) V
//! ```
//!
//! where a pair the modifier hides gets `−∞`, as a pair outside the band does. It composes with
//! the band (a pair must pass both), with [`MaskMod::and`] and [`MaskMod::or`].
//!
//! A mask alone saves nothing: what makes it pay is the **block mask** ([`BlockMask`]). Evaluated
//! once per mask, shape and tile size, it says of each tile of `br` queries by `bc` keys whether
//! every pair is visible (*full*: computed with no mask at all), none is (*empty*: skipped, its K
//! and V never read) or some are (*partial*: computed, then masked entry by entry) — the same
//! three kinds the causal mask gives its tiles ([`crate::TileKind`]). A rung then costs in
//! proportion to the tiles the mask leaves: a document mask of 16 equal documents leaves about a
//! sixteenth of them. Every tiled rung classifies its tiles this way; [`BlockMask`] computes
//! the whole grid at once, to look at (its [`BlockMask::picture`]) or to hand to a kernel.
//!
//! ```
//! use ladder_reference::{AttentionOptions, AttentionShape, BlockMask, MaskMod, ScoreIndex, TileSizes};
//!
//! // Three documents of 96, 160 and 256 tokens packed into one causal sequence of 512.
//! let packed = AttentionOptions::causal().with_mask_mod(MaskMod::document_lengths(&[96, 160, 256]));
//! // A prefix-LM mask: a 128-token prompt seen by every token, the rest causal (no causal flag).
//! let prefix_lm = AttentionOptions::default().with_mask_mod(MaskMod::prefix_lm(128));
//! // Your own: LongNet's dilated attention keeps every second key from the diagonal back.
//! let dilated = MaskMod::new("dilated", |at: &ScoreIndex| at.from_diagonal() % 2 == 0);
//! let both = prefix_lm.with_mask_mod(dilated); // both must keep a pair
//!
//! let shape = AttentionShape::new(1, 1, 1, 512, 512, 64)?;
//! let tiles = TileSizes::new(64, 64)?;
//! let block_mask = BlockMask::new(&packed, &shape, tiles)?;
//! assert_eq!(block_mask.counts().computed(), 18); // of 64 tiles; the causal mask alone: 36
//! assert_eq!(block_mask.picture(0, 0).unwrap().lines().next(), Some("▒·······"));
//! assert!(BlockMask::new(&both, &shape, tiles)?.counts().partial > 0);
//! # Ok::<(), ladder_reference::LadderError>(())
//! ```

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use ndarray::Array4;

use crate::error::{Result, invalid};
use crate::modifiers::ScoreIndex;
use crate::options::{AttentionOptions, TileSizes};
use crate::output::TileCounts;
use crate::shape::{AttentionShape, Mask, TileKind};
use crate::tile::{RowSpans, Runs};

type Predicate = dyn Fn(&ScoreIndex) -> bool + Send + Sync;

/// Which keys each query sees, as a function of the pair's place (see the [module](self)):
/// `true` keeps the pair, `false` hides it.
///
/// Cheap to clone (the function is shared). Two mask modifiers are equal when they are the same
/// function (clones of one another).
#[derive(Clone)]
pub struct MaskMod {
    name: Arc<str>,
    f: Arc<Predicate>,
    /// The key counts the per-key tables of the modifier cover (a document mask's ids), checked
    /// against the problem.
    keys: Vec<usize>,
}

impl fmt::Debug for MaskMod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MaskMod({})", self.name)
    }
}

impl PartialEq for MaskMod {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.f, &other.f)
    }
}

impl MaskMod {
    /// A mask `f(index) -> bool` (true: query `index.q` sees key `index.kv`), named for reports
    /// and errors.
    pub fn new(
        name: impl Into<String>,
        f: impl Fn(&ScoreIndex) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self { name: name.into().into(), f: Arc::new(f), keys: Vec::new() }
    }

    /// A document mask: `ids[j]` is the document of key position `j` (one per key, shared by
    /// every batch entry and head), and a query sees only the keys of its own document. Query
    /// `i` sits at position `i + n_kv − n_q` (bottom-right, as the causal mask: the queries are
    /// the last `n_q` positions); a query before position 0 sees nothing. With the causal flag
    /// this is the mask of packed causal training; the documents need not be contiguous.
    pub fn documents(ids: Vec<u32>) -> Self {
        let keys = ids.len();
        let f = move |at: &ScoreIndex| match at.position() {
            Some(p) => ids.get(p).is_some_and(|&doc| ids.get(at.kv) == Some(&doc)),
            None => false,
        };
        Self { keys: vec![keys], ..Self::new(format!("documents({keys} keys)"), f) }
    }

    /// The document mask of documents of `lengths` tokens, back to back ([`MaskMod::documents`]
    /// with ids `0, 0, …, 1, 1, …`): the packing of a varlen batch as one sequence.
    pub fn document_lengths(lengths: &[usize]) -> Self {
        let ids = lengths
            .iter()
            .enumerate()
            .flat_map(|(doc, &len)| std::iter::repeat_n(doc as u32, len))
            .collect();
        Self::documents(ids)
    }

    /// A prefix-LM mask: every query sees the first `prefix` keys (the prompt, attended
    /// bidirectionally) and the keys up to its own position (causally). It is a whole mask, the
    /// causal part included: use it without the causal flag, which would hide the prefix's later
    /// keys from its first rows.
    pub fn prefix_lm(prefix: usize) -> Self {
        Self::new(format!("prefix-lm({prefix})"), move |at: &ScoreIndex| {
            at.kv < prefix || at.from_diagonal() <= 0
        })
    }

    /// The pairs both masks keep.
    pub fn and(self, other: MaskMod) -> Self {
        self.combine(other, "∧", |a, b| a && b)
    }

    /// The pairs either mask keeps.
    pub fn or(self, other: MaskMod) -> Self {
        self.combine(other, "∨", |a, b| a || b)
    }

    fn combine(self, other: MaskMod, symbol: &str, op: fn(bool, bool) -> bool) -> Self {
        let name = format!("({} {symbol} {})", self.name, other.name);
        let keys = [self.keys, other.keys].concat();
        let (f, g) = (self.f, other.f);
        Self { keys, ..Self::new(name, move |at: &ScoreIndex| op(f(at), g(at))) }
    }

    /// The modifier's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the modifier keeps the pair at `at`.
    pub fn sees(&self, at: &ScoreIndex) -> bool {
        (self.f)(at)
    }

    /// Checks the modifier against the problem: a per-key table must cover every key.
    pub fn check(&self, shape: &AttentionShape) -> Result<()> {
        match self.keys.iter().find(|&&n| n != shape.n_kv) {
            Some(n) => Err(invalid(
                "mask_mod",
                format!("{} has a table of {n} keys for {} keys", self.name, shape.n_kv),
            )),
            None => Ok(()),
        }
    }
}

/// The visible keys of rows `rows` within the key columns `cols` of one `(batch, head)`: each
/// row's band, less what `mask_mod` hides, as runs relative to `cols.start`.
pub(crate) fn row_spans(
    band: &Mask,
    mask_mod: Option<&MaskMod>,
    at: ScoreIndex,
    rows: &Range<usize>,
    cols: &Range<usize>,
) -> RowSpans {
    rows.clone()
        .map(|i| {
            let seen = band.visible(i);
            let (start, end) = (seen.start.max(cols.start), seen.end.min(cols.end));
            if start >= end {
                return Runs::new();
            }
            let band = start - cols.start..end - cols.start;
            let Some(mask_mod) = mask_mod else { return vec![band] };
            let mut runs = Runs::new();
            for j in start..end {
                if !mask_mod.sees(&ScoreIndex { q: i, kv: j, ..at }) {
                    continue;
                }
                let j = j - cols.start;
                match runs.last_mut() {
                    Some(run) if run.end == j => run.end += 1,
                    _ => runs.push(j..j + 1),
                }
            }
            runs
        })
        .collect()
}

/// How tile `rows × cols` of one `(batch, head)` meets the band and the mask modifier, and the
/// runs each row sees when it must be masked: the band decides alone without a modifier (its
/// first and last rows suffice); with one, every pair the band leaves is asked.
pub(crate) fn classify(
    band: &Mask,
    mask_mod: Option<&MaskMod>,
    at: ScoreIndex,
    rows: &Range<usize>,
    cols: &Range<usize>,
) -> (TileKind, Option<RowSpans>) {
    let kind = band.tile(rows.clone(), cols.clone());
    if kind == TileKind::Skip || (kind == TileKind::Full && mask_mod.is_none()) {
        return (kind, None);
    }
    let spans = row_spans(band, mask_mod, at, rows, cols);
    let whole = 0..cols.len();
    if spans.iter().all(|runs| runs.is_empty()) {
        (TileKind::Skip, None)
    } else if spans.iter().all(|runs| runs[..] == [whole.clone()]) {
        (TileKind::Full, None)
    } else {
        (TileKind::Partial, Some(spans))
    }
}

/// How every tile of one problem meets its masks: FlexAttention's `BlockMask`, one
/// [`TileKind`] per `(batch, query head, query block, key block)` (see the [module](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockMask {
    tiles: TileSizes,
    kinds: Array4<TileKind>,
}

impl BlockMask {
    /// Classifies every tile of `tiles` (`br` queries by `bc` keys) of a problem of `shape`
    /// under the masks of `opts` (the band and the mask modifier), asking the modifier about
    /// every pair the band leaves: `batch · heads_q · n_q · n_kv` calls at most, once per mask
    /// and shape.
    pub fn new(opts: &AttentionOptions, shape: &AttentionShape, tiles: TileSizes) -> Result<Self> {
        if let Some(mask_mod) = &opts.mask_mod {
            mask_mod.check(shape)?;
        }
        let band = opts.mask(shape.n_q, shape.n_kv);
        let (q_blocks, kv_blocks) =
            (shape.n_q.div_ceil(tiles.br()), shape.n_kv.div_ceil(tiles.bc()));
        let mut kinds =
            Array4::from_elem((shape.batch, shape.heads_q, q_blocks, kv_blocks), TileKind::Skip);
        for ((b, h, qb, kb), kind) in kinds.indexed_iter_mut() {
            let rows = qb * tiles.br()..((qb + 1) * tiles.br()).min(shape.n_q);
            let cols = kb * tiles.bc()..((kb + 1) * tiles.bc()).min(shape.n_kv);
            let at =
                ScoreIndex { batch: b, head: h, q: 0, kv: 0, n_q: shape.n_q, n_kv: shape.n_kv };
            *kind = classify(&band, opts.mask_mod.as_ref(), at, &rows, &cols).0;
        }
        Ok(Self { tiles, kinds })
    }

    /// The tile sizes the mask was computed for.
    pub fn tiles(&self) -> TileSizes {
        self.tiles
    }

    /// The kind of every tile, indexed `[batch, query head, query block, key block]`.
    pub fn kinds(&self) -> &Array4<TileKind> {
        &self.kinds
    }

    /// The kind of tile `(q_block, kv_block)` of batch entry `b`, query head `h` (`None` out of
    /// range).
    pub fn kind(&self, b: usize, h: usize, q_block: usize, kv_block: usize) -> Option<TileKind> {
        self.kinds.get((b, h, q_block, kv_block)).copied()
    }

    /// How many tiles are full, partial and empty (skipped).
    pub fn counts(&self) -> TileCounts {
        let count = |kind| self.kinds.iter().filter(|&&k| k == kind).count() as u64;
        TileCounts {
            full: count(TileKind::Full),
            partial: count(TileKind::Partial),
            skipped: count(TileKind::Skip),
        }
    }

    /// The fraction of tiles a rung computes (full or partial).
    pub fn density(&self) -> f64 {
        let counts = self.counts();
        counts.computed() as f64 / self.kinds.len().max(1) as f64
    }

    /// The tiles of batch entry `b`, query head `h` as text, one line per query block: `█` full,
    /// `▒` partial, `·` empty (`None` out of range).
    pub fn picture(&self, b: usize, h: usize) -> Option<String> {
        let (batch, heads, q_blocks, kv_blocks) = self.kinds.dim();
        if b >= batch || h >= heads {
            return None;
        }
        let mut text = String::with_capacity(q_blocks * (kv_blocks + 1) * 3);
        for qb in 0..q_blocks {
            for kb in 0..kv_blocks {
                text.push(match self.kinds[(b, h, qb, kb)] {
                    TileKind::Full => '█',
                    TileKind::Partial => '▒',
                    TileKind::Skip => '·',
                });
            }
            text.push('\n');
        }
        Some(text)
    }
}
