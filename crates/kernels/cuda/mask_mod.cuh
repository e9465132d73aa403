// Mask modifiers: which keys a query sees, as a function of the pair's place (FlexAttention's
// mask_mod), and the block mask that lets a kernel skip what a mask empties. A kernel compiled
// with LADDER_MASK_MOD includes the header the host generates from a ladder_kernels::MaskMod
// (mask_mod_body.cuh); without it mask_mod keeps every pair and has_mask_mod folds every use away.
//
// The block mask is computed before the attention kernel, by block_mask.cu at the attention
// kernel's own tile sizes: one kind per tile of BR queries by BC keys. A tile whose pairs inside
// the band the mask all keeps is FULL (no per-entry test), one it all hides is EMPTY (never
// loaded), the rest PARTIAL (mask_mod per entry, after the band's own mask).
#ifndef LADDER_MASK_MOD_CUH
#define LADDER_MASK_MOD_CUH

#include "mma.cuh"

// A mask's ints and tables (its names for them are bound in mask_mod_body.cuh) and the block
// mask: kinds [batch or 1][heads or 1][query tiles][key tiles], a batch or head the mask never
// names sharing one row (stride 0).
struct MaskArgs {
    const float* tables[2];
    int ints[4];
    const unsigned char* blocks;
    int block_batch_stride;
    int block_head_stride;
    int key_tiles;
    int pad;
};

// Where a pair sits, as the mask's body sees it.
struct MaskAt {
    int b;
    int h;
    int q_idx;
    int kv_idx;
    int n_q;
    int n_kv;
};

constexpr unsigned char TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2;

#ifdef LADDER_MASK_MOD
constexpr bool has_mask_mod = true;
#include "mask_mod_body.cuh"
#else
constexpr bool has_mask_mod = false;
__device__ __forceinline__ bool mask_mod(const MaskAt&, const MaskArgs&) { return true; }
#endif

// The kind of key tile `kt` for query tile `qt` of (batch, head): FULL without a mask.
__device__ __forceinline__ unsigned char tile_kind(const MaskArgs& m, int batch, int head, int qt,
                                                   int kt) {
    if constexpr (!has_mask_mod) return TILE_FULL;
    const size_t at = (size_t)batch * m.block_batch_stride + (size_t)head * m.block_head_stride +
                      (size_t)qt * m.key_tiles + kt;
    return m.blocks[at];
}

// Set the entries of row half h of an accumulator tile (row `row`, first key k0) that the mask
// hides to `value`. Rows and keys past the sequence's end are clamped to its last, so that the
// body may index tables by them; those entries are masked by the band's test anyway.
template <int NT>
__device__ __forceinline__ void mask_hidden(float (&s)[NT][4], int h, int row, int k0, MaskAt at,
                                            const MaskArgs& m, float value) {
    if constexpr (has_mask_mod) {
        at.q_idx = min(row, at.n_q - 1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                at.kv_idx = min(k0 + acc_col(nt, e), at.n_kv - 1);
                if (!mask_mod(at, m)) s[nt][e] = value;
            }
    }
}

#endif  // LADDER_MASK_MOD_CUH
