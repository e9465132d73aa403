//! The benchmark results files, one schema for every tool that reads or writes them:
//!
//! - `bench.csv` (written by `ladder bench`) and `peers.csv` (written by `scripts/peers.py`): one
//!   measured case per line, columns [`COLUMNS`], found by name when read;
//! - `bench.json`: every case, skipped and failed ones included ([`row_json`]);
//! - `meta.json`: the card, driver, CUDA version, date, torch version and a note ([`META_KEYS`]),
//!   filled by both tools without clobbering each other's keys ([`merge_meta`]); optionally
//!   `hbm_read_tbps`, a measured HBM read bandwidth in TB/s (a number, written by hand or by a
//!   bandwidth test; absent unless measured), drawn on the decode charts.
//!
//! Throughput follows the FLOP convention of [`attention_flops`] (see `docs/conventions.md`).
//! `ladder bench`, its report and charts, and the notebooks' support crate all read through here.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use ladder_reference::{Mask, Window};
use serde_json::{Map, Value, json};

use crate::modifiers::MaskSpec;

/// The CSV columns, in the order they are written. `scripts/peers.py` writes the same schema;
/// other tools read it by column name, so columns are only ever added at the end, and a reader
/// takes a column added later (`page_size`, `layout`, `window`, `score_mod`, `mask_mod`) as empty when a file
/// has none.
pub const COLUMNS: [&str; 18] = [
    "impl",
    "direction",
    "dtype",
    "causal",
    "batch",
    "heads_q",
    "heads_kv",
    "n_q",
    "n_kv",
    "d",
    "ms",
    "tflops",
    "tbps",
    "page_size",
    "layout",
    "window",
    "score_mod",
    "mask_mod",
];

/// [`COLUMNS`] as the CSV header line.
pub const CSV_HEADER: &str = "impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,ms,tflops,tbps,page_size,layout,window,score_mod,mask_mod";

/// The columns a file may lack (added to the schema later): read as empty.
pub const OPTIONAL_COLUMNS: [&str; 5] = ["page_size", "layout", "window", "score_mod", "mask_mod"];

/// The keys of `meta.json` (both `ladder bench` and `scripts/peers.py` fill it).
pub const META_KEYS: [&str; 6] = ["card", "driver", "cuda", "date", "torch", "note"];

/// Forward or backward pass, or a decoding step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Direction {
    /// `O, lse` from `Q, K, V`.
    Fwd,
    /// `dQ, dK, dV` from `dO` (the forward's `O` and `lse` given).
    Bwd,
    /// A decoding step: `O, lse` of `n_q` new tokens against a KV cache of `n_kv` entries per
    /// sequence (memory-bound: its figure of merit is TB/s of K and V read).
    Decode,
}

impl Direction {
    /// Every direction, in table order.
    pub const ALL: [Direction; 3] = [Direction::Fwd, Direction::Bwd, Direction::Decode];

    /// `fwd`, `bwd` or `decode`, as in the CSV.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Fwd => "fwd",
            Direction::Bwd => "bwd",
            Direction::Decode => "decode",
        }
    }

    /// The direction named `fwd`, `bwd` or `decode`.
    pub fn parse(name: &str) -> Option<Direction> {
        Direction::ALL.into_iter().find(|d| d.name() == name)
    }
}

/// Attention FLOPs by the ladder's convention: forward (and decode) `4·B·Hq·n_q·n_kv·d`, halved
/// for causal with `n_q == n_kv`; backward 2.5× forward. Causal with `n_q != n_kv` (bottom-right aligned)
/// counts the query–key pairs that are actually visible.
pub fn attention_flops(
    direction: Direction,
    batch: usize,
    heads_q: usize,
    n_q: usize,
    n_kv: usize,
    d: usize,
    causal: bool,
) -> f64 {
    let pairs = if !causal {
        n_q as f64 * n_kv as f64
    } else if n_q == n_kv {
        n_q as f64 * n_kv as f64 / 2.0
    } else {
        attended_pairs(n_q, n_kv, true, Window::default())
    };
    pairs_flops(direction, batch * heads_q, pairs, d)
}

/// The query–key pairs a mask leaves visible, counted exactly (row by row of
/// [`Mask::visible`]): what a sliding window's FLOPs are counted on, so that a window's TFLOP/s
/// says how fast the kernel runs the work it must do, not the work it skips.
pub fn attended_pairs(n_q: usize, n_kv: usize, causal: bool, window: Window) -> f64 {
    let mask = Mask::banded(causal, window, n_q, n_kv);
    (0..n_q).map(|i| mask.visible(i).len() as f64).sum()
}

/// `4 · pairs · d` per head for the forward, 2.5× that for the backward.
fn pairs_flops(direction: Direction, heads: usize, pairs: f64, d: usize) -> f64 {
    let forward = 4.0 * heads as f64 * pairs * d as f64;
    match direction {
        Direction::Fwd | Direction::Decode => forward,
        Direction::Bwd => 2.5 * forward,
    }
}

/// The query-key pairs a mask modifier attends with `n_q = n_kv` (causal or not), where they have
/// a closed form: documents (near-equal, [`crate::modifiers::MaskSpec::Documents`]'s split) and a
/// prefix-LM mask (a whole mask, meant without the causal flag: with it, the causal pairs, as
/// the flag hides the prefix's later keys); `None` otherwise.
pub fn mask_pairs(mask: MaskSpec, n_q: usize, n_kv: usize, causal: bool) -> Option<f64> {
    if n_q != n_kv {
        return None;
    }
    let n = n_kv as u64;
    match mask {
        MaskSpec::Documents(docs) => {
            let docs = docs.max(1) as u64;
            // Key j is in document j·docs / n: document i holds keys ceil(i·n/docs) onwards.
            let start = |i: u64| (i * n).div_ceil(docs);
            let pairs = (0..docs)
                .map(|i| start(i + 1) - start(i))
                .map(|len| if causal { len * (len + 1) / 2 } else { len * len })
                .sum::<u64>();
            Some(pairs as f64)
        }
        MaskSpec::PrefixLm(_) if causal => Some((n * (n + 1) / 2) as f64),
        MaskSpec::PrefixLm(prefix) => {
            let p = (prefix as u64).min(n);
            // Rows below the prefix see it whole; the others see themselves and what precedes.
            Some((p * p + (p + 1..=n).sum::<u64>()) as f64)
        }
        MaskSpec::Dilated(_) | MaskSpec::HeadDilated(_) | MaskSpec::BatchPrefixLm(_) => None,
    }
}

/// A window as the CSV writes it, `LEFT:RIGHT` (`-1` for an open side; empty for no window): a
/// comma would split the field.
pub fn window_field(window: Window) -> String {
    if !window.is_some() {
        return String::new();
    }
    let side = |s: Option<usize>| s.map_or("-1".to_string(), |k| k.to_string());
    format!("{}:{}", side(window.left), side(window.right))
}

/// One benchmark case: what ran, on which shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Implementation: `fa1`, `fa2`, or a peer (`sdpa-flash`, `sdpa-cudnn`, `sdpa-efficient`, `triton`).
    pub imp: String,
    /// `fwd`, `bwd` or `decode`.
    pub direction: String,
    /// `fp16` or `bf16`.
    pub dtype: String,
    /// Causal mask (with `n_q == n_kv` in the standard shapes).
    pub causal: bool,
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads.
    pub heads_kv: usize,
    /// Query length.
    pub n_q: usize,
    /// Key length.
    pub n_kv: usize,
    /// Head dimension.
    pub d: usize,
    /// Decode only: tokens per page of a paged KV cache; `None` for a contiguous cache (and for
    /// the other directions).
    pub page_size: Option<usize>,
    /// Prefill only: the memory order of Q, K, V (and O, dO) when it is not `[batch, heads, seq,
    /// d]`: `bshd` for `[batch, seq, heads, d]`, a projection's output, taken as a strided view
    /// without a copy. `None` for `[batch, heads, seq, d]` (and for decoding).
    pub layout: Option<String>,
    /// Prefill only: a sliding window of keys (`Window::default()`: none). Its FLOPs count the
    /// pairs it attends ([`attended_pairs`]).
    pub window: Window,
    /// Prefill only: a score modifier by name (`softcap:50`, `alibi`, …: a
    /// [`crate::modifiers::ModifierSpec`]); `None` for none. It does not change the FLOPs counted.
    pub score_mod: Option<String>,
    /// Prefill only: a mask modifier by name (`documents:16`, `prefix-lm:4096`: a
    /// [`crate::modifiers::MaskSpec`]); `None` for none. Its FLOPs count the pairs it attends
    /// where [`mask_pairs`] knows them.
    pub mask_mod: Option<String>,
}

impl Case {
    /// A case of the standard shapes: `heads` query and key/value heads, `n` queries and keys.
    #[allow(clippy::too_many_arguments)]
    pub fn square(
        imp: &str,
        direction: Direction,
        dtype: &str,
        causal: bool,
        batch: usize,
        heads: usize,
        n: usize,
        d: usize,
    ) -> Case {
        Case {
            imp: imp.to_string(),
            direction: direction.name().to_string(),
            dtype: dtype.to_string(),
            causal,
            batch,
            heads_q: heads,
            heads_kv: heads,
            n_q: n,
            n_kv: n,
            d,
            page_size: None,
            layout: None,
            window: Window::default(),
            score_mod: None,
            mask_mod: None,
        }
    }

    /// This case with a sliding window of keys (`Window::default()`: none).
    pub fn windowed(self, window: Window) -> Case {
        Case { window, ..self }
    }

    /// This case with a score modifier (`None`: none).
    pub fn modified(self, score_mod: Option<String>) -> Case {
        Case { score_mod, ..self }
    }

    /// This case with its inputs in `layout` (`None`: `[batch, heads, seq, d]`; see
    /// [`Case::layout`]).
    pub fn in_layout(self, layout: Option<&str>) -> Case {
        Case { layout: layout.map(str::to_string), ..self }
    }

    /// A decoding case: `n_q` new tokens of `batch` sequences against `len` cached keys and
    /// values each (`n_kv = len`; causal among the new tokens, bottom-right, when there are
    /// several), in a contiguous cache ([`Case::paged`] for pages).
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        imp: &str,
        dtype: &str,
        batch: usize,
        heads_q: usize,
        heads_kv: usize,
        n_q: usize,
        len: usize,
        d: usize,
    ) -> Case {
        Case {
            imp: imp.to_string(),
            direction: Direction::Decode.name().to_string(),
            dtype: dtype.to_string(),
            causal: n_q > 1,
            batch,
            heads_q,
            heads_kv,
            n_q,
            n_kv: len,
            d,
            page_size: None,
            layout: None,
            window: Window::default(),
            score_mod: None,
            mask_mod: None,
        }
    }

    /// This case with its KV cache in pages of `page_size` tokens (`None`: contiguous).
    pub fn paged(self, page_size: Option<usize>) -> Case {
        Case { page_size, ..self }
    }

    /// The implementation, with the input layout when it is not `[batch, heads, seq, d]`
    /// (`fa3/bshd`): the name of its column in tables and its series in charts.
    pub fn series(&self) -> String {
        match &self.layout {
            None => self.imp.clone(),
            Some(l) => format!("{}/{l}", self.imp),
        }
    }

    /// Whether this is a decoding case (direction `decode`).
    pub fn is_decode(&self) -> bool {
        self.direction == Direction::Decode.name()
    }

    /// Bytes of K and V a decoding case must read, `2 · B · Hkv · n_kv · d · element size`
    /// (`None` for other directions, or an unknown dtype).
    pub fn kv_bytes(&self) -> Option<f64> {
        let size = match self.dtype.as_str() {
            "fp16" | "bf16" => 2.0,
            "fp32" | "f32" => 4.0,
            _ => return None,
        };
        self.is_decode()
            .then(|| 2.0 * (self.batch * self.heads_kv * self.n_kv * self.d) as f64 * size)
    }

    /// FLOPs of this case by the ladder's convention (an unknown direction counts as forward);
    /// with a window, or without one a mask modifier [`mask_pairs`] counts, on the pairs it
    /// attends (as `scripts/peers.py` counts them).
    pub fn flops(&self) -> f64 {
        let direction = Direction::parse(&self.direction).unwrap_or(Direction::Fwd);
        let mask = self.mask_mod.as_deref().and_then(|m| m.parse().ok());
        let mask_pairs = mask.and_then(|m| mask_pairs(m, self.n_q, self.n_kv, self.causal));
        if let Some(pairs) = mask_pairs.filter(|_| !self.window.is_some()) {
            return pairs_flops(direction, self.batch * self.heads_q, pairs, self.d);
        }
        if self.window.is_some() {
            let pairs = attended_pairs(self.n_q, self.n_kv, self.causal, self.window);
            return pairs_flops(direction, self.batch * self.heads_q, pairs, self.d);
        }
        attention_flops(
            direction,
            self.batch,
            self.heads_q,
            self.n_q,
            self.n_kv,
            self.d,
            self.causal,
        )
    }

    /// The mask in a word: `full`, `causal`, or a window as `w4095:0` (`LEFT:RIGHT` after the
    /// causal mask's `right = 0`, `-1` open), then the score modifier after a `+`
    /// (`causal+softcap:50`).
    pub fn mask_label(&self) -> String {
        let mask = if !self.window.is_some() {
            if self.causal { "causal" } else { "full" }.to_string()
        } else {
            let right = if self.causal { Some(0) } else { self.window.right };
            format!("w{}", window_field(Window { right, ..self.window }))
        };
        let mask = match &self.mask_mod {
            Some(m) => format!("{mask}·{m}"),
            None => mask,
        };
        match &self.score_mod {
            Some(m) => format!("{mask}+{m}"),
            None => mask,
        }
    }

    /// `fwd d=128 n=4096 causal` and the like, for progress lines and tables (`decode fp16
    /// d=128 L=8192 b=1 h=32/8 new=1`, and ` page=16` for a paged cache, for a decoding case).
    pub fn label(&self) -> String {
        if self.is_decode() {
            let page = self.page_size.map_or(String::new(), |p| format!(" page={p}"));
            return format!(
                "decode {} d={:<3} L={:<6} b={:<2} h={}/{} new={}{page}",
                self.dtype, self.d, self.n_kv, self.batch, self.heads_q, self.heads_kv, self.n_q
            );
        }
        format!(
            "{:<4} {} d={:<3} n={:<5} {:<8} b={} h={}{}",
            self.direction,
            self.dtype,
            self.d,
            self.n_q,
            self.mask_label(),
            self.batch,
            self.heads_q,
            self.layout.as_ref().map_or(String::new(), |l| format!(" {l}"))
        )
    }
}

/// What a case gave.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Timed: median milliseconds per call, and the throughput derived from it.
    Measured {
        /// Median milliseconds per call.
        ms: f64,
        /// TFLOP/s by the ladder's FLOP convention.
        tflops: f64,
        /// TB/s of the bytes the case must move: K and V for a decoding case
        /// ([`Case::kv_bytes`]); empty for the compute-bound directions.
        tbps: Option<f64>,
    },
    /// The implementation does not support this case (head dim, dtype): not an error.
    Skipped(String),
    /// The implementation failed on this case (driver error, out of memory, compile error).
    Failed(String),
}

/// A case and its outcome: one line of the table, and of the CSV when measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// What ran.
    pub case: Case,
    /// What it gave.
    pub outcome: Outcome,
}

impl Row {
    /// A measured row; TFLOP/s from the FLOP convention, and TB/s of K and V read for a decoding
    /// case.
    pub fn measured(case: Case, ms: f64) -> Row {
        let tflops = case.flops() / (ms * 1e-3) / 1e12;
        let tbps = case.kv_bytes().map(|bytes| bytes / (ms * 1e-3) / 1e12);
        Row { case, outcome: Outcome::Measured { ms, tflops, tbps } }
    }

    /// TB/s if measured and recorded.
    pub fn tbps(&self) -> Option<f64> {
        match self.outcome {
            Outcome::Measured { tbps, .. } => tbps,
            _ => None,
        }
    }

    /// `(ms, tflops)` if measured.
    pub fn timing(&self) -> Option<(f64, f64)> {
        match self.outcome {
            Outcome::Measured { ms, tflops, .. } => Some((ms, tflops)),
            _ => None,
        }
    }
}

/// The CSV text of the measured rows (skipped and failed rows are left out: every CSV row has
/// numbers).
pub fn to_csv(rows: &[Row]) -> String {
    let mut s = format!("{CSV_HEADER}\n");
    for row in rows {
        let Outcome::Measured { ms, tflops, tbps } = row.outcome else { continue };
        let c = &row.case;
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{},{ms:.6},{tflops:.3},{},{},{},{},{},{}",
            c.imp,
            c.direction,
            c.dtype,
            c.causal,
            c.batch,
            c.heads_q,
            c.heads_kv,
            c.n_q,
            c.n_kv,
            c.d,
            tbps.map_or(String::new(), |t| format!("{t:.4}")),
            c.page_size.map_or(String::new(), |p| p.to_string()),
            c.layout.as_deref().unwrap_or(""),
            window_field(c.window),
            c.score_mod.as_deref().unwrap_or(""),
            c.mask_mod.as_deref().unwrap_or("")
        );
    }
    s
}

/// Parse CSV text in the schema of [`CSV_HEADER`] (columns found by name, so their order does not
/// matter; the [`OPTIONAL_COLUMNS`] may be missing). Rows without a time (a peer's skipped case)
/// are ignored.
pub fn parse_csv(text: &str) -> anyhow::Result<Vec<Row>> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let Some((_, header)) = lines.next() else { bail!("empty file: no CSV header") };
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    // Each column's position; a missing optional column reads as empty (position past the end).
    let column = |name: &str| match names.iter().position(|n| *n == name) {
        Some(i) => Ok(i),
        None if OPTIONAL_COLUMNS.contains(&name) => Ok(usize::MAX),
        None => {
            Err(anyhow::anyhow!("the CSV header has no `{name}` column (expected `{CSV_HEADER}`)"))
        }
    };
    let cols: Vec<usize> =
        CSV_HEADER.split(',').map(column).collect::<anyhow::Result<Vec<usize>>>()?;
    let mut rows = Vec::new();
    for (i, line) in lines {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |k: usize| fields.get(cols[k]).copied().unwrap_or("");
        let parse_row = || -> anyhow::Result<Option<Row>> {
            let int = |k: usize| -> anyhow::Result<usize> {
                get(k).parse().with_context(|| format!("`{}` is not a count", get(k)))
            };
            let float = |k: usize| -> anyhow::Result<Option<f64>> {
                let s = get(k);
                if s.is_empty() {
                    return Ok(None);
                }
                s.parse().map(Some).with_context(|| format!("`{s}` is not a number"))
            };
            let causal = match get(3).to_ascii_lowercase().as_str() {
                "true" | "1" => true,
                "false" | "0" => false,
                other => bail!("causal must be true or false, got `{other}`"),
            };
            let (Some(ms), Some(tflops)) = (float(10)?, float(11)?) else { return Ok(None) };
            let case = Case {
                imp: get(0).to_string(),
                direction: get(1).to_string(),
                dtype: get(2).to_string(),
                causal,
                batch: int(4)?,
                heads_q: int(5)?,
                heads_kv: int(6)?,
                n_q: int(7)?,
                n_kv: int(8)?,
                d: int(9)?,
                page_size: match get(13) {
                    "" => None,
                    _ => Some(int(13)?),
                },
                layout: match get(14) {
                    "" => None,
                    l => Some(l.to_string()),
                },
                window: match get(15) {
                    "" => Window::default(),
                    w => w.replace(':', ",").parse().map_err(|e: String| anyhow::anyhow!(e))?,
                },
                score_mod: match get(16) {
                    "" => None,
                    m => Some(m.to_string()),
                },
                mask_mod: match get(17) {
                    "" => None,
                    m => Some(m.to_string()),
                },
            };
            Ok(Some(Row { case, outcome: Outcome::Measured { ms, tflops, tbps: float(12)? } }))
        };
        if let Some(row) = parse_row().with_context(|| format!("line {}: `{line}`", i + 1))? {
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Read a CSV file of the schema, naming the file in errors.
pub fn read_csv(path: &Path) -> anyhow::Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_csv(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The JSON object of one row (skipped and failed rows included, with their reason).
pub fn row_json(row: &Row, extra: &Map<String, Value>) -> Value {
    let c = &row.case;
    let mut obj = json!({
        "impl": c.imp, "direction": c.direction, "dtype": c.dtype, "causal": c.causal,
        "batch": c.batch, "heads_q": c.heads_q, "heads_kv": c.heads_kv,
        "n_q": c.n_q, "n_kv": c.n_kv, "d": c.d, "page_size": c.page_size, "layout": c.layout,
        "window": window_field(c.window), "score_mod": c.score_mod, "mask_mod": c.mask_mod,
    });
    let map = obj.as_object_mut().expect("an object literal");
    match &row.outcome {
        Outcome::Measured { ms, tflops, tbps } => {
            map.insert("ms".into(), json!(ms));
            map.insert("tflops".into(), json!(tflops));
            map.insert("tbps".into(), json!(tbps));
        }
        Outcome::Skipped(reason) => {
            map.insert("skipped".into(), json!(reason));
        }
        Outcome::Failed(reason) => {
            map.insert("failed".into(), json!(reason));
        }
    }
    map.extend(extra.clone());
    obj
}

/// `meta.json` of a results folder as a map (empty if the file is missing or unreadable).
pub fn read_meta(dir: &Path) -> Map<String, Value> {
    std::fs::read_to_string(dir.join("meta.json"))
        .ok()
        .and_then(|s| parse_meta(&s).ok())
        .unwrap_or_default()
}

/// The text of a `meta.json` as a map; an error if it is not a JSON object.
pub fn parse_meta(json: &str) -> anyhow::Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(json)? {
        Value::Object(map) => Ok(map),
        other => bail!("meta.json must hold a JSON object, not `{other}`"),
    }
}

/// A string field of `meta`, empty if absent.
pub fn meta_str<'a>(meta: &'a Map<String, Value>, key: &str) -> &'a str {
    meta.get(key).and_then(Value::as_str).unwrap_or("")
}

/// Merge `fields` into `dir/meta.json`, keeping the keys others wrote (e.g. `torch`, filled by
/// `scripts/peers.py`) and making sure every key of [`META_KEYS`] is present.
pub fn merge_meta(dir: &Path, fields: &[(&str, String)]) -> anyhow::Result<()> {
    let mut meta = read_meta(dir);
    for (k, v) in fields {
        meta.insert((*k).to_string(), Value::String(v.clone()));
    }
    for k in META_KEYS {
        meta.entry(k).or_insert_with(|| Value::String(String::new()));
    }
    let path = dir.join("meta.json");
    let text = serde_json::to_string_pretty(&Value::Object(meta))? + "\n";
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// The current time in UTC, ISO 8601 to the second (`2026-11-29T14:03:07Z`).
pub fn utc_now_iso() -> String {
    iso_date(time::OffsetDateTime::now_utc())
}

/// `t` in UTC, ISO 8601 (RFC 3339) to the second.
fn iso_date(t: time::OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC).replace_nanosecond(0).unwrap_or(t);
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(imp: &str, direction: &str, causal: bool, n: usize) -> Case {
        let direction = Direction::parse(direction).unwrap();
        Case::square(imp, direction, "fp16", causal, 16384 / n, 16, n, 128)
    }

    #[test]
    fn flops_follow_the_ladder_convention() {
        // FA3 paper shape: hidden 2048, 16k tokens, d = 128, n = 16k: 4 · 1 · 16 · 16384² · 128.
        let full = attention_flops(Direction::Fwd, 1, 16, 16384, 16384, 128, false);
        assert_eq!(full, 4.0 * 16.0 * 16384.0 * 16384.0 * 128.0);
        assert_eq!(full, 2_199_023_255_552.0);
        assert_eq!(attention_flops(Direction::Fwd, 1, 16, 16384, 16384, 128, true), full / 2.0);
        assert_eq!(attention_flops(Direction::Bwd, 1, 16, 16384, 16384, 128, false), 2.5 * full);
        assert_eq!(attention_flops(Direction::Bwd, 1, 16, 16384, 16384, 128, true), 1.25 * full);
        // Same FLOPs at every n of the sweep once batch·n is fixed... per n: 4 · tokens · n · hidden.
        let at = |n: usize| attention_flops(Direction::Fwd, 16384 / n, 2048 / 64, n, n, 64, false);
        assert_eq!(at(512), 4.0 * 16384.0 * 512.0 * 2048.0);
        // Bottom-right causal, 2 queries over 5 keys: rows see 4 and 5 keys.
        assert_eq!(attention_flops(Direction::Fwd, 1, 1, 2, 5, 1, true), 4.0 * 9.0);
        // More queries than keys: the first rows see nothing.
        assert_eq!(attention_flops(Direction::Fwd, 1, 1, 5, 2, 1, true), 4.0 * 3.0);
        // 4 TFLOP in 10 ms is 400 TFLOP/s.
        let row = Row::measured(case("fa2", "fwd", false, 16384), 10.0);
        let (_, tflops) = row.timing().unwrap();
        assert!((tflops - full / 1e-2 / 1e12).abs() < 1e-9);
    }

    #[test]
    fn csv_round_trips_and_leaves_out_unmeasured_rows() {
        let rows = vec![
            Row::measured(case("fa2", "fwd", false, 512), 0.25),
            Row::measured(case("fa1", "bwd", true, 2048), 123.456789),
            Row { case: case("fa2", "fwd", true, 512), outcome: Outcome::Skipped("d".into()) },
            Row { case: case("fa2", "bwd", true, 512), outcome: Outcome::Failed("oom".into()) },
        ];
        let text = to_csv(&rows);
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        assert_eq!(text.lines().count(), 3);
        assert!(
            text.lines()
                .nth(1)
                .unwrap()
                .starts_with("fa2,fwd,fp16,false,32,16,16,512,512,128,0.250000,")
        );
        assert!(
            text.lines().nth(1).unwrap().ends_with(",,,"),
            "tbps, page, layout and window are empty"
        );
        let back = parse_csv(&text).unwrap();
        assert_eq!(back.len(), 2);
        for (a, b) in back.iter().zip(&rows) {
            assert_eq!(a.case, b.case);
            let ((ma, ta), (mb, tb)) = (a.timing().unwrap(), b.timing().unwrap());
            assert!((ma - mb).abs() < 1e-6 && (ta - tb).abs() < 1e-3, "{ma} {mb} {ta} {tb}");
        }
    }

    #[test]
    fn a_layout_other_than_bhsd_is_a_column_and_a_series_of_its_own() {
        let bshd = case("fa3", "fwd", true, 4096).in_layout(Some("bshd"));
        assert_eq!(
            (bshd.series(), case("fa3", "fwd", true, 4096).series()),
            ("fa3/bshd".into(), "fa3".into())
        );
        let text = to_csv(&[Row::measured(bshd.clone(), 1.0)]);
        assert!(text.lines().nth(1).unwrap().ends_with(",,bshd,,,"), "{text}");
        assert_eq!(parse_csv(&text).unwrap()[0].case, bshd);
        // A file written before the column existed reads as [b, h, s, d].
        let old = "impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,ms,tflops,tbps\n\
                   fa3,fwd,fp16,true,4,16,16,4096,4096,128,1.0,500.0,\n";
        assert_eq!(parse_csv(old).unwrap()[0].case.layout, None);
        assert!(bshd.label().ends_with(" bshd"));
    }

    #[test]
    fn a_mask_modifier_counts_the_pairs_it_attends_and_round_trips() {
        // 16 documents of 1024 keys, causal: 16 · 1024 · 1025 / 2 pairs; the brute-force count
        // of the same mask on a small problem with uneven documents.
        let docs = case("flex", "fwd", true, 16384);
        let docs = Case { mask_mod: Some("documents:16".into()), ..docs };
        assert_eq!(docs.flops(), 4.0 * 16.0 * (16.0 * 1024.0 * 1025.0 / 2.0) * 128.0);
        assert_eq!(docs.mask_label(), "causal·documents:16");
        for (spec, causal) in [
            ("documents:3", true),
            ("documents:3", false),
            ("prefix-lm:4", false),
            ("prefix-lm:4", true),
        ] {
            let mask: MaskSpec = spec.parse().unwrap();
            let m = mask.cpu(10);
            let band = Mask::banded(causal, Window::default(), 10, 10);
            let mut brute = 0;
            for i in 0..10 {
                for j in band.visible(i) {
                    let at = ladder_reference::ScoreIndex {
                        batch: 0,
                        head: 0,
                        q: i,
                        kv: j,
                        n_q: 10,
                        n_kv: 10,
                    };
                    brute += usize::from(m.sees(&at));
                }
            }
            assert_eq!(mask_pairs(mask, 10, 10, causal), Some(brute as f64), "{spec} {causal}");
        }
        let text = to_csv(&[Row::measured(docs.clone(), 1.0)]);
        assert!(text.lines().nth(1).unwrap().ends_with(",,,documents:16"), "{text}");
        assert_eq!(parse_csv(&text).unwrap()[0].case, docs);
    }

    #[test]
    fn a_window_counts_the_pairs_it_attends_and_round_trips() {
        // Mistral's window of 4096 keys, causal, n = 16k: row i sees min(i + 1, 4096) keys.
        let n = 16384;
        let w = Window::left(4095);
        let pairs = 4096.0 * 4097.0 / 2.0 + (n - 4096) as f64 * 4096.0;
        assert_eq!(attended_pairs(n, n, true, w), pairs);
        let windowed = case("fa2", "fwd", true, n).windowed(w);
        assert_eq!(windowed.flops(), 4.0 * 16.0 * pairs * 128.0);
        assert_eq!(windowed.mask_label(), "w4095:0");
        assert!(windowed.label().contains("w4095:0"), "{}", windowed.label());
        // Without a window a causal case keeps the convention (n² / 2), not the exact count.
        assert_eq!(case("fa2", "fwd", true, n).flops(), 4.0 * 16.0 * (n * n) as f64 / 2.0 * 128.0);
        // A two-sided window, not causal, and an open side.
        let two = case("fa2", "bwd", false, 8).windowed(Window::new(1, 2));
        assert_eq!(attended_pairs(8, 8, false, Window::new(1, 2)), 8.0 * 4.0 - 1.0 - 3.0);
        assert_eq!(two.mask_label(), "w1:2");
        assert_eq!(case("fa2", "fwd", false, 8).windowed(Window::left(3)).mask_label(), "w3:-1");
        let text = to_csv(&[Row::measured(windowed.clone(), 1.0), Row::measured(two.clone(), 1.0)]);
        // The window as given (the causal mask's right = 0 is in `causal`).
        assert!(text.lines().nth(1).unwrap().ends_with(",,4095:-1,,"), "{text}");
        let back = parse_csv(&text).unwrap();
        assert_eq!((&back[0].case, &back[1].case), (&windowed, &two));
        let bad = text.replace("4095:-1", "4095");
        assert!(parse_csv(&bad).is_err());
    }

    #[test]
    fn a_score_mod_labels_its_mask_and_round_trips_without_changing_the_flops() {
        let plain = case("fa3", "fwd", true, 4096);
        let capped = plain.clone().windowed(Window::left(511)).modified(Some("softcap:50".into()));
        assert_eq!(capped.mask_label(), "w511:0+softcap:50");
        assert_eq!(plain.clone().modified(Some("alibi".into())).mask_label(), "causal+alibi");
        assert_eq!(plain.clone().modified(Some("alibi".into())).flops(), plain.flops());
        let text = to_csv(&[Row::measured(capped.clone(), 1.0)]);
        assert!(text.lines().nth(1).unwrap().ends_with(",511:-1,softcap:50,"), "{text}");
        assert_eq!(parse_csv(&text).unwrap()[0].case, capped);
        // A file written before the column existed reads as no modifier.
        let old = "impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,ms,tflops,tbps\n\
                   fa3,fwd,fp16,true,4,16,16,4096,4096,128,1.0,500.0,\n";
        assert_eq!(parse_csv(old).unwrap()[0].case.score_mod, None);
    }

    #[test]
    fn decode_rows_carry_tbps_and_round_trip() {
        // One new token, B = 1, 32 query heads over 8 kv heads, L = 8192, d = 128, fp16:
        // K and V are 2 · 8 · 8192 · 128 · 2 bytes = 33.5 MB.
        let case = Case::decode("flash-decoding", "fp16", 1, 32, 8, 1, 8192, 128);
        assert!(case.is_decode() && !case.causal);
        assert_eq!(case.kv_bytes(), Some(2.0 * 8.0 * 8192.0 * 128.0 * 2.0));
        assert_eq!(case.flops(), 4.0 * 32.0 * 8192.0 * 128.0);
        assert!(case.label().contains("L=8192") && case.label().contains("h=32/8"));
        assert_eq!(Direction::parse("decode"), Some(Direction::Decode));
        assert_eq!(Direction::Decode.name(), "decode");
        let row = Row::measured(case.clone(), 0.01);
        let tbps = row.tbps().unwrap();
        assert!((tbps - 33_554_432.0 / 1e-5 / 1e12).abs() < 1e-9, "{tbps}");
        let text = to_csv(std::slice::from_ref(&row));
        let line = text.lines().nth(1).unwrap();
        assert!(
            line.starts_with("flash-decoding,decode,fp16,false,1,32,8,1,8192,128,0.010000,"),
            "{line}"
        );
        assert!(line.ends_with(",3.3554,,,,,"), "{line}");
        let back = parse_csv(&text).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].case, case);
        assert!((back[0].tbps().unwrap() - tbps).abs() < 1e-3);
        // Four new tokens (causal among themselves) in pages of 16: the page size round-trips,
        // and the bytes of K and V are those of the same cache.
        let paged = Case::decode("flash-decoding", "fp16", 1, 32, 8, 4, 8192, 128).paged(Some(16));
        assert!(paged.causal && paged.label().ends_with("new=4 page=16"), "{}", paged.label());
        assert_eq!(paged.kv_bytes(), case.kv_bytes());
        let text = to_csv(&[Row::measured(paged.clone(), 0.01)]);
        assert!(text.lines().nth(1).unwrap().ends_with(",16,,,,"), "{text}");
        assert_eq!(parse_csv(&text).unwrap()[0].case, paged);
        assert_eq!(row_json(&Row::measured(paged, 0.01), &Map::new())["page_size"], 16);
        // Prefill rows have no TB/s.
        assert_eq!(Row::measured(self::case("fa2", "fwd", false, 512), 1.0).tbps(), None);
    }

    #[test]
    fn csv_columns_are_found_by_name_and_errors_name_the_line() {
        let text = "tflops,ms,impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,tbps\n\
                    300.5,1.5,sdpa-flash,fwd,fp16,True,1,16,16,16384,16384,128,\n\
                    ,,sdpa-efficient,bwd,fp16,true,1,16,16,16384,16384,128,\n";
        let rows = parse_csv(text).unwrap();
        assert_eq!(rows.len(), 1, "a row without a time is a peer's skipped case");
        assert_eq!(rows[0].case.imp, "sdpa-flash");
        assert!(rows[0].case.causal);
        assert_eq!(rows[0].timing(), Some((1.5, 300.5)));
        let err = parse_csv("impl,direction\nfa2,fwd\n").unwrap_err();
        assert!(format!("{err:#}").contains("no `dtype` column"), "{err:#}");
        let bad = format!("{CSV_HEADER}\nfa2,fwd,fp16,maybe,1,1,1,1,1,64,1.0,1.0,\n");
        let err = format!("{:#}", parse_csv(&bad).unwrap_err());
        assert!(err.contains("line 2") && err.contains("maybe"), "{err}");
    }

    #[test]
    fn meta_merges_without_clobbering() {
        let dir = tempfile::tempdir().unwrap();
        merge_meta(dir.path(), &[("torch", "2.11.0".into())]).unwrap();
        merge_meta(dir.path(), &[("card", "NVIDIA H200".into()), ("note", "n".into())]).unwrap();
        let meta = read_meta(dir.path());
        assert!(parse_meta("[1]").is_err() && read_meta(&dir.path().join("none")).is_empty());
        assert_eq!(meta_str(&meta, "torch"), "2.11.0");
        assert_eq!(meta_str(&meta, "card"), "NVIDIA H200");
        for k in META_KEYS {
            assert!(meta.contains_key(k), "{k}");
        }
    }

    #[test]
    fn iso_dates() {
        let at = |secs| iso_date(time::OffsetDateTime::from_unix_timestamp(secs).unwrap());
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_795_960_987), "2026-11-29T14:03:07Z");
        assert_eq!(CSV_HEADER, COLUMNS.join(","));
        assert!(utc_now_iso().ends_with('Z') && utc_now_iso().len() == 20);
    }
}
