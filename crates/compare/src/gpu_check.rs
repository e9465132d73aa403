//! Running the GPU rungs (`ladder-kernels`) on a problem and judging them: shared by the GPU
//! equivalence tests and `ladder verify`.
//!
//! The kernels read 16-bit (or `f32`) inputs, so everything here starts from the case's tensors
//! *rounded to the kernel's type* ([`device_inputs`]): the oracle, the CPU rung compared against
//! and the kernel all see the same numbers. The tolerance follows the ladder's rule
//! (`docs/conventions.md`, "Tolerances") with the naive algorithm in the kernel's own precision
//! ([`crate::low_precision`]) as the baseline. Which kernels there are: [`GpuRung`].

use std::time::Duration;

use anyhow::bail;
use ladder_kernels::decode::{self, DecodeOptions, DecodeStats, KvCache};
use ladder_kernels::{DType, Gpu, GpuConfig, KernelCache, KernelError, Options, Tensor, fa2, fa3};
use ladder_reference::{
    AttentionOptions, AttentionOutput, Fa2Options, Fp8Options, Gradients, TileSizes,
    fa2 as cpu_fa2, naive,
};
use ndarray::{Array1, Array3, Array4};

use crate::cases::{Case, Inputs};
use crate::gpu_rungs::{GpuRung, Kernels};
use crate::low_precision::{self, Half};
use crate::metrics::{ErrorStats, Tolerance, error_between_in_units_of};
use crate::oracle::{Expected, ExpectedGradients, GradientOracle, Oracle};
use crate::rungs::RungConfig;

/// The device configuration the `ladder` CLI, the notebooks and the tests use: the library
/// (`ladder-kernels`) reads no environment variables, so the `LADDER_*` variables are mapped
/// onto its [`GpuConfig`] here:
///
/// | variable | meaning |
/// |---|---|
/// | `LADDER_DEVICE=N` | CUDA device ordinal (default 0) |
/// | `LADDER_SYNC_LAUNCHES=1` | synchronise after every launch (faults name their kernel) |
/// | `LADDER_NVRTC_OPTIONS="..."` | extra NVRTC options, split at whitespace |
/// | `LADDER_KERNEL_CACHE=DIR` or `off` | kernel cache folder, or none |
/// | `LADDER_FA2_TILES=m_tiles,bc,warps` | FA2 forward tiles for every head dimension (tuning) |
/// | `LADDER_FA3_TILES=bc,consumers,stages` | FA3 tiles for every head dimension and mask (tuning) |
/// | `LADDER_FA3_SCHEDULE=no-pingpong,...` | FA3 schedule: `full`, or what to switch off (`no-pingpong`, `no-overlap`, `no-persistent`) and the experiment to switch on (`dynamic`: windowed tiles from a counter, with `no-overlap`) |
/// | `LADDER_FA3_L2_SECTION_MB=N` | K and V megabytes the causal FA3 tile order keeps in L2 at a time (tuning) |
/// | `LADDER_DECODE_STAGES=N` | K/V stages of the decoding kernels (tuning) |
pub fn gpu_config_from_env() -> anyhow::Result<GpuConfig> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let mut config = GpuConfig::new();
    if let Some(s) = var("LADDER_DEVICE") {
        let n = s.parse().map_err(|_| anyhow::anyhow!("LADDER_DEVICE={s:?} is not a number"))?;
        config = config.device(n);
    }
    config = config.sync_launches(var("LADDER_SYNC_LAUNCHES").is_some_and(|v| v != "0"));
    if let Some(s) = var("LADDER_NVRTC_OPTIONS") {
        config = config.nvrtc_options(s.split_whitespace());
    }
    if let Some(s) = var("LADDER_KERNEL_CACHE") {
        let cache = if s == "off" { KernelCache::Off } else { KernelCache::Dir(s.into()) };
        config = config.kernel_cache(cache);
    }
    if let Some(s) = var("LADDER_FA2_TILES") {
        let tiles: fa2::ForwardTiles =
            s.parse().map_err(|e| anyhow::anyhow!("LADDER_FA2_TILES: {e}"))?;
        config = config.tune(tiles);
    }
    if let Some(s) = var("LADDER_FA3_TILES") {
        let tiles: fa3::Fa3Tiles =
            s.parse().map_err(|e| anyhow::anyhow!("LADDER_FA3_TILES: {e}"))?;
        config = config.tune(tiles);
    }
    if let Some(s) = var("LADDER_FA3_SCHEDULE") {
        let schedule: fa3::Schedule =
            s.parse().map_err(|e| anyhow::anyhow!("LADDER_FA3_SCHEDULE: {e}"))?;
        config = config.tune(schedule);
    }
    if let Some(s) = var("LADDER_FA3_L2_SECTION_MB") {
        let mb: usize = s
            .parse()
            .map_err(|_| anyhow::anyhow!("LADDER_FA3_L2_SECTION_MB={s:?} is not a number"))?;
        config = config.tune(fa3::L2Section(mb.saturating_mul(1 << 20)));
    }
    if let Some(s) = var("LADDER_DECODE_STAGES") {
        let n =
            s.parse().map_err(|_| anyhow::anyhow!("LADDER_DECODE_STAGES={s:?} is not a number"))?;
        config = config.tune(decode::Stages(n));
    }
    Ok(config)
}

/// The device for `ladder` and the notebooks: [`gpu_config_from_env`], opened.
pub fn open_gpu() -> anyhow::Result<Gpu> {
    Ok(Gpu::with_config(gpu_config_from_env()?)?)
}

/// The one GPU of a test binary ([`gpu_or_skip`], opened on first use and shared by its tests),
/// or `None` without a GPU. `what` names the tests in the skip notice.
pub fn shared_gpu(what: &str) -> Option<&'static Gpu> {
    static GPU: std::sync::OnceLock<Option<Gpu>> = std::sync::OnceLock::new();
    GPU.get_or_init(|| gpu_or_skip(what)).as_ref()
}

/// Random cases per property of a GPU test binary: `LADDER_GPU_CASES` when set (e.g. fewer under
/// compute-sanitizer), else `default`.
pub fn cases_per_property(default: u32) -> u32 {
    std::env::var("LADDER_GPU_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Whether `LADDER_REQUIRE_GPU=1` is set: a GPU test must then fail, not skip, without a GPU.
pub fn gpu_required() -> bool {
    std::env::var("LADDER_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The GPU for a test (outputs poisoned with NaN, launches synchronous), or `None` with a printed
/// notice when there is none.
///
/// # Panics
///
/// When `LADDER_REQUIRE_GPU=1` is set and no GPU can be opened: a GPU test must fail, not skip,
/// where a GPU is promised.
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    let opened = gpu_config_from_env()
        .and_then(|c| Ok(Gpu::with_config(c.poison_outputs(true).sync_launches(true))?));
    match opened {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            if gpu_required() {
                panic!("{test}: LADDER_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("{test}: skipped (no GPU: {e})");
            None
        }
    }
}

/// The 16-bit format of `dtype`, if it is one.
pub fn half_of(dtype: DType) -> Option<Half> {
    match dtype {
        DType::F16 => Some(Half::F16),
        DType::BF16 => Some(Half::BF16),
        DType::F32 => None,
    }
}

/// The case's tensors as the device will hold them (rounded to `dtype`), in `f64`.
pub fn device_inputs(case: &Case, dtype: DType) -> Inputs<f64> {
    rounded(&case.inputs::<f64>(), dtype)
}

/// `x` rounded to `dtype`, in `f64`.
pub fn rounded(x: &Inputs<f64>, dtype: DType) -> Inputs<f64> {
    let round = |t: &Array4<f64>| match half_of(dtype) {
        Some(h) => h.round_all(t),
        None => t.mapv(|v| v as f32 as f64),
    };
    Inputs { q: round(&x.q), k: round(&x.k), v: round(&x.v), d_o: round(&x.d_o) }
}

/// Attention options with the scale rounded to the `f32` the kernel uses, and the kernel's options
/// (without a score modifier or sinks: a CPU modifier is a closure the kernels cannot take; see
/// [`case_options`]).
pub fn options(attention: &AttentionOptions, d: usize) -> (AttentionOptions, Options) {
    let scale = attention.scale.unwrap_or(1.0 / (d as f64).sqrt()) as f32;
    (
        AttentionOptions { scale: Some(scale as f64), ..attention.clone() },
        Options {
            causal: attention.causal,
            scale: Some(scale),
            deterministic: false,
            window: kernel_window(attention.window),
            ..Options::default()
        },
    )
}

/// [`options`] for a case, with its modifier on both sides (the CPU closure and the CUDA source of
/// the same function, or the same sinks).
pub fn case_options(case: &Case) -> (AttentionOptions, Options) {
    let (attention, opts) = options(&case.attention(), case.shape.d);
    (attention, case.kernel_modifier(opts))
}

/// The reference crate's window as the kernels take it (the same two sides).
pub fn kernel_window(w: ladder_reference::Window) -> ladder_kernels::Window {
    ladder_kernels::Window { left: w.left, right: w.right }
}

/// `x` in `f32` (exact for inputs from [`rounded`]).
pub fn narrow(x: &Inputs<f64>) -> Inputs<f32> {
    let to32 = |a: &Array4<f64>| a.mapv(|v| v as f32);
    Inputs { q: to32(&x.q), k: to32(&x.k), v: to32(&x.v), d_o: to32(&x.d_o) }
}

fn upload(gpu: &Gpu, x: &Array4<f64>, dtype: DType) -> Result<Tensor, KernelError> {
    upload_in(gpu, x, dtype, Layout::Bhsd)
}

/// How the checks lay a `[batch, heads, seq, d]` input out in device memory: the kernel sees the
/// same logical tensor through its strides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, heads, seq, d]`, row-major: contiguous.
    Bhsd,
    /// `[batch, seq, heads, d]` in memory (what a projection produces), seen through
    /// `Tensor::transpose(1, 2)`.
    Bshd,
    /// Slot 0 of a `[batch, seq, 3, heads, d]` buffer (a packed QKV projection) whose other slots
    /// hold NaN: rows with gaps between them, where a read outside the view poisons the result.
    Packed,
}

impl Layout {
    /// Every layout the checks draw from.
    pub const ALL: [Layout; 3] = [Layout::Bhsd, Layout::Bshd, Layout::Packed];
}

/// Uploads `x` (`[batch, heads, seq, d]`) as `dtype` in `layout`.
pub fn upload_in(
    gpu: &Gpu,
    x: &Array4<f64>,
    dtype: DType,
    layout: Layout,
) -> Result<Tensor, KernelError> {
    let (b, h, s, d) = x.dim();
    match layout {
        Layout::Bhsd => {
            let values: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            gpu.upload(&values, x.shape(), dtype)
        }
        Layout::Bshd => {
            let bshd = x.view().permuted_axes([0, 2, 1, 3]);
            let values: Vec<f32> = bshd.iter().map(|&v| v as f32).collect();
            gpu.upload(&values, &[b, s, h, d], dtype)?.transpose(1, 2)
        }
        Layout::Packed => {
            let mut values = vec![f32::NAN; b * s * 3 * h * d];
            for ((bi, hi, si, c), &v) in x.indexed_iter() {
                values[(((bi * s + si) * 3) * h + hi) * d + c] = v as f32;
            }
            let strides = [s * 3 * h * d, d, 3 * h * d, 1];
            gpu.upload(&values, &[values.len()], dtype)?.as_strided(&[b, h, s, d], &strides)
        }
    }
}

fn download4(t: &Tensor, dims: [usize; 4]) -> anyhow::Result<Array4<f32>> {
    Ok(Array4::from_shape_vec(dims, t.to_f32_vec()?)?)
}

fn download3(t: &Tensor, dims: [usize; 3]) -> anyhow::Result<Array3<f32>> {
    Ok(Array3::from_shape_vec(dims, t.to_f32_vec()?)?)
}

/// The GPU FP8 path's options for the CPU rung's `fp8` (the GPU always uses block scales; the
/// rotation's seed carries over, so both rotate by the same map).
pub fn gpu_fp8(fp8: &Fp8Options) -> fa3::fp8::Fp8Options {
    fa3::fp8::Fp8Options { incoherent: fp8.incoherent }
}

/// The tiles the CPU `fa3-fp8` rung must quantise in to round exactly the numbers the GPU FP8
/// kernel rounds on `gpu` at head dim `d` with `n_kv` keys and `window`: the kernel's query block
/// and K/V tile (`fa3::fp8::tiles_on`: the `Gpu` configuration's tiles, `LADDER_FA3_TILES`, where
/// set).
pub fn fp8_cpu_tiles(
    gpu: &Gpu,
    d: usize,
    n_kv: usize,
    window: ladder_reference::Window,
) -> anyhow::Result<TileSizes> {
    let t = fa3::fp8::tiles_on(gpu, d, n_kv, window.is_some())?;
    Ok(TileSizes::new(t.br(), t.bc)?)
}

/// Runs the forward rung `rung` on `x` (already rounded to `dtype`); returns its output and the
/// kernel time (for the FP8 rung: quantisation and attention, with the CPU rung's default FP8
/// options; [`forward_fp8`] takes others).
pub fn forward(
    gpu: &Gpu,
    rung: GpuRung,
    x: &Inputs<f64>,
    opts: &Options,
    dtype: DType,
) -> anyhow::Result<(AttentionOutput<f32>, Duration)> {
    forward_fp8(gpu, rung, x, opts, dtype, &RungConfig::default().fp8)
}

/// [`forward`] with the FP8 rung's options `fp8` (other rungs ignore them).
pub fn forward_fp8(
    gpu: &Gpu,
    rung: GpuRung,
    x: &Inputs<f64>,
    opts: &Options,
    dtype: DType,
    fp8: &Fp8Options,
) -> anyhow::Result<(AttentionOutput<f32>, Duration)> {
    forward_in(gpu, rung, x, opts, dtype, fp8, Layout::Bhsd)
}

/// [`forward_fp8`] with Q, K and V in `layout`.
pub fn forward_in(
    gpu: &Gpu,
    rung: GpuRung,
    x: &Inputs<f64>,
    opts: &Options,
    dtype: DType,
    fp8: &Fp8Options,
    layout: Layout,
) -> anyhow::Result<(AttentionOutput<f32>, Duration)> {
    let [q, k, v] = [&x.q, &x.k, &x.v].map(|t| upload_in(gpu, t, dtype, layout));
    let (q, k, v) = (q?, k?, v?);
    let mut out = None;
    let ms = gpu.time_ms(|| {
        out = Some(match rung.kernels() {
            Kernels::Forward(run) => run(gpu, &q, &k, &v, opts)?,
            Kernels::ForwardFp8 { quantize, forward } => {
                forward(gpu, &quantize(gpu, &q, &k, &v, opts, &gpu_fp8(fp8))?)?
            }
            Kernels::Backward { .. } | Kernels::Decode(_) => {
                return Err(KernelError::Config(format!("{rung} is not a forward rung")));
            }
        });
        Ok(())
    })?;
    let out = out.expect("set by the timed closure");
    let (b, hq, n_q, d) = x.q.dim();
    let got = AttentionOutput {
        o: download4(&out.o, [b, hq, n_q, d])?,
        lse: download3(&out.lse, [b, hq, n_q])?,
        stats: Default::default(),
    };
    Ok((got, Duration::from_secs_f64(f64::from(ms) / 1e3)))
}

/// Runs the decoding rung `rung` on `x` (already rounded to `dtype`) as one decoding step: `x.q`'s
/// `n_q` rows are the new tokens, `x.k` and `x.v` a full contiguous cache (every sequence `n_kv`
/// long, the new tokens its last entries, causal among themselves). Returns the output, the
/// kernel time and what the call did ([`decode::forward_with_stats`] run once more, untimed: the
/// kernel and split count, and FlashDecoding++'s fallback rows).
pub fn decode(
    gpu: &Gpu,
    rung: GpuRung,
    x: &Inputs<f64>,
    opts: &DecodeOptions,
    dtype: DType,
) -> anyhow::Result<(AttentionOutput<f32>, Duration, DecodeStats)> {
    let Kernels::Decode(run) = rung.kernels() else {
        bail!("{rung} is not a decoding rung");
    };
    let (q, k, v) =
        (upload(gpu, &x.q, dtype)?, upload(gpu, &x.k, dtype)?, upload(gpu, &x.v, dtype)?);
    let (b, hq, n_q, d) = x.q.dim();
    let lengths = vec![x.k.dim().2; b];
    let cache = KvCache { k: &k, v: &v, lengths: &lengths };
    let mut out = None;
    let ms = gpu.time_ms(|| {
        out = Some(run(gpu, &q, cache.into(), opts)?);
        Ok(())
    })?;
    let out = out.expect("set by the timed closure");
    let (_, stats) = decode::forward_with_stats(gpu, &q, cache, &rung.decode_options(opts))?;
    let got = AttentionOutput {
        o: download4(&out.o, [b, hq, n_q, d])?,
        lse: download3(&out.lse, [b, hq, n_q])?,
        stats: Default::default(),
    };
    Ok((got, Duration::from_secs_f64(f64::from(ms) / 1e3), stats))
}

/// The oracle's tolerances for a GPU forward rung computing on `x` in `dtype`: twice the error of
/// naive attention in `f32` with `P` and `O` rounded to `dtype` (when 16-bit), plus the `f32`
/// rounding floor.
pub fn expected_forward(
    oracle: &Oracle,
    x: &Inputs<f64>,
    dtype: DType,
) -> anyhow::Result<Expected> {
    let x32 = narrow(x);
    let naive32 = naive::attention(x32.q.view(), x32.k.view(), x32.v.view(), &oracle.attention)?;
    let baseline = match half_of(dtype) {
        Some(h) => {
            let low =
                low_precision::attention(x.q.view(), x.k.view(), x.v.view(), &oracle.attention, h)?;
            AttentionOutput { o: low.o.mapv(|v| v as f32), ..naive32 }
        }
        None => naive32,
    };
    Ok(Expected::from_baseline(oracle, &baseline))
}

/// Runs the backward rung `rung` (after its forward pass) on `x`; returns `dQ, dK, dV` and the
/// backward's time.
pub fn backward(
    gpu: &Gpu,
    rung: GpuRung,
    x: &Inputs<f64>,
    opts: &Options,
    dtype: DType,
) -> anyhow::Result<(Gradients<f32>, Duration)> {
    backward_in(gpu, rung, x, opts, dtype, Layout::Bhsd)
}

/// [`backward`] with Q, K, V and dO in `layout`.
pub fn backward_in(
    gpu: &Gpu,
    rung: GpuRung,
    x: &Inputs<f64>,
    opts: &Options,
    dtype: DType,
    layout: Layout,
) -> anyhow::Result<(Gradients<f32>, Duration)> {
    let Kernels::Backward { forward, backward, deterministic } = rung.kernels() else {
        bail!("{rung} is not a backward rung");
    };
    let [q, k, v, d_o] = [&x.q, &x.k, &x.v, &x.d_o].map(|t| upload_in(gpu, t, dtype, layout));
    let (q, k, v, d_o) = (q?, k?, v?, d_o?);
    let opts = &Options { deterministic, ..opts.clone() };
    let out = forward(gpu, &q, &k, &v, opts)?;
    let mut grads = None;
    let ms = gpu.time_ms(|| {
        grads = Some(backward(gpu, &q, &k, &v, &out, &d_o, opts)?);
        Ok(())
    })?;
    let g = grads.expect("set by the timed closure");
    let got = Gradients {
        dq: download4(&g.dq, dims(&x.q))?,
        dk: download4(&g.dk, dims(&x.k))?,
        dv: download4(&g.dv, dims(&x.v))?,
        dsinks: match &g.dsinks {
            Some(t) => Some(Array1::from(t.to_f32_vec()?)),
            None => None,
        },
        stats: Default::default(),
    };
    Ok((got, Duration::from_secs_f64(f64::from(ms) / 1e3)))
}

fn dims(a: &Array4<f64>) -> [usize; 4] {
    let (a0, a1, a2, a3) = a.dim();
    [a0, a1, a2, a3]
}

/// Tolerances for the GPU backward on `x` in the 16-bit `dtype`: twice the error of the naive
/// backward pass with the kernel's 16-bit roundings, plus the `f32` floor.
pub fn expected_backward(
    oracle: &GradientOracle,
    x: &Inputs<f64>,
    dtype: DType,
) -> anyhow::Result<ExpectedGradients> {
    let half = half_of(dtype).ok_or_else(|| anyhow::anyhow!("the backward kernels are 16-bit"))?;
    let low = low_precision::backward(
        x.q.view(),
        x.k.view(),
        x.v.view(),
        x.d_o.view(),
        &oracle.attention,
        half,
    )?;
    let to32 = |a: &Array4<f64>| a.mapv(|v| v as f32);
    let baseline = Gradients {
        dq: to32(&low.dq),
        dk: to32(&low.dk),
        dv: to32(&low.dv),
        dsinks: low.dsinks.map(|d| d.mapv(|v| v as f32)),
        stats: low.stats,
    };
    Ok(ExpectedGradients::from_baseline(oracle, &baseline))
}

/// The GPU gradients `got` against the CPU FA2 backward pass on the same inputs `x32`: for each of
/// `dQ, dK, dV`, the error between the two and its tolerance, the sum of the GPU rung's
/// (`expected`) and the CPU rung's tolerances against the oracle (each may be off the oracle by
/// its own, so together by the sum).
pub fn vs_cpu_backward(
    oracle: &GradientOracle,
    x32: &Inputs<f32>,
    got: &Gradients<f32>,
    expected: &ExpectedGradients,
) -> anyhow::Result<[(ErrorStats, Tolerance); 3]> {
    let opts = Fa2Options::new(oracle.attention.clone());
    let (q, k, v, d_o) = (x32.q.view(), x32.k.view(), x32.v.view(), x32.d_o.view());
    let fwd = cpu_fa2::forward(q, k, v, &opts)?;
    let cpu = cpu_fa2::backward(q, k, v, fwd.o.view(), d_o, fwd.lse.view(), &opts)?;
    let cpu_expected = ExpectedGradients::from_oracle(oracle, x32)?;
    let pairs = [(&got.dq, &cpu.dq), (&got.dk, &cpu.dk), (&got.dv, &cpu.dv)];
    Ok(std::array::from_fn(|t| {
        let (gpu_t, cpu_t) = pairs[t];
        let oracle_t = [&oracle.grads.dq, &oracle.grads.dk, &oracle.grads.dv][t];
        let err = error_between_in_units_of(gpu_t, cpu_t, oracle_t);
        (err, expected.tolerances[t].plus(cpu_expected.tolerances[t]))
    }))
}
