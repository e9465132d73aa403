//! What `ladder bench` runs: its flags ([`BenchArgs`]) resolved into a [`Plan`] of GPU rungs,
//! head dims, lengths and masks, with the shapes of the FlashAttention-3 paper by default.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, ValueEnum};
use ladder_compare::GpuRung;
use ladder_compare::results::Direction;
use ladder_kernels::DType;

/// Which masks to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CausalArg {
    /// Causal and non-causal.
    Both,
    /// Causal only.
    True,
    /// Non-causal only.
    False,
}

/// Element type of Q, K, V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

/// `ladder bench` flags.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// GPU rungs to time, comma-separated (fa1, fa2) [default: all].
    #[arg(long, value_delimiter = ',')]
    pub(super) rung: Vec<String>,
    /// Directions, comma-separated [default: fwd,bwd].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(super) direction: Vec<Direction>,
    /// Head dims, comma-separated [default: 64,128].
    #[arg(long, value_delimiter = ',')]
    pub(super) d: Vec<usize>,
    /// Sequence lengths, comma-separated [default: 512,1024,2048,4096,8192,16384].
    #[arg(long, value_delimiter = ',')]
    pub(super) n: Vec<usize>,
    /// Masks: both, true (causal only) or false.
    #[arg(long, value_enum, default_value_t = CausalArg::Both)]
    pub(super) causal: CausalArg,
    /// Element type of Q, K, V.
    #[arg(long, value_enum, default_value_t = DtypeArg::Fp16)]
    pub(super) dtype: DtypeArg,
    /// Timed samples per case (median reported) [default: 30; 5 with --quick].
    #[arg(long)]
    pub(super) repeats: Option<usize>,
    /// Untimed warm-up calls per case, after the first (compiling) call [default: 5; 2 with --quick].
    #[arg(long)]
    pub(super) warmup: Option<usize>,
    /// Results folder: bench.csv, bench.json, meta.json, charts (*.svg).
    #[arg(long, default_value = "bench-results")]
    pub(super) out: PathBuf,
    /// A small subset for smoke runs: d = 128, n = 1024 and 4096, non-causal, 5 repeats (flags
    /// given explicitly still apply).
    #[arg(long)]
    pub(super) quick: bool,
    /// Only redraw the charts from OUT/bench.csv and OUT/peers.csv (if any) and print the
    /// side-by-side table; needs no GPU.
    #[arg(long)]
    pub(super) charts_only: bool,
    /// Tokens per batch: batch = tokens / n (at least 1).
    #[arg(long, default_value_t = 16384)]
    pub(super) tokens: usize,
    /// Hidden size: heads = hidden / d.
    #[arg(long, default_value_t = 2048)]
    pub(super) hidden: usize,
    /// FA1 (scalar FP32, one block per (batch, head)) runs only up to this n.
    #[arg(long, default_value_t = 2048)]
    pub(super) fa1_max_n: usize,
    /// Timed samples per FA1 case.
    #[arg(long, default_value_t = 3)]
    pub(super) fa1_repeats: usize,
    /// Stop sampling a case once its timed samples add up to this many seconds.
    #[arg(long, default_value_t = 3.0)]
    pub(super) case_budget_s: f64,
}

/// The resolved flags.
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) rungs: Vec<&'static str>,
    pub(super) directions: Vec<Direction>,
    pub(super) ds: Vec<usize>,
    pub(super) ns: Vec<usize>,
    pub(super) causals: Vec<bool>,
    pub(super) dtype: DType,
    pub(super) repeats: usize,
    pub(super) warmup: usize,
    pub(super) tokens: usize,
    pub(super) hidden: usize,
    pub(super) fa1_max_n: usize,
    pub(super) fa1_repeats: usize,
    pub(super) budget_ms: f64,
}

impl Plan {
    pub(super) fn from_args(a: &BenchArgs) -> anyhow::Result<Plan> {
        let known = GpuRung::names();
        let rungs = if a.rung.is_empty() {
            known.clone()
        } else {
            let mut rungs = Vec::new();
            for name in &a.rung {
                let Some(&r) = known.iter().find(|k| **k == name.trim()) else {
                    bail!("--rung {name}: no such GPU rung (known: {})", known.join(", "));
                };
                rungs.push(r);
            }
            rungs
        };
        let or = |given: &[usize], full: &[usize], quick: &[usize]| -> Vec<usize> {
            if !given.is_empty() {
                given.to_vec()
            } else if a.quick {
                quick.to_vec()
            } else {
                full.to_vec()
            }
        };
        let ds = or(&a.d, &[64, 128], &[128]);
        let ns = or(&a.n, &[512, 1024, 2048, 4096, 8192, 16384], &[1024, 4096]);
        let directions = if a.direction.is_empty() {
            vec![Direction::Fwd, Direction::Bwd]
        } else {
            a.direction.clone()
        };
        let causals = match (a.causal, a.quick) {
            (CausalArg::True, _) => vec![true],
            (CausalArg::False, _) | (CausalArg::Both, true) => vec![false],
            (CausalArg::Both, false) => vec![false, true],
        };
        if a.hidden == 0 || a.tokens == 0 {
            bail!("--hidden and --tokens must be positive");
        }
        for &d in &ds {
            if d == 0 || a.hidden % d != 0 {
                bail!("--d {d}: the hidden size {} must be a multiple of d", a.hidden);
            }
        }
        if ns.contains(&0) {
            bail!("--n: lengths must be positive");
        }
        if a.case_budget_s.is_nan() || a.case_budget_s <= 0.0 {
            bail!("--case-budget-s must be positive");
        }
        Ok(Plan {
            rungs,
            directions,
            ds,
            ns,
            causals,
            dtype: match a.dtype {
                DtypeArg::Fp16 => DType::F16,
                DtypeArg::Bf16 => DType::BF16,
            },
            repeats: a.repeats.unwrap_or(if a.quick { 5 } else { 30 }).max(1),
            warmup: a.warmup.unwrap_or(if a.quick { 2 } else { 5 }).max(1),
            tokens: a.tokens,
            hidden: a.hidden,
            fa1_max_n: a.fa1_max_n,
            fa1_repeats: a.fa1_repeats.max(1),
            budget_ms: a.case_budget_s * 1e3,
        })
    }

    /// `(batch, heads)` for head dim `d` and length `n`.
    pub(super) fn dims(&self, d: usize, n: usize) -> (usize, usize) {
        ((self.tokens / n).max(1), self.hidden / d)
    }

    /// The GPU rungs to run at length `n`, in order: by direction, then in table order.
    pub(super) fn rungs_at(&self, n: usize) -> Vec<GpuRung> {
        let mut out = Vec::new();
        for &direction in &self.directions {
            for rung in GpuRung::ALL {
                if rung.direction() == direction
                    && self.rungs.contains(&rung.name())
                    && (rung != GpuRung::Fa1 || n <= self.fa1_max_n)
                {
                    out.push(rung);
                }
            }
        }
        out
    }

    /// Timed samples per case of `rung`.
    pub(super) fn repeats_of(&self, rung: GpuRung) -> usize {
        if rung == GpuRung::Fa1 { self.fa1_repeats } else { self.repeats }
    }

    /// Untimed warm-up calls per case of `rung`, after the first.
    pub(super) fn warmup_of(&self, rung: GpuRung) -> usize {
        if rung == GpuRung::Fa1 { 1 } else { self.warmup }
    }

    pub(super) fn case_count(&self) -> usize {
        self.ds.len()
            * self.causals.len()
            * self.ns.iter().map(|&n| self.rungs_at(n).len()).sum::<usize>()
    }

    /// What the run leaves out or times differently, for the console and `meta.json`.
    pub(super) fn notes(&self) -> Vec<String> {
        let mut notes = vec![format!(
            "median of {} CUDA-event samples per case after {} warm-up calls (at most {:.1} s of \
             samples per case); inputs rotate when they fit in L2",
            self.repeats,
            self.warmup,
            self.budget_ms / 1e3
        )];
        if self.rungs.contains(&GpuRung::Fa1.name()) && self.directions.contains(&Direction::Fwd) {
            notes.push(format!(
                "fa1 (scalar FP32, one block per (batch, head)) only for n <= {} with {} samples \
                 (--fa1-max-n, --fa1-repeats)",
                self.fa1_max_n, self.fa1_repeats
            ));
        }
        let missing: Vec<String> = self
            .rungs
            .iter()
            .flat_map(|r| self.directions.iter().map(move |d| (*r, *d)))
            .filter(|(r, d)| GpuRung::find(r, *d).is_none())
            .map(|(r, d)| format!("{r} {}", d.name()))
            .collect();
        if !missing.is_empty() {
            notes.push(format!("no GPU kernel (yet) for: {}", missing.join(", ")));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn plan(args: &[&str]) -> anyhow::Result<Plan> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?;
        Plan::from_args(&cli.bench)
    }

    #[test]
    fn default_plan_is_the_fa3_paper_sweep() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.ds, [64, 128]);
        assert_eq!(p.ns, [512, 1024, 2048, 4096, 8192, 16384]);
        assert_eq!(p.causals, [false, true]);
        assert_eq!(p.directions, [Direction::Fwd, Direction::Bwd]);
        assert_eq!(p.dims(128, 16384), (1, 16));
        assert_eq!(p.dims(64, 512), (32, 32));
        // fa1 stops at 2048.
        let at = |n| p.rungs_at(n);
        let (det, atomic) = (GpuRung::Fa2BackwardDeterministic, GpuRung::Fa2Backward);
        assert_eq!(at(2048), [GpuRung::Fa1, GpuRung::Fa2, atomic, det]);
        assert_eq!(at(4096), [GpuRung::Fa2, atomic, det]);
        assert_eq!((p.repeats_of(GpuRung::Fa1), p.repeats_of(GpuRung::Fa2)), (3, 30));
        assert!(p.notes().iter().any(|n| n.contains("n <= 2048")));
    }

    #[test]
    fn flags_narrow_the_plan() {
        let p = plan(&[
            "--rung",
            "fa2",
            "--d",
            "64",
            "--n",
            "512,1024",
            "--causal",
            "true",
            "--direction",
            "fwd",
            "--dtype",
            "bf16",
            "--repeats",
            "7",
        ])
        .unwrap();
        assert_eq!(
            (p.rungs.as_slice(), p.ds.as_slice(), p.ns.as_slice()),
            (&["fa2"][..], &[64][..], &[512, 1024][..])
        );
        assert_eq!((p.causals.as_slice(), p.dtype, p.repeats), (&[true][..], DType::BF16, 7));
        assert_eq!(p.case_count(), 2);
        let q = plan(&["--quick"]).unwrap();
        assert_eq!(
            (q.ds.as_slice(), q.ns.as_slice(), q.causals.as_slice()),
            (&[128][..], &[1024, 4096][..], &[false][..])
        );
        assert_eq!(q.repeats, 5);
        assert!(plan(&["--rung", "fa9"]).unwrap_err().to_string().contains("known: fa1, fa2"));
        assert!(plan(&["--d", "96"]).is_err(), "2048 is not a multiple of 96");
        assert!(plan(&["--n", "0"]).is_err());
    }
}
