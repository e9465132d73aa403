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
// mask as lists: per query tile of each (batch, head) the mask distinguishes, the count of live key
// tiles and their list (row_len entries per row, 2·tile + 1 for a partial tile, 2·tile for a full
// one); or, for a walk over query tiles (the backward's, keys outer), per key tile its live query
// tiles. A batch or head the mask never names shares its rows (stride 0).
struct MaskArgs {
    const float* tables[2];
    int ints[4];
    const int* live;        // [rows][row_len]
    const int* live_count;  // [rows]
    int batch_rows;         // rows between batch entries, and between heads
    int head_rows;
    int row_len;
    int pad;
    const int* order;  // FA3's forward: the query tiles (b·heads + h)·tiles + tile in the order
                       // its blocks take them (mask_mod.rs's tile_order), or null
    const int* live_slots;  // beside `live`: where a partial tile's bits are kept, or −1
    const unsigned* bits;   // [slots][BR][BITS_WORDS<BC>]: bit c of a row's word w is key 32·w + c
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

// The 32-bit words of one row of a partial tile's kept bits (block_mask.cu): a row starts a word.
template <int BC>
constexpr int BITS_WORDS = (BC + 31) / 32;

#ifdef LADDER_MASK_MOD
constexpr bool has_mask_mod = true;
#include "mask_mod_body.cuh"
#else
constexpr bool has_mask_mod = false;
__device__ __forceinline__ bool mask_mod(const MaskAt&, const MaskArgs&) { return true; }
#endif

// The tiles a walk visits, in order (a query tile's key tiles, or a key tile's query tiles): every
// tile of the band's span, or with a mask modifier the block mask's live ones. walk[i] is the
// i-th: its index, and whether the mask must be asked per entry.
struct KeyTile {
    int index;
    bool partial;
    int bits;  // a partial tile's kept bits (block_mask.cu), or −1: ask the mask per entry
};
struct KeyWalk {
    const int* live;  // the tile's list (mask modifier only)
    const int* slots;  // its bits' slots, beside it
    // Positions first … last − 1 name the tiles: the tile itself without a mask modifier (a loop
    // over them is the plain loop over the span), the list's entry with one (first = 0). An empty
    // walk may have last < first.
    int first;
    int last;
    __device__ __forceinline__ int start() const { return first; }
    __device__ __forceinline__ int end() const { return last; }
    __device__ __forceinline__ bool empty() const { return last <= first; }
    __device__ __forceinline__ int count() const { return empty() ? 0 : last - first; }
    __device__ __forceinline__ KeyTile at(int pos) const {
        if constexpr (has_mask_mod) {
            const int entry = live[pos];
            return {entry >> 1, (entry & 1) != 0, slots[pos]};
        } else {
            return {pos, false, -1};
        }
    }
    // The i-th tile of the walk.
    __device__ __forceinline__ KeyTile operator[](int i) const { return at(start() + i); }
};

// The walk of tile `tile` of (batch, head) whose band reaches the tiles of `span` (m's lists in
// the walk's direction).
__device__ __forceinline__ KeyWalk key_walk(const MaskArgs& m, TileSpan span, int batch, int head,
                                            int tile) {
    if constexpr (has_mask_mod) {
        const size_t row = (size_t)batch * m.batch_rows + (size_t)head * m.head_rows + tile;
        return {m.live + row * m.row_len, m.live_slots + row * m.row_len, 0, m.live_count[row]};
    } else {
        return {nullptr, nullptr, span.first, span.end};
    }
}

// Set the entries e0 … e0 + EN − 1 of every 8-column tile nt of an accumulator (its row half
// e0 / 2, or EN = 4: all of them) that the mask hides to `value`; query_of(nt, e) and key_of(nt,
// e) place an entry (S with queries on the rows, Sᵀ in the backward with keys on them). Queries
// and keys past the sequence's end are clamped to its last, so that the body may index tables by
// them; those entries are masked by the band's test anyway. The mask is asked in a loop that is
// not unrolled, one bit per entry, and the bits applied after: unrolled, the body's loads for
// every entry are live at once, and FA3's consumers, whose registers S, P and O already fill,
// spill. (hidden_entries and clear_hidden are the two halves, for a kernel that asks before its
// register peak and applies after.)
template <int EN, int NT, class QueryOf, class KeyOf>
__device__ __forceinline__ unsigned long long hidden_entries(int e0, QueryOf query_of, KeyOf key_of,
                                                             MaskAt at, const MaskArgs& m) {
    static_assert(EN * NT <= 64, "one bit per entry");
    unsigned long long hidden = 0;
    if constexpr (has_mask_mod) {
#pragma unroll 4
        for (int c = 0; c < EN * NT; ++c) {
            const int nt = c / EN, e = e0 + c % EN;
            at.q_idx = min(query_of(nt, e), at.n_q - 1);
            at.kv_idx = min(key_of(nt, e), at.n_kv - 1);
            if (!mask_mod(at, m)) hidden |= 1ull << c;
        }
    }
    return hidden;
}
// Set the entries whose bit is set in `hidden` (hidden_entries') to `value`.
template <int EN, int NT>
__device__ __forceinline__ void clear_hidden(float (&s)[NT][4], int e0, unsigned long long hidden,
                                             float value) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < EN; ++i)
            if ((hidden >> (EN * nt + i)) & 1) s[nt][e0 + i] = value;
}
template <int EN, int NT, class QueryOf, class KeyOf>
__device__ __forceinline__ void mask_entries(float (&s)[NT][4], int e0, QueryOf query_of,
                                             KeyOf key_of, MaskAt at, const MaskArgs& m,
                                             float value) {
    if constexpr (has_mask_mod)
        clear_hidden<EN>(s, e0, hidden_entries<EN, NT>(e0, query_of, key_of, at, m), value);
}

// mask_entries on row half h of S (queries on the rows): row `row`, first key k0.
template <int NT>
__device__ __forceinline__ void mask_hidden(float (&s)[NT][4], int h, int row, int k0, MaskAt at,
                                            const MaskArgs& m, float value) {
    mask_entries<2>(s, 2 * h, [&](int, int) { return row; },
                    [&](int nt, int e) { return k0 + acc_col(nt, e); }, at, m, value);
}

// Row half h of S (queries on the rows; the 8-column tiles nt of BC keys) from a partial tile's kept
// bits: `row` is the thread's row of the row half within the tile, `slot` the tile's bits. The
// thread's keys of 8-column tile nt are 8·nt + 2·(lane % 4) + {0, 1}: all in word nt / 4, so the
// row's words are loaded once and each entry is a shift.
template <int BC, int NT>
__device__ __forceinline__ void mask_kept_bits(float (&s)[NT][4], int h, int row, int slot,
                                               const MaskArgs& m, int br, float value) {
    constexpr int WORDS = BITS_WORDS<BC>;
    const unsigned* at = m.bits + ((size_t)slot * br + row) * WORDS;
    unsigned w[WORDS];
#pragma unroll
    for (int i = 0; i < WORDS; ++i) w[i] = at[i];
    const int lane_col = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i)
            if (!((w[nt / 4] >> ((nt % 4) * 8 + lane_col + i)) & 1)) s[nt][2 * h + i] = value;
}

// hidden_entries' bits for Sᵀ (the backward's: keys on the rows, EN = 4 entries of each of the
// NT 8-column tiles of queries) from a partial tile's kept bits instead of the mask: `key` is the
// thread's first key row within the tile (its other is key + 8, in the same 32-key word, since a
// warp's 16 rows start on a multiple of 16), `slot` the tile's bits, `br` their rows (queries).
// One word per query column of the thread: 2·NT loads.
template <int BC, int NT>
__device__ __forceinline__ unsigned long long hidden_kept_bits_t(int key, int slot,
                                                                 const MaskArgs& m, int br) {
    static_assert(4 * NT <= 64, "one bit per entry");
    constexpr int WORDS = BITS_WORDS<BC>;
    const unsigned* at = m.bits + (size_t)slot * br * WORDS + key / 32;
    const int lane_col = 2 * (threadIdx.x % 4);
    unsigned long long hidden = 0;
    // Column c of the thread's 2·NT: 8-column tile c / 2, entries e = c % 2 (key) and 2 + c % 2
    // (key + 8). Not unrolled: unrolled, the loads are live at once and FA3's backward with a
    // score modifier spills.
#pragma unroll 1
    for (int c = 0; c < 2 * NT; ++c) {
        const int nt = c / 2, i = c % 2;
        const unsigned w = ~at[(nt * 8 + lane_col + i) * WORDS] >> (key % 32);
        hidden |= (unsigned long long)(w & 1) << (4 * nt + i);
        hidden |= (unsigned long long)((w >> 8) & 1) << (4 * nt + 2 + i);
    }
    return hidden;
}

#endif  // LADDER_MASK_MOD_CUH
