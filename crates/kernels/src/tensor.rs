//! Device tensors: a typed buffer on the GPU with a shape.
//!
//! A [`Tensor`] owns a cudarc [`CudaSlice`] of `f16`, `bf16` or `f32` elements. Tensors made by
//! [`crate::Gpu`] and tensors wrapped around a caller's own buffers ([`Tensor::from_cuda_slice`])
//! are the same thing, and [`Tensor::into_cuda_slice`] hands the buffer back: no copies either way.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
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

/// A host element type with a device tensor counterpart: `half::f16`, `half::bf16`, `f32`.
///
/// Sealed: the kernels exist for these three only.
pub trait Element: cudarc::driver::DeviceRepr + Sized + private::Sealed {
    /// The tensor dtype of this element type.
    const DTYPE: DType;
    #[doc(hidden)]
    fn wrap(slice: CudaSlice<Self>) -> Storage;
    #[doc(hidden)]
    fn unwrap(storage: Storage) -> std::result::Result<CudaSlice<Self>, Storage>;
    #[doc(hidden)]
    fn borrow(storage: &Storage) -> Option<&CudaSlice<Self>>;
    /// The value widened to `f32` (exact for all three types).
    fn to_f32(self) -> f32;
    /// Append the value's little-endian bytes to `out`.
    fn append_le_bytes(self, out: &mut Vec<u8>);
}

mod private {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// The typed buffer behind a [`Tensor`].
#[doc(hidden)]
#[derive(Debug)]
pub enum Storage {
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
}

macro_rules! element {
    ($t:ty, $variant:ident, $widen:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn to_f32(self) -> f32 {
                $widen(self)
            }
            fn append_le_bytes(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn wrap(slice: CudaSlice<Self>) -> Storage {
                Storage::$variant(slice)
            }
            fn unwrap(storage: Storage) -> std::result::Result<CudaSlice<Self>, Storage> {
                match storage {
                    Storage::$variant(s) => Ok(s),
                    other => Err(other),
                }
            }
            fn borrow(storage: &Storage) -> Option<&CudaSlice<Self>> {
                match storage {
                    Storage::$variant(s) => Some(s),
                    _ => None,
                }
            }
        }
    };
}
element!(f16, F16, f16::to_f32);
element!(bf16, BF16, bf16::to_f32);
element!(f32, F32, std::convert::identity);

/// `$body` with `$s` bound to the typed slice of `$storage`, whatever its element type.
macro_rules! each_storage {
    ($storage:expr, $s:ident => $body:expr) => {
        match $storage {
            Storage::F16($s) => $body,
            Storage::BF16($s) => $body,
            Storage::F32($s) => $body,
        }
    };
}

/// Copy a device slice to the host (waits for the work queued before).
fn download<T: Element>(s: &CudaSlice<T>) -> Result<Vec<T>> {
    s.stream().clone_dtoh(s).map_err(KernelError::driver("copying a tensor to the host"))
}

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::F16(_) => DType::F16,
            Storage::BF16(_) => DType::BF16,
            Storage::F32(_) => DType::F32,
        }
    }

    fn len(&self) -> usize {
        each_storage!(self, s => s.len())
    }

    fn stream(&self) -> &Arc<CudaStream> {
        each_storage!(self, s => s.stream())
    }
}

/// A tensor in device memory, row-major (the last dimension is contiguous).
///
/// Attention inputs are `[batch, heads, seq, head_dim]`; `lse` is `[batch, heads, seq]`.
///
/// Wrapping a buffer you already have (from cudarc, or a framework built on it) costs nothing:
///
/// ```no_run
/// use half::f16;
/// use ladder_kernels::{Gpu, Tensor};
///
/// let gpu = Gpu::new()?;
/// let stream = gpu.stream().clone();
/// let buf = stream.alloc_zeros::<f16>(2 * 8 * 512 * 64).expect("alloc");
/// let q = Tensor::from_cuda_slice(buf, &[2, 8, 512, 64])?; // no copy
/// let buf = q.into_cuda_slice::<f16>()?; // and back
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
#[derive(Debug)]
pub struct Tensor {
    pub(crate) storage: Storage,
    pub(crate) shape: Vec<usize>,
}

impl Tensor {
    /// Wrap an existing device buffer (no copy). Its length must be the product of `shape`; its
    /// stream's context must be the one of the [`crate::Gpu`] it is used with (checked at launch).
    pub fn from_cuda_slice<T: Element>(slice: CudaSlice<T>, shape: &[usize]) -> Result<Tensor> {
        let len = elements(shape)?;
        if slice.len() != len {
            return Err(KernelError::Shape(format!(
                "a buffer of {} elements cannot have shape {shape:?} ({len} elements)",
                slice.len()
            )));
        }
        Ok(Tensor { storage: T::wrap(slice), shape: shape.to_vec() })
    }

    /// Hand the buffer back (no copy). Fails, returning nothing, if `T` is not the tensor's dtype.
    pub fn into_cuda_slice<T: Element>(self) -> Result<CudaSlice<T>> {
        let dtype = self.dtype();
        T::unwrap(self.storage).map_err(|_| {
            KernelError::DType(format!("the tensor is {dtype}, not {} as asked", T::DTYPE))
        })
    }

    /// The buffer, borrowed; `None` if `T` is not the tensor's dtype.
    pub fn as_cuda_slice<T: Element>(&self) -> Option<&CudaSlice<T>> {
        T::borrow(&self.storage)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.storage.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// The stream the buffer was made on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.storage.stream()
    }

    /// The device address for reading on `stream` (the guard orders the access with the buffer's
    /// other users when the context tracks events).
    pub(crate) fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        each_storage!(&self.storage, s => s.device_ptr(stream))
    }

    /// The device address for writing on `stream`.
    pub(crate) fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        each_storage!(&mut self.storage, s => s.device_ptr_mut(stream))
    }

    /// Copy to the host, widened to `f32` (waits for the work queued before).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        Ok(each_storage!(&self.storage, s => {
            download(s)?.into_iter().map(Element::to_f32).collect()
        }))
    }

    /// Copy to the host as raw little-endian bytes, for bitwise comparisons.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.bytes());
        each_storage!(&self.storage, s => {
            download(s)?.into_iter().for_each(|x| x.append_le_bytes(&mut out))
        });
        Ok(out)
    }
}

/// The number of elements of `shape`, or an error if it does not fit in `usize`.
pub(crate) fn elements(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| KernelError::Shape(format!("shape {shape:?} has too many elements")))
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
    fn rounds_like_the_device() {
        assert_eq!(round_to(&[1.0 + 1e-4], DType::F16), vec![1.0]);
        assert_eq!(round_to(&[1.0 + 1e-3], DType::BF16), vec![1.0]);
        assert_eq!(round_to(&[1.0 + 1e-4], DType::F32), vec![1.0 + 1e-4]);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::F32.to_string(), "f32");
    }
}
