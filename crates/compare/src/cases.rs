//! Random attention problems: the proptest strategies every equivalence test draws from.
//!
//! A [`Case`] is small and printable (sizes, options and a seed); its tensors are generated from
//! the seed, so proptest shrinks a failure down to the smallest shape and options that still
//! fail, and the report names a case anyone can rerun. The GPU rungs reuse these strategies with
//! their own [`CaseSpace`].

use std::ops::RangeInclusive;

use ladder_reference::{AttentionOptions, AttentionShape, Element, TileSizes, Window};

use crate::modifiers::{Cap, MaskSpec, ModifierSpec};
use ndarray::Array4;
use proptest::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

/// One attention problem: sizes, options, and the seed of its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub shape: AttentionShape,
    pub causal: bool,
    /// A sliding window around each row's diagonal (none: `Window::default()`).
    pub window: Window,
    /// A modifier: a score modifier or sinks (none by default).
    pub score_mod: Option<ModifierSpec>,
    /// A mask modifier, which hides pairs inside the band (none by default; the CPU rungs).
    pub mask_mod: Option<MaskSpec>,
    /// Standard deviation of the logits `scale · q · k`: 1 is a trained model's regime,
    /// thousands stress overflow (the scale is `logit_std / √d` on unit-normal inputs).
    pub logit_std: f64,
    pub tiles: TileSizes,
    pub splits: usize,
    pub seed: u64,
}

/// The tensors of a case: inputs and an upstream gradient, all unit-normal.
#[derive(Debug, Clone)]
pub struct Inputs<T> {
    pub q: Array4<T>,
    pub k: Array4<T>,
    pub v: Array4<T>,
    /// Upstream gradient `dO` for the backward rungs (shape of `q`).
    pub d_o: Array4<T>,
}

impl<T: Element> Inputs<T> {
    /// The same tensors in `f64` (exactly).
    pub fn widen(&self) -> Inputs<f64> {
        let wide = |x: &Array4<T>| x.mapv(|v| v.as_f64());
        Inputs { q: wide(&self.q), k: wide(&self.k), v: wide(&self.v), d_o: wide(&self.d_o) }
    }
}

impl Case {
    /// The softmax scale giving logits of standard deviation `logit_std`.
    pub fn scale(&self) -> f64 {
        self.logit_std / (self.shape.d as f64).sqrt()
    }

    pub fn attention(&self) -> AttentionOptions {
        let opts = AttentionOptions {
            causal: self.causal,
            scale: Some(self.scale()),
            window: self.window,
            ..Default::default()
        };
        let opts = match self.mask_mod {
            Some(m) => m.apply_cpu(opts, self.shape.n_kv),
            None => opts,
        };
        match self.score_mod {
            Some(m) => m.apply_cpu(opts, self.shape.heads_q),
            None => opts,
        }
    }

    /// The kernels' options `opts` with the case's modifiers: its score modifier or sinks, and
    /// its mask modifier (a mask that cannot be made, a document id past 2²⁴, is left out and the
    /// mismatch then shows in the comparison).
    pub fn kernel_modifier(&self, opts: ladder_kernels::Options) -> ladder_kernels::Options {
        let opts = match self.mask_mod.map(|m| m.gpu(self.shape.n_kv)) {
            Some(Ok(m)) => opts.with_mask_mod(m),
            _ => opts,
        };
        match self.score_mod {
            Some(m) => m.apply_gpu(opts, self.shape.heads_q),
            None => opts,
        }
    }

    /// Unit-normal tensors from the case's seed.
    pub fn inputs<T: Element>(&self) -> Inputs<T> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut normal = |dims: [usize; 4]| {
            Array4::from_shape_simple_fn(dims, || T::of(rng.sample(StandardNormal)))
        };
        let s = &self.shape;
        Inputs {
            q: normal(s.q_dims()),
            k: normal(s.kv_dims()),
            v: normal(s.kv_dims()),
            d_o: normal(s.q_dims()),
        }
    }

    /// Like [`Case::inputs`], plus outliers: each entry of `Q, K, V` independently, with
    /// probability `p`, gets an extra normal term of standard deviation `std` (the FA3 paper's
    /// `N(0,1) + N(0,100)·Bernoulli(0.001)` is `p = 0.001, std = 10`).
    pub fn inputs_with_outliers<T: Element>(&self, p: f64, std: f64) -> Inputs<T> {
        let mut inputs = self.inputs::<T>();
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x9E37_79B9_7F4A_7C15);
        for x in [&mut inputs.q, &mut inputs.k, &mut inputs.v] {
            x.mapv_inplace(|v| {
                if rng.random_bool(p) {
                    v + T::of(std * rng.sample::<f64, _>(StandardNormal))
                } else {
                    v
                }
            });
        }
        inputs
    }
}

/// The space a strategy draws cases from.
#[derive(Debug, Clone)]
pub struct CaseSpace {
    pub batch: RangeInclusive<usize>,
    pub heads_kv: RangeInclusive<usize>,
    /// q heads per kv head (GQA group size).
    pub group: RangeInclusive<usize>,
    pub n_q: RangeInclusive<usize>,
    pub n_kv: RangeInclusive<usize>,
    pub head_dims: Vec<usize>,
    pub block: RangeInclusive<usize>,
    pub splits: RangeInclusive<usize>,
    /// Largest logit standard deviation drawn (log-uniformly from 0.1; half the cases use 1).
    pub max_logit_std: f64,
    /// Whether a quarter of the cases get a sliding window (each side open, or bounded by up to
    /// a few keys past the longest sequence), for the rungs that take one (off in
    /// [`CaseSpace::cpu`]: an implementation under check may know only the causal mask).
    pub windows: bool,
    /// Whether a quarter of the cases get a score modifier ([`score_mods`]; off in
    /// [`CaseSpace::cpu`], for the same reason).
    pub score_mods: bool,
    /// Whether a quarter of the cases get a mask modifier ([`mask_mods`]; off in
    /// [`CaseSpace::cpu`], for the same reason).
    pub mask_mods: bool,
}

impl CaseSpace {
    /// Small problems for the CPU rungs: any length and head dim from 1, blocks from 1,
    /// more splits than keys, logits up to the ±10⁴ range.
    pub fn cpu() -> Self {
        Self {
            batch: 1..=2,
            heads_kv: 1..=2,
            group: 1..=3,
            n_q: 1..=40,
            n_kv: 1..=40,
            head_dims: (1..=24).collect(),
            block: 1..=17,
            splits: 1..=12,
            max_logit_std: 3000.0,
            windows: false,
            score_mods: false,
            mask_mods: false,
        }
    }

    /// Decoding: a few query rows against a longer cache.
    pub fn decode() -> Self {
        Self { n_q: 1..=4, n_kv: 1..=200, ..Self::cpu() }
    }

    /// Only logits in a trained model's range (standard deviation up to 3).
    pub fn moderate_logits(self) -> Self {
        Self { max_logit_std: 3.0, ..self }
    }

    /// Sliding windows in a quarter of the cases ([`CaseSpace::windows`]).
    pub fn with_windows(self) -> Self {
        Self { windows: true, ..self }
    }

    /// Score modifiers in a quarter of the cases ([`CaseSpace::score_mods`]).
    pub fn with_score_mods(self) -> Self {
        Self { score_mods: true, ..self }
    }

    /// Mask modifiers in a quarter of the cases ([`CaseSpace::mask_mods`]).
    pub fn with_mask_mods(self) -> Self {
        Self { mask_mods: true, ..self }
    }
}

/// Cases drawn from `space`.
pub fn cases(space: CaseSpace) -> impl Strategy<Value = Case> {
    let window = windows(space.windows, space.n_q.end().max(space.n_kv.end()) + 4);
    let longest = *space.n_kv.end();
    let window = (window, score_mods(space.score_mods), mask_mods(space.mask_mods, longest));
    let sizes = (
        space.batch,
        space.heads_kv,
        space.group,
        space.n_q,
        space.n_kv,
        prop::sample::select(space.head_dims),
    );
    let max_exp = space.max_logit_std.log10();
    let logit_std = prop_oneof![Just(1.0), (-1.0..=max_exp).prop_map(|e: f64| 10f64.powf(e))];
    let options =
        (any::<bool>(), logit_std, space.block.clone(), space.block, space.splits, any::<u64>());
    (sizes, options, window).prop_map(
        |(
            (batch, heads_kv, group, n_q, n_kv, d),
            (causal, logit_std, br, bc, splits, seed),
            (window, score_mod, mask_mod),
        )| {
            Case {
                shape: AttentionShape::new(batch, heads_kv * group, heads_kv, n_q, n_kv, d)
                    .expect("sizes from ranges ≥ 1"),
                causal,
                window,
                score_mod,
                mask_mod,
                logit_std,
                tiles: TileSizes::new(br, bc).expect("blocks from a range ≥ 1"),
                splits,
                seed,
            }
        },
    )
}

/// No window, or (a quarter of the time, when `on`) one whose sides are each open or up to
/// `longest` keys: from a band of one diagonal to one wider than the sequences.
pub fn windows(on: bool, longest: usize) -> BoxedStrategy<Window> {
    if !on {
        return Just(Window::default()).boxed();
    }
    let side = prop::option::of(0..=longest);
    let window = (side.clone(), side).prop_map(|(left, right)| Window { left, right });
    prop_oneof![3 => Just(Window::default()), 1 => window].boxed()
}

/// No modifier, or (a quarter of the time, when `on`) one of the built-ins, the relative bias or sinks,
/// with caps from well below the drawn logits' range (where softcap bends every score) to above.
pub fn score_mods(on: bool) -> BoxedStrategy<Option<ModifierSpec>> {
    if !on {
        return Just(None).boxed();
    }
    let cap = prop::sample::select(vec![0.5, 5.0, 30.0, 50.0])
        .prop_map(|c| Cap::new(c).expect("positive"));
    let spec = prop_oneof![
        cap.clone().prop_map(ModifierSpec::Softcap),
        Just(ModifierSpec::Alibi),
        cap.prop_map(ModifierSpec::SoftcapAlibi),
        Just(ModifierSpec::RelativeBias),
        Just(ModifierSpec::Sinks),
    ];
    prop_oneof![3 => Just(None), 1 => spec.prop_map(Some)].boxed()
}

/// No mask modifier, or (a quarter of the time, when `on`) documents (1 to 5), a prefix of up to
/// `longest` keys, or a dilated mask (strides 2 and 3: rows that see keys in several runs), or
/// masks that name the head or the batch entry (a stride per head, a prefix per entry).
pub fn mask_mods(on: bool, longest: usize) -> BoxedStrategy<Option<MaskSpec>> {
    if !on {
        return Just(None).boxed();
    }
    let spec = prop_oneof![
        (1..=5usize).prop_map(MaskSpec::Documents),
        (0..=longest).prop_map(MaskSpec::PrefixLm),
        (2..=3usize).prop_map(MaskSpec::Dilated),
        (2..=3usize).prop_map(MaskSpec::HeadDilated),
        (0..=longest / 2).prop_map(MaskSpec::BatchPrefixLm),
    ];
    prop_oneof![3 => Just(None), 1 => spec.prop_map(Some)].boxed()
}

/// `len` deterministic values in [-1, 1): the splitmix64 stream of `seed`. The same inputs on
/// every run and machine, for benchmarks and for GPU tests that need fixed data.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..len)
        .map(|_| {
            // splitmix64
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A deterministic shuffle of `0 .. n` (the order of [`pseudo_random`]`(seed, n)`, ties broken by
/// index): page tables whose pages are scattered, the same on every run.
pub fn permutation(seed: u64, n: usize) -> Vec<usize> {
    let keys = pseudo_random(seed, n);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]).then(a.cmp(&b)));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_shuffle_every_index_once() {
        let p = permutation(7, 1000);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(p, sorted, "shuffled");
        assert_eq!(p, permutation(7, 1000));
        assert_ne!(p, permutation(8, 1000));
        assert!(permutation(1, 0).is_empty());
    }
}
