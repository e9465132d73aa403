// Score modifiers: a function of each scaled score, applied before the softmax (FlexAttention's
// score_mod). A kernel compiled with LADDER_SCORE_MOD includes the header the host generates from
// a ladder_kernels::ScoreMod (score_mod_body.cuh: the user's body, and its derivative for the
// backward pass); without it score_mod is the identity and has_score_mod folds every use away.
//
// The softmax then runs on the modified scores in base 2: the kernels scale their raw Q·Kᵀ by
// the natural softmax scale, apply the modifier, and hand the result to the online softmax with
// a scale of log2(e) (score_scale_log2 below).
#ifndef LADDER_SCORE_MOD_CUH
#define LADDER_SCORE_MOD_CUH

#include "mma.cuh"

// A modifier's scalars and tables (its names for them are bound in score_mod_body.cuh), the
// softmax scale it is applied after, and the sinks. Every kernel's parameter struct embeds one.
struct ModifierArgs {
    const float* tensor[4];
    float scalar[8];
    float scale;
    int pad;
    // The attention sinks, one logit per query head (natural log, in the units of the modified
    // scores), or null: every kernel that takes modifiers folds them in where it normalises a row
    // (softmax.cuh, fold_sink).
    const float* sinks;
};

// Where a score sits, as the modifier's body sees it: its batch entry (a packed batch's
// sequence), query head, query row and key (ints, and the same as floats: a body that computes
// with positions in float, as ALiBi does, avoids an int-to-float conversion per score, which runs
// at the rate of an exponential), and the sequence's lengths.
struct ScoreAt {
    int b;
    int h;
    int q_idx;
    int kv_idx;
    int n_q;
    int n_kv;
    float q_pos;
    float kv_pos;
};

#ifdef LADDER_SCORE_MOD
constexpr bool has_score_mod = true;
#include "score_mod_body.cuh"
#else
constexpr bool has_score_mod = false;
__device__ __forceinline__ float score_mod(float score, const ScoreAt&, const ModifierArgs&) {
    return score;
}
__device__ __forceinline__ float score_mod_derivative(float, const ScoreAt&,
                                                      const ModifierArgs&) {
    return 1.f;
}
#endif

// The scale (base 2) the online softmax applies to a score tile: scale · log2(e) on raw Q·Kᵀ, or
// log2(e) on scores the modifier has already scaled and rewritten.
__device__ __forceinline__ float score_scale_log2(float scale_log2) {
    return has_score_mod ? 1.4426950408889634f : scale_log2;
}

// Where a tile's scores sit: batch entry (a packed batch's sequence), query head, and the
// sequence's lengths.
struct ScorePlace {
    int batch;
    int head;
    int n_q;
    int n_kv;
};

// Rewrite row half h (entries 2h, 2h + 1) of an accumulator tile of raw scores whose row is
// `row` and whose first key is k0 into score_mod(scale · s). Rows and keys past the sequence's
// end are clamped to its last, so that the modifier may index tables by them; those entries are
// masked afterwards.
template <int NT>
__device__ __forceinline__ void modify_scores(float (&s)[NT][4], int h, int row, int k0,
                                              const ScorePlace& at, const ModifierArgs& args) {
    if constexpr (has_score_mod) {
        ScoreAt pos{at.batch, at.head, min(row, at.n_q - 1), 0, at.n_q, at.n_kv, 0.f, 0.f};
        pos.q_pos = (float)pos.q_idx;
        // The thread's first column as a float, once; each entry's is that plus a constant.
        const int col0 = k0 + acc_col(0, 0);
        const float col0_pos = (float)col0, last_pos = (float)(at.n_kv - 1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                const int step = acc_col(nt, e) - acc_col(0, 0);  // a constant per entry
                pos.kv_idx = min(col0 + step, at.n_kv - 1);
                pos.kv_pos = fminf(col0_pos + (float)step, last_pos);
                s[nt][e] = score_mod(s[nt][e] * args.scale, pos, args);
            }
    }
}

// The backward pass's form of modify_scores, on a tile of raw scores and beside it the slopes
// ∂t/∂s of the modifier t = score_mod(s) (the chain rule takes dS = P ∘ (dP − D) to the scores'
// gradient: dS ∘ slope). `query(nt, e)` and `key(e)` give an entry's place: the dQ pass's tiles
// have queries on rows, the main kernel's Sᵀ keys. (A modifier whose derivative is a constant,
// ALiBi's 1, leaves `slope` constant: the compiler drops it and the products by it.)
template <int NT, typename Query, typename Key>
__device__ __forceinline__ void modify_scores_with_slopes(float (&s)[NT][4], float (&slope)[NT][4],
                                                          Query query, Key key,
                                                          const ScorePlace& at,
                                                          const ModifierArgs& args) {
    if constexpr (has_score_mod) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                ScoreAt pos{at.batch, at.head, min(query(nt, e), at.n_q - 1),
                            min(key(nt, e), at.n_kv - 1), at.n_q, at.n_kv, 0.f, 0.f};
                pos.q_pos = (float)pos.q_idx;
                pos.kv_pos = (float)pos.kv_idx;
                const float score = s[nt][e] * args.scale;
                s[nt][e] = score_mod(score, pos, args);
                slope[nt][e] = score_mod_derivative(score, pos, args);
            }
    }
}

// dS ∘= slope: the gradient of the logits to that of the scores (nothing without a modifier).
template <int NT>
__device__ __forceinline__ void chain_slopes(float (&ds)[NT][4], const float (&slope)[NT][4]) {
    if constexpr (has_score_mod) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] *= slope[nt][e];
    }
}

#endif  // LADDER_SCORE_MOD_CUH
