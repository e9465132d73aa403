//! What ring attention costs on one GPU: the whole sequence attended at once
//! (`attention::forward`, FA3 on Hopper) against the same sequence on `P` simulated ranks
//! (`ring::forward`: every chunk pair one kernel call, its partial merged in f32, the K/V slices
//! copied to the next rank on a second stream). bf16, d = 128, 8 query heads over 2 KV heads
//! (the GQA of a Llama-3-8B layer at a quarter of its heads), 16k and 64k tokens, causal, zigzag.
//!
//! One GPU runs every rank's work one after another, so under the zigzag, whose ranks work alike
//! at every step, the simulated ring's time over `P` is what a ring of `P` GPUs would take if its
//! transfers hid completely: the last column, the whole sequence's time over the ring's, is the
//! efficiency of the steps' kernels on slices (with the merges) against one kernel on the whole
//! sequence, the factor that multiplies `P` in the ring's speed-up. TFLOP/s count the pairs the
//! causal mask keeps (4 · d FLOPs a pair).
//!
//! ```sh
//! cargo run --release -p ladder-kernels --example ring_speed
//! ```
//!
//! Without a GPU it says so and exits with status 1.

use ladder_kernels::ring::{self, RingOptions};
use ladder_kernels::{DType, Gpu, Options, attention};

mod timing;
use timing::median_ms;

const D: usize = 128;
const HEADS_Q: usize = 8;
const HEADS_KV: usize = 2;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::new()?;
    println!("{} ({}), bf16, d = {D}, {HEADS_Q}/{HEADS_KV} heads, causal", gpu.name(), gpu.arch());
    println!(
        "{:>6} {:>3} {:>11} {:>9} {:>8} {:>11}",
        "n", "P", "sharding", "ms", "TFLOP/s", "× whole"
    );
    let opts = Options::causal();
    for n in [16384, 65536] {
        let values = |seed: usize, heads: usize| -> Vec<f32> {
            (0..heads * n * D).map(|i| ((i * 7919 + seed) % 1000) as f32 / 1000.0 - 0.5).collect()
        };
        let q = gpu.upload(&values(0, HEADS_Q), &[1, HEADS_Q, n, D], DType::BF16)?;
        let k = gpu.upload(&values(333, HEADS_KV), &[1, HEADS_KV, n, D], DType::BF16)?;
        let v = gpu.upload(&values(667, HEADS_KV), &[1, HEADS_KV, n, D], DType::BF16)?;
        let flops = 4.0 * D as f64 * (n * (n + 1) / 2) as f64 * HEADS_Q as f64;
        let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;
        let whole = median_ms(&gpu, || attention::forward(&gpu, &q, &k, &v, &opts).map(drop))?;
        println!(
            "{n:>6} {:>3} {:>11} {whole:>9.3} {:>8.1} {:>11}",
            1,
            "whole",
            tflops(whole),
            "1.00"
        );
        for p in [2, 4, 8] {
            let ring_opts = RingOptions::new(p);
            let ms =
                median_ms(&gpu, || ring::forward(&gpu, &q, &k, &v, &opts, &ring_opts).map(drop))?;
            let (t, x) = (tflops(ms), whole / ms);
            println!("{n:>6} {p:>3} {:>11} {ms:>9.3} {t:>8.1} {x:>11.2}", "zigzag");
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("ring_speed: {e}");
        std::process::exit(1);
    }
}
