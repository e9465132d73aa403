//! The GPU rungs run live, when the machine has a GPU: the notebook's "on the GPU" section first
//! runs the kernel on a small problem and checks it against the float64 oracle, with the same
//! rule as the GPU tests (`crates/compare/tests/gpu.rs`). Without a GPU the cell shows what the
//! same function printed on the H200, recorded by `record-live` (this crate's binary, run on the
//! GPU machine) under `docs/results/notebook-live/`, with the card and the date.
//!
//! [`try_edit`] runs an edited kernel (`GpuConfig::kernel_source`) through the same check, and
//! [`inspect_edit`] compiles it beside the crate's own without a GPU and shows what ptxas made of
//! both (`ladder_kernels::inspect`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use ladder_compare::cases::Case;
use ladder_compare::gpu_check;
use ladder_compare::gpu_rungs::GpuRung;
use ladder_compare::oracle::{GradientOracle, Oracle};
use ladder_compare::results::Direction;
use ladder_kernels::{DType, Gpu, GpuConfig, inspect};
use ladder_reference::{AttentionShape, TileSizes};

use crate::Failure;

/// What a live check printed: the cell's output, or a recording's.
#[derive(Default)]
pub struct Report(pub String);

impl Report {
    pub(crate) fn say(&mut self, line: impl std::fmt::Display) {
        let _ = writeln!(self.0, "{line}");
    }
}

/// The line `FA3_RESCALE` names in `fa3_forward.cu` (twice: inside the loop and after it), which
/// notebook 13's planted bug takes out of the loop.
pub const FA3_RESCALE: &str = "if (__any_sync(0xffffffff, moved)) rescale(o, alpha);";

/// The recorded checks, by their file name under `docs/results/notebook-live/` ([`record`] says
/// what each runs).
pub const RECORDED: &[&str] =
    &["fa1", "fa2", "fa3", "fa3-fp8", "fa3-no-rescale", "fa2-determinism"];

/// Where the recordings are: `docs/results/notebook-live` of the repository the notebook runs in.
pub fn recordings_dir() -> PathBuf {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let rel = Path::new("docs/results/notebook-live");
    cwd.ancestors()
        .map(|a| a.join(rel))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| cwd.join("..").join(rel))
}

/// Prints why the kernel does not run here, then the recording `name`, if there is one.
fn show_recorded(why: &str, name: &str) {
    let path = recordings_dir().join(format!("{name}.txt"));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let (header, body) = text.split_once('\n').unwrap_or((&text, ""));
            println!(
                "{why} What this cell printed on the H200 ({}):",
                header.trim_start_matches("# ")
            );
            print!("{body}");
        }
        Err(_) => println!("{why} (No recording of it: docs/results/notebook-live/{name}.txt.)"),
    }
}

/// A GPU that runs `rung`, or `None` after saying why there is none here and showing recording
/// `name`.
pub(crate) fn gpu_for(name: &str, rung: GpuRung, config: Option<&GpuConfig>) -> Option<Gpu> {
    let opened = match config {
        Some(c) => Gpu::with_config(c.clone()).map_err(|e| e.to_string()),
        None => gpu_check::open_gpu().map_err(|e| e.to_string()),
    };
    match opened {
        Ok(gpu) if rung.available_on(&gpu) => Some(gpu),
        Ok(gpu) => {
            let why = format!(
                "{} ({}) cannot run {}: it needs a Hopper GPU (sm_90a).",
                gpu.name(),
                gpu.arch(),
                rung.name()
            );
            show_recorded(&why, name);
            None
        }
        Err(e) => {
            show_recorded(&format!("No GPU on this machine ({e})."), name);
            None
        }
    }
}

/// The live check's problem: causal, 8 query heads over 2 kv heads, n_q 500, n_kv 700, fp16, at
/// head dimension `d`, with logits of standard deviation `logit_std`.
fn live_case(d: usize, logit_std: f64) -> Result<Case, Failure> {
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let shape = AttentionShape::new(1, 8, 2, 500, 700, d).map_err(|e| fail(&e))?;
    let tiles = TileSizes::new(64, 64).map_err(|e| fail(&e))?;
    Ok(Case {
        shape,
        causal: true,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std,
        tiles,
        splits: 1,
        seed: 2024,
    })
}

/// Runs GPU `rung` (`"fa1"`, `"fa2"`, whose backward pass runs too, or `"fa3"` on Hopper) on a
/// causal grouped-query problem in fp16 and checks it against the float64 oracle. Without a GPU
/// (or, for FA3, without a Hopper one) it shows the recording of the same check on the H200. An
/// error when a kernel is outside its tolerance.
pub fn gpu_live(rung: &str) -> Result<(), Failure> {
    let Some(forward) = GpuRung::find(rung, Direction::Fwd) else {
        return Err(Failure(format!("no GPU kernel for {rung:?}")));
    };
    let Some(gpu) = gpu_for(rung, forward, None) else { return Ok(()) };
    let mut report = Report::default();
    let pass = check_rung(&gpu, rung, &mut report);
    print!("{}", report.0);
    if !pass? {
        return Err(Failure(format!("{rung} on the GPU is out of tolerance")));
    }
    Ok(())
}

/// Runs `rung` forward (and backward, where it has one) on [`live_case`] at d = 64 on `gpu`,
/// into `report`; whether every result is within tolerance.
pub fn check_rung(gpu: &Gpu, rung: &str, report: &mut Report) -> Result<bool, Failure> {
    check_rung_on(gpu, rung, &live_case(64, 1.0)?, true, report)
}

fn check_rung_on(
    gpu: &Gpu,
    rung: &str,
    case: &Case,
    with_backward: bool,
    report: &mut Report,
) -> Result<bool, Failure> {
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let Some(forward) = GpuRung::find(rung, Direction::Fwd) else {
        return Err(Failure(format!("no GPU kernel for {rung:?}")));
    };
    let shape = case.shape;
    let dtype = DType::F16;
    let x = gpu_check::device_inputs(case, dtype);
    let (attention, opts) = gpu_check::options(&case.attention(), shape.d);
    report.say(format_args!(
        "{} ({}), fp16, batch 1, {} query heads over {} kv heads, n_q {}, n_kv {}, d {}, causal, \
         logits of standard deviation {}",
        gpu.name(),
        gpu.arch(),
        shape.heads_q,
        shape.heads_kv,
        shape.n_q,
        shape.n_kv,
        shape.d,
        case.logit_std
    ));
    let (out, elapsed) =
        gpu_check::forward(gpu, forward, &x, &opts, dtype).map_err(|e| fail(&e))?;
    let oracle = Oracle::new(&x, &attention).map_err(|e| fail(&e))?;
    let expected = gpu_check::expected_forward(&oracle, &x, dtype).map_err(|e| fail(&e))?;
    let verdict = expected.judge(&out);
    report.say(format_args!(
        "{rung} forward: O vs oracle {} (tolerance {}), {:.3} ms (first call includes compiling \
         the kernel): {}",
        verdict.o,
        expected.o,
        elapsed.as_secs_f64() * 1e3,
        if verdict.pass { "within tolerance" } else { "OUT OF TOLERANCE" }
    ));
    let mut pass = verdict.pass;
    if let Some(backward) = GpuRung::find(rung, Direction::Bwd).filter(|_| with_backward) {
        let (grads, elapsed) =
            gpu_check::backward(gpu, backward, &x, &opts, dtype).map_err(|e| fail(&e))?;
        let oracle = GradientOracle::new(&x, &attention).map_err(|e| fail(&e))?;
        let expected = gpu_check::expected_backward(&oracle, &x, dtype).map_err(|e| fail(&e))?;
        let (errs, ok) = expected.judge(&grads);
        report.say(format_args!(
            "{rung} backward: dQ {} dK {} dV {} vs oracle, {:.3} ms: {}",
            errs[0],
            errs[1],
            errs[2],
            elapsed.as_secs_f64() * 1e3,
            if ok { "within tolerance" } else { "OUT OF TOLERANCE" }
        ));
        pass &= ok;
    }
    if pass {
        report.say("ok: within tolerance");
    }
    Ok(pass)
}

/// An edited kernel (`config`'s `GpuConfig::kernel_source`) through `rung`'s forward check on a
/// Hopper GPU, at d = 128 with logits of standard deviation 3 (a row's maximum then moves from
/// tile to tile); prints the verdict either way. Without such a GPU: the recording of notebook
/// 13's planted bug (the rescale taken out of the loop, [`FA3_RESCALE`]).
pub fn try_edit(rung: &str, config: &GpuConfig) -> Result<(), Failure> {
    let Some(forward) = GpuRung::find(rung, Direction::Fwd) else {
        return Err(Failure(format!("no GPU kernel for {rung:?}")));
    };
    let Some(gpu) = gpu_for("fa3-no-rescale", forward, Some(config)) else { return Ok(()) };
    let mut report = Report::default();
    check_edit(&gpu, rung, &mut report)?;
    print!("{}", report.0);
    Ok(())
}

/// [`try_edit`]'s check on `gpu` (opened with the edit), into `report`.
pub fn check_edit(gpu: &Gpu, rung: &str, report: &mut Report) -> Result<bool, Failure> {
    check_rung_on(gpu, rung, &live_case(128, 3.0)?, false, report)
}

/// Notebook 13's planted bug: the FA3 forward with the rescale of O taken out of its loop.
pub fn without_rescale() -> Result<GpuConfig, Failure> {
    let original = ladder_kernels::kernel_source("fa3_forward")
        .ok_or_else(|| Failure("no fa3_forward source".into()))?;
    let edited = original.replacen(FA3_RESCALE, "/* the rescale, taken out */", 1);
    GpuConfig::new().kernel_source("fa3_forward", edited).map_err(|e| Failure(e.to_string()))
}

/// Compiles `target` from the crate's source and from `config`'s (edited) source, without a GPU,
/// and prints what ptxas made of each: registers, spills, and how many of each of `ops` (opcode
/// prefixes: `HGMMA`, `MUFU.EX2`) the machine code has, where an nvdisasm is found
/// (`LADDER_NVDISASM`, or on `PATH`). Without NVRTC it says how to get it.
pub fn inspect_edit(
    target: inspect::Target,
    config: &GpuConfig,
    ops: &[&str],
) -> Result<(), Failure> {
    let builds = [("crate's source", GpuConfig::new()), ("edited", config.clone())]
        .map(|(name, c)| (name, target.compile(&c)));
    compare_builds(builds, ops)
}

/// Compiles `target` as it is and with `score_mod` compiled in (the notebook 15 cell), and prints
/// the two side by side like [`inspect_edit`].
pub fn inspect_score_mod(
    target: inspect::Target,
    score_mod: ladder_kernels::ScoreMod,
    ops: &[&str],
) -> Result<(), Failure> {
    let config = GpuConfig::new();
    let name = score_mod.name();
    let builds = [("plain", target.clone()), (name.as_str(), target.score_mod(score_mod))]
        .map(|(name, t)| (name, t.compile(&config)));
    compare_builds(builds, ops)
}

/// Prints two builds' ptxas reports and, with an nvdisasm, the counts of `ops` in each.
fn compare_builds(
    builds: [(&str, ladder_kernels::Result<inspect::Build>); 2],
    ops: &[&str],
) -> Result<(), Failure> {
    if let Some((_, Err(e))) = builds.iter().find(|(_, b)| b.is_err()) {
        if e.to_string().contains("NVRTC (libnvrtc.so) not found") {
            println!(
                "NVRTC is not found here, so nothing is compiled. To see this cell's output: \
                 `pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvdisasm`, then start Jupyter \
                 with LD_LIBRARY_PATH=<site-packages>/nvidia/cu13/lib and \
                 LADDER_NVDISASM=<site-packages>/nvidia/cu13/bin/nvdisasm."
            );
            return Ok(());
        }
        return Err(Failure(e.to_string()));
    }
    let nvdisasm = std::env::var_os("LADDER_NVDISASM").map(PathBuf::from).or_else(|| {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|dir| Path::new(dir).join("nvdisasm"))
            .find(|p| p.is_file())
    });
    let mut mixes = Vec::new();
    for (name, build) in &builds {
        let Ok(build) = build else { continue };
        println!("{name}: {}", build.summary());
        if let Some(nvdisasm) = &nvdisasm {
            mixes.push(build.instruction_mix(nvdisasm).map_err(|e| Failure(e.to_string()))?);
        }
    }
    let [(first, _), (second, _)] = &builds;
    let width = second.len().max(8);
    if mixes.len() == 2 {
        println!("\n{:<12} {:>15} {:>width$}", "instructions", first, second);
        for op in ops {
            println!("{op:<12} {:>15} {:>width$}", mixes[0].count(op), mixes[1].count(op));
        }
        println!("{:<12} {:>15} {:>width$}", "all", mixes[0].total(), mixes[1].total());
    } else {
        println!("(no nvdisasm found: set LADDER_NVDISASM to see the instruction mix)");
    }
    Ok(())
}

/// FA3's FP8 path live on a Hopper GPU: the same inputs (with outliers: `N(0,1)` plus `N(0,100)` on
/// 0.1 % of the entries, d = 128) through `fa3-fp8-gpu` with and without incoherent processing,
/// each error against the float64 oracle beside the CPU `fa3-fp8` rung's on the same numbers, and
/// held to the FP8 tolerance. Without a Hopper GPU: the recording of the same check.
pub fn gpu_live_fp8() -> Result<(), Failure> {
    let Some(gpu) = gpu_for("fa3-fp8", GpuRung::Fa3Fp8, None) else { return Ok(()) };
    let mut report = Report::default();
    let pass = check_fp8(&gpu, &mut report);
    print!("{}", report.0);
    if !pass? {
        return Err(Failure("fa3-fp8 on the GPU is out of tolerance".into()));
    }
    Ok(())
}

/// [`gpu_live_fp8`]'s check on `gpu`, into `report`; whether both runs are within tolerance.
pub fn check_fp8(gpu: &Gpu, report: &mut Report) -> Result<bool, Failure> {
    use ladder_compare::RungConfig;
    use ladder_compare::oracle::Expected;
    use ladder_compare::rungs::Rung;
    use ladder_reference::Fp8Options;

    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let shape = AttentionShape::new(1, 4, 2, 1024, 1024, 128).map_err(|e| fail(&e))?;
    let tiles = TileSizes::new(128, 128).map_err(|e| fail(&e))?;
    let case = Case {
        shape,
        causal: false,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std: 1.0,
        tiles,
        splits: 1,
        seed: 7,
    };
    let dtype = DType::F16;
    let x = gpu_check::rounded(&case.inputs_with_outliers::<f64>(0.001, 10.0), dtype);
    let (attention, opts) = gpu_check::options(&case.attention(), shape.d);
    let oracle = Oracle::new(&x, &attention).map_err(|e| fail(&e))?;
    let x32 = gpu_check::narrow(&x);
    report.say(format_args!(
        "{} ({}), fp16 in, e4m3 products, batch 1, 4 query heads over 2 kv heads, n 1024, d 128, \
         inputs with outliers",
        gpu.name(),
        gpu.arch()
    ));
    report.say(format_args!(
        "{:<22} {:>14} {:>14} {:>12}",
        "", "GPU rel. L2", "CPU rel. L2", "tolerance"
    ));
    let mut pass = true;
    for (name, incoherent) in [("no rotation", None), ("incoherent processing", Some(7))] {
        let fp8 = Fp8Options { incoherent, ..RungConfig::default().fp8 };
        let (out, _) = gpu_check::forward_fp8(gpu, GpuRung::Fa3Fp8, &x, &opts, dtype, &fp8)
            .map_err(|e| fail(&e))?;
        let tiles = gpu_check::fp8_cpu_tiles(gpu, shape.d, shape.n_kv, Default::default())
            .map_err(|e| fail(&e))?;
        let config =
            RungConfig { attention: attention.clone(), tiles, fp8, ..RungConfig::default() };
        let cpu = Rung::Fa3Fp8
            .forward(x32.q.view(), x32.k.view(), x32.v.view(), &config)
            .map_err(|e| fail(&e))?;
        let expected = Expected::fp8_from_oracle(&oracle, &x32, &fp8).map_err(|e| fail(&e))?;
        let verdict = expected.judge(&out);
        let cpu_err = ladder_compare::error(&cpu.o, &oracle.out.o).rel_l2;
        report.say(format_args!(
            "{name:<22} {:>14.3e} {:>14.3e} {:>12.3e}",
            verdict.o.rel_l2, cpu_err, expected.o.rel_l2
        ));
        pass &= verdict.pass;
    }
    if pass {
        report.say("ok: within the FP8 tolerance (twice the error of per-tensor FP8 attention)");
    }
    Ok(pass)
}

/// Runs every check of [`RECORDED`] on the GPU of `config` and writes what each printed to
/// `dir/NAME.txt`, under a first line naming the card, CUDA and `date`; returns the files. The
/// FA3 checks need a Hopper GPU.
pub fn record(dir: &Path, date: &str) -> Result<Vec<PathBuf>, Failure> {
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
    let gpu = gpu_check::open_gpu().map_err(|e| fail(&e))?;
    let cuda = gpu.cuda_version().unwrap_or_else(|_| "?".into());
    let mut written = Vec::new();
    for name in RECORDED {
        let mut report = Report::default();
        match *name {
            "fa3-fp8" => check_fp8(&gpu, &mut report)?,
            "fa2-determinism" => {
                crate::backward::check_determinism(&gpu, &mut report)?;
                true
            }
            "fa3-no-rescale" => {
                let edited = Gpu::with_config(without_rescale()?).map_err(|e| fail(&e))?;
                check_edit(&edited, "fa3", &mut report)?
            }
            rung => check_rung(&gpu, rung, &mut report)?,
        };
        let path = dir.join(format!("{name}.txt"));
        let header = format!(
            "# {} ({}), CUDA {cuda}, {date}, recorded by notebooks/support's record-live",
            gpu.name(),
            gpu.arch()
        );
        std::fs::write(&path, format!("{header}\n{}", report.0)).map_err(|e| fail(&e))?;
        println!("{}:\n{}", path.display(), report.0);
        written.push(path);
    }
    Ok(written)
}
