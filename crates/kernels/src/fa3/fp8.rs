//! FA3's FP8 forward (Shah et al. 2024, §3.3): the same kernel with e4m3 operands, at twice the
//! tensor-core rate of fp16.
//!
//! FP8 e4m3 has a 3-bit mantissa, so how the numbers are scaled into its range decides the
//! error. Two tricks from the paper, as the CPU rung `ladder_reference::fa3` has them:
//!
//! - **Block quantisation**: one scale per tile of rows (Q per query block of the kernel, K and V
//!   per key tile), `amax / 448`, so an outlier coarsens only its own tile.
//! - **Incoherent processing** ([`Fp8Options::incoherent`]): Q and K are multiplied by the same
//!   random orthogonal map (a Hadamard matrix times random signs, `/ √d`), which leaves `Q Kᵀ`
//!   unchanged but spreads an outlier channel over all `d` channels before rounding.
//!
//! [`quantize`] runs both on the GPU (`cuda/fa3_fp8_quantize.cu`), writing V transposed: e4m3
//! wgmma reads its B operand only K-major, and for `P V` the reduction runs over the keys. The
//! attention kernel (`cuda/fa3_forward.cu` with `FA3_FP8`) folds the scales in where they cost
//! nothing — Q's and K's into the softmax scale of each tile, V's into `P` before it is rounded
//! (which also keeps `P` in `[0, 256]`, FA3's trick against underflow) — and writes O in the
//! inputs' dtype. [`forward`] is both steps; [`forward_quantized`] is the attention alone, on
//! inputs quantised once (what the benchmark times, as FP8 peers take e4m3 inputs).

use cudarc::driver::sys::CUtensorMapDataType;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{
    DTYPES, Fa3Tiles, Fp8Scales, Launch, MapSpec, Schedule, dense_strides, launch, require_hopper,
    tensor_map,
};
use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::{Gpu, Kernel};
use crate::problem::{Options, Output, Problem, grid};
use crate::tensor::{DType, Tensor};

const QUANTIZE_SRC: &str = include_str!("../../cuda/fa3_fp8_quantize.cu");

/// Head dimensions with an FP8 kernel. The attention kernel itself would take any multiple of 8
/// (its shared rows are padded to whole 128-byte blocks, as the 16-bit path's are), but the
/// quantisation kernel (`cuda/fa3_fp8_quantize.cu`) spreads a row over a warp, 32 columns at a
/// time, and rotates it with a Walsh–Hadamard transform, which needs a power of two of at least
/// 32. Of those, 128 and 256 fill whole 128-byte rows of e4m3 and are tested and measured; 64
/// (half a row, padded) is not yet, and other head dims need a quantiser without the rotation.
pub const HEAD_DIMS: &[usize] = &[128, 256];

/// Options of the FP8 path (block scales are always on).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8Options {
    /// Incoherent processing: rotate Q and K by the random Hadamard map whose signs are drawn
    /// from this seed (the draw of `ladder_reference::fp8::RandomHadamard`); `None` turns it off.
    pub incoherent: Option<u64>,
}

/// The random signs of the incoherent-processing map for head dim `d` (a power of two) and
/// `seed`: ChaCha8 seeded with `seed`, one random bool per column, as the CPU rung draws them.
pub fn hadamard_signs(d: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..d).map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 }).collect()
}

/// The FP8 kernel's tiles for head dim `d` and `n_kv` keys: 128 query rows (two consumer
/// warpgroups), two stages, and K/V tiles of 128 keys, or 192 at d = 128 past [`SHORT_KEYS`]
/// keys. Measured on the H200 (docs/perf-notes.md, FA3 v9), d = 128: 192 keys beat 128 by 16 %
/// at n = 2k without the mask and by 14–15 % from 8k on (5–9 % causal; a third fewer rounds of
/// per-tile work per score, where the softmax is as long as the products), and 224 by a few
/// percent; at n = 512 128 keys win by 10 %, and at 1k by 16 % under the mask (less of the last
/// tile wasted). At d = 256 S's registers beside O's 128 leave no room for more than 128. With
/// 192 keys V's transposed tile spans two 128-key column blocks, of which the second's first
/// half is used (its second half, the next tile's first keys, is loaded and not read).
pub fn tiles_for_problem(d: usize, n_kv: usize) -> Result<Fa3Tiles> {
    match d {
        128 if n_kv > SHORT_KEYS => Ok(Fa3Tiles { bc: 192, consumers: 2, stages: 2 }),
        128 | 256 => Ok(Fa3Tiles { bc: 128, consumers: 2, stages: 2 }),
        _ => Err(KernelError::UnsupportedHeadDim { rung: "fa3-fp8", d, supported: HEAD_DIMS }),
    }
}

/// The longest problem (keys) that takes 128-key tiles at d = 128 ([`tiles_for_problem`]).
pub const SHORT_KEYS: usize = 1024;

/// Q, K and V in e4m3 on the GPU with their block scales: what [`quantize`] makes and
/// [`forward_quantized`] reads. The problem (shape, mask, softmax scale) and the tiles are fixed
/// when the inputs are quantised, since the scales' blocks are the kernel's tiles.
pub struct Fp8Inputs {
    problem: Problem,
    tiles: Fa3Tiles,
    /// `[batch, heads_q, n_q, d]`, rotated when incoherent processing is on.
    q: CudaSlice<u8>,
    /// `[batch, heads_kv, n_kv, d]`, rotated likewise.
    k: CudaSlice<u8>,
    /// `[batch, heads_kv, d, n_pad]`: V transposed, keys in `fp8_key_slot` order per 32.
    vt: CudaSlice<u8>,
    n_pad: usize,
    q_scale: CudaSlice<f32>,
    k_scale: CudaSlice<f32>,
    v_scale: CudaSlice<f32>,
    p_lift: CudaSlice<f32>,
    o_scale: CudaSlice<f32>,
}

impl Fp8Inputs {
    /// The problem the inputs were quantised for.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// The tiles (and so the scales' blocks): `tiles.br()` query rows, `tiles.bc` keys.
    pub fn tiles(&self) -> Fa3Tiles {
        self.tiles
    }

    /// Q and K as e4m3 bytes, and V's bytes in natural `[batch, heads_kv, n_kv, d]` order (the
    /// transposition and key permutation undone), for checking against a CPU quantisation.
    pub fn to_bytes(&self) -> Result<[Vec<u8>; 3]> {
        let s = self.q.stream();
        let err = || KernelError::driver("copying FP8 inputs to the host");
        let q = s.clone_dtoh(&self.q).map_err(err())?;
        let k = s.clone_dtoh(&self.k).map_err(err())?;
        let vt = s.clone_dtoh(&self.vt).map_err(err())?;
        let p = &self.problem;
        let mut v = vec![0u8; p.batch * p.heads_kv * p.n_kv * p.d];
        for head in 0..p.batch * p.heads_kv {
            for key in 0..p.n_kv {
                let slot = key / 32 * 32 + key_slot(key % 32);
                for c in 0..p.d {
                    v[(head * p.n_kv + key) * p.d + c] = vt[(head * p.d + c) * self.n_pad + slot];
                }
            }
        }
        Ok([q, k, v])
    }

    /// The e4m3 scales of Q's, K's and V's tiles, `[batch, heads, tiles]` each, row-major.
    pub fn scales(&self) -> Result<[Vec<f32>; 3]> {
        let s = self.q.stream();
        let err = || KernelError::driver("copying FP8 scales to the host");
        Ok([
            s.clone_dtoh(&self.q_scale).map_err(err())?,
            s.clone_dtoh(&self.k_scale).map_err(err())?,
            s.clone_dtoh(&self.v_scale).map_err(err())?,
        ])
    }
}

/// `fp8_key_slot` of `cuda/fp8.cuh`: where key `k` of a 32-key group sits in V's transposed rows.
fn key_slot(k: usize) -> usize {
    let (half, r) = (k / 16, k % 16);
    16 * half + 4 * ((r % 8) / 2) + 2 * (r / 8) + r % 2
}

/// Mirror of `Fp8QuantizeParams` in `cuda/fa3_fp8_quantize.cu`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct QuantizeParams {
    x: u64,
    out: u64,
    scale: u64,
    signs: u64,
    norm: f32,
    heads: i32,
    n: i32,
    rows: i32,
    n_pad: i32,
    p_lift: u64,
    o_scale: u64,
}

// SAFETY: a plain #[repr(C)] struct of device addresses, integers and a float, laid out as its
// CUDA mirror (checked by a test).
unsafe impl DeviceRepr for QuantizeParams {}

fn quantize_variant(d: usize, dtype: DType, bc: usize, hadamard: bool) -> Variant {
    Variant {
        file: "fa3_fp8_quantize",
        source: QUANTIZE_SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FP8Q_D", d.to_string()),
            ("FP8Q_BC", bc.to_string()),
            ("FP8Q_HADAMARD", (hadamard as u32).to_string()),
        ],
    }
}

fn alloc<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, len: usize) -> Result<CudaSlice<T>> {
    let bytes = len.saturating_mul(size_of::<T>());
    // SAFETY: every buffer allocated here is written in full by the quantisation kernels before
    // anything reads it (rows < n of Q and K, every key slot of Vᵀ, every scale).
    unsafe { gpu.stream().alloc::<T>(len) }.map_err(KernelError::alloc(bytes))
}

/// The tiles the FP8 path takes on `gpu` at head dim `d` with `n_kv` keys (its block scales' blocks
/// too): the configuration's (`GpuConfig::tune(tiles)`) where it suits FP8 (an error where
/// it does not), otherwise [`tiles_for_problem`].
pub fn tiles_on(gpu: &Gpu, d: usize, n_kv: usize) -> Result<Fa3Tiles> {
    match gpu.config().tuned::<Fa3Tiles>() {
        Some(t) if t.bc % 32 == 0 && t.bc >= 64 && t.consumers >= 2 => Ok(t),
        Some(t) => Err(KernelError::Config(format!(
            "FA3 tiles {t:?} do not suit FP8: it needs bc a multiple of 32 (the e4m3 k-step) from \
             64 and 2 or 3 consumers"
        ))),
        None => tiles_for_problem(d, n_kv),
    }
}

/// Quantises `q, k, v` (fp16 or bf16, head dim 128 or 256) to e4m3 for the FP8 kernel: block
/// scales, incoherent processing if asked, V transposed. Hopper only.
pub fn quantize(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &Options,
    fp8: &Fp8Options,
) -> Result<Fp8Inputs> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    p.require_contiguous("fa3 fp8")?;
    require_hopper(gpu, "fa3-fp8")?;
    p.require_dtype("fa3-fp8", DTYPES, "fp16, bf16")?;
    let tiles = tiles_on(gpu, p.d, p.n_kv)?;
    let (br, bc) = (tiles.br(), tiles.bc);
    let (q_tiles, k_tiles) = (p.n_q.div_ceil(br), p.n_kv.div_ceil(bc));
    let n_pad = k_tiles * bc;
    let (heads_q, heads_kv) = (p.batch * p.heads_q, p.batch * p.heads_kv);

    let mut out = Fp8Inputs {
        problem: p,
        tiles,
        q: alloc(gpu, heads_q * p.n_q * p.d)?,
        k: alloc(gpu, heads_kv * p.n_kv * p.d)?,
        vt: alloc(gpu, heads_kv * p.d * n_pad)?,
        n_pad,
        q_scale: alloc(gpu, heads_q * q_tiles)?,
        k_scale: alloc(gpu, heads_kv * k_tiles)?,
        v_scale: alloc(gpu, heads_kv * k_tiles)?,
        p_lift: alloc(gpu, heads_kv * k_tiles)?,
        o_scale: alloc(gpu, heads_kv)?,
    };
    let signs = match fp8.incoherent {
        Some(seed) => Some(
            gpu.stream()
                .clone_htod(&hadamard_signs(p.d, seed))
                .map_err(KernelError::alloc(p.d * 4))?,
        ),
        None => None,
    };
    let rows = quantize_variant(p.d, p.dtype, bc, signs.is_some());
    let plain = quantize_variant(p.d, p.dtype, bc, false);
    let kernels = [
        Kernel { variant: rows, entry: "quantize_rows" },
        Kernel { variant: plain.clone(), entry: "quantize_v" },
        Kernel { variant: plain, entry: "v_scales" },
    ];
    for kernel in &kernels {
        gpu.prepare(kernel, 0)?;
    }
    let s = gpu.stream();
    let norm = (1.0 / (p.d as f64).sqrt()) as f32;
    let (signs_ptr, _g0) = match &signs {
        Some(signs) => {
            let (ptr, guard) = signs.device_ptr(s);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    let base = QuantizeParams { signs: signs_ptr, norm, ..QuantizeParams::default() };
    let [rows_kernel, v_kernel, scales_kernel] = &kernels;

    // Q and K: one block per tile of rows.
    for (x, dst, scale, heads, n, tile_rows) in [
        (q, &mut out.q, &mut out.q_scale, p.heads_q, p.n_q, br),
        (k, &mut out.k, &mut out.k_scale, p.heads_kv, p.n_kv, bc),
    ] {
        let (x_ptr, _g1) = x.read_ptr(s);
        let (dst_ptr, _g2) = dst.device_ptr_mut(s);
        let (scale_ptr, _g3) = scale.device_ptr_mut(s);
        let params = QuantizeParams {
            x: x_ptr,
            out: dst_ptr,
            scale: scale_ptr,
            heads: heads as i32,
            n: n as i32,
            rows: tile_rows as i32,
            ..base
        };
        let tiles = n.div_ceil(tile_rows);
        gpu.launch(rows_kernel, grid(tiles, heads, p.batch)?, 256, 0, &params)?;
    }
    // V, transposed, then the factors P and O take for V's scales.
    {
        let (x_ptr, _g1) = v.read_ptr(s);
        let (vt_ptr, _g2) = out.vt.device_ptr_mut(s);
        let (scale_ptr, _g3) = out.v_scale.device_ptr_mut(s);
        let (p_ptr, _g4) = out.p_lift.device_ptr_mut(s);
        let (o_ptr, _g5) = out.o_scale.device_ptr_mut(s);
        let params = QuantizeParams {
            x: x_ptr,
            out: vt_ptr,
            scale: scale_ptr,
            heads: p.heads_kv as i32,
            n: p.n_kv as i32,
            rows: bc as i32,
            n_pad: n_pad as i32,
            p_lift: p_ptr,
            o_scale: o_ptr,
            ..base
        };
        gpu.launch(v_kernel, grid(k_tiles, p.heads_kv, p.batch)?, 256, 0, &params)?;
        gpu.launch(scales_kernel, grid(heads_kv, 1, 1)?, 32, 0, &params)?;
    }
    Ok(out)
}

/// The FP8 attention on inputs [`quantize`] made, with the `Gpu`'s FA3 schedule: O in the
/// inputs' dtype, lse in f32 (natural log).
pub fn forward_quantized(gpu: &Gpu, inputs: &Fp8Inputs) -> Result<Output> {
    let d = inputs.problem.d;
    forward_quantized_with(gpu, inputs, Schedule::on(gpu, d, true))
}

/// [`forward_quantized`] with some of FA3's scheduling ideas switched off (the ablation).
pub fn forward_quantized_with(gpu: &Gpu, inputs: &Fp8Inputs, schedule: Schedule) -> Result<Output> {
    require_hopper(gpu, "fa3-fp8")?;
    gpu.check_stream(inputs.q.stream(), "the FP8 inputs")?;
    let (p, tiles) = (&inputs.problem, inputs.tiles);
    let s = gpu.stream();
    let (q_ptr, _g0) = inputs.q.device_ptr(s);
    let (k_ptr, _g1) = inputs.k.device_ptr(s);
    let (vt_ptr, _g2) = inputs.vt.device_ptr(s);
    let (qs, _g3) = inputs.q_scale.device_ptr(s);
    let (ks, _g4) = inputs.k_scale.device_ptr(s);
    let (ps, _g5) = inputs.p_lift.device_ptr(s);
    let (os, _g6) = inputs.o_scale.device_ptr(s);
    let e4m3 = CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
    let maps = [
        tensor_map(&MapSpec {
            name: "q (e4m3)",
            ptr: q_ptr,
            dims: [p.d, p.n_q, p.heads_q, p.batch],
            strides: dense_strides([p.d, p.n_q, p.heads_q, p.batch]),
            dtype: e4m3,
            elem: 1,
            rows: tiles.br(),
        })?,
        tensor_map(&MapSpec {
            name: "k (e4m3)",
            ptr: k_ptr,
            dims: [p.d, p.n_kv, p.heads_kv, p.batch],
            strides: dense_strides([p.d, p.n_kv, p.heads_kv, p.batch]),
            dtype: e4m3,
            elem: 1,
            rows: tiles.bc,
        })?,
        tensor_map(&MapSpec {
            name: "vᵀ (e4m3)",
            ptr: vt_ptr,
            dims: [inputs.n_pad, p.d, p.heads_kv, p.batch],
            strides: dense_strides([inputs.n_pad, p.d, p.heads_kv, p.batch]),
            dtype: e4m3,
            elem: 1,
            rows: p.d,
        })?,
    ];
    let scales = Fp8Scales { q: qs, k: ks, p: ps, o: os };
    let o = gpu.output(&p.o_shape(), p.dtype)?;
    launch(gpu, p, Launch { tiles, schedule, maps, fp8: Some(scales), lens: None }, o)
}

/// `softmax(scale · Q Kᵀ + mask) V` with e4m3 operands: [`quantize`], then
/// [`forward_quantized`]. Inputs fp16 or bf16 (O in the same), head dim 128 or 256, any
/// lengths, GQA, bottom-right causal; Hopper only.
pub fn forward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &Options,
    fp8: &Fp8Options,
) -> Result<Output> {
    let inputs = quantize(gpu, q, k, v, opts, fp8)?;
    forward_quantized(gpu, &inputs)
}

/// The FP8 variants for the compile check: each head dim, dtype and mask, with and without the
/// rotation.
#[cfg(test)]
pub(crate) fn variants(arch: &str) -> Vec<Variant> {
    let mut all = Vec::new();
    if arch != super::ARCH {
        return all;
    }
    for &dtype in DTYPES {
        for &d in HEAD_DIMS {
            let mut tiles: Vec<Fa3Tiles> = [SHORT_KEYS, SHORT_KEYS + 1]
                .iter()
                .map(|&n_kv| tiles_for_problem(d, n_kv).expect("FP8 head dim"))
                .collect();
            tiles.dedup();
            for t in tiles {
                let schedule = Schedule::for_head_dim(d, true);
                for causal in [false, true] {
                    all.push(super::variant(d, dtype, causal, (t, schedule), true, false));
                }
                for hadamard in [false, true] {
                    all.push(quantize_variant(d, dtype, t.bc, hadamard));
                }
            }
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_slots_are_a_permutation_matching_the_register_layout() {
        let mut seen = [false; 32];
        for k in 0..32 {
            seen[key_slot(k)] = true;
        }
        assert!(seen.iter().all(|&s| s));
        // Thread t of a quad holds keys 2t, 2t+1, 8+2t, 9+2t of a 16-key half in one register,
        // which the e4m3 A operand reads as reduction indices 4t … 4t+3.
        for t in 0..4 {
            let keys = [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t];
            for (j, &key) in keys.iter().enumerate() {
                assert_eq!(key_slot(key), 4 * t + j);
                assert_eq!(key_slot(16 + key), 16 + 4 * t + j);
            }
        }
    }

    #[test]
    fn quantize_params_are_laid_out_as_the_kernel_expects() {
        assert_eq!(std::mem::offset_of!(QuantizeParams, norm), 32);
        assert_eq!(std::mem::offset_of!(QuantizeParams, n_pad), 48);
        assert_eq!(std::mem::offset_of!(QuantizeParams, p_lift), 56);
        assert_eq!(std::mem::size_of::<QuantizeParams>(), 72);
    }

    #[test]
    fn fp8_tiles_cover_the_supported_head_dims() {
        for d in HEAD_DIMS {
            for n_kv in [1, SHORT_KEYS, SHORT_KEYS + 1, 1 << 20] {
                let t = tiles_for_problem(*d, n_kv).unwrap();
                assert_eq!(t.bc % 32, 0);
                assert!(t.shared_bytes(*d, 1) <= crate::fa3::MAX_SHARED_BYTES);
            }
        }
        assert_eq!(tiles_for_problem(128, SHORT_KEYS + 1).unwrap().bc, 192);
        assert_eq!(tiles_for_problem(256, SHORT_KEYS + 1).unwrap().bc, 128);
        let unsupported = tiles_for_problem(64, 1);
        assert!(matches!(unsupported, Err(KernelError::UnsupportedHeadDim { .. })));
    }

    #[test]
    fn signs_are_plus_or_minus_one_and_depend_on_the_seed() {
        let a = hadamard_signs(128, 1);
        assert_eq!(a.len(), 128);
        assert!(a.iter().all(|&s| s == 1.0 || s == -1.0));
        assert_ne!(a, hadamard_signs(128, 2));
        assert_eq!(a, hadamard_signs(128, 1));
    }
}
