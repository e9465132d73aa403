//! Between candle's tensors and the ladder's arrays: candle's attention tensors are
//! `[batch, seq, heads, d]` (candle-flash-attn's layout) in any strides, the CPU rungs take
//! `[batch, heads, seq, d]` arrays. Elements are widened to the rung's `f32` (16-bit inputs, as a
//! GPU kernel does) or `f64`, and the results rounded back to the inputs' type.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};
use ladder_reference::Element;
use ndarray::{Array, ArrayView, Dimension, IntoDimension, ShapeBuilder};

/// What a CPU rung computes in for inputs of `dtype`: `f64` for `f64`, `f32` for `f32`, `f16`
/// and `bf16`; other types are an error naming `op`.
pub(crate) fn compute_type(op: &str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F64 => Ok(DType::F64),
        DType::F32 | DType::F16 | DType::BF16 => Ok(DType::F32),
        other => bail!("{op}: takes f16, bf16, f32 or f64 tensors, not {other:?}"),
    }
}

/// The storage `s` under `layout` as an array of `T` of rank `D` (its strides followed, its
/// elements widened), with the axes permuted by `axes` (`[0, 2, 1, 3]` takes `[b, s, h, d]` to
/// `[b, h, s, d]`).
pub(crate) fn array<T: Element, D: Dimension>(
    s: &CpuStorage,
    layout: &Layout,
    axes: D,
) -> Result<Array<T, D>> {
    fn view<U: Copy, T: Element, D: Dimension>(
        data: &[U],
        layout: &Layout,
        axes: D,
        widen: impl Fn(U) -> f64,
    ) -> Result<Array<T, D>> {
        let dims = D::from_dimension(&layout.dims().into_dimension())
            .ok_or_else(|| candle_core::Error::Msg(format!("rank {}", layout.dims().len())))?;
        let strides = D::from_dimension(&layout.stride().into_dimension())
            .ok_or_else(|| candle_core::Error::Msg("strides".into()))?;
        let data = data.get(layout.start_offset()..).unwrap_or(&[]);
        let v = ArrayView::from_shape(dims.strides(strides), data)
            .map_err(|e| candle_core::Error::Msg(format!("a tensor's layout: {e}")))?;
        Ok(v.permuted_axes(axes).mapv(|x| T::of(widen(x))))
    }
    match s {
        CpuStorage::F64(d) => view(d, layout, axes, |x| x),
        CpuStorage::F32(d) => view(d, layout, axes, f64::from),
        CpuStorage::F16(d) => view(d, layout, axes, f64::from),
        CpuStorage::BF16(d) => view(d, layout, axes, f64::from),
        other => bail!("expected a float tensor, got {:?}", other.dtype()),
    }
}

/// `a`, its axes permuted by `axes`, as row-major storage of `dtype` (rounded to it) and its shape.
pub(crate) fn storage<T: Element, D: Dimension>(
    a: &Array<T, D>,
    axes: D,
    dtype: DType,
) -> Result<(CpuStorage, Shape)> {
    let a = a.view().permuted_axes(axes);
    let shape = Shape::from(a.shape().to_vec());
    let values = a.iter().map(|x| x.as_f64());
    let s = match dtype {
        DType::F64 => CpuStorage::F64(values.collect()),
        DType::F32 => CpuStorage::F32(values.map(|x| x as f32).collect()),
        DType::F16 => CpuStorage::F16(values.map(f16::from_f64).collect()),
        DType::BF16 => CpuStorage::BF16(values.map(bf16::from_f64).collect()),
        other => bail!("cannot write {other:?}"),
    };
    Ok((s, shape))
}

/// The tensor `t` (any device, any strides) as an array of `T`, its axes permuted by `axes`.
pub(crate) fn tensor_array<T: Element, D: Dimension>(t: &Tensor, axes: D) -> Result<Array<T, D>> {
    let dims = D::from_dimension(&t.dims().into_dimension())
        .ok_or_else(|| candle_core::Error::Msg(format!("rank {}", t.rank())))?;
    let values: Vec<f64> = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let a = Array::from_shape_vec(dims, values.into_iter().map(T::of).collect())
        .map_err(|e| candle_core::Error::Msg(format!("{e}")))?;
    Ok(a.permuted_axes(axes))
}

/// [`tensor_array`] of each of `tensors`.
pub(crate) fn tensor_arrays<T: Element, D: Dimension, const N: usize>(
    tensors: [&Tensor; N],
    axes: D,
) -> Result<[Array<T, D>; N]> {
    let arrays =
        tensors.iter().map(|t| tensor_array(t, axes.clone())).collect::<Result<Vec<_>>>()?;
    arrays.try_into().map_err(|_| candle_core::Error::Msg("tensor_arrays".into()))
}

/// The array `a`, its axes permuted by `axes`, as a tensor of `dtype` on `device`.
pub(crate) fn array_tensor<T: Element, D: Dimension>(
    a: &Array<T, D>,
    axes: D,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let a = a.view().permuted_axes(axes);
    let values: Vec<f64> = a.iter().map(|x| x.as_f64()).collect();
    Tensor::from_vec(values, a.shape(), device)?.to_dtype(dtype)
}

/// Fails unless the last axis (the head dimension) of each named layout is contiguous, as
/// candle-flash-attn requires of its inputs (so that a call that works on one device works on
/// the other).
pub(crate) fn require_contiguous_head_dim(op: &str, layouts: &[(&str, &Layout)]) -> Result<()> {
    for (name, l) in layouts {
        if l.stride().last() != Some(&1) {
            bail!(
                "{op}: {name} must have a contiguous last axis (the head dimension, stride 1), \
                 got strides {:?}",
                l.stride()
            );
        }
    }
    Ok(())
}

/// Fails unless the layout has rank `rank`, naming the tensor and what its axes are.
pub(crate) fn require_rank(op: &str, name: &str, l: &Layout, axes: &str) -> Result<()> {
    let rank = axes.split(',').count();
    if l.dims().len() != rank {
        bail!("{op}: {name} must be [{axes}], got shape {:?}", l.dims());
    }
    Ok(())
}
