//! The `ladder` binary as a user runs it.

use std::path::Path;
use std::process::Command;

use ladder_compare::npy::{self, DType};
use ladder_reference::{AttentionOptions, naive};
use ndarray::Array4;

/// The binary cargo built, or the one carried next to this test binary to the GPU machine.
fn ladder_bin() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_ladder"));
    let carried = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join("ladder")));
    std::iter::once(built.clone()).chain(carried).find(|p| p.exists()).unwrap_or(built)
}

fn ladder(args: &[&str]) -> std::process::Output {
    Command::new(ladder_bin()).args(args).output().expect("the ladder binary runs")
}

fn tensor(dims: (usize, usize, usize, usize), seed: usize) -> Array4<f64> {
    // Values exactly representable in float16, so every dtype holds the same tensor.
    Array4::from_shape_fn(dims, |(b, h, i, c)| {
        (((b + 3 * h + 5 * i + 7 * c + seed) % 17) as f64 - 8.0) / 16.0
    })
}

fn write_inputs(dir: &Path, dtype: DType, heads_q: usize) -> [String; 3] {
    let names = ["q.npy", "k.npy", "v.npy"];
    let tensors =
        [tensor((2, heads_q, 7, 8), 1), tensor((2, 2, 11, 8), 2), tensor((2, 2, 11, 8), 3)];
    for (name, t) in names.iter().zip(&tensors) {
        npy::write(&dir.join(name), t, dtype).unwrap();
    }
    names.map(|n| dir.join(n).display().to_string())
}

#[test]
fn run_writes_the_rung_output_in_the_input_dtype() {
    let dir = tempfile::tempdir().unwrap();
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F16, 2e-3), (DType::F64, 1e-12)] {
        let [q, k, v] = write_inputs(dir.path(), dtype, 4);
        let (out, lse) = (dir.path().join("o.npy"), dir.path().join("lse.npy"));
        let (out_s, lse_s) = (out.display().to_string(), lse.display().to_string());
        for rung in ["naive", "fa2", "flash-decoding-pp", "fa3-fp8"] {
            let run = ladder(&[
                "run", "--rung", rung, "--q", &q, "--k", &k, "--v", &v, "--out", &out_s, "--lse",
                &lse_s, "--causal", "--br", "3", "--bc", "4",
            ]);
            assert!(run.status.success(), "{rung}: {}", String::from_utf8_lossy(&run.stderr));
            let o = npy::read(&out).unwrap();
            assert_eq!(o.dtype, dtype);
            assert_eq!(o.data.shape(), &[2, 4, 7, 8]);
            let (lse_dtype, lse_data) = npy::read_any(&lse).unwrap();
            assert_eq!((lse_dtype, lse_data.shape()), (DType::F32, &[2, 4, 7][..]));
            let (qt, kt, vt) =
                (tensor((2, 4, 7, 8), 1), tensor((2, 2, 11, 8), 2), tensor((2, 2, 11, 8), 3));
            let reference =
                naive::attention(qt.view(), kt.view(), vt.view(), &AttentionOptions::causal())
                    .unwrap();
            let err =
                o.data.iter().zip(&reference.o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            let lse_err =
                lse_data.iter().zip(&reference.lse).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            // f16 output is rounded to f16; the FP8 path carries e4m3 error; lse is always f32.
            let allowed = if rung == "fa3-fp8" { 0.1 } else { tol };
            assert!(err < allowed, "{rung} in {dtype:?}: max error {err}");
            assert!(
                lse_err < if rung == "fa3-fp8" { 0.1 } else { 1e-5 },
                "{rung} lse error {lse_err}"
            );
        }
    }
}

#[test]
fn run_rejects_bad_inputs_with_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n).display().to_string();
    let [q, k, v] = write_inputs(dir.path(), DType::F32, 3); // 3 q heads over 2 kv heads
    npy::write(&dir.path().join("flat.npy"), &ndarray::Array2::<f64>::zeros((3, 4)), DType::F32)
        .unwrap();
    npyz::to_file_1d(dir.path().join("ints.npy"), vec![1i32, 2, 3]).unwrap();
    std::fs::write(dir.path().join("junk.npy"), b"not a npy file").unwrap();
    let out = path("o.npy");
    let [missing, flat, ints, junk] = ["missing.npy", "flat.npy", "ints.npy", "junk.npy"].map(path);
    let cases = [
        (vec!["--q", &q, "--k", &k, "--v", &v], "heads_q (3) is not a multiple of heads_kv (2)"),
        (vec!["--q", &missing, "--k", &k, "--v", &v], "missing.npy"),
        (vec!["--q", &flat, "--k", &k, "--v", &v], "expected 4 dimensions"),
        (vec!["--q", &ints, "--k", &k, "--v", &v], "is not supported"),
        (vec!["--q", &junk, "--k", &k, "--v", &v], "junk.npy"),
        (vec!["--q", &k, "--k", &k, "--v", &q], "shape mismatch"),
    ];
    for (args, message) in cases {
        let mut all = vec!["run", "--rung", "fa2", "--out", &out];
        all.extend(args);
        let run = ladder(&all);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{all:?}: {stderr}");
        assert!(stderr.starts_with("error: ") && stderr.contains(message), "{all:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    }
    let run = ladder(&[
        "run",
        "--rung",
        "flash-decoding",
        "--q",
        &q,
        "--k",
        &k,
        "--v",
        &v,
        "--out",
        &out,
        "--splits",
        "0",
    ]);
    assert_eq!(run.status.code(), Some(2));
}

#[test]
fn verify_prints_every_rung_and_passes() {
    let run = ladder(&[
        "verify",
        "--batch",
        "1",
        "--heads-q",
        "4",
        "--heads-kv",
        "2",
        "--n-q",
        "37",
        "--n-kv",
        "53",
        "--d",
        "16",
        "--br",
        "8",
        "--bc",
        "16",
        "--splits",
        "5",
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    for rung in [
        "naive",
        "online-softmax",
        "fa1",
        "fa2",
        "fa3",
        "fa3-fp8",
        "flash-decoding",
        "flash-decoding-pp",
        "naive-bwd",
        "fa2-bwd",
    ] {
        assert!(
            stdout.lines().any(|l| l.split_whitespace().nth(1) == Some(rung)),
            "{rung} missing:\n{stdout}"
        );
    }
    assert!(stdout.contains("all 10 rows within tolerance"));
    let bad = ladder(&["verify", "--heads-q", "3", "--heads-kv", "2"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a multiple"));
}
