//! The modifiers the suite draws, the CLI takes and the benchmarks time: score modifiers, each
//! with its two forms, a Rust closure for the CPU rungs ([`ladder_reference::ScoreMod`]) and CUDA
//! source for the kernels ([`ladder_kernels::ScoreMod`]), attention sinks (the same logits on
//! both sides), and mask modifiers ([`MaskSpec`]: documents, a prefix-LM mask, a dilated mask;
//! the CPU rungs for now). Writing your own score modifier is the same: give both forms (the
//! `check` API holds your CPU closure to the oracle, the GPU tests the source to the CPU).

use std::fmt;
use std::str::FromStr;

use ladder_kernels::{Options, Sinks};
use ladder_reference::{AttentionOptions, MaskMod, ScoreIndex, ScoreMod};

use crate::cases::pseudo_random;

/// A softcap's cap: positive and finite ([`Cap::new`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cap(f64);

impl Cap {
    /// `cap`, if positive and finite.
    pub fn new(cap: f64) -> Result<Cap, String> {
        if cap.is_finite() && cap > 0.0 {
            Ok(Cap(cap))
        } else {
            Err(format!("a softcap must be positive and finite, got {cap}"))
        }
    }

    /// The cap.
    pub fn get(self) -> f64 {
        self.0
    }
}

/// Half-width of [`ModifierSpec::RelativeBias`]'s table: distances beyond it share its ends.
pub const BIAS_RADIUS: i64 = 16;

/// A modifier by name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ModifierSpec {
    /// Gemma-2's logit softcap, `cap · tanh(s / cap)`.
    Softcap(Cap),
    /// ALiBi with the paper's slopes for the problem's heads ([`ScoreMod::alibi_slopes`]).
    Alibi,
    /// Softcap, then ALiBi (flash-attention's order when both are given).
    SoftcapAlibi(Cap),
    /// A user-style modifier: a learned relative-position bias read from a table (T5's, here
    /// `0.5 ·` a fixed pseudo-random table per head, distances clamped to ±[`BIAS_RADIUS`]).
    RelativeBias,
    /// Attention sinks, gpt-oss's: one logit per head in every row's softmax ([`sink_values`]).
    Sinks,
}

/// The sinks of [`ModifierSpec::Sinks`] for `heads` query heads: fixed pseudo-random logits in
/// [−1, 3), the range where a sink takes a visible share of a short row's softmax (values of
/// `f32`, so that both sides see the same numbers).
pub fn sink_values(heads: usize) -> Vec<f64> {
    pseudo_random(0x5171, heads).into_iter().map(|x| (1.0 + 2.0 * x) as f64).collect()
}

impl ModifierSpec {
    /// `opts` with this modifier, for a problem of `heads_q` query heads (a score modifier after
    /// any it already has).
    pub fn apply_cpu(&self, opts: AttentionOptions, heads_q: usize) -> AttentionOptions {
        match self.cpu(heads_q) {
            Some(m) => opts.with_score_mod(m),
            None => opts.with_sinks(sink_values(heads_q)),
        }
    }

    /// The kernels' options `opts` with this modifier, for `heads_q` query heads.
    pub fn apply_gpu(&self, opts: Options, heads_q: usize) -> Options {
        match self.gpu(heads_q) {
            Some(m) => opts.with_score_mod(m),
            None => {
                let sinks = sink_values(heads_q).into_iter().map(|s| s as f32).collect();
                opts.with_sinks(Sinks::new(sinks).expect("the sinks are finite"))
            }
        }
    }

    /// The score modifier's CPU form for a problem of `heads_q` query heads (none for sinks).
    pub fn cpu(&self, heads_q: usize) -> Option<ScoreMod> {
        let alibi = || {
            let slopes = ScoreMod::alibi_slopes(heads_q);
            ScoreMod::alibi(slopes).expect("the paper's slopes are finite")
        };
        Some(match *self {
            ModifierSpec::Softcap(cap) => softcap(cap),
            ModifierSpec::Alibi => alibi(),
            ModifierSpec::SoftcapAlibi(cap) => softcap(cap).then(alibi()),
            ModifierSpec::RelativeBias => {
                let table = bias_table(heads_q);
                let width = 2 * BIAS_RADIUS as usize + 1;
                ScoreMod::new("relative bias", move |s, at: &ScoreIndex| {
                    let r = at.from_diagonal().clamp(-BIAS_RADIUS, BIAS_RADIUS) + BIAS_RADIUS;
                    s + table[at.head * width + r as usize] as f64
                })
                .with_derivative(|_, _, _| 1.0)
            }
            ModifierSpec::Sinks => return None,
        })
    }

    /// The score modifier's kernel form for a problem of `heads_q` query heads: the same
    /// function as CUDA source (none for sinks).
    pub fn gpu(&self, heads_q: usize) -> Option<ladder_kernels::ScoreMod> {
        use ladder_kernels::ScoreMod as Gpu;
        let alibi = || {
            let slopes = ScoreMod::alibi_slopes(heads_q).into_iter().map(|s| s as f32).collect();
            Gpu::alibi(slopes).expect("the paper's slopes are finite")
        };
        let softcap = |cap: Cap| Gpu::softcap(cap.0 as f32).expect("a cap is positive");
        Some(match *self {
            ModifierSpec::Softcap(cap) => softcap(cap),
            ModifierSpec::Alibi => alibi(),
            ModifierSpec::SoftcapAlibi(cap) => softcap(cap).then(alibi()),
            ModifierSpec::Sinks => return None,
            ModifierSpec::RelativeBias => Gpu::new(
                "relative bias",
                format!(
                    "const int r = min(max(kv_idx - (q_idx + n_kv - n_q), -{BIAS_RADIUS}), \
                     {BIAS_RADIUS}) + {BIAS_RADIUS};\n\
                     return score + bias[h * {} + r];",
                    2 * BIAS_RADIUS + 1
                ),
            )
            .tensor("bias", bias_table(heads_q))
            .with_derivative("return 1.f;"),
        })
    }
}

/// The relative bias's table: `heads × (2·BIAS_RADIUS + 1)` values in [−0.5, 0.5).
fn bias_table(heads: usize) -> Vec<f32> {
    let width = 2 * BIAS_RADIUS as usize + 1;
    pseudo_random(0xb1a5, heads * width).into_iter().map(|x| 0.5 * x).collect()
}

/// The CPU softcap, `cap · tanh(s / cap)`.
fn softcap(cap: Cap) -> ScoreMod {
    ScoreMod::softcap(cap.0).expect("a Cap is positive and finite")
}

/// `softcap:CAP`, `alibi`, `softcap:CAP+alibi`, `relative-bias` or `sinks`.
impl FromStr for ModifierSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let cap = |c: &str| {
            c.parse::<f64>()
                .map_err(|_| format!("a softcap is a number, got {c:?}"))
                .and_then(Cap::new)
        };
        match text.trim() {
            "alibi" => Ok(ModifierSpec::Alibi),
            "relative-bias" => Ok(ModifierSpec::RelativeBias),
            "sinks" => Ok(ModifierSpec::Sinks),
            t => match t.strip_prefix("softcap:") {
                Some(rest) => match rest.strip_suffix("+alibi") {
                    Some(c) => Ok(ModifierSpec::SoftcapAlibi(cap(c)?)),
                    None => Ok(ModifierSpec::Softcap(cap(rest)?)),
                },
                None => Err(format!(
                    "a modifier is softcap:CAP, alibi, softcap:CAP+alibi, relative-bias or \
                     sinks, got {text:?}"
                )),
            },
        }
    }
}

impl fmt::Display for ModifierSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModifierSpec::Softcap(c) => write!(f, "softcap:{}", c.0),
            ModifierSpec::Alibi => write!(f, "alibi"),
            ModifierSpec::SoftcapAlibi(c) => write!(f, "softcap:{}+alibi", c.0),
            ModifierSpec::RelativeBias => write!(f, "relative-bias"),
            ModifierSpec::Sinks => write!(f, "sinks"),
        }
    }
}

/// A mask modifier by name ([`MaskMod`]): what packed training and prefix language models mask,
/// and a user-style mask whose rows see keys in several runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskSpec {
    /// `documents:N`: the keys split into `N` documents of near-equal length (key `j` of `n_kv`
    /// is in document `j · N / n_kv`), each query seeing its own document's keys
    /// ([`MaskMod::documents`]). With `--causal`, packed causal training.
    Documents(usize),
    /// `prefix-lm:P`: every query sees the first `P` keys and, causally, the keys up to its own
    /// position ([`MaskMod::prefix_lm`]; a whole mask: run it without `--causal`).
    PrefixLm(usize),
    /// `dilated:S`: a query sees the keys at distances from its diagonal that are multiples of
    /// `S` (LongNet's dilated attention, as one user-written `mask_mod`): every row's keys come in
    /// runs of one.
    Dilated(usize),
    /// `head-dilated:S`: `dilated` with a stride per head, `1 + h mod S` (LongNet's heads dilate
    /// differently): a mask that names the head, so its block mask has a row per head.
    HeadDilated(usize),
    /// `batch-prefix-lm:P`: `prefix-lm` with a prefix per batch entry, `P · (b + 1)` keys: a mask
    /// that names the batch entry, so its block mask has a row per entry.
    BatchPrefixLm(usize),
}

impl MaskSpec {
    /// The CPU form for a problem of `n_kv` keys.
    pub fn cpu(&self, n_kv: usize) -> MaskMod {
        match *self {
            MaskSpec::Documents(docs) => MaskMod::documents(document_ids(docs, n_kv)),
            MaskSpec::PrefixLm(prefix) => MaskMod::prefix_lm(prefix),
            MaskSpec::Dilated(stride) => {
                let stride = stride.max(1) as i64;
                MaskMod::new(format!("dilated({stride})"), move |at: &ScoreIndex| {
                    at.from_diagonal() % stride == 0
                })
            }
            MaskSpec::HeadDilated(strides) => {
                let strides = strides.max(1);
                MaskMod::new(format!("head-dilated({strides})"), move |at: &ScoreIndex| {
                    at.from_diagonal() % (1 + at.head % strides) as i64 == 0
                })
            }
            MaskSpec::BatchPrefixLm(prefix) => {
                MaskMod::new(format!("batch-prefix-lm({prefix})"), move |at: &ScoreIndex| {
                    at.kv < prefix * (at.batch + 1) || at.from_diagonal() <= 0
                })
            }
        }
    }

    /// `opts` with this mask modifier, for a problem of `n_kv` keys (and any mask modifier it
    /// already has).
    pub fn apply_cpu(&self, opts: AttentionOptions, n_kv: usize) -> AttentionOptions {
        opts.with_mask_mod(self.cpu(n_kv))
    }

    /// The kernels' form of [`MaskSpec::cpu`], the same function as CUDA source
    /// ([`ladder_kernels::MaskMod`]).
    pub fn gpu(&self, n_kv: usize) -> ladder_kernels::Result<ladder_kernels::MaskMod> {
        use ladder_kernels::MaskMod as Gpu;
        let int = |x: usize, what: &str| {
            i32::try_from(x)
                .map_err(|_| ladder_kernels::KernelError::Shape(format!("{what} {x} is too large")))
        };
        match *self {
            MaskSpec::Documents(docs) => Gpu::documents(document_ids(docs, n_kv)),
            MaskSpec::PrefixLm(prefix) => Gpu::prefix_lm(prefix),
            MaskSpec::Dilated(stride) => {
                let stride = i32::try_from(stride.max(1)).map_err(|_| {
                    ladder_kernels::KernelError::Shape(format!("dilated stride {stride}"))
                })?;
                Ok(Gpu::new(
                    format!("dilated({stride})"),
                    "return (kv_idx - (q_idx + n_kv - n_q)) % stride == 0;",
                )
                .int("stride", stride))
            }
            MaskSpec::HeadDilated(strides) => Ok(Gpu::new(
                format!("head-dilated({strides})"),
                "return (kv_idx - (q_idx + n_kv - n_q)) % (1 + h % strides) == 0;",
            )
            .int("strides", int(strides.max(1), "head-dilated strides")?)),
            MaskSpec::BatchPrefixLm(prefix) => Ok(Gpu::new(
                format!("batch-prefix-lm({prefix})"),
                "return kv_idx < prefix * (b + 1) || kv_idx <= q_idx + n_kv - n_q;",
            )
            .int("prefix", int(prefix, "batch-prefix-lm prefix")?)),
        }
    }
}

/// The document of each of `n_kv` keys split into `docs` documents of near-equal length
/// ([`MaskSpec::Documents`]): key `j` is in document `j · docs / n_kv`.
fn document_ids(docs: usize, n_kv: usize) -> Vec<u32> {
    let docs = docs.max(1);
    (0..n_kv).map(|j| (j * docs / n_kv) as u32).collect()
}

/// `documents:N`, `prefix-lm:P`, `dilated:S`, `head-dilated:S` or `batch-prefix-lm:P` (`N`, `S`
/// at least 1).
impl FromStr for MaskSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let usage = || {
            format!(
                "a mask modifier is documents:N, prefix-lm:P, dilated:S, head-dilated:S or \
                 batch-prefix-lm:P, got {text:?}"
            )
        };
        let (name, value) = text.trim().split_once(':').ok_or_else(usage)?;
        let value: usize = value.parse().map_err(|_| usage())?;
        match name {
            "documents" if value >= 1 => Ok(MaskSpec::Documents(value)),
            "prefix-lm" => Ok(MaskSpec::PrefixLm(value)),
            "dilated" if value >= 1 => Ok(MaskSpec::Dilated(value)),
            "head-dilated" if value >= 1 => Ok(MaskSpec::HeadDilated(value)),
            "batch-prefix-lm" => Ok(MaskSpec::BatchPrefixLm(value)),
            "documents" | "dilated" | "head-dilated" => {
                Err(format!("{name} takes a count of at least 1, got 0"))
            }
            _ => Err(usage()),
        }
    }
}

impl fmt::Display for MaskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaskSpec::Documents(n) => write!(f, "documents:{n}"),
            MaskSpec::PrefixLm(p) => write!(f, "prefix-lm:{p}"),
            MaskSpec::Dilated(s) => write!(f, "dilated:{s}"),
            MaskSpec::HeadDilated(s) => write!(f, "head-dilated:{s}"),
            MaskSpec::BatchPrefixLm(p) => write!(f, "batch-prefix-lm:{p}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_read_back_what_they_print() {
        for text in ["softcap:50", "alibi", "softcap:30+alibi", "relative-bias", "sinks"] {
            let spec: ModifierSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        for bad in ["softcap:0", "softcap:-1", "softcap:nan", "softcap:", "tanh", "softcap:x+alibi"]
        {
            assert!(bad.parse::<ModifierSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_cpu_forms_are_their_definitions() {
        let at = ScoreIndex { batch: 0, head: 1, q: 2, kv: 9, n_q: 4, n_kv: 10 };
        // Bottom-right: query 2's diagonal is key 8, so key 9 is one past it.
        assert_eq!(at.from_diagonal(), 1);
        let cap = ModifierSpec::Softcap(Cap::new(5.0).unwrap()).cpu(2).unwrap();
        assert!((cap.apply(7.0, &at) - 5.0 * (7.0f64 / 5.0).tanh()).abs() < 1e-15);
        let slope = ScoreMod::alibi_slopes(2)[1];
        assert_eq!(ModifierSpec::Alibi.cpu(2).unwrap().apply(3.0, &at), 3.0 - slope);
        let both = ModifierSpec::SoftcapAlibi(Cap::new(5.0).unwrap()).cpu(2).unwrap();
        assert!((both.apply(7.0, &at) - (5.0 * (1.4f64).tanh() - slope)).abs() < 1e-15);
        // The chain rule through both: softcap's derivative times ALiBi's 1.
        let t = 5.0 * (1.4f64).tanh();
        let want = 1.0 - (t / 5.0) * (t / 5.0);
        assert!((both.derivative(7.0, both.apply(7.0, &at), &at) - want).abs() < 1e-15);
    }

    #[test]
    fn mask_specs_read_back_what_they_print_and_are_their_definitions() {
        for text in [
            "documents:4",
            "prefix-lm:0",
            "prefix-lm:17",
            "dilated:2",
            "head-dilated:3",
            "batch-prefix-lm:5",
        ] {
            let spec: MaskSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        for bad in [
            "documents:0",
            "dilated:0",
            "head-dilated:0",
            "documents",
            "prefix-lm:-1",
            "causal:1",
            "x:y",
        ] {
            assert!(bad.parse::<MaskSpec>().is_err(), "{bad}");
        }
        // 10 keys in 3 documents: keys 0-3, 4-6, 7-9; 4 queries at positions 6…9.
        let docs = MaskSpec::Documents(3).cpu(10);
        let at = |q, kv| ScoreIndex { batch: 0, head: 0, q, kv, n_q: 4, n_kv: 10 };
        let seen: Vec<usize> = (0..10).filter(|&j| docs.sees(&at(0, j))).collect();
        assert_eq!(seen, [4, 5, 6]);
        let seen: Vec<usize> = (0..10).filter(|&j| docs.sees(&at(1, j))).collect();
        assert_eq!(seen, [7, 8, 9]);
        let prefix = MaskSpec::PrefixLm(2).cpu(10);
        let seen: Vec<usize> = (0..10).filter(|&j| prefix.sees(&at(0, j))).collect();
        assert_eq!(seen, [0, 1, 2, 3, 4, 5, 6]);
        let dilated = MaskSpec::Dilated(3).cpu(10);
        let seen: Vec<usize> = (0..10).filter(|&j| dilated.sees(&at(3, j))).collect();
        assert_eq!(seen, [0, 3, 6, 9]);
        // Head 1 of head-dilated:2 dilates by 2, head 2 by 1 (every key).
        let per_head = MaskSpec::HeadDilated(2).cpu(10);
        let on = |head, q| -> Vec<usize> {
            (0..10).filter(|&j| per_head.sees(&ScoreIndex { head, ..at(q, j) })).collect()
        };
        assert_eq!(on(1, 3), [1, 3, 5, 7, 9]);
        assert_eq!(on(2, 3).len(), 10);
        // Query 0 of 10 (position 0) sees the prefix: 2 keys in batch entry 0, 4 in entry 1.
        let per_batch = MaskSpec::BatchPrefixLm(2).cpu(10);
        let first = |batch| -> Vec<usize> {
            let at = |kv| ScoreIndex { batch, head: 0, q: 0, kv, n_q: 10, n_kv: 10 };
            (0..10).filter(|&j| per_batch.sees(&at(j))).collect()
        };
        assert_eq!(first(0), [0, 1]);
        assert_eq!(first(1), [0, 1, 2, 3]);
    }

    #[test]
    fn alibi_slopes_follow_the_paper() {
        assert_eq!(ScoreMod::alibi_slopes(8)[0], 0.5);
        assert_eq!(ScoreMod::alibi_slopes(8)[7], 2f64.powi(-8));
        // 12 heads: the 8 of a power of two, then every other one of 16's.
        let twelve = ScoreMod::alibi_slopes(12);
        assert_eq!(twelve.len(), 12);
        assert_eq!(twelve[8], 2f64.powf(-0.5));
        assert_eq!(twelve[9], 2f64.powf(-1.5));
    }
}
