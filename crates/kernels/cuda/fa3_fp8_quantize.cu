// FA3's FP8 inputs (Shah et al. 2024, §3.3): Q, K, V rounded to e4m3 with one scale per tile of
// rows, before the attention kernel (fa3_forward.cu with FA3_FP8) reads them.
//
//   quantize_rows        Q (tiles of BR rows) and K (tiles of BC keys): optionally rotated first
//                        by the random Hadamard map of incoherent processing, x ↦ H (s ∘ x) / √d,
//                        which leaves Q·Kᵀ unchanged but spreads an outlier channel over all d;
//                        then scale = amax / 448 per tile, x / scale rounded to e4m3.
//   quantize_v           V, per tile of BC keys the same way, written transposed ([d, keys]) with
//                        the keys of every 32-key group in fp8_key_slot order (fp8.cuh).
//   v_scales             per head: the factors P and O take so that V's scales cost nothing in
//                        the kernel: log2(2^8 · scale_j / max_j scale_j), added to P's exponent,
//                        and max_j scale_j / 2^8.
//
// Each block quantises one tile: a first pass finds its largest magnitude, a second (reading the
// tile again, from L2) rounds and writes it. The arithmetic is the CPU rung's, step for step
// (crates/reference/src/fp8.rs): the same butterflies of the fast Walsh–Hadamard transform in the
// same order, correctly rounded divisions; so the e4m3 operands are bit for bit the CPU's.
//
// Compile-time constants: LADDER_DTYPE (input), FP8Q_D (head dim, a power of two ≥ 32),
// FP8Q_BC (keys per V tile), FP8Q_HADAMARD (rotate Q and K).

#include "fp8.cuh"
#include "types.cuh"

#ifndef FP8Q_D
#define FP8Q_D 128
#endif
#ifndef FP8Q_BC
#define FP8Q_BC 128
#endif
#ifndef FP8Q_HADAMARD
#define FP8Q_HADAMARD 0
#endif

constexpr int D = FP8Q_D;
constexpr int BC = FP8Q_BC;
constexpr int PER_LANE = D / 32;  // a row's values per lane: columns lane, lane + 32, …
constexpr int WARPS = 8;          // 256 threads per block
static_assert(D >= 32 && (D & (D - 1)) == 0, "the Walsh–Hadamard transform needs a power of two");

struct Fp8QuantizeParams {
    const elem_t* x;      // [batch, heads, n, D]
    u8* out;              // quantize_rows: [batch, heads, n, D]; quantize_v: [batch, heads, D, n_pad]
    float* scale;         // [batch, heads, tiles]
    const float* signs;   // [D] random ±1 of the rotation (quantize_rows with FP8Q_HADAMARD)
    float norm;           // 1 / √D, rounded to f32 as the CPU rung rounds it
    int heads;
    int n;
    int rows;             // rows per tile
    int n_pad;            // quantize_v: keys per transposed row (tiles · BC)
    float* p_lift;        // v_scales: [batch, heads, tiles]
    float* o_scale;       // v_scales: [batch, heads]
};

// In-place fast Walsh–Hadamard transform of a row spread over the warp (lane holds columns
// lane + 32i). Butterfly h pairs columns c and c + h (c with bit h clear): (a, b) ↦ (a + b, a − b),
// for h = 1, 2, 4, … in turn, as the CPU loop does. Below 32 the partner is another lane.
__device__ __forceinline__ void walsh_hadamard(float (&x)[PER_LANE]) {
    const int lane = lane_id();
#pragma unroll
    for (int h = 1; h < 32; h *= 2)
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const float other = __shfl_xor_sync(0xffffffff, x[i], h);
            x[i] = (lane & h) ? ieee_sub(other, x[i]) : ieee_add(x[i], other);
        }
#pragma unroll
    for (int h = 1; h < PER_LANE; h *= 2)  // column distance 32h: within the lane
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if ((i & h) == 0) {
                const float a = x[i], b = x[i + h];
                x[i] = ieee_add(a, b);
                x[i + h] = ieee_sub(a, b);
            }
}

// Row `row` of head (b, h) in f32, rotated when asked.
template <bool ROTATE>
__device__ __forceinline__ void load_row(const Fp8QuantizeParams& p, size_t head, int row,
                                         float (&x)[PER_LANE]) {
    const elem_t* src = p.x + (head * p.n + row) * D;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) x[i] = to_f32(src[lane_id() + 32 * i]);
    if (ROTATE) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) x[i] = ieee_mul(x[i], p.signs[lane_id() + 32 * i]);
        walsh_hadamard(x);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) x[i] = ieee_mul(x[i], p.norm);
    }
}

// The e4m3 scale of the tile of rows [row0, row_end) of head `head`; every thread gets it.
template <bool ROTATE>
__device__ float tile_scale(const Fp8QuantizeParams& p, size_t head, int row0, int row_end) {
    __shared__ float warp_amax[WARPS];
    float m = 0.f;
    for (int row = row0 + warp_id(); row < row_end; row += WARPS) {
        float x[PER_LANE];
        load_row<ROTATE>(p, head, row, x);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) m = amax_nan(m, x[i]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        m = amax_nan(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (lane_id() == 0) warp_amax[warp_id()] = m;
    __syncthreads();
    m = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = amax_nan(m, warp_amax[w]);
    return e4m3_scale(m);
}

// Grid (tiles, heads, batch), 256 threads: one tile of p.rows rows of Q or K.
extern "C" __global__ void __launch_bounds__(256) quantize_rows(const Fp8QuantizeParams p) {
    constexpr bool rotate = FP8Q_HADAMARD;
    const size_t head = (size_t)blockIdx.z * p.heads + blockIdx.y;
    const int row0 = blockIdx.x * p.rows, row_end = min(row0 + p.rows, p.n);
    const float scale = tile_scale<rotate>(p, head, row0, row_end);
    if (threadIdx.x == 0) p.scale[head * gridDim.x + blockIdx.x] = scale;
    for (int row = row0 + warp_id(); row < row_end; row += WARPS) {
        float x[PER_LANE];
        load_row<rotate>(p, head, row, x);
        u8* dst = p.out + (head * p.n + row) * D;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) dst[lane_id() + 32 * i] = to_e4m3(ieee_div(x[i], scale));
    }
}

// Grid (tiles, heads_kv, batch), 256 threads: one tile of BC keys of V, transposed through shared
// memory (rows padded by 4 bytes, so that the lanes' byte writes of one key fall in different
// banks) and written as D rows of BC keys; keys past n are zeros.
extern "C" __global__ void __launch_bounds__(256) quantize_v(const Fp8QuantizeParams p) {
    constexpr int PITCH = BC + 4;
    __shared__ __align__(16) u8 vt[D * PITCH];
    const size_t head = (size_t)blockIdx.z * p.heads + blockIdx.y;
    const int row0 = blockIdx.x * BC, row_end = min(row0 + BC, p.n);
    const float scale = tile_scale<false>(p, head, row0, row_end);
    if (threadIdx.x == 0) p.scale[head * gridDim.x + blockIdx.x] = scale;
    for (int key = warp_id(); key < BC; key += WARPS) {
        float x[PER_LANE];
        if (row0 + key < row_end) {
            load_row<false>(p, head, row0 + key, x);
        } else {
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) x[i] = 0.f;
        }
        const int slot = key / 32 * 32 + fp8_key_slot(key % 32);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            vt[(lane_id() + 32 * i) * PITCH + slot] = to_e4m3(ieee_div(x[i], scale));
    }
    __syncthreads();
    u8* dst = p.out + head * D * (size_t)p.n_pad + row0;
    for (int w = threadIdx.x; w < D * BC / 4; w += blockDim.x) {
        const int c = w / (BC / 4), k = (w % (BC / 4)) * 4;
        *reinterpret_cast<u32*>(dst + (size_t)c * p.n_pad + k) =
            *reinterpret_cast<const u32*>(&vt[c * PITCH + k]);
    }
}

// Grid (heads_kv · batch), 32 threads: V's factors for the attention kernel (see the top).
extern "C" __global__ void __launch_bounds__(32) v_scales(const Fp8QuantizeParams p) {
    const int tiles = (p.n + BC - 1) / BC;
    const float* scale = p.scale + (size_t)blockIdx.x * tiles;
    float m = 0.f;
    for (int j = lane_id(); j < tiles; j += 32) m = amax_nan(m, scale[j]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        m = amax_nan(m, __shfl_xor_sync(0xffffffff, m, offset));
    for (int j = lane_id(); j < tiles; j += 32)
        p.p_lift[(size_t)blockIdx.x * tiles + j] = 8.f + log2f(ieee_div(scale[j], m));
    if (lane_id() == 0) p.o_scale[blockIdx.x] = ieee_mul(m, 1.f / 256.f);
}
