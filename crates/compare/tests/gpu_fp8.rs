//! The FA3 rung's FP8 path on the GPU (`ladder_kernels::fa3::fp8`) against the CPU `fa3-fp8`
//! rung and the float64 oracle.
//!
//! - The quantisation pass writes, bit for bit, the e4m3 values and block scales the CPU rung
//!   computes (with and without the random Hadamard rotation): the two paths then multiply the
//!   same numbers, and the rest of the comparison is about the kernel.
//! - The attention is within the FP8 tolerance of the oracle (twice the error of per-tensor FP8
//!   attention, [`Expected::fp8_from_oracle`]) and within the sum of tolerances of the CPU rung,
//!   on drawn shapes (ragged lengths, GQA, causal with n_q ≠ n_kv, every head dim the path takes,
//!   fp16 and bf16, Q, K, V contiguous, `[b, s, h, d]` or slots of a packed QKV buffer).
//! - On inputs with outliers (the FA3 paper's N(0,1) + N(0,100)·Bernoulli(0.001), n = 4096),
//!   incoherent processing lowers the GPU's error as it lowers the CPU rung's.
//! - Every schedule computes the same bits.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` they fail.

use ladder_compare::gpu_check::{
    self, Layout, device_inputs, narrow, options, rounded, shared_gpu, upload_in,
};
use ladder_compare::oracle::{Expected, Oracle, check};
use ladder_compare::{Case, CaseSpace, GpuRung, Inputs, RungConfig, cases, error};
use ladder_kernels::fa3::{self, fp8};
use ladder_kernels::{DType, Gpu, KernelError, Tensor};
use ladder_reference::fp8::{Fp8Scaling, Fp8Tensor, RandomHadamard};
use ladder_reference::{AttentionShape, Fp8Options, TileSizes};
use ndarray::{Array3, Array4};
use proptest::prelude::*;

fn gpu() -> Option<&'static Gpu> {
    let gpu = shared_gpu("GPU FP8 tests")?;
    if GpuRung::Fa3Fp8.available_on(gpu) {
        Some(gpu)
    } else {
        eprintln!("fa3-fp8 skipped: {} is {}, not {}", gpu.name(), gpu.arch(), fa3::ARCH);
        None
    }
}

fn upload(gpu: &Gpu, a: &Array4<f64>, dtype: DType) -> Tensor {
    let v: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    gpu.upload(&v, a.shape(), dtype).expect("upload")
}

/// The CPU rung's configuration matching the kernel's blocks (so both quantise the same tiles).
fn cpu_config(gpu: &Gpu, case: &Case, fp8: Fp8Options) -> RungConfig {
    RungConfig {
        attention: case.attention(),
        tiles: gpu_check::fp8_cpu_tiles(gpu, case.shape.d, case.shape.n_kv, case.window)
            .expect("an FP8 head dim"),
        fp8,
        ..RungConfig::default()
    }
}

fn with_seed(incoherent: Option<u64>) -> Fp8Options {
    Fp8Options { incoherent, ..RungConfig::default().fp8 }
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// The GPU FP8 attention on `x` (rounded to `dtype`) within the FP8 tolerance of the oracle and of
/// the CPU rung.
fn check_fp8(
    case: &Case,
    x: &Inputs<f64>,
    (dtype, layout): (DType, Layout),
    fp8: Fp8Options,
) -> Result<(), String> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let (attention, opts) = options(&case.attention(), case.shape.d);
    let (got, _) = gpu_check::forward_in(gpu, GpuRung::Fa3Fp8, x, &opts, dtype, &fp8, layout)
        .map_err(|e| e.to_string())?;
    let oracle = Oracle::new(x, &attention).map_err(|e| e.to_string())?;
    let x32 = narrow(x);
    let expected = Expected::fp8_from_oracle(&oracle, &x32, &fp8).map_err(|e| e.to_string())?;
    let config = RungConfig { attention, ..cpu_config(gpu, case, fp8) };
    let cpu_out = ladder_compare::Rung::Fa3Fp8
        .forward(x32.q.view(), x32.k.view(), x32.v.view(), &config)
        .map_err(|e| e.to_string())?;
    check(
        &format!("fa3-fp8-gpu ({dtype}, {layout:?})"),
        &got,
        &expected,
        Some(("fa3-fp8 (CPU)", &cpu_out, &expected)),
    )
}

fn fp8_space() -> CaseSpace {
    CaseSpace {
        batch: 1..=2,
        heads_kv: 1..=2,
        group: 1..=3,
        n_q: 1..=300,
        n_kv: 1..=400,
        head_dims: fp8::HEAD_DIMS.to_vec(),
        windows: true,
        ..CaseSpace::cpu().moderate_logits()
    }
}

fn layouts() -> impl Strategy<Value = Layout> {
    prop::sample::select(Layout::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(32)))]

    #[test]
    fn gpu_fa3_fp8_fp16_matches_cpu_fa3_fp8_and_the_oracle(case in cases(fp8_space()), rotate in any::<bool>(), layout in layouts()) {
        let x = device_inputs(&case, DType::F16);
        let fp8 = with_seed(rotate.then_some(case.seed));
        check_fp8(&case, &x, (DType::F16, layout), fp8).map_err(fail)?;
    }

    #[test]
    fn gpu_fa3_fp8_bf16_matches_cpu_fa3_fp8_and_the_oracle(case in cases(fp8_space()), rotate in any::<bool>(), layout in layouts()) {
        let x = device_inputs(&case, DType::BF16);
        let fp8 = with_seed(rotate.then_some(case.seed));
        check_fp8(&case, &x, (DType::BF16, layout), fp8).map_err(fail)?;
    }
}

/// Longer shapes: many K/V tiles, several query tiles per block (persistent), causal with
/// n_q ≠ n_kv, GQA.
#[test]
fn gpu_fa3_fp8_long_sequences() {
    for (b, hq, hkv, n_q, n_kv, d, causal) in [
        (1, 4, 1, 2048, 2048, 128, true),
        (2, 8, 2, 700, 1500, 128, false),
        (1, 4, 2, 1500, 700, 256, true),
        (1, 2, 2, 1029, 1029, 256, false),
        (1, 4, 2, 1500, 1500, 80, true),
        (2, 2, 2, 1029, 1029, 96, false),
        (1, 2, 1, 700, 1100, 192, true),
    ] {
        let case = Case {
            shape: AttentionShape::new(b, hq, hkv, n_q, n_kv, d).unwrap(),
            causal,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: TileSizes::new(128, 128).unwrap(),
            splits: 1,
            seed: 11 + d as u64,
        };
        let x = device_inputs(&case, DType::F16);
        check_fp8(&case, &x, (DType::F16, Layout::Bshd), with_seed(Some(5))).unwrap_or_else(|e| {
            panic!("[{b}, {hq}/{hkv}, {n_q}x{n_kv}, {d}], causal = {causal}: {e}")
        });
    }
    // Sliding windows over many K/V tiles (128-key tiles at every length: fp8::tiles_on).
    for (n_q, n_kv, causal, window) in [
        (2048, 2048, true, ladder_reference::Window::left(300)),
        (700, 1500, false, ladder_reference::Window::new(250, 60)),
    ] {
        let case = Case {
            shape: AttentionShape::new(1, 4, 2, n_q, n_kv, 128).unwrap(),
            causal,
            window,
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: TileSizes::new(128, 128).unwrap(),
            splits: 1,
            seed: 17,
        };
        let x = device_inputs(&case, DType::F16);
        check_fp8(&case, &x, (DType::F16, Layout::Bhsd), with_seed(Some(5)))
            .unwrap_or_else(|e| panic!("{n_q}x{n_kv}, causal = {causal}, {window:?}: {e}"));
    }
}

/// The e4m3 operands and scales on the GPU are the CPU rung's, bit for bit.
#[test]
fn gpu_fp8_quantisation_is_the_cpu_rungs_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let decode = |b: &[u8]| -> Vec<f32> {
        b.iter().map(|&x| float8::F8E4M3::from_bits(x).to_f32()).collect()
    };
    // n_kv past fp8::SHORT_KEYS at d = 128: 192-key tiles (V's transposed stage in two blocks).
    // Head dims off the power-of-two rows: rotation blocks of 32 (96), 16 (80, 16), 64 (192).
    for (dtype, d, incoherent, n_kv, layout) in [
        (DType::F16, 128, None, 270, Layout::Bhsd),
        (DType::F16, 128, Some(3), 270, Layout::Bhsd),
        (DType::BF16, 256, Some(9), 270, Layout::Bshd),
        (DType::BF16, 128, None, 270, Layout::Packed),
        (DType::F16, 128, Some(5), fp8::SHORT_KEYS + 77, Layout::Bhsd),
        (DType::F16, 96, Some(7), 270, Layout::Bshd),
        (DType::BF16, 80, Some(2), fp8::SHORT_KEYS + 77, Layout::Packed),
        (DType::F16, 192, Some(4), 270, Layout::Bhsd),
        (DType::BF16, 16, Some(1), 270, Layout::Bhsd),
    ] {
        let case = Case {
            shape: AttentionShape::new(2, 4, 2, 333, n_kv, d).unwrap(),
            causal: false,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: TileSizes::new(128, 128).unwrap(),
            splits: 1,
            seed: 21,
        };
        // Outliers, so that the blocks get different scales.
        let x = rounded(&case.inputs_with_outliers::<f64>(0.002, 30.0), dtype);
        let (_, opts) = options(&case.attention(), d);
        let up = |t| upload_in(gpu, t, dtype, layout).expect("upload");
        let (q, k, v) = (up(&x.q), up(&x.k), up(&x.v));
        let inputs =
            fp8::quantize(gpu, &q, &k, &v, &opts, &fp8::Fp8Options { incoherent }).unwrap();
        let [gq, gk, gv] = inputs.to_bytes().unwrap();
        let [sq, sk, sv] = inputs.scales().unwrap();

        let x32 = narrow(&x);
        let (q32, k32) = match incoherent {
            Some(seed) => {
                let r = RandomHadamard::new(d, seed);
                (r.apply(x32.q.view()), r.apply(x32.k.view()))
            }
            None => (x32.q.clone(), x32.k.clone()),
        };
        let (br, bc) = (inputs.tiles().br(), inputs.tiles().bc);
        let what = format!("{dtype}, d = {d}, incoherent {incoherent:?}, {layout:?}");
        // V in one block per head: the GPU writes the head's scale into each of its tiles' slots.
        let n_kv = x32.v.dim().2;
        for (name, gpu_values, gpu_scales, cpu, tiles) in [
            ("q", gq, sq, Fp8Tensor::quantize(q32.view(), br, Fp8Scaling::PerBlock), 1),
            ("k", gk, sk, Fp8Tensor::quantize(k32.view(), bc, Fp8Scaling::PerBlock), 1),
            (
                "v",
                gv,
                sv,
                Fp8Tensor::quantize(x32.v.view(), n_kv, Fp8Scaling::PerBlock),
                n_kv.div_ceil(bc),
            ),
        ] {
            let cpu_scales: Vec<f32> =
                cpu.scales.iter().flat_map(|&s| std::iter::repeat_n(s, tiles)).collect();
            assert_eq!(gpu_scales, cpu_scales, "{name} scales, {what}");
            let cpu_values: Vec<f32> = cpu.values.iter().copied().collect();
            let got = decode(&gpu_values);
            let diff = got.iter().zip(&cpu_values).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(diff, None, "{name} values first differ at {diff:?}, {what}");
        }
    }
}

/// FA3's §4.3 claim on the GPU: with outliers, incoherent processing lowers the FP8 error (the
/// relative L2 error of O against the oracle), as it does on the CPU rung.
#[test]
fn gpu_fp8_incoherent_processing_lowers_the_error_on_outliers() {
    let Some(gpu) = gpu() else { return };
    let mut ratios = Vec::new();
    for seed in 0..3u64 {
        let case = Case {
            shape: AttentionShape::new(1, 2, 2, 4096, 4096, 128).unwrap(),
            causal: false,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: TileSizes::new(128, 128).unwrap(),
            splits: 1,
            seed,
        };
        let x = rounded(&case.inputs_with_outliers::<f64>(0.001, 10.0), DType::F16);
        let (attention, opts) = options(&case.attention(), 128);
        let oracle = Oracle::new(&x, &attention).unwrap();
        let x32 = narrow(&x);
        let err = |incoherent: Option<u64>| {
            let fp8 = with_seed(incoherent);
            let (got, _) =
                gpu_check::forward_fp8(gpu, GpuRung::Fa3Fp8, &x, &opts, DType::F16, &fp8).unwrap();
            let config = RungConfig { attention: attention.clone(), ..cpu_config(gpu, &case, fp8) };
            let cpu = ladder_compare::Rung::Fa3Fp8
                .forward(x32.q.view(), x32.k.view(), x32.v.view(), &config)
                .unwrap();
            (error(&got.o, &oracle.out.o).rel_l2, error(&cpu.o, &oracle.out.o).rel_l2)
        };
        let ((gpu_plain, cpu_plain), (gpu_rot, cpu_rot)) = (err(None), err(Some(seed)));
        // The FA3 paper reports RMSE: rel L2 times the reference's root mean square.
        let o = &oracle.out.o;
        let rms = (o.iter().map(|v| v * v).sum::<f64>() / o.len() as f64).sqrt();
        println!(
            "fp8 outliers seed {seed}: rel L2 of O, no rotation {gpu_plain:.3e} (CPU \
             {cpu_plain:.3e}), incoherent {gpu_rot:.3e} (CPU {cpu_rot:.3e}); RMSE no rotation \
             {:.3e}, incoherent {:.3e}, gain {:.2}x",
            gpu_plain * rms,
            gpu_rot * rms,
            gpu_plain / gpu_rot
        );
        assert!(gpu_rot < gpu_plain, "seed {seed}: incoherent {gpu_rot:.3e} vs {gpu_plain:.3e}");
        ratios.push(gpu_rot / gpu_plain);
    }
    let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
    println!("fp8 outliers: mean error ratio incoherent / none on the GPU {mean:.3}");
    assert!(mean < 0.9, "mean ratio {mean:.3} ({ratios:?})");
}

/// Every schedule gives the FP8 kernel's bits (they reorder issues, not arithmetic).
#[test]
fn gpu_fp8_schedules_give_the_same_bits() {
    let Some(gpu) = gpu() else { return };
    for causal in [false, true] {
        let case = Case {
            shape: AttentionShape::new(1, 4, 2, 517, 1029, 128).unwrap(),
            causal,
            window: Default::default(),
            score_mod: None,
            mask_mod: None,
            logit_std: 1.0,
            tiles: TileSizes::new(128, 128).unwrap(),
            splits: 1,
            seed: 31,
        };
        let x = device_inputs(&case, DType::F16);
        let (_, opts) = options(&case.attention(), 128);
        let (q, k, v) = (
            upload(gpu, &x.q, DType::F16),
            upload(gpu, &x.k, DType::F16),
            upload(gpu, &x.v, DType::F16),
        );
        let inputs = fp8::quantize(gpu, &q, &k, &v, &opts, &fp8::Fp8Options::default()).unwrap();
        let run = |schedule| {
            let out = fp8::forward_quantized_with(gpu, &inputs, schedule).unwrap();
            (out.o.to_f32_vec().unwrap(), out.lse.to_f32_vec().unwrap())
        };
        let bits = |v: &(Vec<f32>, Vec<f32>)| -> Vec<u32> {
            v.0.iter().chain(&v.1).map(|x| x.to_bits()).collect()
        };
        let full = bits(&run(fa3::Schedule::default()));
        for (pingpong, overlap, persistent) in
            [(false, true, true), (true, false, true), (false, false, true), (true, true, false)]
        {
            let s = fa3::Schedule { pingpong, overlap, persistent, dynamic: false };
            assert!(bits(&run(s)) == full, "{s:?}, causal = {causal}: bits differ");
        }
    }
}

/// Q and K so small (bf16 holds 1e-20) that a tile's score scale, the softmax scale times Q's
/// and K's block scales (~1e-23 each), falls below f32's range: the kernel held it at 0, and a
/// masked score (−inf) times 0 was NaN in every row but the last. It is now held at the smallest
/// normal float, where the scores are ~0 as they should be: the softmax is uniform over the keys
/// a row sees, `O` their mean and `lse` the log of their count. Two e4m3 roundings, each within
/// 2⁻⁴ relative, separate `O` from that mean: V's, and P's once it is lifted by its tile's share
/// of V's scale (a common factor within a tile, not a power of two): `|O − mean| ≤ 2⁻³ max|V|`.
#[test]
fn gpu_fp8_tiny_queries_and_keys_attend_uniformly() {
    let Some(gpu) = gpu() else { return };
    let (heads, n, d) = (2, 300, 128);
    let len = heads * n * d;
    let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
    let values = |seed: u64, scale: f32| -> Vec<f32> {
        ladder_compare::cases::pseudo_random(seed, len).iter().map(|&x| bf16(x * scale)).collect()
    };
    let (q, k, v) = (values(1, 1e-20), values(2, 1e-20), values(3, 1.0));
    let up = |x: &[f32]| gpu.upload(x, &[1, heads, n, d], DType::BF16).expect("upload");
    let opts = ladder_kernels::Options::causal();
    let out = fp8::forward(gpu, &up(&q), &up(&k), &up(&v), &opts, &fp8::Fp8Options::default())
        .expect("FP8 forward");
    let (o, lse) = (out.o.to_f32_vec().unwrap(), out.lse.to_f32_vec().unwrap());
    let v_max = v.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    for h in 0..heads {
        let mut sum = vec![0f64; d];
        for i in 0..n {
            // Causal with n_q = n_kv: row i sees keys 0 ..= i.
            for (c, s) in sum.iter_mut().enumerate() {
                *s += f64::from(v[(h * n + i) * d + c]);
            }
            let row = h * n + i;
            let count = (i + 1) as f64;
            let lse_err = (f64::from(lse[row]) - count.ln()).abs();
            assert!(lse_err <= 1e-3, "head {h}, row {i}: lse {} against ln {count}", lse[row]);
            for (c, s) in sum.iter().enumerate() {
                let got = f64::from(o[row * d + c]);
                assert!(
                    (got - s / count).abs() <= v_max / 8.0,
                    "head {h}, row {i}, column {c}: O {got} against the mean {}",
                    s / count
                );
            }
        }
    }
}

/// Bad input is an error, not a panic: head dims without an FP8 kernel, f32 inputs, quantised
/// inputs run by the other batch kind's attention.
#[test]
fn gpu_fp8_rejects_what_it_cannot_run() {
    let Some(gpu) = gpu() else { return };
    let opts = ladder_kernels::Options::default();
    let x = |d: usize, dtype| gpu.upload(&vec![0.5; 2 * 64 * d], &[1, 2, 64, d], dtype).unwrap();
    let none = fp8::Fp8Options::default();
    for d in [8, 72, 264] {
        let a = x(d, DType::F16);
        let err = fp8::forward(gpu, &a, &a, &a, &opts, &none).unwrap_err();
        assert!(matches!(err, KernelError::UnsupportedHeadDim { d: e, .. } if e == d), "{err}");
        assert!(err.to_string().contains("multiples of 16 from 16 to 256"), "{err}");
    }
    let a = x(64, DType::F16);
    let inputs = fp8::quantize(gpu, &a, &a, &a, &opts, &none).unwrap();
    let lens = ladder_kernels::varlen::SeqLens::from_lengths(gpu, &[64], &[64]).unwrap();
    let err = fp8::forward_quantized_varlen(gpu, &inputs, &lens).unwrap_err().to_string();
    assert!(err.contains("fixed-length batch"), "{err}");
    let packed = gpu.upload(&vec![0.5; 64 * 2 * 64], &[64, 2, 64], DType::F16).unwrap();
    let inputs = fp8::quantize_varlen(gpu, &packed, &packed, &packed, &lens, &opts, &none).unwrap();
    let err = fp8::forward_quantized(gpu, &inputs).unwrap_err().to_string();
    assert!(err.contains("packed batch"), "{err}");
    let other = ladder_kernels::varlen::SeqLens::from_lengths(gpu, &[32, 32], &[32, 32]).unwrap();
    let err = fp8::forward_quantized_varlen(gpu, &inputs, &other).unwrap_err().to_string();
    assert!(err.contains("other sequence offsets"), "{err}");
    let (a, b, c) = (x(128, DType::F32), x(128, DType::F32), x(128, DType::F32));
    assert!(matches!(
        fp8::forward(gpu, &a, &b, &c, &opts, &none),
        Err(KernelError::UnsupportedDtype { .. })
    ));
    // Empty-looking but valid: one query, one key.
    let one = gpu.upload(&[1.0; 128], &[1, 1, 1, 128], DType::F16).unwrap();
    let out = fp8::forward(gpu, &one, &one, &one, &opts, &none).unwrap();
    let o = Array3::from_shape_vec((1, 1, 128), out.o.to_f32_vec().unwrap()).unwrap();
    // softmax over one key is 1: O = V = 1 (e4m3 holds 1 exactly; P = 1 is lifted to 256).
    assert!(o.iter().all(|&x| x == 1.0), "{o:?}");
}
