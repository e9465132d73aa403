// What the backward kernels of both rungs share: their parameter block and the layout of the
// f32 arrays they exchange.
//
// FA2's backward (fa2_backward.cu) is four kernels: prep (D = rowsum(dO ∘ O), lse in base 2,
// dQ's accumulator zeroed), the main kernel (dK, dV and, atomically, dQ), the deterministic dQ
// pass, and finish (scale, sum over a GQA group, convert). FA3's backward (fa3_backward.cu)
// replaces only the main kernel: prep, the dQ pass and finish are FA2's, launched with this same
// block, so the two main kernels read and write the same arrays in the same layout.
#ifndef LADDER_BACKWARD_CUH
#define LADDER_BACKWARD_CUH

#include "layout.cuh"
#include "mask.cuh"
#include "mask_mod.cuh"
#include "types.cuh"
#include "score_mod.cuh"
#include "varlen.cuh"

// One parameter block for every entry point. Q, O, dO, dQ are [batch, heads_q, n_q, D]; K, V,
// dK, dV are [batch, heads_kv, n_kv, D]; 16-bit elements, any strides but the last (layout.cuh).
// A packed batch is one batch entry: n_q = total_q, n_kv = total_k, each sequence's rows and
// lengths in varlen (its rows of lse2 and D start at head·n_q_pad + its first row). The f32
// arrays are the kernels' own, contiguous.
struct BackwardParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* o;
    const u16* d_o;
    const float* lse;  // forward's lse, natural log, [batch·heads_q·n_q]
    float* delta;      // [batch·heads_q·n_q_pad]
    float* lse2;       // [batch·heads_q·n_q_pad], lse·log2(e)
    float* dq_acc;     // [batch, heads_q, n_q, D] f32
    float* dk_acc;     // [batch, heads_q, n_kv, D] f32 (per query head), or null (dkv_written)
    float* dv_acc;     // [batch, heads_q, n_kv, D] f32 (per query head), or null (dkv_written)
    u16* dq;           // outputs
    u16* dk;
    u16* dv;
    float* dsinks;     // [heads_q] f32, with attention sinks only (fa2_backward_sinks)
    int batch;
    int heads_q;
    int heads_kv;
    int n_q;
    int n_kv;
    int n_q_pad;  // n_q rounded up to a multiple of BR
    // The main kernel wrote dK and dV, scaled, in 16 bits (FA3's, without GQA): dk_acc and dv_acc
    // are null and finish converts dQ only.
    int dkv_written;
    float scale;
    float scale_log2;  // scale · log2(e)
    Band band;         // FA2_WINDOW only: the sliding window (mask.cuh)
    Strides q_strides;
    Strides k_strides;
    Strides v_strides;
    Strides o_strides;
    Strides d_o_strides;
    Strides dq_strides;
    Strides dk_strides;
    Strides dv_strides;
    Varlen varlen;  // FA2_VARLEN only
    ModifierArgs mods;  // the score modifier (LADDER_SCORE_MOD) and the sinks (score_mod.cuh)
    // The mask modifier (LADDER_MASK_MOD, mask_mod.cuh; FA2 only), its block mask as lists for
    // each kernel's walk: the main kernel's key tiles' query tiles, the dQ pass's query tiles' key
    // tiles.
    MaskArgs mask;
    MaskArgs mask_dq;
};

// Where the rows of (sequence `s`, query head `head`) start in lse2 and D (padded per head to
// n_q_pad rows): after batch entry and head for a fixed-length batch, at the sequence's first row
// for a packed one.
template <bool PACKED>
__device__ __forceinline__ long long stat_rows(const BackwardParams& p, const SeqBlock& s,
                                               int head) {
    return PACKED ? (long long)head * p.n_q_pad + s.q_start
                  : ((long long)s.batch * p.heads_q + head) * p.n_q_pad;
}

// Add two adjacent floats to global memory atomically: one vector reduction on Hopper (half the
// atomic operations of dQ's accumulation), two scalar ones before it.
__device__ __forceinline__ void red_add2(float* addr, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(x), "f"(y));
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(x));
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr + 1), "f"(y));
#endif
}

#endif  // LADDER_BACKWARD_CUH
