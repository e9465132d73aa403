//! Score modifiers compiled into the kernels: softcap, ALiBi, and your own.
//!
//! A [`ScoreMod`] rewrites each scaled score `s = scale · q·k` before the softmax, as
//! FlexAttention's `score_mod` does: `O = softmax(score_mod(s) + mask) V`. It is CUDA source, the
//! body of a device function
//!
//! ```text
//! float score_mod(float score, int b, int h, int q_idx, int kv_idx, int n_q, int n_kv,
//!                 float q_pos, float kv_pos)
//! ```
//!
//! (`b` the batch entry — a packed batch's sequence —, `h` the query head, `q_idx` and `kv_idx`
//! counted from the sequence's start, `n_q` and `n_kv` its lengths, `q_pos` and `kv_pos` the two
//! indices as floats: arithmetic on positions is cheaper in float, since an int-to-float
//! conversion per score runs at the rate of an exponential), with named scalars and `f32` tables
//! it may read. The kernels are compiled at run time, so the body is compiled into
//! them (through NVRTC, as every kernel is): a modifier costs what its arithmetic costs, and a kernel without one
//! carries nothing of it. The built-ins are written the same way ([`ScoreMod::softcap`],
//! [`ScoreMod::alibi`]); modifiers compose with [`ScoreMod::then`].
//!
//! The backward pass needs `∂t/∂s` for `t = score_mod(s)`: a second body
//! ([`ScoreMod::with_derivative`]) that also sees the modified score as `out`. A compile error in
//! a body comes back as [`crate::KernelError::Compile`] with NVRTC's log, its lines numbered as in
//! the body and the file named after the modifier.
//!
//! The kernels evaluate the body on every entry of a score tile they compute, the tile's padding
//! included: `q_idx < n_q` and `kv_idx < n_kv` always hold (padding entries see the last row or
//! key, and their results are masked away), so a table indexed by them stays in bounds.
//!
//! ```
//! use ladder_kernels::ScoreMod;
//!
//! // A relative-position bias from a table of 2·16 + 1 entries per head (here 8 heads).
//! let table: Vec<f32> = (0..8 * 33).map(|i| (i % 33) as f32 * 0.01).collect();
//! let bias = ScoreMod::new(
//!     "relative bias",
//!     "int r = min(max(kv_idx - q_idx, -16), 16) + 16;\n\
//!      return score + bias[h * 33 + r];",
//! )
//! .tensor("bias", table)
//! .with_derivative("return 1.f;");
//! let both = ScoreMod::softcap(30.0)?.then(bias);
//! assert_eq!(both.name(), "softcap(30) → relative bias");
//! # Ok::<(), ladder_kernels::KernelError>(())
//! ```

use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};

use cudarc::driver::DeviceRepr;

use crate::error::{KernelError, Result};
use crate::gpu::Gpu;

/// Scalars and tables a modifier (all stages of a composed one together) may name.
pub const MAX_SCALARS: usize = 8;
/// See [`MAX_SCALARS`].
pub const MAX_TENSORS: usize = 4;

/// One stage of a modifier: its source and what it reads.
#[derive(Clone, Debug, PartialEq)]
struct Stage {
    /// The name in the generated source (its `#line` file), part of the variant's key.
    name: String,
    /// The name in errors and [`ScoreMod::name`] (with a built-in's values, which the source
    /// does not hold: they travel in the parameters).
    label: String,
    body: String,
    derivative: Option<String>,
    scalars: Vec<(String, f32)>,
    tensors: Vec<(String, Arc<[f32]>)>,
    /// The query heads a per-head table covers (ALiBi's slopes), checked against the problem.
    heads: Option<usize>,
}

/// A function of each scaled score, compiled into the kernels (see the [module](self)).
#[derive(Clone, Debug)]
pub struct ScoreMod {
    stages: Vec<Stage>,
    /// The generated header and its key, made once (every launch builds its variant from them)
    /// and dropped whenever a stage changes.
    generated: OnceLock<Generated>,
}

/// A modifier's generated header ([`ScoreMod::header`], [`crate::MaskMod`]'s) and the variant key
/// hashed from it.
#[derive(Clone, Debug)]
pub(crate) struct Generated {
    pub(crate) key: String,
    pub(crate) header: Arc<str>,
}

impl Generated {
    pub(crate) fn of(header: String) -> Generated {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        header.hash(&mut hasher);
        Generated { key: format!("{:016x}", hasher.finish()), header: header.into() }
    }
}

/// Fails unless every name a modifier (`kind`, `label`) binds for its body is a C identifier.
pub(crate) fn check_identifiers<'a>(
    kind: &str,
    label: &str,
    names: impl IntoIterator<Item = &'a String>,
) -> Result<()> {
    match names.into_iter().find(|name| !is_identifier(name)) {
        Some(name) => {
            Err(KernelError::Shape(format!("{kind} {label}: {name:?} is not a C identifier")))
        }
        None => Ok(()),
    }
}

/// Two modifiers are equal when their stages are (whether either has made its header yet does not
/// matter).
impl PartialEq for ScoreMod {
    fn eq(&self, other: &ScoreMod) -> bool {
        self.stages == other.stages
    }
}

impl ScoreMod {
    /// A modifier from the body of `float score_mod(float score, int b, int h, int q_idx, int
    /// kv_idx, int n_q, int n_kv, float q_pos, float kv_pos)` (see the [module](self)), named for
    /// errors and logs. Forward only until it has a derivative ([`ScoreMod::with_derivative`]).
    pub fn new(name: impl Into<String>, body: impl Into<String>) -> ScoreMod {
        let name = name.into();
        let stage = Stage {
            label: name.clone(),
            name,
            body: body.into(),
            derivative: None,
            scalars: Vec::new(),
            tensors: Vec::new(),
            heads: None,
        };
        ScoreMod { stages: vec![stage], generated: OnceLock::new() }
    }

    /// The body of `∂t/∂s`, which sees the arguments of the modifier and `float out`, the
    /// modified score `t` (softcap's is `1 − (out / cap)²`).
    pub fn with_derivative(mut self, body: impl Into<String>) -> ScoreMod {
        self.last().derivative = Some(body.into());
        self
    }

    /// A scalar the body reads as `const float name`.
    pub fn scalar(mut self, name: impl Into<String>, value: f32) -> ScoreMod {
        self.last().scalars.push((name.into(), value));
        self
    }

    /// A table the body reads as `const float* name` (copied to the device on its first use and
    /// kept there while this modifier or a clone of it lives).
    pub fn tensor(mut self, name: impl Into<String>, values: Vec<f32>) -> ScoreMod {
        self.last().tensors.push((name.into(), values.into()));
        self
    }

    /// Gemma-2's logit softcap, `cap · tanh(score / cap)`, its derivative `1 − (out / cap)²`.
    /// `tanh` is computed as `1 − 2 / (e^{2x} + 1)` on the fast exponential: its error is a few
    /// units of f32's last place of the cap, where `tanh.approx` (about 2⁻¹¹ of its result) would
    /// put up to `cap · 2⁻¹¹` into a logit, 2 % of a probability at a cap of 50. The cap must be
    /// positive and finite.
    pub fn softcap(cap: f32) -> Result<ScoreMod> {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(KernelError::Shape(format!(
                "softcap must be positive and finite, got {cap}"
            )));
        }
        // e^{2s/cap} as one exponential (base 2, its factor from the host), and one reciprocal.
        let mut softcap = ScoreMod::new(
            "softcap",
            "const float e = exp2f(score * two_log2e_over_cap);\n\
             return cap - __fdividef(two_cap, e + 1.f);",
        )
        .scalar("cap", cap)
        .scalar("two_log2e_over_cap", 2.0 * std::f32::consts::LOG2_E / cap)
        .scalar("two_cap", 2.0 * cap)
        .with_derivative("const float t = out / cap;\nreturn 1.f - t * t;");
        softcap.last().label = format!("softcap({cap})");
        Ok(softcap)
    }

    /// ALiBi with flash-attention's convention: `score − slope_h · |kv_idx − (q_idx + n_kv −
    /// n_q)|`, one slope per query head (`slopes.len()` must be the problem's `heads_q`).
    pub fn alibi(slopes: Vec<f32>) -> Result<ScoreMod> {
        if let Some(bad) = slopes.iter().find(|s| !s.is_finite()) {
            return Err(KernelError::Shape(format!("every ALiBi slope must be finite, got {bad}")));
        }
        let heads = slopes.len();
        let mut alibi = ScoreMod::new(
            "alibi",
            "return score - slopes[h] * fabsf(kv_pos - (q_pos + (float)(n_kv - n_q)));",
        )
        .tensor("slopes", slopes)
        .with_derivative("return 1.f;");
        alibi.last().heads = Some(heads);
        Ok(alibi)
    }

    /// `self`, then `next` on its result (softcap then ALiBi is flash-attention's order).
    pub fn then(mut self, next: ScoreMod) -> ScoreMod {
        self.stages.extend(next.stages);
        self.generated = OnceLock::new();
        self
    }

    /// The stages' names, first to last, joined by `→`.
    pub fn name(&self) -> String {
        self.stages.iter().map(|s| s.label.as_str()).collect::<Vec<_>>().join(" → ")
    }

    /// Whether every stage has a derivative (a backward pass needs them).
    pub fn has_derivative(&self) -> bool {
        self.stages.iter().all(|s| s.derivative.is_some())
    }

    /// The last stage, to change (which drops the generated header).
    fn last(&mut self) -> &mut Stage {
        self.generated = OnceLock::new();
        self.stages.last_mut().expect("a modifier has a stage")
    }

    /// Checks what the kernels need: the counts of scalars and tables, names that are C
    /// identifiers, per-head tables as long as the heads, and a derivative for a backward pass.
    pub(crate) fn check(&self, heads_q: usize, backward: bool) -> Result<()> {
        let scalars: usize = self.stages.iter().map(|s| s.scalars.len()).sum();
        let tensors: usize = self.stages.iter().map(|s| s.tensors.len()).sum();
        if scalars > MAX_SCALARS || tensors > MAX_TENSORS {
            return Err(KernelError::Shape(format!(
                "score_mod {} names {scalars} scalars and {tensors} tables; the kernels take up \
                 to {MAX_SCALARS} and {MAX_TENSORS}",
                self.name()
            )));
        }
        for stage in &self.stages {
            let names =
                stage.scalars.iter().map(|(n, _)| n).chain(stage.tensors.iter().map(|(n, _)| n));
            check_identifiers("score_mod", &stage.label, names)?;
            if let Some(heads) = stage.heads
                && heads != heads_q
            {
                return Err(KernelError::Shape(format!(
                    "score_mod {} has {heads} slopes for {heads_q} query heads",
                    stage.label
                )));
            }
            if backward && stage.derivative.is_none() {
                return Err(KernelError::Shape(format!(
                    "score_mod {} has no derivative: give it one (ScoreMod::with_derivative) for \
                     a backward pass",
                    stage.label
                )));
            }
        }
        Ok(())
    }

    /// The header `score_mod_body.cuh` the kernels include when compiled with
    /// `LADDER_SCORE_MOD` (`cuda/score_mod.cuh`): one namespace per stage, then the composed
    /// `score_mod` and `score_mod_derivative`.
    pub(crate) fn header(&self) -> String {
        const ARGS: &str = "float score, const ScoreAt& at, const ModifierArgs& args";
        // The body's names for the score's place (score_mod.cuh's ScoreAt).
        const PLACE: &str = "const int b = at.b, h = at.h, q_idx = at.q_idx, kv_idx = at.kv_idx;\n    \
             const int n_q = at.n_q, n_kv = at.n_kv;\n    \
             const float q_pos = at.q_pos, kv_pos = at.kv_pos;\n    \
             (void)b; (void)h; (void)q_idx; (void)kv_idx; (void)n_q; (void)n_kv; (void)q_pos; \
             (void)kv_pos; (void)args;";
        let mut text = String::from("// Generated from a ladder_kernels::ScoreMod.\n");
        let (mut scalar, mut tensor) = (0, 0);
        for (i, stage) in self.stages.iter().enumerate() {
            // The stage's scalars and tables, bound to their names where a body uses them.
            let mut slots = Vec::new();
            for (name, _) in &stage.scalars {
                slots.push((format!("const float {name} = args.scalar[{scalar}];"), name));
                scalar += 1;
            }
            for (name, _) in &stage.tensors {
                slots.push((
                    format!("const float* __restrict__ {name} = args.tensor[{tensor}];"),
                    name,
                ));
                tensor += 1;
            }
            let reads = |body: &str| -> String {
                let used = slots.iter().filter(|(_, name)| mentions(body, name));
                used.map(|(line, _)| format!("    {line}\n")).collect()
            };
            let file = stage.name.replace(['"', '\\', '\n'], "_");
            let body = &stage.body;
            let _ = write!(
                text,
                "namespace score_mod_{i} {{\n\
                 __device__ __forceinline__ float apply({ARGS}) {{\n    {PLACE}\n{}\
                 #line 1 \"{file}\"\n{body}\n}}\n",
                reads(body)
            );
            let derivative = stage.derivative.as_deref().unwrap_or("return 1.f;");
            let _ = write!(
                text,
                "__device__ __forceinline__ float derivative(float out, {ARGS}) {{\n    (void)out; \
                 {PLACE}\n{}#line 1 \"{file} (derivative)\"\n{derivative}\n}}\n}}\n",
                reads(derivative)
            );
        }
        let call = "at, args";
        let _ = writeln!(text, "__device__ __forceinline__ float score_mod({ARGS}) {{");
        for i in 0..self.stages.len() {
            let _ = writeln!(text, "    score = score_mod_{i}::apply(score, {call});");
        }
        let _ = writeln!(text, "    return score;\n}}");
        let _ = writeln!(text, "__device__ __forceinline__ float score_mod_derivative({ARGS}) {{");
        let _ = writeln!(text, "    float slope = 1.f;");
        for i in 0..self.stages.len() {
            let _ = writeln!(
                text,
                "    {{ const float out = score_mod_{i}::apply(score, {call});\n      \
                 slope *= score_mod_{i}::derivative(out, score, {call});\n      score = out; }}"
            );
        }
        let _ = writeln!(text, "    return slope;\n}}");
        text
    }

    /// The header ([`ScoreMod::header`]) and a key for the variant, its hash (the kernels
    /// compiled with one modifier serve every value of its scalars and tables, which travel in
    /// the parameters); made on first use.
    pub(crate) fn generated(&self) -> &Generated {
        self.generated.get_or_init(|| Generated::of(self.header()))
    }

    /// The parameters the kernels read (`ModifierArgs`), the tables on the device
    /// ([`Gpu::table`]).
    pub(crate) fn args(&self, gpu: &Gpu, scale: f32) -> Result<ModifierArgs> {
        let mut args = ModifierArgs { scale, ..ModifierArgs::default() };
        let scalars = self.stages.iter().flat_map(|s| &s.scalars);
        for (slot, (_, value)) in args.scalar.iter_mut().zip(scalars) {
            *slot = *value;
        }
        let tensors = self.stages.iter().flat_map(|s| &s.tensors);
        for (slot, (_, values)) in args.tensor.iter_mut().zip(tensors) {
            *slot = gpu.table(values)?;
        }
        Ok(args)
    }
}

/// The parameters of a score modifier, as every kernel's parameter struct embeds them (mirror of
/// `ModifierArgs` in `cuda/score_mod.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ModifierArgs {
    tensor: [u64; MAX_TENSORS],
    scalar: [f32; MAX_SCALARS],
    /// The softmax scale: the kernels apply the modifier to `scale · q·k`.
    scale: f32,
    _pad: i32,
    /// The attention sinks, `[heads_q]` (`crate::sinks`), or null.
    pub(crate) sinks: u64,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror.
unsafe impl DeviceRepr for ModifierArgs {}

impl ModifierArgs {
    /// The parameters of `score_mod` (applied after softmax scale `scale`) and `sinks` for one
    /// launch, zeros without them; their tables live on the device ([`Gpu::table`]).
    pub(crate) fn of(
        gpu: &Gpu,
        score_mod: Option<&ScoreMod>,
        sinks: Option<&crate::Sinks>,
        scale: f32,
    ) -> Result<ModifierArgs> {
        let mut args = match score_mod {
            Some(m) => m.args(gpu, scale)?,
            None => ModifierArgs::default(),
        };
        if let Some(sinks) = sinks {
            args.sinks = gpu.table(sinks.shared())?;
        }
        Ok(args)
    }
}

/// Whether `body` names `name` as a whole identifier.
pub(crate) fn mentions(body: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    body.match_indices(name).any(|(at, _)| {
        let before = body[..at].chars().next_back();
        let after = body[at + name.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

pub(crate) fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{CompileSettings, compile, nvrtc_version};
    use crate::fa2::{ForwardTiles, forward_variant};
    use crate::problem::Masking;
    use crate::tensor::DType;

    fn fa2_with(m: &ScoreMod) -> crate::compile::Variant {
        let tiles = ForwardTiles::for_head_dim(64, "sm_90a").expect("tiles");
        let mask = Masking { causal: true, windowed: false };
        forward_variant(64, DType::F16, mask, tiles, [64; 4], false, false).with_score_mod(Some(m))
    }

    #[test]
    fn the_header_binds_what_each_body_names() {
        let m = ScoreMod::softcap(30.0).unwrap().then(ScoreMod::alibi(vec![0.5; 4]).unwrap());
        let header = m.header();
        // softcap's body reads its cap, ALiBi's its slopes; ALiBi's derivative reads neither.
        assert!(header.contains("const float cap = args.scalar[0];"), "{header}");
        assert!(header.contains("const float* __restrict__ slopes = args.tensor[0];"), "{header}");
        assert_eq!(header.matches("slopes = args.tensor[0]").count(), 1, "{header}");
        assert!(header.contains("score = score_mod_1::apply(score,"), "{header}");
        assert_eq!(m.name(), "softcap(30) → alibi");
        assert!(mentions("a + cap*2", "cap") && !mentions("capped", "cap"));
        // Different modifiers make different variants; the same one the same.
        assert_ne!(fa2_with(&m), fa2_with(&ScoreMod::softcap(30.0).unwrap()));
        assert_eq!(fa2_with(&m), fa2_with(&m.clone()));
        // One variant serves every cap: the value travels in the parameters.
        let key = |cap| ScoreMod::softcap(cap).unwrap().generated().key.clone();
        assert_eq!(key(5.0), key(50.0));
        // A change to a stage after the header was made makes it again.
        let made = ScoreMod::new("x", "return score;");
        let before = made.generated().key.clone();
        assert_ne!(made.with_derivative("return 0.5f;").generated().key, before);
    }

    #[test]
    fn bad_modifiers_are_errors() {
        let bad_name = ScoreMod::new("x", "return score;").scalar("not an identifier", 1.0);
        assert!(bad_name.check(1, false).unwrap_err().to_string().contains("not a C identifier"));
        let forward_only = ScoreMod::new("mine", "return 2.f * score;");
        assert!(forward_only.check(1, false).is_ok());
        let err = forward_only.check(1, true).unwrap_err().to_string();
        assert!(err.contains("mine has no derivative"), "{err}");
        let many = (0..5)
            .fold(ScoreMod::new("t", "return score;"), |m, i| m.tensor(format!("t{i}"), vec![0.0]));
        assert!(many.check(1, false).unwrap_err().to_string().contains("up to 8 and 4"));
        assert!(ScoreMod::alibi(vec![f32::INFINITY]).is_err());
    }

    /// A body that does not compile gives NVRTC's log with the line in the body and the
    /// modifier's name as the file. Needs libnvrtc, no GPU (skipped without it unless
    /// `LADDER_REQUIRE_NVRTC=1`).
    #[test]
    fn a_broken_body_reports_its_line() {
        let broken = ScoreMod::new("my mod", "const float x = score;\nreturn x +;");
        let variant = fa2_with(&broken);
        if let Err(e) = nvrtc_version(&variant) {
            assert!(std::env::var("LADDER_REQUIRE_NVRTC").is_err(), "LADDER_REQUIRE_NVRTC but {e}");
            eprintln!("skipped: {e}");
            return;
        }
        let err = compile(&variant, "sm_90a", &CompileSettings::default()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, KernelError::Compile { .. }), "{text}");
        assert!(text.contains("my mod(2): error"), "{text}");
        // And a good one compiles.
        let good = fa2_with(&ScoreMod::new("mine", "return 0.5f * score;"));
        compile(&good, "sm_90a", &CompileSettings::default()).unwrap();
    }
}
