//! The one mapping of engine errors to gRPC statuses, and what a failed
//! batched step means for the requests in it and for the worker.

use pdmesh_engine::EngineError;
use tonic::Status;

/// The gRPC status for an engine error.
pub fn status(e: &EngineError) -> Status {
    let msg = e.to_string();
    match e {
        EngineError::KvFull { .. } | EngineError::Overloaded(_) | EngineError::DeviceOutOfMemory(_) => {
            Status::resource_exhausted(msg)
        }
        EngineError::UnknownSequence(_) => Status::not_found(msg),
        EngineError::KvMismatch(_) => Status::failed_precondition(msg),
        EngineError::Unavailable(_) | EngineError::DeviceLost(_) | EngineError::KvCorrupt(_) => {
            Status::unavailable(msg)
        }
        EngineError::DeadlineExceeded(_) => Status::deadline_exceeded(msg),
        e if e.is_bad_input() => Status::invalid_argument(msg),
        _ => Status::internal(msg),
    }
}

/// What a failed batched step means for the requests in it: a GPU out of
/// memory or lost keeps its class (RESOURCE_EXHAUSTED, UNAVAILABLE); any
/// other failure is the worker's bug (`StepFailed`, INTERNAL), never the
/// client's fault.
pub fn step_error(stage: &str, e: &EngineError) -> EngineError {
    match e {
        EngineError::DeviceOutOfMemory(m) => EngineError::DeviceOutOfMemory(m.clone()),
        EngineError::DeviceLost(m) => EngineError::DeviceLost(m.clone()),
        e => EngineError::StepFailed(format!("{stage}: {e}")),
    }
}

/// Whether a failed step leaves the engine unable to run another: its loop
/// then stops, which takes the worker out of service ([`LoopAlive`]).
pub fn is_fatal(e: &EngineError) -> bool {
    matches!(e, EngineError::DeviceLost(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_failures_are_never_the_clients_fault() {
        let code = |e: EngineError| status(&e).code();
        assert_eq!(code(EngineError::Unavailable("loop stopped".into())), tonic::Code::Unavailable);
        assert_eq!(code(EngineError::StepFailed("x".into())), tonic::Code::Internal);
        assert_eq!(code(EngineError::KvFull { needed: 2, free: 1, total: 8 }), tonic::Code::ResourceExhausted);
        assert_eq!(code(EngineError::BadToken(99_999)), tonic::Code::InvalidArgument);
        assert_eq!(code(EngineError::DeviceOutOfMemory("x".into())), tonic::Code::ResourceExhausted);
        assert_eq!(code(EngineError::DeviceLost("x".into())), tonic::Code::Unavailable);
        // A failed step keeps a GPU's class; anything else is the worker's bug.
        let oom = step_error("decode", &EngineError::DeviceOutOfMemory("x".into()));
        assert_eq!(code(oom), tonic::Code::ResourceExhausted);
        assert_eq!(code(step_error("decode", &EngineError::BadToken(1))), tonic::Code::Internal);
        assert!(is_fatal(&step_error("prefill", &EngineError::DeviceLost("x".into()))));
        assert!(!is_fatal(&EngineError::DeviceOutOfMemory("x".into())));
        assert!(!EngineError::StepFailed("x".into()).is_bad_input());
    }
}
