//! What the ops share: the checks of their inputs, the type they compute in, and the log-sum-exp
//! a forward pass keeps for its backward pass. Each op says only what it computes
//! ([`Attention`]'s methods, on the CPU and, with the `cuda` feature, on candle's CUDA device);
//! [`cpu_fwd`], `cuda_fwd` and [`bwd`] are the `CustomOp3` methods around them.

use std::sync::Mutex;

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, bail};
use ladder_reference::Element;
use ndarray::{Array, Dimension};

use crate::layout::{compute_type, require_contiguous_head_dim, require_rank};

/// An attention op on `(q, k, v)`: its name, its inputs' axes, and its passes in the type `T`
/// the inputs compute in (`f32`, or `f64` for `f64` tensors).
pub(crate) trait Attention {
    /// The op's name, in its errors.
    const NAME: &'static str;
    /// The axes of `q`, `k` and `v`, e.g. `"batch, seq, heads, head_dim"`.
    const AXES: &'static str;

    /// The forward pass: the output's storage in `out_dtype` (the inputs') and shape.
    fn forward<T: Element>(
        &self,
        q: (&CpuStorage, &Layout),
        k: (&CpuStorage, &Layout),
        v: (&CpuStorage, &Layout),
        out_dtype: DType,
    ) -> Result<(CpuStorage, Shape)>;

    /// The backward pass: `dQ, dK, dV` given the forward's output `o` and its gradient `d_o`.
    fn gradients<T: Element>(
        &self,
        qkv: (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)>;

    /// The forward pass on candle's CUDA device (f16 or bf16 inputs of one dtype, checked).
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        q: (&CudaStorage, &Layout),
        k: (&CudaStorage, &Layout),
        v: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)>;

    /// The backward pass on candle's CUDA device (every tensor there).
    #[cfg(feature = "cuda")]
    fn cuda_gradients(
        &self,
        qkv: (&Tensor, &Tensor, &Tensor),
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)>;
}

/// Fails unless `q`, `k` and `v` have the op's rank, a contiguous head dimension and one dtype.
fn check_inputs<A: Attention>(
    (q_l, k_l, v_l): (&Layout, &Layout, &Layout),
    (q, k, v): (DType, DType, DType),
) -> Result<()> {
    for (name, l) in [("q", q_l), ("k", k_l), ("v", v_l)] {
        require_rank(A::NAME, name, l, A::AXES)?;
    }
    require_contiguous_head_dim(A::NAME, &[("q", q_l), ("k", k_l), ("v", v_l)])?;
    if k != q || v != q {
        bail!("{}: q, k and v must have one dtype, got {q:?}, {k:?}, {v:?}", A::NAME);
    }
    Ok(())
}

/// `CustomOp3::cpu_fwd` of `op`: the inputs' ranks, head dimensions and dtypes checked, then
/// `op`'s forward pass in the type they compute in.
pub(crate) fn cpu_fwd<A: Attention>(
    op: &A,
    (q, q_l): (&CpuStorage, &Layout),
    (k, k_l): (&CpuStorage, &Layout),
    (v, v_l): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    check_inputs::<A>((q_l, k_l, v_l), (q.dtype(), k.dtype(), v.dtype()))?;
    let dtype = q.dtype();
    match compute_type(A::NAME, dtype)? {
        DType::F64 => op.forward::<f64>((q, q_l), (k, k_l), (v, v_l), dtype),
        _ => op.forward::<f32>((q, q_l), (k, k_l), (v, v_l), dtype),
    }
}

/// `CustomOp3::cuda_fwd` of `op`: the inputs checked as [`cpu_fwd`] checks them, then `op`'s
/// forward pass on the GPU.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_fwd<A: Attention>(
    op: &A,
    (q, q_l): (&CudaStorage, &Layout),
    (k, k_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    check_inputs::<A>((q_l, k_l, v_l), (q.dtype(), k.dtype(), v.dtype()))?;
    op.cuda_forward((q, q_l), (k, k_l), (v, v_l))
}

/// `CustomOp3::bwd` of `op`: its gradients in the type the inputs compute in (on the GPU for
/// tensors on candle's CUDA device, with the `cuda` feature).
pub(crate) fn bwd<A: Attention>(
    op: &A,
    qkv: (&Tensor, &Tensor, &Tensor),
    o: &Tensor,
    d_o: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if qkv.0.device().is_cuda() {
        let (dq, dk, dv) = op.cuda_gradients(qkv, o, d_o)?;
        return Ok((Some(dq), Some(dk), Some(dv)));
    }
    let (dq, dk, dv) = match compute_type(A::NAME, qkv.0.dtype())? {
        DType::F64 => op.gradients::<f64>(qkv, o, d_o)?,
        _ => op.gradients::<f32>(qkv, o, d_o)?,
    };
    Ok((Some(dq), Some(dk), Some(dv)))
}

/// `CustomOp3` for an [`Attention`] op: its name, [`cpu_fwd`] and [`bwd`].
macro_rules! custom_op3 {
    ($op:ty) => {
        impl candle_core::CustomOp3 for $op {
            fn name(&self) -> &'static str {
                <Self as $crate::op::Attention>::NAME
            }
            fn cpu_fwd(
                &self,
                q: &candle_core::CpuStorage,
                q_l: &candle_core::Layout,
                k: &candle_core::CpuStorage,
                k_l: &candle_core::Layout,
                v: &candle_core::CpuStorage,
                v_l: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                $crate::op::cpu_fwd(self, (q, q_l), (k, k_l), (v, v_l))
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                q: &candle_core::CudaStorage,
                q_l: &candle_core::Layout,
                k: &candle_core::CudaStorage,
                k_l: &candle_core::Layout,
                v: &candle_core::CudaStorage,
                v_l: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
                $crate::op::cuda_fwd(self, (q, q_l), (k, k_l), (v, v_l))
            }
            fn bwd(
                &self,
                q: &candle_core::Tensor,
                k: &candle_core::Tensor,
                v: &candle_core::Tensor,
                o: &candle_core::Tensor,
                d_o: &candle_core::Tensor,
            ) -> candle_core::Result<(
                Option<candle_core::Tensor>,
                Option<candle_core::Tensor>,
                Option<candle_core::Tensor>,
            )> {
                $crate::op::bwd(self, (q, k, v), o, d_o)
            }
        }
    };
}
pub(crate) use custom_op3;

/// A rung's error as candle's, naming the op.
pub(crate) fn err(op: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {e}"))
}

/// The log-sum-exp a forward pass keeps for its backward pass: on the CPU in `f64` (which every
/// type the ops compute in widens to exactly), on the GPU as the rungs' `f32` tensor.
#[derive(Debug)]
pub(crate) struct Saved<D: Dimension> {
    host: Mutex<Option<Array<f64, D>>>,
    #[cfg(feature = "cuda")]
    device: Mutex<Option<ladder_kernels::Tensor>>,
}

impl<D: Dimension> Default for Saved<D> {
    fn default() -> Self {
        Saved {
            host: Mutex::new(None),
            #[cfg(feature = "cuda")]
            device: Mutex::new(None),
        }
    }
}

impl<D: Dimension> Saved<D> {
    /// Keeps `lse`.
    pub(crate) fn keep<T: Element>(&self, lse: &Array<T, D>) {
        *self.host.lock().unwrap_or_else(|p| p.into_inner()) = Some(lse.mapv(|x| x.as_f64()));
    }

    /// The kept lse as `T`, if a forward pass ran on the CPU.
    pub(crate) fn get<T: Element>(&self) -> Option<Array<T, D>> {
        self.host.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|a| a.mapv(T::of))
    }

    /// Keeps the GPU forward pass's `lse`.
    #[cfg(feature = "cuda")]
    pub(crate) fn keep_device(&self, lse: ladder_kernels::Tensor) {
        *self.device.lock().unwrap_or_else(|p| p.into_inner()) = Some(lse);
    }

    /// The kept GPU lse (a handle on the same buffer), if a forward pass ran on the GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn get_device(&self) -> Option<ladder_kernels::Tensor> {
        let kept = self.device.lock().unwrap_or_else(|p| p.into_inner());
        kept.as_ref().and_then(|t| t.view(t.offset(), t.shape(), t.strides()).ok())
    }
}
