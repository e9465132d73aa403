// The combine of partial attention results over disjoint sets of keys: FlashDecoding merges its
// splits with it (flash_decoding.cu), ring attention the slices of K and V that reach a rank
// (ring.cu). A partial is (O_s, lse_s): the softmax-weighted mean of its keys' values and the
// log-sum-exp of its scores. With m = max_s lse_s and w_s = e^(lse_s − m) ∈ [0, 1]:
//
//     lse = m + ln Σ_s w_s,     O = Σ_s w_s · O_s / Σ_s w_s.
//
// A partial that saw no key has lse_s = −∞ and weight 0; a row whose partials are all empty gets
// O = 0 and lse = −∞, as everywhere. A caller merges online, as the softmax itself does: a running
// max m and weight sum l, the sums so far multiplied by combine_weight(m_old, m_new) when m grows.
#ifndef LADDER_COMBINE_CUH
#define LADDER_COMBINE_CUH

#include "types.cuh"

// e^(x − m): the weight of a partial of log-sum-exp x against the running max m, and the factor of
// the sums so far when the max moves from x to m (0 while x = −∞: nothing was added yet).
__device__ __forceinline__ float combine_weight(float x, float m) {
    return fast_exp2((x - m) * LADDER_LOG2E);
}

// 1 / Σ w_s, the merged row's normaliser (0 for a row that saw no key: O = 0).
__device__ __forceinline__ float combine_inverse(float l) { return l > 0.f ? 1.f / l : 0.f; }

// The merged row's log-sum-exp (−∞ for a row that saw no key).
__device__ __forceinline__ float combine_lse(float m, float l) {
    return l == 0.f ? LADDER_NEG_INF : m + logf(l);
}

#endif  // LADDER_COMBINE_CUH
