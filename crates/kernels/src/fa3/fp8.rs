//! FA3's FP8 forward (Shah et al. 2024, §3.3): the same kernel with e4m3 operands, at twice the
//! tensor-core rate of fp16.
//!
//! FP8 e4m3 has a 3-bit mantissa, so how the numbers are scaled into its range decides the
//! error. Two tricks from the paper, as the CPU rung `ladder_reference::fa3` has them:
//!
//! - **Block quantisation**: one scale per tile of rows (Q per query block of the kernel, K per
//!   key tile), `amax / 448`, so an outlier coarsens only its own tile. V takes one scale per head
//!   (per sequence in a packed batch), as flash-attention's FP8 does: then every tile's `P` is
//!   lifted by the same `2⁸` before it is rounded, where V's block scales lifted it less in a tile
//!   of small V and cost 12–17 % more error on the FA3 paper's outlier inputs.
//! - **Incoherent processing** ([`Fp8Options::incoherent`]): Q and K are multiplied by the same
//!   random orthogonal map (a Hadamard matrix times random signs, `/ √d`), which leaves `Q Kᵀ`
//!   unchanged but spreads an outlier channel over all `d` channels before rounding.
//!
//! [`quantize`] runs both on the GPU (`cuda/fa3_fp8_quantize.cu`), writing V transposed: e4m3
//! wgmma reads its B operand only K-major, and for `P V` the reduction runs over the keys. The
//! attention kernel (`cuda/fa3_forward.cu` with `FA3_FP8`) folds the scales in where they cost
//! nothing — Q's and K's into the softmax scale of each tile, V's into O at the end, with `P`
//! lifted into `[0, 256]` before it is rounded (FA3's trick against underflow) — and writes O in
//! the inputs' dtype. [`forward`] is both steps; [`forward_quantized`] is the attention alone, on
//! inputs quantised once (what the benchmark times, as FP8 peers take e4m3 inputs).
//!
//! Every head dim that is a multiple of 16 up to 256 ([`HEAD_DIMS`]); inputs in any batch,
//! head and sequence strides (the quantiser reads them where they lie and writes dense e4m3
//! copies), O laid out like Q. Packed variable-length batches ([`forward_varlen`]) quantise each
//! sequence on its own, as `ladder_reference::varlen` runs the CPU rung on each: its tiles start
//! at its first row and V's scales are normalised per sequence.

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
#[cfg(test)]
use crate::problem::Masking;
use crate::problem::{Options, Output, Packed, Problem, Strides, grid, multiples};
use crate::tensor::{DType, Tensor};
use crate::varlen::{SeqLens, TileTable, VarlenParams};

pub(crate) const QUANTIZE_SRC: &str = include_str!("../../cuda/fa3_fp8_quantize.cu");

/// Head dimensions with an FP8 kernel: every multiple of 16 from 16 to 256. The copy engine
/// moves rows in 16-byte granules, so an e4m3 row must be a whole number of them; the products
/// run over the head dim rounded up to e4m3's 32-wide k-step (the padding zero-filled by the
/// copy engine, never read from memory). At head dims that are not a power of two, incoherent
/// processing rotates blocks of the largest power of two dividing `d` (32 at 96, 16 at 80:
/// `ladder_reference::fp8::RandomHadamard`).
pub const HEAD_DIMS: &[usize] = &multiples::<16>(16);

/// Options of the FP8 path (block scales are always on).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8Options {
    /// Incoherent processing: rotate Q and K by the random Hadamard map whose signs are drawn
    /// from this seed (the draw of `ladder_reference::fp8::RandomHadamard`); `None` turns it off.
    pub incoherent: Option<u64>,
}

/// The random signs of the incoherent-processing map for head dim `d` and `seed`: ChaCha8
/// seeded with `seed`, one random bool per column, as the CPU rung draws them.
pub fn hadamard_signs(d: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..d).map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 }).collect()
}

/// The FP8 kernel's tiles for head dim `d` and `n_kv` keys (the longest sequence's, for a packed
/// batch): 128 query rows (two consumer warpgroups), two stages, and K/V tiles of 128 keys, or
/// 192 up to d = 128 past [`SHORT_KEYS`] keys. Measured on the H200 (docs/perf-notes.md, FA3
/// v9), d = 128: 192 keys beat 128 by 16 % at n = 2k without the mask and by 14–15 % from 8k on
/// (5–9 % causal; a third fewer rounds of per-tile work per score, where the softmax is as long
/// as the products), and 224 by a few percent; at n = 512 128 keys win by 10 %, and at 1k by
/// 16 % under the mask (less of the last tile wasted). Below d = 128 S's registers are the same
/// and O's fewer, so the d = 128 choice carries down. Past d = 128, S's registers beside O's
/// leave no room for more than 128 (d = 256: 64 + 128 per thread). With 192 keys V's transposed
/// tile spans two 128-key column blocks, of which the second's first half is used (its second
/// half, the next tile's first keys, is loaded and not read).
pub fn tiles_for_problem(d: usize, n_kv: usize) -> Result<Fa3Tiles> {
    if !HEAD_DIMS.contains(&d) {
        return Err(KernelError::UnsupportedHeadDim { rung: "fa3-fp8", d, supported: HEAD_DIMS });
    }
    let bc = if d <= 128 && n_kv > SHORT_KEYS { 192 } else { 128 };
    Ok(Fa3Tiles { bc, consumers: 2, stages: 2 })
}

/// The longest problem (keys) that takes 128-key tiles at d = 128 ([`tiles_for_problem`]).
pub const SHORT_KEYS: usize = 1024;

/// Q, K and V in e4m3 on the GPU with their block scales: what [`quantize`] (or
/// [`quantize_varlen`]) makes and [`forward_quantized`] (or [`forward_quantized_varlen`]) reads.
/// The problem (shape, mask, softmax scale) and the tiles are fixed when the inputs are
/// quantised, since the scales' blocks are the kernel's tiles.
pub struct Fp8Inputs {
    problem: Problem,
    tiles: Fa3Tiles,
    /// The packed batch's offsets (`cu_seqlens_q`, `cu_seqlens_k`) it was quantised for.
    offsets: Option<(Vec<usize>, Vec<usize>)>,
    /// Q's axes from the outermost in memory: O is laid out the same way.
    o_order: Vec<usize>,
    /// `[batch, heads_q, n_q, d]` (packed: `[1, heads_q, total_q, d]`), rotated when incoherent
    /// processing is on.
    q: CudaSlice<u8>,
    /// `[batch, heads_kv, n_kv, d]` (packed: `[1, heads_kv, total_k, d]`), rotated likewise.
    k: CudaSlice<u8>,
    /// `[batch, heads_kv, d, n_pad]`: V transposed, each tile at its scale's slot, keys in
    /// `fp8_key_slot` order per 32.
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

    /// Q and K as e4m3 bytes, and V's bytes in natural order (the transposition and key
    /// permutation undone), `[batch, heads, n, d]` each (a packed batch: `[1, heads, total, d]`),
    /// for checking against a CPU quantisation.
    pub fn to_bytes(&self) -> Result<[Vec<u8>; 3]> {
        let s = self.q.stream();
        let err = || KernelError::driver("copying FP8 inputs to the host");
        let q = s.clone_dtoh(&self.q).map_err(err())?;
        let k = s.clone_dtoh(&self.k).map_err(err())?;
        let vt = s.clone_dtoh(&self.vt).map_err(err())?;
        let (p, bc) = (&self.problem, self.tiles.bc);
        let (batch, rows) = self.rows_per_head(p.n_kv, |pk| pk.total_k);
        let mut v = vec![0u8; batch * p.heads_kv * rows * p.d];
        for head in 0..batch * p.heads_kv {
            for (start, len, first_slot) in self.sequences(bc, true) {
                for key in 0..len {
                    let slot =
                        (first_slot + key / bc) * bc + key % bc / 32 * 32 + key_slot(key % 32);
                    for c in 0..p.d {
                        v[(head * rows + start + key) * p.d + c] =
                            vt[(head * p.d + c) * self.n_pad + slot];
                    }
                }
            }
        }
        Ok([q, k, v])
    }

    /// The e4m3 scales of Q's, K's and V's tiles, `[batch, heads, tiles]` each, row-major; for a
    /// packed batch `[heads, slots]`, sequence `b`'s tiles from slot `start_b / rows + b` on (its
    /// first row over the tile's rows, plus its index: see [`quantize_varlen`]).
    pub fn scales(&self) -> Result<[Vec<f32>; 3]> {
        let s = self.q.stream();
        let err = || KernelError::driver("copying FP8 scales to the host");
        Ok([
            s.clone_dtoh(&self.q_scale).map_err(err())?,
            s.clone_dtoh(&self.k_scale).map_err(err())?,
            s.clone_dtoh(&self.v_scale).map_err(err())?,
        ])
    }

    /// Batch entries and rows per head of the dense copies: `(batch, n)`, or `(1, total)` packed.
    fn rows_per_head(&self, n: usize, total: impl Fn(&Packed) -> usize) -> (usize, usize) {
        match &self.problem.packed {
            Some(packed) => (1, total(packed)),
            None => (self.problem.batch, n),
        }
    }

    /// Each sequence's first row, length and first scale slot, for tiles of `rows` (of keys when
    /// `keys`): one sequence of the whole length for a fixed-length batch.
    fn sequences(&self, rows: usize, keys: bool) -> Vec<(usize, usize, usize)> {
        let p = &self.problem;
        match &self.offsets {
            None => vec![(0, if keys { p.n_kv } else { p.n_q }, 0)],
            Some((cu_q, cu_k)) => {
                let cu = if keys { cu_k } else { cu_q };
                (0..cu.len() - 1).map(|b| (cu[b], cu[b + 1] - cu[b], cu[b] / rows + b)).collect()
            }
        }
    }
}

/// Columns per block of the incoherent-processing rotation at head dim `d`: the largest power of
/// two dividing it (`ladder_reference::fp8::RandomHadamard::block`).
fn hadamard_block(d: usize) -> usize {
    1 << d.trailing_zeros()
}

/// `fp8_key_slot` of `cuda/fp8.cuh`: where key `k` of a 32-key group sits in V's transposed rows.
fn key_slot(k: usize) -> usize {
    let (half, r) = (k / 16, k % 16);
    16 * half + 4 * ((r % 8) / 2) + 2 * (r / 8) + r % 2
}

/// Mirror of `Fp8QuantizeParams` in `cuda/fa3_fp8_quantize.cu` (its size checked when the kernel
/// compiles, `FP8Q_HOST_PARAMS_BYTES`).
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
    slots: i32,
    keys: i32,
    p_lift: u64,
    o_scale: u64,
    x_strides: Strides,
    varlen: VarlenParams,
}

// SAFETY: a plain #[repr(C)] struct of device addresses, integers and a float, laid out as its
// CUDA mirror (checked by a test).
unsafe impl DeviceRepr for QuantizeParams {}

fn quantize_variant(d: usize, dtype: DType, bc: usize, hadamard: bool, packed: bool) -> Variant {
    Variant {
        file: "fa3_fp8_quantize",
        source: QUANTIZE_SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FP8Q_D", d.to_string()),
            ("FP8Q_BC", bc.to_string()),
            ("FP8Q_HADAMARD", (hadamard as u32).to_string()),
            ("FP8Q_VARLEN", (packed as u32).to_string()),
            ("FP8Q_HOST_PARAMS_BYTES", size_of::<QuantizeParams>().to_string()),
        ],
        generated: Vec::new(),
    }
}

/// A device buffer of `len` elements for the quantisation kernels: zeros where `zeroed` (a
/// packed batch, which leaves the scale slots past a sequence's tiles and their columns of Vᵀ
/// unwritten, so that nothing read back is uninitialised), otherwise as it is.
fn alloc<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    len: usize,
    zeroed: bool,
) -> Result<CudaSlice<T>> {
    let bytes = len.saturating_mul(size_of::<T>());
    if zeroed {
        return gpu.stream().alloc_zeros::<T>(len).map_err(KernelError::alloc(bytes));
    }
    // SAFETY: a fixed-length batch's buffers are written in full by the quantisation kernels
    // before anything reads them (every row of Q and K, every key slot of Vᵀ, every scale).
    unsafe { gpu.stream().alloc::<T>(len) }.map_err(KernelError::alloc(bytes))
}

/// The tiles the FP8 path takes on `gpu` at head dim `d` with `n_kv` keys, `windowed` or not (its
/// block scales' blocks too): the configuration's (`GpuConfig::tune(tiles)`) where it suits FP8
/// (an error where it does not), otherwise [`tiles_for_problem`], whose 192-key tiles a sliding
/// window does not take: the band's registers make that variant spill, so a window takes the
/// 128-key tiles at every length.
pub fn tiles_on(gpu: &Gpu, d: usize, n_kv: usize, windowed: bool) -> Result<Fa3Tiles> {
    match gpu.config().tuned::<Fa3Tiles>() {
        Some(t) if t.bc % 32 == 0 && t.bc >= 64 && t.consumers >= 2 => Ok(t),
        Some(t) => Err(KernelError::Config(format!(
            "FA3 tiles {t:?} do not suit FP8: it needs bc a multiple of 32 (the e4m3 k-step) from \
             64 and 2 or 3 consumers"
        ))),
        None if windowed => tiles_for_problem(d, n_kv.min(SHORT_KEYS)),
        None => tiles_for_problem(d, n_kv),
    }
}

/// Quantises `q, k, v` (fp16 or bf16, `[batch, heads, seq, d]` in any strides with the head dim
/// contiguous, a head dim in [`HEAD_DIMS`]) to e4m3 for the FP8 kernel: block scales, incoherent
/// processing if asked, V transposed. Hopper only.
pub fn quantize(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &Options,
    fp8: &Fp8Options,
) -> Result<Fp8Inputs> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    p.require_no_mask_mod("fa3-fp8")?;
    quantize_problem(gpu, p, (q, k, v), None, fp8)
}

/// [`quantize`] for a packed variable-length batch ([`crate::varlen`]): Q `[total_q, heads_q,
/// d]`, K and V `[total_k, heads_kv, d]`, sequence `b`'s rows as `lens` gives them. Each sequence
/// is quantised on its own (the CPU rung run on it alone rounds the same numbers): its tiles start
/// at its first row, V's factors are normalised by its own largest scale, and its tiles' scales
/// take the slots from `start / rows + b` on (`start` its first row, `rows` the tile's), so the
/// kernel finds them by arithmetic: slots never overlap, since `⌊(start + len) / rows⌋ + 1 ≥
/// ⌊start / rows⌋ + ⌈len / rows⌉`.
pub fn quantize_varlen(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &SeqLens,
    opts: &Options,
    fp8: &Fp8Options,
) -> Result<Fp8Inputs> {
    let p = Problem::packed(gpu, (q, k, v), lens, opts)?;
    p.require_no_mask_mod("fa3-fp8 (packed)")?;
    quantize_problem(gpu, p, (q, k, v), Some(lens), fp8)
}

/// The quantisation kernels on the checked problem `p` (packed when `lens` is given).
fn quantize_problem(
    gpu: &Gpu,
    p: Problem,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    lens: Option<&SeqLens>,
    fp8: &Fp8Options,
) -> Result<Fp8Inputs> {
    require_hopper(gpu, "fa3-fp8")?;
    p.require_dtype("fa3-fp8", DTYPES, "fp16, bf16")?;
    p.require_no_score_mod("fa3-fp8")?;
    p.require_no_sinks("fa3-fp8")?;
    let tiles = tiles_on(gpu, p.d, p.n_kv, p.window.is_some())?;
    let (br, bc) = (tiles.br(), tiles.bc);
    // Per head: rows of the dense copies, and scale slots (a fixed-length batch's tiles).
    let (batch, q_rows, k_rows, q_slots, k_slots) = match p.packed {
        Some(packed) => (
            1,
            packed.total_q,
            packed.total_k,
            packed.total_q / br + p.batch,
            packed.total_k / bc + p.batch,
        ),
        None => (p.batch, p.n_q, p.n_kv, p.n_q.div_ceil(br), p.n_kv.div_ceil(bc)),
    };
    let n_pad = k_slots * bc;
    let (heads_q, heads_kv) = (batch * p.heads_q, batch * p.heads_kv);
    let zeroed = lens.is_some();
    let mut out = Fp8Inputs {
        problem: p.clone(),
        tiles,
        offsets: lens.map(|l| {
            let (q, k) = l.offsets();
            (q.to_vec(), k.to_vec())
        }),
        o_order: crate::gpu::memory_order(q),
        q: alloc(gpu, heads_q * q_rows * p.d, zeroed)?,
        k: alloc(gpu, heads_kv * k_rows * p.d, zeroed)?,
        vt: alloc(gpu, heads_kv * p.d * n_pad, zeroed)?,
        n_pad,
        q_scale: alloc(gpu, heads_q * q_slots, zeroed)?,
        k_scale: alloc(gpu, heads_kv * k_slots, zeroed)?,
        v_scale: alloc(gpu, heads_kv * k_slots, zeroed)?,
        p_lift: alloc(gpu, heads_kv * k_slots, zeroed)?,
        o_scale: alloc(gpu, p.batch * p.heads_kv, zeroed)?,
    };
    let signs = match fp8.incoherent {
        Some(seed) => Some(
            gpu.stream()
                .clone_htod(&hadamard_signs(p.d, seed))
                .map_err(KernelError::alloc(p.d * 4))?,
        ),
        None => None,
    };
    let packed = lens.is_some();
    let rows = quantize_variant(p.d, p.dtype, bc, signs.is_some(), packed);
    let plain = quantize_variant(p.d, p.dtype, bc, false, packed);
    let kernels = [
        Kernel { variant: rows, entry: "quantize_rows" },
        Kernel { variant: plain.clone(), entry: "v_amax" },
        Kernel { variant: plain.clone(), entry: "v_scales" },
        Kernel { variant: plain, entry: "quantize_v" },
    ];
    for kernel in &kernels {
        gpu.prepare(kernel, 0)?;
    }
    // A packed batch's blocks: its query blocks of br rows and key blocks of bc keys.
    let tables = match lens {
        Some(lens) => Some((lens, lens.tiles(gpu, br, false)?, lens.key_tiles(gpu, bc, false)?)),
        None => None,
    };
    let s = gpu.stream();
    let norm = (1.0 / (hadamard_block(p.d) as f64).sqrt()) as f32;
    let (signs_ptr, _g0) = match &signs {
        Some(signs) => {
            let (ptr, guard) = signs.device_ptr(s);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    let base = QuantizeParams { signs: signs_ptr, norm, ..QuantizeParams::default() };
    let [rows_kernel, amax_kernel, scales_kernel, v_kernel] = &kernels;
    // The grid of one quantisation launch over tiles of `rows` rows (`keys`: of K or V) and
    // `heads` heads, and its view of a packed batch.
    let launch_shape = |keys: bool, rows: usize, heads: usize| {
        let n = if keys { p.n_kv } else { p.n_q };
        let table: Option<(&SeqLens, &TileTable)> =
            tables.as_ref().map(|(lens, q, k)| (*lens, if keys { &**k } else { &**q }));
        let blocks = table.map_or(n.div_ceil(rows), |(_, t)| t.len());
        let (varlen, guards) = VarlenParams::of(gpu, table);
        (grid(blocks, heads, batch), varlen, guards)
    };
    let [qs, ks, vs] = p.strides;

    // Q and K: one block per tile of rows.
    for (x, strides, dst, scale, heads, n, tile_rows, slots, keys) in [
        (q, qs, &mut out.q, &mut out.q_scale, p.heads_q, q_rows, br, q_slots, false),
        (k, ks, &mut out.k, &mut out.k_scale, p.heads_kv, k_rows, bc, k_slots, true),
    ] {
        let (x_ptr, _g1) = x.read_ptr(s);
        let (dst_ptr, _g2) = dst.device_ptr_mut(s);
        let (scale_ptr, _g3) = scale.device_ptr_mut(s);
        let (grid, varlen, _g4) = launch_shape(keys, tile_rows, heads);
        let params = QuantizeParams {
            x: x_ptr,
            out: dst_ptr,
            scale: scale_ptr,
            heads: heads as i32,
            n: n as i32,
            rows: tile_rows as i32,
            slots: slots as i32,
            keys: keys as i32,
            x_strides: strides,
            varlen,
            ..base
        };
        gpu.launch(rows_kernel, grid?, 256, 0, &params)?;
    }
    // V: its tiles' largest magnitudes, the head's scale (and the factors P and O take), then V
    // over it, transposed.
    {
        let (x_ptr, _g1) = v.read_ptr(s);
        let (vt_ptr, _g2) = out.vt.device_ptr_mut(s);
        let (scale_ptr, _g3) = out.v_scale.device_ptr_mut(s);
        let (p_ptr, _g4) = out.p_lift.device_ptr_mut(s);
        let (o_ptr, _g5) = out.o_scale.device_ptr_mut(s);
        let (grid, varlen, _g6) = launch_shape(true, bc, p.heads_kv);
        let params = QuantizeParams {
            x: x_ptr,
            out: vt_ptr,
            scale: scale_ptr,
            heads: p.heads_kv as i32,
            n: k_rows as i32,
            rows: bc as i32,
            n_pad: n_pad as i32,
            slots: k_slots as i32,
            keys: 1,
            p_lift: p_ptr,
            o_scale: o_ptr,
            x_strides: vs,
            varlen,
            ..base
        };
        let grid = grid?;
        gpu.launch(amax_kernel, grid, 256, 0, &params)?;
        gpu.launch(scales_kernel, crate::problem::grid(p.heads_kv, p.batch, 1)?, 32, 0, &params)?;
        gpu.launch(v_kernel, grid, 256, 0, &params)?;
    }
    Ok(out)
}

/// The FP8 attention on inputs [`quantize`] made, with the `Gpu`'s FA3 schedule: O in the
/// inputs' dtype (laid out like Q), lse in f32 (natural log).
pub fn forward_quantized(gpu: &Gpu, inputs: &Fp8Inputs) -> Result<Output> {
    let d = inputs.problem.d;
    forward_quantized_with(gpu, inputs, Schedule::on(gpu, d, true))
}

/// [`forward_quantized`] with some of FA3's scheduling ideas switched off (the ablation).
pub fn forward_quantized_with(gpu: &Gpu, inputs: &Fp8Inputs, schedule: Schedule) -> Result<Output> {
    if inputs.offsets.is_some() {
        return Err(KernelError::Shape(
            "these FP8 inputs were quantised for a packed batch: run them with \
             fp8::forward_quantized_varlen"
                .into(),
        ));
    }
    attention(gpu, inputs, schedule, None)
}

/// The FP8 attention on inputs [`quantize_varlen`] made for the packed batch `lens` (the same
/// offsets, or an error): O `[total_q, heads_q, d]` laid out like Q, lse `[heads_q, total_q]`.
pub fn forward_quantized_varlen(gpu: &Gpu, inputs: &Fp8Inputs, lens: &SeqLens) -> Result<Output> {
    let (cu_q, cu_k) = lens.offsets();
    match &inputs.offsets {
        Some((q, k)) if q == cu_q && k == cu_k => {}
        Some(_) => {
            return Err(KernelError::Shape(
                "these FP8 inputs were quantised for other sequence offsets than lens's".into(),
            ));
        }
        None => {
            return Err(KernelError::Shape(
                "these FP8 inputs were quantised for a fixed-length batch: run them with \
                 fp8::forward_quantized"
                    .into(),
            ));
        }
    }
    let schedule = Schedule::on(gpu, inputs.problem.d, true);
    attention(gpu, inputs, schedule, Some(lens))
}

/// The attention kernel on quantised inputs (packed when `lens` is given, already checked).
fn attention(
    gpu: &Gpu,
    inputs: &Fp8Inputs,
    schedule: Schedule,
    lens: Option<&SeqLens>,
) -> Result<Output> {
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
    let (batch, q_rows) = inputs.rows_per_head(p.n_q, |pk| pk.total_q);
    let (_, k_rows) = inputs.rows_per_head(p.n_kv, |pk| pk.total_k);
    let map = |name, ptr, dims: [usize; 4], rows| {
        tensor_map(&MapSpec {
            name,
            ptr,
            dims,
            strides: dense_strides(dims),
            dtype: e4m3,
            elem: 1,
            rows,
        })
    };
    let maps = [
        map("q (e4m3)", q_ptr, [p.d, q_rows, p.heads_q, batch], tiles.br())?,
        map("k (e4m3)", k_ptr, [p.d, k_rows, p.heads_kv, batch], tiles.bc)?,
        map("vᵀ (e4m3)", vt_ptr, [inputs.n_pad, p.d, p.heads_kv, batch], p.d)?,
    ];
    let scales = Fp8Scales { q: qs, k: ks, p: ps, o: os };
    let o_shape = match p.packed {
        Some(packed) => vec![packed.total_q, p.heads_q, p.d],
        None => p.o_shape().to_vec(),
    };
    let o = gpu.output_in_order(&o_shape, &inputs.o_order, p.dtype)?;
    launch(gpu, p, Launch { tiles, schedule, maps, fp8: Some(scales), lens }, o)
}

/// `softmax(scale · Q Kᵀ + mask) V` with e4m3 operands: [`quantize`], then
/// [`forward_quantized`]. Inputs fp16 or bf16 (O in the same, laid out like Q), any strides with
/// the head dim contiguous, a head dim in [`HEAD_DIMS`], any lengths, GQA, bottom-right causal;
/// Hopper only.
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

/// [`forward`] on a packed variable-length batch ([`crate::varlen`]): [`quantize_varlen`], then
/// [`forward_quantized_varlen`]. Each sequence gets what the FP8 path gives it alone.
pub fn forward_varlen(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &SeqLens,
    opts: &Options,
    fp8: &Fp8Options,
) -> Result<Output> {
    let inputs = quantize_varlen(gpu, q, k, v, lens, opts, fp8)?;
    forward_quantized_varlen(gpu, &inputs, lens)
}

/// The FP8 variants for the compile check: the measured head dims (128, 256) in each dtype, mask
/// and tile choice, with and without the rotation; head dims off the 128-element rows (16, 80, 96,
/// 144, 192, 240: every rotation block from 16 to 64, both tile choices where there are two);
/// packed batches at 96 and 128.
#[cfg(test)]
pub(crate) fn variants(arch: &str) -> Vec<Variant> {
    let mut all = Vec::new();
    if arch != super::ARCH {
        return all;
    }
    let plain = |causal| Masking { causal, windowed: false };
    let mut push = |d: usize, dtype: DType, masks: &[Masking], packed: bool| {
        let mut tiles: Vec<Fa3Tiles> = [SHORT_KEYS, SHORT_KEYS + 1]
            .iter()
            .map(|&n_kv| tiles_for_problem(d, n_kv).expect("FP8 head dim"))
            .collect();
        tiles.dedup();
        for t in tiles {
            let schedule = Schedule::for_head_dim(d, true);
            for &mask in masks {
                all.push(super::variant(d, dtype, mask, (t, schedule), true, packed));
            }
            for hadamard in [false, true] {
                all.push(quantize_variant(d, dtype, t.bc, hadamard, packed));
            }
        }
    };
    for &dtype in DTYPES {
        for d in [128, 256] {
            push(d, dtype, &[plain(false), plain(true)], false);
        }
    }
    for (d, dtype, causal) in [
        (16, DType::F16, true),
        (80, DType::F16, false),
        (96, DType::BF16, true),
        (144, DType::F16, true),
        (192, DType::BF16, false),
        (240, DType::F16, true),
    ] {
        push(d, dtype, &[plain(causal)], false);
    }
    push(96, DType::F16, &[plain(true)], true);
    push(128, DType::BF16, &[plain(false), plain(true)], true);
    // Sliding windows (128-key tiles only, `tiles_on`), fixed-length and packed.
    let t = tiles_for_problem(128, SHORT_KEYS).expect("FP8 head dim");
    for (causal, packed) in [(false, false), (true, false), (true, true)] {
        let mask = Masking { causal, windowed: true };
        all.push(super::variant(
            128,
            DType::F16,
            mask,
            (t, Schedule::for_head_dim(128, true)),
            true,
            packed,
        ));
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
        // The whole size is checked against the kernel's when it compiles; the offsets here.
        assert_eq!(std::mem::offset_of!(QuantizeParams, norm), 32);
        assert_eq!(std::mem::offset_of!(QuantizeParams, n_pad), 48);
        assert_eq!(std::mem::offset_of!(QuantizeParams, keys), 56);
        assert_eq!(std::mem::offset_of!(QuantizeParams, p_lift), 64);
        assert_eq!(std::mem::offset_of!(QuantizeParams, x_strides), 80);
        assert_eq!(std::mem::offset_of!(QuantizeParams, varlen), 104);
    }

    #[test]
    fn fp8_tiles_cover_the_supported_head_dims() {
        assert_eq!(HEAD_DIMS.len(), 16);
        assert_eq!((HEAD_DIMS[0], HEAD_DIMS[15]), (16, 256));
        for &d in HEAD_DIMS {
            assert_eq!(d % 16, 0);
            for n_kv in [1, SHORT_KEYS, SHORT_KEYS + 1, 1 << 20] {
                let t = tiles_for_problem(d, n_kv).unwrap();
                assert_eq!(t.bc % 32, 0);
                assert!(t.shared_bytes(d, 1) <= crate::fa3::MAX_SHARED_BYTES);
            }
        }
        assert_eq!(tiles_for_problem(128, SHORT_KEYS + 1).unwrap().bc, 192);
        assert_eq!(tiles_for_problem(80, SHORT_KEYS + 1).unwrap().bc, 192);
        assert_eq!(tiles_for_problem(144, SHORT_KEYS + 1).unwrap().bc, 128);
        assert_eq!(tiles_for_problem(256, SHORT_KEYS + 1).unwrap().bc, 128);
        for d in [8, 40, 72, 264] {
            let unsupported = tiles_for_problem(d, 1);
            assert!(matches!(unsupported, Err(KernelError::UnsupportedHeadDim { .. })), "{d}");
        }
    }

    #[test]
    fn the_rotation_blocks_are_the_largest_power_of_two_dividing_d() {
        let blocks: Vec<usize> = [16, 80, 96, 128, 144, 192, 240, 256].map(hadamard_block).to_vec();
        assert_eq!(blocks, [16, 16, 32, 128, 16, 64, 16, 256]);
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
