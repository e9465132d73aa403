/// Gemma-2's logit softcap, `cap · tanh(s / cap)`, with its derivative.
fn my_softcap(cap: f64) -> ScoreMod {
    ScoreMod::new("my softcap", move |s, _| cap * (s / cap).tanh())
        // d/ds [c · tanh(s / c)] = 1 − tanh²(s / c) = 1 − (t / c)²: cheap from t.
        .with_derivative(move |_, t, _| 1.0 - (t / cap) * (t / cap))
}
