/// One step of the online softmax for one query row: fold in the key with score `s` and value `v`.
/// `m`: running max; `l`: running Σ e^(s − m); `acc`: running Σ e^(s − m)·v (unnormalised).
fn online_update(m: &mut f32, l: &mut f32, acc: &mut [f32], s: f32, v: &[f32]) {
    let m_new = m.max(s);
    // What was accumulated under the old max, re-expressed under the new one (nothing yet: 0).
    let alpha = if *m == f32::NEG_INFINITY { 0.0 } else { (*m - m_new).exp() };
    let p = (s - m_new).exp();
    *l = *l * alpha + p;
    for (a, &vj) in acc.iter_mut().zip(v) {
        *a = *a * alpha + p * vj;
    }
    *m = m_new;
}
