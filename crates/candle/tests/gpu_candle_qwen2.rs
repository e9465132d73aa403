//! The Qwen2-architecture model on candle's CUDA device (the `cuda` feature), in f16 and bf16,
//! with this crate's attention against candle-transformers' Qwen2 (candle's own attention path)
//! on the same randomly initialised weights, both held to the ladder's rule against the same
//! model in f32 on the CPU (whose attention the CPU tests show equal to candle's):
//!
//! - prefill of three prompts of different lengths packed into one call (`flash_attn_varlen`):
//!   each prompt's last-token logits;
//! - 64 greedy decoding steps against the KV cache on the GPU (`KvCache::attend`): at every step
//!   the logits meet the rule, with the f32 model and candle's fed the tokens ours chose (the
//!   tokens that differ from either model's choice are counted and printed: with the logits
//!   within the rule, only near-ties can differ);
//! - decoding with candle's attention (`AttentionPath::Candle`) from the same prefill: its logits
//!   and ours each within the rule, the other as the baseline;
//! - a training step: every weight's gradient through this crate's backward pass against the same
//!   model with candle's attention (matmul, mask, softmax) differentiated by candle's autograd in
//!   the same precision.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` they fail.
#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;

use candle_core::{D, DType, Device, IndexOp, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::qwen2 as candle_qwen2;
use common::model::{candle_config, frozen_on, prompts, weights_on};
use common::{cuda, meets_the_rule};
use ladder_candle::qwen2::{AttentionPath, Config, Model};

/// Head dimension 64 (FlashAttention-3's on Hopper), grouped-query attention.
fn config() -> Config {
    Config {
        vocab_size: 97,
        hidden_size: 256,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 512,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
    }
}

/// The f32 model on the CPU, and the weights it made (which the GPU models copy).
fn oracle(cfg: &Config) -> Result<(Model, VarMap)> {
    let varmap = VarMap::new();
    let model = Model::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    Ok((model, varmap))
}

#[test]
fn prefill_and_64_greedy_steps_meet_the_rule() -> Result<()> {
    let Some(dev) = cuda("prefill_and_64_greedy_steps_meet_the_rule") else { return Ok(()) };
    let cfg = config();
    let (mut exact, varmap) = oracle(&cfg)?;
    let prompts = prompts(&[5, 77, 130], cfg.vocab_size);
    let steps = 64;
    let capacity = 130 + steps + 1;
    for dtype in [DType::F16, DType::BF16] {
        // Plain tensors: the inference path (fused RMSNorm and rotary kernels).
        let vb = frozen_on(&varmap, &dev, dtype)?;
        let mut ours = Model::new(&cfg, vb.clone())?;
        let mut theirs = candle_qwen2::ModelForCausalLM::new(&candle_config(&cfg), vb)?;
        // Ours decides the tokens; the f32 model and candle's are fed them.
        let mut logits_ours = vec![ours.prefill(&prompts, capacity)?];
        let mut logits_exact = vec![exact.prefill(&prompts, capacity)?];
        let mut chosen: Vec<Vec<u32>> = Vec::new();
        for step in 0..=steps {
            let next: Vec<u32> = logits_ours[step].argmax(D::Minus1)?.to_vec1()?;
            chosen.push(next.clone());
            if step < steps {
                logits_ours.push(ours.decode(&next)?);
                logits_exact.push(exact.decode(&next)?);
            }
        }
        let (mut ties, mut differ_from_candle) = (0, 0);
        for (p, prompt) in prompts.iter().enumerate() {
            theirs.clear_kv_cache();
            let ids = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
            let mut logits_theirs = theirs.forward(&ids, 0)?.flatten_all()?;
            for step in 0..=steps {
                let (ours_p, exact_p) = (logits_ours[step].i(p)?, logits_exact[step].i(p)?);
                let (holds, figures) = meets_the_rule(&ours_p, &logits_theirs, &exact_p, dtype)?;
                assert!(holds, "{dtype:?} prompt {p} step {step}: logits: {figures}");
                let token = chosen[step][p];
                let best = exact_p.argmax(0)?.to_scalar::<u32>()?;
                if token != best {
                    ties += 1;
                }
                if logits_theirs.argmax(0)?.to_scalar::<u32>()? != token {
                    differ_from_candle += 1;
                }
                if step < steps {
                    let ids = Tensor::new(&[token], &dev)?.unsqueeze(0)?;
                    logits_theirs = theirs.forward(&ids, prompt.len() + step)?.flatten_all()?;
                }
            }
        }
        let total = prompts.len() * (steps + 1);
        eprintln!(
            "{dtype:?}: {total} greedy tokens; {ties} differ from the f32 model's (ties), \
             {differ_from_candle} from candle's choice on the same history"
        );
    }
    Ok(())
}

/// Decoding with candle's attention (`AttentionPath::Candle`: each token's query against its
/// cached keys, matmul and softmax) from the ladder's prefill, on the GPU in bf16: at every step its
/// logits and ours each meet the rule against the f32 model, with the other as the baseline.
#[test]
fn decoding_with_candles_attention_meets_the_rule() -> Result<()> {
    let Some(dev) = cuda("decoding_with_candles_attention_meets_the_rule") else { return Ok(()) };
    let cfg = config();
    let (mut exact, varmap) = oracle(&cfg)?;
    let prompts = prompts(&[5, 77, 130], cfg.vocab_size);
    let (steps, dtype) = (16, DType::BF16);
    let capacity = 130 + steps + 1;
    let vb = frozen_on(&varmap, &dev, dtype)?;
    let (mut ours, mut candle) = (Model::new(&cfg, vb.clone())?, Model::new(&cfg, vb)?);
    let mut next: Vec<u32> = ours.prefill(&prompts, capacity)?.argmax(D::Minus1)?.to_vec1()?;
    candle.prefill(&prompts, capacity)?;
    candle.set_attention(AttentionPath::Candle);
    exact.prefill(&prompts, capacity)?;
    for step in 0..steps {
        let (o, c, e) = (ours.decode(&next)?, candle.decode(&next)?, exact.decode(&next)?);
        for p in 0..prompts.len() {
            let (o, c, e) = (o.i(p)?, c.i(p)?, e.i(p)?);
            for (name, a, b) in [("ours", &o, &c), ("candle's", &c, &o)] {
                let (holds, figures) = meets_the_rule(a, b, &e, dtype)?;
                assert!(holds, "step {step}, prompt {p}: {name} logits: {figures}");
            }
        }
        next = o.argmax(D::Minus1)?.to_vec1()?;
    }
    Ok(())
}

/// Every weight's gradient of a next-token loss, by name.
fn gradients(
    model: &mut Model,
    varmap: &VarMap,
    prompts: &[Vec<u32>],
) -> Result<HashMap<String, Tensor>> {
    let hidden = model.forward_packed(prompts, None)?;
    let logits = model.logits(&hidden)?.to_dtype(DType::F32)?;
    let targets: Vec<u32> =
        prompts.iter().flat_map(|p| p[1..].iter().copied().chain([0])).collect();
    let targets = Tensor::new(targets, logits.device())?;
    let grads = candle_nn::loss::cross_entropy(&logits, &targets)?.backward()?;
    let vars = varmap.data().lock().expect("the weights");
    vars.iter()
        .map(|(name, var)| {
            let g = grads
                .get(var)
                .ok_or_else(|| candle_core::Error::Msg(format!("{name}: no gradient")))?;
            Ok((name.clone(), g.clone()))
        })
        .collect()
}

#[test]
fn a_training_steps_gradients_meet_the_rule() -> Result<()> {
    let Some(dev) = cuda("a_training_steps_gradients_meet_the_rule") else { return Ok(()) };
    let cfg = config();
    let (exact, varmap) = oracle(&cfg)?;
    let prompts = prompts(&[5, 77, 130], cfg.vocab_size);
    // The f32 reference: candle's attention differentiated by candle's autograd, on the CPU.
    let want = gradients(&mut exact.with_attention(AttentionPath::Candle), &varmap, &prompts)?;
    assert_eq!(want.len(), 2 + 12 * cfg.num_hidden_layers, "every weight of the model");
    for dtype in [DType::BF16, DType::F16] {
        let (w_ours, w_theirs) =
            (weights_on(&varmap, &dev, dtype)?, weights_on(&varmap, &dev, dtype)?);
        let mut ours = Model::new(&cfg, VarBuilder::from_varmap(&w_ours, dtype, &dev))?;
        let mut theirs = Model::new(&cfg, VarBuilder::from_varmap(&w_theirs, dtype, &dev))?
            .with_attention(AttentionPath::Candle);
        let (g_ours, g_theirs) = (
            gradients(&mut ours, &w_ours, &prompts)?,
            gradients(&mut theirs, &w_theirs, &prompts)?,
        );
        for (name, reference) in &want {
            let (holds, figures) =
                meets_the_rule(&g_ours[name], &g_theirs[name], reference, dtype)?;
            assert!(holds, "{dtype:?} {name}: {figures}");
        }
    }
    Ok(())
}
