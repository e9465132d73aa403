//! Criterion benchmarks of the CPU rungs over n = 256 … 8192 (batch 1, 4 heads, d = 64, no mask).
//!
//! `cargo bench -p ladder-compare --bench cpu_rungs` runs them all (about half an hour on two
//! cores); pass a filter such as `-- fa2/4096` for one. Throughput is reported in FLOP/s with the
//! FLOP count of `docs/conventions.md` (4·B·H·n²·d), so "elements/s" reads as FLOP/s.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ladder_compare::{Case, Rung, RungConfig};
use ladder_reference::{AttentionShape, TileSizes};

const SIZES: [usize; 6] = [256, 512, 1024, 2048, 4096, 8192];
const HEADS: usize = 4;
const D: usize = 64;

fn rungs(c: &mut Criterion) {
    for rung in Rung::ALL {
        let mut group = c.benchmark_group(rung.name());
        group
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(5));
        // The scalar online-softmax rung is 30× slower than the blocked ones: stop it at 2048.
        let sizes = SIZES.iter().copied().filter(|&n| rung != Rung::OnlineSoftmax || n <= 2048);
        for n in sizes {
            let case = Case {
                shape: AttentionShape::new(1, HEADS, HEADS, n, n, D).expect("valid shape"),
                causal: false,
                window: Default::default(),
                score_mod: None,
                mask_mod: None,
                logit_std: 1.0,
                tiles: TileSizes::default(),
                splits: 8,
                seed: 0,
            };
            let inputs = case.inputs::<f32>();
            let config = RungConfig {
                attention: case.attention(),
                tiles: case.tiles,
                splits: case.splits,
                ..RungConfig::default()
            };
            group.throughput(Throughput::Elements((4 * HEADS * n * n * D) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(n), &inputs, |b, inputs| {
                b.iter(|| {
                    rung.forward(inputs.q.view(), inputs.k.view(), inputs.v.view(), &config)
                        .expect("runs")
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, rungs);
criterion_main!(benches);
