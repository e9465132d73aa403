/// FA2's forward pass as a block program: program (i, h, b) owns query rows i·br .. i·br + br
/// of q head h of batch b, and writes their O and lse.
fn fa2_program(p: &mut Program, x: &Fa2Args) {
    let (i, h, b) = (p.program_id(0), p.program_id(1), p.program_id(2));
    let kh = x.kv_head(h);
    let rows = i * x.br..(i + 1) * x.br;
    let in_q = |r: usize| r < x.n_q; // the last block may run past the end of the sequence
    // Q once, before the key loop: it stays on chip (the kernel's sQ).
    let q = p.load(x.q, b, h, rows.clone(), in_q);
    let mut acc = Array2::<f32>::zeros((x.br, x.d));
    let mut m = Array1::from_elem(x.br, f32::NEG_INFINITY);
    let mut l = Array1::<f32>::zeros(x.br);
    // Keys past the last one the block's last row sees are above the causal diagonal for every
    // row of the block: their tiles are never loaded.
    let end = x.mask.visible_end(rows.end.min(x.n_q) - 1);
    for c0 in (0..end).step_by(x.bc) {
        // Whole tiles, masked only past n_kv (the kernel's zero-filled cp.async).
        let k = p.load(x.k, b, kh, c0..c0 + x.bc, |c| c < x.n_kv);
        let v = p.load(x.v, b, kh, c0..c0 + x.bc, |c| c < x.n_kv);
        let mut scores = q.dot(&k.t()) * x.scale;
        for r in 0..x.br {
            // The keys row r does not see (right of the diagonal, or past n_kv) score −∞.
            let visible = x.mask.visible_end(rows.start + r).saturating_sub(c0).min(x.bc);
            let mut row = scores.row_mut(r);
            row.slice_mut(s![visible..]).fill(f32::NEG_INFINITY);
            let m_new = row.iter().copied().fold(m[r], f32::max);
            if m_new == f32::NEG_INFINITY {
                row.fill(0.0); // this row has seen no key yet
                continue;
            }
            let alpha = (m[r] - m_new).exp(); // 0 while m = −∞
            row.mapv_inplace(|t| (t - m_new).exp());
            l[r] = alpha * l[r] + row.sum();
            acc.row_mut(r).mapv_inplace(|a| a * alpha);
            m[r] = m_new;
        }
        acc += &scores.dot(&v); // unnormalised: no division here
    }
    let mut lse = Array1::from_elem(x.br, f32::NEG_INFINITY);
    for r in 0..x.br {
        if l[r] > 0.0 {
            acc.row_mut(r).mapv_inplace(|a| a / l[r]); // the one division per row
            lse[r] = m[r] + l[r].ln();
        }
    }
    // O and lse once, after the loop; rows past n_q are masked.
    p.store(x.o, b, h, rows.clone(), &acc, in_q);
    p.store(x.lse, b, h, rows, &lse, in_q);
}
