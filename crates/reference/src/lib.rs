//! # ladder-reference: the CPU rungs of the attention ladder
//!
//! Every rung computes the same thing,
//!
//! ```text
//! O = softmax(scale · Q Kᵀ + mask) V        lse_i = log Σ_j exp(scale · q_i · k_j)   (visible j)
//! ```
//!
//! for `Q: [batch, heads_q, n_q, d]` and `K, V: [batch, heads_kv, n_kv, d]`, and each rung changes
//! *how* it is computed, one idea at a time:
//!
//! | rung | module | the idea |
//! |---|---|---|
//! | 1 | [`naive`] | materialise `S = QKᵀ` (n_q × n_kv), three-pass safe softmax, then `PV`; also the backward pass and, run in `f64`, the oracle |
//! | 2 | [`online_softmax`] | one pass per row with a running max and sum (Milakov & Gimelshein 2018): no N×N buffer |
//! | 3 | [`fa1`] | FlashAttention-1 (Dao et al. 2022, Alg. 1): K/V-outer tile loop, `O, l, m` round-trip through HBM |
//! | 4 | [`fa2`] | FlashAttention-2 (Dao 2023, Alg. 1 and 2): Q-outer loop, unnormalised accumulator, causal tile skipping, backward pass |
//! | 5 | [`fa3`] | FlashAttention-3 (Shah et al. 2024): the overlapped schedule and the FP8 path with incoherent processing; [`fa3_schedule`] simulates its timeline |
//! | 6 | [`flash_decoding`] | split K/V into chunks processed in parallel, combine partials by log-sum-exp |
//! | 7 | [`flash_decoding_pp`] | unified max φ: chunks need no rescaling; rows that leave the safe range fall back to rung 6 |
//! | past the ladder | [`ring`] | ring attention: the sequence sharded across ranks, K/V passed round a ring, partials merged as rung 6 merges its splits |
//!
//! Every rung takes the same masks and modifiers: the causal mask and a sliding window
//! ([`Mask`]), a mask modifier that hides pairs inside them ([`mask_mod`]: documents, a prefix-LM
//! mask, your own; its [`BlockMask`] says which tiles a rung may skip), a score modifier
//! ([`modifiers`]: softcap, ALiBi, your own) and attention sinks ([`sinks`]).
//!
//! Any rung also runs on a packed batch of sequences of different lengths ([`varlen`]: Q
//! `[total_q, heads_q, d]` with `cu_seqlens`), one sequence at a time.
//!
//! All rungs are generic over the [`Element`] type (`f32` or `f64`): running a rung in `f64`
//! separates the algorithm from rounding, which is how the equivalence suite proves each rung
//! exact before it checks its `f32` accuracy. [`naive::attention`] in `f64` is the oracle.
//!
//! Conventions (shared with the GPU rungs; see `docs/conventions.md` in the repository):
//!
//! - Causal masking with `n_q ≠ n_kv` is aligned bottom-right: query `i` sees keys
//!   `j ≤ i + n_kv − n_q` ([`Mask`]).
//! - A row that sees no key outputs zeros and `lse = −∞`; so does a row whose every visible score
//!   is `−∞`.
//! - Grouped-query attention: q head `h` reads kv head `h / (heads_q / heads_kv)`.
//! - A NaN or ±∞ in an input only reaches the output rows that attend to it (the FP8 path
//!   excepted: a non-finite value poisons its whole quantisation block, as it would on a GPU).
//!
//! ```
//! use ladder_reference::{fa2, naive, AttentionOptions, Fa2Options};
//! use ndarray::Array4;
//!
//! let q = Array4::<f32>::from_shape_fn((1, 2, 5, 8), |(_, h, i, c)| (h + i * c) as f32 * 0.1);
//! let k = Array4::<f32>::from_shape_fn((1, 1, 7, 8), |(_, _, j, c)| (j as f32 - c as f32) * 0.05);
//! let v = Array4::<f32>::from_shape_fn((1, 1, 7, 8), |(_, _, j, c)| (j * c) as f32 * 0.01);
//! let opts = AttentionOptions { causal: true, ..Default::default() };
//!
//! let exact = naive::attention(q.view(), k.view(), v.view(), &opts)?;
//! let tiled = fa2::forward(q.view(), k.view(), v.view(), &Fa2Options::new(opts).with_tiles(2, 3)?)?;
//! let diff = (&exact.o - &tiled.o).iter().fold(0f32, |acc, x| acc.max(x.abs()));
//! assert!(diff < 1e-6);
//! # Ok::<(), ladder_reference::LadderError>(())
//! ```

mod element;
mod error;
pub mod mask_mod;
pub mod modifiers;
mod options;
mod output;
mod problem;
mod shape;
pub mod sinks;
mod tile;

pub mod fa1;
pub mod fa2;
pub mod fa3;
pub mod fa3_schedule;
pub mod flash_decoding;
pub mod flash_decoding_pp;
pub mod fp8;
pub mod naive;
pub mod online_softmax;
pub mod ring;
pub mod varlen;

pub use element::Element;
pub use error::{LadderError, Result};
pub use fa1::Fa1Options;
pub use fa2::Fa2Options;
pub use fa3::{Fa3Options, Fa3Precision};
pub use flash_decoding::FlashDecodingOptions;
pub use flash_decoding_pp::{FlashDecodingPpOptions, Phi};
pub use fp8::{Fp8Options, Fp8Scaling};
pub use mask_mod::{BlockMask, MaskMod};
pub use modifiers::{ScoreIndex, ScoreMod};
pub use options::{AttentionOptions, TileSizes, TiledOptions};
pub use output::{AttentionOutput, Gradients, HbmTraffic, RunStats, TileCounts};
pub use shape::{AttentionShape, Mask, TileKind, Window};
