//! ladder-candle against candle's own attention on a GPU: a Qwen2-architecture model's prefill and
//! decoding throughput, and the attention op alone.
//!
//! ```text
//! cargo run --release -p ladder-candle --features cuda --example candle_bench -- all
//! cargo run --release -p ladder-candle --features bench-candle-flash-attn --example candle_bench -- op
//! ```
//!
//! - `prefill`: 8 prompts of 1.8k–2.3k tokens (16,384 in all) through the model, tokens per second:
//!   this crate's model with its attention (`flash_attn_varlen`, the prompts packed), the same
//!   model with candle's attention (matmul, mask, softmax per prompt: `AttentionPath::Candle`), and
//!   candle-transformers' Qwen2 on the prompts padded to the longest (candle's own model; only the
//!   prompts' tokens are counted).
//! - `decode`: after prompts of 8,192 tokens, greedy decoding steps at batch 1 and 16, tokens per
//!   second: this crate's model (`KvCache::attend`, FlashDecoding) against the same model and cache
//!   with candle's attention (`AttentionPath::Candle`: each token's query against its cached keys,
//!   matmul and softmax) and candle-transformers' Qwen2 (its cache grown by `Tensor::cat`, matmul
//!   and softmax over it; it cannot prefill 16 prompts of 8k tokens in 16 bits).
//! - `op`: `flash_attn` alone at head dim 128, causal and not, 4k–16k tokens, TFLOP/s: this crate's
//!   against candle's matmul-softmax attention and (feature `bench-candle-flash-attn`)
//!   candle-flash-attn's.
//!
//! The model has Qwen2.5-1.5B's shapes (hidden 1536, 12 query heads over 2 key-value heads of 128,
//! MLP 8960, vocabulary 151,936) with random weights, `--layers` of them (28 in the real model).
//! Weights are plain tensors, so nothing is tracked and both models run candle-nn's fused RMSNorm
//! and rotary kernels: they differ only in attention. Times are medians of `--reps` runs after a
//! warm-up, the GPU synchronised around each.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::{D, DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::qwen2 as candle_qwen2;
use clap::{Parser, ValueEnum};
use ladder_candle::qwen2::{AttentionPath, Config, Model};

// candle-transformers' configuration for ours, shared with the tests.
#[path = "../tests/common/model.rs"]
#[allow(dead_code)]
mod model;
use model::{candle_config, frozen_on, prompts};

#[derive(Parser)]
#[command(about = "ladder-candle against candle's own attention on a GPU")]
struct Args {
    /// What to measure.
    #[arg(value_enum, default_value = "all")]
    what: What,
    /// The model's layers (Qwen2.5-1.5B has 28).
    #[arg(long, default_value_t = 28)]
    layers: usize,
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Decoding steps timed per run.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Context length before decoding.
    #[arg(long, default_value_t = 8192)]
    context: usize,
    /// f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum What {
    Prefill,
    Decode,
    Op,
    All,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0).context("candle_bench needs a CUDA device")?;
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype: f16 or bf16, not {other}"),
    };
    if args.reps == 0 || args.steps == 0 {
        bail!("--reps and --steps must be at least 1");
    }
    println!("| case | path | figure |");
    println!("|---|---|---|");
    let mut table = Table;
    if matches!(args.what, What::Prefill | What::Decode | What::All) {
        let cfg = qwen25_1_5b(args.layers, args.context + args.steps + 1);
        eprintln!("candle_bench: {} layers of random weights ({dtype:?})…", cfg.num_hidden_layers);
        let weights = random_weights(&cfg, dtype, &dev)?;
        if matches!(args.what, What::Prefill | What::All) {
            prefill(&cfg, &weights, &args, &dev, &mut table)?;
        }
        if matches!(args.what, What::Decode | What::All) {
            for batch in [1, 16] {
                decode(&cfg, &weights, batch, &args, &dev, &mut table)?;
            }
        }
    }
    if matches!(args.what, What::Op | What::All) {
        op(dtype, &args, &dev, &mut table)?;
    }
    Ok(())
}

struct Row {
    case: String,
    path: &'static str,
    figure: String,
}

/// The results, a Markdown table printed a row at a time (a run cut short keeps what it measured).
struct Table;

impl Table {
    fn push(&mut self, row: Row) {
        println!("| {} | {} | {} |", row.case, row.path, row.figure);
    }
}

/// Qwen2.5-1.5B's shapes with `layers` layers.
fn qwen25_1_5b(layers: usize, positions: usize) -> Config {
    Config {
        vocab_size: 151_936,
        hidden_size: 1536,
        intermediate_size: 8960,
        num_hidden_layers: layers,
        num_attention_heads: 12,
        num_key_value_heads: 2,
        max_position_embeddings: positions,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
    }
}

/// The model's weights, initialised as the model initialises them, as plain (untracked) tensors
/// that every model built from the returned builder shares.
fn random_weights(cfg: &Config, dtype: DType, dev: &Device) -> Result<VarBuilder<'static>> {
    let varmap = VarMap::new();
    Model::new(cfg, VarBuilder::from_varmap(&varmap, dtype, dev))?;
    Ok(frozen_on(&varmap, dev, dtype)?)
}

/// Seconds `f` takes, the GPU synchronised before and after.
fn timed(dev: &Device, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    dev.synchronize()?;
    let start = Instant::now();
    f()?;
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64())
}

/// The median of `reps` runs of `run` (each returning the seconds it measured), after one more
/// run as a warm-up.
fn median_of(reps: usize, mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    run()?;
    let mut times = (0..reps).map(|_| run()).collect::<Result<Vec<_>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The median time of `f`: [`median_of`] of [`timed`].
fn median_time(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    median_of(reps, || timed(dev, &mut f))
}

fn prefill(
    cfg: &Config,
    weights: &VarBuilder<'static>,
    args: &Args,
    dev: &Device,
    table: &mut Table,
) -> Result<()> {
    let lengths = [1792, 2304, 2048, 1920, 2176, 2048, 1856, 2240];
    let prompts = prompts(&lengths, cfg.vocab_size);
    let tokens: usize = lengths.iter().sum();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let case = format!("prefill 8 prompts, {tokens} tokens");
    for (path, name) in [
        (AttentionPath::Ladder, "ladder-candle (flash_attn_varlen)"),
        (AttentionPath::Candle, "same model, candle's attention"),
    ] {
        eprintln!("candle_bench: {case}, {name}…");
        let mut model = Model::new(cfg, weights.clone())?.with_attention(path);
        let t = median_time(dev, args.reps, || {
            model.prefill(&prompts, longest + 1)?;
            Ok(())
        })?;
        table.push(Row { case: case.clone(), path: name, figure: per_second(tokens, t) });
    }
    eprintln!("candle_bench: {case}, candle-transformers' Qwen2…");
    let mut theirs = candle_qwen2::ModelForCausalLM::new(&candle_config(cfg), weights.clone())?;
    // Padded to the longest (the tail of a shorter prompt is padding the causal mask keeps out
    // of its tokens); only the prompts' own tokens count.
    let padded: Vec<u32> = prompts
        .iter()
        .flat_map(|p| p.iter().copied().chain(std::iter::repeat_n(0, longest - p.len())))
        .collect();
    let ids = Tensor::from_vec(padded, (prompts.len(), longest), dev)?;
    let t = median_time(dev, args.reps, || {
        theirs.clear_kv_cache();
        theirs.forward(&ids, 0)?;
        Ok(())
    })?;
    table.push(Row {
        case,
        path: "candle-transformers Qwen2 (padded batch)",
        figure: per_second(tokens, t),
    });
    Ok(())
}

fn decode(
    cfg: &Config,
    weights: &VarBuilder<'static>,
    batch: usize,
    args: &Args,
    dev: &Device,
    table: &mut Table,
) -> Result<()> {
    let (context, steps) = (args.context, args.steps);
    let prompts = prompts(&vec![context; batch], cfg.vocab_size);
    let case = format!("decode batch {batch}, {context} context, {steps} steps");
    let first: Vec<u32> = vec![1; batch];

    // The same model and cache on both attention paths: ours (FlashDecoding over the cache), and
    // candle's (matmul and softmax over the cached keys), candle's own attention path where
    // candle-transformers' model cannot run. Both prefill with the ladder's attention.
    let mut model = Model::new(cfg, weights.clone())?;
    for (path, label) in [
        (AttentionPath::Ladder, "ladder-candle (KvCache::attend)"),
        (AttentionPath::Candle, "same model, candle's attention (matmul, softmax)"),
    ] {
        eprintln!("candle_bench: {case}, {label}…");
        let t = median_of(args.reps, || {
            model.set_attention(AttentionPath::Ladder);
            model.prefill(&prompts, context + steps + 1)?;
            model.set_attention(path);
            timed(dev, || {
                let mut next = first.clone();
                for _ in 0..steps {
                    next = model.decode(&next)?.argmax(D::Minus1)?.to_vec1()?;
                }
                Ok(())
            })
        })?;
        table.push(Row { case: case.clone(), path: label, figure: per_second(batch * steps, t) });
    }
    drop(model);

    eprintln!("candle_bench: {case}, candle-transformers' Qwen2…");
    let mut theirs = candle_qwen2::ModelForCausalLM::new(&candle_config(cfg), weights.clone())?;
    let ids: Vec<u32> = prompts.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(ids, (batch, context), dev)?;
    // At batch 16 its one-call prefill of 16 × 8k tokens fails inside candle: the row says so,
    // and the benchmark goes on.
    let theirs_t = median_of(args.reps, || {
        theirs.clear_kv_cache();
        // Its prefill in one call: candle-transformers' Qwen2 cannot prefill in chunks in 16 bits
        // (its causal mask for a chunk after the first concatenates an f32 and a 16-bit tensor).
        theirs.forward(&ids, 0)?;
        timed(dev, || {
            let mut next = first.clone();
            for step in 0..steps {
                let ids = Tensor::from_vec(next.clone(), (batch, 1), dev)?;
                let logits = theirs.forward(&ids, context + step)?; // [batch, 1, vocab]
                next = logits.squeeze(1)?.argmax(D::Minus1)?.to_vec1()?;
            }
            Ok(())
        })
    });
    let figure = match theirs_t {
        Ok(t) => per_second(batch * steps, t),
        Err(e) => {
            let error = e.to_string();
            format!("cannot run: {}", error.lines().next().unwrap_or("an error"))
        }
    };
    table.push(Row { case, path: "candle-transformers Qwen2 (cat cache)", figure });
    Ok(())
}

fn per_second(tokens: usize, seconds: f64) -> String {
    format!("{:.0} tokens/s ({:.2} ms)", tokens as f64 / seconds, seconds * 1e3)
}

/// candle's attention on `[b, n, h, d]` tensors: `softmax(Q Kᵀ · scale + mask) V` in candle's ops.
fn candle_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let (q, k, v) = (
        q.transpose(1, 2)?.contiguous()?,
        k.transpose(1, 2)?.contiguous()?,
        v.transpose(1, 2)?.contiguous()?,
    );
    let s = (q.matmul(&k.t()?)? * f64::from(scale))?;
    let s = if causal {
        let n = s.dim(2)?;
        let mask: Vec<u8> = (0..n).flat_map(|i| (0..n).map(move |j| u8::from(j <= i))).collect();
        let mask = Tensor::from_vec(mask, (n, n), s.device())?.broadcast_as(s.shape())?;
        let minus_inf = Tensor::new(f32::NEG_INFINITY, s.device())?
            .to_dtype(s.dtype())?
            .broadcast_as(s.shape())?;
        mask.where_cond(&s, &minus_inf)?
    } else {
        s
    };
    Ok(candle_nn::ops::softmax_last_dim(&s)?.matmul(&v)?.transpose(1, 2)?)
}

fn op(dtype: DType, args: &Args, dev: &Device, table: &mut Table) -> Result<()> {
    let (heads, d) = (16, 128);
    let scale = (d as f32).powf(-0.5);
    for (b, n) in [(4, 4096), (2, 8192), (1, 16384)] {
        for causal in [false, true] {
            let case = format!(
                "op d=128, batch {b}, {n} tokens, {heads} heads{}",
                if causal { ", causal" } else { "" }
            );
            eprintln!("candle_bench: {case}…");
            let randn = || Tensor::randn(0f32, 1., (b, n, heads, d), dev)?.to_dtype(dtype);
            let (q, k, v) = (randn()?, randn()?, randn()?);
            let flops =
                4.0 * (b * heads * d) as f64 * (n * n) as f64 / if causal { 2.0 } else { 1.0 };
            let tflops = |t: f64| format!("{:.0} TFLOP/s ({:.3} ms)", flops / t / 1e12, t * 1e3);
            let t = median_time(dev, args.reps, || {
                ladder_candle::flash_attn(&q, &k, &v, scale, causal)?;
                Ok(())
            })?;
            table.push(Row {
                case: case.clone(),
                path: "ladder-candle flash_attn",
                figure: tflops(t),
            });
            #[cfg(feature = "bench-candle-flash-attn")]
            {
                let t = median_time(dev, args.reps, || {
                    candle_flash_attn::flash_attn(&q, &k, &v, scale, causal)?;
                    Ok(())
                })?;
                table.push(Row {
                    case: case.clone(),
                    path: "candle-flash-attn flash_attn",
                    figure: tflops(t),
                });
            }
            if n <= 8192 {
                let t = median_time(dev, args.reps, || {
                    candle_attention(&q, &k, &v, scale, causal)?;
                    Ok(())
                })?;
                table.push(Row { case, path: "candle matmul-softmax", figure: tflops(t) });
            }
        }
    }
    Ok(())
}
