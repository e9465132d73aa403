//! Compile a kernel without running it: what the compiler made of it, on a machine with no GPU.
//!
//! A rung compiles its kernel when a call first needs it. [`Target::compile`] runs the same
//! compile ahead of time, for the variant the rung would launch at a head dimension, element type
//! and mask, from the crate's source or from the text a [`GpuConfig::kernel_source`] gives it. It
//! needs NVRTC (`libnvrtc.so`, e.g. from the `nvidia-cuda-nvrtc` wheel), not a GPU or a driver,
//! and reports ptxas's registers, spills and stack for each entry point ([`Build::resources`]);
//! with an `nvdisasm` (the `nvidia-cuda-nvdisasm` wheel) it also lists the machine code and
//! counts its instructions ([`Build::instruction_mix`]): `HGMMA` for a warpgroup product,
//! `UTMALDG` for a TMA load, `MUFU.EX2` for an exponential.
//!
//! ```no_run
//! use ladder_kernels::{DType, GpuConfig, inspect::Target, kernel_source};
//!
//! // FA3's forward with the accumulator's rescale taken out (a wrong kernel, but one that compiles)
//! let original = kernel_source("fa3_forward").expect("a kernel file");
//! let edited = original.replace("if (__any_sync(0xffffffff, moved)) rescale(o, alpha);", "");
//! let config = GpuConfig::new().kernel_source("fa3_forward", edited)?;
//! let build = Target::new("fa3_forward", 128, DType::F16).causal(true).compile(&config)?;
//! println!("{}", build.summary());
//! let mix = build.instruction_mix(std::path::Path::new("nvdisasm"))?;
//! println!("{} wgmma, {} TMA loads", mix.count("HGMMA"), mix.count("UTMALDG"));
//! # Ok::<(), ladder_kernels::KernelError>(())
//! ```

use std::path::Path;

use crate::compile::{self, Compiled, Variant};
use crate::error::{KernelError, Result};
use crate::problem::Masking;
use crate::{DType, GpuConfig, fa2, fa3};

/// The kernel files [`Target`] can compile.
pub const FILES: &[&str] = &["fa2_forward", "fa3_forward"];

/// Which variant to compile: a kernel file and the problem it would be launched for.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    file: String,
    d: usize,
    dtype: DType,
    causal: bool,
    arch: String,
    score_mod: Option<crate::ScoreMod>,
}

impl Target {
    /// The variant of `file` (one of [`FILES`]) for head dimension `d` and element type `dtype`,
    /// without a mask, for Hopper (`sm_90a`).
    pub fn new(file: &str, d: usize, dtype: DType) -> Target {
        let (file, arch) = (file.to_string(), fa3::ARCH.to_string());
        Target { file, d, dtype, causal: false, arch, score_mod: None }
    }

    /// With the causal mask compiled in.
    pub fn causal(self, causal: bool) -> Target {
        Target { causal, ..self }
    }

    /// For another architecture (`sm_80`, ...; FA3 needs `sm_90a`).
    pub fn arch(self, arch: &str) -> Target {
        Target { arch: arch.to_string(), ..self }
    }

    /// With a score modifier compiled in, on the tiles the rung takes under one.
    pub fn score_mod(self, score_mod: crate::ScoreMod) -> Target {
        Target { score_mod: Some(score_mod), ..self }
    }

    /// The variant the rung launches for this target with `config`'s tiles (its
    /// `GpuConfig::tune` where one is set, the rung's own otherwise). FA2 with the dense
    /// `[batch, heads, n, d]` strides, FA3 with the tiles of long problems.
    fn variant(&self, config: &GpuConfig) -> Result<Variant> {
        let (d, dtype) = (self.d, self.dtype);
        let mask = Masking { causal: self.causal, windowed: false };
        match self.file.as_str() {
            "fa2_forward" => {
                if !fa2::HEAD_DIMS.contains(&d) {
                    let supported = fa2::HEAD_DIMS;
                    return Err(KernelError::UnsupportedHeadDim { rung: "fa2", d, supported });
                }
                let mut tiles = fa2::ForwardTiles::for_config(config, d, &self.arch)?;
                if self.score_mod.is_some() && config.tuned::<fa2::ForwardTiles>().is_none() {
                    tiles = tiles.with_score_mod();
                }
                let rows = [d as i64; 4];
                Ok(fa2::forward_variant(d, dtype, mask, tiles, rows, false, false)
                    .with_score_mod(self.score_mod.as_ref()))
            }
            "fa3_forward" => {
                if self.arch != fa3::ARCH {
                    return Err(KernelError::Config(format!(
                        "fa3_forward compiles for {} only (wgmma, TMA, setmaxnreg), not {}",
                        fa3::ARCH,
                        self.arch
                    )));
                }
                if !fa3::HEAD_DIMS.contains(&d) {
                    let supported = fa3::HEAD_DIMS;
                    return Err(KernelError::UnsupportedHeadDim { rung: "fa3", d, supported });
                }
                // The tiles of long problems (the short ones' are for at most SHORT_KEYS keys).
                let mut tiles = fa3::Fa3Tiles::for_config(config, d, self.causal, usize::MAX)?;
                if self.score_mod.is_some() {
                    tiles = tiles.with_score_mod();
                }
                let schedule = fa3::Schedule::for_config(config, d, false);
                Ok(fa3::variant(d, dtype, mask, (tiles, schedule), false, false)
                    .with_score_mod(self.score_mod.as_ref()))
            }
            other => Err(KernelError::Config(format!(
                "inspect: cannot compile {other:?} (the files it compiles: {})",
                FILES.join(", ")
            ))),
        }
    }

    /// Compile the variant with `config`'s source for the file (edited or the crate's), NVRTC
    /// options and kernel cache. A compile error carries NVRTC's log, and names the source as
    /// edited where it was.
    pub fn compile(&self, config: &GpuConfig) -> Result<Build> {
        let variant = self.variant(config)?;
        let source = config.kernel_source_of(variant.file).unwrap_or(variant.source);
        let edited = !std::ptr::eq(source, variant.source);
        let Compiled { cubin, log, .. } =
            compile::compile_source(&variant, source, &self.arch, &config.compile_settings())?;
        let resources = Resources::parse(&log);
        Ok(Build { label: variant.label(), arch: self.arch.clone(), edited, log, resources, cubin })
    }
}

/// A compiled kernel variant.
#[derive(Clone)]
pub struct Build {
    /// The variant: its file and macro constants.
    pub label: String,
    /// The architecture it was compiled for.
    pub arch: String,
    /// Whether it was compiled from edited text.
    pub edited: bool,
    /// NVRTC's log (ptxas's report and any warnings).
    pub log: String,
    /// ptxas's figures for each entry point, in the log's order.
    pub resources: Vec<Resources>,
    /// The machine code.
    pub cubin: Vec<u8>,
}

impl std::fmt::Debug for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Build")
            .field("label", &self.label)
            .field("arch", &self.arch)
            .field("edited", &self.edited)
            .field("resources", &self.resources)
            .field("cubin", &format_args!("<{} bytes>", self.cubin.len()))
            .finish()
    }
}

/// ptxas's figures for one entry point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    /// The entry point (`fa3_forward`).
    pub entry: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled to local memory by stores plus loads.
    pub spill_bytes: u32,
    /// Stack frame bytes.
    pub stack_bytes: u32,
    /// Static shared memory bytes (dynamic shared memory is set at launch).
    pub static_smem: u32,
}

impl Resources {
    /// The `ptxas info` lines of an NVRTC log: one report per entry point, in order.
    pub fn parse(log: &str) -> Vec<Resources> {
        let mut reports: Vec<Resources> = Vec::new();
        let number_before = |line: &str, unit: &str| -> Option<u32> {
            let idx = line.find(unit)?;
            line[..idx].split_whitespace().last()?.parse().ok()
        };
        for line in log.lines() {
            if let Some(rest) = line.split("Function properties for ").nth(1) {
                reports.push(Resources { entry: rest.trim().to_string(), ..Resources::default() });
            }
            let Some(r) = reports.last_mut() else { continue };
            if line.contains("bytes stack frame") {
                r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_bytes = number_before(line, "bytes spill stores").unwrap_or(0)
                    + number_before(line, "bytes spill loads").unwrap_or(0);
            }
            if line.contains("Used") && line.contains("registers") {
                r.registers = number_before(line, "registers").unwrap_or(0);
                r.static_smem = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
        reports
    }
}

impl Build {
    /// One line per entry point: registers, spills, stack.
    pub fn summary(&self) -> String {
        let source = if self.edited { "edited source" } else { "the crate's source" };
        let mut out = format!("{} for {} ({source})", self.label, self.arch);
        for r in &self.resources {
            out.push_str(&format!(
                "\n  {}: {} registers, {} bytes spilled, {} bytes stack",
                r.entry, r.registers, r.spill_bytes, r.stack_bytes
            ));
        }
        out
    }

    /// The machine code, one instruction per line (opcode and operands, without addresses),
    /// disassembled by the `nvdisasm` at `nvdisasm`.
    pub fn sass(&self, nvdisasm: &Path) -> Result<Vec<String>> {
        sass(&self.cubin, nvdisasm)
    }

    /// How many times each opcode (with its modifiers: `MUFU.EX2`, `HGMMA.64x128x16.F32`) occurs
    /// in the machine code.
    pub fn instruction_mix(&self, nvdisasm: &Path) -> Result<InstructionMix> {
        Ok(InstructionMix::of(&self.sass(nvdisasm)?))
    }
}

/// Opcodes and how often each occurs in a kernel's machine code, most frequent first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstructionMix(pub Vec<(String, usize)>);

impl InstructionMix {
    /// The counts of the instructions `code` (as [`Build::sass`] lists them).
    pub fn of(code: &[String]) -> InstructionMix {
        let mut counts: Vec<(String, usize)> = Vec::new();
        for instruction in code {
            // A predicate (`@P0`, `@!PT`) comes before the opcode.
            let Some(op) = instruction.split_whitespace().find(|t| !t.starts_with('@')) else {
                continue;
            };
            match counts.iter_mut().find(|(o, _)| o == op) {
                Some((_, n)) => *n += 1,
                None => counts.push((op.to_string(), 1)),
            }
        }
        counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        InstructionMix(counts)
    }

    /// How many instructions have an opcode starting with `prefix` (`HGMMA`, `MUFU.EX2`).
    pub fn count(&self, prefix: &str) -> usize {
        self.0.iter().filter(|(op, _)| op.starts_with(prefix)).map(|(_, n)| n).sum()
    }

    /// Every instruction counted.
    pub fn total(&self) -> usize {
        self.0.iter().map(|(_, n)| n).sum()
    }
}

/// The instructions of `cubin` as `nvdisasm -c` prints them: the text between each address
/// comment and its `;` (`@!P0 BRA `(.L_x_12)`).
pub(crate) fn sass(cubin: &[u8], nvdisasm: &Path) -> Result<Vec<String>> {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let fail =
        |why: String| KernelError::Config(format!("nvdisasm ({}): {why}", nvdisasm.display()));
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("ladder-sass-{}-{n}.cubin", std::process::id()));
    std::fs::write(&path, cubin).map_err(|e| fail(format!("writing {}: {e}", path.display())))?;
    let out = std::process::Command::new(nvdisasm).arg("-c").arg(&path).output();
    let _ = std::fs::remove_file(&path);
    let out = out.map_err(|e| fail(e.to_string()))?;
    if !out.status.success() {
        return Err(fail(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Ok(text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("/*")?.split_once("*/"))
        .filter(|(addr, _)| addr.chars().all(|c| c.is_ascii_hexdigit()))
        .map(|(_, rest)| rest.split(';').next().unwrap_or("").trim().to_string())
        .filter(|i| !i.is_empty())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_report() {
        let log = "ptxas info    : Compiling entry function 'fa2_forward' for 'sm_90a'\n\
                   ptxas info    : Function properties for fa2_forward\n    \
                   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 1 barriers, 560 bytes smem\n";
        let want = Resources {
            entry: "fa2_forward".to_string(),
            registers: 168,
            spill_bytes: 8,
            stack_bytes: 8,
            static_smem: 560,
        };
        assert_eq!(Resources::parse(log), vec![want]);
        assert!(Resources::parse("no report here").is_empty());
    }

    #[test]
    fn counts_opcodes_past_their_predicates() {
        let code: Vec<String> = [
            "@P0 MUFU.EX2 R1, R2",
            "MUFU.EX2 R3, R4",
            "HGMMA.64x128x16.F32 R0, gdesc[UR4], R0",
            "@!PT BRA `(.L_x_1)",
        ]
        .map(String::from)
        .into();
        let mix = InstructionMix::of(&code);
        assert_eq!(mix.0[0], ("MUFU.EX2".to_string(), 2));
        assert_eq!(
            (mix.count("MUFU"), mix.count("HGMMA"), mix.count("BRA"), mix.total()),
            (2, 1, 1, 4)
        );
    }

    /// With NVRTC (and nvdisasm at `LADDER_NVDISASM`; `.ci/kernels` installs both): the FA3
    /// forward compiles, ptxas reports no spill, and its machine code has warpgroup products, TMA
    /// loads and exponentials; an edit that takes the rescale out of its loop compiles to fewer
    /// multiplies. Skipped without NVRTC unless `LADDER_REQUIRE_NVRTC=1`.
    #[test]
    fn compiles_a_target_and_counts_its_instructions() {
        let required = std::env::var("LADDER_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        let cache = std::env::var_os("LADDER_KERNEL_CACHE").map(std::path::PathBuf::from);
        let base = match cache {
            Some(dir) => GpuConfig::new().kernel_cache(crate::KernelCache::Dir(dir)),
            None => GpuConfig::new().kernel_cache(crate::KernelCache::Off),
        };
        let target = Target::new("fa3_forward", 128, DType::F16).causal(true);
        let build = match target.compile(&base) {
            Ok(b) => b,
            Err(e) if !required => return eprintln!("skipped: {e}"),
            Err(e) => panic!("LADDER_REQUIRE_NVRTC=1 but {e}"),
        };
        assert!(!build.edited);
        let r = &build.resources[0];
        assert_eq!((r.entry.as_str(), r.spill_bytes), ("fa3_forward", 0), "{}", build.summary());
        assert!(r.registers > 100, "{}", build.summary());
        let rescale = "if (__any_sync(0xffffffff, moved)) rescale(o, alpha);";
        let source = crate::kernel_source("fa3_forward").expect("its source");
        assert_eq!(source.matches(rescale).count(), 2);
        let edited = base.clone().kernel_source("fa3_forward", source.replacen(rescale, "", 1));
        let edited = target.compile(&edited.expect("a kernel file")).expect("the edit compiles");
        assert!(edited.edited && edited.summary().contains("edited source"));
        let Some(nvdisasm) = std::env::var_os("LADDER_NVDISASM") else {
            assert!(!required, "LADDER_REQUIRE_NVRTC=1 needs LADDER_NVDISASM");
            return;
        };
        let mix = build.instruction_mix(Path::new(&nvdisasm)).expect("nvdisasm");
        assert!(mix.count("HGMMA") > 0 && mix.count("UTMALDG") > 0 && mix.count("MUFU.EX2") > 0);
        let without = edited.instruction_mix(Path::new(&nvdisasm)).expect("nvdisasm");
        assert!(
            without.count("FMUL") < mix.count("FMUL"),
            "{} vs {}",
            without.count("FMUL"),
            mix.count("FMUL")
        );
        // Softcap's exact tanh adds special-function operations to each score's exponential.
        let softcap = crate::ScoreMod::softcap(50.0).expect("a positive cap");
        let capped = target.clone().score_mod(softcap).compile(&base).expect("softcap compiles");
        assert!(capped.label.contains("LADDER_SCORE_MOD"), "{}", capped.label);
        assert_eq!(capped.resources[0].spill_bytes, 0, "{}", capped.summary());
        let capped = capped.instruction_mix(Path::new(&nvdisasm)).expect("nvdisasm");
        assert!(
            capped.count("MUFU") > mix.count("MUFU"),
            "softcap: {} MUFU, plain: {}",
            capped.count("MUFU"),
            mix.count("MUFU")
        );
    }

    #[test]
    fn names_what_it_cannot_compile() {
        let config = GpuConfig::new();
        let err = |t: Target| t.variant(&config).unwrap_err().to_string();
        assert!(
            err(Target::new("flash_decoding", 128, DType::F16))
                .contains("fa2_forward, fa3_forward")
        );
        assert!(err(Target::new("fa3_forward", 128, DType::F16).arch("sm_80")).contains("sm_90a"));
        assert!(err(Target::new("fa3_forward", 12, DType::F16)).contains("12"));
        assert!(err(Target::new("fa2_forward", 300, DType::F16)).contains("300"));
        let v = Target::new("fa3_forward", 128, DType::BF16).causal(true).variant(&config).unwrap();
        assert!(
            v.label().contains("FA3_CAUSAL=1") && v.label().contains("FA3_D=128"),
            "{}",
            v.label()
        );
    }
}
