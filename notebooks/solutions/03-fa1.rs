/// Algorithm 1, lines 11–12, for one query row.
/// `o`: the row's output so far, normalised; `m`, `l`: its running max and sum.
/// `tile_max` = m̃, `tile_sum` = l̃ = Σ e^(s − m̃) and `tile_pv` = Σ e^(s − m̃)·v over the tile's keys.
fn fa1_merge(o: &mut [f32], m: &mut f32, l: &mut f32, tile_max: f32, tile_sum: f32, tile_pv: &[f32]) {
    let m_new = m.max(tile_max);
    // e^(m − m_new) and e^(m̃ − m_new), taken as 0 for a side that has seen nothing (−∞).
    let old = if *m == f32::NEG_INFINITY { 0.0 } else { (*m - m_new).exp() };
    let new = if tile_max == f32::NEG_INFINITY { 0.0 } else { (tile_max - m_new).exp() };
    let l_new = old * *l + new * tile_sum;
    if l_new > 0.0 {
        let (carry, fresh) = (*l * old / l_new, new / l_new);
        for (o, &pv) in o.iter_mut().zip(tile_pv) {
            *o = carry * *o + fresh * pv;
        }
    }
    *m = m_new;
    *l = l_new;
}
