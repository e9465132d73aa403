//! FlashDecoding++'s `φ` calibrated from a model's row maxima (`ladder_kernels::decode::
//! calibrate_phi` on `ladder_reference::flash_decoding_pp::row_maxima`): the fallback rate it
//! predicts is the one the FlashDecoding++ rung then has, row for row, on the same calls; and no
//! `φ` does better on them.

use ladder_compare::cases::pseudo_random;
use ladder_kernels::DType;
use ladder_kernels::decode::calibrate_phi;
use ladder_reference::{AttentionOptions, FlashDecodingPpOptions, Phi, flash_decoding_pp};
use ndarray::Array4;

/// Decoding calls of 4 new tokens against 300 keys, 8 query heads over 2 kv heads, whose heads'
/// scores spread differently (head `h`'s queries scaled by `1 + h/2`): row maxima over a range
/// wider than fp16's safe window, as a model's heads have.
fn calls(seed: u64) -> (Array4<f32>, Array4<f32>, Array4<f32>) {
    let (b, hq, hkv, n, l, d) = (3, 8, 2, 4, 300, 32);
    let q = pseudo_random(seed, b * hq * n * d);
    let q = Array4::from_shape_fn((b, hq, n, d), |(bi, h, i, c)| {
        3.0 * (1.0 + h as f32 / 2.0) * q[((bi * hq + h) * n + i) * d + c]
    });
    let kv = |s| Array4::from_shape_vec((b, hkv, l, d), pseudo_random(s, b * hkv * l * d)).unwrap();
    (q, kv(seed + 1), kv(seed + 2))
}

#[test]
fn the_calibrated_fallback_rate_is_the_rungs() {
    let opts = AttentionOptions::causal();
    let fp16 = ladder_kernels::decode::default_safe_range(DType::F16);
    for seed in [1, 2, 3] {
        let (q, k, v) = calls(seed);
        let maxima = flash_decoding_pp::row_maxima(q.view(), k.view(), &opts).unwrap();
        let c = calibrate_phi(&maxima, None, DType::F16).unwrap();
        assert_eq!(c.safe_range, fp16);
        let rung = FlashDecodingPpOptions {
            safe_range: Some((f64::from(fp16.0), f64::from(fp16.1))),
            ..FlashDecodingPpOptions::new(opts.clone())
        }
        .with_phi(Phi::Given(f64::from(c.phi)));
        let out = flash_decoding_pp::forward(q.view(), k.view(), v.view(), &rung).unwrap();
        let rows = maxima.len() as f64;
        let fell_back = out.stats.fallback_rows.expect("the rung counts them") as f64;
        assert_eq!(fell_back, (c.expected_fallback * rows).round(), "seed {seed}: {c:?}");
        assert!(c.expected_fallback > 0.0, "the heads' spread exceeds the window: {c:?}");
        // No φ on a grid around it sends fewer rows back.
        let outside = |phi: f32| {
            maxima.iter().filter(|&&m| !(phi + fp16.0 <= m && m <= phi + fp16.1)).count()
        };
        let best = outside(c.phi);
        for step in -40..=40 {
            let phi = c.phi + step as f32 * 0.25;
            assert!(outside(phi) >= best, "seed {seed}: φ = {phi} does better than {}", c.phi);
        }
    }
}
