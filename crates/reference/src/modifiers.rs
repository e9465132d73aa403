//! Score modifiers: a function of each score, applied before the softmax.
//!
//! FlexAttention (Dong et al. 2024) and FlashAttention-4 let a user change attention without
//! writing a kernel: a `score_mod(score, b, h, q_idx, kv_idx)` rewrites each scaled score
//! `s = scale · q·k` before the softmax, so that
//!
//! ```text
//! O = softmax(score_mod(scale · Q Kᵀ) + mask) V
//! ```
//!
//! Gemma-2's logit softcap ([`ScoreMod::softcap`]) and ALiBi's linear biases
//! ([`ScoreMod::alibi`]) are such functions, and so is anything a user writes with
//! [`ScoreMod::new`]. A rung applies the modifier to every visible score of a tile, where it
//! forms the tile (`Head::score_tile`); nothing else changes, not the online softmax, not the
//! tiles. The backward pass needs its derivative: with `t = score_mod(s)`, the chain rule turns
//! the gradient of the logit, `dT = P ∘ (dP − D)`, into the gradient of the score,
//! `dS = dT ∘ ∂t/∂s`, before the products with K and Q.
//!
//! The GPU rungs (`ladder-kernels`) take the same modifiers as CUDA source compiled into the
//! kernels; the check API (`ladder-compare`) runs both sides of one modifier.

use std::fmt;
use std::sync::Arc;

use crate::error::{Result, invalid};
use crate::shape::AttentionShape;

/// Where a score sits: its batch entry, query head, query row and key (each counted from its
/// sequence's start), and the sequences' lengths. ([`crate::varlen`] runs each sequence of a
/// packed batch as a batch of one, so there `batch` is 0; the GPU kernels give a packed batch's
/// sequence index.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScoreIndex {
    pub batch: usize,
    pub head: usize,
    pub q: usize,
    pub kv: usize,
    pub n_q: usize,
    pub n_kv: usize,
}

impl ScoreIndex {
    /// The signed distance of key `kv` from query `q`'s diagonal, `kv − (q + n_kv − n_q)`
    /// (bottom-right aligned, as the causal mask): 0 on the diagonal, negative before it.
    pub fn from_diagonal(&self) -> i64 {
        self.kv as i64 - (self.q as i64 + self.n_kv as i64 - self.n_q as i64)
    }

    /// The query's position among the keys, `q + n_kv − n_q` (bottom-right aligned: the queries
    /// are the last `n_q` positions), or `None` when it lies before key 0 (`n_q > n_kv`).
    pub fn position(&self) -> Option<usize> {
        (self.q + self.n_kv).checked_sub(self.n_q)
    }
}

type Function = dyn Fn(f64, &ScoreIndex) -> f64 + Send + Sync;
type Derivative = dyn Fn(f64, f64, &ScoreIndex) -> f64 + Send + Sync;

/// A function of each scaled score, applied before the softmax (see the [module](self)).
///
/// Cheap to clone (the functions are shared). Two modifiers are equal when they are the same
/// functions (clones of one another).
#[derive(Clone)]
pub struct ScoreMod {
    name: Arc<str>,
    f: Arc<Function>,
    derivative: Option<Arc<Derivative>>,
    /// The query heads each per-head table of the modifier covers (ALiBi's slopes), checked
    /// against the problem.
    heads: Vec<usize>,
}

impl fmt::Debug for ScoreMod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScoreMod({})", self.name)
    }
}

impl PartialEq for ScoreMod {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.f, &other.f)
    }
}

impl ScoreMod {
    /// A modifier `f(score, index)`, named for reports and errors. Without a derivative
    /// ([`ScoreMod::with_derivative`]) it runs forward only: a backward pass refuses it.
    pub fn new(
        name: impl Into<String>,
        f: impl Fn(f64, &ScoreIndex) -> f64 + Send + Sync + 'static,
    ) -> Self {
        Self { name: name.into().into(), f: Arc::new(f), derivative: None, heads: Vec::new() }
    }

    /// This modifier with its derivative `∂t/∂s`, given the score `s`, the modified score
    /// `t = f(s)` (which often makes it cheap: softcap's is `1 − (t/c)²`) and the index.
    pub fn with_derivative(
        self,
        derivative: impl Fn(f64, f64, &ScoreIndex) -> f64 + Send + Sync + 'static,
    ) -> Self {
        Self { derivative: Some(Arc::new(derivative)), ..self }
    }

    /// Gemma-2's logit softcap: `cap · tanh(s / cap)`, which keeps every logit inside
    /// `(−cap, cap)`; its derivative is `1 − tanh² = 1 − (t / cap)²`. The cap must be positive
    /// and finite.
    pub fn softcap(cap: f64) -> Result<Self> {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(invalid("softcap", format!("must be positive and finite, got {cap}")));
        }
        Ok(Self::new(format!("softcap({cap})"), move |s, _| cap * (s / cap).tanh())
            .with_derivative(move |_, t, _| 1.0 - (t / cap) * (t / cap)))
    }

    /// ALiBi (Press et al. 2022), flash-attention's convention: `s − slope_h · |j − (i + n_kv −
    /// n_q)|`, a penalty linear in the distance from the (bottom-right aligned) diagonal, one
    /// slope per query head. Its derivative is 1. Every slope must be finite.
    pub fn alibi(slopes: Vec<f64>) -> Result<Self> {
        if let Some(bad) = slopes.iter().find(|s| !s.is_finite()) {
            return Err(invalid("alibi", format!("every slope must be finite, got {bad}")));
        }
        let heads = slopes.len();
        let f = move |s: f64, at: &ScoreIndex| {
            s - slopes[at.head] * at.from_diagonal().unsigned_abs() as f64
        };
        Ok(Self { heads: vec![heads], ..Self::new("alibi", f).with_derivative(|_, _, _| 1.0) })
    }

    /// The ALiBi paper's slopes for `heads` heads: the geometric sequence `2^(−8k/heads)`,
    /// `k = 1 … heads`, for a power of two (and its interleaving rule otherwise).
    pub fn alibi_slopes(heads: usize) -> Vec<f64> {
        fn power_of_two(n: usize) -> Vec<f64> {
            (1..=n).map(|k| 2f64.powf(-8.0 * k as f64 / n as f64)).collect()
        }
        if heads.is_power_of_two() || heads == 0 {
            return power_of_two(heads);
        }
        let below = 1 << heads.ilog2();
        let mut slopes = power_of_two(below);
        slopes.extend(power_of_two(2 * below).into_iter().step_by(2).take(heads - below));
        slopes
    }

    /// `self`, then `next` on its result (softcap then ALiBi is flash-attention's order).
    pub fn then(self, next: ScoreMod) -> Self {
        let name = format!("{} ∘ {}", next.name, self.name);
        let heads = [self.heads, next.heads].concat();
        let (f1, f2) = (self.f.clone(), next.f.clone());
        let f = move |s: f64, at: &ScoreIndex| f2(f1(s, at), at);
        let derivative = match (self.derivative, next.derivative) {
            (Some(g1), Some(g2)) => {
                let (f1, f2) = (self.f, next.f);
                Some(Arc::new(move |s: f64, _t: f64, at: &ScoreIndex| {
                    let mid = f1(s, at);
                    g1(s, mid, at) * g2(mid, f2(mid, at), at)
                }) as Arc<Derivative>)
            }
            _ => None,
        };
        Self { name: name.into(), f: Arc::new(f), derivative, heads }
    }

    /// The modifier's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether a backward pass can run through it.
    pub fn has_derivative(&self) -> bool {
        self.derivative.is_some()
    }

    /// `t = f(s)` at `at`.
    pub fn apply(&self, score: f64, at: &ScoreIndex) -> f64 {
        (self.f)(score, at)
    }

    /// `∂t/∂s` at `s` with `t = f(s)`; 1 for a modifier without a derivative (which
    /// [`ScoreMod::check`] keeps out of a backward pass).
    pub fn derivative(&self, score: f64, modified: f64, at: &ScoreIndex) -> f64 {
        self.derivative.as_ref().map_or(1.0, |g| g(score, modified, at))
    }

    /// Checks the modifier against the problem: a per-head table must cover every query head,
    /// and a backward pass needs a derivative.
    pub fn check(&self, shape: &AttentionShape, backward: bool) -> Result<()> {
        if let Some(&heads) = self.heads.iter().find(|&&h| h != shape.heads_q) {
            return Err(invalid(
                "score_mod",
                format!(
                    "{} has a table of {heads} heads for {} query heads",
                    self.name, shape.heads_q
                ),
            ));
        }
        if backward && self.derivative.is_none() {
            return Err(invalid(
                "score_mod",
                format!(
                    "{} has no derivative: give it one (with_derivative) for a backward pass",
                    self.name
                ),
            ));
        }
        Ok(())
    }
}
