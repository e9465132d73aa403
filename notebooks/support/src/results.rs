//! The GPU measurements committed under `docs/results/h200/`, and their charts.
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
it writes docs/results/h200/bench.csv and meta.json, and `scripts/refresh-notebooks 08` redraws \
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

/// Where the results are: `$LADDER_RESULTS_DIR`, else `docs/results/h200` in the repository
/// the notebook runs in (found by walking up from the working directory).
pub fn results_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LADDER_RESULTS_DIR") {
        return PathBuf::from(dir);
    }
    results_dir_named("h200")
}

/// `docs/results/NAME` in the repository the notebook runs in (e.g. `h200-fa3`, or
/// `h200-fa3/ablation`), found by walking up from the working directory.
pub fn results_dir_named(name: &str) -> PathBuf {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let rel = Path::new("docs/results").join(name);
    cwd.ancestors()
        .map(|a| a.join(&rel))
        .find(|p| p.join("bench.csv").exists())
        .unwrap_or_else(|| cwd.join("..").join(&rel))
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
            // The repository-relative folder when it is the committed one (outputs are committed).
            if self.dir.ends_with("docs/results/h200") {
                "docs/results/h200".to_string()
            } else {
                self.dir.display().to_string()
            }
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

    /// The charts of [`charts`] for `impls`.
    pub fn charts(&self, impls: &[&str]) -> Figures {
        charts(&self.select(impls))
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
            let y1 = top - 0.1 - 0.8 * ii as f64 / k;
            let y0 = y1 - 0.8 / k;
            let color = Palette99::pick(ii).to_rgba();
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
    for (ii, name) in impls.iter().enumerate() {
        let color = Palette99::pick(ii).to_rgba();
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

/// The "on the GPU" cell of a rung notebook: the H200 figures of `impls` (the rung first, then
/// what to compare it with) when `docs/results/h200/bench.csv` has rows of the rung itself; else
/// the message saying the rung has not been measured (the peers alone would chart other problems).
pub fn gpu_section(impls: &[&str]) -> Figures {
    match load() {
        Ok(Some(results)) => {
            let rung = impls.first().copied().unwrap_or_default();
            if results.select(&[rung]).is_empty() {
                println!(
                    "No GPU measurements of {rung} are committed: this rung has no GPU kernel \
                     yet. Notebook 08 charts the H200 results of the kernels that exist \
                     ({}).",
                    results.provenance()
                );
                return Figures(Vec::new());
            }
            println!("{}", results.provenance());
            results.charts(impls)
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

/// The FA3 ablation measured on the H200 (`docs/results/h200-fa3/ablation`) beside the schedule
/// simulation's tensor-core utilisation (`ladder_reference::fa3::timeline`, H100 stage costs at
/// d = 128) for the schedule each variant comes closest to: one line per variant, TFLOP/s per
/// measured case and relative to the full kernel.
pub fn fa3_ablation() -> Result<String, String> {
    use ladder_reference::fa3::{Schedule, StageCosts, tensor_core_utilisation, timeline};
    let Some(r) = load_from(&results_dir_named("h200-fa3/ablation"))? else {
        return Ok("No ablation measurements committed (docs/results/h200-fa3/ablation).".into());
    };
    let costs = StageCosts::hopper(128);
    let simulated = |s: Schedule| tensor_core_utilisation(&timeline(s, 64, costs));
    // The kernel always has two consumer warpgroups: without ping-pong they still share the
    // tensor cores, unordered, which is what the simulation's two-warpgroup schedule models.
    let schedules = [
        (
            "neither: 2 warpgroups, unordered",
            "fa3-no-pingpong+no-overlap",
            Some(Schedule::PingPong),
        ),
        ("intra-warpgroup overlap only", "fa3-no-pingpong", Some(Schedule::IntraWarpgroup)),
        ("ping-pong only: turns enforced", "fa3-no-overlap", Some(Schedule::PingPong)),
        ("both (the full kernel)", "fa3", None),
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
        let sim = sim.map_or("≥ either".to_string(), |s| format!("{:.2}", simulated(s)));
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

/// FlashDecoding++ on the H200 against its unified max φ (`docs/results/h200-decode-pp-phi`):
/// the share of rows sent to the FlashDecoding fallback, and the time of the call relative to
/// FlashDecoding's on the same shape, per φ. Prints the table and returns the chart.
pub fn fd_pp_phi_sweep() -> Result<Figures, String> {
    let path = results_dir_named("h200-decode-pp-phi").join("phi-sweep.csv");
    let Ok(text) = std::fs::read_to_string(&path) else {
        println!("No φ sweep committed (docs/results/h200-decode-pp-phi).");
        return Ok(Figures(vec![]));
    };
    // impl,phi,batch,heads_q,heads_kv,n_kv,rows,fallback_rows,ms,tbps
    let mut fd: BTreeMap<String, f64> = BTreeMap::new();
    let mut pp: Vec<(f64, f64, f64)> = Vec::new(); // (φ, fallback share, ms)
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
            "flash-decoding-pp" => pp.push((num(f[1])?, num(f[7])? / num(f[6])?, ms)),
            _ => {}
        }
    }
    pp.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!("   φ   fallback rows   time / FlashDecoding's");
    let mut points = Vec::new();
    for &(phi, share, ms) in &pp {
        let key = format!("{phi}");
        let ratio = fd.get(&key).map(|f| ms / f);
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
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/results/h200");
        let results = load_from(&dir).unwrap().expect("docs/results/h200/bench.csv is committed");
        assert!(results.rows.iter().any(|r| r.implementation == "fa2"));
        assert!(results.rows.iter().any(|r| r.implementation == "sdpa-flash"), "peers.csv too");
        assert!(results.meta.card.contains("H200"), "{:?}", results.meta);
    }

    #[test]
    fn absent_results_are_none() {
        assert!(load_from(Path::new("/nonexistent")).unwrap().is_none());
    }
}
