//! How fast FlashDecoding and FlashDecoding++ read the KV cache: bytes of K and V per second for
//! the decode shapes of the project's benchmarks (one new token, d = 128, fp16), per kernel
//! (FlashDecoding, FlashDecoding++'s GEMV and flat GEMM, and the automatic choice), with the split
//! count of the heuristic and with a sweep of fixed counts: the numbers the dispatcher's
//! crossovers (`decode::GEMV_MAX_ROWS`, `FLAT_GEMM_MAX_ROWS`, `PP_MIN_KEYS`) are to be set from.
//!
//! ```sh
//! cargo run --release -p ladder-kernels --example decode_bandwidth
//! ```
//! Without a GPU it says so and exits with status 1. Timings are CUDA events around 20 calls,
//! after 3 warm-up calls; the cache is several times the L2, so it is read from HBM.

use ladder_kernels::decode::{self, DecodeOptions, KvCache, Strategy};
use ladder_kernels::{DType, Gpu};

fn main() {
    if let Err(e) = run() {
        eprintln!("decode_bandwidth: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::new()?;
    println!("{} ({}), {} SMs", gpu.name(), gpu.arch(), gpu.sm_count());
    println!(
        "{:>3} {:>9} {:>7} {:>15} {:>15} {:>7} {:>10} {:>8}",
        "B", "heads", "L", "strategy", "ran", "splits", "ms", "TB/s"
    );
    let d = 128;
    for (b, hq, hkv, len) in [
        (1, 32, 32, 8192),
        (1, 32, 32, 131072),
        (16, 32, 32, 32768),
        (1, 32, 8, 8192),
        (16, 32, 8, 32768),
    ] {
        let q = gpu.upload(&vec![0.01; b * hq * d], &[b, hq, 1, d], DType::F16)?;
        let kv_len = b * hkv * len * d;
        // Small varied values (not zeros: a kernel can run faster on zeros than on real data).
        let values: Vec<f32> =
            (0..kv_len).map(|i| ((i * 7919) % 2003) as f32 / 2003.0 - 0.5).collect();
        let k = gpu.upload(&values, &[b, hkv, len, d], DType::F16)?;
        let v = gpu.upload(&values, &[b, hkv, len, d], DType::F16)?;
        let lengths = vec![len; b];
        let cache = KvCache { k: &k, v: &v, lengths: &lengths };
        let bytes = 2.0 * (kv_len * 2) as f64;
        let strategies =
            [Strategy::FlashDecoding, Strategy::Gemv, Strategy::FlatGemm, Strategy::Auto];
        for strategy in strategies {
            for splits in [None, Some(1), Some(4), Some(16), Some(64)] {
                let opts = DecodeOptions { splits, strategy, ..DecodeOptions::default() };
                for _ in 0..3 {
                    decode::forward(&gpu, &q, cache, &opts)?;
                }
                let ms = gpu.time_ms(|| {
                    for _ in 0..20 {
                        decode::forward(&gpu, &q, cache, &opts)?;
                    }
                    Ok(())
                })? / 20.0;
                let (_, stats) = decode::forward_with_stats(&gpu, &q, cache, &opts)?;
                let label = splits.map_or(format!("auto {}", stats.plan.splits), |s| s.to_string());
                let tbps = bytes / (f64::from(ms) * 1e-3) / 1e12;
                println!(
                    "{b:>3} {:>9} {len:>7} {strategy:>15} {:>15} {label:>7} {ms:>10.4} {tbps:>8.2}",
                    format!("{hq}/{hkv}"),
                    stats.plan.strategy
                );
            }
        }
    }
    Ok(())
}
