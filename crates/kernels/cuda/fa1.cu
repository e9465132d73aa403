// FlashAttention-1 forward, as Algorithm 1 of Dao et al. 2022 writes it. Clarity first: this
// kernel exists to be read next to the paper and measured against FA2.
//
//   for each K/V tile j (outer loop, sequential):          Algorithm 1, line 5
//       load K_j, V_j into shared memory                    line 6
//       for each Q tile i (inner loop):                     line 7
//           load Q_i, O_i, l_i, m_i from global memory      line 8
//           S = scale · Q_i K_jᵀ, masked                    line 9
//           m̃ = rowmax(S), P̃ = exp(S − m̃), l̃ = rowsum(P̃)  line 10
//           m_new = max(m_i, m̃), l_new = e^(m_i−m_new) l_i + e^(m̃−m_new) l̃    line 11
//           O_i = (l_i e^(m_i−m_new) O_i + e^(m̃−m_new) P̃ V_j) / l_new, to global  line 12
//           l_i = l_new, m_i = m_new, to global             line 13
//
// O, l and m make a round trip through global memory at every (i, j) step: that traffic, and the
// sequential outer loop (one thread block per batch·head, so few blocks), are what FA2 removes.
// Within one j the Q tiles are independent, so the block's warps take them in parallel; each lane
// owns one query row and computes in plain f32 (no tensor cores).
//
// Compile-time constants: FA1_D head dimension, FA1_BC keys per K/V tile, FA1_WARPS warps
// (each takes Q tiles of 32 rows), LADDER_DTYPE element type of Q, K, V, O.

#include "types.cuh"

#ifndef FA1_D
#define FA1_D 64
#endif
#ifndef FA1_BC
#define FA1_BC 32
#endif
#ifndef FA1_WARPS
#define FA1_WARPS 8
#endif

constexpr int D = FA1_D;
constexpr int BC = FA1_BC;
constexpr int WARPS = FA1_WARPS;
constexpr int BR = 32;  // rows per Q tile: one per lane

// Q, K, V, O are [batch, heads, n, D] (heads_q for Q and O, heads_kv for K and V); lse, l_acc,
// m_acc are [batch, heads_q, n_q]; o_acc is like O in f32.
struct Fa1Params {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* lse;
    float* o_acc;  // Algorithm 1's "HBM" O, l, m
    float* l_acc;
    float* m_acc;
    int heads_q;
    int heads_kv;
    int n_q;
    int n_kv;
    float scale;
    int causal;
};

// Launch: grid (1, heads_q, batch), block (32·WARPS, 1, 1), no dynamic shared memory (the K/V
// tiles are static: 2·BC·D·4 bytes).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
fa1_forward(const __grid_constant__ Fa1Params p) {
    // The parameters under the names the algorithm below uses (restrict: no two alias).
    const elem_t* __restrict__ q = p.q;
    const elem_t* __restrict__ k = p.k;
    const elem_t* __restrict__ v = p.v;
    elem_t* __restrict__ o = p.o;
    float* __restrict__ lse = p.lse;
    float* __restrict__ o_acc = p.o_acc;
    float* __restrict__ l_acc = p.l_acc;
    float* __restrict__ m_acc = p.m_acc;
    const int heads_q = p.heads_q, heads_kv = p.heads_kv, n_q = p.n_q, n_kv = p.n_kv;
    const float scale = p.scale;
    const int causal = p.causal;

    __shared__ float sK[BC][D];
    __shared__ float sV[BC][D];

    const int head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / (heads_q / heads_kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t bh = (size_t)batch * heads_q + head;
    const elem_t* gQ = q + bh * n_q * D;
    const elem_t* gK = k + ((size_t)batch * heads_kv + kv_head) * n_kv * D;
    const elem_t* gV = v + ((size_t)batch * heads_kv + kv_head) * n_kv * D;
    float* gO = o_acc + bh * n_q * D;
    float* gl = l_acc + bh * n_q;
    float* gm = m_acc + bh * n_q;
    const int shift = n_kv - n_q;  // bottom-right causal: row i sees keys j <= i + shift
    const int t_r = (n_q + BR - 1) / BR, t_c = (n_kv + BC - 1) / BC;

    // Line 2: O = 0, l = 0, m = −inf in global memory. Each row is only ever touched by its own
    // thread (tile i goes to warp i mod WARPS every time), so no barrier is needed.
    for (int i = warp; i < t_r; i += WARPS) {
        const int row = i * BR + lane;
        if (row >= n_q) continue;
        for (int c = 0; c < D; ++c) gO[(size_t)row * D + c] = 0.f;
        gl[row] = 0.f;
        gm[row] = LADDER_NEG_INF;
    }

    for (int j = 0; j < t_c; ++j) {
        // Line 6: K_j, V_j to shared memory (keys past the end as zeros, masked below).
        __syncthreads();
        for (int idx = threadIdx.x; idx < BC * D; idx += WARPS * 32) {
            const int r = idx / D, c = idx % D, key = j * BC + r;
            sK[r][c] = key < n_kv ? to_f32(gK[(size_t)key * D + c]) : 0.f;
            sV[r][c] = key < n_kv ? to_f32(gV[(size_t)key * D + c]) : 0.f;
        }
        __syncthreads();

        for (int i = warp; i < t_r; i += WARPS) {
            const int row = i * BR + lane;
            if (row >= n_q) continue;
            // Line 8: this row of Q_i (read as the dot products need it), and its O, l, m, from
            // global memory.
            const elem_t* q_row = gQ + (size_t)row * D;
            const float m_i = gm[row], l_i = gl[row];

            // Lines 9–10: scores, their max, exponentials and sum.
            float s[BC];
            float m_tile = LADDER_NEG_INF;
#pragma unroll
            for (int kk = 0; kk < BC; ++kk) {
                const int key = j * BC + kk;
                float dot = 0.f;
                for (int c = 0; c < D; ++c) dot += to_f32(q_row[c]) * sK[kk][c];
                const bool visible = key < n_kv && !(causal && key > row + shift);
                s[kk] = visible ? dot * scale : LADDER_NEG_INF;
                m_tile = fmaxf(m_tile, s[kk]);
            }
            if (m_tile == LADDER_NEG_INF) continue;  // the row sees no key of this tile
            float l_tile = 0.f;
#pragma unroll
            for (int kk = 0; kk < BC; ++kk) {
                s[kk] = expf(s[kk] - m_tile);
                l_tile += s[kk];
            }

            // Lines 11–13: merge with the running statistics; O stays normalised.
            const float m_new = fmaxf(m_i, m_tile);
            const float a = l_i * expf(m_i - m_new);  // weight of the old O (0 on the first tile)
            const float b = expf(m_tile - m_new);      // weight of this tile's P̃ V_j
            const float l_new = a + b * l_tile;
            for (int c = 0; c < D; ++c) {
                float pv = 0.f;
#pragma unroll
                for (int kk = 0; kk < BC; ++kk) pv += s[kk] * sV[kk][c];
                float* out = gO + (size_t)row * D + c;
                *out = (a * *out + b * pv) / l_new;
            }
            gl[row] = l_new;
            gm[row] = m_new;
        }
    }

    // After the last tile: O in the output type, and lse = m + log l (−inf, O = 0 for rows that
    // saw no key).
    for (int i = warp; i < t_r; i += WARPS) {
        const int row = i * BR + lane;
        if (row >= n_q) continue;
        const float l = gl[row];
        for (int c = 0; c < D; ++c) o[(bh * n_q + row) * D + c] = from_f32(gO[(size_t)row * D + c]);
        lse[bh * n_q + row] = l == 0.f ? LADDER_NEG_INF : gm[row] + logf(l);
    }
}
