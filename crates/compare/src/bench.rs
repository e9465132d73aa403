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
//! `scripts/peers.py` times PyTorch SDPA and Triton on the same shapes into `peers.csv` (same
//! schema); `ladder bench --charts-only` redraws the charts with both and prints them side by side.

mod charts;
mod report;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use ladder_kernels::{DType, Gpu, Gradients, KernelError, Options, Output, Tensor, fa1, fa2};
use serde_json::{Map, Value, json};

pub use report::Direction;
use report::{Case, Outcome, Row};

/// L2 cache of an H100/H200 (50 MB): inputs smaller than this are rotated.
const L2_BYTES: usize = 50 << 20;
/// A timed sample spans at least this long (several calls if needed).
const SAMPLE_MS: f64 = 1.0;

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

/// `ladder bench` flags.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// GPU rungs to time, comma-separated (fa1, fa2) [default: all].
    #[arg(long, value_delimiter = ',')]
    rung: Vec<String>,
    /// Directions, comma-separated [default: fwd,bwd].
    #[arg(long, value_enum, value_delimiter = ',')]
    direction: Vec<Direction>,
    /// Head dims, comma-separated [default: 64,128].
    #[arg(long, value_delimiter = ',')]
    d: Vec<usize>,
    /// Sequence lengths, comma-separated [default: 512,1024,2048,4096,8192,16384].
    #[arg(long, value_delimiter = ',')]
    n: Vec<usize>,
    /// Masks: both, true (causal only) or false.
    #[arg(long, value_enum, default_value_t = CausalArg::Both)]
    causal: CausalArg,
    /// Element type of Q, K, V.
    #[arg(long, value_enum, default_value_t = DtypeArg::Fp16)]
    dtype: DtypeArg,
    /// Timed samples per case (median reported) [default: 30; 5 with --quick].
    #[arg(long)]
    repeats: Option<usize>,
    /// Untimed warm-up calls per case, after the first (compiling) call [default: 5; 2 with --quick].
    #[arg(long)]
    warmup: Option<usize>,
    /// Results folder: bench.csv, bench.json, meta.json, charts (*.svg).
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// A small subset for smoke runs: d = 128, n = 1024 and 4096, non-causal, 5 repeats (flags
    /// given explicitly still apply).
    #[arg(long)]
    quick: bool,
    /// Only redraw the charts from OUT/bench.csv and OUT/peers.csv (if any) and print the
    /// side-by-side table; needs no GPU.
    #[arg(long)]
    charts_only: bool,
    /// Tokens per batch: batch = tokens / n (at least 1).
    #[arg(long, default_value_t = 16384)]
    tokens: usize,
    /// Hidden size: heads = hidden / d.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// FA1 (scalar FP32, one block per (batch, head)) runs only up to this n.
    #[arg(long, default_value_t = 2048)]
    fa1_max_n: usize,
    /// Timed samples per FA1 case.
    #[arg(long, default_value_t = 3)]
    fa1_repeats: usize,
    /// Stop sampling a case once its timed samples add up to this many seconds.
    #[arg(long, default_value_t = 3.0)]
    case_budget_s: f64,
}

/// Run `ladder bench`; exit status 2 without a GPU or on a bad flag or file, 1 if a case failed.
pub fn main(args: &BenchArgs) -> ExitCode {
    if args.charts_only {
        return match charts_only(&args.out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        };
    }
    let plan = match Plan::from_args(args) {
        Ok(plan) => plan,
        Err(e) => return fail(e),
    };
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            // `no CUDA device found: ...` (or the unsupported card), on one line.
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&gpu, &plan, &args.out) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => fail(e),
    }
}

fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("error: {e:#}");
    ExitCode::from(2)
}

type ForwardFn = fn(&Gpu, &Tensor, &Tensor, &Tensor, &Options) -> ladder_kernels::Result<Output>;
#[allow(clippy::type_complexity)]
type BackwardFn = fn(
    &Gpu,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Options,
) -> ladder_kernels::Result<Gradients>;

/// What one entry times: a forward call, or a backward call given the same rung's forward output.
#[derive(Clone, Copy)]
enum Pass {
    Forward(ForwardFn),
    Backward(ForwardFn, BackwardFn),
}

/// One timed GPU rung and direction.
#[derive(Clone, Copy)]
struct Entry {
    rung: &'static str,
    pass: Pass,
}

impl Entry {
    fn direction(&self) -> Direction {
        match self.pass {
            Pass::Forward(_) => Direction::Fwd,
            Pass::Backward(..) => Direction::Bwd,
        }
    }
}

/// Every GPU rung the bench can time, in table order. One line per (rung, direction).
fn entries() -> Vec<Entry> {
    vec![
        Entry { rung: "fa1", pass: Pass::Forward(fa1::forward) },
        Entry { rung: "fa2", pass: Pass::Forward(fa2::forward) },
        Entry { rung: "fa2", pass: Pass::Backward(fa2::forward, fa2::backward) },
    ]
}

/// One set of inputs: Q, K, V, and dO when a backward pass is timed.
struct InputSet {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Option<Tensor>,
}

/// One call of a case on input set `i`; returns what it allocated so that it is freed after the
/// sample, outside the timed region.
type Step<'a> = Box<dyn FnMut(usize) -> ladder_kernels::Result<Vec<Tensor>> + 'a>;

impl Pass {
    /// Prepare a case (for a backward pass: the forward outputs it needs, untimed).
    fn setup<'a>(
        self,
        gpu: &'a Gpu,
        sets: &'a [InputSet],
        opts: Options,
    ) -> ladder_kernels::Result<Step<'a>> {
        match self {
            Pass::Forward(forward) => Ok(Box::new(move |i| {
                let s = &sets[i];
                let out = forward(gpu, &s.q, &s.k, &s.v, &opts)?;
                Ok(vec![out.o, out.lse])
            })),
            Pass::Backward(forward, backward) => {
                let outs: Vec<Output> = sets
                    .iter()
                    .map(|s| forward(gpu, &s.q, &s.k, &s.v, &opts))
                    .collect::<ladder_kernels::Result<_>>()?;
                Ok(Box::new(move |i| {
                    let (s, out) = (&sets[i], &outs[i]);
                    let d_o = s.d_o.as_ref().ok_or_else(|| {
                        KernelError::Shape("no dO uploaded for a backward case".into())
                    })?;
                    let g = backward(gpu, &s.q, &s.k, &s.v, &out.o, &out.lse, d_o, &opts)?;
                    Ok(vec![g.dq, g.dk, g.dv])
                }))
            }
        }
    }
}

/// The resolved flags.
#[derive(Debug)]
struct Plan {
    rungs: Vec<&'static str>,
    directions: Vec<Direction>,
    ds: Vec<usize>,
    ns: Vec<usize>,
    causals: Vec<bool>,
    dtype: DType,
    repeats: usize,
    warmup: usize,
    tokens: usize,
    hidden: usize,
    fa1_max_n: usize,
    fa1_repeats: usize,
    budget_ms: f64,
}

impl Plan {
    fn from_args(a: &BenchArgs) -> anyhow::Result<Plan> {
        let known: Vec<&'static str> = {
            let mut names: Vec<&'static str> = entries().iter().map(|e| e.rung).collect();
            names.dedup();
            names
        };
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
        let directions = if a.direction.is_empty() {
            vec![Direction::Fwd, Direction::Bwd]
        } else {
            a.direction.clone()
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
        if a.case_budget_s.is_nan() || a.case_budget_s <= 0.0 {
            bail!("--case-budget-s must be positive");
        }
        Ok(Plan {
            rungs,
            directions,
            ds,
            ns,
            causals,
            dtype: match a.dtype {
                DtypeArg::Fp16 => DType::F16,
                DtypeArg::Bf16 => DType::BF16,
            },
            repeats: a.repeats.unwrap_or(if a.quick { 5 } else { 30 }).max(1),
            warmup: a.warmup.unwrap_or(if a.quick { 2 } else { 5 }).max(1),
            tokens: a.tokens,
            hidden: a.hidden,
            fa1_max_n: a.fa1_max_n,
            fa1_repeats: a.fa1_repeats.max(1),
            budget_ms: a.case_budget_s * 1e3,
        })
    }

    /// `(batch, heads)` for head dim `d` and length `n`.
    fn dims(&self, d: usize, n: usize) -> (usize, usize) {
        ((self.tokens / n).max(1), self.hidden / d)
    }

    /// The entries to run at length `n`, in order.
    fn entries_at(&self, n: usize) -> Vec<Entry> {
        let mut out = Vec::new();
        for &direction in &self.directions {
            for e in entries() {
                if e.direction() == direction
                    && self.rungs.contains(&e.rung)
                    && (e.rung != "fa1" || n <= self.fa1_max_n)
                {
                    out.push(e);
                }
            }
        }
        out
    }

    fn case_count(&self) -> usize {
        self.ds.len()
            * self.causals.len()
            * self.ns.iter().map(|&n| self.entries_at(n).len()).sum::<usize>()
    }

    /// What the run leaves out or times differently, for the console and `meta.json`.
    fn notes(&self) -> Vec<String> {
        let mut notes = vec![format!(
            "median of {} CUDA-event samples per case after {} warm-up calls (at most {:.1} s of \
             samples per case); inputs rotate when they fit in L2",
            self.repeats,
            self.warmup,
            self.budget_ms / 1e3
        )];
        if self.rungs.contains(&"fa1") && self.directions.contains(&Direction::Fwd) {
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
            .filter(|(r, d)| !entries().iter().any(|e| e.rung == *r && e.direction() == *d))
            .map(|(r, d)| format!("{r} {}", d.name()))
            .collect();
        if !missing.is_empty() {
            notes.push(format!("no GPU kernel (yet) for: {}", missing.join(", ")));
        }
        notes
    }
}

/// Deterministic pseudo-random inputs in [-1, 1), generated once per slot and length and reused
/// across cases (every default case has tokens × hidden elements per tensor).
#[derive(Default)]
struct HostPool {
    slots: Vec<Vec<f32>>,
}

impl HostPool {
    fn values(&mut self, slot: usize, len: usize) -> &[f32] {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, Vec::new);
        }
        if self.slots[slot].len() != len {
            let mut state =
                0x9e37_79b9_7f4a_7c15u64 ^ (slot as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            self.slots[slot] = (0..len)
                .map(|_| {
                    // splitmix64
                    state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    z ^= z >> 31;
                    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect();
        }
        &self.slots[slot]
    }
}

/// How many input sets to rotate among so that they do not all sit in L2.
fn sets_for(bytes_per_set: usize) -> usize {
    if bytes_per_set >= L2_BYTES {
        1
    } else {
        (2 * L2_BYTES).div_ceil(bytes_per_set.max(1)).clamp(2, 32)
    }
}

fn upload_sets(
    gpu: &Gpu,
    pool: &mut HostPool,
    plan: &Plan,
    d: usize,
    n: usize,
    with_d_o: bool,
) -> ladder_kernels::Result<Vec<InputSet>> {
    let (batch, heads) = plan.dims(d, n);
    let shape = [batch, heads, n, d];
    let len = batch * heads * n * d;
    let tensors = if with_d_o { 4 } else { 3 };
    let sets = sets_for(tensors * len * plan.dtype.size());
    (0..sets)
        .map(|s| {
            let mut up =
                |role: usize| gpu.upload(pool.values(4 * s + role, len), &shape, plan.dtype);
            Ok(InputSet {
                q: up(0)?,
                k: up(1)?,
                v: up(2)?,
                d_o: if with_d_o { Some(up(3)?) } else { None },
            })
        })
        .collect()
}

/// The median time of one case.
struct Timing {
    ms: f64,
    samples: usize,
    calls_per_sample: usize,
    /// Wall time of the untimed first call (kernel compilation or cache load included).
    first_call_s: f64,
}

fn measure(
    gpu: &Gpu,
    step: &mut Step<'_>,
    sets: usize,
    warmup: usize,
    repeats: usize,
    budget_ms: f64,
) -> ladder_kernels::Result<Timing> {
    let mut next = 0;
    let mut call = |keep: &mut Vec<Vec<Tensor>>| -> ladder_kernels::Result<()> {
        keep.push(step(next % sets)?);
        next += 1;
        Ok(())
    };
    // The first call compiles the kernel (or loads it from the disk cache): not timed.
    let first = Instant::now();
    call(&mut Vec::new())?;
    gpu.synchronize()?;
    let first_call_s = first.elapsed().as_secs_f64();
    let mut single = f64::INFINITY;
    for _ in 0..warmup {
        let mut keep = Vec::new();
        let ms = gpu.time_ms(|| call(&mut keep))?;
        single = single.min(f64::from(ms));
    }
    let calls = ((SAMPLE_MS / single.max(1e-4)).ceil() as usize).clamp(1, 64);
    let mut samples = Vec::with_capacity(repeats);
    let mut total = 0.0;
    for _ in 0..repeats {
        let mut keep = Vec::with_capacity(calls);
        let ms = f64::from(gpu.time_ms(|| (0..calls).try_for_each(|_| call(&mut keep)))?);
        drop(keep); // freed after the end event, in stream order
        samples.push(ms / calls as f64);
        total += ms;
        if total > budget_ms {
            break;
        }
    }
    samples.sort_by(f64::total_cmp);
    let mid = samples.len() / 2;
    let ms =
        if samples.len() % 2 == 1 { samples[mid] } else { (samples[mid - 1] + samples[mid]) / 2.0 };
    Ok(Timing { ms, samples: samples.len(), calls_per_sample: calls, first_call_s })
}

/// The NVIDIA kernel driver's version (e.g. `580.95.05`), from /proc on Linux.
fn kernel_driver_version() -> Option<String> {
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

fn run(gpu: &Gpu, plan: &Plan, out: &Path) -> anyhow::Result<bool> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let cuda = gpu.driver_version().unwrap_or_default();
    let driver = kernel_driver_version().unwrap_or_else(|| format!("CUDA {cuda}"));
    let date = report::utc_now_iso();
    let notes = plan.notes();
    merge_meta(out, gpu, &driver, &cuda, &date, &notes)?;
    eprintln!(
        "ladder bench: {} ({}, {} SMs), driver {driver}, CUDA {cuda}, {}",
        gpu.name(),
        gpu.arch(),
        gpu.sm_count(),
        plan.dtype
    );
    eprintln!(
        "shapes: hidden {} (heads = hidden / d), {} tokens (batch = tokens / n), d {:?}, n {:?}",
        plan.hidden, plan.tokens, plan.ds, plan.ns
    );
    for note in &notes {
        eprintln!("note: {note}");
    }

    let total = plan.case_count();
    let mut rows: Vec<Row> = Vec::new();
    let mut extras: Vec<Map<String, Value>> = Vec::new();
    let mut pool = HostPool::default();
    let mut done = 0;
    let started = Instant::now();
    for &d in &plan.ds {
        for &n in &plan.ns {
            let entries = plan.entries_at(n);
            if entries.is_empty() {
                continue;
            }
            let (batch, heads) = plan.dims(d, n);
            let case_of = |e: &Entry, causal: bool| Case {
                imp: e.rung.to_string(),
                direction: e.direction().name().to_string(),
                dtype: plan.dtype.name().to_string(),
                causal,
                batch,
                heads_q: heads,
                heads_kv: heads,
                n_q: n,
                n_kv: n,
                d,
            };
            let with_d_o = entries.iter().any(|e| e.direction() == Direction::Bwd);
            let prepared = Instant::now();
            let sets = upload_sets(gpu, &mut pool, plan, d, n, with_d_o);
            if let Ok(sets) = &sets {
                eprintln!(
                    "inputs d={d} n={n}: {} set(s) of {} tensors [{batch}, {heads}, {n}, {d}] \
                     ready in {:.1} s",
                    sets.len(),
                    if with_d_o { 4 } else { 3 },
                    prepared.elapsed().as_secs_f64()
                );
            }
            for &causal in &plan.causals {
                for e in &entries {
                    done += 1;
                    let case = case_of(e, causal);
                    let (row, extra) = run_case(gpu, plan, e, case, &sets);
                    let progress =
                        format!("[{done:>3}/{total}] {:<4} {}", row.case.imp, row.case.label());
                    match &row.outcome {
                        Outcome::Measured { ms, tflops, .. } => {
                            let samples = extra.get("samples").and_then(Value::as_u64).unwrap_or(0);
                            let wanted = repeats_of(plan, e) as u64;
                            let mut note = String::new();
                            if samples < wanted {
                                note += &format!("  ({samples} of {wanted} samples: time budget)");
                            }
                            let first = extra.get("first_call_s").and_then(Value::as_f64);
                            if let Some(first) = first.filter(|s| *s > 1.0) {
                                note += &format!(
                                    "  (first call {first:.1} s, kernel compile included)"
                                );
                            }
                            eprintln!("{progress}  {ms:>9.4} ms  {tflops:>7.1} TFLOP/s{note}");
                        }
                        Outcome::Skipped(why) => eprintln!("{progress}  skipped: {why}"),
                        Outcome::Failed(why) => eprintln!("{progress}  FAILED: {why}"),
                    }
                    rows.push(row);
                    extras.push(extra);
                    // Rewrite the CSV after every case: a run cut short keeps what it measured.
                    write_file(&out.join("bench.csv"), &report::to_csv(&rows))?;
                }
            }
            drop(sets);
            gpu.synchronize().ok();
        }
    }

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
        "notes": notes,
        "elapsed_s": started.elapsed().as_secs_f64(),
    });
    let json_rows: Vec<Value> =
        rows.iter().zip(&extras).map(|(r, x)| report::row_json(r, x)).collect();
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
    charts_only(out)?;
    Ok(failed == 0)
}

fn repeats_of(plan: &Plan, e: &Entry) -> usize {
    if e.rung == "fa1" { plan.fa1_repeats } else { plan.repeats }
}

/// Time one case; an unsupported shape is skipped, any other error fails the case (never a panic).
fn run_case(
    gpu: &Gpu,
    plan: &Plan,
    e: &Entry,
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
    let warmup = if e.rung == "fa1" { 1 } else { plan.warmup };
    let opts = Options { causal: case.causal, scale: None };
    let timed = e.pass.setup(gpu, sets, opts).and_then(|mut step| {
        measure(gpu, &mut step, sets.len(), warmup, repeats_of(plan, e), plan.budget_ms)
    });
    match timed {
        Ok(t) => {
            let mut extra = Map::new();
            extra.insert("samples".into(), json!(t.samples));
            extra.insert("calls_per_sample".into(), json!(t.calls_per_sample));
            extra.insert("input_sets".into(), json!(sets.len()));
            extra.insert("first_call_s".into(), json!(t.first_call_s));
            (Row::measured(case, t.ms), extra)
        }
        Err(
            err @ (KernelError::UnsupportedHeadDim { .. } | KernelError::UnsupportedDtype { .. }),
        ) => (Row { case, outcome: Outcome::Skipped(err.to_string()) }, Map::new()),
        Err(err) => (Row { case, outcome: Outcome::Failed(err.to_string()) }, Map::new()),
    }
}

fn merge_meta(
    out: &Path,
    gpu: &Gpu,
    driver: &str,
    cuda: &str,
    date: &str,
    notes: &[String],
) -> anyhow::Result<()> {
    // Keep the part of the note that scripts/peers.py wrote; replace ours.
    let old = report::read_meta(out);
    let mut note = format!("ladder bench {}: {}", env!("CARGO_PKG_VERSION"), notes.join("; "));
    for part in report::meta_str(&old, "note").split("; ").filter(|p| p.starts_with("peers.py:")) {
        note = format!("{note}; {part}");
    }
    report::merge_meta(
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

fn write_file(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Redraw the charts from `dir/bench.csv` and `dir/peers.csv` and print them side by side.
fn charts_only(dir: &Path) -> anyhow::Result<()> {
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
            rows.extend(report::read_csv(path)?);
        }
    }
    let meta = report::read_meta(dir);
    let card = report::meta_str(&meta, "card");
    let subtitle = format!(
        "{}, driver {}, CUDA {}, {}{}",
        if card.is_empty() { "unknown GPU" } else { card },
        report::meta_str(&meta, "driver"),
        report::meta_str(&meta, "cuda"),
        report::meta_str(&meta, "date"),
        match report::meta_str(&meta, "torch") {
            "" => String::new(),
            torch => format!("; peers: torch {torch}"),
        }
    );
    let files = charts::draw_all(dir, &rows, &subtitle)?;
    println!("{}", report::render_side_by_side(&rows));
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
        let at = |n| p.entries_at(n).iter().map(|e| e.rung).collect::<Vec<_>>();
        assert!(at(2048).contains(&"fa1"));
        assert!(!at(4096).contains(&"fa1") && at(4096).contains(&"fa2"));
        assert!(p.notes().iter().any(|n| n.contains("n <= 2048")));
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
        let q = plan(&["--quick"]).unwrap();
        assert_eq!(
            (q.ds.as_slice(), q.ns.as_slice(), q.causals.as_slice()),
            (&[128][..], &[1024, 4096][..], &[false][..])
        );
        assert_eq!(q.repeats, 5);
        assert!(plan(&["--rung", "fa9"]).unwrap_err().to_string().contains("known: fa1, fa2"));
        assert!(plan(&["--d", "96"]).is_err(), "2048 is not a multiple of 96");
        assert!(plan(&["--n", "0"]).is_err());
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

    #[test]
    fn inputs_rotate_only_when_they_fit_in_l2() {
        // Default shapes: 16k tokens × 2048 × 2 bytes = 64 MiB per tensor.
        assert_eq!(sets_for(3 * 16384 * 2048 * 2), 1);
        assert_eq!(sets_for(10 << 20), 10);
        assert_eq!(sets_for(1), 32);
    }

    #[test]
    fn host_inputs_are_deterministic_and_in_range() {
        let mut pool = HostPool::default();
        let a = pool.values(3, 1000).to_vec();
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.1, "{mean}");
        assert_ne!(a, pool.values(2, 1000));
        assert_eq!(a, HostPool::default().values(3, 1000));
    }
}
