//! Check your own attention kernel against the ladder.
//!
//! [`Check`] holds any implementation of attention to the checks the ladder's own rungs pass:
//! random problems drawn from the project's case space (grouped-query heads, causal masks with
//! `n_q ≠ n_kv`, lengths and head dims from 1, logits up to the ±10⁴ range), the float64 oracle,
//! and the tolerance rule of `docs/conventions.md` — twice the error of the naive algorithm in
//! the same precision plus the rounding floor (FP8 by its own rule). On a failure, proptest
//! shrinks the problem, the check shrinks it further (every size and option again, with a few
//! small seeds) to the smallest one that still fails, and you get it back as a
//! [`Counterexample`]: its sizes and seed, what missed and by how much, and the worst entry.
//!
//! You give a name, the space (or take the defaults) and a closure from a [`Problem`] to an
//! [`Output`]:
//!
//! ```
//! use ladder_compare::check::{Check, Output, Precision};
//! use ladder_reference::{LadderError, naive};
//!
//! // Your implementation goes here; our naive rung stands in for it.
//! let passed = Check::new("my attention")
//!     .precisions([Precision::F32, Precision::F64])
//!     .cases(16)
//!     .run(|x| match x.precision {
//!         Precision::F64 => {
//!             let i = x.inputs::<f64>();
//!             let out = naive::attention(i.q.view(), i.k.view(), i.v.view(), &x.attention)?;
//!             Ok::<_, LadderError>(Output::new(out.o, out.lse))
//!         }
//!         _ => {
//!             let i = x.inputs::<f32>();
//!             let out = naive::attention(i.q.view(), i.k.view(), i.v.view(), &x.attention)?;
//!             Ok(Output::new(out.o, out.lse))
//!         }
//!     })?;
//! assert_eq!(passed.cases, 16);
//! println!("{passed}"); // pass: my attention: O and lse within tolerance of the float64 oracle ...
//! # Ok::<(), ladder_compare::check::CheckError>(())
//! ```
//!
//! - **Precisions.** Each drawn case runs once per [`Precision`] of the check. `F32` and `F64`
//!   hand the closure inputs in that type; `F16` and `Bf16` hand it inputs already rounded to
//!   16 bits (in `f32` arrays, ready to upload) and hold the result to the naive algorithm with a
//!   tensor core's 16-bit roundings (`ladder_compare::low_precision`), as the GPU rungs are;
//!   `Fp8` is held to twice the error of per-tensor FP8 attention.
//! - **Gradients.** An output that carries `dQ, dK, dV` ([`Output::with_gradients`]) has them
//!   checked too, against the oracle's backward pass (the upstream gradient is in
//!   [`Problem::inputs`]`.d_o`).
//! - **Layouts.** A kernel that works in `[batch, seq, heads, d]` takes its inputs with
//!   [`Problem::inputs_in`]`(`[`Layout::Bshd`]`)` and returns `O` (and the gradients) in that layout,
//!   saying so with [`Output::in_layout`].
//! - **Against a rung.** [`Check::against`] also compares with one of our CPU rungs on the same
//!   inputs (each may be off the oracle by its own tolerance, so the two by the sum).
//! - **Cases and seed.** Unless the check sets them, `PROPTEST_CASES` (default 256) and
//!   `PROPTEST_RNG_SEED` (default: a fresh seed, printed on failure) apply, like in any proptest
//!   test. [`Check::run_case`] reruns one case.
//!
//! The equivalence suite (`crates/compare/tests/equivalence.rs`) checks every rung this way, and
//! the notebooks' exercise checks run on the same [`property`] runner.

mod judge;
mod minimise;
mod runner;

use std::cell::{Cell, RefCell};
use std::fmt;
use std::ops::RangeInclusive;

use ladder_kernels::DType;
use ladder_reference::{
    AttentionOptions, AttentionOutput, AttentionShape, Fp8Options, LadderError,
};
use ndarray::{Array3, Array4, ShapeError};
use num_traits::ToPrimitive;
use proptest::strategy::Strategy;
use proptest::test_runner::TestCaseError;

pub use judge::{Mismatch, OutOfTolerance};
pub use runner::{PropertyFailure, Ran, Runs, Seed, property};

// What a check's settings and closure name, in one place.
pub use crate::cases::{Case, CaseSpace, Inputs};
pub use crate::metrics::Worst;
pub use crate::rungs::{Rung, RungConfig};
pub use ladder_reference::Element;

use crate::cases::cases;
use crate::gpu_check;

/// The precision an implementation computes in: it sets the inputs the closure is given and the
/// tolerance its result is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// `f64` throughout. The tolerance is the rounding floor alone, ~10⁻¹³ relative: an
    /// algorithmic mistake cannot hide in rounding noise.
    F64,
    /// `f32`: within twice the naive algorithm's `f32` error plus the `f32` rounding floor.
    F32,
    /// fp16 operands with `f32` accumulation (a tensor-core kernel): inputs rounded to fp16,
    /// tolerance from the naive algorithm with `P` and `O` rounded to fp16, plus the `f32` floor.
    /// `lse` is held to `f32` accuracy, as the kernels keep it in `f32`.
    F16,
    /// bfloat16 operands with `f32` accumulation, like [`Precision::F16`].
    Bf16,
    /// FP8 (e4m3) with these options: inputs in `f32` (the implementation quantises them), held
    /// to twice the relative L2 error of per-tensor FP8 attention on the same inputs — rotated
    /// by the same random Hadamard map when `incoherent` is set — plus the `f32` floor. Only `O`'s
    /// relative L2 error is bounded: the FP8 rule is a statistical one, meaningful on problems of
    /// a few hundred outputs per head and moderate logits.
    Fp8(Fp8Options),
}

impl Precision {
    /// `"f64"`, `"f32"`, `"fp16"`, `"bf16"` or `"fp8"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::F16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Fp8(_) => "fp8",
        }
    }

    /// The element type of `ladder-kernels` tensors in this precision, where there is one
    /// (`F32`, `F16`, `Bf16`).
    pub fn kernel_dtype(self) -> Option<DType> {
        match self {
            Precision::F32 => Some(DType::F32),
            Precision::F16 => Some(DType::F16),
            Precision::Bf16 => Some(DType::BF16),
            Precision::F64 | Precision::Fp8(_) => None,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One problem for the implementation under check: a drawn [`Case`] in one [`Precision`].
#[derive(Debug, Clone)]
pub struct Problem {
    /// The case: sizes, mask, logit scale, the tiles and splits our tiled rungs would use (take
    /// them or ignore them), and the seed of the tensors.
    pub case: Case,
    pub precision: Precision,
    /// The mask and the softmax scale to compute with (for 16-bit precisions the scale is an
    /// `f32` value, as a GPU kernel takes it).
    pub attention: AttentionOptions,
    /// `Q, K, V, dO`, rounded to the precision, in `f64` (exactly).
    inputs: Inputs<f64>,
}

impl Problem {
    /// The problem of `case` in `precision`: its tensors rounded to the precision.
    pub fn new(case: &Case, precision: Precision) -> Problem {
        let (inputs, attention) = match precision {
            Precision::F64 => (case.inputs::<f64>(), case.attention()),
            Precision::F32 | Precision::Fp8(_) => (case.inputs::<f32>().widen(), case.attention()),
            Precision::F16 | Precision::Bf16 => {
                let dtype = precision.kernel_dtype().unwrap_or(DType::F16);
                let (attention, _) = gpu_check::options(&case.attention(), case.shape.d);
                (gpu_check::device_inputs(case, dtype), attention)
            }
        };
        Problem { case: case.clone(), precision, attention, inputs }
    }

    /// The sizes: `Q` is `[batch, heads_q, n_q, d]`, `K` and `V` `[batch, heads_kv, n_kv, d]`.
    pub fn shape(&self) -> AttentionShape {
        self.case.shape
    }

    /// The softmax scale (`attention.scale`, always set).
    pub fn scale(&self) -> f64 {
        self.attention.scale.unwrap_or_else(|| self.case.scale())
    }

    /// Whether the causal mask applies (aligned bottom-right: query `i` sees key `j` if and only
    /// if `j ≤ i + n_kv − n_q`).
    pub fn causal(&self) -> bool {
        self.attention.causal
    }

    /// `Q, K, V` and the upstream gradient `dO` as `T`: exact for the problem's own precision
    /// (and for `f32` from any precision but `F64`, whose values `f32` rounds).
    pub fn inputs<T: Element>(&self) -> Inputs<T> {
        let to = |a: &Array4<f64>| a.mapv(T::of);
        let x = &self.inputs;
        Inputs { q: to(&x.q), k: to(&x.k), v: to(&x.v), d_o: to(&x.d_o) }
    }

    /// [`Problem::inputs`] with the axes of `Q, K, V, dO` in `layout`'s order (standard layout):
    /// for a kernel that takes `[batch, seq, heads, d]`, [`Layout::Bshd`]. Hand its results back
    /// through [`Output::in_layout`].
    pub fn inputs_in<T: Element>(&self, layout: Layout) -> Inputs<T> {
        let Inputs { q, k, v, d_o } = self.inputs::<T>();
        let to = |a: Array4<T>| layout.lay_out(a);
        Inputs { q: to(q), k: to(k), v: to(v), d_o: to(d_o) }
    }

    pub(crate) fn inputs_f64(&self) -> &Inputs<f64> {
        &self.inputs
    }

    /// The options our rungs run with on this problem: its attention options, tiles and splits,
    /// and the FP8 options of an FP8 precision.
    pub fn rung_config(&self) -> RungConfig {
        let mut config = RungConfig {
            attention: self.attention.clone(),
            tiles: self.case.tiles,
            splits: self.case.splits,
            ..RungConfig::default()
        };
        if let Precision::Fp8(fp8) = self.precision {
            config.fp8 = fp8;
        }
        config
    }

    /// Runs one of our CPU rungs on the problem: in `f64` for an `F64` problem, in `f32`
    /// otherwise (on the same, already rounded, inputs).
    pub fn run(&self, rung: Rung) -> Result<Output, LadderError> {
        let config = self.rung_config();
        if self.precision == Precision::F64 {
            let x = &self.inputs;
            return Ok(rung.forward(x.q.view(), x.k.view(), x.v.view(), &config)?.into());
        }
        let x = self.inputs::<f32>();
        Ok(rung.forward(x.q.view(), x.k.view(), x.v.view(), &config)?.into())
    }

    /// `"f64"` for an `F64` problem, else `"f32"`: what [`Problem::run`] computes in.
    fn rung_element(&self) -> &'static str {
        if self.precision == Precision::F64 { "f64" } else { "f32" }
    }
}

/// The order of the axes of `Q, K, V, O, dO` and the gradients an implementation takes and
/// returns ([`Problem::inputs_in`], [`Output::in_layout`]); `lse` is `[batch, heads_q, n_q]`
/// either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, heads, seq, d]`, the ladder's own.
    Bhsd,
    /// `[batch, seq, heads, d]`, what a QKV projection produces (FlashAttention's layout).
    Bshd,
}

impl Layout {
    /// `a`, given `[batch, heads, seq, d]`, laid out in this layout.
    fn lay_out<T: Clone>(self, a: Array4<T>) -> Array4<T> {
        match self {
            Layout::Bhsd => a,
            Layout::Bshd => a.permuted_axes([0, 2, 1, 3]).as_standard_layout().into_owned(),
        }
    }

    /// `a`, given in this layout, back as `[batch, heads, seq, d]` (swapping two axes undoes
    /// itself).
    fn undo<T: Clone>(self, a: Array4<T>) -> Array4<T> {
        self.lay_out(a)
    }
}

/// A number an implementation may return: `f64`, `f32`, `half::f16`, `half::bf16` — any type
/// `num_traits` converts to `f64`, so a function generic over [`Element`] may return its `T`.
pub trait Value: ToPrimitive + Copy + 'static {
    /// The value in `f64` (exact for floats; NaN if it has no `f64` value).
    fn to_f64_value(self) -> f64 {
        ToPrimitive::to_f64(&self).unwrap_or(f64::NAN)
    }

    /// The type's name without its path (`"f32"`, `"f16"`), for reports.
    fn type_name() -> &'static str {
        let full = std::any::type_name::<Self>();
        full.rsplit("::").next().unwrap_or(full)
    }
}

impl<T: ToPrimitive + Copy + 'static> Value for T {}

/// What an implementation returns for a [`Problem`]: `O`, `lse` (natural log, `−∞` for a row
/// that sees no key) and, optionally, `dQ, dK, dV`.
#[derive(Debug, Clone)]
pub struct Output {
    o: Array4<f64>,
    lse: Array3<f64>,
    grads: Option<[Array4<f64>; 3]>,
    /// The type `O` was returned in.
    element: &'static str,
}

impl Output {
    /// `O` (`[batch, heads_q, n_q, d]`) and `lse` (`[batch, heads_q, n_q]`), in any [`Value`] type.
    pub fn new<A: Value, B: Value>(o: Array4<A>, lse: Array3<B>) -> Output {
        let element = A::type_name();
        Output { o: o.mapv(A::to_f64_value), lse: lse.mapv(B::to_f64_value), grads: None, element }
    }

    /// `O` and `lse` from flat row-major buffers (what a GPU download gives), shaped by the
    /// problem; an error if a length does not fit.
    pub fn from_flat<A: Value, B: Value>(
        problem: &Problem,
        o: &[A],
        lse: &[B],
    ) -> Result<Output, ShapeError> {
        let s = problem.shape();
        let o = Array4::from_shape_vec(s.q_dims(), o.to_vec())?;
        let lse = Array3::from_shape_vec((s.batch, s.heads_q, s.n_q), lse.to_vec())?;
        Ok(Output::new(o, lse))
    }

    /// Adds the gradients `dQ` (shape of `Q`), `dK` and `dV` (shape of `K`), to be checked too.
    pub fn with_gradients<A: Value>(self, dq: Array4<A>, dk: Array4<A>, dv: Array4<A>) -> Output {
        let grads = [dq, dk, dv].map(|g| g.mapv(A::to_f64_value));
        Output { grads: Some(grads), ..self }
    }

    /// [`Output::with_gradients`] from flat row-major buffers.
    pub fn with_flat_gradients<A: Value>(
        self,
        problem: &Problem,
        dq: &[A],
        dk: &[A],
        dv: &[A],
    ) -> Result<Output, ShapeError> {
        let s = problem.shape();
        let dq = Array4::from_shape_vec(s.q_dims(), dq.to_vec())?;
        let dk = Array4::from_shape_vec(s.kv_dims(), dk.to_vec())?;
        let dv = Array4::from_shape_vec(s.kv_dims(), dv.to_vec())?;
        Ok(self.with_gradients(dq, dk, dv))
    }

    /// This output with `O` and the gradients taken as given in `layout`'s axis order (an
    /// implementation that works in `[batch, seq, heads, d]`: [`Layout::Bshd`]); they are
    /// checked as `[batch, heads, seq, d]`.
    pub fn in_layout(self, layout: Layout) -> Output {
        Output {
            o: layout.undo(self.o),
            grads: self.grads.map(|g| g.map(|x| layout.undo(x))),
            ..self
        }
    }

    /// `O`, in `f64`.
    pub fn o(&self) -> &Array4<f64> {
        &self.o
    }

    /// `lse`, in `f64`.
    pub fn lse(&self) -> &Array3<f64> {
        &self.lse
    }

    /// `dQ, dK, dV`, if given.
    pub fn gradients(&self) -> Option<&[Array4<f64>; 3]> {
        self.grads.as_ref()
    }
}

impl<T: Value> From<AttentionOutput<T>> for Output {
    fn from(out: AttentionOutput<T>) -> Output {
        Output::new(out.o, out.lse)
    }
}

/// A check of one implementation: its name, the space its problems are drawn from, the
/// precisions it runs in, and how many cases from which seed. Build it, then [`Check::run`] it.
///
/// A failure comes back as the smallest problem that still fails:
///
/// ```
/// use ladder_compare::check::{Check, Output, Precision};
/// use ladder_reference::{LadderError, naive};
///
/// // `lse` off by ln 2 (O is right).
/// let check = Check::new("lse + ln 2").precisions([Precision::F32]).seed(1);
/// let err = check
///     .run(|x| {
///         let i = x.inputs::<f32>();
///         let out = naive::attention(i.q.view(), i.k.view(), i.v.view(), &x.attention)?;
///         Ok::<_, LadderError>(Output::new(out.o, out.lse + std::f32::consts::LN_2))
///     })
///     .unwrap_err();
/// let failed = err.counterexample().expect("a wrong lse is caught");
/// let shape = failed.case.shape;
/// assert_eq!((shape.batch, shape.heads_q, shape.n_q, shape.n_kv, shape.d), (1, 1, 1, 1, 1));
/// assert_eq!(failed.worst().map(|w| w.index.clone()), Some(vec![0, 0, 0]));
/// println!("{err}"); // FAIL: lse + ln 2 (f32): lse is out of tolerance against the float64 oracle ...
/// ```
#[derive(Debug, Clone)]
pub struct Check {
    name: String,
    space: CaseSpace,
    causal: Option<bool>,
    precisions: Vec<Precision>,
    against: Option<Rung>,
    runs: Runs,
}

impl Check {
    /// A check with the ladder's defaults: the CPU suite's space ([`CaseSpace::cpu`]: batch 1–2,
    /// 1–2 kv heads with 1–3 query heads each, lengths 1–40, head dims 1–24, logits up to the
    /// ±10⁴ range), causal and not, in `f32` and `f64`, `PROPTEST_CASES` cases (default 256)
    /// from `PROPTEST_RNG_SEED` (default: a fresh seed, reported on failure).
    pub fn new(name: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            space: CaseSpace::cpu(),
            causal: None,
            precisions: vec![Precision::F32, Precision::F64],
            against: None,
            runs: Runs::default(),
        }
    }

    /// Draws from `space` (the sizes, logits, and the tiles and splits a tiled implementation
    /// may take from [`Problem::case`]).
    pub fn space(self, space: CaseSpace) -> Check {
        Check { space, ..self }
    }

    /// Only these head dimensions (`d`).
    pub fn head_dims(mut self, dims: impl IntoIterator<Item = usize>) -> Check {
        self.space.head_dims = dims.into_iter().collect();
        self
    }

    /// Query lengths `n_q` and key/value lengths `n_kv` from these ranges.
    pub fn lengths(mut self, n_q: RangeInclusive<usize>, n_kv: RangeInclusive<usize>) -> Check {
        self.space.n_q = n_q;
        self.space.n_kv = n_kv;
        self
    }

    /// Grouped-query heads: `heads_kv` key/value heads, each shared by `group` query heads
    /// (`1..=1` for both is single-head attention).
    pub fn gqa(mut self, heads_kv: RangeInclusive<usize>, group: RangeInclusive<usize>) -> Check {
        self.space.heads_kv = heads_kv;
        self.space.group = group;
        self
    }

    /// Batch sizes from this range.
    pub fn batch(mut self, batch: RangeInclusive<usize>) -> Check {
        self.space.batch = batch;
        self
    }

    /// Only causal problems (`true`) or only unmasked ones (`false`); by default both.
    pub fn causal(self, causal: bool) -> Check {
        Check { causal: Some(causal), ..self }
    }

    /// Logits with a standard deviation of at most 3, a trained model's range (the default goes
    /// to thousands, where every softmax row is one-hot and `exp` overflows without the max).
    pub fn moderate_logits(self) -> Check {
        Check { space: self.space.moderate_logits(), ..self }
    }

    /// The precisions every case runs in, in order.
    pub fn precisions(self, precisions: impl IntoIterator<Item = Precision>) -> Check {
        Check { precisions: precisions.into_iter().collect(), ..self }
    }

    /// Also compare with one of our CPU rungs on the same inputs ([`Problem::run`]: in `f64` for
    /// `F64` problems, else in `f32`, held to the naive algorithm's tolerance in that type); the
    /// two must agree within the sum of their tolerances. (The FP8 rung is no reference: its
    /// tolerance is FP8's.)
    pub fn against(self, rung: Rung) -> Check {
        Check { against: Some(rung), ..self }
    }

    /// Run `cases` cases, whatever `PROPTEST_CASES` says.
    pub fn cases(mut self, cases: u32) -> Check {
        self.runs.cases = Some(cases);
        self
    }

    /// Draw from this seed, whatever `PROPTEST_RNG_SEED` says: the same cases on every run.
    pub fn seed(mut self, seed: u64) -> Check {
        self.runs.seed = Seed::Fixed(seed);
        self
    }

    /// Save failing cases to `proptest-regressions/` next to `source_file` (pass `file!()`) and
    /// replay them first on later runs, as `proptest!` tests do.
    pub fn regressions(mut self, source_file: &'static str) -> Check {
        self.runs.regressions = Some(source_file);
        self
    }

    /// The check's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `implementation` on the check's cases, each in every precision, and judges every
    /// result. `Ok` with a summary when all pass; otherwise the smallest failing case shrinking
    /// found ([`CheckError::Failed`]), or [`CheckError::Settings`] when the settings cannot draw
    /// a case. An `Err` or a panic from `implementation` fails its case like a wrong answer.
    pub fn run<E: fmt::Display>(
        &self,
        implementation: impl Fn(&Problem) -> Result<Output, E>,
    ) -> Result<Passed, CheckError> {
        self.validate()?;
        let last_failure = RefCell::new(None::<(Case, Precision, Mismatch)>);
        let (runs, gradients) = (Cell::new(0u32), Cell::new(0u32));
        let causal = self.causal;
        let strategy = cases(self.space.clone()).prop_map(move |mut case| {
            if let Some(causal) = causal {
                case.causal = causal;
            }
            case
        });
        let outcome = property(&self.runs, strategy, |case| {
            for &precision in &self.precisions {
                match self.one(&case, precision, &implementation) {
                    Ok(checked) => {
                        runs.set(runs.get() + 1);
                        gradients.set(gradients.get() + u32::from(checked));
                    }
                    Err(mismatch) => {
                        let reason = mismatch.to_string();
                        *last_failure.borrow_mut() = Some((case, precision, mismatch));
                        return Err(TestCaseError::fail(reason));
                    }
                }
            }
            Ok(())
        });
        match outcome {
            Ok(ran) => Ok(self.passed(ran.cases, runs.get(), gradients.get(), ran.seed)),
            Err(PropertyFailure::GaveUp(reason)) => Err(CheckError::GaveUp(reason)),
            Err(PropertyFailure::Failed { reason, value, found_at, shrink_steps, seed }) => {
                let (precision, mismatch) = match last_failure.into_inner() {
                    Some((case, precision, mismatch)) if case == value => (precision, mismatch),
                    // The last failure seen was not the shrunk case: judge that one again.
                    _ => self.first_mismatch(&value, &implementation).unwrap_or_else(|| {
                        (self.precisions[0], Mismatch::Error(format!("(flaky) {reason}")))
                    }),
                };
                // Shrink on where proptest stops (see `minimise`).
                let mut steps = shrink_steps;
                let (case, (precision, mismatch)) = minimise::minimise(
                    &self.space,
                    self.causal.is_some(),
                    value,
                    (precision, mismatch),
                    |case| self.first_mismatch(case, &implementation),
                    &mut steps,
                );
                let cases = self.runs.case_count();
                let found = Found::Drawn { found_at, shrink_steps: steps, cases, seed };
                let name = self.name.clone();
                let failed = Counterexample { name, case, precision, mismatch, found };
                Err(CheckError::Failed(Box::new(failed)))
            }
        }
    }

    /// Runs `implementation` on one given case (a counterexample from an earlier run, say) in
    /// every precision of the check, without drawing or shrinking.
    pub fn run_case<E: fmt::Display>(
        &self,
        case: &Case,
        implementation: impl Fn(&Problem) -> Result<Output, E>,
    ) -> Result<Passed, CheckError> {
        if self.precisions.is_empty() {
            return Err(CheckError::Settings("no precisions to run in".into()));
        }
        let checked = runner::capturing_panics(|| {
            let mut gradients = 0;
            for &precision in &self.precisions {
                match self.one(case, precision, &implementation) {
                    Ok(checked) => gradients += u32::from(checked),
                    Err(mismatch) => return Err((precision, mismatch)),
                }
            }
            Ok(gradients)
        });
        match checked {
            Ok(gradients) => Ok(self.passed(1, self.precisions.len() as u32, gradients, None)),
            Err((precision, mismatch)) => Err(CheckError::Failed(Box::new(Counterexample {
                name: self.name.clone(),
                case: case.clone(),
                precision,
                mismatch,
                found: Found::Given,
            }))),
        }
    }

    fn one<E: fmt::Display>(
        &self,
        case: &Case,
        precision: Precision,
        implementation: &impl Fn(&Problem) -> Result<Output, E>,
    ) -> Result<bool, Mismatch> {
        let problem = Problem::new(case, precision);
        let out = match runner::catch(|| implementation(&problem)) {
            Err(panic) => return Err(Mismatch::Panic(panic)),
            Ok(Err(e)) => return Err(Mismatch::Error(e.to_string())),
            Ok(Ok(out)) => out,
        };
        judge::judge(&problem, &out, self.against)
    }

    fn first_mismatch<E: fmt::Display>(
        &self,
        case: &Case,
        implementation: &impl Fn(&Problem) -> Result<Output, E>,
    ) -> Option<(Precision, Mismatch)> {
        runner::capturing_panics(|| {
            self.precisions.iter().find_map(|&precision| {
                self.one(case, precision, implementation).err().map(|m| (precision, m))
            })
        })
    }

    fn passed(&self, cases: u32, runs: u32, gradients: u32, seed: Option<u64>) -> Passed {
        Passed {
            name: self.name.clone(),
            cases,
            runs,
            precisions: self.precisions.clone(),
            against: self.against,
            gradients,
            seed,
        }
    }

    /// Refuses settings from which no case can be drawn, or that check nothing.
    fn validate(&self) -> Result<(), CheckError> {
        let s = &self.space;
        let bad = |what: String| Err(CheckError::Settings(what));
        for (name, range) in [
            ("batch", &s.batch),
            ("heads_kv", &s.heads_kv),
            ("group", &s.group),
            ("n_q", &s.n_q),
            ("n_kv", &s.n_kv),
            ("block", &s.block),
            ("splits", &s.splits),
        ] {
            if range.is_empty() || *range.start() == 0 {
                return bad(format!("{name} must be a non-empty range from 1 up, not {range:?}"));
            }
        }
        if s.head_dims.is_empty() || s.head_dims.contains(&0) {
            return bad(format!("head dims must be at least 1, and some: {:?}", s.head_dims));
        }
        if !(s.max_logit_std >= 0.1 && s.max_logit_std.is_finite()) {
            return bad(format!("max_logit_std must be finite and ≥ 0.1, not {}", s.max_logit_std));
        }
        if self.precisions.is_empty() {
            return bad("no precisions to run in".into());
        }
        if self.runs.cases == Some(0) {
            return bad("0 cases: a check that runs nothing passes everything".into());
        }
        Ok(())
    }
}

/// A check that passed.
#[derive(Debug, Clone, PartialEq)]
pub struct Passed {
    pub name: String,
    /// Cases drawn (each run in every precision).
    pub cases: u32,
    /// Runs judged: cases × precisions, plus saved regressions replayed first.
    pub runs: u32,
    pub precisions: Vec<Precision>,
    /// The rung compared against, if any.
    pub against: Option<Rung>,
    /// Runs (case × precision) whose gradients were checked too.
    pub gradients: u32,
    /// The seed the cases were drawn from (`None` for [`Check::run_case`]).
    pub seed: Option<u64>,
}

impl fmt::Display for Passed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let against = self.against.map(|r| format!(" and of {r}")).unwrap_or_default();
        let cases =
            if self.cases == 1 { "1 case".to_string() } else { format!("{} cases", self.cases) };
        let names: Vec<&str> = self.precisions.iter().map(|p| p.name()).collect();
        let precisions = match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => names.concat(),
        };
        let gradients = match self.gradients {
            0 => String::new(),
            g if g == self.runs => ", gradients too".to_string(),
            g => format!(", gradients in {g} of {} runs", self.runs),
        };
        write!(
            f,
            "pass: {}: O and lse within tolerance of the float64 oracle{against} on {cases} in \
             {precisions}{gradients}",
            self.name
        )
    }
}

/// How a counterexample was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Drawn at random and shrunk.
    Drawn {
        /// Which case failed first (from 1).
        found_at: u32,
        /// Simpler cases shrinking tried.
        shrink_steps: u32,
        /// Cases the run was to draw.
        cases: u32,
        /// The seed that repeats the run (`Check::seed`, `PROPTEST_RNG_SEED`).
        seed: Option<u64>,
    },
    /// Given to [`Check::run_case`].
    Given,
}

/// The smallest failing problem a check found, and why it fails.
#[derive(Debug, Clone, PartialEq)]
pub struct Counterexample {
    /// The check's name.
    pub name: String,
    /// The shrunk case: its sizes, options and the seed of its tensors ([`Check::run_case`]
    /// reruns it).
    pub case: Case,
    /// The precision it fails in.
    pub precision: Precision,
    pub mismatch: Mismatch,
    pub found: Found,
}

impl Counterexample {
    /// The entry furthest from the reference, for a tolerance failure.
    pub fn worst(&self) -> Option<&Worst> {
        self.mismatch.worst()
    }
}

impl fmt::Display for Counterexample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "FAIL: {} ({}): {}", self.name, self.precision, self.mismatch)?;
        write!(f, "  shrunk case: {}", describe(&self.case))?;
        match self.found {
            Found::Drawn { found_at, shrink_steps, cases, seed } => {
                write!(
                    f,
                    "\n  found at case {found_at} of {cases}, shrunk in {shrink_steps} steps"
                )?;
                if let Some(seed) = seed {
                    write!(f, "; Check::seed({seed}) or PROPTEST_RNG_SEED={seed} repeats the run")?;
                }
                Ok(())
            }
            Found::Given => Ok(()),
        }
    }
}

/// `batch 1, heads 2 q / 1 kv, n_q 3, n_kv 5, d 4, causal, logit std 1, tiles 1×2, splits 1,
/// tensors' seed 7`.
fn describe(case: &Case) -> String {
    let s = case.shape;
    let std = format!("{:.4}", case.logit_std);
    let std = std.trim_end_matches('0').trim_end_matches('.');
    format!(
        "batch {}, heads {} q / {} kv, n_q {}, n_kv {}, d {}, {}, logit std {std}, tiles {}×{}, \
         splits {}, tensors' seed {}",
        s.batch,
        s.heads_q,
        s.heads_kv,
        s.n_q,
        s.n_kv,
        s.d,
        if case.causal { "causal" } else { "not causal" },
        case.tiles.br(),
        case.tiles.bc(),
        case.splits,
        case.seed
    )
}

/// Why a check did not pass. `Debug` prints the same report as `Display`, so a test that returns
/// `Result<(), CheckError>` or calls `.unwrap()` shows it as it is.
#[derive(Clone, PartialEq)]
pub enum CheckError {
    /// The implementation is wrong on this case (the smallest one found).
    Failed(Box<Counterexample>),
    /// The settings cannot draw a case (an empty range, a size of 0, no precisions) or would
    /// check nothing (0 cases).
    Settings(String),
    /// proptest gave up before running enough cases.
    GaveUp(String),
}

impl CheckError {
    /// The counterexample, for [`CheckError::Failed`].
    pub fn counterexample(&self) -> Option<&Counterexample> {
        match self {
            CheckError::Failed(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::Failed(c) => write!(f, "{c}"),
            CheckError::Settings(why) => write!(f, "the check's settings are unusable: {why}"),
            CheckError::GaveUp(why) => write!(f, "the check gave up: {why}"),
        }
    }
}

impl fmt::Debug for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for CheckError {}
