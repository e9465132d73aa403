//! Errors as values: every way a kernel call can fail, each naming the problem.

use cudarc::driver::DriverError;
use cudarc::driver::sys::cudaError_enum;

/// Everything a call into `ladder-kernels` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No CUDA driver library (`libcuda.so`) could be loaded, or it reported no device.
    #[error("no CUDA device found: {0}")]
    NoCuda(String),
    /// The device is older than the kernels support.
    #[error(
        "unsupported GPU {name} (compute capability {major}.{minor}); the kernels need sm_80 or newer"
    )]
    UnsupportedDevice {
        /// Device name as the driver reports it.
        name: String,
        /// Compute capability, major.
        major: i32,
        /// Compute capability, minor.
        minor: i32,
    },
    /// The rung needs a GPU architecture this device does not have (FA3 needs Hopper, `sm_90a`).
    #[error("{rung} needs a {needed} GPU (Hopper: H100, H200); this device is {arch}")]
    UnsupportedArch {
        /// Rung name.
        rung: &'static str,
        /// The device's architecture, e.g. `sm_80`.
        arch: String,
        /// The architecture the rung needs.
        needed: &'static str,
    },
    /// NVRTC (`libnvrtc.so`) could not be loaded, failed to compile a kernel, or the driver could
    /// not load the result.
    #[error("compiling {kernel} failed: {log}")]
    Compile {
        /// The kernel variant, e.g. `fa2_forward(d=128, fp16)`.
        kernel: String,
        /// NVRTC's log or the loader's message.
        log: String,
    },
    /// The rung has no kernel for this head dimension.
    #[error("{rung}: unsupported head dimension {d} (supported: {})", describe_dims(.supported))]
    UnsupportedHeadDim {
        /// Rung name.
        rung: &'static str,
        /// The head dimension asked for.
        d: usize,
        /// What the rung supports.
        supported: &'static [usize],
    },
    /// The rung has no kernel for this element type.
    #[error("{rung}: unsupported dtype {dtype} (supported: {supported})")]
    UnsupportedDtype {
        /// Rung name.
        rung: &'static str,
        /// The element type given.
        dtype: crate::DType,
        /// What the rung supports.
        supported: &'static str,
    },
    /// Tensor shapes do not fit together, or a dimension is zero or too large.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Tensors that must share an element type do not, or a tensor is not of the type asked for.
    #[error("dtype mismatch: {0}")]
    DType(String),
    /// A tensor lives in another CUDA context (another device) than the [`crate::Gpu`] given.
    #[error("wrong device: {0}")]
    Device(String),
    /// A page table of a paged KV cache does not fit the call: too few pages for a sequence's
    /// length, or an entry that is not a page of the cache.
    #[error("invalid page table: {0}")]
    PageTable(String),
    /// A configuration value is invalid (a tile specification, an NVRTC option list, ...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A kernel needs more of a per-block resource than the device has.
    #[error("{kernel} needs {needed} bytes of shared memory per block; {device} allows {limit}")]
    SharedMemory {
        /// The kernel variant.
        kernel: String,
        /// Bytes it needs.
        needed: usize,
        /// Bytes the device allows one block (opt-in maximum).
        limit: usize,
        /// The device's name.
        device: String,
    },
    /// The device has not enough free memory for an allocation.
    #[error("out of device memory allocating {bytes} bytes")]
    OutOfMemory {
        /// Size of the allocation that failed.
        bytes: usize,
    },
    /// A launch or a later synchronisation reported an error (the kernel is named when known).
    #[error("CUDA error in {context}: {source}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
}

/// Result alias for this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

impl KernelError {
    pub(crate) fn driver(context: impl Into<String>) -> impl FnOnce(DriverError) -> KernelError {
        let context = context.into();
        move |source| KernelError::Driver { context, source }
    }

    pub(crate) fn alloc(bytes: usize) -> impl FnOnce(DriverError) -> KernelError {
        move |source| {
            if source.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                KernelError::OutOfMemory { bytes }
            } else {
                KernelError::Driver { context: format!("allocating {bytes} bytes"), source }
            }
        }
    }
}

/// A list of head dimensions as a reader wants it: "multiples of 8 from 8 to 256" for a run of
/// them (of 16 likewise), the numbers otherwise.
fn describe_dims(dims: &[usize]) -> String {
    let step = dims.first().copied().unwrap_or(0);
    let run =
        dims.len() > 2 && step > 0 && dims.iter().enumerate().all(|(i, &d)| d == step * (i + 1));
    match dims.last() {
        Some(last) if run => format!("multiples of {step} from {step} to {last}"),
        _ => format!("{dims:?}"),
    }
}
