//! What a mask modifier costs and saves in the FA2 and FA3 forwards (FA3 on Hopper): fp16,
//! d = 128, 16 heads, 16k tokens per call (n = 8k and 16k), causal, plain against document masks
//! of 4 and 16 equal documents and of 16 documents of uneven lengths (n / 16 ± 100 tokens, whose
//! boundaries fall inside tiles); not causal, plain against a prefix-LM mask of n / 4 keys. TFLOP/s
//! count the pairs each mask attends (4 · d FLOPs a pair). A mask keeps the block mask it made at
//! its first call of a shape: the timed calls reuse it, as a training loop that keeps its mask
//! does; the last column times calls that each make a new mask (its table uploaded and its block
//! mask computed again), what a loop that rebuilds its mask every step pays; the backward
//! columns time the rung's backward pass (dO = Q) on the kept mask, TFLOP/s counting 2.5× the
//! forward's FLOPs.
//!
//! ```sh
//! cargo run --release -p ladder-kernels --example mask_mod_speed
//! ```
//!
//! `FA3_TILES=bc,consumers,stages` runs FA3 on those tiles instead of its own (an experiment;
//! `fa3::Fa3Tiles`), `FA3_SCHEDULE=no-persistent` (or `no-pingpong`, `no-overlap`, comma-separated)
//! on that schedule (`fa3::Schedule`); `ONLY=TEXT` runs only the rows whose `rung n mask` contains TEXT (e.g.
//! `ONLY="fa3 16384 Documents(16)"`, one case to profile); `RELEASE_FREED_MEMORY=1` gives the calls'
//! temporaries back to the system at every synchronisation (`GpuConfig::release_freed_memory`,
//! the driver's default) to show what keeping them saves. Without a GPU it says so and exits with status 1. Each figure is the median of 10 calls timed
//! with CUDA events, after 3 warm-up calls.

use ladder_kernels::{
    DType, Gpu, GpuConfig, Gradients, MaskMod, Options, Output, Result, Tensor, fa2, fa3,
};

mod timing;
use timing::median_ms;

const D: usize = 128;
const HEADS: usize = 16;
const TOKENS: usize = 16384;

/// Pairs query `i` of `n` sees: causal, within its document (`docs` equal documents), or all the
/// first `prefix` keys and causally after them.
fn pairs(n: usize, mask: &Mask) -> u64 {
    let n = n as u64;
    match *mask {
        Mask::Causal => n * (n + 1) / 2,
        Mask::Documents(_) | Mask::Ragged(_) => {
            mask.lengths(n as usize).iter().map(|&len| (len * (len + 1) / 2) as u64).sum()
        }
        Mask::Full => n * n,
        Mask::PrefixLm(p) => (0..n).map(|i| (i + 1).max(p as u64)).sum(),
    }
}

#[derive(Clone, Copy, Debug)]
enum Mask {
    Causal,
    Documents(usize),
    Ragged(usize),
    Full,
    PrefixLm(usize),
}

impl Mask {
    /// The document lengths of a document mask over `n` tokens: equal, or alternately 100 tokens
    /// longer and shorter than `n / docs` (the last takes what is left).
    fn lengths(self, n: usize) -> Vec<usize> {
        match self {
            Mask::Documents(docs) => vec![n / docs; docs],
            Mask::Ragged(docs) => {
                let mut lens: Vec<usize> = (0..docs)
                    .map(|i| if i % 2 == 0 { n / docs + 100 } else { n / docs - 100 })
                    .collect();
                lens[docs - 1] = n - lens[..docs - 1].iter().sum::<usize>();
                lens
            }
            _ => Vec::new(),
        }
    }

    /// The options of this mask for `n` tokens (a new `MaskMod` at each call).
    fn options(self, n: usize) -> Result<Options> {
        Ok(match self {
            Mask::Causal => Options::causal(),
            Mask::Documents(_) | Mask::Ragged(_) => {
                Options::causal().with_mask_mod(MaskMod::document_lengths(&self.lengths(n))?)
            }
            Mask::Full => Options::full(),
            Mask::PrefixLm(p) => Options::full().with_mask_mod(MaskMod::prefix_lm(p)?),
        })
    }
}

type Forward = fn(&Gpu, &Tensor, &Tensor, &Tensor, &Options) -> Result<Output>;
type Backward =
    fn(&Gpu, &Tensor, &Tensor, &Tensor, &Output, &Tensor, &Options) -> Result<Gradients>;

fn run() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut config = GpuConfig::default();
    if let Ok(text) = std::env::var("FA3_TILES") {
        let t: Vec<usize> =
            text.split(',').map(str::parse).collect::<std::result::Result<_, _>>()?;
        let [bc, consumers, stages] = t[..] else {
            return Err(format!("FA3_TILES={text}: expected bc,consumers,stages").into());
        };
        config = config.tune(fa3::Fa3Tiles::new(bc, consumers, stages)?);
    }
    if let Ok(text) = std::env::var("FA3_SCHEDULE") {
        let mut schedule = fa3::Schedule::for_head_dim(D, false);
        for flag in text.split(',') {
            match flag {
                "no-persistent" => schedule.persistent = false,
                "no-pingpong" => schedule.pingpong = false,
                "no-overlap" => schedule.overlap = false,
                _ => return Err(format!("FA3_SCHEDULE: unknown {flag}").into()),
            }
        }
        config = config.tune(schedule);
    }
    if std::env::var_os("RELEASE_FREED_MEMORY").is_some() {
        config = config.release_freed_memory(true);
    }
    let gpu = Gpu::with_config(config)?;
    println!(
        "{} ({}), fp16, d = {D}, {HEADS} heads, {TOKENS} tokens per call",
        gpu.name(),
        gpu.arch()
    );
    let mut rungs: Vec<(&str, Forward, Backward)> = vec![("fa2", fa2::forward, fa2::backward)];
    if gpu.arch() == fa3::ARCH {
        rungs.push(("fa3", fa3::forward, fa3::backward));
    }
    println!(
        "{:>4} {:>6} {:>16} {:>10} {:>8} {:>8} {:>14} {:>8} {:>8}",
        "rung", "n", "mask", "ms", "TFLOP/s", "×plain", "ms (new mask)", "bwd ms", "TFLOP/s"
    );
    for (rung, forward, backward) in rungs {
        for n in [8192, 16384] {
            let batch = TOKENS / n;
            let shape = [batch, HEADS, n, D];
            // Fixed pseudo-random values in [-0.5, 0.5), a different stretch of them for K.
            let values = |seed: usize| -> Vec<f32> {
                (0..batch * HEADS * n * D)
                    .map(|i| ((i * 7919 + seed) % 1000) as f32 / 1000.0 - 0.5)
                    .collect()
            };
            let q = gpu.upload(&values(0), &shape, DType::F16)?;
            let k = gpu.upload(&values(333), &shape, DType::F16)?;
            let v = gpu.upload(&values(667), &shape, DType::F16)?;
            let cases = [
                Mask::Causal,
                Mask::Documents(4),
                Mask::Documents(16),
                Mask::Ragged(16),
                Mask::Full,
                Mask::PrefixLm(n / 4),
            ];
            let mut plain_tflops = 0.0;
            let d_o = &q;
            let only = std::env::var("ONLY").unwrap_or_default();
            for mask in cases {
                if !format!("{rung} {n} {mask:?}").contains(&only) {
                    continue;
                }
                let kept = mask.options(n)?;
                let ms = median_ms(&gpu, || forward(&gpu, &q, &k, &v, &kept).map(drop))?;
                let flops = 4.0 * D as f64 * pairs(n, &mask) as f64 * (batch * HEADS) as f64;
                let tflops = flops / (ms * 1e-3) / 1e12;
                let new_mask = if kept.mask_mod.is_some() {
                    let ms =
                        median_ms(&gpu, || forward(&gpu, &q, &k, &v, &mask.options(n)?).map(drop))?;
                    format!("{ms:.3}")
                } else {
                    plain_tflops = tflops;
                    "-".to_string()
                };
                let out = forward(&gpu, &q, &k, &v, &kept)?;
                let bwd =
                    median_ms(&gpu, || backward(&gpu, &q, &k, &v, &out, d_o, &kept).map(drop))?;
                let bwd_tflops = 2.5 * flops / (bwd * 1e-3) / 1e12;
                let label = format!("{mask:?}");
                println!(
                    "{rung:>4} {n:>6} {label:>16} {ms:>10.3} {tflops:>8.1} {:>8.2} {new_mask:>14} \
                     {bwd:>8.3} {bwd_tflops:>8.1}",
                    tflops / plain_tflops
                );
            }
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("mask_mod_speed: {e}");
        std::process::exit(1);
    }
}
