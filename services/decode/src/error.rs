//! The decode worker's failures, each mapped once to its gRPC status.
//! Messages may name requests, workers and transports: they are for
//! operators (the router keeps them on its spans and tells its caller only
//! that a decode worker failed). They never carry prompt text. Engine
//! errors map through `pdmesh_worker::status`, shared with the prefill.

use pdmesh_proto::kvbroker::v1::{Ticket, TicketState};
use tonic::{Code, Status};

#[derive(Debug)]
pub enum Error {
    /// The request or a KV stream is malformed, or carries more than was reserved.
    BadRequest(String),
    /// The request id is already admitted here.
    AlreadyAdmitted(String),
    /// A KV stream for a request this worker holds no reservation for.
    NoReservation(String),
    /// A KV stream of another layout than this worker's.
    LayoutMismatch(String),
    /// The kvbroker refused the ticket, for the request's own reason (a bad
    /// id, a ticket already open) or a full table: its code is kept.
    BrokerRefused(Code, String),
    /// The kvbroker could not be reached, or was lost mid-wait.
    BrokerUnreachable,
    BrokerLost,
    /// The ticket ended without the KV (cancelled, lease expired, failed).
    TicketEnded(Ticket),
    /// The client went away before the first token.
    ClientGone,
    /// What should not happen did (a broken invariant, a failed step).
    Internal(String),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        use Error::*;
        match e {
            BadRequest(m) => Status::invalid_argument(m),
            AlreadyAdmitted(id) => Status::already_exists(format!("request {id} is already admitted here")),
            NoReservation(id) => Status::not_found(format!("no reservation for request {id} here")),
            LayoutMismatch(m) => Status::failed_precondition(m),
            BrokerRefused(code, m) => Status::new(code, format!("kvbroker refused the ticket: {m}")),
            BrokerUnreachable => Status::unavailable("the kvbroker could not be reached"),
            BrokerLost => Status::unavailable("kvbroker connection lost while waiting for the KV"),
            TicketEnded(t) => {
                let why = if t.reason.is_empty() { String::new() } else { format!(": {}", t.reason) };
                match TicketState::try_from(t.state).unwrap_or(TicketState::Unspecified) {
                    TicketState::Cancelled => Status::cancelled(format!("KV transfer cancelled{why}")),
                    // The prefill side did not deliver in time (died, stalled):
                    // the mesh's fault, worth retrying, never the caller's deadline.
                    TicketState::Expired => Status::unavailable(format!("{}{why}", pdmesh_core::vocab::LEASE_EXPIRED)),
                    _ => Status::unavailable(format!("KV transfer failed{why}")),
                }
            }
            ClientGone => Status::cancelled("client went away"),
            Internal(m) => Status::internal(m),
        }
    }
}

/// The kvbroker's refusal of a ticket, as this worker reports it.
pub fn broker_refusal(e: &Status) -> Error {
    match e.code() {
        // The request's own fault (a bad id, a ticket already open) or a full table.
        c @ (Code::InvalidArgument | Code::FailedPrecondition | Code::ResourceExhausted) => {
            Error::BrokerRefused(c, e.message().into())
        }
        _ => Error::BrokerUnreachable,
    }
}
