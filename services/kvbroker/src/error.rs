//! The broker's errors and their one mapping to gRPC status codes.

use crate::tickets::TicketError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Ticket(#[from] TicketError),
    #[error("unknown agent {0}")]
    UnknownAgent(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("the broker knows {0} workers, its limit")]
    TooManyAgents(usize),
    /// Under mesh TLS: the caller's identity may not do this.
    #[error("{0}")]
    Forbidden(String),
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> tonic::Status {
        let msg = e.to_string();
        match e {
            Error::Ticket(TicketError::NotFound(_)) | Error::UnknownAgent(_) => tonic::Status::not_found(msg),
            Error::Ticket(TicketError::WrongState(..)) => tonic::Status::failed_precondition(msg),
            Error::Ticket(TicketError::Invalid(_)) | Error::Invalid(_) => tonic::Status::invalid_argument(msg),
            Error::Ticket(TicketError::Full(_) | TicketError::FullFor(..)) | Error::TooManyAgents(_) => {
                tonic::Status::resource_exhausted(msg)
            }
            Error::Forbidden(_) => tonic::Status::permission_denied(msg),
        }
    }
}
