// Tensor-core fragments of mma.sync.m16n8k16 (16-bit inputs, f32 accumulate): where each lane's
// registers sit in the tiles, named once here.
//
//   A (16×16, m × k), 4 registers of two 16-bit values: a[i] holds row a_row(i), columns
//     a_col(i) and a_col(i) + 1, with a_row(i) = lane/4 + 8·(i%2), a_col(i) = 2·(lane%4) + 8·(i/2).
//   B (16×8, k × n), 2 registers: b[i] holds column n = lane/4, rows k = 2·(lane%4) + 8·i and +1.
//   C/D accumulator (16×8, m × n), 4 floats: c[e] is at row acc_row(e) = lane/4 + 8·(e/2),
//     column acc_col(nt, e) = 8·nt + 2·(lane%4) + e%2 of the nt-th 8-column tile.
//
// The accumulator of two adjacent 8-column tiles and the A operand of a 16-wide k-step give each
// thread the same rows and column pairs, so a product's result (P, dS) becomes the next product's
// A operand in registers (a_from_acc).
//
// Operands come from shared memory through ldmatrix.x4, which reads four 8×8 matrices of 16-bit
// elements, lanes 8i … 8i+7 giving the row addresses of matrix i; each matrix lands in one
// register per lane. The tiles in shared memory are row-major and swizzled (copy.cuh), and a
// 16×16 block is two 16-byte chunks wide; the four operand kinds differ only in which matrix
// (rows 0-7 or 8-15, chunk 0 or 1) each group of eight lanes points at:
//
//   a_operand        A, tile rows = m, chunks along k     matrices (r0,c0) (r8,c0) (r0,c1) (r8,c1)
//   b_operand        B, tile rows = n, chunks along k     matrices (r0,c0) (r0,c1) (r8,c0) (r8,c1)
//                    (e.g. K for S = Q·Kᵀ: rows are keys)
//   b_operand_trans  B, tile rows = k, chunks along n,    matrices (r0,c0) (r8,c0) (r0,c1) (r8,c1)
//                    transposed by ldmatrix.trans (e.g. V for O = P·V: rows are keys)
//   a_operand_trans  A, tile rows = k, chunks along m,    matrices (r0,c0) (r0,c1) (r8,c0) (r8,c1)
//                    transposed by ldmatrix.trans (e.g. dSᵀ stored keys × queries, for dS·K)
//
// The two B kinds load a 16-wide block of n, that is B for two adjacent 8-column accumulator
// tiles: registers 0, 1 for the first, 2, 3 for the second (mma_16x16).
#ifndef LADDER_MMA_CUH
#define LADDER_MMA_CUH

#include "copy.cuh"
#include "types.cuh"

// ---- register layouts --------------------------------------------------------------------------

__device__ __forceinline__ int acc_row(int e) { return lane_id() / 4 + (e / 2) * 8; }
__device__ __forceinline__ int acc_col(int nt, int e) {
    return nt * 8 + (lane_id() % 4) * 2 + e % 2;
}
__device__ __forceinline__ int a_row(int i) { return lane_id() / 4 + (i % 2) * 8; }
__device__ __forceinline__ int a_col(int i) { return (lane_id() % 4) * 2 + (i / 2) * 8; }

// Zero an accumulator (any array of floats).
__device__ __forceinline__ void zero(float& x) { x = 0.f; }
template <typename T, int N>
__device__ __forceinline__ void zero(T (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) zero(a[i]);
}

// The A operand of a 16-wide k-step from two adjacent accumulator tiles (columns 0-7, 8-15),
// rounded to 16 bits.
__device__ __forceinline__ void a_from_acc(u32 (&a)[4], const float (&c0)[4],
                                           const float (&c1)[4]) {
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}
// The same from accumulator tiles already rounded to 16 bits, one register per row half
// (p[h] = pack2(c[2h], c[2h + 1])).
__device__ __forceinline__ void a_from_packed(u32 (&a)[4], const u32 (&p0)[2],
                                              const u32 (&p1)[2]) {
    a[0] = p0[0];
    a[1] = p0[1];
    a[2] = p1[0];
    a[3] = p1[1];
}

// Store an A operand (16×16, m × k) into a swizzled shared tile of COLS columns at (row0, col0).
template <int COLS>
__device__ __forceinline__ void store_a(u16* tile, int row0, int col0, const u32 (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        *reinterpret_cast<u32*>(tile + swz<COLS>(row0 + a_row(i), col0 + a_col(i))) = a[i];
}

// Transpose an 8×8 matrix of 16-bit values held one register per lane, lane holding row lane/4,
// columns 2·(lane%4) and +1 (the layout pack2(c[2h], c[2h + 1]) gives an accumulator's row half):
// afterwards the lane holds the same places of the transpose (movmatrix, sm_75+, no shared
// memory). FlashDecoding++'s flat GEMM uses it to turn the accumulator of Sᵀ = K·Qᵀ (keys × query
// rows) into the B operand of Oᵀ = Vᵀ·Pᵀ (k = keys, n = rows): B's register i is
// transpose_8x8(pack2(c[2i], c[2i + 1])), keys 8i … 8i + 7.
__device__ __forceinline__ u32 transpose_8x8(u32 x) {
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// ---- ldmatrix and mma ---------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr));
}

// D += A·B for one 16×8×16 tile: A is 4 registers (16×16), B is 2 (16×8), D is 4 floats (16×8).
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if LADDER_DTYPE == 1
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two adjacent accumulator tiles (16×16: c0 columns 0-7, c1 columns 8-15) += A·B, with B a
// 16×16 block as a B operand load leaves it.
__device__ __forceinline__ void mma_16x16(float (&c0)[4], float (&c1)[4], const u32 (&a)[4],
                                          const u32 (&b)[4]) {
    mma_16816(c0, a, b[0], b[1]);
    mma_16816(c1, a, b[2], b[3]);
}

// ---- fragment addresses -------------------------------------------------------------------------

// ldmatrix addresses into a swizzled tile, from one register per operand. A thread reads 16-byte
// chunk `2c + hi` of its row at step c (hi = which 8-column half); the swizzle sends it to chunk
// (2c + hi) ^ (row mod 8) = 2c ^ y with y = hi ^ (row mod 8). Rows start on 128-byte boundaries,
// so the address is (row_addr | y·16) ^ ((c mod 4)·32) + (c / 4)·128: one XOR with a constant per
// load. The XOR is opaque (asm volatile) so that the compiler does not precompute and hold one
// address register per step, which is what pushed the kernels into spilling.
template <int COLS>
struct FragAddr {
    u32 base;
    __device__ __forceinline__ FragAddr(const u16* tile, int row, int hi) {
        base = (smem_addr(tile) + row * COLS * 2) | (((hi ^ (row & 7))) << 4);
    }
    // Address for step `c` (a compile-time constant after unrolling), `rows` rows further down.
    __device__ __forceinline__ u32 at(int c, int rows) const {
        u32 x;
        asm volatile("xor.b32 %0, %1, %2;" : "=r"(x) : "r"(base), "r"((c & 3) << 5));
        return x + (c >> 2) * 128 + rows * COLS * 2;
    }
};

// One operand kind of a tile: its fragment address and whether ldmatrix transposes.
template <int COLS, bool TRANS>
struct Operand {
    FragAddr<COLS> addr;
    // The 16×16 block whose columns are chunks 2c, 2c + 1 (c = k-step for a_operand and b_operand,
    // the 16-wide n or m block for the transposed kinds), `rows` tile rows further down.
    __device__ __forceinline__ void load(u32 (&r)[4], int c, int rows) const {
        if (TRANS)
            ldmatrix_x4_trans(r, addr.at(c, rows));
        else
            ldmatrix_x4(r, addr.at(c, rows));
    }
};

// Lane patterns of the table above: lane -> (row in the 16-row block, chunk half).
//   rows first:   matrices (r0,c0) (r8,c0) (r0,c1) (r8,c1)
//   chunks first: matrices (r0,c0) (r0,c1) (r8,c0) (r8,c1)
template <int COLS, bool TRANS>
__device__ __forceinline__ Operand<COLS, TRANS> rows_first(const u16* tile, int row0) {
    const int lane = lane_id();
    return {FragAddr<COLS>(tile, row0 + lane % 16, lane / 16)};
}
template <int COLS, bool TRANS>
__device__ __forceinline__ Operand<COLS, TRANS> chunks_first(const u16* tile) {
    const int lane = lane_id();
    return {FragAddr<COLS>(tile, lane % 8 + (lane / 16) * 8, (lane / 8) % 2)};
}

// A operand, rows [row0, row0 + 16) of the tile = m, columns = k.
template <int COLS>
__device__ __forceinline__ Operand<COLS, false> a_operand(const u16* tile, int row0) {
    return rows_first<COLS, false>(tile, row0);
}
// B operand, tile rows = n, columns = k (a row-major Kᵀ factor: K for Q·Kᵀ).
template <int COLS>
__device__ __forceinline__ Operand<COLS, false> b_operand(const u16* tile) {
    return chunks_first<COLS, false>(tile);
}
// B operand, tile rows = k, columns = n (a row-major factor: V for P·V).
template <int COLS>
__device__ __forceinline__ Operand<COLS, true> b_operand_trans(const u16* tile) {
    return rows_first<COLS, true>(tile, 0);
}
// A operand, tile rows = k, columns = m (the transpose of a row-major A is stored).
template <int COLS>
__device__ __forceinline__ Operand<COLS, true> a_operand_trans(const u16* tile) {
    return chunks_first<COLS, true>(tile);
}

// One 16-wide k-step of C += A·B for two adjacent accumulator tiles: load B (columns n0 … n0+15
// as the operand kind defines them) and issue the two mma.
template <int COLS, bool TRANS>
__device__ __forceinline__ void mma_k16(float (&c0)[4], float (&c1)[4], const u32 (&a)[4],
                                       const Operand<COLS, TRANS>& b, int c, int rows) {
    u32 f[4];
    b.load(f, c, rows);
    mma_16x16(c0, c1, a, f);
}

// C += A·Bᵀ over the whole head dimension D, for the warp's MT 16-row tiles of A and NT 8-column
// tiles of C: the product S = Q·Kᵀ (and dP = dO·Vᵀ) of every kernel. `a` holds the warp's rows
// (a_operand), `b` the rows of B from `b_rows` on (b_operand: the rows are C's columns, e.g. keys).
// Per 16-wide k-step: the MT A fragments, then per pair of C tiles one B load and MT·2 mma.
template <int D, int MT, int NT, int COLS>
__device__ __forceinline__ void mma_abt(float (&c)[MT][NT][4], const Operand<COLS, false>& a,
                                        const Operand<COLS, false>& b, int b_rows) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 fa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) a.load(fa[mt], kk, mt * 16);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 fb[4];
            b.load(fb, kk, b_rows + np * 16);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_16x16(c[mt][2 * np], c[mt][2 * np + 1], fa[mt], fb);
        }
    }
}

#endif  // LADDER_MMA_CUH
