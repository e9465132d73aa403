//! The K/V pipeline of `fa3_forward.cu`, simulated on the CPU: notebook 13's exercise check.
//!
//! The kernel's producer thread and its consumer warps share `STAGES` shared-memory stages. Each
//! stage has two mbarriers (`barrier.cuh`): `full` (the copy engine has delivered the tile the
//! producer announced) and `empty` (every consumer warp has released the stage). A waiter never
//! names a phase by its number, only by its *parity*: `mbarrier.try_wait.parity p` succeeds when
//! the barrier's current phase has the other parity (the phase of parity `p` has completed). Which parity to wait on at
//! each position of the pipeline is the whole of the protocol, and a wrong one does on the GPU
//! what it does here: the block hangs, or a warp multiplies a tile that has not landed yet, or
//! the copy engine overwrites a tile a warp is still reading.
//!
//! [`simulate`] runs the producer, the consumer warps and the copy engine as separate actors
//! interleaved at random (a seed picks the order), with mbarriers that behave as the hardware's
//! do: a fresh barrier is in phase 0, and waiting on parity 1 returns at once. It stops at the
//! first of those three failures and describes it, or returns the events in the order they ran.

use std::fmt;

use plotters::prelude::*;

/// What one side waits on at a position of the pipeline (a count of the K/V tiles the block has
/// streamed): the stage, the parity the consumers wait on at the stage's `full` barrier, and the
/// parity the producer waits on at its `empty` barrier before it copies into the stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waits {
    pub stage: usize,
    pub full_parity: u32,
    pub empty_parity: u32,
}

/// An mbarrier: a phase completes once `count` threads have arrived and the bytes announced
/// with `expect_tx` have been delivered; then the next phase begins.
#[derive(Clone, Debug)]
struct Mbarrier {
    count: usize,
    arrived: usize,
    bytes_due: i64,
    /// Phases completed so far: the current phase is number `completed`, of parity `completed & 1`.
    completed: u64,
}

impl Mbarrier {
    fn new(count: usize) -> Mbarrier {
        Mbarrier { count, arrived: 0, bytes_due: 0, completed: 0 }
    }

    /// `mbarrier.try_wait.parity`: the phase of `parity` just before the current one is complete
    /// exactly when the current phase has the other parity.
    fn try_wait(&self, parity: u32) -> bool {
        (self.completed & 1) as u32 != parity
    }

    fn arrive(&mut self) {
        self.arrived += 1;
        self.complete_if_done();
    }

    /// `mbarrier.arrive.expect_tx`: one arrival, and `bytes` more to come from the copy engine.
    fn arrive_expect_tx(&mut self, bytes: i64) {
        self.bytes_due += bytes;
        self.arrive();
    }

    /// The copy engine delivered `bytes`.
    fn complete_tx(&mut self, bytes: i64) {
        self.bytes_due -= bytes;
        self.complete_if_done();
    }

    fn complete_if_done(&mut self) {
        if self.arrived == self.count && self.bytes_due == 0 {
            self.arrived = 0;
            self.completed += 1;
        }
    }
}

/// The size of one simulated pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setup {
    /// Shared-memory stages (the kernel's `FA3_STAGES`).
    pub stages: usize,
    /// Consumer warps, each of which releases every stage once per use (the kernel has 8: two
    /// warpgroups of four).
    pub warps: usize,
    /// K/V tiles streamed through the pipeline (over all the block's query tiles).
    pub tiles: usize,
    /// Picks the interleaving.
    pub seed: u64,
}

/// What the simulation saw go wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// Every actor waits and no copy is in flight: the kernel would hang.
    Deadlock(String),
    /// A consumer warp went past its wait on `full` while the stage did not hold its tile.
    ReadBeforeLanded(String),
    /// The producer issued a copy into a stage while a warp was still reading the stage's tile.
    Overwrite(String),
    /// `waits` named a stage outside the pipeline.
    NoSuchStage(String),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, detail) = match self {
            Violation::Deadlock(d) => ("deadlock: every thread waits and nothing is in flight", d),
            Violation::ReadBeforeLanded(d) => ("a warp read a stage before its tile landed", d),
            Violation::Overwrite(d) => ("the producer overwrote a stage a warp still reads", d),
            Violation::NoSuchStage(d) => ("a stage outside the pipeline", d),
        };
        write!(f, "{what}: {detail}")
    }
}

/// One step of the simulation, in the order they ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The producer passed `empty[stage]` on `parity` and issued the copy of `tile`.
    Issue { tile: usize, stage: usize, parity: u32 },
    /// The copy engine delivered `tile` into `stage`.
    Landed { tile: usize, stage: usize },
    /// Consumer `warp` passed `full[stage]` on `parity` and reads `tile`.
    Read { warp: usize, tile: usize, stage: usize, parity: u32 },
    /// Consumer `warp` released `stage` (its read of `tile` is done).
    Release { warp: usize, tile: usize, stage: usize },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Event::Issue { tile, stage, parity } => write!(
                f,
                "producer: empty[{stage}] parity {parity} passed, copy of tile {tile} issued"
            ),
            Event::Landed { tile, stage } => {
                write!(f, "copy engine: tile {tile} landed in stage {stage}")
            }
            Event::Read { warp, tile, stage, parity } => {
                write!(f, "warp {warp}: full[{stage}] parity {parity} passed, reads tile {tile}")
            }
            Event::Release { warp, tile, stage } => {
                write!(f, "warp {warp}: releases stage {stage} (tile {tile})")
            }
        }
    }
}

/// Where one actor is in its loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Waiting on its barrier for the tile at this position.
    Wait(usize),
    /// (a consumer) past its wait, reading the stage's tile at this position.
    Read(usize),
    Done,
}

/// The tile each stage holds (the position it was copied for), and copies in flight.
struct Pipeline {
    full: Vec<Mbarrier>,
    empty: Vec<Mbarrier>,
    holds: Vec<Option<usize>>,
    in_flight: Vec<(usize, usize)>,
}

const TILE_BYTES: i64 = 32 * 1024;

/// A small deterministic generator for the interleaving (splitmix64).
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// Runs the pipeline of `setup` with `waits` deciding every stage and parity, and returns the
/// events in the order they happened, or the first violation (with the events before it).
pub fn simulate(
    setup: Setup,
    waits: impl Fn(usize, usize) -> Waits,
) -> Result<Vec<Event>, (Violation, Vec<Event>)> {
    let Setup { stages, warps, tiles, seed } = setup;
    let mut pipe = Pipeline {
        full: vec![Mbarrier::new(1); stages],
        empty: vec![Mbarrier::new(warps); stages],
        holds: vec![None; stages],
        in_flight: Vec::new(),
    };
    let start = |tiles: usize| if tiles == 0 { Step::Done } else { Step::Wait(0) };
    let mut producer = start(tiles);
    let mut consumers = vec![start(tiles); warps];
    let mut log = Vec::new();
    let mut draw = Draw(seed);
    let stage_of = |pos: usize, log: &Vec<Event>| {
        let w = waits(pos, stages);
        if w.stage < stages {
            Ok(w)
        } else {
            let why = format!("waits({pos}, {stages}) gave stage {}", w.stage);
            Err((Violation::NoSuchStage(why), log.clone()))
        }
    };
    loop {
        // Who can move now: 0 the producer, 1 the copy engine, 2 + w consumer warp w.
        let mut ready = Vec::new();
        if let Step::Wait(pos) = producer {
            let w = stage_of(pos, &log)?;
            if pipe.empty[w.stage].try_wait(w.empty_parity) {
                ready.push(0);
            }
        }
        if !pipe.in_flight.is_empty() {
            ready.push(1);
        }
        for (i, c) in consumers.iter().enumerate() {
            match *c {
                Step::Wait(pos) => {
                    let w = stage_of(pos, &log)?;
                    if pipe.full[w.stage].try_wait(w.full_parity) {
                        ready.push(2 + i);
                    }
                }
                Step::Read(_) => ready.push(2 + i),
                Step::Done => {}
            }
        }
        if ready.is_empty() {
            if producer == Step::Done && consumers.iter().all(|c| *c == Step::Done) {
                return Ok(log);
            }
            let mut who = Vec::new();
            if let Step::Wait(pos) = producer {
                let w = waits(pos, stages);
                let bar = &pipe.empty[w.stage];
                who.push(format!(
                    "the producer (tile {pos}) waits on empty[{}] for parity {}, and the barrier \
                     is in phase {} (parity {})",
                    w.stage,
                    w.empty_parity,
                    bar.completed,
                    bar.completed & 1
                ));
            }
            for (i, c) in consumers.iter().enumerate() {
                if let Step::Wait(pos) = *c {
                    let w = waits(pos, stages);
                    let bar = &pipe.full[w.stage];
                    who.push(format!(
                        "warp {i} (tile {pos}) waits on full[{}] for parity {}, and the barrier \
                         is in phase {} (parity {})",
                        w.stage,
                        w.full_parity,
                        bar.completed,
                        bar.completed & 1
                    ));
                }
            }
            return Err((Violation::Deadlock(who.join("; ")), log));
        }
        match ready[draw.below(ready.len())] {
            0 => {
                let Step::Wait(pos) = producer else { unreachable!("the producer was ready") };
                let w = waits(pos, stages);
                // A warp still reading the stage's tile, or yet to read an earlier tile of it.
                let pending = |c: &Step| match *c {
                    Step::Read(p) => waits(p, stages).stage == w.stage,
                    Step::Wait(p) => p < pos && waits(p, stages).stage == w.stage,
                    Step::Done => false,
                };
                if let Some(i) = consumers.iter().position(pending) {
                    let (Step::Read(p) | Step::Wait(p)) = consumers[i] else { unreachable!() };
                    let doing = if matches!(consumers[i], Step::Read(_)) {
                        "reads"
                    } else {
                        "has yet to read"
                    };
                    let why = format!(
                        "tile {pos} is copied into stage {} while warp {i} {doing} tile {p} there",
                        w.stage
                    );
                    return Err((Violation::Overwrite(why), log));
                }
                pipe.full[w.stage].arrive_expect_tx(TILE_BYTES);
                pipe.holds[w.stage] = None; // the copy engine writes the stage from now on
                pipe.in_flight.push((w.stage, pos));
                log.push(Event::Issue { tile: pos, stage: w.stage, parity: w.empty_parity });
                producer = if pos + 1 < tiles { Step::Wait(pos + 1) } else { Step::Done };
            }
            1 => {
                let (stage, pos) = pipe.in_flight.remove(draw.below(pipe.in_flight.len()));
                pipe.holds[stage] = Some(pos);
                pipe.full[stage].complete_tx(TILE_BYTES);
                log.push(Event::Landed { tile: pos, stage });
            }
            n => {
                let i = n - 2;
                match consumers[i] {
                    Step::Wait(pos) => {
                        let w = waits(pos, stages);
                        if pipe.holds[w.stage] != Some(pos) {
                            let held = match pipe.holds[w.stage] {
                                Some(p) => format!("tile {p}"),
                                None => "a copy still in flight, or nothing yet".to_string(),
                            };
                            let why = format!(
                                "warp {i} passed full[{}] parity {} for tile {pos}, but the \
                                 stage holds {held}",
                                w.stage, w.full_parity
                            );
                            return Err((Violation::ReadBeforeLanded(why), log));
                        }
                        log.push(Event::Read {
                            warp: i,
                            tile: pos,
                            stage: w.stage,
                            parity: w.full_parity,
                        });
                        consumers[i] = Step::Read(pos);
                    }
                    Step::Read(pos) => {
                        let w = waits(pos, stages);
                        pipe.empty[w.stage].arrive();
                        log.push(Event::Release { warp: i, tile: pos, stage: w.stage });
                        consumers[i] =
                            if pos + 1 < tiles { Step::Wait(pos + 1) } else { Step::Done };
                    }
                    Step::Done => unreachable!("a finished warp is never ready"),
                }
            }
        }
    }
}

/// The events as a picture: one row per actor (the producer, the copy engine, each consumer
/// warp), one column per step in the order they ran, each step coloured by the stage it used and
/// labelled with its tile: the ring of stages going round, and who waits for whom.
pub fn timeline(setup: Setup, events: &[Event]) -> crate::results::Figures {
    let rows = 2 + setup.warps;
    let (cell_w, cell_h, left, top) = (16i32, 22i32, 118i32, 30i32);
    let width = (left + cell_w * events.len().max(1) as i32 + 12) as u32;
    let height = (top + cell_h * rows as i32 + 30) as u32;
    let colours = [
        RGBColor(66, 133, 244),
        RGBColor(234, 134, 0),
        RGBColor(52, 168, 83),
        RGBColor(171, 71, 188),
    ];
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        let drawn: Result<(), Box<dyn std::error::Error>> = (|| {
            root.fill(&WHITE)?;
            let title = format!(
                "{} stages, {} warps, {} tiles: each step coloured by its stage, labelled by its tile",
                setup.stages, setup.warps, setup.tiles
            );
            root.draw(&Text::new(title, (8, 8), ("sans-serif", 13)))?;
            for r in 0..rows {
                let name = match r {
                    0 => "producer".to_string(),
                    1 => "copy engine".to_string(),
                    w => format!("warp {}", w - 2),
                };
                root.draw(&Text::new(name, (8, top + r as i32 * cell_h + 5), ("sans-serif", 12)))?;
            }
            for (x, e) in events.iter().enumerate() {
                let (row, tile, stage, open) = match *e {
                    Event::Issue { tile, stage, .. } => (0, tile, stage, true),
                    Event::Landed { tile, stage } => (1, tile, stage, true),
                    Event::Read { warp, tile, stage, .. } => (2 + warp, tile, stage, true),
                    Event::Release { warp, tile, stage } => (2 + warp, tile, stage, false),
                };
                let (x0, y0) = (left + x as i32 * cell_w, top + row as i32 * cell_h);
                let colour = colours[stage % colours.len()];
                // A read is a filled cell, a release an outlined one.
                let style = if open { colour.filled() } else { colour.stroke_width(2) };
                root.draw(&Rectangle::new(
                    [(x0 + 1, y0), (x0 + cell_w - 1, y0 + cell_h - 4)],
                    style,
                ))?;
                let ink = if open { WHITE } else { BLACK };
                root.draw(&Text::new(
                    tile.to_string(),
                    (x0 + 3, y0 + 4),
                    ("sans-serif", 10).into_font().color(&ink),
                ))?;
            }
            let legend = "filled: a copy issued or landed, a read; outlined: a release";
            root.draw(&Text::new(legend, (8, top + rows as i32 * cell_h + 8), ("sans-serif", 12)))?;
            Ok(())
        })();
        if let Err(e) = drawn {
            return crate::results::Figures(vec![format!("<p>chart failed: {e}</p>")]);
        }
        let _ = root.present();
    }
    crate::results::Figures(vec![svg])
}

/// The kernel's own rule (`PipelineState` in `barrier.cuh`), for comparison.
pub fn kernel_waits(count: usize, stages: usize) -> Waits {
    let round = (count / stages) as u32;
    Waits { stage: count % stages, full_parity: round & 1, empty_parity: (round & 1) ^ 1 }
}

/// Notebook 13's check: `waits` must put the `c`-th tile in stage `c mod stages` (the ring's
/// order), and run every pipeline of 1–8 stages, 1–8 warps and up to 40 tiles, in 256 random
/// interleavings, without a hang, an early read or an overwrite.
pub fn check(waits: impl Fn(usize, usize) -> Waits) -> Result<(), crate::Failure> {
    use proptest::prelude::*;
    for stages in 1..=8 {
        for count in 0..64 {
            let stage = waits(count, stages).stage;
            if stage != count % stages {
                return Err(crate::Failure(format!(
                    "FAIL: waits\nwaits({count}, {stages}) puts the tile in stage {stage}: the \
                     {count}-th tile goes to stage {count} mod {stages} = {}, the ring's order",
                    count % stages
                )));
            }
        }
    }
    let setups = (1..=8usize, 1..=8usize, 0..=40usize, any::<u64>())
        .prop_map(|(stages, warps, tiles, seed)| Setup { stages, warps, tiles, seed });
    crate::exercise::property("waits", 256, setups, |setup| {
        simulate(setup, &waits).map(|_| ()).map_err(|(violation, log)| {
            let tail: Vec<String> = log.iter().rev().take(12).map(Event::to_string).collect();
            let tail: Vec<String> = tail.into_iter().rev().collect();
            crate::exercise::fail(format!("{violation}\nthe last events:\n  {}", tail.join("\n  ")))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setups() -> impl Iterator<Item = Setup> {
        (1..=4).flat_map(|stages| {
            (1..=8).flat_map(move |warps| {
                [0, 1, 5, 17, 40].into_iter().flat_map(move |tiles| {
                    (0..20).map(move |seed| Setup { stages, warps, tiles, seed })
                })
            })
        })
    }

    #[test]
    fn the_kernels_rule_runs_every_pipeline() {
        for setup in setups() {
            let log =
                simulate(setup, kernel_waits).unwrap_or_else(|(v, _)| panic!("{setup:?}: {v}"));
            // Every tile issued and landed once, and read and released once by every warp.
            assert_eq!(log.len(), setup.tiles * (2 + 2 * setup.warps), "{setup:?}");
        }
    }

    #[test]
    fn the_same_parity_on_both_sides_hangs() {
        let slip = |count: usize, stages: usize| {
            let w = kernel_waits(count, stages);
            Waits { empty_parity: w.full_parity, ..w }
        };
        let setup = Setup { stages: 2, warps: 8, tiles: 5, seed: 1 };
        assert!(matches!(simulate(setup, slip), Err((Violation::Deadlock(_), _))));
    }

    #[test]
    fn a_parity_per_tile_instead_of_per_round_reads_early_or_overwrites() {
        // count & 1 is the round's parity only with one stage.
        let slip = |count: usize, stages: usize| {
            let p = (count & 1) as u32;
            Waits { stage: count % stages, full_parity: p, empty_parity: p ^ 1 }
        };
        assert!(simulate(Setup { stages: 1, warps: 4, tiles: 9, seed: 3 }, slip).is_ok());
        let failures = (0..50)
            .filter(|&seed| simulate(Setup { stages: 2, warps: 4, tiles: 9, seed }, slip).is_err())
            .count();
        assert_eq!(failures, 50, "every interleaving of two stages goes wrong");
    }

    #[test]
    fn no_wait_at_all_is_caught() {
        let never_wait = |count: usize, stages: usize| {
            // parity 1 on a fresh barrier passes at once, and so does any parity that differs
            // from the current phase's: waiting on "the other parity" each time never blocks.
            Waits { stage: count % stages, full_parity: 1, empty_parity: 1 }
        };
        let failed = (0..20).any(|seed| {
            simulate(Setup { stages: 2, warps: 2, tiles: 8, seed }, never_wait).is_err()
        });
        assert!(failed);
    }

    #[test]
    fn the_timeline_draws_every_step_in_its_actors_row() {
        let setup = Setup { stages: 2, warps: 2, tiles: 5, seed: 5 };
        let events = simulate(setup, kernel_waits).unwrap();
        let svg = &timeline(setup, &events).0[0];
        assert!(svg.starts_with("<svg") && svg.contains("copy engine") && svg.contains("warp 1"));
        // One cell per step, on the white background.
        assert_eq!(svg.matches("<rect").count(), events.len() + 1, "{svg}");
    }

    #[test]
    fn a_fresh_barrier_passes_parity_one_only() {
        let bar = Mbarrier::new(2);
        assert!(bar.try_wait(1));
        assert!(!bar.try_wait(0));
        let mut bar = bar;
        bar.arrive();
        assert!(!bar.try_wait(0), "one of two arrivals: the phase is not complete");
        bar.arrive();
        assert!(bar.try_wait(0) && !bar.try_wait(1), "phase 0 complete, phase 1 current");
        let mut full = Mbarrier::new(1);
        full.arrive_expect_tx(100);
        assert!(!full.try_wait(0), "arrived, but the bytes have not");
        full.complete_tx(100);
        assert!(full.try_wait(0));
    }
}
