//! Excerpts of the project's own source, for notebooks that read a kernel beside its CPU rung.
//!
//! The files are compiled into this crate (`include_str!`), so an excerpt is always the code as
//! it is in the tree the notebook runs from: when a file changes, cargo rebuilds the crate and
//! the notebook shows the new code. An excerpt is chosen by what is written in the file, never
//! by line numbers:
//!
//! - [`section`]: a kernel section, from its `// ---- title ----` marker line to the next marker
//!   (or the end of the file);
//! - [`item`]: a definition (function, struct, `impl` method) by a string on its first line, with
//!   the comments and attributes above it, down to its closing brace;
//! - [`lines`]: from the line holding one string to the next line holding another, with the
//!   comments above the first.
//!
//! A marker or string that is no longer in the file is an error that names it: a notebook cell
//! fails loudly rather than show stale code.
//!
//! [`Beside`] shows two excerpts side by side (the CPU rung on the left, the kernel on the right)
//! as an HTML table in Jupyter.

use std::fmt;

use crate::Failure;

/// The files a notebook may quote, by their path in the repository.
const FILES: &[(&str, &str)] = &[
    (
        "crates/kernels/cuda/fa2_forward.cu",
        include_str!("../../../crates/kernels/cuda/fa2_forward.cu"),
    ),
    ("crates/kernels/cuda/copy.cuh", include_str!("../../../crates/kernels/cuda/copy.cuh")),
    ("crates/kernels/cuda/mma.cuh", include_str!("../../../crates/kernels/cuda/mma.cuh")),
    ("crates/kernels/cuda/softmax.cuh", include_str!("../../../crates/kernels/cuda/softmax.cuh")),
    ("crates/kernels/cuda/mask.cuh", include_str!("../../../crates/kernels/cuda/mask.cuh")),
    ("crates/kernels/cuda/types.cuh", include_str!("../../../crates/kernels/cuda/types.cuh")),
    ("crates/kernels/cuda/layout.cuh", include_str!("../../../crates/kernels/cuda/layout.cuh")),
    (
        "crates/kernels/cuda/flash_decoding.cu",
        include_str!("../../../crates/kernels/cuda/flash_decoding.cu"),
    ),
    ("crates/kernels/cuda/decode.cuh", include_str!("../../../crates/kernels/cuda/decode.cuh")),
    (
        "crates/kernels/cuda/flash_decoding_pp.cu",
        include_str!("../../../crates/kernels/cuda/flash_decoding_pp.cu"),
    ),
    ("crates/kernels/cuda/kv_cache.cuh", include_str!("../../../crates/kernels/cuda/kv_cache.cuh")),
    (
        "crates/kernels/cuda/fa3_forward.cu",
        include_str!("../../../crates/kernels/cuda/fa3_forward.cu"),
    ),
    (
        "crates/kernels/cuda/fa3_backward.cu",
        include_str!("../../../crates/kernels/cuda/fa3_backward.cu"),
    ),
    ("crates/kernels/cuda/backward.cuh", include_str!("../../../crates/kernels/cuda/backward.cuh")),
    (
        "crates/kernels/src/fa3/backward.rs",
        include_str!("../../../crates/kernels/src/fa3/backward.rs"),
    ),
    ("crates/kernels/cuda/barrier.cuh", include_str!("../../../crates/kernels/cuda/barrier.cuh")),
    ("crates/kernels/cuda/tma.cuh", include_str!("../../../crates/kernels/cuda/tma.cuh")),
    ("crates/kernels/cuda/wgmma.cuh", include_str!("../../../crates/kernels/cuda/wgmma.cuh")),
    ("crates/kernels/src/fa3.rs", include_str!("../../../crates/kernels/src/fa3.rs")),
    ("crates/kernels/src/problem.rs", include_str!("../../../crates/kernels/src/problem.rs")),
    ("crates/reference/src/fa2.rs", include_str!("../../../crates/reference/src/fa2.rs")),
    ("crates/reference/src/fa3.rs", include_str!("../../../crates/reference/src/fa3.rs")),
    (
        "crates/reference/src/flash_decoding.rs",
        include_str!("../../../crates/reference/src/flash_decoding.rs"),
    ),
    (
        "crates/reference/src/flash_decoding_pp.rs",
        include_str!("../../../crates/reference/src/flash_decoding_pp.rs"),
    ),
    ("crates/reference/src/tile.rs", include_str!("../../../crates/reference/src/tile.rs")),
    ("crates/reference/src/problem.rs", include_str!("../../../crates/reference/src/problem.rs")),
    ("crates/reference/src/shape.rs", include_str!("../../../crates/reference/src/shape.rs")),
    (
        "scripts/triton_fused_attention.py",
        include_str!("../../../scripts/triton_fused_attention.py"),
    ),
    (
        "docs/results/ptxas/fa2_forward.txt",
        include_str!("../../../docs/results/ptxas/fa2_forward.txt"),
    ),
];

/// The whole text of `path` (one of the files this crate carries).
pub fn file(path: &str) -> Result<&'static str, Failure> {
    FILES.iter().find(|(p, _)| *p == path).map(|(_, text)| *text).ok_or_else(|| {
        let known: Vec<&str> = FILES.iter().map(|(p, _)| *p).collect();
        Failure(format!("source: no file {path:?} (known: {})", known.join(", ")))
    })
}

/// Lines `first..=last` (0-based) of a file, shown with their 1-based line numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excerpt {
    pub path: &'static str,
    /// 1-based number of the first line.
    pub first_line: usize,
    pub lines: Vec<&'static str>,
}

impl Excerpt {
    fn new(path: &'static str, all: &[&'static str], first: usize, last: usize) -> Excerpt {
        let mut lines = all[first..=last].to_vec();
        while lines.last().is_some_and(|l| l.trim().is_empty()) {
            lines.pop();
        }
        Excerpt { path, first_line: first + 1, lines }
    }

    /// The 1-based number of the last line.
    pub fn last_line(&self) -> usize {
        self.first_line + self.lines.len().saturating_sub(1)
    }

    /// The code alone, without line numbers.
    pub fn code(&self) -> String {
        self.lines.join("\n")
    }

    /// `path:first-last`.
    pub fn location(&self) -> String {
        format!("{}:{}-{}", self.path, self.first_line, self.last_line())
    }

    fn numbered(&self) -> String {
        let width = self.last_line().to_string().len();
        self.lines
            .iter()
            .enumerate()
            .map(|(i, l)| format!("{:>width$} │ {l}", self.first_line + i))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Jupyter shows a value with this method as its output: the excerpt as preformatted HTML.
    pub fn evcxr_display(&self) {
        println!("EVCXR_BEGIN_CONTENT text/html\n{}\nEVCXR_END_CONTENT", self.html());
    }

    fn html(&self) -> String {
        format!(
            "<div style=\"font-family:monospace;font-size:0.85em;color:#555\">{}</div>\
             <pre style=\"margin-top:2px\">{}</pre>",
            escape(&self.location()),
            escape(&self.numbered())
        )
    }
}

impl fmt::Display for Excerpt {
    /// `path:first-last`, then the numbered lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.location())?;
        write!(f, "{}", self.numbered())
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn split(path: &str) -> Result<(&'static str, Vec<&'static str>), Failure> {
    let text = file(path)?;
    let path = FILES.iter().find(|(p, _)| *p == path).map(|(p, _)| *p).unwrap_or_default();
    Ok((path, text.lines().collect()))
}

fn is_marker(line: &str) -> bool {
    line.trim_start().starts_with("// ----")
}

/// The section of `path` whose marker line reads `// ---- {title}…`: from the marker to the line
/// before the next marker (or the end of the file).
pub fn section(path: &str, title: &str) -> Result<Excerpt, Failure> {
    let (path, all) = split(path)?;
    let marker = format!("// ---- {title}");
    let first = all
        .iter()
        .position(|l| l.trim_start().starts_with(&marker))
        .ok_or_else(|| Failure(format!("source: no section marked {marker:?} in {path}")))?;
    let last = all[first + 1..]
        .iter()
        .position(|l| is_marker(l))
        .map_or(all.len() - 1, |offset| first + offset);
    Ok(Excerpt::new(path, &all, first, last))
}

/// The lines of comments, attributes and `template <…>` right above line `at`.
fn preamble_start(all: &[&str], at: usize) -> usize {
    let mut first = at;
    while first > 0 {
        let above = all[first - 1].trim_start();
        if above.starts_with("//") || above.starts_with("#[") || above.starts_with("template") {
            first -= 1;
        } else {
            break;
        }
    }
    first
}

fn find(path: &str, all: &[&str], from: usize, needle: &str) -> Result<usize, Failure> {
    all[from..]
        .iter()
        .position(|l| l.contains(needle))
        .map(|i| from + i)
        .ok_or_else(|| Failure(format!("source: {needle:?} is not in {path}")))
}

/// The definition whose first line holds `needle` (the first such line), with the comments above
/// it, down to the closing brace indented like that first line.
pub fn item(path: &str, needle: &str) -> Result<Excerpt, Failure> {
    let (path, all) = split(path)?;
    let at = find(path, &all, 0, needle)?;
    let indent = all[at].len() - all[at].trim_start().len();
    let closes = |l: &&str| {
        let t = l.trim_start();
        l.len() - t.len() == indent && t.starts_with('}')
    };
    let last =
        if all[at].trim_end().ends_with(';') || all[at].trim_end().ends_with('}') {
            at // a one-line definition
        } else {
            all[at..].iter().position(closes).map(|i| at + i).ok_or_else(|| {
                Failure(format!("source: no closing brace for {needle:?} in {path}"))
            })?
        };
    Ok(Excerpt::new(path, &all, preamble_start(&all, at), last))
}

/// From the first line holding `from` (with the comments above it) to the next line holding `to`.
pub fn lines(path: &str, from: &str, to: &str) -> Result<Excerpt, Failure> {
    let (path, all) = split(path)?;
    let first = find(path, &all, 0, from)?;
    let last = find(path, &all, first, to)?;
    Ok(Excerpt::new(path, &all, preamble_start(&all, first), last))
}

/// Two excerpts side by side: the CPU rung on the left, the kernel on the right.
pub struct Beside {
    pub left: Vec<Excerpt>,
    pub right: Vec<Excerpt>,
}

/// `left` beside `right` (each a list of excerpts shown one under the other).
pub fn beside(
    left: impl IntoIterator<Item = Excerpt>,
    right: impl IntoIterator<Item = Excerpt>,
) -> Beside {
    Beside { left: left.into_iter().collect(), right: right.into_iter().collect() }
}

impl Beside {
    /// Jupyter shows a value with this method as its output: a two-column table.
    pub fn evcxr_display(&self) {
        let column = |xs: &[Excerpt]| xs.iter().map(Excerpt::html).collect::<String>();
        let cell = "style=\"vertical-align:top;text-align:left;padding:0 12px 0 0\"";
        println!(
            "EVCXR_BEGIN_CONTENT text/html\n<table><tr><th {cell}>CPU rung</th><th {cell}>kernel</th></tr>\
             <tr><td {cell}>{}</td><td {cell}>{}</td></tr></table>\nEVCXR_END_CONTENT",
            column(&self.left),
            column(&self.right)
        );
    }
}

impl fmt::Display for Beside {
    /// The left excerpts, then the right ones (plain text has no room for two columns).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (title, xs) in [("CPU rung", &self.left), ("kernel", &self.right)] {
            writeln!(f, "== {title}")?;
            for x in xs {
                writeln!(f, "{x}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FA2: &str = "crates/kernels/cuda/fa2_forward.cu";

    #[test]
    fn sections_run_from_their_marker_to_the_next() {
        let s = section(FA2, "S = Q·Kᵀ").unwrap();
        assert!(s.lines[0].contains("// ---- S = Q·Kᵀ"));
        assert!(s.code().contains("mma_16x16(s[mt][2 * np]"));
        assert!(!s.code().contains("mask_columns"), "stops before the mask section");
        let all: Vec<&str> = file(FA2).unwrap().lines().collect();
        let next = all[s.last_line()..].iter().find(|l| !l.trim().is_empty()).unwrap();
        assert!(next.trim_start().starts_with("// ---- score_mod"), "{next}");
        // The last section runs to the end of the file.
        let e = section(FA2, "epilogue").unwrap();
        assert_eq!(e.last_line(), all.len());
        assert!(section(FA2, "no such section").is_err());
    }

    #[test]
    fn every_section_of_the_forward_kernel_is_found() {
        let titles = [
            "which rows",
            "per-warp state",
            "prologue",
            "the K/V walk",
            "S = Q·Kᵀ",
            "mask",
            "online softmax",
            "lazy rescale",
            "O += P·V",
            "epilogue",
        ];
        let mut previous = 0;
        for t in titles {
            let s = section(FA2, t).unwrap();
            assert!(s.first_line > previous, "{t} comes after the one before");
            previous = s.last_line();
        }
    }

    #[test]
    fn the_decoding_kernels_sections_are_found() {
        // What notebook 11 reads, in the files' order.
        let mut previous = 0;
        for t in [
            "the combine (phase 2)",
            "S = Q·K_wᵀ",
            "mask",
            "online softmax of the warp",
            "acc += P_w·V_w",
            "merge the warps'",
        ] {
            let s = section("crates/kernels/cuda/flash_decoding.cu", t).unwrap();
            assert!(s.first_line > previous, "{t} comes after the one before");
            previous = s.last_line();
        }
        for t in ["where the keys live", "which keys a split owns", "the copy of one tile"] {
            assert!(section("crates/kernels/cuda/kv_cache.cuh", t).is_ok(), "{t}");
        }
        let rows = section("crates/kernels/cuda/decode.cuh", "GQA packing").unwrap();
        assert!(rows.code().contains("struct HeadRows"), "{rows}");
        let rung = item("crates/reference/src/flash_decoding.rs", "pub fn split_ranges(").unwrap();
        assert!(rung.code().contains("s * n_kv / splits"), "{rung}");
        // And notebook 12's, of FlashDecoding++.
        const PP: &str = "crates/kernels/cuda/flash_decoding_pp.cu";
        for t in ["the unified max", "flat GEMM (FDPP_GEMV = 0)", "GEMV (FDPP_GEMV = 1)"] {
            assert!(section(PP, t).is_ok(), "{t}");
        }
        let warp = section(PP, "the flat GEMM warp").unwrap();
        assert!(warp.code().contains("struct FlatGemm"), "{warp}");
        let combine = item(PP, "bool combine_row(").unwrap();
        assert!(combine.code().contains("p.fallback[row]"), "{combine}");
        let fallback = section(PP, "the fallback, in this launch").unwrap();
        assert!(fallback.code().contains("w.restart("), "{fallback}");
    }

    #[test]
    fn the_fa3_kernels_excerpts_are_found() {
        // What notebook 13 reads.
        const K: &str = "crates/kernels/cuda/fa3_forward.cu";
        for t in ["the work: persistent blocks", "producer", "consumer"] {
            assert!(section(K, t).is_ok(), "{t}");
        }
        let entry = item(K, "extern \"C\" __global__").unwrap();
        assert!(entry.lines[0].starts_with("// Launch:"), "{entry}");
        assert!(entry.code().contains("warpgroup_reg_alloc") && entry.lines.last() == Some(&"}"));
        let attend = item(K, "void attend(").unwrap();
        assert!(attend.code().contains("land_product(o, pk, s, t, v_read, j >= 2)"), "{attend}");
        assert!(!attend.code().contains("void consumer("), "ends at its own brace");
        for needle in [
            "void land_product(",
            "void wait_turn(",
            "void pass_turn(",
            "void consumer(const",
            "Tile tile_at(const",
            "int next_tile(int",
            "void epilogue(const",
        ] {
            assert!(item(K, needle).is_ok(), "{needle}");
        }
        let state = item("crates/kernels/cuda/barrier.cuh", "struct PipelineState").unwrap();
        assert!(state.code().contains("parity()") && state.lines[0].starts_with("// A position"));
        assert!(item("crates/kernels/cuda/barrier.cuh", "void mbar_wait(").is_ok());
        assert!(item("crates/kernels/cuda/tma.cuh", "void tma_load_tile(").is_ok());
        assert!(item("crates/kernels/cuda/tma.cuh", "void tma_load_4d(").is_ok());
        const W: &str = "crates/kernels/cuda/wgmma.cuh";
        for t in ["register budget", "ordering"] {
            assert!(section(W, t).is_ok(), "{t}");
        }
        for needle in ["u64 smem_desc(", "u64 desc_k_major(", "u64 desc_n_major("] {
            assert!(item(W, needle).is_ok(), "{needle}");
        }
        let host = item("crates/kernels/src/fa3.rs", "pub(crate) fn tensor_map(spec").unwrap();
        assert!(host.code().contains("CU_TENSOR_MAP_SWIZZLE_128B"), "{host}");
        assert!(item("crates/kernels/src/fa3.rs", "fn section_heads(").is_ok());
        let rung = item("crates/reference/src/fa3.rs", "fn overlapped_rows<").unwrap();
        assert!(rung.code().contains("state.rescale(&alpha)"), "{rung}");
    }

    #[test]
    fn the_fa3_backward_excerpts_are_found() {
        // What notebook 14 reads.
        const K: &str = "crates/kernels/cuda/fa3_backward.cu";
        let producer = section(K, "producer").unwrap();
        assert!(producer.code().contains("bulk_load(t.lse2[stage]"), "{producer}");
        for needle in ["void store_ds(", "void issue_dkv(", "void issue_dq(", "void dq_then_dkv("] {
            assert!(item(K, needle).is_ok(), "{needle}");
        }
        let first =
            lines(K, "// Sᵀ = K Q_iᵀ and dPᵀ = V dO_iᵀ, issued together", "pack_p(dp, dst);");
        assert!(first.unwrap().code().contains("wgmma_wait<1>()"));
        let second = lines(K, "u16* ds = t.ds[pos.count & 1];", "mbar_arrive(&t.q_empty[stage]);");
        let second = second.unwrap();
        assert!(second.code().contains("tma_reduce_add_4d"), "{second}");
        assert!(second.code().contains("dq_then_dkv<DQ_COLS0, 0>"), "{second}");
        let shared = lines(
            "crates/kernels/cuda/backward.cuh",
            "// FA2's backward (fa2_backward.cu) is four kernels",
            "block, so the two main kernels read",
        );
        assert!(shared.is_ok());
        assert!(item("crates/kernels/src/fa3/backward.rs", "pub fn backward(").is_ok());
        assert!(item("crates/kernels/cuda/softmax.cuh", "void pack_p(").is_ok());
        assert!(item("crates/reference/src/fa2.rs", "pub fn ds_tile<").is_ok());
    }

    #[test]
    fn items_take_their_comments_and_end_at_their_brace() {
        let swz = item("crates/kernels/cuda/copy.cuh", "int swz(").unwrap();
        assert!(swz.lines[0].starts_with("// Shared-memory tiles"), "{swz}");
        assert!(swz.lines.iter().any(|l| l.starts_with("template <int COLS>")));
        assert_eq!(*swz.lines.last().unwrap(), "}");
        // A method inside an impl block ends at its own brace, not the impl's.
        let rescale = item("crates/reference/src/tile.rs", "pub fn rescale(").unwrap();
        assert!(rescale.lines[0].trim_start().starts_with("///"));
        assert_eq!(*rescale.lines.last().unwrap(), "    }");
        assert!(!rescale.code().contains("pub fn update"));
        // A one-line definition is one line (plus its comments).
        let one = item("crates/kernels/cuda/types.cuh", "float bf16_to_f32(").unwrap();
        assert_eq!(one.lines.len(), 2, "{one}");
        assert!(one.lines[0].starts_with("// bf16 is the top half"));
        assert!(item("crates/kernels/cuda/copy.cuh", "no_such_function").is_err());
    }

    #[test]
    fn lines_run_between_two_strings() {
        let t = lines("scripts/triton_fused_attention.py", "qk_scale *= 1.44269504", "qk_scale")
            .unwrap();
        assert_eq!(t.lines.len(), 1);
        assert!(t.code().contains("1.44269504"));
        let html = beside([t.clone()], [t]).left[0].html();
        assert!(html.contains("1.44269504") && !html.contains("<template"));
    }

    #[test]
    fn html_escapes_code() {
        let swz = item("crates/kernels/cuda/copy.cuh", "int swz(").unwrap();
        assert!(swz.html().contains("template &lt;int COLS&gt;"));
    }
}
