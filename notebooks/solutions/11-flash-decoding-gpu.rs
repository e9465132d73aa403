/// The kernel's warp merge for one row: (m_w, l_w, acc_w) of each warp, base 2, into (O, lse).
fn merge(m: &[f32], l: &[f32], acc: &[Vec<f32>]) -> (Vec<f32>, f32) {
    let d = acc.first().map_or(0, |a| a.len());
    let top = m.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // No warp saw a key: subtract 0, so that every weight is 2^(−inf) = 0 rather than NaN.
    let shift = if top == f32::NEG_INFINITY { 0.0 } else { top };
    let mut o = vec![0f32; d];
    let mut total = 0f32;
    for ((&m_w, &l_w), acc_w) in m.iter().zip(l).zip(acc) {
        let f = (m_w - shift).exp2();
        total += f * l_w;
        for (x, &a) in o.iter_mut().zip(acc_w) {
            *x += f * a;
        }
    }
    if total == 0.0 {
        return (vec![0.0; d], f32::NEG_INFINITY);
    }
    o.iter_mut().for_each(|x| *x /= total);
    (o, top * std::f32::consts::LN_2 + total.ln())
}
