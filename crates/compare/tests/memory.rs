//! Extra memory, measured with a counting allocator (this test binary has a single test so no
//! other test allocates while it measures).

use ladder_compare::memory::{PeakAlloc, measure};
use ladder_compare::{Case, Rung, RungConfig};
use ladder_reference::{AttentionShape, TileSizes};

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Peak heap bytes a rung allocates beyond its returned `O` and `lse`.
fn extra_bytes(rung: Rung, n: usize, d: usize) -> u64 {
    let case = Case {
        shape: AttentionShape::new(1, 1, 1, n, n, d).unwrap(),
        causal: false,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std: 1.0,
        tiles: TileSizes::default(),
        splits: 1,
        seed: 3,
    };
    let inputs = case.inputs::<f32>();
    let config =
        RungConfig { attention: case.attention(), tiles: case.tiles, ..RungConfig::default() };
    let run = measure(|| {
        rung.forward(inputs.q.view(), inputs.k.view(), inputs.v.view(), &config).unwrap()
    });
    let returned = ((run.value.o.len() + run.value.lse.len()) * size_of::<f32>()) as u64;
    run.peak_bytes.expect("the counting allocator is installed") - returned
}

#[test]
fn naive_memory_grows_as_n_squared_while_fa2_stays_linear() {
    // Each worker thread holds its own tiles: fix the pool so the figures do not depend on
    // how many cores the machine has.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(measure_and_check);
}

fn measure_and_check() {
    let d = 64;
    extra_bytes(Rung::Fa2, 64, d); // warm up the thread pool outside the measurements
    let (naive_small, naive_large) =
        (extra_bytes(Rung::Naive, 256, d), extra_bytes(Rung::Naive, 1024, d));
    let (fa2_small, fa2_large) = (extra_bytes(Rung::Fa2, 256, d), extra_bytes(Rung::Fa2, 1024, d));
    // Naive materialises the n × n score matrix: its extra memory grows by (1024² − 256²) floats.
    assert!(naive_small >= 256 * 256 * 4, "naive at n = 256 allocated only {naive_small} bytes");
    assert!(
        naive_large - naive_small >= (1024 * 1024 - 256 * 256) * 4,
        "naive: {naive_small} → {naive_large} bytes"
    );
    // FA2 allocates tiles and per-row statistics: within O(n·d), far below naive.
    for (n, bytes) in [(256, fa2_small), (1024, fa2_large)] {
        assert!(bytes <= (4 * n * d * size_of::<f32>()) as u64, "fa2 at n = {n}: {bytes} bytes");
    }
    assert!(fa2_large * 10 < naive_large);
}
