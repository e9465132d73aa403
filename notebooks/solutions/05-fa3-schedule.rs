/// Algorithm 2 for one consumer warpgroup over `n_blocks` key blocks: its operations in the
/// order it issues them. (Stage::Gemm0, j): S_j = Q K_jᵀ; (Stage::Softmax, j); (Stage::Gemm1, j): O += P_j V_j.
fn algorithm2(n_blocks: usize) -> Vec<(Stage, usize)> {
    if n_blocks == 0 {
        return vec![];
    }
    // Prologue: the first block's scores and softmax, with nothing to overlap yet.
    let mut order = vec![(Stage::Gemm0, 0), (Stage::Softmax, 0)];
    for j in 1..n_blocks {
        // S_j is issued before P_{j-1} V_{j-1}; both run on the tensor cores while the
        // softmax of block j (which needs only S_j) runs on the warpgroup's own units.
        order.extend([(Stage::Gemm0, j), (Stage::Gemm1, j - 1), (Stage::Softmax, j)]);
    }
    // Epilogue: the last block's P V.
    order.push((Stage::Gemm1, n_blocks - 1));
    order
}
