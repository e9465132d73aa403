//! `ladder run`: one rung on your own `.npy` tensors, on the CPU or on the GPU, forward and
//! (for the rungs that have one) backward.
//!
//! Exit status: 0 on success, 2 for bad flags (as clap's own errors), 1 for everything else
//! (a file that cannot be read or does not fit, a kernel that refuses the problem, no GPU).
//! Every error is one line.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::{Args, ValueEnum};
use ladder_compare::GpuRung;
use ladder_compare::gpu_check::{Layout, half_of, upload_in};
use ladder_compare::gpu_rungs::Kernels;
use ladder_compare::memory::human_bytes;
use ladder_compare::npy::{self, DType, NpyTensor};
use ladder_compare::results::Direction;
use ladder_compare::{Rung, RungConfig};
use ladder_kernels::{self as kernels, KernelError, Tensor};
use ladder_reference::{AttentionShape, Element, Fa2Options, RunStats, fa2, naive};
use ndarray::{Array, Array1, Array3, Array4, ArrayD, Dimension};

use crate::RungArgs;

const EXAMPLES: &str = "\
Examples:
  ladder run --rung fa2 --q q.npy --k k.npy --v v.npy --out o.npy --lse lse.npy --causal
  ladder run --rung fa2 --device gpu --q q.npy --k k.npy --v v.npy --out o.npy --causal
  ladder run --rung fa2 --q q.npy --k k.npy --v v.npy --out o.npy --causal \\
             --backward --do do.npy --dq dq.npy --dk dk.npy --dv dv.npy
  ladder run --rung fa3 --device gpu --layout bshd --q q.npy --k k.npy --v v.npy --out o.npy

Rungs with a GPU kernel: fa1 (fp16, bf16, f32), fa2 (fp16, bf16), and on Hopper fa3 and fa3-fp8
(fp16, bf16). --layout bshd reads and writes [batch, seq, heads, d] files. Rungs with a backward pass:
naive and fa2 on the CPU, fa2 and (on Hopper, d <= 128) fa3 on the GPU. --br, --bc, --splits, --phi and --no-incoherent tune the
CPU rungs; the GPU kernels choose their own tiles. Exit status 2 for bad flags, 1 for any other
error.";

#[derive(Args)]
#[command(after_help = EXAMPLES)]
pub struct RunArgs {
    /// The rung to run.
    #[arg(long, value_enum)]
    rung: Rung,
    /// Queries, [batch, heads_q, n_q, d] (--layout bshd: [batch, n_q, heads_q, d]).
    #[arg(long)]
    q: PathBuf,
    /// Keys, [batch, heads_kv, n_kv, d] (--layout bshd: [batch, n_kv, heads_kv, d]).
    #[arg(long)]
    k: PathBuf,
    /// Values, the shape of k.
    #[arg(long)]
    v: PathBuf,
    /// Where to write O (in the dtype of q, the layout of q).
    #[arg(long)]
    out: PathBuf,
    /// The layout of q, k, v, dO and of what is written (O, dQ, dK, dV; lse is always [batch,
    /// heads_q, n_q]): bhsd ([batch, heads, seq, d]) or bshd ([batch, seq, heads, d], what a
    /// projection produces). On the GPU the kernels that take strides (fa2, fa3) read bshd in
    /// place, as transposed views; the others get a [batch, heads, seq, d] copy.
    #[arg(long, value_enum, default_value_t = FileLayout::Bhsd)]
    layout: FileLayout,
    /// Where to write the log-sum-exp, [batch, heads_q, n_q], float32.
    #[arg(long)]
    lse: Option<PathBuf>,
    /// Causal masking, bottom-right aligned.
    #[arg(long)]
    causal: bool,
    /// Where to run the rung: the CPU rung (in f32, or f64 when an input is float64), or its CUDA
    /// kernel (fa1, fa2).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// With --device gpu: the type the kernel reads and writes (inputs are rounded to it) [default:
    /// the type of q where the kernel has it, else fp16: fa1 runs float32/64 inputs in f32, fa2
    /// in fp16].
    #[arg(long, value_enum)]
    dtype: Option<GpuDType>,
    /// Also compute dQ, dK, dV for the upstream gradient --do (naive and fa2 on the CPU, fa2 on
    /// the GPU); needs --do, --dq, --dk and --dv.
    #[arg(long)]
    backward: bool,
    /// With --backward: the upstream gradient dO, the shape of q.
    #[arg(long = "do", value_name = "DO")]
    d_o: Option<PathBuf>,
    /// With --backward: where to write dQ (in the dtype of q).
    #[arg(long)]
    dq: Option<PathBuf>,
    /// With --backward: where to write dK (in the dtype of k).
    #[arg(long)]
    dk: Option<PathBuf>,
    /// With --backward --device gpu: compute dQ without atomics, so that the gradients are the
    /// same bits on every run (a separate dQ pass; slower).
    #[arg(long)]
    pub deterministic: bool,
    /// With --backward: where to write dV (in the dtype of v).
    #[arg(long)]
    dv: Option<PathBuf>,
    /// With --backward and --score-mod sinks: where to write the sinks' gradient (float32, one
    /// value per query head); without it the summary line prints it.
    #[arg(long)]
    dsinks: Option<PathBuf>,
    // --scale applies on the GPU too; the tile and split sizes do not.
    #[command(flatten)]
    rung_args: RungArgs,
}

/// How the `.npy` files' axes are ordered (`--layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FileLayout {
    /// `[batch, heads, seq, d]`.
    Bhsd,
    /// `[batch, seq, heads, d]`.
    Bshd,
}

/// Axes 1 and 2 swapped, as a standard-layout array: `[b, s, h, d]` ↔ `[b, h, s, d]`.
fn swap_seq_and_heads(x: &Array4<f64>) -> Array4<f64> {
    x.view().permuted_axes([0, 2, 1, 3]).as_standard_layout().into_owned()
}

/// Where `ladder run` runs the rung.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Gpu,
}

/// The element types of the GPU kernels, by their command-line names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuDType {
    Fp16,
    Bf16,
    F32,
}

impl GpuDType {
    fn kernel(self) -> kernels::DType {
        match self {
            GpuDType::Fp16 => kernels::DType::F16,
            GpuDType::Bf16 => kernels::DType::BF16,
            GpuDType::F32 => kernels::DType::F32,
        }
    }
}

/// The GPU forward rung whose CPU rung is `rung`, if it has one.
fn gpu_forward(rung: Rung) -> Option<GpuRung> {
    GpuRung::ALL.into_iter().find(|g| g.direction() == Direction::Fwd && g.cpu() == rung)
}

/// The GPU forward rungs.
fn gpu_forwards() -> Vec<GpuRung> {
    GpuRung::ALL.into_iter().filter(|g| g.direction() == Direction::Fwd).collect()
}

/// The backward kernel of a GPU forward rung, if it has one.
fn gpu_backward(forward: GpuRung) -> Option<GpuRung> {
    GpuRung::find(forward.name(), Direction::Bwd)
}

/// The types the rung's kernel takes, by their command-line names.
fn gpu_dtypes(rung: GpuRung) -> Vec<GpuDType> {
    let all = [GpuDType::Fp16, GpuDType::Bf16, GpuDType::F32];
    all.into_iter().filter(|d| rung.dtypes().contains(&d.kernel())).collect()
}

/// The type of q where the kernel has it, else fp16.
fn default_gpu_dtype(rung: GpuRung, q: DType) -> GpuDType {
    match q {
        DType::F16 => GpuDType::Fp16,
        DType::F32 | DType::F64 if gpu_dtypes(rung).contains(&GpuDType::F32) => GpuDType::F32,
        DType::F32 | DType::F64 => GpuDType::Fp16,
    }
}

/// The CPU rungs with a backward pass.
const CPU_BACKWARD: &[Rung] = &[Rung::Naive, Rung::Fa2];

/// A bad flag or combination of flags: exit status 2, as for clap's own errors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Usage(String);

fn usage(message: impl fmt::Display) -> anyhow::Error {
    Usage(message.to_string()).into()
}

fn names<T: Copy>(items: &[T], name: impl Fn(T) -> String) -> String {
    items.iter().map(|&x| name(x)).collect::<Vec<_>>().join(", ")
}

fn dtype_name(d: GpuDType) -> String {
    d.kernel().name().to_string()
}

/// What to run, once the flags are checked.
enum Plan {
    Cpu,
    Gpu { rung: GpuRung, dtype: Option<GpuDType> },
}

/// Where the gradients go: dO to read, dQ, dK, dV to write.
struct BackwardPaths<'a> {
    d_o: &'a Path,
    out: [&'a Path; 3],
}

impl RunArgs {
    /// Checks the flags together; every error here is a [`Usage`] error.
    fn plan(&self) -> anyhow::Result<(Plan, Option<BackwardPaths<'_>>)> {
        let grad_flags =
            [("--do", &self.d_o), ("--dq", &self.dq), ("--dk", &self.dk), ("--dv", &self.dv)];
        let backward = if self.backward {
            let missing: Vec<&str> =
                grad_flags.iter().filter(|(_, p)| p.is_none()).map(|(f, _)| *f).collect();
            let (Some(d_o), Some(dq), Some(dk), Some(dv)) =
                (&self.d_o, &self.dq, &self.dk, &self.dv)
            else {
                return Err(usage(format!(
                    "--backward needs --do (the upstream gradient dO) and --dq, --dk, --dv (where \
                     to write the gradients); missing {}",
                    missing.join(", ")
                )));
            };
            Some(BackwardPaths { d_o, out: [dq, dk, dv] })
        } else {
            if let Some((flag, _)) = grad_flags.iter().find(|(_, p)| p.is_some()) {
                return Err(usage(format!("{flag} goes with --backward")));
            }
            if self.dsinks.is_some() {
                return Err(usage("--dsinks goes with --backward"));
            }
            None
        };
        let plan = match self.device {
            Device::Cpu => {
                if self.dtype.is_some() {
                    return Err(usage(
                        "--dtype picks the GPU kernel's type and needs --device gpu (the CPU \
                         rungs compute in f32, or f64 when an input is float64)",
                    ));
                }
                if backward.is_some() && !CPU_BACKWARD.contains(&self.rung) {
                    return Err(usage(format!(
                        "{} has no backward pass on the CPU (rungs with one: {})",
                        self.rung,
                        names(CPU_BACKWARD, |r| r.to_string())
                    )));
                }
                Plan::Cpu
            }
            Device::Gpu => {
                let forward = gpu_forward(self.rung);
                let takes_mask = match backward {
                    Some(_) => forward.and_then(gpu_backward).is_some_and(GpuRung::takes_mask_mod),
                    None => forward.is_some_and(GpuRung::takes_mask_mod),
                };
                if let Some(m) = self.rung_args.mask_mod
                    && !takes_mask
                {
                    return Err(usage(format!(
                        "--mask-mod {m}: on the GPU only fa2 and fa3 (forward and backward) take \
                         a mask modifier yet (every CPU rung does: --device cpu)"
                    )));
                }
                let rung = gpu_forward(self.rung).ok_or_else(|| {
                    // A decoding kernel (FlashDecoding, FlashDecoding++) takes a KV cache, not `run`'s Q, K, V.
                    let decoding = GpuRung::ALL
                        .into_iter()
                        .any(|g| g.direction() == Direction::Decode && g.cpu() == self.rung);
                    usage(format!(
                        "{} has no GPU kernel (GPU rungs: {}){}",
                        self.rung,
                        names(&gpu_forwards(), |r| r.cpu().to_string()),
                        if decoding {
                            "; its decoding kernel takes a KV cache, not `run`'s Q, K, V: \
                             `ladder bench --direction decode` times it"
                        } else {
                            ""
                        }
                    ))
                })?;
                let dtypes = gpu_dtypes(rung);
                if let Some(dtype) = self.dtype.filter(|d| !dtypes.contains(d)) {
                    return Err(usage(format!(
                        "{} on the GPU takes {}, not {}",
                        self.rung,
                        names(&dtypes, dtype_name),
                        dtype_name(dtype)
                    )));
                }
                if backward.is_some() && gpu_backward(rung).is_none() {
                    let with: Vec<GpuRung> =
                        gpu_forwards().into_iter().filter(|&r| gpu_backward(r).is_some()).collect();
                    return Err(usage(format!(
                        "{} has no backward kernel (GPU rungs with one: {})",
                        self.rung,
                        names(&with, |r| r.cpu().to_string())
                    )));
                }
                Plan::Gpu { rung, dtype: self.dtype }
            }
        };
        Ok((plan, backward))
    }
}

/// Runs `ladder run`; prints any error on one line.
pub fn main(args: &RunArgs) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The chain of causes, each once (a message that already ends with its cause's
            // text is not repeated), on one line even where a message (a compiler log, say)
            // has several.
            let mut message = String::new();
            for cause in e.chain().map(|c| c.to_string()) {
                if !message.ends_with(&cause) {
                    message += &if message.is_empty() { cause } else { format!(": {cause}") };
                }
            }
            let line: Vec<&str> =
                message.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            eprintln!("error: {}", line.join(" "));
            ExitCode::from(if e.is::<Usage>() { 2 } else { 1 })
        }
    }
}

/// The results of a run, widened to `f64`.
struct Results {
    o: Array4<f64>,
    lse: Array3<f64>,
    /// `dQ, dK, dV`.
    grads: Option<[Array4<f64>; 3]>,
    /// The sinks' gradient, with sinks.
    dsinks: Option<Array1<f64>>,
    /// What ran where, for the summary line.
    what: String,
    /// What the run did, for a second line (CPU rungs).
    stats: Option<String>,
}

fn run(args: &RunArgs) -> anyhow::Result<()> {
    let (plan, backward) = args.plan()?;
    let mut config = args.rung_args.config(args.causal).map_err(usage)?;
    // Every tensor is held as [b, h, s, d] here; --layout bshd is undone on reading and redone on
    // writing (on the GPU, the strided kernels get bshd buffers as they are).
    let read = |path: &Path| -> anyhow::Result<NpyTensor> {
        let mut t = npy::read(path)?;
        if args.layout == FileLayout::Bshd {
            t.data = swap_seq_and_heads(&t.data);
        }
        Ok(t)
    };
    let write = |path: &Path, x: &Array4<f64>, dtype: DType| match args.layout {
        FileLayout::Bhsd => npy::write(path, x, dtype),
        FileLayout::Bshd => npy::write(path, &swap_seq_and_heads(x), dtype),
    };
    let [q, k, v] = [&args.q, &args.k, &args.v].map(|p| read(p));
    let (q, k, v) = (q?, k?, v?);
    AttentionShape::of(&q.data.view(), &k.data.view(), &v.data.view()).with_context(|| {
        let as_read = match args.layout {
            FileLayout::Bhsd => "",
            FileLayout::Bshd => " (read from --layout bshd as [batch, heads, seq, d])",
        };
        format!("q {:?}, k {:?}, v {:?}{as_read}", q.data.shape(), k.data.shape(), v.data.shape())
    })?;
    let heads_q = q.data.dim().1;
    if let Some(spec) = args.rung_args.mask_mod {
        config.attention = spec.apply_cpu(config.attention, k.data.dim().2);
    }
    if let Some(spec) = args.rung_args.score_mod {
        config.attention = spec.apply_cpu(config.attention, heads_q);
    }
    let d_o = match &backward {
        Some(paths) => {
            let d_o = read(paths.d_o)?;
            if d_o.data.shape() != q.data.shape() {
                bail!(
                    "{}: dO is {:?} but q is {:?}; they must be equal",
                    paths.d_o.display(),
                    d_o.data.shape(),
                    q.data.shape()
                );
            }
            Some(d_o)
        }
        None => None,
    };
    let tensors = Tensors { q: &q, k: &k, v: &v, d_o: d_o.as_ref() };
    let results = match plan {
        Plan::Cpu => {
            let dtypes = [Some(&q), Some(&k), Some(&v), d_o.as_ref()].map(|t| t.map(|t| t.dtype));
            // f64 if any input is f64 (exact), otherwise f32 (exact for f16 and f32 inputs).
            if dtypes.contains(&Some(DType::F64)) {
                cpu::<f64>(args.rung, &tensors, &config)?
            } else {
                cpu::<f32>(args.rung, &tensors, &config)?
            }
        }
        Plan::Gpu { rung, dtype } => {
            let dtype = dtype.unwrap_or_else(|| default_gpu_dtype(rung, q.dtype));
            gpu(rung, dtype, &tensors, args)?
        }
    };
    write(&args.out, &results.o, q.dtype)?;
    if let Some(path) = &args.lse {
        npy::write(path, &results.lse, DType::F32)?;
    }
    let o_file_shape = match args.layout {
        FileLayout::Bhsd => results.o.shape().to_vec(),
        FileLayout::Bshd => swap_seq_and_heads(&results.o).shape().to_vec(),
    };
    let mut wrote =
        format!("wrote {} {:?} to {}", dtype_label(q.dtype), o_file_shape, args.out.display());
    if let Some(path) = &args.lse {
        wrote += &format!(", lse to {}", path.display());
    }
    if let (Some(grads), Some(paths)) = (&results.grads, &backward) {
        for ((grad, input), path) in grads.iter().zip([&q, &k, &v]).zip(paths.out) {
            write(path, grad, input.dtype)?;
        }
        wrote +=
            &format!(", dQ, dK, dV to {}", paths.out.map(|p| p.display().to_string()).join(", "));
    }
    match (&results.dsinks, &args.dsinks) {
        (Some(dsinks), Some(path)) => {
            npy::write(path, dsinks, DType::F32)?;
            wrote += &format!(", dsinks to {}", path.display());
        }
        (Some(dsinks), None) => wrote += &format!("; dsinks {dsinks}"),
        (None, Some(_)) => {
            return Err(usage("--dsinks: the problem has no sinks (--score-mod sinks)"));
        }
        (None, None) => {}
    }
    eprintln!("{}: {wrote}", results.what);
    if let Some(stats) = results.stats {
        eprintln!("{}: {stats}", args.rung);
    }
    Ok(())
}

fn dtype_label(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "float16",
        DType::F32 => "float32",
        DType::F64 => "float64",
    }
}

/// The inputs as read (widened exactly to `f64`).
struct Tensors<'a> {
    q: &'a NpyTensor,
    k: &'a NpyTensor,
    v: &'a NpyTensor,
    d_o: Option<&'a NpyTensor>,
}

/// The CPU rung computing in `T` (every input value is exact in `T`).
fn cpu<T: Element>(rung: Rung, x: &Tensors, config: &RungConfig) -> anyhow::Result<Results> {
    let narrow = |t: &NpyTensor| t.data.mapv(T::of);
    let (q, k, v) = (narrow(x.q), narrow(x.k), narrow(x.v));
    let out = rung.forward(q.view(), k.view(), v.view(), config)?;
    let mut stats = describe(&out.stats, "");
    let grads = match x.d_o.map(narrow) {
        None => None,
        Some(d_o) => {
            let (q, k, v, d_o) = (q.view(), k.view(), v.view(), d_o.view());
            let g = match rung {
                Rung::Naive => naive::backward(q, k, v, d_o, &config.attention)?,
                Rung::Fa2 => {
                    let opts =
                        Fa2Options { attention: config.attention.clone(), tiles: config.tiles };
                    fa2::backward(q, k, v, out.o.view(), d_o, out.lse.view(), &opts)?
                }
                other => bail!("{other} has no backward pass on the CPU"),
            };
            stats += &describe(&g.stats, "; backward: ");
            Some(g)
        }
    };
    let dsinks = grads.as_ref().and_then(|g| g.dsinks.as_ref().map(widen));
    Ok(Results {
        o: widen(&out.o),
        lse: widen(&out.lse),
        grads: grads.map(|g| [g.dq, g.dk, g.dv].map(|t| widen(&t))),
        dsinks,
        what: format!("{rung} (CPU, {})", T::NAME),
        stats: Some(stats),
    })
}

fn widen<T: Element, D: Dimension>(x: &Array<T, D>) -> Array<f64, D> {
    x.mapv(|v| v.as_f64())
}

fn describe(stats: &RunStats, prefix: &str) -> String {
    format!(
        "{prefix}{} work items, HBM traffic {} under its memory model{}",
        stats.work_items,
        human_bytes(stats.hbm.total_bytes()),
        stats
            .fallback_rows
            .map_or(String::new(), |n| format!(", {n} rows recomputed by the fallback"))
    )
}

/// The rung's CUDA kernel(s) on the inputs rounded to `dtype`.
fn gpu(rung: GpuRung, dtype: GpuDType, x: &Tensors, args: &RunArgs) -> anyhow::Result<Results> {
    let kind = dtype.kernel();
    let named = [(x.q, &args.q), (x.k, &args.k), (x.v, &args.v)]
        .into_iter()
        .chain(x.d_o.zip(args.d_o.as_ref()));
    for (t, path) in named {
        check_range(&t.data, path, kind)?;
    }
    let gpu = ladder_compare::gpu_check::open_gpu().map_err(|e| anyhow!("no GPU: {e}"))?;
    let label = rung.cpu();
    // Kernel errors that do not name the rung get its name.
    let kernel_error = |e: KernelError| match e {
        KernelError::UnsupportedDtype { .. } | KernelError::UnsupportedHeadDim { .. } => anyhow!(e),
        e => anyhow!("{label} on the GPU: {e}"),
    };
    // [b, s, h, d] buffers go to the kernels that take strides as they are, as transposed views;
    // the others get [b, h, s, d].
    let layout = if args.layout == FileLayout::Bshd && rung.takes_strides() {
        Layout::Bshd
    } else {
        Layout::Bhsd
    };
    let upload = |t: &NpyTensor| upload_in(&gpu, &t.data, kind, layout).map_err(kernel_error);
    let (q, k, v) = (upload(x.q)?, upload(x.k)?, upload(x.v)?);
    let opts = kernels::Options {
        causal: args.causal,
        scale: args.rung_args.scale.map(|s| s as f32),
        deterministic: args.deterministic,
        window: ladder_compare::gpu_check::kernel_window(args.rung_args.window.unwrap_or_default()),
        ..kernels::Options::default()
    };
    let opts = match args.rung_args.score_mod {
        Some(m) => m.apply_gpu(opts, x.q.data.dim().1),
        None => opts,
    };
    let opts = match args.rung_args.mask_mod {
        Some(m) => opts.with_mask_mod(m.gpu(x.k.data.dim().2).map_err(kernel_error)?),
        None => opts,
    };
    let out = match rung.kernels() {
        Kernels::Forward(forward) => forward(&gpu, &q, &k, &v, &opts),
        Kernels::ForwardFp8 { quantize, forward } => {
            let fp8 = ladder_compare::gpu_check::gpu_fp8(&args.rung_args.fp8_options());
            quantize(&gpu, &q, &k, &v, &opts, &fp8).and_then(|x| forward(&gpu, &x))
        }
        Kernels::Backward { .. } | Kernels::Decode(_) => bail!("{label}: not a forward kernel"),
    }
    .map_err(kernel_error)?;
    let grads = match x.d_o {
        None => None,
        Some(d_o) => {
            let d_o = upload(d_o)?;
            let Some(Kernels::Backward { backward, .. }) = gpu_backward(rung).map(|r| r.kernels())
            else {
                bail!("{label} has no backward kernel");
            };
            let g = backward(&gpu, &q, &k, &v, &out, &d_o, &opts).map_err(kernel_error)?;
            let dsinks = g.dsinks.as_ref().map(download).transpose()?;
            Some(([download(&g.dq)?, download(&g.dk)?, download(&g.dv)?], dsinks))
        }
    };
    let (grads, dsinks) = grads.map_or((None, None), |(g, d)| (Some(g), d));
    Ok(Results {
        o: download(&out.o)?,
        lse: download(&out.lse)?,
        grads,
        dsinks,
        what: format!("{label} (GPU {}, {}, {})", gpu.name(), gpu.arch(), kind.name()),
        stats: None,
    })
}

/// A device tensor as an `f64` array of its own shape.
fn download<D: Dimension>(t: &Tensor) -> anyhow::Result<Array<f64, D>> {
    let values: Vec<f64> = t.to_f32_vec()?.into_iter().map(f64::from).collect();
    Ok(ArrayD::from_shape_vec(t.shape(), values)?.into_dimensionality()?)
}

/// Fails if a finite value of `t` overflows `dtype` (rounds to infinity).
fn check_range(t: &Array4<f64>, path: &Path, dtype: kernels::DType) -> anyhow::Result<()> {
    let round = |x: f64| half_of(dtype).map_or(x as f32 as f64, |h| h.round(x));
    match t.iter().find(|&&x| x.is_finite() && !round(x).is_finite()) {
        None => Ok(()),
        Some(x) => bail!(
            "{}: {x} overflows {}{}",
            path.display(),
            dtype.name(),
            if dtype == kernels::DType::F16 {
                " (bf16 has the range of f32: --dtype bf16)"
            } else {
                ""
            }
        ),
    }
}
