//! The Qwen2 tests' shared parts: candle-transformers' configuration for ours, the prompts, and
//! the CPU model's weights copied to another device.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Var};
use candle_nn::{Activation, VarBuilder, VarMap};
use candle_transformers::models::qwen2 as candle_qwen2;
use ladder_candle::qwen2::Config;

pub fn candle_config(c: &Config) -> candle_qwen2::Config {
    candle_qwen2::Config {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads,
        max_position_embeddings: c.max_position_embeddings,
        sliding_window: c.max_position_embeddings,
        max_window_layers: c.num_hidden_layers,
        tie_word_embeddings: c.tie_word_embeddings,
        rope_theta: c.rope_theta,
        rms_norm_eps: c.rms_norm_eps,
        use_sliding_window: false,
        hidden_act: Activation::Silu,
    }
}

/// Prompts of the given lengths, fixed pseudo-random tokens below `vocab`.
pub fn prompts(lengths: &[usize], vocab: usize) -> Vec<Vec<u32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(p, &n)| (0..n).map(|i| ((p * 31 + i * 17 + 3) % vocab) as u32).collect())
        .collect()
}

/// The weights of `varmap` as new variables on `dev` in `dtype` (gradients reach them).
pub fn weights_on(varmap: &VarMap, dev: &Device, dtype: DType) -> Result<VarMap> {
    let copy = VarMap::new();
    {
        let from = varmap.data().lock().expect("the weights");
        let mut to = copy.data().lock().expect("the copy");
        for (name, var) in from.iter() {
            let t = var.as_tensor().to_device(dev)?.to_dtype(dtype)?;
            to.insert(name.clone(), Var::from_tensor(&t)?);
        }
    }
    Ok(copy)
}

/// The weights of `varmap` as plain tensors on `dev` in `dtype`: nothing is tracked, so the model
/// takes its inference path (candle-nn's fused RMSNorm and rotary kernels).
pub fn frozen_on(varmap: &VarMap, dev: &Device, dtype: DType) -> Result<VarBuilder<'static>> {
    let from = varmap.data().lock().expect("the weights");
    let tensors = from
        .iter()
        .map(|(name, var)| {
            let t = var.as_tensor().detach();
            Ok((name.clone(), t.to_device(dev)?.to_dtype(dtype)?))
        })
        .collect::<Result<HashMap<_, _>>>()?;
    Ok(VarBuilder::from_tensors(tensors, dtype, dev))
}
