//! The FA3 schedule, simulated: when each stage of each tile runs on a Hopper SM.
//!
//! [`crate::fa3`] reproduces the *order* of FlashAttention-3's operations (the numerics); this
//! module models the *time*. A tile's work is three stages ([`Stage`]): `S = Q Kᵀ` and `O += P V`
//! on the tensor cores, shared by all warpgroups of the SM and running one GEMM at a time, and the
//! online softmax on the warpgroup's own units. [`timeline`] places every stage of a
//! [`Schedule`] (FA2's sequential loop, FA3's intra-warpgroup overlap, FA3's ping-pong between
//! two warpgroups) as early as its inputs and its unit allow, with the stage costs of
//! [`StageCosts`] (e.g. [`StageCosts::hopper`], from the figures the FA3 paper quotes), so the
//! schedules can be drawn and compared ([`makespan`], [`tensor_core_utilisation`]).
//!
//! The items are also re-exported from [`crate::fa3`] (`fa3::timeline`, `fa3::Schedule`, ...),
//! where the notebooks call them.

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
