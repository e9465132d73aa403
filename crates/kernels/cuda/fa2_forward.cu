// FlashAttention-2 forward (Dao 2023, Algorithm 1), on tensor cores with mma.sync.
//
// One thread block owns BR query rows of one (batch, head) and walks the K/V tiles of that head
// once; nothing is shared between blocks. Each of the WARPS warps owns MT·16 of the rows, so the
// softmax statistics (running max m, running sum l) and the unnormalised output accumulator live in
// that warp's registers for the whole walk and are written once at the end (O / l, and lse).
//
// Per K/V tile:  S = Q·Kᵀ  ->  mask (sequence tails, causal diagonal)  ->  online softmax update
//                (rescale the accumulator by 2^(m_old − m_new))  ->  O += P·V.
// Tiles strictly above the causal diagonal are never loaded. The next tile's K and V are copied
// with cp.async while the current one is computed (two shared-memory stages).
//
// Compile-time constants, set by the host for each variant:
//   FA2_D      head dimension (64, 128, 256)
//   FA2_MT     16-row mma tiles per warp (2 halves shared-memory traffic per FLOP; 1 for d = 256)
//   FA2_BC     keys per K/V tile
//   FA2_WARPS  warps per block
//   FA2_CAUSAL 1 for the causal variant (a separate compile: the unmasked kernel carries no
//              diagonal logic and keeps those registers free)

#ifndef FA2_D
#define FA2_D 128
#endif
#ifndef FA2_MT
#define FA2_MT 2
#endif
#ifndef FA2_BC
#define FA2_BC 64
#endif
#ifndef FA2_WARPS
#define FA2_WARPS 4
#endif
#ifndef FA2_CAUSAL
#define FA2_CAUSAL 0
#endif

constexpr int D = FA2_D;
constexpr int MT = FA2_MT;
constexpr int BC = FA2_BC;
constexpr int WARPS = FA2_WARPS;
constexpr bool causal = FA2_CAUSAL;
constexpr int THREADS = WARPS * 32;
constexpr int BR = WARPS * MT * 16;
constexpr int NT = BC / 8;  // 8-column accumulator tiles across one row of S
constexpr int DT = D / 8;   // 8-column accumulator tiles across one row of O

extern "C" __global__ void __launch_bounds__(THREADS, 1)
fa2_forward(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
            u16* __restrict__ o, float* __restrict__ lse, int heads_q, int heads_kv, int n_q,
            int n_kv, float scale_log2) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sK = sQ + BR * D;  // [2][BC][D]
    u16* sV = sK + 2 * BC * D;

    // Causal blocks near the end of the sequence have the most tiles: launch them first so that
    // the last wave is made of short blocks.
    const int q_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / (heads_q / heads_kv);
    const int q0 = q_block * BR;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    const u16* gQ = q + ((size_t)batch * heads_q + head) * n_q * D;
    // K and V of this block's kv head; recomputed inside the loop (see block_y) rather than kept.
    auto kv_offset = [&]() {
        return ((size_t)block_z() * heads_kv + block_y() / (heads_q / heads_kv)) * n_kv * D;
    };
    const u16* gK = k + kv_offset();
    const u16* gV = v + kv_offset();

    // Bottom-right causal alignment: query i sees keys j <= i + shift.
    const int shift = n_kv - n_q;
    int n_tiles = (n_kv + BC - 1) / BC;
    if (causal) {
        int last_key = q0 + BR - 1 + shift;  // the block's most permissive row
        n_tiles = last_key < 0 ? 0 : min(n_tiles, last_key / BC + 1);
    }

    float acc[MT][DT][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
        row_max[mt][0] = row_max[mt][1] = LADDER_NEG_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    load_tile<BR, D, THREADS>(sQ, gQ, q0, n_q);
    if (n_tiles > 0) {
        load_tile<BC, D, THREADS>(sK, gK, 0, n_kv);
        load_tile<BC, D, THREADS>(sV, gV, 0, n_kv);
    }
    cp_async_commit();

    // Row of this thread's accumulator entries e = 0,1 (entries 2,3 are 8 rows further down).
    const int warp_row0 = warp * MT * 16 + lane / 4;
    // Fragment addresses (see FragAddr): Q as the A operand, K as B (rows = keys), V as B through
    // the transposing ldmatrix (rows = keys, chunks along d).
    const FragAddr<D> aQ(sQ, warp * MT * 16 + lane % 16, lane / 16);
    const FragAddr<D> aK(sK, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const FragAddr<D> aV(sV, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

    for (int j = 0; j < n_tiles; ++j) {
        const int stage = j & 1;
        if (j + 1 < n_tiles) {
            const size_t off = kv_offset();
            load_tile<BC, D, THREADS>(sK + (stage ^ 1) * BC * D, k + off, (j + 1) * BC, n_kv);
            load_tile<BC, D, THREADS>(sV + (stage ^ 1) * BC * D, v + off, (j + 1) * BC, n_kv);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int stage_rows = stage * BC;
        const int k0 = j * BC;

        // ---- S = Q·Kᵀ -------------------------------------------------------------------------
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4_a(a[mt], aQ.at(kk, mt * 16));
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 b[4];
                ldmatrix_x4_a(b, aK.at(kk, stage_rows + np * 16));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }

        // ---- mask: keys past the end, and keys right of the causal diagonal -----------------------
        // Only the last tile and the tiles crossing the diagonal need it; the test is uniform
        // across the block, so unmasked tiles pay one comparison.
        const bool tail = k0 + BC > n_kv;
        const bool diagonal = causal && (k0 + BC - 1 > q0 + shift);
        if (tail || diagonal) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // Keys of this tile that the row may see: columns [0, limit).
                    const int row = q0 + warp_row0 + mt * 16 + h * 8;
                    int limit = n_kv - k0;
                    if (causal) limit = min(limit, row + shift + 1 - k0);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (nt * 8 + (lane % 4) * 2 + e >= limit)
                                s[mt][nt][2 * h + e] = LADDER_NEG_INF;
                }
        }

        // ---- online softmax (base 2: scale_log2 = scale · log2 e) ---------------------------------
        // P is rounded to 16 bits as soon as it is computed, two values per register: exactly the
        // A-operand layout of the P·V product, and half the registers of the f32 scores.
        u32 p[MT][NT][2];
        float alpha[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = row_max[mt][h];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]) * scale_log2);
                mx = quad_max(mx);
                // A row that has seen only masked keys keeps max −inf; subtract 0 instead so that
                // its probabilities are exp2(−inf) = 0 rather than NaN.
                const float m_use = mx == LADDER_NEG_INF ? 0.f : mx;
                alpha[mt][h] = row_max[mt][h] == mx ? 1.f : fast_exp2(row_max[mt][h] - m_use);
                row_max[mt][h] = mx;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float p0 = fast_exp2(fmaf(s[mt][nt][2 * h], scale_log2, -m_use));
                    float p1 = fast_exp2(fmaf(s[mt][nt][2 * h + 1], scale_log2, -m_use));
                    sum += p0 + p1;
                    p[mt][nt][h] = pack2(p0, p1);
                }
                // Each thread keeps a partial sum of its own columns; the quad is summed once at
                // the end, since alpha is the same for all four threads of a row.
                row_sum[mt][h] = row_sum[mt][h] * alpha[mt][h] + sum;
            }
        // Rescale the accumulator only when some row of the warp found a new maximum: after the
        // first few tiles that is rare, and the test is uniform across the warp (no divergence).
        // Skipping it is exact, since alpha is then exactly 1.
        bool rescale = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) rescale |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    acc[mt][dt][0] *= alpha[mt][0];
                    acc[mt][dt][1] *= alpha[mt][0];
                    acc[mt][dt][2] *= alpha[mt][1];
                    acc[mt][dt][3] *= alpha[mt][1];
                }
        }

        // ---- O += P·V ----------------------------------------------------------------------------
#pragma unroll
        for (int ks = 0; ks < BC / 16; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = p[mt][2 * ks][0];
                a[mt][1] = p[mt][2 * ks][1];
                a[mt][2] = p[mt][2 * ks + 1][0];
                a[mt][3] = p[mt][2 * ks + 1][1];
            }
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans_a(b, aV.at(dp, stage_rows + ks * 16));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816(acc[mt][2 * dp], a[mt], b[0], b[1]);
                    mma_16816(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
                }
            }
        }
        // The next iteration's copies overwrite the stage read here.
        __syncthreads();
    }
    if (n_tiles == 0) cp_async_wait<0>();

    // ---- epilogue: O = acc / l, lse = m·ln2 + ln l; rows that saw no key get O = 0, lse = −inf ----
    u16* gO = o + ((size_t)batch * heads_q + head) * n_q * D;
    float* gL = lse + ((size_t)batch * heads_q + head) * n_q;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = q0 + warp_row0 + mt * 16 + h * 8;
            const float l = quad_sum(row_sum[mt][h]);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            if (row < n_q) {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    u32 packed = pack2(acc[mt][dt][2 * h] * inv, acc[mt][dt][2 * h + 1] * inv);
                    *reinterpret_cast<u32*>(gO + (size_t)row * D + dt * 8 + (lane % 4) * 2) =
                        packed;
                }
                if (lane % 4 == 0)
                    gL[row] = l > 0.f ? row_max[mt][h] * LADDER_LN2 + logf(l) : LADDER_NEG_INF;
            }
        }
}
