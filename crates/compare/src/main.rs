//! `ladder`: run and verify the rungs of the attention ladder.

mod bench;
mod run;

use std::process::ExitCode;

use anyhow::bail;
use clap::{Args, Parser, Subcommand};
use ladder_compare::memory::{PeakAlloc, human_bytes};
use ladder_compare::modifiers::{MaskSpec, ModifierSpec};
use ladder_compare::verify::{self, VerifyCase};
use ladder_compare::{Rung, RungConfig};
use ladder_reference::{AttentionOptions, AttentionShape, Phi, TileSizes, Window};

// Counts heap use so `verify` can report the extra memory each rung allocates.
#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

#[derive(Parser)]
#[command(
    name = "ladder",
    version,
    about = "The attention ladder: naive attention to FlashDecoding++, rung by rung"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run every rung on a prefill and a decode problem and check each against the rung before
    /// it and the float64 oracle; exits non-zero if any is out of tolerance.
    Verify(VerifyArgs),
    /// Run one rung on your own tensors (.npy, float16/32/64, shape [batch, heads, seq, head_dim]).
    Run(run::RunArgs),
    /// Time the GPU rungs (CUDA events) at the FlashAttention-3 paper's shapes, and FlashDecoding
    /// and FlashDecoding++ with `--direction decode`; write CSV, JSON and TFLOP/s (decode: TB/s) charts (with
    /// scripts/peers.py's PyTorch/Triton figures when present).
    Bench(bench::BenchArgs),
}

/// Options shared by the rungs.
#[derive(Args)]
struct RungArgs {
    /// Softmax scale [default: 1/√d].
    #[arg(long)]
    scale: Option<f64>,
    /// Query rows per tile.
    #[arg(long, default_value_t = 64)]
    br: usize,
    /// Key columns per tile.
    #[arg(long, default_value_t = 64)]
    bc: usize,
    /// K/V splits of the decoding rungs.
    #[arg(long, default_value_t = 8)]
    splits: usize,
    /// FlashDecoding++'s unified max φ [default: estimated per head from 64 sampled keys on the
    /// CPU, 0 on the GPU].
    #[arg(long)]
    phi: Option<f64>,
    /// Turn off incoherent processing on the FP8 path.
    #[arg(long)]
    no_incoherent: bool,
    /// A sliding window LEFT,RIGHT in keys around each query's diagonal (flash-attention's
    /// window_size, bottom-right aligned): query i sees keys i + n_kv − n_q − LEFT through
    /// i + n_kv − n_q + RIGHT; -1 leaves a side open, --causal makes RIGHT 0. Every CPU rung; on
    /// the GPU, fa2 (forward and backward) and fa3, fa3-fp8 (forward).
    #[arg(long, allow_hyphen_values = true)]
    window: Option<Window>,
    /// A modifier: a score modifier applied to each scaled score before the softmax, softcap:CAP
    /// (Gemma-2's cap · tanh(s / cap)), alibi (the ALiBi paper's slopes for the heads),
    /// softcap:CAP+alibi, or relative-bias (a bias table by distance, the user-written example);
    /// or sinks (gpt-oss's attention sinks: one logit per head in every row's softmax, fixed
    /// values in [−1, 3); the backward also gives their gradient). Every CPU rung (and the FA2
    /// backward); on the GPU, fa2 and fa3 (16-bit), forward and backward. `ladder run` only.
    #[arg(long = "score-mod")]
    score_mod: Option<ModifierSpec>,
    /// A mask modifier, which hides query–key pairs inside the band (the causal mask and the
    /// window): documents:N (the keys in N documents of near-equal length, each query seeing its
    /// own document's keys; with --causal, packed causal training), prefix-lm:P (the first P keys
    /// for every query, then causal; without --causal), dilated:S (keys at distances from the
    /// diagonal that are multiples of S), head-dilated:S (a stride of 1 + h mod S for head h) or
    /// batch-prefix-lm:P (a prefix of P·(b + 1) keys for batch entry b). Every CPU rung (and the
    /// FA2 backward); on the GPU FA2 and FA3, forward and backward (16-bit). `ladder run` only.
    #[arg(long = "mask-mod")]
    mask_mod: Option<MaskSpec>,
}

impl RungArgs {
    fn config(&self, causal: bool) -> anyhow::Result<RungConfig> {
        let defaults = RungConfig::default();
        if self.splits == 0 {
            bail!("--splits must be at least 1");
        }
        if let Some(phi) = self.phi.filter(|p| !p.is_finite()) {
            bail!("--phi must be finite, got {phi}");
        }
        Ok(RungConfig {
            attention: AttentionOptions {
                causal,
                scale: self.scale,
                window: self.window.unwrap_or_default(),
                ..Default::default()
            },
            tiles: TileSizes::new(self.br, self.bc)?,
            splits: self.splits,
            phi: self.phi.map_or(defaults.phi, Phi::Given),
            fp8: self.fp8_options(),
        })
    }

    /// The FP8 path's options: the defaults, less incoherent processing with `--no-incoherent`.
    fn fp8_options(&self) -> ladder_reference::Fp8Options {
        let defaults = RungConfig::default().fp8;
        ladder_reference::Fp8Options {
            incoherent: if self.no_incoherent { None } else { defaults.incoherent },
            ..defaults
        }
    }
}

#[derive(Args)]
struct VerifyArgs {
    /// Batch size (any shape flag replaces the two default problems by one custom problem).
    #[arg(long)]
    batch: Option<usize>,
    /// Query heads.
    #[arg(long)]
    heads_q: Option<usize>,
    /// Key/value heads (heads_q must be a multiple).
    #[arg(long)]
    heads_kv: Option<usize>,
    /// Query length.
    #[arg(long)]
    n_q: Option<usize>,
    /// Key/value length.
    #[arg(long)]
    n_kv: Option<usize>,
    /// Head dim.
    #[arg(long)]
    d: Option<usize>,
    /// Causal masking, bottom-right aligned (the default).
    #[arg(long, overrides_with = "no_causal")]
    causal: bool,
    /// No mask.
    #[arg(long)]
    no_causal: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    rung: RungArgs,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Verify(args) => match verify_cmd(&args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => fail(e),
        },
        Command::Run(args) => run::main(&args),
        Command::Bench(args) => bench::main(&args),
    }
}

fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("error: {e:#}");
    ExitCode::from(2)
}

fn verify_cmd(args: &VerifyArgs) -> anyhow::Result<bool> {
    if let Some(m) = args.rung.score_mod {
        bail!(
            "--score-mod {m}: `ladder verify` checks the plain problems; `ladder run --score-mod` \
             runs a modifier, and the test suite checks every rung with them"
        );
    }
    if let Some(m) = args.rung.mask_mod {
        bail!(
            "--mask-mod {m}: `ladder verify` checks the plain problems; `ladder run --mask-mod` \
             runs a mask modifier, and the test suite checks every rung with them"
        );
    }
    let config = args.rung.config(!args.no_causal)?;
    let shape_flags = [args.batch, args.heads_q, args.heads_kv, args.n_q, args.n_kv, args.d];
    let cases = if shape_flags.iter().any(Option::is_some) {
        let base = VerifyCase::prefill().shape;
        let shape = AttentionShape::new(
            args.batch.unwrap_or(base.batch),
            args.heads_q.unwrap_or(base.heads_q),
            args.heads_kv.unwrap_or(base.heads_kv),
            args.n_q.unwrap_or(base.n_q),
            args.n_kv.unwrap_or(base.n_kv),
            args.d.unwrap_or(base.d),
        )?;
        vec![VerifyCase { name: "custom".into(), shape }]
    } else {
        vec![VerifyCase::prefill(), VerifyCase::decode()]
    };
    for case in &cases {
        let s = case.shape;
        eprintln!(
            "verify: {} — batch {}, heads {}/{}, n_q {}, n_kv {}, d {}, {}",
            case.name,
            s.batch,
            s.heads_q,
            s.heads_kv,
            s.n_q,
            s.n_kv,
            s.d,
            if config.attention.causal { "causal" } else { "no mask" }
        );
    }
    let total = 2 * cases.len() * (Rung::ALL.len() + 2);
    let mut done = 0;
    let rows = verify::run(&cases, &config, args.seed, |precision, row| {
        done += 1;
        let extra = row.extra_bytes.map_or("n/a".into(), human_bytes);
        eprintln!(
            "  [{done:>2}/{total}] {:<8} {:<18} {precision} {:>10.1} ms  extra {extra:>10}  err/tol {:.1e}",
            row.case,
            row.label,
            row.elapsed.as_secs_f64() * 1e3,
            row.err_over_tol
        );
    })?;
    // The GPU rungs, when a GPU is there.
    let mut rows = rows;
    match ladder_compare::gpu_check::open_gpu() {
        Ok(gpu) => {
            eprintln!("verify: GPU rungs on {} ({}), fp16", gpu.name(), gpu.arch());
            let gpu_rows = verify::gpu_rows(&gpu, &cases, &config, args.seed, |precision, row| {
                eprintln!(
                    "  [gpu] {:<8} {:<12} {precision} {:>10.3} ms  err/tol {:.1e}",
                    row.case,
                    row.label,
                    row.elapsed.as_secs_f64() * 1e3,
                    row.err_over_tol
                );
            })?;
            rows.extend(gpu_rows);
            // Say which GPU rungs had no kernel for these problems' head dims (fa1 at d = 96,
            // fa3-fp8 at a head dim that is not a multiple of 16), rather than leaving their
            // rows out silently.
            let ds: Vec<usize> = cases.iter().map(|c| c.shape.d).collect();
            for rung in ladder_compare::GpuRung::ALL {
                if rung.available_on(&gpu) && !ds.iter().any(|&d| rung.supports(d)) {
                    eprintln!(
                        "verify: {} not run: no kernel for d = {ds:?} (its head dims: {:?}; e.g. \
                         --d {})",
                        rung.label(),
                        rung.head_dims(),
                        rung.head_dims()[0]
                    );
                }
            }
        }
        Err(e) => eprintln!("verify: GPU rungs not run ({e})"),
    }
    print!("{}", verify::render(&rows));
    let failed: Vec<String> =
        rows.iter().filter(|r| !r.pass).map(|r| format!("{}/{}", r.case, r.label)).collect();
    if failed.is_empty() {
        println!("all {} rows within tolerance (err/tol ≤ 1)", rows.len());
        Ok(true)
    } else {
        println!("OUT OF TOLERANCE: {}", failed.join(", "));
        Ok(false)
    }
}
