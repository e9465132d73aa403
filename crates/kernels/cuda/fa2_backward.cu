// FlashAttention-2 backward (Dao 2023, Algorithm 2), on tensor cores with mma.sync.
//
// Kernels, launched in order:
//   fa2_backward_prep    D_i = rowsum(dO_i ∘ O_i), lse in base 2, and (atomic mode) dQ's f32
//                        accumulator zeroed.
//   fa2_backward         one thread block per (K/V tile j, query head): K_j and V_j stay in shared
//                        memory while the block walks the query tiles i that can see them,
//                        recomputing P from lse instead of storing it:
//                          Sᵀ = K_j Q_iᵀ,  Pᵀ = exp(scale·Sᵀ − lse_i)
//                          dV_j += Pᵀ dO_i
//                          dPᵀ = V_j dO_iᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ − D_i)
//                          dK_j += dSᵀ Q_i
//                          dQ_i += dS K_j          (atomic mode: f32 atomics, other blocks add to
//                                                   the same rows)
//                        Working with the transposes keeps the key index on the rows, so dK and
//                        dV accumulate in each warp's registers, and Pᵀ, dSᵀ come out of one
//                        product already in the operand layout of the next; only dQ needs dSᵀ
//                        through shared memory, transposed by ldmatrix.trans.
//   fa2_backward_dq      deterministic mode only, instead of the atomics: one thread block per
//                        (query tile, query head) walks the key tiles like the forward kernel and
//                        accumulates dQ_i = Σ_j dS_ij K_j in registers (the Triton tutorial's
//                        _attn_bwd_dq on mma.sync):
//                          S = Q_i K_jᵀ,  P = exp(scale·S − lse_i),  dP = dO_i V_jᵀ,
//                          dS = P ∘ (dP − D_i),  dQ_i += dS K_j
//   fa2_backward_finish  scale dQ, dK; sum dK, dV over the query heads of a group (GQA); convert.
//   fa2_backward_sinks   with attention sinks only, after prep: their gradient from lse and D.
//
// Each of the WARPS warps of fa2_backward owns 16 keys of the K/V tile (BC = 16·WARPS keys);
// query tiles have BR rows and are double-buffered with cp.async. Eight warps and 128 keys per
// block (rather than 64) halve the dQ atomics and the Q/dO shared-memory traffic per FLOP.
// FA2_DETERMINISTIC = 1 drops everything dQ from fa2_backward (no dSᵀ tile, no atomics), so that
// every gradient element is summed in an order fixed by the code: dK, dV by each block's walk over
// query tiles and the finish kernel's loop over the group, dQ by fa2_backward_dq's walk over keys.
//
// Legend (tiles as in the CPU rungs and the paper: BR query rows, BC keys):
//   fa2_backward     BC  keys per block (its K/V tile)     BR  query rows per step (query tile t)
//                    k0  first key of the block            i0  first query row of tile t
//                    nt  8-column accumulator tile of Sᵀ across the BR queries (NQ per row)
//   fa2_backward_dq  BR_DQ  query rows per block            BC_DQ  keys per K/V tile j
//                    q0  first query row of the block      k0  first key of tile j
//                    mt  16-row mma tile of the warp       nt  8-column tile of S across keys
//   both             kk  16-wide k-step over d    ks  16-wide k-step over keys or queries
//                    dt  8-column tile across d (DT per row), dp a pair of them (one B load)
//                    np  pair of nt (one B load)  h   row half of an accumulator tile (mma.cuh)
//
// Compile-time constants, set by the host for each variant:
//   FA2_D              head dimension (any multiple of 8 up to 128; layout.cuh pads it)
//   FA2_BR             query rows per step of fa2_backward
//   FA2_WARPS          warps of fa2_backward (BC = 16·FA2_WARPS keys per block)
//   FA2_CAUSAL         1 for the causal variant
//   FA2_WINDOW         1 for a sliding window: the band's sides from p.band (mask.cuh), the
//                      causal mask folded in; both loops walk only the tiles the band reaches
//   FA2_DETERMINISTIC  1: dQ by fa2_backward_dq instead of atomics
//   FA2_DQ_MT, FA2_DQ_WARPS, FA2_DQ_BC   fa2_backward_dq's 16-row tiles per warp, warps, keys per
//                      K/V tile (BR_DQ = 16·FA2_DQ_MT·FA2_DQ_WARPS query rows per block)
//   FA2_VARLEN         1 for a packed variable-length batch (varlen.cuh): fa2_backward's block x
//                      takes the key block p.varlen's table names, fa2_backward_dq's the query
//                      block (the host passes each kernel its table); prep and finish see the
//                      packed tensors as one batch entry of total_q (total_k) rows, which is what
//                      they are.
//   LADDER_SCORE_MOD   a score modifier compiled in (score_mod.cuh): both kernels rewrite their S
//                      tiles with it before the exponential and scale dS by its derivative
//   LADDER_MASK_MOD    a mask modifier compiled in (mask_mod.cuh): both kernels walk the tiles the
//                      block mask lists as live (the main kernel a key tile's query tiles, the dQ
//                      pass a query tile's key tiles) and ask the mask per entry on partial ones
//                      (fixed-length batches)
//   FA2_HOST_PARAMS_BYTES  the host's size of the parameter block, checked against this one's

#include "backward.cuh"
#include "copy.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "types.cuh"
#include "varlen.cuh"

#ifndef FA2_D
#define FA2_D 128
#endif
#ifndef FA2_BR
#define FA2_BR 64
#endif
#ifndef FA2_WARPS
#define FA2_WARPS 8
#endif
#ifndef FA2_CAUSAL
#define FA2_CAUSAL 0
#endif
#ifndef FA2_WINDOW
#define FA2_WINDOW 0
#endif
#ifndef FA2_DETERMINISTIC
#define FA2_DETERMINISTIC 0
#endif
#ifndef FA2_VARLEN
#define FA2_VARLEN 0
#endif

constexpr int D = FA2_D;
constexpr int DK = HeadDim<D>::DK;      // columns of the products (D rounded up to 16)
constexpr int COLS = HeadDim<D>::COLS;  // columns of a shared tile (D rounded up to 64)
constexpr int BR = FA2_BR;
constexpr int WARPS = FA2_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int BC = WARPS * 16;
constexpr bool causal = FA2_CAUSAL;
constexpr bool windowed = FA2_WINDOW;
constexpr bool deterministic = FA2_DETERMINISTIC;
constexpr bool packed = FA2_VARLEN;
static_assert(!(packed && has_mask_mod), "a mask modifier: fixed-length batches");
constexpr int NQ = BR / 8;  // 8-column accumulator tiles across the queries of a tile
// Row length of the dSᵀ tile: BR, but at least the swizzle's span (copy.cuh: 8 chunks of 16 bytes).
constexpr int DS_COLS = BR < 64 ? 64 : BR;
constexpr int DT = DK / 8;  // 8-column accumulator tiles across d

#ifdef FA2_HOST_PARAMS_BYTES
static_assert(sizeof(BackwardParams) == FA2_HOST_PARAMS_BYTES,
              "the host's BackwardParams (src/fa2.rs) must mirror BackwardParams");
#endif

// ---- prep: D = rowsum(dO ∘ O), lse·log2(e), dQ accumulator = 0 ----------------------------------
// One warp per query row; rows up to the padded length get D = lse = 0 so that whole query tiles
// can be copied without bounds checks.
//
// Launch: grid (ceil(batch·heads_q·n_q_pad / 8), 1, 1), block (256, 1, 1), no shared memory.
extern "C" __global__ void fa2_backward_prep(const __grid_constant__ BackwardParams p) {
    const u16* __restrict__ o = p.o;
    const u16* __restrict__ d_o = p.d_o;
    float* __restrict__ dq_acc = p.dq_acc;
    const long long rows_total = (long long)p.batch * p.heads_q * p.n_q_pad;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = lane_id();
    if (warp >= rows_total) return;
    const int bh = warp / p.n_q_pad, row = warp % p.n_q_pad;
    float acc = 0.f;
    if (row < p.n_q) {
        const int b = bh / p.heads_q, h = bh % p.heads_q;
        const u16* o_row = head_base(o, p.o_strides, b, h) + row * p.o_strides.row;
        const u16* d_o_row = head_base(d_o, p.d_o_strides, b, h) + row * p.d_o_strides.row;
        const size_t acc_row = ((size_t)bh * p.n_q + row) * D;
        for (int c = lane; c < D; c += 32) {
            acc += to_f32(o_row[c]) * to_f32(d_o_row[c]);
            if (!deterministic) dq_acc[acc_row + c] = 0.f;  // fa2_backward_dq writes every element
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        p.delta[warp] = acc;
        p.lse2[warp] = row < p.n_q ? p.lse[(size_t)bh * p.n_q + row] * LADDER_LOG2E : 0.f;
    }
}

// ---- the sinks' gradient (sinks.rs): dσ_h = −Σ_{b,i} 2^(σ_h·log2e − lse2_bhi) · D_bhi -------------
// Launch after prep: grid (heads_q, 1, 1), block (SINK_THREADS, 1, 1), no shared memory beyond
// the reduction's. One block per query head sums its rows of every batch entry in an order fixed
// by the code (each thread a strided run of rows, then the warps in turn), so the gradient is the
// same bits every run.
constexpr int SINK_THREADS = 256;
extern "C" __global__ void __launch_bounds__(SINK_THREADS)
fa2_backward_sinks(const __grid_constant__ BackwardParams p) {
    __shared__ float warp_sums[SINK_THREADS / 32];
    const int head = blockIdx.x;
    const float sink = sink_log2(p.mods.sinks, head);
    const long long rows = (long long)p.batch * p.n_q;
    float sum = 0.f;
    for (long long r = threadIdx.x; r < rows; r += SINK_THREADS) {
        const long long b = r / p.n_q, i = r % p.n_q;
        const long long at = (b * p.heads_q + head) * p.n_q_pad + i;  // prep's row of (b, head, i)
        sum = fmaf(fast_exp2(sink - p.lse2[at]), p.delta[at], sum);
    }
    sum = warp_sum(sum);
    if (lane_id() == 0) warp_sums[warp_id()] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < SINK_THREADS / 32; ++w) total += warp_sums[w];
        p.dsinks[head] = -total;
    }
}

// ---- main kernel: dK_j, dV_j (and, atomic mode, dQ) ---------------------------------------------
// Launch: grid (ceil(n_kv / BC), heads_q, batch), block (THREADS = 32·WARPS, 1, 1), dynamic shared
// memory
//   atomic mode:        (2·BC + 4·BR)·COLS·2 + BC·DS_COLS·2 + 4·BR·4 bytes
//   deterministic mode: (2·BC + 4·BR)·COLS·2 + 4·BR·4 bytes
// (K_j, V_j; two stages of Q_i and dO_i; atomic mode: dSᵀ; two stages of lse2 and D).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
fa2_backward(const __grid_constant__ BackwardParams p) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sK = smem;                 // [BC][COLS]
    u16* sV = sK + BC * COLS;       // [BC][COLS]
    u16* sQ = sV + BC * COLS;       // [2][BR][COLS]
    u16* sdO = sQ + 2 * BR * COLS;  // [2][BR][COLS]
    u16* sdS = sdO + 2 * BR * COLS;  // [BC][DS_COLS]: dSᵀ, keys on rows (atomic mode only)
    float* sL = reinterpret_cast<float*>(sdS + (deterministic ? 0 : BC * DS_COLS));  // [2][BR] lse2
    float* sDelta = sL + 2 * BR;                                                  // [2][BR] D

    // The block's keys (varlen.cuh): key block blockIdx.x of batch entry blockIdx.z, or, for a
    // packed batch, the key block of one sequence that the host's table names, looked up once
    // into shared memory. A packed sequence's offsets and lengths are read from there again where
    // they are used (volatile), not held in registers across the products: the kernel is at its
    // register limit. (`if constexpr`, not `?:`: a volatile read is not dropped from the branch
    // not taken.)
    __shared__ SeqBlock packed_seq;
    if constexpr (packed) {
        if (threadIdx.x == 0) packed_seq = packed_block(p.varlen, blockIdx.x);
        __syncthreads();
    }
    const volatile SeqBlock& ps = packed_seq;
    auto seq_n_q = [&]() -> int {
        if constexpr (packed) return ps.n_q;
        else return p.n_q;
    };
    auto seq_n_kv = [&]() -> int {
        if constexpr (packed) return ps.n_kv;
        else return p.n_kv;
    };
    auto key0 = [&]() -> int {  // the block's first key
        if constexpr (packed) return ps.block * BC;
        else return blockIdx.x * BC;
    };
    auto sequence = [&]() -> SeqBlock {  // all of it, where it is needed once
        if constexpr (packed) return packed_block(p.varlen, blockIdx.x);
        else return fixed_block(blockIdx.z, blockIdx.x, p.n_q, p.n_kv);
    };

    const int head = blockIdx.y, batch = packed ? 0 : blockIdx.z;
    const int kv_head = head / (p.heads_q / p.heads_kv);
    const int k0 = key0();
    const int warp = warp_id();
    const size_t bh = (size_t)batch * p.heads_q + head;
    const float scale_log2 = score_scale_log2(p.scale_log2);

    // A fixed-length batch's rows, kept; a packed batch's are found again per query tile.
    const u16* gQ = head_base(p.q, p.q_strides, batch, head);
    const u16* gdO = head_base(p.d_o, p.d_o_strides, batch, head);
    const float* fL = p.lse2 + bh * p.n_q_pad;
    const float* fDelta = p.delta + bh * p.n_q_pad;
    const SeqBlock first = sequence();
    const u16* gK = head_base(p.k, p.k_strides, batch, kv_head) + first.k_start * p.k_strides.row;
    const u16* gV = head_base(p.v, p.v_strides, batch, kv_head) + first.k_start * p.v_strides.row;

    // Query tiles that can see this key tile: with bottom-right alignment query i sees key j when
    // i + shift − left <= j <= i + shift + right (mask.cuh), so under the causal mask the tiles
    // wholly before k0 − shift are skipped, and under a window also those past k_last − shift +
    // left.
    const Band band = band_of<causal, windowed>(p.band);
    const int first_shift = first.n_kv - first.n_q;
    const TileSpan t_span = query_tile_span<BR>(k0, k0 + BC - 1, first.n_q, first_shift, band);
    // The query tiles walked: all of the span, or those the block mask lists as live.
    const KeyWalk walk = key_walk(p.mask, t_span, batch, head, blockIdx.x);

    auto load_query_tile = [&](int t, int stage) {
        const long long q_ld = p.q_strides.row, d_o_ld = p.d_o_strides.row;
        const int n_q = seq_n_q();
        if constexpr (packed) {
            // The sequence's rows; lse2 and D start anywhere, so one float per thread.
            const long long q_start = ps.q_start;
            load_tile<BR, COLS, DK, D, THREADS>(sQ + stage * BR * COLS, gQ + q_start * q_ld, q_ld,
                                                t * BR, n_q);
            load_tile<BR, COLS, DK, D, THREADS>(sdO + stage * BR * COLS, gdO + q_start * d_o_ld,
                                                d_o_ld, t * BR, n_q);
            static_assert(2 * BR <= THREADS, "one thread per float of lse2 and D");
            const int i = threadIdx.x % BR, row = t * BR + i;
            if (threadIdx.x < 2 * BR) {
                const long long rows = (long long)blockIdx.y * p.n_q_pad + q_start;
                const float* src = (threadIdx.x < BR ? p.lse2 : p.delta) + rows;
                float* dst = (threadIdx.x < BR ? sL : sDelta) + stage * BR;
                cp_async_4(dst + i, src + (row < n_q ? row : 0), row < n_q);
            }
        } else {
            load_tile<BR, COLS, DK, D, THREADS>(sQ + stage * BR * COLS, gQ, q_ld, t * BR, n_q);
            load_tile<BR, COLS, DK, D, THREADS>(sdO + stage * BR * COLS, gdO, d_o_ld, t * BR, n_q);
            // BR floats of lse2 and of D: 16-byte chunks from the padded arrays.
            if (threadIdx.x < BR / 4)
                cp_async_16(sL + stage * BR + threadIdx.x * 4, fL + t * BR + threadIdx.x * 4, true);
            else if (threadIdx.x < BR / 2)
                cp_async_16(sDelta + stage * BR + (threadIdx.x - BR / 4) * 4,
                            fDelta + t * BR + (threadIdx.x - BR / 4) * 4, true);
        }
    };

    load_tile<BC, COLS, DK, D, THREADS>(sK, gK, p.k_strides.row, k0, first.n_kv);
    load_tile<BC, COLS, DK, D, THREADS>(sV, gV, p.v_strides.row, k0, first.n_kv);
    if (!walk.empty()) load_query_tile(walk[0].index, 0);
    cp_async_commit();

    float dk[DT][4], dv[DT][4];
    zero(dk);
    zero(dv);

    // The warp's 16 keys are rows warp·16 … of the K/V tile: the A operand of the products whose
    // rows are keys. Q and dO tiles are B operands, as Qᵀ (rows = queries = n) or Q (rows = k).
    const auto kA = a_operand<COLS>(sK, warp * 16);  // Sᵀ = K Qᵀ
    const auto vA = a_operand<COLS>(sV, warp * 16);  // dPᵀ = V dOᵀ
    const auto qB = b_operand<COLS>(sQ);             // Sᵀ = K Qᵀ
    const auto dOB = b_operand<COLS>(sdO);           // dPᵀ = V dOᵀ
    const auto qBt = b_operand_trans<COLS>(sQ);      // dK += dSᵀ Q
    const auto dOBt = b_operand_trans<COLS>(sdO);    // dV += Pᵀ dO

    // First key of the warp; a thread's accumulator rows (keys) are warp_key0() + acc_row(e).
    auto warp_key0 = [&]() { return key0() + warp * 16; };
    // The walk's end, and the stage of position `pos`, (pos − start) mod 2: a packed batch's end
    // read again, its stage toggled (neither kept beside the loop index).
    auto stop = [&]() -> int {
        if constexpr (packed) {
            const int n_q = ps.n_q;
            return query_tile_span<BR>(key0(), key0() + BC - 1, n_q, ps.n_kv - n_q, band).end;
        } else {
            return walk.end();
        }
    };
    int toggled = 0;
    for (int pos = walk.start(); pos < stop(); ++pos, toggled ^= 1) {
        const int stage = packed ? toggled : (pos - walk.start()) & 1;
        const KeyTile tile = walk.at(pos);
        const int t = tile.index;
        // Query tile t is the only copy in flight; after the barrier no warp reads the other
        // stage (tile t − 1) any more, so tile t + 1 is copied there during this tile's work
        // (issued after Pᵀ below, outside the register peak of the Sᵀ product). sdS needs no
        // barrier of its own either: it is written again only after the next iteration's barrier,
        // which every warp reaches after finishing its dQ reads of it.
        cp_async_wait<0>();
        __syncthreads();
        const int i0 = t * BR;
        const int srow = stage * BR;
        const float* tL = sL + stage * BR;
        const float* tDelta = sDelta + stage * BR;

        // ---- Sᵀ = K_j Q_iᵀ and Pᵀ = 2^(scale_log2·Sᵀ − lse2) ------------------------------------
        float pt[NQ][4];
        zero(pt);
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            u32 a[4];
            kA.load(a, kk, 0);
#pragma unroll
            for (int np = 0; np < NQ / 2; ++np)
                mma_k16(pt[2 * np], pt[2 * np + 1], a, qB, kk, srow + np * 16);
        }
        // score_mod(scale · Sᵀ) and its slopes, for dSᵀ below (nothing without a modifier)
        float slope[NQ][4];  // (unused, and so dropped, without a modifier)
        if constexpr (has_score_mod) {
            const ScorePlace place{packed ? (int)ps.seq : batch, head, seq_n_q(), seq_n_kv()};
            const int warp_key = warp_key0();
            modify_scores_with_slopes(
                pt, slope, [&](int nt, int e) { return i0 + acc_col(nt, e); },
                [&](int, int e) { return warp_key + acc_row(e); }, place, p.mods);
        }
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                pt[nt][e] = fast_exp2(fmaf(pt[nt][e], scale_log2, -tL[acc_col(nt, e)]));
        // Only tiles crossing the band's edges or a sequence end need the per-entry test.
        const int k_last = key0() + BC - 1;
        if (i0 + BR > seq_n_q() || k_last >= seq_n_kv() ||
            crosses_band(i0, i0 + BR - 1, key0(), k_last, seq_n_kv() - seq_n_q(), band)) {
            // (read once for the tile: a packed sequence's are volatile reads)
            const int n_q = seq_n_q(), n_kv = seq_n_kv(), warp_key = warp_key0();
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (outside(i0 + acc_col(nt, e), warp_key + acc_row(e), n_q, n_kv, n_kv - n_q,
                                band))
                        pt[nt][e] = 0.f;
        }
        // The mask modifier on a partial tile (Pᵀ: keys on the rows, queries on the columns).
        if (has_mask_mod && tile.partial) {
            const int warp_key = warp_key0();
            mask_entries<4>(pt, 0, [&](int nt, int e) { return i0 + acc_col(nt, e); },
                            [&](int, int e) { return warp_key + acc_row(e); },
                            MaskAt{batch, head, 0, 0, p.n_q, p.n_kv}, p.mask, 0.f);
        }

        if (pos + 1 < stop()) {  // the copy of the next query tile (see the top of the loop)
            load_query_tile(walk.at(pos + 1).index, stage ^ 1);
            cp_async_commit();
        }

        // ---- dV_j += Pᵀ dO_i --------------------------------------------------------------------
#pragma unroll
        for (int ks = 0; ks < BR / 16; ++ks) {
            u32 a[4];
            a_from_acc(a, pt[2 * ks], pt[2 * ks + 1]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp)
                mma_k16(dv[2 * dp], dv[2 * dp + 1], a, dOBt, dp, srow + ks * 16);
        }

        // ---- dPᵀ = V_j dO_iᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − D_i), kept in pt ---------------------------
        {
            float dpt[NQ][4];
            zero(dpt);
#pragma unroll
            for (int kk = 0; kk < DK / 16; ++kk) {
                u32 a[4];
                vA.load(a, kk, 0);
#pragma unroll
                for (int np = 0; np < NQ / 2; ++np)
                    mma_k16(dpt[2 * np], dpt[2 * np + 1], a, dOB, kk, srow + np * 16);
            }
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) pt[nt][e] *= dpt[nt][e] - tDelta[acc_col(nt, e)];
            if constexpr (has_score_mod) chain_slopes(pt, slope);
        }

        // ---- dK_j += dSᵀ Q_i, and (atomic mode) dSᵀ to shared memory for dQ ---------------------
#pragma unroll
        for (int ks = 0; ks < BR / 16; ++ks) {
            u32 a[4];
            a_from_acc(a, pt[2 * ks], pt[2 * ks + 1]);
            if constexpr (!deterministic) store_a<DS_COLS>(sdS, warp * 16, ks * 16, a);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp)
                mma_k16(dk[2 * dp], dk[2 * dp + 1], a, qBt, dp, srow + ks * 16);
        }

        if constexpr (!deterministic) {
            __syncthreads();
            // ---- dQ_i += dS K_j: warp w takes the 16 queries of slab w mod SLABS and a 1/DSPLIT
            // share of the tile's COLS columns, 32 at a time (the partial product stays at 16
            // registers); 16-column halves past DK are padding, skipped. -----------------------------
            constexpr int SLABS = BR / 16, DSPLIT = WARPS / SLABS, DW = COLS / DSPLIT;
            static_assert(SLABS * DSPLIT == WARPS && DW % 32 == 0, "warps tile dQ exactly");
             const auto dSA = a_operand_trans<DS_COLS>(sdS);  // dS, from dSᵀ stored keys × queries
            const auto kBt = b_operand_trans<COLS>(sK);  // K (rows = keys = k)
            const int slab = warp % SLABS, d_begin = (warp / SLABS) * DW;
            const long long dq_rows = packed ? (long long)head * p.varlen.total_q + ps.q_start
                                             : (long long)bh * p.n_q;
            float* gdQ = p.dq_acc + dq_rows * D;
#pragma unroll
            for (int d0 = 0; d0 < DW; d0 += 32) {
                if (d_begin + d0 >= DK) break;  // uniform across the warp
                float dq[4][4];
                zero(dq);
#pragma unroll
                for (int ks = 0; ks < BC / 16; ++ks) {
                    u32 a[4];
                    dSA.load(a, slab, ks * 16);
#pragma unroll
                    for (int dp = 0; dp < 2; ++dp)
                        if (d_begin + d0 + dp * 16 < DK)
                            mma_k16(dq[2 * dp], dq[2 * dp + 1], a, kBt, (d_begin + d0) / 16 + dp,
                                    ks * 16);
                }
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = i0 + slab * 16 + acc_row(2 * h);
                        const int col = d_begin + d0 + acc_col(nt, 0);
                        if (row < seq_n_q() && col < D)
                            red_add2(gdQ + (size_t)row * D + col, dq[nt][2 * h], dq[nt][2 * h + 1]);
                    }
            }
        }
    }
    cp_async_wait<0>();

    // ---- dK_j, dV_j of this query head (unscaled, f32); finish sums the group -------------------
    const long long key_rows = key_rows_offset(packed, p.varlen, sequence(), p.heads_q, head, p.n_kv);
    float* gdK = p.dk_acc + key_rows * D;
    float* gdV = p.dv_acc + key_rows * D;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = warp_key0() + acc_row(2 * h);
        if (key >= seq_n_kv()) continue;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            if (dt * 8 >= D) break;  // padding columns
            const int col = acc_col(dt, 0);
            float* pk = gdK + (size_t)key * D + col;
            float* pv = gdV + (size_t)key * D + col;
            pk[0] = dk[dt][2 * h];
            pk[1] = dk[dt][2 * h + 1];
            pv[0] = dv[dt][2 * h];
            pv[1] = dv[dt][2 * h + 1];
        }
    }
}

#if FA2_DETERMINISTIC
// ---- dQ without atomics (deterministic mode) ----------------------------------------------------
// The forward kernel's structure: each of the WARPS_DQ warps owns MT_DQ·16 query rows of the block
// and keeps their dQ in registers while the block walks the key tiles (K and V double-buffered);
// every dQ element is the sum over key tiles in order j = 0, 1, … of mma products, with no atomics.

#ifndef FA2_DQ_MT
#define FA2_DQ_MT 1
#endif
#ifndef FA2_DQ_WARPS
#define FA2_DQ_WARPS 4
#endif
#ifndef FA2_DQ_BC
#define FA2_DQ_BC 64
#endif

constexpr int MT_DQ = FA2_DQ_MT;
constexpr int WARPS_DQ = FA2_DQ_WARPS;
constexpr int THREADS_DQ = WARPS_DQ * 32;
constexpr int BR_DQ = WARPS_DQ * MT_DQ * 16;
constexpr int BC_DQ = FA2_DQ_BC;
constexpr int NT_DQ = BC_DQ / 8;  // 8-column accumulator tiles across the keys of a tile

// Launch: grid (ceil(n_q / BR_DQ), heads_q, batch), or (varlen.n_tiles, heads_q, 1) with the table
// of query blocks of BR_DQ rows for a packed batch; block (THREADS_DQ = 32·WARPS_DQ, 1, 1),
// dynamic shared memory (2·BR_DQ + 4·BC_DQ)·COLS·2 bytes (Q and dO tiles, then two stages of K
// and two of V). Reads q, k, v, d_o, lse2, delta (prep's padded arrays); writes every element of the
// rows < n_q of dq_acc (plain stores, unscaled). Run after prep, before finish.
extern "C" __global__ void __launch_bounds__(THREADS_DQ, 1)
fa2_backward_dq(const __grid_constant__ BackwardParams p) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;                   // [BR_DQ][COLS]
    u16* sdO = sQ + BR_DQ * COLS;     // [BR_DQ][COLS]
    u16* sK = sdO + BR_DQ * COLS;     // [2][BC_DQ][COLS]
    u16* sV = sK + 2 * BC_DQ * COLS;  // [2][BC_DQ][COLS]

    // The block's query rows (longest causal blocks first); the sequence is looked up again where
    // it is needed rather than kept in registers, as fa2_forward does.
    auto sequence = [&]() { return query_block<packed, causal>(p.varlen, p.n_q, p.n_kv); };
    const SeqBlock w = sequence();
    const int head = blockIdx.y;
    const int q0 = w.block * BR_DQ;
    const int warp = warp_id();
    const long long q_rows = lse_offset(packed, p.varlen, w, p.heads_q, head, p.n_q);  // dQ's
    const long long stats = stat_rows<packed>(p, w, head);                               // lse2, D

    // K and V of this block's kv head; recomputed inside the loop (see block_y) rather than kept.
    auto kv_base = [&](const u16* x, const Strides& s) {
        const long long first = packed ? sequence().k_start * s.row : 0;
        return head_base(x, s, block_z(), block_y() / (p.heads_q / p.heads_kv)) + first;
    };
    auto gK = [&]() { return kv_base(p.k, p.k_strides); };
    auto gV = [&]() { return kv_base(p.v, p.v_strides); };

    const int shift = w.n_kv - w.n_q;  // bottom-right alignment (mask.cuh)
    const Band band = band_of<causal, windowed>(p.band);
    // The key tiles walked: the band's span, or those the block mask lists as live.
    const KeyWalk walk = key_walk(p.mask_dq, key_tile_span<BC_DQ>(q0, q0 + BR_DQ - 1, w.n_kv, shift, band),
                                  w.batch, head, w.block);

    const u16* gQ = head_base(p.q, p.q_strides, w.batch, head) + w.q_start * p.q_strides.row;
    const u16* gdO =
        head_base(p.d_o, p.d_o_strides, w.batch, head) + w.q_start * p.d_o_strides.row;
    load_tile<BR_DQ, COLS, DK, D, THREADS_DQ>(sQ, gQ, p.q_strides.row, q0, w.n_q);
    load_tile<BR_DQ, COLS, DK, D, THREADS_DQ>(sdO, gdO, p.d_o_strides.row, q0, w.n_q);
    if (!walk.empty()) {
        const int n_kv = w.n_kv, first = walk[0].index * BC_DQ;
        load_tile<BC_DQ, COLS, DK, D, THREADS_DQ>(sK, gK(), p.k_strides.row, first, n_kv);
        load_tile<BC_DQ, COLS, DK, D, THREADS_DQ>(sV, gV(), p.v_strides.row, first, n_kv);
    }
    cp_async_commit();

    // First row of the warp's tiles; a thread's accumulator rows are
    // warp_row0 + mt·16 + acc_row(e).
    const int warp_row0 = warp * MT_DQ * 16;
    // lse2 and D of the thread's rows. Rows at or past n_q take 0 (their Q and dO are zero-filled,
    // so everything stays finite) and are never stored.
    float lse2[MT_DQ][2], delta[MT_DQ][2];
#pragma unroll
    for (int mt = 0; mt < MT_DQ; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = q0 + warp_row0 + mt * 16 + acc_row(2 * h);
            const bool in = row < w.n_q;
            lse2[mt][h] = in ? p.lse2[stats + row] : 0.f;
            delta[mt][h] = in ? p.delta[stats + row] : 0.f;
        }

    float dq[MT_DQ][DT][4];
    zero(dq);

    const auto qA = a_operand<COLS>(sQ, warp_row0);    // Q: A of S = Q·Kᵀ
    const auto dOA = a_operand<COLS>(sdO, warp_row0);  // dO: A of dP = dO·Vᵀ
    const auto kB = b_operand<COLS>(sK);               // K: B of S = Q·Kᵀ (rows = keys = n)
    const auto vB = b_operand<COLS>(sV);               // V: B of dP = dO·Vᵀ (rows = keys = n)
    const auto kBt = b_operand_trans<COLS>(sK);        // K: B of dQ += dS·K (rows = keys = k)

    for (int i = 0; i < walk.count(); ++i) {
        const int stage = i & 1;
        const KeyTile tile = walk[i];
        if (i + 1 < walk.count()) {
            const int n_kv = sequence().n_kv, next = walk[i + 1].index * BC_DQ;
            u16* k_stage = sK + (stage ^ 1) * BC_DQ * COLS;
            u16* v_stage = sV + (stage ^ 1) * BC_DQ * COLS;
            load_tile<BC_DQ, COLS, DK, D, THREADS_DQ>(k_stage, gK(), p.k_strides.row, next, n_kv);
            load_tile<BC_DQ, COLS, DK, D, THREADS_DQ>(v_stage, gV(), p.v_strides.row, next, n_kv);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int stage_rows = stage * BC_DQ;
        const int k0 = tile.index * BC_DQ;

        // ---- S = Q·Kᵀ -------------------------------------------------------------------------
        float s[MT_DQ][NT_DQ][4];
        zero(s);
        mma_abt<DK>(s, qA, kB, stage_rows);
        // score_mod(scale · S) and its slopes, for dS below (nothing without a modifier)
        float slope[MT_DQ][NT_DQ][4];  // (unused, and so dropped, without a modifier)
        if constexpr (has_score_mod) {
            const SeqBlock at = sequence();
            const ScorePlace place{at.seq, head, at.n_q, at.n_kv};
#pragma unroll
            for (int mt = 0; mt < MT_DQ; ++mt) {
                const int row0 = q0 + warp_row0 + mt * 16;
                modify_scores_with_slopes(
                    s[mt], slope[mt], [&](int, int e) { return row0 + acc_row(e); },
                    [&](int nt, int e) { return k0 + acc_col(nt, e); }, place, p.mods);
            }
        }

        // ---- P = 2^(S·scale_log2 − lse2), 0 for keys past the end or right of the diagonal ------
        // (set after the exponential: a row that sees no key has lse2 = −inf)
#pragma unroll
        for (int mt = 0; mt < MT_DQ; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_DQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[mt][nt][e] = fast_exp2(
                        fmaf(s[mt][nt][e], score_scale_log2(p.scale_log2), -lse2[mt][e / 2]));
        const int n_kv = sequence().n_kv;
        if (k0 + BC_DQ > n_kv || crosses_band(q0, q0 + BR_DQ - 1, k0, k0 + BC_DQ - 1, shift, band)) {
#pragma unroll
            for (int mt = 0; mt < MT_DQ; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = q0 + warp_row0 + mt * 16 + acc_row(2 * h);
                    mask_band(s[mt], h, key_columns(row, k0, n_kv, shift, band), band, 0.f);
                }
        }
        if constexpr (has_mask_mod) {
            if (tile.partial) {
                const MaskAt at{w.batch, head, 0, 0, w.n_q, n_kv};
#pragma unroll
                for (int mt = 0; mt < MT_DQ; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        mask_hidden(s[mt], h, q0 + warp_row0 + mt * 16 + acc_row(2 * h), k0, at,
                                    p.mask_dq, 0.f);
            }
        }

        // ---- dP = dO·Vᵀ, then dS = P ∘ (dP − D), kept in s --------------------------------------
        {
            float dP[MT_DQ][NT_DQ][4];
            zero(dP);
            mma_abt<DK>(dP, dOA, vB, stage_rows);
#pragma unroll
            for (int mt = 0; mt < MT_DQ; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_DQ; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] *= dP[mt][nt][e] - delta[mt][e / 2];
            if constexpr (has_score_mod)
#pragma unroll
                for (int mt = 0; mt < MT_DQ; ++mt) chain_slopes(s[mt], slope[mt]);
        }

        // ---- dQ += dS·K --------------------------------------------------------------------------
        // dS goes from the accumulator to the A operand in registers, as P in the forward's P·V;
        // K is read through the transposing ldmatrix, as V there.
#pragma unroll
        for (int ks = 0; ks < BC_DQ / 16; ++ks) {
            u32 a[MT_DQ][4];
#pragma unroll
            for (int mt = 0; mt < MT_DQ; ++mt)
                a_from_acc(a[mt], s[mt][2 * ks], s[mt][2 * ks + 1]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                kBt.load(b, dp, stage_rows + ks * 16);
#pragma unroll
                for (int mt = 0; mt < MT_DQ; ++mt)
                    mma_16x16(dq[mt][2 * dp], dq[mt][2 * dp + 1], a[mt], b);
            }
        }
        // The next iteration's copies overwrite the stage read here.
        __syncthreads();
    }
    if (walk.empty()) cp_async_wait<0>();

    // ---- dQ rows to the f32 accumulator (unscaled; finish applies the softmax scale) ------------
    float* gdQ = p.dq_acc + q_rows * D;
#pragma unroll
    for (int mt = 0; mt < MT_DQ; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = q0 + warp_row0 + mt * 16 + acc_row(2 * h);
            if (row >= w.n_q) continue;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                if (dt * 8 >= D) break;  // padding columns
                float* out = gdQ + (size_t)row * D + acc_col(dt, 0);
                out[0] = dq[mt][dt][2 * h];
                out[1] = dq[mt][dt][2 * h + 1];
            }
        }
}
#endif  // FA2_DETERMINISTIC

// ---- finish: dQ = scale·dQ_acc; dK = scale·Σ_group dK_acc; dV = Σ_group dV_acc; to 16 bits ------
// (dQ only where the main kernel wrote dK and dV itself: p.dkv_written.)
// One warp per row of an output (grid-stride over the rows), its lanes two adjacent columns each:
// a row's place in the strided output is worked out once per row, not per element, and the
// contiguous accumulators are read in order.
// Launch: grid (min(ceil(max(dq_rows, dkv_rows) / 8), 16·SM count), 1, 1), block (256, 1, 1), no
// shared memory; dq_rows = batch·heads_q·n_q, dkv_rows = batch·heads_kv·n_kv (grid-stride loops,
// so any grid size is correct).
extern "C" __global__ void fa2_backward_finish(const __grid_constant__ BackwardParams p) {
    const float* __restrict__ dq_acc = p.dq_acc;
    const float* __restrict__ dk_acc = p.dk_acc;
    const float* __restrict__ dv_acc = p.dv_acc;
    const long long dq_rows = (long long)p.batch * p.heads_q * p.n_q;
    const long long dkv_rows = p.dkv_written ? 0 : (long long)p.batch * p.heads_kv * p.n_kv;
    const int group = p.heads_q / p.heads_kv;
    const long long head_len = (long long)p.n_kv * D;  // elements of one query head's dK_acc
    const int lane = lane_id();
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    const long long first = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;

    for (long long r = first; r < dq_rows; r += warps) {
        const long long bh = r / p.n_q;
        const int b = bh / p.heads_q, h = bh % p.heads_q;
        u16* out = head_base(p.dq, p.dq_strides, b, h) + (r % p.n_q) * p.dq_strides.row;
        const float* acc = dq_acc + r * D;
        for (int c = 2 * lane; c < D; c += 64)
            *reinterpret_cast<u32*>(out + c) = pack2(acc[c] * p.scale, acc[c + 1] * p.scale);
    }
    // dK/dV row r is key r % n_kv of kv head bk = r / n_kv, whose query heads are
    // bk·group … bk·group + group − 1 (batch-major, so the flat index works across batches).
    for (long long r = first; r < dkv_rows; r += warps) {
        const long long bk = r / p.n_kv, key = r % p.n_kv;
        const int b = bk / p.heads_kv, h = bk % p.heads_kv;
        u16* out_k = head_base(p.dk, p.dk_strides, b, h) + key * p.dk_strides.row;
        u16* out_v = head_base(p.dv, p.dv_strides, b, h) + key * p.dv_strides.row;
        for (int c = 2 * lane; c < D; c += 64) {
            float sk[2] = {0.f, 0.f}, sv[2] = {0.f, 0.f};
            for (int g = 0; g < group; ++g) {
                const long long src = (bk * group + g) * head_len + key * D + c;
                sk[0] += dk_acc[src], sk[1] += dk_acc[src + 1];
                sv[0] += dv_acc[src], sv[1] += dv_acc[src + 1];
            }
            *reinterpret_cast<u32*>(out_k + c) = pack2(sk[0] * p.scale, sk[1] * p.scale);
            *reinterpret_cast<u32*>(out_v + c) = pack2(sv[0], sv[1]);
        }
    }
}
