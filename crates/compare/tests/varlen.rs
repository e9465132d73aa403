//! Packed variable-length batches on the CPU rungs (`ladder_reference::varlen`): every sequence of
//! a drawn ragged batch (lengths 0, 1, a tile ± 1, longer; sequences with no queries or no keys;
//! GQA; causal with `n_q ≠ n_kv`) is held to the float64 oracle run on that sequence alone,
//! copied out of the packed tensors element by element, within the ladder's rule (twice the
//! naive rung's error in the same precision); the backward pass too, against the float64
//! gradients.

use ladder_compare::oracle::{Expected, ExpectedGradients, check};
use ladder_compare::packed;
use ladder_reference::varlen::{self, SeqLens};
use ladder_reference::{AttentionOptions, Fa2Options, Gradients, RunStats, fa2, naive};
use ndarray::{Array3, s};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// The CPU FA2 rung's tiles in these cases: lengths around them exercise the tails.
const TILE: usize = 16;

/// A sequence length: empty, one, a tile ± 1, or anything up to a few tiles.
fn length() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0), Just(1), (TILE - 1..=TILE + 1), (0..=4 * TILE + 3),]
}

fn normal(shape: (usize, usize, usize), rng: &mut ChaCha8Rng) -> Array3<f32> {
    Array3::from_shape_simple_fn(shape, || StandardNormal.sample(rng))
}

/// A drawn ragged batch: its offsets, packed Q, K, V and dO, and the mask.
struct Batch {
    lens: Vec<(usize, usize)>,
    seq: SeqLens,
    q: Array3<f32>,
    k: Array3<f32>,
    v: Array3<f32>,
    d_o: Array3<f32>,
    attention: AttentionOptions,
}

fn batch(
    lens: Vec<(usize, usize)>,
    (heads_kv, group, d): (usize, usize, usize),
    causal: bool,
    seed: u64,
) -> Batch {
    let (q_lens, k_lens): (Vec<usize>, Vec<usize>) = lens.iter().copied().unzip();
    let seq = SeqLens::from_lengths(&q_lens, &k_lens).unwrap();
    let (total_q, total_k) = seq.totals();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let q = normal((total_q, heads_kv * group, d), &mut rng);
    let k = normal((total_k, heads_kv, d), &mut rng);
    let v = normal((total_k, heads_kv, d), &mut rng);
    let d_o = normal((total_q, heads_kv * group, d), &mut rng);
    Batch { lens, seq, q, k, v, d_o, attention: AttentionOptions { causal, ..Default::default() } }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn varlen_fa2_backward_meets_the_oracle_on_every_sequence(
        lens in prop::collection::vec((length(), length()), 1..=5),
        heads_kv in 1usize..=2,
        group in 1usize..=2,
        d in prop::sample::select(vec![8usize, 16, 40]),
        causal: bool,
        seed: u64,
    ) {
        let x = batch(lens, (heads_kv, group, d), causal, seed);
        let opts = Fa2Options::new(x.attention.clone()).with_tiles(TILE, TILE).unwrap();
        let (q, k, v) = (x.q.view(), x.k.view(), x.v.view());
        let out = varlen::forward(q, k, v, &x.seq, |q, k, v| fa2::forward(q, k, v, &opts)).unwrap();
        let g = varlen::backward((q, k, v), (out.o.view(), out.lse.view()), x.d_o.view(), &x.seq, false, |s| {
            fa2::backward(s.q, s.k, s.v, s.o, s.d_o, s.lse, &opts)
        })
        .unwrap();
        for b in 0..x.seq.batch() {
            let (rows, keys) = (x.seq.q_range(b), x.seq.k_range(b));
            if rows.is_empty() || keys.is_empty() {
                // No query or no key: no gradient flows to this sequence's keys or rows.
                let zero = |t: &Array3<f32>, r: std::ops::Range<usize>| t.slice(s![r, .., ..]).iter().all(|&e| e == 0.0);
                prop_assert!(zero(&g.dq, rows.clone()) && zero(&g.dk, keys.clone()) && zero(&g.dv, keys), "sequence {}", b);
                continue;
            }
            let inputs = packed::inputs((&x.q, &x.k, &x.v), Some(&x.d_o), rows.clone(), keys.clone());
            let expected = ExpectedGradients::new(&inputs, &x.attention).unwrap();
            let got = Gradients {
                dq: packed::rows(&g.dq, rows),
                dk: packed::rows(&g.dk, keys.clone()),
                dv: packed::rows(&g.dv, keys),
                dsinks: None,
                stats: RunStats::default(),
            };
            let (errs, pass) = expected.judge(&got);
            prop_assert!(pass, "sequence {} of {:?}: dQ {} dK {} dV {} (tol {:?})", b, x.lens, errs[0], errs[1], errs[2], expected.tolerances);
        }
    }

    #[test]
    fn varlen_fa2_meets_the_oracle_on_every_sequence(
        lens in prop::collection::vec((length(), length()), 1..=6),
        heads_kv in 1usize..=2,
        group in 1usize..=3,
        d in prop::sample::select(vec![8usize, 16, 40, 64]),
        causal: bool,
        seed: u64,
    ) {
        let (q_lens, k_lens): (Vec<usize>, Vec<usize>) = lens.iter().copied().unzip();
        let seq = SeqLens::from_lengths(&q_lens, &k_lens).unwrap();
        let (total_q, total_k) = seq.totals();
        let heads_q = heads_kv * group;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let q = normal((total_q, heads_q, d), &mut rng);
        let k = normal((total_k, heads_kv, d), &mut rng);
        let v = normal((total_k, heads_kv, d), &mut rng);
        let attention = AttentionOptions { causal, ..Default::default() };
        let opts = Fa2Options::new(attention.clone()).with_tiles(TILE, TILE).unwrap();
        let out = varlen::forward(q.view(), k.view(), v.view(), &seq, |q, k, v| {
            fa2::forward(q, k, v, &opts)
        })
        .unwrap();
        prop_assert_eq!((out.o.dim(), out.lse.dim()), ((total_q, heads_q, d), (heads_q, total_q)));
        for b in 0..seq.batch() {
            let (rows, keys) = (seq.q_range(b), seq.k_range(b));
            if rows.is_empty() {
                continue;
            }
            // This sequence's rows of the packed output, as a [1, heads_q, n, d] output.
            let got = packed::output(&out.o, &out.lse, rows.clone());
            if keys.is_empty() {
                // No key to see: O = 0, lse = −∞ (the oracle has no problem to run).
                prop_assert!(got.o.iter().all(|&x| x == 0.0), "sequence {} O", b);
                prop_assert!(got.lse.iter().all(|&x| x == f32::NEG_INFINITY), "sequence {} lse", b);
                continue;
            }
            let x = packed::inputs((&q, &k, &v), None, rows, keys);
            let expected = Expected::new(&x, &attention).unwrap();
            check(&format!("varlen fa2, sequence {b} of {lens:?}"), &got, &expected, None)
                .map_err(TestCaseError::fail)?;
        }
    }
}

/// With sinks, the packed gradient of each sink sums what every sequence gives it: in float64 it
/// equals the naive backward pass run on each sequence alone, summed (to f64 rounding), and it is
/// there, as zeros, when no sequence has both queries and keys.
#[test]
fn varlen_sinks_gradient_sums_the_sequences() {
    let cases: [&[(usize, usize)]; 3] = [
        &[(5, 9), (0, 4), (17, 3), (1, 1), (6, 0)],
        &[(TILE + 1, 2 * TILE), (TILE, TILE - 1)],
        &[(0, 7), (3, 0)],
    ];
    for (i, lens) in cases.into_iter().enumerate() {
        for causal in [false, true] {
            let x = batch(lens.to_vec(), (2, 2, 8), causal, i as u64);
            let wide = |t: &Array3<f32>| t.mapv(f64::from);
            let (q, k, v, d_o) = (wide(&x.q), wide(&x.k), wide(&x.v), wide(&x.d_o));
            let sinks = vec![0.5, -1.0, 2.0, 0.0];
            let attention = x.attention.clone().with_sinks(sinks.clone());
            let opts = Fa2Options::new(attention.clone()).with_tiles(TILE, TILE).unwrap();
            let (qv, kv, vv) = (q.view(), k.view(), v.view());
            let out = varlen::forward(qv, kv, vv, &x.seq, |q, k, v| fa2::forward(q, k, v, &opts))
                .unwrap();
            let run = |with_sinks: bool| {
                let o = (out.o.view(), out.lse.view());
                varlen::backward((qv, kv, vv), o, d_o.view(), &x.seq, with_sinks, |s| {
                    fa2::backward(s.q, s.k, s.v, s.o, s.d_o, s.lse, &opts)
                })
            };
            let got = run(true).unwrap().dsinks.expect("sinks were asked for");
            let mut want = ndarray::Array1::<f64>::zeros(sinks.len());
            for b in 0..x.seq.batch() {
                let (rows, keys) = (x.seq.q_range(b), x.seq.k_range(b));
                if rows.is_empty() || keys.is_empty() {
                    continue;
                }
                let inputs = packed::inputs((&q, &k, &v), Some(&d_o), rows, keys);
                let (q, k, v, d_o) =
                    (inputs.q.view(), inputs.k.view(), inputs.v.view(), inputs.d_o.view());
                want += &naive::backward(q, k, v, d_o, &attention).unwrap().dsinks.unwrap();
            }
            let diff = (&got - &want).mapv(f64::abs).fold(0.0, |m: f64, &e| m.max(e));
            assert!(diff < 1e-12, "case {i}, causal {causal}: {got} against {want}");
            // The flag must match the rung: a sinks gradient the caller did not expect is an error.
            if want.iter().any(|&e| e != 0.0) {
                assert!(run(false).is_err(), "case {i}: an unexpected sinks gradient passed");
            }
        }
    }
}
