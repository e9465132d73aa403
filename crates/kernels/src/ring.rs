//! Past the ladder: ring attention, the sequence shared among ranks (Liu, Zaharia, Abbeel 2023).
//!
//! Each of `P` ranks holds a slice of the queries and a slice of the keys and values; the K/V
//! slices travel round a ring, one hop per step, and every rank attends its queries to the slice
//! it holds, merging each partial `(O_s, lse_s)` into its rows' running `(O, lse)` by the
//! log-sum-exp rule FlashDecoding combines its splits with (`cuda/combine.cuh`, shared):
//!
//! ```text
//! rank r, step s = 0 … P−1:   K, V of rank (r − s) mod P arrive (and are sent on to rank r + 1)
//!                             (O_s, lse_s) = attention(Q_r, K, V)    FA3 on Hopper, else FA2
//!                             (O, lse) ← combine((O, lse), (O_s, lse_s))      in f32
//! ```
//!
//! Under the causal mask the **zigzag** sharding ([`Sharding::Zigzag`], ring-flash-attention's)
//! gives rank `r` chunks `r` and `2P − 1 − r` of `2P`, so that every rank attends about as many
//! pairs at every step; a chunk pair the mask empties is skipped, the diagonal one runs causal.
//! The CPU rung, `ladder_reference::ring`, has the same schedule, the figures of its balance and
//! the backward pass.
//!
//! **Simulated ranks.** This module runs the `P` ranks on one GPU: each rank's K/V slice is a
//! buffer of its own, packed from the caller's K and V (`ring_gather`), and at every step the
//! slices pass to the next rank by device-to-device copies on a second stream while the step's
//! attention runs on the [`Gpu`]'s. The arithmetic, the schedule and the overlap are those of a
//! ring of GPUs; the transport (NCCL send/recv between devices) is the part a multi-GPU build adds.
//! It is a check of the algorithm on real kernels, not a speed-up: one GPU does all `P` ranks'
//! work.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DeviceRepr};

use crate::compile::Variant;
use crate::error::{KernelError, Result};
use crate::gpu::Kernel;
use crate::problem::Strides;
use crate::{DType, Gpu, Gradients, Options, Output, Problem, Tensor, attention};

/// The CUDA source of the ring's own kernels (gather, merge, finish).
pub const SRC: &str = include_str!("../cuda/ring.cu");

/// Threads per block of the ring's kernels.
const THREADS: u32 = 256;

/// How the sequence is cut among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Rank `r` holds the `r`-th of `P` equal slices.
    Contiguous,
    /// `2P` chunks; rank `r` holds chunks `r` and `2P − 1 − r` (ring-flash-attention's zigzag).
    Zigzag,
}

/// How many ranks share the sequence, and how it is cut among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOptions {
    /// Ranks in the ring (at least 1).
    pub ranks: usize,
    /// How the sequence is cut among them.
    pub sharding: Sharding,
}

impl RingOptions {
    /// `ranks` ranks with the zigzag sharding.
    pub fn new(ranks: usize) -> RingOptions {
        RingOptions { ranks, sharding: Sharding::Zigzag }
    }

    /// These options with `sharding`.
    pub fn with_sharding(self, sharding: Sharding) -> RingOptions {
        RingOptions { sharding, ..self }
    }
}

/// The token ranges each rank holds, in sequence order: one (contiguous) or two (zigzag), as equal
/// as `n` allows (chunk lengths differ by at most one; some are empty when `n` is short). The
/// same cut as `ladder_reference::ring::shards` (`crates/compare/tests/ring.rs` holds them equal).
pub fn shards(n: usize, ranks: usize, sharding: Sharding) -> Vec<Vec<Range<usize>>> {
    let cut = |pieces: usize, i: usize| i * n / pieces..(i + 1) * n / pieces;
    (0..ranks)
        .map(|r| match sharding {
            Sharding::Contiguous => vec![cut(ranks, r)],
            Sharding::Zigzag => vec![cut(2 * ranks, r), cut(2 * ranks, 2 * ranks - 1 - r)],
        })
        .collect()
}

/// How a query chunk meets a key chunk: `Some(true)` the causal square of one chunk, `Some(false)`
/// every pair visible, `None` nothing (a key chunk after the query chunk under the causal mask).
fn meets(causal: bool, q: &Range<usize>, k: &Range<usize>) -> Option<bool> {
    if q.is_empty() || k.is_empty() || (causal && k.start > q.start) {
        None
    } else {
        Some(causal && k.start == q.start)
    }
}

/// Ring attention forward on `ring.ranks` simulated ranks (see the module docs): what
/// [`attention::forward`] returns on the whole sequence, `q`, `k`, `v` `[batch, heads, n, d]`
/// with `n_q = n_kv`, fp16 or bf16, any strides the kernels take. It takes the causal mask or
/// none, and sinks (joined once, at the end); windows and modifiers are refused with an error,
/// since their positions would have to be global in every chunk pair.
pub fn forward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &Options,
    ring: &RingOptions,
) -> Result<Output> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    check(&p, ring, crate::fa2::HEAD_DIMS)?;
    let kernels = RingKernels::new(gpu, p.dtype)?;
    let (b, hq, n, d) = (p.batch, p.heads_q, p.n_q, p.d);
    let mut acc = gpu.zeros(&[b, hq, n, d], DType::F32)?;
    let mut lse_acc = gpu.upload(&vec![f32::NEG_INFINITY; b * hq * n], &[b, hq, n], DType::F32)?;
    // Every chunk pair runs without the sinks (they join once, in `finish`).
    let pair = Options { sinks: None, ..opts.clone() };
    walk(gpu, &kernels, &p, (k, v), ring, |chunks| {
        let out = attention::forward(
            gpu,
            &q.narrow(2, chunks.q.start, chunks.q.len())?,
            &chunks.k,
            &chunks.v,
            &Options { causal: chunks.square, ..pair.clone() },
        )?;
        kernels.merge(gpu, &p, &out, &mut acc, &mut lse_acc, chunks.q.start)
    })?;
    kernels.finish(gpu, &p, q, &acc, &lse_acc)
}

/// Ring attention backward on `ring.ranks` simulated ranks: the gradients of [`forward`] (whose
/// `out` it takes, with the upstream gradient `d_o` laid out like `q`), what
/// [`attention::backward`] returns on the whole sequence. The K/V slices travel the ring as in the
/// forward pass; each chunk pair's backward, given its query rows' *global* lse (and O, whose
/// rows give `D = rowsum(dO ∘ O)`), yields exactly its share of dQ, dK and dV, which are summed in
/// f32 by row (on a ring of GPUs, dK and dV travel with their slice and are home after `P`
/// steps; one GPU adds them where they belong, in the same order). The sinks' gradient comes
/// from each query chunk's pair with its own keys, once per row. Head dimensions up to 128 (the
/// backward kernels').
#[allow(clippy::too_many_arguments)] // the forward's inputs, its output and dO: as `attention::backward`
pub fn backward(
    gpu: &Gpu,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Output,
    d_o: &Tensor,
    opts: &Options,
    ring: &RingOptions,
) -> Result<Gradients> {
    let p = Problem::new(gpu, q, k, v, opts)?;
    check(&p, ring, crate::fa2::BACKWARD_HEAD_DIMS)?;
    p.require_like(gpu, "out.o", &out.o, q.shape(), p.dtype)?;
    p.require_like(gpu, "d_o", d_o, q.shape(), p.dtype)?;
    p.require_like(gpu, "out.lse", &out.lse, &[p.batch, p.heads_q, p.n_q], DType::F32)?;
    if !out.lse.is_contiguous() {
        return Err(KernelError::Shape("out.lse must be contiguous".to_string()));
    }
    let kernels = RingKernels::new(gpu, p.dtype)?;
    let (b, hq, hkv, n, d) = (p.batch, p.heads_q, p.heads_kv, p.n_q, p.d);
    let mut dq = gpu.zeros(&[b, hq, n, d], DType::F32)?;
    let mut dk = gpu.zeros(&[b, hkv, n, d], DType::F32)?;
    let mut dv = gpu.zeros(&[b, hkv, n, d], DType::F32)?;
    let mut dsinks: Option<Vec<f32>> = p.sinks.as_ref().map(|_| vec![0.0; hq]);
    let pair = Options { sinks: None, ..opts.clone() };
    walk(gpu, &kernels, &p, (k, v), ring, |chunks| {
        let (qc, kc) = (&chunks.q, &chunks.k_rows);
        let rows = |t: &Tensor| t.narrow(2, qc.start, qc.len());
        let part = Output { o: rows(&out.o)?, lse: kernels.lse_rows(gpu, &p, &out.lse, qc)? };
        // The sinks' gradient: once per query row, from the pair of its chunk with itself.
        let sinks = if qc == kc { p.sinks.clone() } else { None };
        let g = attention::backward(
            gpu,
            &rows(q)?,
            &chunks.k,
            &chunks.v,
            &part,
            &rows(d_o)?,
            &Options { causal: chunks.square, sinks, ..pair.clone() },
        )?;
        kernels.add(gpu, &p, &g.dq, &mut dq, qc.start)?;
        kernels.add(gpu, &p, &g.dk, &mut dk, kc.start)?;
        kernels.add(gpu, &p, &g.dv, &mut dv, kc.start)?;
        if let (Some(sum), Some(part)) = (dsinks.as_mut(), g.dsinks) {
            sum.iter_mut().zip(part.to_f32_vec()?).for_each(|(s, x)| *s += x);
        }
        Ok(())
    })?;
    Ok(Gradients {
        dq: kernels.cast(gpu, &p, &dq, q)?,
        dk: kernels.cast(gpu, &p, &dk, k)?,
        dv: kernels.cast(gpu, &p, &dv, v)?,
        dsinks: dsinks.map(|s| gpu.upload(&s, &[hq], DType::F32)).transpose()?,
    })
}

/// One chunk pair of the ring: a rank's query chunk `q` (rows of the sequence) and a key chunk it
/// holds, as views `k` and `v` of its K/V slice and as the rows `k_rows` of the sequence;
/// `square` when it is the causal square of one chunk.
struct ChunkPair {
    q: Range<usize>,
    k_rows: Range<usize>,
    k: Tensor,
    v: Tensor,
    square: bool,
}

/// The ring's schedule on simulated ranks: packs each rank's K/V slice, and at every step calls
/// `attend` on each chunk pair the mask leaves (rank by rank) while the slices travel to the next
/// rank on a second stream.
fn walk(
    gpu: &Gpu,
    kernels: &RingKernels,
    p: &Problem,
    (k, v): (&Tensor, &Tensor),
    ring: &RingOptions,
    mut attend: impl FnMut(ChunkPair) -> Result<()>,
) -> Result<()> {
    let ranks = ring.ranks;
    let shards = shards(p.n_q, ranks, ring.sharding);
    // Each rank's slice of K and V, its chunks packed one after the other.
    let capacity = shards.iter().map(|c| c.iter().map(Range::len).sum()).max().unwrap_or(0);
    let mut held = shards
        .iter()
        .map(|chunks| {
            Ok([
                kernels.gather(gpu, p, k, p.strides[1], chunks, capacity)?,
                kernels.gather(gpu, p, v, p.strides[2], chunks, capacity)?,
            ])
        })
        .collect::<Result<Vec<[Tensor; 2]>>>()?;
    // The stream the slices travel on, beside the one the attention runs on.
    let transfer =
        gpu.stream().fork().map_err(KernelError::driver("creating the ring's transfer stream"))?;
    // The next step's slices, on their way while a step attends: rank r's is rank r − 1's. Kept
    // out here so that, on an error, they outlive the join below.
    let mut incoming: Option<Vec<[Tensor; 2]>> = None;
    let steps = (|| -> Result<()> {
        for step in 0..ranks {
            if step + 1 < ranks {
                send(gpu, &transfer, &held, &mut incoming)?;
            }
            attend_step(p, &shards, step, &held, &mut attend)?;
            if let Some(next) = incoming.take() {
                // The next step reads the copies: the attention stream waits for them.
                gpu.stream()
                    .join(&transfer)
                    .map_err(KernelError::driver("waiting for the ring's transfers"))?;
                held = next;
            }
        }
        Ok(())
    })();
    // On every exit, an error's included, the attention stream waits for the copies queued on the
    // transfer stream before any slice they read or write is freed (a buffer's free is queued on
    // the attention stream).
    let joined = gpu
        .stream()
        .join(&transfer)
        .map_err(KernelError::driver("waiting for the ring's transfers"));
    steps.and(joined)
}

/// Step `step` of the ring: `attend` on every chunk pair the mask leaves, rank by rank, each rank
/// holding the slice of rank `r − step`.
fn attend_step(
    p: &Problem,
    shards: &[Vec<Range<usize>>],
    step: usize,
    held: &[[Tensor; 2]],
    attend: &mut impl FnMut(ChunkPair) -> Result<()>,
) -> Result<()> {
    let ranks = shards.len();
    for (r, (queries, [k_held, v_held])) in shards.iter().zip(held).enumerate() {
        let keys = &shards[(r + ranks - step) % ranks];
        for qc in queries {
            let mut at = 0; // the key chunk's first row in the held slice
            for kc in keys {
                let offset = at;
                at += kc.len();
                let Some(square) = meets(p.causal, qc, kc) else { continue };
                attend(ChunkPair {
                    q: qc.clone(),
                    k_rows: kc.clone(),
                    k: k_held.narrow(2, offset, kc.len())?,
                    v: v_held.narrow(2, offset, kc.len())?,
                    square,
                })?;
            }
        }
    }
    Ok(())
}

/// The most ranks a ring takes: far past any GPU count, and small enough that `2 · ranks` chunks
/// and `ranks²` chunk pairs stay well inside `usize`.
pub const MAX_RANKS: usize = 1 << 16;

/// What the ring refuses, whatever the rung underneath would take: `head_dims` are those of the
/// pass (the backward kernels stop at 128), checked here rather than at the first chunk pair.
fn check(p: &Problem, ring: &RingOptions, head_dims: &'static [usize]) -> Result<()> {
    if ring.ranks == 0 || ring.ranks > MAX_RANKS {
        return Err(KernelError::Shape(format!(
            "a ring takes 1 to {MAX_RANKS} ranks, got {}",
            ring.ranks
        )));
    }
    if !head_dims.contains(&p.d) {
        return Err(KernelError::UnsupportedHeadDim { rung: "ring", d: p.d, supported: head_dims });
    }
    if p.n_q != p.n_kv {
        return Err(KernelError::Shape(format!(
            "ring attention shares one sequence among the ranks: n_q = n_kv, got {} and {}",
            p.n_q, p.n_kv
        )));
    }
    p.require_dtype("ring", crate::fa2::DTYPES, "fp16, bf16")?;
    p.require_no_window("ring")?;
    p.require_no_score_mod("ring")?;
    p.require_no_mask_mod("ring")
}

/// Every rank's next slice, rank `r − 1`'s, copied on the `transfer` stream into `next` (the
/// caller's, so that on an error the buffers outlive its join of the transfer stream): the
/// buffers are allocated on the attention stream, which the transfer stream waits for (the
/// allocations, and the step before's reads of the slices the copies read), so the copies overlap
/// this step's attention.
fn send(
    gpu: &Gpu,
    transfer: &Arc<CudaStream>,
    held: &[[Tensor; 2]],
    next: &mut Option<Vec<[Tensor; 2]>>,
) -> Result<()> {
    let ranks = held.len();
    let next = next.insert(
        held.iter()
            .map(|[k, v]| {
                Ok([gpu.output(k.shape(), k.dtype())?, gpu.output(v.shape(), v.dtype())?])
            })
            .collect::<Result<Vec<[Tensor; 2]>>>()?,
    );
    transfer.join(gpu.stream()).map_err(KernelError::driver("ordering the ring's transfers"))?;
    for (r, to) in next.iter_mut().enumerate() {
        for (from, to) in held[(r + ranks - 1) % ranks].iter().zip(to.iter_mut()) {
            let bytes = from.len() * from.dtype().size();
            let (src, _read) = from.read_ptr(transfer);
            let (dst, _write) = to.write_ptr(transfer)?;
            // SAFETY: both are whole packed slices of `bytes` bytes (`gather`'s, or an earlier
            // copy's), alive until the attention stream has waited for this copy.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, transfer.cu_stream())
            }
            .map_err(KernelError::driver("passing a K/V slice along the ring"))?;
        }
    }
    Ok(())
}

/// A `[batch, heads, rows, d]` tensor as `ring.cu` reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RingTensor {
    base: u64,
    strides: Strides,
}

/// Mirror of `RingParams` in `cuda/ring.cu` (device pointers as `u64`; 0 where a kernel takes
/// none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RingParams {
    src: RingTensor,
    dst: u64,
    dst_strides: Strides,
    acc: u64,
    lse_acc: u64,
    lse_part: u64,
    lse_out: u64,
    sinks: u64,
    batch: i32,
    heads: i32,
    rows: i32,
    d: i32,
    n: i32,
    capacity: i32,
    src_row: i32,
    at: i32,
}

// SAFETY: plain #[repr(C)] structs of integers, laid out as their CUDA mirrors.
unsafe impl DeviceRepr for RingParams {}

/// The variant of `ring.cu` for `dtype`.
fn variant(dtype: DType) -> Variant {
    Variant::new("ring", SRC, vec![("LADDER_DTYPE", dtype.code().to_string())])
}

/// Every variant of the ring's kernels (the compile check's).
#[cfg(test)]
pub(crate) fn variants() -> Vec<Variant> {
    crate::fa2::DTYPES.iter().map(|&dtype| variant(dtype)).collect()
}

/// `x` as the kernels' `int` (the tensors' sizes are checked by [`Problem::new`], the ring's
/// own here).
fn int(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| KernelError::Shape(format!("the ring's {what} ({x}) exceed i32::MAX")))
}

/// The grid of a loop over `items` work items of `per_item` threads each.
fn grid(items: usize, per_item: usize) -> (u32, u32, u32) {
    let blocks = (items * per_item).div_ceil(THREADS as usize).clamp(1, 1 << 20);
    (blocks as u32, 1, 1)
}

/// The ring's kernels of one element type, compiled.
struct RingKernels {
    gather: Kernel,
    merge: Kernel,
    finish: Kernel,
    add: Kernel,
    lse_rows: Kernel,
}

impl RingKernels {
    fn new(gpu: &Gpu, dtype: DType) -> Result<RingKernels> {
        let kernel = |entry| Kernel { variant: variant(dtype), entry };
        let kernels = RingKernels {
            gather: kernel("ring_gather"),
            merge: kernel("ring_merge"),
            finish: kernel("ring_finish"),
            add: kernel("ring_add"),
            lse_rows: kernel("ring_lse_rows"),
        };
        for k in [&kernels.gather, &kernels.merge, &kernels.finish, &kernels.add, &kernels.lse_rows]
        {
            gpu.prepare(k, 0)?;
        }
        Ok(kernels)
    }

    /// A rank's slice of `x` (K or V, whose rows lie at `strides`): its `chunks`, one after the
    /// other, in a packed `[batch, heads_kv, capacity, d]` buffer.
    fn gather(
        &self,
        gpu: &Gpu,
        p: &Problem,
        x: &Tensor,
        strides: Strides,
        chunks: &[Range<usize>],
        capacity: usize,
    ) -> Result<Tensor> {
        let (b, h, d) = (p.batch, p.heads_kv, p.d);
        let mut slice = gpu.output(&[b, h, capacity, d], p.dtype)?;
        let mut at = 0;
        for c in chunks.iter().filter(|c| !c.is_empty()) {
            let (src, _read) = x.read_ptr(gpu.stream());
            let (dst, _write) = slice.write_ptr(gpu.stream())?;
            let params = RingParams {
                src: RingTensor { base: src, strides },
                dst,
                batch: int(b, "batch")?,
                heads: int(h, "heads")?,
                rows: int(c.len(), "rows")?,
                d: int(d, "head dim")?,
                capacity: int(capacity, "slice rows")?,
                src_row: int(c.start, "rows")?,
                at: int(at, "slice rows")?,
                ..RingParams::default()
            };
            gpu.launch(&self.gather, grid(b * h * c.len(), d / 8), THREADS, 0, &params)?;
            at += c.len();
        }
        Ok(slice)
    }

    /// Merges one chunk pair's `(O_s, lse_s)` (`part`, rows `at …` of the sequence) into the
    /// running `(acc, lse_acc)`.
    fn merge(
        &self,
        gpu: &Gpu,
        p: &Problem,
        part: &Output,
        acc: &mut Tensor,
        lse_acc: &mut Tensor,
        at: usize,
    ) -> Result<()> {
        let rows = part.o.shape()[2];
        if !part.lse.is_contiguous() {
            return Err(KernelError::Shape("the ring merges a contiguous lse".to_string()));
        }
        let strides = Strides::of(&part.o, "O")?;
        let s = gpu.stream();
        let (o, _g0) = part.o.read_ptr(s);
        let (lse_part, _g1) = part.lse.read_ptr(s);
        let (acc_ptr, _g2) = acc.write_ptr(s)?;
        let (lse_ptr, _g3) = lse_acc.write_ptr(s)?;
        let params = RingParams {
            src: RingTensor { base: o, strides },
            acc: acc_ptr,
            lse_acc: lse_ptr,
            lse_part,
            batch: int(p.batch, "batch")?,
            heads: int(p.heads_q, "heads")?,
            rows: int(rows, "rows")?,
            d: int(p.d, "head dim")?,
            n: int(p.n_q, "rows")?,
            at: int(at, "rows")?,
            ..RingParams::default()
        };
        gpu.launch(&self.merge, grid(p.batch * p.heads_q * rows, 32), THREADS, 0, &params)
    }

    /// The output: the running O in `q`'s dtype and layout, the running lse, the sinks joined.
    fn finish(
        &self,
        gpu: &Gpu,
        p: &Problem,
        q: &Tensor,
        acc: &Tensor,
        lse_acc: &Tensor,
    ) -> Result<Output> {
        let mut lse = gpu.output(&[p.batch, p.heads_q, p.n_q], DType::F32)?;
        let sinks = match &p.sinks {
            // Checked against the heads by Problem::new.
            Some(sinks) => gpu.table(sinks.shared())?,
            None => 0,
        };
        let o = {
            let s = gpu.stream();
            let (lse_acc, _g0) = lse_acc.read_ptr(s);
            let (lse_out, _g1) = lse.write_ptr(s)?;
            self.write(
                gpu,
                p,
                acc,
                q,
                RingParams { lse_acc, lse_out, sinks, ..RingParams::default() },
            )?
        };
        Ok(Output { o, lse })
    }

    /// An f32 sum of gradients (`[batch, heads, n, d]`) in the dtype and layout of `like`.
    fn cast(&self, gpu: &Gpu, p: &Problem, acc: &Tensor, like: &Tensor) -> Result<Tensor> {
        self.write(gpu, p, acc, like, RingParams::default())
    }

    /// `ring_finish`: `acc` into a new tensor of `like`'s shape, dtype and layout, with `extra`'s
    /// lse and sinks (none for a gradient).
    fn write(
        &self,
        gpu: &Gpu,
        p: &Problem,
        acc: &Tensor,
        like: &Tensor,
        extra: RingParams,
    ) -> Result<Tensor> {
        let [b, heads, n, d] = like.shape() else {
            return Err(KernelError::Shape(format!(
                "the ring writes [b, h, n, d], not {:?}",
                like.shape()
            )));
        };
        let (b, heads, n, d) = (*b, *heads, *n, *d);
        let mut out = gpu.output_like(like, p.dtype)?;
        let dst_strides = Strides::of(&out, "the ring's output")?;
        {
            let s = gpu.stream();
            let (acc, _g0) = acc.read_ptr(s);
            let (dst, _g1) = out.write_ptr(s)?;
            let params = RingParams {
                dst,
                dst_strides,
                acc,
                batch: int(b, "batch")?,
                heads: int(heads, "heads")?,
                rows: int(n, "rows")?,
                d: int(d, "head dim")?,
                n: int(n, "rows")?,
                ..extra
            };
            gpu.launch(&self.finish, grid(b * heads * n, d / 8), THREADS, 0, &params)?;
        }
        Ok(out)
    }

    /// Adds a chunk pair's gradient `part` (`[batch, heads, rows, d]`) to rows `at …` of the f32
    /// sum `acc` (`[batch, heads, n, d]`).
    fn add(
        &self,
        gpu: &Gpu,
        p: &Problem,
        part: &Tensor,
        acc: &mut Tensor,
        at: usize,
    ) -> Result<()> {
        let [b, heads, rows, d] = part.shape() else {
            return Err(KernelError::Shape(format!(
                "the ring adds [b, h, n, d], not {:?}",
                part.shape()
            )));
        };
        let (b, heads, rows, d) = (*b, *heads, *rows, *d);
        let strides = Strides::of(part, "a gradient")?;
        let s = gpu.stream();
        let (src, _g0) = part.read_ptr(s);
        let (acc_ptr, _g1) = acc.write_ptr(s)?;
        let params = RingParams {
            src: RingTensor { base: src, strides },
            acc: acc_ptr,
            batch: int(b, "batch")?,
            heads: int(heads, "heads")?,
            rows: int(rows, "rows")?,
            d: int(d, "head dim")?,
            n: int(p.n_q, "rows")?,
            at: int(at, "rows")?,
            ..RingParams::default()
        };
        gpu.launch(&self.add, grid(b * heads * rows, d / 8), THREADS, 0, &params)
    }

    /// Rows `chunk` of the global `lse` (`[batch, heads_q, n]`), as a contiguous
    /// `[batch, heads_q, rows]` tensor: the lse a chunk pair's backward takes.
    fn lse_rows(
        &self,
        gpu: &Gpu,
        p: &Problem,
        lse: &Tensor,
        chunk: &Range<usize>,
    ) -> Result<Tensor> {
        let (b, hq) = (p.batch, p.heads_q);
        let mut rows = gpu.output(&[b, hq, chunk.len()], DType::F32)?;
        {
            let s = gpu.stream();
            let (lse_acc, _g0) = lse.read_ptr(s);
            let (lse_out, _g1) = rows.write_ptr(s)?;
            let params = RingParams {
                lse_acc,
                lse_out,
                batch: int(b, "batch")?,
                heads: int(hq, "heads")?,
                rows: int(chunk.len(), "rows")?,
                n: int(p.n_q, "rows")?,
                at: int(chunk.start, "rows")?,
                ..RingParams::default()
            };
            gpu.launch(&self.lse_rows, grid(b * hq * chunk.len(), 1), THREADS, 0, &params)?;
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_pairs_meet_as_the_causal_mask_says() {
        assert_eq!(meets(true, &(4..8), &(0..4)), Some(false));
        assert_eq!(meets(true, &(4..8), &(4..8)), Some(true));
        assert_eq!(meets(true, &(0..4), &(4..8)), None);
        assert_eq!(meets(false, &(0..4), &(4..8)), Some(false));
        assert_eq!(meets(false, &(0..0), &(4..8)), None);
    }
}
