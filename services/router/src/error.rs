//! How a worker's failure reaches the router's caller: the worker's own
//! verdict on the request (bad input, no KV room, deadline, cancelled)
//! passes through as its code; anything else is the mesh's fault and
//! becomes UNAVAILABLE, never a client error.

use tonic::{Code, Status};

/// A failed Prefill call.
pub fn prefill_failure(e: Status) -> Status {
    match e.code() {
        Code::InvalidArgument => e,
        Code::DeadlineExceeded => Status::deadline_exceeded(format!("prefill: {}", e.message())),
        _ => Status::unavailable(format!("prefill worker failed: {}", e.message())),
    }
}

/// A decode stream that failed after it admitted the request.
pub fn decode_failure(e: Status) -> Status {
    match e.code() {
        Code::InvalidArgument | Code::ResourceExhausted | Code::DeadlineExceeded | Code::Cancelled => e,
        _ => Status::unavailable(format!("decode worker failed: {}", e.message())),
    }
}

/// A decode worker that refused to admit the request, after the last retry.
pub fn decode_refusal(e: Status, worker: &str) -> Status {
    match e.code() {
        Code::Unavailable => Status::unavailable(format!("decode worker {worker}: {}", e.message())),
        _ => e,
    }
}

/// Whether a Prefill call that failed this way may succeed on another
/// worker (or locally): the worker died or broke, or had no room. Not the
/// request's own fault, deadline or cancellation.
pub fn prefill_retryable(e: &Status) -> bool {
    matches!(e.code(), Code::Unavailable | Code::Internal | Code::Unknown | Code::Aborted | Code::ResourceExhausted)
}

/// Whether another decode worker may succeed where this one refused.
pub fn retryable(e: &Status) -> bool {
    matches!(e.code(), Code::ResourceExhausted | Code::Unavailable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_faults_are_never_the_clients_fault() {
        assert_eq!(prefill_failure(Status::internal("x")).code(), Code::Unavailable);
        assert_eq!(decode_failure(Status::failed_precondition("x")).code(), Code::Unavailable);
        assert_eq!(decode_failure(Status::resource_exhausted("full")).code(), Code::ResourceExhausted);
        assert_eq!(prefill_failure(Status::invalid_argument("bad id")).code(), Code::InvalidArgument);
        assert!(retryable(&Status::resource_exhausted("full")));
        assert!(!retryable(&Status::invalid_argument("bad")));
        assert!(prefill_retryable(&Status::unavailable("tcp connect error")));
        assert!(prefill_retryable(&Status::internal("prefill task failed")));
        for c in [Code::InvalidArgument, Code::DeadlineExceeded, Code::Cancelled] {
            assert!(!prefill_retryable(&Status::new(c, "x")), "{c:?}");
        }
    }
}
