// Element types, conversions and constants shared by every kernel.
//
// Deliberately free of CUDA's own headers: NVRTC needs no CUDA include folder for these kernels,
// so they compile the same way on a GPU machine, in CI from the PyPI NVRTC, or anywhere libnvrtc
// is found. The 16-bit types are carried as raw bits (unsigned short) and converted with single
// PTX instructions.
//
// Element type, chosen by the host when it compiles a variant:
//   LADDER_DTYPE 0 = fp16, 1 = bf16, 2 = f32 (FA1 only).
#ifndef LADDER_TYPES_CUH
#define LADDER_TYPES_CUH

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

// An add and a fused multiply-add the compiler may not reassociate or contract differently from
// one inlined copy to the next: sums written with them round the same way in every variant of a
// kernel (FA3's schedules are bitwise equal because of this).
__device__ __forceinline__ float add_rn(float a, float b) {
    float c;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
    return c;
}
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float d;
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
}

// ---- thread and block coordinates ---------------------------------------------------------------

__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int warp_id() { return threadIdx.x / 32; }

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

#endif  // LADDER_TYPES_CUH
