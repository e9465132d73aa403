// FlashAttention-2 backward (Dao 2023, Algorithm 2), on tensor cores with mma.sync.
//
// Three kernels, launched in order:
//   fa2_backward_prep    D_i = rowsum(dO_i ∘ O_i), lse in base 2, and dQ's f32 accumulator zeroed.
//   fa2_backward         one thread block per (K/V tile j, query head): K_j and V_j stay in shared
//                        memory while the block walks the query tiles i that can see them,
//                        recomputing P from lse instead of storing it:
//                          Sᵀ = K_j Q_iᵀ,  Pᵀ = exp(scale·Sᵀ − lse_i)
//                          dV_j += Pᵀ dO_i
//                          dPᵀ = V_j dO_iᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ − D_i)
//                          dK_j += dSᵀ Q_i
//                          dQ_i += dS K_j          (f32 atomics: other blocks add to the same rows)
//                        Working with the transposes keeps the key index on the rows, so dK and
//                        dV accumulate in each warp's registers, and Pᵀ, dSᵀ come out of one
//                        product already in the operand layout of the next; only dQ needs dSᵀ
//                        through shared memory, transposed by ldmatrix.trans.
//   fa2_backward_finish  scale dQ, dK; sum dK, dV over the query heads of a group (GQA); convert.
//
// Each of the WARPS warps owns 16 keys of the K/V tile (BC = 16·WARPS keys); query tiles have BR
// rows and are double-buffered with cp.async. Eight warps and 128 keys per block (rather than 64)
// halve the dQ atomics and the Q/dO shared-memory traffic per FLOP.

#ifndef FA2_D
#define FA2_D 128
#endif
#ifndef FA2_BR
#define FA2_BR 64
#endif
#ifndef FA2_WARPS
#define FA2_WARPS 8
#endif
#ifndef FA2_CAUSAL
#define FA2_CAUSAL 0
#endif

constexpr int D = FA2_D;
constexpr int BR = FA2_BR;
constexpr int WARPS = FA2_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int BC = WARPS * 16;
constexpr bool causal = FA2_CAUSAL;
constexpr int NQ = BR / 8;  // 8-column accumulator tiles across the queries of a tile
constexpr int DT = D / 8;   // 8-column accumulator tiles across d

// ---- prep: D = rowsum(dO ∘ O), lse·log2(e), dQ accumulator = 0 ----------------------------------
// One warp per query row; rows up to the padded length get D = lse = 0 so that whole query tiles
// can be copied without bounds checks.
extern "C" __global__ void fa2_backward_prep(const u16* __restrict__ o, const u16* __restrict__ d_o,
                                             const float* __restrict__ lse,
                                             float* __restrict__ delta, float* __restrict__ lse2,
                                             float* __restrict__ dq_acc, int n_q, int n_q_pad,
                                             int rows_total) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= rows_total) return;
    const int bh = warp / n_q_pad, row = warp % n_q_pad;
    float acc = 0.f;
    if (row < n_q) {
        const size_t base = ((size_t)bh * n_q + row) * D;
        for (int c = lane; c < D; c += 32) {
            acc += to_f32(o[base + c]) * to_f32(d_o[base + c]);
            dq_acc[base + c] = 0.f;
        }
    }
    acc += __shfl_xor_sync(0xffffffff, acc, 16);
    acc += __shfl_xor_sync(0xffffffff, acc, 8);
    acc += __shfl_xor_sync(0xffffffff, acc, 4);
    acc += __shfl_xor_sync(0xffffffff, acc, 2);
    acc += __shfl_xor_sync(0xffffffff, acc, 1);
    if (lane == 0) {
        delta[warp] = acc;
        lse2[warp] = row < n_q ? lse[(size_t)bh * n_q + row] * LADDER_LOG2E : 0.f;
    }
}

// Add two adjacent floats to global memory atomically: one vector reduction on Hopper (half the
// atomic operations of dQ's accumulation), two scalar ones before it.
__device__ __forceinline__ void red_add2(float* addr, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(x), "f"(y));
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(x));
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr + 1), "f"(y));
#endif
}

// ---- main kernel -----------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS, 1)
fa2_backward(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
             const u16* __restrict__ d_o, const float* __restrict__ lse2,
             const float* __restrict__ delta, float* __restrict__ dq_acc,
             float* __restrict__ dk_acc, float* __restrict__ dv_acc, int heads_q, int heads_kv,
             int n_q, int n_kv, int n_q_pad, float scale_log2) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sK = smem;                 // [BC][D]
    u16* sV = sK + BC * D;          // [BC][D]
    u16* sQ = sV + BC * D;          // [2][BR][D]
    u16* sdO = sQ + 2 * BR * D;     // [2][BR][D]
    u16* sdS = sdO + 2 * BR * D;    // [BC][BR]: dSᵀ, keys on rows
    float* sL = reinterpret_cast<float*>(sdS + BC * BR);  // [2][BR] lse2
    float* sDelta = sL + 2 * BR;                            // [2][BR]

    const int head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / (heads_q / heads_kv);
    const int k0 = blockIdx.x * BC;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t bh = (size_t)batch * heads_q + head;

    const u16* gQ = q + bh * n_q * D;
    const u16* gdO = d_o + bh * n_q * D;
    const u16* gK = k + ((size_t)batch * heads_kv + kv_head) * n_kv * D;
    const u16* gV = v + ((size_t)batch * heads_kv + kv_head) * n_kv * D;
    const float* gL = lse2 + bh * n_q_pad;
    const float* gDelta = delta + bh * n_q_pad;
    float* gdQ = dq_acc + bh * n_q * D;

    // Query tiles that can see this key tile: with bottom-right alignment query i sees key j when
    // j <= i + shift, so tiles wholly before k0 − shift are skipped.
    const int shift = n_kv - n_q;
    const int t_end = (n_q + BR - 1) / BR;
    int t_begin = 0;
    if (causal) t_begin = max(0, (k0 - shift) / BR);

    auto load_query_tile = [&](int t, int stage) {
        load_tile<BR, D, THREADS>(sQ + stage * BR * D, gQ, t * BR, n_q);
        load_tile<BR, D, THREADS>(sdO + stage * BR * D, gdO, t * BR, n_q);
        // BR floats of lse2 and of D: 16-byte chunks from the padded arrays.
        if (threadIdx.x < BR / 4)
            cp_async_16(sL + stage * BR + threadIdx.x * 4, gL + t * BR + threadIdx.x * 4, true);
        else if (threadIdx.x < BR / 2)
            cp_async_16(sDelta + stage * BR + (threadIdx.x - BR / 4) * 4,
                        gDelta + t * BR + (threadIdx.x - BR / 4) * 4, true);
    };

    load_tile<BC, D, THREADS>(sK, gK, k0, n_kv);
    load_tile<BC, D, THREADS>(sV, gV, k0, n_kv);
    if (t_begin < t_end) load_query_tile(t_begin, 0);
    cp_async_commit();

    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

    // Operand addresses (see FragAddr in common.cuh).
    const FragAddr<D> aK(sK, warp * 16 + lane % 16, lane / 16);               // A: K rows
    const FragAddr<D> aV(sV, warp * 16 + lane % 16, lane / 16);               // A: V rows
    const FragAddr<D> bQ(sQ, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);     // B: Qᵀ
    const FragAddr<D> bdO(sdO, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);   // B: dOᵀ
    const FragAddr<D> bQt(sQ, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);    // B: Q (trans)
    const FragAddr<D> bdOt(sdO, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);  // B: dO (trans)
    const FragAddr<BR> adS(sdS, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);  // A: dS (trans)
    const FragAddr<D> bKt(sK, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);    // B: K (trans)

    // Row (key) of this thread's accumulator entries 0,1; entries 2,3 are 8 keys further.
    const int my_key = k0 + warp * 16 + lane / 4;

    for (int t = t_begin; t < t_end; ++t) {
        const int stage = (t - t_begin) & 1;
        // Query tile t is the only copy in flight; after the barrier no warp reads the other
        // stage (tile t − 1) any more, so tile t + 1 is copied there during this tile's work
        // (issued after Pᵀ below; placed earlier, it tipped the register allocation into a
        // spill). sdS needs no barrier of its own either: it is written again only after the
        // next iteration's barrier, which every warp reaches after finishing its dQ reads of it.
        // One barrier per tile besides the one that publishes dSᵀ.
        cp_async_wait<0>();
        __syncthreads();
        const int i0 = t * BR;
        const int srow = stage * BR;
        const float* tL = sL + stage * BR;
        const float* tDelta = sDelta + stage * BR;

        // ---- Sᵀ = K_j Q_iᵀ and Pᵀ = 2^(scale_log2·Sᵀ − lse2) --------------------------------------
        float pt[NQ][4];
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) pt[nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4_a(a, aK.at(kk, 0));
#pragma unroll
            for (int np = 0; np < NQ / 2; ++np) {
                u32 b[4];
                ldmatrix_x4_a(b, bQ.at(kk, srow + np * 16));
                mma_16816(pt[2 * np], a, b[0], b[1]);
                mma_16816(pt[2 * np + 1], a, b[2], b[3]);
            }
        }
        // Only tiles crossing the diagonal or a sequence end need the per-entry test.
        const bool need_mask = i0 + BR > n_q || k0 + BC > n_kv || (causal && k0 + BC - 1 > i0 + shift);
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + (lane % 4) * 2 + (e % 2);
                float p = fast_exp2(fmaf(pt[nt][e], scale_log2, -tL[col]));
                if (need_mask) {
                    const int key = my_key + (e / 2) * 8, query = i0 + col;
                    if (query >= n_q || key >= n_kv || (causal && key > query + shift)) p = 0.f;
                }
                pt[nt][e] = p;
            }

        if (t + 1 < t_end) {  // the copy of the next query tile (see the top of the loop)
            load_query_tile(t + 1, stage ^ 1);
            cp_async_commit();
        }

        // ---- dV_j += Pᵀ dO_i ---------------------------------------------------------------------
#pragma unroll
        for (int ks = 0; ks < BR / 16; ++ks) {
            u32 a[4] = {pack2(pt[2 * ks][0], pt[2 * ks][1]), pack2(pt[2 * ks][2], pt[2 * ks][3]),
                        pack2(pt[2 * ks + 1][0], pt[2 * ks + 1][1]),
                        pack2(pt[2 * ks + 1][2], pt[2 * ks + 1][3])};
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans_a(b, bdOt.at(dp, srow + ks * 16));
                mma_16816(dv[2 * dp], a, b[0], b[1]);
                mma_16816(dv[2 * dp + 1], a, b[2], b[3]);
            }
        }

        // ---- dPᵀ = V_j dO_iᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − D_i), kept in pt -----------------------------
        {
            float dpt[NQ][4];
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) dpt[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a[4];
                ldmatrix_x4_a(a, aV.at(kk, 0));
#pragma unroll
                for (int np = 0; np < NQ / 2; ++np) {
                    u32 b[4];
                    ldmatrix_x4_a(b, bdO.at(kk, srow + np * 16));
                    mma_16816(dpt[2 * np], a, b[0], b[1]);
                    mma_16816(dpt[2 * np + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = nt * 8 + (lane % 4) * 2 + (e % 2);
                    pt[nt][e] *= dpt[nt][e] - tDelta[col];
                }
        }

        // ---- dK_j += dSᵀ Q_i, and dSᵀ to shared memory for dQ ------------------------------------
#pragma unroll
        for (int ks = 0; ks < BR / 16; ++ks) {
            u32 a[4] = {pack2(pt[2 * ks][0], pt[2 * ks][1]), pack2(pt[2 * ks][2], pt[2 * ks][3]),
                        pack2(pt[2 * ks + 1][0], pt[2 * ks + 1][1]),
                        pack2(pt[2 * ks + 1][2], pt[2 * ks + 1][3])};
            const int r = warp * 16 + lane / 4, c = ks * 16 + (lane % 4) * 2;
            *reinterpret_cast<u32*>(sdS + swz<BR>(r, c)) = a[0];
            *reinterpret_cast<u32*>(sdS + swz<BR>(r + 8, c)) = a[1];
            *reinterpret_cast<u32*>(sdS + swz<BR>(r, c + 8)) = a[2];
            *reinterpret_cast<u32*>(sdS + swz<BR>(r + 8, c + 8)) = a[3];
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans_a(b, bQt.at(dp, srow + ks * 16));
                mma_16816(dk[2 * dp], a, b[0], b[1]);
                mma_16816(dk[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();

        // ---- dQ_i += dS K_j: warp w takes the 16 queries of slab w mod SLABS and a 1/DSPLIT share
        // of d, 32 columns at a time (the partial product stays at 16 registers). ----------------
        constexpr int SLABS = BR / 16, DSPLIT = WARPS / SLABS, DW = D / DSPLIT;
        static_assert(SLABS * DSPLIT == WARPS && DW % 32 == 0, "warps tile dQ exactly");
        const int slab = warp % SLABS, d_begin = (warp / SLABS) * DW;
        const int q_row = i0 + slab * 16 + lane / 4;
#pragma unroll
        for (int d0 = 0; d0 < DW; d0 += 32) {
            float dq[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq[nt][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < BC / 16; ++ks) {
                u32 a[4];
                ldmatrix_x4_trans_a(a, adS.at(slab, ks * 16));
#pragma unroll
                for (int dp = 0; dp < 2; ++dp) {
                    u32 b[4];
                    ldmatrix_x4_trans_a(b, bKt.at((d_begin + d0) / 16 + dp, ks * 16));
                    mma_16816(dq[2 * dp], a, b[0], b[1]);
                    mma_16816(dq[2 * dp + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = q_row + h * 8;
                    const int col = d_begin + d0 + nt * 8 + (lane % 4) * 2;
                    if (row < n_q)
                        red_add2(gdQ + (size_t)row * D + col, dq[nt][2 * h], dq[nt][2 * h + 1]);
                }
        }
    }
    cp_async_wait<0>();

    // ---- dK_j, dV_j of this query head (unscaled, f32); finish sums the group ----------------------
    float* gdK = dk_acc + (bh * n_kv) * D;
    float* gdV = dv_acc + (bh * n_kv) * D;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = my_key + h * 8;
        if (key >= n_kv) continue;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            const int col = dt * 8 + (lane % 4) * 2;
            float* pk = gdK + (size_t)key * D + col;
            float* pv = gdV + (size_t)key * D + col;
            pk[0] = dk[dt][2 * h];
            pk[1] = dk[dt][2 * h + 1];
            pv[0] = dv[dt][2 * h];
            pv[1] = dv[dt][2 * h + 1];
        }
    }
}

// ---- finish: dQ = scale·dQ_acc; dK = scale·Σ_group dK_acc; dV = Σ_group dV_acc; to 16 bits -------
extern "C" __global__ void fa2_backward_finish(const float* __restrict__ dq_acc,
                                               const float* __restrict__ dk_acc,
                                               const float* __restrict__ dv_acc,
                                               u16* __restrict__ dq, u16* __restrict__ dk,
                                               u16* __restrict__ dv, long long dq_len,
                                               long long dkv_len, int group, long long head_len,
                                               float scale) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < dq_len; i += stride)
        dq[i] = from_f32(dq_acc[i] * scale);
    // dK/dV element i belongs to kv head bk = i / head_len, whose query heads are
    // bk·group … bk·group + group − 1 (batch-major, so the flat index works across batches).
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < dkv_len; i += stride) {
        const long long bk = i / head_len, off = i % head_len;
        float sk = 0.f, sv = 0.f;
        for (int g = 0; g < group; ++g) {
            const long long src = (bk * group + g) * head_len + off;
            sk += dk_acc[src];
            sv += dv_acc[src];
        }
        dk[i] = from_f32(sk * scale);
        dv[i] = from_f32(sv);
    }
}
