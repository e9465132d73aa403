/// Each query sees its own position and the `w - 1` keys before it (w ≥ 1).
fn my_sliding_window(w: usize) -> MaskMod {
    MaskMod::new("my window", move |at: &ScoreIndex| {
        // 0 on the query's own position, −1 for the key before it, …
        let distance = at.from_diagonal();
        distance <= 0 && distance > -(w as i64)
    })
}
