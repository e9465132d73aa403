//! The checks of one decoding call that need no device: the shapes and element types of `q`
//! and the cache, the lengths, the page table against the cache, and the options.

use super::*;
use crate::problem::{dims4, heads_divide, nonempty, same_dtype, same_shape};

/// What the checks need of a tensor: its shape and element type.
#[derive(Clone, Copy, Debug)]
pub(super) struct Desc<'a> {
    pub(super) shape: &'a [usize],
    pub(super) dtype: DType,
}

impl<'a> Desc<'a> {
    pub(super) fn of(t: &'a Tensor) -> Desc<'a> {
        Desc { shape: t.shape(), dtype: t.dtype() }
    }
}

/// A cache as the checks see it (shapes, types, the page table's shape and known entries).
#[derive(Clone, Copy, Debug)]
pub(super) enum CacheDesc<'a> {
    Contiguous { k: Desc<'a>, v: Desc<'a>, lengths: &'a [usize] },
    Paged { k: Desc<'a>, v: Desc<'a>, table: &'a TableInfo, lengths: &'a [usize] },
}

impl<'a> CacheDesc<'a> {
    pub(super) fn of(cache: &Cache<'a>) -> CacheDesc<'a> {
        match *cache {
            Cache::Contiguous(c) => {
                CacheDesc::Contiguous { k: Desc::of(c.k), v: Desc::of(c.v), lengths: c.lengths }
            }
            Cache::Paged(c) => CacheDesc::Paged {
                k: Desc::of(c.k_pages),
                v: Desc::of(c.v_pages),
                table: &c.page_table.info,
                lengths: c.lengths,
            },
        }
    }
}

/// How a checked cache is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Layout {
    /// `[batch, heads_kv, capacity, d]`.
    Contiguous { capacity: usize },
    /// `[num_pages, heads_kv, page_size, d]` and a `[batch, max_pages]` table.
    Paged { page_size: usize, num_pages: usize, max_pages: usize },
}

/// The checked dimensions of one decoding call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) batch: usize,
    pub(super) heads_q: usize,
    pub(super) heads_kv: usize,
    pub(super) n_new: usize,
    pub(super) d: usize,
    pub(super) dtype: DType,
    pub(super) scale: f32,
    pub(super) layout: Layout,
    /// FlashDecoding++'s `φ` and safe window (checked for every call, whatever the strategy).
    pub(super) window: Window,
    /// The sliding window's left side ([`DecodeOptions::window`]), if any.
    pub(super) window_left: Option<usize>,
    /// Packed new tokens ([`forward_varlen`]): the rows of Q, `n_new` then being the most of any
    /// sequence.
    pub(super) total_new: Option<usize>,
}

impl Shape {
    /// Every check of a call that needs no device: shapes, element types, lengths, the page
    /// table against the cache, the options.
    pub(super) fn check(q: Desc, cache: &CacheDesc, opts: &DecodeOptions) -> Result<Shape> {
        let dims = |t: Desc, expected: &str| dims4(t.shape, expected);
        let [batch, heads_q, n_new, d] = dims(q, "q must be [batch, heads_q, n_new, head_dim]")?;
        let (k, v, lengths) = match *cache {
            CacheDesc::Contiguous { k, v, lengths } => (k, v, lengths),
            CacheDesc::Paged { k, v, lengths, .. } => (k, v, lengths),
        };
        let (layout, heads_kv, kd) = match *cache {
            CacheDesc::Contiguous { .. } => {
                let [kb, heads_kv, capacity, kd] =
                    dims(k, "k must be [batch, heads_kv, capacity, head_dim]")?;
                if kb != batch {
                    return Err(KernelError::Shape(format!(
                        "q {:?} and the cache {:?} differ in batch",
                        q.shape, k.shape
                    )));
                }
                (Layout::Contiguous { capacity }, heads_kv, kd)
            }
            CacheDesc::Paged { table, .. } => {
                let [num_pages, heads_kv, page_size, kd] =
                    dims(k, "k_pages must be [num_pages, heads_kv, page_size, head_dim]")?;
                if table.batch != batch {
                    return Err(KernelError::Shape(format!(
                        "the page table has {} rows for a batch of {batch}",
                        table.batch
                    )));
                }
                (Layout::Paged { page_size, num_pages, max_pages: table.max_pages }, heads_kv, kd)
            }
        };
        same_shape(("v", v.shape), ("k", k.shape))?;
        if kd != d {
            return Err(KernelError::Shape(format!(
                "q {:?} and the cache {:?} differ in head_dim",
                q.shape, k.shape
            )));
        }
        nonempty(q.shape, ("the cache", k.shape))?;
        heads_divide(heads_q, heads_kv)?;
        if n_new > MAX_NEW_TOKENS {
            return Err(KernelError::Shape(format!(
                "n_new = {n_new} new tokens per sequence; decoding takes 1 to {MAX_NEW_TOKENS}"
            )));
        }
        if lengths.len() != batch {
            return Err(KernelError::Shape(format!(
                "{} lengths given for a batch of {batch}",
                lengths.len()
            )));
        }
        if let Some((b, &len)) = lengths.iter().enumerate().find(|&(_, &l)| l > MAX_LENGTH) {
            return Err(KernelError::Shape(format!(
                "lengths[{b}] = {len} exceeds the kernels' limit {MAX_LENGTH}"
            )));
        }
        // The kernels take these counts as 32-bit ints.
        let limit = i32::MAX as usize;
        match layout {
            Layout::Contiguous { capacity } => {
                if let Some((b, &len)) = lengths.iter().enumerate().find(|&(_, &l)| l > capacity) {
                    return Err(KernelError::Shape(format!(
                        "lengths[{b}] = {len} exceeds the cache capacity {capacity}"
                    )));
                }
                if capacity > limit {
                    return Err(KernelError::Shape(format!("cache {:?} too large", k.shape)));
                }
            }
            Layout::Paged { page_size, num_pages, .. } => {
                if !PAGE_SIZES.contains(&page_size) {
                    return Err(KernelError::Config(format!(
                        "flash_decoding: pages of {page_size} tokens (k_pages {:?}); the paged \
                         kernel takes {PAGE_SIZES:?}",
                        k.shape
                    )));
                }
                if num_pages > limit {
                    return Err(KernelError::Shape(format!(
                        "{num_pages} pages (k_pages {:?}) is too many",
                        k.shape
                    )));
                }
                if let CacheDesc::Paged { table, .. } = *cache {
                    table.check(lengths, page_size, num_pages)?;
                }
            }
        }
        same_dtype([q.dtype, k.dtype, v.dtype])?;
        let dtype = q.dtype;
        if !DTYPES.contains(&dtype) {
            return Err(KernelError::UnsupportedDtype {
                rung: "flash_decoding",
                dtype,
                supported: "fp16, bf16",
            });
        }
        if !HEAD_DIMS.contains(&d) {
            return Err(KernelError::UnsupportedHeadDim {
                rung: "flash_decoding",
                d,
                supported: HEAD_DIMS,
            });
        }
        if batch.saturating_mul(heads_q).saturating_mul(n_new) > limit {
            return Err(KernelError::Shape(format!("q {:?} too large", q.shape)));
        }
        let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
        crate::problem::check_scale(scale)?;
        let window = Window::new(opts.phi, opts.safe_range, dtype)?;
        let window_left = check_modifiers(opts, heads_q)?;
        Ok(Shape {
            batch,
            heads_q,
            heads_kv,
            n_new,
            d,
            dtype,
            scale,
            layout,
            window,
            window_left,
            total_new: None,
        })
    }

    /// Rows of the split kernel per kv head: query heads per kv head times new tokens.
    pub(super) fn rows_per_kv_head(&self) -> usize {
        self.heads_q / self.heads_kv * self.n_new
    }

    /// Output rows: `batch · heads_q · n_new`, or `total_new · heads_q`.
    pub(super) fn rows(&self) -> usize {
        match self.total_new {
            None => self.batch * self.heads_q * self.n_new,
            Some(total) => total * self.heads_q,
        }
    }

    /// `O`'s shape, `q`'s: `[batch, heads_q, n_new, d]`, or `[total_new, heads_q, d]`.
    pub(super) fn o_shape(&self) -> Vec<usize> {
        match self.total_new {
            None => vec![self.batch, self.heads_q, self.n_new, self.d],
            Some(total) => vec![total, self.heads_q, self.d],
        }
    }

    /// `lse`'s shape: `[batch, heads_q, n_new]`, or `[heads_q, total_new]`.
    pub(super) fn lse_shape(&self) -> Vec<usize> {
        match self.total_new {
            None => vec![self.batch, self.heads_q, self.n_new],
            Some(total) => vec![self.heads_q, total],
        }
    }

    /// Caller-owned outputs ([`forward_into`]) of the call's shapes and types.
    pub(super) fn check_output(&self, out: &Output) -> Result<()> {
        let (o_shape, lse_shape) = (self.o_shape(), self.lse_shape());
        if out.o.shape() != o_shape || out.lse.shape() != lse_shape {
            return Err(KernelError::Shape(format!(
                "decode: outputs O {:?} and lse {:?}, expected {o_shape:?} and {lse_shape:?}",
                out.o.shape(),
                out.lse.shape(),
            )));
        }
        if out.o.dtype() != self.dtype || out.lse.dtype() != DType::F32 {
            return Err(KernelError::DType(format!(
                "decode: outputs O in {} and lse in {}, expected {} (q's) and f32",
                out.o.dtype(),
                out.lse.dtype(),
                self.dtype
            )));
        }
        if !out.lse.is_contiguous() {
            return Err(KernelError::Shape(format!(
                "decode: the output lse must be a contiguous tensor (it has strides {:?})",
                out.lse.strides()
            )));
        }
        Ok(())
    }
}

/// Checks the options' modifiers against the call: the window's right side is the causal mask's
/// (decoding is causal), its left side fits the kernels' 32-bit keys; the score modifier's tables
/// and the sinks cover every query head. Returns the window's left side.
fn check_modifiers(opts: &DecodeOptions, heads_q: usize) -> Result<Option<usize>> {
    if let Some(right) = opts.window.right.filter(|&r| r != 0) {
        return Err(KernelError::Shape(format!(
            "decode: a window's right side must be 0 or open (decoding is causal: a new token sees \
             no key after its own), got {right}"
        )));
    }
    let left = opts.window.left.map(|left| left.min(MAX_LENGTH));
    if let Some(m) = &opts.score_mod {
        m.check(heads_q, false)?;
    }
    if let Some(sinks) = &opts.sinks {
        sinks.check(heads_q)?;
    }
    Ok(left)
}
