//! What `ladder bench` reports: the tables it prints (one line per case, and the implementations
//! side by side) and the run's metadata (card, driver, date). The files themselves (CSV, JSON,
//! `meta.json`) are [`ladder_compare::results`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use std::path::Path;

use ladder_compare::GpuRung;
use ladder_compare::results::{self, Case, Outcome, Row};
use ladder_kernels::Gpu;

/// The peers `scripts/peers.py` times, in the order they follow the GPU rungs in tables and chart
/// legends; other names come last, alphabetically.
const PEER_ORDER: [&str; 8] = [
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "triton",
    "triton-fp8",
    "cudnn-fp8",
    "flex",
    "flashinfer",
];

/// Whether `name` is a peer measured by `scripts/peers.py` (PyTorch SDPA's backends, the Triton
/// tutorial's kernels, cuDNN's FP8 attention, FlexAttention, FlashInfer) rather than one of our
/// kernels or a variant of one.
pub fn is_peer(name: &str) -> bool {
    name.starts_with("sdpa")
        || name.starts_with("triton")
        || name.starts_with("cudnn")
        || name == "flex"
        || name == "flashinfer"
}

/// Sort key of an implementation name: the GPU rungs in table order, the peers in
/// [`PEER_ORDER`], then the rest.
pub fn impl_rank(name: &str) -> (usize, String) {
    let order: Vec<&str> = GpuRung::names().into_iter().chain(PEER_ORDER).collect();
    (order.iter().position(|n| *n == name).unwrap_or(order.len()), name.to_string())
}

/// `4096`, or `1x8192` (queries × keys) when they differ.
fn n_of(c: &Case) -> String {
    if c.n_q == c.n_kv { c.n_q.to_string() } else { format!("{}x{}", c.n_q, c.n_kv) }
}

/// `16`, or `32/8` (query / key-value heads) when they differ.
fn heads_of(c: &Case) -> String {
    if c.heads_q == c.heads_kv {
        c.heads_q.to_string()
    } else {
        format!("{}/{}", c.heads_q, c.heads_kv)
    }
}

/// The run's table: one line per case, with its time and throughput (and TB/s for a decoding
/// case) or why it has none; `page` is the page size of a paged KV cache.
pub fn render_rows(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<15} {:<6} {:<5} {:>4} {:>8} {:<8} {:>5} {:>6} {:>4} {:>10} {:>9} {:>7}",
        "impl", "dir", "dtype", "d", "n", "mask", "batch", "heads", "page", "ms", "TFLOP/s", "TB/s"
    );
    // An input layout other than [b, h, s, d] follows the name (`fa3/bshd`).
    for row in rows {
        let c = &row.case;
        let _ = write!(
            s,
            "{:<15} {:<6} {:<5} {:>4} {:>8} {:<8} {:>5} {:>6} {:>4} ",
            c.series(),
            c.direction,
            c.dtype,
            c.d,
            n_of(c),
            c.mask_label(),
            c.batch,
            heads_of(c),
            c.page_size.map_or("-".to_string(), |p| p.to_string())
        );
        let _ = match &row.outcome {
            Outcome::Measured { ms, tflops, tbps } => match tbps {
                Some(tbps) => writeln!(s, "{ms:>10.4} {tflops:>9.3} {tbps:>7.2}"),
                None => writeln!(s, "{ms:>10.4} {tflops:>9.1} {:>7}", "-"),
            },
            Outcome::Skipped(r) => writeln!(s, "skipped: {r}"),
            Outcome::Failed(r) => writeln!(s, "FAILED: {r}"),
        };
    }
    s
}

/// The side-by-side tables: for the prefill directions, one line per shape (direction, dtype, d,
/// mask, n), one TFLOP/s column per implementation, and FA2 as a fraction of SDPA's flash backend
/// when both are there; then, if there are decoding rows, [`render_decode_side_by_side`].
pub fn render_side_by_side(rows: &[Row]) -> String {
    let (decode, prefill): (Vec<Row>, Vec<Row>) =
        rows.iter().cloned().partition(|r| r.case.is_decode());
    let has_decode = decode.iter().any(|r| r.tbps().is_some());
    let mut s = String::new();
    if !has_decode || prefill.iter().any(|r| r.timing().is_some()) {
        s += &render_prefill_side_by_side(&prefill);
    }
    if has_decode {
        if !s.is_empty() {
            s.push('\n');
        }
        s += &render_decode_side_by_side(&decode);
    }
    s
}

/// The decoding rows side by side: one line per shape (dtype, d, batch, heads q/kv, new tokens,
/// L), one TB/s column per implementation, input layout and cache layout (ours,
/// `flash-decoding/p16` for pages of 16, `flash-decoding/bshd` for Q and the cache in
/// `[b, s, h, d]`, SDPA's flash and cuDNN backends, ...), FlashDecoding as a fraction of SDPA's
/// flash backend when both are there, each paged layout of ours as a fraction of our contiguous
/// cache (`p16/contig`), and our `[b, s, h, d]` contiguous cache as a fraction of `[b, h, s, d]`
/// (`bshd/bhsd`).
pub fn render_decode_side_by_side(rows: &[Row]) -> String {
    type Key = (String, usize, usize, Reverse<usize>, usize, usize, usize);
    // Columns: (implementation's rank, series, page size), contiguous first; the series is the
    // implementation with its input layout (`flash-decoding/bshd`).
    type Column = ((usize, String), String, Option<usize>);
    let mut columns: BTreeSet<Column> = BTreeSet::new();
    let mut table: BTreeMap<Key, BTreeMap<(String, Option<usize>), f64>> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.case.is_decode()) {
        let Some(tbps) = row.tbps() else { continue };
        let c = &row.case;
        columns.insert((impl_rank(&c.imp), c.series(), c.page_size));
        let key = (c.dtype.clone(), c.d, c.batch, Reverse(c.heads_kv), c.heads_q, c.n_q, c.n_kv);
        table.entry(key).or_default().insert((c.series(), c.page_size), tbps);
    }
    let columns: Vec<(String, Option<usize>)> =
        columns.into_iter().map(|(_, series, page)| (series, page)).collect();
    let label = |(name, page): &(String, Option<usize>)| match page {
        None => name.clone(),
        Some(p) => format!("{name}/p{p}"),
    };
    let ours = GpuRung::FlashDecoding.name();
    let has =
        |name: &str, page: Option<usize>| columns.iter().any(|(n, p)| n == name && *p == page);
    let ratio = has(ours, None) && has("sdpa-flash", None);
    // Paged layouts of ours, each against our contiguous cache.
    let pages: Vec<usize> = if has(ours, None) {
        columns.iter().filter(|(n, _)| n == ours).filter_map(|(_, p)| *p).collect()
    } else {
        Vec::new()
    };
    let ours_bshd = format!("{ours}/bshd");
    let bshd = has(ours, None) && has(&ours_bshd, None);
    let width = columns.iter().map(|c| label(c).len()).chain([14]).max().unwrap_or(14);
    let mut s = String::new();
    let _ = write!(
        s,
        "TB/s of K and V read (median), decode\n{:<5} {:>4} {:>5} {:>6} {:>3} {:>7}",
        "dtype", "d", "batch", "heads", "new", "L"
    );
    for column in &columns {
        let _ = write!(s, " {:>width$}", label(column));
    }
    if ratio {
        let _ = write!(s, " {:>15}", "ours/sdpa-flash");
    }
    for p in &pages {
        let _ = write!(s, " {:>11}", format!("p{p}/contig"));
    }
    if bshd {
        let _ = write!(s, " {:>10}", "bshd/bhsd");
    }
    s.push('\n');
    for ((dtype, d, batch, Reverse(heads_kv), heads_q, n_q, len), cells) in &table {
        let heads = format!("{heads_q}/{heads_kv}");
        let _ = write!(s, "{dtype:<5} {d:>4} {batch:>5} {heads:>6} {n_q:>3} {len:>7}");
        for column in &columns {
            let _ = match cells.get(column) {
                Some(t) => write!(s, " {t:>width$.2}"),
                None => write!(s, " {:>width$}", "-"),
            };
        }
        let get = |name: &str, page: Option<usize>| cells.get(&(name.to_string(), page));
        let fraction = |a: Option<&f64>, b: Option<&f64>, w: usize| match (a, b) {
            (Some(a), Some(b)) if *b > 0.0 => format!(" {:>w$.2}x", a / b, w = w - 1),
            _ => format!(" {:>w$}", "-"),
        };
        if ratio {
            s += &fraction(get(ours, None), get("sdpa-flash", None), 15);
        }
        for &p in &pages {
            s += &fraction(get(ours, Some(p)), get(ours, None), 11);
        }
        if bshd {
            s += &fraction(get(&ours_bshd, None), get(ours, None), 10);
        }
        s.push('\n');
    }
    s
}

fn render_prefill_side_by_side(rows: &[Row]) -> String {
    type Key = (u8, String, usize, (bool, String), usize, usize);
    // Columns: an implementation in one input layout (`fa3/bshd`, `Case::series`), each after
    // the same implementation in [b, h, s, d].
    let mut imps: BTreeSet<((usize, String), Option<String>)> = BTreeSet::new();
    let mut table: BTreeMap<Key, BTreeMap<String, f64>> = BTreeMap::new();
    for row in rows {
        let Some((_, tflops)) = row.timing() else { continue };
        let c = &row.case;
        imps.insert((impl_rank(&c.imp), c.layout.clone()));
        let dir_rank = u8::from(c.direction != "fwd");
        let key = (dir_rank, c.dtype.clone(), c.d, (c.causal, c.mask_label()), c.n_q, c.n_kv);
        table.entry(key).or_default().insert(c.series(), tflops);
    }
    let imps: Vec<String> = imps
        .into_iter()
        .map(|((_, name), layout)| match layout {
            None => name,
            Some(l) => format!("{name}/{l}"),
        })
        .collect();
    let fa2 = GpuRung::Fa2.name();
    let ratio = imps.iter().any(|i| i == fa2) && imps.iter().any(|i| i == "sdpa-flash");
    let mut s = String::new();
    let _ = write!(
        s,
        "TFLOP/s (median)\n{:<4} {:<5} {:>4} {:<8} {:>6}",
        "dir", "dtype", "d", "mask", "n"
    );
    for imp in &imps {
        let _ = write!(s, " {:>14}", imp);
    }
    if ratio {
        let _ = write!(s, " {:>14}", "fa2/sdpa-flash");
    }
    s.push('\n');
    for ((dir, dtype, d, (_, mask), n_q, n_kv), cells) in &table {
        let n = if n_q == n_kv { n_q.to_string() } else { format!("{n_q}x{n_kv}") };
        let dir = if *dir == 0 { "fwd" } else { "bwd" };
        let _ = write!(s, "{dir:<4} {dtype:<5} {d:>4} {mask:<8} {n:>6}");
        for imp in &imps {
            match cells.get(imp) {
                Some(t) => {
                    let _ = write!(s, " {t:>14.1}");
                }
                None => {
                    let _ = write!(s, " {:>14}", "-");
                }
            }
        }
        if ratio {
            match (cells.get(fa2), cells.get("sdpa-flash")) {
                (Some(a), Some(b)) if *b > 0.0 => {
                    let _ = write!(s, " {:>13.2}x", a / b);
                }
                _ => {
                    let _ = write!(s, " {:>14}", "-");
                }
            }
        }
        s.push('\n');
    }
    s
}

/// The NVIDIA kernel driver's version (e.g. `580.95.05`), from /proc on Linux.
pub fn kernel_driver_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    driver_version_in(text.lines().next()?)
}

/// The first `digits.digits[.digits]` word of `NVRM version: NVIDIA UNIX Open Kernel Module for
/// x86_64  580.159.04  Release Build ...`.
fn driver_version_in(line: &str) -> Option<String> {
    line.split_whitespace()
        .find(|w| {
            w.contains('.')
                && w.split('.').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// Write the run's card, driver, CUDA version, date and notes into `out/meta.json`.
pub fn merge_meta(
    out: &Path,
    gpu: &Gpu,
    driver: &str,
    cuda: &str,
    date: &str,
    notes: &[String],
) -> anyhow::Result<()> {
    // Keep the part of the note that scripts/peers.py wrote; replace ours.
    let old = results::read_meta(out);
    let mut note = format!("ladder bench {}: {}", env!("CARGO_PKG_VERSION"), notes.join("; "));
    for part in results::meta_str(&old, "note").split("; ").filter(|p| p.starts_with("peers.py:")) {
        note = format!("{note}; {part}");
    }
    results::merge_meta(
        out,
        &[
            ("card", gpu.name().to_string()),
            ("driver", driver.to_string()),
            ("cuda", cuda.to_string()),
            ("date", date.to_string()),
            ("note", note),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(imp: &str, direction: &str, causal: bool, n: usize) -> Case {
        let direction = ladder_compare::results::Direction::parse(direction).unwrap();
        Case::square(imp, direction, "fp16", causal, 16384 / n, 16, n, 128)
    }

    #[test]
    fn side_by_side_puts_peers_next_to_the_rungs() {
        let rows = vec![
            Row::measured(case("sdpa-flash", "fwd", false, 16384), 8.0),
            Row::measured(case("fa2", "fwd", false, 16384), 4.0),
            Row::measured(case("triton", "fwd", false, 16384), 5.0),
            Row::measured(case("fa2", "bwd", true, 512), 1.0),
        ];
        let table = render_side_by_side(&rows);
        let lines: Vec<&str> = table.lines().collect();
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            header,
            ["dir", "dtype", "d", "mask", "n", "fa2", "sdpa-flash", "triton", "fa2/sdpa-flash"]
        );
        assert!(lines[2].starts_with("fwd"), "{table}");
        assert!(lines[2].ends_with("2.00x"), "{table}");
        assert!(lines[3].starts_with("bwd") && lines[3].contains(" - "), "{table}");
        let listing = render_rows(&[Row {
            case: case("fa1", "fwd", false, 512),
            outcome: Outcome::Skipped("unsupported head dimension".into()),
        }]);
        assert!(listing.contains("skipped: unsupported head dimension"), "{listing}");
    }

    #[test]
    fn decode_rows_get_their_own_tb_per_s_table() {
        let dec = |imp: &str, heads_kv, len, ms| {
            Row::measured(Case::decode(imp, "fp16", 1, 32, heads_kv, 1, len, 128), ms)
        };
        let rows = vec![
            Row::measured(case("fa2", "fwd", false, 16384), 4.0),
            dec("flash-decoding", 8, 8192, 0.01),
            dec("sdpa-flash", 8, 8192, 0.02),
            dec("sdpa-cudnn", 32, 131072, 0.5),
            dec("flash-decoding", 32, 131072, 0.4),
        ];
        let table = render_side_by_side(&rows);
        let decode = table.split("TB/s of K and V read").nth(1).expect("a decode table");
        assert!(!table.split("TB/s of K and V").next().unwrap().contains("flash-decoding"));
        let lines: Vec<&str> = decode.lines().collect();
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            header,
            [
                "dtype",
                "d",
                "batch",
                "heads",
                "new",
                "L",
                "flash-decoding",
                "sdpa-flash",
                "sdpa-cudnn",
                "ours/sdpa-flash"
            ]
        );
        // 32/32 before 32/8; 8 · 8192 · 128 · 2 · 2 bytes in 10 µs is 3.36 TB/s.
        assert!(lines[2].contains("32/32") && lines[2].contains("131072"), "{decode}");
        assert!(lines[3].contains("32/8") && lines[3].contains("3.36"), "{decode}");
        assert!(lines[3].trim_end().ends_with("2.00x"), "{decode}");
        let listing = render_rows(&rows);
        assert!(listing.contains("1x8192") && listing.contains("32/8"), "{listing}");
        assert!(listing.contains("3.36"), "{listing}");
        // Decode rows alone: no empty TFLOP/s table.
        let alone = render_side_by_side(&rows[1..]);
        assert!(alone.starts_with("TB/s of K and V read"), "{alone}");
    }

    #[test]
    fn paged_and_speculative_rows_get_their_own_columns_and_lines() {
        let dec = |new: usize, page: Option<usize>, ms: f64| {
            let case = Case::decode("flash-decoding", "fp16", 1, 32, 8, new, 8192, 128);
            Row::measured(case.paged(page), ms)
        };
        let rows = vec![
            dec(1, None, 0.010),
            dec(1, Some(16), 0.0125),
            dec(1, Some(64), 0.010),
            dec(4, None, 0.011),
            dec(4, Some(16), 0.011),
            Row::measured(Case::decode("sdpa-flash", "fp16", 1, 32, 8, 1, 8192, 128), 0.02),
        ];
        let table = render_decode_side_by_side(&rows);
        let lines: Vec<&str> = table.lines().collect();
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            header[6..],
            [
                "flash-decoding",
                "flash-decoding/p16",
                "flash-decoding/p64",
                "sdpa-flash",
                "ours/sdpa-flash",
                "p16/contig",
                "p64/contig"
            ],
            "{table}"
        );
        // One token: paged 16 at 0.8× contiguous, paged 64 at 1.0×, ours at 2× SDPA.
        let one: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(one[4], "1", "{table}");
        assert_eq!(one[10..], ["2.00x", "0.80x", "1.00x"], "{table}");
        // Four tokens: no SDPA row, no pages of 64.
        let four: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!((four[4], four[8], four[9]), ("4", "-", "-"), "{table}");
        assert_eq!(four[10..], ["-", "1.00x", "-"], "{table}");
        let listing = render_rows(&rows);
        assert!(listing.contains("4x8192 causal") && listing.contains("  16 "), "{listing}");
    }

    #[test]
    fn decode_rows_in_another_layout_get_their_own_columns() {
        let dec = |page: Option<usize>, layout: Option<&str>, ms: f64| {
            let case = Case::decode("flash-decoding", "fp16", 1, 32, 8, 1, 8192, 128);
            Row::measured(case.paged(page).in_layout(layout), ms)
        };
        let rows = vec![
            dec(None, None, 0.010),
            dec(Some(16), None, 0.0125),
            dec(None, Some("bshd"), 0.0125),
            dec(Some(16), Some("bshd"), 0.02),
        ];
        let table = render_decode_side_by_side(&rows);
        let lines: Vec<&str> = table.lines().collect();
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            header[6..],
            [
                "flash-decoding",
                "flash-decoding/p16",
                "flash-decoding/bshd",
                "flash-decoding/bshd/p16",
                "p16/contig",
                "bshd/bhsd"
            ],
            "{table}"
        );
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(cells[10..], ["0.80x", "0.80x"], "{table}");
    }

    #[test]
    fn driver_version_from_proc() {
        let line = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release \
                    Build  (dvs-builder@U22-I3-AM25-29-1)  Thu Oct  2 19:52:49 UTC 2025";
        assert_eq!(driver_version_in(line).as_deref(), Some("580.159.04"));
        let old = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.54.03  Tue Jun  6 22:20:39 UTC 2023";
        assert_eq!(driver_version_in(old).as_deref(), Some("535.54.03"));
        assert_eq!(driver_version_in("no version here."), None);
    }
}
