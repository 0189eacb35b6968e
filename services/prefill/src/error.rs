//! The prefill worker's failures, each mapped once to its gRPC status.
//! Messages may name workers and transports: they are for operators (the
//! router keeps them on its spans and tells its caller only that a prefill
//! worker failed). They never carry prompt text. Engine errors map through
//! `pdmesh_worker::status`, shared with the decode worker.

use pdmesh_proto::kvbroker::v1::TicketState;
use tonic::Status;

#[derive(Debug)]
pub enum Error {
    /// The request itself is malformed.
    BadRequest(&'static str),
    /// The decode worker's transfer endpoint is unknown to the kvbroker.
    UnknownDestination { worker: String, why: String },
    /// No KV transport of this worker reaches the decode worker.
    NoTransport(String),
    /// No decode worker opened the transfer ticket within the claim timeout.
    NotOpened,
    /// The ticket ended (cancelled, expired, failed) before the KV was written.
    TicketEnded(TicketState, String),
    /// The ticket asks for what this prefill does not have (its positions).
    Mismatch(String),
    /// The lease ends too soon for a write to start.
    LeaseEnding(String),
    /// The kvbroker could not be reached.
    BrokerUnreachable,
    /// The KV write itself failed.
    WriteFailed(String),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        use Error::*;
        match e {
            BadRequest(m) => Status::invalid_argument(m),
            UnknownDestination { worker, why } => {
                Status::unavailable(format!("decode worker {worker} is unknown to the kvbroker: {why}"))
            }
            NoTransport(w) => Status::failed_precondition(format!("no transport reaches decode worker {w}")),
            NotOpened => Status::deadline_exceeded("no decode worker opened the transfer ticket in time"),
            // The same status the decode reports for this ticket: the mesh's
            // fault (this write was too late), never the caller's deadline.
            TicketEnded(TicketState::Expired, why) => {
                Status::unavailable(format!("{}: {why}", pdmesh_core::vocab::LEASE_EXPIRED))
            }
            TicketEnded(TicketState::Cancelled, why) => Status::cancelled(why),
            TicketEnded(_, why) | Mismatch(why) => Status::failed_precondition(why),
            LeaseEnding(why) => Status::deadline_exceeded(why),
            BrokerUnreachable => Status::unavailable("the kvbroker could not be reached"),
            WriteFailed(why) => Status::unavailable(why),
        }
    }
}

/// A broker call that failed once the ticket was ours: it ended meanwhile.
pub fn ended(what: &str, e: &Status) -> Error {
    Error::TicketEnded(TicketState::Failed, format!("{what}: {}", e.message()))
}

/// The status of a claim that failed for good.
pub fn claim_failure(e: Status) -> Error {
    match e.code() {
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => Error::NotOpened,
        tonic::Code::FailedPrecondition => ended("transfer ticket ended before the KV was written", &e),
        _ => Error::BrokerUnreachable,
    }
}
