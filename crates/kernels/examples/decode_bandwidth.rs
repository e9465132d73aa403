//! How fast FlashDecoding and FlashDecoding++ read the KV cache: bytes of K and V per second for
//! the decode shapes of the project's benchmarks (one new token, d = 128, fp16), per kernel
//! (FlashDecoding, FlashDecoding++'s GEMV and flat GEMM, and the automatic choice), with the split
//! count of the heuristic and with a sweep of fixed counts: the numbers the dispatcher's
//! crossovers (`decode::GEMV_MAX_ROWS`, `FLAT_GEMM_MAX_ROWS`, `PP_MIN_KEYS`) are to be set from.
//!
//! ```sh
//! cargo run --release -p ladder-kernels --example decode_bandwidth [-- --new N --modifiers --page P --fd-only --no-pdl --stages S
//!     --shape B,HQ,HKV,L --splits auto,16 --nvrtc -DNAME=VALUE]
//! ```
//! `--new N`: N new tokens per sequence (default 1); `--modifiers`: FlashDecoding with the
//! heuristic's splits, plain and with each modifier serving needs (softcap 50, ALiBi, sinks, a
//! window of 4096 keys, all four), the bytes counted over the keys each call attends; `--page P`: the cache in pages of P tokens,
//! scattered in a shuffled order as a serving cache's pages are (default: contiguous);
//! `--fd-only`: FlashDecoding alone; `--no-pdl`: ordinary launches instead of programmatic ones
//! (`GpuConfig::programmatic_launch`); `--stages S`: S K/V stages instead of the default
//! (`decode::Stages`); `--shape B,HQ,HKV,L` (repeatable): these shapes instead of the
//! five of the benchmarks; `--splits auto,16`: these split counts instead of the sweep (`auto`,
//! 1, 4, 8, 16, 32, 64); `--nvrtc OPTION` (repeatable): an extra NVRTC option for every kernel,
//! e.g. a `-D` for an experiment (`GpuConfig::nvrtc_options`).
//! Without a GPU it says so and exits with status 1. Each figure is 20 calls into outputs
//! allocated once (`decode::forward_into`, as a serving loop calls it), after 3 warm-up calls,
//! rotating among copies of the cache that together are several times the L2, so that it is read
//! from HBM. Three times per call:
//!
//! - `ms`: CUDA events around the 20 calls as the host issues them (what `ladder bench` reports);
//! - `host µs`: the host's wall time to issue one call. Where it comes near `ms`, the GPU waits
//!   on the host, and `ms` measures the host;
//! - `gpu ms`: the same 20 calls queued behind a kernel that spins for 2 ms, so that the events
//!   time the GPU's work alone, the host out of the way.

use std::time::Instant;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use ladder_kernels::decode::{
    self, Cache, DecodeOptions, KvCache, PageTable, PagedKvCache, Strategy,
};
use ladder_kernels::{DType, Gpu, GpuConfig, KernelError, Output, ScoreMod, Sinks, Tensor, Window};
use rand::SeedableRng;
use rand::seq::SliceRandom;

/// The caches a shape rotates among span at least this many bytes (the H200's L2 is 50 MB).
const ROTATE_BYTES: usize = 200 << 20;
/// Calls per timing.
const CALLS: usize = 20;

/// Holds the stream for `ns` nanoseconds (of the GPU's global timer).
const SPIN: &str = r#"
extern "C" __global__ void spin(long long ns) {
    long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"#;

fn main() {
    if let Err(e) = run() {
        eprintln!("decode_bandwidth: {e}");
        std::process::exit(1);
    }
}

/// Milliseconds per call by events as issued, host microseconds per call, and milliseconds per
/// call with the queue filled behind `spin` first.
fn time_calls(
    gpu: &Gpu,
    spin: &CudaFunction,
    mut call: impl FnMut(usize) -> Result<(), KernelError>,
) -> Result<(f64, f64, f64), Box<dyn std::error::Error>> {
    for i in 0..3 {
        call(i)?;
    }
    let mut host_s = 0.0;
    let issued = gpu.time_ms(|| {
        let start = Instant::now();
        (0..CALLS).try_for_each(&mut call)?;
        host_s = start.elapsed().as_secs_f64();
        Ok(())
    })?;
    let mut spin_launch = gpu.stream().launch_builder(spin);
    let ns: i64 = 2_000_000;
    spin_launch.arg(&ns);
    // SAFETY: `spin` takes one i64 and touches no memory.
    unsafe { spin_launch.launch(LaunchConfig::for_num_elems(1)) }?;
    let queued = gpu.time_ms(|| (0..CALLS).try_for_each(&mut call))?;
    let per_call = |ms: f32| f64::from(ms) / CALLS as f64;
    Ok((per_call(issued), host_s / CALLS as f64 * 1e6, per_call(queued)))
}

/// The reference decode shapes: batch, query heads, kv heads, cache length.
const SHAPES: [(usize, usize, usize, usize); 5] = [
    (1, 32, 32, 8192),
    (1, 32, 32, 131072),
    (16, 32, 32, 32768),
    (1, 32, 8, 8192),
    (16, 32, 8, 32768),
];

/// The command line: new tokens, page size (0: contiguous), FlashDecoding only, no programmatic
/// launches, K/V stages (0: default), shapes, split counts (`None`: the heuristic's), NVRTC
/// options.
struct Args {
    new: usize,
    modifiers: bool,
    page: usize,
    fd_only: bool,
    no_pdl: bool,
    stages: usize,
    shapes: Vec<(usize, usize, usize, usize)>,
    splits: Vec<Option<usize>>,
    nvrtc: Vec<String>,
}

/// `text` as comma-separated numbers.
fn numbers(flag: &str, text: &str) -> Result<Vec<usize>, String> {
    text.split(',').map(|v| v.trim().parse().map_err(|e| format!("{flag} {text}: {e}"))).collect()
}

/// `text` as one number.
fn number(flag: &str, text: &str) -> Result<usize, String> {
    text.trim().parse().map_err(|e| format!("{flag} {text}: {e}"))
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        new: 1,
        modifiers: false,
        page: 0,
        fd_only: false,
        no_pdl: false,
        stages: 0,
        shapes: Vec::new(),
        splits: vec![None, Some(1), Some(4), Some(8), Some(16), Some(32), Some(64)],
        nvrtc: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut text = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--new" => a.new = number(&flag, &text()?)?,
            "--modifiers" => a.modifiers = true,
            "--page" => a.page = number(&flag, &text()?)?,
            "--fd-only" => a.fd_only = true,
            "--no-pdl" => a.no_pdl = true,
            "--stages" => a.stages = number(&flag, &text()?)?,
            "--shape" => match numbers(&flag, &text()?)?[..] {
                [b, hq, hkv, len] if b > 0 && hkv > 0 && len > 0 && hq % hkv == 0 && hq > 0 => {
                    a.shapes.push((b, hq, hkv, len))
                }
                _ => {
                    let rule = "positive, with HQ a multiple of HKV";
                    return Err(format!("{flag} takes B,HQ,HKV,L, {rule}").into());
                }
            },
            "--splits" => {
                a.splits = text()?
                    .split(',')
                    .map(|v| match v.trim() {
                        "auto" => Ok(None),
                        n => n.parse().map(Some).map_err(|e| format!("{flag} {n}: {e}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--nvrtc" => a.nvrtc.push(text()?),
            _ => {
                let known = "--new N, --modifiers, --page P, --fd-only, --no-pdl, --stages S, \
                             --shape B,HQ,HKV,L, --splits auto,N,..., --nvrtc OPTION";
                return Err(format!("unknown argument {flag} ({known})").into());
            }
        }
    }
    if a.shapes.is_empty() {
        a.shapes = SHAPES.to_vec();
    }
    if a.page > 0 {
        if let Some(&(_, _, _, len)) = a.shapes.iter().find(|s| s.3 % a.page != 0) {
            let page = a.page;
            return Err(format!("--page {page}: a cache of {len} tokens is not whole pages").into());
        }
    }
    Ok(a)
}

/// FlashDecoding's options for `--modifiers`, by name: plain, then each modifier serving needs
/// (softcap 50, ALiBi with the paper's slopes for `heads_q` heads, sinks, a window of 4096 keys),
/// then all four.
fn modified(heads_q: usize) -> Result<Vec<(&'static str, DecodeOptions)>, KernelError> {
    let fd = DecodeOptions { strategy: Strategy::FlashDecoding, ..DecodeOptions::default() };
    let slopes = (1..=heads_q).map(|k| 2f32.powf(-8.0 * k as f32 / heads_q as f32)).collect();
    let alibi = ScoreMod::alibi(slopes)?;
    let sinks = Sinks::new((0..heads_q).map(|h| h as f32 * 0.1 - 1.0).collect())?;
    let window = Window::left(4095);
    let all = fd.clone().with_softcap(50.0)?.with_score_mod(alibi.clone());
    Ok(vec![
        ("plain", fd.clone()),
        ("softcap 50", fd.clone().with_softcap(50.0)?),
        ("alibi", fd.clone().with_score_mod(alibi)),
        ("sinks", fd.clone().with_sinks(sinks.clone())),
        ("window 4096", fd.with_window(window)),
        ("all four", all.with_sinks(sinks).with_window(window)),
    ])
}

/// K and V of one copy of the cache, contiguous `[b, hkv, len, d]` or in shuffled pages
/// `[pages, hkv, page, d]`.
struct CacheCopy {
    k: Tensor,
    v: Tensor,
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let mut config =
        GpuConfig::new().programmatic_launch(!args.no_pdl).nvrtc_options(args.nvrtc.clone());
    if args.stages > 0 {
        config = config.tune(ladder_kernels::decode::Stages(args.stages));
    }
    let gpu = Gpu::with_config(config)?;
    println!("{} ({}), {} SMs", gpu.name(), gpu.arch(), gpu.sm_count());
    let layout = if args.page == 0 {
        "contiguous".to_string()
    } else {
        format!("pages of {} (shuffled)", args.page)
    };
    let launch = if args.no_pdl { "ordinary" } else { "programmatic" };
    let stages = match args.stages {
        0 => format!("{} K/V stages (default)", decode::stages(gpu.arch())),
        s => format!("{s} K/V stages"),
    };
    println!("{} new token(s), cache {layout}, {launch} launches, {stages}", args.new);
    if !args.nvrtc.is_empty() {
        println!("NVRTC options: {}", args.nvrtc.join(" "));
    }
    let spin =
        gpu.context().load_module(cudarc::nvrtc::compile_ptx(SPIN)?)?.load_function("spin")?;
    if args.modifiers {
        let columns = ["B", "heads", "L", "modifier", "keys", "ms", "TB/s", "×plain"];
        println!(
            "{:>3} {:>9} {:>7} {:>22} {:>7} {:>10} {:>8} {:>6}",
            columns[0],
            columns[1],
            columns[2],
            columns[3],
            columns[4],
            columns[5],
            columns[6],
            columns[7]
        );
    } else {
        println!(
            "{:>3} {:>9} {:>7} {:>15} {:>15} {:>7} {:>10} {:>8} {:>8} {:>10} {:>8}",
            "B",
            "heads",
            "L",
            "strategy",
            "ran",
            "splits",
            "ms",
            "TB/s",
            "host µs",
            "gpu ms",
            "gpu TB/s"
        );
    }
    let d = 128;
    for &(b, hq, hkv, len) in &args.shapes {
        let new = args.new;
        let q = gpu.upload(&vec![0.01; b * hq * new * d], &[b, hq, new, d], DType::F16)?;
        let kv_len = b * hkv * len * d;
        // Small varied values (not zeros: a kernel can run faster on zeros than on real data).
        let values: Vec<f32> =
            (0..kv_len).map(|i| ((i * 7919) % 2003) as f32 / 2003.0 - 0.5).collect();
        let copies = ROTATE_BYTES.div_ceil(2 * kv_len * 2).max(1);
        // Pages per sequence, when paged.
        let pages = len.checked_div(args.page);
        let kv_shape = match pages {
            None => vec![b, hkv, len, d],
            Some(n) => vec![b * n, hkv, args.page, d],
        };
        let kv = (0..copies)
            .map(|_| {
                let k = gpu.upload(&values, &kv_shape, DType::F16)?;
                let v = gpu.upload(&values, &kv_shape, DType::F16)?;
                Ok(CacheCopy { k, v })
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        let lengths = vec![len; b];
        // Paged: every page of every sequence somewhere in the pool, in a shuffled order.
        let table = match pages {
            None => None,
            Some(n) => {
                let mut entries: Vec<i32> = (0..(b * n) as i32).collect();
                entries.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(7));
                Some(PageTable::upload(&gpu, &entries, b, n)?)
            }
        };
        let cache = |i: usize| -> Cache<'_> {
            let c = &kv[i % copies];
            match &table {
                None => KvCache { k: &c.k, v: &c.v, lengths: &lengths }.into(),
                Some(t) => {
                    PagedKvCache { k_pages: &c.k, v_pages: &c.v, page_table: t, lengths: &lengths }
                        .into()
                }
            }
        };
        let mut out = Output {
            o: gpu.zeros(&[b, hq, new, d], DType::F16)?,
            lse: gpu.zeros(&[b, hq, new], DType::F32)?,
        };
        let bytes = 2.0 * (kv_len * 2) as f64;
        let tbps = |ms: f64| bytes / (ms * 1e-3) / 1e12;
        if args.modifiers {
            let mut plain_tbps = 0.0;
            for (name, opts) in modified(hq)? {
                let (ms, _, _) = time_calls(&gpu, &spin, |i| {
                    decode::forward_into(&gpu, &q, cache(i), &opts, &mut out)
                })?;
                // The keys a call attends (a window's, at most), of every sequence and kv head.
                let keys = opts.window.left.map_or(len, |left| len.min(left + new));
                let rate = 2.0 * (b * hkv * keys * d * 2) as f64 / (ms * 1e-3) / 1e12;
                if name == "plain" {
                    plain_tbps = rate;
                }
                println!(
                    "{b:>3} {:>9} {len:>7} {name:>22} {keys:>7} {ms:>10.4} {rate:>8.2} {:>6.3}",
                    format!("{hq}/{hkv}"),
                    rate / plain_tbps
                );
            }
            continue;
        }
        let strategies =
            [Strategy::FlashDecoding, Strategy::Gemv, Strategy::FlatGemm, Strategy::Auto];
        let strategies = if args.fd_only { &strategies[..1] } else { &strategies[..] };
        for &strategy in strategies {
            for &splits in &args.splits {
                let opts = DecodeOptions { splits, strategy, ..DecodeOptions::default() };
                let (ms, host_us, gpu_ms) = time_calls(&gpu, &spin, |i| {
                    decode::forward_into(&gpu, &q, cache(i), &opts, &mut out)
                })?;
                let (_, stats) = decode::forward_with_stats(&gpu, &q, cache(0), &opts)?;
                let label = splits.map_or(format!("auto {}", stats.plan.splits), |s| s.to_string());
                println!(
                    "{b:>3} {:>9} {len:>7} {strategy:>15} {:>15} {label:>7} {ms:>10.4} {:>8.2} \
                     {host_us:>8.1} {gpu_ms:>10.4} {:>8.2}",
                    format!("{hq}/{hkv}"),
                    stats.plan.strategy,
                    tbps(ms),
                    tbps(gpu_ms)
                );
            }
        }
    }
    Ok(())
}
