/// `work[s][r]`: the pairs rank `r` attends at step `s`, given each rank's chunks (`shards[r]`).
fn my_work(shards: &[Vec<Range<usize>>], causal: bool) -> Vec<Vec<u64>> {
    let p = shards.len();
    let mut work = vec![vec![0u64; p]; p];
    for step in 0..p {
        for r in 0..p {
            // The key chunks rank r holds at this step: rank r − s's, passed along the ring.
            let held = &shards[(r + p - step) % p];
            for q in &shards[r] {
                for k in held {
                    let (nq, nk) = (q.len() as u64, k.len() as u64);
                    work[step][r] += if !causal || k.end <= q.start {
                        nq * nk // every pair visible
                    } else if k == q {
                        nq * (nq + 1) / 2 // its own chunk: the causal triangle
                    } else {
                        0 // keys after the queries
                    };
                }
            }
        }
    }
    work
}
