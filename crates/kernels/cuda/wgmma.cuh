// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): four consecutive warps (a warpgroup,
// starting at a warp index divisible by 4) multiply a 64-row A by an N-column B asynchronously.
//
//   Accumulator: warp w of the warpgroup holds rows 16w … 16w+15 of the 64; within the warp the
//     layout is mma.sync's (mma.cuh): float d[N/8][4], d[nt][e] at row acc_row(e), column
//     acc_col(nt, e). So the softmax and mask code of FA2 applies to it unchanged.
//   A from registers: the m16n8k16 A layout per warp (a_from_packed turns P into it).
//   Operands in shared memory: a 64-bit descriptor (start address, two strides, the swizzle).
//
// Shared tiles here are what TMA writes with the 128-byte swizzle (tma.cuh): column blocks of 128
// bytes (64 16-bit or 128 e4m3 elements), one 128-byte row per tile row, 8-row groups of 1024
// bytes (one swizzle atom).
//   K-major operand (the reduction dimension is contiguous: Q and K for S = Q·Kᵀ, and FP8's
//     transposed V): 8-row groups SBO = 1024 bytes apart; a k-step (16 16-bit or 32 e4m3
//     elements: 32 bytes either way) is +32 bytes inside a column block, and the next column
//     block is +ROWS·128 bytes.
//   N-major operand (V for O = P·V, the reduction dimension is the tile's rows): 8-row groups of
//     the reduction dimension SBO = 1024 bytes apart, 64-column blocks of N LBO = ROWS·128 bytes
//     apart; a 16-wide k-step is +16 rows = +2048 bytes.
//
// Ordering: wgmma_fence before the first wgmma of a batch (registers written by ordinary code
// become visible to it), commit closes a group, wait<N> blocks until at most N groups are in
// flight. Shared memory written by ordinary stores needs fence.proxy.async before wgmma reads it.
#ifndef LADDER_WGMMA_CUH
#define LADDER_WGMMA_CUH

#include "copy.cuh"
#include "types.cuh"
#include "wgmma_ops.cuh"

// ---- descriptors --------------------------------------------------------------------------------

// A descriptor for a 128-byte-swizzled tile at shared address `addr` (bits 0-13: addr/16,
// 16-29: LBO/16, 32-45: SBO/16, 62-63: 1 = 128-byte swizzle).
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3ffff) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}

// K-major tile of ROWS rows × the kk-th 32-byte step of the reduction dimension, rows from `row0`.
template <int ROWS>
__device__ __forceinline__ u64 desc_k_major(const void* tile, int row0, int kk) {
    const u32 addr = smem_addr(tile) + (kk / 4) * ROWS * 128 + row0 * 128 + (kk % 4) * 32;
    return smem_desc(addr, 16, 1024);
}

// N-major tile (rows = reduction dimension): reduction rows 16·ks … 16·ks+15, every column.
template <int ROWS>
__device__ __forceinline__ u64 desc_n_major(const u16* tile, int ks) {
    return smem_desc(smem_addr(tile) + ks * 16 * 128, ROWS * 128, 1024);
}

// ---- ordering -----------------------------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Call after the wait for every register array an in-flight wgmma used (its accumulator, and P
// when it was the A operand). The compiler sees a wgmma as an ordinary instruction that reads
// and writes its registers when issued; this empty asm, ordered after the wait, is where they are
// really last read and written. Without it the compiler may read an accumulator before the
// result has landed, or reuse P's registers for the next P while the product still reads them
// (ptxas then serialises every wgmma of the kernel: C7513).
template <int NT>
__device__ __forceinline__ void wgmma_hold(float (&d)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[nt][e])::"memory");
}
template <int NT, int W>
__device__ __forceinline__ void wgmma_hold(u32 (&a)[NT][W]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int w = 0; w < W; ++w) asm volatile("" : "+r"(a[nt][w])::"memory");
}

// ---- register budget ----------------------------------------------------------------------------

// Give registers back (producer) or take them (consumers); every warp of the warpgroup executes
// the same call. Takes effect only in a kernel with a register cap (__launch_bounds__(threads, 1)).
template <int REGS>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void warpgroup_reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

// ---- products -------------------------------------------------------------------------------------

// S = Q·Kᵀ for the warpgroup's 64 query rows (Q rows from q_row0 of a BR-row tile) against the
// BC keys of a K tile: DK/16 k-steps (DK: the head dim rounded up to the k-step, layout.cuh),
// both operands K-major in shared memory. Issued, not waited.
template <int BR, int BC, int DK>
__device__ __forceinline__ void wgmma_qk(float (&s)[BC / 8][4], const u16* sQ, int q_row0,
                                         const u16* sK) {
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk)
        Wgmma<BC / 8, 0>::ss(s, desc_k_major<BR>(sQ, q_row0, kk), desc_k_major<BC>(sK, 0, kk),
                             kk > 0);
}

// O += P·V: P (64 × BC, 16-bit, registers: p[nt][h] as online_softmax packs it) times the BC × D
// V tile, N-major in shared memory (any D that is a multiple of 8: the instruction's N reads the
// first D columns of the tile's 64-column blocks). Issued, not waited.
template <int BC, int D>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 8][4], const u32 (&p)[BC / 8][2],
                                         const u16* sV) {
#pragma unroll
    for (int ks = 0; ks < BC / 16; ++ks) {
        const u32 a[4] = {p[2 * ks][0], p[2 * ks][1], p[2 * ks + 1][0], p[2 * ks + 1][1]};
        Wgmma<D / 8, 1>::rs(o, a, desc_n_major<BC>(sV, ks), 1);
    }
}

// The same two products with e4m3 operands (m64nNk32, FP8): S = Q·Kᵀ takes DK/32 k-steps; O += P·V
// takes P as pack_p_fp8 packs it (fp8.cuh) and V transposed ([D × BC], keys contiguous, in
// fp8_key_slot order), because e4m3 wgmma reads both operands K-major only.
template <int BR, int BC, int DK>
__device__ __forceinline__ void wgmma_qk_fp8(float (&s)[BC / 8][4], const unsigned char* sQ,
                                             int q_row0, const unsigned char* sK) {
#pragma unroll
    for (int kk = 0; kk < DK / 32; ++kk)
        Wgmma8<BC / 8>::ss(s, desc_k_major<BR>(sQ, q_row0, kk), desc_k_major<BC>(sK, 0, kk),
                           kk > 0);
}
template <int BC, int D>
__device__ __forceinline__ void wgmma_pv_fp8(float (&o)[D / 8][4], const u32 (&p)[BC / 32][4],
                                             const unsigned char* sVt) {
#pragma unroll
    for (int ks = 0; ks < BC / 32; ++ks) Wgmma8<D / 8>::rs(o, p[ks], desc_k_major<D>(sVt, 0, ks), 1);
}

#endif  // LADDER_WGMMA_CUH
