//! The FA3 rung's backward pass on Hopper (kernel `cuda/fa3_backward.cu`).
//!
//! The arithmetic is FA2's backward ([`crate::fa2::backward`], the FA2 paper's Algorithm 2):
//! one thread block per K/V tile walks the query tiles that see it, recomputes `Pᵀ` from the
//! forward's log-sum-exp, accumulates `dK`, `dV` in registers and adds `dQ`'s shares to an f32
//! accumulator. What changes is FA3's machinery (the FA3 paper's §3.1 and Appendix B.1): a producer
//! warpgroup copies Q, dO and their row statistics with TMA through an mbarrier pipeline, two
//! consumer warpgroups (64 keys each) take the five products with `wgmma` — `Sᵀ = K Qᵀ` and
//! `dPᵀ = V dOᵀ` from shared memory, `dV += Pᵀ dO` and `dK += dSᵀ Q` with `Pᵀ`, `dSᵀ` in
//! registers, `dQ = dS K` from the `dSᵀ` tile read as a transposed operand — and the producer
//! hands its registers to them (`setmaxnreg`).
//!
//! Only the main kernel is new: the preparation (`D = rowsum(dO ∘ O)`, lse in base 2), the
//! deterministic dQ pass and the finish (dQ's scale and conversion; with GQA the sum of `dK`, `dV`
//! over each group) are FA2's kernels with the same parameter block (`cuda/backward.cuh`), so both
//! rungs' gradients come out of the same arrays. Without GQA the main kernel writes `dK` and `dV`
//! itself, scaled and in 16 bits, as FA3 does: no f32 round trip through memory for them.
//! `Options::deterministic` drops dQ from the main kernel and computes it in FA2's fixed order.
//!
//! Head dims: every multiple of 8 up to 128 ([`BACKWARD_HEAD_DIMS`]); `dK` and `dV` of 64 keys
//! by `d` columns live in each consumer's registers, which past 128 columns they outgrow. Any
//! strides with the head dim contiguous (the tensor maps carry them), `n_q != n_kv` with
//! bottom-right causal masking, GQA. Packed variable-length batches take
//! [`crate::fa2::backward_varlen`] for now.

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::{CUtensorMap, CUtensorMapDataType};

use super::{MapSpec, dense_strides, require_hopper, tensor_map, tensor_map_16};
use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::fa2::{self, BackwardParams, MainPass};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Gradients, Options, Output, Problem, grid, multiples};
use crate::tensor::{DType, Tensor};

pub(crate) const SRC: &str = include_str!("../../cuda/fa3_backward.cu");

/// Head dimensions of [`backward`]: every multiple of 8 up to 128.
pub const BACKWARD_HEAD_DIMS: &[usize] = &multiples::<16>(8);

/// Keys per thread block: 64 per consumer warpgroup (wgmma's M), two consumers.
pub const BC: usize = 128;
/// Query rows per step of a block's walk: one 128-byte column block of the `dSᵀ` tile.
pub const BR: usize = 64;
/// Shared-memory stages of the Q/dO pipeline.
pub const STAGES: usize = 2;
/// Threads per block: a producer warpgroup and two consumers.
const THREADS: u32 = 384;

/// Dynamic shared memory of the kernel in bytes for head dim `d`: K and V of the block's keys,
/// [`STAGES`] stages of Q and dO tiles (16-bit, rows of whole 64-element blocks) and of their lse
/// and D rows (f32), two `dSᵀ` tiles, dQ's f32 tile (`d` rounded up to the 16-wide k-step, then
/// to 32-column blocks), the barriers, and 1024 bytes of slack for the alignment the swizzle
/// needs. (The kernel checks this against its own layout when it compiles.)
pub fn shared_bytes(d: usize) -> usize {
    let cols = super::tile_cols(d);
    let dq_cols = d.next_multiple_of(32);
    let tiles = 2 * BC * cols * 2 + 2 * STAGES * BR * cols * 2 + 2 * BC * BR * 2 + BR * dq_cols * 4;
    let stats = 2 * STAGES * BR * 4;
    let barriers = (1 + 2 * STAGES) * 8;
    // (the struct's size is a multiple of its 8-byte alignment)
    (tiles + stats + barriers).div_ceil(8) * 8 + 1024
}

/// The kernel variant for head dim `d`, element type, masking and dQ mode, with a score modifier
/// and a mask modifier compiled in or not.
pub(crate) fn variant(
    d: usize,
    dtype: DType,
    causal: bool,
    deterministic: bool,
    (score_mod, mask_mod): (Option<&crate::ScoreMod>, Option<&crate::MaskMod>),
) -> Variant {
    let variant = Variant {
        file: "fa3_backward",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FA3B_D", d.to_string()),
            ("FA3B_STAGES", STAGES.to_string()),
            ("FA3B_CAUSAL", (causal as u32).to_string()),
            ("FA3B_DETERMINISTIC", (deterministic as u32).to_string()),
            ("FA3B_HOST_SHARED_BYTES", shared_bytes(d).to_string()),
            ("FA3B_HOST_PARAMS_BYTES", std::mem::size_of::<Fa3BackwardParams>().to_string()),
        ],
        generated: Vec::new(),
    };
    variant.with_score_mod(score_mod).with_mask_mod(mask_mod)
}

/// Mirror of `Fa3BackwardParams` in `cuda/fa3_backward.cu`: the tensor maps of Q, K, V, dO and
/// dQ's f32 accumulator (128-byte aligned, as the kernel's `TensorMap`), then FA2's parameter
/// block.
#[repr(C)]
#[derive(Clone, Copy)]
struct Fa3BackwardParams {
    q: CUtensorMap,
    k: CUtensorMap,
    v: CUtensorMap,
    d_o: CUtensorMap,
    dq_acc: CUtensorMap,
    b: BackwardParams,
}

// SAFETY: a plain #[repr(C)] struct (opaque tensor-map words, then integers and floats), laid out
// as its CUDA mirror: CUtensorMap is 128 bytes aligned to 128 in both.
unsafe impl DeviceRepr for Fa3BackwardParams {}

/// Gradients of [`super::forward`], as [`crate::fa2::backward`] computes them: given the
/// forward's [`Output`] (`O` and `lse`) and the upstream gradient `dO`, returns `dQ, dK, dV` (with
/// GQA, `dK, dV` summed over each group's query heads), laid out like their inputs. fp16 or bf16,
/// any head dim in [`BACKWARD_HEAD_DIMS`], any strides with the head dim contiguous, on a Hopper
/// GPU (others get [`KernelError::UnsupportedArch`]). `opts.deterministic` makes the result
/// bitwise reproducible: dQ then comes from FA2's dQ pass, in a fixed order.
pub fn backward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Output,
    d_o: &Tensor,
    opts: &Options,
) -> Result<Gradients> {
    require_hopper(gpu, "fa3 backward")?;
    let p = Problem::new(gpu, q, k, v, opts)?;
    p.require_dtype("fa3 backward", super::DTYPES, "fp16, bf16")?;
    p.require_no_window("fa3 backward")?;
    p.require_score_mod_derivative()?;
    if !BACKWARD_HEAD_DIMS.contains(&p.d) {
        return Err(KernelError::UnsupportedHeadDim {
            rung: "fa3 backward",
            d: p.d,
            supported: BACKWARD_HEAD_DIMS,
        });
    }
    let modifiers = (p.score_mod.as_ref(), p.mask_mod.as_ref());
    let kernel = Kernel {
        variant: variant(p.d, p.dtype, p.causal, opts.deterministic, modifiers),
        entry: "fa3_backward",
    };
    let smem = shared_bytes(p.d);
    gpu.prepare(&kernel, smem)?;
    let [qs, ks, vs] = p.strides;
    let launch = |b: &BackwardParams| -> Result<()> {
        // FA2's dQ accumulator, [batch, heads_q, n_q, d] f32 (contiguous).
        let dq_dims = [p.d, p.n_q, p.heads_q, p.batch];
        let dq_acc = MapSpec {
            name: "dq_acc",
            ptr: b.dq_acc,
            dims: dq_dims,
            strides: dense_strides(dq_dims),
            dtype: CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            elem: 4,
            rows: BR,
        };
        let params = Fa3BackwardParams {
            q: tensor_map_16("q", (&p.kernel_dims(q), q.dtype()), qs, b.q, BR)?,
            k: tensor_map_16("k", (&p.kernel_dims(k), k.dtype()), ks, b.k, BC)?,
            v: tensor_map_16("v", (&p.kernel_dims(v), v.dtype()), vs, b.v, BC)?,
            // (d_o checked to have Q's shape and its strides taken by the time the pass runs)
            d_o: tensor_map_16(
                "d_o",
                (&p.kernel_dims(d_o), d_o.dtype()),
                b.d_o_strides,
                b.d_o,
                BR,
            )?,
            dq_acc: tensor_map(&dq_acc)?,
            b: *b,
        };
        let blocks = grid(p.n_kv.div_ceil(BC), p.heads_q, p.batch)?;
        gpu.launch(&kernel, blocks, THREADS, smem, &params)
    };
    let main = MainPass { tiles: (BR, BC), launch: &launch };
    fa2::backward_problem(gpu, &p, (q, k, v), (out, d_o), None, opts.deterministic, Some(main))
}

/// Every variant of the backward for `arch`, for the compile check: d = 64 and 128 in both types,
/// masks and dQ modes, and in fp16 head dims off the 64-column blocks and below the 16-wide k-step.
#[cfg(test)]
pub(crate) fn variants(arch: &str) -> Vec<Variant> {
    let mut all = Vec::new();
    if arch != super::ARCH {
        return all;
    }
    for &dtype in super::DTYPES {
        for d in [64, 128] {
            for causal in [false, true] {
                for deterministic in [false, true] {
                    all.push(variant(d, dtype, causal, deterministic, (None, None)));
                }
            }
        }
    }
    for (d, causal) in [(8, false), (40, true), (96, false), (96, true), (120, false)] {
        all.push(variant(d, DType::F16, causal, false, (None, None)));
    }
    // Score modifiers at the tuned head dims: each built-in.
    let softcap = crate::ScoreMod::softcap(30.0).expect("a valid cap");
    let alibi = crate::ScoreMod::alibi(vec![0.5; 8]).expect("valid slopes");
    for d in [64, 128] {
        for causal in [false, true] {
            for m in [&softcap, &alibi] {
                all.push(variant(d, DType::F16, causal, false, (Some(m), None)));
            }
        }
    }
    // Mask modifiers (a document mask and a prefix-LM mask), alone and under softcap, in both dQ
    // modes.
    let masks = crate::MaskMod::document_lengths(&[64, 64])
        .expect("valid documents")
        .or(crate::MaskMod::prefix_lm(16).expect("a valid prefix"));
    for d in [64, 128] {
        for causal in [false, true] {
            for deterministic in [false, true] {
                all.push(variant(d, DType::F16, causal, deterministic, (None, Some(&masks))));
            }
            all.push(variant(d, DType::F16, causal, false, (Some(&softcap), Some(&masks))));
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_put_fa2s_block_after_the_four_maps() {
        assert_eq!(std::mem::align_of::<Fa3BackwardParams>(), 128);
        assert_eq!(std::mem::offset_of!(Fa3BackwardParams, d_o), 384);
        assert_eq!(std::mem::offset_of!(Fa3BackwardParams, dq_acc), 512);
        assert_eq!(std::mem::offset_of!(Fa3BackwardParams, b), 640);
    }

    #[test]
    fn shared_memory_fits_the_h200_at_every_head_dim() {
        for &d in BACKWARD_HEAD_DIMS {
            assert!(shared_bytes(d) <= super::super::MAX_SHARED_BYTES, "d = {d}");
        }
        // d = 128: K, V 32 KiB each, two stages of Q and dO 16 KiB each, two dSᵀ tiles 16 KiB
        // each, dQ's 32 KiB, 1 KiB of statistics, 40 bytes of barriers, the slack.
        assert_eq!(shared_bytes(128), (64 + 64 + 32 + 32 + 1) * 1024 + 40 + 1024);
        // d = 40: tiles of 64 columns, dQ's of 64 (48 rounded up to 32-column blocks).
        assert_eq!(shared_bytes(40), (32 + 32 + 32 + 16 + 1) * 1024 + 40 + 1024);
    }
}
