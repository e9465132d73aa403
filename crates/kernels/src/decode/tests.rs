//! Unit tests of the decoding host code (split counts, variants, checks, page tables).

use super::cache::HostEntries;
use super::launch::Params;
use super::*;

#[test]
fn num_splits_fills_the_device() {
    // batch · heads_kv = 32 on 132 SMs, 128 key blocks: one wave would be a quarter full.
    let s = num_splits(32, 128, 132, MAX_SPLITS);
    assert!(s >= 4, "{s}");
    assert_eq!(s, 4); // 128 blocks: 97 % of a wave
    // Enough blocks already.
    assert_eq!(num_splits(2048, 128, 132, MAX_SPLITS), 1);
    assert_eq!(num_splits(106, 128, 132, MAX_SPLITS), 1); // ≥ 0.8 · 132
    // Never more splits than key blocks, than asked, or than 128; at least 1.
    assert_eq!(num_splits(1, 3, 132, MAX_SPLITS), 3);
    // One block: efficiency grows with s, so the smallest s within 95 % of the largest.
    assert_eq!(num_splits(1, 1000, 132, 16), 16);
    assert_eq!(num_splits(1, 1000, 132, 20), 19);
    // 8 kv heads (batch 1, GQA 32/8), 128 key blocks: 16 splits fill 97 % of a wave; 15
    // (91 %) would be within FlashAttention's 85 %.
    assert_eq!(num_splits(8, 128, 132, MAX_SPLITS), 16);
    assert!(num_splits(1, 1000, 132, MAX_SPLITS) <= MAX_SPLITS);
    assert_eq!(num_splits(8, 0, 132, MAX_SPLITS), 1);
    assert_eq!(num_splits(8, 100, 0, MAX_SPLITS), 1);
    // A split count that gives each split as many key blocks as the one before is skipped:
    // with 10 key blocks, 6 … 9 splits give 2 blocks each like 5, so after 5 comes 10.
    assert_eq!(num_splits(1, 10, 132, MAX_SPLITS), 10);
    assert_eq!(num_splits(1, 10, 132, 9), 5);
}

#[test]
fn shared_memory_covers_tiles_and_the_merge() {
    // d = 128, 32 rows: Q (8 KB) + three stages of K and V (96 KB), or two (64 KB).
    assert_eq!(split_shared_bytes(128, 2, 3), (32 + 384) * 128 * 2);
    assert_eq!(split_shared_bytes(128, 2, 2), (32 + 256) * 128 * 2);
    // d = 64, 32 rows, two stages: the f32 merge buffer is the larger.
    assert_eq!(split_shared_bytes(64, 2, 2), 4 * 32 * (64 + 10) * 4);
    assert!(split_shared_bytes(64, 2, 2) > (32 + 256) * 64 * 2);
    // d = 256, 16 rows: Q (8 KB) + three stages (192 KB).
    assert_eq!(split_shared_bytes(256, 1, 3), (16 + 384) * 256 * 2);
    for &d in HEAD_DIMS {
        for mt in 1..=rows_per_block(d) / 16 {
            // As many blocks per SM as the paged heuristic counts (Workload::blocks_per_sm:
            // two up to d = 128, one at d = 256) fit on sm_80 (164 KB) and sm_90 (228 KB,
            // 1 KB per block reserved).
            let work = Workload {
                rows_per_kv_head: 16 * mt,
                max_len: 1,
                batch_heads_kv: 1,
                head_dim: d,
                paged: true,
            };
            let blocks = work.blocks_per_sm();
            assert!(blocks * split_shared_bytes(d, mt, stages("sm_80")) <= 164 * 1024);
            assert!(blocks * (split_shared_bytes(d, mt, stages("sm_90a")) + 1024) <= 228 * 1024);
        }
    }
}

#[test]
fn rows_past_32_go_to_more_blocks() {
    // Up to 16 rows: one tile; up to 32: two tiles, one block; then a block per 32 rows.
    for d in [64, 128] {
        assert_eq!((m_tiles(1, d), row_blocks(1, d)), (1, 1));
        assert_eq!((m_tiles(16, d), row_blocks(16, d)), (1, 1));
        assert_eq!((m_tiles(17, d), row_blocks(17, d)), (2, 1));
        assert_eq!((m_tiles(32, d), row_blocks(32, d)), (2, 1));
        assert_eq!((m_tiles(33, d), row_blocks(33, d)), (2, 2));
        assert_eq!((m_tiles(128, d), row_blocks(128, d)), (2, 4)); // GQA 8 × 16 tokens
        assert_eq!(row_blocks(0, d), 1);
    }
    // d = 256: one tile of 16 rows per block.
    assert_eq!((m_tiles(16, 256), row_blocks(16, 256)), (1, 1));
    assert_eq!((m_tiles(17, 256), row_blocks(17, 256)), (1, 2));
    assert_eq!((m_tiles(128, 256), row_blocks(128, 256)), (1, 8));
    let work = |batch: usize, heads_kv: usize, rows, max_len, head_dim, paged| Workload {
        rows_per_kv_head: rows,
        max_len,
        batch_heads_kv: batch * heads_kv,
        head_dim,
        paged,
    };
    let splits = |batch, heads_kv, rows, max_len, paged| {
        default_splits(&work(batch, heads_kv, rows, max_len, 128, paged), 132)
    };
    // The heuristic counts the row blocks: 4 of them on 8 kv heads are 32 blocks per split.
    assert_eq!(splits(1, 8, 128, 128 * BC, false), num_splits(32, 128, 132, MAX_SPLITS));
    assert_eq!(splits(1, 8, 4, 128 * BC, false), num_splits(8, 128, 132, MAX_SPLITS));
    // … 8 of them at d = 256.
    assert_eq!(
        default_splits(&work(1, 8, 128, 128 * BC, 256, false), 132),
        num_splits(64, 128, 132, MAX_SPLITS)
    );
    // A paged cache fills two blocks per SM: batch 16, 8 kv heads (128 blocks) takes 2
    // splits, where a contiguous one takes 1; batch 1, 32 kv heads, 8 splits instead of 4.
    assert_eq!(splits(16, 8, 4, 512 * BC, false), 1);
    assert_eq!(splits(16, 8, 4, 512 * BC, true), 2);
    assert_eq!(splits(1, 32, 1, 128 * BC, false), 4);
    assert_eq!(splits(1, 32, 1, 128 * BC, true), 8);
    // … but not below 16 tiles per split: batch 1, 8 kv heads, 8k keys keeps 16 splits.
    assert_eq!(splits(1, 8, 4, 128 * BC, true), 16);
    assert_eq!(splits(1, 8, 4, 128 * BC, false), 16);
    // … and not at d = 256, where one block fills an SM's shared memory.
    assert_eq!(default_splits(&work(1, 32, 1, 128 * BC, 256, true), 132), 4);
    assert_eq!(work(1, 32, 1, 128 * BC, 256, true).blocks_per_sm(), 1);
}

#[test]
fn params_are_laid_out_like_the_cuda_struct() {
    // The call: 6 pointers, 3 strides, 8 ints, a float, then the lengths; 8-byte aligned. (The
    // kernels check the sizes too: FD_HOST_PARAMS_BYTES.)
    use super::launch::DecodeCall;
    assert_eq!(std::mem::offset_of!(DecodeCall, q_strides), 48);
    assert_eq!(std::mem::offset_of!(DecodeCall, heads_q), 120);
    assert_eq!(std::mem::offset_of!(DecodeCall, scale_log2), 152);
    assert_eq!(std::mem::offset_of!(DecodeCall, lengths), 160);
    assert_eq!(std::mem::offset_of!(DecodeCall, new_starts), 1184);
    assert_eq!(std::mem::size_of::<DecodeCall>(), 2216);
    // FlashDecoding's: the call, 3 pointers, the modifiers' 80 bytes (score_mod.cuh), 2 ints.
    assert_eq!(std::mem::offset_of!(Params, o_part), 2216);
    assert_eq!(std::mem::offset_of!(Params, mods), 2240);
    assert_eq!(std::mem::offset_of!(Params, first_seq), 2320);
    assert_eq!(std::mem::size_of::<Params>(), 2328);
}

fn desc(shape: &[usize], dtype: DType) -> Desc<'_> {
    Desc { shape, dtype }
}

/// A host-checked page table of `rows`, each padded with −1 to `max_pages`.
fn table(rows: &[&[i32]], max_pages: usize) -> TableInfo {
    let mut entries = Vec::new();
    for row in rows {
        entries.extend_from_slice(row);
        entries.resize(entries.len() + max_pages - row.len(), -1);
    }
    let mut info = TableInfo::new(rows.len(), max_pages).unwrap();
    info.host = Some(HostEntries::new(&entries, rows.len(), max_pages).unwrap());
    info
}

fn check_paged(q: &[usize], pages: &[usize], info: &TableInfo, lengths: &[usize]) -> Result<Shape> {
    let f16 = DType::F16;
    let cache = CacheDesc::Paged { k: desc(pages, f16), v: desc(pages, f16), table: info, lengths };
    Shape::check(desc(q, f16), &cache, &DecodeOptions::default())
}

#[test]
fn a_good_paged_cache_passes_the_checks() {
    // Two sequences in pages of 16: 40 keys (3 pages) and 16 keys (1 page); 2 kv heads.
    let info = table(&[&[4, 0, 2], &[1]], 4);
    let p = check_paged(&[2, 8, 2, 64], &[5, 2, 16, 64], &info, &[40, 16]).unwrap();
    assert_eq!(p.layout, Layout::Paged { page_size: 16, num_pages: 5, max_pages: 4 });
    assert_eq!((p.batch, p.heads_q, p.heads_kv, p.n_new, p.d), (2, 8, 2, 2, 64));
    assert_eq!(p.rows_per_kv_head(), 8);
    // Empty sequences read no entry: a row of −1 is fine.
    let empty = table(&[&[-1], &[3]], 1);
    assert!(check_paged(&[2, 8, 1, 64], &[5, 2, 16, 64], &empty, &[0, 9]).is_ok());
    // A device-only table (entries unknown) is checked for its shape only.
    let unseen = TableInfo::new(2, 3).unwrap();
    assert!(check_paged(&[2, 8, 1, 64], &[5, 2, 16, 64], &unseen, &[48, 1]).is_ok());
    // Every page size of PAGE_SIZES.
    for &page in PAGE_SIZES {
        let one = table(&[&[0]], 1);
        assert!(check_paged(&[1, 4, 1, 128], &[1, 1, page, 128], &one, &[page]).is_ok());
    }
}

#[test]
fn bad_page_tables_are_errors() {
    let pages = [5, 2, 16, 64];
    let q = [2, 8, 1, 64];
    let page_err = |r: Result<Shape>, needle: &str| match r {
        Err(KernelError::PageTable(m)) => assert!(m.contains(needle), "{m}"),
        other => panic!("expected a page-table error with {needle:?}, got {other:?}"),
    };
    // Too short for a length: 49 keys need 4 pages of 16, the table has 3 per sequence.
    let info = table(&[&[0, 1, 2], &[3]], 3);
    page_err(check_paged(&q, &pages, &info, &[49, 1]), "needs 4 pages");
    // So is a device-only table of the same shape.
    let unseen = TableInfo::new(2, 3).unwrap();
    page_err(check_paged(&q, &pages, &unseen, &[49, 1]), "needs 4 pages");
    // An entry past the last page, and a negative one, among the entries a sequence reads.
    let info = table(&[&[0, 5, 1], &[3]], 3);
    page_err(check_paged(&q, &pages, &info, &[33, 1]), "page_table[0][1] = 5");
    let info = table(&[&[0, 1, 2], &[3, -1]], 3);
    page_err(check_paged(&q, &pages, &info, &[48, 17]), "page_table[1][1] = -1");
    // The same entries past what the lengths read are never read: fine.
    assert!(check_paged(&q, &pages, &table(&[&[0, 5, 1], &[3]], 3), &[16, 1]).is_ok());
    // Rows and lengths that do not match the batch.
    let three = table(&[&[0], &[1], &[2]], 1);
    let r = check_paged(&q, &pages, &three, &[1, 1]);
    assert!(matches!(&r, Err(KernelError::Shape(m)) if m.contains("3 rows")), "{r:?}");
    let r = check_paged(&q, &pages, &table(&[&[0], &[1]], 1), &[1, 1, 1]);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    // A table with no entries, and host entries that do not fill the shape.
    assert!(matches!(TableInfo::new(0, 4), Err(KernelError::Shape(_))));
    assert!(matches!(TableInfo::new(2, 0), Err(KernelError::Shape(_))));
    assert!(matches!(HostEntries::new(&[0, 1, 2], 2, 2), Err(KernelError::Shape(_))));
}

#[test]
fn page_sizes_and_shapes_are_checked() {
    let q = [1, 8, 1, 64];
    let one = table(&[&[0, 1, 2, 3]], 4);
    // Not a power of two, too small, too large: a configuration error naming the sizes.
    for page in [48, 8, 512, 100] {
        let r = check_paged(&q, &[4, 2, page, 64], &one, &[1]);
        assert!(matches!(&r, Err(KernelError::Config(m)) if m.contains("16, 32")), "{r:?}");
    }
    let f16 = DType::F16;
    let check = |q: Desc, k: Desc, v: Desc| {
        let cache = CacheDesc::Paged { k, v, table: &one, lengths: &[10] };
        Shape::check(q, &cache, &DecodeOptions::default())
    };
    let pages = [4, 2, 16, 64];
    // v unlike k, head dims differing, heads not a multiple, zero pages, rank 3.
    let shape_errors = [
        (desc(&q, f16), desc(&pages, f16), desc(&[4, 2, 32, 64], f16)),
        (desc(&q, f16), desc(&[4, 2, 16, 128], f16), desc(&[4, 2, 16, 128], f16)),
        (desc(&q, f16), desc(&[4, 3, 16, 64], f16), desc(&[4, 3, 16, 64], f16)),
        (desc(&q, f16), desc(&[0, 2, 16, 64], f16), desc(&[0, 2, 16, 64], f16)),
        (desc(&q, f16), desc(&[2, 16, 64], f16), desc(&[2, 16, 64], f16)),
    ];
    for (i, (q, k, v)) in shape_errors.into_iter().enumerate() {
        let r = check(q, k, v);
        assert!(matches!(r, Err(KernelError::Shape(_))), "case {i}: {r:?}");
    }
    // Pages of another dtype than q, and an element type without a kernel.
    let bf = DType::BF16;
    let r = check(desc(&q, f16), desc(&pages, bf), desc(&pages, bf));
    assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
    let r = check(desc(&q, f16), desc(&pages, f16), desc(&pages, bf));
    assert!(matches!(r, Err(KernelError::DType(_))), "{r:?}");
    let f32_ = DType::F32;
    let r = check(desc(&q, f32_), desc(&pages, f32_), desc(&pages, f32_));
    assert!(matches!(r, Err(KernelError::UnsupportedDtype { .. })), "{r:?}");
}

#[test]
fn contiguous_checks_take_any_number_of_rows() {
    let f16 = DType::F16;
    let check = |q: &[usize], kv: &[usize], lengths: &[usize]| {
        let cache = CacheDesc::Contiguous { k: desc(kv, f16), v: desc(kv, f16), lengths };
        Shape::check(desc(q, f16), &cache, &DecodeOptions::default())
    };
    // GQA 8 × 16 tokens = 128 rows per kv head, and 32 × 16 = 512 (MQA).
    let p = check(&[1, 16, 16, 128], &[1, 2, 300, 128], &[300]).unwrap();
    assert_eq!((p.rows_per_kv_head(), p.layout), (128, Layout::Contiguous { capacity: 300 }));
    assert_eq!(check(&[1, 32, 16, 64], &[1, 1, 30, 64], &[30]).unwrap().rows_per_kv_head(), 512);
    // A length past the capacity, the wrong number of lengths, 17 tokens, batch differing.
    for (q, kv, lengths) in [
        (&[1, 8, 1, 64][..], &[1, 2, 30, 64][..], &[31][..]),
        (&[1, 8, 1, 64], &[1, 2, 30, 64], &[3, 3]),
        (&[1, 8, 17, 64], &[1, 2, 30, 64], &[30]),
        (&[2, 8, 1, 64], &[1, 2, 30, 64], &[3, 3]),
    ] {
        let r = check(q, kv, lengths);
        assert!(matches!(r, Err(KernelError::Shape(_))), "{q:?} {kv:?} {lengths:?}: {r:?}");
    }
    // Every multiple of 8 up to 256 has a kernel; 100 and 264 do not.
    assert!(check(&[1, 8, 1, 96], &[1, 2, 30, 96], &[30]).is_ok());
    assert!(check(&[1, 8, 1, 8], &[1, 2, 30, 8], &[30]).is_ok());
    for d in [100, 264] {
        let r = check(&[1, 8, 1, d], &[1, 2, 30, d], &[30]);
        assert!(
            matches!(r, Err(KernelError::UnsupportedHeadDim { d: got, .. }) if got == d),
            "{r:?}"
        );
    }
}

#[test]
fn flash_decoding_pp_options_are_checked_with_the_shapes() {
    let f16 = DType::F16;
    let (q, kv) = ([1, 8, 1, 64], [1, 2, 30, 64]);
    let check = |dtype: DType, opts: DecodeOptions| {
        let cache =
            CacheDesc::Contiguous { k: desc(&kv, dtype), v: desc(&kv, dtype), lengths: &[30] };
        Shape::check(desc(&q, dtype), &cache, &opts)
    };
    // The defaults: φ = 0 and the element type's window, whatever the strategy.
    for strategy in Strategy::ALL {
        let p = check(f16, DecodeOptions { strategy, ..DecodeOptions::default() }).unwrap();
        assert_eq!(p.window.phi, DEFAULT_PHI);
        let (lo, hi) = default_safe_range(f16);
        let log2e = std::f32::consts::LOG2_E;
        assert_eq!((p.window.lo_log2, p.window.hi_log2), (lo * log2e, hi * log2e));
    }
    // bf16 takes a window fp16 cannot (e^40 overflows fp16).
    let wide = DecodeOptions { safe_range: Some((-40.0, 40.0)), ..DecodeOptions::default() };
    assert!(check(DType::BF16, wide.clone()).is_ok());
    for bad in [
        DecodeOptions { phi: f32::NAN, ..DecodeOptions::default() },
        DecodeOptions { phi: f32::NEG_INFINITY, ..DecodeOptions::default() },
        DecodeOptions { safe_range: Some((0.0, 0.0)), ..DecodeOptions::default() },
        wide,
    ] {
        let r = check(f16, bad.clone());
        assert!(matches!(r, Err(KernelError::Config(_))), "{bad:?}: {r:?}");
    }
}

#[test]
fn host_entries_keep_prefix_maxima() {
    let h = HostEntries::new(&[3, 1, 7, -1, 0, 2, 2, 9], 2, 4).unwrap();
    assert_eq!(h.prefix_max, [3, 3, 7, i32::MAX, 0, 2, 2, 9]);
    assert!(h.check_row(0, 3, 8).is_ok());
    assert!(h.check_row(0, 3, 7).is_err(), "7 is not a page of 7");
    assert!(h.check_row(0, 4, 100).is_err(), "−1 is read");
    assert!(h.check_row(1, 3, 3).is_ok());
    let e = h.check_row(1, 4, 3).unwrap_err().to_string();
    assert!(e.contains("page_table[1][3] = 9"), "{e}");
}
