//! A GPU failure and its class (out of memory, a lost device, unavailable,
//! invalid), below the device code and the GEMM that both report one.

use cudarc::driver::DriverError;

/// The class of a GPU failure, which decides what the worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuErrorKind {
    /// No usable GPU: no driver or device, NVRTC missing, a kernel that did not compile.
    Unavailable,
    /// Device memory is exhausted; the device itself is fine.
    OutOfMemory,
    /// The device or its context is gone (a fault in a kernel, an ECC
    /// error, a reset): nothing more can run in this process.
    DeviceLost,
    /// A call with counts that do not fit its buffers, or any other
    /// driver refusal: a bug in the caller.
    Invalid,
}

/// A GPU failure: its class and what was being done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct GpuError {
    pub kind: GpuErrorKind,
    pub what: String,
}

impl GpuError {
    pub fn unavailable(what: impl Into<String>) -> GpuError {
        GpuError { kind: GpuErrorKind::Unavailable, what: what.into() }
    }

    pub fn invalid(what: impl Into<String>) -> GpuError {
        GpuError { kind: GpuErrorKind::Invalid, what: what.into() }
    }

    /// A driver error while doing `what`, classified by its code (named
    /// from the code itself: `DriverError`'s Debug asks the driver).
    pub fn driver(what: &str, e: DriverError) -> GpuError {
        GpuError { kind: classify(e.0), what: format!("{what}: {:?}", e.0) }
    }
}

/// The class of a driver result code. The sticky errors, after which the
/// context cannot be used again, are a lost device.
pub fn classify(code: cudarc::driver::sys::CUresult) -> GpuErrorKind {
    use cudarc::driver::sys::CUresult as R;
    match code {
        R::CUDA_ERROR_OUT_OF_MEMORY => GpuErrorKind::OutOfMemory,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
        | R::CUDA_ERROR_LAUNCH_FAILED
        | R::CUDA_ERROR_LAUNCH_TIMEOUT
        | R::CUDA_ERROR_ECC_UNCORRECTABLE
        | R::CUDA_ERROR_HARDWARE_STACK_ERROR
        | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | R::CUDA_ERROR_MISALIGNED_ADDRESS
        | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
        | R::CUDA_ERROR_INVALID_PC
        | R::CUDA_ERROR_ASSERT
        | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
        | R::CUDA_ERROR_DEINITIALIZED
        | R::CUDA_ERROR_NO_DEVICE => GpuErrorKind::DeviceLost,
        _ => GpuErrorKind::Invalid,
    }
}

/// `Invalid` unless `len >= need`: a launch's bounds check.
pub(crate) fn fits(what: &str, buffer: &str, len: usize, need: usize) -> Result<(), GpuError> {
    if len >= need {
        return Ok(());
    }
    Err(GpuError::invalid(format!("{what}: {buffer} holds {len} values, the launch needs {need}")))
}
