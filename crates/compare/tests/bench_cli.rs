//! `ladder bench` as a user runs it: without a GPU (CI), its charts from existing results, the
//! CSV that `scripts/peers.py` writes, and a tiny `--quick` run where a GPU is present.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ladder_compare::results::CSV_HEADER as HEADER;

/// The `ladder` binary: cargo's, or where gpu-bundle puts it when this test binary was carried to
/// another machine (it runs there from the crate folder).
fn ladder_bin() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ladder"));
    let carried = ["../../.gpu/bin/ladder", "../../target/release/ladder"].map(PathBuf::from);
    std::iter::once(built.clone()).chain(carried).find(|p| p.exists()).unwrap_or(built)
}

fn ladder(args: &[&str]) -> Output {
    Command::new(ladder_bin()).args(args).output().expect("the ladder binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn bench_without_a_gpu_exits_2_with_one_line() {
    if let Ok(gpu) = ladder_kernels::Gpu::new() {
        eprintln!("bench_without_a_gpu_exits_2_with_one_line: skipped ({} present)", gpu.name());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = ladder(&["bench", "--quick", "--out", &path(&dir.path().join("r"))]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("no CUDA device found: "), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

#[test]
fn decode_bench_without_a_gpu_exits_2_with_one_line() {
    if let Ok(gpu) = ladder_kernels::Gpu::new() {
        eprintln!("decode_bench_without_a_gpu_exits_2_with_one_line: skipped ({})", gpu.name());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for args in [&["--direction", "decode"][..], &["--rung", "flash-decoding", "--splits", "8"]] {
        let out = path(&dir.path().join("r"));
        let run = ladder(&[&["bench", "--out", &out][..], args].concat());
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("no CUDA device found: "), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    }
}

#[test]
fn bad_flags_exit_2_before_looking_for_a_gpu() {
    let run = ladder(&["bench", "--rung", "fa9"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains("no such GPU rung"), "{}", text(&run.stderr));
    for (args, message) in [
        (&["--direction", "decode", "--splits", "0"][..], "--splits must be at least 1"),
        (&["--direction", "decode", "--heads-kv", "5"], "--heads-kv 5"),
    ] {
        let run = ladder(&[&["bench"][..], args].concat());
        assert_eq!(run.status.code(), Some(2), "{args:?}");
        assert!(text(&run.stderr).contains(message), "{}", text(&run.stderr));
    }
}

fn write_results(dir: &Path) {
    let bench = format!(
        "{HEADER}\n\
         fa2,fwd,fp16,false,32,16,16,512,512,128,0.250000,274.878,\n\
         fa2,fwd,fp16,false,1,16,16,16384,16384,128,6.000000,366.504,\n\
         fa1,fwd,fp16,false,32,16,16,512,512,128,30.000000,2.291,\n"
    );
    let peers = format!(
        "{HEADER}\n\
         sdpa-flash,fwd,fp16,false,32,16,16,512,512,128,0.275000,249.889,\n\
         sdpa-flash,fwd,fp16,false,1,16,16,16384,16384,128,6.400000,343.597,\n\
         sdpa-cudnn,fwd,fp16,false,1,16,16,16384,16384,128,3.700000,594.330,\n"
    );
    std::fs::write(dir.join("bench.csv"), bench).unwrap();
    std::fs::write(dir.join("peers.csv"), peers).unwrap();
    std::fs::write(
        dir.join("meta.json"),
        r#"{"card": "NVIDIA H200", "driver": "580.95.05", "cuda": "13.0",
            "date": "2026-11-29T14:03:07Z", "torch": "2.11.0", "note": ""}"#,
    )
    .unwrap();
}

#[test]
fn charts_only_draws_rungs_and_peers_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    write_results(dir.path());
    let run = ladder(&["bench", "--charts-only", "--out", &path(dir.path())]);
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let header = stdout.lines().find(|l| l.starts_with("dir")).expect("a table header");
    let columns: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(columns[5..], ["fa1", "fa2", "sdpa-flash", "sdpa-cudnn", "fa2/sdpa-flash"]);
    let row = stdout.lines().find(|l| l.trim_end().ends_with("1.07x")).expect("16k row");
    assert!(row.contains("366.5") && row.contains("343.6") && row.contains("594.3"), "{row}");
    let svg = std::fs::read_to_string(dir.path().join("fwd-fp16-d128-noncausal.svg")).unwrap();
    for name in ["fa1", "fa2", "sdpa-flash", "sdpa-cudnn", "NVIDIA H200", "580.95.05"] {
        assert!(svg.contains(name), "{name} missing from the chart");
    }
}

#[test]
fn charts_only_draws_the_decode_rows_in_tb_per_s() {
    let dir = tempfile::tempdir().unwrap();
    write_results(dir.path());
    let mut bench = std::fs::read_to_string(dir.path().join("bench.csv")).unwrap();
    bench += "flash-decoding,decode,fp16,false,1,32,8,1,8192,128,0.010000,13.422,3.3554\n\
              flash-decoding,decode,fp16,false,1,32,8,1,131072,128,0.120000,17.896,4.4739\n\
              flash-decoding,decode,fp16,false,16,32,32,1,32768,128,1.000000,8.590,4.2950\n";
    let mut peers = std::fs::read_to_string(dir.path().join("peers.csv")).unwrap();
    peers += "sdpa-flash,decode,fp16,false,1,32,8,1,8192,128,0.020000,6.711,1.6777\n\
              sdpa-cudnn,decode,fp16,false,1,32,8,1,8192,128,0.015000,8.948,2.2369\n";
    std::fs::write(dir.path().join("bench.csv"), bench).unwrap();
    std::fs::write(dir.path().join("peers.csv"), peers).unwrap();
    let run = ladder(&["bench", "--charts-only", "--out", &path(dir.path())]);
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{}", text(&run.stderr));
    // The TFLOP/s table is as before; the decode rows have their own TB/s table.
    let header = stdout.lines().find(|l| l.starts_with("dir")).expect("a table header");
    assert!(!header.contains("flash-decoding"), "{header}");
    let decode = stdout.split("TB/s of K and V read").nth(1).expect("a decode table");
    let header = decode.lines().nth(1).unwrap();
    let columns: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(columns[6..], ["flash-decoding", "sdpa-flash", "sdpa-cudnn", "ours/sdpa-flash"]);
    let row = decode.lines().find(|l| l.contains(" 8192")).expect("the 8k row");
    assert!(row.contains("3.36") && row.contains("1.68") && row.contains("2.24"), "{row}");
    assert!(row.trim_end().ends_with("2.00x"), "{row}");
    for (file, names) in [
        ("decode-fp16-d128-b1.svg", &["flash-decoding 32/8", "sdpa-flash 32/8", "sdpa-cudnn"][..]),
        ("decode-fp16-d128-b16.svg", &["flash-decoding 32/32"]),
    ] {
        let svg = std::fs::read_to_string(dir.path().join(file)).unwrap();
        for name in names.iter().chain(&["HBM datasheet", "NVIDIA H200"]) {
            assert!(svg.contains(name), "{name} missing from {file}");
        }
        assert!(!svg.contains("measured"), "no measured bandwidth in meta.json");
    }
    // A measured read bandwidth in meta.json is a second line.
    let meta = r#"{"card": "NVIDIA H200", "hbm_read_tbps": 4.31}"#;
    std::fs::write(dir.path().join("meta.json"), meta).unwrap();
    let run = ladder(&["bench", "--charts-only", "--out", &path(dir.path())]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let svg = std::fs::read_to_string(dir.path().join("decode-fp16-d128-b1.svg")).unwrap();
    assert!(svg.contains("HBM read, measured (4.31 TB/s)"), "the measured line");
}

#[test]
fn charts_only_without_results_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let run = ladder(&["bench", "--charts-only", "--out", &path(dir.path())]);
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains("run `ladder bench` first"), "{}", text(&run.stderr));
}

/// peers.py's CSV (written by its own functions, no torch needed) is the schema `ladder bench`
/// reads, and both count FLOPs alike. Skipped where there is no python3 or no script.
#[test]
fn peers_py_writes_the_schema_ladder_reads() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/peers.py");
    let script = if script.exists() { script } else { Path::new("../../scripts/peers.py").into() };
    if !script.exists() || Command::new("python3").arg("--version").output().is_err() {
        eprintln!(
            "peers_py_writes_the_schema_ladder_reads: skipped (no python3 or scripts/peers.py)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let code = format!(
        "import sys; sys.path.insert(0, {scripts:?}); import peers\n\
         a = peers.parse_args(['--quick'])\n\
         assert (a.d, a.n, a.causals, a.repeats) == ([128], [1024, 4096], [False], 5), a\n\
         assert peers.flops('bwd', 1, 16, 16384, 16384, 128, True) == 1.25 * 4 * 16 * 16384**2 * 128\n\
         rows = [peers.csv_row('sdpa-flash', 'fwd', 'fp16', False, 1, 16, 16384, 128, 6.4),\n\
                 peers.csv_row('triton', 'bwd', 'fp16', True, 32, 32, 512, 64, 0.5)]\n\
         d = peers.parse_args(['--direction', 'decode'])\n\
         assert d.decode[0] == (1, 32, 32, 8192) and len(d.decode) == 42, d.decode\n\
         peers.parse_args(['--direction', 'decode', '--new-tokens', '1,4', '--page-size', 'none,16'])\n\
         rows.append(peers.decode_row('sdpa-flash', 'fp16', 1, 32, 8, 1, 8192, 128, 0.01))\n\
         w = peers.parse_args(['--window', '4095,-1', '--window', 'none', '--window=-1,3']).windows\n\
         assert w == [(4095, None), None, (None, 3)], w\n\
         rows.append(peers.csv_row('flex', 'fwd', 'fp16', True, 1, 16, 16384, 128, 1.0, 'bhsd', w[0]))\n\
         m = peers.parse_args(['--score-mod', 'softcap:50', '--score-mod', 'none']).score_mods\n\
         assert m == ['softcap:50', None], m\n\
         rows.append(peers.csv_row('flex', 'fwd', 'fp16', True, 1, 16, 16384, 128, 3.2, 'bhsd', None, m[0]))\n\
         k = peers.parse_args(['--mask-mod', 'documents:16', '--mask-mod', 'none']).mask_mods\n\
         assert k == ['documents:16', None], k\n\
         rows.append(peers.csv_row('flex', 'fwd', 'fp16', True, 1, 16, 16384, 128, 0.1, 'bhsd', None, None, k[0]))\n\
         peers.write_csv({csv:?}, rows)\n",
        scripts = path(script.parent().unwrap()),
        csv = path(&dir.path().join("peers.csv")),
    );
    let py = Command::new("python3").args(["-B", "-c", &code]).output().unwrap();
    assert!(py.status.success(), "{}", text(&py.stderr));
    let csv = std::fs::read_to_string(dir.path().join("peers.csv")).unwrap();
    assert_eq!(csv.lines().next(), Some(HEADER));
    let run = ladder(&["bench", "--charts-only", "--out", &path(dir.path())]);
    let stdout = text(&run.stdout);
    assert!(run.status.success(), "{}", text(&run.stderr));
    // 4·16·16384²·128 FLOP in 6.4 ms; 2.5 · ½ · 4·32·32·512²·64 FLOP in 0.5 ms.
    assert!(stdout.contains("343.6"), "{stdout}");
    assert!(stdout.contains("171.8"), "{stdout}");
    assert!(dir.path().join("bwd-fp16-d64-causal.svg").exists());
    // The decode row: 2 · 8 · 8192 · 128 · 2 bytes in 10 µs.
    assert!(csv.contains("sdpa-flash,decode,fp16,false,1,32,8,1,8192,128,0.010000,"), "{csv}");
    assert!(stdout.contains("3.36"), "{stdout}");
    assert!(dir.path().join("decode-fp16-d128-b1.svg").exists());
    // The windowed row: its window round-trips, and its FLOPs are the pairs `ladder` counts.
    assert!(csv.lines().any(|l| l.starts_with("flex,") && l.ends_with(",4095:-1,,")), "{csv}");
    // The modified row: its modifier round-trips and labels its mask; its FLOPs are the plain
    // causal case's (½ · 4·16·16384²·128 in 3.2 ms).
    assert!(csv.lines().any(|l| l.starts_with("flex,") && l.ends_with(",,softcap:50,")), "{csv}");
    assert!(
        stdout.lines().any(|l| l.contains("causal+softcap:50") && l.contains("343.6")),
        "{stdout}"
    );
    // The masked row: its FLOPs count the 16 documents' causal pairs (4·16·16·1024·1025/2·128
    // in 0.1 ms), the same in the file and in `ladder`'s table.
    assert!(csv.lines().any(|l| l.starts_with("flex,") && l.ends_with(",,documents:16")), "{csv}");
    assert!(
        stdout.lines().any(|l| l.contains("causal·documents:16") && l.contains("687.9")),
        "{stdout}"
    );
    let windowed = ladder_compare::results::Case::square(
        "flex",
        ladder_compare::results::Direction::Fwd,
        "fp16",
        true,
        1,
        16,
        16384,
        128,
    )
    .windowed(ladder_reference::Window::left(4095));
    let tflops = format!("{:.1}", windowed.flops() / 1e-3 / 1e12);
    assert!(
        stdout.lines().any(|l| l.contains("w4095:0") && l.contains(&tflops)),
        "{tflops} {stdout}"
    );
    assert!(dir.path().join("fwd-fp16-d128-w4095-0.svg").exists());
}

/// On a GPU machine: a tiny `--quick` run writes every file with the agreed schema.
#[test]
fn quick_bench_on_the_gpu_writes_csv_json_meta_and_charts() {
    let Some(gpu) = ladder_compare::gpu_check::gpu_or_skip("quick_bench_on_the_gpu") else {
        return;
    };
    let card = gpu.name().to_string();
    drop(gpu);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let run = ladder(&[
        "bench",
        "--quick",
        "--tokens",
        "2048",
        "--n",
        "256,512",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--out",
        &path(&out),
    ]);
    let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{stderr}\n{stdout}");
    let csv = std::fs::read_to_string(out.join("bench.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(HEADER));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    for imp in ["fa1", "fa2"] {
        for n in ["256", "512"] {
            let row = rows
                .iter()
                .find(|r| r[0] == imp && r[1] == "fwd" && r[7] == n)
                .unwrap_or_else(|| panic!("no {imp} fwd n={n} row in\n{csv}\n{stderr}"));
            let tflops: f64 = row[11].parse().unwrap();
            assert!(tflops > 0.0 && tflops.is_finite(), "{row:?}");
            let batch = (2048 / n.parse::<usize>().unwrap()).to_string();
            assert_eq!((row[2], row[3], row[5], row[9]), ("fp16", "false", "16", "128"));
            assert_eq!(row[4], batch, "batch = tokens / n");
        }
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).unwrap()).unwrap();
    assert_eq!(json["meta"]["card"], card.as_str());
    assert!(json["rows"].as_array().unwrap().len() >= rows.len());
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("meta.json")).unwrap()).unwrap();
    for key in ["card", "driver", "cuda", "date", "torch", "note"] {
        assert!(meta.get(key).is_some(), "meta.json lacks {key}");
    }
    assert!(out.join("fwd-fp16-d128-noncausal.svg").exists());
    assert!(stderr.contains("fa1 (scalar FP32"), "the FA1 limits are said: {stderr}");
}

/// On a GPU machine: a tiny decode run writes FlashDecoding and FlashDecoding++ rows with TB/s,
/// the kernel and split count in bench.json (and FlashDecoding++'s φ and fallback rows), and the
/// decode chart.
#[test]
fn decode_bench_on_the_gpu_writes_tbps_rows_and_splits() {
    let Some(gpu) = ladder_compare::gpu_check::gpu_or_skip("decode_bench_on_the_gpu") else {
        return;
    };
    drop(gpu);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let base = ["bench", "--direction", "decode", "--n", "1024,4096", "--batch", "2"];
    let flags = ["--heads-kv", "8", "--repeats", "3", "--warmup", "1", "--out", &path(&out)];
    for splits in [None, Some("4")] {
        let mut args: Vec<&str> = [&base[..], &flags].concat();
        if let Some(s) = splits {
            args.extend(["--splits", s]);
        }
        let run = ladder(&args);
        let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
        assert!(run.status.success(), "{stderr}\n{stdout}");
        let csv = std::fs::read_to_string(out.join("bench.csv")).unwrap();
        let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
        assert_eq!(rows.len(), 4, "{csv}");
        let expected = [
            ("flash-decoding", "1024"),
            ("flash-decoding-pp", "1024"),
            ("flash-decoding", "4096"),
            ("flash-decoding-pp", "4096"),
        ];
        for (row, (imp, len)) in rows.iter().zip(expected) {
            assert_eq!(
                row[..10],
                [imp, "decode", "fp16", "false", "2", "32", "8", "1", len, "128"]
            );
            let tbps: f64 = row[12].parse().unwrap();
            assert!(tbps > 0.0 && tbps.is_finite(), "{row:?}");
        }
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).unwrap())
                .unwrap();
        for row in json["rows"].as_array().unwrap() {
            let used = row["splits"].as_u64().expect("the split count");
            match splits {
                Some(s) => assert_eq!(used.to_string(), s),
                None => assert!(used >= 1 && row["splits_from"] == "heuristic", "{row}"),
            }
            // 4 query heads per kv head, one token: the flat GEMM; no row of these inputs (scores
            // within a few units of φ = 0) falls back.
            if row["impl"] == "flash-decoding-pp" {
                assert_eq!(row["strategy"], "flat-gemm", "{row}");
                assert_eq!(row["fallback_rows"], 0, "{row}");
                assert_eq!(row["phi"], 0.0, "{row}");
            } else {
                assert_eq!(row["strategy"], "flash-decoding", "{row}");
            }
        }
        assert!(out.join("decode-fp16-d128-b2.svg").exists());
        assert!(stdout.contains("TB/s of K and V read"), "{stdout}");
    }
}

/// On a GPU machine: `--new-tokens` and `--page-size` give one row per (tokens, layout), the page
/// size in its column, and the paged columns and ratios in the side-by-side table.
#[test]
fn paged_and_speculative_decode_rows_on_the_gpu() {
    let Some(gpu) = ladder_compare::gpu_check::gpu_or_skip("paged_decode_bench_on_the_gpu") else {
        return;
    };
    drop(gpu);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let run = ladder(&[
        "bench",
        "--rung",
        "flash-decoding",
        "--n",
        "3000",
        "--batch",
        "3",
        "--heads-kv",
        "8",
        "--new-tokens",
        "1,4",
        "--page-size",
        "none,16,64",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--out",
        &path(&out),
    ]);
    let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{stderr}\n{stdout}");
    let csv = std::fs::read_to_string(out.join("bench.csv")).unwrap();
    assert_eq!(csv.lines().next(), Some(HEADER));
    let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 6, "2 token counts × 3 layouts\n{csv}");
    // In order: each layout, its token counts.
    let expected = [("1", ""), ("4", ""), ("1", "16"), ("4", "16"), ("1", "64"), ("4", "64")];
    for (row, (new, page)) in rows.iter().zip(expected) {
        let causal = if new == "1" { "false" } else { "true" };
        assert_eq!(
            row[..10],
            ["flash-decoding", "decode", "fp16", causal, "3", "32", "8", new, "3000", "128"]
        );
        assert_eq!(row[13], page, "{row:?}");
        let tbps: f64 = row[12].parse().unwrap();
        assert!(tbps > 0.0 && tbps.is_finite(), "{row:?}");
    }
    assert!(stdout.contains("flash-decoding/p16") && stdout.contains("p64/contig"), "{stdout}");
}
