//! What `ladder bench` runs: its flags ([`BenchArgs`]) resolved into a [`Plan`] of GPU rungs,
//! head dims, lengths and masks, with the shapes of the FlashAttention-3 paper by default, and,
//! with `--direction decode`, the decoding shapes ([`DecodeShape`]): new tokens against KV
//! caches of 1k … 128k entries, contiguous or paged ([`CacheLayout`]).

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::bail;
use clap::{Args, ValueEnum};
use ladder_compare::GpuRung;
use ladder_compare::modifiers::ModifierSpec;
use ladder_compare::results::Direction;
use ladder_kernels::DType;
use ladder_kernels::decode;
use ladder_reference::Window;

/// Which masks to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CausalArg {
    /// Causal and non-causal.
    Both,
    /// Causal only.
    True,
    /// Non-causal only.
    False,
}

/// Element type of Q, K, V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

/// How Q, K, V (and dO) of a prefill case lie in memory (`--layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// `[batch, heads, seq, d]`, contiguous.
    Bhsd,
    /// `[batch, seq, heads, d]` in memory, what a QKV projection produces, handed to the rungs
    /// as a transposed view without a copy (O and the gradients come back laid out the same
    /// way); only the rungs that take strides run in it (FA2, FA3).
    Bshd,
}

impl LayoutArg {
    /// The CSV's `layout` field: none for `[batch, heads, seq, d]`, else the layout's name.
    pub(super) fn label(self) -> Option<&'static str> {
        match self {
            LayoutArg::Bhsd => None,
            LayoutArg::Bshd => Some("bshd"),
        }
    }
}

/// FlashDecoding++'s GEMM shape (`--pp-kernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PpKernelArg {
    /// CUDA cores, one query row per block.
    Gemv,
    /// Tensor cores, `Sᵀ = K·Qᵀ` with the rows padded to 8.
    FlatGemm,
}

/// How a decoding case's KV cache is laid out: `--page-size none` or a page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// `[batch, heads_kv, L, d]`.
    Contiguous,
    /// Pages of this many tokens, `[pages, heads_kv, page_size, d]`, in shuffled order.
    Paged(usize),
}

impl CacheLayout {
    /// Tokens per page; `None` when contiguous.
    pub fn page_size(self) -> Option<usize> {
        match self {
            CacheLayout::Contiguous => None,
            CacheLayout::Paged(p) => Some(p),
        }
    }
}

impl FromStr for CacheLayout {
    type Err = String;

    /// `none` (contiguous) or a number of tokens per page.
    fn from_str(s: &str) -> Result<CacheLayout, String> {
        match s.trim() {
            "none" => Ok(CacheLayout::Contiguous),
            n => n.parse().map(CacheLayout::Paged).map_err(|_| {
                format!("`{n}`: expected `none` (a contiguous cache) or tokens per page")
            }),
        }
    }
}

/// `--window`: `none`, or `LEFT,RIGHT` as [`Window`] parses it.
fn parse_window(text: &str) -> Result<Window, String> {
    if text.trim() == "none" { Ok(Window::default()) } else { text.parse() }
}

/// `--score-mod`: `none`, or a modifier as [`ModifierSpec`] parses it.
fn parse_score_mod(text: &str) -> Result<Option<ModifierSpec>, String> {
    if text.trim() == "none" { Ok(None) } else { text.parse().map(Some) }
}

/// `ladder bench` flags.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// GPU rungs to time, comma-separated (fa1, fa2, fa3, fa3-fp8, fa2-det, fa3-det,
    /// flash-decoding, flash-decoding-pp) [default: all]; fa2 and fa3 name both directions. fa3-fp8 times the attention on inputs quantised to
    /// e4m3 beforehand (untimed), as FP8 peers take e4m3 inputs.
    #[arg(long, value_delimiter = ',')]
    pub(super) rung: Vec<String>,
    /// Directions, comma-separated: fwd, bwd, decode [default: fwd,bwd, or the directions of the
    /// rungs given with --rung]. `decode` times FlashDecoding and FlashDecoding++ against KV caches (d = 128 unless
    /// --d; the five reference decode shapes with 1 and 4 new tokens, contiguous and paged, and a
    /// sweep of batch × length × GQA with one new token; TB/s).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(super) direction: Vec<Direction>,
    /// Head dims, comma-separated [default: 64,128].
    #[arg(long, value_delimiter = ',')]
    pub(super) d: Vec<usize>,
    /// Sequence lengths, comma-separated [default: 512,1024,2048,4096,8192,16384]; for decode,
    /// the KV cache lengths L [default: the reference shapes, and 1k,4k,16k,64k,128k].
    #[arg(long, value_delimiter = ',')]
    pub(super) n: Vec<usize>,
    /// Decode only: batch sizes, comma-separated [default: 1,4,16,64].
    #[arg(long, value_delimiter = ',')]
    pub(super) batch: Vec<usize>,
    /// Decode only: key/value heads, comma-separated, for 32 query heads [default: 32,8].
    #[arg(long, value_delimiter = ',')]
    pub(super) heads_kv: Vec<usize>,
    /// Decode only: a fixed number of splits of each KV cache (`DecodeOptions::splits`)
    /// [default: the kernel's heuristic]. The count used is in bench.json's rows.
    #[arg(long)]
    pub(super) splits: Option<usize>,
    /// FlashDecoding++ only: force its GEMV or flat GEMM [default: the GEMV for one row per kv
    /// head, the flat GEMM for more]. The kernel that ran is in bench.json's rows.
    #[arg(long, value_enum)]
    pub(super) pp_kernel: Option<PpKernelArg>,
    /// FlashDecoding++ only: the unified max φ (`DecodeOptions::phi`) [default: 0]. Rows whose
    /// scores leave its window are recomputed (in the same launch); their count is in bench.json.
    #[arg(long)]
    pub(super) phi: Option<f32>,
    /// FlashDecoding++ only: add the splits' partials with atomics as they come
    /// (`DecodeOptions::atomic_sums`, the paper's way) instead of in split order.
    #[arg(long)]
    pub(super) pp_atomic_sums: bool,
    /// Decode only: new tokens per sequence (1 … 16; more than one is speculative decoding,
    /// causal among themselves), comma-separated [default: 1,4 on the reference shapes, 1 on the
    /// sweep].
    #[arg(long, value_delimiter = ',')]
    pub(super) new_tokens: Vec<usize>,
    /// Decode only: KV cache layouts, comma-separated: `none` (contiguous) or tokens per page
    /// (16, 32, 64, 128, 256; pages in shuffled order) [default: none,16,64 on the reference
    /// shapes, none on the sweep].
    #[arg(long, value_delimiter = ',')]
    pub(super) page_size: Vec<CacheLayout>,
    /// Memory layouts of Q, K, V (and of a decoding call's Q and cache), comma-separated: bhsd
    /// ([batch, heads, seq, d]), bshd ([batch, seq, heads, d], as a strided view; FA2, FA3 and
    /// the decoding rungs; pages of a paged cache [page, page_size, heads_kv, d]) [default: bhsd].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(super) layout: Vec<LayoutArg>,
    /// Masks: both, true (causal only) or false.
    #[arg(long, value_enum, default_value_t = CausalArg::Both)]
    pub(super) causal: CausalArg,
    /// A sliding window of keys, `LEFT,RIGHT` (flash-attention's `window_size`, `-1` for an open
    /// side: `4095,0` or `4095,-1` with the causal mask is Mistral's window of 4096), or `none`;
    /// give the flag once per window [default: none]. A windowed case runs on the rungs that take
    /// a window (fa2 forward and backward, fa3 and fa3-fp8 forward) and counts TFLOP/s on the
    /// pairs it attends.
    #[arg(long, value_parser = parse_window, allow_hyphen_values = true)]
    pub(super) window: Vec<Window>,
    /// A modifier (`softcap:CAP`, `alibi`, `softcap:CAP+alibi`, `relative-bias`, `sinks`) or
    /// `none`; give the flag once per modifier [default: none]. A modified case runs on the
    /// rungs that take a modifier (fa2, fa3: forward and backward) and counts the FLOPs of the
    /// unmodified case.
    #[arg(long = "score-mod", value_parser = parse_score_mod)]
    pub(super) score_mod: Vec<Option<ModifierSpec>>,
    /// Element type of Q, K, V.
    #[arg(long, value_enum, default_value_t = DtypeArg::Fp16)]
    pub(super) dtype: DtypeArg,
    /// Timed samples per case (median reported) [default: 30; 5 with --quick].
    #[arg(long)]
    pub(super) repeats: Option<usize>,
    /// Untimed warm-up calls per case, after the first (compiling) call [default: 5; 2 with --quick].
    #[arg(long)]
    pub(super) warmup: Option<usize>,
    /// Results folder: bench.csv, bench.json, meta.json, charts (*.svg).
    #[arg(long, default_value = "bench-results")]
    pub(super) out: PathBuf,
    /// A small subset for smoke runs: d = 128, n = 1024 and 4096, non-causal, 5 repeats (flags
    /// given explicitly still apply).
    #[arg(long)]
    pub(super) quick: bool,
    /// Only redraw the charts from OUT/bench.csv and OUT/peers.csv (if any) and print the
    /// side-by-side table; needs no GPU.
    #[arg(long)]
    pub(super) charts_only: bool,
    /// Tokens per batch: batch = tokens / n (at least 1).
    #[arg(long, default_value_t = 16384)]
    pub(super) tokens: usize,
    /// Hidden size: heads = hidden / d.
    #[arg(long, default_value_t = 2048)]
    pub(super) hidden: usize,
    /// FA1 (scalar FP32, one block per (batch, head)) runs only up to this n.
    #[arg(long, default_value_t = 2048)]
    pub(super) fa1_max_n: usize,
    /// Timed samples per FA1 case.
    #[arg(long, default_value_t = 3)]
    pub(super) fa1_repeats: usize,
    /// Stop sampling a case once its timed samples add up to this many seconds.
    #[arg(long, default_value_t = 3.0)]
    pub(super) case_budget_s: f64,
    /// Instead of the standard shapes, the rungs with a packed entry point (fa2, fa3 forward;
    /// fa2, fa2-det backward; --rung and --direction select) on a packed variable-length batch:
    /// 64 sequences of 128 … 4096 tokens (a fixed draw), heads = hidden / d (--d, --causal,
    /// --dtype apply), beside the same kernel on 64 sequences of the mean length; real FLOPs only.
    /// Writes varlen.csv.
    #[arg(long)]
    pub(super) varlen: bool,
}

/// Query heads of every decoding case (Llama-style 32 heads of d = 128).
pub(super) const DECODE_HEADS_Q: usize = 32;
/// Decoding cases whose K and V together exceed this many bytes are left out.
pub(super) const DECODE_MAX_KV_BYTES: usize = 40_000_000_000;
/// The five reference decoding shapes (d = 128: batch 1 and 16, all heads and grouped 4:1, short
/// and long caches): (batch, heads_q, heads_kv, L). Each runs with [`REFERENCE_NEW_TOKENS`] new
/// tokens and in every [`REFERENCE_LAYOUTS`] unless the flags say otherwise.
const DECODE_REFERENCE_SHAPES: [(usize, usize, usize, usize); 5] = [
    (1, 32, 32, 8 << 10),
    (1, 32, 32, 128 << 10),
    (16, 32, 32, 32 << 10),
    (1, 32, 8, 8 << 10),
    (16, 32, 8, 32 << 10),
];
/// New tokens per sequence on the reference shapes: ordinary and speculative decoding.
const REFERENCE_NEW_TOKENS: [usize; 2] = [1, 4];
/// Cache layouts of the reference shapes: contiguous, and the small and the middle page size.
const REFERENCE_LAYOUTS: [CacheLayout; 3] =
    [CacheLayout::Contiguous, CacheLayout::Paged(16), CacheLayout::Paged(64)];
const DECODE_BATCHES: [usize; 4] = [1, 4, 16, 64];
const DECODE_LENGTHS: [usize; 5] = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 128 << 10];
const DECODE_HEADS_KV: [usize; 2] = [32, 8];

/// One decoding shape: `batch` sequences with `heads_q` query heads, against a KV cache of
/// `heads_kv` heads and `len` entries per sequence (every sequence full); the new tokens and the
/// cache layouts it runs with are [`Plan::decode_new_tokens`] and [`Plan::decode_layouts`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct DecodeShape {
    pub(super) batch: usize,
    pub(super) heads_q: usize,
    pub(super) heads_kv: usize,
    pub(super) len: usize,
}

impl DecodeShape {
    /// Bytes of K and V together at head dim `d` in `dtype`.
    pub(super) fn kv_bytes(&self, d: usize, dtype: DType) -> usize {
        2 * self.batch * self.heads_kv * self.len * d * dtype.size()
    }

    /// Whether this is one of the five reference shapes.
    fn is_reference(&self) -> bool {
        DECODE_REFERENCE_SHAPES.contains(&(self.batch, self.heads_q, self.heads_kv, self.len))
    }
}

/// The resolved flags.
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) rungs: Vec<&'static str>,
    pub(super) directions: Vec<Direction>,
    pub(super) ds: Vec<usize>,
    pub(super) ns: Vec<usize>,
    pub(super) causals: Vec<bool>,
    /// `--window` (default: no window only).
    pub(super) windows: Vec<Window>,
    /// `--score-mod` (default: none only).
    pub(super) score_mods: Vec<Option<ModifierSpec>>,
    /// `--layout` (default `[b, h, s, d]` only).
    pub(super) input_layouts: Vec<LayoutArg>,
    pub(super) dtype: DType,
    pub(super) repeats: usize,
    pub(super) warmup: usize,
    pub(super) tokens: usize,
    pub(super) hidden: usize,
    pub(super) fa1_max_n: usize,
    pub(super) fa1_repeats: usize,
    pub(super) budget_ms: f64,
    /// Head dims of the decoding cases.
    pub(super) decode_ds: Vec<usize>,
    /// The decoding shapes, in order (empty unless `decode` is a direction).
    pub(super) decode: Vec<DecodeShape>,
    /// Decoding shapes left out because K and V exceed [`DECODE_MAX_KV_BYTES`].
    pub(super) decode_too_large: usize,
    /// `--splits`: a fixed split count for the decoding kernel.
    pub(super) splits: Option<usize>,
    /// FlashDecoding++'s strategy (`--pp-kernel`, or by the rows) and `φ` (`--phi`).
    pub(super) pp_strategy: decode::Strategy,
    pub(super) phi: f32,
    /// `--pp-atomic-sums`.
    pub(super) pp_atomic_sums: bool,
    /// `--new-tokens` (empty: the defaults per shape).
    pub(super) new_tokens: Vec<usize>,
    /// `--page-size` (empty: the defaults per shape).
    pub(super) layouts: Vec<CacheLayout>,
}

impl Plan {
    pub(super) fn from_args(a: &BenchArgs) -> anyhow::Result<Plan> {
        let known = GpuRung::names();
        let rungs = if a.rung.is_empty() {
            known.clone()
        } else {
            let mut rungs = Vec::new();
            for name in &a.rung {
                let Some(&r) = known.iter().find(|k| **k == name.trim()) else {
                    bail!("--rung {name}: no such GPU rung (known: {})", known.join(", "));
                };
                rungs.push(r);
            }
            rungs
        };
        let or = |given: &[usize], full: &[usize], quick: &[usize]| -> Vec<usize> {
            if !given.is_empty() {
                given.to_vec()
            } else if a.quick {
                quick.to_vec()
            } else {
                full.to_vec()
            }
        };
        let ds = or(&a.d, &[64, 128], &[128]);
        let ns = or(&a.n, &[512, 1024, 2048, 4096, 8192, 16384], &[1024, 4096]);
        let directions = if !a.direction.is_empty() {
            a.direction.clone()
        } else if !a.rung.is_empty() {
            // The directions the named rungs have kernels for (`--rung flash-decoding` alone
            // means decode).
            Direction::ALL
                .into_iter()
                .filter(|&d| rungs.iter().any(|r| GpuRung::find(r, d).is_some()))
                .collect()
        } else {
            vec![Direction::Fwd, Direction::Bwd]
        };
        let causals = match (a.causal, a.quick) {
            (CausalArg::True, _) => vec![true],
            (CausalArg::False, _) | (CausalArg::Both, true) => vec![false],
            (CausalArg::Both, false) => vec![false, true],
        };
        if a.hidden == 0 || a.tokens == 0 {
            bail!("--hidden and --tokens must be positive");
        }
        for &d in &ds {
            if d == 0 || a.hidden % d != 0 {
                bail!("--d {d}: the hidden size {} must be a multiple of d", a.hidden);
            }
        }
        if ns.contains(&0) {
            bail!("--n: lengths must be positive");
        }
        if a.varlen && a.window.iter().any(Window::is_some) {
            bail!("--window: the windowed cases run on the standard shapes, not with --varlen");
        }
        if a.varlen && a.score_mod.iter().any(Option::is_some) {
            bail!("--score-mod: the modified cases run on the standard shapes, not with --varlen");
        }
        if a.case_budget_s.is_nan() || a.case_budget_s <= 0.0 {
            bail!("--case-budget-s must be positive");
        }
        if a.batch.contains(&0) {
            bail!("--batch: batch sizes must be positive");
        }
        for &h in &a.heads_kv {
            if h == 0 || DECODE_HEADS_Q % h != 0 {
                bail!("--heads-kv {h}: must divide the {DECODE_HEADS_Q} query heads");
            }
        }
        if a.splits == Some(0) {
            bail!("--splits must be at least 1");
        }
        if let Some(phi) = a.phi.filter(|p| !p.is_finite()) {
            bail!("--phi must be finite, got {phi}");
        }
        let pp_strategy = match a.pp_kernel {
            None => decode::Strategy::FlashDecodingPp,
            Some(PpKernelArg::Gemv) => decode::Strategy::Gemv,
            Some(PpKernelArg::FlatGemm) => decode::Strategy::FlatGemm,
        };
        if let Some(n) = a.new_tokens.iter().find(|&&n| n == 0 || n > decode::MAX_NEW_TOKENS) {
            bail!("--new-tokens {n}: decoding takes 1 to {} new tokens", decode::MAX_NEW_TOKENS);
        }
        for layout in &a.page_size {
            if let Some(p) = layout.page_size().filter(|p| !decode::PAGE_SIZES.contains(p)) {
                bail!("--page-size {p}: pages of {:?} tokens, or none", decode::PAGE_SIZES);
            }
        }
        let dtype = match a.dtype {
            DtypeArg::Fp16 => DType::F16,
            DtypeArg::Bf16 => DType::BF16,
        };
        let decode_ds = if a.d.is_empty() { vec![128] } else { a.d.clone() };
        let mut decode = Vec::new();
        if directions.contains(&Direction::Decode) {
            let overridden = !(a.n.is_empty() && a.batch.is_empty() && a.heads_kv.is_empty());
            if !overridden {
                decode.extend(DECODE_REFERENCE_SHAPES.map(|(batch, heads_q, heads_kv, len)| {
                    DecodeShape { batch, heads_q, heads_kv, len }
                }));
            }
            if !a.quick || overridden {
                let pick = |given: &[usize], default: &[usize]| {
                    if given.is_empty() { default.to_vec() } else { given.to_vec() }
                };
                for batch in pick(&a.batch, &DECODE_BATCHES) {
                    for heads_kv in pick(&a.heads_kv, &DECODE_HEADS_KV) {
                        for len in pick(&a.n, &DECODE_LENGTHS) {
                            let shape =
                                DecodeShape { batch, heads_q: DECODE_HEADS_Q, heads_kv, len };
                            if !decode.contains(&shape) {
                                decode.push(shape);
                            }
                        }
                    }
                }
            }
        }
        let max_d = decode_ds.iter().copied().max().unwrap_or(0);
        let before = decode.len();
        decode.retain(|s| s.kv_bytes(max_d, dtype) <= DECODE_MAX_KV_BYTES);
        let decode_too_large = before - decode.len();
        Ok(Plan {
            rungs,
            directions,
            ds,
            ns,
            causals,
            windows: if a.window.is_empty() { vec![Window::default()] } else { a.window.clone() },
            score_mods: if a.score_mod.is_empty() { vec![None] } else { a.score_mod.clone() },
            input_layouts: if a.layout.is_empty() {
                vec![LayoutArg::Bhsd]
            } else {
                a.layout.clone()
            },
            dtype,
            repeats: a.repeats.unwrap_or(if a.quick { 5 } else { 30 }).max(1),
            warmup: a.warmup.unwrap_or(if a.quick { 2 } else { 5 }).max(1),
            tokens: a.tokens,
            hidden: a.hidden,
            fa1_max_n: a.fa1_max_n,
            fa1_repeats: a.fa1_repeats.max(1),
            budget_ms: a.case_budget_s * 1e3,
            decode_ds,
            decode,
            decode_too_large,
            splits: a.splits,
            pp_strategy,
            phi: a.phi.unwrap_or(decode::DEFAULT_PHI),
            pp_atomic_sums: a.pp_atomic_sums,
            new_tokens: a.new_tokens.clone(),
            layouts: a.page_size.clone(),
        })
    }

    /// The new-token counts `shape` runs with: `--new-tokens`, else 1 and 4 on the reference
    /// shapes and 1 on the sweep.
    pub(super) fn decode_new_tokens(&self, shape: DecodeShape) -> Vec<usize> {
        if !self.new_tokens.is_empty() {
            self.new_tokens.clone()
        } else if shape.is_reference() {
            REFERENCE_NEW_TOKENS.to_vec()
        } else {
            vec![1]
        }
    }

    /// The cache layouts `shape` runs with: `--page-size`, else contiguous and pages of 16 and
    /// 64 on the reference shapes, contiguous on the sweep.
    pub(super) fn decode_layouts(&self, shape: DecodeShape) -> Vec<CacheLayout> {
        if !self.layouts.is_empty() {
            self.layouts.clone()
        } else if shape.is_reference() {
            REFERENCE_LAYOUTS.to_vec()
        } else {
            vec![CacheLayout::Contiguous]
        }
    }

    /// Decoding cases per head dim and decoding rung: every shape with each of its new-token
    /// counts and cache layouts.
    fn decode_cases(&self) -> usize {
        self.decode
            .iter()
            .map(|&s| self.decode_new_tokens(s).len() * self.decode_layouts(s).len())
            .sum()
    }

    /// `(batch, heads)` for head dim `d` and length `n`.
    pub(super) fn dims(&self, d: usize, n: usize) -> (usize, usize) {
        ((self.tokens / n).max(1), self.hidden / d)
    }

    /// The decoding rungs to run on every decoding shape, in table order.
    pub(super) fn decode_rungs(&self) -> Vec<GpuRung> {
        if !self.directions.contains(&Direction::Decode) {
            return Vec::new();
        }
        GpuRung::ALL
            .into_iter()
            .filter(|r| r.direction() == Direction::Decode && self.rungs.contains(&r.name()))
            .collect()
    }

    /// The prefill (forward and backward) GPU rungs to run at length `n`, in order: by
    /// direction, then in table order.
    /// [`Plan::rungs_at`] that take inputs in `layout` (every one in `[b, h, s, d]`; those
    /// that take strides in the others).
    pub(super) fn rungs_in(&self, layout: LayoutArg, d: usize, n: usize) -> Vec<GpuRung> {
        let mut rungs = self.rungs_at(d, n);
        if layout != LayoutArg::Bhsd {
            rungs.retain(|r| r.takes_strides());
        }
        rungs
    }

    /// [`Plan::rungs_in`] that take `window` and `score_mod` (every one when both are none).
    pub(super) fn rungs_with(
        &self,
        layout: LayoutArg,
        d: usize,
        n: usize,
        (window, score_mod): (Window, Option<ModifierSpec>),
    ) -> Vec<GpuRung> {
        let mut rungs = self.rungs_in(layout, d, n);
        if window.is_some() {
            rungs.retain(|r| r.takes_window());
        }
        if score_mod.is_some() {
            rungs.retain(|r| r.takes_score_mod());
        }
        rungs
    }

    /// Every (window, score modifier) pair of the plan.
    pub(super) fn masks(&self) -> Vec<(Window, Option<ModifierSpec>)> {
        self.windows.iter().flat_map(|&w| self.score_mods.iter().map(move |&m| (w, m))).collect()
    }

    pub(super) fn rungs_at(&self, d: usize, n: usize) -> Vec<GpuRung> {
        let mut out = Vec::new();
        for &direction in self.directions.iter().filter(|d| **d != Direction::Decode) {
            for rung in GpuRung::ALL {
                if rung.direction() == direction
                    && self.rungs.contains(&rung.name())
                    && rung.supports(d)
                    && (rung != GpuRung::Fa1 || n <= self.fa1_max_n)
                {
                    out.push(rung);
                }
            }
        }
        out
    }

    /// Timed samples per case of `rung`.
    pub(super) fn repeats_of(&self, rung: GpuRung) -> usize {
        if rung == GpuRung::Fa1 { self.fa1_repeats } else { self.repeats }
    }

    /// Untimed warm-up calls per case of `rung`, after the first.
    pub(super) fn warmup_of(&self, rung: GpuRung) -> usize {
        if rung == GpuRung::Fa1 { 1 } else { self.warmup }
    }

    pub(super) fn case_count(&self) -> usize {
        self.causals.len()
            * self
                .input_layouts
                .iter()
                .flat_map(|&l| self.ds.iter().map(move |&d| (l, d)))
                .flat_map(|(l, d)| self.ns.iter().map(move |&n| (l, d, n)))
                .flat_map(|(l, d, n)| self.masks().into_iter().map(move |m| (l, d, n, m)))
                .map(|(l, d, n, m)| self.rungs_with(l, d, n, m).len())
                .sum::<usize>()
            + self.input_layouts.len()
                * self.decode_ds.len()
                * self.decode_cases()
                * self.decode_rungs().len()
    }

    /// What the run leaves out or times differently, for the console and `meta.json`.
    pub(super) fn notes(&self) -> Vec<String> {
        let mut notes = vec![format!(
            "median of {} CUDA-event samples per case after {} warm-up calls (at most {:.1} s of \
             samples per case); inputs rotate when they fit in L2",
            self.repeats,
            self.warmup,
            self.budget_ms / 1e3
        )];
        if self.rungs.contains(&GpuRung::Fa1.name()) && self.directions.contains(&Direction::Fwd) {
            notes.push(format!(
                "fa1 (scalar FP32, one block per (batch, head)) only for n <= {} with {} samples \
                 (--fa1-max-n, --fa1-repeats)",
                self.fa1_max_n, self.fa1_repeats
            ));
        }
        let missing: Vec<String> = self
            .rungs
            .iter()
            .flat_map(|r| self.directions.iter().map(move |d| (*r, *d)))
            .filter(|(r, d)| GpuRung::find(r, *d).is_none())
            // Decoding is its own kind of kernel: the prefill rungs have none, and the decoding
            // rungs have no prefill pass; neither is a gap worth a note.
            .filter(|(r, d)| {
                *d != Direction::Decode && GpuRung::find(r, Direction::Decode).is_none()
            })
            .map(|(r, d)| format!("{r} {}", d.name()))
            .collect();
        if !missing.is_empty() {
            notes.push(format!("no GPU kernel (yet) for: {}", missing.join(", ")));
        }
        if !self.decode_rungs().is_empty() {
            let tokens =
                |n: &[usize]| n.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
            let layouts = |l: &[CacheLayout]| {
                let name = |l: &CacheLayout| {
                    l.page_size().map_or("contiguous".into(), |p| format!("pages of {p}"))
                };
                l.iter().map(name).collect::<Vec<String>>().join(", ")
            };
            let tokens = if self.new_tokens.is_empty() {
                format!(
                    "new tokens {} on the reference shapes, 1 on the sweep",
                    tokens(&REFERENCE_NEW_TOKENS)
                )
            } else {
                format!("new tokens {}", tokens(&self.new_tokens))
            };
            let layouts = if self.layouts.is_empty() {
                format!(
                    "caches {} on the reference shapes, contiguous on the sweep",
                    layouts(&REFERENCE_LAYOUTS)
                )
            } else {
                format!("caches {}", layouts(&self.layouts))
            };
            let per_shape = format!("{tokens} / {layouts}");
            notes.push(format!(
                "decode: {} shape(s), {per_shape} ({} cases); each KV cache allocated once per \
                 shape and layout with every sequence full, pages in shuffled order; O and lse \
                 allocated once per case (decode::forward_into); calls back to back, the split \
                 kernel launched programmatically (PDL) on sm_90+; TB/s = bytes of K and V / time; \
                 splits: {}",
                self.decode.len(),
                self.decode_cases(),
                self.splits
                    .map_or("the kernel's heuristic".to_string(), |s| format!("{s} (--splits)"))
            ));
        }
        if self.score_mods.iter().any(Option::is_some) {
            notes.push(
                "modified cases (--score-mod): on fa2 and fa3, forward and backward, TFLOP/s counting the \
                 FLOPs of the unmodified case"
                    .to_string(),
            );
        }
        if self.windows.iter().any(Window::is_some) {
            notes.push(
                "windowed cases: on the rungs that take a window, TFLOP/s counting only the \
                 query-key pairs the window attends"
                    .to_string(),
            );
        }
        if self.decode_too_large > 0 {
            notes.push(format!(
                "decode: {} shape(s) left out, their K and V exceeding {} GB",
                self.decode_too_large,
                DECODE_MAX_KV_BYTES / 1_000_000_000
            ));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn plan(args: &[&str]) -> anyhow::Result<Plan> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?;
        Plan::from_args(&cli.bench)
    }

    #[test]
    fn default_plan_is_the_fa3_paper_sweep() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.ds, [64, 128]);
        assert_eq!(p.ns, [512, 1024, 2048, 4096, 8192, 16384]);
        assert_eq!(p.causals, [false, true]);
        assert_eq!(p.directions, [Direction::Fwd, Direction::Bwd]);
        assert_eq!(p.dims(128, 16384), (1, 16));
        assert_eq!(p.dims(64, 512), (32, 32));
        // fa1 stops at 2048.
        let at = |n| p.rungs_at(128, n);
        let (det, atomic) = (GpuRung::Fa2BackwardDeterministic, GpuRung::Fa2Backward);
        let fp8 = GpuRung::Fa3Fp8;
        let (fa3, fa3_det) = (GpuRung::Fa3Backward, GpuRung::Fa3BackwardDeterministic);
        assert_eq!(
            at(2048),
            [GpuRung::Fa1, GpuRung::Fa2, GpuRung::Fa3, fp8, atomic, det, fa3, fa3_det]
        );
        assert_eq!(at(4096), [GpuRung::Fa2, GpuRung::Fa3, fp8, atomic, det, fa3, fa3_det]);
        assert!(p.rungs_at(64, 4096).contains(&fp8), "fa3-fp8 takes every multiple of 16");
        assert_eq!((p.repeats_of(GpuRung::Fa1), p.repeats_of(GpuRung::Fa2)), (3, 30));
        assert!(p.notes().iter().any(|n| n.contains("n <= 2048")));
        let notes = p.notes().join("; ");
        assert!(notes.contains("fa1 bwd") && !notes.contains("flash-decoding"), "{notes}");
        let d = plan(&["--direction", "fwd,decode"]).unwrap().notes().join("; ");
        assert!(!d.contains("fa2 decode") && !d.contains("flash-decoding fwd"), "{d}");
    }

    #[test]
    fn flags_narrow_the_plan() {
        let p = plan(&[
            "--rung",
            "fa2",
            "--d",
            "64",
            "--n",
            "512,1024",
            "--causal",
            "true",
            "--direction",
            "fwd",
            "--dtype",
            "bf16",
            "--repeats",
            "7",
        ])
        .unwrap();
        assert_eq!(
            (p.rungs.as_slice(), p.ds.as_slice(), p.ns.as_slice()),
            (&["fa2"][..], &[64][..], &[512, 1024][..])
        );
        assert_eq!((p.causals.as_slice(), p.dtype, p.repeats), (&[true][..], DType::BF16, 7));
        assert_eq!(p.case_count(), 2);
        // [b, s, h, d] inputs: only the rungs that take strides run in them.
        let args = ["--rung", "fa1,fa2", "--direction", "fwd", "--d", "64", "--n", "512"];
        let l = plan(&[&args[..], &["--layout", "bhsd,bshd"]].concat()).unwrap();
        assert_eq!(l.rungs_in(LayoutArg::Bshd, 64, 512), [GpuRung::Fa2]);
        assert_eq!(l.rungs_in(LayoutArg::Bhsd, 64, 512), [GpuRung::Fa1, GpuRung::Fa2]);
        assert_eq!(l.case_count(), 2 * 3, "fa1, fa2 and fa2/bshd, with and without the mask");
        let q = plan(&["--quick"]).unwrap();
        assert_eq!(
            (q.ds.as_slice(), q.ns.as_slice(), q.causals.as_slice()),
            (&[128][..], &[1024, 4096][..], &[false][..])
        );
        assert_eq!(q.repeats, 5);
        assert!(plan(&["--rung", "fa9"]).unwrap_err().to_string().contains("known: fa1, fa2"));
        assert!(plan(&["--d", "96"]).is_err(), "2048 is not a multiple of 96");
        assert!(plan(&["--n", "0"]).is_err());
        // No decoding cases unless asked for.
        assert!(plan(&[]).unwrap().decode.is_empty());
    }

    #[test]
    fn windows_add_cases_on_the_rungs_that_take_one() {
        let args = ["--rung", "fa2,fa3", "--direction", "fwd", "--d", "128", "--n", "16384"];
        let p = plan(&[&args[..], &["--causal", "true", "--window", "none"]].concat()).unwrap();
        assert_eq!((p.windows.as_slice(), p.case_count()), (&[Window::default()][..], 2));
        let w = plan(
            &[&args[..], &["--causal", "true", "--window", "none", "--window", "4095,-1"]].concat(),
        )
        .unwrap();
        assert_eq!(w.windows, [Window::default(), Window::left(4095)]);
        let windowed = w.rungs_with(LayoutArg::Bhsd, 128, 16384, (Window::left(4095), None));
        assert_eq!(windowed, [GpuRung::Fa2, GpuRung::Fa3]);
        assert_eq!(w.case_count(), 4, "fa2 and fa3, plain and windowed");
        let fa1 = plan(&["--rung", "fa1", "--direction", "fwd", "--n", "512", "--window", "8,0"]);
        assert_eq!(fa1.unwrap().case_count(), 0, "fa1 takes no window");
        assert!(w.notes().join("; ").contains("pairs the window attends"));
        assert_eq!(plan(&args).unwrap().windows, [Window::default()], "no window by default");
        assert!(plan(&[&args[..], &["--window", "4095"]].concat()).is_err());
        assert!(plan(&["--varlen", "--window", "128,0"]).is_err());
    }

    #[test]
    fn decode_plan_is_the_reference_shapes_and_the_sweep() {
        let p = plan(&["--direction", "decode"]).unwrap();
        assert_eq!(p.directions, [Direction::Decode]);
        assert_eq!(p.decode_rungs(), [GpuRung::FlashDecoding, GpuRung::FlashDecodingPp]);
        assert!(p.rungs_at(128, 4096).is_empty(), "no prefill rungs");
        assert_eq!(p.decode_ds, [128]);
        let shape = |batch, heads_kv, len| DecodeShape { batch, heads_q: 32, heads_kv, len };
        assert_eq!(
            p.decode[..5],
            [
                shape(1, 32, 8192),
                shape(1, 32, 131072),
                shape(16, 32, 32768),
                shape(1, 8, 8192),
                shape(16, 8, 32768)
            ]
        );
        // 4 batches × 2 GQA × 5 lengths, less (1, 32/32, 128k) already there and the two
        // (64, 32/32) caches over 40 GB (64k: 68.7 GB, 128k: 137 GB).
        assert_eq!(p.decode.len(), 5 + 40 - 1 - 2);
        assert_eq!(p.decode_too_large, 2);
        assert!(p.decode.contains(&shape(64, 8, 131072)), "34 GB fits");
        assert!(p.decode.contains(&shape(16, 32, 131072)), "34 GB fits");
        assert!(!p.decode.contains(&shape(64, 32, 65536)));
        assert!(p.decode.iter().all(|s| s.kv_bytes(128, DType::F16) <= DECODE_MAX_KV_BYTES));
        // The reference shapes run with 1 and 4 new tokens, contiguous and in pages of 16 and
        // 64 (the table in one run); the sweep with one token, contiguous.
        let (reference, sweep) = (shape(1, 8, 8192), shape(4, 8, 1024));
        assert_eq!(p.decode_new_tokens(reference), [1, 4]);
        let paged = |s: &[usize]| -> Vec<CacheLayout> {
            std::iter::once(CacheLayout::Contiguous)
                .chain(s.iter().map(|&p| CacheLayout::Paged(p)))
                .collect()
        };
        assert_eq!(p.decode_layouts(reference), paged(&[16, 64]));
        assert_eq!((p.decode_new_tokens(sweep), p.decode_layouts(sweep)), (vec![1], paged(&[])));
        assert_eq!(p.case_count(), 2 * (5 * 2 * 3 + (p.decode.len() - 5)), "two decoding rungs");
        assert_eq!(p.splits, None);
        assert_eq!((p.pp_strategy, p.phi), (decode::Strategy::FlashDecodingPp, 0.0));
        assert!(!p.pp_atomic_sums);
        let notes = p.notes().join("\n");
        assert!(notes.contains("heuristic") && notes.contains("2 shape(s) left out"), "{notes}");
        assert!(notes.contains("pages of 16, pages of 64 on the reference shapes"), "{notes}");

        // --rung flash-decoding alone means decode; --quick keeps the reference shapes.
        let q = plan(&["--rung", "flash-decoding", "--quick"]).unwrap();
        assert_eq!(q.directions, [Direction::Decode]);
        assert_eq!(q.decode, p.decode[..5]);
        assert_eq!(q.repeats, 5);
        // --n, --batch, --heads-kv replace the shapes by their grid; --splits is passed on.
        let g = plan(&[
            "--direction",
            "fwd,decode",
            "--n",
            "4096,65536",
            "--batch",
            "2",
            "--heads-kv",
            "4",
            "--splits",
            "16",
            "--d",
            "64",
        ])
        .unwrap();
        assert_eq!(g.decode, [shape(2, 4, 4096), shape(2, 4, 65536)]);
        assert_eq!((g.decode_ds.as_slice(), g.splits), (&[64][..], Some(16)));
        assert_eq!(g.rungs_at(64, 4096), [GpuRung::Fa2, GpuRung::Fa3, GpuRung::Fa3Fp8]);
        assert_eq!(
            g.case_count(),
            3 * 2 * 2 + 2 * 2,
            "fa2, fa3, fa3-fp8 fwd × 2 masks × 2 lengths, and 2 decode × 2 decoding rungs"
        );
        assert!(g.notes().join(" ").contains("16 (--splits)"));
        let l = plan(&["--direction", "decode", "--n", "1024"]).unwrap();
        assert_eq!(l.decode.len(), 4 * 2, "every batch and GQA at L = 1024");
        // --new-tokens and --page-size apply to every shape.
        let f = plan(&[
            "--direction",
            "decode",
            "--new-tokens",
            "2,16",
            "--page-size",
            "none,32,256",
            "--quick",
        ])
        .unwrap();
        assert_eq!(f.decode.len(), 5);
        for s in &f.decode {
            assert_eq!(f.decode_new_tokens(*s), [2, 16]);
            assert_eq!(f.decode_layouts(*s), paged(&[32, 256]));
        }
        assert_eq!(f.case_count(), 2 * 5 * 2 * 3);
        let notes = f.notes().join(" ");
        assert!(notes.contains("new tokens 2, 16 / caches contiguous, pages of 32"), "{notes}");
        let g2 = plan(&["--direction", "decode", "--n", "4096", "--page-size", "64"]).unwrap();
        assert_eq!(g2.decode_layouts(g2.decode[0]), [CacheLayout::Paged(64)]);
        assert_eq!(g2.decode_new_tokens(g2.decode[0]), [1]);
        // Bad decode flags.
        assert!(plan(&["--direction", "decode", "--heads-kv", "5"]).is_err());
        assert!(plan(&["--direction", "decode", "--batch", "0"]).is_err());
        assert!(plan(&["--direction", "decode", "--splits", "0"]).is_err());
        for bad in [["--new-tokens", "0"], ["--new-tokens", "17"], ["--page-size", "48"]] {
            let e = plan(&["--direction", "decode", bad[0], bad[1]]).unwrap_err().to_string();
            assert!(e.contains(bad[0]), "{bad:?}: {e}");
        }
        assert!(plan(&["--direction", "decode", "--page-size", "big"]).is_err());
        // FlashDecoding++'s kernel and φ.
        let pp = plan(&["--rung", "flash-decoding-pp", "--pp-kernel", "gemv", "--phi", "2.5"]);
        let pp = pp.unwrap();
        assert_eq!(pp.decode_rungs(), [GpuRung::FlashDecodingPp]);
        assert_eq!((pp.pp_strategy, pp.phi), (decode::Strategy::Gemv, 2.5));
        let flat = plan(&["--direction", "decode", "--pp-kernel", "flat-gemm", "--pp-atomic-sums"]);
        let flat = flat.unwrap();
        assert_eq!((flat.pp_strategy, flat.pp_atomic_sums), (decode::Strategy::FlatGemm, true));
        let e = plan(&["--direction", "decode", "--phi", "inf"]).unwrap_err().to_string();
        assert!(e.contains("--phi"), "{e}");
        assert!(plan(&["--direction", "sideways"]).is_err());
    }
}
