// FlashAttention-3 forward (Shah et al. 2024) on Hopper: TMA, wgmma, warp specialisation,
// ping-pong between consumer warpgroups, and the intra-warpgroup overlap of Algorithm 2.
//
// The arithmetic is FA2's (fa2_forward.cu): per K/V tile, S = Q·Kᵀ, mask, online softmax,
// O += P·V, and O / l at the end. What changes is who does what, and when:
//
//   producer warpgroup (one thread)        consumer warpgroups (64 query rows each)
//   ------------------------------         ------------------------------------------------------
//   TMA: Q tile              -> q_full      wait q_full;  S_0 = Q·K_0ᵀ, softmax -> P_0
//   for each K/V tile j:                   for each K/V tile j ≥ 1:
//     wait k_empty[stage]                    P_{j-2}·V_{j-2} has landed: release V_{j-2},
//     TMA: K_j               -> k_full         round P_{j-1} into P's registers
//     wait v_empty[stage]                    wait k_full, v_full
//     TMA: V_j               -> v_full       S_j = Q·K_jᵀ                         (wgmma, async)
//                                            O *= alpha_{j-1}                     (under S_j)
//                                            O += P_{j-1}·V_{j-1}                 (wgmma, async)
//                                            softmax of S_j -> P_j, alpha_j       (under P·V)
//                                            release K_j
//                                          O += P_last·V_last; O / l; write O and lse
//
// O is written through shared memory where it fits (FA3_O_SMEM): each consumer warpgroup puts
// its 64 rows there and one of its threads hands them to the copy engine (a TMA store), so the
// warpgroup goes on to its next tile instead of waiting on 4-byte global stores.
//
// Shared memory holds the Q tile and STAGES stages of K and V, so the producer copies tiles
// j+1 … j+STAGES-1 while tile j is computed. The producer gives its registers to the consumers
// (setmaxnreg), who need them: S, P, the previous P and O all live in registers. Blocks are
// persistent: each walks many (query block, head, batch) tiles, and the producer loads the next
// tile's Q as soon as the consumers' last S = Q·Kᵀ of the current one is done.
//
// FP8 (FA3_FP8 = 1, the paper's §3.3): Q, K and V arrive in e4m3, quantised by
// fa3_fp8_quantize.cu with one scale per tile of rows (Q per BR rows, K and V per BC keys) and
// V transposed (e4m3 wgmma reads both operands K-major; fp8.cuh says why its keys are permuted).
// The scales enter where they cost nothing: Q's and K_j's multiply the softmax scale of tile j;
// V_j's divided by the head's largest one, times 2^8, multiplies P_j before it is rounded to
// e4m3 (so P sits in [0, 256] instead of [0, 1], where small probabilities would go subnormal) —
// as log2 of it added inside the exponential, FA3's "max offset"; the epilogue multiplies O
// back by the largest scale / 2^8. The row sum l is of the unscaled P, as everywhere else.
//
// Switches (compile time; the ablation of the FA3 paper, §4.2):
//   FA3_OVERLAP   1: intra-warpgroup overlap (Algorithm 2): the softmax of S_j runs while the
//                 tensor cores compute P_{j-1}·V_{j-1}, which is waited for at the top of the
//                 next round. 0: the warpgroup waits for both products before its softmax and
//                 packs P at the end of the round (a sequential round).
//   FA3_PINGPONG  1: consumer warpgroups take turns issuing their products (named barriers), so
//                 one's softmax runs under the other's products. 0: no ordering between them.
//
// Legend (tiles as in the CPU rungs):
//   BR  query rows per block (64 per consumer warpgroup)   BC  keys per K/V tile
//   q0  first query row of the block                       k0  first key of tile j
//   wg  consumer warpgroup (0 … CONSUMERS-1)               nt  8-column accumulator tile of S
//   h   row half of an accumulator tile (see mma.cuh)      dt  8-column accumulator tile of O
//
// Compile-time constants, set by the host for each variant:
//   FA3_D, FA3_BC, FA3_CONSUMERS, FA3_STAGES, FA3_CAUSAL, FA3_OVERLAP, FA3_PINGPONG, FA3_FP8,
//   FA3_O_SMEM (1: O through shared memory and a TMA store; 0: from registers to global memory),
//   FA3_VARLEN (1: a packed variable-length batch, varlen.cuh; O from registers, since a TMA
//   store of whole 64-row boxes would write over the next sequence's rows),
//   FA3_WINDOW (1: a sliding window, the band of mask.cuh in the parameters; each tile then walks
//   only the K/V tiles its rows' bands reach, from the first, not from 0),
//   LADDER_SCORE_MOD (a score modifier compiled in, score_mod.cuh: each S_j is scaled and
//   rewritten in softmax_step, before the mask),
//   LADDER_MASK_MOD (a mask modifier compiled in, mask_mod.cuh: producer and consumers walk the
//   K/V tiles the block mask lists as live, in its order, and softmax_step asks the mask per
//   entry on the partial ones; 16-bit, fixed-length batches),
//   FA3_HOST_SHARED_BYTES, FA3_HOST_PARAMS_BYTES (the host's sizes, checked below)

#include "barrier.cuh"
#include "fp8.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mask_mod.cuh"
#include "mma.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "types.cuh"
#include "varlen.cuh"
#include "wgmma.cuh"

#ifndef FA3_D
#define FA3_D 128
#endif
#ifndef FA3_BC
#define FA3_BC 128
#endif
#ifndef FA3_CONSUMERS
#define FA3_CONSUMERS 2
#endif
#ifndef FA3_STAGES
#define FA3_STAGES 2
#endif
#ifndef FA3_CAUSAL
#define FA3_CAUSAL 0
#endif
#ifndef FA3_OVERLAP
#define FA3_OVERLAP 1
#endif
#ifndef FA3_PINGPONG
#define FA3_PINGPONG 1
#endif
#ifndef FA3_FP8
#define FA3_FP8 0
#endif
#ifndef FA3_O_SMEM
#define FA3_O_SMEM 0
#endif
#ifndef FA3_VARLEN
#define FA3_VARLEN 0
#endif
#ifndef FA3_WINDOW
#define FA3_WINDOW 0
#endif
#ifndef FA3_DYNAMIC
#define FA3_DYNAMIC 0
#endif

constexpr int D = FA3_D;
constexpr int BC = FA3_BC;
constexpr int CONSUMERS = FA3_CONSUMERS;
constexpr int STAGES = FA3_STAGES;
constexpr bool causal = FA3_CAUSAL;
constexpr bool overlap = FA3_OVERLAP;
constexpr bool pingpong = FA3_PINGPONG && CONSUMERS > 1;
constexpr bool o_smem = FA3_O_SMEM;
constexpr bool packed = FA3_VARLEN;
constexpr bool windowed = FA3_WINDOW;
// Whether the blocks take their tiles from a counter (next_dynamic_tile) rather than in a fixed
// order (FA3_DYNAMIC, an experiment: see next_dynamic_tile): under a window, whose tiles are all
// about as long, and without the intra-warpgroup overlap (with it, the consumers' data-dependent
// end of the walk makes ptxas serialise every wgmma, C7518, even behind a vote).
constexpr bool dynamic = FA3_DYNAMIC && windowed && !overlap;
static_assert(!(packed && o_smem), "a packed batch stores O from registers (see FA3_VARLEN)");
static_assert(!(has_mask_mod && (FA3_FP8 || packed)), "a mask modifier: 16-bit, fixed length");
constexpr int BR = 64 * CONSUMERS;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int NT = BC / 8;  // 8-column accumulator tiles across one row of S
constexpr int DT = D / 8;   // 8-column accumulator tiles across one row of O (wgmma's N = D)
static_assert(D % 8 == 0 && D <= 256 && BC % 16 == 0 && BC <= 256,
              "tile shapes wgmma and TMA accept");

// The operands of the two products, and P as the second one's A operand in registers.
#if FA3_FP8
typedef u8 op_t;                // e4m3
typedef u32 PRegs[BC / 32][4];  // four e4m3 per register (fp8.cuh: pack_p_fp8)
static_assert(BC % 32 == 0, "FP8 tiles: whole k-steps of keys");
// The head dim as the products and tiles see it (layout.cuh's HeadDim, for e4m3): 32-wide
// k-steps, shared rows of whole 128-element (128-byte) column blocks.
constexpr int DK = round_up(D, 32);
constexpr int COLS = round_up(D, 128);
// Vᵀ's stage holds whole 128-key column blocks (one swizzle span each); with BC = 192 the last
// block's second half is the next tile's first keys, loaded and not read.
constexpr int VT_KEYS = (BC + 127) / 128 * 128;
constexpr int V_STAGE = D * VT_KEYS;
#else
typedef u16 op_t;          // fp16 or bf16
typedef u32 PRegs[NT][2];  // two 16-bit values per register (softmax.cuh: pack_p)
constexpr int DK = HeadDim<D>::DK;
constexpr int COLS = HeadDim<D>::COLS;
constexpr int V_STAGE = BC * COLS;
#endif
// The shared tiles hold COLS columns, the copy engine zero-fills those past D (they lie outside
// the tensor map's extent: nothing is read from memory), and S = Q·Kᵀ runs over DK of them.
// O's tile (16-bit, FA3_O_SMEM) has rows of O_COLS, whole 64-element blocks; the copy engine
// stores only its first D columns.
constexpr int O_COLS = round_up(D, 64);

// Registers per thread after the hand-over: 24 for the producer, the rest for the consumers
// (65536 per SM; one block per SM).
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 160 : 240;

// Named barriers of the ping-pong schedule: warpgroup wg waits on SCHEDULE_BARRIER + wg; those
// of the O tiles in shared memory, one per warpgroup: O_BARRIER + wg.
constexpr int SCHEDULE_BARRIER = 1;
constexpr int O_BARRIER = SCHEDULE_BARRIER + CONSUMERS;

// Q, K, V are described by tensor maps (tma.cuh), with their strides; O is [batch, heads_q,
// n_q, D] at o_strides and lse is [batch, heads_q, n_q] (contiguous), natural log. A packed batch
// (FA3_VARLEN) is one batch entry of total rows, its sequences' rows and lengths in varlen, lse
// [heads_q, total_q].
struct Fa3ForwardParams {
    TensorMap q;
    TensorMap k;
    TensorMap v;
    TensorMap o_map;  // O in boxes of 64 rows (FA3_O_SMEM)
    u16* o;
    float* lse;
    // FP8 only (null otherwise): the scales of fa3_fp8_quantize.cu, see the top of the file.
    const float* q_scale;  // [batch, heads_q, q blocks]
    const float* k_scale;  // [batch, heads_kv, K/V tiles]
    const float* p_lift;   // [batch, heads_kv, K/V tiles]: log2(2^8 · v_scale / the head's largest)
    const float* o_scale;  // [batch, heads_kv]: the head's largest v_scale / 2^8
    int batch;
    int heads_q;
    int heads_kv;
    int n_q;
    int n_kv;
    float scale_log2;  // softmax scale · log2(e)
    Band band;          // FA3_WINDOW only: the window's band (the causal mask folded in)
    int section_heads;  // causal tile order: (head, batch) pairs walked together (see below)
    Strides o_strides;  // O's rows, where the epilogue stores them from registers
    Varlen varlen;      // FA3_VARLEN only
    // FA3_DYNAMIC only: [0] the tiles taken past the first wave, [1] the blocks done; zero at
    // launch, and the last block out puts them back to zero.
    unsigned* tile_counter;
    ModifierArgs mods;  // the score modifier (LADDER_SCORE_MOD) and the sinks (score_mod.cuh)
    MaskArgs mask;      // the mask modifier and its block mask (LADDER_MASK_MOD; mask_mod.cuh)
};

// Shared memory (dynamic, 1024-byte aligned for the swizzle), in this order: with FA3_O_SMEM,
// O's tile (per consumer warpgroup, 64 rows in [64 × 64] column blocks with the copy engine's
// 128-byte swizzle, the swizzle the Q tile arrives in), then the rest.
template <bool STAGED>
struct OTile {
    u16 o[BR * O_COLS];
};
template <>
struct OTile<false> {};  // O from registers to global memory (Fa3Tiles::o_in_shared): no space
__device__ __forceinline__ u16* o_tile(OTile<true>& t) { return t.o; }
__device__ __forceinline__ u16* o_tile(OTile<false>&) { return nullptr; }
static_assert(BR * O_COLS * 2 % 1024 == 0, "the tiles after O stay 1024-byte aligned");

// One tile of the persistent blocks' work (tile_at below): a query block of one head.
struct Tile {
    int q0;       // first query row, within the sequence
    int head;
    int kv_end;   // one past the last K/V tile it needs (the first: first_kv_tile)
    SeqBlock seq;  // the sequence: where its rows lie, and its lengths
};

struct PipelineTiles : OTile<o_smem> {
    op_t q[BR * COLS];          // 128-byte column blocks of [BR rows × 128 bytes]
    op_t k[STAGES][BC * COLS];  // the same for BC rows, per stage
    op_t v[STAGES][V_STAGE];    // the same (FP8: V transposed, D rows × VT_KEYS keys)
    u64 q_full;                 // Q has landed
    u64 q_empty;                // every consumer warp is done with Q (its last S = Q·Kᵀ)
    u64 k_full[STAGES];         // K tile has landed
    u64 v_full[STAGES];
    u64 k_empty[STAGES];        // every consumer warp is done with the stage's K
    u64 v_empty[STAGES];
};

// A packed batch's variant has one more slot: its current tile, which the producer looks up and
// hands to the consumers (see consumer); so does one whose producer takes its tiles from a
// counter (FA3_DYNAMIC). The other variants work their tiles out with arithmetic alone and keep
// the layout without it.
struct PackedTiles : PipelineTiles {
    Tile tile;
};
template <bool PACKED>
struct Shared {
    typedef PipelineTiles type;
};
template <>
struct Shared<true> {
    typedef PackedTiles type;
};
typedef Shared<packed || dynamic>::type SharedTiles;
__device__ __forceinline__ Tile* tile_slot(PackedTiles& t) { return &t.tile; }
__device__ __forceinline__ Tile* tile_slot(PipelineTiles&) { return nullptr; }

// The host sizes the launch from its own copy of these layouts (Fa3Tiles::shared_bytes and
// ForwardParams in src/fa3.rs) and passes its figures in, so that the two cannot drift apart.
#ifdef FA3_HOST_SHARED_BYTES
static_assert(sizeof(SharedTiles) + 1024 == FA3_HOST_SHARED_BYTES,
              "Fa3Tiles::shared_bytes (host) is the shared tiles' size plus the alignment slack");
#endif
#ifdef FA3_HOST_PARAMS_BYTES
static_assert(sizeof(Fa3ForwardParams) == FA3_HOST_PARAMS_BYTES,
              "ForwardParams (host) mirrors Fa3ForwardParams");
#endif

// ---- the work: persistent blocks over (query block, head, batch) tiles -------------------------

// Each block walks tiles blockIdx.x, blockIdx.x + gridDim.x, … (one block per SM), so that while
// the consumers finish one tile the producer already loads the next. Without the mask,
// consecutive tiles are query blocks of one head, which share K and V in L2. Causal tiles are
// numbered longest first (query blocks from the end) within sections of section_heads (head,
// batch) pairs, and blocks take them in snake order (round r goes left to right when r is even,
// right to left when odd), so that each block's sum of tile lengths comes out about even. The
// sections keep a head's query blocks close in time: they all read its K and V, which the host
// sizes the sections to keep in L2 (a head's next query block comes section_heads tiles later).
//
// Under a mask modifier the host orders the tiles instead (mask_mod.rs's tile_order: head after
// head, and within every two rounds the most live key tiles first), causal or not, taken in the
// same snake order: a mask makes each query tile's walk as long as what it keeps (a document's
// first query tile walks one key tile, its last the whole document), which the causal numbering
// does not follow.
//
// A packed batch's tiles are the host's list of (sequence, query block) pairs, longest first,
// for each head: under the mask the heads of one query block are neighbours (a section of every
// head, as above), without it one head's list comes after the other's.

__device__ __forceinline__ int q_blocks(const Fa3ForwardParams& p) { return (p.n_q + BR - 1) / BR; }

// The band this variant applies: the host's window, or the causal mask (or none) compiled in.
__device__ __forceinline__ Band band(const Fa3ForwardParams& p) {
    return band_of<causal, windowed>(p.band);
}
// The K/V tiles that the rows q0 … q0 + BR − 1 of a sequence see.
__device__ __forceinline__ TileSpan kv_span(const Fa3ForwardParams& p, int q0, const SeqBlock& s) {
    return key_tile_span<BC>(q0, q0 + BR - 1, s.n_kv, s.n_kv - s.n_q, band(p));
}
// Where a tile's walk over K/V starts: 0, or with a window the first tile its band reaches
// (arithmetic, worked out again where needed rather than carried in Tile, whose size the packed
// variant's shared slot mirrors).
__device__ __forceinline__ int first_kv_tile(const Fa3ForwardParams& p, const Tile& t) {
    return windowed ? kv_span(p, t.q0, t.seq).first : 0;
}
// The K/V tiles a tile walks, in order: those its band reaches (from first_kv_tile), or the
// block mask's live ones.
__device__ __forceinline__ KeyWalk kv_walk(const Fa3ForwardParams& p, const Tile& t) {
    return key_walk(p.mask, TileSpan{first_kv_tile(p, t), t.kv_end}, t.seq.batch, t.head,
                    t.q0 / BR);
}
__device__ __forceinline__ int tile_count(const Fa3ForwardParams& p) {
    return packed ? p.varlen.n_tiles * p.heads_q : q_blocks(p) * p.heads_q * p.batch;
}

__device__ __forceinline__ Tile packed_tile_at(const Fa3ForwardParams& p, int index) {
    const int block = causal ? index / p.heads_q : index % p.varlen.n_tiles;
    Tile t;
    t.head = causal ? index % p.heads_q : index / p.varlen.n_tiles;
    t.seq = packed_block(p.varlen, block);
    t.q0 = t.seq.block * BR;
    t.kv_end = kv_span(p, t.q0, t.seq).end;
    return t;
}

__device__ __forceinline__ Tile tile_at(const Fa3ForwardParams& p, int index) {
    if (packed) return packed_tile_at(p, index);
    const int blocks = q_blocks(p), heads = p.heads_q * p.batch;
    int q_block, bh;
    if (has_mask_mod) {
        const int tile = p.mask.order[index];
        q_block = tile % blocks;
        bh = tile / blocks;
    } else if (causal) {
        const int section = index / (p.section_heads * blocks);
        const int first = section * p.section_heads;
        const int in_section = min(p.section_heads, heads - first);  // the last may be short
        const int r = index - first * blocks;
        q_block = blocks - 1 - r / in_section;
        bh = first + r % in_section;
    } else {
        q_block = index % blocks;
        bh = index / blocks;
    }
    Tile t;
    t.q0 = q_block * BR;
    t.head = bh % p.heads_q;
    t.seq = fixed_block(bh / p.heads_q, q_block, p.n_q, p.n_kv);
    t.kv_end = kv_span(p, t.q0, t.seq).end;
    return t;
}

// This block's first tile and the one after `index` (snake order for causal and under a mask, see
// above).
//
// Under a window the tiles are all about as long, and the static order that evens out the falling
// lengths of causal tiles leaves the blocks uneven at run time instead (the SMs' active cycles
// spread ±11 % at n = 16k). With FA3_DYNAMIC, after the first wave each producer takes the next
// untaken tile from a counter (as FA3's dynamic tile scheduler does), and a block that finishes
// early takes more; the producer hands each tile to its consumers in the tile slot, and a tile
// with q0 = −1 tells them the walk is over. It balances the SMs but has not yet been measured
// faster (docs/perf-notes.md, seventeenth session), so it is off unless the schedule asks.
__device__ __forceinline__ int first_tile() { return blockIdx.x; }
__device__ __forceinline__ int next_tile(int index) {
    if (!causal && !has_mask_mod) return index + gridDim.x;
    const int round = index / gridDim.x, lane = index % gridDim.x;  // lane: this block's place
    const int block = round % 2 == 0 ? lane : gridDim.x - 1 - lane;
    const int next = round + 1;
    return next * gridDim.x + (next % 2 == 0 ? block : gridDim.x - 1 - block);
}

__device__ __forceinline__ int next_dynamic_tile(const Fa3ForwardParams& p) {
    return gridDim.x + (int)atomicAdd(&p.tile_counter[0], 1u);
}

// A position in the K/V pipeline, counted across the block's tiles (barrier.cuh).
typedef PipelineState<STAGES> KvPosition;

// Where K/V tile j of the sequence starts in Vᵀ's columns (FP8: each tile at its slot).
__device__ __forceinline__ int vt_column(const SeqBlock& seq, int j) {
    return (fp8_first_slot(packed, seq, seq.k_start, BC) + j) * BC;
}

// ---- producer ---------------------------------------------------------------------------------

// One thread issues every copy in the consumers' order; a stage is reused once every consumer
// warp has released it (the empty barrier's phase of the previous round; on the first round the
// wait on parity 1 returns at once).
__device__ void producer(const Fa3ForwardParams& p, SharedTiles& t) {
    tma_prefetch(&p.q);
    tma_prefetch(&p.k);
    tma_prefetch(&p.v);
    KvPosition kv;
    int tiles_done = 0;
    for (int index = first_tile(); index < tile_count(p); ++tiles_done) {
        const Tile tile = tile_at(p, index);
        const int kv_head = tile.head / (p.heads_q / p.heads_kv);
        mbar_wait(&t.q_empty, (tiles_done & 1) ^ 1);
        if (packed || dynamic) *tile_slot(t) = tile;  // published by the arrival on q_full below
        mbar_expect_tx(&t.q_full, sizeof(t.q));
        const SeqBlock& seq = tile.seq;
        tma_load_tile<BR, COLS>(t.q, &p.q, &t.q_full, 0, seq.q_start + tile.q0, tile.head,
                                seq.batch);
        const KeyWalk walk = kv_walk(p, tile);
        for (int pos = walk.start(); pos < walk.end(); ++pos, ++kv.count) {
            const int j = walk.at(pos).index;
            const int stage = kv.stage(), free = kv.parity() ^ 1;
            const int k0 = seq.k_start + j * BC;
            mbar_wait(&t.k_empty[stage], free);
            mbar_expect_tx(&t.k_full[stage], sizeof(t.k[0]));
            tma_load_tile<BC, COLS>(t.k[stage], &p.k, &t.k_full[stage], 0, k0, kv_head, seq.batch);
            mbar_wait(&t.v_empty[stage], free);
            mbar_expect_tx(&t.v_full[stage], sizeof(t.v[0]));
#if FA3_FP8  // Vᵀ: keys are the columns, each K/V tile at its scale's slot (fp8.cuh)
            tma_load_tile<D, VT_KEYS>(t.v[stage], &p.v, &t.v_full[stage], vt_column(seq, j), 0,
                                      kv_head, seq.batch);
#else
            tma_load_tile<BC, COLS>(t.v[stage], &p.v, &t.v_full[stage], 0, k0, kv_head, seq.batch);
#endif
        }
        index = dynamic ? next_dynamic_tile(p) : next_tile(index);
    }
    if (dynamic) {
        // The end of the walk, for the consumers; then the last block out resets the counters.
        mbar_wait(&t.q_empty, (tiles_done & 1) ^ 1);
        tile_slot(t)->q0 = -1;
        mbar_arrive(&t.q_full);
        if (atomicAdd(&p.tile_counter[1], 1u) == gridDim.x - 1) {
            p.tile_counter[0] = 0;
            p.tile_counter[1] = 0;
        }
    }
}

// ---- consumer ---------------------------------------------------------------------------------

// Ping-pong: wait for this warpgroup's turn to issue products, and pass the turn on.
__device__ __forceinline__ void wait_turn(int wg) {
    if (pingpong) named_sync(SCHEDULE_BARRIER + wg, 256);
}
__device__ __forceinline__ void pass_turn(int wg) {
    if (pingpong) named_arrive(SCHEDULE_BARRIER + (wg + 1) % CONSUMERS, 256);
}

struct RowState {
    float m[2], l[2];  // running max (base 2) and sum of the thread's two rows
};

// The products and P's packing in the variant's operand type (16-bit, or e4m3 with its scales).
__device__ __forceinline__ void issue_qk(float (&s)[NT][4], const SharedTiles& t, int q_row0,
                                         int stage) {
#if FA3_FP8
    wgmma_qk_fp8<BR, BC, DK>(s, t.q, q_row0, t.k[stage]);
#else
    wgmma_qk<BR, BC, DK>(s, t.q, q_row0, t.k[stage]);
#endif
}
__device__ __forceinline__ void issue_pv(float (&o)[DT][4], const PRegs& pk, const SharedTiles& t,
                                         int stage) {
#if FA3_FP8
    wgmma_pv_fp8<BC, D>(o, pk, t.v[stage]);
#else
    wgmma_pv<BC, D>(o, pk, t.v[stage]);
#endif
}

// FP8: how many tiles' scales each head has (fp8_tile_slot in fp8.cuh): a fixed-length batch's
// tiles, or a packed batch's slots.
__device__ __forceinline__ int scale_slots(const Fa3ForwardParams& p, int rows, int total, int n) {
    return packed ? total / rows + p.batch : (n + rows - 1) / rows;
}
__device__ __forceinline__ int kv_slots(const Fa3ForwardParams& p) {
    return scale_slots(p, BC, p.varlen.total_k, p.n_kv);
}
// Where one head's scales are (FP8): the softmax scale times Q's for this query block, and where
// its K/V tiles' scales start in k_scale and p_lift (one index, not two pointers: registers are
// short in the consumers).
struct Scales {
    float q = 1.f;
    int kv_tile0 = 0;
    float o = 1.f;
};
__device__ __forceinline__ Scales scales_of(const Fa3ForwardParams& p, const Tile& tile,
                                            int kv_head) {
    Scales sc;
    if (FA3_FP8) {
        const SeqBlock& seq = tile.seq;
        const int q_slots = scale_slots(p, BR, p.varlen.total_q, p.n_q);
        sc.q = p.scale_log2 *
               p.q_scale[fp8_tile_slot(packed, seq, seq.q_start, BR, tile.head, p.heads_q, q_slots)];
        SeqBlock first = seq;
        first.block = 0;
        sc.kv_tile0 =
            (int)fp8_tile_slot(packed, first, seq.k_start, BC, kv_head, p.heads_kv, kv_slots(p));
        sc.o = p.o_scale[(size_t)seq.seq * p.heads_kv + kv_head];
    }
    return sc;
}
// The softmax scale of tile j (base 2), with the e4m3 scales of its Q and K tiles (FP8). The
// product is held at the smallest normal float: with tiny Q and K (bf16 holds 1e-20, whose block
// scales are ~1e-23) it falls below f32's range and flushes to 0, and a masked score (−inf) times
// 0 is NaN; the scores it scales are ~0 either way. A NaN scale (a NaN input) stays NaN.
__device__ __forceinline__ float score_scale(const Fa3ForwardParams& p, const Scales& sc, int j) {
    if (!FA3_FP8) return score_scale_log2(p.scale_log2);
    constexpr float SMALLEST_NORMAL = 1.17549435e-38f;
    const float c = sc.q * p.k_scale[sc.kv_tile0 + j];
    return c < SMALLEST_NORMAL ? SMALLEST_NORMAL : c;
}
// log2 of what P_j is lifted by before it is rounded to e4m3 (FP8), 0 otherwise.
__device__ __forceinline__ float p_lift(const Fa3ForwardParams& p, const Scales& sc, int j) {
    return FA3_FP8 ? p.p_lift[sc.kv_tile0 + j] : 0.f;
}
__device__ __forceinline__ void pack(const float (&s)[NT][4], PRegs& pk) {
#if FA3_FP8
    pack_p_fp8(s, pk);
#else
    pack_p(s, pk);
#endif
}

// score_mod(scale · S_j) where a modifier is compiled in, then mask S_j where needed (the
// sequence tail, the edges of the band, the mask modifier on a partial tile `kv`), then the online
// softmax in place: s becomes
// P = 2^(S·scale_log2 − m) in f32. Returns whether any row's max moved (alpha ≠ 1), in which
// case O must be rescaled by alpha.
__device__ __forceinline__ bool softmax_step(float (&s)[NT][4], float (&alpha)[2], RowState& st,
                                             const Fa3ForwardParams& p, const Tile& tile,
                                             float scale_log2, float lift, int row0, int k0,
                                             const KeyTile& kv) {
    const SeqBlock& seq = tile.seq;
    const Band band = ::band(p);
    if constexpr (has_score_mod) {
        const ScorePlace place{seq.seq, tile.head, seq.n_q, seq.n_kv};
#pragma unroll
        for (int h = 0; h < 2; ++h)
            modify_scores(s, h, row0 + (warp_id() % 4) * 16 + acc_row(2 * h), k0, place, p.mods);
    }
    const int shift = seq.n_kv - seq.n_q;
    if (k0 + BC > seq.n_kv || crosses_band(row0, row0 + 63, k0, k0 + BC - 1, shift, band)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + (warp_id() % 4) * 16 + acc_row(2 * h);
            mask_band(s, h, key_columns(row, k0, seq.n_kv, shift, band), band, LADDER_NEG_INF);
        }
    }
    if (has_mask_mod && kv.partial) {
        // The tile's bits where the block mask kept them, else the mask asked per entry.
        const MaskAt at{seq.batch, tile.head, 0, 0, seq.n_q, seq.n_kv};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + (warp_id() % 4) * 16 + acc_row(2 * h);
            if (kv.bits >= 0)
                mask_kept_bits<BC>(s, h, row - tile.q0, kv.bits, p.mask, BR, LADDER_NEG_INF);
            else
                mask_hidden(s, h, row, k0, at, p.mask, LADDER_NEG_INF);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
        alpha[h] = online_softmax_in_place(s, h, scale_log2, st.m[h], st.l[h], lift);
    return alpha[0] != 1.f || alpha[1] != 1.f;
}

__device__ __forceinline__ void rescale(float (&o)[DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] *= alpha[e / 2];
}

// O = acc / l (times V's scale, FP8) and lse = m·ln2 + ln l for the thread's rows, the head's sink
// folded in first; rows that saw no key (l = 0) get O = 0 and lse = −inf (σ with a sink), rows
// that met a NaN get NaN. O goes through shared
// memory and a TMA store (FA3_O_SMEM) or straight from registers.
__device__ void epilogue(const Fa3ForwardParams& p, SharedTiles& t, const Tile& tile, int wg,
                         const float (&o)[DT][4], const RowState& st, float o_scale, int row0) {
    const SeqBlock& seq = tile.seq;
    u16* gO = head_base(p.o, p.o_strides, seq.batch, tile.head);
    float* gL = p.lse + lse_offset(packed, p.varlen, seq, p.heads_q, tile.head, p.n_q);
    const bool issuer = threadIdx.x % 128 == 0;  // the warpgroup's thread that stores its O tile
    // (The FP8 path takes no sinks: compiled out, as its registers at d = 256 have no room.)
    const float sink = FA3_FP8 ? LADDER_NEG_INF : sink_log2(p.mods.sinks, tile.head);
    if constexpr (o_smem) {
        // The warpgroup's previous O tile must have left the buffer before it is written again.
        if (issuer) tma_store_wait_read();
        named_sync(O_BARRIER + wg, 128);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = (warp_id() % 4) * 16 + acc_row(2 * h);  // row within the warpgroup's 64
        const int row = row0 + r;
        float l = quad_sum(st.l[h]), m = st.m[h];
        const float alpha = fold_sink(m, l, sink);
        const float inv = l > 0.f ? alpha * o_scale / l : 0.f;
        if constexpr (o_smem) {
            // [64 × 64] column blocks with the copy engine's 128-byte swizzle (tma.cuh).
            u16* sO = o_tile(t) + wg * 64 * O_COLS;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int c = acc_col(dt, 0);
                *reinterpret_cast<u32*>(sO + (c / 64) * 64 * 64 + swz<64>(r, c % 64)) =
                    pack2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
            }
        } else if (row < seq.n_q) {
            u16* gRow = gO + row_offset<u16>(p.o_strides, seq.q_start + row);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<u32*>(gRow + acc_col(dt, 0)) =
                    pack2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
        }
        if (row < seq.n_q && lane_id() % 4 == 0)
            gL[row] = l == 0.f ? LADDER_NEG_INF : fma_rn(m, LADDER_LN2, logf(l));
    }
    if constexpr (o_smem) {
        tma_store_fence();
        named_sync(O_BARRIER + wg, 128);
        if (issuer) {
            tma_store_tile<64, O_COLS>(&p.o_map, o_tile(t) + wg * 64 * O_COLS, 0, row0,
                                       tile.head, seq.batch);
            tma_store_commit();
        }
    }
}

// With the overlap, at the top of round j (and once more after the last): P_{j-2}·V_{j-2} ran under
// the last softmax; wait for it to land, free V_{j-2}'s stage (where there was a V_{j-2}), and
// round P_{j-1} into the operand registers P_{j-2} held. The wait sits here, at the top of the
// round, and not at the end of the last one: there ptxas hoisted it above the softmax (SASS: the
// WARPGROUP.DEPBAR ahead of every MUFU.EX2), which then no longer overlapped the product; it does
// not move a wait across the loop's back edge.
__device__ __forceinline__ void land_product(float (&o)[DT][4], PRegs& pk, const float (&s)[NT][4],
                                             SharedTiles& t, const KvPosition& v_read,
                                             bool had_v_before) {
    wgmma_wait<0>();
    wgmma_hold(o);
    wgmma_hold(pk);
    if (had_v_before) release(&t.v_empty[KvPosition{v_read.count - 1}.stage()]);
    pack(s, pk);
}

// One consumer warpgroup's walk over the K/V tiles of one tile, for its 64 query rows (from
// row0); `kv` is the pipeline position, shared in lockstep by every consumer and the producer.
__device__ __forceinline__ void attend(const Fa3ForwardParams& p, SharedTiles& t, const Tile& tile,
                                       int wg, int row0, KvPosition& kv) {
    float o[DT][4];
    zero(o);
    RowState st = {{LADDER_NEG_INF, LADDER_NEG_INF}, {0.f, 0.f}};
    const int q_row0 = wg * 64;  // the warpgroup's rows inside the Q tile
    // The K/V tiles at the walk's positions first … first + n_tiles − 1 (n_tiles ≤ 0: none).
    const KeyWalk walk = kv_walk(p, tile);
    const int first = walk.start();
    const int n_tiles = walk.end() - first;
    const Scales sc = scales_of(p, tile, tile.head / (p.heads_q / p.heads_kv));

    // Algorithm 2. Prologue: S_0 and its softmax (O is still zero: nothing to rescale).
    float s[NT][4];  // S_j, then P_j in f32 until it is packed (overlap: at the next round's top)
    PRegs pk;        // P_{j-1}, the A operand of P_{j-1}·V_{j-1}
    float alpha[2];
    bool moved = false;  // whether the last softmax moved a row's max: O needs alpha
    KvPosition v_read = kv;  // V lags K by one tile
    if (n_tiles > 0) {
        const KeyTile kv_0 = walk.at(first);
        const float scale_0 = score_scale(p, sc, kv_0.index), lift_0 = p_lift(p, sc, kv_0.index);
        wait_turn(wg);
        mbar_wait(&t.k_full[kv.stage()], kv.parity());
        wgmma_fence();
        issue_qk(s, t, q_row0, kv.stage());
        wgmma_commit();
        pass_turn(wg);
        wgmma_wait<0>();
        wgmma_hold(s);
        release(&t.k_empty[kv.stage()]);
        ++kv.count;
        softmax_step(s, alpha, st, p, tile, scale_0, lift_0, row0, kv_0.index * BC, kv_0);
        if constexpr (!overlap) pack(s, pk);
    }
    for (int j = 1; j < n_tiles; ++j, ++kv.count, ++v_read.count) {
        // Which tile j is (a mask modifier's list), and its scales (FP8), are read from global
        // memory here, before the waits and the products, so that their latency hides under them
        // (after the waits' memory clobbers the compiler could not hoist the loads, and the
        // softmax would stall on them).
        const KeyTile kv_j = walk.at(first + j);
        const float scale_j = score_scale(p, sc, kv_j.index), lift_j = p_lift(p, sc, kv_j.index);
        if constexpr (overlap) land_product(o, pk, s, t, v_read, j >= 2);
        // Both tiles are waited for before the products are issued: ptxas serialises every
        // wgmma of a kernel that waits (branches) between the issues of one batch.
        mbar_wait(&t.k_full[kv.stage()], kv.parity());
        mbar_wait(&t.v_full[v_read.stage()], v_read.parity());
        wait_turn(wg);
        wgmma_fence();
        issue_qk(s, t, q_row0, kv.stage());  // S_j
        wgmma_commit();
        // O *= alpha_{j-1} while the tensor cores compute S_j, then O += P_{j-1}·V_{j-1}.
        if (__any_sync(0xffffffff, moved)) rescale(o, alpha);
        wgmma_fence();
        issue_pv(o, pk, t, v_read.stage());
        wgmma_commit();
        pass_turn(wg);
        // With the overlap, wait for S_j only: P_{j-1}·V_{j-1} still runs under the softmax
        // below. Without it (the ablation), wait for both products first.
        wgmma_wait<overlap ? 1 : 0>();
        wgmma_hold(s);
        release(&t.k_empty[kv.stage()]);
        if constexpr (!overlap) {
            wgmma_hold(o);
            wgmma_hold(pk);
            release(&t.v_empty[v_read.stage()]);  // V_{j-1}
        }
        moved = softmax_step(s, alpha, st, p, tile, scale_j, lift_j, row0, kv_j.index * BC, kv_j);
        if constexpr (!overlap) pack(s, pk);
    }
    // Every S = Q·Kᵀ of the tile is done: the producer may load the next tile's Q.
    release(&t.q_empty);
    if (n_tiles > 0) {
        if constexpr (overlap) land_product(o, pk, s, t, v_read, n_tiles >= 2);
        if (__any_sync(0xffffffff, moved)) rescale(o, alpha);
        mbar_wait(&t.v_full[v_read.stage()], v_read.parity());
        wgmma_fence();
        issue_pv(o, pk, t, v_read.stage());
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_hold(o);
        release(&t.v_empty[v_read.stage()]);
    }
    epilogue(p, t, tile, wg, o, st, sc.o, row0);
}

__device__ void consumer(const Fa3ForwardParams& p, SharedTiles& t, int wg) {
    // The first warpgroup moves first: the last gives it the turn (and takes the last turn back
    // at the end, so that every named barrier ends balanced).
    if (pingpong && wg == CONSUMERS - 1) named_arrive(SCHEDULE_BARRIER, 256);
    KvPosition kv;
    int tiles_done = 0;
    for (int index = first_tile(); dynamic || index < tile_count(p);
         index = next_tile(index), ++tiles_done) {
        // A packed batch's tile is read from shared memory, where the producer put it well
        // ahead: looked up here, its dependent loads (the tile table, then the offsets) would
        // stall every tile's start; with FA3_DYNAMIC it comes from the producer's counter. (A
        // fixed-length tile is arithmetic, done before the wait.)
        Tile tile;
        if (!dynamic) tile = tile_at(p, index);
        mbar_wait(&t.q_full, tiles_done & 1);
        if (packed || dynamic) tile = *tile_slot(t);
        // (A vote, so that ptxas sees a warp-uniform branch: a break it cannot prove uniform
        // makes it serialise every wgmma of the kernel, C7518.)
        if (dynamic && __any_sync(0xffffffff, tile.q0 < 0)) break;
        attend(p, t, tile, wg, tile.q0 + wg * 64, kv);
    }
    if (pingpong && wg == CONSUMERS - 1) named_sync(SCHEDULE_BARRIER, 256);
    // The last O tile's store must be done before the block's shared memory goes away.
    if (o_smem && threadIdx.x % 128 == 0) tma_store_wait_all();
}

// Launch: grid (min(tiles, SMs), 1, 1), block THREADS = 128·(CONSUMERS + 1), dynamic shared
// memory sizeof(SharedTiles) + 1024 (for the alignment).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
fa3_forward(const __grid_constant__ Fa3ForwardParams p) {
    extern __shared__ unsigned char smem_raw[];
    SharedTiles& t = *reinterpret_cast<SharedTiles*>(
        (reinterpret_cast<size_t>(smem_raw) + 1023) & ~static_cast<size_t>(1023));

    if (threadIdx.x == 0) {
        mbar_init(&t.q_full, 1);
        mbar_init(&t.q_empty, CONSUMERS * 4);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&t.k_full[s], 1);
            mbar_init(&t.v_full[s], 1);
            mbar_init(&t.k_empty[s], CONSUMERS * 4);
            mbar_init(&t.v_empty[s], CONSUMERS * 4);
        }
        mbar_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        warpgroup_reg_dealloc<PRODUCER_REGS>();
        if (threadIdx.x == 0) producer(p, t);
    } else {
        warpgroup_reg_alloc<CONSUMER_REGS>();
        consumer(p, t, warpgroup - 1);
    }
}
