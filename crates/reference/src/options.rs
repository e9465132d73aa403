//! Options every rung shares: the masks, the softmax scale, the score modifier and the tile sizes.

use crate::error::{Result, invalid};
use crate::mask_mod::MaskMod;
use crate::modifiers::{ScoreIndex, ScoreMod};
use crate::shape::{AttentionShape, Mask, Window};

/// What is computed: `softmax(score_mod(scale · QKᵀ) + mask) V`, with each head's sink logit in
/// every row's softmax when there are sinks. The mask is the band (`causal`, `window`) and the
/// mask modifier together: a pair is visible when both keep it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttentionOptions {
    /// Apply the causal mask (bottom-right aligned, see [`crate::Mask`]).
    pub causal: bool,
    /// Softmax scale; `None` means `1/√d`.
    pub scale: Option<f64>,
    /// A sliding window of keys around each row's diagonal ([`Window`]; none by default).
    pub window: Window,
    /// A function of each pair's place that hides pairs inside the band ([`MaskMod`]: documents,
    /// a prefix-LM mask, your own); none by default.
    pub mask_mod: Option<MaskMod>,
    /// A function of each scaled score applied before the softmax ([`ScoreMod`]: softcap,
    /// ALiBi, your own); none by default.
    pub score_mod: Option<ScoreMod>,
    /// Attention sinks ([`crate::sinks`]): one logit per query head, in the units of the scaled
    /// scores, that joins every row's softmax with a value of zero (gpt-oss); none by default.
    pub sinks: Option<Vec<f64>>,
}

impl AttentionOptions {
    /// Causal attention with the default scale.
    pub fn causal() -> Self {
        Self { causal: true, ..Self::default() }
    }

    /// These options within a sliding window (`Window::left(w - 1)` with [`Self::causal`] is a
    /// causal window of `w` keys).
    pub fn with_window(self, window: Window) -> Self {
        Self { window, ..self }
    }

    /// These options with `mask_mod` too (both must keep a pair: [`MaskMod::and`] with any mask
    /// modifier they already have).
    pub fn with_mask_mod(self, mask_mod: MaskMod) -> Self {
        let mask_mod = Some(match self.mask_mod {
            Some(first) => first.and(mask_mod),
            None => mask_mod,
        });
        Self { mask_mod, ..self }
    }

    /// These options with `score_mod` applied after any modifier they already have.
    pub fn with_score_mod(self, score_mod: ScoreMod) -> Self {
        let score_mod = Some(match self.score_mod {
            Some(first) => first.then(score_mod),
            None => score_mod,
        });
        Self { score_mod, ..self }
    }

    /// These options with Gemma-2's logit softcap ([`ScoreMod::softcap`]); a cap of 0 is no
    /// softcap (flash-attention's convention), a negative or non-finite one an error.
    pub fn with_softcap(self, cap: f64) -> Result<Self> {
        if cap == 0.0 {
            return Ok(self);
        }
        Ok(self.with_score_mod(ScoreMod::softcap(cap)?))
    }

    /// These options with attention sinks, one finite logit per query head ([`crate::sinks`]).
    pub fn with_sinks(self, sinks: Vec<f64>) -> Self {
        Self { sinks: Some(sinks), ..self }
    }

    /// The band these options put on `n_q` queries and `n_kv` keys (the causal mask and the
    /// window; the mask modifier hides pairs inside it).
    pub fn mask(&self, n_q: usize, n_kv: usize) -> Mask {
        Mask::banded(self.causal, self.window, n_q, n_kv)
    }

    /// Whether query `at.q` sees key `at.kv`: inside the band and kept by the mask modifier.
    pub fn sees(&self, at: &ScoreIndex) -> bool {
        self.mask(at.n_q, at.n_kv).visible(at.q).contains(&at.kv)
            && self.mask_mod.as_ref().is_none_or(|m| m.sees(at))
    }

    /// The scale to use for `shape`; a non-finite scale is an error.
    pub fn resolve_scale(&self, shape: &AttentionShape) -> Result<f64> {
        let scale = self.scale.unwrap_or_else(|| shape.default_scale());
        if !scale.is_finite() {
            return Err(invalid("scale", format!("must be finite, got {scale}")));
        }
        Ok(scale)
    }
}

/// Tile sizes of the blocked rungs: `br` query rows by `bc` key columns.
///
/// On a GPU a tile must fit in on-chip SRAM; on the CPU any size ≥ 1 works, and block sizes of 1
/// are a good stress test of the rescaling logic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TileSizes {
    br: usize,
    bc: usize,
}

impl Default for TileSizes {
    fn default() -> Self {
        Self { br: 64, bc: 64 }
    }
}

impl TileSizes {
    /// `br` query rows by `bc` key columns; both must be at least 1.
    pub fn new(br: usize, bc: usize) -> Result<Self> {
        if br == 0 {
            return Err(invalid("br", "the query block size must be at least 1"));
        }
        if bc == 0 {
            return Err(invalid("bc", "the key block size must be at least 1"));
        }
        Ok(Self { br, bc })
    }

    /// The FlashAttention-1 paper's choice for an SRAM of `sram_bytes` (Algorithm 1, line 1):
    /// `Bc = ⌈M / 4d⌉`, `Br = min(⌈M / 4d⌉, d)` with `M` the SRAM size in elements.
    pub fn from_sram(sram_bytes: usize, d: usize, elem_bytes: usize) -> Result<Self> {
        if d == 0 || elem_bytes == 0 {
            return Err(invalid("d", "head dim and element size must be at least 1"));
        }
        let m = sram_bytes / elem_bytes;
        if m < 4 * d {
            return Err(invalid(
                "sram_bytes",
                format!("{sram_bytes} bytes hold fewer than 4·d = {} elements", 4 * d),
            ));
        }
        let bc = m.div_ceil(4 * d);
        Self::new(bc.min(d), bc)
    }

    /// Query rows per tile.
    pub fn br(&self) -> usize {
        self.br
    }

    /// Key columns per tile.
    pub fn bc(&self) -> usize {
        self.bc
    }
}

/// Options of the rungs that need only the problem and the tiles: FA1 ([`crate::Fa1Options`])
/// and FA2 ([`crate::Fa2Options`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TiledOptions {
    pub attention: AttentionOptions,
    pub tiles: TileSizes,
}

impl TiledOptions {
    /// Default tiles (64 × 64).
    pub fn new(attention: AttentionOptions) -> Self {
        Self { attention, tiles: TileSizes::default() }
    }

    /// Sets the tile sizes (`br` query rows by `bc` key columns).
    pub fn with_tiles(self, br: usize, bc: usize) -> Result<Self> {
        Ok(Self { tiles: TileSizes::new(br, bc)?, ..self })
    }
}
