//! Rung 4: FlashAttention-3-style attention (Shah et al. 2024), emulated on the CPU.
//!
//! FA3 computes exactly what FA2 computes; what changes is the *schedule*, to keep Hopper's
//! tensor cores busy while the much slower exponentials run. On an H100, `exp` throughput is
//! ~250× below matmul throughput, so for `d = 128` a tile's softmax takes about as long as one
//! of its two GEMMs. FA3 hides it two ways:
//!
//! - **Intra-warpgroup overlap** (Algorithm 2): issue `S_next = Q K_{j+1}ᵀ` and
//!   `O += P_j V_j` asynchronously, and compute the softmax of block `j + 1` while the tensor
//!   cores work. In the loop below the order of operations is exactly that: the scores of the
//!   next block are formed *before* the current block's `P V`, and the accumulator is rescaled
//!   *after* it, which is legal because `diag(α)(O + P V) = diag(α) O + diag(α) P V`.
//! - **Ping-pong between warpgroups**: two consumer warpgroups take turns, one's softmax running
//!   during the other's GEMMs; a producer warp feeds both through TMA (warp specialisation).
//!
//! A CPU has none of that hardware, so [`forward`] reproduces the *order* of Algorithm 2, and
//! [`timeline`] simulates the schedules on a tensor-core/softmax resource model so they can be
//! drawn and compared. The FP8 path ([`Fa3Precision::Fp8`]) quantises `Q, K, V` (and `P` before
//! the second GEMM) to e4m3 with per-block scales and optional incoherent processing
//! ([`crate::fp8`]); its error is compared with an FP8 tolerance, not the `f32` one.

use std::ops::Range;

use ndarray::{Array2, ArrayView4, s};

use crate::element::Element;
use crate::error::Result;
use crate::fp8::{Fp8Options, Fp8Tensor, RandomHadamard, round_e4m3};
use crate::options::{AttentionOptions, TileSizes};
use crate::output::{AttentionOutput, Counters};
use crate::problem::{Head, Problem};
use crate::shape::TileKind;
use crate::tile::{OnlineRows, add_pv, blocks, score_tile};

/// The number format the tiles are multiplied in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fa3Precision {
    /// The element type of the inputs (`f32` or `f64`).
    #[default]
    Full,
    /// e4m3 inputs with block (or tensor) scales, `P` in e4m3 for the second GEMM.
    Fp8(Fp8Options),
}

/// Options of the FA3 rung.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Fa3Options {
    pub attention: AttentionOptions,
    pub tiles: TileSizes,
    pub precision: Fa3Precision,
}

impl Fa3Options {
    pub fn new(attention: AttentionOptions) -> Self {
        Self { attention, tiles: TileSizes::default(), precision: Fa3Precision::Full }
    }

    /// Sets the tile sizes (`br` query rows by `bc` key columns).
    pub fn with_tiles(self, br: usize, bc: usize) -> Result<Self> {
        Ok(Self { tiles: TileSizes::new(br, bc)?, ..self })
    }

    /// Switches to the FP8 path.
    pub fn with_fp8(self, fp8: Fp8Options) -> Self {
        Self { precision: Fa3Precision::Fp8(fp8), ..self }
    }
}

/// The e4m3 operands and their scales.
struct Fp8Operands<T> {
    q: Fp8Tensor<T>,
    k: Fp8Tensor<T>,
    v: Fp8Tensor<T>,
}

/// FA3-style forward pass: FA2's work decomposition with Algorithm 2's overlapped loop.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &Fa3Options,
) -> Result<AttentionOutput<T>> {
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let Fa3Precision::Fp8(fp8) = opts.precision else {
        return Ok(run(&problem, None, opts.tiles, size_of::<T>()));
    };
    // Incoherent processing rotates Q and K by the same orthogonal map; V is left alone.
    let (q_in, k_in) = match fp8.incoherent {
        Some(seed) => {
            let rotation = RandomHadamard::new(problem.shape.d, seed);
            (rotation.apply(q), rotation.apply(k))
        }
        None => (q.to_owned(), k.to_owned()),
    };
    let (br, bc) = (opts.tiles.br(), opts.tiles.bc());
    let ops = Fp8Operands {
        q: Fp8Tensor::quantize(q_in.view(), br, fp8.scaling),
        k: Fp8Tensor::quantize(k_in.view(), bc, fp8.scaling),
        v: Fp8Tensor::quantize(v, bc, fp8.scaling),
    };
    let quantised = Problem {
        q: ops.q.values.view(),
        k: ops.k.values.view(),
        v: ops.v.values.view(),
        ..problem
    };
    Ok(run(&quantised, Some(&ops), opts.tiles, 1))
}

/// Runs every `(batch, head, query block)` in parallel; `input_bytes` is the HBM size of one
/// element of `Q, K, V` (1 for FP8).
fn run<T: Element>(
    problem: &Problem<'_, T>,
    fp8: Option<&Fp8Operands<T>>,
    tiles: TileSizes,
    input_bytes: usize,
) -> AttentionOutput<T> {
    let counters = Counters::new(size_of::<T>());
    problem.per_query_block(tiles.br(), &counters, |head, rows| {
        overlapped_rows(head, rows, tiles.bc(), fp8, &counters, input_bytes)
    })
}

/// One consumer warpgroup's loop (FA3 Algorithm 2) for the query rows `rows`.
fn overlapped_rows<T: Element>(
    head: &Head<'_, T>,
    rows: Range<usize>,
    bc: usize,
    fp8: Option<&Fp8Operands<T>>,
    counters: &Counters,
    input_bytes: usize,
) -> OnlineRows<T> {
    let (width, d) = (head.q.ncols(), head.v.ncols());
    let q_i = head.q.slice(s![rows.clone(), ..]);
    counters.read_bytes(rows.len() * width * input_bytes);
    let tiles: Vec<(Range<usize>, Option<Vec<usize>>)> = blocks(head.k.nrows(), bc)
        .filter_map(|cols| {
            let (kind, limits) = head.classify(&rows, &cols);
            counters.tile(kind);
            (kind != TileKind::Skip).then_some((cols, limits))
        })
        .collect();

    // GEMM 0: S = scale · Q_i K_jᵀ (times the e4m3 scales of both tiles).
    let scores = |(cols, limits): &(Range<usize>, Option<Vec<usize>>)| {
        counters.read_bytes(cols.len() * width * input_bytes);
        let factor = fp8.map_or(head.scale, |f| {
            head.scale
                * f.q.scale(head.b, head.h, rows.start)
                * f.k.scale(head.b, head.kh, cols.start)
        });
        score_tile(q_i, head.k.slice(s![cols.clone(), ..]), factor, limits.as_deref())
    };
    // GEMM 1: O += P V_j (P rounded to e4m3 first on the FP8 path; l keeps the exact sum).
    let pv = |acc: &mut Array2<T>,
              p: &mut Array2<T>,
              (cols, limits): &(Range<usize>, Option<Vec<usize>>)| {
        counters.read_bytes(cols.len() * d * input_bytes);
        let factor = fp8.map_or(T::one(), |f| {
            p.mapv_inplace(round_e4m3);
            f.v.scale(head.b, head.kh, cols.start)
        });
        add_pv(
            &mut acc.view_mut(),
            factor,
            p.view(),
            head.v.slice(s![cols.clone(), ..]),
            limits.as_deref(),
        );
    };

    let mut state = OnlineRows::new(rows.len(), d);
    let Some((first, rest)) = tiles.split_first() else {
        return state;
    };
    let mut p = scores(first);
    state.softmax_step(&mut p); // the accumulator is still zero: nothing to rescale
    let mut current = first;
    for next in rest {
        let mut s_next = scores(next); // GEMM 0 of block j+1 is issued first…
        pv(&mut state.acc, &mut p, current); // …then GEMM 1 of block j, which the softmax overlaps
        let alpha = state.softmax_step(&mut s_next);
        state.rescale(&alpha); // once GEMM 1 of block j has landed
        (p, current) = (s_next, next);
    }
    pv(&mut state.acc, &mut p, current);
    state
}

// ---------------------------------------------------------------------------------------------
// The schedule, as a timeline
// ---------------------------------------------------------------------------------------------

/// A schedule of the per-tile work of FA3's consumer warpgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// One warpgroup, each step waiting for the one before (FA2 on Hopper).
    Sequential,
    /// One warpgroup, Algorithm 2: the softmax of block `j+1` overlaps `P V` of block `j`.
    IntraWarpgroup,
    /// Two warpgroups, each sequential, sharing the tensor cores: one's softmax overlaps the
    /// other's GEMMs.
    PingPong,
}

/// The three steps of one tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `S = Q Kᵀ` on the tensor cores.
    Gemm0,
    /// The online softmax on the warpgroup's own units (exp, max, sum).
    Softmax,
    /// `O += P V` on the tensor cores.
    Gemm1,
}

/// How long each stage of a tile takes, in arbitrary units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageCosts {
    pub gemm0: f64,
    pub softmax: f64,
    pub gemm1: f64,
}

impl StageCosts {
    /// Costs on an H100 SXM5 for head dim `d`, from the figures the FA3 paper quotes:
    /// 989 TFLOP/s of fp16 matmul against 3.9 TFLOP/s of exponentials. A tile's GEMMs are
    /// `2·br·bc·d` FLOPs each and its softmax `br·bc` exponentials; a GEMM costs 1.
    pub fn hopper(d: usize) -> Self {
        let softmax = 989.0 / (3.9 * 2.0 * d as f64);
        Self { gemm0: 1.0, softmax, gemm1: 1.0 }
    }
}

/// One stage of one tile on the timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub warpgroup: usize,
    pub stage: Stage,
    /// Key block index.
    pub block: usize,
    pub start: f64,
    pub end: f64,
}

/// Simulates `schedule` over `n_blocks` key blocks per warpgroup: the tensor cores run one GEMM
/// at a time (shared by all warpgroups), each warpgroup runs its own softmax, and an operation
/// starts as soon as its inputs and its unit are ready (earliest first).
pub fn timeline(schedule: Schedule, n_blocks: usize, costs: StageCosts) -> Vec<Event> {
    struct Op {
        warpgroup: usize,
        stage: Stage,
        block: usize,
        deps: Vec<usize>,
    }
    let mut ops: Vec<Op> = Vec::new();
    let push = |ops: &mut Vec<Op>, warpgroup, stage, block, deps| {
        ops.push(Op { warpgroup, stage, block, deps });
        ops.len() - 1
    };
    let warpgroups = if schedule == Schedule::PingPong { 2 } else { 1 };
    for wg in 0..warpgroups {
        if schedule == Schedule::IntraWarpgroup {
            // Algorithm 2: G0(0), S(0); then per j: G0(j), G1(j−1), S(j); finally G1(last).
            let mut g0 = push(&mut ops, wg, Stage::Gemm0, 0, vec![]);
            let mut sm = push(&mut ops, wg, Stage::Softmax, 0, vec![g0]);
            let mut prev_g1: Option<usize> = None;
            for j in 1..n_blocks {
                let mut deps = vec![sm];
                deps.extend(prev_g1);
                g0 = push(&mut ops, wg, Stage::Gemm0, j, deps);
                let g1 = push(&mut ops, wg, Stage::Gemm1, j - 1, vec![sm]);
                sm = push(&mut ops, wg, Stage::Softmax, j, vec![g0, sm]);
                prev_g1 = Some(g1);
            }
            if n_blocks > 0 {
                push(&mut ops, wg, Stage::Gemm1, n_blocks - 1, vec![sm]);
            }
        } else {
            let mut last: Option<usize> = None;
            for j in 0..n_blocks {
                for stage in [Stage::Gemm0, Stage::Softmax, Stage::Gemm1] {
                    last = Some(push(&mut ops, wg, stage, j, last.into_iter().collect()));
                }
            }
        }
    }
    if schedule == Schedule::PingPong && n_blocks > 0 {
        // The barrier of the ping-pong: the warpgroups take turns on the tensor cores. A turn
        // is a warpgroup's GEMMs between two softmaxes, `G1(j−1), G0(j)`; turn t of warpgroup 1
        // waits for turn t of warpgroup 0, and turn t+1 of warpgroup 0 for turn t of warpgroup 1.
        let find = |wg, stage, block| {
            ops.iter()
                .position(|o| o.warpgroup == wg && o.stage == stage && o.block == block)
                .expect("op exists")
        };
        let turn = |wg, t: usize| -> (usize, usize) {
            match t {
                0 => (find(wg, Stage::Gemm0, 0), find(wg, Stage::Gemm0, 0)),
                t if t == n_blocks => {
                    (find(wg, Stage::Gemm1, t - 1), find(wg, Stage::Gemm1, t - 1))
                }
                t => (find(wg, Stage::Gemm1, t - 1), find(wg, Stage::Gemm0, t)),
            }
        };
        let order: Vec<(usize, usize)> =
            (0..=n_blocks).flat_map(|t| [turn(0, t), turn(1, t)]).collect();
        for pair in order.windows(2) {
            let (prev_last, next_first) = (pair[0].1, pair[1].0);
            ops[next_first].deps.push(prev_last);
        }
    }

    let cost = |stage| match stage {
        Stage::Gemm0 => costs.gemm0,
        Stage::Softmax => costs.softmax,
        Stage::Gemm1 => costs.gemm1,
    };
    // Units: 0 is the tensor cores, 1 + wg is warpgroup wg's softmax.
    let unit = |op: &Op| if op.stage == Stage::Softmax { 1 + op.warpgroup } else { 0 };
    let mut free = vec![0.0f64; 1 + warpgroups];
    let mut end: Vec<Option<f64>> = vec![None; ops.len()];
    let mut events = Vec::with_capacity(ops.len());
    while events.len() < ops.len() {
        let next = ops
            .iter()
            .enumerate()
            .filter(|(i, op)| end[*i].is_none() && op.deps.iter().all(|d| end[*d].is_some()))
            .map(|(i, op)| {
                let ready = op.deps.iter().map(|d| end[*d].unwrap_or(0.0)).fold(0.0, f64::max);
                (i, ready.max(free[unit(op)]))
            })
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let Some((i, start)) = next else { break };
        let op = &ops[i];
        let finish = start + cost(op.stage);
        free[unit(op)] = finish;
        end[i] = Some(finish);
        events.push(Event {
            warpgroup: op.warpgroup,
            stage: op.stage,
            block: op.block,
            start,
            end: finish,
        });
    }
    events
}

/// When the last event ends.
pub fn makespan(events: &[Event]) -> f64 {
    events.iter().map(|e| e.end).fold(0.0, f64::max)
}

/// The fraction of the makespan the tensor cores spend on GEMMs.
pub fn tensor_core_utilisation(events: &[Event]) -> f64 {
    let busy: f64 =
        events.iter().filter(|e| e.stage != Stage::Softmax).map(|e| e.end - e.start).sum();
    let span = makespan(events);
    if span > 0.0 { busy / span } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: StageCosts = StageCosts { gemm0: 1.0, softmax: 1.0, gemm1: 1.0 };

    #[test]
    fn overlap_hides_the_softmax() {
        let n = 8;
        let seq = timeline(Schedule::Sequential, n, UNIT);
        let intra = timeline(Schedule::IntraWarpgroup, n, UNIT);
        assert_eq!(makespan(&seq), 3.0 * n as f64);
        // G0(0), S(0), then each block costs max(G1, S) after its G0, plus the last G1.
        assert_eq!(makespan(&intra), 2.0 * n as f64 + 1.0);
        assert!(tensor_core_utilisation(&intra) > tensor_core_utilisation(&seq));
        let pingpong = timeline(Schedule::PingPong, n, UNIT);
        // Two warpgroups' worth of work in less than twice the sequential time.
        assert!(makespan(&pingpong) < 2.0 * makespan(&seq) * 0.75);
    }

    #[test]
    fn timelines_respect_units_and_order() {
        for schedule in [Schedule::Sequential, Schedule::IntraWarpgroup, Schedule::PingPong] {
            let events = timeline(schedule, 5, StageCosts::hopper(64));
            let wgs = if schedule == Schedule::PingPong { 2 } else { 1 };
            assert_eq!(events.len(), 15 * wgs);
            // The tensor cores never run two GEMMs at once.
            let mut gemms: Vec<_> = events.iter().filter(|e| e.stage != Stage::Softmax).collect();
            gemms.sort_by(|a, b| a.start.total_cmp(&b.start));
            assert!(gemms.windows(2).all(|w| w[0].end <= w[1].start + 1e-12));
            // Each tile's softmax follows its S and precedes its P V.
            for wg in 0..wgs {
                for j in 0..5 {
                    let at = |stage| {
                        events
                            .iter()
                            .find(|e| e.warpgroup == wg && e.block == j && e.stage == stage)
                            .unwrap()
                    };
                    assert!(at(Stage::Gemm0).end <= at(Stage::Softmax).start);
                    assert!(at(Stage::Softmax).end <= at(Stage::Gemm1).start);
                }
            }
        }
    }
}
