// The KV cache of the decoding kernels (flash_decoding.cu, flash_decoding_pp.cu): where a
// sequence's keys live, contiguous or paged, which keys each split owns, and the copy of a tile
// of K and V into shared memory. Both kernel families read the cache through these helpers only,
// so a paged cache gives them the same bits as a contiguous one holding the same data.
#ifndef LADDER_KV_CACHE_CUH
#define LADDER_KV_CACHE_CUH

#include "copy.cuh"
#include "decode.cuh"
#include "types.cuh"

// Keys that always share a page: pages hold a multiple of 16 keys and tiles start at multiples of
// 16, so a group of 16 keys never straddles two pages.
constexpr int KEY_GROUP = 16;

// ---- where the keys live: the one place the contiguous and the paged kernels differ -----------
//
// In both layouts the keys of one (sequence, kv head) lie in runs of rows of D elements, `row`
// elements apart (the cache's key stride: D for the [.., key, D] layouts, heads_kv·D for
// [.., key, heads_kv, D]): one run of `capacity` rows when the cache is contiguous, one run per
// page when it is paged. A page holds a multiple of 16 keys and a tile's groups of 16 keys start
// at multiples of 16, so each group lies inside one run: the copy asks where each group starts,
// and nothing else changes. With s = kv_strides (decode.cuh; K and V share them):
//
//   contiguous  K, V [batch, heads_kv, capacity, D]:
//               key j of (b, h) is at b·s.batch + h·s.head + j·s.row
//   paged       K, V [num_pages, heads_kv, page_size, D] and page_table [batch, max_pages]:
//               key j of (b, h) is at page·s.batch + h·s.head + (j % page_size)·s.row,
//               page = page_table[b][j / page_size]
//
// start(key, k_end, bad) is where the group of keys key … key + 15 begins (key a multiple of 16).
// Paged, a group at or past the chunk's end k_end is not looked up (the table may have no entry
// for it) and gets −1, and so does a group whose page-table entry is outside [0, num_pages): that
// entry is never followed, the group is not read, and `bad` is set, so that the block turns the
// sequence's rows into NaN rather than a wrong number. (The host checks every table whose entries
// it has seen; this guards tables that live only on the device.) Contiguous, it is arithmetic,
// never −1 (a group past the chunk gets an address that is never read).
template <bool PAGED>
struct CacheRows;

template <>
struct CacheRows<true> {
    const int* pages;  // this sequence's row of the page table
    const Strides& s;
    int kv_head, log2_page, num_pages;

    __device__ __forceinline__ CacheRows(const DecodeCall& c, int batch, int kv_head)
        : pages(c.page_table + (size_t)batch * c.max_pages),
          s(c.kv_strides),
          kv_head(kv_head),
          log2_page(c.log2_page),
          num_pages(c.num_pages) {}

    __device__ __forceinline__ long long start(int key, int k_end, bool& bad) const {
        if (key >= k_end) return -1;
        const int page = pages[key >> log2_page];
        if ((unsigned)page >= (unsigned)num_pages) {  // negative or past the last page
            bad = true;
            return -1;
        }
        return head_offset<u16>(s, page, kv_head) +
               row_offset<u16>(s, key & ((1 << log2_page) - 1));
    }
};

template <>
struct CacheRows<false> {
    const Strides& s;
    long long first;  // element offset of key 0 of this (sequence, kv head)

    __device__ __forceinline__ CacheRows(const DecodeCall& c, int batch, int kv_head)
        : s(c.kv_strides), first(head_offset<u16>(c.kv_strides, batch, kv_head)) {}

    __device__ __forceinline__ long long start(int key, int, bool&) const {
        return first + row_offset<u16>(s, key);
    }
};

// ---- which keys a split owns --------------------------------------------------------------------
//
// Split s of a sequence of length len owns keys [first + s·chunk, min(first + (s+1)·chunk, len))
// with chunk = ceil((len − first) / splits) rounded up to a multiple of BC, so chunks follow each
// sequence's own length (short sequences of a batch do not pay for the longest one) and only a
// sequence's last chunk ends inside a tile. Splits past the end get no key (begin = end = len, no
// tile). `first` (a multiple of BC) is 0 but under a sliding window, whose keys start later.
struct KeyChunk {
    int begin, end, tiles;
};

template <int BC>
__device__ __forceinline__ KeyChunk key_chunk(int len, int splits, int split, int first = 0) {
    // 64-bit so that no product wraps.
    const long long keys = (long long)len - first;
    const long long per_split = (keys + splits - 1) / splits;
    const long long chunk = (per_split + BC - 1) / BC * BC;
    const int begin = first + (int)min((long long)split * chunk, keys);
    const int end = (int)min((long long)begin + chunk, (long long)len);
    return {begin, end, (end - begin + BC - 1) / BC};
}

// ---- the copy of one tile -----------------------------------------------------------------------
//
// Copy keys k0 … k0 + BC − 1 of K and V into one pipeline stage (swizzled tiles of COLS columns,
// as load_tile in copy.cuh): start[g] is where the tile's g-th group of 16 keys begins
// (CacheRows::start) and `row` the elements between its keys; keys at or past k_end, groups
// starting at −1 and the columns at or past D become zeros and are never read from memory. Each
// thread copies one 16-byte column chunk of rows r, r + STEP, r + 2·STEP, …: LANES threads per
// row, the tile's chunks per row rounded up to a power of two (lanes past the row's last chunk
// copy nothing), so that STEP divides 16, the group of each of those rows is a compile-time
// constant and a row never leaves its group.
template <int BC, int THREADS, bool PAGED>
__device__ __forceinline__ void load_kv_tile(u16* sK, u16* sV, const u16* gK, const u16* gV,
                                             const long long (&start)[BC / KEY_GROUP],
                                             long long row, int k0, int k_end) {
    constexpr int CHUNKS = COLS / 8;  // 16-byte chunks per row of the tile
    constexpr int LANES = CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;
    constexpr int STEP = THREADS / LANES;  // rows between one thread's copies
    static_assert(BC % KEY_GROUP == 0, "whole groups per tile");
    static_assert(THREADS % LANES == 0 && KEY_GROUP % STEP == 0, "rows stay in their group");
    const int r = threadIdx.x / LANES;
    const int col = (threadIdx.x % LANES) * 8;
    if (LANES != CHUNKS && col >= COLS) return;  // a lane past the row's last chunk
    const bool col_in = col < D;
#pragma unroll
    for (int i = 0; i < BC / STEP; ++i) {
        const int key = r + i * STEP;        // tile row: key k0 + key
        const int g = i * STEP / KEY_GROUP;  // its group
        const long long src = start[g] + (long long)(key - g * KEY_GROUP) * row + col;
        const bool valid = col_in && k0 + key < k_end && (!PAGED || start[g] >= 0);
        cp_async_16(sK + swz<COLS>(key, col), gK + src, valid);
        cp_async_16(sV + swz<COLS>(key, col), gV + src, valid);
    }
}

// ---- the K/V pipeline of a split ----------------------------------------------------------------
//
// Both decoding kernels walk their split's tiles through one STAGES-deep cp.async pipeline: find
// where tile t's groups of keys lie (`starts`: CacheRows::start, which reads the page table when
// paged; a tile past the last starts past k_end), then copy it into stage t % STAGES and commit a
// group (`load`; a tile past the last commits an empty group, so that commit group g always holds
// tile g of the walk). The kernels call `starts` for tile j + STAGES − 1 before waiting for tile j,
// so that a page-table read overlaps the wait instead of delaying the copy. `bad` records a
// page-table entry outside the cache (this thread's; the kernels OR it over the block).
template <int BC, int THREADS, int STAGES, bool PAGED>
struct KvPipeline {
    static constexpr int GROUPS = BC / KEY_GROUP;
    const CacheRows<PAGED>& cache;
    const DecodeCall& call;
    u16* sK;  // [STAGES][BC][COLS]
    u16* sV;  // [STAGES][BC][COLS]
    int k_begin, k_end, n_tiles;
    bool bad;

    __device__ __forceinline__ KvPipeline(const CacheRows<PAGED>& cache, const DecodeCall& call,
                                          u16* sK, u16* sV, const KeyChunk& keys)
        : cache(cache),
          call(call),
          sK(sK),
          sV(sV),
          k_begin(keys.begin),
          k_end(keys.end),
          n_tiles(keys.tiles),
          bad(false) {}

    __device__ __forceinline__ void starts(int tile, long long (&start)[GROUPS]) {
#pragma unroll
        for (int g = 0; g < GROUPS; ++g)
            start[g] = cache.start(k_begin + tile * BC + g * KEY_GROUP, k_end, bad);
    }

    // The first STAGES − 1 tiles on their way: the walk's first STAGES − 1 commit groups, one tile
    // each, so that tile j has landed once at most STAGES − 2 younger groups are pending.
    __device__ __forceinline__ void prime() {
#pragma unroll
        for (int t = 0; t < STAGES - 1; ++t) {
            long long start[GROUPS];
            starts(t, start);
            load(t, start);
        }
    }

    __device__ __forceinline__ void load(int tile, const long long (&start)[GROUPS]) const {
        if (tile < n_tiles) {
            const int stage = tile % STAGES;
            load_kv_tile<BC, THREADS, PAGED>(sK + stage * BC * COLS, sV + stage * BC * COLS,
                                             call.k, call.v, start, call.kv_strides.row,
                                             k_begin + tile * BC, k_end);
        }
        cp_async_commit();
    }
};

#endif  // LADDER_KV_CACHE_CUH
