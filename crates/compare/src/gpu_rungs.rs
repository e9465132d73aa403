//! Every GPU kernel of `ladder-kernels` by name: [`GpuRung`].
//!
//! One table ([`GpuRung::ALL`] and one [`Spec`] per variant) says what each kernel is called in
//! the CLI and the CSV files, which direction it computes, the head dimensions and element types
//! it supports, the CPU rung it is checked against, and the functions that launch it. `ladder
//! bench`, `ladder verify`, [`crate::gpu_check`] and the GPU tests read it, so a new kernel (FA3,
//! the decoding kernels) is one variant and one [`Spec`] here.

use std::fmt;
use std::str::FromStr;

use ladder_kernels::decode::{self, Cache, DecodeOptions, Strategy};
use ladder_kernels::fa3::fp8::{self, Fp8Inputs, Fp8Options};
use ladder_kernels::{DType, Gpu, Gradients, Options, Output, Tensor, fa1, fa2, fa3};

use crate::results::Direction;
use crate::rungs::Rung;

/// A forward kernel: `O, lse` from `Q, K, V`.
pub type ForwardFn =
    fn(&Gpu, &Tensor, &Tensor, &Tensor, &Options) -> ladder_kernels::Result<Output>;

/// A forward kernel on a packed variable-length batch (`ladder_kernels::varlen`).
pub type VarlenForwardFn = fn(
    &Gpu,
    &Tensor,
    &Tensor,
    &Tensor,
    &ladder_kernels::varlen::SeqLens,
    &Options,
) -> ladder_kernels::Result<Output>;

/// A backward kernel: `dQ, dK, dV` from `Q, K, V`, the forward's output and `dO`.
pub type BackwardFn = fn(
    &Gpu,
    &Tensor,
    &Tensor,
    &Tensor,
    &Output,
    &Tensor,
    &Options,
) -> ladder_kernels::Result<Gradients>;

/// A backward kernel on a packed variable-length batch.
pub type VarlenBackwardFn = fn(
    &Gpu,
    &Tensor,
    &Tensor,
    &Tensor,
    &Output,
    &Tensor,
    &ladder_kernels::varlen::SeqLens,
    &Options,
) -> ladder_kernels::Result<Gradients>;

/// The FP8 path's quantisation: `Q, K, V` to e4m3 with their scales.
pub type QuantizeFn =
    fn(&Gpu, &Tensor, &Tensor, &Tensor, &Options, &Fp8Options) -> ladder_kernels::Result<Fp8Inputs>;

/// The FP8 path's attention on quantised inputs.
pub type QuantizedForwardFn = fn(&Gpu, &Fp8Inputs) -> ladder_kernels::Result<Output>;

/// The FP8 path's quantisation of a packed variable-length batch.
pub type VarlenQuantizeFn = fn(
    &Gpu,
    &Tensor,
    &Tensor,
    &Tensor,
    &ladder_kernels::varlen::SeqLens,
    &Options,
    &Fp8Options,
) -> ladder_kernels::Result<Fp8Inputs>;

/// The FP8 path's attention on a quantised packed batch.
pub type VarlenQuantizedForwardFn =
    fn(&Gpu, &Fp8Inputs, &ladder_kernels::varlen::SeqLens) -> ladder_kernels::Result<Output>;

/// A decoding kernel: `O, lse` of a few new tokens `Q` against a KV cache, contiguous or paged.
pub type DecodeFn = fn(&Gpu, &Tensor, Cache<'_>, &DecodeOptions) -> ladder_kernels::Result<Output>;

/// The functions that launch a GPU rung.
#[derive(Clone, Copy)]
pub enum Kernels {
    /// A forward pass.
    Forward(ForwardFn),
    /// A backward pass, and the forward pass that gives it `O` and `lse`.
    Backward {
        /// The forward pass run first (untimed in `ladder bench`).
        forward: ForwardFn,
        /// The backward pass.
        backward: BackwardFn,
        /// Whether it runs with [`Options::deterministic`] (dQ without atomics).
        deterministic: bool,
    },
    /// A decoding step against a KV cache ([`Direction::Decode`]).
    Decode(DecodeFn),
    /// A forward pass on e4m3 operands: the quantisation (untimed in `ladder bench`, as FP8
    /// peers take e4m3 inputs), then the attention.
    ForwardFp8 {
        /// Rounds `Q, K, V` to e4m3.
        quantize: QuantizeFn,
        /// The attention on the quantised inputs.
        forward: QuantizedForwardFn,
    },
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kernels::Forward(_) => "Kernels::Forward",
            Kernels::Backward { .. } => "Kernels::Backward",
            Kernels::Decode(_) => "Kernels::Decode",
            Kernels::ForwardFp8 { .. } => "Kernels::ForwardFp8",
        })
    }
}

/// What there is to know about one GPU rung.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The name in `ladder bench --rung` and the CSV's `impl` column (shared by the directions of
    /// one algorithm).
    pub name: &'static str,
    /// The row label in `ladder verify` and in test messages (unique).
    pub label: &'static str,
    /// Forward, backward or decode.
    pub direction: Direction,
    /// Head dimensions the kernel is compiled for.
    pub head_dims: &'static [usize],
    /// Element types of Q, K, V it accepts.
    pub dtypes: &'static [DType],
    /// The CPU rung it is checked against.
    pub cpu: Rung,
    /// The launch functions.
    pub kernels: Kernels,
}

const HALF: &[DType] = &[DType::F16, DType::BF16];

const FA1: Spec = Spec {
    name: "fa1",
    label: "fa1-gpu",
    direction: Direction::Fwd,
    head_dims: fa1::HEAD_DIMS,
    dtypes: &[DType::F16, DType::BF16, DType::F32],
    cpu: Rung::Fa1,
    kernels: Kernels::Forward(fa1::forward),
};

const FA2: Spec = Spec {
    name: "fa2",
    label: "fa2-gpu",
    direction: Direction::Fwd,
    head_dims: fa2::HEAD_DIMS,
    dtypes: HALF,
    cpu: Rung::Fa2,
    kernels: Kernels::Forward(fa2::forward),
};

const FA3: Spec = Spec {
    name: "fa3",
    label: "fa3-gpu",
    direction: Direction::Fwd,
    head_dims: fa3::HEAD_DIMS,
    dtypes: fa3::DTYPES,
    cpu: Rung::Fa3,
    kernels: Kernels::Forward(fa3::forward),
};

const FA3_FP8: Spec = Spec {
    name: "fa3-fp8",
    label: "fa3-fp8-gpu",
    direction: Direction::Fwd,
    head_dims: fp8::HEAD_DIMS,
    dtypes: fa3::DTYPES,
    cpu: Rung::Fa3Fp8,
    kernels: Kernels::ForwardFp8 { quantize: fp8::quantize, forward: fp8::forward_quantized },
};

const FA2_BACKWARD: Spec = Spec {
    name: "fa2",
    label: "fa2-bwd-gpu",
    direction: Direction::Bwd,
    head_dims: fa2::BACKWARD_HEAD_DIMS,
    dtypes: HALF,
    cpu: Rung::Fa2,
    kernels: Kernels::Backward {
        forward: fa2::forward,
        backward: fa2::backward,
        deterministic: false,
    },
};

const FA2_BACKWARD_DETERMINISTIC: Spec = Spec {
    name: "fa2-det",
    label: "fa2-bwd-det-gpu",
    direction: Direction::Bwd,
    head_dims: fa2::BACKWARD_HEAD_DIMS,
    dtypes: HALF,
    cpu: Rung::Fa2,
    kernels: Kernels::Backward {
        forward: fa2::forward,
        backward: fa2::backward,
        deterministic: true,
    },
};

const FA3_BACKWARD: Spec = Spec {
    name: "fa3",
    label: "fa3-bwd-gpu",
    direction: Direction::Bwd,
    head_dims: fa3::BACKWARD_HEAD_DIMS,
    dtypes: fa3::DTYPES,
    cpu: Rung::Fa2,
    kernels: Kernels::Backward {
        forward: fa3::forward,
        backward: fa3::backward,
        deterministic: false,
    },
};

const FA3_BACKWARD_DETERMINISTIC: Spec = Spec {
    name: "fa3-det",
    label: "fa3-bwd-det-gpu",
    direction: Direction::Bwd,
    head_dims: fa3::BACKWARD_HEAD_DIMS,
    dtypes: fa3::DTYPES,
    cpu: Rung::Fa2,
    kernels: Kernels::Backward {
        forward: fa3::forward,
        backward: fa3::backward,
        deterministic: true,
    },
};

const FLASH_DECODING: Spec = Spec {
    name: "flash-decoding",
    label: "flash-decoding-gpu",
    direction: Direction::Decode,
    head_dims: decode::HEAD_DIMS,
    dtypes: decode::DTYPES,
    cpu: Rung::FlashDecoding,
    kernels: Kernels::Decode(flash_decoding),
};

const FLASH_DECODING_PP: Spec = Spec {
    name: "flash-decoding-pp",
    label: "flash-decoding-pp-gpu",
    direction: Direction::Decode,
    head_dims: decode::HEAD_DIMS,
    dtypes: decode::DTYPES,
    cpu: Rung::FlashDecodingPp,
    kernels: Kernels::Decode(flash_decoding_pp),
};

/// [`decode::forward`] with FlashDecoding's kernels whatever the options' strategy.
fn flash_decoding(
    gpu: &Gpu,
    q: &Tensor,
    cache: Cache<'_>,
    opts: &DecodeOptions,
) -> ladder_kernels::Result<Output> {
    decode::forward(gpu, q, cache, &GpuRung::FlashDecoding.decode_options(opts))
}

/// [`decode::forward`] with FlashDecoding++'s kernels: the options' GEMV or flat GEMM if they
/// force one, else the one the rows call for.
fn flash_decoding_pp(
    gpu: &Gpu,
    q: &Tensor,
    cache: Cache<'_>,
    opts: &DecodeOptions,
) -> ladder_kernels::Result<Output> {
    decode::forward(gpu, q, cache, &GpuRung::FlashDecodingPp.decode_options(opts))
}

/// A GPU kernel of the ladder, one per (algorithm, direction).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuRung {
    /// FlashAttention-1 forward (`ladder_kernels::fa1::forward`).
    Fa1,
    /// FlashAttention-2 forward (`ladder_kernels::fa2::forward`).
    Fa2,
    /// FlashAttention-3 forward on Hopper (`ladder_kernels::fa3::forward`).
    Fa3,
    /// FlashAttention-3 forward in FP8 e4m3 on Hopper (`ladder_kernels::fa3::fp8`).
    Fa3Fp8,
    /// FlashAttention-2 backward (`ladder_kernels::fa2::backward`), dQ by atomics.
    Fa2Backward,
    /// FlashAttention-2 backward with `Options::deterministic` (dQ by a separate pass).
    Fa2BackwardDeterministic,
    /// FlashAttention-3 backward on Hopper (`ladder_kernels::fa3::backward`), dQ by atomics;
    /// checked against the CPU FA2 backward rung (the same arithmetic).
    Fa3Backward,
    /// FlashAttention-3 backward with `Options::deterministic` (dQ by FA2's separate pass).
    Fa3BackwardDeterministic,
    /// FlashDecoding (`ladder_kernels::decode::forward`): new tokens against a KV cache.
    FlashDecoding,
    /// FlashDecoding++ (`ladder_kernels::decode::forward` with a FlashDecoding++ strategy):
    /// unified max, flat GEMM or GEMV, rows out of range recomputed against their own largest score.
    FlashDecodingPp,
}

impl GpuRung {
    /// Every GPU rung, in table order.
    pub const ALL: [GpuRung; 10] = [
        GpuRung::Fa1,
        GpuRung::Fa2,
        GpuRung::Fa3,
        GpuRung::Fa3Fp8,
        GpuRung::Fa2Backward,
        GpuRung::Fa2BackwardDeterministic,
        GpuRung::Fa3Backward,
        GpuRung::Fa3BackwardDeterministic,
        GpuRung::FlashDecoding,
        GpuRung::FlashDecodingPp,
    ];

    /// Everything about the rung.
    pub fn spec(self) -> &'static Spec {
        match self {
            GpuRung::Fa1 => &FA1,
            GpuRung::Fa2 => &FA2,
            GpuRung::Fa3 => &FA3,
            GpuRung::Fa3Fp8 => &FA3_FP8,
            GpuRung::Fa2Backward => &FA2_BACKWARD,
            GpuRung::Fa2BackwardDeterministic => &FA2_BACKWARD_DETERMINISTIC,
            GpuRung::Fa3Backward => &FA3_BACKWARD,
            GpuRung::Fa3BackwardDeterministic => &FA3_BACKWARD_DETERMINISTIC,
            GpuRung::FlashDecoding => &FLASH_DECODING,
            GpuRung::FlashDecodingPp => &FLASH_DECODING_PP,
        }
    }

    /// The decoding options the rung runs with: `opts` with its strategy pinned to the rung's
    /// kernels (FlashDecoding; or FlashDecoding++, keeping a forced GEMV or flat GEMM). Other
    /// rungs leave `opts` as it is.
    pub fn decode_options(self, opts: &DecodeOptions) -> DecodeOptions {
        let strategy = match self {
            GpuRung::FlashDecoding => Strategy::FlashDecoding,
            GpuRung::FlashDecodingPp if opts.strategy.is_pp() => opts.strategy,
            GpuRung::FlashDecodingPp => Strategy::FlashDecodingPp,
            _ => opts.strategy,
        };
        DecodeOptions { strategy, ..opts.clone() }
    }

    /// The CLI and CSV name (`fa1`, `fa2`, `flash-decoding`): the same for both directions of
    /// one algorithm.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The unique label of `ladder verify`'s rows (`fa1-gpu`, `fa2-gpu`, `fa2-bwd-gpu`,
    /// `flash-decoding-gpu`).
    pub fn label(self) -> &'static str {
        self.spec().label
    }

    /// Forward, backward or decode.
    pub fn direction(self) -> Direction {
        self.spec().direction
    }

    /// The head dimensions the kernel supports.
    pub fn head_dims(self) -> &'static [usize] {
        self.spec().head_dims
    }

    /// The element types the kernel supports.
    pub fn dtypes(self) -> &'static [DType] {
        self.spec().dtypes
    }

    /// Whether the kernel supports head dimension `d`.
    pub fn supports(self, d: usize) -> bool {
        self.head_dims().contains(&d)
    }

    /// Whether the kernel takes Q, K, V (and dO, or a decoding call's cache) in any batch, head
    /// and sequence strides, e.g. as `[batch, seq, heads, d]` views (all but FA1); the others take
    /// contiguous `[batch, heads, seq, d]` tensors only.
    pub fn takes_strides(self) -> bool {
        matches!(
            self,
            GpuRung::Fa2
                | GpuRung::Fa3
                | GpuRung::Fa3Fp8
                | GpuRung::Fa2Backward
                | GpuRung::Fa2BackwardDeterministic
                | GpuRung::Fa3Backward
                | GpuRung::Fa3BackwardDeterministic
                | GpuRung::FlashDecoding
                | GpuRung::FlashDecodingPp
        )
    }

    /// Whether the kernel takes a sliding window (`Options::window`): FA2, forward and backward,
    /// and the FA3 forward, 16-bit and FP8; the others refuse one with an error.
    pub fn takes_window(self) -> bool {
        matches!(
            self,
            GpuRung::Fa2
                | GpuRung::Fa2Backward
                | GpuRung::Fa2BackwardDeterministic
                | GpuRung::Fa3
                | GpuRung::Fa3Fp8
        )
    }

    /// Whether the kernel takes a score modifier (`Options::score_mod`): FA2 and FA3, forward
    /// (16-bit) and backward.
    pub fn takes_score_mod(self) -> bool {
        matches!(
            self,
            GpuRung::Fa2
                | GpuRung::Fa2Backward
                | GpuRung::Fa2BackwardDeterministic
                | GpuRung::Fa3
                | GpuRung::Fa3Backward
                | GpuRung::Fa3BackwardDeterministic
        )
    }

    /// Whether the kernel takes a mask modifier (`Options::mask_mod`): FA2 and FA3, forward
    /// (16-bit) and backward (fixed-length batches).
    pub fn takes_mask_mod(self) -> bool {
        matches!(
            self,
            GpuRung::Fa2
                | GpuRung::Fa3
                | GpuRung::Fa2Backward
                | GpuRung::Fa2BackwardDeterministic
                | GpuRung::Fa3Backward
                | GpuRung::Fa3BackwardDeterministic
        )
    }

    /// Whether the kernel runs on `gpu` (FA3 needs Hopper, `sm_90a`; the others sm_80+).
    pub fn available_on(self, gpu: &Gpu) -> bool {
        !matches!(
            self,
            GpuRung::Fa3
                | GpuRung::Fa3Fp8
                | GpuRung::Fa3Backward
                | GpuRung::Fa3BackwardDeterministic
        ) || gpu.arch() == fa3::ARCH
    }

    /// The CPU rung it is checked against.
    pub fn cpu(self) -> Rung {
        self.spec().cpu
    }

    /// The CPU rung's label in `ladder verify` (`fa2`, or `fa2-bwd` for a backward pass).
    pub fn cpu_label(self) -> String {
        match self.direction() {
            Direction::Fwd | Direction::Decode => self.cpu().name().to_string(),
            Direction::Bwd => format!("{}-bwd", self.cpu().name()),
        }
    }

    /// The functions that launch it.
    pub fn kernels(self) -> Kernels {
        self.spec().kernels
    }

    /// Its forward pass on packed variable-length batches, where it has one (FA2, FA3).
    pub fn varlen_forward(self) -> Option<VarlenForwardFn> {
        match self {
            GpuRung::Fa2 => Some(fa2::forward_varlen),
            GpuRung::Fa3 => Some(fa3::forward_varlen),
            _ => None,
        }
    }

    /// The FP8 rung's quantisation and attention on packed variable-length batches.
    pub fn varlen_fp8(self) -> Option<(VarlenQuantizeFn, VarlenQuantizedForwardFn)> {
        match self {
            GpuRung::Fa3Fp8 => Some((fp8::quantize_varlen, fp8::forward_quantized_varlen)),
            _ => None,
        }
    }

    /// A backward rung's passes on packed variable-length batches, where it has them (FA2's):
    /// the forward that gives the backward `O` and `lse`, and the backward (run with the
    /// `deterministic` of its [`Kernels::Backward`]).
    pub fn varlen_backward(self) -> Option<(VarlenForwardFn, VarlenBackwardFn)> {
        match self {
            GpuRung::Fa2Backward | GpuRung::Fa2BackwardDeterministic => {
                Some((fa2::forward_varlen, fa2::backward_varlen))
            }
            _ => None,
        }
    }

    /// Its forward pass on fixed-length batches, where it has one of its own (not FP8's, which
    /// takes quantised inputs, nor a backward rung's).
    pub fn forward(self) -> Option<ForwardFn> {
        match self.kernels() {
            Kernels::Forward(forward) => Some(forward),
            _ => None,
        }
    }

    /// The rung called `name` (as in the CSV's `impl` column) in `direction`, if there is one.
    pub fn find(name: &str, direction: Direction) -> Option<GpuRung> {
        GpuRung::ALL.into_iter().find(|r| r.name() == name && r.direction() == direction)
    }

    /// The distinct names, in table order (`fa1`, `fa2`, `fa3`, `fa3-fp8`, `fa2-det`, `fa3-det`,
    /// `flash-decoding`, `flash-decoding-pp`).
    pub fn names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Vec::new();
        for r in GpuRung::ALL {
            if !names.contains(&r.name()) {
                names.push(r.name());
            }
        }
        names
    }
}

impl fmt::Display for GpuRung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The GPU rung of a label (`fa2-bwd-gpu`), the inverse of [`GpuRung::label`].
impl FromStr for GpuRung {
    type Err = String;

    fn from_str(s: &str) -> Result<GpuRung, String> {
        GpuRung::ALL.into_iter().find(|r| r.label() == s.trim()).ok_or_else(|| {
            let labels: Vec<&str> = GpuRung::ALL.iter().map(|r| r.label()).collect();
            format!("no GPU rung `{s}` (known: {})", labels.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_labels_and_lookups_agree() {
        assert_eq!(
            GpuRung::names(),
            [
                "fa1",
                "fa2",
                "fa3",
                "fa3-fp8",
                "fa2-det",
                "fa3-det",
                "flash-decoding",
                "flash-decoding-pp"
            ]
        );
        for r in GpuRung::ALL {
            assert_eq!(r.label().parse::<GpuRung>(), Ok(r));
            assert_eq!(GpuRung::find(r.name(), r.direction()), Some(r));
            assert_eq!(r.to_string(), r.label());
            assert!(!r.head_dims().is_empty() && !r.dtypes().is_empty());
            assert_eq!(
                matches!(r.kernels(), Kernels::Backward { .. }),
                r.direction() == Direction::Bwd
            );
            assert_eq!(
                matches!(r.kernels(), Kernels::Decode(_)),
                r.direction() == Direction::Decode
            );
        }
        assert_eq!(GpuRung::find("fa2", Direction::Bwd), Some(GpuRung::Fa2Backward));
        assert_eq!(GpuRung::find("fa1", Direction::Bwd), None);
        assert_eq!(
            GpuRung::find("fa2-det", Direction::Bwd),
            Some(GpuRung::Fa2BackwardDeterministic)
        );
        assert!("fa9".parse::<GpuRung>().unwrap_err().contains("fa2-bwd-gpu"));
        assert!(GpuRung::Fa2.supports(256) && !GpuRung::Fa2Backward.supports(256));
        assert_eq!(GpuRung::Fa2Backward.cpu_label(), "fa2-bwd");
        assert_eq!(GpuRung::find("fa3", Direction::Bwd), Some(GpuRung::Fa3Backward));
        assert_eq!(GpuRung::Fa3BackwardDeterministic.label(), "fa3-bwd-det-gpu");
        assert_eq!(GpuRung::Fa3Backward.cpu_label(), "fa2-bwd");
        assert!(GpuRung::Fa3Backward.supports(128) && !GpuRung::Fa3Backward.supports(136));
        assert!(GpuRung::Fa1.dtypes().contains(&DType::F32));
        let fd = GpuRung::FlashDecoding;
        assert_eq!(GpuRung::find("flash-decoding", Direction::Decode), Some(fd));
        assert_eq!(GpuRung::find("flash-decoding", Direction::Fwd), None);
        assert_eq!(
            (fd.label(), fd.cpu(), fd.cpu_label()),
            ("flash-decoding-gpu", Rung::FlashDecoding, "flash-decoding".to_string())
        );
        assert!(fd.supports(128) && fd.dtypes() == [DType::F16, DType::BF16]);
        let pp = GpuRung::FlashDecodingPp;
        assert_eq!(GpuRung::find("flash-decoding-pp", Direction::Decode), Some(pp));
        assert_eq!(
            (pp.label(), pp.cpu(), pp.cpu_label()),
            ("flash-decoding-pp-gpu", Rung::FlashDecodingPp, "flash-decoding-pp".to_string())
        );
        assert_eq!("flash-decoding-pp-gpu".parse::<GpuRung>(), Ok(pp));
        let f8 = GpuRung::Fa3Fp8;
        assert_eq!((f8.label(), f8.cpu()), ("fa3-fp8-gpu", Rung::Fa3Fp8));
        assert!(f8.supports(128) && f8.supports(80) && !f8.supports(72));
        assert!(matches!(f8.kernels(), Kernels::ForwardFp8 { .. }));
    }

    #[test]
    fn decoding_rungs_pin_their_strategy() {
        let with = |strategy| DecodeOptions { strategy, phi: 1.5, ..DecodeOptions::default() };
        for s in Strategy::ALL {
            let fd = GpuRung::FlashDecoding.decode_options(&with(s));
            assert_eq!((fd.strategy, fd.phi), (Strategy::FlashDecoding, 1.5));
            let pp = GpuRung::FlashDecodingPp.decode_options(&with(s)).strategy;
            assert_eq!(pp, if s.is_pp() { s } else { Strategy::FlashDecodingPp }, "{s}");
            assert_eq!(GpuRung::Fa2.decode_options(&with(s)).strategy, s);
        }
    }
}
