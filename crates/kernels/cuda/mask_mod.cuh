// Mask modifiers: which keys a query sees, as a function of the pair's place (FlexAttention's
// mask_mod), and the block mask that lets a kernel skip what a mask empties. A kernel compiled
// with LADDER_MASK_MOD includes the header the host generates from a ladder_kernels::MaskMod
// (mask_mod_body.cuh); without it mask_mod keeps every pair and has_mask_mod folds every use away.
//
// The block mask is computed before the attention kernel, by block_mask.cu at the attention
// kernel's own tile sizes: one kind per tile of BR queries by BC keys. A tile whose pairs inside
// the band the mask all keeps is FULL (no per-entry test), one it all hides is EMPTY (never
// loaded), the rest PARTIAL (mask_mod per entry, after the band's own mask). The kernels read it
// as FlexAttention's BlockMask keeps it: per query tile, the list of its live (full or partial)
// key tiles in order, so that a walk jumps from one live tile to the next with one load.
#ifndef LADDER_MASK_MOD_CUH
#define LADDER_MASK_MOD_CUH

#include "mask.cuh"
#include "mma.cuh"

// A mask's ints and tables (its names for them are bound in mask_mod_body.cuh) and the block
// mask: per query tile of each (batch, head) the mask distinguishes, the count of live key tiles
// and their list (key_tiles entries per row, 2·tile + 1 for a partial tile, 2·tile for a full
// one). A batch or head the mask never names shares its rows (stride 0).
struct MaskArgs {
    const float* tables[2];
    int ints[4];
    const int* live;        // [rows][key_tiles]
    const int* live_count;  // [rows]
    int batch_rows;         // rows between batch entries, and between heads
    int head_rows;
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

// The key tiles a query tile's walk visits, in order: every tile of the band's span, or with a
// mask modifier the block mask's live ones. walk[i] is the i-th: its index, and whether the mask
// must be asked per entry.
struct KeyTile {
    int index;
    bool partial;
};
struct KeyWalk {
    const int* live;  // the query tile's list (mask modifier only)
    int first;        // the span's first tile (without one)
    int count;        // tiles to visit
    __device__ __forceinline__ KeyTile operator[](int i) const {
        if constexpr (has_mask_mod) {
            const int entry = live[i];
            return {entry >> 1, (entry & 1) != 0};
        } else {
            return {first + i, false};
        }
    }
};

// The walk of query tile qt of (batch, head) whose band reaches the key tiles of `span`.
__device__ __forceinline__ KeyWalk key_walk(const MaskArgs& m, TileSpan span, int batch, int head,
                                            int qt) {
    if constexpr (has_mask_mod) {
        const size_t row = (size_t)batch * m.batch_rows + (size_t)head * m.head_rows + qt;
        return {m.live + row * m.key_tiles, 0, m.live_count[row]};
    } else {
        return {nullptr, span.first, max(span.end - span.first, 0)};
    }
}

// Set the entries of row half h of an accumulator tile (row `row`, first key k0) that the mask
// hides to `value`. Rows and keys past the sequence's end are clamped to its last, so that the
// body may index tables by them; those entries are masked by the band's test anyway. The mask is
// asked in a loop that is not unrolled, one bit per entry, and the bits applied after: unrolled,
// the body's loads for every column of the tile are live at once, and FA3's consumers, whose
// registers S, P and O already fill, spill.
template <int NT>
__device__ __forceinline__ void mask_hidden(float (&s)[NT][4], int h, int row, int k0, MaskAt at,
                                            const MaskArgs& m, float value) {
    if constexpr (has_mask_mod) {
        static_assert(2 * NT <= 64, "one bit per entry of the thread's row half");
        at.q_idx = min(row, at.n_q - 1);
        const int k_thread = k0 + acc_col(0, 0);  // the thread's first key; then +1, +8, +9, …
        unsigned long long hidden = 0;
#pragma unroll 1
        for (int c = 0; c < 2 * NT; ++c) {
            at.kv_idx = min(k_thread + (c / 2) * 8 + c % 2, at.n_kv - 1);
            if (!mask_mod(at, m)) hidden |= 1ull << c;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if ((hidden >> (2 * nt + e)) & 1) s[nt][2 * h + e] = value;
    }
}

#endif  // LADDER_MASK_MOD_CUH
