/// Stage and parities for the `count`-th tile through `stages` stages.
fn waits(count: usize, stages: usize) -> Waits {
    // The tile's round: how many times every stage has been used before this use of its stage.
    // Each use completes one phase of the stage's `full` barrier (the copy lands) and one of its
    // `empty` barrier (every warp releases it), so in round r the consumers wait for phase r of
    // `full`, of parity r & 1. The producer, before round r's copy, waits for the release of
    // round r − 1: phase r − 1 of `empty`, of parity (r − 1) & 1 = (r & 1) ^ 1, which for r = 0
    // is 1, the "phase before phase 0" a fresh barrier counts as complete.
    let round = (count / stages) as u32;
    Waits { stage: count % stages, full_parity: round & 1, empty_parity: (round & 1) ^ 1 }
}
