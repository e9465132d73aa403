//! The kernel crate's API on a real GPU: hostile input gives an `Err` (never a panic, a hang or a
//! wrong answer), a NaN reaches only the rows it should, buffers wrapped from cudarc work without
//! copies, and the deterministic backward is bitwise reproducible.
//!
//! Without a GPU these tests print a notice and pass; with `LADDER_REQUIRE_GPU=1` a missing GPU
//! fails them.

use half::f16;
use ladder_compare::GpuRung;
use ladder_compare::cases::pseudo_random;
use ladder_compare::gpu_check::shared_gpu;
use ladder_compare::gpu_rungs::{BackwardFn, ForwardFn};
use ladder_kernels::{DType, Gpu, KernelError, Options, Output, Tensor, Window, fa1, fa2, fa3};

fn gpu() -> Option<&'static Gpu> {
    shared_gpu("GPU API tests")
}

/// The tensor-core forward kernels that run on `gpu`: FA2, and FA3 on Hopper.
fn forwards(gpu: &Gpu) -> Vec<(&'static str, ForwardFn)> {
    let mut all: Vec<(&'static str, ForwardFn)> = vec![("fa2", fa2::forward)];
    if GpuRung::Fa3.available_on(gpu) {
        all.push(("fa3", fa3::forward));
    }
    all
}

fn tensor(gpu: &Gpu, shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    gpu.upload(&pseudo_random(seed, shape.iter().product()), shape, dtype).expect("upload")
}

#[test]
fn mismatched_dtypes_are_errors() {
    let Some(gpu) = gpu() else { return };
    let q = tensor(gpu, &[1, 2, 64, 64], DType::F16, 1);
    let k16 = tensor(gpu, &[1, 2, 64, 64], DType::F16, 2);
    let kb = tensor(gpu, &[1, 2, 64, 64], DType::BF16, 2);
    let q32 = tensor(gpu, &[1, 2, 64, 64], DType::F32, 1);
    let opts = Options::full();
    assert!(matches!(fa2::forward(gpu, &q, &kb, &k16, &opts), Err(KernelError::DType(_))));
    assert!(matches!(fa2::forward(gpu, &q, &k16, &kb, &opts), Err(KernelError::DType(_))));
    for (name, forward) in forwards(gpu) {
        assert!(matches!(forward(gpu, &q, &kb, &k16, &opts), Err(KernelError::DType(_))));
        let r = forward(gpu, &q32, &q32, &q32, &opts);
        assert!(
            matches!(r, Err(KernelError::UnsupportedDtype { rung, .. }) if rung == name),
            "{name}: {r:?}"
        );
    }
    if !GpuRung::Fa3.available_on(gpu) {
        let r = fa3::forward(gpu, &q, &k16, &k16, &opts);
        assert!(matches!(r, Err(KernelError::UnsupportedArch { rung: "fa3", .. })), "{r:?}");
    }
    // The backward's extra inputs: dO of the wrong dtype, lse of the wrong shape.
    let out = fa2::forward(gpu, &q, &k16, &k16, &opts).expect("forward");
    let d_o = tensor(gpu, &[1, 2, 64, 64], DType::BF16, 3);
    assert!(matches!(
        fa2::backward(gpu, &q, &k16, &k16, &out, &d_o, &opts),
        Err(KernelError::DType(_))
    ));
    let bad_lse = Output { o: tensor(gpu, &[1, 2, 64, 64], DType::F16, 4), lse: q32 };
    assert!(matches!(
        fa2::backward(gpu, &q, &k16, &k16, &bad_lse, &k16, &opts),
        Err(KernelError::Shape(_))
    ));
}

#[test]
fn mismatched_and_empty_shapes_are_errors() {
    let Some(gpu) = gpu() else { return };
    let t = |shape: &[usize]| tensor(gpu, shape, DType::F16, 5);
    let opts = Options::causal();
    let q = t(&[1, 4, 50, 64]);
    let cases: Vec<(&str, Tensor, Tensor, Tensor)> = vec![
        ("k and v lengths differ", t(&[1, 4, 50, 64]), t(&[1, 2, 50, 64]), t(&[1, 2, 49, 64])),
        ("head dims differ", t(&[1, 4, 50, 64]), t(&[1, 2, 50, 128]), t(&[1, 2, 50, 128])),
        ("batches differ", t(&[1, 4, 50, 64]), t(&[2, 2, 50, 64]), t(&[2, 2, 50, 64])),
        ("heads not a multiple", t(&[1, 4, 50, 64]), t(&[1, 3, 50, 64]), t(&[1, 3, 50, 64])),
        ("rank 3", t(&[4, 50, 64]), t(&[2, 50, 64]), t(&[2, 50, 64])),
        ("zero queries", t(&[1, 4, 0, 64]), t(&[1, 2, 50, 64]), t(&[1, 2, 50, 64])),
        ("zero keys", t(&[1, 4, 50, 64]), t(&[1, 2, 0, 64]), t(&[1, 2, 0, 64])),
        ("zero batch", t(&[0, 4, 50, 64]), t(&[0, 2, 50, 64]), t(&[0, 2, 50, 64])),
    ];
    for (what, q, k, v) in &cases {
        let results = [
            fa1::forward(gpu, q, k, v, &opts),
            fa2::forward(gpu, q, k, v, &opts),
            fa3::forward(gpu, q, k, v, &opts),
        ];
        for result in results {
            assert!(matches!(result, Err(KernelError::Shape(_))), "{what}: {result:?}");
        }
    }
    // dO of the wrong shape.
    let k = t(&[1, 2, 50, 64]);
    let out = fa2::forward(gpu, &q, &k, &k, &opts).expect("forward");
    let d_o = t(&[1, 4, 51, 64]);
    assert!(matches!(
        fa2::backward(gpu, &q, &k, &k, &out, &d_o, &opts),
        Err(KernelError::Shape(_))
    ));
    // A buffer whose length is not the shape's.
    let buf = gpu.stream().alloc_zeros::<f16>(10).expect("alloc");
    assert!(matches!(Tensor::from_cuda_slice(buf, &[1, 1, 3, 4]), Err(KernelError::Shape(_))));
}

/// The kernels take the row max on the raw scores (softmax.cuh, scaled_row_max): only a positive
/// scale keeps it, and a masked score times 0 or a negative scale is NaN or +inf. They also flush
/// subnormal numbers to 0 and multiply by scale · log2 e. Such a scale (0, negative, subnormal,
/// past f32::MAX / log2 e, or not finite) is an error from every forward and backward, never a NaN
/// output; the smallest normal scale gives finite outputs under the causal mask.
#[test]
fn scales_not_positive_and_finite_are_errors() {
    let Some(gpu) = gpu() else { return };
    let x = tensor(gpu, &[1, 2, 40, 64], DType::F16, 7);
    let rejected = [
        0.0,
        -0.125,
        -0.0,
        1e-40,
        f32::from_bits(1),
        f32::MAX,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let out = fa2::forward(gpu, &x, &x, &x, &Options::causal()).expect("forward");
    for scale in rejected {
        let opts = Options::causal().with_scale(scale);
        for (name, forward) in forwards(gpu) {
            let r = forward(gpu, &x, &x, &x, &opts);
            assert!(matches!(r, Err(KernelError::Shape(_))), "{name}, scale {scale}: {r:?}");
        }
        let r = fa1::forward(gpu, &x, &x, &x, &opts);
        assert!(matches!(r, Err(KernelError::Shape(_))), "fa1, scale {scale}: {r:?}");
        if GpuRung::Fa3.available_on(gpu) {
            let y = tensor(gpu, &[1, 2, 40, 128], DType::F16, 8);
            let r = fa3::fp8::forward(gpu, &y, &y, &y, &opts, &Default::default());
            assert!(matches!(r, Err(KernelError::Shape(_))), "fa3 fp8, scale {scale}: {r:?}");
        }
        let r = fa2::backward(gpu, &x, &x, &x, &out, &x, &opts);
        assert!(matches!(r, Err(KernelError::Shape(_))), "backward, scale {scale}: {r:?}");
    }
    // The smallest normal scale runs, and every output is finite.
    let opts = Options::causal().with_scale(f32::MIN_POSITIVE);
    for (name, forward) in forwards(gpu) {
        let out = forward(gpu, &x, &x, &x, &opts).expect("the smallest normal scale runs");
        let finite = |t: &Tensor| t.to_f32_vec().expect("copy").iter().all(|v| v.is_finite());
        assert!(finite(&out.o) && finite(&out.lse), "{name}: non-finite output at scale 2^-126");
    }
}

#[test]
fn unsupported_head_dims_are_errors() {
    let Some(gpu) = gpu() else { return };
    let t = |d: usize| tensor(gpu, &[1, 1, 20, d], DType::F16, 6);
    let opts = Options::full();
    // FA2 and FA3 take every multiple of 8 up to 256 (FA3's FP8 path multiples of 16), FA1 32,
    // 64 and 128.
    for d in [12, 100, 264] {
        let x = t(d);
        for (name, forward) in forwards(gpu) {
            let r = forward(gpu, &x, &x, &x, &opts);
            assert!(
                matches!(r, Err(KernelError::UnsupportedHeadDim { rung, .. }) if rung == name),
                "{name}: {r:?}"
            );
        }
    }
    if GpuRung::Fa3.available_on(gpu) {
        let r = fa3::fp8::forward(gpu, &t(72), &t(72), &t(72), &opts, &Default::default());
        assert!(matches!(r, Err(KernelError::UnsupportedHeadDim { rung: "fa3-fp8", d: 72, .. })));
    }
    let x = t(256);
    let r = fa1::forward(gpu, &x, &x, &x, &opts);
    assert!(matches!(r, Err(KernelError::UnsupportedHeadDim { rung: "fa1", d: 256, .. })));
    let out = fa2::forward(gpu, &x, &x, &x, &opts).expect("fa2 has d = 256 forward");
    let r = fa2::backward(gpu, &x, &x, &x, &out, &x, &opts);
    assert!(matches!(r, Err(KernelError::UnsupportedHeadDim { d: 256, .. })), "{r:?}");
}

#[test]
fn out_of_memory_is_an_error_and_the_gpu_stays_usable() {
    let Some(gpu) = gpu() else { return };
    // 2 TiB: more than any GPU has.
    let r = gpu.zeros(&[1 << 40], DType::F16);
    assert!(matches!(r, Err(KernelError::OutOfMemory { bytes }) if bytes == 2 << 40), "{r:?}");
    let r = gpu.upload(&[0.0; 3], &[1 << 62, 1 << 62], DType::F32);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    // Still usable: a forward pass runs and gives finite numbers.
    let x = tensor(gpu, &[1, 2, 100, 64], DType::F16, 7);
    let out = fa2::forward(gpu, &x, &x, &x, &Options::causal()).expect("forward after OOM");
    assert!(out.o.to_f32_vec().expect("copy").iter().all(|v| v.is_finite()));
}

/// The memory a call frees stays in the device's pool across a synchronisation
/// (`Gpu::keep_freed_memory`, set by `Gpu::with_config`), so the next call does not map it again.
#[test]
fn freed_memory_stays_in_the_pool() {
    use ladder_kernels::cudarc::driver::sys;
    let Some(gpu) = gpu() else { return };
    let attribute = |attr| -> u64 {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut value = 0u64;
        gpu.context().bind_to_thread().expect("bind");
        // SAFETY: the device's current pool, and a u64 for the two attributes read below.
        unsafe {
            sys::cuDeviceGetMemPool(&mut pool, gpu.context().cu_device()).result().expect("pool");
            sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast())
                .result()
                .expect("attribute");
        }
        value
    };
    use sys::CUmemPool_attribute::{
        CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    };
    assert_eq!(attribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), u64::MAX);
    // 256 MiB allocated, freed and synchronised: still reserved by the pool.
    let big = gpu.zeros(&[64 << 20], DType::F32).expect("256 MiB");
    drop(big);
    gpu.synchronize().expect("synchronize");
    let reserved = attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    assert!(reserved >= 256 << 20, "the pool kept {reserved} bytes");
}

/// Which query rows a NaN in row `j` of K or V reaches: every row that sees key `j`.
fn sees(i: usize, j: usize, n_q: usize, n_kv: usize, causal: bool) -> bool {
    !causal || j + n_q <= i + n_kv
}

#[test]
fn a_nan_reaches_only_the_rows_it_should() {
    let Some(gpu) = gpu() else { return };
    let (b, hq, hkv, n_q, n_kv, d) = (1, 4, 2, 150, 230, 64);
    let (qs, kvs) = ([b, hq, n_q, d], [b, hkv, n_kv, d]);
    let (q, k, v) = (
        pseudo_random(8, b * hq * n_q * d),
        pseudo_random(9, b * hkv * n_kv * d),
        pseudo_random(10, b * hkv * n_kv * d),
    );
    // (tensor, head, row, column) of the NaN; V only without the causal mask (see below).
    let spots =
        [(0, 3, 77, 5, true), (1, 1, 101, 9, true), (1, 0, 3, 0, false), (2, 1, 200, 17, false)];
    for ((tensor_ix, head, row, col, causal), (name, forward)) in
        spots.into_iter().flat_map(|spot| forwards(gpu).into_iter().map(move |f| (spot, f)))
    {
        let opts = if causal { Options::causal() } else { Options::full() };
        let run = |q: &[f32], k: &[f32], v: &[f32]| -> (Vec<f32>, Vec<f32>) {
            let up = |x: &[f32], s: &[usize]| gpu.upload(x, s, DType::F16).expect("upload");
            let out = forward(gpu, &up(q, &qs), &up(k, &kvs), &up(v, &kvs), &opts).expect(name);
            (out.o.to_f32_vec().expect("o"), out.lse.to_f32_vec().expect("lse"))
        };
        let clean = run(&q, &k, &v);
        let (mut q2, mut k2, mut v2) = (q.clone(), k.clone(), v.clone());
        let (target, heads, n) = match tensor_ix {
            0 => (&mut q2, hq, n_q),
            1 => (&mut k2, hkv, n_kv),
            _ => (&mut v2, hkv, n_kv),
        };
        target[((head) * n + row) * d + col] = f32::NAN;
        let _ = heads;
        let dirty = run(&q2, &k2, &v2);
        let group = hq / hkv;
        for h in 0..hq {
            for i in 0..n_q {
                let reached_row = match tensor_ix {
                    0 => h == head && i == row,
                    _ => h / group == head && sees(i, row, n_q, n_kv, causal),
                };
                for c in 0..d {
                    let at = (h * n_q + i) * d + c;
                    let reached = reached_row && (tensor_ix < 2 || c == col);
                    let (was, now) = (clean.0[at], dirty.0[at]);
                    if reached {
                        assert!(
                            now.is_nan(),
                            "{name}, tensor {tensor_ix}: O[{h},{i},{c}] = {now}, want NaN"
                        );
                    } else {
                        assert_eq!(
                            was.to_bits(),
                            now.to_bits(),
                            "{name}, tensor {tensor_ix}: O[{h},{i},{c}] changed"
                        );
                    }
                }
                let (was, now) = (clean.1[h * n_q + i], dirty.1[h * n_q + i]);
                if reached_row && tensor_ix < 2 {
                    assert!(
                        now.is_nan(),
                        "{name}, tensor {tensor_ix}: lse[{h},{i}] = {now}, want NaN"
                    );
                } else {
                    assert_eq!(
                        was.to_bits(),
                        now.to_bits(),
                        "{name}, tensor {tensor_ix}: lse[{h},{i}] changed"
                    );
                }
            }
        }
    }
}

#[test]
fn wrapped_cudarc_buffers_run_without_copies() {
    let Some(gpu) = gpu() else { return };
    let shape = [1, 2, 90, 64];
    let host: Vec<f16> =
        pseudo_random(11, shape.iter().product()).into_iter().map(f16::from_f32).collect();
    let slice = gpu.stream().clone_htod(&host).expect("copy");
    let q = Tensor::from_cuda_slice(slice, &shape).expect("wrap");
    let ours = gpu.upload_slice(&host, &shape).expect("upload");
    let opts = Options::causal();
    let a = fa2::forward(gpu, &q, &q, &q, &opts).expect("wrapped");
    let b = fa2::forward(gpu, &ours, &ours, &ours, &opts).expect("uploaded");
    assert_eq!(a.o.to_bytes().expect("a"), b.o.to_bytes().expect("b"));
    // Handed back as the same type; a different type is an error, not a reinterpretation.
    let back = q.into_cuda_slice::<f16>().expect("same type back");
    assert_eq!(back.len(), host.len());
    let o = a.o;
    assert!(matches!(o.into_cuda_slice::<f32>(), Err(KernelError::DType(_))));
    // A Gpu made from the same stream runs on it.
    let same = Gpu::from_stream(gpu.stream().clone(), gpu.config().clone()).expect("from_stream");
    let c = fa2::forward(&same, &ours, &ours, &ours, &opts).expect("from_stream forward");
    assert_eq!(c.o.to_bytes().expect("c"), b.o.to_bytes().expect("b"));
}

/// A borrowed buffer (a framework's, lent for one call) runs as an owned one does, is never
/// written or handed out, and outlives every tensor and view made from it.
#[test]
fn borrowed_buffers_run_and_are_left_to_their_owner() {
    let Some(gpu) = gpu() else { return };
    let (b, s, h, d) = (2, 70, 3, 64);
    let host: Vec<f16> = pseudo_random(12, b * s * h * d).into_iter().map(f16::from_f32).collect();
    let slice = gpu.stream().clone_htod(&host).expect("copy");
    // `[batch, seq, heads, d]` as `[batch, heads, seq, d]`, as candle lends it.
    let strides = [s * h * d, d, h * d, 1];
    let owned = Tensor::from_cuda_slice_strided(
        gpu.stream().clone_htod(&host).expect("copy"),
        &[b, h, s, d],
        &strides,
    )
    .expect("owned");
    let opts = Options::causal();
    let want = fa2::forward(gpu, &owned, &owned, &owned, &opts).expect("owned forward");
    for round in 0..3 {
        // SAFETY: `slice` outlives the tensor and its views (dropped at the end of the round).
        let q =
            unsafe { Tensor::from_borrowed_cuda_slice_strided(&slice, &[b, h, s, d], &strides) }
                .expect("borrow");
        assert!(q.is_borrowed());
        let k = q.view(0, &[b, h, s, d], &strides).expect("a view of it");
        let got = fa2::forward(gpu, &q, &k, &q, &opts).expect("borrowed forward");
        assert_eq!(
            got.o.to_bytes().expect("got"),
            want.o.to_bytes().expect("want"),
            "round {round}"
        );
        let mut k = k;
        assert!(matches!(gpu.fill_bytes(&mut k, 0xff), Err(KernelError::Shape(_))));
        drop(k);
        let mut q = q;
        assert!(matches!(gpu.fill_bytes(&mut q, 0xff), Err(KernelError::Shape(_))));
        assert!(matches!(q.into_cuda_slice::<f16>(), Err(KernelError::Shape(_))));
    }
    // Every borrowing tensor is gone; the owner's buffer is still there, unchanged.
    let back: Vec<f16> = gpu.stream().clone_dtoh(&slice).expect("the owner's buffer");
    assert_eq!(back, host);
    // A bad layout is an error before anything is borrowed.
    // SAFETY: `slice` outlives the call.
    let bad =
        unsafe { Tensor::from_borrowed_cuda_slice_strided(&slice, &[b, h, s, d + 1], &strides) };
    assert!(matches!(bad, Err(KernelError::Shape(_))));
}

/// Q, K and V as three views of one packed `[batch, seq, 3, heads, d]` projection (and of a fused
/// `[batch, seq, heads_q + 2·heads_kv, d]` one, GQA) give bitwise what three separate tensors
/// give, in every rung that takes strides, packed batches included; a shared buffer is never
/// written through.
#[test]
fn views_of_one_qkv_buffer_run_without_copies() {
    let Some(gpu) = gpu() else { return };
    let (b, s, h, d) = (2, 200, 4, 64);
    let host = pseudo_random(21, b * s * 3 * h * d);
    let qkv = gpu.upload(&host, &[b, s, 3, h, d], DType::F16).expect("upload");
    let views: Vec<Tensor> =
        (0..3).map(|i| qkv.select(2, i).and_then(|t| t.transpose(1, 2)).expect("view")).collect();
    // The same values copied out into tensors of their own, [b, h, s, d].
    let slot = |i: usize| -> Tensor {
        let v: Vec<f32> = (0..b * h * s * d)
            .map(|e| {
                let (bi, hi, si, c) = (e / (h * s * d), e / (s * d) % h, e / d % s, e % d);
                host[(((bi * s + si) * 3 + i) * h + hi) * d + c]
            })
            .collect();
        gpu.upload(&v, &[b, h, s, d], DType::F16).expect("upload slot")
    };
    let copies: Vec<Tensor> = (0..3).map(slot).collect();
    for (name, run) in forwards(gpu) {
        for opts in [Options::full(), Options::causal()] {
            let a = run(gpu, &views[0], &views[1], &views[2], &opts).expect("views");
            let c = run(gpu, &copies[0], &copies[1], &copies[2], &opts).expect("copies");
            assert_eq!(a.o.to_bytes().unwrap(), c.o.to_bytes().unwrap(), "{name} {opts:?}");
            assert_eq!(a.lse.to_bytes().unwrap(), c.lse.to_bytes().unwrap(), "{name} {opts:?}");
        }
    }
    let grads = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let out = fa2::forward(gpu, q, k, v, &Options::causal()).expect("forward");
        let g = fa2::backward(gpu, q, k, v, &out, &copies[0], &Options::causal().deterministic());
        let g = g.expect("backward");
        [g.dq, g.dk, g.dv].map(|t| t.to_bytes().unwrap())
    };
    assert_eq!(grads(&views[0], &views[1], &views[2]), grads(&copies[0], &copies[1], &copies[2]));
    // A fused GQA projection: 4 query heads, then 2 key and 2 value heads, per token.
    let fused = gpu.upload(&host[..b * s * 8 * d], &[b, s, 8, d], DType::F16).expect("upload");
    let part =
        |start, len| fused.narrow(2, start, len).and_then(|t| t.transpose(1, 2)).expect("narrow");
    let (q, k, v) = (part(0, 4), part(4, 2), part(6, 2));
    let own = |t: &Tensor| gpu.upload(&t.to_f32_vec().unwrap(), t.shape(), DType::F16).unwrap();
    for (name, run) in forwards(gpu) {
        let a = run(gpu, &q, &k, &v, &Options::causal()).expect("narrowed views");
        let c = run(gpu, &own(&q), &own(&k), &own(&v), &Options::causal()).expect("copies");
        assert_eq!(a.o.to_bytes().unwrap(), c.o.to_bytes().unwrap(), "{name} fused GQA");
    }
    // Packed variable-length batches take the views too: [total, 3, heads, d].
    let lens =
        ladder_kernels::varlen::SeqLens::from_lengths(gpu, &[150, 250], &[150, 250]).unwrap();
    let packed = gpu.upload(&host[..400 * 3 * h * d], &[400, 3, h, d], DType::F16).unwrap();
    let pv: Vec<Tensor> = (0..3).map(|i| packed.select(1, i).unwrap()).collect();
    let a = fa2::forward_varlen(gpu, &pv[0], &pv[1], &pv[2], &lens, &Options::causal()).unwrap();
    let c = fa2::forward_varlen(
        gpu,
        &own(&pv[0]),
        &own(&pv[1]),
        &own(&pv[2]),
        &lens,
        &Options::causal(),
    );
    assert_eq!(a.o.to_bytes().unwrap(), c.unwrap().o.to_bytes().unwrap(), "fa2 varlen views");
    // Views are checked, and a shared buffer is not written through or handed back.
    assert!(qkv.select(2, 3).unwrap_err().to_string().contains("select(2, 3)"));
    assert!(qkv.narrow(3, 3, 2).is_err());
    assert!(
        qkv.view(1, &[b * s * 3 * h * d], &[1])
            .unwrap_err()
            .to_string()
            .contains("past the buffer")
    );
    let mut shared = qkv.select(2, 0).unwrap();
    assert!(gpu.fill_bytes(&mut shared, 0).unwrap_err().to_string().contains("other views share"));
    drop(views);
    assert!(qkv.into_cuda_slice::<f16>().unwrap_err().to_string().contains("shared"));
}

/// The deterministic backward gives the same bits every run, on a shape with many key tiles and a
/// grid of thousands of blocks; the atomic one is reported (how often its bits differ), not
/// asserted: the order of its f32 additions depends on which blocks race. FA2's backward, and
/// FA3's on Hopper.
#[test]
fn deterministic_backward_is_bitwise_reproducible() {
    let Some(gpu) = gpu() else { return };
    check_deterministic(gpu, "fa2", fa2::forward, fa2::backward);
    if GpuRung::Fa3Backward.available_on(gpu) {
        check_deterministic(gpu, "fa3", fa3::forward, fa3::backward);
    }
}

fn check_deterministic(gpu: &Gpu, rung: &str, forward: ForwardFn, backward: BackwardFn) {
    let (b, hq, hkv, n, d) = (4, 16, 4, 2048, 128);
    let shape_q = [b, hq, n, d];
    let shape_kv = [b, hkv, n, d];
    let q = tensor(gpu, &shape_q, DType::BF16, 12);
    let k = tensor(gpu, &shape_kv, DType::BF16, 13);
    let v = tensor(gpu, &shape_kv, DType::BF16, 14);
    let d_o = tensor(gpu, &shape_q, DType::BF16, 15);
    for causal in [false, true] {
        let base = if causal { Options::causal() } else { Options::full() };
        let out = forward(gpu, &q, &k, &v, &base).expect("forward");
        let bits = |opts: &Options| -> [Vec<u8>; 3] {
            let g = backward(gpu, &q, &k, &v, &out, &d_o, opts).expect("backward");
            [&g.dq, &g.dk, &g.dv].map(|t| t.to_bytes().expect("copy"))
        };
        let runs = 5;
        let first = bits(&base.clone().deterministic());
        for run in 1..runs {
            let again = bits(&base.clone().deterministic());
            for (t, name) in ["dQ", "dK", "dV"].iter().enumerate() {
                assert!(
                    first[t] == again[t],
                    "{rung}, causal={causal}: deterministic {name} differs in run {run}"
                );
            }
        }
        let atomic_first = bits(&base);
        let differing = (1..runs).filter(|_| bits(&base)[0] != atomic_first[0]).count();
        eprintln!(
            "{rung} atomic dQ ({b}x{hq}/{hkv} heads, n = {n}, d = {d}, causal = {causal}): \
             {differing} of {} reruns differ bitwise from the first",
            runs - 1
        );
        // Both modes compute the same gradient: they agree to bf16 rounding.
        let to_f32 = |x: &[u8]| -> Vec<f32> {
            x.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        };
        let (det, atomic) = (to_f32(&first[0]), to_f32(&atomic_first[0]));
        let num: f64 = det.iter().zip(&atomic).map(|(a, b)| f64::from(a - b).powi(2)).sum();
        let den: f64 = det.iter().map(|a| f64::from(*a).powi(2)).sum();
        let rel = (num / den).sqrt();
        // Two roundings of the same f32 sum to bf16 (2^-8 relative each) bound the difference.
        assert!(
            rel < 2.0 * 2f64.powi(-8),
            "{rung}, causal={causal}: deterministic vs atomic dQ rel L2 {rel:e}"
        );
    }
}

/// A kernel compiled from edited text (`GpuConfig::kernel_source`) is what the rung launches: FA2's
/// forward with its rescale of O planted out (`acc *= alpha` made `acc *= 1`) fails the ladder's
/// check against the float64 oracle where the crate's own kernel passes it, and a `Gpu` without
/// the edit is unaffected. (What a learner's "fix the kernel" exercise rests on.)
#[test]
fn an_edited_kernel_is_the_one_that_runs() {
    use ladder_compare::gpu_check::{expected_forward, gpu_config_from_env};
    use ladder_compare::oracle::Oracle;
    use ladder_compare::{Case, gpu_check};
    let Some(gpu) = gpu() else { return };
    let original = ladder_kernels::kernel_source("fa2_forward").expect("the FA2 forward source");
    let rescale = "acc[mt][dt][e] *= alpha[mt][e / 2];";
    assert_eq!(original.matches(rescale).count(), 1, "the line the planted bug edits");
    let planted = original.replace(rescale, "acc[mt][dt][e] *= 1.f;");
    let config = gpu_config_from_env().expect("config").kernel_source("fa2_forward", planted);
    let edited = Gpu::with_config(config.expect("a known kernel file")).expect("a second Gpu");

    // Several K/V tiles, so that a row's running max moves after its first tile.
    let case = Case {
        shape: ladder_reference::AttentionShape::new(1, 2, 2, 200, 700, 64).unwrap(),
        causal: false,
        window: Default::default(),
        score_mod: None,
        mask_mod: None,
        logit_std: 2.0,
        tiles: ladder_reference::TileSizes::new(64, 64).unwrap(),
        splits: 1,
        seed: 3,
    };
    let x = gpu_check::device_inputs(&case, DType::F16);
    let (attention, opts) = gpu_check::options(&case.attention(), 64);
    let oracle = Oracle::new(&x, &attention).expect("oracle");
    let expected = expected_forward(&oracle, &x, DType::F16).expect("tolerance");
    let run = |gpu: &Gpu| gpu_check::forward(gpu, GpuRung::Fa2, &x, &opts, DType::F16).unwrap().0;
    let verdict = |gpu: &Gpu| expected.judge(&run(gpu));
    let ours = verdict(gpu);
    assert!(ours.pass, "the crate's kernel: O {}, lse {}", ours.o, ours.lse);
    let planted = verdict(&edited);
    assert!(!planted.pass, "the planted bug passed the check: O {}", planted.o);
    assert!(verdict(gpu).pass, "the shared Gpu still runs the crate's kernel");
    println!("planted bug (no rescale): O {} against the crate's {}", planted.o, ours.o);
}

/// A sliding window: the rungs that take none refuse it with an error naming them, and the
/// windowed kernels (FA2 forward and backward, FA3 forward 16-bit and FP8), given a window wider
/// than the sequences, compute bit for bit what the kernels without one do (the band only masks;
/// the tiles and their arithmetic are the same), causal or not.
#[test]
fn windows_are_refused_where_unsupported_and_a_full_window_changes_no_bit() {
    let Some(gpu) = gpu() else { return };
    let (n, d) = (200, 64);
    let q = tensor(gpu, &[2, 4, n, d], DType::F16, 21);
    let k = tensor(gpu, &[2, 2, n, d], DType::F16, 22);
    let v = tensor(gpu, &[2, 2, n, d], DType::F16, 23);
    let d_o = tensor(gpu, &[2, 4, n, d], DType::F16, 24);
    let window = Options::full().with_window(Window::new(8, 3));
    let refused = |rung: &str, r: Result<(), KernelError>| {
        assert!(
            matches!(&r, Err(KernelError::Shape(m)) if m.contains(rung) && m.contains("window")),
            "{rung} with a window: {r:?}"
        );
    };
    refused("fa1", fa1::forward(gpu, &q, &k, &v, &window).map(drop));
    let bytes = |t: &Tensor| t.to_bytes().expect("copy");
    if GpuRung::Fa3.available_on(gpu) {
        let out = fa2::forward(gpu, &q, &k, &v, &Options::full()).expect("forward");
        refused("fa3 backward", fa3::backward(gpu, &q, &k, &v, &out, &d_o, &window).map(drop));
        let fp8 = fa3::fp8::Fp8Options::default();
        for causal in [false, true] {
            let plain = if causal { Options::causal() } else { Options::full() };
            let wide = plain.clone().with_window(Window::new(2 * n, 2 * n));
            let a = fa3::forward(gpu, &q, &k, &v, &plain).expect("fa3 forward");
            let b = fa3::forward(gpu, &q, &k, &v, &wide).expect("fa3 windowed forward");
            assert!(bytes(&a.o) == bytes(&b.o) && bytes(&a.lse) == bytes(&b.lse), "fa3 {causal}");
            let a = fa3::fp8::forward(gpu, &q, &k, &v, &plain, &fp8).expect("fa3-fp8 forward");
            let b = fa3::fp8::forward(gpu, &q, &k, &v, &wide, &fp8).expect("fa3-fp8 windowed");
            assert!(bytes(&a.o) == bytes(&b.o) && bytes(&a.lse) == bytes(&b.lse), "fp8 {causal}");
        }
    }
    for causal in [false, true] {
        let plain = if causal { Options::causal() } else { Options::full() }.deterministic();
        let wide = plain.clone().with_window(Window::new(2 * n, 2 * n));
        let (a, b) = (
            fa2::forward(gpu, &q, &k, &v, &plain).expect("forward"),
            fa2::forward(gpu, &q, &k, &v, &wide).expect("windowed forward"),
        );
        assert!(bytes(&a.o) == bytes(&b.o) && bytes(&a.lse) == bytes(&b.lse), "causal {causal}");
        let ga = fa2::backward(gpu, &q, &k, &v, &a, &d_o, &plain).expect("backward");
        let gb = fa2::backward(gpu, &q, &k, &v, &b, &d_o, &wide).expect("windowed backward");
        for (name, x, y) in [("dQ", &ga.dq, &gb.dq), ("dK", &ga.dk, &gb.dk), ("dV", &ga.dv, &gb.dv)]
        {
            assert!(bytes(x) == bytes(y), "causal {causal}: windowed {name} differs");
        }
    }
}
