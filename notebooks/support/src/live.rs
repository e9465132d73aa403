//! The GPU rungs run live, when the machine has a GPU: the notebook's "on the GPU" section first
//! runs the kernel on a small problem and checks it against the float64 oracle, with the same
//! rule as the GPU tests (`crates/compare/tests/gpu.rs`); without a GPU it says so, and the cell
//! after it shows the figures measured on the H200.

use ladder_compare::cases::Case;
use ladder_compare::gpu_check;
use ladder_compare::gpu_rungs::GpuRung;
use ladder_compare::oracle::{GradientOracle, Oracle};
use ladder_compare::results::Direction;
use ladder_kernels::DType;
use ladder_reference::{AttentionShape, TileSizes};

use crate::Failure;

/// Runs GPU `rung` (`"fa1"`, `"fa2"`, whose backward pass runs too, or `"fa3"` on Hopper) on a causal grouped-query
/// problem in fp16 and checks it against the float64 oracle. `Ok` without a GPU (after saying so);
/// an error when a kernel is outside its tolerance.
pub fn gpu_live(rung: &str) -> Result<(), Failure> {
    let gpu = match ladder_compare::gpu_check::open_gpu() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("No GPU on this machine ({e}).");
            println!(
                "The kernels are not run here; the next cell shows what they did on the H200."
            );
            return Ok(());
        }
    };
    let Some(forward) = GpuRung::find(rung, Direction::Fwd) else {
        return Err(Failure(format!("no GPU kernel for {rung:?}")));
    };
    if !forward.available_on(&gpu) {
        println!(
            "{} ({}) cannot run {rung}: it needs a Hopper GPU (sm_90a). The next cell shows what \
             it did on the H200.",
            gpu.name(),
            gpu.arch()
        );
        return Ok(());
    }
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let shape = AttentionShape::new(1, 8, 2, 500, 700, 64).map_err(|e| fail(&e))?;
    let tiles = TileSizes::new(64, 64).map_err(|e| fail(&e))?;
    let case = Case {
        shape,
        causal: true,
        window: Default::default(),
        logit_std: 1.0,
        tiles,
        splits: 1,
        seed: 2024,
    };
    let dtype = DType::F16;
    let x = gpu_check::device_inputs(&case, dtype);
    let (attention, opts) = gpu_check::options(&case.attention(), shape.d);
    println!(
        "{} ({}), fp16, batch 1, 8 query heads over 2 kv heads, n_q 500, n_kv 700, d 64, causal",
        gpu.name(),
        gpu.arch()
    );

    let (out, elapsed) =
        gpu_check::forward(&gpu, forward, &x, &opts, dtype).map_err(|e| fail(&e))?;
    let oracle = Oracle::new(&x, &attention).map_err(|e| fail(&e))?;
    let expected = gpu_check::expected_forward(&oracle, &x, dtype).map_err(|e| fail(&e))?;
    let verdict = expected.judge(&out);
    println!(
        "{rung} forward: O vs oracle {} (tolerance {}), {:.3} ms (first call includes compiling the kernel)",
        verdict.o,
        expected.o,
        elapsed.as_secs_f64() * 1e3
    );
    if !verdict.pass {
        return Err(Failure(format!("{rung} forward on the GPU is out of tolerance")));
    }
    if let Some(backward) = GpuRung::find(rung, Direction::Bwd) {
        let (grads, elapsed) =
            gpu_check::backward(&gpu, backward, &x, &opts, dtype).map_err(|e| fail(&e))?;
        let oracle = GradientOracle::new(&x, &attention).map_err(|e| fail(&e))?;
        let expected = gpu_check::expected_backward(&oracle, &x, dtype).map_err(|e| fail(&e))?;
        let (errs, pass) = expected.judge(&grads);
        println!(
            "{rung} backward: dQ {} dK {} dV {} vs oracle, {:.3} ms",
            errs[0],
            errs[1],
            errs[2],
            elapsed.as_secs_f64() * 1e3
        );
        if !pass {
            return Err(Failure(format!("{rung} backward on the GPU is out of tolerance")));
        }
    }
    println!("ok: within tolerance");
    Ok(())
}

/// FA3's FP8 path live on a Hopper GPU: the same inputs (with outliers: `N(0,1)` plus `N(0,100)` on
/// 0.1 % of the entries, d = 128) through `fa3-fp8-gpu` with and without incoherent processing,
/// each error against the float64 oracle beside the CPU `fa3-fp8` rung's on the same numbers, and
/// held to the FP8 tolerance. `Ok` without a Hopper GPU (after saying so).
pub fn gpu_live_fp8() -> Result<(), Failure> {
    use ladder_compare::RungConfig;
    use ladder_compare::oracle::Expected;
    use ladder_compare::rungs::Rung;
    use ladder_reference::Fp8Options;

    let gpu = match ladder_compare::gpu_check::open_gpu() {
        Ok(gpu) if GpuRung::Fa3Fp8.available_on(&gpu) => gpu,
        Ok(gpu) => {
            println!(
                "{} ({}) cannot run fa3-fp8: it needs a Hopper GPU (sm_90a).",
                gpu.name(),
                gpu.arch()
            );
            println!("The next cell shows what it did on the H200.");
            return Ok(());
        }
        Err(e) => {
            println!("No GPU on this machine ({e}). The next cell shows what it did on the H200.");
            return Ok(());
        }
    };
    let fail = |e: &dyn std::fmt::Display| Failure(e.to_string());
    let shape = AttentionShape::new(1, 4, 2, 1024, 1024, 128).map_err(|e| fail(&e))?;
    let tiles = TileSizes::new(128, 128).map_err(|e| fail(&e))?;
    let case = Case {
        shape,
        causal: false,
        window: Default::default(),
        logit_std: 1.0,
        tiles,
        splits: 1,
        seed: 7,
    };
    let dtype = DType::F16;
    let x = gpu_check::rounded(&case.inputs_with_outliers::<f64>(0.001, 10.0), dtype);
    let (attention, opts) = gpu_check::options(&case.attention(), shape.d);
    let oracle = Oracle::new(&x, &attention).map_err(|e| fail(&e))?;
    let x32 = gpu_check::narrow(&x);
    println!(
        "{} ({}), fp16 in, e4m3 products, batch 1, 4 query heads over 2 kv heads, n 1024, d 128, \
         inputs with outliers",
        gpu.name(),
        gpu.arch()
    );
    println!("{:<22} {:>14} {:>14} {:>12}", "", "GPU rel. L2", "CPU rel. L2", "tolerance");
    for (name, incoherent) in [("no rotation", None), ("incoherent processing", Some(7))] {
        let fp8 = Fp8Options { incoherent, ..RungConfig::default().fp8 };
        let (out, _) = gpu_check::forward_fp8(&gpu, GpuRung::Fa3Fp8, &x, &opts, dtype, &fp8)
            .map_err(|e| fail(&e))?;
        let tiles = gpu_check::fp8_cpu_tiles(&gpu, shape.d, shape.n_kv, Default::default())
            .map_err(|e| fail(&e))?;
        let config = RungConfig { attention, tiles, fp8, ..RungConfig::default() };
        let cpu = Rung::Fa3Fp8
            .forward(x32.q.view(), x32.k.view(), x32.v.view(), &config)
            .map_err(|e| fail(&e))?;
        let expected = Expected::fp8_from_oracle(&oracle, &x32, &fp8).map_err(|e| fail(&e))?;
        let verdict = expected.judge(&out);
        let cpu_err = ladder_compare::error(&cpu.o, &oracle.out.o).rel_l2;
        println!(
            "{name:<22} {:>14.3e} {:>14.3e} {:>12.3e}",
            verdict.o.rel_l2, cpu_err, expected.o.rel_l2
        );
        if !verdict.pass {
            return Err(Failure(format!("fa3-fp8 on the GPU ({name}) is out of tolerance")));
        }
    }
    println!("ok: within the FP8 tolerance (twice the error of per-tensor FP8 attention)");
    Ok(())
}
