//! FP8 (e4m3) arithmetic for the FA3 rung: block quantisation and incoherent processing.
//!
//! e4m3 has 3 mantissa bits (relative rounding error up to 2⁻⁴) and a largest finite value of
//! 448. FlashAttention-3 (Shah et al. 2024, §3.3) feeds `Q, K, V` to the tensor cores in e4m3
//! with two tricks that keep the error down:
//!
//! - **Block quantisation**: one scale per tile (`amax / 448`) instead of one per tensor, so a
//!   large value only coarsens its own tile. Tensor-core products of e4m3 numbers are exact in
//!   `f32`; the scales are multiplied back afterwards.
//! - **Incoherent processing**: multiply `Q` and `K` by the same random orthogonal matrix
//!   `M = H · diag(±1) / √n` (a Hadamard matrix with random signs). `(QM)(KM)ᵀ = QKᵀ`, so the
//!   scores do not change, but an outlier in one channel is spread over all `n` channels and
//!   quantises with far less error. With a Hadamard matrix, `xM` costs `O(n log n)`. Hadamard
//!   matrices of every order do not exist, so at a head dim that is not a power of two `H` is
//!   block-diagonal ([`RandomHadamard`]: blocks of 32 at `d = 96`, 16 at `d = 80`).
//!
//! Conversion rounds to nearest even and saturates at ±448 (the CUDA `__NV_SATFINITE` mode),
//! through the [`float8`] crate.

use float8::F8E4M3;
use ndarray::{Array3, Array4, ArrayView4, Axis, Zip, s};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::element::Element;
use crate::tile::nan_max;

/// The largest finite e4m3 value.
pub const E4M3_MAX: f64 = 448.0;

/// Rounds `x` to the nearest e4m3 value (saturating at ±448, NaN stays NaN).
pub fn round_e4m3<T: Element>(x: T) -> T {
    T::of(F8E4M3::from_f64(x.as_f64()).to_f64())
}

/// How FP8 scales are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Scaling {
    /// One scale per tile of rows (FA3's block quantisation).
    #[default]
    PerBlock,
    /// One scale per tensor (the FA3 paper's baseline FP8 attention).
    PerTensor,
}

/// Options of the FP8 path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Options {
    pub scaling: Fp8Scaling,
    /// Incoherent processing with random signs drawn from this seed; `None` turns it off.
    pub incoherent: Option<u64>,
}

/// A tensor stored as e4m3 values with one scale per block of rows of each `(batch, head)`.
/// `values` hold the e4m3 numbers exactly (as `T`); the real tensor is `values × scale`.
#[derive(Debug, Clone)]
pub struct Fp8Tensor<T> {
    pub values: Array4<T>,
    /// Shape `[batch, heads, ⌈n / block_rows⌉]`.
    pub scales: Array3<T>,
    pub block_rows: usize,
}

impl<T: Element> Fp8Tensor<T> {
    /// Quantises `x` (shape `[batch, heads, n, d]`) in blocks of `block_rows` rows.
    pub fn quantize(x: ArrayView4<T>, block_rows: usize, scaling: Fp8Scaling) -> Self {
        let (b, h, n, _) = x.dim();
        let block_rows = block_rows.max(1);
        // NaN-propagating, so a NaN poisons its block instead of vanishing from the scale.
        let amax = |t: ArrayView4<T>| t.iter().fold(T::zero(), |m, &v| nan_max(m, v.abs()));
        let tensor_amax = amax(x.view());
        let mut scales = Array3::zeros((b, h, n.div_ceil(block_rows)));
        for ((bi, hi, blk), scale) in scales.indexed_iter_mut() {
            let a = match scaling {
                Fp8Scaling::PerBlock => {
                    let rows = blk * block_rows..((blk + 1) * block_rows).min(n);
                    amax(x.slice(s![bi..=bi, hi..=hi, rows, ..]))
                }
                Fp8Scaling::PerTensor => tensor_amax,
            };
            *scale = if a == T::zero() { T::one() } else { a / T::of(E4M3_MAX) };
        }
        let mut values = x.to_owned();
        Zip::indexed(values.lanes_mut(Axis(3))).for_each(|(bi, hi, row), mut lane| {
            let scale = scales[[bi, hi, row / block_rows]];
            lane.mapv_inplace(|v| round_e4m3(v / scale));
        });
        Self { values, scales, block_rows }
    }

    /// The scale of the block holding `row` of head `(b, h)`.
    pub fn scale(&self, b: usize, h: usize, row: usize) -> T {
        self.scales[[b, h, row / self.block_rows]]
    }

    /// The real tensor the quantised one stands for.
    pub fn dequantize(&self) -> Array4<T> {
        let mut out = self.values.clone();
        Zip::indexed(out.lanes_mut(Axis(3))).for_each(|(bi, hi, row), mut lane| {
            let scale = self.scale(bi, hi, row);
            lane.mapv_inplace(|v| v * scale);
        });
        out
    }
}

/// The random orthogonal map of incoherent processing: `x ↦ H (s ∘ x) / √b` on each row, with
/// `s` random signs and `H` block-diagonal, one `b × b` Sylvester–Hadamard matrix per `b`
/// consecutive columns, `b` the largest power of two that divides the head dim `d`: the whole
/// row when `d` is a power of two (128, 256), three blocks of 32 at `d = 96`, five of 16 at
/// `d = 80`. The rows keep their width, so the kernels' tiles do not change, and an outlier
/// channel is spread over the `b` channels of its block (a head dim of `2^k · odd` spreads over
/// `2^k`; an odd one only has its signs flipped).
#[derive(Debug, Clone, PartialEq)]
pub struct RandomHadamard {
    signs: Vec<f64>,
}

impl RandomHadamard {
    /// Draws the signs for head dim `d` from `seed`: ChaCha8, one random bool per column.
    pub fn new(d: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Self { signs: (0..d).map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 }).collect() }
    }

    /// The random signs (±1), one per column.
    pub fn signs(&self) -> &[f64] {
        &self.signs
    }

    /// Columns per Hadamard block: the largest power of two dividing the head dim.
    pub fn block(&self) -> usize {
        hadamard_block(self.signs.len())
    }

    /// Applies the map to every row (last axis) of `x`, whose rows have the head dim's width.
    pub fn apply<T: Element>(&self, x: ArrayView4<T>) -> Array4<T> {
        let block = self.block();
        let norm = T::of(1.0 / (block as f64).sqrt());
        let mut out = x.to_owned();
        Zip::from(out.lanes_mut(Axis(3))).for_each(|mut row| {
            let row = row.as_slice_mut().expect("rows of a fresh array are contiguous");
            for (v, &s) in row.iter_mut().zip(&self.signs) {
                *v = *v * T::of(s);
            }
            row.chunks_mut(block).for_each(walsh_hadamard);
            row.iter_mut().for_each(|v| *v = *v * norm);
        });
        out
    }
}

/// The largest power of two dividing `d` (1 for an odd `d`, and for 0): the block of
/// [`RandomHadamard`] at head dim `d`.
pub fn hadamard_block(d: usize) -> usize {
    if d == 0 { 1 } else { 1 << d.trailing_zeros() }
}

/// In-place fast Walsh–Hadamard transform (unnormalised); `x.len()` is a power of two.
fn walsh_hadamard<T: Element>(x: &mut [T]) {
    let mut h = 1;
    while h < x.len() {
        for start in (0..x.len()).step_by(2 * h) {
            for i in start..start + h {
                let (a, b) = (x[i], x[i + h]);
                (x[i], x[i + h]) = (a + b, a - b);
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array4, ArrayView2};

    #[test]
    fn e4m3_rounds_to_nearest_and_saturates() {
        assert_eq!(round_e4m3(448.0f32), 448.0);
        assert_eq!(round_e4m3(1000.0f32), 448.0);
        assert_eq!(round_e4m3(-1000.0f64), -448.0);
        // Between 1 and 2 the spacing is 1/8: 1.06 rounds down, 1.07 up.
        assert_eq!(round_e4m3(1.06f32), 1.0);
        assert_eq!(round_e4m3(1.07f32), 1.125);
        // Smallest subnormal is 2⁻⁹.
        assert_eq!(round_e4m3(2f64.powi(-9)), 2f64.powi(-9));
        assert_eq!(round_e4m3(2f64.powi(-11)), 0.0);
        assert!(round_e4m3(f32::NAN).is_nan());
    }

    #[test]
    fn block_scales_bound_the_relative_error() {
        let x = Array4::from_shape_fn((1, 1, 6, 3), |(_, _, i, c)| {
            (i as f64 + 1.0) * 10f64.powi(c as i32 - 1)
        });
        for scaling in [Fp8Scaling::PerBlock, Fp8Scaling::PerTensor] {
            let q = Fp8Tensor::quantize(x.view(), 4, scaling);
            assert_eq!(q.scales.dim(), (1, 1, 2));
            let back = q.dequantize();
            for (a, b) in x.iter().zip(back.iter()) {
                assert!((a - b).abs() <= a.abs() / 16.0 + 1e-9, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn random_hadamard_is_orthogonal() {
        for (d, block) in [(5, 1), (12, 4), (16, 16), (96, 32)] {
            let x = Array4::from_shape_fn((1, 1, 3, d), |(_, _, i, c)| {
                ((i + 1) * (c + 3)) as f64 * 0.37 - 1.0
            });
            let t = RandomHadamard::new(d, 7);
            assert_eq!((t.signs().len(), t.block()), (d, block));
            let y = t.apply(x.view());
            assert_eq!(y.dim(), x.dim());
            let dot = |a: ArrayView2<f64>, i: usize, j: usize| a.row(i).dot(&a.row(j));
            let (xs, ys) = (x.slice(s![0, 0, .., ..]), y.slice(s![0, 0, .., ..]));
            for (i, j) in [(0, 0), (0, 1), (1, 2), (2, 2)] {
                assert!((dot(xs, i, j) - dot(ys, i, j)).abs() < 1e-9, "d = {d}");
            }
        }
    }

    #[test]
    fn random_hadamard_spreads_a_channel_over_its_block() {
        // One outlier in column 40 of d = 96 (blocks of 32): the map spreads it over columns
        // 32 … 63, each |x| / √32, and leaves the other blocks alone.
        let mut x = Array4::<f64>::zeros((1, 1, 1, 96));
        x[[0, 0, 0, 40]] = 32.0;
        let y = RandomHadamard::new(96, 3).apply(x.view());
        for c in 0..96 {
            let want = if (32..64).contains(&c) { 32.0 / 32f64.sqrt() } else { 0.0 };
            assert!((y[[0, 0, 0, c]].abs() - want).abs() < 1e-12, "column {c}");
        }
    }
}
