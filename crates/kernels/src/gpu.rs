//! The device: one CUDA context and stream, the kernels compiled for it, and launch checking.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use crate::compile::{self, Compiled, Variant};
use crate::error::{KernelError, Result};
use crate::tensor::{DType, Tensor, encode};

/// A CUDA device with everything the kernels need.
///
/// ```no_run
/// let gpu = ladder_kernels::Gpu::new()?;
/// println!("{} ({}), {} SMs", gpu.name(), gpu.arch(), gpu.sm_count());
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    arch: String,
    sm_count: u32,
    max_smem_per_block: u32,
    functions: Mutex<HashMap<(Variant, &'static str), CudaFunction>>,
    poison_outputs: AtomicBool,
    sync_launches: AtomicBool,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("name", &self.name).field("arch", &self.arch).finish()
    }
}

impl Gpu {
    /// Open device 0 (or `$LADDER_DEVICE`). Fails with [`KernelError::NoCuda`] when no driver or
    /// device is found: never panics on a machine without CUDA.
    pub fn new() -> Result<Gpu> {
        let ordinal = match std::env::var("LADDER_DEVICE") {
            Ok(s) => s
                .parse()
                .map_err(|_| KernelError::NoCuda(format!("LADDER_DEVICE={s:?} is not a number")))?,
            Err(_) => 0,
        };
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::NoCuda(
                "the CUDA driver library (libcuda.so) is not installed".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| KernelError::NoCuda(format!("device {ordinal}: {e}")))?;
        // One stream, one order of work: the per-buffer events cudarc records for multi-stream
        // safety would only add launch overhead.
        // SAFETY: every tensor of this crate is used on the one stream below.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let name = ctx.name().map_err(KernelError::driver("reading the device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(KernelError::driver("reading the compute capability"))?;
        if major < 8 {
            return Err(KernelError::UnsupportedDevice { name, major, minor });
        }
        // Hopper's wgmma/setmaxnreg live in the architecture-specific sm_90a target.
        let arch = if (major, minor) == (9, 0) {
            "sm_90a".to_string()
        } else {
            format!("sm_{major}{minor}")
        };
        let attr = |a| ctx.attribute(a).map_err(KernelError::driver("reading a device attribute"));
        let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem_per_block =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            sm_count,
            max_smem_per_block,
            functions: Mutex::new(HashMap::new()),
            poison_outputs: AtomicBool::new(false),
            sync_launches: AtomicBool::new(std::env::var_os("LADDER_SYNC_LAUNCHES").is_some()),
        })
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The NVRTC target the kernels are compiled for, e.g. `sm_90a`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The CUDA driver version as `major.minor`.
    pub fn driver_version(&self) -> Result<String> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the driver library is loaded (a context exists) and `v` is valid for writes.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
            .result()
            .map_err(KernelError::driver("reading the driver version"))?;
        Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
    }

    /// The stream every kernel of this device runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Fill every output buffer with NaN before its kernel runs, so that an element the kernel
    /// forgets to write cannot pass a check. For tests; off by default.
    pub fn set_poison_outputs(&self, on: bool) {
        self.poison_outputs.store(on, Ordering::Relaxed);
    }

    /// Synchronise after every launch, so that an asynchronous fault is reported by the kernel
    /// that caused it (slower). Also on when `LADDER_SYNC_LAUNCHES` is set.
    pub fn set_sync_launches(&self, on: bool) {
        self.sync_launches.store(on, Ordering::Relaxed);
    }

    /// Wait for all queued work; reports any asynchronous error.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(KernelError::driver("synchronising the device"))
    }

    /// Upload `values` (row-major, `shape`) as `dtype`, rounding to nearest.
    pub fn upload(&self, values: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len: usize = shape.iter().product();
        if values.len() != len {
            return Err(KernelError::Shape(format!(
                "{} values given for shape {shape:?} ({len} elements)",
                values.len()
            )));
        }
        let bytes = encode(values, dtype);
        let data = self.stream.clone_htod(&bytes).map_err(KernelError::alloc(bytes.len()))?;
        Ok(Tensor { data, dtype, shape: shape.to_vec() })
    }

    /// Upload half-precision values as they are.
    pub fn upload_f16(&self, values: &[half::f16], shape: &[usize]) -> Result<Tensor> {
        let wide: Vec<f32> = values.iter().map(|x| x.to_f32()).collect();
        self.upload(&wide, shape, DType::F16)
    }

    /// A tensor of zeros.
    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let data = self.stream.alloc_zeros::<u8>(bytes).map_err(KernelError::alloc(bytes))?;
        Ok(Tensor { data, dtype, shape: shape.to_vec() })
    }

    /// A tensor a kernel is about to overwrite: uninitialised, or NaN when poisoning is on.
    pub(crate) fn output(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        // SAFETY: the buffer is either filled below or entirely written by the kernel it is made
        // for before anything reads it.
        let data = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(KernelError::alloc(bytes))?;
        let t = Tensor { data, dtype, shape: shape.to_vec() };
        if self.poison_outputs.load(Ordering::Relaxed) {
            self.fill_bytes(&t, 0xff)?;
        }
        Ok(t)
    }

    /// Set every byte of `t` to `byte` (0xff makes every element NaN).
    pub fn fill_bytes(&self, t: &Tensor, byte: u8) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let (ptr, _guard) = t.data.device_ptr(&self.stream);
        // SAFETY: ptr addresses t.bytes() bytes owned by `t`, on this stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(ptr, byte, t.bytes(), self.stream.cu_stream())
        }
        .map_err(KernelError::driver("filling a buffer"))
    }

    /// The function `entry` of `variant`, compiled (or loaded from the cache) on first use and
    /// allowed `dynamic_smem` bytes of dynamic shared memory.
    pub(crate) fn function(
        &self,
        variant: &Variant,
        entry: &'static str,
        dynamic_smem: u32,
    ) -> Result<CudaFunction> {
        if dynamic_smem > self.max_smem_per_block {
            return Err(KernelError::Compile {
                kernel: variant.label(),
                log: format!(
                    "needs {dynamic_smem} bytes of shared memory; {} allows {}",
                    self.name, self.max_smem_per_block
                ),
            });
        }
        let key = (variant.clone(), entry);
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(&key) {
            return Ok(f.clone());
        }
        let Compiled { cubin, .. } = compile::compile(variant, &self.arch)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(KernelError::driver(format!("loading {}", variant.label())))?;
        let f = module
            .load_function(entry)
            .map_err(KernelError::driver(format!("finding {entry} in {}", variant.label())))?;
        if dynamic_smem > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_smem as i32,
            )
            .map_err(KernelError::driver(format!("raising the shared memory of {entry}")))?;
        }
        functions.insert(key, f.clone());
        Ok(f)
    }

    /// Check a launch: the launch call's own result always; with sync launches on, also the
    /// kernel's completion.
    pub(crate) fn check_launch(
        &self,
        launched: std::result::Result<(), cudarc::driver::DriverError>,
        what: &str,
        cfg: &LaunchConfig,
    ) -> Result<()> {
        launched.map_err(KernelError::driver(format!("launching {what} with {cfg:?}")))?;
        if self.sync_launches.load(Ordering::Relaxed) {
            self.stream.synchronize().map_err(KernelError::driver(format!("running {what}")))?;
        }
        Ok(())
    }

    /// Milliseconds the GPU spends on `work`, measured with CUDA events around it.
    pub fn time_ms(&self, mut work: impl FnMut() -> Result<()>) -> Result<f32> {
        let err = KernelError::driver("timing with events");
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timed).map_err(KernelError::driver("creating an event"))?;
        let end = self.ctx.new_event(timed).map_err(KernelError::driver("creating an event"))?;
        start.record(&self.stream).map_err(KernelError::driver("recording an event"))?;
        work()?;
        end.record(&self.stream).map_err(KernelError::driver("recording an event"))?;
        end.synchronize().map_err(KernelError::driver("waiting for an event"))?;
        start.elapsed_ms(&end).map_err(err)
    }
}
