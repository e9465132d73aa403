/// The first query tile (of `br` rows) that sees any key of the block starting at key `k0`,
/// bottom-right causal, with `n_q` queries and `n_kv` keys (0 when every tile does).
fn first_query_tile(k0: usize, n_q: usize, n_kv: usize, br: usize) -> usize {
    // The block's first key is the one seen earliest: by query q when k0 <= q + n_kv - n_q, that
    // is from q = k0 - (n_kv - n_q) on (and from 0 when that is negative). Its tile:
    (k0 + n_q).saturating_sub(n_kv) / br
}
