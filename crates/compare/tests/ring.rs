//! The ring rung (`ladder_reference::ring`) against FA2 on the whole sequence: drawn problems
//! (GQA, lengths not divisible by the ranks or by `2P`, ranks 1–5, both shardings, causal and
//! not, sinks), forward and backward, in `f64` (exact to ~1e-13: the algorithm) and against the
//! float64 oracle's tolerance in `f32`; and the zigzag sharding's balance under the causal mask.

use ladder_compare::oracle::{Expected, check};
use ladder_compare::{CaseSpace, cases};
use ladder_reference::ring::{self, RingOptions, Sharding};
use ladder_reference::{AttentionOptions, Fa2Options, fa2};
use ndarray::{Array, Dimension};
use proptest::prelude::*;

fn max_diff<D: Dimension>(a: &Array<f64, D>, b: &Array<f64, D>) -> f64 {
    a.iter().zip(b).map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() }).fold(0.0, f64::max)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn ring_attention_is_fa2_on_the_whole_sequence(
        case in cases(CaseSpace { n_q: 1..=40, n_kv: 1..=1, ..CaseSpace::cpu().moderate_logits() }),
        ranks in 1..=5usize,
        zigzag in any::<bool>(),
        sinks in any::<bool>(),
    ) {
        // One sequence shared by the ranks: as many keys as queries.
        let mut shape = case.shape;
        shape.n_kv = shape.n_q;
        let case = ladder_compare::Case { shape, ..case };
        let mut attention = AttentionOptions { causal: case.causal, scale: Some(case.scale()), ..Default::default() };
        if sinks {
            attention = attention.with_sinks((0..shape.heads_q).map(|h| h as f64 * 0.5 - 1.0).collect());
        }
        let sharding = if zigzag { Sharding::Zigzag } else { Sharding::Contiguous };
        let opts = RingOptions { tiles: case.tiles, ..RingOptions::new(attention.clone(), ranks) }.with_sharding(sharding);
        let x = case.inputs::<f64>();
        let (q, k, v, d_o) = (x.q.view(), x.k.view(), x.v.view(), x.d_o.view());
        let full = Fa2Options { attention: attention.clone(), tiles: case.tiles };
        let want = fa2::forward(q, k, v, &full).unwrap();
        let got = ring::forward(q, k, v, &opts).unwrap().out;
        prop_assert!(max_diff(&got.o, &want.o) < 1e-12, "O differs by {}", max_diff(&got.o, &want.o));
        prop_assert!(max_diff(&got.lse, &want.lse) < 1e-12, "lse differs");
        let g_want = fa2::backward(q, k, v, want.o.view(), d_o, want.lse.view(), &full).unwrap();
        let g_got = ring::backward(q, k, v, got.o.view(), d_o, got.lse.view(), &opts).unwrap();
        for (name, a, b) in [("dq", &g_got.dq, &g_want.dq), ("dk", &g_got.dk, &g_want.dk), ("dv", &g_got.dv, &g_want.dv)] {
            prop_assert!(max_diff(a, b) < 1e-11, "{} differs by {}", name, max_diff(a, b));
        }
        if let (Some(a), Some(b)) = (&g_got.dsinks, &g_want.dsinks) {
            prop_assert!(max_diff(a, b) < 1e-11, "dsinks differ");
        }
        prop_assert_eq!(g_got.dsinks.is_some(), sinks);
        // In f32, against the float64 oracle with the rule every rung meets.
        let x32 = case.inputs::<f32>();
        let expected = Expected::new(&x32, &attention).unwrap();
        let out = ring::forward(x32.q.view(), x32.k.view(), x32.v.view(), &opts).unwrap().out;
        check("ring", &out, &expected, None).map_err(TestCaseError::fail)?;
    }
}

/// Under the causal mask the contiguous ring's last rank attends at every step and the first
/// only at the first, so a step lasts as long as the busiest rank's work: the zigzag sharding
/// evens the ranks out, and its ring finishes in about half the contiguous ring's time.
#[test]
fn the_zigzag_balances_the_causal_ring() {
    let (p, n) = (4, 4 * 64);
    let x = ndarray::Array4::<f64>::from_shape_fn((1, 1, n, 8), |(_, _, i, c)| {
        ((i * 3 + c) % 7) as f64 * 0.1
    });
    let run = |sharding| {
        let opts = RingOptions::new(AttentionOptions::causal(), p).with_sharding(sharding);
        ring::forward(x.view(), x.view(), x.view(), &opts).unwrap().work
    };
    let (contiguous, zigzag) = (run(Sharding::Contiguous), run(Sharding::Zigzag));
    // The same pairs in all: the causal triangle.
    let total = |w: &Vec<Vec<u64>>| w.iter().flatten().sum::<u64>();
    assert_eq!(total(&contiguous), (n * (n + 1) / 2) as u64);
    assert_eq!(total(&zigzag), total(&contiguous));
    // Contiguous: at step s only ranks r ≥ s work.
    for (s, step) in contiguous.iter().enumerate() {
        assert!(step.iter().enumerate().all(|(r, &w)| (w > 0) == (r >= s)), "step {s}: {step:?}");
    }
    // Zigzag: every rank works at every step, within a few percent of the others.
    for (s, step) in zigzag.iter().enumerate() {
        let (lo, hi) = (*step.iter().min().unwrap(), *step.iter().max().unwrap());
        assert!(lo > 0 && (hi - lo) as f64 <= 0.1 * hi as f64, "step {s}: {step:?}");
    }
    let (c, z) = (ring::critical_path(&contiguous), ring::critical_path(&zigzag));
    assert!(z as f64 <= 0.6 * c as f64, "zigzag {z} pairs on the critical path, contiguous {c}");
}

#[test]
fn what_the_ring_does_not_take_is_an_error() {
    let x = ndarray::Array4::<f64>::zeros((1, 2, 6, 4));
    let k = ndarray::Array4::<f64>::zeros((1, 2, 5, 4));
    let err = |opts: RingOptions, k: &ndarray::Array4<f64>| {
        ring::forward(x.view(), k.view(), k.view(), &opts).unwrap_err().to_string()
    };
    assert!(err(RingOptions::new(AttentionOptions::default(), 0), &x).contains("at least 1 rank"));
    assert!(err(RingOptions::new(AttentionOptions::default(), 2), &k).contains("n_q = n_kv"));
    let windowed = AttentionOptions::default().with_window(ladder_reference::Window::left(2));
    assert!(err(RingOptions::new(windowed, 2), &x).contains("windows"));
    let sinks = AttentionOptions::default().with_sinks(vec![0.0]);
    assert!(err(RingOptions::new(sinks, 2), &x).contains("sinks"));
}

/// The GPU ring (`ladder_kernels::ring`) cuts the sequence exactly as this rung does.
#[test]
fn the_gpu_ring_shards_as_the_cpu_rung() {
    use ladder_kernels::ring as gpu_ring;
    for n in 0..=40 {
        for p in 1..=8 {
            for (cpu, gpu) in [
                (Sharding::Contiguous, gpu_ring::Sharding::Contiguous),
                (Sharding::Zigzag, gpu_ring::Sharding::Zigzag),
            ] {
                assert_eq!(ring::shards(n, p, cpu), gpu_ring::shards(n, p, gpu), "n {n}, P {p}");
            }
        }
    }
}
