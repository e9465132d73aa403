//! Shapes, grouped-query heads and the causal mask: the bookkeeping every rung shares.

use std::ops::Range;

use ndarray::{ArrayView3, ArrayView4};

use crate::error::{LadderError, Result};

/// The sizes of one attention problem: `Q: [batch, heads_q, n_q, d]`, `K, V: [batch, heads_kv, n_kv, d]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub n_q: usize,
    pub n_kv: usize,
    pub d: usize,
}

impl AttentionShape {
    /// Checks the sizes: all at least 1 and `heads_q` a multiple of `heads_kv`.
    pub fn new(
        batch: usize,
        heads_q: usize,
        heads_kv: usize,
        n_q: usize,
        n_kv: usize,
        d: usize,
    ) -> Result<Self> {
        let shape = Self { batch, heads_q, heads_kv, n_q, n_kv, d };
        if [batch, heads_q, n_q, d].contains(&0) {
            return Err(LadderError::EmptyDimension {
                tensor: "q",
                shape: shape.q_dims().to_vec(),
            });
        }
        if [heads_kv, n_kv].contains(&0) {
            return Err(LadderError::EmptyDimension {
                tensor: "k",
                shape: shape.kv_dims().to_vec(),
            });
        }
        if heads_q % heads_kv != 0 {
            return Err(LadderError::HeadsNotMultiple { heads_q, heads_kv });
        }
        Ok(shape)
    }

    /// Reads and checks the shape of `q, k, v`.
    pub fn of<T>(q: &ArrayView4<T>, k: &ArrayView4<T>, v: &ArrayView4<T>) -> Result<Self> {
        let (b, hq, nq, d) = q.dim();
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.is_empty() {
                return Err(LadderError::EmptyDimension {
                    tensor: name,
                    shape: t.shape().to_vec(),
                });
            }
        }
        if k.dim() != v.dim() {
            return Err(LadderError::ShapeMismatch(format!(
                "k is {:?} but v is {:?}; they must be equal",
                k.shape(),
                v.shape()
            )));
        }
        let (bk, hkv, nkv, dk) = k.dim();
        if bk != b || dk != d {
            return Err(LadderError::ShapeMismatch(format!(
                "q is {:?} and k is {:?}: batch and head dim (axes 0 and 3) must agree",
                q.shape(),
                k.shape()
            )));
        }
        Self::new(b, hq, hkv, nq, nkv, d)
    }

    /// Checks that `o` or `dO` has the shape of `q`.
    pub fn expect_like_q<T>(&self, name: &'static str, t: &ArrayView4<T>) -> Result<()> {
        if t.shape() != self.q_dims() {
            return Err(LadderError::ShapeMismatch(format!(
                "{name} is {:?} but q is {:?}; they must be equal",
                t.shape(),
                self.q_dims()
            )));
        }
        Ok(())
    }

    /// Checks that `lse` has shape `[batch, heads_q, n_q]`.
    pub fn expect_lse<T>(&self, t: &ArrayView3<T>) -> Result<()> {
        let want = [self.batch, self.heads_q, self.n_q];
        if t.shape() != want {
            return Err(LadderError::ShapeMismatch(format!(
                "lse is {:?} but must be [batch, heads_q, n_q] = {want:?}",
                t.shape()
            )));
        }
        Ok(())
    }

    pub fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.n_q, self.d]
    }

    pub fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.heads_kv, self.n_kv, self.d]
    }

    /// Number of q heads that share one kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// The kv head that q head `h` reads.
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group()
    }

    /// The default softmax scale, `1/√d`.
    pub fn default_scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }
}

/// Which keys each query row may see.
///
/// Without `causal` every row sees every key. With `causal`, the mask is aligned to the
/// bottom-right corner: row `i` sees keys `0..=i + n_kv − n_q`, so the last query sees every key
/// (decoding with a KV cache) and, when `n_q > n_kv`, the first `n_q − n_kv` rows see none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask {
    causal: bool,
    n_q: usize,
    n_kv: usize,
}

/// How a `(query block, key block)` tile meets the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileKind {
    /// Every row sees every key of the tile: plain matrix products, no mask.
    Full,
    /// Some entries are masked: the tile is computed, then masked (a diagonal tile).
    Partial,
    /// No row sees any key of the tile: it is skipped entirely.
    Skip,
}

impl Mask {
    pub fn new(causal: bool, n_q: usize, n_kv: usize) -> Self {
        Self { causal, n_q, n_kv }
    }

    /// One past the last key that query row `i` sees (0: it sees none).
    pub fn visible_end(&self, i: usize) -> usize {
        if self.causal {
            (i + self.n_kv + 1).saturating_sub(self.n_q).min(self.n_kv)
        } else {
            self.n_kv
        }
    }

    /// Classifies the tile of query rows `rows` and key columns `cols`.
    pub fn tile(&self, rows: Range<usize>, cols: Range<usize>) -> TileKind {
        if rows.is_empty() || cols.is_empty() || self.visible_end(rows.end - 1) <= cols.start {
            TileKind::Skip
        } else if self.visible_end(rows.start) >= cols.end {
            TileKind::Full
        } else {
            TileKind::Partial
        }
    }

    /// For each row of the tile, how many of its leading columns are visible.
    pub fn tile_limits(&self, rows: Range<usize>, cols: Range<usize>) -> Vec<usize> {
        rows.map(|i| self.visible_end(i).saturating_sub(cols.start).min(cols.len())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_mask_is_bottom_right_aligned() {
        // More keys than queries: the last query sees all keys.
        let m = Mask::new(true, 2, 5);
        assert_eq!((m.visible_end(0), m.visible_end(1)), (4, 5));
        // More queries than keys: the first rows see nothing.
        let m = Mask::new(true, 5, 2);
        assert_eq!((0..5).map(|i| m.visible_end(i)).collect::<Vec<_>>(), vec![0, 0, 0, 1, 2]);
        assert_eq!(Mask::new(false, 5, 2).visible_end(0), 2);
    }

    #[test]
    fn tiles_are_classified_against_the_diagonal() {
        let m = Mask::new(true, 8, 8);
        assert_eq!(m.tile(4..8, 0..4), TileKind::Full);
        assert_eq!(m.tile(0..4, 0..4), TileKind::Partial);
        assert_eq!(m.tile(0..4, 4..8), TileKind::Skip);
        assert_eq!(m.tile_limits(0..4, 0..4), vec![1, 2, 3, 4]);
        assert_eq!(Mask::new(false, 8, 8).tile(0..4, 4..8), TileKind::Full);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(matches!(
            AttentionShape::new(1, 3, 2, 4, 4, 8),
            Err(LadderError::HeadsNotMultiple { heads_q: 3, heads_kv: 2 })
        ));
        assert!(matches!(
            AttentionShape::new(1, 2, 2, 0, 4, 8),
            Err(LadderError::EmptyDimension { tensor: "q", .. })
        ));
        assert!(matches!(
            AttentionShape::new(1, 2, 2, 3, 0, 8),
            Err(LadderError::EmptyDimension { tensor: "k", .. })
        ));
        assert_eq!(AttentionShape::new(2, 6, 2, 3, 4, 8).unwrap().kv_head(5), 1);
    }
}
