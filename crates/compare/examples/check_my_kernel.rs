//! Check your own attention kernel against the ladder (`ladder_compare::check`).
//!
//! A user's kernel — one pass over the keys per query row with a running max, a running sum and
//! an unnormalised accumulator (the online softmax every FlashAttention kernel is built on) — is
//! checked as written, and passes; then with the rescale factor α left out, and fails, shrunk to
//! the smallest problem that shows the bug.
//!
//! ```sh
//! cargo run -p ladder-compare --example check_my_kernel
//! ```
//!
//! Its output is committed as `docs/figures/check-my-kernel.txt`, which the book's chapter "Check
//! your own kernel" includes; `.ci/examples` runs it again and fails if the output has changed.
//! It exits with status 1 if the correct kernel fails or the broken one passes.

use std::convert::Infallible;
use std::process::ExitCode;

use ladder_compare::check::{Check, Element, Output, Precision, Problem};
use ndarray::{Array3, Array4, s};

// ANCHOR: kernel
/// Attention the way a kernel computes it, in `T`: for each query row, one pass over the keys
/// it sees, keeping the running max `m`, the running sum `l` of `exp(s − m)` and the
/// accumulator `acc` of `exp(s − m) · v`. When a key raises the max, everything summed so far
/// was scaled by the old max and must be rescaled by `α = exp(m_old − m_new)`;
/// `rescale = false` leaves α out.
fn my_attention<T: Element>(x: &Problem, rescale: bool) -> Output {
    let (inputs, shape) = (x.inputs::<T>(), x.shape());
    let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
    let scale = T::of(x.scale());
    let group = shape.heads_q / shape.heads_kv; // query heads per key/value head
    let mut o = Array4::<T>::zeros(shape.q_dims());
    let mut lse = Array3::<T>::zeros((shape.batch, shape.heads_q, shape.n_q));
    for b in 0..shape.batch {
        for h in 0..shape.heads_q {
            let kv = h / group;
            for i in 0..shape.n_q {
                // Causal, bottom-right aligned: query i sees keys j ≤ i + n_kv − n_q.
                let seen = match x.causal() {
                    true => (i + 1 + shape.n_kv).saturating_sub(shape.n_q),
                    false => shape.n_kv,
                };
                let (mut m, mut l) = (T::neg_infinity(), T::zero());
                let mut acc = vec![T::zero(); shape.d];
                for j in 0..seen {
                    let score = scale * q.slice(s![b, h, i, ..]).dot(&k.slice(s![b, kv, j, ..]));
                    let m_new = m.max(score);
                    let alpha = if rescale { (m - m_new).exp() } else { T::one() };
                    let p = (score - m_new).exp();
                    l = alpha * l + p;
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = alpha * *a + p * v[[b, kv, j, c]];
                    }
                    m = m_new;
                }
                if seen == 0 {
                    lse[[b, h, i]] = T::neg_infinity(); // a row that sees no key: O = 0
                    continue;
                }
                for (c, a) in acc.iter().enumerate() {
                    o[[b, h, i, c]] = *a / l;
                }
                lse[[b, h, i]] = m + l.ln();
            }
        }
    }
    Output::new(o, lse)
}
// ANCHOR_END: kernel

// ANCHOR: check
/// The kernel in the problem's precision: the check runs every case in `f32` and in `f64`.
fn in_precision(x: &Problem, rescale: bool) -> Result<Output, Infallible> {
    Ok(match x.precision {
        Precision::F64 => my_attention::<f64>(x, rescale),
        _ => my_attention::<f32>(x, rescale),
    })
}

fn main() -> ExitCode {
    // 256 cases, each in f32 and f64, from a fixed seed (so that the book's copy stays true).
    let check = |name: &str| Check::new(name).cases(256).seed(2024);

    match check("my_attention").run(|x| in_precision(x, true)) {
        Ok(passed) => println!("{passed}"),
        Err(failed) => {
            println!("{failed}");
            return ExitCode::FAILURE; // a correct kernel must pass
        }
    }

    println!();
    match check("my_attention without α").run(|x| in_precision(x, false)) {
        Ok(passed) => {
            println!("{passed}\nthe broken kernel passed: the checker is broken");
            ExitCode::FAILURE
        }
        Err(failed) => {
            println!("{failed}");
            ExitCode::SUCCESS
        }
    }
}
// ANCHOR_END: check
