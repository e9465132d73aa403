//! TFLOP/s against sequence length, one SVG per (direction, dtype, head dim, mask), one line per
//! implementation: the ladder's rungs solid, the peers (PyTorch SDPA, Triton) dashed.
//!
//! SVG text is written as `<text>` elements with plotters' built-in size estimate, so drawing
//! needs no font files and no fontconfig.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;

use anyhow::bail;
use ladder_compare::results::{self, Row};

use super::report::{impl_rank, render_side_by_side};

/// Line colours, one per implementation in legend order.
const COLORS: [RGBColor; 8] = [
    RGBColor(148, 103, 189), // fa1: purple
    RGBColor(214, 39, 40),   // fa2: red
    RGBColor(31, 119, 180),  // sdpa-flash: blue
    RGBColor(44, 160, 44),   // sdpa-cudnn: green
    RGBColor(255, 127, 14),  // sdpa-efficient: orange
    RGBColor(23, 190, 207),  // triton: cyan
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

/// One chart: the rows of one (direction, dtype, d, causal), by implementation.
#[derive(Debug, Default)]
struct Chart {
    series: BTreeMap<(usize, String), BTreeMap<usize, f64>>,
}

/// File name of the chart of one group, e.g. `fwd-fp16-d128-causal.svg`.
pub fn chart_name(direction: &str, dtype: &str, d: usize, causal: bool) -> String {
    format!("{direction}-{dtype}-d{d}-{}.svg", if causal { "causal" } else { "noncausal" })
}

/// Draw one chart per (direction, dtype, d, causal) of the measured `rows` into `dir`, titled with
/// `subtitle` (card, driver, date). Returns the files written.
pub fn draw_all(dir: &Path, rows: &[Row], subtitle: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut charts: BTreeMap<(u8, String, usize, bool), Chart> = BTreeMap::new();
    for row in rows {
        let Some((_, tflops)) = row.timing() else { continue };
        let c = &row.case;
        if c.n_q != c.n_kv || !tflops.is_finite() {
            continue; // the sweep is square; other shapes have no place on an n axis
        }
        let key = (u8::from(c.direction != "fwd"), c.dtype.clone(), c.d, c.causal);
        let chart = charts.entry(key).or_default();
        chart.series.entry(impl_rank(&c.imp)).or_default().insert(c.n_q, tflops);
    }
    let mut written = Vec::new();
    for ((dir_rank, dtype, d, causal), chart) in &charts {
        let direction = if *dir_rank == 0 { "fwd" } else { "bwd" };
        let path = dir.join(chart_name(direction, dtype, *d, *causal));
        let title = format!(
            "{} {dtype}, d = {d}, {}: TFLOP/s",
            if *dir_rank == 0 { "Forward" } else { "Backward" },
            if *causal { "causal" } else { "non-causal" }
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

fn draw(path: &Path, title: &str, subtitle: &str, chart: &Chart) -> anyhow::Result<()> {
    let all = || chart.series.values().flat_map(|s| s.iter());
    let (lo, hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (&n, _)| {
        let x = (n as f64).log2();
        (lo.min(x), hi.max(x))
    });
    let (lo, hi) = (lo.floor() - 0.3, hi.ceil() + 0.3);
    let top = all().map(|(_, &t)| t).fold(1.0, f64::max) * 1.15;

    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let (head, body) = root.split_vertically(56);
    head.draw(&Text::new(title.to_string(), (16, 8), ("sans-serif", 22).into_font()))?;
    head.draw(&Text::new(subtitle.to_string(), (16, 34), ("sans-serif", 15).into_font()))?;
    let mut ctx = ChartBuilder::on(&body)
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(lo..hi, 0f64..top)?;
    let ticks = (hi - lo).round() as usize + 1;
    ctx.configure_mesh()
        .x_labels(ticks)
        .x_label_formatter(&|x| n_label(*x))
        .x_desc("sequence length n (log2 scale; batch = tokens / n)")
        .y_desc("TFLOP/s")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, ((rank, name), points)) in chart.series.iter().enumerate() {
        // Known implementations keep their colour from chart to chart; others take the spares.
        let color = COLORS[if *rank < 6 { *rank } else { 6 + i % 2 }];
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
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
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
    let files = draw_all(dir, &rows, &subtitle)?;
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
}
