//! FA2 forward and a deterministic backward on buffers the caller owns.
//!
//! The buffers are plain cudarc `CudaSlice`s, as a cudarc or candle user already has them: they
//! are wrapped as `Tensor`s without a copy, the kernels run on the caller's stream, and the
//! results are handed back as `CudaSlice`s. One output row is checked against a float64 softmax
//! computed here on the CPU.
//!
//! ```sh
//! cargo run --release -p ladder-kernels --example own_buffers
//! ```
//! Without a GPU it says so and exits with status 1.

use half::f16;
use ladder_kernels::cudarc::driver::CudaSlice;
use ladder_kernels::{Gpu, GpuConfig, KernelError, Options, Tensor, fa2};

fn main() {
    if let Err(e) = run() {
        eprintln!("own_buffers: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // Your stream, from your own context (here: a fresh one on device 0). cudarc loads libcuda on
    // first use, and panics without it: ask first.
    if !ladder_kernels::driver_library_present() {
        return Err("no CUDA driver (libcuda.so) on this machine".into());
    }
    let ctx = ladder_kernels::cudarc::driver::CudaContext::new(0)
        .map_err(|e| KernelError::NoCuda(e.to_string()))?; // no GPU: a clear error, not a panic
    let stream = ctx.default_stream();
    let gpu = Gpu::from_stream(stream.clone(), GpuConfig::new())?;
    println!(
        "{} ({}, {} SMs, CUDA {})",
        gpu.name(),
        gpu.arch(),
        gpu.sm_count(),
        gpu.cuda_version()?
    );

    // Grouped-query attention: 8 query heads share 2 key/value heads.
    let (b, hq, hkv, n, d) = (2, 8, 2, 1000, 128);
    let values = |len: usize, seed: usize| -> Vec<f16> {
        (0..len).map(|i| f16::from_f32((((i * 7919 + seed) % 1000) as f32 / 500.0) - 1.0)).collect()
    };
    let host_q = values(b * hq * n * d, 1);
    let host_k = values(b * hkv * n * d, 2);
    let host_v = values(b * hkv * n * d, 3);
    let copy = |h: &[f16]| stream.clone_htod(h);

    // Wrap, no copy.
    let q = Tensor::from_cuda_slice(copy(&host_q)?, &[b, hq, n, d])?;
    let k = Tensor::from_cuda_slice(copy(&host_k)?, &[b, hkv, n, d])?;
    let v = Tensor::from_cuda_slice(copy(&host_v)?, &[b, hkv, n, d])?;

    let opts = Options::causal().deterministic();
    let out = fa2::forward(&gpu, &q, &k, &v, &opts)?;
    let d_o = Tensor::from_cuda_slice(copy(&values(b * hq * n * d, 4))?, &[b, hq, n, d])?;
    let grads = fa2::backward(&gpu, &q, &k, &v, &out, &d_o, &opts)?;
    println!("O {:?} lse {:?} dK {:?}", out.o.shape(), out.lse.shape(), grads.dk.shape());

    // Hand the output back as your own buffer.
    let o: CudaSlice<f16> = out.o.into_cuda_slice()?;
    let o_host: Vec<f16> = stream.clone_dtoh(&o)?;

    // Check one row (batch 1, head 5, query 777) against a float64 softmax.
    let (bi, h, i) = (1, 5, 777);
    let kh = h / (hq / hkv);
    let row = |x: &[f16], heads: usize, head: usize, r: usize| -> Vec<f64> {
        let at = ((bi * heads + head) * n + r) * d;
        x[at..at + d].iter().map(|v| v.to_f64()).collect()
    };
    let qi = row(&host_q, hq, h, i);
    let scale = 1.0 / (d as f64).sqrt();
    let scores: Vec<f64> =
        (0..=i) // causal, n_q == n_kv: keys 0..=i
            .map(|j| {
                scale * qi.iter().zip(row(&host_k, hkv, kh, j)).map(|(a, b)| a * b).sum::<f64>()
            })
            .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = weights.iter().sum();
    let mut want = vec![0.0; d];
    for (j, w) in weights.iter().enumerate() {
        for (c, x) in row(&host_v, hkv, kh, j).iter().enumerate() {
            want[c] += w / sum * x;
        }
    }
    let got = row(&o_host, hq, h, i);
    let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max);
    println!("row ({bi}, {h}, {i}): max |O - float64 softmax| = {worst:.2e}");
    // fp16 output: half an ulp of values below 1 is at most 2^-12.
    if worst > 2f64.powi(-10) {
        return Err(format!("row differs from the reference by {worst:e}").into());
    }
    Ok(())
}
