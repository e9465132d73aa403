// FP8 (e4m3) for the FA3 rung: conversions, the exact arithmetic of block quantisation, and the
// one layout fact that makes P·V cheap in FP8.
//
// e4m3: 1 sign, 4 exponent, 3 mantissa bits; largest finite value 448; cvt rounds to nearest
// even and, with .satfinite, saturates at ±448 (NaN stays NaN) — the rounding of the CPU rung
// (crates/reference/src/fp8.rs). The quantisation steps use IEEE arithmetic written out (ieee_*
// below), so the GPU's e4m3 operands are bit for bit the CPU rung's.
//
// P's registers and V's key order. The A operand of an e4m3 wgmma (m64nNk32) from registers holds,
// per thread (lane = 4g + t), the row g (and g + 8) at reduction indices 4t … 4t+3 and
// 16+4t … 16+4t+3 of each 32-wide step. The f32 accumulator of S = Q·Kᵀ holds the same rows at
// key columns 2t, 2t+1, 8+2t, 9+2t (and +16): the thread has the right rows but other columns.
// FA3 moves the bytes between threads (shuffles); we instead store V transposed with its keys
// permuted inside every 32-key group, so that reduction index 4t+j meets the key the thread holds
// there: key 2t + (j & 1) + 8·(j >> 1) (+16). P then packs straight from its registers
// (pack_p_fp8 in softmax.cuh) and the product is the same sum in another order.
#ifndef LADDER_FP8_CUH
#define LADDER_FP8_CUH

#include "types.cuh"
#include "varlen.cuh"

typedef unsigned char u8;

constexpr float E4M3_MAX = 448.f;

// Four floats to e4m3, the first in the lowest byte (the operand order of a register).
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
    u16 lo, hi;
    // cvt …e4m3x2 puts its first source in the upper byte.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | ((u32)hi << 16);
}
__device__ __forceinline__ u8 to_e4m3(float x) { return (u8)(pack4_e4m3(x, 0.f, 0.f, 0.f) & 0xff); }

// f32 arithmetic exactly as IEEE (and the CPU) has it: correctly rounded, subnormals kept. The
// kernels are compiled with --use_fast_math, whose `/` is approximate and whose `+`, `*` flush
// subnormals; the quantisation must not, to stay bit for bit the CPU rung's.
__device__ __forceinline__ float ieee_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float ieee_sub(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float ieee_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float ieee_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// max(|x|, m) that lets a NaN through (fmaxf would drop it): a NaN input poisons its block's
// scale, as on the CPU, instead of vanishing from it.
__device__ __forceinline__ float amax_nan(float m, float x) {
    const float a = fabsf(x);
    return (a != a || a > m) ? a : m;
}

// The scale of a block whose largest magnitude is amax: amax / 448, or 1 for an all-zero block.
__device__ __forceinline__ float e4m3_scale(float amax) {
    return amax == 0.f ? 1.f : ieee_div(amax, E4M3_MAX);
}

// Where key k (0 … 31) of a 32-key group sits in V's transposed rows: the reduction index of the
// e4m3 A operand whose register holds P's column k (see above).
__device__ __forceinline__ int fp8_key_slot(int k) {
    const int half = k / 16, r = k % 16;
    return 16 * half + 4 * ((r % 8) / 2) + 2 * (r / 8) + r % 2;
}

// Round P (f32, accumulator layout, as online_softmax_in_place leaves it, already lifted towards
// e4m3's range) to e4m3, four values per register: p[c][0 … 3] is the A operand of the c-th
// 32-key step of O += P·V, with the keys in fp8_key_slot order.
template <int NT>
__device__ __forceinline__ void pack_p_fp8(const float (&s)[NT][4], u32 (&p)[NT / 4][4]) {
#pragma unroll
    for (int c = 0; c < NT / 4; ++c)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            // r: 0 row g keys 0-15 of the step, 1 row g+8, 2 row g keys 16-31, 3 row g+8.
            const int nt = 4 * c + 2 * (r / 2), e = 2 * (r % 2);
            p[c][r] = pack4_e4m3(s[nt][e], s[nt][e + 1], s[nt + 1][e], s[nt + 1][e + 1]);
        }
}

// Where the scale of tile `s.block` (of `rows` rows) of a sequence's head `head` lies, in arrays
// of `slots` per head: [batch, heads, slots] for a fixed-length batch (slots = its tiles). In a
// packed batch every sequence is quantised on its own, its tiles starting at its first row
// `start`; sequence s's tiles take slots start / rows + s on, which needs no table and never
// overlaps the next sequence's: ⌊(start + len) / rows⌋ + 1 ≥ ⌊start / rows⌋ + ⌈len / rows⌉.
// So slots = total / rows + batch, and V's transposed rows hold slots · BC keys, each tile at
// its slot's columns.
__device__ __forceinline__ int fp8_first_slot(bool packed, const SeqBlock& s, int start, int rows) {
    return packed ? start / rows + s.seq : 0;
}
__device__ __forceinline__ long long fp8_tile_slot(bool packed, const SeqBlock& s, int start,
                                                   int rows, int head, int heads, int slots) {
    return ((long long)s.batch * heads + head) * slots + fp8_first_slot(packed, s, start, rows) +
           s.block;
}

#endif  // LADDER_FP8_CUH
