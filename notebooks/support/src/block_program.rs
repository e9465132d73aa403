//! A block-program emulator: FA2's forward pass written the way Triton writes a kernel, on the
//! CPU, with every byte it moves counted.
//!
//! A GPU kernel is one *program* run once per point of a *grid*; each run knows only its
//! program id. Here the grid is `[x, y, z]` like a CUDA grid, [`Hbm::launch`] runs the program
//! once per id, and the program reaches the tensors in [`Hbm`] only through tile loads and
//! stores:
//!
//! - [`Program::load`]`(tensor, batch, head, rows, mask)` returns the rows `rows` of one
//!   `(batch, head)` of a `[batch, heads, n, width]` tensor as a `rows.len() × width` tile. A row
//!   whose `mask` is false reads as zeros and costs nothing (Triton's `tl.load(…, mask, other=0)`,
//!   the kernel's zero-filled `cp.async`); an *unmasked* row past the end is an out-of-bounds
//!   access and panics, as a GPU would fault;
//! - [`Program::store`] writes a tile back the same way.
//!
//! The emulator counts, per tensor, the loads and stores, the bytes moved (4 per `f32`, masked
//! rows not counted) and how often each row was read and written ([`Hbm::traffic`],
//! [`Hbm::row_reads`]).
//!
//! [`check_fa2`] is the notebook exercise's check, a property test on `ladder_compare::check`
//! (the project's case strategy and tolerances): it runs a learner's FA2 program on random
//! problems and holds it to two things: its `O` and `lse` to the float64 oracle (and to the FA2
//! rung), within the `f32` tolerance, **and** its HBM traffic to FA2's memory model, the counters
//! of `ladder_reference::fa2::forward` run with the same tiles: `Q` read once, `K` and `V` once
//! per query block, tiles no row of the block can see never loaded, `O` and `lse` written once.
//! On a failure the problem is shrunk, and the message names the smallest one that still fails.

use std::fmt;
use std::ops::Range;

use ladder_compare::cases::Case;
use ladder_compare::check::{Check, Output, Precision, Rung};
use ladder_reference::{AttentionOutput, Fa2Options, HbmTraffic, Mask, fa2};
use ndarray::{Array1, Array2, Array3, Array4, ArrayView2, Axis, s};

use crate::Failure;

/// Bytes per element: the emulator's tensors are `f32`, as the rung it is compared with.
const ELEM_BYTES: u64 = 4;

/// A tensor in the emulator's HBM: what a kernel receives as a pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ptr(usize);

/// The emulator's global memory: named `[batch, heads, n, width]` tensors of `f32`, with what
/// the programs did to each.
#[derive(Debug, Clone, Default)]
pub struct Hbm {
    buffers: Vec<Buffer>,
}

#[derive(Debug, Clone)]
struct Buffer {
    name: String,
    data: Array4<f32>,
    /// How many times each row `[batch, head, row]` was loaded (unmasked) and stored.
    reads: Array3<u32>,
    writes: Array3<u32>,
    loads: u64,
    stores: u64,
}

impl Hbm {
    pub fn new() -> Hbm {
        Hbm::default()
    }

    /// Puts `data` (`[batch, heads, n, width]`) in HBM under `name` (an input tensor).
    pub fn put(&mut self, name: &str, data: Array4<f32>) -> Ptr {
        let (b, h, n, _) = data.dim();
        self.buffers.push(Buffer {
            name: name.to_string(),
            data,
            reads: Array3::zeros((b, h, n)),
            writes: Array3::zeros((b, h, n)),
            loads: 0,
            stores: 0,
        });
        Ptr(self.buffers.len() - 1)
    }

    /// An output tensor of shape `dims`, filled with NaN so that a row no program writes shows up.
    pub fn output(&mut self, name: &str, dims: [usize; 4]) -> Ptr {
        self.put(name, Array4::from_elem(dims, f32::NAN))
    }

    /// The tensor's values, as the host sees them after the launch (not counted as traffic).
    pub fn get(&self, t: Ptr) -> &Array4<f32> {
        &self.buffers[t.0].data
    }

    /// How many times each row `[batch, head, row]` of `t` was loaded.
    pub fn row_reads(&self, t: Ptr) -> &Array3<u32> {
        &self.buffers[t.0].reads
    }

    /// How many times each row `[batch, head, row]` of `t` was stored.
    pub fn row_writes(&self, t: Ptr) -> &Array3<u32> {
        &self.buffers[t.0].writes
    }

    /// Runs `program` once for every program id of `grid` (`[x, y, z]`), one after another, last
    /// id first: a GPU promises no order, so a program must not rely on another's results.
    pub fn launch(&mut self, grid: [usize; 3], program: impl Fn(&mut Program<'_>)) {
        let [gx, gy, gz] = grid;
        for linear in (0..gx * gy * gz).rev() {
            let pid = [linear % gx, linear / gx % gy, linear / (gx * gy)];
            program(&mut Program { pid, grid, hbm: self });
        }
    }

    /// What the programs moved, per tensor.
    pub fn traffic(&self) -> Traffic {
        let per_row = |b: &Buffer| b.data.dim().3 as u64 * ELEM_BYTES;
        Traffic {
            tensors: self
                .buffers
                .iter()
                .map(|b| TensorTraffic {
                    name: b.name.clone(),
                    loads: b.loads,
                    stores: b.stores,
                    read_bytes: b.reads.iter().map(|&r| r as u64).sum::<u64>() * per_row(b),
                    written_bytes: b.writes.iter().map(|&w| w as u64).sum::<u64>() * per_row(b),
                })
                .collect(),
        }
    }
}

/// One run of a program: its id, and its only way to HBM.
pub struct Program<'a> {
    pid: [usize; 3],
    grid: [usize; 3],
    hbm: &'a mut Hbm,
}

impl Program<'_> {
    /// This program's id along `axis` (0, 1 or 2): `tl.program_id(axis)`, CUDA's `blockIdx`.
    pub fn program_id(&self, axis: usize) -> usize {
        self.pid[axis]
    }

    /// The size of the grid along `axis`: `tl.num_programs(axis)`, CUDA's `gridDim`.
    pub fn num_programs(&self, axis: usize) -> usize {
        self.grid[axis]
    }

    /// Loads rows `rows` of `(batch, head)` of `t` as a `rows.len() × width` tile. Rows whose
    /// `mask` is false read as zeros and move no bytes; an unmasked row past the end panics.
    #[track_caller]
    pub fn load(
        &mut self,
        t: Ptr,
        batch: usize,
        head: usize,
        rows: Range<usize>,
        mask: impl Fn(usize) -> bool,
    ) -> Array2<f32> {
        let buf = &mut self.hbm.buffers[t.0];
        check_bounds("load from", buf, batch, head);
        let mut tile = Array2::zeros((rows.len(), buf.data.dim().3));
        for (i, r) in rows.enumerate() {
            if mask(r) {
                check_row("load from", buf, r);
                tile.row_mut(i).assign(&buf.data.slice(s![batch, head, r, ..]));
                buf.reads[[batch, head, r]] += 1;
            }
        }
        buf.loads += 1;
        tile
    }

    /// Stores `tile` (`rows.len() × width`, or a vector for a tensor of width 1) into rows `rows`
    /// of `(batch, head)` of `t`. Rows whose `mask` is false are not written; an unmasked row past
    /// the end panics.
    #[track_caller]
    pub fn store(
        &mut self,
        t: Ptr,
        batch: usize,
        head: usize,
        rows: Range<usize>,
        tile: impl IntoTile,
        mask: impl Fn(usize) -> bool,
    ) {
        let tile = tile.into_tile();
        let buf = &mut self.hbm.buffers[t.0];
        check_bounds("store to", buf, batch, head);
        let width = buf.data.dim().3;
        assert!(
            tile.dim() == (rows.len(), width),
            "store to {}: the tile is {:?} but rows {rows:?} of width {width} need {:?}",
            buf.name,
            tile.dim(),
            (rows.len(), width)
        );
        for (i, r) in rows.enumerate() {
            if mask(r) {
                check_row("store to", buf, r);
                buf.data.slice_mut(s![batch, head, r, ..]).assign(&tile.row(i));
                buf.writes[[batch, head, r]] += 1;
            }
        }
        buf.stores += 1;
    }
}

#[track_caller]
fn check_bounds(what: &str, buf: &Buffer, batch: usize, head: usize) {
    let (b, h, _, _) = buf.data.dim();
    assert!(
        batch < b && head < h,
        "{what} {}: (batch {batch}, head {head}) is out of bounds: it has {b} batches of {h} heads",
        buf.name
    );
}

#[track_caller]
fn check_row(what: &str, buf: &Buffer, row: usize) {
    let n = buf.data.dim().2;
    assert!(
        row < n,
        "{what} {}: row {row} is out of bounds (it has {n} rows) and its mask let it through: \
         mask the rows past the end (|r| r < {n})",
        buf.name
    );
}

/// What [`Program::store`] accepts: a 2-D tile, or a vector stored as a column (`lse`).
pub trait IntoTile {
    fn into_tile(self) -> Array2<f32>;
}

impl IntoTile for Array2<f32> {
    fn into_tile(self) -> Array2<f32> {
        self
    }
}

impl IntoTile for &Array2<f32> {
    fn into_tile(self) -> Array2<f32> {
        self.clone()
    }
}

impl IntoTile for ArrayView2<'_, f32> {
    fn into_tile(self) -> Array2<f32> {
        self.to_owned()
    }
}

impl IntoTile for Array1<f32> {
    fn into_tile(self) -> Array2<f32> {
        self.insert_axis(Axis(1))
    }
}

impl IntoTile for &Array1<f32> {
    fn into_tile(self) -> Array2<f32> {
        self.clone().insert_axis(Axis(1))
    }
}

/// Loads, stores and bytes of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorTraffic {
    pub name: String,
    pub loads: u64,
    pub stores: u64,
    pub read_bytes: u64,
    pub written_bytes: u64,
}

/// What a launch moved, per tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traffic {
    pub tensors: Vec<TensorTraffic>,
}

impl Traffic {
    /// The totals, in the form of the rungs' memory model (`ladder_reference::HbmTraffic`).
    pub fn hbm(&self) -> HbmTraffic {
        HbmTraffic {
            read_bytes: self.tensors.iter().map(|t| t.read_bytes).sum(),
            written_bytes: self.tensors.iter().map(|t| t.written_bytes).sum(),
        }
    }

    /// The traffic of the tensor called `name` (all zeros if there is none).
    pub fn of(&self, name: &str) -> TensorTraffic {
        self.tensors.iter().find(|t| t.name == name).cloned().unwrap_or(TensorTraffic {
            name: name.to_string(),
            loads: 0,
            stores: 0,
            read_bytes: 0,
            written_bytes: 0,
        })
    }
}

impl fmt::Display for Traffic {
    /// One line per tensor, then the totals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<8} {:>7} {:>7} {:>12} {:>14}",
            "tensor", "loads", "stores", "bytes read", "bytes written"
        )?;
        for t in &self.tensors {
            writeln!(
                f,
                "{:<8} {:>7} {:>7} {:>12} {:>14}",
                t.name, t.loads, t.stores, t.read_bytes, t.written_bytes
            )?;
        }
        let total = self.hbm();
        write!(f, "{:<24} {:>12} {:>14}", "total", total.read_bytes, total.written_bytes)
    }
}

/// What an FA2 block program is given: the pointers, the sizes, the tiles and the mask.
///
/// `q` is `[batch, heads_q, n_q, d]`, `k` and `v` are `[batch, heads_kv, n_kv, d]`, `o` is like
/// `q` and `lse` is `[batch, heads_q, n_q, 1]`. The grid is `[n_q.div_ceil(br), heads_q, batch]`,
/// the CUDA kernel's: program `(i, h, b)` owns query rows `i·br .. i·br + br` of head `h`.
#[derive(Debug, Clone, Copy)]
pub struct Fa2Args {
    pub q: Ptr,
    pub k: Ptr,
    pub v: Ptr,
    pub o: Ptr,
    pub lse: Ptr,
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub n_q: usize,
    pub n_kv: usize,
    pub d: usize,
    /// Query rows per program.
    pub br: usize,
    /// Keys per K/V tile.
    pub bc: usize,
    /// The softmax scale.
    pub scale: f32,
    /// Which keys each query row sees: `mask.visible_end(i)` is one past row `i`'s last key
    /// (`n_kv` without the causal mask; bottom-right aligned with it).
    pub mask: Mask,
}

impl Fa2Args {
    /// The kv head that q head `h` reads (grouped-query attention).
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads_q / self.heads_kv)
    }

    /// The launch grid: `[n_q.div_ceil(br), heads_q, batch]`.
    pub fn grid(&self) -> [usize; 3] {
        [self.n_q.div_ceil(self.br), self.heads_q, self.batch]
    }
}

/// A launch of an FA2 program on one problem: its output and the HBM it ran on.
pub struct Fa2Run {
    pub out: AttentionOutput<f32>,
    pub hbm: Hbm,
    pub args: Fa2Args,
}

/// Runs `program` on `case` (its `f32` inputs, tiles `case.tiles`, mask and scale).
pub fn run_fa2(case: &Case, program: impl Fn(&mut Program<'_>, &Fa2Args)) -> Fa2Run {
    let x = case.inputs::<f32>();
    let sh = case.shape;
    let mut hbm = Hbm::new();
    let (q, k, v) = (hbm.put("Q", x.q), hbm.put("K", x.k), hbm.put("V", x.v));
    let o = hbm.output("O", sh.q_dims());
    let lse = hbm.output("lse", [sh.batch, sh.heads_q, sh.n_q, 1]);
    let args = Fa2Args {
        q,
        k,
        v,
        o,
        lse,
        batch: sh.batch,
        heads_q: sh.heads_q,
        heads_kv: sh.heads_kv,
        n_q: sh.n_q,
        n_kv: sh.n_kv,
        d: sh.d,
        br: case.tiles.br(),
        bc: case.tiles.bc(),
        scale: case.scale() as f32,
        mask: Mask::new(case.causal, sh.n_q, sh.n_kv),
    };
    hbm.launch(args.grid(), |p| program(p, &args));
    let out = AttentionOutput {
        o: hbm.get(o).clone(),
        lse: hbm.get(lse).index_axis(Axis(3), 0).to_owned(),
        stats: Default::default(),
    };
    Fa2Run { out, hbm, args }
}

/// Runs `program` on `case` and holds its traffic to FA2's memory model: the counters of
/// `ladder_reference::fa2::forward` on the same inputs with the same tiles. `Ok` with the run
/// (whose values [`check_fa2`] judges) when every row of `Q` was read once, every row of `O` and
/// `lse` written once, and the bytes read and written are the model's; else why not.
pub fn judge_traffic(
    case: &Case,
    program: impl Fn(&mut Program<'_>, &Fa2Args),
) -> Result<Fa2Run, String> {
    let x = case.inputs::<f32>();
    let run = run_fa2(case, program);
    let opts = Fa2Options { attention: case.attention(), tiles: case.tiles };
    let model =
        fa2::forward(x.q.view(), x.k.view(), x.v.view(), &opts).map_err(|e| e.to_string())?;
    let a = &run.args;
    let (hbm, traffic) = (&run.hbm, run.hbm.traffic());
    let once = |t: Ptr, counts: &Array3<u32>, what: &str, why: &str| -> Result<(), String> {
        match counts.indexed_iter().find(|&(_, &c)| c != 1) {
            None => Ok(()),
            Some(((b, h, r), &c)) => Err(format!(
                "row {r} of {} (batch {b}, head {h}) was {what} {c} times, not once: {why}",
                hbm.buffers[t.0].name
            )),
        }
    };
    once(a.q, hbm.row_reads(a.q), "read", "FA2 loads its query block once, before the key loop")?;
    for t in [a.o, a.lse] {
        once(t, hbm.row_writes(t), "written", "FA2 stores O and lse once, after the key loop")?;
    }
    let (mine, model_hbm) = (traffic.hbm(), model.stats.hbm);
    if mine != model_hbm {
        let of = |n: &str| traffic.of(n);
        let q_bytes = of("Q").read_bytes;
        let (kv_mine, kv_model) =
            (of("K").read_bytes + of("V").read_bytes, model_hbm.read_bytes.saturating_sub(q_bytes));
        let tiles = model.stats.tiles;
        let hint = if of("K").read_bytes != of("V").read_bytes {
            "K and V are read differently: load V with the same tiles as K"
        } else if kv_mine > kv_model {
            "a K/V tile is loaded twice, or a tile that no row of the block sees (above the causal \
             diagonal) is loaded anyway"
        } else if kv_mine < kv_model {
            "a K/V tile some row of the block sees is missing, or a tile is loaded in part: load \
             whole tiles (masking only the keys past n_kv) and mask the scores, not the loads"
        } else {
            "O or lse is read, or an input is written"
        };
        return Err(format!(
            "HBM traffic differs from FA2's memory model (fa2::forward, br = {}, bc = {}):\n  \
             yours: read {} bytes (Q {}, K {}, V {}, O {}, lse {}), wrote {} bytes\n  \
             model: read {} bytes (Q once, K and V once per query block: {} loaded, {} of \
             them masked, and {} skipped, never loaded), wrote {} bytes\n  \
             K and V: {kv_mine} bytes read, the model reads {kv_model}: {hint}",
            a.br,
            a.bc,
            mine.read_bytes,
            q_bytes,
            of("K").read_bytes,
            of("V").read_bytes,
            of("O").read_bytes,
            of("lse").read_bytes,
            mine.written_bytes,
            model_hbm.read_bytes,
            count(tiles.computed(), "tile"),
            tiles.partial,
            count(tiles.skipped, "tile"),
            model_hbm.written_bytes,
        ));
    }
    Ok(run)
}

/// `1 tile`, `2 tiles`.
fn count(n: u64, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// The cases of the exercise's check come from this seed: the same draws on every run.
const SEED: u64 = 2023;

/// The exercise's check, a property test on `ladder_compare::check`: `program` on `cases` random
/// problems of the project's CPU case space (GQA, causal with `n_q ≠ n_kv`, lengths, head dims
/// and tiles from 1, logits up to ±10⁴), in `f32`. Each run's traffic is held to the memory model
/// ([`judge_traffic`]), its `O` and `lse` to the float64 oracle and to the FA2 rung. Prints `pass`,
/// or returns the counterexample, shrunk to the smallest problem that still fails.
pub fn check_fa2(
    name: &str,
    cases: u32,
    program: impl Fn(&mut Program<'_>, &Fa2Args),
) -> Result<(), Failure> {
    let passed = Check::new(name)
        .precisions([Precision::F32])
        .against(Rung::Fa2)
        .cases(cases)
        .seed(SEED)
        .run(|x| judge_traffic(&x.case, &program).map(|run| Output::new(run.out.o, run.out.lse)))
        .map_err(|e| Failure(e.to_string()))?;
    println!("{passed}");
    println!(
        "      and its HBM traffic is FA2's memory model on every case: Q read once, K and V once \
         per query block, skipped tiles never loaded, O and lse written once"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ladder_reference::{AttentionShape, TileSizes};
    use ndarray::prelude::*;

    // The notebook's reference solution, compiled against this crate as the learner's cell is.
    include!("../../solutions/09-fa2-gpu.rs");

    fn case(n_q: usize, n_kv: usize, causal: bool, br: usize, bc: usize) -> Case {
        Case {
            shape: AttentionShape::new(1, 2, 1, n_q, n_kv, 4).unwrap(),
            causal,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: TileSizes::new(br, bc).unwrap(),
            splits: 1,
            seed: 7,
        }
    }

    #[test]
    fn masked_rows_read_zeros_and_cost_nothing() {
        let mut hbm = Hbm::new();
        let x =
            hbm.put("X", Array4::from_shape_fn((1, 1, 3, 2), |(_, _, r, c)| (r * 2 + c) as f32));
        let y = hbm.output("Y", [1, 1, 3, 2]);
        hbm.launch([2, 1, 1], |p| {
            let rows = 2 * p.program_id(0)..2 * p.program_id(0) + 2; // the second block runs past n
            let tile = p.load(x, 0, 0, rows.clone(), |r| r < 3);
            p.store(y, 0, 0, rows, tile * 10.0, |r| r < 3);
        });
        assert_eq!(hbm.get(y).as_slice().unwrap(), &[0., 10., 20., 30., 40., 50.]);
        let t = hbm.traffic();
        // 3 rows of 2 floats each way: the masked fourth row moved nothing.
        assert_eq!(
            t.of("X"),
            TensorTraffic {
                name: "X".into(),
                loads: 2,
                stores: 0,
                read_bytes: 24,
                written_bytes: 0
            }
        );
        assert_eq!(t.hbm(), HbmTraffic { read_bytes: 24, written_bytes: 24 });
        assert_eq!(hbm.row_reads(x).as_slice().unwrap(), &[1, 1, 1]);
        assert!(t.to_string().contains("total"));
    }

    #[test]
    fn every_program_id_runs_once() {
        let mut hbm = Hbm::new();
        let seen = hbm.output("seen", [1, 1, 2 * 3 * 4, 1]);
        hbm.launch([2, 3, 4], |p| {
            assert_eq!([p.num_programs(0), p.num_programs(1), p.num_programs(2)], [2, 3, 4]);
            let linear = p.program_id(0) + 2 * (p.program_id(1) + 3 * p.program_id(2));
            p.store(seen, 0, 0, linear..linear + 1, array![[linear as f32]], |_| true);
        });
        let seen: Vec<f32> = hbm.get(seen).iter().copied().collect();
        assert_eq!(seen, (0..24).map(|i| i as f32).collect::<Vec<_>>());
        assert!(hbm.row_writes(Ptr(0)).iter().all(|&w| w == 1));
    }

    #[test]
    #[should_panic(expected = "row 3 is out of bounds")]
    fn an_unmasked_row_past_the_end_faults() {
        let mut hbm = Hbm::new();
        let x = hbm.put("X", Array4::zeros((1, 1, 3, 2)));
        hbm.launch([1, 1, 1], |p| {
            p.load(x, 0, 0, 0..4, |_| true);
        });
    }

    #[test]
    #[should_panic(expected = "the tile is (1, 3)")]
    fn a_store_of_the_wrong_shape_is_refused() {
        let mut hbm = Hbm::new();
        let y = hbm.output("Y", [1, 1, 3, 2]);
        hbm.launch([1, 1, 1], |p| p.store(y, 0, 0, 0..1, array![[1.0, 2.0, 3.0]], |_| true));
    }

    /// FA2's program with one of the mistakes the check must catch.
    #[derive(Clone, Copy, Default)]
    struct Flaw {
        no_causal_skip: bool,
        reload_q: bool,
        no_rescale: bool,
        partial_tiles: bool,
    }

    fn flawed(p: &mut Program, x: &Fa2Args, flaw: Flaw) {
        let (i, h, b) = (p.program_id(0), p.program_id(1), p.program_id(2));
        let kh = x.kv_head(h);
        let rows = i * x.br..(i + 1) * x.br;
        let in_q = |r: usize| r < x.n_q;
        let mut q = p.load(x.q, b, h, rows.clone(), in_q);
        let visible: Vec<usize> = rows.clone().map(|r| x.mask.visible_end(r)).collect();
        let last = x.mask.visible_end(rows.end.min(x.n_q) - 1);
        let end = if flaw.no_causal_skip { x.n_kv } else { last };
        let mut m = Array1::from_elem(x.br, f32::NEG_INFINITY);
        let mut l = Array1::<f32>::zeros(x.br);
        let mut acc = Array2::<f32>::zeros((x.br, x.d));
        for c0 in (0..end).step_by(x.bc) {
            if flaw.reload_q {
                q = p.load(x.q, b, h, rows.clone(), in_q);
            }
            let cols = c0..c0 + x.bc;
            let keep = if flaw.partial_tiles { last } else { x.n_kv };
            let k = p.load(x.k, b, kh, cols.clone(), |c| c < keep);
            let v = p.load(x.v, b, kh, cols.clone(), |c| c < keep);
            let mut s = q.dot(&k.t()) * x.scale;
            for r in 0..x.br {
                for (c, sc) in s.row_mut(r).iter_mut().enumerate() {
                    if c0 + c >= visible[r] {
                        *sc = f32::NEG_INFINITY;
                    }
                }
                let m_new = s.row(r).iter().copied().fold(m[r], f32::max);
                if m_new == f32::NEG_INFINITY {
                    s.row_mut(r).fill(0.0);
                    continue;
                }
                let alpha = if flaw.no_rescale { 1.0 } else { (m[r] - m_new).exp() };
                s.row_mut(r).mapv_inplace(|t| (t - m_new).exp());
                l[r] = alpha * l[r] + s.row(r).sum();
                acc.row_mut(r).mapv_inplace(|a| a * alpha);
                m[r] = m_new;
            }
            acc += &s.dot(&v);
        }
        let mut lse = Array1::from_elem(x.br, f32::NEG_INFINITY);
        for r in 0..x.br {
            if l[r] > 0.0 {
                acc.row_mut(r).mapv_inplace(|a| a / l[r]);
                lse[r] = m[r] + l[r].ln();
            } else {
                acc.row_mut(r).fill(0.0);
            }
        }
        p.store(x.o, b, h, rows.clone(), &acc, in_q);
        p.store(x.lse, b, h, rows, &lse, in_q);
    }

    fn failure(flaw: Flaw) -> String {
        let name = "flawed";
        check_fa2(name, 128, |p, x| flawed(p, x, flaw)).expect_err("the check must fail").0
    }

    /// A size of the shrunk case in a failure message (`n_q 3,`).
    fn field(message: &str, name: &str) -> usize {
        let at = message.find(&format!(" {name} ")).unwrap_or_else(|| panic!("{message}"));
        let rest = &message[at + name.len() + 2..];
        rest[..rest.find(',').unwrap()].trim().parse().unwrap()
    }

    #[test]
    fn the_reference_solution_passes_and_matches_the_model_exactly() {
        check_fa2("fa2_program", 128, fa2_program).unwrap();
        // One causal case in numbers: K and V are read for the 6 visible tiles of each head, the
        // 4 tiles above the diagonal never.
        let run = judge_traffic(&case(8, 8, true, 2, 2), fa2_program).unwrap();
        let t = run.hbm.traffic();
        assert_eq!(t.of("Q").read_bytes, 2 * 8 * 4 * 4);
        assert_eq!(t.of("K").read_bytes, 2 * (1 + 2 + 3 + 4) * 2 * 4 * 4);
        assert_eq!(t.of("K").loads, 2 * 10);
    }

    #[test]
    fn the_flawless_variant_passes() {
        check_fa2("flawless", 64, |p, x| flawed(p, x, Flaw::default())).unwrap();
    }

    #[test]
    fn loading_the_tiles_above_the_diagonal_fails_on_a_small_causal_case() {
        let message = failure(Flaw { no_causal_skip: true, ..Flaw::default() });
        assert!(message.contains("differs from FA2's memory model"), "{message}");
        assert!(message.contains("above the causal"), "{message}");
        // The smallest such problem: two rows and one key, one row per block; the first row
        // sees no key, so its block must load nothing.
        assert!(message.contains(", causal,"), "{message}");
        assert_eq!((field(&message, "n_q"), field(&message, "n_kv")), (2, 1), "{message}");
        assert!(
            message.contains("1 tile loaded, 0 of them masked, and 1 tile skipped"),
            "{message}"
        );
    }

    #[test]
    fn reloading_q_fails() {
        let message = failure(Flaw { reload_q: true, ..Flaw::default() });
        assert!(message.contains("of Q (batch"), "{message}");
        assert!(message.contains("times, not once"), "{message}");
    }

    #[test]
    fn loading_parts_of_tiles_fails() {
        let message = failure(Flaw { partial_tiles: true, ..Flaw::default() });
        assert!(message.contains("loaded in part"), "{message}");
    }

    #[test]
    fn a_missing_rescale_fails_on_values() {
        let message = failure(Flaw { no_rescale: true, ..Flaw::default() });
        assert!(message.contains("out of tolerance"), "{message}");
        // One row and two keys in two tiles are enough to need the rescale.
        assert_eq!((field(&message, "n_q"), field(&message, "n_kv")), (1, 2), "{message}");
    }

    #[test]
    fn a_program_that_never_stores_fails() {
        let load_q_only = |p: &mut Program, x: &Fa2Args| {
            let (i, h, b) = (p.program_id(0), p.program_id(1), p.program_id(2));
            p.load(x.q, b, h, i * x.br..(i + 1) * x.br, |r| r < x.n_q);
        };
        let message = check_fa2("lazy", 16, load_q_only).expect_err("nothing written").0;
        assert!(message.contains("FAIL: lazy"), "{message}");
        assert!(message.contains("row 0 of O (batch 0, head 0) was written 0 times"), "{message}");
    }
}
