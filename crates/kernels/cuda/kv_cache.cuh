// The KV cache of the decoding kernels (flash_decoding.cu, flash_decoding_pp.cu): where a
// sequence's keys live, contiguous or paged, which keys each split owns, and the copy of a tile
// of K and V into shared memory. Both kernel families read the cache through these helpers only,
// so a paged cache gives them the same bits as a contiguous one holding the same data.
#ifndef LADDER_KV_CACHE_CUH
#define LADDER_KV_CACHE_CUH

#include "copy.cuh"
#include "types.cuh"

// Keys that always share a page: pages hold a multiple of 16 keys and tiles start at multiples of
// 16, so a group of 16 keys never straddles two pages.
constexpr int KEY_GROUP = 16;

// ---- where the keys live: the one place the contiguous and the paged kernels differ -----------
//
// In both layouts the keys of one (sequence, kv head) lie in runs of consecutive rows of D
// elements: one run of `capacity` rows when the cache is contiguous, one run per page when it is
// paged. A page holds a multiple of 16 keys and a tile's groups of 16 keys start at multiples of
// 16, so each group lies inside one run: the copy asks where each group starts, and nothing else
// changes.
//
//   contiguous  K, V [batch, heads_kv, capacity, D]:
//               key j of (b, h) is row (b·heads_kv + h)·capacity + j
//   paged       K, V [num_pages, heads_kv, page_size, D] and page_table [batch, max_pages]:
//               key j of (b, h) is row (page·heads_kv + h)·page_size + j % page_size,
//               page = page_table[b][j / page_size]
//
// start(key, k_end, bad) is where the group of keys key … key + 15 begins (key a multiple of 16).
// Paged, a group at or past the chunk's end k_end is not looked up (the table may have no entry
// for it) and gets −1, and so does a group whose page-table entry is outside [0, num_pages): that
// entry is never followed, the group is not read, and `bad` is set, so that the block turns the
// sequence's rows into NaN rather than a wrong number. (The host checks every table whose entries
// it has seen; this guards tables that live only on the device.) Contiguous, it is arithmetic,
// never −1 (a group past the chunk gets an address that is never read).
//
// The constructor takes the kernel's parameter struct, which names the layout's numbers the same
// way in both kernel families (page_table, max_pages, heads_kv, log2_page, num_pages, capacity).
template <int D, bool PAGED>
struct CacheRows;

template <int D>
struct CacheRows<D, true> {
    const int* pages;  // this sequence's row of the page table
    int kv_head, heads_kv, log2_page, num_pages;

    template <typename Params>
    __device__ __forceinline__ CacheRows(const Params& p, int batch, int kv_head)
        : pages(p.page_table + (size_t)batch * p.max_pages),
          kv_head(kv_head),
          heads_kv(p.heads_kv),
          log2_page(p.log2_page),
          num_pages(p.num_pages) {}

    __device__ __forceinline__ long long start(int key, int k_end, bool& bad) const {
        if (key >= k_end) return -1;
        const int page = pages[key >> log2_page];
        if ((unsigned)page >= (unsigned)num_pages) {  // negative or past the last page
            bad = true;
            return -1;
        }
        const long long run = (long long)page * heads_kv + kv_head;
        return ((run << log2_page) + (key & ((1 << log2_page) - 1))) * D;
    }
};

template <int D>
struct CacheRows<D, false> {
    long long first;  // element offset of key 0 of this (sequence, kv head)

    template <typename Params>
    __device__ __forceinline__ CacheRows(const Params& p, int batch, int kv_head)
        : first(((long long)batch * p.heads_kv + kv_head) * p.capacity * D) {}

    __device__ __forceinline__ long long start(int key, int, bool&) const {
        return first + (long long)key * D;
    }
};

// ---- which keys a split owns --------------------------------------------------------------------
//
// Split s of a sequence of length len owns keys [s·chunk, min((s+1)·chunk, len)) with
// chunk = ceil(len / splits) rounded up to a multiple of BC, so chunks follow each sequence's own
// length (short sequences of a batch do not pay for the longest one) and only a sequence's last
// chunk ends inside a tile. Splits past the end get no key (begin = end = len, no tile).
struct KeyChunk {
    int begin, end, tiles;
};

template <int BC>
__device__ __forceinline__ KeyChunk key_chunk(int len, int splits, int split) {
    // 64-bit so that no product wraps.
    const long long per_split = ((long long)len + splits - 1) / splits;
    const long long chunk = (per_split + BC - 1) / BC * BC;
    const int begin = (int)min((long long)split * chunk, (long long)len);
    const int end = (int)min((long long)begin + chunk, (long long)len);
    return {begin, end, (end - begin + BC - 1) / BC};
}

// ---- the copy of one tile -----------------------------------------------------------------------
//
// Copy keys k0 … k0 + BC − 1 of K and V into one pipeline stage (swizzled tiles, as load_tile in
// copy.cuh): start[g] is where the tile's g-th group of 16 keys begins (CacheRows::start); keys at
// or past k_end and groups starting at −1 become zeros and are never read. Each thread copies one
// 16-byte column chunk of rows r, r + STEP, r + 2·STEP, …; STEP divides 16, so the group of each
// of those rows is a compile-time constant and a row never leaves its group.
template <int D, int BC, int THREADS, bool PAGED>
__device__ __forceinline__ void load_kv_tile(u16* sK, u16* sV, const u16* gK, const u16* gV,
                                             const long long (&start)[BC / KEY_GROUP], int k0,
                                             int k_end) {
    constexpr int CHUNKS = D / 8;           // 16-byte chunks per row
    constexpr int STEP = THREADS / CHUNKS;  // rows between one thread's copies
    static_assert(BC % KEY_GROUP == 0, "whole groups per tile");
    static_assert(THREADS % CHUNKS == 0 && KEY_GROUP % STEP == 0, "rows stay in their group");
    const int r = threadIdx.x / CHUNKS;
    const int col = (threadIdx.x % CHUNKS) * 8;
#pragma unroll
    for (int i = 0; i < BC / STEP; ++i) {
        const int row = r + i * STEP;         // tile row: key k0 + row
        const int g = i * STEP / KEY_GROUP;   // its group
        const long long src = start[g] + (long long)(row - g * KEY_GROUP) * D + col;
        const bool valid = k0 + row < k_end && (!PAGED || start[g] >= 0);
        cp_async_16(sK + swz<D>(row, col), gK + src, valid);
        cp_async_16(sV + swz<D>(row, col), gV + src, valid);
    }
}

#endif  // LADDER_KV_CACHE_CUH
