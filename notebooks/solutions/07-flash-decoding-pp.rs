/// FlashDecoding++ for one query row. `scores[j]`, `v.row(j)`: the keys the row sees, split in `chunks`.
/// Some((O, lse)) from the unified max φ, or None when the row must be recomputed by FlashDecoding.
fn unified_max_row(scores: &[f32], v: ArrayView2<f32>, chunks: &[Range<usize>], phi: f32, lo: f32, hi: f32) -> Option<(Vec<f32>, f32)> {
    let d = v.ncols();
    let (mut acc, mut l, mut max) = (vec![0f32; d], 0f32, f32::NEG_INFINITY);
    for chunk in chunks {
        // Phase 1 (in parallel on a GPU): no running max, no rescale, no dependency on other chunks.
        let (mut acc_s, mut l_s, mut max_s) = (vec![0f32; d], 0f32, f32::NEG_INFINITY);
        for j in chunk.clone() {
            let p = (scores[j] - phi).exp();
            l_s += p;
            max_s = max_s.max(scores[j]);
            for c in 0..d {
                acc_s[c] += p * v[[j, c]];
            }
        }
        // Phase 2: the partials are simply summed.
        l += l_s;
        max = max.max(max_s);
        acc.iter_mut().zip(&acc_s).for_each(|(a, b)| *a += b);
    }
    let offset = max - phi;
    if !(offset >= lo && offset <= hi && l.is_finite() && l > 0.0) {
        return None; // out of the safe range: FlashDecoding recomputes this row
    }
    Some((acc.iter().map(|a| a / l).collect(), phi + l.ln()))
}
