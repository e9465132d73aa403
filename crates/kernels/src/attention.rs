//! Attention by the fastest rung that takes the call: FlashAttention-3 on Hopper where it accepts
//! the problem, FlashAttention-2 otherwise (another architecture, a head dimension or an alignment
//! FA3 has no kernel for, a window in the backward pass). What a model, or a ring of them
//! ([`crate::ring`]), calls when it wants attention rather than a particular rung.
//!
//! FA3 declines with the errors of its own limits ([`KernelError::UnsupportedArch`],
//! `UnsupportedHeadDim`, `UnsupportedDtype`, `SharedMemory`, `Shape`), and the call goes to FA2;
//! a shape error of a bad input is among them, and FA2 then reports it in its own words. Any
//! other error (a device failure) is returned as it is, not retried on FA2.

use crate::error::{KernelError, Result};
use crate::{Gpu, Gradients, Options, Output, Tensor, fa2, fa3, varlen::SeqLens};

/// Whether FlashAttention-3 turned the call down for its own limits, so that FlashAttention-2
/// should take it.
fn fa3_declined(e: &KernelError) -> bool {
    matches!(
        e,
        KernelError::UnsupportedArch { .. }
            | KernelError::UnsupportedHeadDim { .. }
            | KernelError::UnsupportedDtype { .. }
            | KernelError::SharedMemory { .. }
            | KernelError::Shape(_)
    )
}

/// `fa3` where FlashAttention-3 takes the call on Hopper, else `fa2`.
fn fa3_or_fa2<R>(
    gpu: &Gpu,
    fa3: impl FnOnce() -> Result<R>,
    fa2: impl FnOnce() -> Result<R>,
) -> Result<R> {
    if gpu.arch() == "sm_90a" {
        match fa3() {
            Err(e) if fa3_declined(&e) => {}
            done => return done,
        }
    }
    fa2()
}

/// [`fa3::forward`] on Hopper where it takes the call, else [`fa2::forward`].
pub fn forward(gpu: &Gpu, q: &Tensor, k: &Tensor, v: &Tensor, opts: &Options) -> Result<Output> {
    fa3_or_fa2(gpu, || fa3::forward(gpu, q, k, v, opts), || fa2::forward(gpu, q, k, v, opts))
}

/// [`fa3::forward_varlen`] on Hopper where it takes the call, else [`fa2::forward_varlen`].
pub fn forward_varlen(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &SeqLens,
    opts: &Options,
) -> Result<Output> {
    fa3_or_fa2(
        gpu,
        || fa3::forward_varlen(gpu, q, k, v, lens, opts),
        || fa2::forward_varlen(gpu, q, k, v, lens, opts),
    )
}

/// The backward pass of [`forward`]: [`fa3::backward::backward`] on Hopper where it takes the
/// call (no window), else [`fa2::backward`].
pub fn backward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Output,
    d_o: &Tensor,
    opts: &Options,
) -> Result<Gradients> {
    let fa2 = || fa2::backward(gpu, q, k, v, out, d_o, opts);
    if opts.window.is_some() {
        return fa2();
    }
    fa3_or_fa2(gpu, || fa3::backward::backward(gpu, q, k, v, out, d_o, opts), fa2)
}
