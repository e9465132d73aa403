//! Mask modifiers compiled into the kernels: document masks, prefix-LM masks, and your own.
//!
//! A [`MaskMod`] says which keys each query sees, as FlexAttention's `mask_mod` does:
//! `O = softmax(score_mod(s) + band + mask_mod) V`, a pair it hides getting `−∞` as a pair outside
//! the band (causal, a window) does; a pair must pass both. It is CUDA source, the body of
//!
//! ```text
//! bool mask_mod(int b, int h, int q_idx, int kv_idx, int n_q, int n_kv)
//! ```
//!
//! (`true`: query `q_idx` of head `h` of batch entry `b` sees key `kv_idx`; `n_q` and `n_kv` the
//! lengths), with named `int` scalars and `f32` tables it may read (an integer table, a document
//! id per key, holds integers below 2²⁴ exactly). The built-ins are written the same way
//! ([`MaskMod::documents`], [`MaskMod::prefix_lm`]); masks compose with [`MaskMod::and`] and
//! [`MaskMod::or`]. A compile error in a body comes back as [`crate::KernelError::Compile`] with
//! NVRTC's log, its lines numbered as in the body.
//!
//! What makes a mask pay is the **block mask**: before the attention kernel runs, a generated
//! kernel evaluates the body on every pair of every tile (the attention kernel's own tile sizes)
//! and records whether the tile's pairs inside the band are all visible (*full*: computed with no
//! per-entry test), none is (*empty*: skipped, its K and V never read) or some are (*partial*:
//! the body evaluated per entry). A batch or head the body never names (`b`, `h`) shares one row
//! of the block mask, as FlexAttention's `B = None`, `H = None` do. A second small kernel turns
//! each query tile's row into the list of its live key tiles, which the FA2 and FA3 forwards walk
//! (FlexAttention's `kv_indices`): a walk jumps from one live tile to the next with one load. The
//! block mask is made at a mask's first call of a shape (lengths, band, the kernel's tiles) and
//! kept with the mask for its next calls (its clones share it; [`MaskMod::int`] and
//! [`MaskMod::table`] drop it): keep the mask, as you keep FlexAttention's `BlockMask`, and a
//! training loop computes it once. The kernels evaluate the body
//! only where `q_idx < n_q` and `kv_idx < n_kv` (padding entries see the last row or key, and are
//! masked anyway), so a table indexed by them stays in bounds.
//!
//! ```
//! use ladder_kernels::MaskMod;
//!
//! // Three documents of 96, 160 and 256 tokens packed into one sequence of 512.
//! let packed = MaskMod::document_lengths(&[96, 160, 256])?;
//! // LongNet's dilated attention, as a user-written mask: every second key from the diagonal.
//! let dilated = MaskMod::new(
//!     "dilated",
//!     "return (kv_idx - (q_idx + n_kv - n_q)) % stride == 0;",
//! )
//! .int("stride", 2);
//! let both = packed.and(dilated);
//! assert_eq!(both.name(), "(documents(512 keys) ∧ dilated)");
//! # Ok::<(), ladder_kernels::KernelError>(())
//! ```

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Band, Problem, grid};
use crate::score_mod::{Generated, check_identifiers, mentions};

pub(crate) const BLOCK_MASK_SRC: &str = include_str!("../cuda/block_mask.cu");

/// Threads of `block_mask` (`THREADS` in `cuda/block_mask.cu`).
const BLOCK_MASK_THREADS: u32 = 256;
/// Warps of `block_list` (`LIST_WARPS`), one per row.
const BLOCK_LIST_WARPS: usize = 4;

/// `int` scalars a mask (all its terms together) may name.
pub const MAX_MASK_INTS: usize = 4;
/// `f32` tables a mask (all its terms together) may name.
pub const MAX_MASK_TABLES: usize = 2;

/// One term of a mask: its source and what it reads.
#[derive(Clone, Debug, PartialEq)]
struct Term {
    /// The name in the generated source (its `#line` file).
    name: String,
    /// The name in errors and [`MaskMod::name`].
    label: String,
    body: String,
    ints: Vec<(String, i32)>,
    tables: Vec<(String, Arc<[f32]>)>,
    /// The keys a per-key table covers (a document mask's ids), checked against the problem.
    keys: Option<usize>,
}

/// How the terms combine: a tree of `∧` and `∨` over them.
#[derive(Clone, Debug, PartialEq)]
enum Expr {
    Term(usize),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
}

impl Expr {
    fn shifted(self, by: usize) -> Expr {
        match self {
            Expr::Term(i) => Expr::Term(i + by),
            Expr::And(a, b) => Expr::And(Box::new(a.shifted(by)), Box::new(b.shifted(by))),
            Expr::Or(a, b) => Expr::Or(Box::new(a.shifted(by)), Box::new(b.shifted(by))),
        }
    }

    fn source(&self) -> String {
        match self {
            Expr::Term(i) => format!("mask_mod_{i}::apply(at, args)"),
            Expr::And(a, b) => format!("({} && {})", a.source(), b.source()),
            Expr::Or(a, b) => format!("({} || {})", a.source(), b.source()),
        }
    }

    fn label(&self, terms: &[Term]) -> String {
        match self {
            Expr::Term(i) => terms[*i].label.clone(),
            Expr::And(a, b) => format!("({} ∧ {})", a.label(terms), b.label(terms)),
            Expr::Or(a, b) => format!("({} ∨ {})", a.label(terms), b.label(terms)),
        }
    }
}

/// Which keys each query sees, compiled into the kernels (see the [module](self)).
#[derive(Clone, Debug)]
pub struct MaskMod {
    terms: Vec<Term>,
    expr: Expr,
    /// The generated header and its key, made once and dropped whenever a term changes.
    generated: OnceLock<Generated>,
    /// The block masks made for it on the device (see [`block_mask`]).
    blocks: BlockMasks,
}

/// Two masks are equal when their terms and how they combine are.
impl PartialEq for MaskMod {
    fn eq(&self, other: &MaskMod) -> bool {
        (&self.terms, &self.expr) == (&other.terms, &other.expr)
    }
}

impl MaskMod {
    /// A mask from the body of `bool mask_mod(int b, int h, int q_idx, int kv_idx, int n_q, int
    /// n_kv)` (see the [module](self)), named for errors and logs.
    pub fn new(name: impl Into<String>, body: impl Into<String>) -> MaskMod {
        let name = name.into();
        let term = Term {
            label: name.clone(),
            name,
            body: body.into(),
            ints: Vec::new(),
            tables: Vec::new(),
            keys: None,
        };
        MaskMod {
            terms: vec![term],
            expr: Expr::Term(0),
            generated: OnceLock::new(),
            blocks: BlockMasks::default(),
        }
    }

    /// An `int` the body reads as `const int name`.
    pub fn int(mut self, name: impl Into<String>, value: i32) -> MaskMod {
        self.last().ints.push((name.into(), value));
        self
    }

    /// A table the body reads as `const float* name` (copied to the device on its first use and
    /// kept there while this mask or a clone of it lives).
    pub fn table(mut self, name: impl Into<String>, values: Vec<f32>) -> MaskMod {
        self.last().tables.push((name.into(), values.into()));
        self
    }

    /// A document mask: `ids[j]` is the document of key position `j` (one per key, shared by every
    /// batch entry and head), and a query sees only the keys of its own document. Query `i` sits
    /// at position `i + n_kv − n_q` (bottom-right, as the causal mask: the queries are the last
    /// `n_q` positions); a query before position 0 sees nothing. With the causal flag this is the
    /// mask of packed causal training; the documents need not be contiguous. Ids must be below
    /// 2²⁴ (the table holds them as `f32`).
    pub fn documents(ids: Vec<u32>) -> Result<MaskMod> {
        if let Some(bad) = ids.iter().find(|&&id| id >= 1 << 24) {
            return Err(KernelError::Shape(format!("document ids must be below 2^24, got {bad}")));
        }
        let keys = ids.len();
        let mut mask = MaskMod::new(
            "documents",
            "const int p = q_idx + n_kv - n_q;\nreturn p >= 0 && ids[p] == ids[kv_idx];",
        )
        .table("ids", ids.iter().map(|&id| id as f32).collect());
        let term = mask.last();
        term.label = format!("documents({keys} keys)");
        term.keys = Some(keys);
        Ok(mask)
    }

    /// The document mask of documents of `lengths` tokens, back to back ([`MaskMod::documents`]
    /// with ids `0, 0, …, 1, 1, …`).
    pub fn document_lengths(lengths: &[usize]) -> Result<MaskMod> {
        let ids = lengths
            .iter()
            .enumerate()
            .flat_map(|(doc, &len)| std::iter::repeat_n(doc as u32, len))
            .collect();
        MaskMod::documents(ids)
    }

    /// A prefix-LM mask: every query sees the first `prefix` keys (the prompt, attended
    /// bidirectionally) and the keys up to its own position (causally). A whole mask, the causal
    /// part included: use it without the causal flag.
    pub fn prefix_lm(prefix: usize) -> Result<MaskMod> {
        let prefix = i32::try_from(prefix)
            .map_err(|_| KernelError::Shape(format!("prefix-LM prefix {prefix} is too long")))?;
        let mut mask =
            MaskMod::new("prefix-lm", "return kv_idx < prefix || kv_idx <= q_idx + n_kv - n_q;")
                .int("prefix", prefix);
        mask.last().label = format!("prefix-lm({prefix})");
        Ok(mask)
    }

    /// The pairs both masks keep.
    pub fn and(self, other: MaskMod) -> MaskMod {
        self.combine(other, |a, b| Expr::And(Box::new(a), Box::new(b)))
    }

    /// The pairs either mask keeps.
    pub fn or(self, other: MaskMod) -> MaskMod {
        self.combine(other, |a, b| Expr::Or(Box::new(a), Box::new(b)))
    }

    fn combine(mut self, other: MaskMod, op: fn(Expr, Expr) -> Expr) -> MaskMod {
        let right = other.expr.shifted(self.terms.len());
        self.terms.extend(other.terms);
        MaskMod {
            expr: op(self.expr, right),
            terms: self.terms,
            generated: OnceLock::new(),
            blocks: BlockMasks::default(),
        }
    }

    /// The mask's name: its terms' names joined by `∧` and `∨`.
    pub fn name(&self) -> String {
        self.expr.label(&self.terms)
    }

    /// The last term, to change (which drops the generated header and the block masks).
    fn last(&mut self) -> &mut Term {
        self.generated = OnceLock::new();
        self.blocks = BlockMasks::default();
        self.terms.last_mut().expect("a mask has a term")
    }

    /// Whether some term's body names `name` (`b`, `h`): the block mask then has a row per batch
    /// entry or head.
    fn reads(&self, name: &str) -> bool {
        self.terms.iter().any(|t| mentions(&t.body, name))
    }

    /// Checks what the kernels need: the counts of scalars and tables, names that are C
    /// identifiers, and per-key tables as long as the keys.
    pub(crate) fn check(&self, n_kv: usize) -> Result<()> {
        let ints: usize = self.terms.iter().map(|t| t.ints.len()).sum();
        let tables: usize = self.terms.iter().map(|t| t.tables.len()).sum();
        if ints > MAX_MASK_INTS || tables > MAX_MASK_TABLES {
            return Err(KernelError::Shape(format!(
                "mask_mod {} names {ints} ints and {tables} tables; the kernels take up to \
                 {MAX_MASK_INTS} and {MAX_MASK_TABLES}",
                self.name()
            )));
        }
        for term in &self.terms {
            let names = term.ints.iter().map(|(n, _)| n).chain(term.tables.iter().map(|(n, _)| n));
            check_identifiers("mask_mod", &term.label, names)?;
            if let Some(keys) = term.keys
                && keys != n_kv
            {
                return Err(KernelError::Shape(format!(
                    "mask_mod {} has a table of {keys} keys for {n_kv} keys",
                    term.label
                )));
            }
        }
        Ok(())
    }

    /// The header `mask_mod_body.cuh` the kernels include when compiled with `LADDER_MASK_MOD`
    /// (`cuda/mask_mod.cuh`): one namespace per term, then the composed `mask_mod`.
    pub(crate) fn header(&self) -> String {
        const ARGS: &str = "const MaskAt& at, const MaskArgs& args";
        const PLACE: &str = "const int b = at.b, h = at.h, q_idx = at.q_idx, kv_idx = at.kv_idx;\n    \
             const int n_q = at.n_q, n_kv = at.n_kv;\n    \
             (void)b; (void)h; (void)q_idx; (void)kv_idx; (void)n_q; (void)n_kv; (void)args;";
        let mut text = String::from("// Generated from a ladder_kernels::MaskMod.\n");
        let (mut int, mut table) = (0, 0);
        for (i, term) in self.terms.iter().enumerate() {
            let mut reads = String::new();
            for (name, _) in &term.ints {
                if mentions(&term.body, name) {
                    let _ = writeln!(reads, "    const int {name} = args.ints[{int}];");
                }
                int += 1;
            }
            for (name, _) in &term.tables {
                if mentions(&term.body, name) {
                    let _ = writeln!(
                        reads,
                        "    const float* __restrict__ {name} = args.tables[{table}];"
                    );
                }
                table += 1;
            }
            let file = term.name.replace(['"', '\\', '\n'], "_");
            let _ = write!(
                text,
                "namespace mask_mod_{i} {{\n\
                 __device__ __forceinline__ bool apply({ARGS}) {{\n    {PLACE}\n{reads}\
                 #line 1 \"{file}\"\n{}\n}}\n}}\n",
                term.body
            );
        }
        let _ = writeln!(
            text,
            "__device__ __forceinline__ bool mask_mod({ARGS}) {{\n    return {};\n}}",
            self.expr.source()
        );
        text
    }

    /// The header and a key for the variant, its hash (the kernels compiled with one mask serve
    /// every value of its ints and tables, which travel in the parameters); made on first use.
    pub(crate) fn generated(&self) -> &Generated {
        self.generated.get_or_init(|| Generated::of(self.header()))
    }

    /// The parameters the kernels read ([`MaskArgs`]), the tables on the device
    /// ([`Gpu::table`]), and the block mask's place (set by the caller).
    pub(crate) fn args(&self, gpu: &Gpu) -> Result<MaskArgs> {
        let mut args = MaskArgs::default();
        let ints = self.terms.iter().flat_map(|t| &t.ints);
        for (slot, (_, value)) in args.ints.iter_mut().zip(ints) {
            *slot = *value;
        }
        let tables = self.terms.iter().flat_map(|t| &t.tables);
        for (slot, (_, values)) in args.tables.iter_mut().zip(tables) {
            *slot = gpu.table(values)?;
        }
        Ok(args)
    }

    /// The block mask's extent in batch entries and heads: 1 where the body never names `b` or
    /// `h`.
    pub(crate) fn block_extent(&self, batch: usize, heads_q: usize) -> (usize, usize) {
        (if self.reads("b") { batch } else { 1 }, if self.reads("h") { heads_q } else { 1 })
    }
}

/// Which tiles a kernel's walk visits, and so which lists of the block mask it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Walk {
    /// Each query tile walks its key tiles (the forwards, the backward's dQ pass).
    KeysOfQueryTile,
    /// Each key tile walks its query tiles (the backward's main kernel, keys outer).
    QueriesOfKeyTile,
}

/// The parameters of `p`'s mask modifier for a kernel of tiles of `br` queries by `bc` keys
/// walking them as `walk` says, and its block mask ([`block_mask`]; none and null parameters
/// without a modifier).
pub(crate) fn mask_args(
    gpu: &Gpu,
    p: &Problem,
    tiles: (usize, usize),
    walk: Walk,
) -> Result<(MaskArgs, Option<Arc<DeviceBlockMask>>)> {
    match &p.mask_mod {
        Some(m) => block_mask(gpu, m, p, tiles, walk).map(|(args, blocks)| (args, Some(blocks))),
        None => Ok((MaskArgs::default(), None)),
    }
}

/// The block mask of `mask` for problem `p` at the attention kernel's tiles of `br` queries by
/// `bc` keys (`cuda/block_mask.cu`) as lists for `walk`, and the parameters that point the
/// attention kernel at it: keep the returned block mask alive until that kernel is queued. Made
/// on the device at the first call of a shape and kept with the mask ([`MaskMod`]'s cache) for
/// the next ones.
fn block_mask(
    gpu: &Gpu,
    mask: &MaskMod,
    p: &Problem,
    (br, bc): (usize, usize),
    walk: Walk,
) -> Result<(MaskArgs, Arc<DeviceBlockMask>)> {
    // (`p` is checked: `Problem` held the mask to its keys.)
    let (batches, heads) = mask.block_extent(p.batch, p.heads_q);
    let key = BlockKey {
        stream: Arc::as_ptr(gpu.stream()) as usize,
        batches,
        heads,
        n_q: p.n_q,
        n_kv: p.n_kv,
        band: p.band(),
        br,
        bc,
        walk,
    };
    let blocks = match mask.blocks.find(&key) {
        Some(blocks) => blocks,
        None => {
            let blocks = Arc::new(make_block_mask(gpu, mask, key)?);
            mask.blocks.keep(blocks.clone());
            blocks
        }
    };
    let mut args = mask.args(gpu)?;
    {
        use cudarc::driver::DevicePtr;
        args.live = blocks.live.device_ptr(gpu.stream()).0;
        args.live_count = blocks.counts.device_ptr(gpu.stream()).0;
        args.live_slots = blocks.live_slots.device_ptr(gpu.stream()).0;
        args.bits = blocks.bits.device_ptr(gpu.stream()).0;
    }
    let (tiles, entries) = key.lists();
    // (The sizes fit an int: make_block_mask checked them.)
    args.head_rows = if heads > 1 { tiles as i32 } else { 0 };
    args.batch_rows = if batches > 1 { (heads * tiles) as i32 } else { 0 };
    args.row_len = entries as i32;
    Ok((args, blocks))
}

/// A block mask on the device: per query tile its live key tiles, or per key tile its live query
/// tiles (`MaskArgs` in `cuda/mask_mod.cuh`), and where asked the order FA3's persistent blocks
/// take the query tiles in ([`DeviceBlockMask::set_tile_order`]).
#[derive(Debug)]
pub(crate) struct DeviceBlockMask {
    key: BlockKey,
    live: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    live_slots: CudaSlice<i32>,
    bits: CudaSlice<u32>,
    order: Mutex<Option<(TileOrderKey, CudaSlice<i32>)>>,
}

/// What a tile order depends on besides its block mask: the batch, the query heads, and the
/// persistent blocks that walk it.
type TileOrderKey = (usize, usize, usize);

impl DeviceBlockMask {
    /// Points `args` (this block mask's) at the order in which `grid` persistent blocks take the
    /// query tiles of `batch` × `heads_q` heads ([`tile_order`], each tile's work its live key
    /// tiles, a partial one counted twice), made at the first ask (one copy of the lists to the
    /// host) and kept for the next calls of the same extents.
    pub(crate) fn set_tile_order(
        &self,
        gpu: &Gpu,
        (batch, heads_q, grid): TileOrderKey,
        args: &mut MaskArgs,
    ) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let key = (batch, heads_q, grid);
        let mut order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        if order.as_ref().is_none_or(|(k, _)| *k != key) {
            let s = gpu.stream();
            let copy = || KernelError::driver("copying the block mask to the host");
            let counts = s.clone_dtoh(&self.counts).map_err(copy())?;
            let live = s.clone_dtoh(&self.live).map_err(copy())?;
            let (tiles, entries) = self.key.lists();
            let rows = self.key.batches * self.key.heads * tiles;
            // A partial tile costs about twice a full one: the mask asked per entry.
            let work: Vec<i32> = (0..rows)
                .map(|row| {
                    let listed = &live[row * entries..][..counts[row].max(0) as usize];
                    listed.iter().map(|&tile| 1 + (tile & 1)).sum()
                })
                .collect();
            let extents = (batch, heads_q, self.key.batches > 1, self.key.heads > 1);
            let ordered = tile_order(&work, tiles, extents, 2 * grid);
            let bytes = 4 * ordered.len();
            *order = Some((key, s.clone_htod(&ordered).map_err(KernelError::alloc(bytes))?));
        }
        if let Some((_, order)) = order.as_ref() {
            args.order = order.device_ptr(gpu.stream()).0;
        }
        Ok(())
    }
}

/// The query tiles of `batch` × `heads_q` heads (`tiles` each, numbered `(b · heads_q + h) ·
/// tiles + tile`) in the order persistent blocks should take them, by the work of the block
/// mask's rows (`work`, its rows distinguishing the batch entries and heads or not):
/// heads one after the other, each from its last tile back (the causal order), and within each
/// run of `window` tiles (two rounds of the blocks) the most live key tiles first.
///
/// A mask makes the walks uneven in ways the causal order does not follow (documents: a
/// document's first query tile walks one key tile, its last the whole document); sorted
/// longest-first in each window, the blocks' static snake order gives every block about the
/// same work. Sorting all the tiles at once would balance as well, but then the query tiles of
/// one document run far apart in time and each reads the document's K and V from memory again
/// (measured: the kernel became DRAM-bound, 85 % of its bandwidth, at 16 documents in 16k);
/// within a window, the tiles running together are those of about two heads, whose K and V stay
/// in L2.
fn tile_order(
    work: &[i32],
    tiles: usize,
    (batch, heads_q, batch_rows, head_rows): (usize, usize, bool, bool),
    window: usize,
) -> Vec<i32> {
    let row = |b: usize, h: usize, tile: usize| {
        let (b, h) = (if batch_rows { b } else { 0 }, if head_rows { h } else { 0 });
        (b * if head_rows { heads_q } else { 1 } + h) * tiles + tile
    };
    let mut order: Vec<(i32, i32)> = (0..batch * heads_q)
        .flat_map(|bh| (0..tiles).rev().map(move |tile| (bh, tile)))
        .map(|(bh, tile)| {
            let count = work[row(bh / heads_q, bh % heads_q, tile)];
            (count, (bh * tiles + tile) as i32)
        })
        .collect();
    for run in order.chunks_mut(window.max(1)) {
        run.sort_by_key(|&(count, _)| std::cmp::Reverse(count));
    }
    order.into_iter().map(|(_, tile)| tile).collect()
}

/// What a block mask depends on besides the mask: the stream (a device) it was made on, the
/// extents it distinguishes, the lengths and band, the kernel's tiles and its walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlockKey {
    stream: usize,
    batches: usize,
    heads: usize,
    n_q: usize,
    n_kv: usize,
    band: Band,
    br: usize,
    bc: usize,
    walk: Walk,
}

impl BlockKey {
    /// The lists' count per (batch, head) and their length: query tiles and key tiles, or the
    /// other way round.
    fn lists(&self) -> (usize, usize) {
        let (query_tiles, key_tiles) = (self.n_q.div_ceil(self.br), self.n_kv.div_ceil(self.bc));
        match self.walk {
            Walk::KeysOfQueryTile => (query_tiles, key_tiles),
            Walk::QueriesOfKeyTile => (key_tiles, query_tiles),
        }
    }
}

/// The most memory a block mask keeps partial tiles' bits in (`cuda/block_mask.cu`): 2 KB a tile of
/// 128 × 128, so 2,048 partial tiles (16 uneven documents in 16k tokens have about 250).
const BITS_BUDGET_BYTES: usize = 4 << 20;

/// How many block masks a mask keeps (the latest shapes it was called with).
const BLOCK_MASKS_KEPT: usize = 8;

/// The block masks made for a mask, shared by its clones (they are the same mask) and dropped
/// with the last of them, or when a term changes.
#[derive(Clone, Debug, Default)]
struct BlockMasks(Arc<Mutex<Vec<Arc<DeviceBlockMask>>>>);

impl BlockMasks {
    fn find(&self, key: &BlockKey) -> Option<Arc<DeviceBlockMask>> {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().find(|b| b.key == *key).cloned()
    }

    fn keep(&self, blocks: Arc<DeviceBlockMask>) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == BLOCK_MASKS_KEPT {
            kept.remove(0);
        }
        kept.push(blocks);
    }
}

/// Computes the block mask of `key` on the device: the kinds of every tile (`block_mask`), then
/// the lists of live tiles for the key's walk (`block_list`).
fn make_block_mask(gpu: &Gpu, mask: &MaskMod, key: BlockKey) -> Result<DeviceBlockMask> {
    let (query_tiles, key_tiles) = (key.n_q.div_ceil(key.br), key.n_kv.div_ceil(key.bc));
    let (tiles, entries) = key.lists();
    let rows = key.batches * key.heads * tiles;
    let int = |x: usize, what: &str| {
        i32::try_from(x).map_err(|_| {
            KernelError::Shape(format!("the block mask's {what} ({x}) exceeds an int"))
        })
    };
    let len = rows * entries;
    // Tiles are listed as 2·tile + partial.
    int(2 * entries, "tiles")?;
    let s = gpu.stream();
    // SAFETY (the three allocations): block_mask writes every kind, and block_list every count
    // and the entries the counts cover, before the attention kernel reads them.
    let kinds = unsafe { s.alloc::<u8>(len.max(1)) }.map_err(KernelError::alloc(len))?;
    let live = unsafe { s.alloc::<i32>(len.max(1)) }.map_err(KernelError::alloc(4 * len))?;
    let counts = unsafe { s.alloc::<i32>(rows.max(1)) }.map_err(KernelError::alloc(4 * rows))?;
    // The kept bits of partial tiles: a slot per tile (block_mask writes every one), the slots
    // of the listed ones, and room for as many tiles' bits as BITS_BUDGET_BYTES holds; past it a
    // partial tile asks the mask per entry. The counter of slots taken starts at zero.
    let tile_count = key.batches * key.heads * query_tiles * key_tiles;
    let words = key.br * key.bc.div_ceil(32);
    let capacity = (BITS_BUDGET_BYTES / (4 * words.max(1))).min(tile_count).max(1);
    // SAFETY: as above; block_mask writes a slot's bits before a slot is listed.
    let slots =
        unsafe { s.alloc::<i32>(tile_count.max(1)) }.map_err(KernelError::alloc(4 * tile_count))?;
    let live_slots = unsafe { s.alloc::<i32>(len.max(1)) }.map_err(KernelError::alloc(4 * len))?;
    let bits = unsafe { s.alloc::<u32>(capacity * words) }
        .map_err(KernelError::alloc(4 * capacity * words))?;
    let used = s.alloc_zeros::<u32>(1).map_err(KernelError::alloc(4))?;
    let variant = block_mask_variant(mask, key.br, key.bc);
    let classify = Kernel { variant: variant.clone(), entry: "block_mask" };
    let list = Kernel { variant, entry: "block_list" };
    gpu.prepare(&classify, 0)?;
    gpu.prepare(&list, 0)?;
    {
        use cudarc::driver::DevicePtr;
        let (kinds_ptr, _g0) = kinds.device_ptr(s);
        let (live_ptr, _g1) = live.device_ptr(s);
        let (counts_ptr, _g2) = counts.device_ptr(s);
        let (slots_ptr, _g3) = slots.device_ptr(s);
        let (live_slots_ptr, _g4) = live_slots.device_ptr(s);
        let (bits_ptr, _g5) = bits.device_ptr(s);
        let (used_ptr, _g6) = used.device_ptr(s);
        let params = BlockMaskParams {
            mask: mask.args(gpu)?,
            kinds: kinds_ptr,
            live: live_ptr,
            live_count: counts_ptr,
            heads: int(key.heads, "heads")?,
            n_q: int(key.n_q, "queries")?,
            n_kv: int(key.n_kv, "keys")?,
            query_tiles: int(query_tiles, "query tiles")?,
            key_tiles: int(key_tiles, "key tiles")?,
            rows: int(rows, "rows")?,
            by_key: i32::from(key.walk == Walk::QueriesOfKeyTile),
            band: key.band,
            slots: slots_ptr,
            live_slots: live_slots_ptr,
            bits: bits_ptr,
            bits_used: used_ptr,
            bits_capacity: int(capacity, "bits' slots")?,
        };
        let launch = grid(key_tiles, query_tiles, key.batches * key.heads)?;
        gpu.launch(&classify, launch, BLOCK_MASK_THREADS, 0, &params)?;
        let launch = grid(rows.div_ceil(BLOCK_LIST_WARPS), 1, 1)?;
        gpu.launch(&list, launch, 32 * BLOCK_LIST_WARPS as u32, 0, &params)?;
    }
    // (`slots` and `used` are freed in stream order, after block_list has read them.)
    Ok(DeviceBlockMask { key, live, counts, live_slots, bits, order: Mutex::new(None) })
}

/// The block mask kernel of `mask` at tiles of `br` × `bc`.
pub(crate) fn block_mask_variant(mask: &MaskMod, br: usize, bc: usize) -> Variant {
    let defines = vec![("BM_BR", br.to_string()), ("BM_BC", bc.to_string())];
    Variant::new("block_mask", BLOCK_MASK_SRC, defines).with_mask_mod(Some(mask))
}

/// Mirror of `BlockMaskParams` in `cuda/block_mask.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BlockMaskParams {
    mask: MaskArgs,
    kinds: u64,
    live: u64,
    live_count: u64,
    heads: i32,
    n_q: i32,
    n_kv: i32,
    query_tiles: i32,
    key_tiles: i32,
    rows: i32,
    by_key: i32,
    band: Band,
    slots: u64,
    live_slots: u64,
    bits: u64,
    bits_used: u64,
    bits_capacity: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers, laid out as its CUDA mirror.
unsafe impl DeviceRepr for BlockMaskParams {}

/// A mask's ints and tables and the block mask, as the kernels read them (mirror of `MaskArgs`
/// in `cuda/mask_mod.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct MaskArgs {
    pub(crate) tables: [u64; MAX_MASK_TABLES],
    pub(crate) ints: [i32; MAX_MASK_INTS],
    /// The block mask: per query tile (rows `[batch or 1][heads or 1][query tiles]`) its live
    /// key tiles, `[rows][key tiles]` as `2·tile + partial`, and their count `[rows]` (or per key
    /// tile its query tiles: [`Walk`]); or null.
    pub(crate) live: u64,
    pub(crate) live_count: u64,
    /// Rows between batch entries and heads (0 for an extent of 1).
    pub(crate) batch_rows: i32,
    pub(crate) head_rows: i32,
    /// Entries per row of `live`.
    pub(crate) row_len: i32,
    _pad: i32,
    /// The query tiles in the order FA3's persistent blocks take them
    /// ([`DeviceBlockMask::set_tile_order`]), or null.
    pub(crate) order: u64,
    /// Beside `live`: the slot of a partial tile's kept bits, or −1; and the bits.
    pub(crate) live_slots: u64,
    pub(crate) bits: u64,
}

// SAFETY: a plain #[repr(C)] struct of integers, laid out as its CUDA mirror.
unsafe impl DeviceRepr for MaskArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_are_ordered_by_head_then_longest_first_in_each_window() {
        // 2 heads of 3 query tiles, a block mask with a row per head: counts 1 2 2 | 2 0 3.
        let counts = [1, 2, 2, 2, 0, 3];
        // Head 0 from its last tile (2, 1, 0), then head 1's (5, 4, 3); windows of 4 sorted
        // (stably) by count: [2, 1, 0, 5] → [5, 2, 1, 0]; [4, 3] → [3, 4].
        assert_eq!(tile_order(&counts, 3, (1, 2, false, true), 4), [5, 2, 1, 0, 3, 4]);
        // One window: every tile sorted, the causal order among equal counts.
        assert_eq!(tile_order(&counts, 3, (1, 2, false, true), 6), [5, 2, 1, 3, 0, 4]);
        // A row the heads share (the first three counts) repeated for each head, and for each
        // batch entry of a row per batch entry (the batch entries' rows: 1 2 2 and 2 0 3).
        assert_eq!(tile_order(&counts[..3], 3, (1, 2, false, false), 6), [2, 1, 5, 4, 0, 3]);
        assert_eq!(tile_order(&counts, 3, (2, 1, true, false), 6), [5, 2, 1, 3, 0, 4]);
    }

    /// The busiest of `grid` blocks' work over the mean's when they take `order` in snake order
    /// (the FA3 kernel's `next_tile`), each tile's work `work[tile % tiles]`.
    fn busiest(order: &[i32], work: &[i32], tiles: usize, grid: usize) -> f64 {
        let mut load = vec![0i64; grid];
        for (k, &tile) in order.iter().enumerate() {
            let (round, lane) = (k / grid, k % grid);
            let block = if round % 2 == 0 { lane } else { grid - 1 - lane };
            load[block] += i64::from(work[tile as usize % tiles]);
        }
        let mean = load.iter().sum::<i64>() as f64 / grid as f64;
        *load.iter().max().unwrap() as f64 / mean
    }

    #[test]
    fn the_tile_order_shares_a_document_mask_out_evenly() {
        // 16 documents of 256 tokens in 4,096, causal, tiles of 128: query tile i walks
        // (i mod 2) + 1 key tiles; 8 documents of 512: (i mod 4) + 1; 4 of 1,024: (i mod 8) + 1.
        // 64 heads share the row; 132 blocks. The causal numbering (tiles from the last, all
        // heads of one before the next) leaves the busiest block far above the mean; the order
        // stays within 5 %.
        let (tiles, heads, grid) = (32, 64, 132);
        for period in [2, 4, 8] {
            let work: Vec<i32> = (0..tiles).map(|i| (i % period) as i32 + 1).collect();
            let order = tile_order(&work, tiles, (1, heads, false, false), 2 * grid);
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..(tiles * heads) as i32).collect::<Vec<_>>(), "every tile once");
            let causal: Vec<i32> = (0..tiles)
                .rev()
                .flat_map(|i| (0..heads).map(move |h| (h * tiles + i) as i32))
                .collect();
            let (ours, theirs) =
                (busiest(&order, &work, tiles, grid), busiest(&causal, &work, tiles, grid));
            assert!(ours <= 1.05, "period {period}: busiest {ours:.3}× the mean");
            assert!(theirs > 1.2, "period {period}: the causal numbering {theirs:.3}×");
        }
    }

    #[test]
    fn the_header_composes_the_terms_and_binds_what_each_reads() {
        let m = MaskMod::document_lengths(&[3, 5])
            .unwrap()
            .and(MaskMod::prefix_lm(2).unwrap().or(MaskMod::new("all", "return true;")));
        assert_eq!(m.name(), "(documents(8 keys) ∧ (prefix-lm(2) ∨ all))");
        let h = m.header();
        assert!(h.contains("const float* __restrict__ ids = args.tables[0];"), "{h}");
        assert!(h.contains("const int prefix = args.ints[0];"), "{h}");
        assert!(
            h.contains(
                "return (mask_mod_0::apply(at, args) && (mask_mod_1::apply(at, args) || \
                 mask_mod_2::apply(at, args)));"
            ),
            "{h}"
        );
        assert_eq!(m.block_extent(4, 8), (1, 1));
        let per_head = MaskMod::new("even heads", "return h % 2 == 0;");
        assert_eq!(per_head.block_extent(4, 8), (1, 8));
    }

    #[test]
    fn bad_masks_are_errors() {
        let docs = MaskMod::document_lengths(&[4, 4]).unwrap();
        assert!(docs.check(8).is_ok());
        let err = docs.check(9).unwrap_err().to_string();
        assert!(err.contains("table of 8 keys for 9 keys"), "{err}");
        let err = MaskMod::new("x", "return true;").int("not an ident", 1).check(4).unwrap_err();
        assert!(err.to_string().contains("not a C identifier"), "{err}");
        let many = (0..5).fold(MaskMod::new("x", "return true;"), |m, i| m.int(format!("i{i}"), i));
        assert!(many.check(4).unwrap_err().to_string().contains("up to 4"));
        assert!(MaskMod::documents(vec![1 << 24]).is_err());
    }
}
