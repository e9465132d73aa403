//! The `ladder` binary as a user runs it.

use std::path::Path;
use std::process::Command;

use ladder_compare::Inputs;
use ladder_compare::gpu_check::{self, narrow};
use ladder_compare::metrics::error;
use ladder_compare::npy::{self, DType};
use ladder_compare::oracle::{Expected, ExpectedGradients, GradientOracle, Oracle, check};
use ladder_reference::{AttentionOptions, AttentionOutput, Element, Gradients, naive};
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
        assert_one_line_error(&run, 1, message);
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
    assert_one_line_error(&run, 2, "--splits must be at least 1");
}

/// `--score-mod` reaches the CPU rungs as the modifier by its definition; a bad one, and `verify`
/// with one, are one-line errors.
#[test]
fn run_takes_a_score_mod_on_the_cpu() {
    use ladder_compare::modifiers::ModifierSpec;
    let dir = tempfile::tempdir().unwrap();
    let [q, k, v] = write_inputs(dir.path(), DType::F64, 4);
    let out = dir.path().join("o.npy");
    let out_s = out.display().to_string();
    let (qt, kt, vt) =
        (tensor((2, 4, 7, 8), 1), tensor((2, 2, 11, 8), 2), tensor((2, 2, 11, 8), 3));
    let run = |extra: &[&str]| {
        let base = ["run", "--rung", "fa2", "--q", &q, "--k", &k, "--v", &v, "--out", &out_s];
        ladder(&[&base[..], extra].concat())
    };
    for spec in ["softcap:0.2", "softcap:0.2+alibi", "relative-bias", "sinks"] {
        let run = run(&["--causal", "--score-mod", spec]);
        assert!(run.status.success(), "{spec}: {}", String::from_utf8_lossy(&run.stderr));
        let o = npy::read(&out).unwrap();
        let m: ModifierSpec = spec.parse().unwrap();
        let opts = m.apply_cpu(AttentionOptions::causal(), 4);
        let want = naive::attention(qt.view(), kt.view(), vt.view(), &opts).unwrap();
        let plain =
            naive::attention(qt.view(), kt.view(), vt.view(), &AttentionOptions::causal()).unwrap();
        let err = o.data.iter().zip(&want.o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let moved = o.data.iter().zip(&plain.o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-12 && moved > 1e-3, "{spec}: error {err}, change {moved}");
    }
    let bad = run(&["--score-mod", "softcap:-1"]);
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("positive and finite"));
    let verify = ladder(&["verify", "--score-mod", "alibi"]);
    assert_one_line_error(
        &verify,
        2,
        "--score-mod alibi: `ladder verify` checks the plain problems",
    );
}

/// `--mask-mod` reaches the CPU rungs as the mask by its
/// definition, composed with `--score-mod`; a GPU rung other than the fa2 forward, `verify` and a
/// bad spec are one-line errors.
#[test]
fn run_takes_a_mask_mod_on_the_cpu() {
    use ladder_compare::modifiers::{MaskSpec, ModifierSpec};
    let dir = tempfile::tempdir().unwrap();
    let [q, k, v] = write_inputs(dir.path(), DType::F64, 4);
    let out = dir.path().join("o.npy");
    let out_s = out.display().to_string();
    let (qt, kt, vt) =
        (tensor((2, 4, 7, 8), 1), tensor((2, 2, 11, 8), 2), tensor((2, 2, 11, 8), 3));
    let run = |extra: &[&str]| {
        let base = ["run", "--rung", "fa2", "--q", &q, "--k", &k, "--v", &v, "--out", &out_s];
        ladder(&[&base[..], extra].concat())
    };
    for (spec, causal) in [("documents:3", true), ("prefix-lm:4", false), ("dilated:2", false)] {
        let flags = [&["--mask-mod", spec, "--score-mod", "alibi", "--bc", "3"][..], &["--causal"]];
        let run = run(&flags[..1 + causal as usize].concat());
        assert!(run.status.success(), "{spec}: {}", String::from_utf8_lossy(&run.stderr));
        let o = npy::read(&out).unwrap();
        let m: MaskSpec = spec.parse().unwrap();
        let base = AttentionOptions { causal, ..Default::default() };
        let opts = ModifierSpec::Alibi.apply_cpu(m.apply_cpu(base.clone(), 11), 4);
        let want = naive::attention(qt.view(), kt.view(), vt.view(), &opts).unwrap();
        let unmasked = ModifierSpec::Alibi.apply_cpu(base, 4);
        let plain = naive::attention(qt.view(), kt.view(), vt.view(), &unmasked).unwrap();
        let err = o.data.iter().zip(&want.o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let moved = o.data.iter().zip(&plain.o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-12 && moved > 1e-3, "{spec}: error {err}, change {moved}");
    }
    let bad = run(&["--mask-mod", "documents:0"]);
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("at least 1"));
    let fa1 = ["run", "--rung", "fa1", "--q", &q, "--k", &k, "--v", &v, "--out", &out_s];
    let gpu = ladder(&[&fa1[..], &["--mask-mod", "documents:2", "--device", "gpu"]].concat());
    assert_one_line_error(
        &gpu,
        2,
        "on the GPU only fa2 and fa3 (forward and backward) take a mask modifier",
    );
    let verify = ladder(&["verify", "--mask-mod", "prefix-lm:3"]);
    assert_one_line_error(&verify, 2, "--mask-mod prefix-lm:3: `ladder verify`");
}

/// Asserts that `run` failed with exit status `code` and one line `error: …` containing `message`.
fn assert_one_line_error(run: &std::process::Output, code: i32, message: &str) {
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(code), "{stderr}");
    assert!(stderr.starts_with("error: ") && stderr.contains(message), "{message:?}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
}

/// A problem written to `dir` as `.npy` files of `dtype`, with `dO`: the tensors, in `f64`.
struct Problem {
    x: Inputs<f64>,
    paths: [String; 4],
}

impl Problem {
    fn write(dir: &Path, dtype: DType, q: (usize, usize, usize, usize), n_kv: usize) -> Self {
        let kv = (q.0, 2, n_kv, q.3);
        let x = Inputs { q: tensor(q, 1), k: tensor(kv, 2), v: tensor(kv, 3), d_o: tensor(q, 4) };
        let named = [("q.npy", &x.q), ("k.npy", &x.k), ("v.npy", &x.v), ("do.npy", &x.d_o)];
        let paths = named.map(|(name, t)| {
            npy::write(&dir.join(name), t, dtype).unwrap();
            dir.join(name).display().to_string()
        });
        Self { x, paths }
    }

    /// The `ladder run` arguments for `rung` on this problem, causal, writing into `dir` with
    /// the prefix `tag`, with `--backward` when `backward`.
    fn args(&self, dir: &Path, rung: &str, tag: &str, backward: bool) -> Vec<String> {
        let [q, k, v, d_o] = &self.paths;
        let out = |name: &str| dir.join(format!("{tag}-{name}.npy")).display().to_string();
        let mut args: Vec<String> =
            ["run", "--rung", rung, "--q", q, "--k", k, "--v", v].map(String::from).to_vec();
        args.extend(["--out".into(), out("o"), "--lse".into(), out("lse"), "--causal".into()]);
        if backward {
            args.extend(["--backward", "--do", d_o].map(String::from));
            for g in ["dq", "dk", "dv"] {
                args.extend([format!("--{g}"), out(g)]);
            }
        }
        args
    }

    /// Runs `ladder run` with `args` (from [`Problem::args`] with `tag`) and reads what it wrote.
    fn run(
        dir: &Path,
        tag: &str,
        args: &[String],
    ) -> (AttentionOutput<f64>, Option<Gradients<f64>>) {
        let run = ladder(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(run.status.success(), "{args:?}: {}", String::from_utf8_lossy(&run.stderr));
        let read4 = |name: &str| npy::read(&dir.join(format!("{tag}-{name}.npy"))).unwrap().data;
        let lse = npy::read_any(&dir.join(format!("{tag}-lse.npy"))).unwrap().1;
        let out = AttentionOutput {
            o: read4("o"),
            lse: lse.into_dimensionality::<ndarray::Ix3>().unwrap(),
            stats: Default::default(),
        };
        let grads = args.iter().any(|a| a == "--backward").then(|| Gradients {
            dq: read4("dq"),
            dk: read4("dk"),
            dv: read4("dv"),
            dsinks: None,
            stats: Default::default(),
        });
        (out, grads)
    }
}

/// The inputs in `T` (exact: the files hold values of every dtype).
fn inputs_in<T: Element>(x: &Inputs<f64>) -> Inputs<T> {
    let cast = |a: &Array4<f64>| a.mapv(T::of);
    Inputs { q: cast(&x.q), k: cast(&x.k), v: cast(&x.v), d_o: cast(&x.d_o) }
}

fn grads_of(g: &Gradients<f64>) -> [&Array4<f64>; 3] {
    [&g.dq, &g.dk, &g.dv]
}

/// CPU backward of naive and fa2 in `T`: each within the crate's tolerance of the float64
/// oracle (twice the naive backward's error in `T` plus the rounding floor: in f64 the floor
/// alone, ~1e-13 relative), and the two within the sum of their tolerances of each other.
fn check_cpu_backward<T: Element>(dtype: DType) {
    let dir = tempfile::tempdir().unwrap();
    let problem = Problem::write(dir.path(), dtype, (2, 4, 7, 8), 11);
    let mut runs = Vec::new();
    for rung in ["naive", "fa2"] {
        let mut args = problem.args(dir.path(), rung, rung, true);
        args.extend(["--br", "3", "--bc", "4"].map(String::from));
        let (_, grads) = Problem::run(dir.path(), rung, &args);
        let grads = grads.unwrap();
        for (name, g) in ["dq", "dk", "dv"].iter().zip(grads_of(&grads)) {
            let file = npy::read(&dir.path().join(format!("{rung}-{name}.npy"))).unwrap();
            assert_eq!((file.dtype, g.shape()), (dtype, file.data.shape()), "{rung} {name}");
        }
        runs.push((rung, grads));
    }
    let expected =
        ExpectedGradients::new(&inputs_in::<T>(&problem.x), &AttentionOptions::causal()).unwrap();
    for (rung, grads) in &runs {
        let (errs, pass) = expected.judge(grads);
        assert!(pass, "{rung} in {}: {errs:?} (tol {:?})", T::NAME, expected.tolerances);
    }
    let [(_, naive), (_, fa2)] = &runs[..] else { unreachable!() };
    for (t, (a, b)) in grads_of(fa2).into_iter().zip(grads_of(naive)).enumerate() {
        let (err, tol) = (error(a, b), expected.tolerances[t].plus(expected.tolerances[t]));
        assert!(tol.admits(err), "fa2 vs naive in {}, gradient {t}: {err} (tol {tol})", T::NAME);
    }
}

#[test]
fn run_backward_on_the_cpu_matches_the_oracle_and_naive_matches_fa2() {
    check_cpu_backward::<f64>(DType::F64);
    check_cpu_backward::<f32>(DType::F32);
}

#[test]
fn run_rejects_bad_flag_combinations_and_gradients() {
    let dir = tempfile::tempdir().unwrap();
    let problem = Problem::write(dir.path(), DType::F32, (1, 2, 5, 8), 6);
    let [q, k, v, d_o] = problem.paths.clone();
    let out = dir.path().join("o.npy").display().to_string();
    let missing = dir.path().join("missing.npy").display().to_string();
    let base = |rung: &str| {
        ["run", "--rung", rung, "--q", &q, "--k", &k, "--v", &v, "--out", &out]
            .map(String::from)
            .to_vec()
    };
    let grads = ["--dq", "dq.npy", "--dk", "dk.npy", "--dv", "dv.npy"];
    let cases: [(&str, Vec<&str>, i32, &str); 12] = [
        ("fa2", vec!["--backward"], 2, "--backward needs --do"),
        ("fa2", vec!["--backward", "--do", &d_o], 2, "missing --dq, --dk, --dv"),
        ("fa2", vec!["--do", &d_o], 2, "--do goes with --backward"),
        ("fa1", [&["--backward", "--do", &d_o][..], &grads].concat(), 2, "fa1 has no backward"),
        ("fa2", [&["--backward", "--do", &k][..], &grads].concat(), 1, "k.npy: dO is [1, 2, 6, 8]"),
        ("fa2", [&["--backward", "--do", &missing][..], &grads].concat(), 1, "missing.npy"),
        (
            "naive",
            vec!["--device", "gpu"],
            2,
            "naive has no GPU kernel (GPU rungs: fa1, fa2, fa3, fa3-fp8)",
        ),
        (
            "online-softmax",
            vec!["--device", "gpu"],
            2,
            "online-softmax has no GPU kernel (GPU rungs: fa1, fa2, fa3, fa3-fp8)",
        ),
        (
            "flash-decoding",
            vec!["--device", "gpu"],
            2,
            "flash-decoding has no GPU kernel (GPU rungs: fa1, fa2, fa3, fa3-fp8); its decoding \
             kernel",
        ),
        ("fa2", vec!["--device", "gpu", "--dtype", "f32"], 2, "fa2 on the GPU takes fp16, bf16"),
        (
            "fa1",
            [&["--device", "gpu", "--backward", "--do", &d_o][..], &grads].concat(),
            2,
            "fa1 has no backward kernel (GPU rungs with one: fa2, fa3)",
        ),
        (
            "fa2",
            vec!["--dtype", "fp16"],
            2,
            "--dtype picks the GPU kernel's type and needs --device gpu",
        ),
    ];
    for (rung, extra, code, message) in cases {
        let mut args = base(rung);
        args.extend(extra.iter().map(|s| s.to_string()));
        let run = ladder(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_one_line_error(&run, code, message);
    }
    // Flags clap rejects: exit status 2 with clap's own message.
    for extra in [["--device", "tpu"], ["--dtype", "f8"]] {
        let mut args = base("fa2");
        args.extend(extra.map(String::from));
        let run = ladder(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(run.status.code(), Some(2), "{}", String::from_utf8_lossy(&run.stderr));
    }
}

/// With a GPU (or where one is promised: `LADDER_REQUIRE_GPU=1`), `--device gpu` runs fa1 and
/// fa2 forward and fa2 backward, each held to the GPU tests' rule (twice the error of the naive
/// algorithm with the kernel's 16-bit roundings, `ladder_compare::low_precision`, plus the f32
/// floor) against the oracle, and within the sum of its and the CPU rung's tolerances of the CPU
/// rung's result. Without one, `--device gpu` is a one-line "no GPU" error with exit status 1.
#[test]
fn run_on_the_gpu_matches_the_cpu_rung_or_says_there_is_no_gpu() {
    use ladder_kernels::DType as K;
    let dir = tempfile::tempdir().unwrap();
    // d = 64: a head dim every kernel has, backward included; f32 files of fp16/bf16 values.
    let problem = Problem::write(dir.path(), DType::F32, (1, 4, 37, 64), 53);
    let gpu_expected =
        ladder_compare::gpu_check::gpu_required() || ladder_kernels::Gpu::new().is_ok();
    if !gpu_expected {
        for backward in [false, true] {
            let mut args = problem.args(dir.path(), "fa2", "gpu", backward);
            args.extend(["--device", "gpu"].map(String::from));
            let run = ladder(&args.iter().map(String::as_str).collect::<Vec<_>>());
            assert_one_line_error(&run, 1, "no GPU: ");
        }
        return;
    }
    let (attention, _) = gpu_check::options(&AttentionOptions::causal(), 64);
    let x = &problem.x;
    let x32 = narrow(x);
    let oracle = Oracle::new(x, &attention).unwrap();
    let cpu_expected = Expected::from_oracle(&oracle, &x32).unwrap();
    let grad_oracle = GradientOracle::new(x, &attention).unwrap();
    let cpu_grad_expected = ExpectedGradients::from_oracle(&grad_oracle, &x32).unwrap();
    // fa1's default for float32 input is f32, fa2's fp16.
    for (rung, dtypes) in [
        ("fa1", [(None, K::F32), (Some("fp16"), K::F16)]),
        ("fa2", [(None, K::F16), (Some("bf16"), K::BF16)]),
    ] {
        let backward = rung == "fa2";
        let (cpu_out, cpu_grads) =
            Problem::run(dir.path(), "cpu", &problem.args(dir.path(), rung, "cpu", backward));
        for (flag, dtype) in dtypes {
            let mut args = problem.args(dir.path(), rung, "gpu", backward);
            args.extend(["--device", "gpu"].map(String::from));
            args.extend(flag.map(|f| ["--dtype".to_string(), f.to_string()]).into_iter().flatten());
            let (out, grads) = Problem::run(dir.path(), "gpu", &args);
            let expected = gpu_check::expected_forward(&oracle, x, dtype).unwrap();
            let label = format!("{rung} (GPU, {dtype})");
            check(&label, &out, &expected, Some(("CPU", &cpu_out, &cpu_expected)))
                .unwrap_or_else(|e| panic!("{e}"));
            let (Some(grads), Some(cpu_grads)) = (grads, &cpu_grads) else { continue };
            let expected = gpu_check::expected_backward(&grad_oracle, x, dtype).unwrap();
            let (errs, pass) = expected.judge(&grads);
            assert!(pass, "{label} backward vs oracle: {errs:?} (tol {:?})", expected.tolerances);
            for (t, (a, b)) in grads_of(&grads).into_iter().zip(grads_of(cpu_grads)).enumerate() {
                let tol = expected.tolerances[t].plus(cpu_grad_expected.tolerances[t]);
                let err = error(a, b);
                assert!(tol.admits(err), "{label} vs CPU fa2, gradient {t}: {err} (tol {tol})");
            }
        }
    }
    // [b, s, h, d] files: fa2 (and fa3 on Hopper) read them in place, as strided views; fa1
    // takes a [b, h, s, d] copy. Each meets the oracle as it does on [b, h, s, d] files.
    let bshd = problem.in_bshd(dir.path(), DType::F32);
    let hopper = ladder_kernels::Gpu::new().is_ok_and(|g| g.arch() == ladder_kernels::fa3::ARCH);
    for rung in ["fa1", "fa2"].into_iter().chain(hopper.then_some("fa3")) {
        let backward = rung == "fa2";
        let mut args = bshd.args(dir.path(), rung, "gpu-bshd", backward);
        args.extend(["--device", "gpu", "--layout", "bshd"].map(String::from));
        let (out, grads) = Problem::run(dir.path(), "gpu-bshd", &args);
        let out = AttentionOutput { o: swapped(&out.o), ..out };
        let dtype = if rung == "fa1" { K::F32 } else { K::F16 };
        let expected = gpu_check::expected_forward(&oracle, x, dtype).unwrap();
        check(&format!("{rung} (GPU, bshd)"), &out, &expected, None)
            .unwrap_or_else(|e| panic!("{e}"));
        if let Some(g) = grads {
            let g = Gradients { dq: swapped(&g.dq), dk: swapped(&g.dk), dv: swapped(&g.dv), ..g };
            let expected = gpu_check::expected_backward(&grad_oracle, x, K::F16).unwrap();
            let (errs, pass) = expected.judge(&g);
            assert!(pass, "{rung} (GPU, bshd) backward: {errs:?} (tol {:?})", expected.tolerances);
        }
    }
}

/// `x` with axes 1 and 2 swapped: `[b, h, s, d]` ↔ `[b, s, h, d]`.
fn swapped(x: &Array4<f64>) -> Array4<f64> {
    x.view().permuted_axes([0, 2, 1, 3]).as_standard_layout().into_owned()
}

impl Problem {
    /// The same problem written again as `[batch, seq, heads, d]` files (`bshd-q.npy`, ...),
    /// and `self` with its paths pointing at them.
    fn in_bshd(&self, dir: &Path, dtype: DType) -> Problem {
        let x = &self.x;
        let named = [("q", &x.q), ("k", &x.k), ("v", &x.v), ("do", &x.d_o)];
        let paths = named.map(|(name, t)| {
            let path = dir.join(format!("bshd-{name}.npy"));
            npy::write(&path, &swapped(t), dtype).unwrap();
            path.display().to_string()
        });
        Problem { x: x.clone(), paths }
    }
}

/// `--layout bshd`: the files are `[batch, seq, heads, d]`, and so are O and the gradients written;
/// the CPU rungs give what they give on the `[batch, heads, seq, d]` files, bit for bit.
#[test]
fn run_reads_and_writes_the_bshd_layout() {
    let dir = tempfile::tempdir().unwrap();
    let problem = Problem::write(dir.path(), DType::F32, (2, 4, 9, 8), 13);
    let bshd = problem.in_bshd(dir.path(), DType::F32);
    for rung in ["naive", "fa2"] {
        let (out, grads) =
            Problem::run(dir.path(), "bhsd", &problem.args(dir.path(), rung, "bhsd", true));
        let mut args = bshd.args(dir.path(), rung, "bshd", true);
        args.extend(["--layout", "bshd"].map(String::from));
        let (out_t, grads_t) = Problem::run(dir.path(), "bshd", &args);
        assert_eq!(out_t.o.shape(), &[2, 9, 4, 8], "{rung}: O is written [b, s, h, d]");
        assert_eq!(swapped(&out_t.o), out.o, "{rung}: O");
        assert_eq!(out_t.lse, out.lse, "{rung}: lse stays [b, h, s]");
        let (g, g_t) = (grads.unwrap(), grads_t.unwrap());
        assert_eq!(g_t.dk.shape(), &[2, 13, 2, 8]);
        for (a, b) in grads_of(&g).into_iter().zip(grads_of(&g_t)) {
            assert_eq!(&swapped(b), a, "{rung}: a gradient");
        }
    }
    // A bshd file whose heads do not match says so in the [b, h, s, d] terms it was read as.
    let mut args = bshd.args(dir.path(), "fa2", "bad", false);
    args.extend(["--layout", "bshd"].map(String::from));
    let k_at = args.iter().position(|a| a == "--k").unwrap() + 1;
    args[k_at] = bshd.paths[0].clone(); // q as k: 4 heads of 9 rows for 2 of 13, and v 2 of 13
    let run = ladder(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_one_line_error(&run, 1, "read from --layout bshd as [batch, heads, seq, d]");
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
    // Ten CPU rows, and the GPU rows of the kernels that take d = 16 where there is a GPU.
    let rows = stdout
        .lines()
        .find(|l| l.starts_with("all ") && l.contains(" rows within tolerance"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse::<usize>().ok());
    assert!(rows.is_some_and(|n| n >= 10), "{stdout}");
    let bad = ladder(&["verify", "--heads-q", "3", "--heads-kv", "2"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a multiple"));
}
