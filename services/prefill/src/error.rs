//! The prefill worker's own failures, each mapped once to its gRPC status.
//! Shipping the KV fails as `pdmesh_worker::kv::ship::ShipError` (shared
//! with the decode worker, which ships sequences it hands over); engine
//! errors map through `pdmesh_worker::status`. Messages never carry prompt
//! text.

use tonic::Status;

#[derive(Debug)]
pub enum Error {
    /// The request itself is malformed.
    BadRequest(&'static str),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        match e {
            Error::BadRequest(m) => Status::invalid_argument(m),
        }
    }
}
