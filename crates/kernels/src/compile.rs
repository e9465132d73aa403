//! Run-time compilation of the kernel sources with NVRTC, and a disk cache of the results.
//!
//! Each rung's `.cu` file is compiled per *variant*: the head dimension, element type and tile
//! sizes are macro constants (`-DFA2_D=128 ...`), so every variant is straight-line code for the
//! compiler. NVRTC turns a variant into a cubin for the exact device (`sm_90a` on Hopper) and its
//! log carries ptxas's register / shared-memory / spill report. Cubins are cached on disk under a
//! key made of the source, its headers, the options, the architecture and NVRTC's version, so only
//! the first run of a process on a machine pays the compile.

use std::ffi::{CString, c_char, c_int};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::error::{KernelError, Result};

/// The headers the kernels `#include` (name as written in `#include "..."`, text), handed to
/// NVRTC with every program: NVRTC has no include path here, so these are all a kernel can
/// include (none of CUDA's own headers are needed).
pub const HEADERS: &[(&str, &str)] = &[
    ("types.cuh", include_str!("../cuda/types.cuh")),
    ("copy.cuh", include_str!("../cuda/copy.cuh")),
    ("layout.cuh", include_str!("../cuda/layout.cuh")),
    ("mma.cuh", include_str!("../cuda/mma.cuh")),
    ("softmax.cuh", include_str!("../cuda/softmax.cuh")),
    ("mask.cuh", include_str!("../cuda/mask.cuh")),
    ("combine.cuh", include_str!("../cuda/combine.cuh")),
    ("decode.cuh", include_str!("../cuda/decode.cuh")),
    ("kv_cache.cuh", include_str!("../cuda/kv_cache.cuh")),
    ("barrier.cuh", include_str!("../cuda/barrier.cuh")),
    ("tma.cuh", include_str!("../cuda/tma.cuh")),
    ("wgmma.cuh", include_str!("../cuda/wgmma.cuh")),
    ("wgmma_ops.cuh", include_str!("../cuda/wgmma_ops.cuh")),
    ("fp8.cuh", include_str!("../cuda/fp8.cuh")),
    ("pdl.cuh", include_str!("../cuda/pdl.cuh")),
    ("varlen.cuh", include_str!("../cuda/varlen.cuh")),
    ("backward.cuh", include_str!("../cuda/backward.cuh")),
    ("score_mod.cuh", include_str!("../cuda/score_mod.cuh")),
    ("mask_mod.cuh", include_str!("../cuda/mask_mod.cuh")),
];

/// The header a variant compiled with a score modifier includes (`cuda/score_mod.cuh` includes it
/// under `LADDER_SCORE_MOD`): generated from the modifier ([`crate::ScoreMod`]).
pub const SCORE_MOD_HEADER: &str = "score_mod_body.cuh";

/// The header a variant compiled with a mask modifier includes (`cuda/mask_mod.cuh` includes it
/// under `LADDER_MASK_MOD`): generated from the modifier ([`crate::MaskMod`]).
pub const MASK_MOD_HEADER: &str = "mask_mod_body.cuh";

/// The crate's kernel files, by stem (the `.cu` file under `cuda/`), with their text.
const SOURCES: [(&str, &str); 10] = [
    ("fa1", crate::fa1::SRC),
    ("fa2_forward", crate::fa2::FORWARD_SRC),
    ("fa2_backward", crate::fa2::BACKWARD_SRC),
    ("fa3_forward", crate::fa3::SRC),
    ("fa3_backward", crate::fa3::backward::SRC),
    ("fa3_fp8_quantize", crate::fa3::fp8::QUANTIZE_SRC),
    ("flash_decoding", crate::decode::SRC),
    ("flash_decoding_pp", crate::decode::PP_SRC),
    ("block_mask", crate::mask_mod::BLOCK_MASK_SRC),
    ("ring", crate::ring::SRC),
];

/// Every kernel file of the crate, by stem (the `.cu` file under `cuda/`): what
/// [`crate::GpuConfig::kernel_source`] may replace.
pub const KERNEL_FILES: &[&str] = &{
    let mut files = [""; SOURCES.len()];
    let mut i = 0;
    while i < files.len() {
        files[i] = SOURCES[i].0;
        i += 1;
    }
    files
};

/// The crate's own source of the kernel file `file` (one of [`KERNEL_FILES`]), e.g. to edit it
/// and compile the edit with [`crate::GpuConfig::kernel_source`].
pub fn kernel_source(file: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(f, _)| *f == file).map(|(_, text)| *text)
}

/// One compilable kernel: a rung's source plus the macro constants that pick the variant.
///
/// Equality and hashing use the file stem and the definitions only: each stem names one source,
/// and hashing the source text (kilobytes) on every launch's function lookup would cost several
/// microseconds per call. The disk cache's key does include the full text.
#[derive(Clone, Debug)]
pub struct Variant {
    /// File stem of the source, e.g. `fa2_forward`; also the name of its `extern "C"` entry points.
    pub file: &'static str,
    /// The `.cu` source; it includes what it needs from [`HEADERS`].
    pub source: &'static str,
    /// `-D` definitions, in order.
    pub defines: Vec<(&'static str, String)>,
    /// Headers generated for this variant, by name: a score modifier's ([`SCORE_MOD_HEADER`]) and
    /// a mask modifier's ([`MASK_MOD_HEADER`]). A variant with one also defines its macro
    /// (`LADDER_SCORE_MOD`, `LADDER_MASK_MOD`) as the header's hash, which equality and hashing
    /// see.
    pub generated: Vec<(&'static str, std::sync::Arc<str>)>,
}

impl PartialEq for Variant {
    fn eq(&self, other: &Variant) -> bool {
        (self.file, &self.defines) == (other.file, &other.defines)
    }
}

impl Eq for Variant {}

impl Hash for Variant {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.file, &self.defines).hash(state);
    }
}

impl Variant {
    /// The variant of `file` (its `source`) with `defines`, nothing generated.
    pub fn new(
        file: &'static str,
        source: &'static str,
        defines: Vec<(&'static str, String)>,
    ) -> Variant {
        Variant { file, source, defines, generated: Vec::new() }
    }

    /// This variant with the score modifier `m` compiled in.
    pub fn with_score_mod(mut self, m: Option<&crate::ScoreMod>) -> Variant {
        if let Some(m) = m {
            let generated = m.generated();
            self.defines.push(("LADDER_SCORE_MOD", generated.key.clone()));
            self.generated.push((SCORE_MOD_HEADER, generated.header.clone()));
        }
        self
    }

    /// This variant with the mask modifier `m` compiled in.
    pub fn with_mask_mod(mut self, m: Option<&crate::MaskMod>) -> Variant {
        if let Some(m) = m {
            let generated = m.generated();
            self.defines.push(("LADDER_MASK_MOD", generated.key.clone()));
            self.generated.push((MASK_MOD_HEADER, generated.header.clone()));
        }
        self
    }

    /// The headers NVRTC gets for this variant: [`HEADERS`], and the generated ones.
    fn headers(&self) -> Vec<(&str, &str)> {
        let mut headers = HEADERS.to_vec();
        headers.extend(self.generated.iter().map(|(name, text)| (*name, &**text)));
        headers
    }

    /// A readable name for logs and errors: `fa2_forward(FA2_D=128, LADDER_DTYPE=0)`.
    pub fn label(&self) -> String {
        let defs: Vec<String> = self.defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{}({})", self.file, defs.join(", "))
    }

    fn options(&self, arch: &str, extra: &[String]) -> Vec<String> {
        let mut opts = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_string(),
            "--use_fast_math".to_string(),
            "--ptxas-options=-v".to_string(),
        ];
        opts.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        // Extra options (e.g. `-lineinfo`) come last, so that an experiment's `-D` wins.
        opts.extend(extra.iter().cloned());
        opts
    }
}

/// A compiled variant: the cubin and NVRTC's log (with ptxas's resource report).
#[derive(Clone, Debug)]
pub struct Compiled {
    /// Machine code for the architecture it was compiled for.
    pub cubin: Vec<u8>,
    /// NVRTC's log; `ptxas info` lines give registers, shared memory and spills.
    pub log: String,
    /// Whether it came from the disk cache (printed by the compile check).
    #[cfg_attr(not(test), allow(dead_code))]
    pub cached: bool,
}

/// How variants are compiled: extra NVRTC options and the disk cache's folder (none: no cache).
#[derive(Clone, Debug, Default)]
pub struct CompileSettings {
    /// Options appended to every compile; part of the cache key.
    pub extra_options: Vec<String>,
    /// The cache folder.
    pub cache_dir: Option<PathBuf>,
}

/// Compile `variant` for `arch` (`sm_90a`, `sm_80`, ...), through the disk cache.
#[cfg(test)]
pub fn compile(variant: &Variant, arch: &str, settings: &CompileSettings) -> Result<Compiled> {
    compile_source(variant, variant.source, arch, settings)
}

/// [`compile`] with `source` in place of the variant's own text (an edited kernel: the same
/// file, entry points and macro constants), through the same disk cache, whose key hashes the
/// text. A compile error names the variant as edited.
pub fn compile_source(
    variant: &Variant,
    source: &str,
    arch: &str,
    settings: &CompileSettings,
) -> Result<Compiled> {
    let edited = !std::ptr::eq(source, variant.source);
    compile_text(variant, source, arch, settings).map_err(|e| match e {
        KernelError::Compile { kernel, log } if edited => {
            KernelError::Compile { kernel: format!("{kernel}, edited source"), log }
        }
        e => e,
    })
}

fn compile_text(
    variant: &Variant,
    source: &str,
    arch: &str,
    settings: &CompileSettings,
) -> Result<Compiled> {
    let version = nvrtc_version(variant)?;
    let options = variant.options(arch, &settings.extra_options);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (source, variant.headers(), &options, version).hash(&mut hasher);
    let key = format!("{}-{arch}-{:016x}", variant.file, hasher.finish());
    let dir = &settings.cache_dir;
    if let Some(dir) = &dir {
        if let (Ok(cubin), Ok(log)) = (
            std::fs::read(dir.join(format!("{key}.cubin"))),
            std::fs::read_to_string(dir.join(format!("{key}.log"))),
        ) {
            // A log without ptxas's report (written by a version that let NVRTC compile
            // concurrently, see compile_uncached) is compiled again, so the compile check always
            // has the report.
            if log.contains("ptxas info") {
                return Ok(Compiled { cubin, log, cached: true });
            }
        }
    }
    let compiled = compile_uncached(variant, source, &options)?;
    if let Some(dir) = &dir {
        // A cache that cannot be written only costs the next run a compile. Each file is
        // written under a name of its own, then renamed into place, so that threads and processes
        // compiling the same variant at once never read or leave a half-written file; the log
        // goes first, so that whoever finds the cubin finds its log complete.
        if std::fs::create_dir_all(dir).is_ok() {
            let _ = write_atomically(&dir.join(format!("{key}.log")), compiled.log.as_bytes());
            let _ = write_atomically(&dir.join(format!("{key}.cubin")), &compiled.cubin);
        }
    }
    Ok(compiled)
}

/// Write `bytes` to a temporary file unique to this process and call, then rename it to `path`.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("{}-{n}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn load_error(variant: &Variant) -> KernelError {
    KernelError::Compile {
        kernel: variant.label(),
        log: "NVRTC (libnvrtc.so) not found: install the CUDA toolkit or put its lib folder on \
              LD_LIBRARY_PATH"
            .to_string(),
    }
}

/// NVRTC's (major, minor) version, or a clear error when the library cannot be loaded.
pub fn nvrtc_version(variant: &Variant) -> Result<(i32, i32)> {
    if !crate::nvrtc_library_present() {
        return Err(load_error(variant));
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| {
        KernelError::Compile { kernel: variant.label(), log: format!("nvrtcVersion: {e:?}") }
    })?;
    Ok((major, minor))
}

fn compile_uncached(variant: &Variant, source: &str, options: &[String]) -> Result<Compiled> {
    // One NVRTC compile at a time per process: with several in flight (two `Gpu`s of one process
    // compiling at once), one compile's log came back empty, ptxas's report lost, while its cubin
    // was fine (seen on the H200 with CUDA 13.0). The compiles are seconds, once per variant.
    static NVRTC: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = NVRTC.lock().unwrap_or_else(|p| p.into_inner());
    let fail = |log: String| KernelError::Compile { kernel: variant.label(), log };
    let cstring = |s: &str| CString::new(s).map_err(|e| fail(e.to_string()));
    let src = cstring(source)?;
    let name = cstring(&format!("{}.cu", variant.file))?;
    let headers = variant.headers();
    let header_texts = headers.iter().map(|(_, text)| cstring(text)).collect::<Result<Vec<_>>>()?;
    let header_names = headers.iter().map(|(name, _)| cstring(name)).collect::<Result<Vec<_>>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut prog = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is a NUL-terminated string alive for the call (NVRTC copies them), and
    // both arrays hold headers.len() entries.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as c_int,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: nvrtcCreateProgram succeeded, so `prog` is initialised.
    let prog = unsafe { prog.assume_init() };
    // SAFETY: `prog` was just created and is destroyed exactly once below.
    unsafe {
        let compiled = nvrtc::compile_program(prog, options);
        let log = nvrtc::get_program_log(prog).map(|l| c_chars_to_string(&l)).unwrap_or_default();
        let result = match compiled {
            Err(e) => Err(fail(format!("{e:?}\n{log}"))),
            Ok(()) => {
                let mut size = 0usize;
                let cubin = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size).result().and_then(|()| {
                    let mut buf = vec![0 as c_char; size];
                    nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr()).result().map(|()| buf)
                });
                match cubin {
                    Ok(buf) => Ok(Compiled {
                        cubin: buf.into_iter().map(|c| c as u8).collect(),
                        log,
                        cached: false,
                    }),
                    Err(e) => Err(fail(format!("nvrtcGetCUBIN: {e:?}"))),
                }
            }
        };
        let _ = nvrtc::destroy_program(prog);
        result
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How the checks below compile: the disk cache at `LADDER_KERNEL_CACHE`, and the options in
    /// `LADDER_NVRTC_OPTIONS` (split at whitespace), as on the GPU (ladder_compare::gpu_check),
    /// e.g. `-DFA3_O_SMEM=0`.
    fn settings_from_env() -> CompileSettings {
        CompileSettings {
            extra_options: std::env::var("LADDER_NVRTC_OPTIONS")
                .map(|s| s.split_whitespace().map(String::from).collect())
                .unwrap_or_default(),
            cache_dir: std::env::var_os("LADDER_KERNEL_CACHE").map(PathBuf::from),
        }
    }

    /// The instructions of `cubin` (inspect::sass) with the nvdisasm at `LADDER_NVDISASM`;
    /// `None` when it is not set.
    fn sass(cubin: &[u8]) -> Option<Vec<String>> {
        let nvdisasm = PathBuf::from(std::env::var_os("LADDER_NVDISASM")?);
        Some(crate::inspect::sass(cubin, &nvdisasm).expect("run nvdisasm (LADDER_NVDISASM)"))
    }

    /// Every sm_90a variant of the kernel file `file` with its SASS (one instruction per entry),
    /// or `None` (after saying why) where NVRTC or nvdisasm is missing and not required.
    fn sass_of(file: &str) -> Option<Vec<(Variant, Vec<String>)>> {
        let settings = settings_from_env();
        let required = std::env::var("LADDER_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        let variants = crate::variants("sm_90a").into_iter().filter(|v| v.file == file);
        let mut out = Vec::new();
        for v in variants {
            let compiled = match compile(&v, "sm_90a", &settings) {
                Ok(c) => c,
                Err(e) if !required => {
                    eprintln!("skipped: {e}");
                    return None;
                }
                Err(e) => panic!("LADDER_REQUIRE_NVRTC=1 but {e}"),
            };
            let Some(code) = sass(&compiled.cubin) else {
                assert!(!required, "LADDER_REQUIRE_NVRTC=1 needs LADDER_NVDISASM (an nvdisasm)");
                eprintln!("skipped: LADDER_NVDISASM is not set");
                return None;
            };
            out.push((v, code));
        }
        Some(out)
    }

    /// A numeric compile-time constant of `v` (0 where it is not set).
    fn define(v: &Variant, name: &str) -> usize {
        v.defines.iter().find(|(k, _)| *k == name).and_then(|(_, x)| x.parse().ok()).unwrap_or(0)
    }

    /// What the FA3 kernel is made of, checked in its machine code (NVRTC and nvdisasm, no GPU;
    /// `.ci/kernels` installs both): TMA loads (UTMALDG) and, where O goes through shared memory,
    /// TMA stores (UTMASTG); warpgroup products (HGMMA, or QGMMA in FP8); and, where the schedule
    /// overlaps the softmax with P·V (Algorithm 2), every exponential of the softmax between the
    /// wait for S = Q·Kᵀ and the wait for P·V. ptxas moves a wait within its basic block: written
    /// after the softmax, the wait for P·V once went ahead of it in every variant, and the overlap
    /// was lost without a test noticing (docs/perf-notes.md, FA3 v9).
    #[test]
    fn fa3_machine_code_overlaps_the_softmax_with_its_product() {
        let Some(disassembled) = sass_of("fa3_forward") else { return };
        let mut checked = 0;
        for (v, code) in &disassembled {
            let label = v.label();
            let has = |op: &str| code.iter().any(|i| i.contains(op));
            let product = if define(v, "FA3_FP8") == 1 { "QGMMA" } else { "HGMMA" };
            assert!(has(product), "{label}: no {product}");
            assert!(has("UTMALDG"), "{label}: no TMA load (UTMALDG)");
            if define(v, "FA3_O_SMEM") == 1 {
                assert!(has("UTMASTG"), "{label}: O through shared memory but no TMA store");
            }
            if define(v, "FA3_OVERLAP") == 1 {
                let waits_for_s: Vec<usize> =
                    (0..code.len()).filter(|&k| code[k].contains("DEPBAR.LE gsb0, 0x1")).collect();
                assert_eq!(
                    waits_for_s.len(),
                    1,
                    "{label}: expected one wait for S alone (the loop's)"
                );
                let s_landed = waits_for_s[0];
                let pv_landed = code[s_landed..]
                    .iter()
                    .position(|i| i.contains("DEPBAR.LE gsb0, 0x0"))
                    .map_or(code.len(), |k| s_landed + k);
                let under = code[s_landed..pv_landed].iter().filter(|i| i.contains("MUFU.EX2"));
                // One exponential per score of the thread (64 rows × BC keys over 128 threads),
                // and alpha's, one per row.
                let scores = define(v, "FA3_BC") / 2 + 2;
                let under = under.count();
                assert!(
                    under >= scores,
                    "{label}: {under} exponentials between the waits for S and for P·V, expected \
                     the softmax's {scores} (ptxas moved the wait for P·V ahead of the softmax?)"
                );
            }
            checked += 1;
        }
        assert!(checked > 0, "no FA3 variant");
        println!("{checked} FA3 variants: TMA, wgmma and the softmax under P·V in their SASS");
    }

    /// What FA3's backward kernel is made of, in its machine code: TMA loads of Q, K, V, dO
    /// (UTMALDG) and bulk copies of lse2 and D (UBLKCP); every product a warpgroup product issued
    /// once per query tile (HGMMA: Sᵀ and dPᵀ over d, dV and dK over the tile's 64 queries, and,
    /// unless deterministic, dQ over the block's 128 keys in the two consumers' branches, each of
    /// which issues dV and dK behind its dQ, so that those appear twice); dQ added
    /// by the copy engine (UTMAREDG) rather than by atomics; and no generic loads or stores
    /// (LD.E/ST.E): the consumers' own shared-memory accesses must be LDS/STS, which they stop
    /// being when the compiler loses track of the shared tiles' address space.
    #[test]
    fn fa3_backward_machine_code_has_its_copies_and_products() {
        let Some(disassembled) = sass_of("fa3_backward") else { return };
        let mut checked = 0;
        for (v, code) in &disassembled {
            let label = v.label();
            let count = |op: &str| code.iter().filter(|i| i.contains(op)).count();
            let deterministic = define(v, "FA3B_DETERMINISTIC") == 1;
            let dk = define(v, "FA3B_D").next_multiple_of(16);
            let dkv_copies = if deterministic { 1 } else { 2 };
            let dq = if deterministic { 0 } else { 2 * 128 / 16 };
            let products = 2 * dk / 16 + dkv_copies * 2 * 64 / 16 + dq;
            assert_eq!(count("HGMMA"), products, "{label}: HGMMA instructions");
            assert!(count("UTMALDG") > 0 && count("UBLKCP") > 0, "{label}: no TMA or bulk copy");
            assert_eq!(count("UTMAREDG") > 0, !deterministic, "{label}: dQ's TMA reduction");
            let generic = code.iter().filter(|i| {
                let op = i.split_whitespace().find(|t| !t.starts_with('@')).unwrap_or("");
                op.starts_with("LD.") || op.starts_with("ST.")
            });
            assert_eq!(generic.count(), 0, "{label}: generic loads or stores");
            checked += 1;
        }
        assert!(checked > 0, "no FA3 backward variant");
        println!("{checked} FA3 backward variants: TMA, wgmma, dQ by TMA reduction in their SASS");
    }

    /// An edited kernel compiles through the same path as the crate's (`compile_source`, what
    /// `GpuConfig::kernel_source` runs): a working edit compiles, one with a mistake is a compile
    /// error that says the source was edited and carries NVRTC's message. Needs libnvrtc, as the
    /// compile check does.
    #[test]
    fn an_edited_kernel_compiles_or_says_why() {
        let settings = settings_from_env();
        let variant = crate::fa2::variants("sm_80").into_iter().next().expect("an FA2 variant");
        let original = crate::kernel_source(variant.file).expect("its source");
        let edited = format!("{original}\n// an edit\n");
        match compile_source(&variant, &edited, "sm_80", &settings) {
            Ok(c) => assert!(c.log.contains("ptxas info"), "{}", c.log),
            Err(e) if std::env::var("LADDER_REQUIRE_NVRTC").is_ok_and(|v| v == "1") => {
                panic!("LADDER_REQUIRE_NVRTC=1 but {e}")
            }
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        }
        let broken = original.replacen("extern \"C\"", "extern \"C\" this_is_not_cuda", 1);
        let err = compile_source(&variant, &broken, "sm_80", &settings).unwrap_err().to_string();
        assert!(err.contains("edited source") && err.contains("this_is_not_cuda"), "{err}");
    }

    /// Every kernel variant compiles with NVRTC for Hopper (sm_90a) and Ampere (sm_80), and
    /// ptxas's report is printed; the tensor-core (FA2, FlashDecoding) kernels must not spill. Needs libnvrtc,
    /// no GPU: skipped without it unless `LADDER_REQUIRE_NVRTC=1` (as `.ci/kernels` sets).
    /// `LADDER_COMPILE_FILTER=fa2_forward` narrows it to matching variants; `LADDER_KERNEL_CACHE`
    /// names the cache folder (`.ci/kernels` gives it an empty one, so everything compiles);
    /// `LADDER_NVRTC_OPTIONS` adds options, split at whitespace.
    #[test]
    fn every_kernel_compiles_without_spills() {
        let filter = std::env::var("LADDER_COMPILE_FILTER").unwrap_or_default();
        let settings = settings_from_env();
        let variants = |arch: &str| -> Vec<Variant> {
            crate::variants(arch).into_iter().filter(|v| v.label().contains(&filter)).collect()
        };
        let Some(first) = variants("sm_90a").into_iter().next() else {
            panic!("no kernel variant's label contains LADDER_COMPILE_FILTER={filter:?}");
        };
        if let Err(e) = nvrtc_version(&first) {
            if std::env::var("LADDER_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("LADDER_REQUIRE_NVRTC=1 but {e}");
            }
            eprintln!("skipped: {e}");
            return;
        }
        let mut failures = Vec::new();
        for arch in ["sm_90a", "sm_80"] {
            for v in &variants(arch) {
                let compiled = match compile(v, arch, &settings) {
                    Ok(c) => c,
                    Err(e) => {
                        failures.push(format!("{arch} {}: {e}", v.label()));
                        continue;
                    }
                };
                // ptxas's notes matter on Hopper: "Potential Performance Loss: wgmma ... serialized"
                // (C7510-C7515) or an ignored setmaxnreg (C7508) mean the kernel silently lost its
                // asynchrony.
                let notable = |l: &&str| l.contains("arning") || l.contains("Performance Loss");
                for line in compiled.log.lines().filter(notable) {
                    println!("{arch:7} {}: {line}", v.label());
                    if line.contains("wgmma") || line.contains("setmaxnreg") {
                        failures.push(format!("{arch} {}: {line}", v.label()));
                    }
                }
                let reports = crate::inspect::Resources::parse(&compiled.log);
                if reports.is_empty() {
                    failures.push(format!("{arch} {}: no ptxas report in the log", v.label()));
                }
                for r in reports {
                    let entry = &r.entry;
                    let defines: Vec<String> =
                        v.defines.iter().map(|(k, x)| format!("{k}={x}")).collect();
                    println!(
                        "{arch:7} {entry:20} {:70} regs {:3}  spill {:5} B  stack {:5} B  smem {:5} B{}",
                        defines.join(" "),
                        r.registers,
                        r.spill_bytes,
                        r.stack_bytes,
                        r.static_smem,
                        if compiled.cached { " (cached)" } else { "" }
                    );
                    // The tensor-core kernels (FA2, FlashDecoding) keep everything in registers;
                    // FA1 is the scalar teaching kernel and may use local memory.
                    let tensor_core = entry.starts_with("fa2_")
                        || entry.starts_with("fa3_")
                        || entry.starts_with("flash_decoding");
                    if tensor_core && r.spill_bytes > 0 {
                        failures.push(format!(
                            "{arch} {} {entry} spills {} bytes",
                            v.label(),
                            r.spill_bytes
                        ));
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
