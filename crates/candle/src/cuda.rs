//! The ops on candle's CUDA device (the `cuda` feature): `ladder-kernels`' rungs run on candle's
//! own buffers and stream, with no copies.
//!
//! candle lends a `CustomOp` its inputs as `&CudaStorage`; [`lend`] wraps them as read-only
//! `ladder_kernels` tensors that borrow candle's memory (strides followed, axes permuted to the
//! rungs' `[batch, heads, seq, d]`), and the outputs the rungs allocate on candle's stream go back
//! to candle as they are ([`to_storage`], [`to_tensor`]). One [`Gpu`] per candle device keeps the
//! compiled kernels ([`gpu`]). The forward pass runs FlashAttention-3 on Hopper (sm_90a) where it
//! takes the call, FlashAttention-2 otherwise; the backward pass likewise ([`forward`],
//! [`backward`]). The kernels take f16 and bf16 only, as candle-flash-attn does.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaStorageSlice, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{
    CudaDevice, CudaStorage, Layout, Result, Shape, Storage, StorageRef, Tensor, bail,
};
use half::{bf16, f16};
use ladder_kernels::{Gpu, GpuConfig, KernelError, Output, attention};

use crate::op::err;

/// The [`Gpu`] of candle's device `dev`, opened on its stream once per device and kept for the
/// life of the process (it holds the kernels compiled for the device).
pub(crate) fn gpu(op: &str, dev: &CudaDevice) -> Result<Arc<Gpu>> {
    static GPUS: Mutex<Vec<(DeviceId, Arc<Gpu>)>> = Mutex::new(Vec::new());
    let mut gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, gpu)) = gpus.iter().find(|(id, _)| *id == dev.id()) {
        return Ok(gpu.clone());
    }
    let gpu =
        Arc::new(Gpu::from_stream(dev.cuda_stream(), GpuConfig::new()).map_err(|e| err(op, e))?);
    gpus.push((dev.id(), gpu.clone()));
    Ok(gpu)
}

/// A `ladder_kernels` tensor over candle's memory, for as long as candle lends it (`'a`).
pub(crate) struct Lent<'a> {
    tensor: ladder_kernels::Tensor,
    _lender: PhantomData<&'a CudaStorage>,
}

impl std::ops::Deref for Lent<'_> {
    type Target = ladder_kernels::Tensor;
    fn deref(&self) -> &ladder_kernels::Tensor {
        &self.tensor
    }
}

impl Lent<'_> {
    /// Another handle on the same borrowed elements, for the rungs' structs that hold tensors by
    /// value ([`Output`]); it must not outlive `self`'s lender either (it is dropped in the call).
    pub(crate) fn alias(&self) -> Result<ladder_kernels::Tensor> {
        let t = &self.tensor;
        t.view(t.offset(), t.shape(), t.strides()).map_err(|e| err("ladder-candle", e))
    }
}

/// The elements of `s` under `layout`, their axes permuted by `axes` (`[0, 2, 1, 3]` takes
/// candle's `[batch, seq, heads, d]` to the rungs' `[batch, heads, seq, d]`), borrowed.
pub(crate) fn lend<'a>(
    op: &str,
    name: &str,
    s: &'a CudaStorage,
    layout: &Layout,
    axes: &[usize],
) -> Result<Lent<'a>> {
    let shape: Vec<usize> = axes.iter().map(|&a| layout.dims()[a]).collect();
    let strides: Vec<usize> = axes.iter().map(|&a| layout.stride()[a]).collect();
    // SAFETY: the tensor (and `alias`es of it) live no longer than `'a`, the borrow of candle's
    // storage, during which candle neither frees nor writes it (a CustomOp's inputs).
    let whole = match &s.slice {
        CudaStorageSlice::F16(x) => unsafe {
            ladder_kernels::Tensor::from_borrowed_cuda_slice_strided(x, &[x.len()], &[1])
        },
        CudaStorageSlice::BF16(x) => unsafe {
            ladder_kernels::Tensor::from_borrowed_cuda_slice_strided(x, &[x.len()], &[1])
        },
        _ => bail!(
            "{op}: on a CUDA device the kernels take f16 or bf16 tensors (as candle-flash-attn), \
             {name} is {:?}",
            s.dtype()
        ),
    }
    .map_err(|e| err(op, e))?;
    let tensor = whole
        .view(layout.start_offset(), &shape, &strides)
        .map_err(|e| err(op, format!("{name}: {e}")))?;
    Ok(Lent { tensor, _lender: PhantomData })
}

/// The device's [`Gpu`] and [`lend`] of a `CustomOp3`'s inputs `q`, `k` and `v` (storage and
/// layout each), their axes permuted by `axes`.
pub(crate) fn lend_qkv<'a>(
    op: &str,
    inputs: [(&'a CudaStorage, &'a Layout); 3],
    axes: &[usize],
) -> Result<(Arc<Gpu>, [Lent<'a>; 3])> {
    let gpu = gpu(op, &inputs[0].0.device)?;
    let [(q, q_l), (k, k_l), (v, v_l)] = inputs;
    let lent =
        [lend(op, "q", q, q_l, axes)?, lend(op, "k", k, k_l, axes)?, lend(op, "v", v, v_l, axes)?];
    Ok((gpu, lent))
}

/// The storage of a candle tensor on a CUDA device, and its layout.
pub(crate) fn cuda_storage<'a>(
    op: &str,
    name: &str,
    storage: &'a Storage,
) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => bail!("{op}: {name} is not on the CUDA device the other tensors are on"),
    }
}

/// The axes of `t` in the order they lie in memory, outermost first, and their extents there;
/// fails unless the tensor is dense (what the rungs allocate).
fn memory_layout(op: &str, t: &ladder_kernels::Tensor) -> Result<(Vec<usize>, Vec<usize>)> {
    let mut order: Vec<usize> = (0..t.shape().len()).collect();
    order.sort_by_key(|&a| std::cmp::Reverse(t.strides()[a]));
    let extents: Vec<usize> = order.iter().map(|&a| t.shape()[a]).collect();
    let mut dense = 1;
    for (&a, &n) in order.iter().zip(&extents).rev() {
        if n > 1 && t.strides()[a] != dense {
            bail!("{op}: a result of shape {:?} has gaps (strides {:?})", t.shape(), t.strides());
        }
        dense *= n;
    }
    Ok((order, extents))
}

/// The rungs' dense result `t` as a candle tensor, its axes permuted by `axes` (its own inverse:
/// `[0, 2, 1, 3]` takes `[batch, heads, seq, d]` back to candle's `[batch, seq, heads, d]`),
/// without a copy (candle's strides say where each element lies).
pub(crate) fn to_tensor(
    op: &str,
    t: ladder_kernels::Tensor,
    axes: &[usize],
    dev: &CudaDevice,
) -> Result<Tensor> {
    let (order, extents) = memory_layout(op, &t)?;
    let storage = Storage::Cuda(into_storage(op, t, dev)?);
    let in_memory = Tensor::from_storage(storage, extents, BackpropOp::none(), false);
    // Axis `a` of the rungs' tensor is axis `position[a]` of `in_memory`.
    let mut position = vec![0; order.len()];
    for (p, &a) in order.iter().enumerate() {
        position[a] = p;
    }
    let to_candle: Vec<usize> = axes.iter().map(|&a| position[a]).collect();
    in_memory.permute(to_candle)
}

/// The rungs' result `t`, dense with its axes permuted by `axes` in row-major order (the order
/// of the inputs a forward pass lays its output out in), as candle storage of that shape.
pub(crate) fn to_storage(
    op: &str,
    t: ladder_kernels::Tensor,
    axes: &[usize],
    dev: &CudaDevice,
) -> Result<(CudaStorage, Shape)> {
    let shape: Vec<usize> = axes.iter().map(|&a| t.shape()[a]).collect();
    let mut dense = 1;
    for (&a, &n) in axes.iter().zip(&shape).rev() {
        if n > 1 && t.strides()[a] != dense {
            bail!("{op}: the output of shape {shape:?} is not in the inputs' order");
        }
        dense *= n;
    }
    Ok((into_storage(op, t, dev)?, Shape::from(shape)))
}

/// The buffer of `t` as candle storage (no copy).
fn into_storage(op: &str, t: ladder_kernels::Tensor, dev: &CudaDevice) -> Result<CudaStorage> {
    let e = |e: KernelError| err(op, e);
    Ok(match t.dtype() {
        ladder_kernels::DType::F16 => {
            CudaStorage::wrap_cuda_slice(t.into_cuda_slice::<f16>().map_err(e)?, dev.clone())
        }
        ladder_kernels::DType::BF16 => {
            CudaStorage::wrap_cuda_slice(t.into_cuda_slice::<bf16>().map_err(e)?, dev.clone())
        }
        ladder_kernels::DType::F32 => {
            CudaStorage::wrap_cuda_slice(t.into_cuda_slice::<f32>().map_err(e)?, dev.clone())
        }
    })
}

/// The forward pass of the rungs' `(q, k, v)` `[batch, heads, seq, d]`: FlashAttention-3 on
/// Hopper where it takes the call, FlashAttention-2 otherwise ([`ladder_kernels::attention`]).
pub(crate) fn forward(
    gpu: &Gpu,
    (q, k, v): Qkv<'_>,
    opts: &ladder_kernels::Options,
) -> std::result::Result<Output, KernelError> {
    attention::forward(gpu, q, k, v, opts)
}

/// The backward pass of [`forward`] ([`ladder_kernels::attention::backward`]).
pub(crate) fn backward(
    gpu: &Gpu,
    (q, k, v): Qkv<'_>,
    out: &Output,
    d_o: &ladder_kernels::Tensor,
    opts: &ladder_kernels::Options,
) -> std::result::Result<ladder_kernels::Gradients, KernelError> {
    attention::backward(gpu, q, k, v, out, d_o, opts)
}

/// Ladder tensors of the rungs' inputs.
type Qkv<'a> = (&'a ladder_kernels::Tensor, &'a ladder_kernels::Tensor, &'a ladder_kernels::Tensor);

/// The packed forward pass (`q` `[total_q, heads_q, d]`, `k` and `v` `[total_k, heads_kv, d]`),
/// FlashAttention-3 on Hopper where it takes the call, FlashAttention-2 otherwise.
pub(crate) fn forward_varlen(
    gpu: &Gpu,
    (q, k, v): Qkv<'_>,
    lens: &ladder_kernels::varlen::SeqLens,
    opts: &ladder_kernels::Options,
) -> std::result::Result<Output, KernelError> {
    attention::forward_varlen(gpu, q, k, v, lens, opts)
}

/// `t` as it is when its axes lie in memory in their own order (outermost first) with no two
/// elements at one address, else a contiguous copy: a forward pass lays its output out in its
/// query's order, and candle takes a custom op's output as contiguous.
pub(crate) fn in_axis_order(t: &Tensor) -> Result<Tensor> {
    let strides: Vec<usize> =
        t.dims().iter().zip(t.stride()).filter(|(n, _)| **n > 1).map(|(_, s)| *s).collect();
    let ordered = strides.windows(2).all(|w| w[0] > w[1]) && !strides.contains(&0);
    if ordered { Ok(t.clone()) } else { t.contiguous() }
}

/// `t` as it is unless elements share an address (a broadcast, stride 0), which the kernels'
/// tensors refuse: then a contiguous copy.
pub(crate) fn without_broadcast(t: &Tensor) -> Result<Tensor> {
    let broadcast = t.dims().iter().zip(t.stride()).any(|(&n, &s)| n > 1 && s == 0);
    if broadcast { t.contiguous() } else { Ok(t.clone()) }
}

/// [`lend`] of each of the read-locked storages `guards` (tensors on candle's CUDA device), their
/// axes permuted by `axes`.
pub(crate) fn lend_all<'a, const N: usize>(
    op: &str,
    guards: &'a [(StorageRef<'a>, &'a Layout); N],
    axes: &[usize],
) -> Result<[Lent<'a>; N]> {
    const NAMES: [&str; 5] = ["q", "k", "v", "o", "d_o"];
    let mut lent = Vec::with_capacity(N);
    for (i, (storage, layout)) in guards.iter().enumerate() {
        let name = NAMES.get(i).copied().unwrap_or("a tensor");
        lent.push(lend(op, name, cuda_storage(op, name, storage)?, layout, axes)?);
    }
    lent.try_into().map_err(|_| err(op, "lend_all"))
}
