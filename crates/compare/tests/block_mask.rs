//! The block mask against the dense mask it summarises: a tile it calls empty has no visible
//! pair (so skipping it loses nothing), a full one has no hidden pair (so computing it without a
//! mask is exact), a partial one has both; and the tiled rungs walk exactly its tiles.

use ladder_compare::{CaseSpace, Rung, RungConfig, cases};
use ladder_reference::{BlockMask, MaskMod, ScoreIndex, TileKind, TileSizes, fa2};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_tile_kind_is_what_its_pairs_say(
        case in cases(CaseSpace::cpu().with_windows().with_mask_mods()),
    ) {
        let (opts, shape, tiles) = (case.attention(), case.shape, case.tiles);
        let block_mask = BlockMask::new(&opts, &shape, tiles).unwrap();
        let (n_q, n_kv) = (shape.n_q, shape.n_kv);
        for ((b, h, qb, kb), &kind) in block_mask.kinds().indexed_iter() {
            let rows = qb * tiles.br()..((qb + 1) * tiles.br()).min(n_q);
            let cols = kb * tiles.bc()..((kb + 1) * tiles.bc()).min(n_kv);
            let (mut seen, mut hidden) = (0, 0);
            for q in rows.clone() {
                for kv in cols.clone() {
                    if opts.sees(&ScoreIndex { batch: b, head: h, q, kv, n_q, n_kv }) {
                        seen += 1;
                    } else {
                        hidden += 1;
                    }
                }
            }
            let want = match (seen, hidden) {
                (0, _) => TileKind::Skip,
                (_, 0) => TileKind::Full,
                _ => TileKind::Partial,
            };
            prop_assert_eq!(kind, want, "tile ({}, {}) of batch {}, head {}: {} seen, {} hidden",
                qb, kb, b, h, seen, hidden);
        }
        // FA2 walks the same tiles: its counters are the block mask's.
        let inputs = case.inputs::<f64>();
        let config = RungConfig { attention: opts.clone(), tiles, ..RungConfig::default() };
        let out = Rung::Fa2.forward(inputs.q.view(), inputs.k.view(), inputs.v.view(), &config).unwrap();
        prop_assert_eq!(out.stats.tiles, block_mask.counts());
    }
}

/// What a document mask buys: 8 documents over 512 keys leave an eighth of the pairs and about an
/// eighth of the 64×64 tiles (those along the documents' diagonal blocks), and FA2's HBM reads
/// of K and V fall with them.
#[test]
fn a_document_mask_skips_the_tiles_between_documents() {
    let shape = ladder_reference::AttentionShape::new(1, 1, 1, 512, 512, 16).unwrap();
    let tiles = TileSizes::new(64, 64).unwrap();
    let plain = ladder_reference::AttentionOptions::default();
    let docs = plain.clone().with_mask_mod(MaskMod::document_lengths(&[64; 8]));
    let mask = BlockMask::new(&docs, &shape, tiles).unwrap();
    assert_eq!(mask.counts().full, 8);
    assert_eq!((mask.counts().partial, mask.counts().skipped), (0, 56));
    assert_eq!(mask.density(), 1.0 / 8.0);
    let picture = mask.picture(0, 0).unwrap();
    assert_eq!(picture.lines().next(), Some("█·······"));
    assert_eq!(picture.lines().last(), Some("·······█"));
    // Documents that straddle tile boundaries make partial tiles.
    let ragged = plain.clone().with_mask_mod(MaskMod::document_lengths(&[100, 200, 212]));
    let counts = BlockMask::new(&ragged, &shape, tiles).unwrap().counts();
    assert!(counts.partial > 0 && counts.skipped > 0, "{counts:?}");

    let q = ndarray::Array4::from_shape_fn((1, 1, 512, 16), |(_, _, i, c)| {
        ((i * 7 + c) % 11) as f64 * 0.1
    });
    let run = |opts| {
        let opts = fa2::Fa2Options::new(opts).with_tiles(64, 64).unwrap();
        fa2::forward(q.view(), q.view(), q.view(), &opts).unwrap().stats
    };
    let (all, masked) = (run(plain), run(docs));
    assert_eq!(all.tiles.computed(), 64);
    assert_eq!(masked.tiles.computed(), 8);
    assert!(masked.hbm.read_bytes * 4 < all.hbm.read_bytes, "{masked:?} vs {all:?}");
    // A table of the wrong length is an error.
    let bad =
        ladder_reference::AttentionOptions::default().with_mask_mod(MaskMod::documents(vec![0; 5]));
    assert!(BlockMask::new(&bad, &shape, tiles).is_err());
}

/// The picture in the book's "Beyond causal" chapter: three documents of 96, 160 and 256 tokens
/// packed into one causal sequence of 512, in 64 × 64 tiles.
#[test]
fn the_books_picture() {
    let shape = ladder_reference::AttentionShape::new(1, 1, 1, 512, 512, 64).unwrap();
    let opts = ladder_reference::AttentionOptions::causal()
        .with_mask_mod(MaskMod::document_lengths(&[96, 160, 256]));
    let mask = BlockMask::new(&opts, &shape, TileSizes::new(64, 64).unwrap()).unwrap();
    let picture = [
        "▒·······",
        "▒▒······",
        "·▒▒·····",
        "·▒█▒····",
        "····▒···",
        "····█▒··",
        "····██▒·",
        "····███▒",
    ];
    assert_eq!(mask.picture(0, 0).unwrap().lines().collect::<Vec<_>>(), picture);
    let counts = mask.counts();
    assert_eq!((counts.full, counts.partial, counts.skipped), (7, 11, 46));
}
