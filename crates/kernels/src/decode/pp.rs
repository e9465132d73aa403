//! FlashDecoding++'s kernels (`cuda/flash_decoding_pp.cu`): their variants, parameter struct,
//! shared memory and safe window. The launch sequence is in [`super::forward`]'s implementation.

use cudarc::driver::DeviceRepr;

use super::launch::{DecodeCall, padded};
use super::{BC, MAX_BATCH_PER_LAUNCH, WARPS, dispatch::flat_rows_per_block};
use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::tensor::DType;

pub(crate) const SRC: &str = include_str!("../../cuda/flash_decoding_pp.cu");

/// The GEMM shape of a FlashDecoding++ split kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PpKernel {
    /// CUDA cores, one row per block.
    Gemv,
    /// Tensor cores, `Sᵀ = K·Qᵀ` with `n_tiles` 8-row tiles per block (1 or 2).
    Flat { n_tiles: usize },
}

impl PpKernel {
    /// The flat GEMM for `rows_per_kv_head` rows at head dimension `d`: one 8-row tile up to 8
    /// rows, else two (and more rows in more blocks of 16); always one at `d` = 256.
    pub(crate) fn flat(rows_per_kv_head: usize, d: usize) -> PpKernel {
        PpKernel::Flat { n_tiles: flat_rows_per_block(rows_per_kv_head, d) / 8 }
    }

    /// Every GEMM shape at head dimension `d` (two 8-row tiles only up to `d` = 128).
    pub(crate) fn all(d: usize) -> Vec<PpKernel> {
        let flat_tiles = flat_rows_per_block(usize::MAX, d) / 8;
        let flat = (1..=flat_tiles).map(|n_tiles| PpKernel::Flat { n_tiles });
        std::iter::once(PpKernel::Gemv).chain(flat).collect()
    }

    /// Rows one block holds.
    pub(crate) fn rows_per_block(self) -> usize {
        match self {
            PpKernel::Gemv => 1,
            PpKernel::Flat { n_tiles } => 8 * n_tiles,
        }
    }
}

/// The variant (its entry point `flash_decoding_pp_split`, whose last block per group combines) for
/// head dimension `d`, element type `dtype`, GEMM shape `kernel`, `stages` K/V stages and a
/// contiguous or paged cache.
pub(crate) fn variant(
    d: usize,
    dtype: DType,
    kernel: PpKernel,
    stages: usize,
    paged: bool,
) -> Variant {
    let (gemv, n_tiles) = match kernel {
        PpKernel::Gemv => (1, 1),
        PpKernel::Flat { n_tiles } => (0, n_tiles),
    };
    Variant {
        file: "flash_decoding_pp",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FD_D", d.to_string()),
            ("FD_BC", BC.to_string()),
            ("FD_WARPS", WARPS.to_string()),
            ("FD_STAGES", stages.to_string()),
            ("FD_PAGED", u8::from(paged).to_string()),
            ("FD_MAX_BATCH", MAX_BATCH_PER_LAUNCH.to_string()),
            ("FDPP_GEMV", gemv.to_string()),
            ("FDPP_NT", n_tiles.to_string()),
            ("FD_HOST_PARAMS_BYTES", std::mem::size_of::<PpParams>().to_string()),
        ],
        generated: Vec::new(),
    }
}

/// Every FlashDecoding++ variant, for the compile check.
#[cfg(test)]
pub(crate) fn variants() -> Vec<Variant> {
    let mut all = Vec::new();
    for &dtype in super::DTYPES {
        for &d in super::launch::compile_head_dims(dtype) {
            for kernel in PpKernel::all(d) {
                for stages in [2, 3] {
                    for paged in [false, true] {
                        all.push(variant(d, dtype, kernel, stages, paged));
                    }
                }
            }
        }
    }
    all
}

/// Dynamic shared memory of the split kernel in bytes: a 16-row Q tile and `stages` stages of K
/// and V (16-bit rows of the padded width, [`padded`]), or, if larger, the f32 merge buffer that
/// reuses the same memory (rows of that width padded by 4 floats, plus the two sums and the
/// maximum).
pub(crate) fn shared_bytes(d: usize, kernel: PpKernel, stages: usize) -> usize {
    let (_, cols) = padded(d);
    let tiles = (16 + 2 * stages * BC) * cols * 2;
    let merge = WARPS * kernel.rows_per_block() * (cols + 4 + 3) * 4;
    tiles.max(merge)
}

/// `φ` and the safe window `[lo, hi]` of `max_j s_j − φ`, checked, in the kernel's units (log2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Window {
    pub phi: f32,
    pub phi_log2: f32,
    pub lo_log2: f32,
    pub hi_log2: f32,
}

/// The default safe window of `max_j s_j − φ` for element type `dtype`: `±ln(MAX)/2`, as the CPU
/// rung (±5.55 for fp16, ±44.4 for bf16). `2^t` is rounded to `dtype` before it multiplies `V`, so
/// the window keeps the largest term of a row well inside its range.
pub fn default_safe_range(dtype: DType) -> (f32, f32) {
    let half = max_of(dtype).ln() / 2.0;
    (-half, half)
}

/// The largest finite value of `dtype`.
fn max_of(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::MAX.to_f32(),
        DType::BF16 => half::bf16::MAX.to_f32(),
        DType::F32 => f32::MAX,
    }
}

impl Window {
    /// Checks `φ` and the window for element type `dtype`: `φ` finite, `lo < hi` finite, and
    /// `hi ≤ ln(MAX)` so that the largest term `e^hi` is finite in `dtype`.
    pub(crate) fn new(phi: f32, safe_range: Option<(f32, f32)>, dtype: DType) -> Result<Window> {
        let log2e = std::f32::consts::LOG2_E;
        if !(phi.is_finite() && (phi * log2e).is_finite()) {
            return Err(KernelError::Config(format!(
                "flash_decoding_pp: phi must be finite, got {phi}"
            )));
        }
        let (lo, hi) = safe_range.unwrap_or_else(|| default_safe_range(dtype));
        let top = max_of(dtype).ln();
        if !(lo.is_finite() && hi.is_finite() && lo < hi && hi <= top) {
            return Err(KernelError::Config(format!(
                "flash_decoding_pp: the safe range needs finite lo < hi ≤ ln(MAX of {dtype}) = \
                 {top:.2}, got ({lo}, {hi})"
            )));
        }
        Ok(Window { phi, phi_log2: phi * log2e, lo_log2: lo * log2e, hi_log2: hi * log2e })
    }
}

/// Mirror of `FdppParams` in `cuda/flash_decoding_pp.cu` (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct PpParams {
    pub call: DecodeCall,
    pub acc_part: u64,
    pub l_part: u64,
    pub lr_part: u64,
    pub max_part: u64,
    pub fallback: u64,
    pub counters: u64,
    pub sums: AtomicSums,
    pub phi: f32,
    pub phi_log2: f32,
    pub lo_log2: f32,
    pub hi_log2: f32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror (whose
// size the kernels check against FD_HOST_PARAMS_BYTES).
unsafe impl DeviceRepr for PpParams {}

/// Mirror of `AtomicSums` in `cuda/flash_decoding_pp.cu`: where the splits add their partials
/// with atomics, per output row (Σ acc_s over `d` floats, then Σ l_s, Σ lr_s and the largest
/// exponent as an ordered key), all zero at rest; null pointers to sum in split order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AtomicSums {
    pub acc: u64,
    pub l: u64,
    pub lr: u64,
    pub t_max: u64,
}

impl AtomicSums {
    /// 32-bit words the sums of `rows` output rows at head dimension `d` take.
    pub(crate) fn words(rows: usize, d: usize) -> usize {
        rows * (d + 3)
    }

    /// The sums of `rows` rows at head dimension `d` laid out from `base` (16-byte aligned, so
    /// that each row of `acc` is when `d` is a multiple of 4), first row `row0`.
    pub(crate) fn at(base: u64, rows: usize, d: usize, row0: usize) -> AtomicSums {
        let f = |start: usize, per_row: usize| base + (4 * (start + row0 * per_row)) as u64;
        AtomicSums {
            acc: f(0, d),
            l: f(rows * d, 1),
            lr: f(rows * (d + 1), 1),
            t_max: f(rows * (d + 2), 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_laid_out_like_the_cuda_struct() {
        // The call (2,216 bytes), 6 pointers, the 4 of the atomic sums and 4 floats; 8-byte
        // aligned. (The kernel checks the size too: FD_HOST_PARAMS_BYTES.)
        assert_eq!(std::mem::offset_of!(PpParams, acc_part), 2216);
        assert_eq!(std::mem::offset_of!(PpParams, counters), 2256);
        assert_eq!(std::mem::offset_of!(PpParams, sums), 2264);
        assert_eq!(std::mem::offset_of!(PpParams, hi_log2), 2308);
        assert_eq!(std::mem::size_of::<PpParams>(), 2312);
    }

    #[test]
    fn shared_memory_fits_two_blocks() {
        // d = 128, three stages: the Q tile (4 KB) and 96 KB of K and V.
        assert_eq!(shared_bytes(128, PpKernel::Flat { n_tiles: 2 }, 3), (16 + 384) * 128 * 2);
        // d = 64, two stages, 16 rows: the tiles (33 KB) outweigh the merge (4·16·71·4 = 18 KB).
        assert_eq!(shared_bytes(64, PpKernel::Flat { n_tiles: 2 }, 2), (16 + 256) * 64 * 2);
        for &d in super::super::HEAD_DIMS {
            // As many blocks per SM as the paged heuristic counts (two up to d = 128, one at
            // d = 256), as for FlashDecoding's split kernel.
            let work = super::super::Workload {
                rows_per_kv_head: 1,
                max_len: 1,
                batch_heads_kv: 1,
                head_dim: d,
                paged: true,
            };
            let blocks = work.blocks_per_sm();
            for kernel in PpKernel::all(d) {
                assert!(blocks * shared_bytes(d, kernel, 2) <= 164 * 1024);
                assert!(blocks * (shared_bytes(d, kernel, 3) + 1024) <= 228 * 1024);
            }
        }
        assert_eq!(PpKernel::flat(1, 128), PpKernel::Flat { n_tiles: 1 });
        assert_eq!(PpKernel::flat(8, 128), PpKernel::Flat { n_tiles: 1 });
        assert_eq!(PpKernel::flat(9, 128), PpKernel::Flat { n_tiles: 2 });
        assert_eq!(PpKernel::flat(128, 128).rows_per_block(), 16);
        assert_eq!(PpKernel::flat(16, 256), PpKernel::Flat { n_tiles: 1 });
        assert_eq!(PpKernel::all(256).len(), 2);
    }

    #[test]
    fn the_window_is_checked() {
        // Defaults: ±ln(MAX)/2 of the element type, as the CPU rung.
        let (lo, hi) = default_safe_range(DType::F16);
        assert!((hi - 5.545).abs() < 1e-3 && lo == -hi, "{hi}");
        let (lo, hi) = default_safe_range(DType::BF16);
        assert!((hi - 44.36).abs() < 1e-2 && lo == -hi, "{hi}");
        let w = Window::new(2.0, None, DType::F16).unwrap();
        let log2e = std::f32::consts::LOG2_E;
        assert_eq!((w.phi, w.phi_log2), (2.0, 2.0 * log2e));
        assert!((w.hi_log2 - 5.545 * log2e).abs() < 1e-2);
        assert!(Window::new(0.0, Some((-20.0, 11.0)), DType::F16).is_ok());
        // φ not finite; lo ≥ hi; a bound not finite; hi past ln(MAX) (11.09 for fp16).
        for (phi, range) in [
            (f32::NAN, None),
            (f32::INFINITY, None),
            (f32::MAX, None),
            (0.0, Some((1.0, 1.0))),
            (0.0, Some((2.0, 1.0))),
            (0.0, Some((f32::NEG_INFINITY, 1.0))),
            (0.0, Some((-1.0, f32::NAN))),
            (0.0, Some((-1.0, 11.2))),
        ] {
            let r = Window::new(phi, range, DType::F16);
            assert!(matches!(r, Err(KernelError::Config(_))), "{phi} {range:?}: {r:?}");
        }
        assert!(Window::new(0.0, Some((-1.0, 80.0)), DType::BF16).is_ok());
    }
}
