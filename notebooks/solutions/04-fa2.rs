/// FA2's work for one query block (one thread block on a GPU): returns (O_i, lse_i).
/// `kv.load(j)` gives key block j as (K_j, V_j); `visible[r]`: how many leading keys row r sees.
fn fa2_query_block(q_i: ArrayView2<f32>, kv: &KvBlocks, scale: f32, visible: &[usize]) -> (Array2<f32>, Array1<f32>) {
    let rows = q_i.nrows();
    let mut acc = Array2::<f32>::zeros((rows, kv.d()));
    let mut m = Array1::from_elem(rows, f32::NEG_INFINITY);
    let mut l = Array1::<f32>::zeros(rows);
    // Key blocks that start past the last key any row sees lie above the causal diagonal:
    // never loaded, never computed.
    let end = visible.iter().copied().max().unwrap_or(0);
    for j in 0..end.div_ceil(kv.bc()) {
        let (k_j, v_j) = kv.load(j);
        let c0 = j * kv.bc();
        let mut p = q_i.dot(&k_j.t()) * scale;
        for r in 0..rows {
            let limit = visible[r].saturating_sub(c0).min(k_j.nrows());
            let mut row = p.row_mut(r);
            row.slice_mut(s![limit..]).fill(f32::NEG_INFINITY); // the mask (diagonal tiles only)
            let m_new = row.iter().copied().fold(m[r], f32::max);
            if m_new == f32::NEG_INFINITY {
                row.fill(0.0); // this row has seen no key yet
                continue;
            }
            let alpha = (m[r] - m_new).exp(); // 0 while m = −∞
            row.mapv_inplace(|x| (x - m_new).exp());
            l[r] = alpha * l[r] + row.sum();
            acc.row_mut(r).mapv_inplace(|a| a * alpha);
            m[r] = m_new;
        }
        acc += &p.dot(&v_j); // unnormalised: no division here
    }
    let mut lse = Array1::from_elem(rows, f32::NEG_INFINITY);
    for r in 0..rows {
        if l[r] > 0.0 {
            acc.row_mut(r).mapv_inplace(|a| a / l[r]); // the one division per row
            lse[r] = m[r] + l[r].ln();
        }
    }
    (acc, lse)
}
