// Tensors in global memory, and the head dimension a kernel computes with.
#ifndef LADDER_LAYOUT_CUH
#define LADDER_LAYOUT_CUH

#include "types.cuh"

// A [batch, heads, rows, d] tensor whose last dimension is contiguous: element (b, h, r, c) lies
// at b·batch + h·head + r·row + c elements from its base. [b, h, s, d], [b, s, h, d] and the other
// layouts a framework hands over without a copy are all of this form; the host checks that the
// strides stay inside the buffer and never make two elements share an address.
struct Strides {
    long long batch;
    long long head;
    long long row;
};

// The offset of head h of batch b, in elements of T. The host keeps the batch and head strides
// whole 16-byte chunks and below 2^32 chunks, so each product is one 32 × 32 → 64-bit multiply of
// chunk counts: a 64-bit product costs the FA2 forward kernel's tightest variants a spill.
template <typename T>
__device__ __forceinline__ long long head_offset(const Strides& s, int b, int h) {
    constexpr int CHUNK = 16 / sizeof(T);
    return CHUNK * (long long)((u64)(u32)b * (u32)(s.batch / CHUNK) +
                               (u64)(u32)h * (u32)(s.head / CHUNK));
}

// The offset of row r within a head, in elements of T (the same product of chunk counts).
template <typename T>
__device__ __forceinline__ long long row_offset(const Strides& s, int r) {
    constexpr int CHUNK = 16 / sizeof(T);
    return CHUNK * (long long)((u64)(u32)r * (u32)(s.row / CHUNK));
}

// The first element of head h of batch b.
template <typename T>
__device__ __forceinline__ T* head_base(T* base, const Strides& s, int b, int h) {
    return base + head_offset<T>(s, b, h);
}

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// A head dimension D (any multiple of 8) as the tensor-core kernels see it:
//   DK    the width of the products: whole 16-wide k-steps (mma.sync and wgmma take k = 16), the
//         columns D … DK of every shared tile zero-filled by the copy, never read from memory;
//   COLS  the row length of a shared tile: whole 64-element rows, since the swizzle (copy.cuh)
//         permutes the eight 16-byte chunks of each 64 columns.
// Only the columns below D are ever read from or written to global memory.
template <int D>
struct HeadDim {
    static_assert(D % 8 == 0 && D >= 8 && D <= 256, "head dims are multiples of 8 up to 256");
    static constexpr int DK = round_up(D, 16);
    static constexpr int COLS = round_up(D, 64);
};

#endif  // LADDER_LAYOUT_CUH
