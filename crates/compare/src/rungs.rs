//! The ladder itself: every rung by name, in order, behind one call.

use std::fmt;

use ladder_reference::{
    AttentionOptions, AttentionOutput, Element, Fa1Options, Fa2Options, Fa3Options,
    FlashDecodingOptions, FlashDecodingPpOptions, Fp8Options, Phi, Result, TileSizes, fa1, fa2,
    fa3, flash_decoding, flash_decoding_pp, naive, online_softmax,
};
use ndarray::ArrayView4;

/// A rung of the ladder (the FP8 path of FA3 is listed as a rung of its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Rung {
    /// 0: materialised S and P, three-pass softmax.
    Naive,
    /// 1: one pass per row with a running max and sum.
    OnlineSoftmax,
    /// 2: FlashAttention-1, K/V-outer tiles, O/l/m through HBM.
    Fa1,
    /// 3: FlashAttention-2, Q-outer tiles, causal tile skipping.
    Fa2,
    /// 4: FlashAttention-3 schedule (intra-warpgroup overlap).
    Fa3,
    /// 4: FlashAttention-3 FP8 path (e4m3, block scales, incoherent processing).
    Fa3Fp8,
    /// 5: FlashDecoding, split K/V with log-sum-exp combine.
    FlashDecoding,
    /// 6: FlashDecoding++, unified max with fallback.
    FlashDecodingPp,
}

impl Rung {
    /// Every rung, in ladder order.
    pub const ALL: [Rung; 8] = [
        Rung::Naive,
        Rung::OnlineSoftmax,
        Rung::Fa1,
        Rung::Fa2,
        Rung::Fa3,
        Rung::Fa3Fp8,
        Rung::FlashDecoding,
        Rung::FlashDecodingPp,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Rung::Naive => "naive",
            Rung::OnlineSoftmax => "online-softmax",
            Rung::Fa1 => "fa1",
            Rung::Fa2 => "fa2",
            Rung::Fa3 => "fa3",
            Rung::Fa3Fp8 => "fa3-fp8",
            Rung::FlashDecoding => "flash-decoding",
            Rung::FlashDecodingPp => "flash-decoding-pp",
        }
    }

    /// The rung number on the ladder: its chapter in `docs/rungs/` and its notebook (FA3 and its
    /// FP8 path share 5).
    pub fn number(self) -> usize {
        match self {
            Rung::Naive => 1,
            Rung::OnlineSoftmax => 2,
            Rung::Fa1 => 3,
            Rung::Fa2 => 4,
            Rung::Fa3 | Rung::Fa3Fp8 => 5,
            Rung::FlashDecoding => 6,
            Rung::FlashDecodingPp => 7,
        }
    }

    /// The rung this one is checked against (the FP8 path against FA3 in full precision).
    pub fn previous(self) -> Option<Rung> {
        match self {
            Rung::Naive => None,
            Rung::OnlineSoftmax => Some(Rung::Naive),
            Rung::Fa1 => Some(Rung::OnlineSoftmax),
            Rung::Fa2 => Some(Rung::Fa1),
            Rung::Fa3 | Rung::Fa3Fp8 => Some(Rung::Fa2),
            Rung::FlashDecoding => Some(Rung::Fa3),
            Rung::FlashDecodingPp => Some(Rung::FlashDecoding),
        }
    }

    /// Whether the rung computes in FP8 (and is held to the FP8 tolerance).
    pub fn is_fp8(self) -> bool {
        self == Rung::Fa3Fp8
    }

    /// Runs the rung's forward pass.
    pub fn forward<T: Element>(
        self,
        q: ArrayView4<T>,
        k: ArrayView4<T>,
        v: ArrayView4<T>,
        config: &RungConfig,
    ) -> Result<AttentionOutput<T>> {
        let (attention, tiles, splits) = (config.attention.clone(), config.tiles, config.splits);
        match self {
            Rung::Naive => naive::attention(q, k, v, &attention),
            Rung::OnlineSoftmax => online_softmax::attention(q, k, v, &attention),
            Rung::Fa1 => fa1::forward(q, k, v, &Fa1Options { attention, tiles }),
            Rung::Fa2 => fa2::forward(q, k, v, &Fa2Options { attention, tiles }),
            Rung::Fa3 => fa3::forward(q, k, v, &Fa3Options { tiles, ..Fa3Options::new(attention) }),
            Rung::Fa3Fp8 => fa3::forward(
                q,
                k,
                v,
                &Fa3Options { tiles, ..Fa3Options::new(attention) }.with_fp8(config.fp8),
            ),
            Rung::FlashDecoding => {
                flash_decoding::forward(q, k, v, &FlashDecodingOptions { attention, tiles, splits })
            }
            Rung::FlashDecodingPp => flash_decoding_pp::forward(
                q,
                k,
                v,
                &FlashDecodingPpOptions {
                    tiles,
                    splits,
                    phi: config.phi,
                    ..FlashDecodingPpOptions::new(attention)
                },
            ),
        }
    }
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The options of every rung at once; each rung reads the ones it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct RungConfig {
    pub attention: AttentionOptions,
    pub tiles: TileSizes,
    pub splits: usize,
    pub phi: Phi,
    pub fp8: Fp8Options,
}

impl Default for RungConfig {
    fn default() -> Self {
        Self {
            attention: AttentionOptions::default(),
            tiles: TileSizes::default(),
            splits: 8,
            phi: Phi::default(),
            fp8: Fp8Options { incoherent: Some(0), ..Fp8Options::default() },
        }
    }
}
