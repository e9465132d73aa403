//! How `ladder bench` times a case: deterministic inputs uploaded in enough sets to rotate
//! through when they fit in L2, one untimed (compiling) call, warm-up calls, then CUDA-event
//! samples of one or several calls each, and their median. Decoding cases get their own inputs
//! ([`DecodeSet`]: a KV cache allocated once per shape and layout, contiguous or in shuffled
//! pages) and step ([`decode_step`]), and the same measurement.

use std::time::Instant;

use ladder_compare::gpu_rungs::Kernels;
use ladder_compare::{GpuRung, cases};
use ladder_kernels::decode::{
    self, Cache, DecodeOptions, DecodeStats, KvCache, PageTable, PagedKvCache,
};
use ladder_kernels::{DType, Gpu, KernelError, Options, Output, Tensor};

use super::plan::{CacheLayout, DecodeShape, LayoutArg, Plan};

/// L2 cache of an H100/H200 (50 MB): inputs smaller than this are rotated.
const L2_BYTES: usize = 50 << 20;
/// A timed sample spans at least this long (several calls if needed).
const SAMPLE_MS: f64 = 1.0;

/// One set of inputs: Q, K, V, and dO when a backward pass is timed.
pub(super) struct InputSet {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Option<Tensor>,
}

/// One call of a case on input set `i`; returns what it allocated so that it is freed after the
/// sample, outside the timed region.
pub(super) type Step<'a> = Box<dyn FnMut(usize) -> ladder_kernels::Result<Vec<Tensor>> + 'a>;

/// Prepare a case of `rung` on `sets` (for a backward pass: the forward outputs it needs,
/// untimed); the step then runs one call on input set `i`.
pub(super) fn step<'a>(
    rung: GpuRung,
    gpu: &'a Gpu,
    sets: &'a [InputSet],
    opts: Options,
) -> ladder_kernels::Result<Step<'a>> {
    match rung.kernels() {
        Kernels::Forward(forward) => Ok(Box::new(move |i| {
            let s = &sets[i];
            let out = forward(gpu, &s.q, &s.k, &s.v, &opts)?;
            Ok(vec![out.o, out.lse])
        })),
        Kernels::ForwardFp8 { quantize, forward } => {
            // The inputs are quantised once, untimed: FP8 peers take e4m3 inputs too.
            let fp8 =
                ladder_compare::gpu_check::gpu_fp8(&ladder_compare::RungConfig::default().fp8);
            let inputs: Vec<_> = sets
                .iter()
                .map(|s| quantize(gpu, &s.q, &s.k, &s.v, &opts, &fp8))
                .collect::<ladder_kernels::Result<_>>()?;
            Ok(Box::new(move |i| {
                let out = forward(gpu, &inputs[i])?;
                Ok(vec![out.o, out.lse])
            }))
        }
        Kernels::Decode(_) => {
            Err(KernelError::Config(format!("{rung} takes a KV cache: time it with decode_step")))
        }
        Kernels::Backward { forward, backward, deterministic } => {
            let opts = Options { deterministic, ..opts };
            let outs: Vec<Output> = sets
                .iter()
                .map(|s| forward(gpu, &s.q, &s.k, &s.v, &opts))
                .collect::<ladder_kernels::Result<_>>()?;
            Ok(Box::new(move |i| {
                let (s, out) = (&sets[i], &outs[i]);
                let d_o = s.d_o.as_ref().ok_or_else(|| {
                    KernelError::Shape("no dO uploaded for a backward case".into())
                })?;
                let g = backward(gpu, &s.q, &s.k, &s.v, out, d_o, &opts)?;
                Ok(vec![g.dq, g.dk, g.dv])
            }))
        }
    }
}

/// One set of decoding inputs: a query `[batch, heads_q, n_new, d]` for each count of new tokens
/// the shape runs with, and the cache: K and V `[batch, heads_kv, L, d]`, or in pages
/// `[pages, heads_kv, page_size, d]` with a page table.
pub(super) struct DecodeSet {
    qs: Vec<(usize, Tensor)>,
    k: Tensor,
    v: Tensor,
    page_table: Option<PageTable>,
}

impl DecodeSet {
    /// The query of `n_new` new tokens.
    fn q(&self, n_new: usize) -> ladder_kernels::Result<&Tensor> {
        self.qs.iter().find(|(n, _)| *n == n_new).map(|(_, q)| q).ok_or_else(|| {
            KernelError::Config(format!("no query of {n_new} new tokens was uploaded"))
        })
    }

    /// The cache, every sequence `lengths[b]` long.
    fn cache<'a>(&'a self, lengths: &'a [usize]) -> Cache<'a> {
        match &self.page_table {
            None => KvCache { k: &self.k, v: &self.v, lengths }.into(),
            Some(page_table) => {
                PagedKvCache { k_pages: &self.k, v_pages: &self.v, page_table, lengths }.into()
            }
        }
    }
}

/// Prepare a decoding case of `rung` on `sets`, `n_new` new tokens per sequence, every sequence
/// `lengths[b]` long; the step then runs one call on input set `i`, into outputs allocated once.
pub(super) fn decode_step<'a>(
    rung: GpuRung,
    gpu: &'a Gpu,
    sets: &'a [DecodeSet],
    n_new: usize,
    lengths: &'a [usize],
    opts: DecodeOptions,
) -> ladder_kernels::Result<Step<'a>> {
    let Kernels::Decode(_) = rung.kernels() else {
        return Err(KernelError::Config(format!("{rung} is not a decoding kernel")));
    };
    let opts = rung.decode_options(&opts);
    // O and lse are allocated once per case and overwritten by every call
    // (decode::forward_into), as a serving loop keeps them from one step to the next.
    let q = sets.first().ok_or_else(|| KernelError::Config("no input set".into()))?.q(n_new)?;
    let mut out = Output {
        o: gpu.zeros(q.shape(), q.dtype())?,
        lse: gpu.zeros(&q.shape()[..3], DType::F32)?,
    };
    Ok(Box::new(move |i| {
        let s = &sets[i];
        decode::forward_into(gpu, s.q(n_new)?, s.cache(lengths), &opts, &mut out)?;
        Ok(Vec::new())
    }))
}

/// What one call of a decoding case does ([`decode::forward_with_stats`] on input set 0, untimed):
/// the kernel and split count that ran, and FlashDecoding++'s fallback rows.
pub(super) fn decode_stats(
    rung: GpuRung,
    gpu: &Gpu,
    sets: &[DecodeSet],
    n_new: usize,
    lengths: &[usize],
    opts: DecodeOptions,
) -> ladder_kernels::Result<DecodeStats> {
    let s = sets.first().ok_or_else(|| KernelError::Config("no input set".into()))?;
    let opts = rung.decode_options(&opts);
    Ok(decode::forward_with_stats(gpu, s.q(n_new)?, s.cache(lengths), &opts)?.1)
}

/// Elements of the pseudo-random block a KV cache repeats (odd, so that the pattern does not line
/// up with rows of d elements).
const CACHE_BLOCK: usize = (1 << 20) + 7;

/// Deterministic pseudo-random inputs in [-1, 1), generated once per slot and length and reused
/// across cases (every default case has tokens × hidden elements per tensor). KV caches (up to
/// tens of GB) repeat one block of [`CACHE_BLOCK`] values, kept in the 16-bit type it is
/// uploaded in, and grown as larger caches come.
#[derive(Default)]
pub(super) struct HostPool {
    slots: Vec<Vec<f32>>,
    cache_f16: Vec<half::f16>,
    cache_bf16: Vec<half::bf16>,
}

/// `buf` extended to at least `len` elements by repeating `block` (converted by `conv`).
fn repeat_to<T: Copy>(buf: &mut Vec<T>, block: &[f32], len: usize, conv: fn(f32) -> T) {
    if buf.len() >= len {
        return;
    }
    let block: Vec<T> = block.iter().map(|&x| conv(x)).collect();
    buf.reserve_exact(len - buf.len());
    while buf.len() < len {
        let start = buf.len() % block.len();
        let take = (block.len() - start).min(len - buf.len());
        buf.extend_from_slice(&block[start..start + take]);
    }
}

impl HostPool {
    /// Upload a `[batch, heads_kv, L, d]` cache tensor in `dtype` (16-bit), its values starting
    /// `shift` elements into the repeated block.
    fn upload_cache(
        &mut self,
        gpu: &Gpu,
        shape: &[usize],
        dtype: DType,
        shift: usize,
    ) -> ladder_kernels::Result<Tensor> {
        let len: usize = shape.iter().product();
        let shift = shift % CACHE_BLOCK;
        let block = cases::pseudo_random(u64::MAX, CACHE_BLOCK);
        match dtype {
            DType::F16 => {
                repeat_to(&mut self.cache_f16, &block, len + shift, half::f16::from_f32);
                gpu.upload_slice(&self.cache_f16[shift..shift + len], shape)
            }
            DType::BF16 => {
                repeat_to(&mut self.cache_bf16, &block, len + shift, half::bf16::from_f32);
                gpu.upload_slice(&self.cache_bf16[shift..shift + len], shape)
            }
            DType::F32 => Err(KernelError::UnsupportedDtype {
                rung: "flash-decoding",
                dtype,
                supported: "fp16, bf16",
            }),
        }
    }

    /// Give back the host copy of the caches (at the end of the decoding cases).
    pub(super) fn release_caches(&mut self) {
        self.cache_f16 = Vec::new();
        self.cache_bf16 = Vec::new();
    }

    pub(super) fn values(&mut self, slot: usize, len: usize) -> &[f32] {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, Vec::new);
        }
        if self.slots[slot].len() != len {
            self.slots[slot] = cases::pseudo_random(slot as u64, len);
        }
        &self.slots[slot]
    }
}

/// How many input sets to rotate among so that they do not all sit in L2.
fn sets_for(bytes_per_set: usize) -> usize {
    if bytes_per_set >= L2_BYTES {
        1
    } else {
        (2 * L2_BYTES).div_ceil(bytes_per_set.max(1)).clamp(2, 32)
    }
}

pub(super) fn upload_sets(
    gpu: &Gpu,
    pool: &mut HostPool,
    plan: &Plan,
    (d, n): (usize, usize),
    layout: LayoutArg,
    with_d_o: bool,
) -> ladder_kernels::Result<Vec<InputSet>> {
    let (batch, heads) = plan.dims(d, n);
    // In memory as the layout says; the rungs get [batch, heads, n, d] views.
    let shape = match layout {
        LayoutArg::Bhsd => [batch, heads, n, d],
        LayoutArg::Bshd => [batch, n, heads, d],
    };
    let view = |t: Tensor| match layout {
        LayoutArg::Bhsd => Ok(t),
        LayoutArg::Bshd => t.transpose(1, 2),
    };
    let len = batch * heads * n * d;
    let tensors = if with_d_o { 4 } else { 3 };
    let sets = sets_for(tensors * len * plan.dtype.size());
    (0..sets)
        .map(|s| {
            let mut up = |role: usize| {
                view(gpu.upload(pool.values(4 * s + role, len), &shape, plan.dtype)?)
            };
            Ok(InputSet {
                q: up(0)?,
                k: up(1)?,
                v: up(2)?,
                d_o: if with_d_o { Some(up(3)?) } else { None },
            })
        })
        .collect()
}

/// Upload the inputs of a decoding shape at head dim `d` in `layout`: as many sets as rotate out
/// of L2 (one when the cache is larger than L2), each a query per count in `new_tokens` and a full
/// KV cache. A paged cache holds exactly the pages its sequences fill, `ceil(L / page_size)` each,
/// handed out in a shuffled order (as an allocator that has served many requests would), so that
/// consecutive pages of a sequence are not neighbours in memory. With `axes` = bshd, Q and the
/// cache lie token-major in memory (`[batch, n_new, heads_q, d]`, `[batch, L, heads_kv, d]`,
/// pages `[page, page_size, heads_kv, d]`: FlashAttention's `k_cache`, vLLM's NHD) and the rung
/// gets `[.., heads, tokens, d]` views.
#[allow(clippy::too_many_arguments)]
pub(super) fn upload_decode_sets(
    gpu: &Gpu,
    pool: &mut HostPool,
    plan: &Plan,
    d: usize,
    shape: DecodeShape,
    layout: CacheLayout,
    axes: LayoutArg,
    new_tokens: &[usize],
) -> ladder_kernels::Result<Vec<DecodeSet>> {
    // In memory as `axes` says (axes 1 and 2 swapped for bshd); the rung gets the view.
    let in_memory = |[a, b, c, d]: [usize; 4]| match axes {
        LayoutArg::Bhsd => [a, b, c, d],
        LayoutArg::Bshd => [a, c, b, d],
    };
    let view = |t: Tensor| match axes {
        LayoutArg::Bhsd => Ok(t),
        LayoutArg::Bshd => t.transpose(1, 2),
    };
    let DecodeShape { batch, heads_q, heads_kv, len } = shape;
    let q_len = |n_new: usize| batch * heads_q * n_new * d;
    let (kv_shape, pages_per_seq) = match layout {
        CacheLayout::Contiguous => ([batch, heads_kv, len, d], 0),
        CacheLayout::Paged(page) => {
            let per_seq = len.div_ceil(page);
            ([batch * per_seq, heads_kv, page, d], per_seq)
        }
    };
    let q_bytes: usize = new_tokens.iter().map(|&n| q_len(n) * plan.dtype.size()).sum();
    let sets = sets_for(shape.kv_bytes(d, plan.dtype) + q_bytes);
    (0..sets)
        .map(|s| {
            let qs = new_tokens
                .iter()
                .map(|&n| {
                    let q = gpu.upload(
                        pool.values(4 * s, q_len(n)),
                        &in_memory([batch, heads_q, n, d]),
                        plan.dtype,
                    )?;
                    Ok((n, view(q)?))
                })
                .collect::<ladder_kernels::Result<_>>()?;
            let kv_shape = in_memory(kv_shape);
            let k = view(pool.upload_cache(gpu, &kv_shape, plan.dtype, (2 * s) * 7919)?)?;
            let v = view(pool.upload_cache(gpu, &kv_shape, plan.dtype, (2 * s + 1) * 7919)?)?;
            let page_table = match layout {
                CacheLayout::Contiguous => None,
                CacheLayout::Paged(_) => {
                    let pages = batch * pages_per_seq;
                    let entries: Vec<i32> = cases::permutation(s as u64, pages)
                        .into_iter()
                        .map(|p| i32::try_from(p).unwrap_or(i32::MAX))
                        .collect();
                    Some(PageTable::upload(gpu, &entries, batch, pages_per_seq)?)
                }
            };
            Ok(DecodeSet { qs, k, v, page_table })
        })
        .collect()
}

/// The median time of one case.
pub(super) struct Timing {
    pub(super) ms: f64,
    pub(super) samples: usize,
    pub(super) calls_per_sample: usize,
    /// Wall time of the untimed first call (kernel compilation or cache load included).
    pub(super) first_call_s: f64,
}

pub(super) fn measure(
    gpu: &Gpu,
    step: &mut Step<'_>,
    sets: usize,
    warmup: usize,
    repeats: usize,
    budget_ms: f64,
) -> ladder_kernels::Result<Timing> {
    let mut next = 0;
    let mut call = |keep: &mut Vec<Vec<Tensor>>| -> ladder_kernels::Result<()> {
        keep.push(step(next % sets)?);
        next += 1;
        Ok(())
    };
    // The first call compiles the kernel (or loads it from the disk cache): not timed.
    let first = Instant::now();
    call(&mut Vec::new())?;
    gpu.synchronize()?;
    let first_call_s = first.elapsed().as_secs_f64();
    let mut single = f64::INFINITY;
    for _ in 0..warmup {
        let mut keep = Vec::new();
        let ms = gpu.time_ms(|| call(&mut keep))?;
        single = single.min(f64::from(ms));
    }
    let calls = ((SAMPLE_MS / single.max(1e-4)).ceil() as usize).clamp(1, 64);
    let mut samples = Vec::with_capacity(repeats);
    let mut total = 0.0;
    for _ in 0..repeats {
        let mut keep = Vec::with_capacity(calls);
        let ms = f64::from(gpu.time_ms(|| (0..calls).try_for_each(|_| call(&mut keep)))?);
        drop(keep); // freed after the end event, in stream order
        samples.push(ms / calls as f64);
        total += ms;
        if total > budget_ms {
            break;
        }
    }
    samples.sort_by(f64::total_cmp);
    let mid = samples.len() / 2;
    let ms =
        if samples.len() % 2 == 1 { samples[mid] } else { (samples[mid - 1] + samples[mid]) / 2.0 };
    Ok(Timing { ms, samples: samples.len(), calls_per_sample: calls, first_call_s })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_rotate_only_when_they_fit_in_l2() {
        // Default shapes: 16k tokens × 2048 × 2 bytes = 64 MiB per tensor.
        assert_eq!(sets_for(3 * 16384 * 2048 * 2), 1);
        assert_eq!(sets_for(10 << 20), 10);
        assert_eq!(sets_for(1), 32);
    }

    #[test]
    fn host_inputs_are_deterministic_and_in_range() {
        let mut pool = HostPool::default();
        let a = pool.values(3, 1000).to_vec();
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.1, "{mean}");
        assert_ne!(a, pool.values(2, 1000));
        assert_eq!(a, HostPool::default().values(3, 1000));
    }

    #[test]
    fn caches_repeat_one_block_and_grow_in_place() {
        let block: Vec<f32> = (0..5).map(|i| i as f32).collect();
        let mut buf: Vec<f32> = Vec::new();
        repeat_to(&mut buf, &block, 7, |x| x);
        assert_eq!(buf, [0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 1.0]);
        repeat_to(&mut buf, &block, 12, |x| x);
        assert_eq!(buf[5..], [0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 1.0]);
        repeat_to(&mut buf, &block, 3, |x| x);
        assert_eq!(buf.len(), 12, "never shrinks");
    }
}
