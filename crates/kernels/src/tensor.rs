//! Device tensors: a buffer on the GPU with a shape and an element type.

use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use std::sync::Arc;

use crate::error::{KernelError, Result};

/// Element type of a device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
        }
    }

    /// The value kernels receive as `LADDER_DTYPE`.
    pub(crate) fn code(self) -> u32 {
        match self {
            DType::F16 => 0,
            DType::BF16 => 1,
            DType::F32 => 2,
        }
    }

    /// Short name: `fp16`, `bf16`, `f32`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "fp16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor in device memory, row-major (the last dimension is contiguous).
///
/// Attention inputs are `[batch, heads, seq, head_dim]`; `lse` is `[batch, heads, seq]`.
#[derive(Debug)]
pub struct Tensor {
    pub(crate) data: CudaSlice<u8>,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
}

impl Tensor {
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype.size()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.data.stream()
    }

    /// Copy to the host, widened to `f32` (waits for the work queued before).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let bytes = self
            .stream()
            .clone_dtoh(&self.data)
            .map_err(KernelError::driver("copying a tensor to the host"))?;
        Ok(match self.dtype {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => {
                bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
            DType::BF16 => {
                bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
        })
    }
}

/// Encode host `f32` values as the bytes of `dtype` (rounding to nearest even).
pub(crate) fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
    }
}

/// Round host values to `dtype` and back: what the device will see after an upload.
pub fn round_to(values: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => values.to_vec(),
        DType::F16 => values.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
        DType::BF16 => values.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_little_endian_elements() {
        assert_eq!(encode(&[1.0], DType::F16), vec![0x00, 0x3c]);
        assert_eq!(encode(&[1.0], DType::BF16), vec![0x80, 0x3f]);
        assert_eq!(encode(&[1.0], DType::F32), 1.0f32.to_le_bytes().to_vec());
        assert_eq!(round_to(&[1.0 + 1e-4], DType::F16), vec![1.0]);
    }
}
