/// softmax(scale · Q Kᵀ) V for one head, no mask.
fn attention_head(q: ArrayView2<f32>, k: ArrayView2<f32>, v: ArrayView2<f32>, scale: f32) -> Array2<f32> {
    let mut p = q.dot(&k.t()) * scale; // S, n_q × n_kv
    for mut row in p.rows_mut() {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max); // pass 1: the max
        row.mapv_inplace(|s| (s - m).exp()); // pass 2: exponentials…
        let l = row.sum(); // …and their sum
        row /= l; // pass 3: normalise
    }
    p.dot(&v)
}
