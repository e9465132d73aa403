// FlashDecoding++ (Hong et al. 2024): decoding against a KV cache with a unified max φ instead of
// a running one, a flat GEMM for the few query rows, and a GEMV for one. Read it next to the CPU
// rung, crates/reference/src/flash_decoding_pp.rs, and after flash_decoding.cu, whose grid,
// chunks, GQA packing, row blocks and cache (kv_cache.cuh) it shares.
//
// ---- the unified max ----------------------------------------------------------------------------
//
// FlashDecoding's blocks each track a running max: every tile's scores are reduced to a row max
// across the threads of a row, the output is rescaled whenever the max grows, and the combine
// weighs each split by exp(lse_s − lse). FlashDecoding++ fixes the value subtracted before exp in
// advance: φ, given by the caller, the same for every split, tile and thread, so nothing waits for
// a max and nothing is rescaled. In base 2 (t = s·log2(e) − φ·log2(e), s = scale·q·k, so that
// 2^t = e^(s − φ) is one ex2 instruction):
//
//   phase 1, block (s, kv_head, b) of flash_decoding_pp_split, grid (splits · row_blocks,
//   heads_kv, batch), over chunk s of the keys:
//       acc_s = Σ_{j∈s} P_j · v_j,   l_s = Σ_{j∈s} 2^(t_j),   lr_s = Σ_{j∈s} P_j,
//       max_s = max_{j∈s} t_j,       with P_j = 2^(t_j) as it multiplies V (below)
//   phase 2, in the same kernel: the last of a group's split blocks to finish (last_to_finish,
//   decode.cuh, FlashDecoding's rule), one warp per output row:
//       O = Σ_s acc_s / Σ_s lr_s,   lse = φ + ln Σ_s l_s        (plain sums: see below)
//
// Why two sums: the flat GEMM rounds 2^t to 16 bits (P) before it multiplies V, and with no max
// subtracted the largest term is no longer exactly 1. Dividing by the sum of the unrounded terms
// would leave that term's rounding in O (a row that sees a single key would get v·(1 + ε) instead
// of v, ε up to half an ulp of the 16-bit type); dividing by the sum of the P that were actually
// used makes O an exact weighted mean of the rows of V again. lse and the decision below take the
// unrounded sum. (FlashDecoding needs neither: its largest term is 2^0 = 1. The GEMV keeps P in
// f32, so its two sums are one.)
//
// max_s is each thread's own fmax of the exponents it computed: it is never reduced across
// threads inside the loop, and the exponentials never wait for it; it serves only the decision
// below. Where FlashDecoding's combine must first find the largest lse_s and weigh every split by
// it, this one only adds: the unified max is what makes it a plain sum, and a plain sum can be
// taken as the splits come. Two ways (FdppParams::sums):
//
//   in split order (the default): each split writes its partials to a workspace, and the last
//       block reads them all and adds them in split order, so a call gives the same bits every
//       time;
//   atomic (the paper's): each split adds its partials into one sum per row with atomics as it
//       finishes (red.add, in L2), and the last block reads one row of sums instead of one per
//       split, and clears them for the next call. The order of the additions, and so the last
//       bits of O, may change from call to call.
//
// The safe window. 2^t must neither overflow the 16-bit P it is rounded to nor leave every term
// of a row tiny. A row whose largest exponent max_s t leaves [lo, hi] (log2 units; the host's
// default is ±ln(MAX)/2 of the element type, ±5.5 in natural units for fp16 and ±44 for bf16), or
// whose sum came out infinite or zero, falls back: the combine writes 1 into fallback[row] (the
// count forward_with_stats reports) instead of the row, and the same last block recomputes it: it
// walks the whole sequence once more, the row subtracting the largest exponent the combine found
// (an exact softmax, FlashDecoding's arithmetic in one split), in this launch, with no second
// kernel and no host round trip. This is the CPU rung's rule: a row that saw no key (max = −inf)
// is O = 0, lse = −inf, and a row with a NaN score (its sum is NaN) is NaN; neither falls back.
//
// ---- flat GEMM (FDPP_GEMV = 0) ------------------------------------------------------------------
//
// With R = group · n_new rows per kv head, FlashDecoding computes S = Q·Kᵀ with the rows as the
// mma's M: a 16-row tile, most of it padding when R is 1 … 8. Swapping the operands,
//
//   Sᵀ = K_w · Qᵀ      mma M = the warp's 16 keys, N = the rows (8 per tile, NT tiles), K = d
//   Oᵀ += V_wᵀ · Pᵀ    mma M = 16 columns of d,    N = the rows,                    K = the keys
//
// puts the long cache dimension on M and pads the rows only to n = 8: half the tensor-core work of
// an m16 tile at R ≤ 8. Qᵀ is the B operand of every tile, so it is loaded into registers once.
// The accumulator of Sᵀ (keys × rows) is not the layout of Pᵀ as a B operand (rows × keys per
// lane); movmatrix transposes each 8×8 block in registers (transpose_8x8 in mma.cuh). A block
// holds ROWS = 8·NT rows; more rows per kv head go to more blocks (row_blocks), as in
// FlashDecoding.
//
// ---- GEMV (FDPP_GEMV = 1) -----------------------------------------------------------------------
//
// With one row (R = 1: multi-head attention, one new token) even n = 8 is 7/8 padding. The GEMV
// keeps the tensor cores out of it: per tile each warp's 16 keys are dotted with q on the CUDA
// cores, two lanes per key (each half of d, then one shuffle), and P·V is a sum of the 16 rows of
// V weighted by p_j, each lane owning D/32 columns; p stays in f32 (the flat GEMM rounds it to 16
// bits for the tensor cores). One row per block (more rows, if the host is asked for them, go to
// more blocks, each streaming the chunk's K and V from L2).
//
// Both kernels stream K and V exactly as FlashDecoding does: tiles of BC = 64 keys, 16 per warp,
// in a STAGES-deep cp.async pipeline, the warps' states merged through shared memory at the end
// (a plain sum now: no max to reconcile).
//
// Legend:
//   R     rows of the kv head (group · n_new)         RB    rows of this block (≤ ROWS)
//   ROWS  rows per block (8·NT, or 1 for the GEMV)    r0    the block's first row of the R
//   k0    first key of the current tile               kw    tile row of the warp's first key
//   kk    16-wide k-step over d (Sᵀ = K·Qᵀ)           dm    16-wide block of d (Oᵀ = Vᵀ·Pᵀ)
//   nt    8-row tile of the rows                      t     exponent, s·log2(e) − φ·log2(e)
//
// Compile-time constants, set by the host for each variant:
//   FD_D, FD_BC, FD_WARPS, FD_STAGES, FD_PAGED, FD_MAX_BATCH   as in flash_decoding.cu
//   FDPP_GEMV  1: the GEMV (one row per block), 0: the flat GEMM
//   FDPP_NT    flat GEMM: 8-row tiles per block (1: ≤ 8 rows, 2: ≤ 16)

#include "copy.cuh"
#include "decode.cuh"
#include "kv_cache.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "softmax.cuh"
#include "types.cuh"

#ifndef FD_BC
#define FD_BC 64
#endif
#ifndef FD_WARPS
#define FD_WARPS 4
#endif
#ifndef FD_STAGES
#define FD_STAGES 3
#endif
#ifndef FD_PAGED
#define FD_PAGED 0
#endif
#ifndef FDPP_GEMV
#define FDPP_GEMV 0
#endif
#ifndef FDPP_NT
#define FDPP_NT 1
#endif

constexpr int BC = FD_BC;
constexpr int WARPS = FD_WARPS;
constexpr int STAGES = FD_STAGES;
constexpr bool PAGED = FD_PAGED != 0;
constexpr int NT = FDPP_NT;
static_assert(STAGES >= 2, "at least one copy in flight");
static_assert(NT == 1 || NT == 2, "one or two 8-row tiles");
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = FDPP_GEMV ? 1 : 8 * NT;  // rows per block
// Rows of the Q tile in shared memory: the B-operand load of Qᵀ reads 16 rows (ldmatrix.x4), the
// rows past the block's own are zeros.
constexpr int Q_ROWS = 16;
constexpr int GROUPS = BC / KEY_GROUP;  // groups of 16 keys per tile (kv_cache.cuh)
// f32 row stride of the warp-merge buffer: 4 floats of padding put the 4 rows × 8 columns a flat
// GEMM store touches into 32 different banks.
constexpr int RED_STRIDE = COLS + 4;
static_assert(BC == 16 * WARPS, "each warp owns 16 keys of a tile");
// The GEMV and the combine give each lane PER_LANE columns of a shared row (the last lanes'
// past D are zeros of the copy, and never stored).
constexpr int PER_LANE = COLS / 32;

// The splits' partials added as they come (see "the unified max" above), one of each per output
// row; t_max as an ordered key (max_key), so that an unsigned atomic max takes the largest float.
struct AtomicSums {
    float* acc;        // [output rows, D]  Σ_s acc_s
    float* l;          // [output rows]     Σ_s l_s
    float* lr;         // [output rows]     Σ_s lr_s
    unsigned* t_max;   // [output rows]     max_s max_s, as max_key (0, the cleared value: none)
};

// A float's key in an unsigned order that is the floats' order (negative floats below positive
// ones, each the more negative the smaller); 0 lies below every non-NaN float's key.
__device__ __forceinline__ unsigned max_key(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_max_key(unsigned k) {
    if (k == 0) return LADDER_NEG_INF;
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Four consecutive floats added into global memory by one vector reduction in L2 (sm_90; four
// scalar ones before). dst is 16-byte aligned.
__device__ __forceinline__ void red_add4(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y),
                 "f"(v.z), "f"(v.w)
                 : "memory");
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
}

// The call (decode.cuh), and these kernels' own: workspaces, f32, acc_part [output rows, splits,
// D] (unnormalised), l_part, lr_part and max_part [output rows, splits]; fallback [output rows];
// the rows numbered as HeadRows::flat numbers them. Both kernels take the same struct.
struct FdppParams {
    DecodeCall call;
    float* acc_part;  // Σ 2^t · v per (row, split)
    float* l_part;    // Σ 2^t per (row, split): lse and the decision
    float* lr_part;   // Σ 2^t as rounded for P·V per (row, split): O's denominator
    float* max_part;  // the largest t per (row, split), −inf if none
    int* fallback;    // 1 where the row fell back (recomputed in this launch), else 0; every row
    // One per (sequence, kv head, row block) of the launch, zero before it and left zero after:
    // the splits of a group count themselves in here (last_to_finish, decode.cuh).
    unsigned* counters;
    // The atomic sums, over the splits, per output row: zero before the launch and left zero
    // after (the combine clears what it reads); null to sum in split order.
    AtomicSums sums;
    float phi;        // φ, natural log (the units of lse)
    float phi_log2;   // φ · log2(e)
    float lo_log2;    // the safe window of max t, log2 units
    float hi_log2;
};
#ifdef FD_HOST_PARAMS_BYTES
static_assert(sizeof(FdppParams) == FD_HOST_PARAMS_BYTES, "the host's mirror of FdppParams");
#endif

// Two 16-bit values of a register (low half first) as floats.
__device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
    lo = to_f32((u16)(x & 0xffff));
    hi = to_f32((u16)(x >> 16));
}

// N = 2, 4 or 8 consecutive 16-bit values (the address aligned to 2·N bytes: one 16-byte chunk
// of a swizzled tile at most, since the next chunk of a row lies elsewhere) as floats, in one load.
template <int N>
__device__ __forceinline__ void unpack(float (&x)[N], const u16* src) {
    static_assert(N == 2 || N == 4 || N == 8, "one, two or four registers");
    if constexpr (N == 8) {
        const uint4 y = *reinterpret_cast<const uint4*>(src);
        unpack2(y.x, x[0], x[1]);
        unpack2(y.y, x[2], x[3]);
        unpack2(y.z, x[4], x[5]);
        unpack2(y.w, x[6], x[7]);
    } else if constexpr (N == 4) {
        const uint2 y = *reinterpret_cast<const uint2*>(src);
        unpack2(y.x, x[0], x[1]);
        unpack2(y.y, x[2], x[3]);
    } else {
        unpack2(*reinterpret_cast<const u32*>(src), x[0], x[1]);
    }
}

// N consecutive columns col … col + N − 1 of row `row` of a swizzled tile (COLS columns) as
// floats: one load when N divides a 16-byte chunk (col is then a multiple of N, and the run lies
// in one chunk), else N / 2 pairs, each in its chunk.
template <int N>
__device__ __forceinline__ void unpack_row(float (&x)[N], const u16* tile, int row, int col) {
    if constexpr (8 % N == 0) {
        unpack<N>(x, tile + swz<COLS>(row, col));
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 2)
            unpack2(*reinterpret_cast<const u32*>(tile + swz<COLS>(row, col + i)), x[i], x[i + 1]);
    }
}

// The f32 buffer that merges the warps' states at the end of a split block (it reuses the tiles'
// shared memory): per warp and row, the unnormalised output, the two sums and the largest exponent.
struct Merge {
    float* acc;    // [WARPS][ROWS][RED_STRIDE]
    float* l;      // [WARPS][ROWS]
    float* lr;     // [WARPS][ROWS]
    float* t_max;  // [WARPS][ROWS]
};

// ---- the flat GEMM warp -------------------------------------------------------------------------
//
// A warp's state and its work on one tile. The warp holds all ROWS rows of the block; its lane
// holds, in each 8-row tile nt, rows acc_col(nt, 0) and acc_col(nt, 1) = 8·nt + 2·(lane%4) + {0,1}
// (the columns of the transposed accumulators), and of its 16 keys per tile keys acc_row(0) and
// acc_row(2) = lane/4 and lane/4 + 8.
struct FlatGemm {
    Operand<COLS, false> kA;  // K: A of Sᵀ = K·Qᵀ (tile rows = keys = m, columns = d = k)
    Operand<COLS, true> vA;   // V: A of Oᵀ = Vᵀ·Pᵀ (tile rows = keys = k, columns = d = m)
    u32 q[DK / 16][NT][2];    // Qᵀ: B of Sᵀ = K·Qᵀ for every k-step, loaded once
    float o[DK / 16][NT][4];  // Oᵀ, unnormalised: d 16·dm + acc_row(e), row acc_col(nt, e)
    float l[NT][2];          // this thread's part of each row's Σ 2^t
    float lr[NT][2];         // the same sum of the 16-bit P that multiplies V
    float t_max[NT][2];      // the largest exponent this thread computed for each row
    float ref[NT][2];        // what each row subtracts before exp2: φ·log2(e), or its own max
    int limit[NT][2];        // one past the last key each of the thread's rows sees

    __device__ __forceinline__ FlatGemm(const u16* sQ, const u16* sK, const u16* sV, int r0,
                                        int n_new, int len, int k_end, float phi_log2)
        : kA(a_operand<COLS>(sK, 0)), vA(a_operand_trans<COLS>(sV)) {
        // Qᵀ as B (k = d, n = rows): Q's tile rows are B's n, so the B load of K in FlashDecoding
        // (b_operand) reads it; registers 0, 1 are rows 0-7, registers 2, 3 rows 8-15.
        const auto qB = b_operand<COLS>(sQ);
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            u32 b[4];
            qB.load(b, kk, 0);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                q[kk][nt][0] = b[2 * nt];
                q[kk][nt][1] = b[2 * nt + 1];
            }
        }
        restart(r0, n_new, len, k_end, phi_log2, nullptr);
    }

    // A fresh walk over keys up to k_end, each row subtracting φ·log2(e) plus its `shift` (block
    // row r: shift[r]; none: 0).
    __device__ __forceinline__ void restart(int r0, int n_new, int len, int k_end, float phi_log2,
                                            const float* shift) {
        zero(o);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                l[nt][i] = lr[nt][i] = 0.f;
                t_max[nt][i] = LADDER_NEG_INF;
                ref[nt][i] = phi_log2 + (shift ? shift[acc_col(nt, i)] : 0.f);
                // Token t of the row sees keys j ≤ len − n_new + t (bottom-right causal).
                const int token = (r0 + acc_col(nt, i)) % n_new;
                limit[nt][i] = min(len - n_new + token + 1, k_end);
            }
    }

    // One tile: the warp's 16 keys are tile rows kw … kw + 15, keys key0 … key0 + 15; `masked`
    // when some of them lie past a row's limit.
    __device__ __forceinline__ void step(int kw, int key0, bool masked, float scale_log2) {
        // ---- Sᵀ = K_w·Qᵀ: 16 keys × 8·NT rows ---------------------------------------------------
        float st[NT][4];
        zero(st);
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            u32 a[4];
            kA.load(a, kk, kw);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_16816(st[nt], a, q[kk][nt][0], q[kk][nt][1]);
        }

        // ---- P = 2^t with the unified max: no row max, no rescaling -----------------------------
        // Masking sets t (not s) to −inf, so that a negative scale cannot turn it into +inf.
        u32 pb[NT][2];  // Pᵀ as B of Oᵀ += Vᵀ·Pᵀ: k = keys (8i … 8i + 7 in register i), n = rows
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float t = fmaf(st[nt][e], scale_log2, -ref[nt][e % 2]);
                if (masked && key0 + acc_row(e) >= limit[nt][e % 2]) t = LADDER_NEG_INF;
                t_max[nt][e % 2] = fmaxf(t_max[nt][e % 2], t);
                p[e] = fast_exp2(t);
                l[nt][e % 2] += p[e];
            }
            // p[0], p[1] are key lane/4, rows 2·(lane%4) + {0, 1}: row half 0 of Sᵀ's tile, keys
            // 0-7; p[2], p[3] the same rows for keys 8-15. Rounded to 16 bits and transposed, they
            // are the two registers of B; lr sums them as rounded.
            const u32 keys_lo = pack2(p[0], p[1]), keys_hi = pack2(p[2], p[3]);
            float r[4];
            unpack2(keys_lo, r[0], r[1]);
            unpack2(keys_hi, r[2], r[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) lr[nt][e % 2] += r[e];
            pb[nt][0] = transpose_8x8(keys_lo);
            pb[nt][1] = transpose_8x8(keys_hi);
        }

        // ---- Oᵀ += V_wᵀ·Pᵀ: one 16-key k-step per 16 columns of d -------------------------------
#pragma unroll
        for (int dm = 0; dm < DK / 16; ++dm) {
            u32 a[4];
            vA.load(a, dm, kw);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_16816(o[dm][nt], a, pb[nt][0], pb[nt][1]);
        }
    }

    // The warp's state into the merge buffer.
    __device__ __forceinline__ void store(const Merge& m, int warp) const {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                // The eight lanes holding a row's other keys share its column: lane % 4.
                const float sum = column_sum(l[nt][i]);
                const float sum_rounded = column_sum(lr[nt][i]);
                const float mx = column_max(t_max[nt][i]);
                if (lane_id() < 4) {
                    const int r = warp * ROWS + acc_col(nt, i);
                    m.l[r] = sum;
                    m.lr[r] = sum_rounded;
                    m.t_max[r] = mx;
                }
            }
#pragma unroll
        for (int dm = 0; dm < DK / 16; ++dm)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    m.acc[(warp * ROWS + acc_col(nt, e)) * RED_STRIDE + dm * 16 + acc_row(e)] =
                        o[dm][nt][e];
    }
};

// ---- the GEMV warp ------------------------------------------------------------------------------
//
// One row. Lane = key j (lane % 16) of the warp's 16 and half h (lane / 16) of the shared row for
// Q·Kᵀ (the padding past D is zeros in Q and K alike); lane = columns lane·PER_LANE … +PER_LANE of
// O for P·V.
struct Gemv {
    const u16* sK;
    const u16* sV;
    float q[COLS / 2];     // the row's columns h·COLS/2 … +COLS/2, f32
    float o[PER_LANE];     // the output's columns lane·PER_LANE … +PER_LANE, unnormalised
    float l;          // Σ 2^t over this lane's keys (lanes < 16; lanes ≥ 16 hold the same keys)
    float t_max;      // the largest exponent this lane computed
    float ref;        // what the row subtracts before exp2: φ·log2(e), or its own max
    int limit;        // one past the last key the row sees

    __device__ __forceinline__ Gemv(const u16* sQ, const u16* sK, const u16* sV, int r0, int n_new,
                                    int len, int k_end, float phi_log2)
        : sK(sK), sV(sV) {
        const int h = lane_id() / 16;
#pragma unroll
        for (int c = 0; c < COLS / 16; ++c) {
            const uint4 x =
                *reinterpret_cast<const uint4*>(sQ + swz<COLS>(0, (h * COLS / 16 + c) * 8));
            unpack2(x.x, q[8 * c], q[8 * c + 1]);
            unpack2(x.y, q[8 * c + 2], q[8 * c + 3]);
            unpack2(x.z, q[8 * c + 4], q[8 * c + 5]);
            unpack2(x.w, q[8 * c + 6], q[8 * c + 7]);
        }
        restart(r0, n_new, len, k_end, phi_log2, nullptr);
    }

    // A fresh walk over keys up to k_end, the row subtracting φ·log2(e) plus `shift[0]` (none: 0).
    __device__ __forceinline__ void restart(int r0, int n_new, int len, int k_end, float phi_log2,
                                            const float* shift) {
        zero(o);
        l = 0.f;
        t_max = LADDER_NEG_INF;
        ref = phi_log2 + (shift ? shift[0] : 0.f);
        limit = min(len - n_new + r0 % n_new + 1, k_end);
    }

    __device__ __forceinline__ void step(int kw, int key0, bool masked, float scale_log2) {
        const int lane = lane_id(), j = lane % 16, h = lane / 16;
        // ---- s_j = q·k_j: each lane half of d (8 columns per 16-byte load), then one shuffle ----
        // Two partial sums (even and odd columns) halve the chain of dependent FMAs.
        float s_even = 0.f, s_odd = 0.f;
#pragma unroll
        for (int c = 0; c < COLS / 16; ++c) {
            const uint4 x =
                *reinterpret_cast<const uint4*>(sK + swz<COLS>(kw + j, (h * COLS / 16 + c) * 8));
            const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float k0, k1;
                unpack2(w[i], k0, k1);
                s_even = fmaf(q[8 * c + 2 * i], k0, s_even);
                s_odd = fmaf(q[8 * c + 2 * i + 1], k1, s_odd);
            }
        }
        float s = s_even + s_odd;
        s += __shfl_xor_sync(0xffffffff, s, 16);

        // ---- p_j = 2^t with the unified max, kept in f32 (no tensor core needs it in 16 bits) ---
        float t = fmaf(s, scale_log2, -ref);
        if (masked && key0 + j >= limit) t = LADDER_NEG_INF;
        t_max = fmaxf(t_max, t);
        const float p = fast_exp2(t);
        l += h == 0 ? p : 0.f;  // each key once

        // ---- o += Σ_j p_j · v_j: p_j from lane j, row j of V at this lane's columns -------------
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
            const float pj = __shfl_sync(0xffffffff, p, jj);
            float x[PER_LANE];
            unpack_row<PER_LANE>(x, sV, kw + jj, lane * PER_LANE);
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) o[i] = fmaf(pj, x[i], o[i]);
        }
    }

    // The warp's state into the merge buffer (one row: index warp). P·V used the f32 p, so the
    // sum as rounded is the sum.
    __device__ __forceinline__ void store(const Merge& m, int warp) const {
        const float sum = warp_sum(l);
        const float mx = warp_max(t_max);
        if (lane_id() == 0) {
            m.l[warp] = m.lr[warp] = sum;
            m.t_max[warp] = mx;
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            m.acc[warp * RED_STRIDE + lane_id() * PER_LANE + i] = o[i];
    }
};

#if FDPP_GEMV
typedef Gemv WarpState;
#else
typedef FlatGemm WarpState;
#endif

// A lane's PER_LANE columns of an f32 row of D (col = lane · PER_LANE), read from L2 (other blocks
// of this launch wrote them); columns past D read as 0.
__device__ __forceinline__ void load_lane_columns(float (&x)[PER_LANE], const float* src) {
    if constexpr (D == COLS && (PER_LANE == 2 || PER_LANE % 4 == 0)) {
        load_f32<PER_LANE, true>(x, src);
    } else {
        // Pairs of columns, both below D or both past it (D and the lane's first column are even).
        const int col = lane_id() * PER_LANE;
#pragma unroll
        for (int i = 0; i < PER_LANE; i += 2) {
            const float2 y = col + i < D ? __ldcg(reinterpret_cast<const float2*>(src + i))
                                         : make_float2(0.f, 0.f);
            x[i] = y.x, x[i + 1] = y.y;
        }
    }
}

// Zeros into the lane's columns (those below D) of an f32 row: the atomic sums, cleared.
__device__ __forceinline__ void clear_lane_columns(float* dst) {
    const int col = lane_id() * PER_LANE;
#pragma unroll
    for (int i = 0; i < PER_LANE; i += 2)
        if (D == COLS || col + i < D) __stcg(reinterpret_cast<float2*>(dst + i), make_float2(0.f, 0.f));
}

// ---- phase 2: one output row, by one warp -------------------------------------------------------
//
// Output row `row` (HeadRows::flat) from every split's partials, which other blocks of this launch
// wrote (so read from L2, ld.cg); lane i holds columns [i·PER_LANE, (i+1)·PER_LANE) (those below
// D). Called by every lane of the warp; returns (to all of them) whether the row falls back,
// leaving it unwritten, its largest exponent in *t_row.
__device__ __forceinline__ bool combine_row(const FdppParams& p, size_t row, float* t_row) {
    const DecodeCall& call = p.call;
    const int lane = lane_id();
    const int splits = call.splits;
    const bool atomic = p.sums.acc != nullptr;
    const int col = lane * PER_LANE;

    float l = 0.f, lr = 0.f, t_max = LADDER_NEG_INF;
    float o[PER_LANE];
    zero(o);
    if (atomic) {
        // One row of sums, read and cleared for the next call (every lane reads the row's three
        // scalars; lane 0 clears them once all have).
        float* acc = p.sums.acc + (size_t)row * D + col;
        load_lane_columns(o, acc);
        clear_lane_columns(acc);
        l = __ldcg(p.sums.l + row);
        lr = __ldcg(p.sums.lr + row);
        t_max = from_max_key(__ldcg(p.sums.t_max + row));
        __syncwarp();
        if (lane == 0) {
            __stcg(p.sums.l + row, 0.f);
            __stcg(p.sums.lr + row, 0.f);
            __stcg(p.sums.t_max + row, 0u);
        }
    } else {
        const float* l_s = p.l_part + (size_t)row * splits;
        const float* lr_s = p.lr_part + (size_t)row * splits;
        const float* max_s = p.max_part + (size_t)row * splits;
        for (int s = lane; s < splits; s += 32) {
            l += __ldcg(l_s + s);
            lr += __ldcg(lr_s + s);
            t_max = fmaxf(t_max, __ldcg(max_s + s));
        }
        l = warp_sum(l);
        lr = warp_sum(lr);
        t_max = warp_max(t_max);
    }

    // The decision, the CPU rung's: keep the row if its largest exponent is inside the window and
    // its sum is a positive number; a row without a finite score (max −inf: O = 0, lse = −inf) or
    // with a NaN (l NaN: the row is NaN) is kept too. Everything else falls back. (The
    // rounded sum is positive whenever the largest term is inside the default windows; a window
    // reaching below the 16-bit type's subnormals could round every term to 0: then the row falls
    // back too.)
    // (NaN is tested on the bits: under --use_fast_math a compiler may fold l != l to false.)
    const float inf = __int_as_float(0x7f800000);
    const bool is_nan = (__float_as_uint(l) & 0x7fffffff) > 0x7f800000;
    const bool inside = t_max >= p.lo_log2 && t_max <= p.hi_log2 && l > 0.f && l < inf &&
                        lr > 0.f && lr < inf;
    const bool keep = inside || is_nan || t_max == LADDER_NEG_INF;
    if (lane == 0) {
        p.fallback[row] = keep ? 0 : 1;
        *t_row = t_max;
    }
    if (!keep) return true;  // the whole warp: the block walks the row again (below)

    if (!atomic) {
        // BATCH splits' loads in flight at a time (COMBINE_BATCH, decode.cuh, where 64 floats a
        // lane leave the registers to spare), added in split order.
        constexpr int BATCH = PER_LANE <= 4 ? COMBINE_BATCH : COMBINE_BATCH * 4 / PER_LANE;
        const float* acc_s = p.acc_part + (size_t)row * splits * D + col;
        for (int s0 = 0; s0 < splits; s0 += BATCH) {
            float x[BATCH][PER_LANE];
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                if (s0 + b < splits) load_lane_columns(x[b], acc_s + (size_t)(s0 + b) * D);
                else zero(x[b]);
            }
#pragma unroll
            for (int b = 0; b < BATCH; ++b)
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) o[i] += x[b][i];
        }
    }
    // O's denominator is the sum of P as it multiplied V. lr = 0 only for a row without keys
    // (O = 0); a NaN makes O NaN.
    const float inv = lr > 0.f ? 1.f / lr : (lr == 0.f ? 0.f : lr);
    const OutputRow out(call, call.o_strides, row);
    u16* dst = call.o + out.at + col;
#pragma unroll
    for (int i = 0; i < PER_LANE; i += 2)
        if (D == COLS || col + i < D)
            *reinterpret_cast<u32*>(dst + i) = pack2(o[i] * inv, o[i + 1] * inv);
    if (lane == 0) call.lse[out.lse] = l == 0.f ? LADDER_NEG_INF : p.phi + logf(l);
    return false;
}

// ---- the walk: one pass of a block's warps over a range of keys ---------------------------------
//
// The K/V pipeline of flash_decoding_split (kv_cache.cuh): STAGES − 1 tiles in flight while one is
// read (KvPipeline::prime starts them; group g of its commits holds tile g).
//
// Every tile of the walk: find where tile j + STAGES − 1 lies, wait for tile j, one barrier (every
// warp is done with tile j − 1, whose stage the next copy reuses). Tiles reaching past `min_limit`
// (token 0's limit, the smallest) need the causal mask. Ends with every copy landed and a barrier.
template <class Pipeline>
__device__ __forceinline__ void walk(Pipeline& kv, WarpState& w, int min_limit, float scale_log2) {
    const int warp = warp_id();
    for (int j = 0; j < kv.n_tiles; ++j) {
        long long next[GROUPS];
        kv.starts(j + STAGES - 1, next);
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        kv.load(j + STAGES - 1, next);
        const int k0 = kv.k_begin + j * BC;
        w.step((j % STAGES) * BC + warp * 16, k0 + warp * 16, k0 + BC > min_limit, scale_log2);
    }
    cp_async_wait<0>();
    __syncthreads();
}

// Row r's sums over the warps of the merge buffer.
__device__ __forceinline__ void merged_sums(const Merge& m, int r, float& l, float& lr,
                                            float& t_max) {
    l = lr = 0.f;
    t_max = LADDER_NEG_INF;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) {
        l += m.l[v * ROWS + r];
        lr += m.lr[v * ROWS + r];
        t_max = fmaxf(t_max, m.t_max[v * ROWS + r]);
    }
}

// Columns c … c + 3 of row r summed over the warps of the merge buffer.
__device__ __forceinline__ float4 merged_columns(const Merge& m, int r, int c) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int v = 0; v < WARPS; ++v) {
        const float4 x = *reinterpret_cast<const float4*>(m.acc + (v * ROWS + r) * RED_STRIDE + c);
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
    }
    return acc;
}

// Launch: grid (splits · row_blocks, heads_kv, batch), block (THREADS, 1, 1), dynamic shared
// memory max((Q_ROWS + 2·STAGES·BC)·COLS·2, WARPS·ROWS·(RED_STRIDE + 3)·4) bytes: the Q tile and
// STAGES stages of K and V during the walk, then the same memory as the f32 merge buffer.
// Launched programmatically (pdl.cuh), as flash_decoding_split.
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_decoding_pp_split(const __grid_constant__ FdppParams p) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;                     // [Q_ROWS][COLS]
    u16* sK = sQ + Q_ROWS * COLS;       // [STAGES][BC][COLS]
    u16* sV = sK + STAGES * BC * COLS;  // [STAGES][BC][COLS]
    // The last block's fallback rows: which, and each one's largest exponent (its new reference).
    __shared__ int falls[ROWS];
    __shared__ float t_row[ROWS];

    const DecodeCall& call = p.call;
    const int split = blockIdx.x / call.row_blocks, row_block = blockIdx.x % call.row_blocks;
    const int kv_head = blockIdx.y, batch = blockIdx.z;
    const int warp = warp_id();
    const HeadRows rows(call, batch, kv_head);  // GQA packing (decode.cuh)
    const int n_new = rows.n_new;
    const int R = rows.count();
    const int r0 = row_block * ROWS;
    const int RB = min(ROWS, R - r0);
    if (RB <= 0) return;  // packed new tokens: a row block past this sequence's rows
    const int len = call.lengths[batch];
    const CacheRows<PAGED> cache(call, batch, kv_head);
    const KeyChunk keys = key_chunk<BC>(len, call.splits, split);  // as FlashDecoding's splits

    // Nothing above touches memory: the blocks may start during the previous call's tail, and
    // wait here for it (the workspaces and counters are the same from call to call).
    wait_for_prior_grids();
    allow_next_grid();

    KvPipeline<BC, THREADS, STAGES, PAGED> kv(cache, call, sK, sV, keys);
    // Q in a commit group of its own, first: the warps copy it into registers before the walk,
    // while the first K/V tiles are still in flight.
    load_head_rows<Q_ROWS, THREADS>(sQ, call.q, call.q_strides, rows, r0, RB);
    cp_async_commit();
    kv.prime();
    cp_async_wait<STAGES - 1>();  // Q has landed (the STAGES − 1 younger K/V groups may not)
    __syncthreads();
    WarpState w(sQ, sK, sV, r0, n_new, len, keys.end, p.phi_log2);
    walk(kv, w, min(len - n_new + 1, keys.end), call.scale_log2);
    // Paged: whether any thread of the block met a page outside the cache.
    const bool bad_page = PAGED && __syncthreads_or(kv.bad);

    // ---- merge the warps: a plain sum (every warp subtracted the same φ) ------------------------
    Merge m;
    m.acc = reinterpret_cast<float*>(smem);
    m.l = m.acc + WARPS * ROWS * RED_STRIDE;
    m.lr = m.l + WARPS * ROWS;
    m.t_max = m.lr + WARPS * ROWS;
    w.store(m, warp);
    __syncthreads();

    // Each thread takes 4 consecutive columns of a row at a time; rows past RB are padding.
    for (int i = threadIdx.x; i < RB * (D / 4); i += THREADS) {
        const int r = i / (D / 4);
        const int c = (i % (D / 4)) * 4;
        float l, lr, t_max;
        merged_sums(m, r, l, lr, t_max);
        float4 acc = merged_columns(m, r, c);
        // A page outside the cache: NaN sums, which make the row NaN in the combine (a NaN row
        // does not fall back), whatever the other splits hold.
        if (bad_page) {
            const float nan = __int_as_float(0x7fc00000);
            acc = make_float4(nan, nan, nan, nan);
            l = lr = nan;
        }
        const size_t row = rows.flat(r0 + r);
        if (p.sums.acc) {
            red_add4(p.sums.acc + row * D + c, acc);
            if (c == 0) {
                atomicAdd(p.sums.l + row, l);
                atomicAdd(p.sums.lr + row, lr);
                atomicMax(p.sums.t_max + row, max_key(t_max));
            }
        } else {
            const size_t out = row * call.splits + split;
            *reinterpret_cast<float4*>(p.acc_part + out * D + c) = acc;
            if (c == 0) {
                p.l_part[out] = l;
                p.lr_part[out] = lr;
                p.max_part[out] = t_max;
            }
        }
    }

    // ---- phase 2: the last block of the group adds the splits up, a warp per row ----------------
    if (!last_to_finish(p.counters, call, row_block)) return;
    bool fell = false;
    for (int r = warp; r < ROWS; r += WARPS) {
        const bool f = r < RB && combine_row(p, rows.flat(r0 + r), &t_row[r]);
        if (lane_id() == 0) {
            falls[r] = f;
            if (!f) t_row[r] = 0.f;  // rows kept: the walk below subtracts φ (and writes nothing)
        }
        fell |= f;
    }
    if (!__syncthreads_or(fell)) return;

    // ---- the fallback, in this launch: the rows whose largest exponent left the window ---------
    //
    // Their partials are unusable (2^t overflowed the 16-bit P, or every term of the row was
    // tiny), but the combine found each row's largest exponent over all the splits. This block
    // walks the whole sequence once more, each fallback row subtracting exactly that maximum (an
    // exact softmax: the largest term is 2^0 = 1, as FlashDecoding's), and writes those rows.
    // Rare by the choice of φ (decode::calibrate_phi); when φ misses every row, a call costs about
    // what a FlashDecoding call with one split would.
    const KeyChunk all = key_chunk<BC>(len, 1, 0);
    KvPipeline<BC, THREADS, STAGES, PAGED> kv_all(cache, call, sK, sV, all);
    kv_all.prime();
    w.restart(r0, n_new, len, all.end, p.phi_log2, t_row);
    walk(kv_all, w, min(len - n_new + 1, all.end), call.scale_log2);
    const bool bad_page_all = PAGED && __syncthreads_or(kv_all.bad);
    w.store(m, warp);
    __syncthreads();
    for (int i = threadIdx.x; i < RB * (D / 4); i += THREADS) {
        const int r = i / (D / 4);
        const int c = (i % (D / 4)) * 4;
        if (!falls[r]) continue;
        float l, lr, t_max;
        merged_sums(m, r, l, lr, t_max);
        const float4 acc = merged_columns(m, r, c);
        // O's denominator: the sum of P as it multiplied V (see "Why two sums"); positive, as
        // the row's largest term is 1.
        const float nan = __int_as_float(0x7fc00000);
        const float inv = bad_page_all ? nan : 1.f / lr;
        const size_t row = rows.flat(r0 + r);
        const OutputRow out(call, call.o_strides, row);
        u16* dst = call.o + out.at + c;
        *reinterpret_cast<u32*>(dst) = pack2(acc.x * inv, acc.y * inv);
        *reinterpret_cast<u32*>(dst + 2) = pack2(acc.z * inv, acc.w * inv);
        if (c == 0)
            call.lse[out.lse] = bad_page_all ? nan : p.phi + t_row[r] * LADDER_LN2 + logf(l);
    }
}
