//! How a worker's failure reaches the router's caller: the worker's own
//! verdict on the request (bad input, no KV room, deadline, cancelled)
//! passes through as its code; anything else is the mesh's fault and
//! becomes UNAVAILABLE, never a client error. A failure of the connection
//! itself (the worker died, or could not be reached) is named as such,
//! without the transport library's text or the worker's id: those stay on
//! the failed call's span (`pick.*` attributes name the worker).

pub use pdmesh_core::grpc::{is_transport, timed_out};
use tonic::{Code, Status};

/// The router's own failures, each mapped once to its gRPC status
/// (`From<Error> for Status` below): the one place the router builds a
/// status. A worker's failure is mapped by the functions after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The request is malformed: what is wrong with it (INVALID_ARGUMENT).
    BadRequest(String),
    /// No live worker of this kind in discovery.
    NoWorker(String),
    /// Every worker of this kind tried refused or failed.
    AllRefused(String),
    /// The tokenizer failed, could not be reached, or broke a stream:
    /// what happened, in the caller's words.
    Tokenizer(&'static str),
    /// A decode worker ended its stream without finishing the request.
    DecodeEnded,
    /// The request's decode worker is draining (handing it over).
    DecodeDraining,
    /// The request's deadline passed: while doing what.
    Deadline(String),
    /// The caller went away.
    ClientGone,
    /// The router serves its limit of requests at once.
    Busy { limit: u64 },
    /// A worker stopped making progress under a call: its kind, its name
    /// and how (the call moves elsewhere; see `crate::stall`).
    Stalled { kind: &'static str, name: String, why: String },
    /// A broken invariant or an unusable channel (a bug).
    Internal(String),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        match e {
            Error::BadRequest(m) => Status::invalid_argument(m),
            Error::NoWorker(kind) => Status::unavailable(format!("no live {kind} worker")),
            Error::AllRefused(kind) => Status::unavailable(format!("every {kind} worker refused or failed")),
            Error::Tokenizer(what) => Status::unavailable(what),
            Error::DecodeEnded => Status::unavailable("a decode worker ended the stream without finishing"),
            Error::DecodeDraining => Status::unavailable("the request's decode worker drained"),
            Error::Deadline(m) => Status::deadline_exceeded(m),
            Error::ClientGone => Status::cancelled("client went away"),
            Error::Stalled { kind, name, why } => Status::unavailable(format!("{kind} worker {name} stalled: {why}")),
            Error::Busy { limit } => {
                let mut s = Status::resource_exhausted(format!(
                    "the router serves {limit} requests at once, its limit; retry shortly"
                ));
                // The gateway turns this into OpenAI's 429 `router_busy`.
                if let Ok(v) = "router_busy".parse() {
                    s.metadata_mut().insert(pdmesh_core::vocab::OVERLOAD_HEADER, v);
                }
                s
            }
            Error::Internal(m) => Status::internal(m),
        }
    }
}

/// The mesh's fault, as the caller sees it: which kind of worker, and what
/// happened. The worker's own words (they name workers, transports and
/// libraries) stay on the failed call's span.
fn worker_fault(what: &str, lost: &str, e: &Status) -> Status {
    if is_transport(e) {
        Status::unavailable(format!("a {what} {lost}"))
    } else {
        Status::unavailable(format!("a {what} failed"))
    }
}

/// What the caller hears when a transfer's lease ran out (either worker
/// may report it first).
fn lease_expired(e: &Status) -> Option<Status> {
    (e.code() == Code::Unavailable && e.message().starts_with(pdmesh_core::vocab::LEASE_EXPIRED)).then(|| {
        Status::unavailable(
            "the prompt's KV did not reach its decode worker before the transfer's lease ran out (a prefill worker failed or stalled)",
        )
    })
}

/// What the caller hears when a prompt's KV failed its checksum at the
/// decode worker (the router transfers it again, then prefills locally).
fn kv_corrupt(e: &Status) -> Option<Status> {
    is_kv_corrupt(e).then(|| {
        Status::unavailable(format!(
            "{}: the prompt's KV failed its checksum at the decode worker",
            pdmesh_core::vocab::KV_CORRUPT
        ))
    })
}

/// Whether a decode failure is a transferred KV that failed its checksum.
pub fn is_kv_corrupt(e: &Status) -> bool {
    e.code() == Code::Unavailable && e.message().starts_with(pdmesh_core::vocab::KV_CORRUPT)
}

/// A failed Prefill call.
pub fn prefill_failure(e: Status) -> Status {
    if let Some(s) = lease_expired(&e) {
        return s;
    }
    match e.code() {
        _ if timed_out(&e) => Status::deadline_exceeded("the request's deadline passed during its prefill"),
        _ if is_transport(&e) => worker_fault("prefill worker", "was lost mid-request", &e),
        Code::InvalidArgument => e,
        Code::DeadlineExceeded => Status::deadline_exceeded(format!("prefill: {}", e.message())),
        // Every prefill worker tried was full: its own words say how full.
        Code::ResourceExhausted => Status::unavailable(format!("no prefill worker has room: {}", e.message())),
        _ => worker_fault("prefill worker", "was lost mid-request", &e),
    }
}

/// A decode stream that failed after it admitted the request.
pub fn decode_failure(e: Status) -> Status {
    if let Some(s) = lease_expired(&e).or_else(|| kv_corrupt(&e)) {
        return s;
    }
    match e.code() {
        _ if timed_out(&e) => Status::deadline_exceeded("the request's deadline passed during its generation"),
        _ if is_transport(&e) => worker_fault("decode worker", "was lost mid-request", &e),
        Code::InvalidArgument | Code::ResourceExhausted | Code::DeadlineExceeded => e,
        // The decode's CANCELLED is never the caller's leaving (the router
        // sees that itself): its ticket was cancelled inside the mesh.
        _ => worker_fault("decode worker", "was lost mid-request", &e),
    }
}

/// A decode worker that refused to admit the request, after the last retry.
pub fn decode_refusal(e: Status) -> Status {
    match e.code() {
        _ if timed_out(&e) => Status::deadline_exceeded("the request's deadline passed before a decode worker took it"),
        _ if is_transport(&e) => worker_fault("decode worker", "could not be reached", &e),
        Code::Unavailable | Code::Internal | Code::Unknown => worker_fault("decode worker", "could not be reached", &e),
        _ => e,
    }
}

/// Whether a Prefill call that failed this way may succeed on another
/// worker (or locally): the worker died or broke, or had no room. Not the
/// request's own fault, deadline or cancellation.
pub fn prefill_retryable(e: &Status) -> bool {
    is_transport(e)
        || matches!(
            e.code(),
            Code::Unavailable | Code::Internal | Code::Unknown | Code::Aborted | Code::ResourceExhausted
        )
}

/// Whether a decode stream that failed this way (already mapped by
/// [`decode_failure`]) before any token reached the caller may succeed on
/// another dispatch: the worker died or broke, not the request's fault.
pub fn decode_retryable(e: &Status) -> bool {
    e.code() == Code::Unavailable
}

/// Whether another decode worker may succeed where this one refused.
pub fn retryable(e: &Status) -> bool {
    is_transport(e) || matches!(e.code(), Code::ResourceExhausted | Code::Unavailable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_router_error_has_one_code_and_none_blames_the_client_for_the_mesh() {
        let code = |e: Error| Status::from(e).code();
        assert_eq!(code(Error::BadRequest("x".into())), Code::InvalidArgument);
        assert_eq!(code(Error::NoWorker("decode".into())), Code::Unavailable);
        assert_eq!(code(Error::AllRefused("prefill".into())), Code::Unavailable);
        assert_eq!(code(Error::Tokenizer("the tokenizer failed")), Code::Unavailable);
        assert_eq!(code(Error::DecodeEnded), Code::Unavailable);
        assert_eq!(code(Error::DecodeDraining), Code::Unavailable);
        assert_eq!(code(Error::Deadline("x".into())), Code::DeadlineExceeded);
        assert_eq!(code(Error::ClientGone), Code::Cancelled);
        assert_eq!(code(Error::Internal("x".into())), Code::Internal);
        let busy = Status::from(Error::Busy { limit: 4096 });
        assert_eq!(busy.code(), Code::ResourceExhausted);
        let header = busy.metadata().get(pdmesh_core::vocab::OVERLOAD_HEADER).and_then(|v| v.to_str().ok());
        assert_eq!(header, Some("router_busy"), "the gateway's 429 router_busy");
        assert!(busy.message().contains("4096"));
    }

    /// A status as the channel makes it when the connection breaks: the
    /// h2 error kept as its source.
    fn broken(code: Code) -> Status {
        #[derive(Debug)]
        struct Cause(Status);
        impl std::fmt::Display for Cause {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("h2 protocol error: error reading a body from connection")
            }
        }
        impl std::error::Error for Cause {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        Status::from_error(Box::new(Cause(Status::new(code, "error reading a body from connection"))))
    }

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
        let lease =
            decode_failure(Status::unavailable(format!("{}: lease expired", pdmesh_core::vocab::LEASE_EXPIRED)));
        assert_eq!(lease.code(), Code::Unavailable, "the mesh's fault, never the caller's deadline");
        assert!(lease.message().contains("lease ran out") && decode_retryable(&lease), "{lease:?}");
        let lease = prefill_failure(Status::unavailable(format!("{}: late write", pdmesh_core::vocab::LEASE_EXPIRED)));
        assert!(lease.message().contains("lease ran out") && prefill_retryable(&lease), "{lease:?}");
        let inner = decode_failure(Status::cancelled("KV transfer cancelled: prefill-0 drained"));
        assert_eq!((inner.code(), inner.message()), (Code::Unavailable, "a decode worker failed"));
        let full =
            prefill_failure(Status::resource_exhausted("1024 prompts already wait for a prefill step, the limit"));
        assert_eq!(full.code(), Code::Unavailable);
        assert!(full.message().contains("wait for a prefill step"), "{full:?}");
        let nixl = prefill_failure(Status::unavailable("writing the KV to decode-0 over nixl failed: NIXL_ERR"));
        assert_eq!(nixl.message(), "a prefill worker failed", "no worker ids or library text reach the caller");
    }

    #[test]
    fn a_broken_connection_is_named_without_library_text() {
        let e = broken(Code::Unknown);
        assert!(is_transport(&e), "{e:?}");
        assert!(!is_transport(&Status::unavailable("KV transfer failed")));
        let m = decode_failure(e.clone());
        assert_eq!(m.code(), Code::Unavailable);
        assert_eq!(m.message(), "a decode worker was lost mid-request");
        assert!(decode_retryable(&m));
        assert_eq!(decode_refusal(e.clone()).message(), "a decode worker could not be reached");
        assert_eq!(prefill_failure(e).message(), "a prefill worker was lost mid-request");
        // A worker's own words stay on its span: the caller hears which kind failed.
        let own = decode_failure(Status::unavailable("KV transfer failed: broker gone"));
        assert_eq!(own.message(), "a decode worker failed");
        // A reset the dying peer sent is not the client's cancellation.
        let reset = broken(Code::Cancelled);
        assert!(is_transport(&reset));
        assert_eq!(decode_failure(reset).code(), Code::Unavailable);
        assert!(!decode_retryable(&Status::cancelled("client went away")));
        assert!(!decode_retryable(&Status::deadline_exceeded("late")));
        // The call's own timeout is the request's deadline, not a lost worker.
        let late = Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert!(!is_transport(&late));
        assert_eq!(prefill_failure(late).code(), Code::DeadlineExceeded);
        let late = || Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert_eq!(decode_failure(late()).code(), Code::DeadlineExceeded, "never the client's cancellation");
        assert_eq!(decode_refusal(late()).code(), Code::DeadlineExceeded);
    }
}
