/// FlashDecoding++'s combine for one row: the splits' (acc_s, l_s, lr_s) and φ (natural log)
/// into (O, lse).
fn combine(phi: f32, acc: &[Vec<f32>], l: &[f32], lr: &[f32]) -> (Vec<f32>, f32) {
    let d = acc.first().map_or(0, |a| a.len());
    let (l, lr): (f32, f32) = (l.iter().sum(), lr.iter().sum());
    if lr == 0.0 {
        return (vec![0.0; d], f32::NEG_INFINITY); // no key
    }
    // O by the sum of P as it multiplied V (an exact weighted mean of V); lse by the exact sum.
    let o = (0..d).map(|c| acc.iter().map(|a| a[c]).sum::<f32>() / lr).collect();
    (o, phi + l.ln())
}
