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

/// Which keys each query row may see: a band around the bottom-right diagonal.
///
/// Row `i`'s diagonal is key `i + shift`, `shift = n_kv − n_q`, so the last query lines up with
/// the last key (decoding with a KV cache). Row `i` sees the keys `j` with
/// `i + shift − left ≤ j ≤ i + shift + right` (inside `0..n_kv`), where `left` and `right` are a
/// [`Window`]'s sides (unbounded when `None`) and the causal mask is `right = 0`. Without a
/// window or `causal` every row sees every key; with `causal` and `n_q > n_kv` the first
/// `n_q − n_kv` rows see none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask {
    left: Option<usize>,
    right: Option<usize>,
    n_q: usize,
    n_kv: usize,
}

/// A sliding window of keys around each query's diagonal: flash-attention's `window_size =
/// (left, right)`, bottom-right aligned as the causal mask is ([`Mask`]). `None` leaves a side
/// unbounded (flash-attention's `-1`); `Window::default()` is no window. Mistral's and Gemma's
/// local layers are `Window::left(w − 1)` with the causal mask: each token sees itself and the
/// `w − 1` before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Window {
    /// Keys before the diagonal a row may see.
    pub left: Option<usize>,
    /// Keys after the diagonal a row may see (the causal mask makes it 0).
    pub right: Option<usize>,
}

impl Window {
    /// `left` keys before the diagonal, any number after it (make it causal for `right = 0`).
    pub fn left(left: usize) -> Self {
        Self { left: Some(left), right: None }
    }

    /// `left` keys before the diagonal and `right` after it.
    pub fn new(left: usize, right: usize) -> Self {
        Self { left: Some(left), right: Some(right) }
    }

    /// Whether either side is bounded.
    pub fn is_some(&self) -> bool {
        self.left.is_some() || self.right.is_some()
    }
}

/// `"LEFT,RIGHT"`, each side a number of keys or `-1` for an open side (flash-attention's
/// `window_size`): `"4095,0"` is Mistral's window of 4096 with the causal mask.
impl std::str::FromStr for Window {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let side = |s: &str| match s.trim() {
            "-1" => Ok(None),
            s => s.parse::<usize>().map(Some).map_err(|_| {
                format!("a window side is a number of keys or -1 (open), got {s:?} in {text:?}")
            }),
        };
        match text.split(',').collect::<Vec<_>>()[..] {
            [left, right] => Ok(Window { left: side(left)?, right: side(right)? }),
            _ => Err(format!("a window is LEFT,RIGHT (e.g. 4095,0 or 128,-1), got {text:?}")),
        }
    }
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
    /// The causal mask (or none), without a window.
    pub fn new(causal: bool, n_q: usize, n_kv: usize) -> Self {
        Self::banded(causal, Window::default(), n_q, n_kv)
    }

    /// The causal mask (or none) within `window`.
    pub fn banded(causal: bool, window: Window, n_q: usize, n_kv: usize) -> Self {
        let right = if causal { Some(0) } else { window.right };
        Self { left: window.left, right, n_q, n_kv }
    }

    /// The keys query row `i` sees (empty when it sees none).
    pub fn visible(&self, i: usize) -> Range<usize> {
        // The diagonal, i + n_kv − n_q, may lie before key 0.
        let diagonal = i as i128 + self.n_kv as i128 - self.n_q as i128;
        let clamp = |j: i128| j.clamp(0, self.n_kv as i128) as usize;
        let end = self.right.map_or(self.n_kv, |r| clamp(diagonal + r as i128 + 1));
        let start = self.left.map_or(0, |l| clamp(diagonal - l as i128)).min(end);
        start..end
    }

    /// One past the last key that query row `i` sees (0: it sees none; with a window's left side
    /// the row's keys start at [`Mask::visible`]'s start, not at 0).
    pub fn visible_end(&self, i: usize) -> usize {
        self.visible(i).end
    }

    /// Classifies the tile of query rows `rows` and key columns `cols`. Both ends of a row's band
    /// move right by at most one key per row, so the first and last rows decide.
    pub fn tile(&self, rows: Range<usize>, cols: Range<usize>) -> TileKind {
        if rows.is_empty() || cols.is_empty() {
            return TileKind::Skip;
        }
        let (first, last) = (self.visible(rows.start), self.visible(rows.end - 1));
        if last.end <= cols.start || first.start >= cols.end {
            TileKind::Skip
        } else if last.start <= cols.start && first.end >= cols.end {
            TileKind::Full
        } else {
            TileKind::Partial
        }
    }

    /// For each row of the tile, the columns it sees (relative to the tile's first key).
    pub fn tile_limits(&self, rows: Range<usize>, cols: Range<usize>) -> Vec<Range<usize>> {
        rows.map(|i| {
            let seen = self.visible(i);
            let end = seen.end.clamp(cols.start, cols.end) - cols.start;
            (seen.start.clamp(cols.start, cols.end) - cols.start).min(end)..end
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_as_flash_attention_writes_them() {
        assert_eq!("4095,0".parse::<Window>(), Ok(Window::new(4095, 0)));
        assert_eq!("128, -1".parse::<Window>(), Ok(Window::left(128)));
        assert_eq!("-1,-1".parse::<Window>(), Ok(Window::default()));
        for bad in ["", "3", "1,2,3", "a,1", "-2,0", "1.5,0"] {
            assert!(bad.parse::<Window>().is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn causal_mask_is_bottom_right_aligned() {
        // More keys than queries: the last query sees all keys.
        let m = Mask::new(true, 2, 5);
        assert_eq!((m.visible(0), m.visible(1)), (0..4, 0..5));
        // More queries than keys: the first rows see nothing.
        let m = Mask::new(true, 5, 2);
        assert_eq!((0..5).map(|i| m.visible(i).end).collect::<Vec<_>>(), vec![0, 0, 0, 1, 2]);
        assert_eq!(Mask::new(false, 5, 2).visible(0), 0..2);
    }

    #[test]
    fn tiles_are_classified_against_the_diagonal() {
        let m = Mask::new(true, 8, 8);
        assert_eq!(m.tile(4..8, 0..4), TileKind::Full);
        assert_eq!(m.tile(0..4, 0..4), TileKind::Partial);
        assert_eq!(m.tile(0..4, 4..8), TileKind::Skip);
        assert_eq!(m.tile_limits(0..4, 0..4), vec![0..1, 0..2, 0..3, 0..4]);
        assert_eq!(Mask::new(false, 8, 8).tile(0..4, 4..8), TileKind::Full);
    }

    #[test]
    fn windows_are_bands_around_the_bottom_right_diagonal() {
        // Mistral's local attention: causal, each row sees itself and the 2 keys before it.
        let m = Mask::banded(true, Window::left(2), 6, 6);
        let seen: Vec<_> = (0..6).map(|i| m.visible(i)).collect();
        assert_eq!(seen, vec![0..1, 0..2, 0..3, 1..4, 2..5, 3..6]);
        // Two-sided, with more keys than queries: the band is centred on key i + 2.
        let m = Mask::banded(false, Window::new(1, 1), 2, 4);
        assert_eq!((m.visible(0), m.visible(1)), (1..4, 2..4));
        // Causal wins over a window's right side.
        assert_eq!(Mask::banded(true, Window::new(0, 3), 4, 4).visible(1), 1..2);
        // A row whose band lies wholly before key 0 sees nothing.
        assert_eq!(Mask::banded(false, Window::new(0, 0), 5, 2).visible(0), 0..0);
        let m = Mask::banded(true, Window::left(1), 8, 8);
        assert_eq!(m.tile(4..8, 0..2), TileKind::Skip);
        assert_eq!(m.tile(4..8, 2..8), TileKind::Partial);
        assert_eq!(m.tile_limits(4..6, 2..6), vec![1..3, 2..4]);
        let m = Mask::banded(false, Window::new(8, 8), 4, 4);
        assert_eq!(m.tile(0..4, 0..4), TileKind::Full);
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
