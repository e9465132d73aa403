//! The FA3 schedule, simulated: when each stage of each tile runs on a Hopper SM.
//!
//! [`crate::fa3`] reproduces the *order* of FlashAttention-3's operations (the numerics); this
//! module models the *time*. A tile's work is three stages ([`Stage`]): `S = Q Kᵀ` and `O += P V`
//! on the tensor cores, shared by all warpgroups of the SM and running one GEMM at a time, and the
//! online softmax on the warpgroup's own units. [`timeline`] places every stage of a
//! [`Schedule`] (FA2's sequential loop, FA3's intra-warpgroup overlap, FA3's ping-pong between
//! two warpgroups, and both together) as early as its inputs and its unit allow, with the stage
//! costs of [`StageCosts`] (e.g. [`StageCosts::hopper`], from the figures the FA3 paper quotes),
//! so the schedules can be drawn and compared ([`makespan`], [`tensor_core_utilisation`]).
//!
//! Warp specialisation adds a third kind of unit: a *producer* warp that only copies `K_j` and
//! `V_j` into rings of shared-memory stages with TMA, for the consumer warpgroups to compute on.
//! [`timeline_with_producer`] adds its copies ([`Stage::LoadK`], [`Stage::LoadV`]) to the
//! timeline: a copy needs a free stage of its ring, and a stage is free again once every consumer
//! has finished the product that reads it — `S = Q Kᵀ` for `K`, `P V` for `V` ([`Pipeline`]).
//!
//! [`run_program`] times one warpgroup's *program*, the order in which it issues its operations
//! (the GEMMs asynchronously, the softmax on its own threads), and checks that the order is legal:
//! the loop of Algorithm 2 is one such order, FA2's loop another.
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
    /// Two warpgroups, each running Algorithm 2, taking turns on the tensor cores: both ideas at
    /// once, as FA3's kernel runs them. A turn is a warpgroup's `S_{j+1} = Q K_{j+1}ᵀ` and
    /// `O += P_j V_j`, issued together between two of its softmaxes.
    PingPongOverlap,
}

impl Schedule {
    /// Consumer warpgroups the schedule runs.
    pub fn warpgroups(self) -> usize {
        match self {
            Schedule::Sequential | Schedule::IntraWarpgroup => 1,
            Schedule::PingPong | Schedule::PingPongOverlap => 2,
        }
    }

    /// Whether each warpgroup runs Algorithm 2's overlapped loop.
    fn overlapped(self) -> bool {
        matches!(self, Schedule::IntraWarpgroup | Schedule::PingPongOverlap)
    }
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
    /// The producer's TMA copy of `K_j` into a stage of the `K` ring ([`timeline_with_producer`]
    /// only).
    LoadK,
    /// The producer's TMA copy of `V_j` into a stage of the `V` ring.
    LoadV,
}

impl Stage {
    /// A copy by the producer, not work of a consumer warpgroup.
    pub fn is_load(self) -> bool {
        matches!(self, Stage::LoadK | Stage::LoadV)
    }
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

/// The producer of [`timeline_with_producer`]: two rings of `stages` shared-memory buffers (at
/// least one; 0 counts as 1), one for the `K_j` tiles and one for the `V_j`, as FA3's kernel has,
/// filled by copies of cost `load` each (in the units of [`StageCosts`]), one at a time, in the
/// order `K_0, V_0, K_1, V_1, …`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pipeline {
    pub stages: usize,
    pub load: f64,
}

/// One stage of one tile on the timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    /// The consumer warpgroup (0 for a copy: the producer serves them all).
    pub warpgroup: usize,
    pub stage: Stage,
    /// Key block index.
    pub block: usize,
    pub start: f64,
    pub end: f64,
}

/// Simulates `schedule` over `n_blocks` key blocks per warpgroup: the tensor cores run one GEMM
/// at a time (shared by all warpgroups), each warpgroup runs its own softmax, and an operation
/// starts as soon as its inputs and its unit are ready (earliest first). `K_j, V_j` are taken as
/// already in shared memory (see [`timeline_with_producer`] for the copies).
pub fn timeline(schedule: Schedule, n_blocks: usize, costs: StageCosts) -> Vec<Event> {
    // Without a producer every operation's inputs come from operations before it: no stall.
    simulate(schedule, n_blocks, costs, None).0
}

/// [`timeline`] with warp specialisation's producer: before a warpgroup's `S_j = Q K_jᵀ` the
/// producer must have copied `K_j`, and before its `O += P_j V_j`, `V_j`. It can copy `K_j` only
/// once the stage it goes to is free, that is once every warpgroup has finished `S = Q Kᵀ` on
/// block `j − stages`, and `V_j` once every warpgroup has finished `P V` on block `j − stages`.
/// With copies that are cheap next to a block's compute the rings run ahead and the copies hide;
/// with copies as slow as the compute, they do not.
///
/// A schedule whose producer waits for a consumer that waits for the producer cannot run (the
/// ping-pong on rings of one stage: a warpgroup's turn holds its next `S` behind the other's
/// `P V`, which needs a `V` the producer cannot copy yet). That is an error naming where it
/// stalled; FA3's kernel has two stages or more.
pub fn timeline_with_producer(
    schedule: Schedule,
    n_blocks: usize,
    costs: StageCosts,
    pipeline: Pipeline,
) -> Result<Vec<Event>, String> {
    let (events, ops) = simulate(schedule, n_blocks, costs, Some(pipeline));
    if events.len() < ops {
        let done = |stage| events.iter().filter(|e| e.stage == stage).count();
        return Err(format!(
            "{schedule:?} stalls on rings of {} stage(s) after {} of {n_blocks} copies of K, {} of \
             V and {} of {} products P V: each waits for the other",
            pipeline.stages.max(1),
            done(Stage::LoadK),
            done(Stage::LoadV),
            done(Stage::Gemm1),
            n_blocks * schedule.warpgroups()
        ));
    }
    Ok(events)
}

/// The events, and how many operations there were (more than events when the schedule stalls).
fn simulate(
    schedule: Schedule,
    n_blocks: usize,
    costs: StageCosts,
    pipeline: Option<Pipeline>,
) -> (Vec<Event>, usize) {
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
    let warpgroups = schedule.warpgroups();
    // The producer's copies come first, K_0, V_0, K_1, V_1, … (the rings' stages are added
    // below): one producer thread issues them in that order.
    let loads: Vec<(usize, usize)> = match pipeline {
        Some(_) => (0..n_blocks)
            .map(|j| {
                let deps = if j == 0 { vec![] } else { vec![ops.len() - 1] };
                let k = push(&mut ops, 0, Stage::LoadK, j, deps);
                (k, push(&mut ops, 0, Stage::LoadV, j, vec![k]))
            })
            .collect(),
        None => Vec::new(),
    };
    let loaded_k = |j: usize| loads.get(j).map(|l| l.0);
    let loaded_v = |j: usize| loads.get(j).map(|l| l.1);
    for wg in 0..warpgroups {
        if schedule.overlapped() && n_blocks > 0 {
            // Algorithm 2: G0(0), S(0); then per j: G0(j), G1(j−1), S(j); finally G1(last).
            let mut g0 = push(&mut ops, wg, Stage::Gemm0, 0, loaded_k(0).into_iter().collect());
            let mut sm = push(&mut ops, wg, Stage::Softmax, 0, vec![g0]);
            let mut prev_g1: Option<usize> = None;
            for j in 1..n_blocks {
                let mut deps = vec![sm];
                deps.extend(prev_g1);
                deps.extend(loaded_k(j));
                g0 = push(&mut ops, wg, Stage::Gemm0, j, deps);
                let mut deps = vec![sm];
                deps.extend(loaded_v(j - 1));
                let g1 = push(&mut ops, wg, Stage::Gemm1, j - 1, deps);
                sm = push(&mut ops, wg, Stage::Softmax, j, vec![g0, sm]);
                prev_g1 = Some(g1);
            }
            let mut deps = vec![sm];
            deps.extend(loaded_v(n_blocks - 1));
            push(&mut ops, wg, Stage::Gemm1, n_blocks - 1, deps);
        } else {
            let mut last: Option<usize> = None;
            for j in 0..n_blocks {
                for stage in [Stage::Gemm0, Stage::Softmax, Stage::Gemm1] {
                    let mut deps: Vec<usize> = last.into_iter().collect();
                    match stage {
                        Stage::Gemm0 => deps.extend(loaded_k(j)),
                        Stage::Gemm1 => deps.extend(loaded_v(j)),
                        _ => {}
                    }
                    last = Some(push(&mut ops, wg, stage, j, deps));
                }
            }
        }
    }
    let find = |ops: &[Op], wg, stage, block| {
        ops.iter()
            .position(|o| o.warpgroup == wg && o.stage == stage && o.block == block)
            .expect("op exists")
    };
    if let Some(p) = pipeline {
        // K_j and V_j go to stage j mod `stages` of their rings, free once every warpgroup has
        // finished the product that read block j − stages: S for K, P V for V.
        let stages = p.stages.max(1);
        for j in stages..n_blocks {
            for wg in 0..warpgroups {
                let read_k = find(&ops, wg, Stage::Gemm0, j - stages);
                let read_v = find(&ops, wg, Stage::Gemm1, j - stages);
                ops[loads[j].0].deps.push(read_k);
                ops[loads[j].1].deps.push(read_v);
            }
        }
    }
    if warpgroups == 2 && n_blocks > 0 {
        // The barrier of the ping-pong: the warpgroups take turns on the tensor cores. A turn is
        // a warpgroup's GEMMs between two of its softmaxes — `G1(j−1), G0(j)` in the sequential
        // loop, `G0(j), G1(j−1)` in Algorithm 2's; turn t of warpgroup 1 waits for turn t of
        // warpgroup 0, and turn t+1 of warpgroup 0 for turn t of warpgroup 1.
        let overlapped = schedule.overlapped();
        let turn = |ops: &[Op], wg, t: usize| -> (usize, usize) {
            let g0 = |b| find(ops, wg, Stage::Gemm0, b);
            let g1 = |b| find(ops, wg, Stage::Gemm1, b);
            match t {
                0 => (g0(0), g0(0)),
                t if t == n_blocks => (g1(t - 1), g1(t - 1)),
                t if overlapped => (g0(t), g1(t - 1)),
                t => (g1(t - 1), g0(t)),
            }
        };
        let order: Vec<(usize, usize)> =
            (0..=n_blocks).flat_map(|t| [turn(&ops, 0, t), turn(&ops, 1, t)]).collect();
        for pair in order.windows(2) {
            let (prev_last, next_first) = (pair[0].1, pair[1].0);
            ops[next_first].deps.push(prev_last);
        }
    }

    let cost = |stage| match stage {
        Stage::Gemm0 => costs.gemm0,
        Stage::Softmax => costs.softmax,
        Stage::Gemm1 => costs.gemm1,
        Stage::LoadK | Stage::LoadV => pipeline.map_or(0.0, |p| p.load),
    };
    // Units: 0 is the tensor cores, 1 + wg is warpgroup wg's softmax, the last the producer.
    let producer = 1 + warpgroups;
    let unit = |op: &Op| match op.stage {
        Stage::Softmax => 1 + op.warpgroup,
        Stage::LoadK | Stage::LoadV => producer,
        Stage::Gemm0 | Stage::Gemm1 => 0,
    };
    let mut free = vec![0.0f64; 2 + warpgroups];
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
    (events, ops.len())
}

/// Times one consumer warpgroup's `program`: the `(stage, key block)` operations in the order
/// the warpgroup issues them, over blocks `0..n` (`n` the number of `S = Q Kᵀ` in it). The GEMMs
/// are asynchronous: issuing one does not stop the warpgroup, and the tensor cores run them one
/// at a time in issue order; the softmax runs on the warpgroup's own threads, so nothing after
/// it is issued before it ends, and it waits for its block's scores. `K, V` are in shared memory.
///
/// The order must be legal, else an error says which rule it breaks: every stage of every block
/// exactly once; for each block `S` before its softmax before its `P V`; the softmaxes in block
/// order (the running max) and the `P V` products too (the accumulator); and at most two score
/// tiles in registers at once (a tile lives from its `S = Q Kᵀ` until its `P V` is issued).
/// FA2's loop ([`Schedule::Sequential`]) and Algorithm 2's are legal, and with Algorithm 2's
/// order the events are those [`timeline`] gives for [`Schedule::IntraWarpgroup`].
pub fn run_program(program: &[(Stage, usize)], costs: StageCosts) -> Result<Vec<Event>, String> {
    let n = program.iter().filter(|(stage, _)| *stage == Stage::Gemm0).count();
    let mut position = vec![[None::<usize>; 3]; n];
    let index = |stage: Stage| match stage {
        Stage::Gemm0 => Ok(0),
        Stage::Softmax => Ok(1),
        Stage::Gemm1 => Ok(2),
        Stage::LoadK | Stage::LoadV => {
            Err("a consumer warpgroup does not copy K or V: the producer does".to_string())
        }
    };
    for (k, &(stage, block)) in program.iter().enumerate() {
        if block >= n {
            return Err(format!(
                "step {k}: {stage:?} of block {block}, but there are only {n} blocks (one                  Gemm0 each)"
            ));
        }
        let slot = &mut position[block][index(stage)?];
        if slot.is_some() {
            return Err(format!("step {k}: {stage:?} of block {block} a second time"));
        }
        *slot = Some(k);
    }
    let at = |block: usize, stage: usize| position[block][stage];
    for (block, stages) in position.iter().enumerate() {
        for (s, name) in [(1, "Softmax"), (2, "Gemm1")] {
            if stages[s].is_none() {
                return Err(format!("block {block} has no {name}"));
            }
        }
    }
    let before = |a: Option<usize>, b: Option<usize>| a < b;
    for j in 0..n {
        if !before(at(j, 0), at(j, 1)) || !before(at(j, 1), at(j, 2)) {
            return Err(format!(
                "block {j}: its Softmax needs its Gemm0 (S) first, and its Gemm1 (P V) needs                  its Softmax (P) first"
            ));
        }
        if j > 0 && !before(at(j - 1, 1), at(j, 1)) {
            return Err(format!(
                "the Softmax of block {j} comes before that of block {}: the running max goes                  block by block",
                j - 1
            ));
        }
        if j > 0 && !before(at(j - 1, 2), at(j, 2)) {
            return Err(format!(
                "the Gemm1 of block {j} comes before that of block {}: the accumulator is                  rescaled block by block",
                j - 1
            ));
        }
    }
    let mut live = 0usize;
    for (k, &(stage, block)) in program.iter().enumerate() {
        match stage {
            Stage::Gemm0 => live += 1,
            Stage::Gemm1 => live -= 1,
            _ => {}
        }
        if live > 2 {
            return Err(format!(
                "step {k}: Gemm0 of block {block} makes three score tiles live at once; the                  registers hold two (issue a Gemm1 first)"
            ));
        }
    }

    let cost = |stage| match stage {
        Stage::Gemm0 => costs.gemm0,
        Stage::Softmax => costs.softmax,
        Stage::Gemm1 | Stage::LoadK | Stage::LoadV => costs.gemm1,
    };
    let mut end = vec![[0.0f64; 3]; n];
    let (mut issue, mut tensor_free) = (0.0f64, 0.0f64);
    let mut events = Vec::with_capacity(program.len());
    for &(stage, block) in program {
        let (start, finish) = match stage {
            Stage::Softmax => {
                // Waits for its scores (and the softmax before it: the same threads).
                let start = issue.max(end[block][0]);
                let finish = start + cost(stage);
                issue = finish; // the threads were busy until now
                (start, finish)
            }
            _ => {
                let ready = if stage == Stage::Gemm1 { end[block][1] } else { 0.0 };
                let start = issue.max(ready).max(tensor_free);
                tensor_free = start + cost(stage);
                (start, tensor_free)
            }
        };
        end[block][index(stage)?] = finish;
        events.push(Event { warpgroup: 0, stage, block, start, end: finish });
    }
    Ok(events)
}

/// The order in which one warpgroup issues its operations under `schedule` (for the two-warpgroup
/// schedules, the order of each): FA2's `S, softmax, P V` per block, or Algorithm 2's. (Only the
/// tests use it: in the notebook, writing Algorithm 2's order is the exercise.)
#[cfg(test)]
fn program(schedule: Schedule, n_blocks: usize) -> Vec<(Stage, usize)> {
    if !schedule.overlapped() {
        return (0..n_blocks)
            .flat_map(|j| [(Stage::Gemm0, j), (Stage::Softmax, j), (Stage::Gemm1, j)])
            .collect();
    }
    if n_blocks == 0 {
        return Vec::new();
    }
    let mut order = vec![(Stage::Gemm0, 0), (Stage::Softmax, 0)];
    for j in 1..n_blocks {
        order.extend([(Stage::Gemm0, j), (Stage::Gemm1, j - 1), (Stage::Softmax, j)]);
    }
    order.push((Stage::Gemm1, n_blocks - 1));
    order
}

/// When the last event ends.
pub fn makespan(events: &[Event]) -> f64 {
    events.iter().map(|e| e.end).fold(0.0, f64::max)
}

/// The fraction of the makespan the tensor cores spend on GEMMs.
pub fn tensor_core_utilisation(events: &[Event]) -> f64 {
    let busy: f64 = events
        .iter()
        .filter(|e| matches!(e.stage, Stage::Gemm0 | Stage::Gemm1))
        .map(|e| e.end - e.start)
        .sum();
    let span = makespan(events);
    if span > 0.0 { busy / span } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: StageCosts = StageCosts { gemm0: 1.0, softmax: 1.0, gemm1: 1.0 };
    const ALL: [Schedule; 4] = [
        Schedule::Sequential,
        Schedule::IntraWarpgroup,
        Schedule::PingPong,
        Schedule::PingPongOverlap,
    ];

    fn costs() -> Vec<StageCosts> {
        vec![
            UNIT,
            StageCosts::hopper(64),
            StageCosts::hopper(128),
            StageCosts { gemm0: 1.0, softmax: 3.0, gemm1: 0.5 },
            StageCosts { gemm0: 0.7, softmax: 0.2, gemm1: 1.3 },
        ]
    }

    fn at(events: &[Event], wg: usize, stage: Stage, block: usize) -> Event {
        *events
            .iter()
            .find(|e| e.warpgroup == wg && e.stage == stage && e.block == block)
            .expect("event exists")
    }

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
        for schedule in ALL {
            let events = timeline(schedule, 5, StageCosts::hopper(64));
            let wgs = schedule.warpgroups();
            assert_eq!(events.len(), 15 * wgs);
            // The tensor cores never run two GEMMs at once.
            let mut gemms: Vec<_> = events.iter().filter(|e| e.stage != Stage::Softmax).collect();
            gemms.sort_by(|a, b| a.start.total_cmp(&b.start));
            assert!(gemms.windows(2).all(|w| w[0].end <= w[1].start + 1e-12));
            // Each tile's softmax follows its S and precedes its P V.
            for wg in 0..wgs {
                for j in 0..5 {
                    assert!(
                        at(&events, wg, Stage::Gemm0, j).end
                            <= at(&events, wg, Stage::Softmax, j).start
                    );
                    assert!(
                        at(&events, wg, Stage::Softmax, j).end
                            <= at(&events, wg, Stage::Gemm1, j).start
                    );
                }
            }
        }
    }

    #[test]
    fn both_ideas_together_keep_the_tensor_cores_busiest() {
        for costs in costs() {
            let u = |s| tensor_core_utilisation(&timeline(s, 16, costs));
            let both = u(Schedule::PingPongOverlap);
            assert!(both >= u(Schedule::IntraWarpgroup) - 1e-9, "{costs:?}");
            assert!(both >= u(Schedule::Sequential), "{costs:?}");
        }
        // With FA3's costs at d = 128 the combination is within a block of the bound: two
        // warpgroups' GEMMs back to back.
        let events = timeline(Schedule::PingPongOverlap, 16, StageCosts::hopper(128));
        assert!(makespan(&events) <= 2.0 * 2.0 * 16.0 + 2.0, "{}", makespan(&events));
        // The turns alternate: warpgroup 1's first product waits for warpgroup 0's.
        assert!(
            at(&events, 0, Stage::Gemm0, 0).end <= at(&events, 1, Stage::Gemm0, 0).start + 1e-12
        );
    }

    #[test]
    fn algorithm_2_as_a_program_is_the_intra_warpgroup_timeline() {
        let key = |e: &Event| (e.stage as u8, e.block);
        for costs in costs() {
            for n in 0..9 {
                for (schedule, order) in [
                    (Schedule::IntraWarpgroup, program(Schedule::IntraWarpgroup, n)),
                    (Schedule::Sequential, program(Schedule::Sequential, n)),
                ] {
                    let mut ran = run_program(&order, costs).expect("legal");
                    let mut simulated = timeline(schedule, n, costs);
                    ran.sort_by_key(key);
                    simulated.sort_by_key(key);
                    assert_eq!(ran, simulated, "{schedule:?}, n = {n}, {costs:?}");
                }
            }
        }
    }

    #[test]
    fn illegal_programs_are_refused_with_the_rule_they_break() {
        use Stage::*;
        let refused = |order: &[(Stage, usize)], why: &str| {
            let err = run_program(order, UNIT).expect_err(why);
            assert!(err.contains(why), "{err}");
        };
        refused(&[(Gemm0, 0), (Softmax, 0)], "no Gemm1");
        refused(&[(Gemm0, 0), (Softmax, 0), (Gemm1, 0), (Gemm1, 0)], "a second time");
        refused(&[(Softmax, 0), (Gemm0, 0), (Gemm1, 0)], "needs its Gemm0");
        refused(&[(Gemm0, 0), (Softmax, 0), (Gemm1, 1)], "only 1 blocks");
        refused(&[(LoadK, 0), (Gemm0, 0), (Softmax, 0), (Gemm1, 0)], "the producer does");
        let two = [(Gemm0, 0), (Gemm0, 1), (Softmax, 1), (Softmax, 0), (Gemm1, 0), (Gemm1, 1)];
        refused(&two, "running max");
        let two = [(Gemm0, 0), (Gemm0, 1), (Softmax, 0), (Softmax, 1), (Gemm1, 1), (Gemm1, 0)];
        refused(&two, "rescaled block by block");
        let three = [
            (Gemm0, 0),
            (Gemm0, 1),
            (Gemm0, 2),
            (Softmax, 0),
            (Gemm1, 0),
            (Softmax, 1),
            (Gemm1, 1),
            (Softmax, 2),
            (Gemm1, 2),
        ];
        refused(&three, "three score tiles");
    }

    #[test]
    fn a_deeper_prologue_is_legal_and_never_slower_than_algorithm_2() {
        // S of the next block issued before the softmax of this one: also two tiles at most.
        let n = 12;
        let mut order = vec![(Stage::Gemm0, 0)];
        for j in 0..n {
            if j + 1 < n {
                order.push((Stage::Gemm0, j + 1));
            }
            order.extend([(Stage::Softmax, j), (Stage::Gemm1, j)]);
        }
        // That order makes tile j+1 live before tile j's P V: still two at a time.
        for costs in costs() {
            let deeper = makespan(&run_program(&order, costs).expect("legal"));
            let alg2 = makespan(&timeline(Schedule::IntraWarpgroup, n, costs));
            assert!(deeper <= alg2 + 1e-9, "{costs:?}: {deeper} > {alg2}");
        }
    }

    #[test]
    fn the_producer_rings_run_ahead_by_their_stages() {
        let n = 8;
        for schedule in ALL {
            for costs in costs() {
                // Free copies and rings as deep as the loop: exactly the compute-only timeline.
                let free =
                    timeline_with_producer(schedule, n, costs, Pipeline { stages: n, load: 0.0 })
                        .expect("no stall");
                let compute: Vec<Event> =
                    free.iter().filter(|e| !e.stage.is_load()).copied().collect();
                assert_eq!(compute, timeline(schedule, n, costs), "{schedule:?}");
                // Cheap copies on two stages hide behind the compute: only the first copy of K
                // shows, before the first S.
                let cheap = Pipeline { stages: 2, load: 0.25 };
                let events = timeline_with_producer(schedule, n, costs, cheap).expect("no stall");
                let plain = makespan(&timeline(schedule, n, costs));
                assert!((makespan(&events) - plain - 0.25).abs() < 1e-9, "{schedule:?} {costs:?}");
                for stages in [1, 2, 3] {
                    let p = Pipeline { stages, load: 0.6 };
                    let events = match timeline_with_producer(schedule, n, costs, p) {
                        Ok(events) => events,
                        // Only FA2's loop finishes a block before it starts the next.
                        Err(stall) if stages == 1 && schedule != Schedule::Sequential => {
                            assert!(stall.contains("stalls on rings of 1 stage"), "{stall}");
                            continue;
                        }
                        Err(stall) => panic!("{schedule:?}, {stages} stages: {stall}"),
                    };
                    assert_eq!(events.len(), n * (2 + 3 * schedule.warpgroups()));
                    // One copy at a time, in the order K_0, V_0, K_1, V_1, …
                    let mut copies: Vec<&Event> =
                        events.iter().filter(|e| e.stage.is_load()).collect();
                    copies.sort_by(|a, b| a.start.total_cmp(&b.start));
                    for (t, pair) in copies.windows(2).enumerate() {
                        assert!(pair[0].end <= pair[1].start + 1e-12);
                        let order = |e: &Event| 2 * e.block + usize::from(e.stage == Stage::LoadV);
                        assert_eq!((order(pair[0]), order(pair[1])), (t, t + 1));
                    }
                    for j in 0..n {
                        let (k, v) =
                            (at(&events, 0, Stage::LoadK, j), at(&events, 0, Stage::LoadV, j));
                        for wg in 0..schedule.warpgroups() {
                            // Nobody computes on a tile before it has landed …
                            assert!(k.end <= at(&events, wg, Stage::Gemm0, j).start + 1e-12);
                            assert!(v.end <= at(&events, wg, Stage::Gemm1, j).start + 1e-12);
                            // … and a copy goes into a stage only once every reader is done.
                            if j >= stages {
                                let read_k = at(&events, wg, Stage::Gemm0, j - stages).end;
                                let read_v = at(&events, wg, Stage::Gemm1, j - stages).end;
                                assert!(read_k <= k.start + 1e-12, "{schedule:?} {stages}");
                                assert!(read_v <= v.start + 1e-12, "{schedule:?} {stages}");
                            }
                        }
                    }
                }
            }
        }
        // FA2's loop, unit costs, copies of 2 each: four units of copies per block against three
        // of compute, so the producer sets the pace — the copies run one at a time, and they are
        // not tensor-core work.
        let slow = timeline_with_producer(
            Schedule::Sequential,
            n,
            UNIT,
            Pipeline { stages: 2, load: 2.0 },
        )
        .expect("no stall");
        assert!(makespan(&slow) >= 4.0 * n as f64, "{}", makespan(&slow));
        assert!(tensor_core_utilisation(&slow) <= 0.5 + 1e-12);
    }
}
