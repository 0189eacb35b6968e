//! The service's errors and their one mapping to gRPC status codes.

use pdmesh_engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("input is {size} bytes; the limit is {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("{n} chat messages; the limit is {limit}")]
    TooManyMessages { n: usize, limit: usize },
    #[error("request has no input: set prompt or chat")]
    NoInput,
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
}

impl Error {
    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Engine(e) => e.kind(),
            Error::TooLarge { .. } => "too_large",
            Error::TooManyMessages { .. } => "too_many_messages",
            Error::NoInput => "no_input",
            Error::BadToken(_) => "bad_token",
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> tonic::Status {
        let msg = e.to_string();
        match &e {
            Error::Engine(inner) if inner.is_bad_input() => tonic::Status::invalid_argument(msg),
            Error::TooLarge { .. } | Error::TooManyMessages { .. } | Error::NoInput | Error::BadToken(_) => {
                tonic::Status::invalid_argument(msg)
            }
            Error::Engine(_) => tonic::Status::internal(msg),
        }
    }
}
