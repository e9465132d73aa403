//! Rung 5: FlashAttention-3-style attention (Shah et al. 2024), emulated on the CPU.
//!
//! FA3 computes exactly what FA2 computes; what changes is the *schedule*, to keep Hopper's
//! tensor cores busy while the much slower exponentials run. On an H100, `exp` throughput is
//! ~250× below matmul throughput, so for `d = 128` a tile's softmax takes about as long as one
//! of its two GEMMs. FA3 hides it two ways:
//!
//! - **Intra-warpgroup overlap** (Algorithm 2): issue `S_next = Q K_{j+1}ᵀ` and
//!   `O += P_j V_j` asynchronously, and compute the softmax of block `j + 1` while the tensor
//!   cores work. In the loop below the order of operations is exactly that: the scores of the
//!   next block are formed *before* the current block's `P V`, and the accumulator is rescaled
//!   *after* it, which is legal because `diag(α)(O + P V) = diag(α) O + diag(α) P V`.
//! - **Ping-pong between warpgroups**: two consumer warpgroups take turns, one's softmax running
//!   during the other's GEMMs; a producer warp feeds both through TMA (warp specialisation).
//!
//! A CPU has none of that hardware, so [`forward`] reproduces the *order* of Algorithm 2, and
//! [`timeline`] (from [`crate::fa3_schedule`], re-exported here) simulates the schedules on a
//! tensor-core/softmax resource model so they can be drawn and compared.
//!
//! The FP8 path ([`Fa3Precision::Fp8`]) quantises `Q, K, V` to e4m3 with per-block scales and
//! optional incoherent processing ([`crate::fp8`]), and `P` before the second GEMM. `P ∈ [0, 1]`
//! rounded as it is would lose its small values (e4m3 goes subnormal below 2⁻⁶), so — as FA3 keeps
//! `P` in `[0, 256]` — it is multiplied by `2⁸ · s_j / s_max` first, where `s_j` is the e4m3 scale
//! of the V block it multiplies and `s_max` the head's largest, and `O` by `s_max / 2⁸` at the
//! end. V is quantised in one block per head, so `s_j = s_max` and the lift is `2⁸` in every
//! tile: with V's own block scales the lift was smaller in a block of small V, which rounded more
//! of its probabilities to subnormals and cost 12–17 % more error on the FA3 paper's outlier
//! inputs. The GPU kernel does exactly this. The error is compared with an FP8 tolerance, not the
//! `f32` one.

use std::ops::Range;

use ndarray::{Array2, ArrayView4, s};

use crate::element::Element;
use crate::error::Result;
use crate::fp8::{Fp8Options, Fp8Tensor, RandomHadamard, round_e4m3};
use crate::options::{AttentionOptions, TileSizes};
use crate::output::{AttentionOutput, Counters};
use crate::problem::{Head, Problem};
use crate::shape::TileKind;
use crate::tile::{OnlineRows, RowSpans, add_pv, blocks, nan_max};

/// The number format the tiles are multiplied in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fa3Precision {
    /// The element type of the inputs (`f32` or `f64`).
    #[default]
    Full,
    /// e4m3 inputs with block (or tensor) scales, `P` in e4m3 for the second GEMM.
    Fp8(Fp8Options),
}

/// Options of the FA3 rung.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fa3Options {
    pub attention: AttentionOptions,
    pub tiles: TileSizes,
    pub precision: Fa3Precision,
}

impl Fa3Options {
    pub fn new(attention: AttentionOptions) -> Self {
        Self { attention, tiles: TileSizes::default(), precision: Fa3Precision::Full }
    }

    /// Sets the tile sizes (`br` query rows by `bc` key columns).
    pub fn with_tiles(self, br: usize, bc: usize) -> Result<Self> {
        Ok(Self { tiles: TileSizes::new(br, bc)?, ..self })
    }

    /// Switches to the FP8 path.
    pub fn with_fp8(self, fp8: Fp8Options) -> Self {
        Self { precision: Fa3Precision::Fp8(fp8), ..self }
    }
}

/// The e4m3 operands and their scales.
struct Fp8Operands<T> {
    q: Fp8Tensor<T>,
    k: Fp8Tensor<T>,
    v: Fp8Tensor<T>,
}

impl<T: Element> Fp8Operands<T> {
    /// The largest scale of V's blocks in head `(b, h)` (NaN if any is NaN).
    fn v_max(&self, b: usize, h: usize) -> T {
        self.v.scales.slice(s![b, h, ..]).iter().fold(T::zero(), |m, &x| nan_max(m, x))
    }
}

/// What `P` is multiplied by before it is rounded to e4m3: `2⁸ · s_j / s_max`.
const P_RANGE: f64 = 256.0;

/// FA3-style forward pass: FA2's work decomposition with Algorithm 2's overlapped loop.
pub fn forward<T: Element>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &Fa3Options,
) -> Result<AttentionOutput<T>> {
    let problem = Problem::new(q, k, v, &opts.attention)?;
    let Fa3Precision::Fp8(fp8) = opts.precision else {
        return Ok(run(&problem, None, opts.tiles, size_of::<T>()));
    };
    // Incoherent processing rotates Q and K by the same orthogonal map; V is left alone.
    let (q_in, k_in) = match fp8.incoherent {
        Some(seed) => {
            let rotation = RandomHadamard::new(problem.shape.d, seed);
            (rotation.apply(q), rotation.apply(k))
        }
        None => (q.to_owned(), k.to_owned()),
    };
    let (br, bc) = (opts.tiles.br(), opts.tiles.bc());
    let ops = Fp8Operands {
        q: Fp8Tensor::quantize(q_in.view(), br, fp8.scaling),
        k: Fp8Tensor::quantize(k_in.view(), bc, fp8.scaling),
        // V in one block per head (flash-attention's choice): every tile's P then takes the
        // same lift, 2⁸ (the module docs say why that matters).
        v: Fp8Tensor::quantize(v, v.dim().2.max(1), fp8.scaling),
    };
    let quantised = Problem {
        q: ops.q.values.view(),
        k: ops.k.values.view(),
        v: ops.v.values.view(),
        ..problem
    };
    Ok(run(&quantised, Some(&ops), opts.tiles, 1))
}

/// Runs every `(batch, head, query block)` in parallel; `input_bytes` is the HBM size of one
/// element of `Q, K, V` (1 for FP8).
fn run<T: Element>(
    problem: &Problem<'_, T>,
    fp8: Option<&Fp8Operands<T>>,
    tiles: TileSizes,
    input_bytes: usize,
) -> AttentionOutput<T> {
    let counters = Counters::new(size_of::<T>());
    problem.per_query_block(tiles.br(), &counters, |head, rows| {
        overlapped_rows(head, rows, tiles.bc(), fp8, &counters, input_bytes)
    })
}

/// One consumer warpgroup's loop (FA3 Algorithm 2) for the query rows `rows`.
fn overlapped_rows<T: Element>(
    head: &Head<'_, T>,
    rows: Range<usize>,
    bc: usize,
    fp8: Option<&Fp8Operands<T>>,
    counters: &Counters,
    input_bytes: usize,
) -> OnlineRows<T> {
    let (width, d) = (head.q.ncols(), head.v.ncols());
    let q_i = head.q.slice(s![rows.clone(), ..]);
    counters.read_bytes(rows.len() * width * input_bytes);
    // (each tile's key columns, and the columns each row sees where the tile is masked)
    let tiles: Vec<(Range<usize>, Option<RowSpans>)> = blocks(head.k.nrows(), bc)
        .filter_map(|cols| {
            let (kind, limits) = head.classify(&rows, &cols);
            counters.tile(kind);
            (kind != TileKind::Skip).then_some((cols, limits))
        })
        .collect();

    // GEMM 0: S = scale · Q_i K_jᵀ (times the e4m3 scales of both tiles).
    let scores = |(cols, limits): &(Range<usize>, Option<RowSpans>)| {
        counters.read_bytes(cols.len() * width * input_bytes);
        let factor = fp8.map_or(head.scale, |f| {
            head.scale
                * f.q.scale(head.b, head.h, rows.start)
                * f.k.scale(head.b, head.kh, cols.start)
        });
        head.score_tile(q_i, &rows, cols, factor, limits.as_deref())
    };
    // GEMM 1: O += P V_j. On the FP8 path P is lifted by 2⁸ · s_j / s_max and rounded to e4m3
    // first (the module docs say why), and the product scaled back by s_max / 2⁸; l keeps the
    // exact sum.
    let pv = |acc: &mut Array2<T>,
              p: &mut Array2<T>,
              (cols, limits): &(Range<usize>, Option<RowSpans>)| {
        counters.read_bytes(cols.len() * d * input_bytes);
        let factor = fp8.map_or(T::one(), |f| {
            let v_max = f.v_max(head.b, head.kh);
            let lift = T::of(P_RANGE) * (f.v.scale(head.b, head.kh, cols.start) / v_max);
            p.mapv_inplace(|x| round_e4m3(x * lift));
            v_max / T::of(P_RANGE)
        });
        add_pv(
            &mut acc.view_mut(),
            factor,
            p.view(),
            head.v.slice(s![cols.clone(), ..]),
            limits.as_deref(),
        );
    };

    let mut state = OnlineRows::new(rows.len(), d);
    let Some((first, rest)) = tiles.split_first() else {
        return state;
    };
    let mut p = scores(first);
    state.softmax_step(&mut p); // the accumulator is still zero: nothing to rescale
    let mut current = first;
    for next in rest {
        let mut s_next = scores(next); // GEMM 0 of block j+1 is issued first…
        pv(&mut state.acc, &mut p, current); // …then GEMM 1 of block j, which the softmax overlaps
        let alpha = state.softmax_step(&mut s_next);
        state.rescale(&alpha); // once GEMM 1 of block j has landed
        (p, current) = (s_next, next);
    }
    pv(&mut state.acc, &mut p, current);
    state
}

// The schedule simulator lives in `fa3_schedule`; its items are re-exported here, the path the
// notebooks use.
pub use crate::fa3_schedule::{
    Event, Pipeline, Schedule, Stage, StageCosts, makespan, run_program, tensor_core_utilisation,
    timeline, timeline_with_producer,
};
