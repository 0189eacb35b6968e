//! The engine's one error type. Each variant is classified once, here, with
//! a short `kind()` used as a metric label by the services above.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read model file {path}: {source}")]
    ModelIo { path: PathBuf, source: std::io::Error },
    #[error("invalid model file {path}: {why}")]
    BadModel { path: PathBuf, why: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("prompt has {len} tokens; with max_tokens {max_tokens} it needs {needed} positions but the context holds {context}")]
    PromptTooLong { len: usize, max_tokens: usize, needed: usize, context: usize },
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("KV cache full: {needed} blocks needed, {free} of {total} free")]
    KvFull { needed: usize, free: usize, total: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    #[error("KV import rejected: {0}")]
    KvMismatch(String),
    /// Transferred KV whose checksum differs from the sender's.
    #[error("{corrupt}: {0}", corrupt = pdmesh_vocab::KV_CORRUPT)]
    KvCorrupt(String),
    #[error("model fetch failed: {0}")]
    Fetch(#[from] pdmesh_model::FetchError),
    /// The engine's loop is gone (its thread stopped): the worker cannot serve.
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// The request's deadline passed (or would pass before it finished).
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    /// A batched step failed for reasons of its own, not of one request.
    #[error("engine step failed: {0}")]
    StepFailed(String),
    /// The worker's queue is at its bound: another worker may have room.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// GPU memory is exhausted for this step; the device is fine and the
    /// worker stays up (RESOURCE_EXHAUSTED: another worker may have room).
    #[error("GPU out of memory: {0}")]
    DeviceOutOfMemory(String),
    /// The GPU or its context is gone: nothing more can run here, and the
    /// worker takes itself out of service.
    #[error("GPU lost: {0}")]
    DeviceLost(String),
}

/// A GPU failure, by its class: no usable GPU is `Unavailable`, a bad call
/// is a failed step (a bug).
impl From<pdmesh_cuda::gpu::GpuError> for EngineError {
    fn from(e: pdmesh_cuda::gpu::GpuError) -> EngineError {
        use pdmesh_cuda::gpu::GpuErrorKind as K;
        let what = format!("CUDA: {}", e.what);
        match e.kind {
            K::Unavailable => EngineError::Unavailable(what),
            K::OutOfMemory => EngineError::DeviceOutOfMemory(what),
            K::DeviceLost => EngineError::DeviceLost(what),
            K::Invalid => EngineError::StepFailed(what),
        }
    }
}

impl EngineError {
    /// Short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::ModelIo { .. } => "model_io",
            EngineError::BadModel { .. } => "bad_model",
            EngineError::Unsupported(_) => "unsupported",
            EngineError::Tokenizer(_) => "tokenizer",
            EngineError::Template(_) => "template",
            EngineError::InvalidArgument(_) => "invalid_argument",
            EngineError::EmptyPrompt => "empty_prompt",
            EngineError::PromptTooLong { .. } => "prompt_too_long",
            EngineError::BadToken(_) => "bad_token",
            EngineError::KvFull { .. } => "kv_full",
            EngineError::UnknownSequence(_) => "unknown_sequence",
            EngineError::KvMismatch(_) => "kv_mismatch",
            EngineError::KvCorrupt(_) => "kv_corrupt",
            EngineError::Fetch(_) => "fetch",
            EngineError::Unavailable(_) => "unavailable",
            EngineError::StepFailed(_) => "step_failed",
            EngineError::DeadlineExceeded(_) => "deadline_exceeded",
            EngineError::Overloaded(_) => "overloaded",
            EngineError::DeviceOutOfMemory(_) => "device_out_of_memory",
            EngineError::DeviceLost(_) => "device_lost",
        }
    }

    /// True when the caller sent something wrong (maps to INVALID_ARGUMENT / 400).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidArgument(_)
                | EngineError::EmptyPrompt
                | EngineError::PromptTooLong { .. }
                | EngineError::BadToken(_)
                | EngineError::Template(_)
        )
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
