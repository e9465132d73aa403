// FlashAttention-2 forward (Dao 2023, Algorithm 1), on tensor cores with mma.sync.
//
// One thread block owns BR query rows of one (batch, head) and walks the K/V tiles of that head
// once; nothing is shared between blocks. Each of the WARPS warps owns MT·16 of the rows, so the
// softmax statistics (running max m, running sum l) and the unnormalised output accumulator live in
// that warp's registers for the whole walk and are written once at the end (O / l, and lse).
//
// Per K/V tile:  S = Q·Kᵀ  ->  mask (sequence tails, the band: mask.cuh)  ->  online softmax
//                update (rescale the accumulator by 2^(m_old − m_new))  ->  O += P·V.
// Tiles wholly outside the band (right of the causal diagonal, left of a sliding window) are
// never loaded. The next tile's K and V are copied
// with cp.async while the current one is computed (two shared-memory stages).
//
// Legend (tiles as in the CPU rungs and the paper):
//   BR  query rows per block (= WARPS·MT·16)       BC  keys per K/V tile
//   q0  first query row of the block               k0  first key of K/V tile j
//   j   K/V tile                                   kk  16-wide k-step over d (S = Q·Kᵀ)
//   ks  16-wide k-step over keys (O += P·V)
//   mt  16-row mma tile of the warp                nt  8-column accumulator tile of S (NT per row)
//   np  pair of nt (one B load)                    dt  8-column tile of O (DT per row), dp a pair
//   h   row half of an accumulator tile (entries 2h, 2h+1; see mma.cuh)
//
// Compile-time constants, set by the host for each variant:
//   FA2_D      head dimension (any multiple of 8 up to 256; layout.cuh pads it to the products'
//              16-wide k-steps in registers and to 64-element rows in shared memory)
//   FA2_MT     16-row mma tiles per warp (2 halves shared-memory traffic per FLOP; 1 for d = 256)
//   FA2_BC     keys per K/V tile
//   FA2_WARPS  warps per block
//   FA2_CAUSAL 1 for the causal variant (a separate compile: the unmasked kernel carries no
//              diagonal logic and keeps those registers free)
//   FA2_WINDOW 1 for a sliding window: the band's sides come from the parameters (p.band, with
//              the causal mask folded in), and the key walk starts at the band's first tile
//   FA2_Q_ROW, FA2_K_ROW, FA2_V_ROW, FA2_O_ROW
//              elements between rows of Q, K, V, O (D when contiguous, heads·D for [b, s, h, d]):
//              compiled in, so that the copies address a tile's rows with immediate offsets; a
//              stride in a register costs the d = 64 causal kernel a spill. The batch and head
//              strides are the parameters' (layout.cuh), used once per tile.
//   FA2_V_STRIDES 1 when V's batch and head strides differ from K's (V's offset is computed on its
//              own; 0: K's serves both, which the tightest variants need to stay out of spills)
//   FA2_VARLEN 1 for a packed variable-length batch (varlen.cuh): block x takes the query block
//              the tile table names, and every length and offset is its sequence's
//   LADDER_SCORE_MOD  a score modifier compiled in (score_mod.cuh): S is scaled and rewritten
//              before the mask, and the softmax runs in base 2 on the result
//   LADDER_MASK_MOD  a mask modifier compiled in (mask_mod.cuh): the walk visits only the key
//              tiles the block mask lists as live, and a partial tile asks the mask per entry

#include "copy.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mask_mod.cuh"
#include "mma.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "types.cuh"
#include "varlen.cuh"

#ifndef FA2_D
#define FA2_D 128
#endif
#ifndef FA2_MT
#define FA2_MT 2
#endif
#ifndef FA2_BC
#define FA2_BC 64
#endif
#ifndef FA2_WARPS
#define FA2_WARPS 4
#endif
#ifndef FA2_CAUSAL
#define FA2_CAUSAL 0
#endif
#ifndef FA2_WINDOW
#define FA2_WINDOW 0
#endif

constexpr int D = FA2_D;
#ifndef FA2_Q_ROW
#define FA2_Q_ROW FA2_D
#define FA2_K_ROW FA2_D
#define FA2_V_ROW FA2_D
#define FA2_O_ROW FA2_D
#endif
constexpr long long Q_ROW = FA2_Q_ROW, K_ROW = FA2_K_ROW, V_ROW = FA2_V_ROW, O_ROW = FA2_O_ROW;
#ifndef FA2_V_STRIDES
#define FA2_V_STRIDES 0
#endif
#ifndef FA2_VARLEN
#define FA2_VARLEN 0
#endif
constexpr bool packed = FA2_VARLEN;
constexpr int DK = HeadDim<D>::DK;      // columns of the products (D rounded up to 16)
constexpr int COLS = HeadDim<D>::COLS;  // columns of a shared tile (D rounded up to 64)
constexpr int MT = FA2_MT;
constexpr int BC = FA2_BC;
constexpr int WARPS = FA2_WARPS;
constexpr bool causal = FA2_CAUSAL;
constexpr bool windowed = FA2_WINDOW;
constexpr int THREADS = WARPS * 32;
constexpr int BR = WARPS * MT * 16;
constexpr int NT = BC / 8;  // 8-column accumulator tiles across one row of S
constexpr int DT = DK / 8;  // 8-column accumulator tiles across one row of O

// Q, K, V, O are [batch, heads, n, D] (heads_q for Q and O, heads_kv for K and V) with any
// strides but the last (layout.cuh; the row strides are also FA2_*_ROW, which the kernel uses);
// lse is [batch, heads_q, n_q], contiguous, natural log. A packed batch (FA2_VARLEN) is one batch
// entry of total rows: its sequences' rows and lengths come from varlen, and lse is
// [heads_q, total_q].
struct Fa2ForwardParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    Strides q_strides;
    Strides k_strides;
    Strides v_strides;
    Strides o_strides;
    int heads_q;
    int heads_kv;
    int n_q;
    int n_kv;
    float scale_log2;  // softmax scale · log2(e)
    Band band;         // FA2_WINDOW only: the sliding window (mask.cuh)
    Varlen varlen;     // FA2_VARLEN only
    ModifierArgs mods;  // the score modifier (LADDER_SCORE_MOD) and the sinks (score_mod.cuh)
    MaskArgs mask;      // the mask modifier and its block mask (LADDER_MASK_MOD; mask_mod.cuh)
};

// Launch: grid (ceil(n_q / BR), heads_q, batch), or (varlen.n_tiles, heads_q, 1) for a packed
// batch; block (THREADS = 32·WARPS, 1, 1),
// dynamic shared memory (BR + 4·BC)·COLS·2 bytes (Q tile, then two stages of K and two of V).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
fa2_forward(const __grid_constant__ Fa2ForwardParams p) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;                // [BR][COLS]
    u16* sK = sQ + BR * COLS;      // [2][BC][COLS]
    u16* sV = sK + 2 * BC * COLS;  // [2][BC][COLS]

    // ---- which rows: one block per query tile, the longest causal blocks first ------------------
    // Causal blocks near the end of the sequence have the most tiles: launch them first so that
    // the last wave is made of short blocks (a packed batch's tile table is in that order).
    // The sequence is looked up again where it is needed rather than kept in registers, as the
    // K/V offsets below are (a packed batch's offsets and lengths are then L1 hits; kept, they
    // cost the d = 128 causal kernel a spill).
    auto sequence = [&]() { return query_block<packed, causal>(p.varlen, p.n_q, p.n_kv); };
    const SeqBlock w = sequence();
    const int head = blockIdx.y;
    const int q0 = w.block * BR;
    const int warp = warp_id();

    const u16* gQ = head_base(p.q, p.q_strides, w.batch, head) + w.q_start * Q_ROW;
    // K and V of this block's kv head; recomputed inside the loop (see block_y) rather than kept.
    auto kv_offset = [&](const Strides& s, long long row) {
        const long long first = packed ? sequence().k_start * row : 0;
        return head_offset<u16>(s, block_z(), block_y() / (p.heads_q / p.heads_kv)) + first;
    };

    const int shift = w.n_kv - w.n_q;  // bottom-right alignment (mask.cuh)
    const Band band = band_of<causal, windowed>(p.band);
    // The key tiles the walk computes: every tile of the band's span, or those the block mask
    // leaves live (mask_mod.cuh).
    const KeyWalk walk = key_walk(p.mask, key_tile_span<BC>(q0, q0 + BR - 1, w.n_kv, shift, band),
                                  w.batch, head, w.block);

    // ---- per-warp state: the warp's rows of O, m and l, in registers for the whole walk ---------
    float acc[MT][DT][4];  // O, unnormalised
    float row_max[MT][2], row_sum[MT][2];
    zero(acc);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row_max[mt][0] = row_max[mt][1] = LADDER_NEG_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    // ---- prologue: Q once, and the first K/V tile into stage 0 ----------------------------------
    load_tile<BR, COLS, DK, D, THREADS>(sQ, gQ, Q_ROW, q0, w.n_q);
    if (!walk.empty()) {
        const int n_kv = w.n_kv, first = walk[0].index * BC;
        const long long k_off = kv_offset(p.k_strides, K_ROW);
        const long long v_off = FA2_V_STRIDES ? kv_offset(p.v_strides, V_ROW) : k_off;
        load_tile<BC, COLS, DK, D, THREADS>(sK, p.k + k_off, K_ROW, first, n_kv);
        load_tile<BC, COLS, DK, D, THREADS>(sV, p.v + v_off, V_ROW, first, n_kv);
    }
    cp_async_commit();

    // First row of the warp's tiles; a thread's accumulator rows are
    // warp_row0 + mt·16 + acc_row(e).
    const int warp_row0 = warp * MT * 16;
    const auto qA = a_operand<COLS>(sQ, warp_row0);  // Q: A of S = Q·Kᵀ
    const auto kB = b_operand<COLS>(sK);             // K: B of S = Q·Kᵀ (rows = keys = n)
    const auto vB = b_operand_trans<COLS>(sV);       // V: B of O = P·V (rows = keys = k)

    // ---- the K/V walk: copy the next tile into the other stage while tile j is computed ---------
    for (int pos = walk.start(); pos < walk.end(); ++pos) {
        const int stage = (pos - walk.start()) & 1;
        const KeyTile tile = walk.at(pos);
        if (pos + 1 < walk.end()) {
            const int n_kv = sequence().n_kv, next = walk.at(pos + 1).index * BC;
            u16* k_stage = sK + (stage ^ 1) * BC * COLS;
            u16* v_stage = sV + (stage ^ 1) * BC * COLS;
            const long long k_off = kv_offset(p.k_strides, K_ROW);
            const long long v_off = FA2_V_STRIDES ? kv_offset(p.v_strides, V_ROW) : k_off;
            load_tile<BC, COLS, DK, D, THREADS>(k_stage, p.k + k_off, K_ROW, next, n_kv);
            load_tile<BC, COLS, DK, D, THREADS>(v_stage, p.v + v_off, V_ROW, next, n_kv);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int stage_rows = stage * BC;
        const int k0 = tile.index * BC;

        // ---- S = Q·Kᵀ -------------------------------------------------------------------------
        // (mma_abt in mma.cuh is this loop; written out here because calling it tips ptxas into
        // a 24-byte spill at d = 128, see docs/perf-notes.md)
        float s[MT][NT][4];
        zero(s);
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) qA.load(a[mt], kk, mt * 16);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 b[4];
                kB.load(b, kk, stage_rows + np * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    mma_16x16(s[mt][2 * np], s[mt][2 * np + 1], a[mt], b);
            }
        }

        // ---- score_mod(scale · S), before the mask (nothing without a modifier) ----------------
        if constexpr (has_score_mod) {
            const SeqBlock at = sequence();
            const ScorePlace place{at.seq, head, at.n_q, at.n_kv};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    modify_scores(s[mt], h, q0 + warp_row0 + mt * 16 + acc_row(2 * h), k0, place,
                                  p.mods);
        }

        // ---- mask: keys past the end, and keys outside the band --------------------------------
        // Only the last tile and the tiles crossing the band's edges need it; the test is uniform
        // across the block, so unmasked tiles pay one comparison.
        const SeqBlock now = sequence();
        const int now_shift = now.n_kv - now.n_q;
        if (k0 + BC > now.n_kv || crosses_band(q0, q0 + BR - 1, k0, k0 + BC - 1, now_shift, band)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = q0 + warp_row0 + mt * 16 + acc_row(2 * h);
                    mask_band(s[mt], h, key_columns(row, k0, now.n_kv, now_shift, band), band,
                              LADDER_NEG_INF);
                }
        }
        // ---- the mask modifier, on the tiles it leaves partly visible --------------------------
        if (has_mask_mod && tile.partial) {
            const MaskAt at{now.batch, head, 0, 0, now.n_q, now.n_kv};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    mask_hidden(s[mt], h, q0 + warp_row0 + mt * 16 + acc_row(2 * h), k0, at,
                                p.mask, LADDER_NEG_INF);
        }

        // ---- online softmax: P = 2^(S·scale_log2 − m), rounded to 16 bits -----------------------
        u32 pk[MT][NT][2];
        float alpha[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                alpha[mt][h] = online_softmax(s[mt], h, score_scale_log2(p.scale_log2),
                                              row_max[mt][h], row_sum[mt][h], pk[mt]);

        // ---- lazy rescale: acc ·= 2^(m_old − m_new), only when a row of the warp moved ----------
        // Rescale the accumulator only when some row of the warp found a new maximum: after the
        // first few tiles that is rare, and the test is uniform across the warp (no divergence).
        // Skipping it is exact, since alpha is then exactly 1.
        bool rescale = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) rescale |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= alpha[mt][e / 2];
        }

        // ---- O += P·V ---------------------------------------------------------------------------
#pragma unroll
        for (int ks = 0; ks < BC / 16; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                a_from_packed(a[mt], pk[mt][2 * ks], pk[mt][2 * ks + 1]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                vB.load(b, dp, stage_rows + ks * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    mma_16x16(acc[mt][2 * dp], acc[mt][2 * dp + 1], a[mt], b);
            }
        }
        // The next iteration's copies overwrite the stage read here.
        __syncthreads();
    }
    if (walk.empty()) cp_async_wait<0>();

    // ---- epilogue: O = acc / l, lse = m·ln2 + ln l, the head's sink folded in first; rows that
    // saw no key (l = 0) get O = 0 and lse = −inf (σ with a sink), rows that met a NaN (l = NaN)
    // get NaN in both ---------------------------------------------------------------------------
    const SeqBlock seq = sequence();
    u16* gO = head_base(p.o, p.o_strides, seq.batch, head) + seq.q_start * O_ROW;
    float* gL = p.lse + lse_offset(packed, p.varlen, seq, p.heads_q, head, p.n_q);
    const float sink = sink_log2(p.mods.sinks, head);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = q0 + warp_row0 + mt * 16 + acc_row(2 * h);
            float l = quad_sum(row_sum[mt][h]);
            const float alpha = fold_sink(row_max[mt][h], l, sink);
            const float inv = l > 0.f ? alpha / l : 0.f;
            if (row < seq.n_q) {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    if (dt * 8 < D)  // the padding columns D … DK stay in registers
                        *reinterpret_cast<u32*>(gO + row * O_ROW + acc_col(dt, 0)) =
                            pack2(acc[mt][dt][2 * h] * inv, acc[mt][dt][2 * h + 1] * inv);
                if (lane_id() % 4 == 0)
                    gL[row] = l == 0.f ? LADDER_NEG_INF : row_max[mt][h] * LADDER_LN2 + logf(l);
            }
        }
}
