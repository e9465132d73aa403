//! The device: one CUDA context and stream, the kernels compiled for it, and the one way kernels
//! are launched (a parameter struct, checked, named).

use std::any::Any;
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use std::path::PathBuf;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::compile::{self, CompileSettings, Compiled, Variant};
use crate::error::{KernelError, Result};
use crate::tensor::{DType, Element, Tensor, elements};

/// One entry point of one compiled variant.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    pub variant: Variant,
    pub entry: &'static str,
}

/// Where compiled kernels are cached on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KernelCache {
    /// The platform's cache folder (`~/.cache/attention-ladder/kernels` on Linux).
    #[default]
    Default,
    /// This folder.
    Dir(PathBuf),
    /// No disk cache: every process compiles the kernels it uses once.
    Off,
}

impl KernelCache {
    /// The folder this cache uses, if any.
    pub fn dir(&self) -> Option<PathBuf> {
        match self {
            KernelCache::Default => {
                dirs::cache_dir().map(|d| d.join("attention-ladder").join("kernels"))
            }
            KernelCache::Dir(d) => Some(d.clone()),
            KernelCache::Off => None,
        }
    }
}

/// How a [`Gpu`] is opened and how it compiles and launches kernels.
///
/// The library reads no environment variables: every knob is here (the `ladder` CLI maps its
/// `LADDER_*` variables onto these fields).
///
/// ```no_run
/// use ladder_kernels::{Gpu, GpuConfig, KernelCache, fa2::ForwardTiles};
///
/// let gpu = Gpu::with_config(
///     GpuConfig::new()
///         .device(0)
///         .sync_launches(true) // report asynchronous faults at the launch that caused them
///         .kernel_cache(KernelCache::Off)
///         .tune(ForwardTiles::new(2, 64, 4)?), // the FA2 forward's tiles, for every head dim
/// )?;
/// # Ok::<(), ladder_kernels::KernelError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct GpuConfig {
    device: usize,
    sync_launches: bool,
    poison_outputs: bool,
    nvrtc_options: Vec<String>,
    kernel_cache: KernelCache,
    no_programmatic_launch: bool,
    release_freed_memory: bool,
    /// The rungs' knobs ([`GpuConfig::tune`]), at most one of each type.
    tuning: Vec<Arc<dyn AnyTuning>>,
    /// Kernel files compiled from other text ([`GpuConfig::kernel_source`]).
    sources: Vec<(&'static str, SourceText)>,
}

/// A kernel file's replacement text, shown by its size in a configuration's `Debug` output
/// rather than in full.
#[derive(Clone)]
struct SourceText(Arc<str>);

impl Debug for SourceText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{} bytes of edited source>", self.0.len())
    }
}

/// A tuning knob of one rung, carried by a [`GpuConfig`] ([`GpuConfig::tune`]) and read back by
/// that rung ([`GpuConfig::tuned`]) in place of its tuned default. The rungs define their own
/// knob types, so the device knows none of them (and imports no rung).
pub trait Tuning: Any + Copy + Debug + Send + Sync {}

/// A [`Tuning`] of any type, so that one configuration holds the knobs of every rung.
trait AnyTuning: Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;
}

impl<T: Tuning> AnyTuning for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl GpuConfig {
    /// Device 0, asynchronous launches, no poisoning, the default kernel cache and tiles.
    pub fn new() -> GpuConfig {
        GpuConfig::default()
    }

    /// The CUDA device ordinal to open.
    pub fn device(mut self, ordinal: usize) -> GpuConfig {
        self.device = ordinal;
        self
    }

    /// Synchronise after every launch, so that an asynchronous fault is reported by the kernel
    /// that caused it (slower; for debugging and tests).
    pub fn sync_launches(mut self, on: bool) -> GpuConfig {
        self.sync_launches = on;
        self
    }

    /// Fill every output buffer with NaN before its kernel runs, so that an element a kernel
    /// forgets to write cannot pass a check (for tests).
    pub fn poison_outputs(mut self, on: bool) -> GpuConfig {
        self.poison_outputs = on;
        self
    }

    /// Extra NVRTC options for every kernel (e.g. `-lineinfo`, or a `-D` for an experiment); part
    /// of the disk cache's key like every other option.
    pub fn nvrtc_options<S: Into<String>>(
        mut self,
        options: impl IntoIterator<Item = S>,
    ) -> GpuConfig {
        self.nvrtc_options = options.into_iter().map(Into::into).collect();
        self
    }

    /// Where compiled kernels are cached.
    pub fn kernel_cache(mut self, cache: KernelCache) -> GpuConfig {
        self.kernel_cache = cache;
        self
    }

    /// A rung's tuning knob (`Tuning`): tiles, a schedule, a pipeline depth, in place of the
    /// rung's tuned choice, for tuning experiments and ablations. Each rung defines its own:
    /// [`crate::fa2::ForwardTiles`], [`crate::fa3::Fa3Tiles`], [`crate::fa3::Schedule`],
    /// [`crate::fa3::L2Section`], [`crate::decode::Stages`]. Setting one again replaces it.
    pub fn tune<T: Tuning>(mut self, knob: T) -> GpuConfig {
        self.tuning.retain(|t| !t.as_any().is::<T>());
        self.tuning.push(Arc::new(knob));
        self
    }

    /// The knob of type `T` set with [`GpuConfig::tune`], if any (what the rung that owns `T`
    /// reads in place of its default).
    pub fn tuned<T: Tuning>(&self) -> Option<T> {
        self.tuning.iter().find_map(|t| t.as_any().downcast_ref::<T>().copied())
    }

    /// Compile the kernel file `file` (one of [`crate::KERNEL_FILES`], e.g.
    /// `"fa2_forward"`) from `source` instead of the crate's own text
    /// ([`crate::kernel_source`]): every rung that launches it then runs the edit with
    /// its own checks, launch and tests — change a kernel and run the suite on it. The edit must
    /// keep the file's entry points and parameter struct (the host launches them as before). Set
    /// again for the same file, it replaces the earlier text. An unknown file is an error.
    ///
    /// ```no_run
    /// use ladder_kernels::{Gpu, GpuConfig, kernel_source};
    ///
    /// let original = kernel_source("fa2_forward").expect("a kernel file");
    /// // The online softmax's rescale of O, planted out (a bug for the checks to catch).
    /// let edited = original.replace("*= alpha[mt][e / 2];", "*= 1.f;");
    /// let gpu = Gpu::with_config(GpuConfig::new().kernel_source("fa2_forward", edited)?)?;
    /// # Ok::<(), ladder_kernels::KernelError>(())
    /// ```
    pub fn kernel_source(mut self, file: &str, source: impl Into<String>) -> Result<GpuConfig> {
        let Some(&file) = crate::KERNEL_FILES.iter().find(|&&f| f == file) else {
            return Err(KernelError::Config(format!(
                "kernel_source: no kernel file {file:?} (the files: {})",
                crate::KERNEL_FILES.join(", ")
            )));
        };
        self.sources.retain(|(f, _)| *f != file);
        self.sources.push((file, SourceText(Arc::from(source.into()))));
        Ok(self)
    }

    /// How kernels are compiled under this configuration: its NVRTC options and cache folder.
    pub(crate) fn compile_settings(&self) -> CompileSettings {
        CompileSettings {
            extra_options: self.nvrtc_options.clone(),
            cache_dir: self.kernel_cache.dir(),
        }
    }

    /// The text `file` is compiled from where [`GpuConfig::kernel_source`] replaced it.
    pub fn kernel_source_of(&self, file: &str) -> Option<&str> {
        self.sources.iter().find(|(f, _)| *f == file).map(|(_, s)| &*s.0)
    }

    /// Launch the decoding kernel with programmatic dependent launch (Hopper and later; on by
    /// default there, ignored before). The kernel may then start while the kernel before it in
    /// the stream finishes, and waits (`griddepcontrol.wait`) before its first read of memory;
    /// results are the same either way. It starts early only where that kernel lets it (calls
    /// `griddepcontrol.launch_dependents`, as the decoding kernel does): back-to-back decoding
    /// calls overlap one's launch with the other's tail; after an ordinary kernel it starts when
    /// that one completes, as without. Off: an ordinary launch (for measuring what it gains).
    pub fn programmatic_launch(mut self, on: bool) -> GpuConfig {
        self.no_programmatic_launch = !on;
        self
    }

    /// Give memory the kernels free back to the system at every synchronisation (the CUDA
    /// driver's default), instead of keeping it in the device's memory pool for the next call
    /// (what [`Gpu::with_config`] sets otherwise: [`Gpu::keep_freed_memory`]). On: every call
    /// maps its temporaries afresh, which the GPU waits for.
    pub fn release_freed_memory(mut self, on: bool) -> GpuConfig {
        self.release_freed_memory = on;
        self
    }
}

/// The `N` comma-separated counts of a tile specification such as `2,64,4` (spaces allowed), or
/// `None` when the text is not exactly that: what `ForwardTiles` and `Fa3Tiles` parse, each
/// checking the counts and naming its own format in the error.
pub(crate) fn parse_counts<const N: usize>(spec: &str) -> Option<[usize; N]> {
    let parts: Vec<Option<usize>> = spec.split(',').map(|x| x.trim().parse().ok()).collect();
    let parts: Vec<usize> = parts.into_iter().collect::<Option<_>>()?;
    parts.try_into().ok()
}

/// A CUDA device (one context and stream) with the kernels compiled for it.
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
    max_smem_per_block: usize,
    /// Whether [`Gpu::launch_programmatic`] sets programmatic stream serialisation (sm_90+).
    programmatic: bool,
    config: GpuConfig,
    compile: CompileSettings,
    functions: Mutex<HashMap<(Variant, &'static str), CudaFunction>>,
    poison_outputs: AtomicBool,
    sync_launches: AtomicBool,
    /// Memory the kernels reuse from call to call ([`Gpu::with_scratch`]).
    scratch: Mutex<ScratchBuffers>,
    /// Device copies of the modifiers' small tables ([`Gpu::table`]), each with the host `Arc`
    /// it copies.
    tables: Mutex<Vec<DeviceTable>>,
}

/// A host table (held weakly: its owner decides how long it lives) and its device copy.
type DeviceTable = (Weak<[f32]>, CudaSlice<f32>);

/// Elements the scratch buffers grow by ([`Gpu::with_scratch`]): calls of nearby sizes share a
/// buffer without reallocating, and a large one costs at most this much more than it needs.
const SCRATCH_GRANULE: usize = 1 << 16;

/// The buffers behind [`Gpu::with_scratch`], allocated when first needed.
#[derive(Default)]
struct ScratchBuffers {
    counters: Option<CudaSlice<u32>>,
    floats: Option<CudaSlice<f32>>,
}

/// Device addresses of the scratch memory [`Gpu::with_scratch`] lends to a launch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scratch {
    /// `u32` counters, zero.
    pub counters: u64,
    /// `f32` workspace.
    pub floats: u64,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("name", &self.name).field("arch", &self.arch).finish()
    }
}

impl Gpu {
    /// Open device 0 with the default configuration. Fails with [`KernelError::NoCuda`] when no
    /// driver or device is found: never panics on a machine without CUDA.
    pub fn new() -> Result<Gpu> {
        Gpu::with_config(GpuConfig::default())
    }

    /// Open the device `config` names, on its default stream.
    pub fn with_config(config: GpuConfig) -> Result<Gpu> {
        if !crate::driver_library_present() {
            return Err(KernelError::NoCuda(
                "the CUDA driver library (libcuda.so) is not installed".into(),
            ));
        }
        let ordinal = config.device;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| KernelError::NoCuda(format!("device {ordinal}: {e}")))?;
        // One stream, one order of work: the per-buffer events cudarc records for multi-stream
        // safety would only add launch overhead.
        // SAFETY: with tracking off nothing orders two streams of this context, so every launch
        // checks that its tensors were made on the one stream below (`check_context`), and
        // `context()` / `stream()` say so to callers who make their own buffers.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let release = config.release_freed_memory;
        let gpu = Gpu::open(stream, config)?;
        if !release {
            gpu.keep_freed_memory()?;
        }
        Ok(gpu)
    }

    /// Keep the memory that buffers free in the device's memory pool, for the next allocations
    /// to reuse, rather than giving it back to the system at the next synchronisation (the
    /// driver's default release threshold, 0). The rungs allocate their outputs and temporaries
    /// at each call (a backward pass at n = 16k, 16 heads, d = 128: 670 MB of f32 accumulators);
    /// given back at every synchronisation, each call maps them again while the GPU waits — about
    /// a millisecond, as long as a whole masked backward. [`Gpu::with_config`] calls this (unless
    /// [`GpuConfig::release_freed_memory`]); a [`Gpu::from_stream`] leaves a framework's pool as
    /// it set it, and may call this. The setting is the device's, for every context of the
    /// process; PyTorch's caching allocator keeps freed memory likewise.
    pub fn keep_freed_memory(&self) -> Result<()> {
        use cudarc::driver::sys;
        let failed = || KernelError::driver("keeping the memory pool's freed memory");
        self.ctx.bind_to_thread().map_err(KernelError::driver("binding the context"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut keep = u64::MAX;
        // SAFETY: `pool` receives the device's current pool, and the attribute's value is the
        // u64 the driver reads for the release threshold.
        unsafe {
            sys::cuDeviceGetMemPool(&mut pool, self.ctx.cu_device()).result().map_err(failed())?;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
            .result()
            .map_err(failed())?;
        }
        Ok(())
    }

    /// Use a stream you already have (from cudarc, or a framework built on it): the kernels run on
    /// it, in order with your other work, on buffers you wrap with [`Tensor::from_cuda_slice`].
    /// The context's event tracking is left as you set it. `config.device` is ignored.
    pub fn from_stream(stream: Arc<CudaStream>, config: GpuConfig) -> Result<Gpu> {
        Gpu::open(stream, config)
    }

    fn open(stream: Arc<CudaStream>, config: GpuConfig) -> Result<Gpu> {
        let ctx = stream.context().clone();
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
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as usize;
        let compile = config.compile_settings();
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            sm_count,
            max_smem_per_block,
            programmatic: major >= 9 && !config.no_programmatic_launch,
            compile,
            functions: Mutex::new(HashMap::new()),
            poison_outputs: AtomicBool::new(config.poison_outputs),
            sync_launches: AtomicBool::new(config.sync_launches),
            scratch: Mutex::new(ScratchBuffers::default()),
            tables: Mutex::new(Vec::new()),
            config,
        })
    }

    /// Whether the decoding kernel is launched programmatically on this device
    /// ([`GpuConfig::programmatic_launch`], and an sm_90+ device).
    pub fn programmatic_launches(&self) -> bool {
        self.programmatic
    }

    /// The configuration this device was opened with.
    pub fn config(&self) -> &GpuConfig {
        &self.config
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The NVRTC target the kernels are compiled for, e.g. `sm_90a`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The most dynamic shared memory one block may opt in to, in bytes (227 KiB on Hopper, 163 KiB
    /// on the A100, 99 KiB on sm_86, sm_89 and sm_120).
    pub fn max_shared_memory_per_block(&self) -> usize {
        self.max_smem_per_block
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The newest CUDA version the installed driver supports, as `major.minor` (e.g. `13.0`;
    /// `cuDriverGetVersion`). This is not the driver's own release number (e.g. 580.95).
    pub fn cuda_version(&self) -> Result<String> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the driver library is loaded (a context exists) and `v` is valid for writes.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
            .result()
            .map_err(KernelError::driver("reading the driver version"))?;
        Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
    }

    /// The stream every kernel of this device runs on (hand it to cudarc for your own work). A
    /// `Gpu` from [`Gpu::new`] / [`Gpu::with_config`] turns its context's event tracking off, so
    /// buffers it is given must be made on this stream (a launch checks it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (see [`Gpu::stream`] for which streams its buffers may come from).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Fill every output buffer with NaN before its kernel runs, so that an element the kernel
    /// forgets to write cannot pass a check. For tests; off by default.
    pub fn set_poison_outputs(&self, on: bool) {
        self.poison_outputs.store(on, Ordering::Relaxed);
    }

    /// Synchronise after every launch, so that an asynchronous fault is reported by the kernel
    /// that caused it (slower).
    pub fn set_sync_launches(&self, on: bool) {
        self.sync_launches.store(on, Ordering::Relaxed);
    }

    /// Wait for all queued work; reports any asynchronous error.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(KernelError::driver("synchronising the device"))
    }

    /// Upload `values` (row-major, `shape`) as `dtype`, rounding to nearest.
    pub fn upload(&self, values: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len = elements(shape)?;
        if values.len() != len {
            return Err(KernelError::Shape(format!(
                "{} values given for shape {shape:?} ({len} elements)",
                values.len()
            )));
        }
        match dtype {
            DType::F32 => self.upload_slice(values, shape),
            DType::F16 => {
                let h: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
                self.upload_slice(&h, shape)
            }
            DType::BF16 => {
                let h: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                self.upload_slice(&h, shape)
            }
        }
    }

    /// Upload elements as they are (`half::f16`, `half::bf16` or `f32`).
    pub fn upload_slice<T: Element>(&self, values: &[T], shape: &[usize]) -> Result<Tensor> {
        let len = elements(shape)?;
        if values.len() != len {
            return Err(KernelError::Shape(format!(
                "{} values given for shape {shape:?} ({len} elements)",
                values.len()
            )));
        }
        let bytes = len * T::DTYPE.size();
        let data = if len == 0 {
            self.stream.null::<T>().map_err(KernelError::alloc(0))?
        } else {
            self.stream.clone_htod(values).map_err(KernelError::alloc(bytes))?
        };
        Tensor::from_cuda_slice(data, shape)
    }

    /// The device address of a small `f32` table (ALiBi's slopes, the attention sinks, a score
    /// modifier's table), copied on its first use and kept while the host's `Arc` lives: a
    /// decoding step at batch 1 lasts a few microseconds, about what uploading a few hundred
    /// bytes per call costs. The host table is immutable and alive, so an address match is the
    /// same table; the copies of dropped tables are freed on the next call (stream-ordered, after
    /// the launches that read them). An empty table gets one zero, which no in-bounds index reads.
    pub(crate) fn table(&self, values: &Arc<[f32]>) -> Result<u64> {
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        tables.retain(|(host, _)| host.strong_count() > 0);
        let at = tables
            .iter()
            .position(|(host, _)| std::ptr::addr_eq(host.as_ptr(), Arc::as_ptr(values)));
        let at = match at {
            Some(at) => at,
            None => {
                let data: &[f32] = if values.is_empty() { &[0.0] } else { values };
                let copy = self
                    .stream
                    .clone_htod(data)
                    .map_err(KernelError::alloc(std::mem::size_of_val(data)))?;
                tables.push((Arc::downgrade(values), copy));
                tables.len() - 1
            }
        };
        let (ptr, _guard) = tables[at].1.device_ptr(&self.stream);
        Ok(ptr)
    }

    /// A tensor of zeros.
    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let mut t = self.alloc(shape, dtype)?;
        self.fill_bytes(&mut t, 0)?;
        Ok(t)
    }

    /// An uninitialised tensor (its contents are whatever the memory held).
    fn alloc(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        fn typed<T: Element>(stream: &Arc<CudaStream>, shape: &[usize]) -> Result<Tensor> {
            let len = elements(shape)?;
            let bytes = len.saturating_mul(T::DTYPE.size());
            let data = if len == 0 {
                stream.null::<T>().map_err(KernelError::alloc(0))?
            } else {
                // SAFETY: callers either fill the buffer or hand it to a kernel that writes all
                // of it before anything reads it.
                unsafe { stream.alloc::<T>(len) }.map_err(KernelError::alloc(bytes))?
            };
            Tensor::from_cuda_slice(data, shape)
        }
        match dtype {
            DType::F16 => typed::<half::f16>(&self.stream, shape),
            DType::BF16 => typed::<half::bf16>(&self.stream, shape),
            DType::F32 => typed::<f32>(&self.stream, shape),
        }
    }

    /// A tensor a kernel is about to overwrite: uninitialised, or NaN when poisoning is on.
    pub(crate) fn output(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let mut t = self.alloc(shape, dtype)?;
        if self.poison_outputs.load(Ordering::Relaxed) {
            self.fill_bytes(&mut t, 0xff)?;
        }
        Ok(t)
    }

    /// A tensor of `like`'s shape for a kernel to overwrite ([`Gpu::output`]), its axes in the
    /// order of `like`'s strides with no gaps: the output of a `[batch, seq, heads, d]` input is
    /// `[batch, seq, heads, d]` in memory too.
    pub(crate) fn output_like(&self, like: &Tensor, dtype: DType) -> Result<Tensor> {
        self.output_in_order(like.shape(), &memory_order(like), dtype)
    }

    /// A tensor of `shape` for a kernel to overwrite, with no gaps, its axes laid out in memory
    /// in `order` (outermost first; [`memory_order`]).
    pub(crate) fn output_in_order(
        &self,
        shape: &[usize],
        order: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let in_memory: Vec<usize> = order.iter().map(|&a| shape[a]).collect();
        let mut t = self.output(&in_memory, dtype)?;
        let dense = t.strides.clone();
        for (position, &axis) in order.iter().enumerate() {
            t.shape[axis] = in_memory[position];
            t.strides[axis] = dense[position];
        }
        Ok(t)
    }

    /// Set every byte of `t`'s buffer to `byte` (0xff makes every element NaN); fails for a buffer
    /// other views share ([`Tensor::view`]).
    pub fn fill_bytes(&self, t: &mut Tensor, byte: u8) -> Result<()> {
        self.check_context(t, "fill_bytes")?;
        if t.buffer_len() == 0 {
            return Ok(());
        }
        let bytes = t.buffer_len() * t.dtype().size();
        let before = (t.offset() * t.dtype().size()) as u64; // a view's first element's offset
        let (ptr, _guard) = t.write_ptr(&self.stream)?;
        // SAFETY: ptr − before is the start of the `bytes` bytes of the buffer `t` alone holds
        // (write_ptr fails for a shared one), on this stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                ptr - before,
                byte,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(KernelError::driver("filling a buffer"))
    }

    /// Fails with [`KernelError::Device`] unless `t` lives in this device's context and, when the
    /// context does not track events (a `Gpu` opened by [`Gpu::new`] / [`Gpu::with_config`]), was
    /// made on this `Gpu`'s stream: nothing would order another stream's writes before our reads.
    pub(crate) fn check_context(&self, t: &Tensor, name: &str) -> Result<()> {
        self.check_stream(t.stream(), name)
    }

    /// [`Gpu::check_context`] for any buffer, given the stream it was made on.
    pub(crate) fn check_stream(&self, stream: &Arc<CudaStream>, name: &str) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(KernelError::Device(format!(
                "{name} lives in another CUDA context than this Gpu ({})",
                self.name
            )));
        }
        if !self.ctx.is_event_tracking() && stream.cu_stream() != self.stream.cu_stream() {
            return Err(KernelError::Device(format!(
                "{name} was made on another stream of a context without event tracking; make it \
                 on gpu.stream(), or use Gpu::from_stream on a context that tracks events"
            )));
        }
        Ok(())
    }

    /// The function `entry` of `variant`, compiled (or loaded from the cache) on first use and
    /// allowed `dynamic_smem` bytes of dynamic shared memory.
    fn function(&self, kernel: &Kernel, dynamic_smem: usize) -> Result<CudaFunction> {
        let Kernel { variant, entry } = kernel;
        if dynamic_smem > self.max_smem_per_block {
            return Err(KernelError::SharedMemory {
                kernel: format!("{entry} in {}", variant.label()),
                needed: dynamic_smem,
                limit: self.max_smem_per_block,
                device: self.name.clone(),
            });
        }
        let key = (variant.clone(), *entry);
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(&key) {
            return Ok(f.clone());
        }
        let source = self.config.kernel_source_of(variant.file).unwrap_or(variant.source);
        let Compiled { cubin, .. } =
            compile::compile_source(variant, source, &self.arch, &self.compile)?;
        let module =
            self.ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| KernelError::Compile {
                kernel: variant.label(),
                log: format!("the driver could not load the compiled module: {e}"),
            })?;
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

    /// Run `launch` with scratch memory that lives from call to call instead of being allocated
    /// per call (an allocation and a free cost the host microseconds, a sizeable share of a
    /// decoding step): at least `counters` `u32` counters that are zero, and that its kernels must
    /// leave zero (the decoding kernel's last block per group resets its count), and at least
    /// `floats` `f32` of workspace whose contents do not outlive the call (NaN first when outputs
    /// are poisoned, so that a kernel reading what no kernel wrote fails its tests). Calls on this
    /// `Gpu` follow each other in stream order: a kernel launched programmatically
    /// ([`Gpu::launch_programmatic`]) may start during the previous call's tail, but waits for it
    /// to finish before it touches memory, so one call never sees the next's use of a buffer; the
    /// lock, held for the launches, keeps two threads sharing this `Gpu` from freeing a buffer
    /// under each other's launches. Buffers grow in steps of [`SCRATCH_GRANULE`] elements and
    /// shrink only with [`Gpu::release_scratch`]. A buffer that grows is freed in stream order,
    /// after the work queued before it, so these calls are not for CUDA-graph capture (a graph
    /// would keep the old address).
    pub(crate) fn with_scratch<R>(
        &self,
        counters: usize,
        floats: usize,
        launch: impl FnOnce(Scratch) -> Result<R>,
    ) -> Result<R> {
        let mut held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let ScratchBuffers { counters: c, floats: f } = &mut *held;
        let (c, f) = (self.grown(c, counters)?, self.grown(f, floats)?);
        if self.poison_outputs.load(Ordering::Relaxed) {
            let (ptr, _guard) = f.device_ptr_mut(&self.stream);
            // SAFETY: ptr addresses at least `floats` f32 owned by `f`, on this stream.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    ptr,
                    0xff,
                    4 * floats,
                    self.stream.cu_stream(),
                )
            }
            .map_err(KernelError::driver("poisoning the workspace"))?;
        }
        let (counters, _g0) = c.device_ptr_mut(&self.stream);
        let (floats, _g1) = f.device_ptr_mut(&self.stream);
        launch(Scratch { counters, floats })
    }

    /// Free the scratch memory the decoding kernels keep from call to call (their workspaces grow
    /// with the largest call so far: batch × query heads × new tokens × splits × (d + 1) floats).
    /// The next call allocates what it needs again.
    pub fn release_scratch(&self) {
        let mut held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        *held = ScratchBuffers::default();
    }

    /// `slot`'s buffer, replaced by a zeroed one of `n` rounded up to [`SCRATCH_GRANULE`]
    /// elements when smaller (the old one is freed in stream order, after the kernels that used
    /// it).
    fn grown<'s, T: DeviceRepr + ValidAsZeroBits>(
        &self,
        slot: &'s mut Option<CudaSlice<T>>,
        n: usize,
    ) -> Result<&'s mut CudaSlice<T>> {
        let need = n.max(1);
        let buffer = match slot.take() {
            Some(b) if b.len() >= need => b,
            _ => {
                let len = need.next_multiple_of(SCRATCH_GRANULE);
                self.stream
                    .alloc_zeros::<T>(len)
                    .map_err(KernelError::alloc(len * std::mem::size_of::<T>()))?
            }
        };
        Ok(slot.insert(buffer))
    }

    /// Make sure `kernel` is compiled and loaded for `dynamic_smem` bytes of shared memory, so
    /// that the launches that follow cannot fail half-way on a compile error.
    pub(crate) fn prepare(&self, kernel: &Kernel, dynamic_smem: usize) -> Result<()> {
        self.function(kernel, dynamic_smem).map(|_| ())
    }

    /// Launch `kernel` with its parameter struct, as every rung does (the decoding kernel through
    /// [`Gpu::launch_programmatic`], the same with one launch attribute more). The launch
    /// call's own result is always checked; with sync launches on, also the kernel's completion,
    /// so an asynchronous fault names the kernel that caused it.
    pub(crate) fn launch<P: DeviceRepr>(
        &self,
        kernel: &Kernel,
        grid: (u32, u32, u32),
        threads: u32,
        dynamic_smem: usize,
        params: &P,
    ) -> Result<()> {
        self.launch_as(kernel, grid, threads, dynamic_smem, params, false)
    }

    /// [`Gpu::launch`] with programmatic dependent launch where the device has it and the
    /// configuration allows it ([`GpuConfig::programmatic_launch`]): the kernel may start before
    /// the previous work in the stream has finished, so it must execute `griddepcontrol.wait`
    /// (pdl.cuh) before it reads or writes any memory that work may touch.
    pub(crate) fn launch_programmatic<P: DeviceRepr>(
        &self,
        kernel: &Kernel,
        grid: (u32, u32, u32),
        threads: u32,
        dynamic_smem: usize,
        params: &P,
    ) -> Result<()> {
        self.launch_as(kernel, grid, threads, dynamic_smem, params, self.programmatic)
    }

    fn launch_as<P: DeviceRepr>(
        &self,
        kernel: &Kernel,
        grid: (u32, u32, u32),
        threads: u32,
        dynamic_smem: usize,
        params: &P,
        programmatic: bool,
    ) -> Result<()> {
        let f = self.function(kernel, dynamic_smem)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: dynamic_smem as u32,
        };
        let what = kernel.entry;
        let failed = KernelError::driver(format!("launching {what} with {cfg:?}"));
        if programmatic {
            use cudarc::driver::sys;
            // The driver takes the context from the calling thread (this stream may be the null
            // stream), and cudarc's own launch binds it first: so do we.
            self.ctx
                .bind_to_thread()
                .map_err(KernelError::driver(format!("binding the context to launch {what}")))?;
            // SAFETY: an all-zero launch attribute is valid plain data; its id and value are set
            // below.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: threads,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: dynamic_smem as u32,
                hStream: self.stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // The kernel's one parameter, by address (the driver copies it at the launch).
            let mut args = [params as *const P as *mut std::ffi::c_void];
            // SAFETY: as in the launch below (the parameter struct mirrors the kernel's); `attr`,
            // `config` and `args` outlive the call, which copies them.
            unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    f.cu_function(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .map_err(failed)?;
        } else {
            let mut launch = self.stream.launch_builder(&f);
            launch.arg(params);
            // SAFETY: every rung passes the #[repr(C)] mirror of the parameter struct its kernel
            // declares, with device pointers to buffers of the sizes the kernel indexes (checked
            // by the rung before the launch).
            unsafe { launch.launch(cfg) }.map_err(failed)?;
        }
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

/// The axes of `t` from the largest stride down (ties in axis order): the order they lie in
/// memory, outermost first.
pub(crate) fn memory_order(t: &Tensor) -> Vec<usize> {
    let mut order: Vec<usize> = (0..t.shape().len()).collect();
    order.sort_by_key(|&a| std::cmp::Reverse(t.strides()[a]));
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Stages;
    use crate::fa2::ForwardTiles;
    use crate::fa3::{L2Section, Schedule};

    #[test]
    fn a_config_compiles_known_kernel_files_from_other_text() {
        for file in crate::KERNEL_FILES {
            let source = crate::kernel_source(file).expect("every kernel file has its source");
            assert!(source.contains("extern \"C\" __global__"), "{file}: no entry point");
        }
        assert_eq!(crate::kernel_source("fa2"), None);
        let config = GpuConfig::new().kernel_source("fa2_forward", "first").unwrap();
        let config = config.kernel_source("fa2_forward", "second").unwrap();
        assert_eq!(config.kernel_source_of("fa2_forward"), Some("second"), "the last text wins");
        assert_eq!(config.kernel_source_of("fa3_forward"), None);
        assert!(format!("{config:?}").contains("<6 bytes of edited source>"), "{config:?}");
        let err = GpuConfig::new().kernel_source("fa2.cu", "x").unwrap_err().to_string();
        assert!(err.contains("no kernel file \"fa2.cu\"") && err.contains("fa2_forward"), "{err}");
    }

    #[test]
    fn a_config_carries_one_knob_of_each_rung_type() {
        let tiles = ForwardTiles::new(2, 64, 4).unwrap();
        let config = GpuConfig::new().tune(tiles).tune(Stages(4)).tune(L2Section(8 << 20));
        assert_eq!(config.tuned::<ForwardTiles>(), Some(tiles));
        assert_eq!(config.tuned::<Stages>(), Some(Stages(4)));
        assert_eq!(config.tuned::<Schedule>(), None, "never set");
        // Setting a knob again replaces it; the others stay.
        let config = config.tune(Stages(2));
        assert_eq!((config.tuned::<Stages>(), config.tuning.len()), (Some(Stages(2)), 3));
        assert_eq!(config.tuned::<L2Section>(), Some(L2Section(8 << 20)));
        assert!(format!("{config:?}").contains("Stages(2)"), "{config:?}");
    }
}
