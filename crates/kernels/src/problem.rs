//! The shape of one attention call, checked once for every rung.

use cudarc::driver::DeviceRepr;

use crate::error::{KernelError, Result};
use crate::gpu::Gpu;
use crate::mask_mod::MaskMod;
use crate::score_mod::{ModifierArgs, ScoreMod};
use crate::sinks::Sinks;
use crate::tensor::{DType, Tensor};
use crate::varlen::SeqLens;

/// Forward output of every GPU rung: `O` in the inputs' dtype and `lse` (natural log) in `f32`.
#[derive(Debug)]
pub struct Output {
    /// `[batch, heads_q, n_q, d]`, its axes in memory in the order of Q's (the rungs that take
    /// strided inputs: [`crate::fa2`]); `[total_q, heads_q, d]` for a packed batch
    /// ([`crate::varlen`]).
    pub o: Tensor,
    /// `[batch, heads_q, n_q]`, or `[heads_q, total_q]` for a packed batch; `-inf` for rows that
    /// see no key.
    pub lse: Tensor,
}

/// Gradients of a backward pass, each in the dtype and shape of its input (and its axes in memory
/// in the order of the input's).
#[derive(Debug)]
pub struct Gradients {
    /// `[batch, heads_q, n_q, d]`.
    pub dq: Tensor,
    /// `[batch, heads_kv, n_kv, d]` (summed over the query heads of each group).
    pub dk: Tensor,
    /// `[batch, heads_kv, n_kv, d]`.
    pub dv: Tensor,
    /// `[heads_q]` in f32, the sinks' gradient summed over every row (`None` without sinks).
    pub dsinks: Option<Tensor>,
}

/// Options shared by the GPU rungs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Options {
    /// Causal mask, aligned to the bottom-right corner when `n_q != n_kv`: query `i` sees keys
    /// `j <= i + n_kv - n_q` (the FlashAttention 2.1+ and KV-cache convention).
    pub causal: bool,
    /// Softmax scale, positive, with `scale · log2 e` a normal f32 (another is an error: the
    /// kernels find each row's max on the raw scores, which only a positive scale keeps, and flush
    /// subnormal numbers); `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Backward pass only: compute dQ without atomics, so that the gradients are bitwise
    /// identical from run to run (a separate dQ pass over the key tiles; slower). The forward
    /// pass is deterministic either way.
    pub deterministic: bool,
    /// A sliding window of keys around each query's diagonal ([`Window`]; none by default). FA2
    /// takes it, forward and backward, and the FA3 forward, 16-bit and FP8; the other rungs
    /// refuse it with an error.
    pub window: Window,
    /// A function of each scaled score applied before the softmax ([`ScoreMod`]: softcap,
    /// ALiBi, your own CUDA), compiled into the kernels. FA2 and FA3 take it, forward (16-bit)
    /// and backward; the other rungs refuse it with an error.
    pub score_mod: Option<ScoreMod>,
    /// Attention sinks ([`Sinks`]: one logit per query head that joins every row's softmax with
    /// a value of zero, gpt-oss); the backward pass returns their gradient. FA2 and FA3 take
    /// them, forward (16-bit) and backward; the other rungs refuse them with an error.
    pub sinks: Option<Sinks>,
    /// Which keys each query sees beyond the band ([`MaskMod`]: document masks, prefix-LM, your
    /// own CUDA), compiled into the kernels with a block mask that skips the tiles it empties.
    /// FA2 and FA3 take it, forward and backward (16-bit, not packed); the other rungs refuse it
    /// with an error.
    pub mask_mod: Option<MaskMod>,
}

/// A sliding window (flash-attention's `window_size = (left, right)`), bottom-right aligned as
/// the causal mask is: query `i` sees the keys `j` with
/// `i + n_kv − n_q − left ≤ j ≤ i + n_kv − n_q + right`; `None` leaves a side open
/// (flash-attention's `-1`), and `causal` makes `right` 0. Mistral's and Gemma's local layers are
/// `Window::left(w - 1)` with `causal`: each token sees itself and the `w − 1` before it. The
/// kernels walk only the key tiles a window reaches, so a window of `w` keys costs in proportion
/// to `w`, not to the sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Window {
    /// Keys before the diagonal a query may see.
    pub left: Option<usize>,
    /// Keys after the diagonal a query may see.
    pub right: Option<usize>,
}

impl Window {
    /// `left` keys before the diagonal, any number after it (with `causal`: none after it).
    pub fn left(left: usize) -> Window {
        Window { left: Some(left), right: None }
    }

    /// `left` keys before the diagonal and `right` after it.
    pub fn new(left: usize, right: usize) -> Window {
        Window { left: Some(left), right: Some(right) }
    }

    /// Whether either side is bounded.
    pub fn is_some(&self) -> bool {
        self.left.is_some() || self.right.is_some()
    }
}

/// What a kernel variant masks: the causal diagonal compiled in, and whether a sliding window's
/// band comes in the parameters (`FA2_WINDOW`, `FA3_WINDOW`; the kernels without it carry no
/// band logic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Masking {
    pub(crate) causal: bool,
    pub(crate) windowed: bool,
}

impl Masking {
    /// The masking of problem `p`.
    pub(crate) fn of(p: &Problem) -> Masking {
        Masking { causal: p.causal, windowed: p.window.is_some() }
    }
}

/// The largest band side the kernels take (`UNBOUNDED − 1` in `cuda/mask.cuh`). A windowed
/// problem's sequences are shorter than [`WINDOW_MAX_LEN`], so its open side, `n_q + n_kv`, never
/// reaches it; it keeps the unused band of an unwindowed problem in range too.
const BAND_LIMIT: usize = (1 << 30) - 1;

/// Mirror of `Band` in `cuda/mask.cuh`: the keys a query sees before and after its diagonal.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Band {
    pub(crate) left: i32,
    pub(crate) right: i32,
}

impl Options {
    /// Causal attention with the default scale.
    pub fn causal() -> Options {
        Options { causal: true, ..Options::default() }
    }

    /// Unmasked attention with the default scale.
    pub fn full() -> Options {
        Options::default()
    }

    /// These options with a deterministic backward pass.
    pub fn deterministic(self) -> Options {
        Options { deterministic: true, ..self }
    }

    /// These options with softmax scale `scale`.
    pub fn with_scale(self, scale: f32) -> Options {
        Options { scale: Some(scale), ..self }
    }

    /// These options within a sliding window.
    pub fn with_window(self, window: Window) -> Options {
        Options { window, ..self }
    }

    /// These options with `score_mod` applied after any modifier they already have.
    pub fn with_score_mod(self, score_mod: ScoreMod) -> Options {
        let score_mod = Some(match self.score_mod {
            Some(first) => first.then(score_mod),
            None => score_mod,
        });
        Options { score_mod, ..self }
    }

    /// These options with `mask_mod`, kept where any mask they already have keeps (both must).
    pub fn with_mask_mod(self, mask_mod: MaskMod) -> Options {
        let mask_mod = Some(match self.mask_mod {
            Some(first) => first.and(mask_mod),
            None => mask_mod,
        });
        Options { mask_mod, ..self }
    }

    /// These options with attention sinks.
    pub fn with_sinks(self, sinks: Sinks) -> Options {
        Options { sinks: Some(sinks), ..self }
    }

    /// These options with Gemma-2's logit softcap ([`ScoreMod::softcap`]); a cap of 0 is no
    /// softcap (flash-attention's convention), a negative or non-finite one an error.
    pub fn with_softcap(self, cap: f32) -> Result<Options> {
        if cap == 0.0 {
            return Ok(self);
        }
        Ok(self.with_score_mod(ScoreMod::softcap(cap)?))
    }
}

/// The softmax scales the GPU rungs take: positive, with `scale · log2 e` a normal f32. FA2, FA3
/// and FlashDecoding find a row's max on the raw scores and scale it once (softmax.cuh,
/// `scaled_row_max`), which is the max of the scaled scores only for a positive scale, and a
/// masked score (−inf) times a scale of 0 or less is NaN or +inf; the kernels flush subnormal
/// numbers to 0 (fast math), and scale them by `scale · log2 e`, so a subnormal one is 0 there and
/// one past `f32::MAX / log2 e` is +inf. Every GPU rung takes the same scales: another is an error
/// rather than a wrong answer. (The CPU rungs take any finite scale.)
pub(crate) fn check_scale(scale: f32) -> Result<()> {
    if scale > 0.0 && (scale * std::f32::consts::LOG2_E).is_normal() {
        Ok(())
    } else {
        Err(KernelError::Shape(format!(
            "scale {scale}: expected a positive number with scale · log2(e) a normal f32"
        )))
    }
}

// ---- the checks every rung's host code makes (Problem::new and decoding's Shape::check) ----

/// The `N` dimensions of `shape`, or an error saying what it must be (`expected`, e.g. "q must
/// be [batch, heads, seq, head_dim]").
pub(crate) fn dims<const N: usize>(shape: &[usize], expected: &str) -> Result<[usize; N]> {
    <[usize; N]>::try_from(shape)
        .map_err(|_| KernelError::Shape(format!("{expected}, got shape {shape:?}")))
}

/// [`dims`] of a `[batch, heads, seq, head_dim]` tensor.
pub(crate) fn dims4(shape: &[usize], expected: &str) -> Result<[usize; 4]> {
    dims(shape, expected)
}

/// `(name, shape)` must equal `(other, its shape)` (V and K, dO and O).
pub(crate) fn same_shape(
    (name, shape): (&str, &[usize]),
    (other, like): (&str, &[usize]),
) -> Result<()> {
    if shape == like {
        Ok(())
    } else {
        Err(KernelError::Shape(format!("{name} has shape {shape:?} but {other} has {like:?}")))
    }
}

/// No axis of `q` or of the keys' tensor (`kv`: its name and shape) may be empty.
pub(crate) fn nonempty(q: &[usize], (kv_name, kv): (&str, &[usize])) -> Result<()> {
    if q.contains(&0) || kv.contains(&0) {
        Err(KernelError::Shape(format!(
            "every dimension must be at least 1 (q {q:?}, {kv_name} {kv:?})"
        )))
    } else {
        Ok(())
    }
}

/// Grouped-query attention: the query heads come in whole groups per key/value head.
pub(crate) fn heads_divide(heads_q: usize, heads_kv: usize) -> Result<()> {
    if heads_kv != 0 && heads_q % heads_kv == 0 {
        Ok(())
    } else {
        Err(KernelError::Shape(format!(
            "heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv}"
        )))
    }
}

/// Q, K and V in one element type.
pub(crate) fn same_dtype([q, k, v]: [DType; 3]) -> Result<()> {
    if k == q && v == q {
        Ok(())
    } else {
        Err(KernelError::DType(format!("q, k, v must share a dtype (got {q}, {k}, {v})")))
    }
}

/// Mirror of `Strides` in `cuda/layout.cuh`: where the rows of a `[batch, heads, rows, d]` tensor
/// lie, in elements (the head dimension is contiguous).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Strides {
    pub(crate) batch: i64,
    pub(crate) head: i64,
    pub(crate) row: i64,
}

// SAFETY: a plain #[repr(C)] struct of integers, laid out as its CUDA mirror.
unsafe impl DeviceRepr for Strides {}

impl Strides {
    /// The strides of `t`, a rank-4 tensor, as the kernels take them: the last axis contiguous
    /// and, for 16-bit elements, every other stride a multiple of 8 elements, since the kernels
    /// copy rows in 16-byte chunks. Axes of length 1 are never stepped along: they take their
    /// row-major stride, whatever the tensor's (so that FA2's compiled-in row strides are the
    /// contiguous ones for a contiguous tensor).
    pub(crate) fn of(t: &Tensor, name: &str) -> Result<Strides> {
        Strides::checked(t.shape(), t.strides(), t.dtype(), name)
    }

    /// The strides of a packed `[total, heads, d]` tensor ([`crate::varlen`]) as the kernels see
    /// it: one batch entry of `[heads, total, d]`, each sequence's rows an offset into it.
    pub(crate) fn of_packed(t: &Tensor, name: &str) -> Result<Strides> {
        let packed = dims(t.shape(), &format!("{name} must be [total, heads, head_dim]"))?;
        let [row, head, column] = dims(t.strides(), "strides")?;
        let shape = one_batch(packed);
        let [_, heads, total, d] = shape;
        Strides::checked(&shape, &[heads * total * d, head, row, column], t.dtype(), name)
    }

    /// [`Strides::of`] a rank-4 tensor of `shape` and `strides` (in elements of `dtype`).
    fn checked(shape: &[usize], strides: &[usize], dtype: DType, name: &str) -> Result<Strides> {
        let dense = crate::tensor::row_major(shape);
        let step = |axis: usize| if shape[axis] == 1 { dense[axis] } else { strides[axis] };
        if step(3) > 1 {
            return Err(KernelError::Shape(format!(
                "{name} has strides {strides:?}: its last axis (the head dimension) must be \
                 contiguous (stride 1)"
            )));
        }
        let chunk = (16 / dtype.size()).max(1);
        if (0..3).any(|axis| step(axis) % chunk != 0) {
            return Err(KernelError::Shape(format!(
                "{name} has strides {strides:?}: the kernels read rows in 16-byte chunks, so the \
                 batch, head and sequence strides must be multiples of {chunk} elements"
            )));
        }
        if (0..3).any(|axis| step(axis) / chunk > u32::MAX as usize) {
            return Err(KernelError::Shape(format!(
                "{name} has strides {strides:?}: the kernels take strides below 2^32 chunks of 16 \
                 bytes"
            )));
        }
        let [batch, head, row] = [0, 1, 2].map(|axis| step(axis) as i64);
        Ok(Strides { batch, head, row })
    }
}

/// A packed `[total, heads, d]` tensor as the kernels see it: one batch entry of `[heads, total,
/// d]`, each sequence's rows an offset into it.
fn one_batch([total, heads, d]: [usize; 3]) -> [usize; 4] {
    [1, heads, total, d]
}

/// The dimensions of `softmax(scale · Q Kᵀ) V` with `Q: [batch, heads_q, n_q, d]` and
/// `K, V: [batch, heads_kv, n_kv, d]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads (divides `heads_q`: grouped-query attention).
    pub heads_kv: usize,
    /// Query length.
    pub n_q: usize,
    /// Key length.
    pub n_kv: usize,
    /// Head dimension.
    pub d: usize,
    /// Element type of Q, K, V and O.
    pub dtype: DType,
    /// Softmax scale actually used.
    pub scale: f32,
    /// Causal mask.
    pub causal: bool,
    /// Sliding window (none: `Window::default()`).
    pub window: Window,
    /// Score modifier (checked against the heads).
    pub score_mod: Option<ScoreMod>,
    /// Attention sinks (checked against the heads).
    pub sinks: Option<Sinks>,
    /// Mask modifier (checked against the keys).
    pub mask_mod: Option<MaskMod>,
    /// Where the rows of Q, K and V lie ([`Strides::of`]; checked by [`Problem::new`]).
    pub(crate) strides: [Strides; 3],
    /// Whether Q, K and V are all row-major with no gaps.
    pub(crate) contiguous: bool,
    /// A packed variable-length batch ([`Problem::packed`]): its token counts. `batch` is then its
    /// number of sequences and `n_q`, `n_kv` their longest lengths.
    pub packed: Option<Packed>,
}

/// The token counts of a packed batch: Q has `total_q` rows, K and V `total_k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packed {
    /// Rows of Q (and O, lse).
    pub total_q: usize,
    /// Rows of K and V.
    pub total_k: usize,
}

/// Sequences a sliding window takes are shorter than this (2^29 tokens), so that a row index plus
/// a band's side (each at most `n_q + n_kv`) stays inside an `i32`.
pub(crate) const WINDOW_MAX_LEN: usize = 1 << 29;

/// The sizes of a problem, before they are checked against each other.
struct Sizes {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    n_q: usize,
    n_kv: usize,
    d: usize,
}

impl Problem {
    /// Check q, k, v against each other, the device and the options.
    pub fn new(gpu: &Gpu, q: &Tensor, k: &Tensor, v: &Tensor, opts: &Options) -> Result<Problem> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            gpu.check_context(t, name)?;
        }
        let [batch, heads_q, n_q, d] = dims4(q.shape(), "q must be [batch, heads, seq, head_dim]")?;
        let [kb, heads_kv, n_kv, kd] = dims4(k.shape(), "k must be [batch, heads, seq, head_dim]")?;
        same_shape(("v", v.shape()), ("k", k.shape()))?;
        if kb != batch || kd != d {
            return Err(KernelError::Shape(format!(
                "q {:?} and k {:?} differ in batch or head_dim",
                q.shape(),
                k.shape()
            )));
        }
        nonempty(q.shape(), ("k", k.shape()))?;
        let sizes = Sizes { batch, heads_q, heads_kv, n_q, n_kv, d };
        Problem::checked([q, k, v], sizes, opts, Strides::of, None)
    }

    /// A packed variable-length batch ([`crate::varlen`]): Q `[total_q, heads_q, d]`, K and V
    /// `[total_k, heads_kv, d]`, with any strides but the last, sequence `b` owning the rows
    /// `lens` gives it. Checked as [`Problem::new`] checks a fixed-length batch, and the token
    /// counts against the offsets' last entries.
    pub fn packed(
        gpu: &Gpu,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        lens: &SeqLens,
        opts: &Options,
    ) -> Result<Problem> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            gpu.check_context(t, name)?;
        }
        lens.check_context(gpu)?;
        let expected = "q must be [total_q, heads, head_dim] (a packed batch)";
        let [total_q, heads_q, d] = dims(q.shape(), expected)?;
        let expected = "k must be [total_k, heads, head_dim] (a packed batch)";
        let [total_k, heads_kv, kd] = dims(k.shape(), expected)?;
        same_shape(("v", v.shape()), ("k", k.shape()))?;
        if kd != d {
            return Err(KernelError::Shape(format!(
                "q {:?} and k {:?} differ in head_dim",
                q.shape(),
                k.shape()
            )));
        }
        if (total_q, total_k) != lens.totals() {
            let (cu_q, cu_k) = lens.totals();
            return Err(KernelError::Shape(format!(
                "q has {total_q} tokens and k {total_k}, but cu_seqlens_q ends at {cu_q} and \
                 cu_seqlens_k at {cu_k}: the last offsets are the token counts"
            )));
        }
        nonempty(q.shape(), ("k", k.shape()))?;
        let (n_q, n_kv) = lens.max_lengths();
        let sizes = Sizes { batch: lens.batch(), heads_q, heads_kv, n_q, n_kv, d };
        let packed = Some(Packed { total_q, total_k });
        Problem::checked([q, k, v], sizes, opts, Strides::of_packed, packed)
    }

    /// The checks shared by fixed-length and packed batches, once their sizes are known.
    fn checked(
        [q, k, v]: [&Tensor; 3],
        Sizes { batch, heads_q, heads_kv, n_q, n_kv, d }: Sizes,
        opts: &Options,
        strides_of: fn(&Tensor, &str) -> Result<Strides>,
        packed: Option<Packed>,
    ) -> Result<Problem> {
        heads_divide(heads_q, heads_kv)?;
        same_dtype([q.dtype(), k.dtype(), v.dtype()])?;
        // The kernels index with 32-bit rows and 64-bit offsets; keep rows in range.
        let limit = i32::MAX as usize;
        if n_q > limit || n_kv > limit || batch * heads_q > 65_535 * 65_535 {
            return Err(KernelError::Shape(format!(
                "q {:?} / k {:?} too large",
                q.shape(),
                k.shape()
            )));
        }
        let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
        check_scale(scale)?;
        if let Some(m) = &opts.score_mod {
            m.check(heads_q, false)?;
        }
        if let Some(sinks) = &opts.sinks {
            sinks.check(heads_q)?;
        }
        if let Some(m) = &opts.mask_mod {
            m.check(n_kv)?;
        }
        // A band's sides travel as ints (mask.cuh) and are added to row indices: keep every sum
        // inside an int.
        if opts.window.is_some() && n_q.max(n_kv) >= WINDOW_MAX_LEN {
            return Err(KernelError::Shape(format!(
                "sliding windows take sequences shorter than {WINDOW_MAX_LEN} tokens (q {:?}, k \
                 {:?})",
                q.shape(),
                k.shape()
            )));
        }
        // Every GPU rung's head dims are multiples of 8; another is reported by the rung as an
        // unsupported head dim, not as the strides of 16-byte chunks it cannot have.
        let strides = if d % 8 == 0 {
            [strides_of(q, "q")?, strides_of(k, "k")?, strides_of(v, "v")?]
        } else {
            [Strides::default(); 3]
        };
        Ok(Problem {
            batch,
            heads_q,
            heads_kv,
            n_q,
            n_kv,
            d,
            dtype: q.dtype(),
            scale,
            causal: opts.causal,
            window: opts.window,
            score_mod: opts.score_mod.clone(),
            sinks: opts.sinks.clone(),
            mask_mod: opts.mask_mod.clone(),
            strides,
            contiguous: [q, k, v].iter().all(|t| t.is_contiguous()),
            packed,
        })
    }

    /// The strides of `t` (Q, K, V, or an output laid out like them) as the kernels take them:
    /// [`Strides::of_packed`] for a packed batch, [`Strides::of`] otherwise.
    pub(crate) fn strides_of(&self, t: &Tensor, name: &str) -> Result<Strides> {
        match self.packed {
            Some(_) => Strides::of_packed(t, name),
            None => Strides::of(t, name),
        }
    }

    /// The dimensions of `t` (one [`Problem::strides_of`] takes) as the kernels see them: a
    /// packed `[total, heads, d]` tensor is one batch entry of `[heads, total, d]`.
    pub(crate) fn kernel_dims(&self, t: &Tensor) -> Vec<usize> {
        match (self.packed, <[usize; 3]>::try_from(t.shape())) {
            (Some(_), Ok(packed)) => one_batch(packed).to_vec(),
            _ => t.shape().to_vec(),
        }
    }

    /// Fails if the options ask for a sliding window, for the rungs that take none yet (`rung`
    /// names the one that refuses).
    pub(crate) fn require_no_window(&self, rung: &str) -> Result<()> {
        if self.window.is_some() {
            Err(KernelError::Shape(format!(
                "{rung} takes no sliding window yet ({:?}); fa2 does, forward and backward, and the \
                 fa3 forward, 16-bit and FP8",
                self.window
            )))
        } else {
            Ok(())
        }
    }

    /// Fails if the options carry a score modifier, for the rungs that take none yet (`rung`
    /// names the one that refuses).
    pub(crate) fn require_no_score_mod(&self, rung: &str) -> Result<()> {
        match &self.score_mod {
            Some(m) => Err(KernelError::Shape(format!(
                "{rung} takes no score_mod yet ({}); fa2 and fa3 do, forward (16-bit) and \
                 backward",
                m.name()
            ))),
            None => Ok(()),
        }
    }

    /// Fails if the options carry a mask modifier, for the rungs that take none yet (`rung` names
    /// the one that refuses).
    pub(crate) fn require_no_mask_mod(&self, rung: &str) -> Result<()> {
        match &self.mask_mod {
            Some(m) => Err(KernelError::Shape(format!(
                "{rung} takes no mask_mod yet ({}); fa2 and fa3 do, forward and backward \
                 (16-bit, not packed)",
                m.name()
            ))),
            None => Ok(()),
        }
    }

    /// Fails if the options carry attention sinks, for the rungs that take none yet (`rung`
    /// names the one that refuses).
    pub(crate) fn require_no_sinks(&self, rung: &str) -> Result<()> {
        match &self.sinks {
            Some(_) => Err(KernelError::Shape(format!(
                "{rung} takes no attention sinks yet; fa2 and fa3 do, forward (16-bit) and backward"
            ))),
            None => Ok(()),
        }
    }

    /// Fails if the score modifier has no derivative (a backward pass needs one).
    pub(crate) fn require_score_mod_derivative(&self) -> Result<()> {
        match &self.score_mod {
            Some(m) => m.check(self.heads_q, true),
            None => Ok(()),
        }
    }

    /// The score modifier's and the sinks' parameters for a launch (zeros without them).
    pub(crate) fn modifier_args(&self, gpu: &Gpu) -> Result<ModifierArgs> {
        ModifierArgs::of(gpu, self.score_mod.as_ref(), self.sinks.as_ref(), self.scale)
    }

    /// The band the kernels compiled with a window apply ([`Band`]): the window's sides, an
    /// open one as `n_q + n_kv` (no key is that far from a diagonal), the causal mask as
    /// `right = 0`. Sides stay below `mask.cuh`'s `UNBOUNDED` (2³⁰), which the kernels assume.
    pub(crate) fn band(&self) -> Band {
        let open = (self.n_q + self.n_kv).min(BAND_LIMIT);
        let side = |s: Option<usize>| s.unwrap_or(open).min(open) as i32;
        let right = if self.causal { 0 } else { side(self.window.right) };
        Band { left: side(self.window.left), right }
    }

    /// Fails unless Q, K and V are row-major with no gaps, for the rungs that take no strides
    /// yet (`rung` names the one that refuses, and the error says which one takes strides).
    pub(crate) fn require_contiguous(&self, rung: &str) -> Result<()> {
        if self.contiguous {
            Ok(())
        } else {
            Err(KernelError::Shape(format!(
                "{rung} takes contiguous [batch, heads, seq, head_dim] tensors only; fa2 and fa3 \
                 take strided ones (e.g. [batch, seq, heads, head_dim] through \
                 Tensor::transpose(1, 2))"
            )))
        }
    }

    /// `[heads_q, heads_kv, n_q, n_kv]` as the kernels' `int`s (in range: checked by `new`).
    pub(crate) fn dims_i32(&self) -> [i32; 4] {
        [self.heads_q, self.heads_kv, self.n_q, self.n_kv].map(|x| x as i32)
    }

    /// Shape of O (= Q's).
    pub fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.n_q, self.d]
    }

    /// Shape of K and V.
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_kv, self.n_kv, self.d]
    }

    /// Shape of lse: `[batch, heads_q, n_q]`, or `[heads_q, total_q]` for a packed batch.
    pub fn lse_shape(&self) -> Vec<usize> {
        match self.packed {
            None => vec![self.batch, self.heads_q, self.n_q],
            Some(Packed { total_q, .. }) => vec![self.heads_q, total_q],
        }
    }

    /// Fails unless `t` has shape `shape` and dtype `dtype` (for the backward's extra inputs).
    pub(crate) fn require_like(
        &self,
        gpu: &Gpu,
        name: &str,
        t: &Tensor,
        shape: &[usize],
        dtype: DType,
    ) -> Result<()> {
        gpu.check_context(t, name)?;
        if t.shape() != shape {
            return Err(KernelError::Shape(format!(
                "{name} has shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        if t.dtype() != dtype {
            return Err(KernelError::DType(format!("{name} is {}, expected {dtype}", t.dtype())));
        }
        Ok(())
    }

    /// The softmax scale times log2(e): the kernels work in base 2, so every exponential is one
    /// `ex2` instruction.
    pub(crate) fn scale_log2(&self) -> f32 {
        self.scale * std::f32::consts::LOG2_E
    }

    pub(crate) fn require_dtype(
        &self,
        rung: &'static str,
        allowed: &[DType],
        supported: &'static str,
    ) -> Result<()> {
        if allowed.contains(&self.dtype) {
            Ok(())
        } else {
            Err(KernelError::UnsupportedDtype { rung, dtype: self.dtype, supported })
        }
    }
}

/// Grid dimensions for `blocks` × heads × batch, within the launch limits.
pub(crate) fn grid(blocks: usize, heads: usize, batch: usize) -> Result<(u32, u32, u32)> {
    let fit = |x: usize, max: usize, what: &str| -> Result<u32> {
        if x <= max {
            Ok(x as u32)
        } else {
            Err(KernelError::Shape(format!("{what} = {x} exceeds the launch limit {max}")))
        }
    };
    Ok((
        fit(blocks, i32::MAX as usize, "blocks")?,
        fit(heads, 65_535, "heads")?,
        fit(batch, 65_535, "batch")?,
    ))
}

/// `[step, 2·step, …, N·step]`: the head dimensions of a kernel compiled for whatever it is given
/// (every multiple of its granule).
pub(crate) const fn multiples<const N: usize>(step: usize) -> [usize; N] {
    let mut dims = [0; N];
    let mut i = 0;
    while i < N {
        dims[i] = step * (i + 1);
        i += 1;
    }
    dims
}
