//! The GPU measurements committed under `docs/results/history/h200/`, and their charts.
//!
//! `ladder bench`, run on a GPU machine, writes two files there:
//!
//! - `bench.csv`, one row per measurement, with the header
//!   `impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,ms,tflops,tbps`
//!   (`tflops` by the FLOP convention of `docs/conventions.md`: forward `4·B·Hq·n_q·n_kv·d`,
//!   halved for causal square, backward 2.5× forward; `tbps` may be empty);
//! - `meta.json`, with `card`, `driver`, `cuda`, `date`, `torch` and `note`.
//!
//! Both files are read by `ladder_compare::results`, the same code that writes them (and that
//! reads `scripts/peers.py`'s `peers.csv`); this module turns them into the notebooks' [`Row`] and
//! [`Meta`] and charts them.
//!
//! The notebooks never invent figures: when the files are absent, [`load`] returns `None` and
//! [`NOT_MEASURED`] says how to produce them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use ladder_compare::results as bench;
use plotters::prelude::*;

/// What a notebook says where no GPU results are committed.
pub const NOT_MEASURED: &str = "No results committed yet — run `ladder bench` on a GPU machine; \
it writes docs/results/history/h200/bench.csv and meta.json, and `scripts/refresh-notebooks 08` redraws \
the charts. The GPU kernels live in the `ladder-kernels` crate (crates/kernels).";

/// One row of `bench.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub implementation: String,
    pub direction: String,
    pub dtype: String,
    pub causal: bool,
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub n_q: usize,
    pub n_kv: usize,
    pub d: usize,
    pub ms: f64,
    pub tflops: f64,
    pub tbps: Option<f64>,
    /// Tokens per page of a paged KV cache (`None`: contiguous, or not a decode row).
    pub page_size: Option<usize>,
}

impl Row {
    /// The notebook's view of a measured row of `ladder_compare::results` (`None` if unmeasured).
    fn from_bench(row: bench::Row) -> Option<Row> {
        let bench::Outcome::Measured { ms, tflops, tbps } = row.outcome else { return None };
        let c = row.case;
        Some(Row {
            implementation: c.imp,
            direction: c.direction,
            dtype: c.dtype,
            causal: c.causal,
            batch: c.batch,
            heads_q: c.heads_q,
            heads_kv: c.heads_kv,
            n_q: c.n_q,
            n_kv: c.n_kv,
            d: c.d,
            ms,
            tflops,
            tbps,
            page_size: c.page_size,
        })
    }

    /// A decode step: a few query tokens against a cache (direction `decode`, as `ladder bench
    /// --direction decode` and `scripts/peers.py` write it, or a shape of one).
    pub fn is_decode(&self) -> bool {
        self.direction == "decode" || (self.n_q <= 16 && self.n_kv > self.n_q)
    }

    /// The problem, without the implementation: rows with the same case are compared.
    pub fn case(&self) -> String {
        let n = |x: usize| {
            if x >= 1024 && x % 1024 == 0 { format!("{}k", x / 1024) } else { x.to_string() }
        };
        format!(
            "{} {} {} B{} H{}/{} {}×{} d{}",
            self.direction,
            self.dtype,
            if self.causal { "causal" } else { "full" },
            self.batch,
            self.heads_q,
            self.heads_kv,
            n(self.n_q),
            n(self.n_kv),
            self.d
        )
    }
}

/// `meta.json`: where and when the figures were measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Meta {
    pub card: String,
    pub driver: String,
    pub cuda: String,
    pub date: String,
    pub torch: String,
    pub note: String,
}

/// The committed measurements.
#[derive(Debug, Clone)]
pub struct Results {
    pub dir: PathBuf,
    pub rows: Vec<Row>,
    pub meta: Meta,
}

/// Where the results are: `$LADDER_RESULTS_DIR`, else `docs/results/history/h200` in the repository
/// the notebook runs in (found by walking up from the working directory).
pub fn results_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LADDER_RESULTS_DIR") {
        return PathBuf::from(dir);
    }
    results_dir_named("h200")
}

/// `docs/results/NAME` in the repository the notebook runs in (e.g. `current`, or a lease of the
/// history by its name, `h200-fa3` or `h200-fa3/ablation`, which lies in
/// `docs/results/history/NAME`), found by walking up from the working directory.
pub fn results_dir_named(name: &str) -> PathBuf {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let results = cwd
        .ancestors()
        .map(|a| a.join("docs/results"))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| cwd.join("../docs/results"));
    let top = results.join(name);
    let history = results.join("history").join(name);
    if !top.exists() && history.exists() { history } else { top }
}

/// `docs/results/NAME` when `dir` is a folder of the committed results, whatever the checkout.
fn committed_name(dir: &Path) -> Option<String> {
    let parts: Vec<String> =
        dir.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let at = parts.windows(2).rposition(|w| w[0] == "docs" && w[1] == "results")?;
    let rest = &parts[at + 2..];
    (!rest.is_empty()).then(|| format!("docs/results/{}", rest.join("/")))
}

/// Reads `bench.csv` (our kernels), `peers.csv` (the peers timed in the same run, when present)
/// and `meta.json`; `Ok(None)` when `bench.csv` is not there, `Err` naming the line when a file
/// is there but malformed.
pub fn load() -> Result<Option<Results>, String> {
    load_from(&results_dir())
}

/// [`load`] from a given folder.
pub fn load_from(dir: &Path) -> Result<Option<Results>, String> {
    let csv = dir.join("bench.csv");
    let Ok(text) = std::fs::read_to_string(&csv) else {
        return Ok(None);
    };
    let mut rows = parse_csv(&text).map_err(|e| format!("{}: {e}", csv.display()))?;
    let peers = dir.join("peers.csv");
    if let Ok(text) = std::fs::read_to_string(&peers) {
        rows.extend(parse_csv(&text).map_err(|e| format!("{}: {e}", peers.display()))?);
    }
    let meta = match std::fs::read_to_string(dir.join("meta.json")) {
        Ok(json) => parse_meta(&json).map_err(|e| format!("{}/meta.json: {e}", dir.display()))?,
        Err(_) => Meta { note: "meta.json missing".into(), ..Meta::default() },
    };
    Ok(Some(Results { dir: dir.to_owned(), rows, meta }))
}

/// Parses `bench.csv` (columns found by name; rows without a time, a peer's skipped case, are
/// left out).
pub fn parse_csv(text: &str) -> Result<Vec<Row>, String> {
    let rows = bench::parse_csv(text).map_err(|e| format!("{e:#}"))?;
    Ok(rows.into_iter().filter_map(Row::from_bench).collect())
}

/// Parses `meta.json`; missing keys read as empty.
pub fn parse_meta(json: &str) -> Result<Meta, String> {
    let value = bench::parse_meta(json).map_err(|e| format!("{e:#}"))?;
    let get = |k: &str| match value.get(k) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    Ok(Meta {
        card: get("card"),
        driver: get("driver"),
        cuda: get("cuda"),
        date: get("date"),
        torch: get("torch"),
        note: get("note"),
    })
}

impl Results {
    /// One line naming the card, driver, CUDA, torch and date, and the folder read.
    pub fn provenance(&self) -> String {
        let m = &self.meta;
        let mut s = format!(
            "Measured on {} (driver {}, CUDA {}, torch {}) on {}; read from {}.",
            m.card,
            m.driver,
            m.cuda,
            m.torch,
            m.date,
            // The repository-relative folder when it is a committed one (outputs are committed,
            // and must not carry the path of the checkout they were run in).
            committed_name(&self.dir).unwrap_or_else(|| self.dir.display().to_string())
        );
        if !m.note.is_empty() {
            let _ = write!(s, " Note: {}", m.note);
        }
        s
    }

    /// The rows of the implementations in `impls` (all rows when `impls` is empty).
    pub fn select(&self, impls: &[&str]) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| impls.is_empty() || impls.contains(&r.implementation.as_str()))
            .collect()
    }
}

/// Charts of `rows`: TFLOP/s of the prefill cases, one chart per direction, and TB/s of the
/// decode cases that report it. Each bar is one implementation on one case, so every
/// implementation is compared only with the peers measured on the same problem.
pub fn charts(rows: &[&Row]) -> Figures {
    let mut figures = Vec::new();
    for direction in ["fwd", "bwd"] {
        let chosen: Vec<&Row> = rows
            .iter()
            .copied()
            .filter(|r| r.direction == direction && !r.is_decode() && r.tflops > 0.0)
            .collect();
        if !chosen.is_empty() {
            let title = format!("{direction}: TFLOP/s (higher is better)");
            figures.push(bar_chart(&title, "TFLOP/s", &chosen, |r| Some(r.tflops)));
        }
    }
    let decode: Vec<&Row> =
        rows.iter().copied().filter(|r| r.is_decode() && r.tbps.is_some()).collect();
    if !decode.is_empty() {
        figures.push(bar_chart("decode: TB/s of K and V read", "TB/s", &decode, |r| r.tbps));
    }
    Figures(figures)
}

/// Horizontal grouped bars: one group per case, one bar per implementation.
fn bar_chart(
    title: &str,
    unit: &str,
    rows: &[&Row],
    value: impl Fn(&Row) -> Option<f64>,
) -> String {
    let mut cases: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    let mut impls: Vec<String> = Vec::new();
    for r in rows {
        if let Some(v) = value(r) {
            cases.entry(r.case()).or_default().push((r.implementation.clone(), v));
            if !impls.contains(&r.implementation) {
                impls.push(r.implementation.clone());
            }
        }
    }
    let labels: Vec<String> = cases.keys().cloned().collect();
    let max = cases.values().flatten().map(|(_, v)| *v).fold(0.0, f64::max).max(1e-9);
    let slot = 16u32;
    let height = 90 + labels.len() as u32 * (impls.len() as u32 * slot + 12);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (820, height.max(220))).into_drawing_area();
        let _ = draw_bars(&root, title, unit, &labels, &impls, &cases, max);
        let _ = root.present();
    }
    svg
}

fn draw_bars(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    labels: &[String],
    impls: &[String],
    cases: &BTreeMap<String, Vec<(String, f64)>>,
    max: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let n = labels.len() as f64;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(250)
        .build_cartesian_2d(0.0..max * 1.45, 0.0..n)?;
    let labels_for_axis = labels.to_vec();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .y_labels(labels.len() * 2 + 1)
        .y_label_formatter(&move |y: &f64| {
            let i = (*y - 0.5).round();
            if (y - 0.5 - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels_for_axis.len() {
                labels_for_axis[labels_for_axis.len() - 1 - i as usize].clone()
            } else {
                String::new()
            }
        })
        .x_desc(unit)
        .draw()?;
    let k = impls.len().max(1) as f64;
    for (ci, label) in labels.iter().enumerate() {
        let top = n - ci as f64; // first case at the top
        for (name, v) in &cases[label] {
            let ii = impls.iter().position(|x| x == name).unwrap_or(0);
            let name = name.as_str();
            let y1 = top - 0.1 - 0.8 * ii as f64 / k;
            let y0 = y1 - 0.8 / k;
            let color = color_of(name);
            chart.draw_series(std::iter::once(Rectangle::new(
                [(0.0, y0), (*v, y1)],
                color.filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{v:.1}"),
                (*v + max * 0.01, (y0 + y1) / 2.0 + 0.15 / k),
                ("sans-serif", 11),
            )))?;
        }
    }
    for name in impls {
        let color = color_of(name);
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, -1.0), (0.0, -1.0)],
                color.filled(),
            )))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

/// The colour of an implementation, the same in every chart: our kernels in strong colours, the
/// peers in others, none of them too pale to read on white.
pub fn color_of(implementation: &str) -> RGBColor {
    match implementation {
        "fa1" => RGBColor(190, 30, 140),
        "fa2" => RGBColor(20, 90, 200),
        "fa3" => RGBColor(0, 40, 110),
        "fa3-fp8" => RGBColor(200, 30, 30),
        "flash-decoding" => RGBColor(20, 90, 200),
        "flash-decoding-pp" => RGBColor(190, 30, 140),
        "sdpa-flash" => RGBColor(230, 110, 0),
        "sdpa-cudnn" => RGBColor(30, 140, 60),
        "sdpa-efficient" => RGBColor(130, 90, 180),
        "triton" => RGBColor(140, 80, 60),
        "triton-fp8" => RGBColor(205, 150, 20),
        "flashinfer" => RGBColor(140, 86, 75),
        "cudnn-fp8" => RGBColor(110, 190, 90),
        "flex" => RGBColor(0, 150, 170),
        // Variants of our kernels (an ablation, a tuning run) and anything else: a dark grey.
        _ => RGBColor(90, 90, 90),
    }
}

/// One of the ladder's kernels (as opposed to a peer: PyTorch's back-ends, Triton, FlashInfer).
pub fn is_ours(implementation: &str) -> bool {
    !implementation.starts_with("sdpa")
        && !implementation.starts_with("triton")
        && !implementation.starts_with("cudnn")
        && implementation != "flashinfer"
        && implementation != "flex"
}

/// Whether `implementation` multiplies in FP8 (e4m3): ours and the peers' FP8 kernels.
pub fn is_fp8(implementation: &str) -> bool {
    implementation.ends_with("fp8")
}

/// The ceilings measured on the card (`docs/conventions.md`, "Measured ceilings on the H200"),
/// drawn by [`against_n`] as a roofline: no fp16 kernel can beat the fp16 GEMM (FP8's products run
/// at twice its rate), and none can beat the rate at which its inputs and outputs cross HBM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofs {
    /// fp16 GEMM (8192³, cuBLAS) in TFLOP/s, measured: a reference line, not a bound (attention
    /// kernels pass it at large head dimensions).
    pub gemm_tflops: f64,
    /// A device-to-device copy, bytes read + written, in TB/s.
    pub copy_tbps: f64,
    /// The datasheet's dense fp16/bf16 tensor-core peak in TFLOP/s: the bound of a 16-bit kernel.
    pub peak_fp16_tflops: f64,
    /// The datasheet's dense FP8 tensor-core peak in TFLOP/s: the bound of an e4m3 kernel.
    pub peak_fp8_tflops: f64,
}

impl Roofs {
    /// The H200's: GEMM and copy measured on 2026-11-29 (679 TFLOP/s, 4.24 TB/s), the
    /// datasheet's dense peaks (H200 SXM: 989 TFLOP/s fp16, 1,979 FP8).
    pub const H200: Roofs = Roofs {
        gemm_tflops: 679.0,
        copy_tbps: 4.24,
        peak_fp16_tflops: 989.0,
        peak_fp8_tflops: 1979.0,
    };

    /// FLOPs per byte of HBM traffic of one attention call (fp16, `n_q = n_kv = n`): forward
    /// `4n²d` FLOPs (half under a causal mask) over `Q, K, V, O` (`8nd` bytes); backward 2.5× the
    /// FLOPs over `Q, K, V, O, dO` read and `dQ, dK, dV` written (`16nd` bytes). The head
    /// dimension cancels: the intensity grows with `n` alone.
    pub fn intensity(direction: &str, causal: bool, n: usize) -> f64 {
        let mask = if causal { 0.5 } else { 1.0 };
        let n = n as f64;
        if direction == "bwd" { 10.0 * n * mask / 16.0 } else { 4.0 * n * mask / 8.0 }
    }

    /// The roofline of a 16-bit kernel: the lower of the fp16 peak and the memory roof at this
    /// intensity.
    pub fn bound(&self, direction: &str, causal: bool, n: usize) -> f64 {
        self.peak_fp16_tflops.min(self.copy_tbps * Self::intensity(direction, causal, n))
    }
}

/// How [`against_n`] draws.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AgainstN {
    /// A logarithmic TFLOP/s axis, for kernels orders of magnitude apart (FA1 against the rest).
    pub log_y: bool,
    /// The measured ceilings, drawn as dashed lines.
    pub roofs: Option<Roofs>,
}

/// TFLOP/s against the sequence length of the `direction` (`"fwd"` or `"bwd"`) rows of square
/// prefill problems: one panel per head dimension and mask, one line per implementation (our
/// kernels drawn thicker), the measured ceilings when asked. `None` when there are no such rows.
pub fn against_n(title: &str, rows: &[&Row], direction: &str, style: AgainstN) -> Option<String> {
    let chosen: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| r.direction == direction && !r.is_decode() && r.tflops > 0.0 && r.n_q == r.n_kv)
        .collect();
    if chosen.is_empty() {
        return None;
    }
    let mut panels: Vec<(usize, bool)> = chosen.iter().map(|r| (r.d, r.causal)).collect();
    panels.sort();
    panels.dedup();
    let mut impls: Vec<&str> = chosen.iter().map(|r| r.implementation.as_str()).collect();
    impls.sort_by_key(|name| (!is_ours(name), *name));
    impls.dedup();
    let mut ns: Vec<usize> = chosen.iter().map(|r| r.n_q).collect();
    ns.sort();
    ns.dedup();
    let cols = panels.len().min(2);
    let panel_rows = panels.len().div_ceil(cols);
    let (panel_w, panel_h) = (460u32, 300u32);
    let mut legend: Vec<(String, RGBColor, bool)> =
        impls.iter().map(|name| (name.to_string(), color_of(name), false)).collect();
    // FP8 rows (e4m3 products) are bounded by the FP8 peak, the others by the fp16 one.
    let fp8 = impls.iter().any(|name| is_fp8(name));
    let peaks: Vec<(String, f64, RGBColor)> = style.roofs.map_or(Vec::new(), |r| {
        let mut peaks = vec![(
            format!("fp16 peak, datasheet ({:.0})", r.peak_fp16_tflops),
            r.peak_fp16_tflops,
            RGBColor(90, 90, 200),
        )];
        if fp8 {
            peaks.push((
                format!("FP8 peak, datasheet ({:.0})", r.peak_fp8_tflops),
                r.peak_fp8_tflops,
                RGBColor(170, 60, 170),
            ));
        }
        peaks
    });
    if let Some(roofs) = style.roofs {
        for (label, _, color) in &peaks {
            legend.push((label.clone(), *color, true));
        }
        legend.push((
            format!("fp16 GEMM, measured ({:.0} TFLOP/s)", roofs.gemm_tflops),
            BLACK,
            true,
        ));
        legend.push((
            format!("memory: {:.2} TB/s × FLOP/byte", roofs.copy_tbps),
            RGBColor(150, 150, 150),
            true,
        ));
    }
    let per_line = (cols as u32 * panel_w / 230).max(1) as usize;
    let header = 34 + 20 * legend.len().div_ceil(per_line) as u32;
    let size = (cols as u32 * panel_w, header + panel_rows as u32 * panel_h);

    let values: Vec<f64> = chosen.iter().map(|r| r.tflops).collect();
    let top_value = values.iter().cloned().fold(0.0, f64::max);
    // On a log axis the values drawn are log10(TFLOP/s), labelled back as TFLOP/s: whole decades.
    let log_y = style.log_y;
    let y_of = |v: f64| if log_y { v.log10() } else { v };
    let ceiling =
        peaks.iter().map(|p| p.1).fold(style.roofs.map_or(0.0, |r| r.gemm_tflops), f64::max);
    let (y_range, y_labels) = if log_y {
        let lo = values.iter().cloned().fold(f64::INFINITY, f64::min).log10().floor();
        let hi = top_value.max(ceiling).log10().ceil();
        (lo..hi, (hi - lo) as usize + 1)
    } else {
        (0.0..top_value.max(ceiling) * 1.08, 8)
    };
    let (first, last) = (ns[0] as f64, *ns.last().expect("not empty") as f64);
    let x_range = first / 1.25..last * 1.25;
    let x_ticks: Vec<f64> = ns.iter().map(|&n| n as f64).collect();

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let drawn: Result<(), Box<dyn std::error::Error>> = (|| {
            root.fill(&WHITE)?;
            let (top, body) = root.split_vertically(header);
            let top = top.titled(title, ("sans-serif", 18))?;
            for (i, (name, color, dashed)) in legend.iter().enumerate() {
                let x = 20 + (i % per_line) as i32 * 230;
                let y = 8 + (i / per_line) as i32 * 20;
                let style = color.stroke_width(if *dashed { 1 } else { 3 });
                if *dashed {
                    top.draw(&PathElement::new([(x, y), (x + 8, y)], style))?;
                    top.draw(&PathElement::new([(x + 14, y), (x + 22, y)], style))?;
                } else {
                    top.draw(&PathElement::new([(x, y), (x + 22, y)], style))?;
                }
                top.draw(&Text::new(name.clone(), (x + 28, y - 7), ("sans-serif", 13)))?;
            }
            for (area, &(d, causal)) in body.split_evenly((panel_rows, cols)).iter().zip(&panels) {
                let caption = format!("d = {d}, {}", if causal { "causal" } else { "no mask" });
                let mut chart = ChartBuilder::on(area)
                    .caption(caption, ("sans-serif", 15))
                    .margin(8)
                    .x_label_area_size(34)
                    .y_label_area_size(52)
                    .build_cartesian_2d(
                        x_range.clone().log_scale().with_key_points(x_ticks.clone()),
                        y_range.clone(),
                    )?;
                chart
                    .configure_mesh()
                    .light_line_style(WHITE)
                    .bold_line_style(RGBColor(225, 225, 225))
                    .x_desc("sequence length n")
                    .y_desc(if log_y { "TFLOP/s (log scale)" } else { "TFLOP/s" })
                    .y_labels(y_labels)
                    .x_label_formatter(&|x| {
                        let n = x.round() as usize;
                        if n >= 1024 { format!("{}k", n / 1024) } else { n.to_string() }
                    })
                    .y_label_formatter(&|y| {
                        if !log_y {
                            format!("{y:.0}")
                        } else if (y - y.round()).abs() < 1e-9 {
                            format!("{}", 10f64.powf(y.round()))
                        } else {
                            String::new()
                        }
                    })
                    .draw()?;
                for (_, peak, color) in &peaks {
                    let y = y_of(*peak);
                    chart.draw_series(DashedLineSeries::new(
                        [(x_range.start, y), (x_range.end, y)],
                        4,
                        4,
                        color.stroke_width(1),
                    ))?;
                }
                if let Some(roofs) = style.roofs {
                    let gemm = y_of(roofs.gemm_tflops);
                    chart.draw_series(DashedLineSeries::new(
                        [(x_range.start, gemm), (x_range.end, gemm)],
                        8,
                        6,
                        BLACK.stroke_width(1),
                    ))?;
                    // The memory roof, up to where it meets the top of the panel.
                    let steps = 60;
                    let memory: Vec<(f64, f64)> = (0..=steps)
                        .map(|k| {
                            let x = x_range.start
                                * (x_range.end / x_range.start).powf(k as f64 / steps as f64);
                            let n = x.round() as usize;
                            (x, roofs.copy_tbps * Roofs::intensity(direction, causal, n))
                        })
                        .filter(|&(_, v)| y_of(v) <= y_range.end)
                        .map(|(x, v)| (x, y_of(v)))
                        .collect();
                    if memory.len() > 1 {
                        chart.draw_series(DashedLineSeries::new(
                            memory,
                            8,
                            6,
                            RGBColor(150, 150, 150).stroke_width(2),
                        ))?;
                    }
                }
                for name in &impls {
                    let mut points: Vec<(f64, f64)> = chosen
                        .iter()
                        .filter(|r| r.implementation == *name && r.d == d && r.causal == causal)
                        .map(|r| (r.n_q as f64, y_of(r.tflops)))
                        .collect();
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let color = color_of(name);
                    let width = if is_ours(name) { 3 } else { 2 };
                    chart
                        .draw_series(LineSeries::new(points.clone(), color.stroke_width(width)))?;
                    chart.draw_series(
                        points.iter().map(|&p| Circle::new(p, width + 1, color.filled())),
                    )?;
                }
            }
            Ok(())
        })();
        if let Err(e) = drawn {
            return Some(format!("<p>chart failed: {e}</p>"));
        }
        let _ = root.present();
    }
    Some(svg)
}

impl Results {
    /// [`against_n`] for `impls` (all when empty), one figure per direction in `directions`
    /// that has rows of the first implementation named (of any, when `impls` is empty): a
    /// direction the rung was not measured in would chart only its peers.
    pub fn charts_against_n(
        &self,
        impls: &[&str],
        directions: &[&str],
        style: AgainstN,
    ) -> Figures {
        let rows = self.select(impls);
        let figures = directions
            .iter()
            .filter(|dir| {
                rows.iter().any(|r| {
                    r.direction == **dir && impls.first().is_none_or(|f| r.implementation == *f)
                })
            })
            .filter_map(|dir| {
                let dtype = rows.first().map_or("fp16", |r| r.dtype.as_str());
                let fp8 = rows.iter().any(|r| r.direction == *dir && is_fp8(&r.implementation));
                let inputs = if fp8 {
                    format!("{dtype} inputs (FP8 rows: e4m3 products)")
                } else {
                    dtype.to_string()
                };
                let title = match *dir {
                    "fwd" => format!("forward, {inputs}: TFLOP/s against n"),
                    "bwd" => format!("backward, {inputs}: TFLOP/s against n"),
                    other => other.to_string(),
                };
                against_n(&title, &rows, dir, style)
            })
            .collect();
        Figures(figures)
    }

    /// TFLOP/s of the square prefill problems at the sequence lengths `ns` (all when empty): one
    /// row per direction, head dimension, mask and `n`, one column per implementation of `impls`
    /// (in that order), then one column `a / b` per pair of `ratios`, each of two
    /// implementations on the same problem.
    pub fn comparison_table(&self, ns: &[usize], impls: &[&str], ratios: &[(&str, &str)]) -> Table {
        let rows: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| !r.is_decode() && r.n_q == r.n_kv && (ns.is_empty() || ns.contains(&r.n_q)))
            .collect();
        // The problems of the implementations shown (a ratio may name others).
        let mut keys: Vec<(String, usize, bool, usize)> = rows
            .iter()
            .filter(|r| impls.contains(&r.implementation.as_str()))
            .map(|r| (r.direction.clone(), r.d, r.causal, r.n_q))
            .collect();
        keys.sort_by_key(|(dir, d, causal, n)| (dir != "fwd", *d, *causal, *n));
        keys.dedup();
        let mut header: Vec<String> =
            ["pass", "d", "mask", "n"].iter().map(|h| h.to_string()).collect();
        header.extend(impls.iter().map(|i| i.to_string()));
        header.extend(ratios.iter().map(|(a, b)| format!("{a} / {b}")));
        let number = |v: f64| if v < 10.0 { format!("{v:.1}") } else { format!("{v:.0}") };
        let body = keys
            .iter()
            .map(|(dir, d, causal, n)| {
                let tflops = |imp: &str| {
                    rows.iter()
                        .find(|r| {
                            r.implementation == imp
                                && r.direction == *dir
                                && r.d == *d
                                && r.causal == *causal
                                && r.n_q == *n
                        })
                        .map(|r| r.tflops)
                };
                let mut line = vec![
                    dir.clone(),
                    d.to_string(),
                    if *causal { "causal" } else { "none" }.to_string(),
                    if *n >= 1024 { format!("{}k", n / 1024) } else { n.to_string() },
                ];
                line.extend(impls.iter().map(|i| tflops(i).map_or("–".into(), number)));
                line.extend(ratios.iter().map(|(a, b)| match (tflops(a), tflops(b)) {
                    (Some(x), Some(y)) => format!("{:.2}×", x / y),
                    _ => "–".into(),
                }));
                line
            })
            .collect();
        Table { header, rows: body }
    }
}

/// A small table, shown by evcxr as HTML (and copied into the book by `scripts/refresh-notebooks`
/// from a `book` cell).
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// The table as an HTML `<table>`, numbers right-aligned.
    pub fn to_html(&self) -> String {
        let escape = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
        let mut html = String::from("<table>\n<thead><tr>");
        for h in &self.header {
            let _ = write!(html, "<th>{}</th>", escape(h));
        }
        html.push_str("</tr></thead>\n<tbody>\n");
        for row in &self.rows {
            html.push_str("<tr>");
            for (c, cell) in row.iter().enumerate() {
                let align = if c >= 3 { " style=\"text-align:right\"" } else { "" };
                let _ = write!(html, "<td{align}>{}</td>", escape(cell));
            }
            html.push_str("</tr>\n");
        }
        html.push_str("</tbody>\n</table>");
        html
    }

    /// Shows the table in Jupyter (nothing for a table without rows).
    pub fn evcxr_display(&self) {
        if !self.rows.is_empty() {
            println!("EVCXR_BEGIN_CONTENT text/html\n{}\nEVCXR_END_CONTENT", self.to_html());
        }
    }
}

/// One line of a sweep committed beside decode measurements (`split-sweep.txt`,
/// `strategy-sweep.txt`: `examples/decode_bandwidth.rs` prints them).
#[derive(Debug, Clone, PartialEq)]
pub struct SweepRow {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// Tokens in the KV cache.
    pub len: usize,
    /// The strategy asked for and the kernel that ran (`None` in a sweep of one kernel).
    pub strategy: Option<String>,
    pub ran: Option<String>,
    /// The split count: fixed, or the heuristic's choice (`auto`, with its count when printed).
    pub splits: Option<usize>,
    pub auto: bool,
    pub ms: f64,
    pub tbps: f64,
}

/// Parses a sweep table: a header line starting with `B` (`B heads L [strategy ran] splits ms
/// TB/s [host µs gpu ms gpu TB/s]`, the two-word names of `decode_bandwidth`'s later columns
/// read as one column each) and one line per run; a split count of `auto` or `auto N` is the
/// heuristic's choice.
pub fn parse_sweep(text: &str) -> Result<Vec<SweepRow>, String> {
    let mut lines = text.lines().enumerate().skip_while(|(_, l)| !l.trim_start().starts_with("B "));
    let Some((_, header)) = lines.next() else {
        return Err("no header line starting with `B`".into());
    };
    let header = header.replace("host µs", "host_µs").replace("gpu ms", "gpu_ms");
    let header = header.replace("gpu TB/s", "gpu_TB/s");
    let header: Vec<&str> = header.split_whitespace().collect();
    let column = |name: &str| header.iter().position(|h| *h == name);
    let need = |name: &str| column(name).ok_or_else(|| format!("no column {name:?}"));
    let (b, heads, len, splits, ms, tbps) =
        (need("B")?, need("heads")?, need("L")?, need("splits")?, need("ms")?, need("TB/s")?);
    let mut rows = Vec::new();
    for (number, line) in lines {
        let mut tokens: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        if tokens.is_empty() {
            continue;
        }
        // `auto 4`: the heuristic's count printed beside it, one column in the header. (A
        // strategy may be called `auto` too: only an `auto` followed by a count is merged.)
        if tokens.len() == header.len() + 1 {
            let merged =
                tokens.windows(2).position(|w| w[0] == "auto" && w[1].parse::<usize>().is_ok());
            if let Some(a) = merged {
                let count = tokens.remove(a + 1);
                tokens[a] = format!("auto {count}");
            }
        }
        let at = |what: &str| format!("line {}: {what} in {line:?}", number + 1);
        if tokens.len() != header.len() {
            return Err(at("wrong number of columns"));
        }
        let int = |c: usize| tokens[c].parse::<usize>().map_err(|_| at("not a whole number"));
        let real = |c: usize| tokens[c].parse::<f64>().map_err(|_| at("not a number"));
        let (heads_q, heads_kv) = tokens[heads].split_once('/').ok_or_else(|| at("heads"))?;
        let split = tokens[splits].as_str();
        let (auto, count) = match split.strip_prefix("auto") {
            Some(rest) => (true, rest.trim()),
            None => (false, split),
        };
        rows.push(SweepRow {
            batch: int(b)?,
            heads_q: heads_q.parse().map_err(|_| at("heads"))?,
            heads_kv: heads_kv.parse().map_err(|_| at("heads"))?,
            len: int(len)?,
            strategy: column("strategy").map(|c| tokens[c].clone()),
            ran: column("ran").map(|c| tokens[c].clone()),
            splits: if count.is_empty() {
                None
            } else {
                Some(count.parse().map_err(|_| at("split count"))?)
            },
            auto,
            ms: real(ms)?,
            tbps: real(tbps)?,
        });
    }
    Ok(rows)
}

/// The sweep `docs/results/FOLDER/FILE`, parsed; `Ok(None)` when it is not committed.
pub fn committed_sweep(folder: &str, file: &str) -> Result<Option<Vec<SweepRow>>, String> {
    let path = results_dir_named(folder).join(file);
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_sweep(&text).map(Some).map_err(|e| format!("{}: {e}", path.display())),
        Err(_) => Ok(None),
    }
}

/// The "on the GPU" cell of a rung notebook: the H200 figures of `impls` (the rung first, then
/// what to compare it with), one figure of [`against_n`] per direction in `directions` in which
/// the rung was measured, when `docs/results/history/h200/bench.csv` has rows of the rung itself; else
/// the message saying the rung has not been measured (the peers alone would chart other problems).
pub fn gpu_section_against_n(impls: &[&str], directions: &[&str], style: AgainstN) -> Figures {
    match load() {
        Ok(Some(results)) => {
            let rung = impls.first().copied().unwrap_or_default();
            if results.select(&[rung]).is_empty() {
                println!("No GPU measurements of {rung} are committed ({}).", results.provenance());
                return Figures(Vec::new());
            }
            println!("{}", results.provenance());
            results.charts_against_n(impls, directions, style)
        }
        Ok(None) => {
            println!("{NOT_MEASURED}");
            Figures(Vec::new())
        }
        Err(e) => {
            println!("The committed results could not be read: {e}");
            Figures(Vec::new())
        }
    }
}

/// Charts as SVG, shown inline by evcxr (and extracted into the book by
/// `scripts/refresh-notebooks`).
pub struct Figures(pub Vec<String>);

impl Figures {
    /// Prints the charts as HTML for Jupyter; nothing when there are none.
    pub fn evcxr_display(&self) {
        // One block: evcxr keeps a single output per cell.
        if !self.0.is_empty() {
            let html: String = self.0.iter().map(|svg| format!("<div>{svg}</div>")).collect();
            println!("EVCXR_BEGIN_CONTENT text/html\n{html}\nEVCXR_END_CONTENT");
        }
    }
}

/// The "on the GPU" charts of a rung whose measurements live in their own folder
/// (`docs/results/FOLDER`, e.g. `h200-fa3`): `impls` (the rung first), at head dimension `d`
/// when given, contiguous KV caches only (a folder's `table.txt` has the paged rows); a message
/// instead when the folder is missing or unreadable.
pub fn gpu_section_in(folder: &str, impls: &[&str], d: Option<usize>) -> Figures {
    match load_from(&results_dir_named(folder)) {
        Ok(Some(results)) => {
            println!("{}", results.provenance());
            let rows: Vec<&Row> = results
                .select(impls)
                .into_iter()
                .filter(|r| d.is_none_or(|d| r.d == d) && r.page_size.is_none())
                .collect();
            charts(&rows)
        }
        Ok(None) => {
            println!("No measurements in docs/results/{folder} (run `ladder bench` on a GPU).");
            Figures(Vec::new())
        }
        Err(e) => {
            println!("The committed results could not be read: {e}");
            Figures(Vec::new())
        }
    }
}

/// A text file committed beside measurements (`docs/results/FOLDER/FILE`, e.g. a sweep printed
/// by an example), or a line saying it is missing.
pub fn committed_text(folder: &str, file: &str) -> String {
    let path = results_dir_named(folder).join(file);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|_| format!("No {file} committed in docs/results/{folder}."))
}

/// The FA3 ablation measured on the H200 (`docs/results/history/h200-fa3/ablation`) beside the schedule
/// simulation's tensor-core utilisation (`ladder_reference::fa3::timeline`, H100 stage costs at
/// d = 128) for the schedule each variant comes closest to: one line per variant, TFLOP/s per
/// measured case and relative to the full kernel.
pub fn fa3_ablation() -> Result<String, String> {
    use ladder_reference::fa3::{Schedule, StageCosts, tensor_core_utilisation, timeline};
    let Some(r) = load_from(&results_dir_named("h200-fa3/ablation"))? else {
        return Ok(
            "No ablation measurements committed (docs/results/history/h200-fa3/ablation).".into()
        );
    };
    let costs = StageCosts::hopper(128);
    let simulated = |s: Schedule| tensor_core_utilisation(&timeline(s, 64, costs));
    // The kernel always has two consumer warpgroups: without ping-pong they still share the
    // tensor cores, unordered, which is what the simulation's two-warpgroup schedule models.
    let schedules = [
        ("neither: 2 warpgroups, unordered", "fa3-no-pingpong+no-overlap", Schedule::PingPong),
        ("intra-warpgroup overlap only", "fa3-no-pingpong", Schedule::IntraWarpgroup),
        ("ping-pong only: turns enforced", "fa3-no-overlap", Schedule::PingPong),
        ("both (the full kernel)", "fa3", Schedule::PingPongOverlap),
    ];
    let mut cases: Vec<(bool, usize)> =
        r.rows.iter().filter(|x| x.implementation == "fa3").map(|x| (x.causal, x.n_q)).collect();
    cases.sort();
    cases.dedup();
    let tflops = |imp: &str, (causal, n): (bool, usize)| {
        r.rows
            .iter()
            .find(|x| x.implementation == imp && x.causal == causal && x.n_q == n)
            .map(|x| x.tflops)
    };
    let mut out = format!("{}\n\n{:<42} {:>10}", r.provenance(), "schedule", "simulated");
    for (causal, n) in &cases {
        let mask = if *causal { "causal" } else { "full" };
        out += &format!(" {:>16}", format!("{mask} {}k", n / 1024));
    }
    out += "\n";
    for (label, imp, sim) in schedules {
        let sim = format!("{:.2}", simulated(sim));
        out += &format!("{label:<42} {sim:>10}");
        for &case in &cases {
            let cell = match (tflops(imp, case), tflops("fa3", case)) {
                (Some(t), Some(full)) => format!("{t:.0} ({:.2}×)", t / full),
                _ => "-".into(),
            };
            out += &format!(" {cell:>16}");
        }
        out += "\n";
    }
    out += &format!(
        "{:<42} {:>10}   (FA2's loop on Hopper: no kernel variant)\n",
        "one warpgroup in order",
        format!("{:.2}", simulated(Schedule::Sequential))
    );
    out += &format!("{:<42} {:>10}", "cuDNN (same lease)", "");
    for &case in &cases {
        let cell = tflops("sdpa-cudnn", case).map_or("-".into(), |t| format!("{t:.0}"));
        out += &format!(" {cell:>16}");
    }
    Ok(out)
}

/// FlashDecoding++ on the H200 against its unified max φ (`docs/results/history/h200-decode-pp-phi`):
/// the share of rows sent to the FlashDecoding fallback, and the time of the call relative to
/// FlashDecoding's on the same shape, per φ. Prints the table and returns the chart.
pub fn fd_pp_phi_sweep() -> Result<Figures, String> {
    let path = results_dir_named("h200-decode-pp-phi").join("phi-sweep.csv");
    let Ok(text) = std::fs::read_to_string(&path) else {
        println!("No φ sweep committed (docs/results/history/h200-decode-pp-phi).");
        return Ok(Figures(vec![]));
    };
    // impl,phi,batch,heads_q,heads_kv,n_kv,rows,fallback_rows,ms,tbps
    let mut fd: BTreeMap<String, f64> = BTreeMap::new();
    let mut pp: Vec<(f64, &str, f64, f64)> = Vec::new(); // (φ, as written, fallback share, ms)
    for (i, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let bad = || format!("{}: line {}: {line:?}", path.display(), i + 1);
        if f.len() != 10 {
            return Err(bad());
        }
        let num = |s: &str| s.parse::<f64>().map_err(|_| bad());
        let ms = num(f[8])?;
        match f[0] {
            "flash-decoding" => {
                fd.insert(f[1].to_string(), ms);
            }
            "flash-decoding-pp" => pp.push((num(f[1])?, f[1], num(f[7])? / num(f[6])?, ms)),
            _ => {}
        }
    }
    pp.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!("   φ   fallback rows   time / FlashDecoding's");
    let mut points = Vec::new();
    for &(phi, written, share, ms) in &pp {
        let ratio = fd.get(written).map(|f| ms / f);
        println!(
            "{phi:>5}   {:>12.1} %   {}",
            share * 100.0,
            ratio.map_or("–".to_string(), |r| format!("{r:.2}"))
        );
        points.push((phi, share, ratio.unwrap_or(f64::NAN)));
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 360)).into_drawing_area();
        draw_phi_sweep(&root, &points).map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(Figures(vec![svg]))
}

fn draw_phi_sweep(
    root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    points: &[(f64, f64, f64)],
) -> Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let lo = points.iter().map(|p| p.0).fold(f64::INFINITY, f64::min) - 0.5;
    let hi = points.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max) + 0.5;
    let mut chart = ChartBuilder::on(root)
        .caption("FlashDecoding++ on the H200: fallback against φ", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(lo..hi, 0.0..2.4)?;
    chart.configure_mesh().x_desc("unified max φ").y_desc("share of rows / time ratio").draw()?;
    let share: Vec<(f64, f64)> = points.iter().map(|p| (p.0, p.1)).collect();
    let time: Vec<(f64, f64)> =
        points.iter().filter(|p| p.2.is_finite()).map(|p| (p.0, p.2)).collect();
    let (red, blue) = (RED.mix(0.9), BLUE.mix(0.9));
    chart
        .draw_series(LineSeries::new(share.clone(), red.stroke_width(2)))?
        .label("rows sent to the fallback (share)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], red.stroke_width(2)));
    chart.draw_series(share.iter().map(|&p| Circle::new(p, 3, red.filled())))?;
    chart
        .draw_series(LineSeries::new(time.clone(), blue.stroke_width(2)))?
        .label("time / FlashDecoding's time")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], blue.stroke_width(2)));
    chart.draw_series(time.iter().map(|&p| TriangleMarker::new(p, 4, blue.filled())))?;
    let grey = BLACK.mix(0.5);
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.0), (0.0, 2.4)],
            grey.stroke_width(1),
        )))?
        .label("default φ = 0")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], grey.stroke_width(1)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperMiddle)
        .draw()?;
    Ok(())
}

/// Charts committed beside measurements (`docs/results/FOLDER/FILE`, SVGs drawn by `ladder bench
/// --charts-only`), to show inline; a line for each one that is missing.
pub fn committed_charts(folder: &str, files: &[&str]) -> Figures {
    let mut svgs = Vec::new();
    for file in files {
        let path = results_dir_named(folder).join(file);
        match std::fs::read_to_string(&path) {
            // From the <svg> element on: the XML prolog has no place inside HTML.
            Ok(svg) => svgs.extend(svg.find("<svg").map(|at| svg[at..].to_string())),
            Err(_) => println!("No {file} committed in docs/results/{folder}."),
        }
    }
    Figures(svgs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_bench_format() {
        let text = format!(
            "{}\nfa2,fwd,fp16,true,4,32,32,4096,4096,128,1.5,400.0,\n\
             sdpa-cudnn,fwd,fp16,false,1,32,8,1,8192,128,0.02,1.0,2.5\n",
            bench::CSV_HEADER
        );
        let rows = parse_csv(&text).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(rows[0].causal && rows[0].tbps.is_none() && !rows[0].is_decode());
        assert!(rows[1].is_decode() && rows[1].tbps == Some(2.5));
        assert!(parse_csv("a,b\n").is_err());
        let figures = charts(&rows.iter().collect::<Vec<_>>());
        assert_eq!(figures.0.len(), 2);
        assert!(figures.0[0].contains("<svg"));
    }

    #[test]
    fn the_committed_results_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/results/history/h200");
        let results =
            load_from(&dir).unwrap().expect("docs/results/history/h200/bench.csv is committed");
        assert!(results.rows.iter().any(|r| r.implementation == "fa2"));
        assert!(results.rows.iter().any(|r| r.implementation == "sdpa-flash"), "peers.csv too");
        assert!(results.meta.card.contains("H200"), "{:?}", results.meta);
    }

    #[test]
    fn absent_results_are_none() {
        assert!(load_from(Path::new("/nonexistent")).unwrap().is_none());
    }

    #[test]
    fn committed_folders_are_named_from_the_repository_root() {
        let named = |p: &str| committed_name(Path::new(p));
        assert_eq!(
            named("/any/checkout/docs/results/history/h200-fa3"),
            Some("docs/results/history/h200-fa3".into())
        );
        assert_eq!(
            named("../docs/results/history/h200-fa3/ablation").as_deref(),
            Some("docs/results/history/h200-fa3/ablation")
        );
        assert_eq!(named("/tmp/bench"), None);
        assert_eq!(named("/x/docs/results"), None);
    }

    #[test]
    fn charts_against_n_have_a_panel_per_head_dim_and_mask_and_only_measured_directions() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/results/history/h200");
        let results = load_from(&dir).unwrap().expect("committed");
        // FA1 has no backward kernel: its section draws the forward figure only.
        let fa1 = results.charts_against_n(
            &["fa1", "sdpa-flash"],
            &["fwd", "bwd"],
            AgainstN { log_y: true, roofs: None },
        );
        assert_eq!(fa1.0.len(), 1);
        let svg = &fa1.0[0];
        for caption in ["d = 64, no mask", "d = 64, causal", "d = 128, no mask", "d = 128, causal"]
        {
            assert!(svg.contains(caption), "{caption} missing");
        }
        assert!(svg.contains("\nfa1\n") && svg.contains("\nsdpa-flash\n"), "legend");
        assert!(svg.contains("\n16k\n") && svg.contains("\n512\n"), "the x axis names every n");
        // Every implementation, both directions, with the ceilings: compact, not a tall bar chart.
        let all = results.charts_against_n(
            &[],
            &["fwd", "bwd"],
            AgainstN { log_y: false, roofs: Some(Roofs::H200) },
        );
        assert_eq!(all.0.len(), 2);
        assert!(all.0[0].contains("fp16 GEMM, measured (679 TFLOP/s)"));
        let height = |svg: &str| -> u32 {
            let at = svg.find("height=\"").unwrap() + 8;
            svg[at..].split('"').next().unwrap().parse().unwrap()
        };
        assert!(all.0.iter().all(|svg| height(svg) < 800), "figures stay under 800 px");
    }

    #[test]
    fn the_roofline_takes_the_lower_of_the_peak_and_the_memory_roof() {
        let r = Roofs::H200;
        // Forward, no mask: n/2 FLOP per byte, so the memory roof passes the fp16 peak (989)
        // between n = 256 and 512 (at 233 FLOP per byte); causal halves the FLOPs and moves the
        // crossing to twice n.
        assert_eq!(Roofs::intensity("fwd", false, 512), 256.0);
        assert_eq!(Roofs::intensity("fwd", true, 512), 128.0);
        assert_eq!(r.bound("fwd", false, 512), 989.0);
        assert!((r.bound("fwd", true, 512) - 4.24 * 128.0).abs() < 1e-9);
        assert!(r.bound("bwd", false, 256) < 989.0 && r.bound("bwd", false, 1024) == 989.0);
    }

    #[test]
    fn the_table_keeps_the_asked_lengths_and_implementations_and_takes_the_ratios() {
        let text = format!(
            "{}\nfa2,fwd,fp16,false,1,16,16,2048,2048,128,1.0,300.0,\n\
             sdpa-flash,fwd,fp16,false,1,16,16,2048,2048,128,1.0,250.0,\n\
             sdpa-cudnn,fwd,fp16,false,1,16,16,2048,2048,128,1.0,600.0,\n\
             fa2,fwd,fp16,false,1,16,16,4096,4096,128,1.0,320.0,\n",
            bench::CSV_HEADER
        );
        let results =
            Results { dir: PathBuf::new(), rows: parse_csv(&text).unwrap(), meta: Meta::default() };
        let impls = ["fa2", "sdpa-cudnn", "sdpa-flash"];
        let ratios = [("fa2", "sdpa-cudnn"), ("fa2", "sdpa-flash")];
        let table = results.comparison_table(&[2048], &impls, &ratios);
        assert_eq!(
            table.header[4..9],
            ["fa2", "sdpa-cudnn", "sdpa-flash", "fa2 / sdpa-cudnn", "fa2 / sdpa-flash"]
        );
        assert_eq!(table.rows.len(), 1, "n = 4096 was not asked for");
        assert_eq!(table.rows[0][7..9], ["0.50×", "1.20×"]);
        assert!(table.to_html().contains("<td style=\"text-align:right\">300</td>"));
        // Every length when none is asked for, and only the implementations named.
        let all = results.comparison_table(&[], &["fa2"], &[("fa2", "sdpa-cudnn")]);
        assert_eq!((all.rows.len(), all.header.len()), (2, 6));
        assert_eq!(all.rows[0][5], "0.50×", "a ratio may name an implementation not shown");
        assert_eq!(all.rows[1][5], "–", "no cuDNN row at n = 4096");
    }

    #[test]
    fn the_committed_sweeps_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/results/history");
        let sweep = |file: &str| parse_sweep(&std::fs::read_to_string(dir.join(file)).unwrap());
        let split = sweep("h200-decode/split-sweep.txt").unwrap();
        assert_eq!(split.len(), 25);
        let first = &split[0];
        assert_eq!((first.batch, first.heads_q, first.heads_kv, first.len), (1, 32, 32, 8192));
        assert!(first.auto && first.splits.is_none() && first.strategy.is_none());
        assert_eq!((split[1].splits, split[1].ms, split[1].tbps), (Some(1), 0.0854, 1.57));
        let strategy = sweep("h200-decode-pp/strategy-sweep.txt").unwrap();
        assert_eq!(strategy.len(), 100);
        assert_eq!(strategy[0].strategy.as_deref(), Some("flash-decoding"));
        assert!(strategy[0].auto && strategy[0].splits == Some(4));
        // The dispatcher's own rows: strategy `auto`, the kernel it ran, the heuristic's splits.
        let dispatched: Vec<&SweepRow> =
            strategy.iter().filter(|r| r.strategy.as_deref() == Some("auto") && r.auto).collect();
        assert_eq!(dispatched.len(), 5, "one per shape");
        assert_eq!(dispatched[0].ran.as_deref(), Some("gemv"));
        assert_eq!((dispatched[0].splits, dispatched[0].tbps), (Some(4), 3.13));
        assert_eq!(dispatched[3].ran.as_deref(), Some("flat-gemm"));
        assert_eq!(dispatched[3].splits, Some(15));
        // decode_bandwidth's later format: host and GPU times beside the events' (v4: PDL on).
        let v4 = sweep("h200-decode-v4/bandwidth-sweep.txt").unwrap();
        assert_eq!(v4.len(), 35);
        assert_eq!(v4[0].strategy.as_deref(), Some("flash-decoding"));
        assert!(v4[0].auto && v4[0].splits == Some(4));
        assert_eq!((v4[1].splits, v4[1].ms, v4[1].tbps), (Some(1), 0.0762, 1.76));
        assert!(parse_sweep("no table here").is_err());
        assert!(parse_sweep("  B heads L splits ms TB/s\n 1 32/8 8192 4 0.1\n").is_err());
    }
}
