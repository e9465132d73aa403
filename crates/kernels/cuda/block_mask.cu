// The block mask of a mask modifier (mask_mod.cuh), FlexAttention's create_block_mask computed
// where the mask can run (the host cannot evaluate CUDA source), in two launches:
//   block_mask  one kind per tile of BR queries by BC keys of each (batch, head) the mask
//               distinguishes: each block classifies one tile, its threads evaluating the mask on
//               every pair inside the sequences and the band (causal, a window: mask.cuh), and
//               the block votes;
//   block_list  each row of kinds (a query tile's) becomes the list of its live key tiles that
//               the attention kernels walk (MaskArgs), one warp per row; or (by_key) each column
//               (a key tile's) the list of its live query tiles, for the backward's walk.
//
// Compile-time constants, set by the host for each variant:
//   BM_BR, BM_BC  the attention kernel's query rows and keys per tile
//   LADDER_MASK_MOD  the mask (always: this kernel exists for it)

#include "mask.cuh"
#include "mask_mod.cuh"

#ifndef BM_BR
#define BM_BR 128
#endif
#ifndef BM_BC
#define BM_BC 64
#endif

constexpr int BR = BM_BR, BC = BM_BC;
constexpr int THREADS = 256;

struct BlockMaskParams {
    MaskArgs mask;
    unsigned char* kinds;  // [batches][heads][query_tiles][key_tiles]
    int* live;             // block_list: [batches][heads][tiles][entries] (MaskArgs)
    int* live_count;       // block_list: [batches][heads][tiles]
    int heads;             // heads the mask distinguishes (1 when it never names h)
    int n_q;
    int n_kv;
    int query_tiles;
    int key_tiles;
    int rows;     // block_list: batches · heads · (query or key) tiles
    int by_key;   // block_list: a list per key tile of its query tiles (else per query tile)
    Band band;  // the attention's band: the causal mask as right = 0, a window, or UNBOUNDED sides
};

// Launch: grid (key_tiles, query_tiles, batches · heads), block (THREADS, 1, 1).
extern "C" __global__ void __launch_bounds__(THREADS)
block_mask(const __grid_constant__ BlockMaskParams p) {
    const int kt = blockIdx.x, qt = blockIdx.y;
    const int b = blockIdx.z / p.heads, h = blockIdx.z % p.heads;
    const int shift = p.n_kv - p.n_q;  // bottom-right alignment (mask.cuh)
    bool seen = false, hidden = false;
    for (int i = threadIdx.x; i < BR * BC; i += THREADS) {
        const int q = qt * BR + i / BC, k = kt * BC + i % BC;
        if (outside(q, k, p.n_q, p.n_kv, shift, p.band)) continue;
        const bool sees = mask_mod(MaskAt{b, h, q, k, p.n_q, p.n_kv}, p.mask);
        seen |= sees;
        hidden |= !sees;
    }
    seen = __syncthreads_or(seen);
    hidden = __syncthreads_or(hidden);
    if (threadIdx.x == 0)
        p.kinds[((size_t)blockIdx.z * p.query_tiles + qt) * p.key_tiles + kt] =
            !seen ? TILE_EMPTY : hidden ? TILE_PARTIAL : TILE_FULL;
}

// Launch: grid (ceil(rows / LIST_WARPS), 1, 1), block (32 · LIST_WARPS, 1, 1); after block_mask.
constexpr int LIST_WARPS = 4;
extern "C" __global__ void __launch_bounds__(32 * LIST_WARPS)
block_list(const __grid_constant__ BlockMaskParams p) {
    const int row = blockIdx.x * LIST_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= p.rows) return;
    // The row's tile and (batch, head), and where its entries lie among the kinds.
    const int tiles = p.by_key ? p.key_tiles : p.query_tiles;
    const int entries = p.by_key ? p.query_tiles : p.key_tiles;
    const size_t bh = row / tiles, tile = row % tiles;
    const unsigned char* kinds = p.kinds + bh * p.query_tiles * p.key_tiles +
                                 (p.by_key ? tile : tile * p.key_tiles);
    const int step = p.by_key ? p.key_tiles : 1;
    int* live = p.live + (size_t)row * entries;
    int count = 0;  // live tiles listed so far (the same in every lane)
    for (int e0 = 0; e0 < entries; e0 += 32) {
        const int e = e0 + lane;
        const unsigned char kind = e < entries ? kinds[(size_t)e * step] : TILE_EMPTY;
        const unsigned alive = __ballot_sync(0xffffffff, kind != TILE_EMPTY);
        if (kind != TILE_EMPTY)
            live[count + __popc(alive & ((1u << lane) - 1))] = 2 * e + (kind == TILE_PARTIAL);
        count += __popc(alive);
    }
    if (lane == 0) p.live_count[row] = count;
}
