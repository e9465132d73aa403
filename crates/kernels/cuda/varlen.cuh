// Which query block of which sequence a block of threads computes, for fixed-length batches and
// for packed variable-length ones.
//
// A packed batch lays its sequences back to back in [total, heads, d] tensors: sequence b owns
// rows cu_q[b] .. cu_q[b + 1] of Q (and O, lse) and rows cu_k[b] .. cu_k[b + 1] of K and V, and is
// an attention problem of its own (its own tails, its own bottom-right causal diagonal). The host
// lists the work as (sequence, block) pairs in the order it should run, most work first
// (SeqLens's tile tables, src/varlen.rs), so a block's index names its rows directly: no block is
// launched for padding, and none searches for its sequence. A block is BR query rows in the
// forward kernels and the backward's dQ pass, BC keys in the backward's main kernel.
#ifndef LADDER_VARLEN_CUH
#define LADDER_VARLEN_CUH

struct Varlen {
    const int* cu_q;   // [batch + 1]
    const int* cu_k;   // [batch + 1]
    const int* tiles;  // [n_tiles][2]: (sequence, block), in the order they run
    int n_tiles;
    int total_q;  // rows of Q: lse is [heads_q, total_q]
    int total_k;  // rows of K and V
};

// One block of rows of one sequence, and where that sequence lies.
struct SeqBlock {
    int batch;    // the batch index the strides take (0 in a packed batch, one tensor of rows)
    int seq;      // the sequence: its index in the packed batch, or the batch index
    int block;    // which block of the sequence's query rows (or, backward, of its keys)
    int q_start;  // the sequence's first row of Q, O and lse (0 in a fixed-length batch)
    int k_start;  // its first row of K and V
    int n_q;      // its lengths
    int n_kv;
};

// Block `index` of the packed batch's tile table.
__device__ __forceinline__ SeqBlock packed_block(const Varlen& v, int index) {
    const int2 t = reinterpret_cast<const int2*>(v.tiles)[index];
    SeqBlock s;
    s.batch = 0;
    s.seq = t.x;
    s.block = t.y;
    s.q_start = v.cu_q[t.x];
    s.n_q = v.cu_q[t.x + 1] - s.q_start;
    s.k_start = v.cu_k[t.x];
    s.n_kv = v.cu_k[t.x + 1] - s.k_start;
    return s;
}

// Block `block` of batch entry `batch` of a fixed-length batch.
__device__ __forceinline__ SeqBlock fixed_block(int batch, int block, int n_q, int n_kv) {
    SeqBlock s;
    s.batch = batch;
    s.seq = batch;
    s.block = block;
    s.q_start = 0;
    s.k_start = 0;
    s.n_q = n_q;
    s.n_kv = n_kv;
    return s;
}

// The query block this thread block computes, in a kernel launched with one block per query block
// (x) and head (y): a packed batch's from its table; a fixed-length batch's block x of batch entry
// z, causal ones in reverse (the blocks at the end of a sequence have the most key tiles, and
// launched first, the last wave is made of short blocks).
template <bool PACKED, bool CAUSAL>
__device__ __forceinline__ SeqBlock query_block(const Varlen& v, int n_q, int n_kv) {
    return PACKED ? packed_block(v, blockIdx.x)
                  : fixed_block(blockIdx.z, CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x, n_q,
                                n_kv);
}

// Where lse's rows of (batch, head) start, and those of any array of query rows laid out like it
// (the backward's D, lse2 and dQ accumulator): [batch, heads_q, n_q] for a fixed-length batch,
// [heads_q, total_q] from the sequence's first row for a packed one.
__device__ __forceinline__ long long lse_offset(bool packed, const Varlen& v, const SeqBlock& s,
                                                int heads_q, int head, int n_q) {
    return packed ? (long long)head * v.total_q + s.q_start
                  : ((long long)s.batch * heads_q + head) * n_q;
}

// Where the key rows of (batch, head) start in a per-query-head array of key rows (the backward's
// dK and dV accumulators): [batch, heads_q, n_kv] for a fixed-length batch, [heads_q, total_k]
// from the sequence's first key for a packed one.
__device__ __forceinline__ long long key_rows_offset(bool packed, const Varlen& v,
                                                     const SeqBlock& s, int heads_q, int head,
                                                     int n_kv) {
    return packed ? (long long)head * v.total_k + s.k_start
                  : ((long long)s.batch * heads_q + head) * n_kv;
}

#endif  // LADDER_VARLEN_CUH
