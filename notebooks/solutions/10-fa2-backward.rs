/// D_i = Σ_c dO_ic · O_ic for the rows of one head: `o` and `d_o` are [n_q, d]; returns [n_q].
fn delta(o: ArrayView2<f32>, d_o: ArrayView2<f32>) -> Array1<f32> {
    // One dot product per row: O and dO are all it needs, never P.
    Array1::from_iter(o.rows().into_iter().zip(d_o.rows()).map(|(o_i, do_i)| o_i.dot(&do_i)))
}

/// dS = P ∘ (dP − D) for one tile: `p` and `dp` are [rows, cols], `d` holds D of the tile's rows.
fn ds(p: ArrayView2<f32>, dp: ArrayView2<f32>, d: ArrayView1<f32>) -> Array2<f32> {
    // D is one number per row: broadcast it across the tile's columns.
    &p * &(&dp - &d.insert_axis(Axis(1)))
}
