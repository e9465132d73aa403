//! The launch of a checked call: FlashDecoding's kernel variants and parameter struct, and the
//! one kernel per chunk of sequences that FlashDecoding or FlashDecoding++ launches.

use cudarc::driver::{DevicePtr, DeviceRepr};

use super::*;
use crate::problem::Strides;
use crate::score_mod::ModifierArgs;

/// What FlashDecoding's kernel is compiled with beyond the shape: a sliding window
/// (`FD_WINDOW`), sinks (`FD_SINKS`) and a score modifier (its generated header).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Modifiers<'a> {
    pub(super) windowed: bool,
    pub(super) sinks: bool,
    pub(super) score_mod: Option<&'a ScoreMod>,
}

/// The kernels' variant (both entry points live in one module) for head dimension `d`, element
/// type `dtype`, `m_tiles` 16-row mma tiles of rows, `stages` K/V stages, a contiguous or a paged
/// cache, and `modifiers` (none: no define is added, the variant of a plain call).
pub(super) fn split_variant(
    d: usize,
    dtype: DType,
    m_tiles: usize,
    stages: usize,
    paged: bool,
    modifiers: &Modifiers,
) -> Variant {
    let mut variant = Variant {
        file: "flash_decoding",
        source: SRC,
        defines: vec![
            ("LADDER_DTYPE", dtype.code().to_string()),
            ("FD_D", d.to_string()),
            ("FD_MT", m_tiles.to_string()),
            ("FD_BC", BC.to_string()),
            ("FD_WARPS", WARPS.to_string()),
            ("FD_STAGES", stages.to_string()),
            ("FD_PAGED", u8::from(paged).to_string()),
            ("FD_MAX_BATCH", MAX_BATCH_PER_LAUNCH.to_string()),
            ("FD_HOST_PARAMS_BYTES", std::mem::size_of::<Params>().to_string()),
        ],
        generated: Vec::new(),
    };
    if modifiers.windowed {
        variant.defines.push(("FD_WINDOW", "1".to_string()));
    }
    if modifiers.sinks {
        variant.defines.push(("FD_SINKS", "1".to_string()));
    }
    variant.with_score_mod(modifiers.score_mod)
}

/// The widths the kernels compute head dimension `d` with (`HeadDim` in `cuda/layout.cuh`): the
/// products' `dk` (whole 16-wide k-steps) and the shared tiles' rows of `cols` (whole 64-element
/// rows, the swizzle's span).
pub(crate) fn padded(d: usize) -> (usize, usize) {
    (d.div_ceil(16) * 16, d.div_ceil(64) * 64)
}

/// Dynamic shared memory of the split kernel in bytes: the Q tile and `stages` stages of K and V
/// (16-bit rows of [`padded`] width), or, if larger, the f32 buffer that merges the warps' states
/// at the end (it reuses the same memory; rows of the products' width padded by 8 floats).
pub(crate) fn split_shared_bytes(d: usize, m_tiles: usize, stages: usize) -> usize {
    let (dk, cols) = padded(d);
    let rows = 16 * m_tiles;
    let tiles = (rows + 2 * stages * BC) * cols * 2;
    let merge = WARPS * rows * (dk + 8 + 2) * 4;
    tiles.max(merge)
}

/// The head dimensions the compile check builds in `dtype`: every one would be 32 per variant
/// family; fp16 takes the widths the kernels were written for, both ends, and head dims padded to
/// 16 columns (40, 72, 136, 200) and to whole rows of 64 (96, 192) — the copies' and the GEMV's
/// general paths; bf16 the three written for.
#[cfg(test)]
pub(crate) fn compile_head_dims(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F16 => &[8, 40, 64, 72, 96, 128, 136, 192, 200, 256],
        _ => &[64, 128, 256],
    }
}

/// Every variant of rungs 6 and 7, for the compile check.
#[cfg(test)]
pub(crate) fn variants() -> Vec<Variant> {
    let mut all = pp::variants();
    for &dtype in DTYPES {
        for &d in compile_head_dims(dtype) {
            for m_tiles in 1..=rows_per_block(d) / 16 {
                for stages in [2, 3] {
                    for paged in [false, true] {
                        let none = Modifiers::default();
                        all.push(split_variant(d, dtype, m_tiles, stages, paged, &none));
                    }
                }
            }
        }
    }
    // The modifiers (FlashDecoding only): a window, sinks, softcap, ALiBi, and all of them, at the
    // written-for head dims, on both caches, with the tiles of ordinary and of GQA decoding.
    let softcap = ScoreMod::softcap(30.0).expect("a valid cap");
    let alibi = ScoreMod::alibi(vec![0.5; 8]).expect("valid slopes");
    let both = softcap.clone().then(alibi.clone());
    let none = Modifiers::default();
    let modifiers = [
        Modifiers { windowed: true, ..none },
        Modifiers { sinks: true, ..none },
        Modifiers { score_mod: Some(&softcap), ..none },
        Modifiers { score_mod: Some(&alibi), ..none },
        Modifiers { windowed: true, sinks: true, score_mod: Some(&both) },
    ];
    for d in [64, 128, 256] {
        for m_tiles in 1..=rows_per_block(d) / 16 {
            for paged in [false, true] {
                for m in &modifiers {
                    all.push(split_variant(d, DType::F16, m_tiles, 3, paged, m));
                }
            }
        }
    }
    all
}

/// Mirror of `DecodeCall` in `cuda/decode.cuh`, the part of a call both kernel families take
/// (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct DecodeCall {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) page_table: u64,
    pub(super) o: u64,
    pub(super) lse: u64,
    pub(super) q_strides: Strides,
    pub(super) o_strides: Strides,
    pub(super) kv_strides: Strides,
    pub(super) heads_q: i32,
    pub(super) heads_kv: i32,
    pub(super) n_new: i32,
    pub(super) max_pages: i32,
    pub(super) num_pages: i32,
    pub(super) log2_page: i32,
    pub(super) splits: i32,
    pub(super) row_blocks: i32,
    pub(super) scale_log2: f32,
    pub(super) total_new: i32,
    pub(super) lengths: [i32; MAX_BATCH_PER_LAUNCH],
    pub(super) new_starts: [i32; MAX_BATCH_PER_LAUNCH + 1],
}

/// Mirror of `FdParams` in `cuda/flash_decoding.cu` (device pointers as `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct Params {
    pub(super) call: DecodeCall,
    pub(super) o_part: u64,
    pub(super) lse_part: u64,
    pub(super) counters: u64,
    pub(super) mods: ModifierArgs,
    pub(super) first_seq: i32,
    pub(super) window_left: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out as its CUDA mirror (whose
// size the kernel checks against FD_HOST_PARAMS_BYTES).
unsafe impl DeviceRepr for Params {}

/// The launch of one checked call ([`check_call`]), into `out` (checked here); with
/// `count_fallbacks`, returns how many rows fell back when FlashDecoding++ ran (copying its flags,
/// one `i32` per output row, to the host: the call then waits for the GPU):
///
/// - FlashDecoding: `flash_decoding_split` (whose last block per group of splits combines them);
/// - FlashDecoding++: `flash_decoding_pp_split` (whose last block per group of splits adds them
///   up, flags the rows that fall back and recomputes those rows itself, each against its own
///   largest score).
///
/// One kernel per call (per chunk of sequences), launched programmatically (pdl.cuh): its blocks
/// may start during the previous call's tail and wait for it before they touch memory, since
/// every call uses the same workspaces and counters.
pub(super) fn launch(
    gpu: &Gpu,
    q: &Tensor,
    cache: Cache<'_>,
    Call {
        shape: p,
        score_mod,
        sinks,
        plan,
        stages,
        q_strides,
        kv_strides,
        new_starts,
        atomic_sums,
    }: &Call,
    out: &mut Output,
    count_fallbacks: bool,
) -> Result<Option<usize>> {
    for (name, t) in [("o", &out.o), ("lse", &out.lse)] {
        gpu.check_context(t, name)?;
    }
    p.check_output(out)?;
    let o_strides = match new_starts {
        None => Strides::of(&out.o, "o")?,
        Some(_) => Strides::of_packed(&out.o, "o")?,
    };
    let (k, v, table) = cache.buffers();
    let lengths = cache.lengths();
    let r = p.rows_per_kv_head();
    let splits = plan.splits;
    let too_many = || KernelError::Config(format!("flash_decoding: {splits} splits is too many"));
    let splits_i = i32::try_from(splits).map_err(|_| too_many())?;
    let stages = *stages;
    let paged = table.is_some();

    // FlashDecoding's kernel (and its row blocks, which size the counters either way).
    let (m_tiles, fd_row_blocks) = (m_tiles(r, p.d), row_blocks(r, p.d));
    let fd_blocks_x = splits.checked_mul(fd_row_blocks).ok_or_else(too_many)?;
    let modifiers = Modifiers {
        windowed: p.window_left.is_some(),
        sinks: sinks.is_some(),
        score_mod: score_mod.as_ref(),
    };
    // FlashDecoding++'s kernel, when it runs; FlashDecoding's otherwise.
    let pp_kernel = match plan.strategy {
        Strategy::Gemv => Some(PpKernel::Gemv),
        Strategy::FlatGemm => Some(PpKernel::flat(r, p.d)),
        _ => None,
    };
    let fd_launch = match pp_kernel {
        Some(_) => None,
        None => {
            let fd = split_variant(p.d, p.dtype, m_tiles, stages, paged, &modifiers);
            let fd_split = Kernel { variant: fd, entry: "flash_decoding_split" };
            let fd_smem = split_shared_bytes(p.d, m_tiles, stages);
            gpu.prepare(&fd_split, fd_smem)?;
            Some((fd_split, fd_smem))
        }
    };
    let pp_launch = match pp_kernel {
        None => None,
        Some(kernel) => {
            let variant = pp::variant(p.d, p.dtype, kernel, stages, paged);
            let split = Kernel { variant, entry: "flash_decoding_pp_split" };
            let smem = pp::shared_bytes(p.d, kernel, stages);
            gpu.prepare(&split, smem)?;
            let row_blocks = r.div_ceil(kernel.rows_per_block());
            let blocks_x = splits.checked_mul(row_blocks).ok_or_else(too_many)?;
            Some((split, smem, row_blocks, blocks_x))
        }
    };

    // Workspaces, f32, in the Gpu's scratch memory (kept from call to call), over the call's
    // output rows (numbered as `HeadRows::flat` in cuda/decode.cuh numbers them): O_s
    // (FlashDecoding) or acc_s (FlashDecoding++) [rows, splits, d], lse_s or l_s [rows, splits];
    // FlashDecoding++ also the sum of P as rounded and the largest exponent per split [rows,
    // splits] each, and its fallback flags, one i32 per row (in the same scratch memory: an
    // allocation per call would stand between one call's kernel and the next in the stream, where
    // the programmatic launch wants the kernels back to back). Every element a kernel reads was
    // written earlier in the call. FlashDecoding with one split writes O and lse directly: none.
    let rows = p.rows();
    let parts = if splits > 1 || pp_kernel.is_some() { rows * splits } else { 0 };
    let pp_parts = if pp_kernel.is_some() { 2 * parts + rows } else { 0 };
    let workspace = parts * (p.d + 1) + pp_parts;
    // The modifiers' parameters (their tables stay on the device between calls).
    let mods = ModifierArgs::of(gpu, score_mod.as_ref(), sinks.as_ref(), p.scale)?;
    // At most MAX_LENGTH (checked), which fits in i32.
    let window_left = p.window_left.unwrap_or(0) as i32;
    let s = gpu.stream();
    let (q_ptr, _g0) = q.read_ptr(s);
    let (k_ptr, _g1) = k.read_ptr(s);
    let (v_ptr, _g2) = v.read_ptr(s);
    let (o_ptr, _g5) = out.o.write_ptr(s)?;
    let (lse_ptr, _g6) = out.lse.write_ptr(s)?;
    let (table_ptr, _g7) = match table {
        Some(t) => {
            let (ptr, guard) = t.table.device_ptr(s);
            (ptr, Some(guard))
        }
        None => (0, None),
    };
    // The layout's numbers: the pages' count and size (the size a power of two, checked) and the
    // table's row length.
    let (max_pages, num_pages, log2_page) = match p.layout {
        Layout::Contiguous { .. } => (0, 0, 0),
        Layout::Paged { page_size, num_pages, max_pages } => {
            (max_pages, num_pages, page_size.trailing_zeros())
        }
    };
    // Batches of more than MAX_BATCH_PER_LAUNCH sequences go in chunks: Q, O, the workspaces, the
    // flags, a contiguous cache and the page table have a batch stride, so a chunk is the same
    // call on pointers advanced by its first sequence (pages are shared by all sequences: not
    // advanced).
    let rows_per_seq = p.heads_q * p.n_new;
    let elem = p.dtype.size();
    // The split kernels' counters: one per (sequence, kv head, row block) of a launch, for the
    // kernel with the more row blocks (both leave them zero).
    let pp_row_blocks = pp_launch.as_ref().map_or(0, |&(_, _, row_blocks, _)| row_blocks);
    let counters =
        fd_row_blocks.max(pp_row_blocks) * p.heads_kv * p.batch.min(MAX_BATCH_PER_LAUNCH);
    // FlashDecoding++'s atomic sums, after the counters (16-byte aligned) in the same memory,
    // which is zero when allocated and which every kernel leaves zero.
    let sums_at = counters.next_multiple_of(4);
    let atomic = plan.sums_atomically(*atomic_sums);
    let words = if atomic { sums_at + AtomicSums::words(rows, p.d) } else { counters };
    let fallback_rows = gpu.with_scratch(words, workspace, |scratch| {
        // The workspaces' addresses, in the order listed above.
        let o_part_ptr = scratch.floats;
        let lse_part_ptr = o_part_ptr + (4 * parts * p.d) as u64;
        let lr_part_ptr = lse_part_ptr + (4 * parts) as u64;
        let max_part_ptr = lr_part_ptr + (4 * parts) as u64;
        let flags_ptr = max_part_ptr + (4 * parts) as u64;
        for first in (0..p.batch).step_by(MAX_BATCH_PER_LAUNCH) {
            let n = (p.batch - first).min(MAX_BATCH_PER_LAUNCH);
            // The chunk's first output row and its rows (decode.cuh numbers packed rows
            // token-major), and where its first sequence's Q, O and lse start: the batch
            // stride, or its first token's row (element offsets; strides are non-negative).
            let (row0, chunk_rows, q_off, o_off, lse0) = match new_starts {
                None => {
                    let (row0, rows) = (first * rows_per_seq, n * rows_per_seq);
                    let batch_offset = |s: &Strides| first * s.batch as usize;
                    (row0, rows, batch_offset(q_strides), batch_offset(&o_strides), row0)
                }
                Some(starts) => {
                    let (t0, t1) = (starts[first], starts[first + n]);
                    let row = |s: &Strides| t0 * s.row as usize;
                    (t0 * p.heads_q, (t1 - t0) * p.heads_q, row(q_strides), row(&o_strides), t0)
                }
            };
            if chunk_rows == 0 {
                continue; // packed: no sequence of this chunk has a new token
            }
            let mut chunk_starts = [0i32; MAX_BATCH_PER_LAUNCH + 1];
            if let Some(starts) = new_starts {
                // Each below total_new, which fits in i32 (checked).
                for (dst, &t) in chunk_starts.iter_mut().zip(&starts[first..=first + n]) {
                    *dst = (t - starts[first]) as i32;
                }
            }
            let kv0 = if paged { 0 } else { first * kv_strides.batch as usize };
            let mut chunk_lengths = [0i32; MAX_BATCH_PER_LAUNCH];
            // Each length is at most MAX_LENGTH, which fits in i32 (checked above).
            for (dst, &len) in chunk_lengths.iter_mut().zip(&lengths[first..first + n]) {
                *dst = len as i32;
            }
            let at = |ptr: u64, elements: usize, size: usize| ptr + (elements * size) as u64;
            let call = DecodeCall {
                q: at(q_ptr, q_off, elem),
                k: at(k_ptr, kv0, elem),
                v: at(v_ptr, kv0, elem),
                page_table: if table.is_some() { at(table_ptr, first * max_pages, 4) } else { 0 },
                o: at(o_ptr, o_off, elem),
                lse: at(lse_ptr, lse0, 4),
                q_strides: *q_strides,
                o_strides,
                kv_strides: *kv_strides,
                heads_q: p.heads_q as i32,
                heads_kv: p.heads_kv as i32,
                n_new: p.n_new as i32,
                // Each at most i32::MAX (checked above).
                max_pages: max_pages as i32,
                num_pages: num_pages as i32,
                log2_page: log2_page as i32,
                splits: splits_i,
                row_blocks: fd_row_blocks as i32,
                scale_log2: p.scale * std::f32::consts::LOG2_E,
                total_new: p.total_new.unwrap_or(0) as i32,
                lengths: chunk_lengths,
                new_starts: chunk_starts,
            };
            let params = Params {
                call,
                o_part: at(o_part_ptr, row0 * splits * p.d, 4),
                lse_part: at(lse_part_ptr, row0 * splits, 4),
                counters: scratch.counters,
                mods,
                // At most the batch, which fits in i32 (the rows do, checked).
                first_seq: first as i32,
                window_left,
            };
            if let Some((split, smem, row_blocks, blocks_x)) = &pp_launch {
                let w = p.window;
                let pp_params = PpParams {
                    call: DecodeCall { row_blocks: *row_blocks as i32, ..call },
                    acc_part: params.o_part,
                    l_part: params.lse_part,
                    lr_part: at(lr_part_ptr, row0 * splits, 4),
                    max_part: at(max_part_ptr, row0 * splits, 4),
                    fallback: at(flags_ptr, row0, 4),
                    counters: scratch.counters,
                    sums: if atomic {
                        AtomicSums::at(scratch.counters + 4 * sums_at as u64, rows, p.d, row0)
                    } else {
                        AtomicSums::default()
                    },
                    phi: w.phi,
                    phi_log2: w.phi_log2,
                    lo_log2: w.lo_log2,
                    hi_log2: w.hi_log2,
                };
                gpu.launch_programmatic(
                    split,
                    grid(*blocks_x, p.heads_kv, n)?,
                    32 * WARPS as u32,
                    *smem,
                    &pp_params,
                )?;
            }
            if let Some((fd_split, fd_smem)) = &fd_launch {
                gpu.launch_programmatic(
                    fd_split,
                    grid(fd_blocks_x, p.heads_kv, n)?,
                    32 * WARPS as u32,
                    *fd_smem,
                    &params,
                )?;
            }
        }
        if !(count_fallbacks && pp_kernel.is_some()) {
            return Ok(None);
        }
        // Copied while the scratch memory is still this call's.
        let mut flags = vec![0i32; rows];
        // SAFETY: flags_ptr addresses `rows` i32 of the scratch buffer, written by this call's
        // kernels on this stream; the host waits for the copy before reading `flags`.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut flags, flags_ptr, s.cu_stream()) }
            .map_err(KernelError::driver("copying the fallback flags to the host"))?;
        s.synchronize().map_err(KernelError::driver("copying the fallback flags to the host"))?;
        Ok(Some(flags.iter().filter(|&&f| f != 0).count()))
    })?;
    drop((_g0, _g1, _g2, _g5, _g6, _g7));
    Ok(fallback_rows)
}
