// FlashDecoding (Dao, Haziza, Massa, Sizov 2023): decoding against a KV cache, with the keys split
// across thread blocks. Read it next to the CPU rung, crates/reference/src/flash_decoding.rs.
//
// A decoding step has a few new query tokens per sequence (n_new = 1 … 16) and a long KV cache.
// FA2 gives one block to each (query block, head, batch): at batch 1 that is a few dozen blocks,
// each streaming a whole KV cache alone, on a GPU with 132 SMs. Here one kernel,
// flash_decoding_split, grid (splits · row_blocks, heads_kv, batch), does both phases of the rung:
//
//   phase 1: block (s, kv_head, b) runs FA2 over the keys of chunk s of sequence b and writes the
//       partial output O_s (normalised within the chunk, f32) and lse_s (natural log, −inf when
//       the chunk gives the row no key) to workspaces;
//   phase 2, the combine: the last of the splits' blocks to finish (a counter per group of
//       splits, see "The combine" below) merges them,
//       lse = ln Σ_s exp(lse_s),  O = Σ_s exp(lse_s − lse) · O_s,  in the inputs' dtype.
//   With one split there is nothing to merge: the block writes O and lse itself.
//
// The combine could be a second kernel (FlashAttention's is); at batch 1 a call reads a few tens
// of MB in ~10 µs, and a second launch, with the drain of the first and the fill of the second,
// costs a sizeable share of that (docs/perf-notes.md, FlashDecoding v3).
//
// GQA packing (decode.cuh, HeadRows). One kv head's rows are r = 0 … R−1 with R = group · n_new
// (group = heads_q / heads_kv), row r being query head kv_head·group + r / n_new, new token
// t = r % n_new; it has a number among the launch's output rows (HeadRows::flat, which indexes
// the workspaces), and its Q and O rows lie wherever the caller's strides put them. K and V of the
// kv head are read once for all the rows a block holds.
//
// Row blocks. A block holds at most ROWS = 16·MT ≤ 32 rows (MT = 1 or 2 mma tiles of 16; rows
// past the block's last are zeros and are never stored): every warp keeps the output of all its
// rows in registers, 16·MT·D/32 floats per lane, and two tiles are what fits (one at D = 256). A kv head with more
// rows (GQA 8 × 16 speculative tokens = 128) is shared by row_blocks = ceil(R / ROWS) blocks of
// consecutive rows, each reading the chunk's K and V. They are neighbours in the grid
// (blockIdx.x = split · row_blocks + row_block), so they run together and all but one find the
// tiles in L2: HBM traffic stays one read of the cache, L2 traffic grows row_blocks-fold.
//
// Causal mask among the new tokens, bottom-right (mask.cuh): token t of a sequence of length len
// (len counts the new tokens, which are the cache's last entries) sees keys j ≤ len − n_new + t.
//
// Chunks. Split s of sequence b owns keys [s·chunk, min((s+1)·chunk, len)) with
// chunk = ceil(len / splits) rounded up to a multiple of BC, so chunks follow each sequence's own
// length (short sequences of a batch do not pay for the longest one) and only a sequence's last
// chunk ends inside a tile. Splits past the end get no key: they write O_s = 0 and lse_s = −inf,
// weight 0 in the combine (exactly the CPU rung's empty chunk).
//
// The cache, contiguous or paged (FD_PAGED): see "where the keys live" in kv_cache.cuh, the one
// place the two kernels differ.
//
// Modifiers (what serving needs; the CPU rung takes the same, AttentionOptions): a sliding window
// (FD_WINDOW, the window's left side at run time: token t of a sequence of length len sees keys
// len − n_new + t − left … len − n_new + t), a score modifier (score_mod.cuh, compiled in:
// softcap, ALiBi, your own) and attention sinks (one logit per query head, folded in where a row
// is normalised: by the block itself with one split, else by the combine, as one more split with
// lse_s = σ and O_s = 0). A window also narrows the keys the splits share out to those some new
// token sees, [len − n_new − left, len), from a tile boundary: the keys before it are never read.
// Without them (the default variant) every use folds away.
//
// The combine. The last of a group's blocks to finish combines its splits: each counts itself in
// on a counter once its partials are written (last_to_finish, decode.cuh, which FlashDecoding++
// shares). Blocks of a group all return early together or none does (a group's splits share
// their rows), so a count is never left short.
//
// Inside a split block: the block walks the chunk in tiles of BC = 64 keys, K and V in a
// STAGES-deep cp.async pipeline (STAGES − 1 tiles in flight while one is read). Each of the 4
// warps owns 16 keys of every tile (keys 16·warp … 16·warp + 15) and all the block's rows, with
// its own online-softmax state (row max m, row sum l, unnormalised output acc): per tile
// S_w = Q·K_wᵀ (ROWS × 16), P_w = 2^(S_w·scale_log2 − m), acc += P_w·V_w. The warps' states are
// merged once at the end through shared memory with the log-sum-exp rule (the combine of phase 2
// in miniature):
//   M = max_w m_w,   L = Σ_w 2^(m_w − M) · l_w,
//   O_s = Σ_w 2^(m_w − M) · acc_w / L,   lse_s = M·ln2 + ln L.
//
// Legend:
//   R     rows of the kv head (group · n_new)         RB    rows of this block (≤ ROWS)
//   ROWS  rows of the padded Q tile (16·MT)           r0    the block's first row of the R
//   k0    first key of the current tile               kw    tile row of the warp's first key
//   kk    16-wide k-step over d (S = Q·Kᵀ)            dp    pair of 8-column tiles of O
//   mt    16-row mma tile                             h     row half of an accumulator tile
//   g     16-key group of a tile (never split by a page boundary)
//
// Compile-time constants, set by the host for each variant:
//   FD_D      head dimension (any multiple of 8 up to 256; decode.cuh pads it to the products'
//             16-wide k-steps and to 64-element rows in shared memory)
//   FD_MT     16-row mma tiles of the Q tile (1: ≤ 16 rows per block, 2: ≤ 32; 1 at D = 256)
//   FD_BC     keys per K/V tile (16 per warp)
//   FD_WARPS  warps per block of the split kernel
//   FD_STAGES K/V tiles in shared memory (STAGES − 1 copies in flight while one tile is read)
//   FD_PAGED  0: contiguous cache, 1: paged cache
//   FD_WINDOW 1: a sliding window (its left side in FdParams), 0: none
//   FD_SINKS  1: attention sinks (in FdParams' ModifierArgs), 0: none
//   LADDER_SCORE_MOD  a score modifier compiled in (score_mod.cuh)
//
// Shared memory: the Q tile and STAGES stages of K and V during the walk; then the same memory as
// the f32 buffer that merges the warps. (The combine works in registers.)

#include "combine.cuh"
#include "copy.cuh"
#include "decode.cuh"
#include "kv_cache.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "types.cuh"

#ifndef FD_MT
#define FD_MT 2
#endif
#ifndef FD_BC
#define FD_BC 64
#endif
#ifndef FD_WARPS
#define FD_WARPS 4
#endif
#ifndef FD_STAGES
#define FD_STAGES 3
#endif
#ifndef FD_PAGED
#define FD_PAGED 0
#endif
#ifndef FD_WINDOW
#define FD_WINDOW 0
#endif
#ifndef FD_SINKS
#define FD_SINKS 0
#endif

constexpr int MT = FD_MT;
constexpr int BC = FD_BC;
constexpr int WARPS = FD_WARPS;
constexpr int STAGES = FD_STAGES;
constexpr bool PAGED = FD_PAGED != 0;
constexpr bool SLIDING = FD_WINDOW != 0;
constexpr bool SINKS = FD_SINKS != 0;
static_assert(STAGES >= 2, "at least one copy in flight");
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = MT * 16;   // rows of the Q tile
constexpr int DT = DK / 8;      // 8-column accumulator tiles across one row of O
// Groups of 16 keys that always share a page (kv_cache.cuh) per tile.
constexpr int GROUPS = BC / KEY_GROUP;
// f32 row stride of the warp-merge buffer: 8 floats of padding put the 8 rows a half-warp's
// float2 stores touch into 8 different groups of banks.
constexpr int RED_STRIDE = DK + 8;
static_assert(BC == 16 * WARPS, "each warp owns 16 keys of a tile");

// The call (decode.cuh), and this kernel's own: workspaces, f32, o_part [output rows, splits, D]
// and lse_part [output rows, splits], the rows numbered as HeadRows::flat numbers them.
struct FdParams {
    DecodeCall call;
    float* o_part;
    float* lse_part;
    // One per (sequence, kv head, row block) of a launch, zero before the launch and left zero
    // after it: the splits of a group count themselves in here (see "The combine").
    unsigned* counters;
    // The modifiers (see "Modifiers" above): the score modifier's scalars and tables, the softmax
    // scale it is applied after, and the sinks (or null).
    ModifierArgs mods;
    // The launch's first sequence in the call (the modifier's batch index is first_seq + the
    // sequence within the launch), and the window's left side (FD_WINDOW).
    int first_seq;
    int window_left;
};
#ifdef FD_HOST_PARAMS_BYTES
static_assert(sizeof(FdParams) == FD_HOST_PARAMS_BYTES, "the host's mirror of FdParams");
#endif

// ---- the cache: kv_cache.cuh --------------------------------------------------------------------
//
// Where each group of 16 keys lives (CacheRows<PAGED>::start: from the cache's strides when
// contiguous, page_table[b][j / page_size] when paged), which keys a split owns
// (key_chunk) and the copy of a tile (load_kv_tile) live in kv_cache.cuh, shared with
// FlashDecoding++ (flash_decoding_pp.cu): the helper chosen at compile time is the only
// difference between the contiguous and the paged kernel.

// ---- the output: one row's O and lse ------------------------------------------------------------

// Columns c … c+3 of row r of the kv head (output row rows.flat(r)), o · inv rounded to the
// inputs' dtype (and the row's lse with the first columns).
__device__ __forceinline__ void store_output(const FdParams& p, const HeadRows& rows, int r, int c,
                                             float4 o, float inv, float lse) {
    const DecodeCall& call = p.call;
    *reinterpret_cast<uint2*>(call.o + rows.at(call.o_strides, r) + c) =
        make_uint2(pack2(o.x * inv, o.y * inv), pack2(o.z * inv, o.w * inv));
    if (c == 0) call.lse[rows.lse_index(r)] = lse;
}

// ---- the combine (phase 2), in the last block of a group ----------------------------------------

// Rows r0 … r0 + RB − 1 of the kv head, by combine.cuh's rule. Each thread takes 8 columns of a
// row at a time (4 in each half of the row, so that a warp's float4 loads cover whole 32-byte
// sectors) and reads the row's lse_s and its columns of O_s for COMBINE_BATCH splits at once.
// Every read is an L2 round trip, and the tail of the call waits for them, so as many go out
// together as registers allow (two float4 per split: 16 splits of 8 columns are 144 registers,
// reused from the main loop's), and the batches are merged with the online rule: running max m,
// running weight sum l, the sums so far rescaled when m grows. (Reading all lse_s first, then the
// O_s, 4 columns at a time, took a round trip and a barrier more and twice the batches:
// docs/perf-notes.md, FlashDecoding v4.)
constexpr int COMBINE_COLS = 8;

__device__ void combine_rows(const FdParams& p, const HeadRows& rows, int r0, int RB) {
    constexpr int PER_ROW = D / COMBINE_COLS;  // threads per row
    const int splits = p.call.splits;
    for (int i = threadIdx.x; i < RB * PER_ROW; i += THREADS) {
        // Columns c … c + 3 and c + D/2 … c + D/2 + 3 of row r.
        const int r = r0 + i / PER_ROW, c = (i % PER_ROW) * 4;
        const size_t row = rows.flat(r);
        const float* lse_s = p.lse_part + row * splits;
        const float4* o_s = reinterpret_cast<const float4*>(p.o_part + row * splits * D + c);
        float m = LADDER_NEG_INF, l = 0.f;
        float4 o[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
        bool nan = false;
        for (int s0 = 0; s0 < splits; s0 += COMBINE_BATCH) {
            float x[COMBINE_BATCH];
            float4 v[COMBINE_BATCH][2];
#pragma unroll
            for (int b = 0; b < COMBINE_BATCH; ++b) {
                const int s = s0 + b;
                const bool in = s < splits;
                x[b] = in ? __ldcg(lse_s + s) : LADDER_NEG_INF;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    v[b][h] = in ? __ldcg(o_s + (size_t)s * (D / 4) + h * (D / 8))
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            float m_new = m;
#pragma unroll
            for (int b = 0; b < COMBINE_BATCH; ++b) {
                m_new = fmaxf(m_new, x[b]);
                // fmaxf skips NaN; a split whose scores met a NaN (lse_s = NaN) makes the row
                // NaN, as with one split and in the CPU rung, instead of dropping out of it.
                nan |= x[b] != x[b];
            }
            // No split so far saw a key (m_new = −inf): every weight is 0, nothing to add.
            if (m_new == LADDER_NEG_INF) continue;
            const float alpha = combine_weight(m, m_new);  // 0 while m = −inf
            l *= alpha;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                o[h].x *= alpha, o[h].y *= alpha;
                o[h].z *= alpha, o[h].w *= alpha;
            }
#pragma unroll
            for (int b = 0; b < COMBINE_BATCH; ++b) {
                const float w = combine_weight(x[b], m_new);
                // A weight of 0 adds nothing (as in the CPU rung, not even a NaN of its O_s).
                if (w == 0.f) continue;
                l += w;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    o[h].x += w * v[b][h].x, o[h].y += w * v[b][h].y;
                    o[h].z += w * v[b][h].z, o[h].w += w * v[b][h].w;
                }
            }
            m = m_new;
        }
        // The sink, one more split of lse_s = σ and O_s = 0 (a row that saw no key keeps it:
        // O = 0, lse = σ).
        if (SINKS) {
            float m2 = m * LADDER_LOG2E;  // fold_sink works in base 2
            const float alpha = fold_sink(m2, l, sink_log2(p.mods.sinks, rows.head(r)));
            m = m2 * LADDER_LN2;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                o[h].x *= alpha, o[h].y *= alpha;
                o[h].z *= alpha, o[h].w *= alpha;
            }
        }
        // All splits empty (the row sees no key): O = 0, lse = −inf, as everywhere.
        float inv = combine_inverse(l);
        float lse = combine_lse(m, l);
        if (nan) inv = lse = __int_as_float(0x7fc00000);
        store_output(p, rows, r, c, o[0], inv, lse);
        store_output(p, rows, r, c + D / 2, o[1], inv, lse);
    }
}

// Launch: grid (splits · row_blocks, heads_kv, batch), block (THREADS, 1, 1), dynamic shared
// memory max((ROWS + 2·STAGES·BC)·COLS·2, WARPS·ROWS·(RED_STRIDE + 2)·4) bytes (see "Shared memory"
// above).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_decoding_split(const __grid_constant__ FdParams p) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;                    // [ROWS][COLS]
    u16* sK = sQ + ROWS * COLS;        // [STAGES][BC][COLS]
    u16* sV = sK + STAGES * BC * COLS; // [STAGES][BC][COLS]

    const DecodeCall& call = p.call;
    const int split = blockIdx.x / call.row_blocks, row_block = blockIdx.x % call.row_blocks;
    const int kv_head = blockIdx.y, batch = blockIdx.z;
    const int warp = warp_id();
    const HeadRows rows(call, batch, kv_head);  // GQA packing above
    const int n_new = rows.n_new;
    const int R = rows.count();
    const int r0 = row_block * ROWS;
    const int RB = min(ROWS, R - r0);
    // Packed new tokens: the grid has the row blocks of the sequence with the most rows, and a
    // sequence with fewer has nothing for the rest (all of a group's splits leave together, so
    // its count is never left short).
    if (RB <= 0) return;
    const int len = call.lengths[batch];
    const CacheRows<PAGED> cache(call, batch, kv_head);

    // This split's keys [k_begin, k_end) (see "Chunks" above), from the first tile some new token
    // sees under a window.
    const int first_key = SLIDING ? max(len - n_new - p.window_left, 0) / BC * BC : 0;
    const KeyChunk keys = key_chunk<BC>(len, call.splits, split, first_key);
    const int k_begin = keys.begin, k_end = keys.end, n_tiles = keys.tiles;


    // The host launches this kernel programmatically (pdl.cuh): its blocks may start during the
    // previous kernel's tail, and nothing above this line touches memory. The next call may then
    // start as soon as every block of this one is running: it too waits here before reading.
    wait_for_prior_grids();
    allow_next_grid();

    // One past the last key each of the thread's rows sees, within this chunk: the causal limit of
    // its token, or the chunk's end. Rows of every tile at or past min_limit need the mask.
    // Under a window, also the first key it sees (lower[]): tiles before max_lower need it.
    int limit[MT][2], lower[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = (r0 + mt * 16 + acc_row(2 * h)) % n_new;
            limit[mt][h] = min(len - n_new + t + 1, k_end);
            lower[mt][h] = len - n_new + t - p.window_left;
        }
    const int min_limit = min(len - n_new + 1, k_end);  // token 0's limit: the smallest
    const int max_lower = len - 1 - p.window_left;      // the last token's first key: the largest
    // Where the score modifier sees the thread's rows: the sequence, the query head and the token
    // of row half (mt, h) (padding rows as the block's last row), among n_new queries and len keys.
    ScorePlace place[MT][2];
    int token[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(r0 + mt * 16 + acc_row(2 * h), R - 1);
            place[mt][h] = ScorePlace{p.first_seq + batch, rows.head(r), n_new, len};
            token[mt][h] = r % n_new;
        }

    float acc[MT][DT][4];  // this warp's O, unnormalised
    float row_max[MT][2], row_sum[MT][2];
    zero(acc);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row_max[mt][0] = row_max[mt][1] = LADDER_NEG_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    // The K/V pipeline (kv_cache.cuh): the first STAGES − 1 tiles in flight, one commit group
    // each, the Q tile riding in group 0 with tile 0.
    KvPipeline<BC, THREADS, STAGES, PAGED> kv(cache, call, sK, sV, keys);
    load_head_rows<ROWS, THREADS>(sQ, call.q, call.q_strides, rows, r0, RB);
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        long long start[GROUPS];
        kv.starts(t, start);
        kv.load(t, start);
    }

    const auto qA = a_operand<COLS>(sQ, 0);     // Q: A of S = Q·Kᵀ (all ROWS rows, per warp)
    const auto kB = b_operand<COLS>(sK);        // K: B of S = Q·Kᵀ (rows = keys = n)
    const auto vB = b_operand_trans<COLS>(sV);  // V: B of O = P·V (rows = keys = k)

    for (int j = 0; j < n_tiles; ++j) {
        // Where tile j + STAGES − 1 lies, found before the wait: with a paged cache that reads the
        // page table, and its latency overlaps the wait instead of delaying the copy.
        long long next[GROUPS];
        kv.starts(j + STAGES - 1, next);
        // Tile j has landed once at most STAGES − 2 younger groups are pending; after the
        // barrier every warp is done with tile j − 1, whose stage the copy of tile
        // j + STAGES − 1 then reuses. One barrier per tile.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        kv.load(j + STAGES - 1, next);
        const int k0 = k_begin + j * BC;
        const int kw = (j % STAGES) * BC + warp * 16;  // tile row of this warp's first key

        // ---- S = Q·K_wᵀ: ROWS × 16 scores of this warp's keys -----------------------------------
        float s[MT][2][4];
        zero(s);
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            u32 b[4];
            kB.load(b, kk, kw);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a[4];
                qA.load(a, kk, mt * 16);
                mma_16x16(s[mt][0], s[mt][1], a, b);
            }
        }

        // ---- the score modifier: S ← score_mod(scale · S) (nothing without one) --------------
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                modify_scores(s[mt], h, token[mt][h], k0 + warp * 16, place[mt][h], p.mods);

        // ---- mask: keys past the chunk or the sequence, and right of a token's diagonal ---------
        // Uniform across the block: only a chunk's last tile and the tiles holding the new tokens
        // (the last n_new ≤ 16 keys of the sequence) are masked; under a window, also the tiles
        // holding some token's first key.
        if (SLIDING && k0 < max_lower) {
            const int kw0 = k0 + warp * 16;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    mask_outside(s[mt], h, ColumnSpan{lower[mt][h] - kw0, limit[mt][h] - kw0},
                                 LADDER_NEG_INF);
        } else if (k0 + BC > min_limit) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    mask_columns(s[mt], h, limit[mt][h] - (k0 + warp * 16), LADDER_NEG_INF);
        }

        // ---- online softmax of the warp's state: P = 2^(S·scale_log2 − m), 16-bit ---------------
        u32 pk[MT][2][2];
        float alpha[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                alpha[mt][h] = online_softmax(s[mt], h, score_scale_log2(call.scale_log2),
                                              row_max[mt][h], row_sum[mt][h], pk[mt]);
        bool rescale = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) rescale |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= alpha[mt][e / 2];
        }

        // ---- acc += P_w·V_w: one 16-wide k-step (the warp's 16 keys) ----------------------------
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) a_from_packed(a[mt], pk[mt][0], pk[mt][1]);
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            u32 b[4];
            vB.load(b, dp, kw);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_16x16(acc[mt][2 * dp], acc[mt][2 * dp + 1], a[mt], b);
        }
    }
    // An empty chunk still has the Q copy in flight; the merge below reuses its memory.
    cp_async_wait<0>();
    __syncthreads();
    // Paged: whether any thread of the block met a page outside the cache.
    const bool bad_page = PAGED && __syncthreads_or(kv.bad);

    // ---- merge the warps' states through shared memory (log-sum-exp rule) -----------------------
    float* red_acc = reinterpret_cast<float*>(smem);   // [WARPS][ROWS][RED_STRIDE]
    float* red_m = red_acc + WARPS * ROWS * RED_STRIDE;  // [WARPS][ROWS], base 2, scaled
    float* red_l = red_m + WARPS * ROWS;                 // [WARPS][ROWS]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + acc_row(2 * h);
            const float l = quad_sum(row_sum[mt][h]);
            if (r >= RB) continue;  // a padding row: never read below
            float* dst = red_acc + (warp * ROWS + r) * RED_STRIDE;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(dst + acc_col(dt, 2 * h)) =
                    make_float2(acc[mt][dt][2 * h], acc[mt][dt][2 * h + 1]);
            if (lane_id() % 4 == 0) {
                red_m[warp * ROWS + r] = row_max[mt][h];
                red_l[warp * ROWS + r] = l;
            }
        }
    __syncthreads();

    // Each thread takes 4 consecutive columns of a row at a time; rows past RB are padding.
    for (int i = threadIdx.x; i < RB * (D / 4); i += THREADS) {
        const int r = i / (D / 4);
        const int c = (i % (D / 4)) * 4;
        float m = LADDER_NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red_m[w * ROWS + r]);
        // No warp saw a key: subtract 0 so that the weights are 2^(−inf) = 0, not NaN.
        const float m_use = m == LADDER_NEG_INF ? 0.f : m;
        float l = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = fast_exp2(red_m[w * ROWS + r] - m_use);
            l += f * red_l[w * ROWS + r];
            const float4 x =
                *reinterpret_cast<const float4*>(red_acc + (w * ROWS + r) * RED_STRIDE + c);
            o.x += f * x.x;
            o.y += f * x.y;
            o.z += f * x.z;
            o.w += f * x.w;
        }
        // With one split this is the row's O: the sink joins its softmax here (see "Modifiers").
        float m_row = m;
        if (SINKS && call.splits == 1) {
            const float alpha = fold_sink(m_row, l, sink_log2(p.mods.sinks, rows.head(r0 + r)));
            o.x *= alpha, o.y *= alpha, o.z *= alpha, o.w *= alpha;
        }
        // A row that saw no key of this chunk: O_s = 0, lse_s = −inf (weight 0 in the combine).
        float inv = l > 0.f ? 1.f / l : 0.f;
        float lse_s = l == 0.f ? LADDER_NEG_INF : m_row * LADDER_LN2 + logf(l);
        // A page outside the cache: O_s = NaN and lse_s = +inf, which turn the combined row into
        // NaN whatever the other splits hold (+inf is their maximum, and +inf − +inf is NaN).
        if (bad_page) {
            inv = __int_as_float(0x7fc00000);
            // With one split this is the row's lse, which the combine would have made NaN.
            lse_s = __int_as_float(call.splits == 1 ? 0x7fc00000 : 0x7f800000);
        }
        if (call.splits == 1) {  // nothing to combine: this is the row's O and lse
            store_output(p, rows, r0 + r, c, o, inv, lse_s);
            continue;
        }
        const size_t out = rows.flat(r0 + r) * call.splits + split;
        *reinterpret_cast<float4*>(p.o_part + out * D + c) =
            make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
        if (c == 0) p.lse_part[out] = lse_s;
    }
    if (call.splits == 1 || !last_to_finish(p.counters, call, row_block)) return;
    combine_rows(p, rows, r0, RB);
}
