//! `ladder bench`: time the GPU rungs with CUDA events at the FlashAttention-3 paper's shapes and
//! write `bench.csv`, `bench.json`, `meta.json` and TFLOP/s charts.
//!
//! The shapes: hidden size 2048 (heads = 2048 / d) and 16k tokens per batch (batch = 16384 / n),
//! d = 64 and 128, n = 512 … 16k, causal and not, forward and backward. Each case gets one untimed
//! call (which compiles the kernel), warm-up calls, then `repeats` samples timed with CUDA events;
//! a sample is one call, or several back to back when a call is shorter than a millisecond (so the
//! host's launch overhead is not timed), and the table reports the median per call. When a case's
//! inputs fit in L2, the calls rotate among several input sets so the cache is not what is
//! measured.
//!
//! With `--direction decode`, FlashDecoding is timed against KV caches of 1k … 128k entries (the
//! five reference decode shapes and a batch × length × GQA sweep, d = 128): one new token
//! everywhere, and on the reference shapes also four (speculative decoding) and paged caches of
//! 16 and 64 tokens per page (`--new-tokens`, `--page-size` choose). The cache is allocated once
//! per shape and layout, every sequence full, and the row's TB/s is the bytes of K and V over the
//! time; `--splits N` fixes the kernel's split count (the count used is in `bench.json`).
//!
//! `scripts/peers.py` times PyTorch SDPA and Triton on the same shapes into `peers.csv` (same
//! schema); `ladder bench --charts-only` redraws the charts with both and prints them side by side.
//!
//! With `--varlen`, the prefill rungs run on a packed batch of 64 ragged sequences instead
//! (`varlen.csv`; `scripts/peers_varlen.py` times the peers on the same batch).
//!
//! The parts: `plan` (the flags and what they select), `timing` (inputs and the measurement of
//! one case), `report` (the printed tables and the run's metadata), `charts` (the SVG charts),
//! `varlen` (the packed batch);
//! the files' schema is [`ladder_compare::results`] and the GPU rungs [`ladder_compare::GpuRung`].
//! This module runs the cases in order and writes the files.

mod charts;
mod plan;
mod report;
mod timing;
mod varlen;

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use ladder_compare::modifiers::ModifierSpec;
use ladder_compare::results::{self, Case, Direction, Outcome, Row};
use ladder_compare::{GpuRung, gpu_check};
use ladder_kernels::decode::{self, DecodeOptions};
use ladder_kernels::{Gpu, KernelError, Options, fa3};
use serde_json::{Map, Value, json};

pub use plan::BenchArgs;
use plan::{CacheLayout, DecodeShape, LayoutArg, Plan};
use timing::{DecodeSet, InputSet, Timing};

/// Run `ladder bench`; exit status 2 without a GPU or on a bad flag or file, 1 if a case failed.
pub fn main(args: &BenchArgs) -> ExitCode {
    if args.charts_only {
        return match charts::charts_only(&args.out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        };
    }
    let plan = match Plan::from_args(args) {
        Ok(plan) => plan,
        Err(e) => return fail(e),
    };
    let gpu = match gpu_check::open_gpu() {
        Ok(gpu) => gpu,
        Err(e) => {
            // `no CUDA device found: ...` (or the unsupported card), on one line.
            eprintln!("{e:#}");
            return ExitCode::from(2);
        }
    };
    let done = if args.varlen {
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))
            .and_then(|()| varlen::run(&gpu, &plan, &args.out))
    } else {
        run(&gpu, &plan, &args.out)
    };
    match done {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => fail(e),
    }
}

/// The CSV name of `rung` on `gpu`: its own name, or for FA3 under a non-default schedule
/// (`LADDER_FA3_SCHEDULE`, the ablation), tiles (`LADDER_FA3_TILES`, tuning) or causal tile order
/// (`LADDER_FA3_L2_SECTION_MB`) `fa3-` (or `fa3-fp8-`) and what differs, e.g. `fa3-no-pingpong`,
/// `fa3-bc192c2s2` or `fa3-l2s12mb`.
fn impl_name(gpu: &Gpu, rung: GpuRung) -> String {
    let mut name = rung.name().to_string();
    if matches!(rung, GpuRung::Fa3 | GpuRung::Fa3Fp8) {
        if let Some(schedule) = gpu.config().tuned::<fa3::Schedule>() {
            name = format!("{name}-{}", schedule.label().replace(',', "+"));
        }
        if let Some(t) = gpu.config().tuned::<fa3::Fa3Tiles>() {
            name = format!("{name}-bc{}c{}s{}", t.bc, t.consumers, t.stages);
        }
        if let Some(fa3::L2Section(bytes)) = gpu.config().tuned() {
            name = format!("{name}-l2s{}mb", bytes >> 20);
        }
    }
    name
}

fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("error: {e:#}");
    ExitCode::from(2)
}

fn run(gpu: &Gpu, plan: &Plan, out: &Path) -> anyhow::Result<bool> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let cuda = gpu.cuda_version().unwrap_or_default();
    let driver = report::kernel_driver_version().unwrap_or_else(|| format!("CUDA {cuda}"));
    let date = results::utc_now_iso();
    let notes = plan.notes();
    report::merge_meta(out, gpu, &driver, &cuda, &date, &notes)?;
    eprintln!(
        "ladder bench: {} ({}, {} SMs), driver {driver}, CUDA {cuda}, {}",
        gpu.name(),
        gpu.arch(),
        gpu.sm_count(),
        plan.dtype
    );
    if plan.ds.iter().any(|&d| plan.ns.iter().any(|&n| !plan.rungs_at(d, n).is_empty())) {
        eprintln!(
            "shapes: hidden {} (heads = hidden / d), {} tokens (batch = tokens / n), d {:?}, n {:?}",
            plan.hidden, plan.tokens, plan.ds, plan.ns
        );
    }
    if !plan.decode_rungs().is_empty() {
        eprintln!(
            "decode shapes: d {:?}, {} (batch, heads q/kv, L) shapes",
            plan.decode_ds,
            plan.decode.len()
        );
    }
    for note in &notes {
        eprintln!("note: {note}");
    }

    let total = plan.case_count();
    let mut rows: Vec<Row> = Vec::new();
    let mut extras: Vec<Map<String, Value>> = Vec::new();
    let mut pool = timing::HostPool::default();
    let mut done = 0;
    let started = Instant::now();
    for (&layout, &d, &n) in plan
        .input_layouts
        .iter()
        .flat_map(|l| plan.ds.iter().flat_map(move |d| plan.ns.iter().map(move |n| (l, d, n))))
    {
        let rungs = plan.rungs_in(layout, d, n);
        if rungs.is_empty() {
            continue;
        }
        let (batch, heads) = plan.dims(d, n);
        let case_of = |rung: GpuRung, causal: bool| {
            let dtype = plan.dtype.name();
            let imp = impl_name(gpu, rung);
            Case::square(&imp, rung.direction(), dtype, causal, batch, heads, n, d)
                .in_layout(layout.label())
        };
        let with_d_o = rungs.iter().any(|r| r.direction() == Direction::Bwd);
        let prepared = Instant::now();
        let sets = timing::upload_sets(gpu, &mut pool, plan, (d, n), layout, with_d_o);
        if let Ok(sets) = &sets {
            let order = match layout {
                LayoutArg::Bhsd => String::new(),
                LayoutArg::Bshd => format!(" (in memory [{batch}, {n}, {heads}, {d}])"),
            };
            eprintln!(
                "inputs d={d} n={n}: {} set(s) of {} tensors [{batch}, {heads}, {n}, {d}]\
                 {order} ready in {:.1} s",
                sets.len(),
                if with_d_o { 4 } else { 3 },
                prepared.elapsed().as_secs_f64()
            );
        }
        for (&causal, (window, score_mod)) in
            plan.causals.iter().flat_map(|c| plan.masks().into_iter().map(move |m| (c, m)))
        {
            for rung in plan.rungs_with(layout, d, n, (window, score_mod)) {
                done += 1;
                let case = case_of(rung, causal)
                    .windowed(window)
                    .modified(score_mod.map(|m| m.to_string()));
                let (row, extra) = run_case(gpu, plan, rung, case, &sets);
                print_progress(done, total, plan.repeats_of(rung), &row, &extra);
                rows.push(row);
                extras.push(extra);
                // Rewrite the CSV after every case: a run cut short keeps what it measured.
                write_file(&out.join("bench.csv"), &results::to_csv(&rows))?;
            }
        }
        drop(sets);
        gpu.synchronize().ok();
    }
    let decode_rungs = plan.decode_rungs();
    let decode_axes = plan.input_layouts.iter().filter(|_| !decode_rungs.is_empty());
    for (&axes, &d) in decode_axes.flat_map(|a| plan.decode_ds.iter().map(move |d| (a, d))) {
        for &shape in &plan.decode {
            let DecodeShape { batch, heads_q, heads_kv, len } = shape;
            let lengths = vec![len; batch];
            let new_tokens = plan.decode_new_tokens(shape);
            for layout in plan.decode_layouts(shape) {
                let prepared = Instant::now();
                let sets = timing::upload_decode_sets(
                    gpu,
                    &mut pool,
                    plan,
                    d,
                    shape,
                    layout,
                    axes,
                    &new_tokens,
                );
                if let Ok(sets) = &sets {
                    let how = match layout {
                        CacheLayout::Contiguous => "contiguous".to_string(),
                        CacheLayout::Paged(p) => format!("pages of {p}"),
                    };
                    let order = axes.label().map_or(String::new(), |l| format!(", {l}"));
                    eprintln!(
                        "inputs decode d={d} b={batch} h={heads_q}/{heads_kv} L={len} ({how}{order}): \
                         {} set(s) of a {:.2} GB KV cache, ready in {:.1} s",
                        sets.len(),
                        shape.kv_bytes(d, plan.dtype) as f64 / 1e9,
                        prepared.elapsed().as_secs_f64()
                    );
                }
                for &n_new in &new_tokens {
                    for &rung in &decode_rungs {
                        done += 1;
                        let dtype = plan.dtype.name();
                        let case = Case::decode(
                            rung.name(),
                            dtype,
                            batch,
                            heads_q,
                            heads_kv,
                            n_new,
                            len,
                            d,
                        )
                        .paged(layout.page_size())
                        .in_layout(axes.label());
                        let (row, extra) = run_decode_case(gpu, plan, rung, case, &sets, &lengths);
                        print_progress(done, total, plan.repeats_of(rung), &row, &extra);
                        rows.push(row);
                        extras.push(extra);
                        write_file(&out.join("bench.csv"), &results::to_csv(&rows))?;
                    }
                }
                drop(sets);
                gpu.synchronize().ok();
            }
        }
    }
    pool.release_caches();

    let meta = json!({
        "card": gpu.name(),
        "arch": gpu.arch(),
        "sm_count": gpu.sm_count(),
        "driver": driver,
        "cuda": cuda,
        "date": date,
        "ladder": env!("CARGO_PKG_VERSION"),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "repeats": plan.repeats,
        "warmup": plan.warmup,
        "tokens": plan.tokens,
        "hidden": plan.hidden,
        "decode_splits": plan.splits,
        "notes": notes,
        "elapsed_s": started.elapsed().as_secs_f64(),
    });
    let json_rows: Vec<Value> =
        rows.iter().zip(&extras).map(|(r, x)| results::row_json(r, x)).collect();
    let doc = json!({ "meta": meta, "rows": json_rows });
    write_file(&out.join("bench.json"), &(serde_json::to_string_pretty(&doc)? + "\n"))?;

    println!("\n{}", report::render_rows(&rows));
    let failed = rows.iter().filter(|r| matches!(r.outcome, Outcome::Failed(_))).count();
    let skipped = rows.iter().filter(|r| matches!(r.outcome, Outcome::Skipped(_))).count();
    println!(
        "{} cases in {:.0} s: {} measured, {skipped} skipped, {failed} failed",
        rows.len(),
        started.elapsed().as_secs_f64(),
        rows.len() - skipped - failed
    );
    charts::charts_only(out)?;
    Ok(failed == 0)
}

/// The progress line of one case: its time and throughput (TB/s and splits for a decoding case),
/// or why it has none.
fn print_progress(done: usize, total: usize, wanted: usize, row: &Row, extra: &Map<String, Value>) {
    let progress = format!("[{done:>3}/{total}] {:<4} {}", row.case.imp, row.case.label());
    match &row.outcome {
        Outcome::Measured { ms, tflops, tbps } => {
            let samples = extra.get("samples").and_then(Value::as_u64).unwrap_or(0);
            let wanted = wanted as u64;
            let mut note = String::new();
            if samples < wanted {
                note += &format!("  ({samples} of {wanted} samples: time budget)");
            }
            let first = extra.get("first_call_s").and_then(Value::as_f64);
            if let Some(first) = first.filter(|s| *s > 1.0) {
                note += &format!("  (first call {first:.1} s, kernel compile included)");
            }
            match (tbps, extra.get("splits").and_then(Value::as_u64)) {
                (Some(tbps), splits) => {
                    let splits = splits.map_or(String::new(), |s| format!("  splits {s:>3}"));
                    let kernel = extra
                        .get("strategy")
                        .and_then(Value::as_str)
                        .map_or(String::new(), |k| format!("  {k}"));
                    eprintln!("{progress}  {ms:>9.4} ms  {tbps:>6.2} TB/s{splits}{kernel}{note}");
                }
                (None, _) => eprintln!("{progress}  {ms:>9.4} ms  {tflops:>7.1} TFLOP/s{note}"),
            }
        }
        Outcome::Skipped(why) => eprintln!("{progress}  skipped: {why}"),
        Outcome::Failed(why) => eprintln!("{progress}  FAILED: {why}"),
    }
}

/// Time one case; an unsupported shape is skipped, any other error fails the case (never a panic).
fn run_case(
    gpu: &Gpu,
    plan: &Plan,
    rung: GpuRung,
    case: Case,
    sets: &ladder_kernels::Result<Vec<InputSet>>,
) -> (Row, Map<String, Value>) {
    let sets = match sets {
        Ok(sets) => sets,
        Err(err) => {
            let why = format!("uploading the inputs: {err}");
            return (Row { case, outcome: Outcome::Failed(why) }, Map::new());
        }
    };
    let (warmup, repeats) = (plan.warmup_of(rung), plan.repeats_of(rung));
    let mut opts = Options { causal: case.causal, ..Options::default() }
        .with_window(ladder_compare::gpu_check::kernel_window(case.window));
    if let Some(name) = &case.score_mod {
        match name.parse::<ModifierSpec>() {
            Ok(spec) => opts = spec.apply_gpu(opts, case.heads_q),
            Err(why) => return (Row { case, outcome: Outcome::Failed(why) }, Map::new()),
        }
    }
    let timed = timing::step(rung, gpu, sets, opts).and_then(|mut step| {
        timing::measure(gpu, &mut step, sets.len(), warmup, repeats, plan.budget_ms)
    });
    outcome(case, timed, sets.len())
}

/// Time one decoding case on `sets` (every sequence `lengths[b]` long); the kernel and split count
/// used go into the row's extras (`strategy`; `splits`, and `splits_from`: `--splits` or
/// `heuristic`), and for FlashDecoding++ `phi` and the rows that fell back (`fallback_rows`, from
/// one more untimed call).
fn run_decode_case(
    gpu: &Gpu,
    plan: &Plan,
    rung: GpuRung,
    case: Case,
    sets: &ladder_kernels::Result<Vec<DecodeSet>>,
    lengths: &[usize],
) -> (Row, Map<String, Value>) {
    let sets = match sets {
        Ok(sets) => sets,
        Err(err) => {
            let why = format!("uploading the KV cache: {err}");
            return (Row { case, outcome: Outcome::Failed(why) }, Map::new());
        }
    };
    let (warmup, repeats) = (plan.warmup_of(rung), plan.repeats_of(rung));
    let opts = DecodeOptions {
        splits: plan.splits,
        strategy: plan.pp_strategy,
        phi: plan.phi,
        atomic_sums: plan.pp_atomic_sums,
        ..DecodeOptions::default()
    };
    // What `decode::forward` picks: the same plan on the same shape.
    let work = decode::Workload {
        rows_per_kv_head: case.heads_q / case.heads_kv.max(1) * case.n_q,
        max_len: lengths.iter().copied().max().unwrap_or(0),
        batch_heads_kv: case.batch * case.heads_kv,
        head_dim: case.d,
        paged: case.page_size.is_some(),
    };
    let strategy = rung.decode_options(&opts).strategy;
    let resolved = decode::plan(strategy, plan.splits, &work, gpu.sm_count() as usize);
    let n_new = case.n_q;
    let timed =
        timing::decode_step(rung, gpu, sets, n_new, lengths, opts.clone()).and_then(|mut step| {
            timing::measure(gpu, &mut step, sets.len(), warmup, repeats, plan.budget_ms)
        });
    let measured = timed.is_ok();
    let (row, mut extra) = outcome(case, timed, sets.len());
    if let Ok(p) = resolved {
        extra.insert("strategy".into(), json!(p.strategy.name()));
        extra.insert("splits".into(), json!(p.splits));
    }
    let from = if plan.splits.is_some() { "--splits" } else { "heuristic" };
    extra.insert("splits_from".into(), json!(from));
    if strategy.is_pp() && measured {
        extra.insert("phi".into(), json!(plan.phi));
        let atomic = resolved.as_ref().is_ok_and(|p| p.sums_atomically(plan.pp_atomic_sums));
        extra.insert("atomic_sums".into(), json!(atomic));
        if let Ok(stats) = timing::decode_stats(rung, gpu, sets, n_new, lengths, opts) {
            extra.insert("fallback_rows".into(), json!(stats.fallback_rows));
        }
    }
    (row, extra)
}

/// The row of a timed case, and its extras for `bench.json`.
fn outcome(
    case: Case,
    timed: ladder_kernels::Result<Timing>,
    input_sets: usize,
) -> (Row, Map<String, Value>) {
    match timed {
        Ok(t) => {
            let mut extra = Map::new();
            extra.insert("samples".into(), json!(t.samples));
            extra.insert("calls_per_sample".into(), json!(t.calls_per_sample));
            extra.insert("input_sets".into(), json!(input_sets));
            extra.insert("first_call_s".into(), json!(t.first_call_s));
            (Row::measured(case, t.ms), extra)
        }
        Err(
            err @ (KernelError::UnsupportedHeadDim { .. } | KernelError::UnsupportedDtype { .. }),
        ) => (Row { case, outcome: Outcome::Skipped(err.to_string()) }, Map::new()),
        Err(err) => (Row { case, outcome: Outcome::Failed(err.to_string()) }, Map::new()),
    }
}

fn write_file(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
