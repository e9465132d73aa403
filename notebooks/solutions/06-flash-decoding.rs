/// FlashDecoding's phase 2 for one row: combine the chunks' (lse_s, O_s) into (O, lse).
fn combine(lse_s: &[f32], o_s: &[Vec<f32>]) -> (Vec<f32>, f32) {
    let mut o = vec![0f32; o_s.first().map_or(0, |o| o.len())];
    // Shift by the largest lse before exponentiating, as the safe softmax shifts by the max.
    let m = lse_s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return (o, f32::NEG_INFINITY); // no chunk saw a key
    }
    let weights: Vec<f32> = lse_s.iter().map(|&x| (x - m).exp()).collect(); // empty chunks: 0
    let total: f32 = weights.iter().sum();
    for (w, part) in weights.iter().zip(o_s) {
        for (acc, &x) in o.iter_mut().zip(part) {
            *acc += w / total * x;
        }
    }
    (o, m + total.ln())
}
