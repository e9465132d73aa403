//! The oracle against the definition, and the counted quantities against their closed forms.
//!
//! Every other test compares rungs with the naive rung run in `f64`; these tests pin that oracle
//! to the formula itself, written out with plain loops and no shared helper (the mask included),
//! and its backward pass to finite differences.

use ladder_reference::{
    AttentionOptions, Fa1Options, Fa2Options, FlashDecodingOptions, FlashDecodingPpOptions,
    LadderError, MaskMod, Phi, ScoreMod, TileSizes, Window, fa1, fa2, fa3, flash_decoding,
    flash_decoding_pp, naive, online_softmax,
};
use ndarray::{Array3, Array4};

/// Deterministic pseudo-random values in [-1, 1) (a tiny LCG: no RNG crate in the oracle test).
fn tensor(dims: (usize, usize, usize, usize), seed: u64) -> Array4<f64> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    Array4::from_shape_simple_fn(dims, || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    })
}

/// `softmax(scale · q kᵀ + mask) v` straight from the definition.
fn definition(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    causal: bool,
    scale: f64,
) -> (Array4<f64>, Array3<f64>) {
    modified_definition(q, k, v, causal, scale, |s, _, _, _| s, None)
}

/// `softmax(f(scale · q kᵀ) + mask) v` straight from the definition, `f(s, head, i, j)`; with
/// `sinks`, head `h`'s logit `sinks[h]` joins every row's sum (gpt-oss's sink: a key with value 0).
fn modified_definition(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    causal: bool,
    scale: f64,
    f: impl Fn(f64, usize, usize, usize) -> f64,
    sinks: Option<&[f64]>,
) -> (Array4<f64>, Array3<f64>) {
    let nkv_minus_nq = k.dim().2 as i64 - q.dim().2 as i64;
    // Bottom-right causal alignment: query i sees key j iff j <= i + nkv - nq.
    let keep =
        |_: usize, _: usize, i: usize, j: usize| !causal || j as i64 <= i as i64 + nkv_minus_nq;
    masked_definition(q, k, v, keep, scale, f, sinks)
}

/// [`modified_definition`] with any mask: query `i` of batch entry `b`, head `h` sees key `j` iff
/// `keep(b, h, i, j)`.
fn masked_definition(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    keep: impl Fn(usize, usize, usize, usize) -> bool,
    scale: f64,
    f: impl Fn(f64, usize, usize, usize) -> f64,
    sinks: Option<&[f64]>,
) -> (Array4<f64>, Array3<f64>) {
    let (b, hq, nq, d) = q.dim();
    let (_, hkv, nkv, _) = k.dim();
    let mut o = Array4::zeros((b, hq, nq, d));
    let mut lse = Array3::zeros((b, hq, nq));
    for bi in 0..b {
        for h in 0..hq {
            let kh = h * hkv / hq;
            for i in 0..nq {
                let sees = |j: usize| keep(bi, h, i, j);
                let scores: Vec<f64> = (0..nkv)
                    .filter(|&j| sees(j))
                    .map(|j| {
                        let s = (0..d).map(|c| q[[bi, h, i, c]] * k[[bi, kh, j, c]]).sum::<f64>();
                        f(scale * s, h, i, j)
                    })
                    .collect();
                let sink = sinks.map_or(0.0, |s| s[h].exp());
                if scores.is_empty() && sinks.is_none() {
                    lse[[bi, h, i]] = f64::NEG_INFINITY;
                    continue;
                }
                let total: f64 = scores.iter().map(|s| s.exp()).sum::<f64>() + sink;
                lse[[bi, h, i]] = total.ln();
                for (j, s) in (0..nkv).filter(|&j| sees(j)).zip(&scores) {
                    for c in 0..d {
                        o[[bi, h, i, c]] += s.exp() / total * v[[bi, kh, j, c]];
                    }
                }
            }
        }
    }
    (o, lse)
}

fn max_diff<D: ndarray::Dimension>(a: &ndarray::Array<f64, D>, b: &ndarray::Array<f64, D>) -> f64 {
    a.iter().zip(b).map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() }).fold(0.0, f64::max)
}

/// Asserts that `grads` (dQ, dK, dV) are the central finite differences of the loss `L = Σ O ∘ dO`
/// of naive attention under `opts`, entry by entry.
fn assert_finite_differences(
    opts: &AttentionOptions,
    [q, k, v]: [&Array4<f64>; 3],
    d_o: &Array4<f64>,
    grads: [&Array4<f64>; 3],
) {
    let loss = |x: &[Array4<f64>; 3]| {
        (&naive::attention(x[0].view(), x[1].view(), x[2].view(), opts).unwrap().o * d_o).sum()
    };
    let h = 1e-6;
    for (which, analytic) in grads.into_iter().enumerate() {
        for (idx, &g) in analytic.indexed_iter() {
            let mut inputs = [q.clone(), k.clone(), v.clone()];
            inputs[which][idx] += h;
            let up = loss(&inputs);
            inputs[which][idx] -= 2.0 * h;
            let numeric = (up - loss(&inputs)) / (2.0 * h);
            assert!(
                (numeric - g).abs() < 1e-7,
                "tensor {which} at {idx:?}: numeric {numeric}, analytic {g}"
            );
        }
    }
}

#[test]
fn naive_f64_is_the_definition() {
    let shapes = [
        (1u64, 1, 1, 1, 1, 1, 1),
        (2, 2, 4, 2, 5, 9, 3),
        (3, 1, 3, 1, 9, 4, 5),
        (4, 2, 2, 2, 7, 7, 8),
    ];
    for (seed, b, hq, hkv, nq, nkv, d) in shapes {
        let (q, k, v) = (
            tensor((b, hq, nq, d), seed),
            tensor((b, hkv, nkv, d), seed + 10),
            tensor((b, hkv, nkv, d), seed + 20),
        );
        for causal in [false, true] {
            let scale = 0.7;
            let (o, lse) = definition(&q, &k, &v, causal, scale);
            let out = naive::attention(
                q.view(),
                k.view(),
                v.view(),
                &AttentionOptions { causal, scale: Some(scale), ..Default::default() },
            )
            .unwrap();
            assert!(max_diff(&out.o, &o) < 1e-14, "O differs (seed {seed}, causal {causal})");
            assert!(max_diff(&out.lse, &lse) < 1e-14, "lse differs (seed {seed}, causal {causal})");
        }
    }
}

#[test]
fn rows_that_see_no_key_give_zeros_and_minus_infinity() {
    // n_q > n_kv with the bottom-right causal mask: the first n_q − n_kv rows see nothing.
    let (q, k, v) = (tensor((1, 1, 5, 3), 1), tensor((1, 1, 2, 3), 2), tensor((1, 1, 2, 3), 3));
    let opts = AttentionOptions::causal();
    let outputs = [
        naive::attention(q.view(), k.view(), v.view(), &opts).unwrap(),
        online_softmax::attention(q.view(), k.view(), v.view(), &opts).unwrap(),
        fa1::forward(
            q.view(),
            k.view(),
            v.view(),
            &Fa1Options::new(opts.clone()).with_tiles(2, 1).unwrap(),
        )
        .unwrap(),
        fa2::forward(
            q.view(),
            k.view(),
            v.view(),
            &Fa2Options::new(opts.clone()).with_tiles(2, 1).unwrap(),
        )
        .unwrap(),
        fa3::forward(q.view(), k.view(), v.view(), &fa3::Fa3Options::new(opts.clone())).unwrap(),
        flash_decoding::forward(
            q.view(),
            k.view(),
            v.view(),
            &FlashDecodingOptions::new(opts.clone()).with_splits(5).unwrap(),
        )
        .unwrap(),
        flash_decoding_pp::forward(
            q.view(),
            k.view(),
            v.view(),
            &FlashDecodingPpOptions::new(opts),
        )
        .unwrap(),
    ];
    for out in outputs {
        for i in 0..3 {
            assert_eq!(out.lse[[0, 0, i]], f64::NEG_INFINITY);
            assert!(out.o.slice(ndarray::s![0, 0, i, ..]).iter().all(|&x| x == 0.0));
        }
        assert!(out.lse[[0, 0, 3]].is_finite() && out.lse[[0, 0, 4]].is_finite());
    }
}

/// Attention sinks as gpt-oss writes them: one more logit per head in every row's softmax, with
/// no value. Every rung against the definition, rows that a causal mask empties included (they
/// keep the sink: O = 0 and lse = σ, never −∞).
#[test]
fn every_rung_with_sinks_is_the_definition() {
    let (b, hq, hkv, nq, nkv, d) = (2, 4, 2, 7, 5, 3);
    let (q, k, v) =
        (tensor((b, hq, nq, d), 41), tensor((b, hkv, nkv, d), 42), tensor((b, hkv, nkv, d), 43));
    let sinks = vec![0.5, -1.0, 2.0, 0.0];
    let scale = 0.8;
    for causal in [false, true] {
        let (o, lse) = modified_definition(&q, &k, &v, causal, scale, |s, _, _, _| s, Some(&sinks));
        let opts = AttentionOptions { causal, scale: Some(scale), ..Default::default() }
            .with_sinks(sinks.clone());
        let (q, k, v) = (q.view(), k.view(), v.view());
        let tiled = |br, bc| Fa2Options::new(opts.clone()).with_tiles(br, bc).unwrap();
        let outputs = [
            ("naive", naive::attention(q, k, v, &opts)),
            ("online", online_softmax::attention(q, k, v, &opts)),
            (
                "fa1",
                fa1::forward(q, k, v, &Fa1Options::new(opts.clone()).with_tiles(2, 3).unwrap()),
            ),
            ("fa2", fa2::forward(q, k, v, &tiled(2, 3))),
            (
                "fa3",
                fa3::forward(
                    q,
                    k,
                    v,
                    &fa3::Fa3Options::new(opts.clone()).with_tiles(3, 2).unwrap(),
                ),
            ),
            (
                "flash-decoding",
                flash_decoding::forward(
                    q,
                    k,
                    v,
                    &FlashDecodingOptions::new(opts.clone()).with_splits(3).unwrap(),
                ),
            ),
            (
                "flash-decoding++",
                flash_decoding_pp::forward(q, k, v, &FlashDecodingPpOptions::new(opts.clone())),
            ),
        ];
        for (rung, out) in outputs {
            let out = out.unwrap();
            assert!(max_diff(&out.o, &o) < 1e-14, "{rung}: O differs (causal {causal})");
            assert!(max_diff(&out.lse, &lse) < 1e-14, "{rung}: lse differs (causal {causal})");
            if causal {
                // Rows 0 and 1 see no key (bottom-right: row i sees keys j <= i − 2).
                for (bi, h, i) in [(0, 0, 0), (1, 2, 1), (0, 3, 1)] {
                    // (FlashDecoding++ sums relative to its φ: σ up to a rounding.)
                    assert!((out.lse[[bi, h, i]] - sinks[h]).abs() < 1e-15, "{rung}");
                    assert!(out.o.slice(ndarray::s![bi, h, i, ..]).iter().all(|&x| x == 0.0));
                }
            }
        }
    }
    for bad in [vec![0.0; 3], vec![0.0, f64::NAN, 0.0, 0.0], vec![f64::INFINITY; 4]] {
        let opts = AttentionOptions::default().with_sinks(bad);
        let err = naive::attention(q.view(), k.view(), v.view(), &opts).unwrap_err().to_string();
        assert!(err.contains("sinks"), "{err}");
    }
}

/// Mask modifiers by their definitions, written out here: a document mask (key j's document is
/// `ids[j]`, query i sits at position i + nkv − nq), a prefix-LM mask (the first `p` keys, then
/// causal), a mask that keeps every other key (several runs per row), each composed with the
/// band and a score modifier. Every rung against the definition, in tiles from 1×1 up.
#[test]
fn every_rung_with_a_mask_mod_is_the_definition() {
    let (b, hq, hkv, nq, nkv, d) = (2, 4, 2, 6, 9, 3);
    let (q, k, v) =
        (tensor((b, hq, nq, d), 51), tensor((b, hkv, nkv, d), 52), tensor((b, hkv, nkv, d), 53));
    let scale = 0.9;
    let ids = [0u32, 0, 0, 1, 1, 2, 2, 2, 2];
    let shift = nkv - nq; // query i sits at position i + 3
    let every_other = MaskMod::new("every other key", |at: &ladder_reference::ScoreIndex| {
        (at.kv + at.head) % 2 == 0
    });
    type Keep = Box<dyn Fn(usize, usize, usize, usize) -> bool>;
    let cases: Vec<(&str, AttentionOptions, Keep)> = vec![
        (
            "documents, causal",
            AttentionOptions::causal().with_mask_mod(MaskMod::documents(ids.to_vec())),
            Box::new(move |_, _, i, j| j <= i + shift && ids[j] == ids[i + shift]),
        ),
        (
            "document lengths 3, 2, 4 (the same mask)",
            AttentionOptions::causal().with_mask_mod(MaskMod::document_lengths(&[3, 2, 4])),
            Box::new(move |_, _, i, j| j <= i + shift && ids[j] == ids[i + shift]),
        ),
        (
            "prefix-LM of 5",
            AttentionOptions::default().with_mask_mod(MaskMod::prefix_lm(5)),
            Box::new(move |_, _, i, j| j < 5 || j <= i + shift),
        ),
        (
            "every other key, within a window (2, 1)",
            AttentionOptions::default()
                .with_window(Window::new(2, 1))
                .with_mask_mod(every_other.clone()),
            Box::new(move |_, h, i, j| {
                (j + h) % 2 == 0 && j + 2 >= i + shift && j <= i + shift + 1
            }),
        ),
        (
            "prefix-LM of 2 or every other key",
            AttentionOptions::default().with_mask_mod(MaskMod::prefix_lm(2).or(every_other)),
            Box::new(move |_, h, i, j| j < 2 || j <= i + shift || (j + h) % 2 == 0),
        ),
        (
            "a mask of batch entry 1 alone (entry 0 sees nothing)",
            AttentionOptions::default().with_mask_mod(MaskMod::new("b1", |at| at.batch == 1)),
            Box::new(|b, _, _, _| b == 1),
        ),
    ];
    for (name, opts, keep) in cases {
        let opts = AttentionOptions { scale: Some(scale), ..opts }
            .with_score_mod(ScoreMod::alibi(vec![0.5, 0.25, 0.125, 0.0625]).unwrap());
        let alibi = |s: f64, h: usize, i: usize, j: usize| {
            s - [0.5, 0.25, 0.125, 0.0625][h] * (i as f64 + shift as f64 - j as f64).abs()
        };
        let (o, lse) = masked_definition(&q, &k, &v, &keep, scale, alibi, None);
        let (q, k, v) = (q.view(), k.view(), v.view());
        for (br, bc) in [(1, 1), (2, 3), (4, 4), (8, 16)] {
            let tiled = Fa2Options::new(opts.clone()).with_tiles(br, bc).unwrap();
            let outputs = [
                ("naive", naive::attention(q, k, v, &opts)),
                ("online", online_softmax::attention(q, k, v, &opts)),
                ("fa1", fa1::forward(q, k, v, &tiled)),
                ("fa2", fa2::forward(q, k, v, &tiled)),
                (
                    "fa3",
                    fa3::forward(
                        q,
                        k,
                        v,
                        &fa3::Fa3Options::new(opts.clone()).with_tiles(br, bc).unwrap(),
                    ),
                ),
                (
                    "flash-decoding",
                    flash_decoding::forward(
                        q,
                        k,
                        v,
                        &FlashDecodingOptions::new(opts.clone())
                            .with_splits(3)
                            .unwrap()
                            .with_tiles(br, bc)
                            .unwrap(),
                    ),
                ),
                (
                    "flash-decoding++",
                    flash_decoding_pp::forward(q, k, v, &FlashDecodingPpOptions::new(opts.clone())),
                ),
            ];
            for (rung, out) in outputs {
                let out = out.unwrap();
                let at = format!("{rung}, {name}, tiles {br}×{bc}");
                assert!(max_diff(&out.o, &o) < 1e-14, "{at}: O differs");
                assert!(max_diff(&out.lse, &lse) < 1e-14, "{at}: lse differs");
            }
        }
        // A row the masks empty gets zeros and −∞.
        for ((bi, h, i), &l) in lse.indexed_iter() {
            if (0..nkv).all(|j| !keep(bi, h, i, j)) {
                assert_eq!(l, f64::NEG_INFINITY, "{name}");
            }
        }
    }
    // A document table of the wrong length is an error, not a wrong answer.
    let bad = AttentionOptions::default().with_mask_mod(MaskMod::documents(vec![0; 8]));
    let err = naive::attention(q.view(), k.view(), v.view(), &bad).unwrap_err().to_string();
    assert!(err.contains("8 keys for 9 keys"), "{err}");
}

/// The backward pass through a mask modifier against finite differences: the hidden pairs carry
/// no gradient, and FA2's tiles skip what the block mask empties.
#[test]
fn the_backward_pass_through_a_mask_mod_matches_finite_differences() {
    let (b, hq, hkv, nq, nkv, d) = (1, 2, 1, 5, 7, 3);
    let (q, k, v, d_o) = (
        tensor((b, hq, nq, d), 61),
        tensor((b, hkv, nkv, d), 62),
        tensor((b, hkv, nkv, d), 63),
        tensor((b, hq, nq, d), 64),
    );
    let opts = AttentionOptions { scale: Some(0.9), ..AttentionOptions::causal() }
        .with_mask_mod(MaskMod::document_lengths(&[3, 4]));
    let grads = naive::backward(q.view(), k.view(), v.view(), d_o.view(), &opts).unwrap();
    assert_finite_differences(&opts, [&q, &k, &v], &d_o, [&grads.dq, &grads.dk, &grads.dv]);
    let out = naive::attention(q.view(), k.view(), v.view(), &opts).unwrap();
    let tiled = Fa2Options::new(opts.clone()).with_tiles(2, 2).unwrap();
    let (o, lse) = (out.o.view(), out.lse.view());
    let fa2_grads =
        fa2::backward(q.view(), k.view(), v.view(), o, d_o.view(), lse, &tiled).unwrap();
    for (which, (from_naive, from_fa2)) in
        [(&grads.dq, &fa2_grads.dq), (&grads.dk, &fa2_grads.dk), (&grads.dv, &fa2_grads.dv)]
            .into_iter()
            .enumerate()
    {
        assert!(
            max_diff(from_naive, from_fa2) < 1e-13,
            "FA2's gradient {which} differs from naive's"
        );
    }
    // Two documents of 3 and 4 keys, 5 queries at positions 2…6: 2×2 tiles, the block mask skips
    // the tiles across the documents' boundary that the causal mask alone would compute.
    let causal_only =
        Fa2Options::new(AttentionOptions { scale: Some(0.9), ..AttentionOptions::causal() })
            .with_tiles(2, 2)
            .unwrap();
    let plain = fa2::forward(q.view(), k.view(), v.view(), &causal_only).unwrap();
    let masked = fa2::forward(q.view(), k.view(), v.view(), &tiled).unwrap();
    assert!(masked.stats.tiles.skipped > plain.stats.tiles.skipped);
}

/// The sinks' gradient, `−Σᵢ exp(σ − lseᵢ) Dᵢ`, against finite differences of `L = Σ O ∘ dO`,
/// from the naive backward pass and FA2's (which takes it from lse and D alone).
#[test]
fn the_sinks_gradient_matches_finite_differences() {
    let (b, hq, hkv, nq, nkv, d) = (2, 2, 1, 6, 4, 3);
    let (q, k, v, d_o) = (
        tensor((b, hq, nq, d), 51),
        tensor((b, hkv, nkv, d), 52),
        tensor((b, hkv, nkv, d), 53),
        tensor((b, hq, nq, d), 54),
    );
    let sinks = vec![0.3, -0.7];
    for causal in [false, true] {
        let opts = |sinks: Vec<f64>| {
            AttentionOptions { causal, scale: Some(0.9), ..Default::default() }
                .with_softcap(0.8)
                .unwrap()
                .with_sinks(sinks)
        };
        let loss = |sinks: Vec<f64>| {
            (&naive::attention(q.view(), k.view(), v.view(), &opts(sinks)).unwrap().o * &d_o).sum()
        };
        let fwd = naive::attention(q.view(), k.view(), v.view(), &opts(sinks.clone())).unwrap();
        let naive_grads =
            naive::backward(q.view(), k.view(), v.view(), d_o.view(), &opts(sinks.clone()))
                .unwrap();
        let fa2_grads = fa2::backward(
            q.view(),
            k.view(),
            v.view(),
            fwd.o.view(),
            d_o.view(),
            fwd.lse.view(),
            &Fa2Options::new(opts(sinks.clone())).with_tiles(2, 3).unwrap(),
        )
        .unwrap();
        let h = 1e-6;
        for head in 0..hq {
            let shifted = |by: f64| {
                let mut s = sinks.clone();
                s[head] += by;
                loss(s)
            };
            let numeric = (shifted(h) - shifted(-h)) / (2.0 * h);
            for (rung, grads) in [("naive", &naive_grads), ("fa2", &fa2_grads)] {
                let analytic = grads.dsinks.as_ref().expect("sinks have a gradient")[head];
                assert!(
                    (numeric - analytic).abs() < 1e-7,
                    "{rung} head {head} (causal {causal}): numeric {numeric}, analytic {analytic}"
                );
            }
        }
        // The sinks change dQ, dK, dV only through P: FA2's agree with the naive pass.
        for (a, b) in [(&naive_grads.dq, &fa2_grads.dq), (&naive_grads.dk, &fa2_grads.dk)] {
            assert!(max_diff(a, b) < 1e-13);
        }
    }
}

/// Softcap and ALiBi as their papers write them: `c · tanh(s / c)`, then `s − m_h · |i + n_kv −
/// n_q − j|` (bottom-right aligned, flash-attention's convention).
#[test]
fn naive_f64_with_softcap_and_alibi_is_the_definition() {
    let (b, hq, hkv, nq, nkv, d) = (2, 4, 2, 5, 9, 3);
    let (q, k, v) =
        (tensor((b, hq, nq, d), 31), tensor((b, hkv, nkv, d), 32), tensor((b, hkv, nkv, d), 33));
    let slopes = ScoreMod::alibi_slopes(hq);
    assert_eq!(slopes, [0.25, 0.0625, 0.015625, 0.00390625]);
    let (cap, scale) = (0.3, 0.8);
    for causal in [false, true] {
        let f = |s: f64, h: usize, i: usize, j: usize| {
            let distance = (i as f64 + nkv as f64 - nq as f64 - j as f64).abs();
            cap * (s / cap).tanh() - slopes[h] * distance
        };
        let (o, lse) = modified_definition(&q, &k, &v, causal, scale, f, None);
        let opts = AttentionOptions { causal, scale: Some(scale), ..Default::default() }
            .with_softcap(cap)
            .unwrap()
            .with_score_mod(ScoreMod::alibi(slopes.clone()).unwrap());
        let out = naive::attention(q.view(), k.view(), v.view(), &opts).unwrap();
        assert!(max_diff(&out.o, &o) < 1e-14, "O differs (causal {causal})");
        assert!(max_diff(&out.lse, &lse) < 1e-14, "lse differs (causal {causal})");
    }
    let bad = AttentionOptions::default().with_score_mod(ScoreMod::alibi(vec![0.5; 3]).unwrap());
    let err = naive::attention(q.view(), k.view(), v.view(), &bad).unwrap_err().to_string();
    assert!(err.contains("3 heads for 4 query heads"), "{err}");
    assert!(AttentionOptions::default().with_softcap(-1.0).is_err());
    assert_eq!(AttentionOptions::default().with_softcap(0.0).unwrap(), AttentionOptions::default());
    let forward_only =
        AttentionOptions::default().with_score_mod(ScoreMod::new("x2", |s, _| 2.0 * s));
    let d_o = tensor((b, hq, nq, d), 34);
    let err = naive::backward(q.view(), k.view(), v.view(), d_o.view(), &forward_only);
    assert!(err.unwrap_err().to_string().contains("x2 has no derivative"));
}

#[test]
fn naive_backward_matches_finite_differences() {
    let (b, hq, hkv, nq, nkv, d) = (1, 2, 1, 4, 5, 3);
    let (q, k, v, d_o) = (
        tensor((b, hq, nq, d), 5),
        tensor((b, hkv, nkv, d), 6),
        tensor((b, hkv, nkv, d), 7),
        tensor((b, hq, nq, d), 8),
    );
    // Without a modifier, and through softcap then ALiBi (the chain rule of the derivatives).
    let modified = |causal| {
        AttentionOptions { causal, scale: Some(0.9), ..Default::default() }
            .with_softcap(0.5)
            .unwrap()
            .with_score_mod(ScoreMod::alibi(vec![0.3, 0.1]).unwrap())
    };
    let plain = |causal| AttentionOptions { causal, scale: Some(0.9), ..Default::default() };
    for opts in [plain(false), plain(true), modified(false), modified(true)] {
        let grads = naive::backward(q.view(), k.view(), v.view(), d_o.view(), &opts).unwrap();
        assert_finite_differences(&opts, [&q, &k, &v], &d_o, [&grads.dq, &grads.dk, &grads.dv]);
    }
}

#[test]
fn fa1_and_fa2_count_the_traffic_of_their_memory_models() {
    let (b, hq, hkv, nq, nkv, d) = (2, 4, 2, 37, 29, 8);
    let (q, k, v) =
        (tensor((b, hq, nq, d), 1), tensor((b, hkv, nkv, d), 2), tensor((b, hkv, nkv, d), 3));
    let (br, bc) = (5, 7);
    let (tr, tc) = (nq.div_ceil(br), nkv.div_ceil(bc));
    let heads = (b * hq) as u64;
    let bytes = |elems: usize| elems as u64 * 8 * heads;
    let opts = AttentionOptions::default();

    // FA1, Algorithm 1: K_j, V_j once; Q_i, O_i, l_i, m_i in and O_i, l_i, m_i out per tile;
    // plus initialising O, l, m and writing lse.
    let out = fa1::forward(
        q.view(),
        k.view(),
        v.view(),
        &Fa1Options::new(opts.clone()).with_tiles(br, bc).unwrap(),
    )
    .unwrap();
    assert_eq!(out.stats.hbm.read_bytes, bytes(2 * nkv * d + tc * (2 * nq * d + 2 * nq)));
    assert_eq!(out.stats.hbm.written_bytes, bytes((nq * d + 2 * nq) + tc * (nq * d + 2 * nq) + nq));
    assert_eq!(out.stats.tiles.full, (tr * tc) as u64 * heads);

    // FA2: Q_i once, K and V once per query block, O and lse written once.
    let out = fa2::forward(
        q.view(),
        k.view(),
        v.view(),
        &Fa2Options::new(opts).with_tiles(br, bc).unwrap(),
    )
    .unwrap();
    assert_eq!(out.stats.hbm.read_bytes, bytes(nq * d + tr * 2 * nkv * d));
    assert_eq!(out.stats.hbm.written_bytes, bytes(nq * (d + 1)));
    assert_eq!(out.stats.work_items, tr * (b * hq));
}

#[test]
fn fa2_skips_exactly_the_tiles_above_the_diagonal() {
    let (nq, nkv, br, bc) = (23, 31, 4, 6);
    let (q, k, v) =
        (tensor((1, 1, nq, 4), 1), tensor((1, 1, nkv, 4), 2), tensor((1, 1, nkv, 4), 3));
    let opts = Fa2Options::new(AttentionOptions::causal()).with_tiles(br, bc).unwrap();
    let out = fa2::forward(q.view(), k.view(), v.view(), &opts).unwrap();
    // Row i sees keys j ≤ i + nkv − nq: tile (r, c) is hidden iff its first key is beyond what
    // its last row sees, and fully visible iff its first row sees its last key.
    let (mut skipped, mut full, mut partial) = (0, 0, 0);
    for r in (0..nq).step_by(br) {
        for c in (0..nkv).step_by(bc) {
            let last_row = (r + br).min(nq) - 1;
            let last_col = (c + bc).min(nkv) - 1;
            if c as i64 > last_row as i64 + nkv as i64 - nq as i64 {
                skipped += 1;
            } else if last_col as i64 <= r as i64 + nkv as i64 - nq as i64 {
                full += 1;
            } else {
                partial += 1;
            }
        }
    }
    assert_eq!(
        (out.stats.tiles.skipped, out.stats.tiles.full, out.stats.tiles.partial),
        (skipped, full, partial)
    );
    assert!(skipped > 0 && partial > 0);
}

#[test]
fn fa1_traffic_falls_as_sram_grows_and_fa2_moves_less() {
    let (n, d) = (512, 32);
    let (q, k, v) = (tensor((1, 1, n, d), 1), tensor((1, 1, n, d), 2), tensor((1, 1, n, d), 3));
    let opts = AttentionOptions::default();
    let fa1_traffic = |tiles| {
        fa1::forward(q.view(), k.view(), v.view(), &Fa1Options { attention: opts.clone(), tiles })
            .unwrap()
            .stats
            .hbm
            .total_bytes()
    };
    let fa2_traffic = |tiles| {
        fa2::forward(q.view(), k.view(), v.view(), &Fa2Options { attention: opts.clone(), tiles })
            .unwrap()
            .stats
            .hbm
            .total_bytes()
    };
    // FA1 with the paper's block sizes for a 16 KiB and a 128 KiB SRAM.
    let (small, large) = (
        TileSizes::from_sram(16 << 10, d, 8).unwrap(),
        TileSizes::from_sram(128 << 10, d, 8).unwrap(),
    );
    assert!(fa1_traffic(large) < fa1_traffic(small), "FA1 traffic should fall as SRAM grows");
    assert!(
        fa1_traffic(large)
            < naive::attention(q.view(), k.view(), v.view(), &opts)
                .unwrap()
                .stats
                .hbm
                .total_bytes()
    );
    // With the same tiles FA2 moves less: no O, l, m round trips.
    for b in [1, 16, 64, 512] {
        let tiles = TileSizes::new(b, b).unwrap();
        assert!(fa2_traffic(tiles) < fa1_traffic(tiles), "tiles {b}×{b}");
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let ok = tensor((1, 2, 3, 4), 1);
    let kv = tensor((1, 1, 5, 4), 2);
    let opts = AttentionOptions::default();
    let expect_err = |r: Result<ladder_reference::AttentionOutput<f64>, LadderError>| {
        r.expect_err("must be an error")
    };

    // Head dim mismatch, k/v mismatch, heads not a multiple, zero sizes, bad options.
    let wrong_d = tensor((1, 1, 5, 3), 3);
    assert!(matches!(
        expect_err(naive::attention(ok.view(), wrong_d.view(), wrong_d.view(), &opts)),
        LadderError::ShapeMismatch(_)
    ));
    assert!(matches!(
        expect_err(fa2::forward(
            ok.view(),
            kv.view(),
            wrong_d.view(),
            &Fa2Options::new(opts.clone())
        )),
        LadderError::ShapeMismatch(_)
    ));
    let three_heads = tensor((1, 3, 3, 4), 4);
    let two_kv = tensor((1, 2, 5, 4), 5);
    assert!(matches!(
        expect_err(online_softmax::attention(
            three_heads.view(),
            two_kv.view(),
            two_kv.view(),
            &opts
        )),
        LadderError::HeadsNotMultiple { heads_q: 3, heads_kv: 2 }
    ));
    let empty = Array4::<f64>::zeros((1, 2, 0, 4));
    assert!(matches!(
        expect_err(fa1::forward(
            empty.view(),
            kv.view(),
            kv.view(),
            &Fa1Options::new(opts.clone())
        )),
        LadderError::EmptyDimension { .. }
    ));
    let no_keys = Array4::<f64>::zeros((1, 1, 0, 4));
    assert!(matches!(
        expect_err(fa3::forward(
            ok.view(),
            no_keys.view(),
            no_keys.view(),
            &fa3::Fa3Options::new(opts.clone())
        )),
        LadderError::EmptyDimension { .. }
    ));
    let nan_scale = AttentionOptions { scale: Some(f64::NAN), ..Default::default() };
    assert!(matches!(
        expect_err(naive::attention(ok.view(), kv.view(), kv.view(), &nan_scale)),
        LadderError::InvalidOption { name: "scale", .. }
    ));
    assert!(TileSizes::new(0, 4).is_err() && TileSizes::new(4, 0).is_err());
    assert!(FlashDecodingOptions::new(opts.clone()).with_splits(0).is_err());
    let zero_splits = FlashDecodingOptions { splits: 0, ..FlashDecodingOptions::new(opts.clone()) };
    assert!(matches!(
        expect_err(flash_decoding::forward(ok.view(), kv.view(), kv.view(), &zero_splits)),
        LadderError::InvalidOption { name: "splits", .. }
    ));
    let pp = FlashDecodingPpOptions::new(opts.clone());
    for bad in [
        pp.clone().with_phi(Phi::Given(f64::INFINITY)),
        pp.clone().with_phi(Phi::Estimate { samples: 0 }),
        FlashDecodingPpOptions { safe_range: Some((1.0, -1.0)), ..pp },
    ] {
        assert!(matches!(
            expect_err(flash_decoding_pp::forward(ok.view(), kv.view(), kv.view(), &bad)),
            LadderError::InvalidOption { .. }
        ));
    }
    // Backward: dO, O and lse must match the forward shapes.
    let fwd =
        fa2::forward(ok.view(), kv.view(), kv.view(), &Fa2Options::new(opts.clone())).unwrap();
    let short_lse = Array3::<f64>::zeros((1, 2, 2));
    assert!(
        fa2::backward(
            ok.view(),
            kv.view(),
            kv.view(),
            fwd.o.view(),
            ok.view(),
            short_lse.view(),
            &Fa2Options::new(opts.clone())
        )
        .is_err()
    );
    assert!(naive::backward(ok.view(), kv.view(), kv.view(), kv.view(), &opts).is_err());
}
