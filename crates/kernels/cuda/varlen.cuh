// Which query block of which sequence a block of threads computes, for fixed-length batches and
// for packed variable-length ones.
//
// A packed batch lays its sequences back to back in [total, heads, d] tensors: sequence b owns
// rows cu_q[b] .. cu_q[b + 1] of Q (and O, lse) and rows cu_k[b] .. cu_k[b + 1] of K and V, and is
// an attention problem of its own (its own tails, its own bottom-right causal diagonal). The host
// lists the work as (sequence, query block) pairs in the order it should run, longest first
// (SeqLens's tile table, src/varlen.rs), so a block's index names its query block directly: no
// block is launched for padding, and none searches for its sequence.
#ifndef LADDER_VARLEN_CUH
#define LADDER_VARLEN_CUH

struct Varlen {
    const int* cu_q;   // [batch + 1]
    const int* cu_k;   // [batch + 1]
    const int* tiles;  // [n_tiles][2]: (sequence, query block), in the order they run
    int n_tiles;
    int total_q;  // rows of Q: lse is [heads_q, total_q]
};

// One query block of one sequence, and where that sequence lies.
struct SeqBlock {
    int batch;    // the batch index the strides take (0 in a packed batch, one tensor of rows)
    int q_block;  // which BR rows of the sequence
    int q_start;  // the sequence's first row of Q, O and lse (0 in a fixed-length batch)
    int k_start;  // its first row of K and V
    int n_q;      // its lengths
    int n_kv;
};

// Query block `index` of the packed batch's tile table.
__device__ __forceinline__ SeqBlock packed_block(const Varlen& v, int index) {
    const int2 t = reinterpret_cast<const int2*>(v.tiles)[index];
    SeqBlock s;
    s.batch = 0;
    s.q_block = t.y;
    s.q_start = v.cu_q[t.x];
    s.n_q = v.cu_q[t.x + 1] - s.q_start;
    s.k_start = v.cu_k[t.x];
    s.n_kv = v.cu_k[t.x + 1] - s.k_start;
    return s;
}

// Query block `q_block` of batch entry `batch` of a fixed-length batch.
__device__ __forceinline__ SeqBlock fixed_block(int batch, int q_block, int n_q, int n_kv) {
    SeqBlock s;
    s.batch = batch;
    s.q_block = q_block;
    s.q_start = 0;
    s.k_start = 0;
    s.n_q = n_q;
    s.n_kv = n_kv;
    return s;
}

// Where lse's rows of (batch, head) start: [batch, heads_q, n_q] for a fixed-length batch,
// [heads_q, total_q] from the sequence's first row for a packed one.
__device__ __forceinline__ long long lse_offset(bool packed, const Varlen& v, const SeqBlock& s,
                                                int heads_q, int head, int n_q) {
    return packed ? (long long)head * v.total_q + s.q_start
                  : ((long long)s.batch * heads_q + head) * n_q;
}

#endif  // LADDER_VARLEN_CUH
