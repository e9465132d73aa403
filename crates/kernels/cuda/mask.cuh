// Masking of score tiles: keys past the end of the sequence, and the band of keys each query sees.
//
// Query i's diagonal is key i + shift, shift = n_kv − n_q (bottom-right alignment, as in
// FlashAttention-2 and PyTorch's is_causal with n_q != n_kv), and query i sees the keys of its
// band, [i + shift − left, i + shift + right]: the causal mask is right = 0, a sliding window
// (flash-attention's window_size) bounds either side. Both ends of the band move right by one key
// per row, so a tile's first and last rows decide which tiles are needed and which need masking.
#ifndef LADDER_MASK_CUH
#define LADDER_MASK_CUH

#include "mma.cuh"

// Keys a query sees before (left) and after (right) its diagonal. UNBOUNDED only comes from
// fixed_band, at compile time, so its tests fold away; a window's open side arrives from the host
// as n_q + n_kv (at most UNBOUNDED − 1), which no key is that far from.
struct Band {
    int left;
    int right;
};
constexpr int UNBOUNDED = 0x40000000;

__device__ __forceinline__ bool bounded(int side) { return side != UNBOUNDED; }

// The band of the kernels compiled without a window: causal or nothing.
template <bool CAUSAL>
__device__ __forceinline__ Band fixed_band() {
    return Band{UNBOUNDED, CAUSAL ? 0 : UNBOUNDED};
}

// The band a kernel applies: the host's window (which folds the causal mask into right = 0) when
// compiled WINDOWED, else the fixed one. The host's sides are below UNBOUNDED; masking them with
// UNBOUNDED − 1 says so to the compiler, which then folds every bounded() test of a windowed
// kernel to true: no branch on the band's shape is left in it (in a wgmma kernel such a branch
// between the products makes ptxas serialise them).
template <bool CAUSAL, bool WINDOWED>
__device__ __forceinline__ Band band_of(const Band& window) {
    return WINDOWED ? Band{window.left & (UNBOUNDED - 1), window.right & (UNBOUNDED - 1)}
                    : fixed_band<CAUSAL>();
}

// A range of tiles [first, end), empty when end <= first (not clamped: the clamp would cost the
// kernels without a window an instruction and, at their register limit, a spill).
struct TileSpan {
    int first;
    int end;
    __device__ __forceinline__ bool empty() const { return end <= first; }
};

// Key tiles of BC keys that query rows q0 … q_last need (tiles wholly outside every row's band
// are never loaded).
template <int BC>
__device__ __forceinline__ TileSpan key_tile_span(int q0, int q_last, int n_kv, int shift,
                                                  Band band) {
    int end = (n_kv + BC - 1) / BC, first = 0;
    if (bounded(band.right)) {
        const int last_key = q_last + shift + band.right;  // the last row's last visible key
        end = last_key < 0 ? 0 : min(end, last_key / BC + 1);
    }
    if (bounded(band.left)) {
        const int first_key = q0 + shift - band.left;  // the first row's first visible key
        first = first_key > 0 ? first_key / BC : 0;
    }
    return TileSpan{first, end};
}

// Query tiles of BR rows that see any key of k0 … k_last (the backward's K/V-outer loop).
template <int BR>
__device__ __forceinline__ TileSpan query_tile_span(int k0, int k_last, int n_q, int shift,
                                                    Band band) {
    int end = (n_q + BR - 1) / BR, first = 0;
    if (bounded(band.right)) {
        const int first_row = k0 - shift - band.right;  // the first row whose band reaches k0
        first = first_row > 0 ? first_row / BR : 0;
    }
    if (bounded(band.left)) {
        const int last_row = k_last - shift + band.left;  // the last row that still sees k_last
        end = last_row < 0 ? 0 : min(end, last_row / BR + 1);
    }
    return TileSpan{first, end};
}

// Whether the tile of rows q0 … q_last and keys k0 … k_last has keys outside some row's band.
__device__ __forceinline__ bool crosses_band(int q0, int q_last, int k0, int k_last, int shift,
                                             Band band) {
    return (bounded(band.right) && k_last > q0 + shift + band.right) ||
           (bounded(band.left) && k0 < q_last + shift - band.left);
}

// Whether a tile with keys up to k_last has keys right of the diagonal of its first query q0.
template <bool CAUSAL>
__device__ __forceinline__ bool crosses_diagonal(int q0, int k_last, int shift) {
    return crosses_band(q0, q0, 0, k_last, shift, fixed_band<CAUSAL>());
}

// Whether key `key` is hidden from query `query`: past either sequence end, or outside its band.
__device__ __forceinline__ bool outside(int query, int key, int n_q, int n_kv, int shift,
                                        Band band) {
    return query >= n_q || key >= n_kv ||
           (bounded(band.right) && key > query + shift + band.right) ||
           (bounded(band.left) && key < query + shift - band.left);
}

template <bool CAUSAL>
__device__ __forceinline__ bool masked(int query, int key, int n_q, int n_kv, int shift) {
    return outside(query, key, n_q, n_kv, shift, fixed_band<CAUSAL>());
}

// Columns of the tile starting at k0 that query `query` sees: [lo, hi).
struct ColumnSpan {
    int lo;
    int hi;
};
__device__ __forceinline__ ColumnSpan key_columns(int query, int k0, int n_kv, int shift,
                                                  Band band) {
    ColumnSpan c{0, n_kv - k0};
    if (bounded(band.right)) c.hi = min(c.hi, query + shift + band.right + 1 - k0);
    if (bounded(band.left)) c.lo = query + shift - band.left - k0;
    return c;
}

// Set the entries of row half h of an accumulator tile row (NT tiles of 8 columns) whose column
// is outside [c.lo, c.hi) to `value`.
template <int NT>
__device__ __forceinline__ void mask_outside(float (&s)[NT][4], int h, ColumnSpan c, float value) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e)
            if (acc_col(nt, e) >= c.hi || acc_col(nt, e) < c.lo) s[nt][e] = value;
}

// Set the entries of row half h whose column is at or past `limit` to `value` (a band with no
// left side: the lower bound is the smallest int, whose test folds away, leaving one comparison
// per entry).
template <int NT>
__device__ __forceinline__ void mask_columns(float (&s)[NT][4], int h, int limit, float value) {
    constexpr int NO_LOWER_BOUND = -0x7fffffff - 1;
    mask_outside(s, h, ColumnSpan{NO_LOWER_BOUND, limit}, value);
}

// Set the entries of row half h outside the columns `c` it sees to `value`: one comparison per
// entry for a band with no left side (the causal mask), two for a window.
template <int NT>
__device__ __forceinline__ void mask_band(float (&s)[NT][4], int h, ColumnSpan c, Band band,
                                          float value) {
    if (bounded(band.left))
        mask_outside(s, h, c, value);
    else
        mask_columns(s, h, c.hi, value);
}

#endif  // LADDER_MASK_CUH
