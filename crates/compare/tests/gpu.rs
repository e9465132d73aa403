//! The GPU rungs against their CPU rungs and the float64 oracle.
//!
//! Every case draws fresh random tensors (the shared proptest strategies: GQA, causal with
//! n_q ≠ n_kv, lengths that are not multiples of any tile), rounds them to the kernel's 16-bit
//! type (or keeps f32), runs the kernel with its output buffers poisoned with NaN (an element the
//! kernel forgets to write fails the check), and holds the result to the ladder's rule
//! (`docs/conventions.md`): within twice the error of the naive algorithm in the same precision
//! (`ladder_compare::low_precision`), and within the sum of both tolerances of the CPU rung.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` (set by the GPU
//! bundle) a missing GPU fails them.

use ladder_compare::gpu_check::shared_gpu;
use ladder_compare::gpu_check::{self, Layout, device_inputs, narrow, options};
use ladder_compare::oracle::{Expected, GradientOracle, Oracle, check};
use ladder_compare::{Case, CaseSpace, GpuRung, RungConfig, cases};
use ladder_kernels::{DType, Gpu, KernelError, Options, fa1, fa2, fa3};
use proptest::prelude::*;

fn gpu() -> Option<&'static Gpu> {
    shared_gpu("GPU rung tests")
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Shapes for `rung` on the GPU: longer sequences than the CPU suite (several tiles and a tail),
/// the head dimensions the rung supports, logits in a trained model's range, sliding windows
/// and score modifiers where the rung takes them.
fn space(rung: GpuRung) -> CaseSpace {
    CaseSpace {
        batch: 1..=2,
        heads_kv: 1..=2,
        group: 1..=3,
        n_q: 1..=300,
        n_kv: 1..=300,
        head_dims: rung.head_dims().to_vec(),
        windows: rung.takes_window(),
        score_mods: rung.takes_score_mod(),
        ..CaseSpace::cpu().moderate_logits()
    }
}

/// The layouts of Q, K, V (and dO) the rungs that take strides are drawn in.
fn layouts() -> impl Strategy<Value = Layout> {
    prop::sample::select(Layout::ALL.to_vec())
}

/// Runs a GPU forward rung on `case` and checks it against the oracle and its CPU rung (in f32).
fn check_forward(rung: GpuRung, case: &Case, dtype: DType) -> Result<(), TestCaseError> {
    check_forward_in(rung, case, dtype, Layout::Bhsd)
}

/// [`check_forward`] with the inputs in `layout`.
fn check_forward_in(
    rung: GpuRung,
    case: &Case,
    dtype: DType,
    layout: Layout,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    if !rung.available_on(gpu) {
        eprintln!("{rung} skipped: {} is {}, not {}", gpu.name(), gpu.arch(), fa3::ARCH);
        return Ok(());
    }
    let x = device_inputs(case, dtype);
    let (attention, opts) = gpu_check::case_options(case);
    let fp8 = RungConfig::default().fp8;
    let (got, _) =
        gpu_check::forward_in(gpu, rung, &x, &opts, dtype, &fp8, layout).map_err(fail)?;
    let oracle = Oracle::new(&x, &attention).map_err(fail)?;
    let expected = gpu_check::expected_forward(&oracle, &x, dtype).map_err(fail)?;
    let x32 = narrow(&x);
    let config = RungConfig { attention, ..RungConfig::default() };
    let cpu_out = rung.cpu().forward(x32.q.view(), x32.k.view(), x32.v.view(), &config);
    let cpu_out = cpu_out.map_err(fail)?;
    let cpu_expected = Expected::from_oracle(&oracle, &x32).map_err(fail)?;
    let label = format!("{} ({dtype}, {layout:?})", rung.label());
    let cpu_label = format!("{} (CPU)", rung.cpu_label());
    check(&label, &got, &expected, Some((&cpu_label, &cpu_out, &cpu_expected))).map_err(fail)
}

/// Runs a GPU backward rung (after its forward) on `case` and checks `dQ, dK, dV` against the float64
/// oracle (within twice the 16-bit naive backward's error) and against the CPU FA2 backward.
/// The inputs are in `layout`, the gradients come back in their inputs' layouts.
fn check_backward(
    rung: GpuRung,
    case: &Case,
    dtype: DType,
    layout: Layout,
) -> Result<(), TestCaseError> {
    let Some(gpu) = gpu() else { return Ok(()) };
    if !rung.available_on(gpu) {
        eprintln!("{rung} skipped: {} is {}, not {}", gpu.name(), gpu.arch(), fa3::ARCH);
        return Ok(());
    }
    let x = device_inputs(case, dtype);
    let (attention, opts) = gpu_check::case_options(case);
    let (got, _) = gpu_check::backward_in(gpu, rung, &x, &opts, dtype, layout).map_err(fail)?;
    let oracle = GradientOracle::new(&x, &attention).map_err(fail)?;
    let expected = gpu_check::expected_backward(&oracle, &x, dtype).map_err(fail)?;
    let (errs, pass) = expected.judge(&got);
    let [tq, tk, tv] = expected.tolerances;
    if !pass {
        let sinks = expected
            .judge_sinks(&got)
            .map_or(String::new(), |(err, tol, _)| format!(", dsinks {err} (tol {tol})"));
        return Err(fail(format!(
            "{rung} ({dtype}, {layout:?}) vs oracle: dQ {} dK {} dV {} (tol {tq} / {tk} / \
             {tv}){sinks}",
            errs[0], errs[1], errs[2]
        )));
    }
    // Against the CPU rung: each within its own tolerance of the oracle, so within the sum.
    let pairs = gpu_check::vs_cpu_backward(&oracle, &narrow(&x), &got, &expected).map_err(fail)?;
    for (t, (err, tol)) in pairs.into_iter().enumerate() {
        if !tol.admits(err) {
            return Err(fail(format!(
                "{rung} ({dtype}) vs CPU fa2 backward, gradient {t}: {err} (tol {tol})"
            )));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(gpu_check::cases_per_property(48)))]

    #[test]
    fn gpu_fa2_backward_fp16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa2Backward)), layout in layouts()) {
        check_backward(GpuRung::Fa2Backward, &case, DType::F16, layout)?;
    }

    #[test]
    fn gpu_fa2_deterministic_backward_fp16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa2BackwardDeterministic)), layout in layouts()) {
        check_backward(GpuRung::Fa2BackwardDeterministic, &case, DType::F16, layout)?;
    }

    #[test]
    fn gpu_fa2_deterministic_backward_bf16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa2BackwardDeterministic)), layout in layouts()) {
        check_backward(GpuRung::Fa2BackwardDeterministic, &case, DType::BF16, layout)?;
    }

    #[test]
    fn gpu_fa2_backward_bf16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa2Backward)), layout in layouts()) {
        check_backward(GpuRung::Fa2Backward, &case, DType::BF16, layout)?;
    }

    #[test]
    fn gpu_fa3_backward_fp16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa3Backward)), layout in layouts()) {
        check_backward(GpuRung::Fa3Backward, &case, DType::F16, layout)?;
    }

    #[test]
    fn gpu_fa3_backward_bf16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa3Backward)), layout in layouts()) {
        check_backward(GpuRung::Fa3Backward, &case, DType::BF16, layout)?;
    }

    #[test]
    fn gpu_fa3_deterministic_backward_fp16_matches_the_oracle_and_cpu_fa2(case in cases(space(GpuRung::Fa3BackwardDeterministic)), layout in layouts()) {
        check_backward(GpuRung::Fa3BackwardDeterministic, &case, DType::F16, layout)?;
    }

    #[test]
    fn gpu_fa1_fp16_matches_cpu_fa1_and_the_oracle(case in cases(space(GpuRung::Fa1))) {
        check_forward(GpuRung::Fa1, &case, DType::F16)?;
    }

    #[test]
    fn gpu_fa1_f32_matches_cpu_fa1_and_the_oracle(case in cases(space(GpuRung::Fa1))) {
        check_forward(GpuRung::Fa1, &case, DType::F32)?;
    }

    #[test]
    fn gpu_fa2_fp16_matches_cpu_fa2_and_the_oracle(case in cases(space(GpuRung::Fa2)), layout in layouts()) {
        check_forward_in(GpuRung::Fa2, &case, DType::F16, layout)?;
    }

    #[test]
    fn gpu_fa3_fp16_matches_cpu_fa3_and_the_oracle(case in cases(space(GpuRung::Fa3)), layout in layouts()) {
        check_forward_in(GpuRung::Fa3, &case, DType::F16, layout)?;
    }

    #[test]
    fn gpu_fa3_bf16_matches_cpu_fa3_and_the_oracle(case in cases(space(GpuRung::Fa3)), layout in layouts()) {
        check_forward_in(GpuRung::Fa3, &case, DType::BF16, layout)?;
    }

    #[test]
    fn gpu_fa2_bf16_matches_cpu_fa2_and_the_oracle(case in cases(space(GpuRung::Fa2)), layout in layouts()) {
        check_forward_in(GpuRung::Fa2, &case, DType::BF16, layout)?;
    }
}

/// One larger problem per head dimension: many tiles, GQA, causal with n_q < n_kv (a KV cache);
/// head dims off the tuned ones (padded to the 16-wide k-step, to 64-element shared rows), in
/// the layouts that take strides.
#[test]
fn gpu_fa2_long_sequences() {
    for (d, causal, layout) in [
        (64, true, Layout::Bhsd),
        (128, false, Layout::Bhsd),
        (128, true, Layout::Bhsd),
        (256, true, Layout::Bhsd),
        (96, true, Layout::Bshd),
        (40, false, Layout::Packed),
        (160, true, Layout::Packed),
    ] {
        let case = long_case((1, 4, 2, 700, 1500, d), causal, 64, 1000 + d as u64);
        check_forward_in(GpuRung::Fa2, &case, DType::F16, layout)
            .unwrap_or_else(|e| panic!("d = {d}, causal = {causal}, {layout:?}: {e}"));
    }
}

/// FA3 on longer problems: many K/V tiles (and pipeline rounds), GQA, causal with n_q < n_kv and
/// n_q > n_kv (top rows that see no key), one head dim of every tile row and off the 64-element
/// blocks, in each layout; and problems of several hundred query tiles, so that each persistent
/// block walks several tiles (the pipeline's stages and phases carry over from one tile to the
/// next).
#[test]
fn gpu_fa3_long_sequences() {
    for (b, hq, hkv, n_q, n_kv, d, causal, layout) in [
        (1, 4, 2, 700, 1500, 40, true, Layout::Bshd),
        (1, 4, 2, 700, 1500, 96, false, Layout::Packed),
        (1, 4, 2, 1500, 700, 96, true, Layout::Bshd),
        (1, 4, 2, 700, 1500, 160, true, Layout::Bhsd),
        (1, 4, 2, 700, 1500, 192, false, Layout::Bshd),
        (1, 4, 2, 300, 2100, 224, true, Layout::Packed),
        (2, 8, 8, 300, 2100, 96, false, Layout::Bshd),
    ]
    .into_iter()
    .chain(
        [
            (1, 4, 2, 700, 1500, 64, true),
            (1, 4, 2, 700, 1500, 128, false),
            (1, 4, 2, 700, 1500, 128, true),
            (1, 4, 2, 1500, 700, 128, true),
            (1, 4, 2, 700, 1500, 256, false),
            (1, 4, 2, 700, 1500, 256, true),
            (3, 24, 8, 600, 900, 128, false),
            (3, 24, 8, 900, 600, 64, true),
            (2, 16, 16, 1000, 1000, 128, true),
            // Past 2k keys: d = 128's 176-key tiles, with O written from registers, and d = 64
            // causal's 192 query rows (fa3::SHORT_KEYS).
            (1, 4, 2, 300, 2100, 128, false),
            (1, 4, 2, 300, 2100, 128, true),
            (1, 4, 2, 300, 2100, 64, true),
        ]
        .map(|(b, hq, hkv, n_q, n_kv, d, causal)| (b, hq, hkv, n_q, n_kv, d, causal, Layout::Bhsd)),
    ) {
        let case = long_case((b, hq, hkv, n_q, n_kv, d), causal, 128, 3000 + d as u64);
        check_forward_in(GpuRung::Fa3, &case, DType::F16, layout).unwrap_or_else(|e| {
            panic!("[{b}, {hq}/{hkv}, {n_q}x{n_kv}, {d}], causal = {causal}, {layout:?}: {e}")
        });
    }
}

/// FA3 with sliding windows on problems of many K/V tiles, so that a query block's walk starts
/// past the first tile (its first tile partly left of the band) and ends before the last: causal
/// windows (Mistral's shape, small), two-sided ones, n_q ≠ n_kv, every layout, the 176-key tiles
/// of d = 128 past 2k keys and d = 64's three consumer warpgroups.
#[test]
fn gpu_fa3_windowed_long_sequences() {
    use ladder_reference::Window;
    for (n_q, n_kv, d, causal, window, layout) in [
        (1500, 1500, 128, true, Window::left(300), Layout::Bhsd),
        (2100, 2100, 128, true, Window::left(511), Layout::Bshd),
        (700, 2100, 128, false, Window::new(400, 90), Layout::Bhsd),
        (1500, 700, 64, true, Window::left(200), Layout::Packed),
        (1029, 1029, 64, false, Window::new(0, 300), Layout::Bhsd),
        (700, 1500, 256, true, Window::left(333), Layout::Bshd),
        (900, 900, 96, false, Window::new(150, 150), Layout::Packed),
    ] {
        let case =
            Case { window, ..long_case((1, 4, 2, n_q, n_kv, d), causal, 128, 4000 + d as u64) };
        check_forward_in(GpuRung::Fa3, &case, DType::F16, layout).unwrap_or_else(|e| {
            panic!("{n_q}x{n_kv}, d = {d}, causal = {causal}, {window:?}, {layout:?}: {e}")
        });
    }
}

/// The GPU, when it has the FA3 kernels (Hopper); `None` after saying so otherwise.
fn hopper() -> Option<&'static Gpu> {
    let gpu = gpu()?;
    if !GpuRung::Fa3.available_on(gpu) {
        eprintln!("fa3 skipped: {} is {}", gpu.name(), gpu.arch());
        return None;
    }
    Some(gpu)
}

/// A fixed problem of `(batch, heads_q, heads_kv, n_q, n_kv, d)` with the CPU rung's tiles
/// `tile × tile`, its tensors drawn from `seed`: the longer cases of these tests.
fn long_case(
    (b, hq, hkv, n_q, n_kv, d): (usize, usize, usize, usize, usize, usize),
    causal: bool,
    tile: usize,
    seed: u64,
) -> Case {
    Case {
        shape: ladder_reference::AttentionShape::new(b, hq, hkv, n_q, n_kv, d).unwrap(),
        causal,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std: 1.0,
        tiles: ladder_reference::TileSizes::new(tile, tile).unwrap(),
        splits: 1,
        seed,
    }
}

/// The problem of the FA3 schedule and tile-order tests: `batch` sequences × 4 query heads (2 kv
/// heads), 517 queries against 1029 keys (5 query blocks of 128 rows, ragged tails), d = 128.
fn fa3_case(batch: usize, causal: bool, seed: u64) -> Case {
    long_case((batch, 4, 2, 517, 1029, 128), causal, 128, seed)
}

/// `a` in fp16 on `gpu`.
fn upload_f16(gpu: &Gpu, a: &ndarray::Array4<f64>) -> ladder_kernels::Tensor {
    let v: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    gpu.upload(&v, a.shape(), DType::F16).unwrap()
}

/// Every FA3 schedule (no ping-pong, no intra-warpgroup overlap, neither; one block per tile) is
/// right on its own
/// (the oracle's rule) and computes what the full kernel computes, bit for bit: they reorder when
/// products are issued, not the arithmetic. Each is also run twice (deterministic).
#[test]
fn gpu_fa3_ablation_variants_equal_the_full_kernel() {
    let Some(gpu) = hopper() else { return };
    let schedules = [
        (true, true, true),
        (false, true, true),
        (true, false, true),
        (false, false, true),
        (true, true, false),
    ]
    .map(|(pingpong, overlap, persistent)| fa3::Schedule {
        pingpong,
        overlap,
        persistent,
        dynamic: false,
    });
    let mut failures = Vec::new();
    for causal in [false, true] {
        let case = fa3_case(2, causal, 77);
        let x = device_inputs(&case, DType::F16);
        let (attention, opts) = options(&case.attention(), 128);
        let oracle = Oracle::new(&x, &attention).unwrap();
        let expected = gpu_check::expected_forward(&oracle, &x, DType::F16).unwrap();
        let (q, k, v) = (upload_f16(gpu, &x.q), upload_f16(gpu, &x.k), upload_f16(gpu, &x.v));
        let run = |schedule| {
            let out = fa3::forward_with(gpu, &q, &k, &v, &opts, schedule).unwrap();
            (out.o.to_f32_vec().unwrap(), out.lse.to_f32_vec().unwrap())
        };
        let full = run(schedules[0]);
        for schedule in schedules {
            let got = run(schedule);
            let again = run(schedule);
            let what = format!("{schedule:?}, causal = {causal}");
            let output = ladder_reference::AttentionOutput {
                o: ndarray::Array4::from_shape_vec(x.q.dim(), got.0.clone()).unwrap(),
                lse: ndarray::Array3::from_shape_vec(
                    (x.q.dim().0, x.q.dim().1, x.q.dim().2),
                    got.1.clone(),
                )
                .unwrap(),
                stats: Default::default(),
            };
            let verdict = expected.judge(&output);
            if !verdict.pass {
                failures.push(format!("{what}: vs oracle O {} lse {}", verdict.o, verdict.lse));
            }
            let bits = |a: &[f32]| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            if bits(&got.0) != bits(&again.0) || bits(&got.1) != bits(&again.1) {
                failures.push(format!("{what}: two runs differ"));
            }
            let differ = |a: &[f32], b: &[f32]| {
                let n = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                (n, worst)
            };
            let (no, wo) = differ(&got.0, &full.0);
            let (nl, wl) = differ(&got.1, &full.1);
            if no + nl > 0 {
                failures.push(format!(
                    "{what}: differs from the full schedule in {no} of O (max {wo:e}), {nl} of \
                     lse (max {wl:e})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The causal FA3 kernel walks its tiles in sections of heads sized to keep their K and V in L2
/// (`fa3::L2_SECTION_BYTES`). Any section size (4, 5 or 7 of 32 heads, the last section short, or
/// all heads at once) gives the same bits: the order moves tiles between blocks, it never changes
/// a tile's arithmetic. 160 tiles: more than an H200's 132 blocks, so blocks walk several.
#[test]
fn gpu_fa3_causal_tile_order_does_not_change_the_bits() {
    // Each section size runs on a `Gpu` of its own (the size is part of its configuration).
    if hopper().is_none() {
        return;
    }
    // 8 sequences × 4 q heads (2 kv heads), 5 query blocks of 128 rows: 160 tiles. One q head's
    // share of K and V: 1029 keys × 128 × 2 tensors × 2 bytes / 2 q heads per kv head.
    let per_head = 1029 * 128 * 2;
    let case = fa3_case(8, true, 78);
    let x = device_inputs(&case, DType::F16);
    let (_, opts) = options(&case.attention(), 128);
    let run = |section: Option<usize>| {
        let config = gpu_check::gpu_config_from_env().unwrap().poison_outputs(true);
        let config = match section {
            Some(bytes) => config.tune(fa3::L2Section(bytes)),
            None => config,
        };
        let gpu = Gpu::with_config(config).unwrap();
        let (q, k, v) = (upload_f16(&gpu, &x.q), upload_f16(&gpu, &x.k), upload_f16(&gpu, &x.v));
        let out = fa3::forward(&gpu, &q, &k, &v, &opts).unwrap();
        (out.o.to_bytes().unwrap(), out.lse.to_bytes().unwrap())
    };
    let default = run(None);
    assert!(default.0.iter().any(|&b| b != 0), "an all-zero O proves nothing");
    for heads in [fa3::MIN_SECTION_HEADS, 5, 7, 100] {
        let got = run(Some(heads * per_head));
        assert!(got == default, "sections of {heads} heads: not the default order's bits");
    }
}

/// Backward on a longer problem: many K/V and query tiles, GQA, causal with n_q < n_kv.
#[test]
fn gpu_fa2_backward_long_sequences() {
    for (d, causal, layout) in [
        (64, true, Layout::Bhsd),
        (128, false, Layout::Bhsd),
        (128, true, Layout::Bhsd),
        (96, true, Layout::Bshd),
        (72, false, Layout::Packed),
    ] {
        let case = long_case((1, 4, 2, 300, 700, d), causal, 64, 2000 + d as u64);
        for rung in [GpuRung::Fa2Backward, GpuRung::Fa2BackwardDeterministic] {
            check_backward(rung, &case, DType::F16, layout)
                .unwrap_or_else(|e| panic!("{rung}, d = {d}, causal = {causal}, {layout:?}: {e}"));
        }
    }
}

/// FA3's backward on longer problems: many K/V tiles and query tiles (several rounds of the
/// pipeline's stages), GQA, causal with n_q < n_kv and n_q > n_kv (query rows that see no key),
/// head dims below the k-step's 16 columns, off the 64-column blocks and at the tiles' largest, in
/// each layout; both dQ modes.
#[test]
fn gpu_fa3_backward_long_sequences() {
    for (n_q, n_kv, d, causal, layout) in [
        (300, 700, 64, true, Layout::Bhsd),
        (700, 300, 64, true, Layout::Bshd),
        (520, 520, 128, false, Layout::Bhsd),
        (300, 700, 128, true, Layout::Packed),
        (700, 300, 96, true, Layout::Bhsd),
        (300, 700, 40, false, Layout::Bshd),
        (129, 257, 8, true, Layout::Bhsd),
    ] {
        let case = long_case((1, 4, 2, n_q, n_kv, d), causal, 64, 3000 + d as u64);
        for rung in [GpuRung::Fa3Backward, GpuRung::Fa3BackwardDeterministic] {
            check_backward(rung, &case, DType::F16, layout).unwrap_or_else(|e| {
                panic!("{rung}, {n_q}x{n_kv}, d = {d}, causal = {causal}, {layout:?}: {e}")
            });
        }
    }
}

/// Bad input is an error naming the problem, never a panic or a wrong answer.
#[test]
fn gpu_rungs_reject_bad_input() {
    let Some(gpu) = gpu() else { return };
    let t = |shape: &[usize], dtype| {
        let n: usize = shape.iter().product();
        gpu.upload(&vec![0.5; n], shape, dtype).unwrap()
    };
    for d in [100, 264] {
        let q = t(&[1, 2, 8, d], DType::F16);
        let err = fa2::forward(gpu, &q, &q, &q, &Options::full()).unwrap_err();
        assert!(matches!(err, KernelError::UnsupportedHeadDim { d: e, .. } if e == d), "{err}");
        assert!(err.to_string().contains("multiples of 8 from 8 to 256"), "{err}");
    }
    // Strides: the head dim must be contiguous, the other strides whole 16-byte chunks, and the
    // rungs that take no strides say so.
    let q = t(&[1, 8, 2, 64], DType::F16).transpose(1, 2).unwrap();
    let err = fa1::forward(gpu, &q, &q, &q, &Options::full()).unwrap_err();
    assert!(err.to_string().contains("contiguous"), "{err}");
    let k = t(&[1, 2, 8, 64], DType::F16);
    let cols = t(&[1, 2, 64, 8], DType::F16).transpose(2, 3).unwrap();
    let err = fa2::forward(gpu, &cols, &k, &k, &Options::full()).unwrap_err();
    assert!(err.to_string().contains("must be contiguous (stride 1)"), "{err}");
    let odd = t(&[2 * 8 * 68], DType::F16).as_strided(&[1, 2, 8, 64], &[0, 8 * 68, 68, 1]);
    let err = fa2::forward(gpu, &odd.unwrap(), &k, &k, &Options::full()).unwrap_err();
    assert!(err.to_string().contains("multiples of 8 elements"), "{err}");
    if GpuRung::Fa3.available_on(gpu) {
        for d in [100, 264] {
            let q = t(&[1, 2, 8, d], DType::F16);
            let err = fa3::forward(gpu, &q, &q, &q, &Options::full()).unwrap_err();
            assert!(matches!(err, KernelError::UnsupportedHeadDim { d: e, .. } if e == d), "{err}");
            assert!(err.to_string().contains("multiples of 8 from 8 to 256"), "{err}");
        }
        let err = fa3::forward(gpu, &cols, &k, &k, &Options::full()).unwrap_err();
        assert!(err.to_string().contains("must be contiguous (stride 1)"), "{err}");
        let err = fa3::fp8::forward(gpu, &cols, &k, &k, &Options::full(), &Default::default());
        let err = err.unwrap_err().to_string();
        assert!(err.contains("must be contiguous (stride 1)"), "{err}");
    }
    let q32 = t(&[1, 2, 8, 64], DType::F32);
    let err = fa2::forward(gpu, &q32, &q32, &q32, &Options::full()).unwrap_err();
    assert!(matches!(err, KernelError::UnsupportedDtype { .. }), "{err}");
    let (q, k) = (t(&[1, 3, 8, 64], DType::F16), t(&[1, 2, 8, 64], DType::F16));
    let err = fa2::forward(gpu, &q, &k, &k, &Options::full()).unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
    let v = t(&[1, 2, 9, 64], DType::F16);
    let err = fa1::forward(gpu, &k, &k, &v, &Options::causal()).unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)), "{err}");
    let q = t(&[1, 2, 8, 136], DType::F16);
    let out = fa2::forward(gpu, &q, &q, &q, &Options::full()).unwrap();
    let err = fa2::backward(gpu, &q, &q, &q, &out, &q, &Options::full()).unwrap_err();
    assert!(matches!(err, KernelError::UnsupportedHeadDim { d: 136, .. }), "{err}");
    let err = fa3::backward(gpu, &q, &q, &q, &out, &q, &Options::full()).unwrap_err();
    if GpuRung::Fa3Backward.available_on(gpu) {
        assert!(matches!(err, KernelError::UnsupportedHeadDim { d: 136, .. }), "{err}");
        assert!(err.to_string().contains("multiples of 8 from 8 to 128"), "{err}");
        // dO of another shape than Q's
        let q = t(&[1, 2, 8, 64], DType::F16);
        let out = fa3::forward(gpu, &q, &q, &q, &Options::full()).unwrap();
        let d_o = t(&[1, 2, 9, 64], DType::F16);
        let err = fa3::backward(gpu, &q, &q, &q, &out, &d_o, &Options::full()).unwrap_err();
        assert!(matches!(err, KernelError::Shape(_)), "{err}");
    } else {
        assert!(matches!(err, KernelError::UnsupportedArch { .. }), "{err}");
    }
    let err = gpu.upload(&[1.0; 3], &[2, 2], DType::F16).unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)), "{err}");
}

/// Score modifiers on problems of many tiles, in FA2 and FA3: Gemma-2's softcap (a cap below the
/// logits' range, where it bends every score), ALiBi after softcap (a bias growing with the
/// distance: bottom-right aligned with n_q ≠ n_kv), a relative bias read from a table; causal,
/// windowed and full, every layout (a packed batch gives the modifier its sequence as `b`),
/// fp16 and bf16, d = 64 (FA3's two consumer warpgroups under a modifier), 128 and 256.
#[test]
fn gpu_score_mods_long_sequences() {
    use ladder_compare::modifiers::{Cap, ModifierSpec};
    use ladder_reference::Window;
    let cap = |c| Cap::new(c).unwrap();
    let cases = [
        (1500, 1500, 128, true, ModifierSpec::Softcap(cap(0.5)), Window::default(), Layout::Bhsd),
        (700, 2100, 128, false, ModifierSpec::Softcap(cap(30.0)), Window::default(), Layout::Bshd),
        (
            1500,
            700,
            64,
            true,
            ModifierSpec::SoftcapAlibi(cap(5.0)),
            Window::default(),
            Layout::Bhsd,
        ),
        (700, 1500, 256, true, ModifierSpec::Alibi, Window::default(), Layout::Packed),
        (1029, 1029, 128, true, ModifierSpec::RelativeBias, Window::left(300), Layout::Bhsd),
        (
            900,
            900,
            64,
            false,
            ModifierSpec::Softcap(cap(50.0)),
            Window::new(150, 150),
            Layout::Packed,
        ),
        // Sinks: n_q > n_kv, so the first 800 causal rows see no key and keep only the sink.
        (1500, 700, 128, true, ModifierSpec::Sinks, Window::default(), Layout::Bhsd),
        (1100, 900, 64, true, ModifierSpec::Sinks, Window::left(200), Layout::Packed),
    ];
    for rung in [GpuRung::Fa2, GpuRung::Fa3] {
        for (i, &(n_q, n_kv, d, causal, spec, window, layout)) in cases.iter().enumerate() {
            let base = long_case((1, 4, 2, n_q, n_kv, d), causal, 128, 5000 + i as u64);
            let case = Case { window, score_mod: Some(spec), ..base };
            let dtype = if i % 2 == 0 { DType::F16 } else { DType::BF16 };
            check_forward_in(rung, &case, dtype, layout).unwrap_or_else(|e| {
                panic!("{rung}: {n_q}x{n_kv}, d = {d}, causal = {causal}, {spec}, {window:?}, {layout:?}: {e}")
            });
        }
    }
}

/// The FA2 and FA3 backward through score modifiers on problems of several key and query tiles: softcap's
/// derivative `1 − (t / cap)²` (a cap that bends every score), ALiBi after softcap (the chain
/// rule), the relative bias (derivative 1), under causal, full and windowed masks, every layout,
/// both dQ modes.
#[test]
fn gpu_score_mods_backward_long_sequences() {
    use ladder_compare::modifiers::{Cap, ModifierSpec};
    use ladder_reference::Window;
    let cap = |c| Cap::new(c).unwrap();
    let cases = [
        (300, 700, 128, true, ModifierSpec::Softcap(cap(0.5)), Window::default(), Layout::Bhsd),
        (
            700,
            300,
            64,
            false,
            ModifierSpec::SoftcapAlibi(cap(5.0)),
            Window::default(),
            Layout::Bshd,
        ),
        (500, 500, 96, true, ModifierSpec::RelativeBias, Window::left(200), Layout::Packed),
        (400, 600, 128, false, ModifierSpec::Alibi, Window::new(100, 50), Layout::Bhsd),
        // The sinks' gradient, over rows of several tiles (and rows without keys: n_q > n_kv).
        (900, 400, 128, true, ModifierSpec::Sinks, Window::default(), Layout::Bhsd),
        (600, 600, 64, false, ModifierSpec::Sinks, Window::default(), Layout::Packed),
    ];
    for (i, &(n_q, n_kv, d, causal, spec, window, layout)) in cases.iter().enumerate() {
        let base = long_case((1, 4, 2, n_q, n_kv, d), causal, 64, 6000 + i as u64);
        let case = Case { window, score_mod: Some(spec), ..base };
        check_every_backward(&case, layout, &spec.to_string());
    }
}

/// Runs every backward rung that takes `case`'s window (the FA3 backward takes none yet), both dQ
/// modes, on `case` in fp16 and `layout`; a failure names the case and `what` it modifies.
fn check_every_backward(case: &Case, layout: Layout, what: &str) {
    let rungs = [
        GpuRung::Fa2Backward,
        GpuRung::Fa2BackwardDeterministic,
        GpuRung::Fa3Backward,
        GpuRung::Fa3BackwardDeterministic,
    ];
    for rung in rungs.into_iter().filter(|r| !case.window.is_some() || r.takes_window()) {
        check_backward(rung, case, DType::F16, layout).unwrap_or_else(|e| {
            let s = &case.shape;
            panic!(
                "{rung}, {}x{}, d = {}, causal = {}, {what}, {layout:?}: {e}",
                s.n_q, s.n_kv, s.d, case.causal
            )
        });
    }
}

/// A score modifier (or sinks) reaches only the rungs that take one; the others, and bad
/// modifiers, are errors that say why.
#[test]
fn gpu_score_mods_are_refused_where_unsupported() {
    use ladder_kernels::ScoreMod;
    let Some(gpu) = gpu() else { return };
    let q = gpu.upload(&vec![0.25; 2 * 64 * 64], &[1, 2, 64, 64], DType::F16).unwrap();
    let softcap = Options::causal().with_score_mod(ScoreMod::softcap(30.0).unwrap());
    let err = fa1::forward(gpu, &q, &q, &q, &softcap).unwrap_err().to_string();
    assert!(err.contains("fa1 takes no score_mod"), "{err}");
    // A backward pass needs the modifier's derivative.
    let forward_only =
        Options::causal().with_score_mod(ScoreMod::new("twice", "return 2.f * score;"));
    let out = fa2::forward(gpu, &q, &q, &q, &forward_only).unwrap();
    let err = fa2::backward(gpu, &q, &q, &q, &out, &q, &forward_only).unwrap_err().to_string();
    assert!(err.contains("twice has no derivative"), "{err}");
    // ALiBi's slopes must match the query heads.
    let three = Options::full().with_score_mod(ScoreMod::alibi(vec![0.5; 3]).unwrap());
    let err = fa2::forward(gpu, &q, &q, &q, &three).unwrap_err().to_string();
    assert!(err.contains("3 slopes for 2 query heads"), "{err}");
    assert!(ScoreMod::softcap(-1.0).is_err() && ScoreMod::softcap(f32::NAN).is_err());
    assert_eq!(Options::full().with_softcap(0.0).unwrap(), Options::full(), "a cap of 0 is off");
    // A body that does not compile comes back with NVRTC's log, named after the modifier.
    let broken = Options::full().with_score_mod(ScoreMod::new("my mod", "return score +;"));
    let err = fa2::forward(gpu, &q, &q, &q, &broken).unwrap_err();
    assert!(matches!(err, KernelError::Compile { .. }), "{err}");
    assert!(err.to_string().contains("my mod(1)"), "{err}");
    // Sinks: one finite logit per query head, on the rungs that take them.
    let sinks = Options::causal().with_sinks(ladder_kernels::Sinks::new(vec![0.5; 2]).unwrap());
    let err = fa1::forward(gpu, &q, &q, &q, &sinks).unwrap_err().to_string();
    assert!(err.contains("fa1 takes no attention sinks"), "{err}");
    let three = Options::causal().with_sinks(ladder_kernels::Sinks::new(vec![0.5; 3]).unwrap());
    let err = fa2::forward(gpu, &q, &q, &q, &three).unwrap_err().to_string();
    assert!(err.contains("3 given for 2 heads"), "{err}");
    assert!(ladder_kernels::Sinks::new(vec![f32::NAN]).is_err());
    if GpuRung::Fa3.available_on(gpu) {
        let err = fa3::fp8::forward(gpu, &q, &q, &q, &softcap, &Default::default());
        assert!(err.unwrap_err().to_string().contains("fa3-fp8 takes no score_mod"));
        let err = fa3::fp8::forward(gpu, &q, &q, &q, &sinks, &Default::default());
        assert!(err.unwrap_err().to_string().contains("fa3-fp8 takes no attention sinks"));
        let out = fa3::forward(gpu, &q, &q, &q, &forward_only).unwrap();
        let err = fa3::backward(gpu, &q, &q, &q, &out, &q, &forward_only).unwrap_err().to_string();
        assert!(err.contains("twice has no derivative"), "{err}");
    }
}

/// Mask modifiers in the FA2 and FA3 forwards, on problems of many tiles: the block mask skips
/// the tiles a document mask empties and the kernel asks the mask per entry on the tiles it leaves
/// partial.
/// Packed causal training (16 documents), documents with `n_q ≠ n_kv` (more queries than keys:
/// the first rows see nothing), a prefix-LM mask, LongNet's dilated mask (a user-written body
/// with an `int`) inside a window, a document mask under softcap, and masks that name the head and
/// the batch entry; fp16 and bf16, d = 64, 128 and 256, both layouts a mask takes.
#[test]
fn gpu_mask_mods_long_sequences() {
    use ladder_compare::modifiers::{Cap, MaskSpec, ModifierSpec};
    use ladder_reference::Window;
    let none = Window::default();
    let cases = [
        (1024, 1024, 128, true, MaskSpec::Documents(16), none, None, Layout::Bhsd),
        (700, 1500, 64, false, MaskSpec::Documents(5), none, None, Layout::Bshd),
        (1500, 700, 256, true, MaskSpec::Documents(3), none, None, Layout::Bhsd),
        (900, 900, 128, false, MaskSpec::PrefixLm(300), none, None, Layout::Bshd),
        (1029, 1029, 64, true, MaskSpec::Dilated(3), Window::left(400), None, Layout::Bhsd),
        (
            600,
            600,
            128,
            true,
            MaskSpec::Documents(4),
            none,
            Some(ModifierSpec::Softcap(Cap::new(5.0).unwrap())),
            Layout::Bshd,
        ),
        // Masks that name the head, or the batch entry: their block masks have a row each, which
        // FA3's longest-first tile order must map back to every (batch, head).
        (1100, 1100, 128, true, MaskSpec::HeadDilated(3), none, None, Layout::Bhsd),
        (1000, 1000, 64, false, MaskSpec::BatchPrefixLm(300), none, None, Layout::Bshd),
    ];
    for (i, &(n_q, n_kv, d, causal, mask, window, score_mod, layout)) in cases.iter().enumerate() {
        let base = long_case((2, 4, 2, n_q, n_kv, d), causal, 128, 7000 + i as u64);
        let case = Case { window, score_mod, mask_mod: Some(mask), ..base };
        let dtype = if i % 2 == 0 { DType::F16 } else { DType::BF16 };
        for rung in [GpuRung::Fa2, GpuRung::Fa3] {
            check_forward_in(rung, &case, dtype, layout).unwrap_or_else(|e| {
                panic!(
                    "{rung}: {n_q}x{n_kv}, d = {d}, causal = {causal}, {mask}, {window:?}, \
                     {layout:?}: {e}"
                )
            });
        }
    }
}

/// Mask modifiers in the FA2 and FA3 backwards, both dQ modes: the main kernels walk each key
/// tile's live query tiles, the dQ pass each query tile's live key tiles; 16 packed documents,
/// documents with `n_q ≠ n_kv` both ways, prefix-LM, dilated inside a window (FA2: the FA3
/// backward takes no window), documents under softcap.
#[test]
fn gpu_mask_mods_backward_long_sequences() {
    use ladder_compare::modifiers::{Cap, MaskSpec, ModifierSpec};
    use ladder_reference::Window;
    let none = Window::default();
    let softcap = Some(ModifierSpec::Softcap(Cap::new(5.0).unwrap()));
    let cases = [
        (1024, 1024, 128, true, MaskSpec::Documents(16), none, None, Layout::Bhsd),
        (300, 700, 64, false, MaskSpec::Documents(5), none, None, Layout::Bshd),
        (700, 300, 128, true, MaskSpec::Documents(3), none, None, Layout::Bhsd),
        (600, 600, 96, false, MaskSpec::PrefixLm(200), none, None, Layout::Bshd),
        (515, 515, 64, true, MaskSpec::Dilated(3), Window::left(200), None, Layout::Bhsd),
        (400, 400, 128, true, MaskSpec::Documents(4), none, softcap, Layout::Bshd),
    ];
    for (i, &(n_q, n_kv, d, causal, mask, window, score_mod, layout)) in cases.iter().enumerate() {
        let base = long_case((1, 4, 2, n_q, n_kv, d), causal, 64, 8000 + i as u64);
        let case = Case { window, score_mod, mask_mod: Some(mask), ..base };
        check_every_backward(&case, layout, &mask.to_string());
    }
}

/// A block mask is made once per mask and shape and kept with the mask (its clones too): a second
/// call with the mask gives the same bits, and so does a call with an equal mask made anew (its
/// own block mask); a mask of other documents on the same shape gets its own.
#[test]
fn gpu_block_masks_are_kept_per_mask_and_shape() {
    use ladder_kernels::MaskMod;
    let Some(gpu) = gpu() else { return };
    let n = 1000;
    let values: Vec<f32> =
        (0..2 * 4 * n * 64).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let q = gpu.upload(&values, &[2, 4, n, 64], DType::F16).unwrap();
    let docs = || MaskMod::document_lengths(&[300, 200, 500]).unwrap();
    let other = Options::causal().with_mask_mod(MaskMod::document_lengths(&[500, 500]).unwrap());
    let kept = Options::causal().with_mask_mod(docs());
    let mut rungs = vec![GpuRung::Fa2];
    if GpuRung::Fa3.available_on(gpu) {
        rungs.push(GpuRung::Fa3);
    }
    for rung in rungs {
        let run = |opts: &Options| {
            let out = match rung {
                GpuRung::Fa3 => fa3::forward(gpu, &q, &q, &q, opts),
                _ => fa2::forward(gpu, &q, &q, &q, opts),
            };
            out.unwrap().o.to_f32_vec().unwrap()
        };
        let first = run(&kept);
        assert_eq!(run(&kept.clone()), first, "{rung}: the kept block mask");
        assert_eq!(run(&Options::causal().with_mask_mod(docs())), first, "{rung}: a new mask");
        assert_ne!(run(&other), first, "{rung}: other documents");
        assert_eq!(run(&kept), first, "{rung}: after another mask");
    }
}

/// A mask modifier reaches FA2 and FA3, forward and backward; the other rungs (FA1, FP8) and bad
/// masks are errors that say why.
#[test]
fn gpu_mask_mods_are_refused_where_unsupported() {
    use ladder_kernels::MaskMod;
    let Some(gpu) = gpu() else { return };
    let q = gpu.upload(&vec![0.25; 2 * 64 * 64], &[1, 2, 64, 64], DType::F16).unwrap();
    let docs = Options::causal().with_mask_mod(MaskMod::document_lengths(&[20, 44]).unwrap());
    let err = fa1::forward(gpu, &q, &q, &q, &docs).unwrap_err().to_string();
    assert!(err.contains("fa1 takes no mask_mod"), "{err}");
    // A document table must cover the keys.
    let short = Options::causal().with_mask_mod(MaskMod::document_lengths(&[20, 40]).unwrap());
    let err = fa2::forward(gpu, &q, &q, &q, &short).unwrap_err().to_string();
    assert!(err.contains("table of 60 keys for 64 keys"), "{err}");
    // A body that does not compile comes back with NVRTC's log, named after the mask.
    let broken = Options::full().with_mask_mod(MaskMod::new("my mask", "return q_idx <;"));
    let err = fa2::forward(gpu, &q, &q, &q, &broken).unwrap_err();
    assert!(matches!(err, KernelError::Compile { .. }), "{err}");
    assert!(err.to_string().contains("my mask(1)"), "{err}");
    if GpuRung::Fa3.available_on(gpu) {
        let err = fa3::fp8::forward(gpu, &q, &q, &q, &docs, &Default::default());
        assert!(err.unwrap_err().to_string().contains("fa3-fp8 takes no mask_mod"));
        let err = fa3::forward(gpu, &q, &q, &q, &short).unwrap_err().to_string();
        assert!(err.contains("table of 60 keys for 64 keys"), "{err}");
    }
}
