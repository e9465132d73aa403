/// x ← H · diag(signs) · x / √n in place, with H the Sylvester–Hadamard matrix (n = x.len(), a power of two).
fn rotate(x: &mut [f64], signs: &[f64]) {
    for (v, s) in x.iter_mut().zip(signs) {
        *v *= s;
    }
    // Fast Walsh–Hadamard transform: butterflies at strides 1, 2, 4, …
    let mut h = 1;
    while h < x.len() {
        for start in (0..x.len()).step_by(2 * h) {
            for i in start..start + h {
                let (a, b) = (x[i], x[i + h]);
                x[i] = a + b;
                x[i + h] = a - b;
            }
        }
        h *= 2;
    }
    let norm = 1.0 / (x.len() as f64).sqrt();
    x.iter_mut().for_each(|v| *v *= norm);
}
