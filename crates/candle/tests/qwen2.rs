//! The Qwen2-architecture model with this crate's attention against candle-transformers' Qwen2
//! (candle's own attention path: matmul, mask, softmax, in f32) on the same randomly initialised
//! weights, on candle's CPU device:
//!
//! - prefill: three prompts of different lengths packed into one call (`flash_attn_varlen`)
//!   against each prompt alone through candle's model: the logits of each prompt's last token;
//!   Our model reads the weights as plain tensors here (its inference path: candle-nn's fused
//!   RMSNorm and rotary kernels), as variables in the training test (the differentiable forms);
//! - generation: 64 greedy steps against the KV cache (`KvCache::attend`): the same tokens as
//!   candle's model with its own cache;
//! - training: every weight's gradient of a next-token loss over the packed prompts, through this
//!   crate's backward pass, against the same model with candle's own attention (matmul, mask,
//!   softmax) differentiated by candle's autograd. (candle-transformers' Qwen2 cannot be that
//!   reference: its fused RMSNorm and rotary embedding have no backward pass.)

mod common;

use candle_core::{D, DType, Device, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::qwen2 as candle_qwen2;
use common::model::{candle_config, frozen_on, prompts};
use ladder_candle::qwen2::{AttentionPath, Config, Model};

fn config() -> Config {
    Config {
        vocab_size: 97,
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 128,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
    }
}

/// Our model and the weights it made (`VarMap`), which candle's model then reads.
fn models() -> Result<(Model, VarMap, Config)> {
    let cfg = config();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ours = Model::new(&cfg, vb)?;
    Ok((ours, varmap, cfg))
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let size = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((diff, size))
}

#[test]
fn prefill_and_64_greedy_steps_match_candles_qwen2() -> Result<()> {
    let (_, varmap, cfg) = models()?;
    let mut ours = Model::new(&cfg, frozen_on(&varmap, &Device::Cpu, DType::F32)?)?;
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut theirs = candle_qwen2::ModelForCausalLM::new(&candle_config(&cfg), vb)?;
    let prompts = prompts(&[5, 17, 9], cfg.vocab_size);
    let steps = 64;
    let first = ours.prefill(&prompts, 17 + steps + 1)?;
    let generated = ours.greedy(&first, steps)?;
    for (p, prompt) in prompts.iter().enumerate() {
        theirs.clear_kv_cache();
        let ids = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let logits = theirs.forward(&ids, 0)?.squeeze(0)?.squeeze(0)?;
        let (diff, size) = max_diff(&first.get(p)?, &logits)?;
        // f32 logits of a 2-layer model: both compute in f32, in different orders.
        assert!(diff <= 1e-4 * size.max(1.0), "prompt {p}: prefill logits differ by {diff}");
        let mut token = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
        let mut tokens = vec![token];
        for step in 0..steps {
            let ids = Tensor::new(&[token], &Device::Cpu)?.unsqueeze(0)?;
            let logits = theirs.forward(&ids, prompt.len() + step)?;
            token = logits.flatten_all()?.argmax(D::Minus1)?.to_scalar::<u32>()?;
            tokens.push(token);
        }
        assert_eq!(generated[p], tokens, "prompt {p}: greedy tokens differ");
    }
    Ok(())
}

/// Decoding with candle's attention (each token's query against its cached keys, matmul and
/// softmax) gives the logits and the greedy tokens of decoding with the ladder's, from one prefill.
#[test]
fn decoding_with_candles_attention_matches_the_ladders() -> Result<()> {
    let (_, varmap, cfg) = models()?;
    let weights = || frozen_on(&varmap, &Device::Cpu, DType::F32);
    let prompts = prompts(&[5, 17, 9], cfg.vocab_size);
    let steps = 16;
    let mut ladder = Model::new(&cfg, weights()?)?;
    let mut candle = Model::new(&cfg, weights()?)?;
    let first = ladder.prefill(&prompts, 17 + steps + 1)?;
    candle.prefill(&prompts, 17 + steps + 1)?;
    candle.set_attention(AttentionPath::Candle);
    let mut next: Vec<u32> = first.argmax(D::Minus1)?.to_vec1()?;
    for step in 0..steps {
        let (ours, theirs) = (ladder.decode(&next)?, candle.decode(&next)?);
        let (diff, size) = max_diff(&ours, &theirs)?;
        // f32 logits of a 2-layer model, the attention summed in two orders.
        assert!(diff <= 1e-4 * size.max(1.0), "step {step}: logits differ by {diff}");
        let tokens: Vec<u32> = theirs.argmax(D::Minus1)?.to_vec1()?;
        assert_eq!(ours.argmax(D::Minus1)?.to_vec1::<u32>()?, tokens, "step {step}: tokens differ");
        next = tokens;
    }
    Ok(())
}

#[test]
fn a_training_steps_gradients_match_candles_autograd() -> Result<()> {
    let (mut ours, varmap, cfg) = models()?;
    // The same model on the same weights, with candle's attention (matmul, mask, softmax).
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut theirs = Model::new(&cfg, vb)?.with_attention(AttentionPath::Candle);
    let prompts = prompts(&[5, 17, 9], cfg.vocab_size);
    // The loss: a next-token cross-entropy on every position of every prompt.
    let loss = |model: &mut Model| -> Result<Tensor> {
        let hidden = model.forward_packed(&prompts, None)?;
        let logits = model.logits(&hidden)?;
        let targets: Vec<u32> =
            prompts.iter().flat_map(|p| p[1..].iter().copied().chain([0])).collect();
        let targets = Tensor::new(targets, &Device::Cpu)?;
        candle_nn::loss::cross_entropy(&logits, &targets)
    };
    let (ours_loss, their_loss) = (loss(&mut ours)?, loss(&mut theirs)?);
    let (diff, size) = max_diff(&ours_loss, &their_loss)?;
    assert!(diff <= 1e-5 * size.max(1.0), "losses differ by {diff}");
    let (ours_grads, their_grads) = (ours_loss.backward()?, their_loss.backward()?);
    let vars = varmap.data().lock().expect("the weights");
    // Per layer: q, k, v (weights and biases), o, the MLP's three, two norms; then the embedding
    // (tied to the output) and the final norm.
    assert_eq!(vars.len(), 2 + 12 * cfg.num_hidden_layers, "every weight of the model");
    for (name, var) in vars.iter() {
        let a = ours_grads.get(var).unwrap_or_else(|| panic!("{name}: no gradient (ladder)"));
        let b = their_grads.get(var).unwrap_or_else(|| panic!("{name}: no gradient (candle)"));
        let (diff, size) = max_diff(a, b)?;
        assert!(size > 0.0, "{name}: a zero gradient");
        // f32 through two layers, the two attentions summing in different orders.
        assert!(diff <= 1e-4 * size, "{name}: gradients differ by {diff} (largest {size})");
    }
    Ok(())
}
