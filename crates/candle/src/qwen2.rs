//! A Qwen2-architecture decoder whose attention is this crate's: packed prompts of different
//! lengths through [`flash_attn_varlen`] (prefill, and training, whose gradients go back through
//! the op), then one token per sequence at a time against a [`KvCache`] (generation).
//!
//! The architecture is Qwen2's (and Llama's, but for the biases of the q, k, v projections):
//! token embeddings; per layer, RMSNorm, grouped-query attention with rotary position embeddings
//! (the halves-rotated form), a residual, RMSNorm, a SwiGLU MLP, a residual; a final RMSNorm and the
//! tied (or separate) output projection. Parameter names are Hugging Face's
//! (`model.layers.0.self_attn.q_proj.weight`, …), so a checkpoint's safetensors load as they are,
//! and `candle_transformers::models::qwen2` reads the same weights (the tests compare the two).
//!
//! The model works on tokens packed back to back, `[tokens, hidden]`: a prefill packs every
//! prompt, a decoding step one token per sequence, and each token's rotary position is its own.
//! Every part is differentiable where a gradient is wanted: when the weights are variables (a
//! training step), the rotary embedding and RMSNorm run in candle's tensor ops, since candle-nn's
//! fused kernels for them have no backward pass; when nothing is tracked (inference, weights
//! loaded as plain tensors), they run as those fused kernels, as candle-transformers' models do. [`AttentionPath::Candle`] swaps the attention for candle's own (matmul, mask, softmax):
//! the same model with the other attention, to hold one to the other.

use candle_core::{D, DType, Device, Module, Result, Tensor, bail};
use candle_nn::{Embedding, Linear, VarBuilder};

use crate::{KvCache, flash_attn_varlen};

/// The sizes of a Qwen2-architecture model (the fields of its `config.json` the model reads).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
}

impl Config {
    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

/// Which attention the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionPath {
    /// This crate's ops: [`flash_attn_varlen`] over packed prompts, [`KvCache::attend`] when
    /// decoding.
    #[default]
    Ladder,
    /// candle's own attention, one sequence at a time: `softmax(Q Kᵀ · scale + causal mask) V` with
    /// the key-value heads repeated for their query heads (what candle-transformers' models do),
    /// differentiable by candle's autograd. When decoding, each new token's query against its
    /// sequence's cached keys and values, read out of the [`KvCache`] (as candle-transformers'
    /// models read their concatenated caches).
    Candle,
}

/// RMSNorm: candle-nn's fused kernel when no gradient is tracked, else in candle's tensor ops
/// (`rms_norm_slow`, differentiable).
#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
        let weight = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
        Ok(RmsNorm { weight, eps: eps as f32 })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.track_op() || self.weight.track_op() {
            candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps)
        } else {
            candle_nn::ops::rms_norm(x, &self.weight, self.eps)
        }
    }
}

/// The rotary embedding's tables: `cos` and `sin` of `position · θ^(−2i/d)`, `[positions, d/2]`.
#[derive(Debug, Clone)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    fn new(cfg: &Config, dtype: DType, device: &Device) -> Result<Rotary> {
        let d = cfg.head_dim();
        let inv_freq: Vec<f32> =
            (0..d / 2).map(|i| cfg.rope_theta.powf(-2.0 * i as f64 / d as f64) as f32).collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, d / 2), device)?;
        let positions = Tensor::arange(0u32, cfg.max_position_embeddings as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_position_embeddings, 1))?;
        let angles = positions.matmul(&inv_freq)?;
        Ok(Rotary { cos: angles.cos()?.to_dtype(dtype)?, sin: angles.sin()?.to_dtype(dtype)? })
    }

    /// `x` `[tokens, heads, d]` rotated by each token's position (`positions`, u32 `[tokens]`):
    /// candle-nn's fused kernel when no gradient is tracked, else the differentiable form
    /// (`candle_nn::rotary_emb::rope_slow`).
    fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let (cos, sin) =
            (self.cos.index_select(positions, 0)?, self.sin.index_select(positions, 0)?);
        if !x.track_op() {
            // rope_thd takes [batch, seq, heads, d], a position per seq entry: the tokens.
            let x = x.unsqueeze(0)?.contiguous()?;
            return candle_nn::rotary_emb::rope_thd(&x, &cos, &sin)?.squeeze(0);
        }
        // rope_slow takes [batch, heads, seq, d] with a position per seq entry: the tokens.
        let x = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
        candle_nn::rotary_emb::rope_slow(&x, &cos, &sin)?.squeeze(0)?.transpose(0, 1)
    }
}

/// Grouped-query attention with its projections.
#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// How a layer's attention runs: over packed prompts (`seqlens` the `u32` offsets), or for one new
/// token per sequence against a cache.
enum Pass<'a> {
    Packed {
        seqlens: &'a Tensor,
        longest: usize,
        caches: Option<&'a mut KvCache>,
        starts: &'a [usize],
        path: AttentionPath,
    },
    Decode {
        cache: &'a mut KvCache,
        path: AttentionPath,
    },
}

impl Attention {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Attention> {
        let (h, kv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim());
        Ok(Attention {
            q_proj: candle_nn::linear(cfg.hidden_size, h * d, vb.pp("q_proj"))?,
            k_proj: candle_nn::linear(cfg.hidden_size, kv * d, vb.pp("k_proj"))?,
            v_proj: candle_nn::linear(cfg.hidden_size, kv * d, vb.pp("v_proj"))?,
            o_proj: candle_nn::linear_no_bias(h * d, cfg.hidden_size, vb.pp("o_proj"))?,
            heads: h,
            kv_heads: kv,
            head_dim: d,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        positions: &Tensor,
        pass: Pass,
    ) -> Result<Tensor> {
        let tokens = x.dim(0)?;
        let split = |t: Tensor, heads: usize| t.reshape((tokens, heads, self.head_dim));
        let q = rotary.apply(&split(x.apply(&self.q_proj)?, self.heads)?, positions)?;
        let k = rotary.apply(&split(x.apply(&self.k_proj)?, self.kv_heads)?, positions)?;
        let v = split(x.apply(&self.v_proj)?, self.kv_heads)?;
        let scale = (self.head_dim as f32).powf(-0.5);
        let o = match pass {
            Pass::Packed { seqlens, longest, caches, starts, path } => {
                if let Some(cache) = caches {
                    for (b, w) in starts.windows(2).enumerate() {
                        let (start, len) = (w[0], w[1] - w[0]);
                        cache.append(b, &k.narrow(0, start, len)?, &v.narrow(0, start, len)?)?;
                    }
                }
                match path {
                    AttentionPath::Ladder => flash_attn_varlen(
                        &q, &k, &v, seqlens, seqlens, longest, longest, scale, true,
                    )?,
                    AttentionPath::Candle => {
                        let each = starts
                            .windows(2)
                            .map(|w| {
                                let one = |t: &Tensor| t.narrow(0, w[0], w[1] - w[0]);
                                candle_attention(&one(&q)?, &one(&k)?, &one(&v)?, scale)
                            })
                            .collect::<Result<Vec<_>>>()?;
                        Tensor::cat(&each, 0)?
                    }
                }
            }
            Pass::Decode { cache, path } => {
                for b in 0..tokens {
                    cache.append(b, &k.narrow(0, b, 1)?, &v.narrow(0, b, 1)?)?;
                }
                match path {
                    AttentionPath::Ladder => {
                        cache.attend(&q.unsqueeze(1)?, scale, None)?.squeeze(1)?
                    }
                    AttentionPath::Candle => {
                        let each = (0..tokens)
                            .map(|b| {
                                let len = cache.lengths()[b];
                                let held = |t: &Tensor| t.get(b)?.narrow(0, 0, len);
                                let (k, v) = (held(cache.k())?, held(cache.v())?);
                                candle_decode_attention(&q.narrow(0, b, 1)?, &k, &v, scale)
                            })
                            .collect::<Result<Vec<_>>>()?;
                        Tensor::cat(&each, 0)?
                    }
                }
            }
        };
        o.reshape((tokens, self.heads * self.head_dim))?.apply(&self.o_proj)
    }
}

/// candle's own causal attention on one sequence: `q` `[n, heads, d]`, `k` and `v` `[n, kv_heads,
/// d]`, each kv head repeated for its query heads, `softmax(Q Kᵀ · scale + mask) V`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let (n, heads, _) = q.dims3()?;
    let (q, k, v) = (q.transpose(0, 1)?.contiguous()?, repeat_kv(k, heads)?, repeat_kv(v, heads)?);
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, n), q.device())?.to_dtype(q.dtype())?;
    let s = (q.matmul(&k.t()?)? * f64::from(scale))?.broadcast_add(&mask)?;
    let p = candle_nn::ops::softmax(&s, D::Minus1)?; // (softmax_last_dim has no backward pass)
    p.matmul(&v.contiguous()?)?.transpose(0, 1)
}

/// candle's own attention for one new token: `q` `[1, heads, d]` against a sequence's cached `k` and
/// `v` `[len, kv_heads, d]`, each kv head repeated for its query heads, `softmax(q Kᵀ · scale) V`
/// (the token sees every cached key, itself included).
fn candle_decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let heads = q.dim(1)?;
    let q = q.transpose(0, 1)?.contiguous()?; // [heads, 1, d]
    let s = (q.matmul(&repeat_kv(k, heads)?.t()?)? * f64::from(scale))?;
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    p.matmul(&repeat_kv(v, heads)?.contiguous()?)?.transpose(0, 1) // [1, heads, d]
}

/// `t` `[len, kv_heads, d]` as `[heads, len, d]`, each kv head repeated for its group of query
/// heads (what candle-transformers' `repeat_kv` does).
fn repeat_kv(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (len, kv, d) = t.dims3()?;
    let t = t.transpose(0, 1)?; // [kv_heads, len, d]
    t.unsqueeze(1)?.broadcast_as((kv, heads / kv, len, d))?.reshape((heads, len, d))
}

/// The SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Mlp> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate_proj: candle_nn::linear_no_bias(h, i, vb.pp("gate_proj"))?,
            up_proj: candle_nn::linear_no_bias(h, i, vb.pp("up_proj"))?,
            down_proj: candle_nn::linear_no_bias(i, h, vb.pp("down_proj"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&x.apply(&self.gate_proj)?)?;
        (gate * x.apply(&self.up_proj)?)?.apply(&self.down_proj)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

/// A Qwen2-architecture decoder (see the [module](self)).
#[derive(Debug, Clone)]
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    cfg: Config,
    path: AttentionPath,
    /// One per layer, after [`Model::prefill`].
    caches: Vec<KvCache>,
    device: Device,
    dtype: DType,
}

impl Model {
    /// The model with the weights of `vb` (Hugging Face's names, under `model.` and `lm_head`).
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Model> {
        if cfg.num_attention_heads == 0
            || cfg.hidden_size % cfg.num_attention_heads != 0
            || cfg.num_key_value_heads == 0
            || cfg.num_attention_heads % cfg.num_key_value_heads != 0
        {
            bail!("qwen2: heads must divide hidden_size and kv heads the heads, got {cfg:?}");
        }
        let m = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = m.pp("layers").pp(i);
                Ok(Layer {
                    self_attn: Attention::new(cfg, l.pp("self_attn"))?,
                    mlp: Mlp::new(cfg, l.pp("mlp"))?,
                    input_layernorm: RmsNorm::new(
                        cfg.hidden_size,
                        cfg.rms_norm_eps,
                        l.pp("input_layernorm"),
                    )?,
                    post_attention_layernorm: RmsNorm::new(
                        cfg.hidden_size,
                        cfg.rms_norm_eps,
                        l.pp("post_attention_layernorm"),
                    )?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        let rotary = Rotary::new(cfg, vb.dtype(), vb.device())?;
        Ok(Model {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            cfg: cfg.clone(),
            path: AttentionPath::Ladder,
            caches: Vec::new(),
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }

    /// This model with `path`'s attention (the weights shared).
    pub fn with_attention(self, path: AttentionPath) -> Model {
        Model { path, ..self }
    }

    /// Runs `path`'s attention from now on, the caches kept: a batch prefilled on one path decodes
    /// on the other.
    pub fn set_attention(&mut self, path: AttentionPath) {
        self.path = path;
    }

    /// The final hidden states `[tokens, hidden]` of `prompts` packed back to back (each from
    /// position 0), through every layer's packed attention: a training step's forward pass (its
    /// gradients go back through `flash_attn_varlen`). With `capacity`, each layer's keys and
    /// values also go into a fresh cache of that many tokens per prompt, for [`Model::decode`].
    pub fn forward_packed(
        &mut self,
        prompts: &[Vec<u32>],
        capacity: Option<usize>,
    ) -> Result<Tensor> {
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            bail!("qwen2: every prompt needs a token");
        }
        let mut starts = vec![0usize];
        for p in prompts {
            starts.push(starts[starts.len() - 1] + p.len());
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if longest > self.cfg.max_position_embeddings {
            bail!(
                "qwen2: a prompt of {longest} tokens exceeds {} positions",
                self.cfg.max_position_embeddings
            );
        }
        let tokens: Vec<u32> = prompts.iter().flatten().copied().collect();
        let positions: Vec<u32> = prompts.iter().flat_map(|p| 0..p.len() as u32).collect();
        let seqlens: Vec<u32> = starts.iter().map(|&s| s as u32).collect();
        let (tokens, positions, seqlens) = (
            Tensor::new(tokens, &self.device)?,
            Tensor::new(positions, &self.device)?,
            Tensor::new(seqlens, &self.device)?,
        );
        self.caches = match capacity {
            None => Vec::new(),
            Some(capacity) => (0..self.layers.len())
                .map(|_| {
                    let (kv, d) = (self.cfg.num_key_value_heads, self.cfg.head_dim());
                    KvCache::new(prompts.len(), capacity, kv, d, self.dtype, &self.device)
                })
                .collect::<Result<_>>()?,
        };
        let mut x = self.embed_tokens.forward(&tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let caches = self.caches.get_mut(i);
            let pass = Pass::Packed {
                seqlens: &seqlens,
                longest,
                caches,
                starts: &starts,
                path: self.path,
            };
            x = layer.forward(&x, &self.rotary, &positions, pass)?;
        }
        x.apply(&self.norm)
    }

    /// Prefill for generation: [`Model::forward_packed`] with caches of `capacity` tokens per
    /// prompt; returns the logits of each prompt's last token, `[prompts, vocab]`.
    pub fn prefill(&mut self, prompts: &[Vec<u32>], capacity: usize) -> Result<Tensor> {
        let hidden = self.forward_packed(prompts, Some(capacity))?;
        let mut last = Vec::with_capacity(prompts.len());
        let mut end = 0;
        for p in prompts {
            end += p.len();
            last.push((end - 1) as u32);
        }
        let last = Tensor::new(last, &self.device)?;
        hidden.index_select(&last, 0)?.apply(&self.lm_head)
    }

    /// One decoding step: `tokens[b]` appended to sequence `b` (each at its own position, after its
    /// cached tokens), attending to its cache by the model's [`AttentionPath`]; returns the
    /// next-token logits `[batch, vocab]`.
    pub fn decode(&mut self, tokens: &[u32]) -> Result<Tensor> {
        if self.caches.is_empty() {
            bail!("qwen2: decode needs a prefill first");
        }
        let lengths = self.caches[0].lengths().to_vec();
        if tokens.len() != lengths.len() {
            bail!("qwen2: {} tokens for {} sequences", tokens.len(), lengths.len());
        }
        let positions: Vec<u32> = lengths.iter().map(|&l| l as u32).collect();
        let positions = Tensor::new(positions, &self.device)?;
        let mut x = self.embed_tokens.forward(&Tensor::new(tokens, &self.device)?)?;
        for (layer, cache) in self.layers.iter().zip(self.caches.iter_mut()) {
            x = layer.forward(
                &x,
                &self.rotary,
                &positions,
                Pass::Decode { cache, path: self.path },
            )?;
        }
        x.apply(&self.norm)?.apply(&self.lm_head)
    }

    /// The logits of hidden states `[tokens, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        hidden.apply(&self.lm_head)
    }

    /// Greedy generation: after [`Model::prefill`]'s logits `first`, `steps` decoding steps, each
    /// taking every sequence's most likely token; returns the tokens, `[steps + 1]` per sequence
    /// (the one chosen from `first`, then each step's).
    pub fn greedy(&mut self, first: &Tensor, steps: usize) -> Result<Vec<Vec<u32>>> {
        let mut next: Vec<u32> = first.argmax(D::Minus1)?.to_vec1()?;
        let mut out: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        for _ in 0..steps {
            next = self.decode(&next)?.argmax(D::Minus1)?.to_vec1()?;
            for (seq, &t) in out.iter_mut().zip(&next) {
                seq.push(t);
            }
        }
        Ok(out)
    }
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        rotary: &Rotary,
        positions: &Tensor,
        pass: Pass,
    ) -> Result<Tensor> {
        let h =
            self.self_attn.forward(&x.apply(&self.input_layernorm)?, rotary, positions, pass)?;
        let x = (x + h)?;
        let h = x.apply(&self.post_attention_layernorm)?.apply(&self.mlp)?;
        x + h
    }
}
