// Shared device helpers for the ladder's kernels, prepended to every rung's .cu source.
//
// Deliberately header-free: NVRTC needs no CUDA include folder for these kernels, so they compile
// the same way on a GPU machine, in CI from the PyPI NVRTC, or anywhere libnvrtc is found. The
// 16-bit types are carried as raw bits (unsigned short) and converted with single PTX instructions.
//
// Element type, chosen by the host when it compiles a variant:
//   LADDER_DTYPE 0 = fp16, 1 = bf16, 2 = f32 (FA1 only).

#ifndef LADDER_DTYPE
#define LADDER_DTYPE 0
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define LADDER_NEG_INF (-__int_as_float(0x7f800000))
#define LADDER_LOG2E 1.4426950408889634f
#define LADDER_LN2 0.6931471805599453f

// ---- scalar conversions ---------------------------------------------------------------------

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// bf16 is the top half of an f32, so widening is a shift.
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __int_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#if LADDER_DTYPE == 2
typedef float elem_t;
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float from_f32(float x) { return x; }
#elif LADDER_DTYPE == 1
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 x) { return bf16_to_f32(x); }
__device__ __forceinline__ u16 from_f32(float x) { return f32_to_bf16(x); }
#else
typedef u16 elem_t;
__device__ __forceinline__ float to_f32(u16 x) { return f16_to_f32(x); }
__device__ __forceinline__ u16 from_f32(float x) { return f32_to_f16(x); }
#endif

// Two floats packed into one 32-bit register of two 16-bit values (low half = first), the operand
// format of the tensor-core instructions.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if LADDER_DTYPE == 1
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// 2^x on the special-function unit. The kernels fold log2(e) into the softmax scale so that every
// exponential is one ex2 instruction.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- asynchronous global -> shared copies (sm_80+) --------------------------------------------

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
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- tensor-core fragments (mma.sync m16n8k16, f32 accumulate) ---------------------------------

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
    asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
    asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}

// D += A·B for one 16x8x16 tile: A is 4 registers (16x16), B is 2 (16x8), D is 4 floats (16x8).
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if LADDER_DTYPE == 1
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Shared-memory tiles of 16-bit elements with D columns are stored in 16-byte chunks whose index is
// XOR-ed with the row (mod 8). ldmatrix reads 8 rows at one chunk column, and cp.async writes whole
// rows; with the swizzle both touch 8 different bank groups instead of one.
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
    return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// ldmatrix addresses into a swizzled tile, from one register per operand. A thread reads 16-byte
// chunk `2c + hi` of its row at k-step c (hi = which 8-column half); the swizzle sends it to chunk
// (2c + hi) ^ (row mod 8) = 2c ^ y with y = hi ^ (row mod 8). Rows start on 128-byte boundaries,
// so the address is (row_addr | y·16) ^ ((c mod 4)·32) + (c / 4)·128: one XOR with a constant per
// load. The XOR is opaque (asm volatile) so that the compiler does not precompute and hold one
// address register per k-step, which is what pushed the kernel into spilling.
template <int D>
struct FragAddr {
    u32 base;
    __device__ __forceinline__ FragAddr(const u16* tile, int row, int hi) {
        base = (smem_addr(tile) + row * D * 2) | (((hi ^ (row & 7))) << 4);
    }
    // Address for k-step `c` (a compile-time constant after unrolling), `rows` rows further down.
    __device__ __forceinline__ u32 at(int c, int rows) const {
        u32 x;
        asm volatile("xor.b32 %0, %1, %2;" : "=r"(x) : "r"(base), "r"((c & 3) << 5));
        return x + (c >> 2) * 128 + rows * D * 2;
    }
};

__device__ __forceinline__ void ldmatrix_x4_a(u32 (&r)[4], u32 addr) {
    asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans_a(u32 (&r)[4], u32 addr) {
    asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
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

// The block's coordinates, read afresh at each use: the compiler cannot hoist a volatile read, so
// values derived from them (such as a head's base pointer) are recomputed from the special
// registers and kernel parameters instead of holding registers across a whole loop.
__device__ __forceinline__ int block_y() {
    int y;
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    return y;
}
__device__ __forceinline__ int block_z() {
    int z;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    return z;
}

// Sum or max across the four threads that share a row of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}
