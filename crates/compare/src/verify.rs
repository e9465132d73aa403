//! `ladder verify`: every rung on a problem, checked against the rung before it and the oracle.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use ladder_reference::{
    AttentionOutput, AttentionShape, Element, Fa2Options, HbmTraffic, Result, fa2, naive,
};

use crate::cases::{Case, Inputs};
use crate::memory::{human_bytes, measure};
use crate::metrics::{ErrorStats, Tolerance, error_between};
use crate::oracle::{Expected, ExpectedGradients, GradientOracle, Oracle, judge_between};
use crate::rungs::{Rung, RungConfig};

/// One problem of the verification run.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyCase {
    pub name: String,
    pub shape: AttentionShape,
}

impl VerifyCase {
    /// The default prefill problem: batch 2, 8 query heads over 2 kv heads, 1024 tokens, d = 64.
    pub fn prefill() -> Self {
        Self {
            name: "prefill".into(),
            shape: AttentionShape::new(2, 8, 2, 1024, 1024, 64).expect("valid"),
        }
    }

    /// The default decode problem: one query token per head against an 8192-token cache.
    pub fn decode() -> Self {
        Self {
            name: "decode".into(),
            shape: AttentionShape::new(2, 8, 2, 1, 8192, 64).expect("valid"),
        }
    }

    /// The random problem of this case under `config`: unit-normal tensors from `seed`.
    fn spec(&self, config: &RungConfig, seed: u64) -> Case {
        Case {
            shape: self.shape,
            causal: config.attention.causal,
            window: config.attention.window,
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: config.tiles,
            splits: config.splits,
            seed,
        }
    }
}

/// One line of the table.
#[derive(Debug, Clone)]
pub struct Row {
    pub case: String,
    pub label: String,
    /// Name of the rung compared against and the error against it (in `f32`).
    pub vs_previous: Option<(String, ErrorStats)>,
    /// Error against the float64 oracle in `f32` (for backward rows, the worst of dQ, dK, dV).
    pub vs_oracle: ErrorStats,
    /// Largest ratio of an `f32` error to its tolerance (≤ 1 passes).
    pub err_over_tol: f64,
    /// The same ratio for the rung run in `f64`, where the tolerance is ~10⁻¹³: the algorithm
    /// itself, without `f32` noise.
    pub f64_err_over_tol: f64,
    /// Wall time of the `f32` run.
    pub elapsed: Duration,
    /// Heap allocated beyond the returned tensors, at the peak (`f32` run).
    pub extra_bytes: Option<u64>,
    /// Modelled HBM traffic of the CPU rung's memory model (`None` for GPU rows: not modelled).
    pub hbm: Option<HbmTraffic>,
    pub note: String,
    /// Within tolerance in both precisions.
    pub pass: bool,
}

/// Runs every rung (and the two backward rungs) on each case, in `f32` and in `f64`, calling
/// `progress` as each finishes.
pub fn run(
    cases: &[VerifyCase],
    config: &RungConfig,
    seed: u64,
    mut progress: impl FnMut(&str, &Row),
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for case in cases {
        let spec = case.spec(config, seed);
        // The f64 run sees the f32 inputs widened, so one oracle serves both precisions.
        let narrow_inputs = spec.inputs::<f32>();
        let wide_inputs = narrow_inputs.widen();
        let oracle = Oracle::new(&wide_inputs, &config.attention)?;
        let gradients = GradientOracle::new(&wide_inputs, &config.attention)?;
        let narrow = check_case(case, &narrow_inputs, &oracle, &gradients, config, &mut progress)?;
        let wide = check_case(case, &wide_inputs, &oracle, &gradients, config, &mut progress)?;
        for (mut row, wide) in narrow.into_iter().zip(wide) {
            row.f64_err_over_tol = wide.err_over_tol;
            row.pass &= wide.pass;
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Every rung on one case in precision `T`.
fn check_case<T: Element>(
    case: &VerifyCase,
    inputs: &Inputs<T>,
    oracle: &Oracle,
    gradients: &GradientOracle,
    config: &RungConfig,
    progress: &mut impl FnMut(&str, &Row),
) -> Result<Vec<Row>> {
    let expected = Expected::from_oracle(oracle, inputs)?;
    let expected_fp8 = Expected::fp8_from_oracle(oracle, inputs, &config.fp8)?;
    let mut outputs: HashMap<Rung, AttentionOutput<T>> = HashMap::new();
    let mut rows = Vec::new();
    for rung in Rung::ALL {
        let measured =
            measure(|| rung.forward(inputs.q.view(), inputs.k.view(), inputs.v.view(), config));
        let out = measured.value?;
        let this = if rung.is_fp8() { &expected_fp8 } else { &expected };
        let verdict = this.judge(&out);
        let mut ratio = ratio_of(verdict.o, this.o).max(ratio_of(verdict.lse, this.lse));
        let mut pass = verdict.pass;
        let vs_previous = rung.previous().map(|prev| {
            let prev_expected = if prev.is_fp8() { &expected_fp8 } else { &expected };
            let pair = judge_between(&out, &outputs[&prev], this, prev_expected);
            ratio = ratio
                .max(ratio_of(pair.o, this.o.plus(prev_expected.o)))
                .max(ratio_of(pair.lse, this.lse.plus(prev_expected.lse)));
            pass &= pair.pass;
            (prev.name().to_string(), pair.o)
        });
        let row = Row {
            case: case.name.clone(),
            label: rung.name().to_string(),
            vs_previous,
            vs_oracle: verdict.o,
            err_over_tol: ratio,
            f64_err_over_tol: f64::NAN,
            elapsed: measured.elapsed,
            extra_bytes: measured
                .peak_bytes
                .map(|b| b.saturating_sub(bytes_of::<T>(out.o.len() + out.lse.len()))),
            hbm: Some(out.stats.hbm),
            note: note(rung, &out, expected_fp8.baseline),
            pass,
        };
        progress(T::NAME, &row);
        rows.push(row);
        outputs.insert(rung, out);
    }
    rows.extend(backward_rows(case, inputs, gradients, config, &outputs[&Rung::Fa2], progress)?);
    Ok(rows)
}

fn backward_rows<T: Element>(
    case: &VerifyCase,
    inputs: &Inputs<T>,
    gradients: &GradientOracle,
    config: &RungConfig,
    forward: &AttentionOutput<T>,
    progress: &mut impl FnMut(&str, &Row),
) -> Result<Vec<Row>> {
    let attention = config.attention.clone();
    let expected = ExpectedGradients::from_oracle(gradients, inputs)?;
    let (q, k, v, d_o) = (inputs.q.view(), inputs.k.view(), inputs.v.view(), inputs.d_o.view());
    let naive_run = measure(|| naive::backward(q, k, v, d_o, &attention));
    let naive_grads = naive_run.value?;
    let fa2_opts = Fa2Options { attention, tiles: config.tiles };
    let fa2_run =
        measure(|| fa2::backward(q, k, v, forward.o.view(), d_o, forward.lse.view(), &fa2_opts));
    let fa2_grads = fa2_run.value?;

    let mut rows = Vec::new();
    for (label, grads, elapsed, peak, previous) in [
        ("naive-bwd", &naive_grads, naive_run.elapsed, naive_run.peak_bytes, None),
        ("fa2-bwd", &fa2_grads, fa2_run.elapsed, fa2_run.peak_bytes, Some(&naive_grads)),
    ] {
        let (errs, mut pass) = expected.judge(grads);
        let mut ratio = errs
            .iter()
            .zip(&expected.tolerances)
            .map(|(e, t)| ratio_of(*e, *t))
            .fold(0.0, f64::max);
        let vs_previous = previous.map(|prev| {
            let pair = [
                error_between(&grads.dq, &prev.dq),
                error_between(&grads.dk, &prev.dk),
                error_between(&grads.dv, &prev.dv),
            ];
            for (e, t) in pair.iter().zip(&expected.tolerances) {
                let r = ratio_of(*e, t.plus(*t));
                ratio = ratio.max(r);
                pass &= r <= 1.0;
            }
            (
                "naive-bwd".to_string(),
                pair.into_iter().fold(ErrorStats::default(), ErrorStats::worst),
            )
        });
        let row = Row {
            case: case.name.clone(),
            label: label.to_string(),
            vs_previous,
            vs_oracle: errs.into_iter().fold(ErrorStats::default(), ErrorStats::worst),
            err_over_tol: ratio,
            f64_err_over_tol: f64::NAN,
            elapsed,
            extra_bytes: peak.map(|b| {
                b.saturating_sub(bytes_of::<T>(grads.dq.len() + grads.dk.len() + grads.dv.len()))
            }),
            hbm: Some(grads.stats.hbm),
            note: "dQ, dK, dV".to_string(),
            pass,
        };
        progress(T::NAME, &row);
        rows.push(row);
    }
    Ok(rows)
}

/// The larger of the two error-to-tolerance ratios (NaN counts as failing).
fn ratio_of(err: ErrorStats, tol: Tolerance) -> f64 {
    let r = (err.rel_l2 / tol.rel_l2).max(err.max_abs / tol.max_abs);
    if r.is_nan() { f64::INFINITY } else { r }
}

fn bytes_of<T>(elements: usize) -> u64 {
    (elements * size_of::<T>()) as u64
}

fn note<T>(rung: Rung, out: &AttentionOutput<T>, fp8_baseline: ErrorStats) -> String {
    let s = &out.stats;
    let mut note = format!("{} work items", s.work_items);
    if s.tiles.computed() + s.tiles.skipped > 0 {
        let _ = write!(
            note,
            ", {} tiles ({} skipped)",
            s.tiles.computed() + s.tiles.skipped,
            s.tiles.skipped
        );
    }
    if let Some(rows) = s.fallback_rows {
        let _ = write!(note, ", {rows} fallback rows");
    }
    if rung.is_fp8() {
        // The FP8 tolerance is relative to this: when it is large, so are the logits for e4m3.
        let _ = write!(note, ", e4m3 (per-tensor FP8 baseline: {:.2e})", fp8_baseline.rel_l2);
    }
    note
}

/// The table, one row per line.
///
/// The "extra mem" column needs the counting allocator ([`crate::memory`]), which only a binary
/// can install (the `ladder` CLI does); when no row has the figure (a notebook, a test, a library
/// caller without the allocator) the column is left out instead of reading `n/a` on every row.
pub fn render(rows: &[Row]) -> String {
    let with_memory = rows.iter().any(|r| r.extra_bytes.is_some());
    let header = [
        "case",
        "rung",
        "vs previous (rel L2 / max abs)",
        "vs oracle (rel L2 / max abs)",
        "err/tol",
        "f64 err/tol",
        "time",
        "extra mem",
        "HBM traffic",
        "ok",
        "notes",
    ];
    const MEMORY: usize = 7;
    let keep = |c: &usize| with_memory || *c != MEMORY;
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let cells: [String; 11] = [
                r.case.clone(),
                r.label.clone(),
                r.vs_previous.as_ref().map_or("-".into(), |(name, e)| format!("{e} ({name})")),
                r.vs_oracle.to_string(),
                format!("{:.1e}", r.err_over_tol),
                // GPU rows have no f64 run.
                if r.f64_err_over_tol.is_nan() {
                    "-".into()
                } else {
                    format!("{:.1e}", r.f64_err_over_tol)
                },
                format!("{:.1} ms", r.elapsed.as_secs_f64() * 1e3),
                r.extra_bytes.map_or("n/a".into(), human_bytes),
                r.hbm.map_or("n/a".into(), |h| human_bytes(h.total_bytes())),
                if r.pass { "ok".into() } else { "FAIL".into() },
                r.note.clone(),
            ];
            cells.into_iter().enumerate().filter(|(c, _)| keep(c)).map(|(_, x)| x).collect()
        })
        .collect();
    let header: Vec<&str> =
        header.into_iter().enumerate().filter(|(c, _)| keep(c)).map(|(_, h)| h).collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| body.iter().map(|r| r[c].chars().count()).fold(header[c].len(), usize::max))
        .collect();
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let padded: Vec<String> =
            cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", padded.join("  ").trim_end());
    };
    line(header.clone(), &mut out);
    let rules: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    line(rules.iter().map(String::as_str).collect(), &mut out);
    for r in &body {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

/// The GPU rungs on each case, in fp16: FA1 and FA2 forward against their CPU rungs, FA2
/// backward against the CPU FA2 backward, and FlashDecoding and FlashDecoding++ (on a case of at
/// most 16 queries, causal or a single one: a decoding step, the queries the last tokens of a
/// full cache) against the CPU rungs 6 and 7 with the same split count (and `--phi`, which the
/// GPU takes as its `φ`, default [`ladder_kernels::decode::DEFAULT_PHI`]; without it the CPU rung
/// estimates its own), all on the case's inputs rounded to fp16
/// and judged by the float64 oracle of those inputs (tolerance: twice the 16-bit naive error, see
/// [`crate::low_precision`]). Times are the kernels' own (CUDA events), the first call of a
/// variant including its compilation.
pub fn gpu_rows(
    gpu: &ladder_kernels::Gpu,
    cases: &[VerifyCase],
    config: &RungConfig,
    seed: u64,
    mut progress: impl FnMut(&str, &Row),
) -> anyhow::Result<Vec<Row>> {
    use crate::gpu_check;
    use crate::gpu_rungs::GpuRung;
    use crate::results::Direction;
    use ladder_kernels::DType;
    use ladder_kernels::decode::{self, DecodeOptions};
    use ladder_reference::Phi;

    let dtype = DType::F16;
    let mut rows = Vec::new();
    for case in cases {
        let d = case.shape.d;
        let spec = case.spec(config, seed);
        let x = gpu_check::device_inputs(&spec, dtype);
        let (attention, opts) = gpu_check::options(&config.attention, d);
        let oracle = Oracle::new(&x, &attention)?;
        let x32 = gpu_check::narrow(&x);
        let cpu_expected = Expected::from_oracle(&oracle, &x32)?;
        let gpu_expected = gpu_check::expected_forward(&oracle, &x, dtype)?;
        let (q, k, v) = (x32.q.view(), x32.k.view(), x32.v.view());
        let cpu_config = RungConfig { attention: attention.clone(), ..RungConfig::default() };
        // A forward-like row: the GPU output against the oracle and against its CPU rung's, each
        // held to its own tolerance.
        let forward_row = |rung: GpuRung,
                           out: &AttentionOutput<f32>,
                           cpu_out: &AttentionOutput<f32>,
                           (gpu_expected, cpu_expected): (&Expected, &Expected),
                           elapsed: Duration,
                           note: String| {
            let verdict = gpu_expected.judge(out);
            let pair = judge_between(out, cpu_out, gpu_expected, cpu_expected);
            let ratio = ratio_of(verdict.o, gpu_expected.o)
                .max(ratio_of(verdict.lse, gpu_expected.lse))
                .max(ratio_of(pair.o, gpu_expected.o.plus(cpu_expected.o)))
                .max(ratio_of(pair.lse, gpu_expected.lse.plus(cpu_expected.lse)));
            Row {
                case: case.name.clone(),
                label: rung.label().to_string(),
                vs_previous: Some((format!("{}, CPU", rung.cpu_label()), pair.o)),
                vs_oracle: verdict.o,
                err_over_tol: ratio,
                f64_err_over_tol: f64::NAN,
                elapsed,
                extra_bytes: None,
                hbm: None,
                note,
                pass: verdict.pass && pair.pass,
            }
        };
        for rung in GpuRung::ALL {
            if !rung.supports(d) || !rung.dtypes().contains(&dtype) || !rung.available_on(gpu) {
                continue;
            }
            let cpu_name = format!("{}, CPU", rung.cpu_label());
            let row = match rung.direction() {
                Direction::Fwd if rung.cpu().is_fp8() => {
                    // The CPU rung quantises in the kernel's blocks, so both round the same
                    // numbers; both are held to the FP8 tolerance.
                    let fp8_config = RungConfig {
                        tiles: gpu_check::fp8_cpu_tiles(
                            gpu,
                            d,
                            case.shape.n_kv,
                            config.attention.window,
                        )?,
                        fp8: config.fp8,
                        ..cpu_config.clone()
                    };
                    let fp8_expected = Expected::fp8_from_oracle(&oracle, &x32, &config.fp8)?;
                    let cpu_out = rung.cpu().forward(q, k, v, &fp8_config)?;
                    let (out, elapsed) =
                        gpu_check::forward_fp8(gpu, rung, &x, &opts, dtype, &config.fp8)?;
                    let rotation =
                        if config.fp8.incoherent.is_some() { "incoherent" } else { "no rotation" };
                    let note = format!("fp16 in, e4m3 ({rotation}), on {}", gpu.name());
                    let expected = (&fp8_expected, &fp8_expected);
                    forward_row(rung, &out, &cpu_out, expected, elapsed, note)
                }
                Direction::Fwd => {
                    let cpu_out = rung.cpu().forward(q, k, v, &cpu_config)?;
                    let (out, elapsed) = gpu_check::forward(gpu, rung, &x, &opts, dtype)?;
                    let expected = (&gpu_expected, &cpu_expected);
                    forward_row(
                        rung,
                        &out,
                        &cpu_out,
                        expected,
                        elapsed,
                        format!("fp16 on {}", gpu.name()),
                    )
                }
                Direction::Decode => {
                    // A decoding step has 1 to 16 new tokens, causal among themselves: a case
                    // with more queries, or several without the mask, is not one.
                    let n_q = case.shape.n_q;
                    if n_q > decode::MAX_NEW_TOKENS || (n_q > 1 && !attention.causal) {
                        continue;
                    }
                    let splits = config.splits;
                    let decode_config =
                        RungConfig { splits, phi: config.phi, ..cpu_config.clone() };
                    let cpu_out = rung.cpu().forward(q, k, v, &decode_config)?;
                    // φ: --phi, or the GPU's default (the CPU rung estimates its own without it).
                    let phi = match config.phi {
                        Phi::Given(phi) => phi as f32,
                        Phi::Estimate { .. } => decode::DEFAULT_PHI,
                    };
                    let decode_opts = DecodeOptions {
                        scale: opts.scale,
                        splits: Some(splits),
                        phi,
                        ..DecodeOptions::default()
                    };
                    let (out, elapsed, stats) =
                        gpu_check::decode(gpu, rung, &x, &decode_opts, dtype)?;
                    let mut note = format!("fp16 on {}, {splits} splits (--splits)", gpu.name());
                    if let Some(rows) = stats.fallback_rows {
                        let _ = write!(
                            note,
                            ", {}, φ = {phi}, {rows} fallback rows",
                            stats.plan.strategy
                        );
                    }
                    let expected = (&gpu_expected, &cpu_expected);
                    forward_row(rung, &out, &cpu_out, expected, elapsed, note)
                }
                Direction::Bwd => {
                    let grad_oracle = GradientOracle::new(&x, &attention)?;
                    let expected = gpu_check::expected_backward(&grad_oracle, &x, dtype)?;
                    let (grads, elapsed) = gpu_check::backward(gpu, rung, &x, &opts, dtype)?;
                    let (errs, mut pass) = expected.judge(&grads);
                    let mut ratio = errs
                        .iter()
                        .zip(&expected.tolerances)
                        .map(|(e, t)| ratio_of(*e, *t))
                        .fold(0.0, f64::max);
                    let pair = gpu_check::vs_cpu_backward(&grad_oracle, &x32, &grads, &expected)?;
                    for (e, tol) in &pair {
                        let r = ratio_of(*e, *tol);
                        ratio = ratio.max(r);
                        pass &= r <= 1.0;
                    }
                    let worst = pair
                        .into_iter()
                        .map(|(e, _)| e)
                        .fold(ErrorStats::default(), ErrorStats::worst);
                    Row {
                        case: case.name.clone(),
                        label: rung.label().to_string(),
                        vs_previous: Some((cpu_name, worst)),
                        vs_oracle: errs.into_iter().fold(ErrorStats::default(), ErrorStats::worst),
                        err_over_tol: ratio,
                        f64_err_over_tol: f64::NAN,
                        elapsed,
                        extra_bytes: None,
                        hbm: None,
                        note: format!("dQ, dK, dV; fp16 on {}", gpu.name()),
                        pass,
                    }
                }
            };
            progress("fp16", &row);
            rows.push(row);
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(extra_bytes: Option<u64>) -> Row {
        Row {
            case: "prefill".into(),
            label: "naive".into(),
            vs_previous: None,
            vs_oracle: ErrorStats::default(),
            err_over_tol: 0.5,
            f64_err_over_tol: 0.25,
            elapsed: Duration::from_millis(3),
            extra_bytes,
            hbm: Some(HbmTraffic { read_bytes: 1024, written_bytes: 1024 }),
            note: "4 work items".into(),
            pass: true,
        }
    }

    #[test]
    fn the_memory_column_appears_only_when_something_was_measured() {
        let without = render(&[row(None), row(None)]);
        assert!(!without.contains("extra mem") && !without.contains("n/a"), "{without}");
        assert!(without.contains("HBM traffic") && without.contains("2.0 KiB"), "{without}");
        // One measured row is enough for the column; an unmeasured one reads n/a in it.
        let with = render(&[row(Some(512)), row(None)]);
        assert!(with.contains("extra mem") && with.contains("512 B"), "{with}");
        assert!(with.lines().nth(3).is_some_and(|l| l.contains("n/a")), "{with}");
        // The rule under the header has one run of dashes per column: 10 without, 11 with.
        let columns = |table: &str| table.lines().nth(1).unwrap().split_whitespace().count();
        assert_eq!((columns(&without), columns(&with)), (10, 11));
    }
}
