//! One sequence of a packed variable-length batch (`[total, heads, d]`, rows `cu[b] .. cu[b + 1]`)
//! as a problem of its own, `[1, heads, n, d]`, so that the float64 oracle and the CPU rungs, which
//! take fixed-length batches, can check it. The tests of the CPU and GPU varlen paths cut their
//! outputs up the same way.

use std::ops::Range;

use ladder_reference::AttentionOutput;
use ndarray::{Array2, Array3, Array4, Axis, s};

use crate::Inputs;

/// Rows `rows` of packed `x` as `[1, heads, rows.len(), d]`, copied element by element.
pub fn rows<T: Copy>(x: &Array3<T>, rows: Range<usize>) -> Array4<T> {
    let (_, heads, d) = x.dim();
    Array4::from_shape_fn((1, heads, rows.len(), d), |(_, h, i, c)| x[[rows.start + i, h, c]])
}

/// The inputs of one sequence: its `queries` of Q, its `keys` of K and V, and `dO` zero (forward
/// checks) or `d_o`'s rows of it.
pub fn inputs<T: Copy + num_traits::Zero>(
    (q, k, v): (&Array3<T>, &Array3<T>, &Array3<T>),
    d_o: Option<&Array3<T>>,
    queries: Range<usize>,
    keys: Range<usize>,
) -> Inputs<T> {
    let (_, heads_q, d) = q.dim();
    Inputs {
        q: rows(q, queries.clone()),
        k: rows(k, keys.clone()),
        v: rows(v, keys),
        d_o: match d_o {
            Some(d_o) => rows(d_o, queries),
            None => Array4::zeros((1, heads_q, queries.len(), d)),
        },
    }
}

/// One sequence's rows of a packed output: O `[total_q, heads_q, d]` and lse `[heads_q, total_q]`.
pub fn output(o: &Array3<f32>, lse: &Array2<f32>, queries: Range<usize>) -> AttentionOutput<f32> {
    AttentionOutput {
        o: rows(o, queries.clone()),
        lse: lse.slice(s![.., queries]).insert_axis(Axis(0)).to_owned(),
        stats: Default::default(),
    }
}
