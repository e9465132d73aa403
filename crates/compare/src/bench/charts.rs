//! TFLOP/s against sequence length, one SVG per (direction, dtype, head dim, mask), one line per
//! implementation: the ladder's rungs solid, the peers (PyTorch SDPA, Triton) dashed. Decoding
//! rows get their own charts ([`draw_decode`]): TB/s against the KV cache length, one SVG per
//! (dtype, head dim, batch), one line per (implementation, query/kv heads), with the HBM
//! bandwidth of the datasheet (and a measured one, when `meta.json` has [`HBM_READ_KEY`]).
//!
//! SVG text is written as `<text>` elements with plotters' built-in size estimate, so drawing
//! needs no font files and no fontconfig.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;

use anyhow::bail;
use ladder_compare::results::{self, Row};

use super::report::{impl_rank, is_peer, render_side_by_side};

/// Line colours of the known implementations; others take [`SPARE_COLORS`].
const COLORS: [(&str, RGBColor); 13] = [
    ("fa1", RGBColor(148, 103, 189)),              // purple
    ("fa2", RGBColor(214, 39, 40)),                // red
    ("fa2-det", RGBColor(227, 119, 194)),          // pink
    ("fa3", RGBColor(0, 0, 0)),                    // black
    ("fa3-det", RGBColor(96, 96, 96)),             // dark grey
    ("flash-decoding", RGBColor(214, 39, 40)),     // red
    ("flash-decoding-pp", RGBColor(188, 189, 34)), // olive
    ("sdpa-flash", RGBColor(31, 119, 180)),        // blue
    ("sdpa-cudnn", RGBColor(44, 160, 44)),         // green
    ("sdpa-efficient", RGBColor(255, 127, 14)),    // orange
    ("triton", RGBColor(23, 190, 207)),            // cyan
    ("flashinfer", RGBColor(140, 86, 75)),         // brown
    ("flex", RGBColor(148, 103, 189)),             // purple (fa1 never runs at 16k)
];
const SPARE_COLORS: [RGBColor; 2] = [RGBColor(188, 128, 0), RGBColor(127, 127, 127)];

/// The colour of implementation `name` (the `i`-th series of its chart).
fn color_of(name: &str, i: usize) -> RGBColor {
    COLORS.iter().find(|(n, _)| *n == name).map_or(SPARE_COLORS[i % 2], |(_, c)| *c)
}

/// HBM3e bandwidth of the H200 datasheet, TB/s: the decode charts' reference line.
pub const HBM_DATASHEET_TBPS: f64 = 4.8;
/// The `meta.json` key of a measured HBM read bandwidth in TB/s (a number; absent unless
/// measured), drawn as a second line on the decode charts.
pub const HBM_READ_KEY: &str = "hbm_read_tbps";

/// One chart: the rows of one (direction, dtype, d, mask), by implementation.
#[derive(Debug, Default)]
struct Chart {
    series: BTreeMap<(usize, String), BTreeMap<usize, f64>>,
}

/// File name of the chart of one group, e.g. `fwd-fp16-d128-causal.svg`, or
/// `fwd-fp16-d128-w4095-0.svg` for a window (`mask` is [`Case::mask_label`]).
///
/// [`Case::mask_label`]: ladder_compare::results::Case::mask_label
pub fn chart_name(direction: &str, dtype: &str, d: usize, mask: &str) -> String {
    let mask = if mask == "full" { "noncausal".to_string() } else { mask.replace(':', "-") };
    format!("{direction}-{dtype}-d{d}-{mask}.svg")
}

/// Draw one chart per (direction, dtype, d, mask) of the measured `rows` into `dir`, titled with
/// `subtitle` (card, driver, date). Returns the files written.
pub fn draw_all(dir: &Path, rows: &[Row], subtitle: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut charts: BTreeMap<(u8, String, usize, (bool, String)), Chart> = BTreeMap::new();
    for row in rows {
        let Some((_, tflops)) = row.timing() else { continue };
        let c = &row.case;
        if c.is_decode() || c.n_q != c.n_kv || !tflops.is_finite() {
            continue; // the sweep is square; other shapes have no place on an n axis
        }
        let mask = (c.causal, c.mask_label());
        let key = (u8::from(c.direction != "fwd"), c.dtype.clone(), c.d, mask);
        let chart = charts.entry(key).or_default();
        chart.series.entry(impl_rank(&c.series())).or_default().insert(c.n_q, tflops);
    }
    let mut written = Vec::new();
    for ((dir_rank, dtype, d, (_, mask)), chart) in &charts {
        let direction = if *dir_rank == 0 { "fwd" } else { "bwd" };
        let path = dir.join(chart_name(direction, dtype, *d, mask));
        let mask = match mask.as_str() {
            "full" => "non-causal".to_string(),
            "causal" => "causal".to_string(),
            w => format!("window {} (TFLOP/s of the pairs it attends)", &w[1..]),
        };
        let title = format!(
            "{} {dtype}, d = {d}, {mask}: TFLOP/s",
            if *dir_rank == 0 { "Forward" } else { "Backward" },
        );
        draw(&path, &title, subtitle, chart)
            .with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// `512`, `1k`, `16k` for a log₂ tick; nothing between powers of two.
fn n_label(log2_n: f64) -> String {
    if (log2_n - log2_n.round()).abs() > 1e-6 {
        return String::new();
    }
    let n = 2f64.powf(log2_n.round()) as u64;
    if n >= 1024 && n % 1024 == 0 { format!("{}k", n / 1024) } else { n.to_string() }
}

/// The chart area of every chart here: a title block, `log2(n)` on the x axis over `ns` (padded),
/// `0 ..= top` on the y axis; `series` draws the lines, then the legend goes to `legend`.
struct Frame<'a> {
    title: &'a str,
    subtitle: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    y_decimals: usize,
    legend: SeriesLabelPosition,
}

type Axes<'c, 'p> = ChartContext<
    'c,
    SVGBackend<'p>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

impl Frame<'_> {
    fn draw(
        self,
        path: &Path,
        ns: impl Iterator<Item = usize>,
        top: f64,
        series: impl FnOnce(&mut Axes<'_, '_>, (f64, f64)) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let (lo, hi) = ns.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), n| {
            let x = (n as f64).log2();
            (lo.min(x), hi.max(x))
        });
        let (lo, hi) = (lo.floor() - 0.3, hi.ceil() + 0.3);
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(56);
        head.draw(&Text::new(self.title.to_string(), (16, 8), ("sans-serif", 22).into_font()))?;
        head.draw(&Text::new(self.subtitle.to_string(), (16, 34), ("sans-serif", 15).into_font()))?;
        let mut ctx = ChartBuilder::on(&body)
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(lo..hi, 0f64..top)?;
        let ticks = (hi - lo).round() as usize + 1;
        let decimals = self.y_decimals;
        ctx.configure_mesh()
            .x_labels(ticks)
            .x_label_formatter(&|x| n_label(*x))
            .x_desc(self.x_desc)
            .y_desc(self.y_desc)
            .y_label_formatter(&|y| format!("{y:.decimals$}"))
            .label_style(("sans-serif", 14))
            .draw()?;
        series(&mut ctx, (lo, hi))?;
        ctx.configure_series_labels()
            .position(self.legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()?;
        root.present()?;
        Ok(())
    }
}

fn draw(path: &Path, title: &str, subtitle: &str, chart: &Chart) -> anyhow::Result<()> {
    let all = || chart.series.values().flat_map(|s| s.iter());
    let top = all().map(|(_, &t)| t).fold(1.0, f64::max) * 1.15;
    let frame = Frame {
        title,
        subtitle,
        x_desc: "sequence length n (log2 scale; batch = tokens / n)",
        y_desc: "TFLOP/s",
        y_decimals: 0,
        legend: SeriesLabelPosition::UpperLeft,
    };
    frame.draw(path, all().map(|(&n, _)| n), top, |ctx, _| draw_series(ctx, chart))
}

fn draw_series(ctx: &mut Axes<'_, '_>, chart: &Chart) -> anyhow::Result<()> {
    for (i, ((_, name), points)) in chart.series.iter().enumerate() {
        // Known implementations keep their colour from chart to chart; others take the spares.
        let color = color_of(name, i);
        let ours = name.starts_with("fa");
        let style = color.stroke_width(if ours { 3 } else { 2 });
        let pts: Vec<(f64, f64)> = points.iter().map(|(&n, &t)| ((n as f64).log2(), t)).collect();
        let anno = if ours {
            ctx.draw_series(LineSeries::new(pts.clone(), style))?
        } else {
            ctx.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?
        };
        anno.label(name.clone()).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
        });
        ctx.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    Ok(())
}

/// One decode chart: TB/s by (implementation, heads_q, heads_kv) and cache length.
type DecodeChart = BTreeMap<((usize, String), Reverse<usize>, usize), BTreeMap<usize, f64>>;

/// File name of the decode chart of one group, e.g. `decode-fp16-d128-b16.svg`.
pub fn decode_chart_name(dtype: &str, d: usize, batch: usize) -> String {
    format!("decode-{dtype}-d{d}-b{batch}.svg")
}

/// Draw one TB/s chart per (dtype, d, batch) of the measured decoding `rows` of one new token
/// against a contiguous cache (the sweep over L; rows with more new tokens or a paged cache are
/// at a few shapes only, and are compared in the side-by-side table) into `dir`, with the
/// datasheet's HBM bandwidth and, if given, a measured read bandwidth (TB/s). Returns the files
/// written.
pub fn draw_decode(
    dir: &Path,
    rows: &[Row],
    subtitle: &str,
    measured_tbps: Option<f64>,
) -> anyhow::Result<Vec<PathBuf>> {
    let mut charts: BTreeMap<(String, usize, usize), DecodeChart> = BTreeMap::new();
    for row in rows {
        let c = &row.case;
        let Some(tbps) = row.tbps().filter(|t| t.is_finite() && c.is_decode()) else { continue };
        // One new token, a contiguous cache in [b, h, s, d]: the other layouts are the table's.
        if c.n_q != 1 || c.page_size.is_some() || c.layout.is_some() {
            continue;
        }
        let key = (c.dtype.clone(), c.d, c.batch);
        let series = (impl_rank(&c.imp), Reverse(c.heads_kv), c.heads_q);
        charts.entry(key).or_default().entry(series).or_default().insert(c.n_kv, tbps);
    }
    let mut written = Vec::new();
    for ((dtype, d, batch), chart) in &charts {
        let path = dir.join(decode_chart_name(dtype, *d, *batch));
        let title =
            format!("Decode {dtype}, d = {d}, batch {batch}, one new token: TB/s of K and V");
        draw_decode_chart(&path, &title, subtitle, chart, measured_tbps)
            .with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn draw_decode_chart(
    path: &Path,
    title: &str,
    subtitle: &str,
    chart: &DecodeChart,
    measured_tbps: Option<f64>,
) -> anyhow::Result<()> {
    let all = || chart.values().flat_map(|s| s.iter());
    let top = all().map(|(_, &t)| t).chain(measured_tbps).fold(HBM_DATASHEET_TBPS, f64::max) * 1.15;
    let frame = Frame {
        title,
        subtitle,
        x_desc: "KV cache length L (log2 scale)",
        y_desc: "TB/s",
        y_decimals: 1,
        legend: SeriesLabelPosition::LowerRight,
    };
    frame.draw(path, all().map(|(&n, _)| n), top, |ctx, (lo, hi)| {
        draw_decode_series(ctx, chart, measured_tbps, (lo, hi), top)
    })
}

fn draw_decode_series(
    ctx: &mut Axes<'_, '_>,
    chart: &DecodeChart,
    measured_tbps: Option<f64>,
    (lo, hi): (f64, f64),
    top: f64,
) -> anyhow::Result<()> {
    let references = [
        Some((HBM_DATASHEET_TBPS, "HBM datasheet", BLACK)),
        measured_tbps.map(|t| (t, "HBM read, measured", RGBColor(100, 100, 100))),
    ];
    for (tbps, name, color) in references.into_iter().flatten() {
        let line = vec![(lo, tbps), (hi, tbps)];
        ctx.draw_series(DashedLineSeries::new(line, 4, 4, color.stroke_width(1)))?
            .label(format!("{name} ({tbps:.2} TB/s)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color));
        ctx.draw_series(std::iter::once(Text::new(
            name.to_string(),
            (hi - 0.3 - 0.12 * name.len() as f64, tbps + top * 0.012),
            ("sans-serif", 13).into_font(),
        )))?;
    }
    for (i, (((_, name), Reverse(heads_kv), heads_q), points)) in chart.iter().enumerate() {
        let color = color_of(name, i);
        let ours = !is_peer(name);
        let style = color.stroke_width(if ours { 3 } else { 2 });
        let pts: Vec<(f64, f64)> = points.iter().map(|(&n, &t)| ((n as f64).log2(), t)).collect();
        // Grouped-query attention dashed, one kv head per query head solid.
        let grouped = heads_q != heads_kv;
        let anno = if grouped {
            ctx.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?
        } else {
            ctx.draw_series(LineSeries::new(pts.clone(), style))?
        };
        anno.label(format!("{name} {heads_q}/{heads_kv}")).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
        });
        if grouped {
            ctx.draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 5, color.filled())))?;
        } else {
            ctx.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
    }
    Ok(())
}

/// The measured HBM read bandwidth recorded in `meta.json` (a number or a numeric string).
fn measured_hbm(meta: &serde_json::Map<String, serde_json::Value>) -> Option<f64> {
    let v = meta.get(HBM_READ_KEY)?;
    v.as_f64()
        .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
        .filter(|t: &f64| t.is_finite() && *t > 0.0)
}

/// Redraw the charts from `dir/bench.csv` and `dir/peers.csv` and print them side by side.
pub fn charts_only(dir: &Path) -> anyhow::Result<()> {
    let (ours, peers) = (dir.join("bench.csv"), dir.join("peers.csv"));
    if !ours.exists() && !peers.exists() {
        bail!(
            "neither {} nor {} exists: run `ladder bench` first",
            ours.display(),
            peers.display()
        );
    }
    let mut rows = Vec::new();
    for path in [&ours, &peers] {
        if path.exists() {
            rows.extend(results::read_csv(path)?);
        }
    }
    let meta = results::read_meta(dir);
    let card = results::meta_str(&meta, "card");
    let subtitle = format!(
        "{}, driver {}, CUDA {}, {}{}",
        if card.is_empty() { "unknown GPU" } else { card },
        results::meta_str(&meta, "driver"),
        results::meta_str(&meta, "cuda"),
        results::meta_str(&meta, "date"),
        match results::meta_str(&meta, "torch") {
            "" => String::new(),
            torch => format!("; peers: torch {torch}"),
        }
    );
    let mut files = draw_all(dir, &rows, &subtitle)?;
    files.extend(draw_decode(dir, &rows, &subtitle, measured_hbm(&meta))?);
    println!("{}", render_side_by_side(&rows));
    eprintln!(
        "charts: {} SVG file(s) in {} ({} rows from {}{})",
        files.len(),
        dir.display(),
        rows.len(),
        if ours.exists() { "bench.csv" } else { "" },
        if peers.exists() { " + peers.csv" } else { "" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ladder_compare::results::parse_csv;

    #[test]
    fn ticks_are_powers_of_two() {
        assert_eq!(n_label(9.0), "512");
        assert_eq!(n_label(10.0), "1k");
        assert_eq!(n_label(14.0), "16k");
        assert_eq!(n_label(9.5), "");
    }

    #[test]
    fn one_svg_per_group_with_every_series_named() {
        let csv = "impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,ms,tflops,tbps\n\
            fa2,fwd,fp16,false,32,16,16,512,512,128,0.2,300.0,\n\
            fa2,fwd,fp16,false,1,16,16,16384,16384,128,6.0,360.0,\n\
            sdpa-flash,fwd,fp16,false,32,16,16,512,512,128,0.3,250.0,\n\
            sdpa-flash,fwd,fp16,false,1,16,16,16384,16384,128,7.0,340.0,\n\
            fa2,bwd,fp16,true,32,16,16,512,512,128,0.9,120.0,\n";
        let rows = parse_csv(csv).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = draw_all(dir.path(), &rows, "NVIDIA H200, driver 580.95, 2026-11-29").unwrap();
        let names: Vec<String> =
            files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["fwd-fp16-d128-noncausal.svg", "bwd-fp16-d128-causal.svg"]);
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..60]);
        for text in ["fa2", "sdpa-flash", "NVIDIA H200", "Forward fp16, d = 128", "16k", "512"] {
            assert!(svg.contains(text), "{text} missing from the SVG");
        }
        let svg = std::fs::read_to_string(&files[1]).unwrap();
        assert!(svg.contains("Backward") && !svg.contains("sdpa-flash"));
    }

    #[test]
    fn decode_charts_per_batch_with_the_hbm_lines() {
        // Rows of four new tokens or of a paged cache (here the only ones at batch 4) are left
        // out of the charts.
        let csv = "impl,direction,dtype,causal,batch,heads_q,heads_kv,n_q,n_kv,d,ms,tflops,tbps,\
                   page_size\n\
            flash-decoding,decode,fp16,false,1,32,32,1,1024,128,0.01,0.1,1.6,\n\
            flash-decoding,decode,fp16,false,1,32,32,1,131072,128,0.05,0.3,4.2,\n\
            flash-decoding,decode,fp16,false,1,32,8,1,131072,128,0.02,0.3,3.9,\n\
            sdpa-flash,decode,fp16,false,1,32,32,1,131072,128,0.06,0.2,3.5,\n\
            flash-decoding,decode,fp16,false,16,32,8,1,32768,128,0.1,0.3,4.1,\n\
            flash-decoding,decode,fp16,true,4,32,8,4,8192,128,0.1,0.3,4.0,\n\
            flash-decoding,decode,fp16,false,4,32,8,1,8192,128,0.1,0.3,4.0,16\n\
            fa2,fwd,fp16,false,1,16,16,16384,16384,128,6.0,360.0,,\n";
        let rows = parse_csv(csv).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = draw_decode(dir.path(), &rows, "NVIDIA H200", Some(4.3)).unwrap();
        let names: Vec<String> =
            files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["decode-fp16-d128-b1.svg", "decode-fp16-d128-b16.svg"]);
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        for text in [
            "flash-decoding 32/32",
            "flash-decoding 32/8",
            "sdpa-flash 32/32",
            "HBM datasheet",
            "4.80 TB/s",
            "HBM read, measured",
            "128k",
            "1k",
            "batch 1",
        ] {
            assert!(svg.contains(text), "{text} missing from the decode SVG");
        }
        // The prefill charts leave the decoding rows out.
        let prefill = draw_all(dir.path(), &rows, "x").unwrap();
        assert_eq!(prefill.len(), 1);
        let meta = serde_json::json!({ "hbm_read_tbps": 4.25, "card": "x" });
        assert_eq!(measured_hbm(meta.as_object().unwrap()), Some(4.25));
        assert_eq!(measured_hbm(&serde_json::Map::new()), None);
    }
}
