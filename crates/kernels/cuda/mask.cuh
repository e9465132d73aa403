// Masking of score tiles: keys past the end of the sequence, and the causal diagonal.
//
// Causal masking is bottom-right aligned (as in FlashAttention-2 and PyTorch's is_causal with
// n_q != n_kv): query i sees key j iff j <= i + shift, shift = n_kv − n_q.
#ifndef LADDER_MASK_CUH
#define LADDER_MASK_CUH

#include "mma.cuh"

// Key tiles of BC keys that query rows up to q_last need: all of them, or under the causal mask
// only those up to q_last's diagonal (tiles wholly right of it are never loaded).
template <bool CAUSAL, int BC>
__device__ __forceinline__ int key_tiles(int q_last, int n_kv, int shift) {
    int n_tiles = (n_kv + BC - 1) / BC;
    if (CAUSAL) {
        const int last_key = q_last + shift;  // the most permissive row's last visible key
        n_tiles = last_key < 0 ? 0 : min(n_tiles, last_key / BC + 1);
    }
    return n_tiles;
}

// Whether a tile with keys up to k_last has keys right of the diagonal of its first query q0.
template <bool CAUSAL>
__device__ __forceinline__ bool crosses_diagonal(int q0, int k_last, int shift) {
    return CAUSAL && k_last > q0 + shift;
}

// Whether key `key` is hidden from query `query` (past either sequence end, or right of the
// diagonal).
template <bool CAUSAL>
__device__ __forceinline__ bool masked(int query, int key, int n_q, int n_kv, int shift) {
    return query >= n_q || key >= n_kv || (CAUSAL && key > query + shift);
}

// Keys of the tile starting at k0 that query `query` sees: columns [0, key_limit).
template <bool CAUSAL>
__device__ __forceinline__ int key_limit(int query, int k0, int n_kv, int shift) {
    int limit = n_kv - k0;
    if (CAUSAL) limit = min(limit, query + shift + 1 - k0);
    return limit;
}

// Set the entries of row half h of an accumulator tile row (NT tiles of 8 columns) whose column
// is at or past `limit` to `value`.
template <int NT>
__device__ __forceinline__ void mask_columns(float (&s)[NT][4], int h, int limit, float value) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e)
            if (acc_col(nt, e) >= limit) s[nt][e] = value;
}

#endif  // LADDER_MASK_CUH
