// What the two decoding kernel families (flash_decoding.cu, flash_decoding_pp.cu) share about a
// call: its parameters, the head dimension they compute with, and where a kv head's rows of new
// tokens lie in Q and O. Read it before either kernel; kv_cache.cuh holds the cache's side.
#ifndef LADDER_DECODE_CUH
#define LADDER_DECODE_CUH

#include "copy.cuh"
#include "layout.cuh"
#include "types.cuh"

#ifndef FD_D
#define FD_D 128
#endif
#ifndef FD_MAX_BATCH
#define FD_MAX_BATCH 256
#endif

// The head dimension (any multiple of 8 up to 256) and its padded widths (layout.cuh): the
// products run over DK columns (whole 16-wide k-steps), shared tiles have COLS-column rows (the
// swizzle's 64), and every column at or past D is a zero of the copy, never read from or written
// to memory.
constexpr int D = FD_D;
constexpr int DK = HeadDim<D>::DK;
constexpr int COLS = HeadDim<D>::COLS;

// The parameters of a call both families take, embedded in each kernel's own struct as `call`.
// Q and O are [batch, heads_q, n_new, D] with any strides (the head dimension contiguous), or, for
// packed new tokens (total_new > 0), [total_new, heads_q, D] seen as one batch entry of
// [heads_q, total_new, D], sequence b's new tokens being rows new_starts[b] … new_starts[b + 1]
// (lse then [heads_q, total_new]); K and V
// [batch, heads_kv, capacity, D] (contiguous cache) or [num_pages, heads_kv, page_size, D] (paged,
// with page_table [batch, max_pages]), any strides, the same for K and V; lengths[b] is the
// number of valid cache entries of sequence b (its new tokens included). The lengths travel
// inside the struct (a launch copies it to constant memory), so a call needs no host-to-device
// copy; the host launches batches of more than FD_MAX_BATCH sequences in chunks.
struct DecodeCall {
    const u16* q;
    const u16* k;
    const u16* v;
    const int* page_table;  // paged only
    u16* o;
    float* lse;             // [batch, heads_q, n_new] or [heads_q, total_new], natural log
    Strides q_strides;      // (batch, head, token)
    Strides o_strides;      // (batch, head, token)
    Strides kv_strides;     // (batch or page, kv head, key)
    int heads_q;
    int heads_kv;
    int n_new;
    int max_pages;   // paged: entries per row of page_table
    int num_pages;   // paged: pages in k and v
    int log2_page;   // paged: page_size = 2^log2_page
    int splits;
    int row_blocks;  // blocks per (split, kv head, sequence): ceil(R / rows per block)
    float scale_log2;  // softmax scale · log2(e)
    int total_new;     // packed new tokens: rows of Q (lse's row length); 0: n_new per sequence
    int lengths[FD_MAX_BATCH];
    // Packed: each sequence's first row of Q and O, counted from the launch's first sequence
    // (the host advances the pointers to it), and one past the last sequence's last.
    int new_starts[FD_MAX_BATCH + 1];
};

// ---- GQA packing: the rows of one kv head -------------------------------------------------------
//
// The blocks of a kv head hold every query head of its group and every new token of its
// sequence: R = group · n_new rows, row r being query head kv_head·group + r / n_new and new token
// r % n_new. In Q and O, whose strides are the caller's, row r lies at head_offset + row_offset
// (layout.cuh) of that head and token. Each row also has a number among the launch's output rows,
// which indexes the workspaces of partials and FlashDecoding++'s fallback flags:
//   n_new per sequence   (batch·heads_kv + kv_head)·R + r, the [batch, heads_q, n_new] order,
//                        which is lse's too;
//   packed new tokens    token·heads_q + head (token-major, so that the rows of a launch's
//                        sequences are one range), while lse is [heads_q, total_new].
struct HeadRows {
    int batch;   // the batch index of Q's and O's strides (0 for packed new tokens)
    int seq;     // the sequence within the launch
    int kv_head, heads_kv, heads_q, group;
    int n_new;   // this sequence's new tokens (packed: 0 … 16)
    int token0;  // its first row of Q and O (packed; 0 otherwise)
    int total;   // packed: lse's row length; 0 otherwise

    __device__ __forceinline__ HeadRows(const DecodeCall& c, int batch, int kv_head)
        : batch(c.total_new > 0 ? 0 : batch),
          seq(batch),
          kv_head(kv_head),
          heads_kv(c.heads_kv),
          heads_q(c.heads_q),
          group(c.heads_q / c.heads_kv),
          n_new(c.total_new > 0 ? c.new_starts[batch + 1] - c.new_starts[batch] : c.n_new),
          token0(c.total_new > 0 ? c.new_starts[batch] : 0),
          total(c.total_new) {}

    // Rows of the kv head: group · n_new.
    __device__ __forceinline__ int count() const { return group * n_new; }
    __device__ __forceinline__ int head(int r) const { return kv_head * group + r / n_new; }
    __device__ __forceinline__ int token(int r) const { return token0 + r % n_new; }
    // Row r's number among the launch's output rows (the workspaces, the fallback flags).
    __device__ __forceinline__ size_t flat(int r) const {
        if (total > 0) return (size_t)token(r) * heads_q + head(r);
        return ((size_t)seq * heads_kv + kv_head) * count() + r;
    }
    // Row r's element of lse.
    __device__ __forceinline__ size_t lse_index(int r) const {
        return total > 0 ? (size_t)head(r) * total + token(r) : flat(r);
    }
    // Where row r lies in a tensor of strides s (Q or O), in elements.
    __device__ __forceinline__ long long at(const Strides& s, int r) const {
        return head_offset<u16>(s, batch, head(r)) + row_offset<u16>(s, token(r));
    }
};

// The same for a row given by its number among the launch's output rows (FlashDecoding++'s
// combine, one warp per row): its element offset in a tensor of strides s, and its lse element.
struct OutputRow {
    long long at;
    size_t lse;

    __device__ __forceinline__ OutputRow(const DecodeCall& c, const Strides& s, size_t row) {
        int batch, head, token;
        if (c.total_new > 0) {  // token-major
            batch = 0, token = (int)(row / c.heads_q), head = (int)(row % c.heads_q);
            lse = (size_t)head * c.total_new + token;
        } else {  // [batch, heads_q, n_new]
            const size_t bh = row / c.n_new;
            token = (int)(row % c.n_new);
            batch = (int)(bh / c.heads_q), head = (int)(bh % c.heads_q);
            lse = row;
        }
        at = head_offset<u16>(s, batch, head) + row_offset<u16>(s, token);
    }
};

// Copy rows 0 … n − 1 of a kv head's block, rows r0 … r0 + n − 1 of Q (HeadRows::at), into a
// swizzled shared tile of ROWS rows and COLS columns (load_rows in copy.cuh): every column at or
// past D is a zero, as are the rows at or past n.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_head_rows(u16* smem, const u16* q, const Strides& s,
                                               const HeadRows& rows, int r0, int n) {
    load_rows<ROWS, COLS, COLS, D, THREADS>(
        smem, q, [&](int r) { return rows.at(s, r0 + r); }, n);
}

// ---- the last block of a group of splits ---------------------------------------------------------
//
// Both decoders combine a group's splits (the same rows of one kv head of one sequence, every
// split) in the last of its blocks to finish. Each block counts itself in on counters[group] once
// its partials are written: after a barrier, one thread adds 1 with a device-scope atomic that
// releases the block's stores (PTX release patterns are cumulative: the barrier orders the other
// threads' stores before it) and acquires the other splits'. The block that brings the count to
// `splits` is the last: every other split's partials are in memory, and it reads them from L2
// (ld.cg: the SM's L1 is not coherent). It puts the counter back to 0, so the host zeroes the
// counters once, not per call. One thread's atomic instead of every thread's __threadfence
// (fence.sc) then a relaxed atomic: a shorter wait at the end of every call (docs/perf-notes.md,
// eighth session).

// Adds 1 to *counter and returns the old value, as a device-scope release and acquire.
__device__ __forceinline__ unsigned count_in(unsigned* counter) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(old)
                 : "l"(counter)
                 : "memory");
    return old;
}

// The splits whose partials a combine reads at once: each read is an L2 round trip that the tail
// of the call waits for, so as many go out together as registers allow.
constexpr int COMBINE_BATCH = 16;

// Whether this block is the last of its group of splits to finish: counters has one per (sequence,
// kv head, row block) of the launch (grid (splits · row_blocks, heads_kv, batch)). Every thread
// of the block calls it, after writing its partials; the barrier after the count orders thread
// 0's acquire before every thread's reads of the other splits' partials.
__device__ bool last_to_finish(unsigned* counters, const DecodeCall& call, int row_block) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        const size_t group = ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * call.row_blocks;
        unsigned* counter = counters + group + row_block;
        last = count_in(counter) == (unsigned)call.splits - 1;
        if (last) atomicExch(counter, 0u);  // every split has counted: ready for the next launch
    }
    __syncthreads();
    return last;
}

#endif  // LADDER_DECODE_CUH
