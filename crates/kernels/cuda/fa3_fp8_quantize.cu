// FA3's FP8 inputs (Shah et al. 2024, §3.3): Q, K, V rounded to e4m3 with one scale per tile of
// rows, before the attention kernel (fa3_forward.cu with FA3_FP8) reads them.
//
//   quantize_rows        Q (tiles of BR rows) and K (tiles of BC keys): optionally rotated first
//                        by the random Hadamard map of incoherent processing, x ↦ H (s ∘ x) / √b
//                        (H block-diagonal in blocks of b columns, b the largest power of two
//                        dividing D), which leaves Q·Kᵀ unchanged but spreads an outlier channel
//                        over its block; then scale = amax / 448 per tile, x / scale to e4m3.
//   v_amax, v_scales,    V with one scale per head (a packed batch: per sequence), as
//   quantize_v           flash-attention's FP8 takes it: each tile's largest magnitude (v_amax),
//                        the head's (v_scales: written as every tile's scale, with the factors
//                        the kernel reads, 2^8 for P and the scale / 2^8 for O), then V over it,
//                        written transposed ([D, keys]) with the keys of every 32-key group in
//                        fp8_key_slot order (fp8.cuh). One scale per head rounds every tile's P
//                        at the same lift; V's own block scales made P's lift 2^8 · s_j / max s,
//                        small in a tile of small V, and cost 12–17 % more error on outliers.
//
// Each block quantises one tile: a first pass finds its largest magnitude, a second (reading the
// tile again, from L2) rounds and writes it. The arithmetic is the CPU rung's, step for step
// (crates/reference/src/fp8.rs): the same butterflies of the fast Walsh–Hadamard transform in the
// same order, correctly rounded divisions; so the e4m3 operands are bit for bit the CPU's.
//
// Inputs are read at their strides (fixed-length [batch, heads, n, D], or a packed batch as one
// batch entry of [heads, total, D]); the e4m3 copies are dense. A packed batch (FP8Q_VARLEN)
// quantises each sequence on its own, as the CPU rung does: its tiles start at its first row, and
// their scales sit at fp8_tile_slot (fp8.cuh), so the attention kernel finds them without a table.
//
// Compile-time constants: LADDER_DTYPE (input), FP8Q_D (head dim, a multiple of 16 up to 256),
// FP8Q_BC (keys per V tile), FP8Q_HADAMARD (rotate Q and K), FP8Q_VARLEN (a packed batch).

#include "fp8.cuh"
#include "layout.cuh"
#include "types.cuh"
#include "varlen.cuh"

#ifndef FP8Q_D
#define FP8Q_D 128
#endif
#ifndef FP8Q_BC
#define FP8Q_BC 128
#endif
#ifndef FP8Q_HADAMARD
#define FP8Q_HADAMARD 0
#endif
#ifndef FP8Q_VARLEN
#define FP8Q_VARLEN 0
#endif

constexpr int D = FP8Q_D;
constexpr int BC = FP8Q_BC;
constexpr bool packed = FP8Q_VARLEN;
constexpr int PER_LANE = (D + 31) / 32;  // a row's values per lane: columns lane, lane + 32, …
constexpr int HADAMARD_BLOCK = D & -D;    // the largest power of two dividing D
constexpr int WARPS = 8;                  // 256 threads per block
static_assert(D % 16 == 0 && D <= 256, "e4m3 rows of whole 16-byte chunks, at most 256");

struct Fp8QuantizeParams {
    const elem_t* x;      // [batch, heads, n, D] at x_strides (packed: [1, heads, total, D])
    u8* out;              // quantize_rows: [batch, heads, n, D]; quantize_v: [batch, heads, D, n_pad]
    float* scale;         // [batch, heads, slots] (fp8_tile_slot)
    const float* signs;   // [D] random ±1 of the rotation (quantize_rows with FP8Q_HADAMARD)
    float norm;           // 1 / √HADAMARD_BLOCK, rounded to f32 as the CPU rung rounds it
    int heads;
    int n;                // rows per head: the length (packed: the token count)
    int rows;             // rows per tile
    int n_pad;            // quantize_v: keys per transposed row (slots · BC)
    int slots;            // tiles' scales per head (fp8_tile_slot)
    int keys;             // packed: 1 when the rows are K's or V's (the sequences' key ranges)
    float* p_lift;        // v_scales: [batch, heads, slots]
    float* o_scale;       // v_scales: [batch (sequences), heads]
    Strides x_strides;
    Varlen varlen;        // packed: the offsets, and the (sequence, tile) pairs blockIdx.x takes
};

#ifdef FP8Q_HOST_PARAMS_BYTES
static_assert(sizeof(Fp8QuantizeParams) == FP8Q_HOST_PARAMS_BYTES,
              "QuantizeParams (host, src/fa3/fp8.rs) mirrors Fp8QuantizeParams");
#endif

// The rows one block quantises: tile `block` of a sequence (its scale's slot, its first row and
// the end of its rows, counted in the head's rows).
struct RowTile {
    SeqBlock seq;
    int start;  // the sequence's first row (of Q, or of K and V)
    int row0, row_end;
    long long slot;
};
__device__ __forceinline__ RowTile row_tile(const Fp8QuantizeParams& p, int rows) {
    RowTile t;
    t.seq = packed ? packed_block(p.varlen, blockIdx.x) : fixed_block(blockIdx.z, blockIdx.x, p.n, p.n);
    t.start = p.keys ? t.seq.k_start : t.seq.q_start;
    const int len = p.keys ? t.seq.n_kv : t.seq.n_q;
    t.row0 = t.start + t.seq.block * rows;
    t.row_end = t.start + min((t.seq.block + 1) * rows, len);
    t.slot = fp8_tile_slot(packed, t.seq, t.start, rows, blockIdx.y, p.heads, p.slots);
    return t;
}

// In-place fast Walsh–Hadamard transform of each HADAMARD_BLOCK-column block of a row spread
// over the warp (lane holds columns lane + 32i). Butterfly h pairs columns c and c + h (c with bit
// h clear): (a, b) ↦ (a + b, a − b), for h = 1, 2, 4, … < HADAMARD_BLOCK in turn, as the CPU loop
// does. Below 32 the partner is another lane (columns past D hold zeros and pair only with each
// other: a block never straddles D).
__device__ __forceinline__ void walsh_hadamard(float (&x)[PER_LANE]) {
    const int lane = lane_id();
#pragma unroll
    for (int h = 1; h < 32 && h < HADAMARD_BLOCK; h *= 2)
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const float other = __shfl_xor_sync(0xffffffff, x[i], h);
            x[i] = (lane & h) ? ieee_sub(other, x[i]) : ieee_add(x[i], other);
        }
#pragma unroll
    for (int h = 1; 32 * h < HADAMARD_BLOCK; h *= 2)  // column distance 32h: within the lane
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if ((i & h) == 0) {
                const float a = x[i], b = x[i + h];
                x[i] = ieee_add(a, b);
                x[i + h] = ieee_sub(a, b);
            }
}

// Whether the lane's i-th value is a column of the row (D need not be a multiple of 32).
__device__ __forceinline__ bool in_row(int i) { return lane_id() + 32 * i < D; }

// Row `row` of head `head` (of batch entry `batch`) in f32, rotated when asked; zeros past D.
template <bool ROTATE>
__device__ __forceinline__ void load_row(const Fp8QuantizeParams& p, int batch, int head, int row,
                                         float (&x)[PER_LANE]) {
    const elem_t* src = head_base(p.x, p.x_strides, batch, head) + (long long)row * p.x_strides.row;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) x[i] = in_row(i) ? to_f32(src[lane_id() + 32 * i]) : 0.f;
    if (ROTATE) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (in_row(i)) x[i] = ieee_mul(x[i], p.signs[lane_id() + 32 * i]);
        walsh_hadamard(x);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) x[i] = ieee_mul(x[i], p.norm);
    }
}

// The largest magnitude in tile `t` of head `head` (NaN if any is); every thread gets it.
template <bool ROTATE>
__device__ float tile_amax(const Fp8QuantizeParams& p, const RowTile& t, int head) {
    __shared__ float warp_amax[WARPS];
    float m = 0.f;
    for (int row = t.row0 + warp_id(); row < t.row_end; row += WARPS) {
        float x[PER_LANE];
        load_row<ROTATE>(p, t.seq.batch, head, row, x);
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
    return m;
}

// Grid (tiles, heads, batch), 256 threads: one tile of p.rows rows of Q or K (packed: the tile
// table's pair blockIdx.x, batch 1).
extern "C" __global__ void __launch_bounds__(256) quantize_rows(const Fp8QuantizeParams p) {
    constexpr bool rotate = FP8Q_HADAMARD;
    const int head = blockIdx.y;
    const RowTile t = row_tile(p, p.rows);
    const float scale = e4m3_scale(tile_amax<rotate>(p, t, head));
    if (threadIdx.x == 0) p.scale[t.slot] = scale;
    u8* out = p.out + ((size_t)t.seq.batch * p.heads + head) * p.n * D;
    for (int row = t.row0 + warp_id(); row < t.row_end; row += WARPS) {
        float x[PER_LANE];
        load_row<rotate>(p, t.seq.batch, head, row, x);
        u8* dst = out + (size_t)row * D;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (in_row(i)) dst[lane_id() + 32 * i] = to_e4m3(ieee_div(x[i], scale));
    }
}

// Grid (tiles, heads_kv, batch), 256 threads: one tile of BC keys of V, transposed through shared
// memory (rows padded by 4 bytes, so that the lanes' byte writes of one key fall in different
// banks) and written as D rows of BC keys at the tile's slot; keys past the sequence are zeros.
extern "C" __global__ void __launch_bounds__(256) quantize_v(const Fp8QuantizeParams p) {
    constexpr int PITCH = BC + 4;
    __shared__ __align__(16) u8 vt[D * PITCH];
    const int head = blockIdx.y;
    const RowTile t = row_tile(p, BC);
    const float scale = p.scale[t.slot];  // the head's (v_scales)
    for (int key = warp_id(); key < BC; key += WARPS) {
        float x[PER_LANE];
        if (t.row0 + key < t.row_end) {
            load_row<false>(p, t.seq.batch, head, t.row0 + key, x);
        } else {
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) x[i] = 0.f;
        }
        const int slot = key / 32 * 32 + fp8_key_slot(key % 32);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (in_row(i)) vt[(lane_id() + 32 * i) * PITCH + slot] = to_e4m3(ieee_div(x[i], scale));
    }
    __syncthreads();
    // The tile's keys start at column (its slot within the head) · BC.
    const long long head_slot0 = ((long long)t.seq.batch * p.heads + head) * p.slots;
    u8* dst = p.out + ((size_t)t.seq.batch * p.heads + head) * D * (size_t)p.n_pad +
              (size_t)(t.slot - head_slot0) * BC;
    for (int w = threadIdx.x; w < D * BC / 4; w += blockDim.x) {
        const int c = w / (BC / 4), k = (w % (BC / 4)) * 4;
        *reinterpret_cast<u32*>(dst + (size_t)c * p.n_pad + k) =
            *reinterpret_cast<const u32*>(&vt[c * PITCH + k]);
    }
}

// Grid (tiles, heads_kv, batch), 256 threads: the largest magnitude of one tile of BC keys of V,
// into the tile's scale slot (v_scales turns the head's largest into its scale).
extern "C" __global__ void __launch_bounds__(256) v_amax(const Fp8QuantizeParams p) {
    const int head = blockIdx.y;
    const RowTile t = row_tile(p, BC);
    const float m = tile_amax<false>(p, t, head);
    if (threadIdx.x == 0) p.scale[t.slot] = m;
}

// Grid (heads_kv, batch), 32 threads: the scale of head blockIdx.x of batch entry (packed:
// sequence) blockIdx.y from its tiles' largest magnitudes (v_amax), written as every tile's
// scale, and the factors the attention kernel takes (see the top).
extern "C" __global__ void __launch_bounds__(32) v_scales(const Fp8QuantizeParams p) {
    const int head = blockIdx.x, b = blockIdx.y;
    SeqBlock seq = fixed_block(b, 0, p.n, p.n);
    if (packed) {
        seq.batch = 0;
        seq.seq = b;
        seq.k_start = p.varlen.cu_k[b];
        seq.n_kv = p.varlen.cu_k[b + 1] - seq.k_start;
    }
    const int tiles = (seq.n_kv + BC - 1) / BC;
    const long long first = fp8_tile_slot(packed, seq, seq.k_start, BC, head, p.heads, p.slots);
    float* scale = p.scale + first;
    float m = 0.f;
    for (int j = lane_id(); j < tiles; j += 32) m = amax_nan(m, scale[j]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        m = amax_nan(m, __shfl_xor_sync(0xffffffff, m, offset));
    // The head's scale, as the CPU rung takes it from the head's largest magnitude (an all-zero
    // head: 1); every tile's P is then lifted by exactly 2^8.
    const float s = e4m3_scale(m);
    for (int j = lane_id(); j < tiles; j += 32) {
        scale[j] = s;
        p.p_lift[first + j] = 8.f;
    }
    if (lane_id() == 0) p.o_scale[(size_t)b * p.heads + head] = ieee_mul(s, 1.f / 256.f);
}
