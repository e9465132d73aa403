// Tensor Memory Accelerator (TMA, sm_90): whole tiles copied from global to shared memory by the
// copy engine, one instruction from one thread, completing on an mbarrier (barrier.cuh).
//
// The host describes each tensor once with cuTensorMapEncodeTiled (crates/kernels/src/fa3.rs):
// Q, K, V of shape [batch, heads, n, d] become 4-d maps with dimensions (d, n, heads, batch),
// innermost first, the tensor's own row, head and batch strides (any layout with d contiguous),
// boxes of 128 bytes × ROWS rows (64 16-bit columns, or 128 e4m3 ones), and the 128-byte
// swizzle. A box is then one 128-byte row per tile row, so a [ROWS × d] tile lands in shared
// memory as column blocks of [ROWS × 128 bytes], each swizzled exactly as wgmma's
// 128-byte-swizzle layout expects (wgmma.cuh). What lies outside the tensor is filled with zeros
// by the copy engine and never read: rows past the end of a sequence, and columns past d when d
// is not a whole number of blocks (d = 96 lands as two blocks, the second half zeros). The
// bytes a box brings to its mbarrier are the whole box's either way. (FP8's transposed V,
// [batch, heads, d, keys], is read the same way with keys as columns.)
#ifndef LADDER_TMA_CUH
#define LADDER_TMA_CUH

#include "copy.cuh"
#include "types.cuh"

// The driver's opaque 128-byte tensor map (CUtensorMap; NVRTC has no cuda.h), passed inside the
// kernel's __grid_constant__ parameter struct, whose address the copy instructions take.
struct alignas(128) TensorMap {
    u64 opaque[16];
};

// Fetch a tensor map into the copy engine's descriptor cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Copy the box at coordinates (col, row, head, batch) of `map` to `smem` (1024-byte aligned, for
// the swizzle); completion adds the box's bytes to `bar`'s transaction count.
__device__ __forceinline__ void tma_load_4d(void* smem, const TensorMap* map, u64* bar, int col,
                                            int row, int head, int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(smem_addr(smem)),
        "l"(map), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(smem_addr(bar))
        : "memory");
}

// A [ROWS × COLS] tile of T starting at (col0, row0) of (head, batch), as column blocks of 128
// bytes ([ROWS × 128/sizeof(T)] each, one swizzle span): 64 columns of fp16/bf16, 128 of e4m3.
template <int ROWS, int COLS, typename T>
__device__ __forceinline__ void tma_load_tile(T* smem, const TensorMap* map, u64* bar, int col0,
                                              int row0, int head, int batch) {
    constexpr int BLOCK = 128 / sizeof(T);  // columns per 128-byte block
    static_assert(COLS % BLOCK == 0, "whole 128-byte column blocks");
#pragma unroll
    for (int cb = 0; cb < COLS / BLOCK; ++cb)
        tma_load_4d(smem + cb * ROWS * BLOCK, map, bar, col0 + cb * BLOCK, row0, head, batch);
}

// Copy `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory without a tensor map (a row of per-row statistics), completing on `bar` like a
// tile.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_addr(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

// ---- stores: shared to global, by the copy engine ------------------------------------------------
//
// The other direction: a tile written to shared memory (in the same swizzled column blocks) is
// copied to the tensor by one thread, asynchronously. Rows past the tensor's end are not
// written. The writing threads make their stores visible to the copy engine first
// (tma_store_fence, then a barrier), and the buffer may be written again only once the copy has
// read it (tma_store_wait_read).

// Make this thread's ordinary shared-memory stores visible to the copy engine (the async proxy).
__device__ __forceinline__ void tma_store_fence() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Copy `smem` to the box at coordinates (col, row, head, batch) of `map`.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* smem, int col,
                                             int row, int head, int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
            map),
        "r"(col), "r"(row), "r"(head), "r"(batch), "r"(smem_addr(smem))
        : "memory");
}

// Add `smem` (f32) into the box at coordinates (col, row, head, batch) of `map`, element by element
// and atomically with respect to other reductions (the copy engine's add at L2): how blocks that
// share output rows sum their shares without per-element atomics. Rows outside the tensor are
// skipped, as by a store.
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap* map, const void* smem, int col,
                                                  int row, int head, int batch) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
        " [%0, {%1, %2, %3, %4}], [%5];" ::"l"(map),
        "r"(col), "r"(row), "r"(head), "r"(batch), "r"(smem_addr(smem))
        : "memory");
}

// The stores issued so far by this thread form one group (what the waits below count).
__device__ __forceinline__ void tma_store_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until every group of this thread has read its shared memory (the buffer is free again).
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Wait until every group of this thread has completed (its writes done).
__device__ __forceinline__ void tma_store_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// A [ROWS × COLS] 16-bit tile in column blocks of [ROWS × 64] (as tma_load_tile lays them out)
// to (col0, row0) of (head, batch).
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_store_tile(const TensorMap* map, const u16* smem, int col0,
                                               int row0, int head, int batch) {
    constexpr int BLOCK = 64;  // 16-bit columns per 128-byte block
    static_assert(COLS % BLOCK == 0, "whole 128-byte column blocks");
#pragma unroll
    for (int cb = 0; cb < COLS / BLOCK; ++cb)
        tma_store_4d(map, smem + cb * ROWS * BLOCK, col0 + cb * BLOCK, row0, head, batch);
}

#endif  // LADDER_TMA_CUH
