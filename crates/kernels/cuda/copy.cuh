// Global -> shared copies with cp.async (sm_80+), into XOR-swizzled tiles.
#ifndef LADDER_COPY_CUH
#define LADDER_COPY_CUH

#include "types.cuh"

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Copy 16 bytes; when `valid` is false nothing is read and the 16 bytes are zero-filled, which is
// how tails past the end of a sequence become harmless zeros.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shared-memory tiles of 16-bit elements with COLS columns are stored in 16-byte chunks whose
// index is XOR-ed with the row (mod 8). ldmatrix reads 8 rows at one chunk column, and cp.async
// writes whole rows; with the swizzle both touch 8 different bank groups instead of one.
template <int COLS>
__device__ __forceinline__ int swz(int row, int col) {
    return row * COLS + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Copy rows [row0, row0 + ROWS) of a [n, D] matrix into a swizzled shared tile; rows at or past `n`
// become zeros. All THREADS threads of the block take part, each copying 16-byte chunks at one
// column, STEP rows apart: one base pointer per thread plus compile-time offsets, so the compiler
// needs no register per chunk. Rows past `n` are never read (cp.async with zero source bytes).
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(u16* smem, const u16* gmem, int row0, int n) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    static_assert(THREADS % CHUNKS_PER_ROW == 0, "a thread keeps one column");
    constexpr int STEP = THREADS / CHUNKS_PER_ROW;
    static_assert(ROWS % STEP == 0, "whole tile");
    const int r = threadIdx.x / CHUNKS_PER_ROW;
    const int col = (threadIdx.x % CHUNKS_PER_ROW) * 8;
    const u16* src = gmem + (long long)(row0 + r) * D + col;
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i)
        cp_async_16(smem + swz<D>(r + i * STEP, col), src + i * STEP * D, row0 + r + i * STEP < n);
}

// N consecutive floats (N = 2 or a multiple of 4, the address aligned to 4·min(N, 4) bytes), in
// one load per 4.
template <int N>
__device__ __forceinline__ void load_f32(float (&x)[N], const float* src) {
    static_assert(N == 2 || N % 4 == 0, "float2 or float4s");
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 v = *reinterpret_cast<const float4*>(src + i);
            x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
        }
    } else {
        const float2 v = *reinterpret_cast<const float2*>(src);
        x[0] = v.x, x[1] = v.y;
    }
}

#endif  // LADDER_COPY_CUH
