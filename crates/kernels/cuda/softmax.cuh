// Row reductions over an mma accumulator, and the online-softmax update of FlashAttention-2.
#ifndef LADDER_SOFTMAX_CUH
#define LADDER_SOFTMAX_CUH

#include "types.cuh"

// Max or sum across the four threads that share a row of an mma accumulator (lanes 4r … 4r+3).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}
// Max or sum across the eight threads that share a column of an mma accumulator (lanes c, c + 4,
// …, c + 28 with c = lane % 4): the row statistics of a transposed product such as Sᵀ = K·Qᵀ,
// whose columns are the query rows.
__device__ __forceinline__ float column_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 8));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 16));
}
__device__ __forceinline__ float column_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 4);
    x += __shfl_xor_sync(0xffffffff, x, 8);
    return x + __shfl_xor_sync(0xffffffff, x, 16);
}
// Sum across the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
    return x;
}
// Max across the 32 lanes of a warp (NaN-ignoring, like fmaxf).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
    return x;
}

// The largest score of row half h (accumulator entries 2h, 2h + 1) across the quad, times
// scale_log2: the max is taken on the raw scores and scaled once per row, one instruction per
// score instead of a max and a multiply per pair. For scale_log2 > 0 (the rungs accept only
// positive softmax scales) it is exactly the max of the scaled scores, since rounding x·c is
// monotone in x; a masked score (−inf) stays −inf.
template <int NT>
__device__ __forceinline__ float scaled_row_max(const float (&s)[NT][4], int h, float scale_log2) {
    float mx = LADDER_NEG_INF;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    return quad_max(mx) * scale_log2;
}

// The online-softmax step for one row half h (accumulator entries 2h, 2h + 1: row acc_row(2h))
// of a score tile s, in base 2 (scale_log2 = softmax scale · log2 e):
//   m_new = max(m, rowmax(s)·scale_log2),  P = 2^(s·scale_log2 − m_new),  l = alpha·l + rowsum P
// and returns alpha = 2^(m − m_new), the factor that rescales the output accumulator. P is
// rounded to 16 bits as soon as it is computed, two values per register (p[nt][h]): exactly the
// A-operand layout of the P·V product (a_from_packed), and half the registers of f32 scores.
// l is this thread's partial sum over its own columns; the quad is summed once at the end, since
// alpha is the same for all four threads of a row.
template <int NT>
__device__ __forceinline__ float online_softmax(const float (&s)[NT][4], int h, float scale_log2,
                                                float& m, float& l, u32 (&p)[NT][2]) {
    const float mx = fmaxf(m, scaled_row_max(s, h, scale_log2));
    // A row that has seen only masked keys keeps max −inf; subtract 0 instead so that its
    // probabilities are exp2(−inf) = 0 rather than NaN.
    const float m_use = mx == LADDER_NEG_INF ? 0.f : mx;
    const float alpha = m == mx ? 1.f : fast_exp2(m - m_use);
    m = mx;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float p0 = fast_exp2(fmaf(s[nt][2 * h], scale_log2, -m_use));
        float p1 = fast_exp2(fmaf(s[nt][2 * h + 1], scale_log2, -m_use));
        sum += p0 + p1;
        p[nt][h] = pack2(p0, p1);
    }
    l = l * alpha + sum;
    return alpha;
}

// The same step with P left in s, in f32 (s = 2^(s·scale_log2 − m_new)); pack_p rounds it to the
// 16-bit A operand later. FA3 uses this form: its softmax runs while the tensor cores still read
// the previous P, so the new P may only be written into P's registers once that product is done.
// `lift` (log2 of a factor, 0 for none) scales P by 2^lift inside the exponential, for free, while
// l still sums the unscaled P (FP8 lifts P towards e4m3's range: fp8.cuh).
template <int NT>
__device__ __forceinline__ float online_softmax_in_place(float (&s)[NT][4], int h,
                                                         float scale_log2, float& m, float& l,
                                                         float lift = 0.f) {
    const float mx = fmaxf(m, scaled_row_max(s, h, scale_log2));
    const float m_use = mx == LADDER_NEG_INF ? 0.f : mx;  // as in online_softmax
    const float alpha = m == mx ? 1.f : fast_exp2(m - m_use);
    m = mx;
    const float shift = lift - m_use;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[nt][e] = fast_exp2(fma_rn(s[nt][e], scale_log2, shift));
            sum = add_rn(sum, s[nt][e]);
        }
    l = fma_rn(l, alpha, lift == 0.f ? sum : sum * fast_exp2(-lift));
    return alpha;
}

// Round P (f32, accumulator layout) to 16 bits, two values per register: p[nt][h] =
// pack2(s[nt][2h], s[nt][2h + 1]), the A-operand layout of O += P·V.
template <int NT>
__device__ __forceinline__ void pack_p(const float (&s)[NT][4], u32 (&p)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) p[nt][h] = pack2(s[nt][2 * h], s[nt][2 * h + 1]);
}

// The sink logit of query head `head` in the softmax's base-2 units (sinks.rs: one more logit in
// every row's sum, of value zero), or −inf without sinks.
__device__ __forceinline__ float sink_log2(const float* sinks, int head) {
    return sinks != nullptr ? sinks[head] * LADDER_LOG2E : LADDER_NEG_INF;
}

// Fold a sink logit (base 2, sink_log2) into a row's max m and sum l at the end of its walk:
// m' = max(m, σ), l' = l·2^(m − m') + 2^(σ − m'); returns 2^(m − m'), the factor the accumulator
// takes. A row that saw no key (m = −inf, l = 0) gets l' = 1 and factor 0: O = 0 and lse = σ. A
// NaN row keeps its NaN sum. Without a sink (σ = −inf) the row is left as it is (factor 1).
__device__ __forceinline__ float fold_sink(float& m, float& l, float sink) {
    if (sink == LADDER_NEG_INF) return 1.f;
    const float m_new = fmaxf(m, sink);
    const float alpha = fast_exp2(m - m_new);
    l = fmaf(l, alpha, fast_exp2(sink - m_new));
    m = m_new;
    return alpha;
}

#endif  // LADDER_SOFTMAX_CUH
