//! Past the ladder: ring attention, the sequence split across devices.
//!
//! When a sequence no longer fits one GPU, each of `P` ranks holds a slice of the queries and a
//! slice of the keys and values; the K/V slices travel around a ring, one hop per step, and every
//! rank attends its queries to the slice it holds, keeping a partial `(O_s, lse_s)` per slice
//! (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers"). After `P` steps every
//! query has met every key, and the partials are merged by their log-sum-exp, exactly as
//! FlashDecoding merges its splits ([`crate::flash_decoding`]: here the splits live on different
//! devices):
//!
//! ```text
//! rank r, step s = 0 … P−1:   K, V of rank (r − s) mod P arrive (and are sent on to rank r + 1)
//!                             (O_s, lse_s) = attention(Q_r, K, V)       one FA2 call per chunk pair
//! then, per query row:        lse = log Σ_s exp(lse_s),   O = Σ_s exp(lse_s − lse) O_s
//! ```
//!
//! **Load balance under the causal mask.** With contiguous slices rank 0's queries see only its
//! own keys while rank `P − 1`'s see everyone's: the last rank works `P` steps, the first one.
//! The zigzag sharding (ring-flash-attention's) cuts the sequence into `2P` chunks and gives rank
//! `r` chunks `r` and `2P − 1 − r`, an early and a late one, so that every rank attends about the
//! same number of pairs at every step ([`RingOutput::work`] counts them).
//!
//! **Backward.** The gradients come the same way round the ring: each chunk pair's FA2 backward,
//! given the *global* `lse` and `D = rowsum(dO ∘ O)` of its query rows, yields exactly its share of
//! `dQ`, `dK` and `dV` (`P = exp(S − lse)` is the global probability); `dQ` stays on the query's
//! rank, `dK` and `dV` travel with their K/V slice and are home after `P` steps.
//!
//! This CPU rung runs the ranks as slices of one problem, in order; `ladder-kernels` will run it
//! over NCCL. It takes the causal mask or none, and sinks (one more partial in the merge), not yet
//! windows or modifiers, whose positions would have to be global.

use std::ops::Range;

use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, ArrayView4, Axis, s};

use crate::element::Element;
use crate::error::{Result, invalid};
use crate::fa2::{self, Fa2Options};
use crate::flash_decoding::combine_row;
use crate::options::{AttentionOptions, TileSizes};
use crate::output::{AttentionOutput, Gradients, RunStats};
use crate::shape::AttentionShape;

/// How the sequence is cut among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Rank `r` holds the `r`-th of `P` equal slices.
    Contiguous,
    /// `2P` chunks; rank `r` holds chunks `r` and `2P − 1 − r` (ring-flash-attention's zigzag).
    Zigzag,
}

/// Options of the ring rung.
#[derive(Debug, Clone, PartialEq)]
pub struct RingOptions {
    pub attention: AttentionOptions,
    /// The FA2 tiles each chunk pair runs with.
    pub tiles: TileSizes,
    /// Ranks in the ring (at least 1).
    pub ranks: usize,
    pub sharding: Sharding,
}

impl RingOptions {
    /// `ranks` ranks with the zigzag sharding and FA2's default tiles.
    pub fn new(attention: AttentionOptions, ranks: usize) -> RingOptions {
        RingOptions { attention, tiles: TileSizes::default(), ranks, sharding: Sharding::Zigzag }
    }

    /// These options with `sharding`.
    pub fn with_sharding(self, sharding: Sharding) -> RingOptions {
        RingOptions { sharding, ..self }
    }

    fn check(&self, shape: &AttentionShape) -> Result<()> {
        self.check_ring()?;
        if shape.n_q != shape.n_kv {
            return Err(invalid(
                "ring",
                format!(
                    "ring attention shares one sequence among the ranks: n_q = n_kv, got {} and {}",
                    shape.n_q, shape.n_kv
                ),
            ));
        }
        Ok(())
    }

    /// What the ring takes whatever the shape: a rank or more, the causal mask or none.
    fn check_ring(&self) -> Result<()> {
        if self.ranks == 0 {
            return Err(invalid("ranks", "a ring needs at least 1 rank"));
        }
        let a = &self.attention;
        if a.window.is_some() || a.score_mod.is_some() || a.mask_mod.is_some() {
            return Err(invalid(
                "ring",
                "the causal mask or none, and sinks: windows and modifiers are not ring-sharded yet",
            ));
        }
        Ok(())
    }
}

/// The token ranges each rank holds, in sequence order: one (contiguous) or two (zigzag), as equal
/// as `n` allows (chunk lengths differ by at most one; some are empty when `n` is short).
pub fn shards(n: usize, ranks: usize, sharding: Sharding) -> Vec<Vec<Range<usize>>> {
    let cut = |pieces: usize, i: usize| i * n / pieces..(i + 1) * n / pieces;
    (0..ranks)
        .map(|r| match sharding {
            Sharding::Contiguous => vec![cut(ranks, r)],
            Sharding::Zigzag => vec![cut(2 * ranks, r), cut(2 * ranks, 2 * ranks - 1 - r)],
        })
        .collect()
}

/// What [`forward`] gives: the output, and the work of the ring.
#[derive(Debug, Clone)]
pub struct RingOutput<T> {
    pub out: AttentionOutput<T>,
    /// `work[s][r]`: the query–key pairs rank `r` attended at step `s` (of one head); a ring's
    /// step lasts as long as its busiest rank's.
    pub work: Vec<Vec<u64>>,
}

/// How a query chunk meets a key chunk: every pair visible, the causal square of one chunk, or
/// nothing (a key chunk after the query chunk under the causal mask).
fn meets(causal: bool, q: &Range<usize>, k: &Range<usize>) -> Option<bool> {
    if q.is_empty() || k.is_empty() || (causal && k.start > q.start) {
        None
    } else {
        Some(causal && k.start == q.start)
    }
}

/// The rows `r` of axis 2 of `a` (a chunk of the sequence).
fn chunk<'a, T: Element>(a: ArrayView4<'a, T>, r: &Range<usize>) -> ArrayView4<'a, T> {
    a.slice_move(s![.., .., r.clone(), ..])
}

/// One chunk pair the ring attends: at `step`, `rank`'s query chunk `q` against the key chunk `k`
/// it holds then, a causal square or fully visible.
struct Pair {
    step: usize,
    rank: usize,
    q: Range<usize>,
    k: Range<usize>,
    square: bool,
}

/// Every chunk pair the ring attends, in order: the key chunks of rank `(r − s) mod P` at step
/// `s`.
fn schedule(n: usize, opts: &RingOptions) -> Vec<Pair> {
    let shards = shards(n, opts.ranks, opts.sharding);
    let p = opts.ranks;
    let mut pairs = Vec::new();
    for step in 0..p {
        for r in 0..p {
            let src = (r + p - step) % p;
            for q in &shards[r] {
                for k in &shards[src] {
                    if let Some(square) = meets(opts.attention.causal, q, k) {
                        pairs.push(Pair { step, rank: r, q: q.clone(), k: k.clone(), square });
                    }
                }
            }
        }
    }
    pairs
}

impl Pair {
    /// The query–key pairs it attends (of one head): the causal square's triangle, or all.
    fn attended(&self) -> u64 {
        let (q, k) = (self.q.len() as u64, self.k.len() as u64);
        if self.square { q * (q + 1) / 2 } else { q * k }
    }
}

/// `work[s][r]`: the query–key pairs rank `r` attends at step `s` (of one head) on a sequence of
/// `n` tokens, counted without attending: what [`forward`] reports, for planning a ring of any
/// length (with [`critical_path`]).
pub fn work(n: usize, opts: &RingOptions) -> Result<Vec<Vec<u64>>> {
    opts.check_ring()?;
    let mut work = vec![vec![0u64; opts.ranks]; opts.ranks];
    for pair in schedule(n, opts) {
        work[pair.step][pair.rank] += pair.attended();
    }
    Ok(work)
}

/// The options of one chunk pair's FA2 call: the causal square or no mask, no sinks (they join
/// once, in the merge).
fn pair_options(opts: &RingOptions, square: bool) -> Fa2Options {
    let attention = AttentionOptions { causal: square, sinks: None, ..opts.attention.clone() };
    Fa2Options { attention, tiles: opts.tiles }
}

/// Ring attention forward: `q`, `k`, `v` the whole sequence (`[batch, heads, n, d]`, `n_q = n_kv`),
/// sharded among `opts.ranks` ranks; returns what FA2 on the whole sequence returns, and the work
/// of each rank at each step.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &RingOptions,
) -> Result<RingOutput<T>> {
    let shape = AttentionShape::of(&q, &k, &v)?;
    opts.check(&shape)?;
    if let Some(sinks) = &opts.attention.sinks {
        crate::sinks::check(sinks, shape.heads_q)?;
    }
    let (b, hq, n, d) = (shape.batch, shape.heads_q, shape.n_q, shape.d);
    // Each query row's partials, one per key chunk it met: (lse_s, O_s).
    let mut parts: Vec<Vec<(Array3<T>, Array4<T>)>> = vec![Vec::new(); n];
    for Pair { q: qr, k: kr, square, .. } in schedule(n, opts) {
        let out =
            fa2::forward(chunk(q, &qr), chunk(k, &kr), chunk(v, &kr), &pair_options(opts, square))?;
        for (i, row) in qr.clone().enumerate() {
            let lse = out.lse.slice(s![.., .., i..i + 1]).to_owned();
            parts[row].push((lse, out.o.slice(s![.., .., i..i + 1, ..]).to_owned()));
        }
    }
    // The merge: FlashDecoding's combine over each row's partials, the sink joining once.
    let mut o = Array4::zeros((b, hq, n, d));
    let mut lse = Array3::from_elem((b, hq, n), T::neg_infinity());
    for (row, row_parts) in parts.iter().enumerate() {
        for bi in 0..b {
            for h in 0..hq {
                let lse_s: Array1<T> = row_parts.iter().map(|(l, _)| l[[bi, h, 0]]).collect();
                let mut o_s = Array2::zeros((row_parts.len(), d));
                for (mut dst, (_, part)) in o_s.rows_mut().into_iter().zip(row_parts) {
                    dst.assign(&part.slice(s![bi, h, 0, ..]));
                }
                let sink = opts.attention.sinks.as_ref().map(|s| T::of(s[h]));
                let o_row = o.slice_mut(s![bi, h, row, ..]);
                lse[[bi, h, row]] = combine_row(lse_s.view(), o_s.view(), o_row, sink);
            }
        }
    }
    let stats = RunStats { work_items: opts.ranks, ..RunStats::default() };
    Ok(RingOutput { out: AttentionOutput { o, lse, stats }, work: work(n, opts)? })
}

/// Ring attention backward: the gradients FA2's backward gives on the whole sequence, computed
/// chunk pair by chunk pair with each query row's global `lse` (from [`forward`]) and `o`.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    o: ArrayView4<T>,
    d_o: ArrayView4<T>,
    lse: ArrayView3<T>,
    opts: &RingOptions,
) -> Result<Gradients<T>> {
    let shape = AttentionShape::of(&q, &k, &v)?;
    opts.check(&shape)?;
    shape.expect_like_q("o", &o)?;
    shape.expect_like_q("dO", &d_o)?;
    shape.expect_lse(&lse)?;
    let (mut dq, mut dk, mut dv) =
        (Array4::zeros(q.raw_dim()), Array4::zeros(k.raw_dim()), Array4::zeros(v.raw_dim()));
    for Pair { q: qr, k: kr, square, .. } in schedule(shape.n_q, opts) {
        let g = fa2::backward(
            chunk(q, &qr),
            chunk(k, &kr),
            chunk(v, &kr),
            chunk(o, &qr),
            chunk(d_o, &qr),
            lse.slice(s![.., .., qr.clone()]),
            &pair_options(opts, square),
        )?;
        // dQ stays with its rank; dK, dV travel with their slice: both are sums over the pairs.
        let add = |acc: &mut Array4<T>, r: &Range<usize>, part: &Array4<T>| {
            let mut dst = acc.slice_mut(s![.., .., r.clone(), ..]);
            dst.zip_mut_with(part, |a, &x| *a = *a + x);
        };
        add(&mut dq, &qr, &g.dq);
        add(&mut dk, &kr, &g.dk);
        add(&mut dv, &kr, &g.dv);
    }
    // The sinks' gradient needs only the global lse and D (crate::sinks).
    let dsinks = match &opts.attention.sinks {
        Some(sinks) => {
            crate::sinks::check(sinks, shape.heads_q)?;
            let delta = (&o.to_owned() * &d_o).sum_axis(Axis(3));
            Some(crate::sinks::gradient(sinks, lse, delta.view()))
        }
        None => None,
    };
    let stats = RunStats { work_items: opts.ranks, ..RunStats::default() };
    Ok(Gradients { dq, dk, dv, dsinks, stats })
}

/// The largest work of any rank at each step, summed over the steps: the ring's time in units of
/// attended pairs (a step lasts as long as its busiest rank), for comparing shardings.
pub fn critical_path(work: &[Vec<u64>]) -> u64 {
    work.iter().map(|step| step.iter().copied().max().unwrap_or(0)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_sequence_once() {
        for (n, p) in [(16, 4), (10, 3), (3, 4), (1, 1)] {
            for sharding in [Sharding::Contiguous, Sharding::Zigzag] {
                let mut covered = vec![0; n];
                for rank in shards(n, p, sharding) {
                    for r in rank {
                        r.for_each(|t| covered[t] += 1);
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "n {n}, P {p}, {sharding:?}");
            }
        }
        assert_eq!(shards(16, 2, Sharding::Zigzag), vec![vec![0..4, 12..16], vec![4..8, 8..12]]);
    }

    #[test]
    fn the_work_counts_every_attended_pair_once() {
        for (n, p) in [(16, 4), (10, 3), (3, 4), (1, 1), (131_072, 8)] {
            for sharding in [Sharding::Contiguous, Sharding::Zigzag] {
                for causal in [false, true] {
                    let attention = AttentionOptions { causal, ..AttentionOptions::default() };
                    let opts = RingOptions::new(attention, p).with_sharding(sharding);
                    let total: u64 = work(n, &opts).unwrap().iter().flatten().sum();
                    let n = n as u64;
                    let want = if causal { n * (n + 1) / 2 } else { n * n };
                    assert_eq!(total, want, "n {n}, P {p}, {sharding:?}, causal {causal}");
                }
            }
        }
        // Two ranks, zigzag, 8 tokens: rank 0 holds 0..2 and 6..8, rank 1 holds 2..4 and 4..6.
        // Step 0, each rank its own chunks: rank 0 the squares 0..2 (3) and 6..8 (3) and 6..8
        // against 0..2 (4); rank 1 the squares 2..4, 4..6 and 4..6 against 2..4, as many.
        // Step 1: rank 0's 6..8 against 2..4 and 4..6 (8), rank 1's 2..4 and 4..6 against 0..2.
        let causal = RingOptions::new(AttentionOptions::causal(), 2);
        assert_eq!(work(8, &causal).unwrap(), vec![vec![10, 10], vec![8, 8]]);
        assert!(work(8, &RingOptions::new(AttentionOptions::causal(), 0)).is_err());
    }
}
