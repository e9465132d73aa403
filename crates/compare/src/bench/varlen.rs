//! `ladder bench --varlen`: the prefill rungs on a packed variable-length batch, as a serving
//! engine batches ragged prompts, against the same kernel on a fixed-length batch of the same
//! token count.
//!
//! The batch: [`SEQUENCES`] sequences whose lengths are a fixed pseudo-random draw from
//! [`SHORTEST`] … [`LONGEST`] ([`lengths`]; `scripts/peers_varlen.py` draws the same ones), each
//! attending to itself (causal per sequence, or not), heads = hidden / d. FLOPs are the real ones,
//! the sum over the sequences (no padding counted). The fixed-length row is `SEQUENCES` sequences
//! of the mean length. With `bwd` among the directions, FA2's backward (after an untimed forward)
//! runs on both batches too; `fa3-fp8` times its attention on inputs quantised once, untimed. Rows go to `varlen.csv`:
//! `imp,direction,batching,dtype,causal,sequences,heads,d,tokens,gflop,ms,tflops`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use ladder_compare::gpu_check::gpu_fp8;
use ladder_compare::gpu_rungs::Kernels;
use ladder_compare::results::{Direction, attention_flops};
use ladder_compare::{GpuRung, RungConfig};
use ladder_kernels::varlen::SeqLens;
use ladder_kernels::{Gpu, Options, Tensor};

use super::plan::Plan;
use super::timing::{self, HostPool, Step};

/// Sequences in the batch.
pub(super) const SEQUENCES: usize = 64;
/// The shortest and longest lengths drawn.
pub(super) const SHORTEST: usize = 128;
/// See [`SHORTEST`].
pub(super) const LONGEST: usize = 4096;

/// The lengths of the benchmark's batch: sequence `i` is `lo + h(i) mod (hi − lo + 1)` with `h` a
/// 64-bit mix of `i` (SplitMix64's finaliser), so that any language draws the same batch.
pub(super) fn lengths(count: usize, lo: usize, hi: usize) -> Vec<usize> {
    (0..count as u64)
        .map(|i| {
            let mut x = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 31;
            lo + (x % (hi - lo + 1) as u64) as usize
        })
        .collect()
}

/// One row of `varlen.csv`.
struct VarlenRow {
    imp: String,
    direction: Direction,
    batching: &'static str,
    causal: bool,
    heads: usize,
    d: usize,
    tokens: usize,
    flop: f64,
    ms: f64,
}

impl VarlenRow {
    fn tflops(&self) -> f64 {
        self.flop / (self.ms * 1e-3) / 1e12
    }
}

/// What one rung times on the two batches (packed, then fixed-length): the forward, or (a
/// backward rung) the backward after an untimed forward.
type Steps<'a> = [(&'static str, Step<'a>); 2];

/// Times the prefill rungs of `plan` (fa2, fa3, and with `bwd` among the directions the FA2
/// backward) on the varlen batch at each head dim and mask, writes `out/varlen.csv` and prints a
/// table.
pub(super) fn run(gpu: &Gpu, plan: &Plan, out: &Path) -> anyhow::Result<bool> {
    let lens = lengths(SEQUENCES, SHORTEST, LONGEST);
    let tokens: usize = lens.iter().sum();
    let mean = tokens / SEQUENCES;
    let seqlens = SeqLens::from_lengths(gpu, &lens, &lens)?;
    // The rungs with a packed entry point in the plan's directions.
    let rungs: Vec<GpuRung> = GpuRung::ALL
        .into_iter()
        .filter(|r| plan.rungs.contains(&r.name()) && plan.directions.contains(&r.direction()))
        .filter(|r| r.available_on(gpu))
        .filter(|r| {
            r.varlen_forward().is_some()
                || r.varlen_backward().is_some()
                || r.varlen_fp8().is_some()
        })
        .collect();
    eprintln!(
        "varlen: {SEQUENCES} sequences of {SHORTEST} … {LONGEST} tokens ({tokens} in all, mean \
         {mean}); fixed-length rows: {SEQUENCES} × {mean}; rungs {:?}",
        rungs.iter().map(|r| r.label()).collect::<Vec<_>>()
    );
    let mut pool = HostPool::default();
    let mut rows = Vec::new();
    let mut ok = true;
    for &d in &plan.ds {
        let heads = (plan.hidden / d).max(1);
        let upload = |pool: &mut HostPool, slot, shape: &[usize]| -> anyhow::Result<Tensor> {
            let len = shape.iter().product();
            Ok(gpu.upload(pool.values(slot, len), shape, plan.dtype)?)
        };
        // Q, K, V and dO, packed and as the fixed-length batch.
        let packed: Vec<Tensor> = (0..4)
            .map(|slot| upload(&mut pool, slot, &[tokens, heads, d]))
            .collect::<anyhow::Result<_>>()?;
        let fixed: Vec<Tensor> = (0..4)
            .map(|slot| upload(&mut pool, slot, &[SEQUENCES, heads, mean, d]))
            .collect::<anyhow::Result<_>>()?;
        for &causal in &plan.causals {
            for &rung in &rungs {
                let direction = rung.direction();
                let flop = |n: &[usize]| -> f64 {
                    n.iter().map(|&n| attention_flops(direction, 1, heads, n, n, d, causal)).sum()
                };
                let steps = match steps(gpu, rung, (&packed, &fixed), &seqlens, causal) {
                    Ok(steps) => steps,
                    Err(e) => {
                        ok = false;
                        eprintln!("varlen: {} d={d} causal={causal}: {e}", rung.label());
                        continue;
                    }
                };
                for (batching, mut step) in steps {
                    let n = if batching == "varlen" { lens.clone() } else { vec![mean; SEQUENCES] };
                    let timed = timing::measure(
                        gpu,
                        &mut step,
                        1,
                        plan.warmup,
                        plan.repeats,
                        plan.budget_ms,
                    );
                    match timed {
                        Ok(t) => {
                            let row = VarlenRow {
                                imp: rung.name().to_string(),
                                direction,
                                batching,
                                causal,
                                heads,
                                d,
                                tokens,
                                flop: flop(&n),
                                ms: t.ms,
                            };
                            eprintln!(
                                "varlen: {} {batching:<6} d={d} causal={causal}: {:.3} ms, {:.0} TFLOP/s",
                                rung.label(),
                                row.ms,
                                row.tflops()
                            );
                            rows.push(row);
                        }
                        Err(e) => {
                            ok = false;
                            eprintln!(
                                "varlen: {} {batching} d={d} causal={causal}: {e}",
                                rung.label()
                            );
                        }
                    }
                }
            }
        }
    }
    let csv = to_csv(&rows, plan);
    let path = out.join("varlen.csv");
    std::fs::write(&path, csv).with_context(|| format!("writing {}", path.display()))?;
    println!("{}", table(&rows));
    Ok(ok)
}

/// The timed steps of `rung` on the packed batch and the fixed-length one (`[q, k, v, d_o]`
/// each). A backward rung's forward runs here, once per batch, untimed.
fn steps<'a>(
    gpu: &'a Gpu,
    rung: GpuRung,
    (packed, fixed): (&'a [Tensor], &'a [Tensor]),
    seqlens: &'a SeqLens,
    causal: bool,
) -> anyhow::Result<Steps<'a>> {
    let opts = Options { causal, ..Options::default() };
    if let (Some(varlen_run), Some(fixed_run)) = (rung.varlen_forward(), rung.forward()) {
        let varlen_opts = opts.clone();
        let varlen: Step = Box::new(move |_| {
            let o = varlen_run(gpu, &packed[0], &packed[1], &packed[2], seqlens, &varlen_opts)?;
            Ok(vec![o.o, o.lse])
        });
        let fixed: Step = Box::new(move |_| {
            let o = fixed_run(gpu, &fixed[0], &fixed[1], &fixed[2], &opts)?;
            Ok(vec![o.o, o.lse])
        });
        return Ok([("varlen", varlen), ("fixed", fixed)]);
    }
    if let (Some((quantize_varlen, varlen_run)), Kernels::ForwardFp8 { quantize, forward }) =
        (rung.varlen_fp8(), rung.kernels())
    {
        // FP8: quantised once, untimed (as `ladder bench` times the fixed-length FP8 rung).
        let fp8 = gpu_fp8(&RungConfig::default().fp8);
        let packed_in =
            quantize_varlen(gpu, &packed[0], &packed[1], &packed[2], seqlens, &opts, &fp8)?;
        let fixed_in = quantize(gpu, &fixed[0], &fixed[1], &fixed[2], &opts, &fp8)?;
        let varlen: Step = Box::new(move |_| {
            let o = varlen_run(gpu, &packed_in, seqlens)?;
            Ok(vec![o.o, o.lse])
        });
        let fixed: Step = Box::new(move |_| {
            let o = forward(gpu, &fixed_in)?;
            Ok(vec![o.o, o.lse])
        });
        return Ok([("varlen", varlen), ("fixed", fixed)]);
    }
    let Some((varlen_forward, varlen_backward)) = rung.varlen_backward() else {
        anyhow::bail!("{} has no packed entry point", rung.label());
    };
    let Kernels::Backward { forward, backward, deterministic } = rung.kernels() else {
        anyhow::bail!("{} is not a backward rung", rung.label());
    };
    let opts = Options { deterministic, ..opts };
    let [q, k, v, d_o] = [&packed[0], &packed[1], &packed[2], &packed[3]];
    let out = varlen_forward(gpu, q, k, v, seqlens, &opts)?;
    let varlen_opts = opts.clone();
    let varlen: Step = Box::new(move |_| {
        let g = varlen_backward(gpu, q, k, v, &out, d_o, seqlens, &varlen_opts)?;
        Ok(vec![g.dq, g.dk, g.dv])
    });
    let [q, k, v, d_o] = [&fixed[0], &fixed[1], &fixed[2], &fixed[3]];
    let out = forward(gpu, q, k, v, &opts)?;
    let fixed: Step = Box::new(move |_| {
        let g = backward(gpu, q, k, v, &out, d_o, &opts)?;
        Ok(vec![g.dq, g.dk, g.dv])
    });
    Ok([("varlen", varlen), ("fixed", fixed)])
}

fn to_csv(rows: &[VarlenRow], plan: &Plan) -> String {
    let mut csv = String::from(
        "imp,direction,batching,dtype,causal,sequences,heads,d,tokens,gflop,ms,tflops\n",
    );
    for r in rows {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{SEQUENCES},{},{},{},{:.3},{:.4},{:.1}",
            r.imp,
            r.direction.name(),
            r.batching,
            plan.dtype.name(),
            r.causal,
            r.heads,
            r.d,
            r.tokens,
            r.flop / 1e9,
            r.ms,
            r.tflops()
        );
    }
    csv
}

/// `rung  pass  d  mask  varlen  fixed  varlen / fixed` (TFLOP/s).
fn table(rows: &[VarlenRow]) -> String {
    let mut t =
        String::from("rung     pass    d    mask     varlen  fixed  varlen/fixed (TFLOP/s)\n");
    for r in rows.iter().filter(|r| r.batching == "varlen") {
        let fixed = rows.iter().find(|f| {
            f.batching == "fixed"
                && (&f.imp, f.direction, f.d, f.causal) == (&r.imp, r.direction, r.d, r.causal)
        });
        let (f, ratio) = match fixed {
            Some(f) => (format!("{:.0}", f.tflops()), format!("{:.2}", r.tflops() / f.tflops())),
            None => ("-".into(), "-".into()),
        };
        let mask = if r.causal { "causal" } else { "full" };
        let pass = r.direction.name();
        let _ = writeln!(
            t,
            "{:<8} {pass:<7} {:<4} {mask:<8} {:>6.0} {f:>6}  {ratio}",
            r.imp,
            r.d,
            r.tflops()
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_is_a_fixed_spread_of_lengths() {
        let l = lengths(SEQUENCES, SHORTEST, LONGEST);
        assert_eq!(l, lengths(SEQUENCES, SHORTEST, LONGEST));
        assert!(l.iter().all(|&n| (SHORTEST..=LONGEST).contains(&n)));
        let total: usize = l.iter().sum();
        // About 128k tokens, as the benchmark's issue asks, and a real spread.
        assert!((100_000..160_000).contains(&total), "{total}");
        assert!(l.iter().any(|&n| n < 1000) && l.iter().any(|&n| n > 3500), "{l:?}");
        // The values scripts/peers_varlen.py checks it draws too.
        assert_eq!(&l[..3], &FIRST_THREE);
    }

    /// The first three lengths, pinned so that a change to the draw is seen on both sides.
    const FIRST_THREE: [usize; 3] = [1026, 3881, 1488];
}
