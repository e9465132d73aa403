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
// Copy 4 bytes (one float), zero-filled when `valid` is false: for rows of per-row statistics that
// start anywhere, where 16-byte chunks would not be aligned.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
    int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)),
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

// Copy rows 0 … n − 1 of a tile whose row r starts at gmem + row_at(r) (elements) into a swizzled
// shared tile of COLS columns, columns [0, DK): rows at or past n and columns at or past D become
// zeros and are never read from memory; columns DK … COLS are left alone. The threads walk the
// tile's 16-byte chunks in order, one address per chunk: for rows that lie anywhere (load_tile's
// general path, the decoding kernels' rows of new tokens).
template <int ROWS, int COLS, int DK, int D, int THREADS, typename RowAt>
__device__ __forceinline__ void load_rows(u16* smem, const u16* gmem, RowAt row_at, int n) {
    constexpr int CHUNKS_PER_ROW = DK / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
#pragma unroll
    for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int r = chunk / CHUNKS_PER_ROW, col = (chunk % CHUNKS_PER_ROW) * 8;
        if (CHUNKS % THREADS == 0 || chunk < CHUNKS) {
            const bool valid = col < D && r < n;
            cp_async_16(smem + swz<COLS>(r, col), gmem + (valid ? row_at(r) + col : 0), valid);
        }
    }
}

// Copy rows [row0, row0 + ROWS) of a [n, D] matrix whose rows are `ld` elements apart into a
// swizzled shared tile of COLS columns, columns [0, DK): rows at or past `n` and columns at or past
// D (the zero padding of a head dimension, layout.cuh) become zeros and are never read from
// memory (cp.async with zero source bytes); columns DK … COLS are left alone. All THREADS threads
// of the block take part. Where every row has as many chunks as a whole number of threads covers,
// each thread copies 16-byte chunks at one column, STEP rows apart: one base pointer per thread
// plus compile-time offsets, so the compiler needs no register per chunk. Otherwise (a head
// dimension of 40 or 80, say) the threads walk the tile's chunks in order.
template <int ROWS, int COLS, int DK, int D, int THREADS>
__device__ __forceinline__ void load_tile(u16* smem, const u16* gmem, long long ld, int row0,
                                          int n) {
    static_assert(D <= DK && DK <= COLS && D % 8 == 0 && DK % 8 == 0, "columns of the tile");
    constexpr int CHUNKS_PER_ROW = DK / 8;
    if constexpr (THREADS % CHUNKS_PER_ROW == 0 && ROWS % (THREADS / CHUNKS_PER_ROW) == 0) {
        constexpr int STEP = THREADS / CHUNKS_PER_ROW;
        const int r = threadIdx.x / CHUNKS_PER_ROW;
        const int col = (threadIdx.x % CHUNKS_PER_ROW) * 8;
        const bool col_in = DK == D || col < D;
        const u16* src = gmem + (row0 + r) * ld + (col_in ? col : 0);
#pragma unroll
        for (int i = 0; i < ROWS / STEP; ++i, src += STEP * ld)
            cp_async_16(smem + swz<COLS>(r + i * STEP, col), src, col_in && row0 + r + i * STEP < n);
    } else {
        load_rows<ROWS, COLS, DK, D, THREADS>(
            smem, gmem, [&](int r) { return (row0 + r) * ld; }, n - row0);
    }
}

// The square case: a [n, D] matrix stored densely into a tile of D columns.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(u16* smem, const u16* gmem, int row0, int n) {
    load_tile<ROWS, D, D, D, THREADS>(smem, gmem, D, row0, n);
}

// N consecutive floats (N = 2 or a multiple of 4, the address aligned to 4·min(N, 4) bytes), in
// one load per 4; from L2 (ld.cg, past the SM's L1, which is not coherent) when L2 is set: what
// other blocks of the same launch wrote.
template <int N, bool L2 = false>
__device__ __forceinline__ void load_f32(float (&x)[N], const float* src) {
    static_assert(N == 2 || N % 4 == 0, "float2 or float4s");
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4* at = reinterpret_cast<const float4*>(src + i);
            const float4 v = L2 ? __ldcg(at) : *at;
            x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
        }
    } else {
        const float2* at = reinterpret_cast<const float2*>(src);
        const float2 v = L2 ? __ldcg(at) : *at;
        x[0] = v.x, x[1] = v.y;
    }
}

#endif  // LADDER_COPY_CUH
