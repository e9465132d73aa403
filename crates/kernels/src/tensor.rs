//! Device tensors: a typed buffer on the GPU with a shape and strides.
//!
//! A [`Tensor`] owns a cudarc [`CudaSlice`] of `f16`, `bf16` or `f32` elements. Tensors made by
//! [`crate::Gpu`] and tensors wrapped around a caller's own buffers ([`Tensor::from_cuda_slice`])
//! are the same thing, and [`Tensor::into_cuda_slice`] hands the buffer back: no copies either way.
//!
//! A tensor's strides say where each element lies in its buffer, so one buffer can be seen in
//! another order without a copy: a projection's `[batch, seq, heads, d]` output is the
//! `[batch, heads, seq, d]` tensor the attention rungs take after [`Tensor::transpose`]`(1, 2)`,
//! and [`Tensor::from_cuda_slice_strided`] takes any strides that keep every element inside the
//! buffer and at an address of its own (rows with gaps between them, one of three slots of a
//! packed QKV projection).
//!
//! A framework that owns its buffers and lends them for one call (candle's `CustomOp`s get
//! `&CudaSlice`s) wraps them with [`Tensor::from_borrowed_cuda_slice_strided`]: the tensor reads
//! the buffer and never frees it.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::{bf16, f16};
use std::mem::ManuallyDrop;
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

/// A tensor's buffer: owned (freed with the last tensor that shares it) or borrowed from a caller
/// who frees it (never freed here, never written).
#[derive(Debug)]
pub(crate) struct Buffer {
    storage: ManuallyDrop<Storage>,
    borrowed: bool,
}

impl Buffer {
    fn owned(storage: Storage) -> Buffer {
        Buffer { storage: ManuallyDrop::new(storage), borrowed: false }
    }

    /// The storage, if the buffer is owned (a borrowed one is handed back as it was).
    fn into_owned(self) -> std::result::Result<Storage, Buffer> {
        if self.borrowed {
            return Err(self);
        }
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the storage is taken exactly once.
        Ok(unsafe { ManuallyDrop::take(&mut this.storage) })
    }

    /// The storage for writing: `None` for a borrowed buffer.
    fn writable(&mut self) -> Option<&mut Storage> {
        (!self.borrowed).then_some(&mut *self.storage)
    }
}

impl std::ops::Deref for Buffer {
    type Target = Storage;
    fn deref(&self) -> &Storage {
        &self.storage
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: drop runs once; the storage is not used after this.
        let storage = unsafe { ManuallyDrop::take(&mut self.storage) };
        if self.borrowed {
            // The lender frees its buffer: forget ours, after the work queued on it.
            each_storage!(storage, s => {
                s.leak();
            });
        }
    }
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
    /// The buffer, shared by the views made from one tensor ([`Tensor::select`], [`Tensor::view`]).
    pub(crate) storage: Arc<Buffer>,
    /// Elements of the buffer before the tensor's first one (0 unless a view starts later).
    pub(crate) offset: usize,
    pub(crate) shape: Vec<usize>,
    /// Elements between neighbours along each axis (row-major: `[.., shape[n-1], 1]`).
    pub(crate) strides: Vec<usize>,
}

impl Tensor {
    /// Wrap an existing device buffer (no copy), row-major. Its length must be the product of
    /// `shape`; its stream's context must be the one of the [`crate::Gpu`] it is used with
    /// (checked at launch).
    pub fn from_cuda_slice<T: Element>(slice: CudaSlice<T>, shape: &[usize]) -> Result<Tensor> {
        let len = elements(shape)?;
        if slice.len() != len {
            return Err(KernelError::Shape(format!(
                "a buffer of {} elements cannot have shape {shape:?} ({len} elements)",
                slice.len()
            )));
        }
        Ok(Tensor::whole(T::wrap(slice), shape.to_vec(), row_major(shape)))
    }

    /// A tensor that owns all of `storage`, from its first element.
    pub(crate) fn whole(storage: Storage, shape: Vec<usize>, strides: Vec<usize>) -> Tensor {
        Tensor { storage: Arc::new(Buffer::owned(storage)), offset: 0, shape, strides }
    }

    /// Borrow a buffer someone else owns (no copy), read-only, with `shape` and `strides` as
    /// [`Tensor::from_cuda_slice_strided`] takes and checks them: the rungs read it, nothing
    /// writes it ([`Tensor::into_cuda_slice`], [`crate::Gpu::fill_bytes`] and the outputs of
    /// `decode::forward_into` refuse it), and dropping the tensor leaves it alone.
    ///
    /// # Safety
    /// `slice` must stay allocated, and unwritten, for as long as the tensor or any view of it
    /// lives and any work the rungs queued on it runs: drop them before the lender frees or
    /// writes its buffer, or after work queued later on the same stream.
    pub unsafe fn from_borrowed_cuda_slice_strided<T: Element>(
        slice: &CudaSlice<T>,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Tensor> {
        check_strides(shape, strides, slice.len())?;
        let (ptr, _guard) = slice.device_ptr(slice.stream());
        // SAFETY: the same allocation, `slice.len()` elements; our copy is leaked, never freed
        // (`Buffer::drop`), and the caller keeps the original alive (this function's contract).
        let alias = unsafe { slice.stream().upgrade_device_ptr::<T>(ptr, slice.len()) };
        let storage = ManuallyDrop::new(T::wrap(alias));
        Ok(Tensor {
            storage: Arc::new(Buffer { storage, borrowed: true }),
            offset: 0,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        })
    }

    /// Whether the buffer is borrowed ([`Tensor::from_borrowed_cuda_slice_strided`]).
    pub fn is_borrowed(&self) -> bool {
        self.storage.borrowed
    }

    /// Wrap an existing device buffer (no copy) whose element `[i0, i1, ..]` lies at
    /// `i0·strides[0] + i1·strides[1] + ..` (in elements). Every element must lie inside the
    /// buffer, and no two at the same address (a tensor the kernels write must not alias itself).
    ///
    /// ```no_run
    /// # use ladder_kernels::{Gpu, Tensor};
    /// # let gpu = Gpu::new()?;
    /// // Q of a packed QKV projection [batch, seq, 3, heads, d]: slot 0 of each token, as
    /// // [batch, heads, seq, d].
    /// let (b, s, h, d) = (2, 512, 8, 64);
    /// let qkv = gpu.stream().alloc_zeros::<half::f16>(b * s * 3 * h * d).expect("alloc");
    /// let q = Tensor::from_cuda_slice_strided(qkv, &[b, h, s, d], &[s * 3 * h * d, d, 3 * h * d, 1])?;
    /// # Ok::<(), ladder_kernels::KernelError>(())
    /// ```
    pub fn from_cuda_slice_strided<T: Element>(
        slice: CudaSlice<T>,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Tensor> {
        check_strides(shape, strides, slice.len())?;
        Ok(Tensor::whole(T::wrap(slice), shape.to_vec(), strides.to_vec()))
    }

    /// The same buffer seen with another shape and strides (no copy), checked as
    /// [`Tensor::from_cuda_slice_strided`] checks them.
    pub fn as_strided(mut self, shape: &[usize], strides: &[usize]) -> Result<Tensor> {
        check_strides(shape, strides, self.buffer_len() - self.offset)?;
        self.shape = shape.to_vec();
        self.strides = strides.to_vec();
        Ok(self)
    }

    /// Another tensor over the same buffer (no copy): its first element `offset` elements into
    /// the buffer, then `shape` and `strides` as [`Tensor::from_cuda_slice_strided`] takes and
    /// checks them. Views share the buffer, so several can be handed to one call, e.g. Q, K and V
    /// of one packed projection ([`Tensor::select`] makes those). The rungs only read their
    /// inputs; a shared buffer cannot be written through ([`Gpu::fill_bytes`](crate::Gpu::fill_bytes)
    /// and `decode::forward_into`'s outputs refuse it), and [`Tensor::into_cuda_slice`] hands it
    /// back once the other views are gone.
    pub fn view(&self, offset: usize, shape: &[usize], strides: &[usize]) -> Result<Tensor> {
        let len = self.buffer_len();
        if offset > len {
            return Err(KernelError::Shape(format!(
                "a view at offset {offset} of a buffer of {len} elements"
            )));
        }
        check_strides(shape, strides, len - offset)?;
        Ok(Tensor {
            storage: self.storage.clone(),
            offset,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        })
    }

    /// The view of index `index` along `axis`, that axis removed (no copy): slot 0, 1, 2 of a
    /// packed `[batch, seq, 3, heads, d]` QKV projection are Q, K and V as `[batch, seq, heads,
    /// d]`, each then `transpose(1, 2)` for the rungs.
    ///
    /// ```no_run
    /// # use ladder_kernels::{Gpu, Options, Tensor, fa2};
    /// # let gpu = Gpu::new()?;
    /// let (b, s, h, d) = (2, 512, 8, 64);
    /// let buf = gpu.stream().alloc_zeros::<half::f16>(b * s * 3 * h * d).expect("alloc");
    /// let qkv = Tensor::from_cuda_slice(buf, &[b, s, 3, h, d])?;
    /// let [q, k, v] = [0, 1, 2].map(|i| qkv.select(2, i).and_then(|t| t.transpose(1, 2)));
    /// let out = fa2::forward(&gpu, &q?, &k?, &v?, &Options::causal())?;
    /// # Ok::<(), ladder_kernels::KernelError>(())
    /// ```
    pub fn select(&self, axis: usize, index: usize) -> Result<Tensor> {
        let rank = self.shape.len();
        if axis >= rank || index >= self.shape[axis] {
            return Err(KernelError::Shape(format!(
                "select({axis}, {index}) of a tensor of shape {:?}",
                self.shape
            )));
        }
        let (mut shape, mut strides) = (self.shape.clone(), self.strides.clone());
        shape.remove(axis);
        let step = strides.remove(axis);
        self.view(self.offset + index * step, &shape, &strides)
    }

    /// The view of `len` indices from `start` along `axis` (no copy): the query, key and value
    /// heads of a fused `[batch, seq, heads_q + 2·heads_kv, d]` projection are
    /// `narrow(2, 0, heads_q)`, `narrow(2, heads_q, heads_kv)`, `narrow(2, heads_q + heads_kv,
    /// heads_kv)`.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        let rank = self.shape.len();
        if axis >= rank || start.checked_add(len).is_none_or(|end| end > self.shape[axis]) {
            return Err(KernelError::Shape(format!(
                "narrow({axis}, {start}, {len}) of a tensor of shape {:?}",
                self.shape
            )));
        }
        let mut shape = self.shape.clone();
        shape[axis] = len;
        self.view(self.offset + start * self.strides[axis], &shape, &self.strides)
    }

    /// The same buffer with axes `a` and `b` swapped (no copy): a `[batch, seq, heads, d]`
    /// tensor's `transpose(1, 2)` is the `[batch, heads, seq, d]` one the attention rungs take.
    pub fn transpose(mut self, a: usize, b: usize) -> Result<Tensor> {
        let rank = self.shape.len();
        if a >= rank || b >= rank {
            return Err(KernelError::Shape(format!(
                "transpose({a}, {b}) of a tensor of rank {rank}"
            )));
        }
        self.shape.swap(a, b);
        self.strides.swap(a, b);
        Ok(self)
    }

    /// Elements between neighbours along each axis.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Whether the elements are in row-major order with no gaps (what [`Tensor::from_cuda_slice`]
    /// makes). Axes of length 1 may have any stride.
    pub fn is_contiguous(&self) -> bool {
        let dense = row_major(&self.shape);
        self.shape.iter().zip(&self.strides).zip(&dense).all(|((&n, &s), &r)| n == 1 || s == r)
            && self.storage.len() == self.len()
            && self.offset == 0
    }

    /// Hand the whole buffer back (no copy). Fails, returning nothing, if `T` is not the
    /// tensor's dtype, other views still share the buffer, or it is borrowed.
    pub fn into_cuda_slice<T: Element>(self) -> Result<CudaSlice<T>> {
        let dtype = self.dtype();
        let buffer = Arc::try_unwrap(self.storage).map_err(|_| {
            KernelError::Shape("the buffer is shared with other views of it".to_string())
        })?;
        let storage = buffer.into_owned().map_err(|_| {
            KernelError::Shape("the buffer is borrowed: its owner keeps it".to_string())
        })?;
        T::unwrap(storage).map_err(|_| {
            KernelError::DType(format!("the tensor is {dtype}, not {} as asked", T::DTYPE))
        })
    }

    /// The whole buffer, borrowed (a view's elements start [`Tensor::offset`] into it); `None`
    /// if `T` is not the tensor's dtype.
    pub fn as_cuda_slice<T: Element>(&self) -> Option<&CudaSlice<T>> {
        T::borrow(&self.storage)
    }

    /// Elements of the buffer before the tensor's first one (0 but for a view).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Number of elements (of the shape; the buffer may hold more, see
    /// [`Tensor::from_cuda_slice_strided`]).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Number of elements of the buffer behind the tensor.
    pub(crate) fn buffer_len(&self) -> usize {
        self.storage.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes of the tensor's elements.
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
        let (base, guard) = each_storage!(&**self.storage, s => s.device_ptr(stream));
        (base + (self.offset * self.dtype().size()) as u64, guard)
    }

    /// The device address for writing on `stream`; fails for a buffer other views share (the
    /// kernels' outputs are never views, see [`Tensor::view`]).
    pub(crate) fn write_ptr<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> Result<(u64, SyncOnDrop<'a>)> {
        let bytes = (self.offset * self.dtype().size()) as u64;
        let buffer = Arc::get_mut(&mut self.storage).ok_or_else(|| {
            KernelError::Shape(
                "cannot write into a tensor whose buffer other views share".to_string(),
            )
        })?;
        let storage = buffer
            .writable()
            .ok_or_else(|| KernelError::Shape("cannot write into a borrowed buffer".to_string()))?;
        let (base, guard) = each_storage!(storage, s => s.device_ptr_mut(stream));
        Ok((base + bytes, guard))
    }

    /// Copy to the host in row-major order of the shape, widened to `f32` (waits for the work
    /// queued before).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        Ok(each_storage!(&**self.storage, s => {
            self.in_order(download(s)?).into_iter().map(Element::to_f32).collect()
        }))
    }

    /// Copy to the host as raw little-endian bytes in row-major order of the shape, for bitwise
    /// comparisons.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.bytes());
        each_storage!(&**self.storage, s => {
            self.in_order(download(s)?).into_iter().for_each(|x| x.append_le_bytes(&mut out))
        });
        Ok(out)
    }

    /// The tensor's elements in row-major order of the shape, from a copy of its whole buffer:
    /// the buffer itself when the tensor is contiguous, else gathered through the strides.
    fn in_order<T: Copy>(&self, buffer: Vec<T>) -> Vec<T> {
        if self.is_contiguous() {
            return buffer;
        }
        let mut out = Vec::with_capacity(self.len());
        let mut index = vec![0usize; self.shape.len()];
        for _ in 0..self.len() {
            let at = index.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>();
            out.push(buffer[self.offset + at]);
            for axis in (0..index.len()).rev() {
                index[axis] += 1;
                if index[axis] < self.shape[axis] {
                    break;
                }
                index[axis] = 0;
            }
        }
        out
    }
}

/// Row-major strides of `shape`.
pub(crate) fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for axis in (0..shape.len().saturating_sub(1)).rev() {
        strides[axis] = strides[axis + 1] * shape[axis + 1];
    }
    strides
}

/// Strides that give every element of `shape` its own address inside a buffer of `len`
/// elements, or an error that says which rule they break.
fn check_strides(shape: &[usize], strides: &[usize], len: usize) -> Result<()> {
    if strides.len() != shape.len() {
        return Err(KernelError::Shape(format!(
            "shape {shape:?} has {} axes but {} strides were given ({strides:?})",
            shape.len(),
            strides.len()
        )));
    }
    elements(shape)?;
    if shape.contains(&0) {
        return Ok(());
    }
    // The last element's offset, checked for overflow: it must lie inside the buffer.
    let last = shape
        .iter()
        .zip(strides)
        .try_fold(0usize, |acc, (&n, &s)| (n - 1).checked_mul(s).and_then(|x| acc.checked_add(x)));
    match last {
        Some(last) if last < len => {}
        _ => {
            return Err(KernelError::Shape(format!(
                "strides {strides:?} of shape {shape:?} reach past the buffer of {len} elements"
            )));
        }
    }
    // No two elements share an address when, taking the axes from the smallest stride up, each
    // stride is larger than the span of the axes before it (the sufficient rule frameworks use).
    let mut axes: Vec<usize> = (0..shape.len()).filter(|&a| shape[a] > 1).collect();
    axes.sort_by_key(|&a| strides[a]);
    let mut span = 0usize;
    for &a in &axes {
        if strides[a] <= span {
            return Err(KernelError::Shape(format!(
                "strides {strides:?} of shape {shape:?} overlap: axis {a} (stride {}) steps onto \
                 elements of the axes with smaller strides",
                strides[a]
            )));
        }
        span += (shape[a] - 1) * strides[a];
    }
    Ok(())
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
    fn strides_must_stay_inside_the_buffer_and_not_overlap() {
        assert_eq!(row_major(&[2, 3, 4]), vec![12, 4, 1]);
        // [b, s, h, d] seen as [b, h, s, d], and slot 0 of a packed QKV buffer.
        assert!(
            check_strides(&[2, 8, 5, 64], &[5 * 8 * 64, 64, 8 * 64, 1], 2 * 5 * 8 * 64).is_ok()
        );
        let packed = [5 * 3 * 8 * 64, 64, 3 * 8 * 64, 1];
        assert!(check_strides(&[2, 8, 5, 64], &packed, 2 * 5 * 3 * 8 * 64).is_ok());
        let err = |shape: &[usize], strides: &[usize], len| {
            check_strides(shape, strides, len).unwrap_err().to_string()
        };
        assert!(err(&[2, 4], &[4, 1], 7).contains("past the buffer"), "one element short");
        assert!(err(&[2, 4], &[2, 1], 8).contains("overlap"), "rows overlap");
        assert!(err(&[2, 4], &[0, 1], 8).contains("overlap"), "broadcast rows");
        assert!(err(&[2, 4], &[4], 8).contains("2 axes"));
        assert!(err(&[usize::MAX, 4], &[1, 1], 8).contains("too many elements"));
        // Axes of length 1 take any stride; empty tensors any strides.
        assert!(check_strides(&[1, 4], &[0, 1], 4).is_ok());
        assert!(check_strides(&[0, 4], &[99, 1], 0).is_ok());
    }

    #[test]
    fn rounds_like_the_device() {
        assert_eq!(round_to(&[1.0 + 1e-4], DType::F16), vec![1.0]);
        assert_eq!(round_to(&[1.0 + 1e-3], DType::BF16), vec![1.0]);
        assert_eq!(round_to(&[1.0 + 1e-4], DType::F32), vec![1.0 + 1e-4]);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::F32.to_string(), "f32");
    }
}
