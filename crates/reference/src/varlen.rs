//! Variable-length batches: sequences of different lengths packed back to back, as a serving
//! engine batches ragged prompts (FlashAttention's `flash_attn_varlen_func`, cuDNN's ragged
//! offsets). No row of padding is stored or computed.
//!
//! Q is `[total_q, heads_q, d]` and K, V are `[total_k, heads_kv, d]`. Sequence `b` owns rows
//! `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` of Q and `cu_seqlens_k[b] .. cu_seqlens_k[b + 1]` of
//! K and V ([`SeqLens`]: `batch + 1` offsets each, from 0 to the token count). Each sequence is an
//! attention problem of its own, with its own bottom-right causal mask and GQA grouping, so
//! [`forward`] runs any rung on each sequence in turn and packs the results the same way: O
//! `[total_q, heads_q, d]` and lse `[heads_q, total_q]` (FlashAttention's varlen layout). A
//! sequence without queries adds nothing; the rows of one without keys see no key, so they get
//! `O = 0` and `lse = −∞` (the ladder's rule) without a call to the rung, whose shapes are never
//! empty. [`backward`] does the same for a backward rung: dQ packed like Q, dK and dV like K
//! (zero for the keys of a sequence without queries, and dQ for the rows of one without keys).
//!
//! ```
//! use ladder_reference::varlen::{self, SeqLens};
//! use ladder_reference::{AttentionOptions, naive};
//! use ndarray::Array3;
//!
//! // Two sequences: 3 queries against 5 keys, then 2 against 2; 4 query heads, 2 kv heads.
//! let lens = SeqLens::from_lengths(&[3, 2], &[5, 2])?;
//! let q = Array3::<f64>::from_shape_fn((5, 4, 8), |(t, h, c)| (t + h + c) as f64 * 0.1);
//! let kv = Array3::<f64>::from_shape_fn((7, 2, 8), |(t, h, c)| (t * h + c) as f64 * 0.05);
//! let opts = AttentionOptions::causal();
//! let out = varlen::forward(q.view(), kv.view(), kv.view(), &lens, |q, k, v| {
//!     naive::attention(q, k, v, &opts)
//! })?;
//! assert_eq!((out.o.dim(), out.lse.dim()), ((5, 4, 8), (4, 5)));
//! # Ok::<(), ladder_reference::LadderError>(())
//! ```

use std::ops::Range;

use ndarray::{Array1, Array2, Array3, ArrayView2, ArrayView3, ArrayView4, Axis, s};

use crate::element::Element;
use crate::error::{LadderError, Result};
use crate::output::{AttentionOutput, Gradients, RunStats};

/// Where each sequence's queries and keys lie in the packed tensors: `cu_seqlens_q` and
/// `cu_seqlens_k`, the offsets of the sequences' first rows (`batch + 1` each, the last the token
/// count), checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqLens {
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
}

impl SeqLens {
    /// Checked offsets: as many of each, at least two (one sequence), starting at 0, never
    /// decreasing (a sequence may be empty).
    pub fn new(cu_seqlens_q: &[usize], cu_seqlens_k: &[usize]) -> Result<SeqLens> {
        for (name, cu) in [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)] {
            if cu.len() < 2 {
                return Err(mismatch(format!(
                    "{name} has {} entries: it needs batch + 1 (at least 2)",
                    cu.len()
                )));
            }
            if cu[0] != 0 {
                return Err(mismatch(format!("{name} starts at {}, not 0", cu[0])));
            }
            if let Some(b) = cu.windows(2).position(|w| w[1] < w[0]) {
                return Err(mismatch(format!(
                    "{name} decreases at sequence {b}: {} then {}",
                    cu[b],
                    cu[b + 1]
                )));
            }
        }
        if cu_seqlens_q.len() != cu_seqlens_k.len() {
            return Err(mismatch(format!(
                "cu_seqlens_q has {} entries and cu_seqlens_k {}: one per sequence plus one each",
                cu_seqlens_q.len(),
                cu_seqlens_k.len()
            )));
        }
        Ok(SeqLens { cu_q: cu_seqlens_q.to_vec(), cu_k: cu_seqlens_k.to_vec() })
    }

    /// The offsets of sequences of `q_lens` queries and `k_lens` keys (the prefix sums).
    pub fn from_lengths(q_lens: &[usize], k_lens: &[usize]) -> Result<SeqLens> {
        let offsets = |lens: &[usize]| {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |end, &n| {
                    *end += n;
                    Some(*end)
                }))
                .collect()
        };
        let (cu_q, cu_k): (Vec<usize>, Vec<usize>) = (offsets(q_lens), offsets(k_lens));
        SeqLens::new(&cu_q, &cu_k)
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    /// `cu_seqlens_q`.
    pub fn cu_seqlens_q(&self) -> &[usize] {
        &self.cu_q
    }

    /// `cu_seqlens_k`.
    pub fn cu_seqlens_k(&self) -> &[usize] {
        &self.cu_k
    }

    /// The query rows of sequence `b`.
    pub fn q_range(&self, b: usize) -> Range<usize> {
        self.cu_q[b]..self.cu_q[b + 1]
    }

    /// The key rows of sequence `b`.
    pub fn k_range(&self, b: usize) -> Range<usize> {
        self.cu_k[b]..self.cu_k[b + 1]
    }

    /// The longest sequence's queries and keys (FlashAttention's `max_seqlen_q`, `max_seqlen_k`).
    pub fn max_lengths(&self) -> (usize, usize) {
        let longest = |cu: &[usize]| cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        (longest(&self.cu_q), longest(&self.cu_k))
    }

    /// Queries and keys of the whole batch (the packed tensors' first axis).
    pub fn totals(&self) -> (usize, usize) {
        (self.cu_q[self.batch()], self.cu_k[self.batch()])
    }
}

/// What [`forward`] gives: O `[total_q, heads_q, d]`, lse `[heads_q, total_q]` (natural log,
/// `−∞` for rows that see no key), and the rung's statistics summed over the sequences.
#[derive(Debug, Clone)]
pub struct VarlenOutput<T> {
    pub o: Array3<T>,
    pub lse: Array2<T>,
    pub stats: RunStats,
}

/// Runs `rung` on every sequence of the packed batch (see the module docs): its Q
/// `[1, heads_q, n_q, d]` and K, V `[1, heads_kv, n_kv, d]` are views into `q`, `k`, `v`, no copy.
pub fn forward<T: Element>(
    q: ArrayView3<T>,
    k: ArrayView3<T>,
    v: ArrayView3<T>,
    lens: &SeqLens,
    mut rung: impl FnMut(ArrayView4<T>, ArrayView4<T>, ArrayView4<T>) -> Result<AttentionOutput<T>>,
) -> Result<VarlenOutput<T>> {
    check(q, k, v, lens)?;
    let (total_q, heads_q, d) = q.dim();
    let mut o = Array3::zeros((total_q, heads_q, d));
    let mut lse = Array2::from_elem((heads_q, total_q), T::neg_infinity());
    let mut stats = RunStats::default();
    for b in 0..lens.batch() {
        let (rows, keys) = (lens.q_range(b), lens.k_range(b));
        if rows.is_empty() || keys.is_empty() {
            continue; // no rows, or rows that see no key: O = 0 and lse = −∞ already
        }
        let out = rung(rows_of(q, &rows), rows_of(k, &keys), rows_of(v, &keys))?;
        o.slice_mut(s![rows.clone(), .., ..]).assign(&unpacked(&out.o));
        lse.slice_mut(s![.., rows]).assign(&out.lse.index_axis(Axis(0), 0));
        stats.add(&out.stats);
    }
    Ok(VarlenOutput { o, lse, stats })
}

/// What a backward rung gets for one sequence of the batch ([`backward`]): views of its rows of
/// Q, K, V, the forward's O and lse, and dO, as a batch of one (`[1, heads, n, d]`, lse `[1,
/// heads_q, n_q]`).
#[derive(Debug, Clone, Copy)]
pub struct Sequence<'a, T> {
    pub q: ArrayView4<'a, T>,
    pub k: ArrayView4<'a, T>,
    pub v: ArrayView4<'a, T>,
    pub o: ArrayView4<'a, T>,
    pub lse: ArrayView3<'a, T>,
    pub d_o: ArrayView4<'a, T>,
}

/// The gradients of a packed batch: dQ `[total_q, heads_q, d]`, dK and dV `[total_k, heads_kv,
/// d]`, and the rung's statistics summed over the sequences.
#[derive(Debug, Clone)]
pub struct VarlenGradients<T> {
    pub dq: Array3<T>,
    pub dk: Array3<T>,
    pub dv: Array3<T>,
    /// The sinks' gradient `[heads_q]`, summed over the sequences (`None` without sinks; zeros
    /// where no sequence has both queries and keys).
    pub dsinks: Option<Array1<T>>,
    pub stats: RunStats,
}

/// Runs the backward `rung` on every sequence of the packed batch that has queries and keys,
/// given the forward's output `out` and the upstream gradient `d_o` (packed like Q), and packs
/// the gradients as the inputs (see the module docs). `sinks` says whether the rung's options
/// carry sinks, so that their gradient is there (as zeros) even when no sequence runs.
pub fn backward<T: Element>(
    (q, k, v): (ArrayView3<T>, ArrayView3<T>, ArrayView3<T>),
    (o, lse): (ArrayView3<T>, ArrayView2<T>),
    d_o: ArrayView3<T>,
    lens: &SeqLens,
    sinks: bool,
    mut rung: impl FnMut(Sequence<'_, T>) -> Result<Gradients<T>>,
) -> Result<VarlenGradients<T>> {
    check(q, k, v, lens)?;
    let (total_q, heads_q, _) = q.dim();
    for (name, t) in [("o", o), ("d_o", d_o)] {
        if t.dim() != q.dim() {
            return Err(mismatch(format!("{name} is {:?} but q is {:?}", t.shape(), q.shape())));
        }
    }
    if lse.dim() != (heads_q, total_q) {
        return Err(mismatch(format!(
            "lse is {:?}, expected [heads_q, total_q] = [{heads_q}, {total_q}]",
            lse.shape()
        )));
    }
    let mut dq = Array3::zeros(q.raw_dim());
    let (mut dk, mut dv) = (Array3::zeros(k.raw_dim()), Array3::zeros(k.raw_dim()));
    let mut stats = RunStats::default();
    let mut dsinks: Option<Array1<T>> = sinks.then(|| Array1::zeros(heads_q));
    for b in 0..lens.batch() {
        let (rows, keys) = (lens.q_range(b), lens.k_range(b));
        if rows.is_empty() || keys.is_empty() {
            // Nothing flows: the gradients of these rows or keys stay 0, and a sink's too (a
            // row without keys has O = 0, so D = 0).
            continue;
        }
        let g = rung(Sequence {
            q: rows_of(q, &rows),
            k: rows_of(k, &keys),
            v: rows_of(v, &keys),
            o: rows_of(o, &rows),
            lse: lse.slice_move(s![.., rows.clone()]).insert_axis(Axis(0)),
            d_o: rows_of(d_o, &rows),
        })?;
        dq.slice_mut(s![rows, .., ..]).assign(&unpacked(&g.dq));
        dk.slice_mut(s![keys.clone(), .., ..]).assign(&unpacked(&g.dk));
        dv.slice_mut(s![keys, .., ..]).assign(&unpacked(&g.dv));
        match (&mut dsinks, g.dsinks) {
            (Some(sum), Some(part)) if part.len() == heads_q => {
                sum.zip_mut_with(&part, |s, &p| *s = *s + p)
            }
            (None, None) => {}
            (_, part) => {
                return Err(mismatch(format!(
                    "sequence {b}: sinks {sinks} but the rung returned a sinks gradient of {:?}",
                    part.map(|p| p.len())
                )));
            }
        }
        stats.add(&g.stats);
    }
    Ok(VarlenGradients { dq, dk, dv, dsinks, stats })
}

/// The packed tensors agree with each other and with `lens`.
fn check<T>(q: ArrayView3<T>, k: ArrayView3<T>, v: ArrayView3<T>, lens: &SeqLens) -> Result<()> {
    let ((total_q, heads_q, d), (total_k, heads_kv, dk)) = (q.dim(), k.dim());
    if v.dim() != k.dim() {
        return Err(mismatch(format!("v is {:?} but k is {:?}", v.shape(), k.shape())));
    }
    if dk != d {
        return Err(mismatch(format!(
            "q is {:?} and k {:?}: head dims differ",
            q.shape(),
            k.shape()
        )));
    }
    if (total_q, total_k) != lens.totals() {
        return Err(mismatch(format!(
            "cu_seqlens end at {:?} (queries, keys) but q has {total_q} rows and k {total_k}",
            lens.totals()
        )));
    }
    if heads_kv == 0 || heads_q % heads_kv != 0 {
        return Err(LadderError::HeadsNotMultiple { heads_q, heads_kv });
    }
    Ok(())
}

/// Rows `rows` of a packed `[n, heads, d]` tensor as `[1, heads, rows, d]`, a view.
fn rows_of<'a, T>(t: ArrayView3<'a, T>, rows: &Range<usize>) -> ArrayView4<'a, T> {
    t.slice_move(s![rows.clone(), .., ..]).insert_axis(Axis(0)).permuted_axes([0, 2, 1, 3])
}

/// A batch of one, `[1, heads, n, d]`, seen as `[n, heads, d]`.
fn unpacked<T>(x: &ndarray::Array4<T>) -> ndarray::ArrayView3<'_, T> {
    x.index_axis(Axis(0), 0).permuted_axes([1, 0, 2])
}

fn mismatch(message: String) -> LadderError {
    LadderError::ShapeMismatch(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttentionOptions, Fa2Options, fa2, naive};
    use ndarray::{Array4, ArrayView4};

    fn values(shape: (usize, usize, usize), seed: usize) -> Array3<f64> {
        Array3::from_shape_fn(shape, |(t, h, c)| {
            (((t * 7 + h * 3 + c * 5 + seed) % 23) as f64 - 11.0) / 9.0
        })
    }

    /// Sequence `b` copied out of the packed tensor element by element (not through the views
    /// `forward` takes), as `[1, heads, n, d]`.
    fn sequence(x: &Array3<f64>, rows: Range<usize>) -> Array4<f64> {
        let (_, heads, d) = x.dim();
        Array4::from_shape_fn((1, heads, rows.len(), d), |(_, h, i, c)| x[[rows.start + i, h, c]])
    }

    #[test]
    fn each_sequence_is_its_own_problem() {
        // Ragged, GQA 3:1, causal with n_q < n_kv, n_q > n_kv (top rows see no key), one query,
        // a sequence without queries and one without keys.
        let (q_lens, k_lens) = ([4, 7, 1, 0, 3, 5], [9, 3, 6, 4, 0, 5]);
        let lens = SeqLens::from_lengths(&q_lens, &k_lens).unwrap();
        let (total_q, total_k) = lens.totals();
        let (q, k, v) =
            (values((total_q, 6, 8), 1), values((total_k, 2, 8), 2), values((total_k, 2, 8), 3));
        let opts = AttentionOptions::causal();
        let fa2_opts = Fa2Options::new(opts.clone()).with_tiles(2, 3).unwrap();
        let out = forward(q.view(), k.view(), v.view(), &lens, |q, k, v| {
            fa2::forward(q, k, v, &fa2_opts)
        })
        .unwrap();
        for b in 0..lens.batch() {
            let (rows, keys) = (lens.q_range(b), lens.k_range(b));
            let got_o = out.o.slice(s![rows.clone(), .., ..]);
            let got_lse = out.lse.slice(s![.., rows.clone()]);
            if keys.is_empty() {
                assert!(
                    got_o.iter().all(|&x| x == 0.0)
                        && got_lse.iter().all(|&x| x == f64::NEG_INFINITY)
                );
                continue;
            }
            if rows.is_empty() {
                continue;
            }
            let (qs, ks, vs) =
                (sequence(&q, rows.clone()), sequence(&k, keys.clone()), sequence(&v, keys));
            let want = naive::attention(qs.view(), ks.view(), vs.view(), &opts).unwrap();
            for ((i, h, c), &x) in got_o.indexed_iter() {
                assert!((x - want.o[[0, h, i, c]]).abs() < 1e-12, "sequence {b} row {i} head {h}");
            }
            for ((h, i), &x) in got_lse.indexed_iter() {
                let w = want.lse[[0, h, i]];
                assert!(
                    x == w || (x - w).abs() < 1e-12,
                    "sequence {b} lse row {i} head {h}: {x} {w}"
                );
            }
        }
        // The top rows of sequence 1 (7 queries, 3 keys) see no key.
        assert_eq!(out.lse[[0, lens.q_range(1).start]], f64::NEG_INFINITY);
    }

    #[test]
    fn equal_lengths_give_the_dense_batch_bit_for_bit() {
        let lens = SeqLens::from_lengths(&[5, 5, 5], &[6, 6, 6]).unwrap();
        let (q, k, v) = (values((15, 4, 8), 4), values((18, 2, 8), 5), values((18, 2, 8), 6));
        // The dense [batch, heads, n, d] tensors the packed ones hold.
        let dense = |x: &Array3<f64>, n: usize| {
            let (_, heads, d) = x.dim();
            Array4::from_shape_fn((3, heads, n, d), |(b, h, i, c)| x[[b * n + i, h, c]])
        };
        let opts = AttentionOptions::causal();
        let run = |q: ArrayView4<f64>, k: ArrayView4<f64>, v: ArrayView4<f64>| {
            naive::attention(q, k, v, &opts)
        };
        let packed = forward(q.view(), k.view(), v.view(), &lens, run).unwrap();
        let batch = run(dense(&q, 5).view(), dense(&k, 6).view(), dense(&v, 6).view()).unwrap();
        for ((b, h, i, c), &x) in batch.o.indexed_iter() {
            assert_eq!(packed.o[[b * 5 + i, h, c]], x);
        }
        for ((b, h, i), &x) in batch.lse.indexed_iter() {
            assert_eq!(packed.lse[[h, b * 5 + i]], x);
        }
    }

    #[test]
    fn bad_offsets_and_shapes_are_errors() {
        let bad = |q: &[usize], k: &[usize]| SeqLens::new(q, k).unwrap_err().to_string();
        assert!(bad(&[0], &[0]).contains("at least 2"));
        assert!(bad(&[1, 4], &[0, 4]).contains("starts at 1"));
        assert!(bad(&[0, 4, 3], &[0, 4, 5]).contains("decreases at sequence 1"));
        assert!(bad(&[0, 4], &[0, 4, 5]).contains("one per sequence"));
        let lens = SeqLens::from_lengths(&[3, 2], &[4, 4]).unwrap();
        assert_eq!((lens.max_lengths(), lens.totals(), lens.batch()), ((3, 4), (5, 8), 2));
        let (q, k) = (values((5, 2, 8), 1), values((8, 2, 8), 2));
        let opts = AttentionOptions::default();
        let run = |q: ArrayView4<f64>, k: ArrayView4<f64>, v: ArrayView4<f64>| {
            naive::attention(q, k, v, &opts)
        };
        let err = |q: &Array3<f64>, k: &Array3<f64>, v: &Array3<f64>| {
            forward(q.view(), k.view(), v.view(), &lens, run).unwrap_err().to_string()
        };
        assert!(err(&values((6, 2, 8), 1), &k, &k).contains("q has 6 rows"));
        assert!(err(&q, &k, &values((8, 2, 4), 2)).contains("v is [8, 2, 4]"));
        assert!(err(&values((5, 3, 8), 1), &k, &k).contains("not a multiple"));
    }
}
