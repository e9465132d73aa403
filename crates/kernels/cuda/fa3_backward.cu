// FlashAttention-3 backward (Shah et al. 2024, §3.1 and Appendix B.1) on Hopper: FA2's backward
// arithmetic (fa2_backward.cu, Algorithm 2 of the FA2 paper) with FA3's machinery — TMA copies
// from a producer warpgroup, an mbarrier pipeline, wgmma products, registers handed to the
// consumers (setmaxnreg).
//
// This is the main kernel only. The preparation (D = rowsum(dO ∘ O), lse in base 2, dQ's f32
// accumulator zeroed), the deterministic dQ pass and the finish (dQ's scale and conversion, and
// with GQA dK's and dV's sum over the group) are FA2's kernels, launched around this one with the
// same parameter block (backward.cuh): the two rungs read and write the same arrays.
//
// One block per (K/V tile of BC keys, query head, batch entry). K_j and V_j land once; the block
// then walks the query tiles i that can see them, recomputing P from lse instead of storing it:
//
//   producer warpgroup (one thread)        consumer warpgroup wg (64 keys of the tile each)
//   ------------------------------         --------------------------------------------------
//   TMA: K_j, V_j            -> kv_full    wait kv_full
//   for each query tile i:                 for each query tile i:
//     wait q_empty[stage]                    wait q_full[stage]
//     TMA: Q_i, dO_i,                        Sᵀ  = K_wg Q_iᵀ,  dPᵀ = V_wg dO_iᵀ       (wgmma, ss)
//          lse2_i, D_i       -> q_full       Pᵀ  = 2^(scale_log2·Sᵀ − lse2_i), masked
//                                            dSᵀ = Pᵀ ∘ (dPᵀ − D_i)
//                                            dSᵀ -> shared memory; both warpgroups meet
//                                            dQ_i[:, cols_wg] = dS K_j[:, cols_wg]   (wgmma, ss)
//                                            dV_wg += Pᵀ dO_i,  dK_wg += dSᵀ Q_i      (wgmma, rs)
//                                            dQ_i -> shared memory (under dV, dK); one
//                                              thread has the copy engine add the tile to
//                                              dQ's f32 accumulator
//                                            release the stage
//                                          dK_wg, dV_wg -> dK, dV, scaled, in 16 bits; with GQA
//                                            to f32 accumulators (finish sums the group, scales
//                                            and converts)
//
// As in fa2_backward.cu the products are taken with the key index on the rows (Sᵀ, dPᵀ, dSᵀ):
// dK and dV accumulate in the consumers' registers, and Pᵀ, dSᵀ come out of the first products
// already in the register layout of the A operand of the next (wgmma's accumulator is mma.sync's,
// wgmma.cuh). Only dQ needs dS with the query index on the rows: the consumers store dSᵀ (keys ×
// queries) in one shared tile, which dQ's product reads as an M-major A operand (wgmma's
// transposed A), and split dQ's columns between them. The dSᵀ tile is double-buffered: warpgroup
// wg writes buffer i mod 2 only after both passed tile i − 1's meeting, which each reaches only
// after its own dQ product of tile i − 2 (the last reader of that buffer) has completed.
//
// Other blocks (the other key tiles) add to the same rows of dQ. Rather than an atomic per pair
// of elements from every consumer thread, the consumers write dQ_i's tile to shared memory (f32,
// in the copy engine's swizzled 32-column blocks) and one thread hands it to the copy engine as a
// reduction (cp.reduce.async.bulk.tensor, tma.cuh): the adds happen at L2, a tile at a time, and
// the consumers go on. The tile is rewritten a tile later, once that thread has seen the copy
// engine finish reading it (before the next dSᵀ meeting, which every consumer passes first).
//
// FA3B_DETERMINISTIC = 1 drops everything dQ (no dSᵀ or dQ tile, no reductions, no meetings):
// FA2's dQ pass computes dQ in a fixed order instead.
//
// Legend (tiles as in the CPU rungs: BR query rows, BC keys):
//   BC  keys per block (64 per consumer warpgroup)    BR  query rows per step (query tile i)
//   k0  first key of the block                        i0  first query row of tile i
//   nt  8-column accumulator tile of Sᵀ across the BR queries (NQ per row)
//   dt  8-column accumulator tile across d           ks  16-wide k-step
//
// Compile-time constants, set by the host for each variant:
//   FA3B_D (any multiple of 8 up to 128), FA3B_STAGES, FA3B_CAUSAL, FA3B_DETERMINISTIC,
//   LADDER_SCORE_MOD (score_mod.cuh), LADDER_MASK_MOD (mask_mod.cuh: producer and consumers
//   walk the query tiles the block mask lists as live for the block's keys, in its order, and
//   the consumers read a partial one's kept bits, or ask the mask per entry where none were
//   kept),
//   FA3B_HOST_SHARED_BYTES, FA3B_HOST_PARAMS_BYTES (the host's sizes, checked below)

#include "backward.cuh"
#include "barrier.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "types.cuh"
#include "wgmma.cuh"

#ifndef FA3B_D
#define FA3B_D 128
#endif
#ifndef FA3B_STAGES
#define FA3B_STAGES 2
#endif
#ifndef FA3B_CAUSAL
#define FA3B_CAUSAL 0
#endif
#ifndef FA3B_DETERMINISTIC
#define FA3B_DETERMINISTIC 0
#endif

constexpr int D = FA3B_D;
constexpr int DK = HeadDim<D>::DK;      // columns of the products over d (D rounded up to 16)
constexpr int COLS = HeadDim<D>::COLS;  // columns of a shared tile (whole 64-element blocks)
constexpr int STAGES = FA3B_STAGES;
constexpr bool causal = FA3B_CAUSAL;
constexpr bool deterministic = FA3B_DETERMINISTIC;
constexpr int CONSUMERS = 2;
constexpr int BC = 64 * CONSUMERS;  // wgmma's M is 64: one consumer warpgroup's keys
constexpr int BR = 64;              // one 128-byte column block of dSᵀ's queries
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int NQ = BR / 8;
static_assert(D % 8 == 0 && D <= 128, "dK and dV of 64 keys × D fit the consumers' registers");

// dQ_i = dS K_j is split between the consumers by columns of d. An N-major operand's columns
// start in a 64-column block (wgmma.cuh), so past 64 columns the split falls on the block
// boundary (the second warpgroup takes what is left), below it in the middle of the one block.
constexpr int DQ_SPLIT = DK > 64 ? 64 : DK / 2;
constexpr int DQ_COLS0 = DQ_SPLIT, DQ_COLS1 = DK - DQ_SPLIT;
static_assert(DQ_COLS0 % 8 == 0 && DQ_COLS1 % 8 == 0 && DQ_COLS1 <= 64, "wgmma widths");
// dQ's f32 tile in shared memory: [BR × 32] column blocks (128 bytes per row, one swizzle span).
constexpr int DQ_BLOCKS = (DK + 31) / 32;

// Registers per thread after the hand-over: 24 for the producer, 240 for each consumer (65536 per
// SM; one block per SM).
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = 240;

// The consumers' meetings: both halves of dSᵀ are in shared memory; both column ranges of dQ_i.
constexpr int DS_BARRIER = 1;
constexpr int DQ_BARRIER = 2;
// The consumer thread that hands dQ's tiles to the copy engine.
constexpr int DQ_ISSUER = 128;

// FA2's parameter block (backward.cuh) and the tensor maps of the tiles the copy engine reads:
// Q and dO in tiles of BR rows, K and V in tiles of BC, with their strides; and the map that
// dQ's tiles are added through (f32, FA2's accumulator [batch, heads_q, n_q, D], 32-column
// boxes of BR rows).
struct Fa3BackwardParams {
    TensorMap q;
    TensorMap k;
    TensorMap v;
    TensorMap d_o;
    TensorMap dq_acc;
    BackwardParams b;
};

// Shared memory (dynamic, 1024-byte aligned for the swizzle). Every tile is in the copy engine's
// 128-byte-swizzled column blocks (tma.cuh); dSᵀ is [BC keys × BR queries], one column block.
struct SharedTiles {
    u16 k[BC * COLS];
    u16 v[BC * COLS];
    u16 q[STAGES][BR * COLS];
    u16 d_o[STAGES][BR * COLS];
    u16 ds[2][BC * BR];
    float dq[DQ_BLOCKS * BR * 32];
    float lse2[STAGES][BR];
    float delta[STAGES][BR];
    u64 kv_full;          // K_j and V_j have landed
    u64 q_full[STAGES];   // Q_i, dO_i, lse2_i and D_i have landed
    u64 q_empty[STAGES];  // every consumer thread is done with the stage
};

#ifdef FA3B_HOST_SHARED_BYTES
static_assert(sizeof(SharedTiles) + 1024 == FA3B_HOST_SHARED_BYTES,
              "the host's shared-memory size (src/fa3/backward.rs) is the tiles' plus the slack");
#endif
#ifdef FA3B_HOST_PARAMS_BYTES
static_assert(sizeof(Fa3BackwardParams) == FA3B_HOST_PARAMS_BYTES,
              "the host's Fa3BackwardParams (src/fa3/backward.rs) mirrors this one");
#endif

typedef PipelineState<STAGES> QueryPosition;

// The block's work: its keys (key block seq.block of batch entry seq.batch), its heads, and the
// query tiles that see them.
struct Work {
    SeqBlock seq;
    int k0;
    int head;
    int kv_head;
    KeyWalk walk;  // the query tiles it walks: the span's, or the block mask's live ones
};

__device__ __forceinline__ Work work_of(const BackwardParams& p) {
    Work w;
    w.seq = fixed_block(blockIdx.z, blockIdx.x, p.n_q, p.n_kv);
    w.k0 = w.seq.block * BC;
    w.head = blockIdx.y;
    w.kv_head = w.head / (p.heads_q / p.heads_kv);
    // Bottom-right causal: query i sees key j when j <= i + shift, so tiles wholly before
    // k0 − shift see none of the block's keys.
    const TileSpan span{causal ? max(0, (w.k0 - (p.n_kv - p.n_q)) / BR) : 0, (p.n_q + BR - 1) / BR};
    w.walk = key_walk(p.mask, span, w.seq.batch, w.head, w.seq.block);
    return w;
}

// ---- producer ---------------------------------------------------------------------------------

__device__ void producer(const Fa3BackwardParams& p, SharedTiles& t, const Work& w) {
    tma_prefetch(&p.q);
    tma_prefetch(&p.d_o);
    mbar_expect_tx(&t.kv_full, sizeof(t.k) + sizeof(t.v));
    const int batch = w.seq.batch;
    tma_load_tile<BC, COLS>(t.k, &p.k, &t.kv_full, 0, w.k0, w.kv_head, batch);
    tma_load_tile<BC, COLS>(t.v, &p.v, &t.kv_full, 0, w.k0, w.kv_head, batch);
    // lse2 and D rows of (batch, head), padded per head to n_q_pad.
    const long long stats = stat_rows<false>(p.b, w.seq, w.head);
    QueryPosition pos;
    for (int at = w.walk.start(); at < w.walk.end(); ++at, ++pos.count) {
        const int i = w.walk.at(at).index, stage = pos.stage();
        mbar_wait(&t.q_empty[stage], pos.parity() ^ 1);
        mbar_expect_tx(&t.q_full[stage], sizeof(t.q[0]) + sizeof(t.d_o[0]) + 2 * BR * 4);
        tma_load_tile<BR, COLS>(t.q[stage], &p.q, &t.q_full[stage], 0, i * BR, w.head, batch);
        tma_load_tile<BR, COLS>(t.d_o[stage], &p.d_o, &t.q_full[stage], 0, i * BR, w.head, batch);
        // (n_q_pad is a whole number of BR rows: these rows are aligned and inside the arrays)
        bulk_load(t.lse2[stage], p.b.lse2 + stats + i * BR, BR * 4, &t.q_full[stage]);
        bulk_load(t.delta[stage], p.b.delta + stats + i * BR, BR * 4, &t.q_full[stage]);
    }
}

// ---- consumers --------------------------------------------------------------------------------

// dQ_i's columns [C0, C0 + N) = dS K_j: dS from the dSᵀ tile (A, M-major), K's columns from the K
// tile (B, N-major), over the BC keys. Issued, not waited.
template <int N, int C0>
__device__ __forceinline__ void issue_dq(float (&dq)[N / 8][4], const u16* ds, const u16* k) {
    const u16* k_cols = k + (C0 / 64) * BC * 64 + C0 % 64;
#pragma unroll
    for (int ks = 0; ks < BC / 16; ++ks)
        Wgmma<N / 8, 1, 1>::ss(dq, desc_n_major<BC>(ds, ks), desc_n_major<BC>(k_cols, ks), ks > 0);
}

// dV += Pᵀ dO_i and dK += dSᵀ Q_i: the tiles' rows (queries) are the reduction. Issued, not
// waited.
__device__ __forceinline__ void issue_dkv(float (&dv)[D / 8][4], float (&dk)[D / 8][4],
                                          const u32 (&pt)[NQ][2], const u32 (&dst)[NQ][2],
                                          const u16* q, const u16* d_o) {
    wgmma_pv<BR, D>(dv, pt, d_o);
    wgmma_pv<BR, D>(dk, dst, q);
}

// dQ_i's columns [C0, C0 + N) of this warpgroup, then dV and dK: dQ's product goes first so that
// its entries go into dQ's shared tile (f32, 32-column blocks with the copy engine's 128-byte
// swizzle: 16-byte chunks permuted by row mod 8, so the quad's and the warp's rows land in
// different banks) while the tensor cores take dV and dK. dV and dK are left in flight.
template <int N, int C0>
__device__ __forceinline__ void dq_then_dkv(float* sdq, const u16* ds, const u16* k,
                                            float (&dv)[D / 8][4], float (&dk)[D / 8][4],
                                            const u32 (&pt)[NQ][2], const u32 (&dst)[NQ][2],
                                            const u16* q, const u16* d_o) {
    float dq[N / 8][4];
    wgmma_fence();
    issue_dq<N, C0>(dq, ds, k);
    wgmma_commit();
    issue_dkv(dv, dk, pt, dst, q, d_o);
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_hold(dq);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = (warp_id() % 4) * 16 + acc_row(2 * h);
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const int c = C0 + acc_col(nt, 0);
            const int chunk = ((c % 32) / 4) ^ (r % 8);
            float* at = sdq + (c / 32) * BR * 32 + r * 32 + chunk * 4 + c % 4;
            *reinterpret_cast<float2*>(at) = make_float2(dq[nt][2 * h], dq[nt][2 * h + 1]);
        }
    }
}

// dSᵀ (packed, the warpgroup's 64 keys) into the shared tile at its rows, swizzled as TMA would
// have written it (the layout dQ's product reads).
__device__ __forceinline__ void store_ds(u16* ds, const u32 (&dst)[NQ][2], int key_row0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = key_row0 + (warp_id() % 4) * 16 + acc_row(2 * h);
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
            *reinterpret_cast<u32*>(ds + swz<64>(r, acc_col(nt, 0))) = dst[nt][h];
    }
}

__device__ void consumer(const Fa3BackwardParams& p, SharedTiles& t, const Work& w, int wg) {
    const BackwardParams& b = p.b;
    const int key_row0 = wg * 64;                               // the warpgroup's rows of K_j
    const int warp_key0 = w.k0 + key_row0 + (warp_id() % 4) * 16;  // keys of the thread's rows
    const int shift = b.n_kv - b.n_q;
    float dk[D / 8][4], dv[D / 8][4];
    zero(dk);
    zero(dv);

    mbar_wait(&t.kv_full, 0);
    QueryPosition pos;
    for (int at = w.walk.start(); at < w.walk.end(); ++at, ++pos.count) {
        const KeyTile tile = w.walk.at(at);
        const int stage = pos.stage(), i0 = tile.index * BR;
        // The mask modifier on a partial tile, from its kept bits or else asked here (Pᵀ: keys on
        // the rows, queries on the columns), before the products' register peak, and applied to
        // Pᵀ below. (With a score modifier as well, the bits' loads made the d = 128 variants
        // spill, wherever they were placed: those ask the mask.)
        unsigned long long hidden = 0;
        if (has_mask_mod && tile.partial) {
            if (!has_score_mod && tile.bits >= 0)
                hidden = hidden_kept_bits_t<BC, NQ>(warp_key0 - w.k0 + acc_row(0), tile.bits,
                                                    b.mask, BR);
            else
                hidden = hidden_entries<4, NQ>(
                    0, [&](int nt, int e) { return i0 + acc_col(nt, e); },
                    [&](int, int e) { return warp_key0 + acc_row(e); },
                    MaskAt{w.seq.batch, w.head, 0, 0, b.n_q, b.n_kv}, b.mask);
        }
        mbar_wait(&t.q_full[stage], pos.parity());

        // Sᵀ = K Q_iᵀ and dPᵀ = V dO_iᵀ, issued together; Pᵀ is computed under the second.
        float s[NQ][4], dp[NQ][4];
        wgmma_fence();
        wgmma_qk<BC, BR, DK>(s, t.k, key_row0, t.q[stage]);
        wgmma_commit();
        wgmma_qk<BC, BR, DK>(dp, t.v, key_row0, t.d_o[stage]);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_hold(s);
        // score_mod(scale · Sᵀ) and its slopes, for dSᵀ below (nothing without a modifier)
        float slope[NQ][4];  // (unused, and so dropped, without a modifier)
        if constexpr (has_score_mod) {
            const ScorePlace place{w.seq.seq, w.head, b.n_q, b.n_kv};
            modify_scores_with_slopes(
                s, slope, [&](int nt, int e) { return i0 + acc_col(nt, e); },
                [&](int, int e) { return warp_key0 + acc_row(e); }, place, b.mods);
        }
        const float* lse2 = t.lse2[stage];
        const float scale_log2 = score_scale_log2(b.scale_log2);
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -lse2[acc_col(nt, e)]));
        // Only tiles that cross the diagonal or an end of either sequence need the entry test
        // (padding query rows have lse2 = 0, keys past the end zeros: neither gives P = 0).
        const int k_last = w.k0 + BC - 1;
        if (i0 + BR > b.n_q || k_last >= b.n_kv || crosses_diagonal<causal>(i0, k_last, shift)) {
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (masked<causal>(i0 + acc_col(nt, e), warp_key0 + acc_row(e), b.n_q, b.n_kv,
                                       shift))
                        s[nt][e] = 0.f;
        }
        if constexpr (has_mask_mod) clear_hidden<4>(s, 0, hidden, 0.f);
        wgmma_wait<0>();
        wgmma_hold(dp);
        const float* delta = t.delta[stage];
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[acc_col(nt, e)]);
        if constexpr (has_score_mod) chain_slopes(dp, slope);
        u32 pt[NQ][2], dst[NQ][2];  // Pᵀ and dSᵀ, rounded to 16 bits: the A operands below
        pack_p(s, pt);
        pack_p(dp, dst);

        u16* ds = t.ds[pos.count & 1];
        if constexpr (!deterministic) {
            store_ds(ds, dst, key_row0);
            tma_store_fence();  // the stores, visible to wgmma (the async proxy)
            // dQ's shared tile is written below: the copy engine must have read the last one.
            if (threadIdx.x == DQ_ISSUER) tma_store_wait_read();
            named_sync(DS_BARRIER, 128 * CONSUMERS);

            if (wg == 0)
                dq_then_dkv<DQ_COLS0, 0>(t.dq, ds, t.k, dv, dk, pt, dst, t.q[stage], t.d_o[stage]);
            else
                dq_then_dkv<DQ_COLS1, DQ_SPLIT>(t.dq, ds, t.k, dv, dk, pt, dst, t.q[stage],
                                                t.d_o[stage]);
            tma_store_fence();
            named_sync(DQ_BARRIER, 128 * CONSUMERS);
            if (threadIdx.x == DQ_ISSUER) {  // rows past n_q are outside the map: not added
#pragma unroll
                for (int cb = 0; cb < DQ_BLOCKS; ++cb)
                    tma_reduce_add_4d(&p.dq_acc, t.dq + cb * BR * 32, cb * 32, i0, w.head,
                                      w.seq.batch);
                tma_store_commit();
            }
        } else {
            wgmma_fence();
            issue_dkv(dv, dk, pt, dst, t.q[stage], t.d_o[stage]);
            wgmma_commit();
        }
        wgmma_wait<0>();
        wgmma_hold(dv);
        wgmma_hold(dk);
        wgmma_hold(pt);
        wgmma_hold(dst);
        // Every thread arrives (its own reads of the stage's lse2 and D are what it releases).
        mbar_arrive(&t.q_empty[stage]);
    }
    // The copy engine reads dQ's last tile from shared memory, which must outlive it.
    if (!deterministic && threadIdx.x == DQ_ISSUER) tma_store_wait_all();

    // dK_j, dV_j of this query head: without GQA the head's own gradients, scaled and converted
    // here (a quad's four threads write 16 adjacent bytes of a row, which L2 merges into whole
    // sectors); with GQA unscaled f32 shares, which finish sums over the group, scales and
    // converts.
    if (b.dkv_written) {
        u16* gk = head_base(b.dk, b.dk_strides, w.seq.batch, w.kv_head);
        u16* gv = head_base(b.dv, b.dv_strides, w.seq.batch, w.kv_head);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = warp_key0 + acc_row(2 * h);
            if (key >= b.n_kv) continue;
            u16* rk = gk + (long long)key * b.dk_strides.row;
            u16* rv = gv + (long long)key * b.dv_strides.row;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                const int col = acc_col(dt, 0);
                *reinterpret_cast<u32*>(rk + col) =
                    pack2(dk[dt][2 * h] * b.scale, dk[dt][2 * h + 1] * b.scale);
                *reinterpret_cast<u32*>(rv + col) = pack2(dv[dt][2 * h], dv[dt][2 * h + 1]);
            }
        }
        return;
    }
    const long long key_rows = key_rows_offset(false, b.varlen, w.seq, b.heads_q, w.head, b.n_kv);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = warp_key0 + acc_row(2 * h);
        if (key >= b.n_kv) continue;
        float* gk = b.dk_acc + (key_rows + key) * D;
        float* gv = b.dv_acc + (key_rows + key) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            const int col = acc_col(dt, 0);
            *reinterpret_cast<float2*>(gk + col) = make_float2(dk[dt][2 * h], dk[dt][2 * h + 1]);
            *reinterpret_cast<float2*>(gv + col) = make_float2(dv[dt][2 * h], dv[dt][2 * h + 1]);
        }
    }
}

// Launch: grid (ceil(n_kv / BC), heads_q, batch), block THREADS = 384, dynamic shared memory
// sizeof(SharedTiles) + 1024 (for the alignment). Key blocks in order: under the causal mask the
// first have the most query tiles, so the longest blocks start first.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
fa3_backward(const __grid_constant__ Fa3BackwardParams p) {
    // Aligned by pointer arithmetic on the shared array, not through an integer: the compiler then
    // still knows the tiles are shared memory, and the consumers' own loads and stores (lse2, D,
    // dSᵀ, dQ) become LDS/STS rather than generic accesses (64-bit addresses, the long scoreboard).
    extern __shared__ unsigned char smem_raw[];
    SharedTiles& t =
        *reinterpret_cast<SharedTiles*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);

    if (threadIdx.x == 0) {
        mbar_init(&t.kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&t.q_full[s], 1);
            mbar_init(&t.q_empty[s], CONSUMERS * 128);
        }
        mbar_init_fence();
    }
    __syncthreads();

    const Work w = work_of(p.b);
    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        warpgroup_reg_dealloc<PRODUCER_REGS>();
        if (threadIdx.x == 0) producer(p, t, w);
    } else {
        warpgroup_reg_alloc<CONSUMER_REGS>();
        consumer(p, t, w, warpgroup - 1);
    }
}
