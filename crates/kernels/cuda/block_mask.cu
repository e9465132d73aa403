// The block mask of a mask modifier (mask_mod.cuh), FlexAttention's create_block_mask computed
// where the mask can run (the host cannot evaluate CUDA source), in two launches:
//   block_mask  one kind per tile of BR queries by BC keys of each (batch, head) the mask
//               distinguishes: each block classifies one tile, its threads evaluating the mask on
//               every pair inside the sequences and the band (causal, a window: mask.cuh), and
//               the block votes;
//   block_list  each row of kinds (a query tile's) becomes the list of its live key tiles that
//               the attention kernels walk (MaskArgs), one warp per row; or (by_key) each column
//               (a key tile's) the list of its live query tiles, for the backward's walk.
// block_mask also keeps the mask's bits of partial tiles, while there is room (bits_capacity
// tiles): it has asked the mask on every pair of the tile anyway, and an attention kernel that
// reads a partial tile's bits (one word per 32 keys of a row) does not ask it again per entry.
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
    int* slots;            // [batches][heads][query_tiles][key_tiles]: a partial tile's bits, or −1
    int* live_slots;       // block_list: the slots of the live entries, beside `live`
    unsigned* bits;        // [bits_capacity][BR][BITS_WORDS] (mask_mod.cuh)
    unsigned* bits_used;   // slots taken so far (one counter, zero before block_mask)
    int bits_capacity;
};

// Launch: grid (key_tiles, query_tiles, batches · heads), block (THREADS, 1, 1).
// Each warp takes one 32-key word of a row at a time (lane = key), so that a ballot is the word of
// bits; pairs outside the sequences or the band count as seen (the band masks them anyway).
extern "C" __global__ void __launch_bounds__(THREADS)
block_mask(const __grid_constant__ BlockMaskParams p) {
    constexpr int WORDS = BITS_WORDS<BC>;
    __shared__ unsigned words[BR * WORDS];
    __shared__ int slot;
    const int kt = blockIdx.x, qt = blockIdx.y;
    const int b = blockIdx.z / p.heads, h = blockIdx.z % p.heads;
    const int shift = p.n_kv - p.n_q;  // bottom-right alignment (mask.cuh)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    bool seen = false, hidden = false;
    for (int w = warp; w < BR * WORDS; w += THREADS / 32) {
        const int c = (w % WORDS) * 32 + lane;
        const int q = qt * BR + w / WORDS, k = kt * BC + c;
        bool sees = true;
        if (c < BC && !outside(q, k, p.n_q, p.n_kv, shift, p.band)) {
            sees = mask_mod(MaskAt{b, h, q, k, p.n_q, p.n_kv}, p.mask);
            seen |= sees;
            hidden |= !sees;
        }
        const unsigned word = __ballot_sync(0xffffffff, sees);
        if (lane == 0) words[w] = word;
    }
    seen = __syncthreads_or(seen);
    hidden = __syncthreads_or(hidden);
    const size_t tile = ((size_t)blockIdx.z * p.query_tiles + qt) * p.key_tiles + kt;
    if (threadIdx.x == 0) {
        const bool partial = seen && hidden;
        p.kinds[tile] = !seen ? TILE_EMPTY : partial ? TILE_PARTIAL : TILE_FULL;
        int taken = -1;
        if (partial) {
            const unsigned at = atomicAdd(p.bits_used, 1u);
            if (at < (unsigned)p.bits_capacity) taken = (int)at;
        }
        slot = taken;
        p.slots[tile] = taken;
    }
    __syncthreads();
    if (slot >= 0)
        for (int w = threadIdx.x; w < BR * WORDS; w += THREADS)
            p.bits[(size_t)slot * BR * WORDS + w] = words[w];
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
    const int* slots = p.slots + (kinds - p.kinds);
    int* live = p.live + (size_t)row * entries;
    int* live_slots = p.live_slots + (size_t)row * entries;
    int count = 0;  // live tiles listed so far (the same in every lane)
    for (int e0 = 0; e0 < entries; e0 += 32) {
        const int e = e0 + lane;
        const unsigned char kind = e < entries ? kinds[(size_t)e * step] : TILE_EMPTY;
        const unsigned alive = __ballot_sync(0xffffffff, kind != TILE_EMPTY);
        if (kind != TILE_EMPTY) {
            const int at = count + __popc(alive & ((1u << lane) - 1));
            live[at] = 2 * e + (kind == TILE_PARTIAL);
            live_slots[at] = slots[(size_t)e * step];
        }
        count += __popc(alive);
    }
    if (lane == 0) p.live_count[row] = count;
}
