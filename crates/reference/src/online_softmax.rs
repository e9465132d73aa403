//! Rung 2: online softmax, one pass per row and no `N × N` buffer.
//!
//! The naive rung needs the whole row of scores before it can normalise: first the max, then the
//! sum. The online normaliser (Milakov & Gimelshein 2018, "Online normalizer calculation for
//! softmax", Algorithm 3) keeps a running max `m` and a running sum `l` and fixes up the sum
//! whenever the max grows:
//!
//! ```text
//! for each visible key j:
//!     s     = scale · q · k_j
//!     m_new = max(m, s)
//!     l     = l · exp(m − m_new) + exp(s − m_new)
//!     acc   = acc · exp(m − m_new) + exp(s − m_new) · v_j     ← the same fix-up, applied to O
//!     m     = m_new
//! o = acc / l,   lse = m + ln l
//! ```
//!
//! Extending the fix-up to the output accumulator is what makes attention a single pass over
//! the keys; every later rung is this loop, tiled.

use ndarray::{Array1, ArrayView4, Zip};

use crate::element::Element;
use crate::error::Result;
use crate::options::AttentionOptions;
use crate::output::{AttentionOutput, Counters};
use crate::problem::Problem;
use crate::tile::{exp_diff, nan_max, normalise_row, shift_of};

/// Online-softmax attention: each query row streams over its keys once.
pub fn attention<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &AttentionOptions,
) -> Result<AttentionOutput<T>> {
    let problem = Problem::new(q, k, v, opts)?;
    let shape = problem.shape;
    let d = shape.d;
    let counters = Counters::new(size_of::<T>());

    let (o, lse) = problem.per_head(|head, mut o, mut lse| {
        let (scale, k, v) = (head.scale, head.k, head.v);
        for (i, q_row) in head.q.rows().into_iter().enumerate() {
            let seen: Vec<usize> = head.row_runs(i).into_iter().flatten().collect();
            let (mut m, mut l) = (T::neg_infinity(), T::zero());
            let mut acc = Array1::zeros(d);
            for &j in &seen {
                let score = head.logit(scale * q_row.dot(&k.row(j)), i, j);
                let m_new = nan_max(m, score);
                let alpha = exp_diff(m, m_new);
                let p = (score - shift_of(m_new)).exp();
                l = l * alpha + p;
                Zip::from(&mut acc).and(v.row(j)).for_each(|a, &vj| *a = *a * alpha + p * vj);
                m = m_new;
            }
            lse[i] = normalise_row(acc.view_mut(), m, l, head.sink);
            o.row_mut(i).assign(&acc);
            // HBM model: no on-chip reuse, every row streams its keys and values.
            counters.read(d + 2 * seen.len() * d);
            counters.write(d + 1);
        }
    });
    Ok(AttentionOutput { o, lse, stats: counters.stats(shape.batch * shape.heads_q) })
}
