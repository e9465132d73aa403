// Ring attention (ring.rs drives it): the sequence shared among ranks, each holding a slice of the
// queries and of the keys and values; the K/V slices travel round the ring, one hop per step, and
// every rank attends its queries to the slice it holds with the FA3 or FA2 kernel, which returns
// (O_s, lse_s). What is not attention lives here:
//
//   ring_gather  a rank's chunks of K or V, out of a tensor of any strides, into its packed slice
//                (the slice that travels);
//   ring_merge   one chunk pair's (O_s, lse_s) into its query rows' running (O, lse), in f32, by
//                combine.cuh's rule, as FlashDecoding merges its splits;
//   ring_finish  the running O into the output's dtype and layout, a sink joining once (and, in
//                the backward pass, each f32 gradient into its input's dtype and layout);
//   ring_add     one chunk pair's share of dQ, dK or dV into its rows' f32 sum (backward);
//   ring_lse_rows  a chunk's rows of the global lse, contiguous, for its pairs' backward.
//
// Each is a plain loop over the rows, 8 columns per thread: memory-bound, a small part of a
// step's time.
#include "combine.cuh"
#include "layout.cuh"
#include "types.cuh"

// A [batch, heads, rows, d] tensor of the element type at `base`, any strides (d contiguous).
struct RingTensor {
    const elem_t* base;
    Strides strides;
};

struct RingParams {
    RingTensor src;   // gather: K or V; merge: O_s of one chunk pair
    elem_t* dst;      // gather: the packed slice [batch, heads, capacity, d]; finish: O
    Strides dst_strides;  // finish: O's
    float* acc;       // the running O, [batch, heads_q, n, d], f32
    float* lse_acc;   // the running lse, [batch, heads_q, n]
    const float* lse_part;  // merge: lse_s of the chunk pair, [batch, heads_q, rows]
    float* lse_out;         // finish: lse, [batch, heads_q, n]; lse_rows: [batch, heads, rows]
    const float* sinks;     // finish: one logit per query head (natural log), or null
                            // (and lse_out null: a gradient's cast, no lse)
    int batch;
    int heads;
    int rows;      // rows of the chunk (gather, merge) or of the sequence (finish)
    int d;
    int n;         // the sequence's length: rows of acc and lse_acc
    int capacity;  // gather: rows of the packed slice
    int src_row;   // gather: the chunk's first row in src
    int at;        // gather: its first row in the slice; merge: in the sequence
};

// Element i of a [batch, heads, rows, d / 8] grid of 8-column groups: its coordinates.
struct Group {
    int b, h, r, c;
};
__device__ __forceinline__ Group group_of(long long i, const RingParams& p) {
    const int groups = p.d / 8;
    Group g;
    g.c = 8 * (int)(i % groups);
    i /= groups;
    g.r = (int)(i % p.rows);
    i /= p.rows;
    g.h = (int)(i % p.heads);
    g.b = (int)(i / p.heads);
    return g;
}

__device__ __forceinline__ long long groups(const RingParams& p) {
    return (long long)p.batch * p.heads * p.rows * (p.d / 8);
}

__device__ __forceinline__ const elem_t* at_row(const RingTensor& t, int b, int h, int r) {
    return t.base + head_offset<elem_t>(t.strides, b, h) + row_offset<elem_t>(t.strides, r);
}

// Launch: 256 threads, one per 8 columns of a row, rows src_row … src_row + rows − 1.
extern "C" __global__ void ring_gather(const __grid_constant__ RingParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < groups(p);
         i += (long long)gridDim.x * blockDim.x) {
        const Group g = group_of(i, p);
        const uint4* from = reinterpret_cast<const uint4*>(at_row(p.src, g.b, g.h, p.src_row + g.r) + g.c);
        const long long to = (((long long)g.b * p.heads + g.h) * p.capacity + p.at + g.r) * p.d + g.c;
        *reinterpret_cast<uint4*>(p.dst + to) = *from;
    }
}

// The running row's offset in acc (in floats) and in lse_acc.
__device__ __forceinline__ long long acc_row(const RingParams& p, int b, int h, int r) {
    return ((long long)b * p.heads + h) * p.n + r;
}

// Launch: 256 threads, a warp per row of the chunk pair's O_s (its lanes 8 columns each; the
// row's lse is read by every lane and written by lane 0 after the warp's reads, so a row never
// straddles two warps).
extern "C" __global__ void ring_merge(const __grid_constant__ RingParams p) {
    const int lane = lane_id();
    const long long rows = (long long)p.batch * p.heads * p.rows;
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; i < rows; i += warps) {
        const int r = (int)(i % p.rows), bh = (int)(i / p.rows);
        const int b = bh / p.heads, h = bh % p.heads;
        const long long row = acc_row(p, b, h, p.at + r);
        const float x0 = p.lse_acc[row], x1 = p.lse_part[i];
        // fmaxf skips a NaN; its weight below is NaN and turns the row NaN, as in the combine.
        const float m = fmaxf(x0, x1);
        if (m == LADDER_NEG_INF) continue;  // neither saw a key: O = 0, lse = −∞ stay
        const float w0 = combine_weight(x0, m), w1 = combine_weight(x1, m);
        const float l = w0 + w1, inv = combine_inverse(l);
        const int c = 8 * lane;
        if (c < p.d) {
            float4* acc = reinterpret_cast<float4*>(p.acc + row * p.d + c);
            const elem_t* o = at_row(p.src, b, h, r) + c;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float4 a = acc[half];
                a.x = (w0 * a.x + w1 * to_f32(o[4 * half + 0])) * inv;
                a.y = (w0 * a.y + w1 * to_f32(o[4 * half + 1])) * inv;
                a.z = (w0 * a.z + w1 * to_f32(o[4 * half + 2])) * inv;
                a.w = (w0 * a.w + w1 * to_f32(o[4 * half + 3])) * inv;
                acc[half] = a;
            }
        }
        __syncwarp();
        if (lane == 0) p.lse_acc[row] = combine_lse(m, l);
    }
}

// Launch: 256 threads, one per 8 columns of a row of O (rows = n).
extern "C" __global__ void ring_finish(const __grid_constant__ RingParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < groups(p);
         i += (long long)gridDim.x * blockDim.x) {
        const Group g = group_of(i, p);
        const long long row = acc_row(p, g.b, g.h, g.r);
        float scale = 1.f;
        if (p.lse_out) {  // the forward's output (a gradient's cast has no lse)
            float lse = p.lse_acc[row];
            if (p.sinks) {
                // The sink: one more partial, of lse_s = σ and O_s = 0 (a row that saw no key
                // keeps it: O = 0, lse = σ).
                const float sink = p.sinks[g.h], m = fmaxf(lse, sink);
                const float w0 = combine_weight(lse, m), l = w0 + combine_weight(sink, m);
                scale = w0 * combine_inverse(l);
                lse = combine_lse(m, l);
            }
            if (g.c == 0) p.lse_out[row] = lse;
        }
        const float* acc = p.acc + row * p.d + g.c;
        elem_t* out = p.dst + head_offset<elem_t>(p.dst_strides, g.b, g.h) +
                      row_offset<elem_t>(p.dst_strides, g.r) + g.c;
#pragma unroll
        for (int c = 0; c < 8; ++c) out[c] = from_f32(acc[c] * scale);
    }
}

// Launch: 256 threads, one per 8 columns of a row of the chunk pair's gradient (src, `rows` rows),
// added to rows at … of the f32 sum acc ([batch, heads, n, d]).
extern "C" __global__ void ring_add(const __grid_constant__ RingParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < groups(p);
         i += (long long)gridDim.x * blockDim.x) {
        const Group g = group_of(i, p);
        const elem_t* x = at_row(p.src, g.b, g.h, g.r) + g.c;
        float* acc = p.acc + acc_row(p, g.b, g.h, p.at + g.r) * p.d + g.c;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] += to_f32(x[c]);
    }
}

// Launch: 256 threads, one per row: lse_out[b, h, r] = lse_acc[b, h, at + r] for the chunk's rows.
extern "C" __global__ void ring_lse_rows(const __grid_constant__ RingParams p) {
    const long long rows = (long long)p.batch * p.heads * p.rows;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows;
         i += (long long)gridDim.x * blockDim.x) {
        const long long bh = i / p.rows;
        p.lse_out[i] = p.lse_acc[bh * p.n + p.at + i % p.rows];
    }
}
