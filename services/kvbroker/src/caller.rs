//! Who may do what at the broker. Under mesh TLS every caller has an
//! identity, its certificate's common name `<kind>/<instance id>`:
//! - only workers (prefill, decode) register agents, each only its own;
//! - only a decode opens tickets, each naming itself as the destination;
//! - only a prefill claims, naming itself as the source, and only the
//!   claimant begins and completes a ticket's write;
//! - renewing, cancelling and watching are for workers and routers.
//!
//! Without TLS there are no identities and every call is let through
//! (the mesh is then only as safe as its network: see the README).

use crate::error::Error;

/// A caller under mesh TLS.
pub struct Caller {
    pub kind: String,
    pub id: String,
}

impl Caller {
    /// The caller of `req`; `None` without mesh TLS.
    pub fn of<T>(req: &tonic::Request<T>) -> Option<Caller> {
        let name = pdmesh_core::tls::peer_identity(req)?;
        let (kind, id) = name.split_once('/').unwrap_or((name.as_str(), ""));
        Some(Caller { kind: kind.into(), id: id.into() })
    }

    fn name(&self) -> String {
        format!("{}/{}", self.kind, self.id)
    }

    /// The caller is one of `kinds`.
    pub fn is(&self, kinds: &[&str], what: &str) -> Result<(), Error> {
        if kinds.contains(&self.kind.as_str()) {
            return Ok(());
        }
        Err(Error::Forbidden(format!("{} may not {what} (only {})", self.name(), kinds.join(", "))))
    }

    /// The caller is a `kind` acting for itself: `worker` is its own id.
    pub fn acts_as(&self, kind: &str, worker: &str, what: &str) -> Result<(), Error> {
        self.is(&[kind], what)?;
        if self.id == worker {
            return Ok(());
        }
        Err(Error::Forbidden(format!("{} may not {what} for {worker}", self.name())))
    }
}

/// Apply `check` when there is a caller (mesh TLS); let everything through otherwise.
pub fn check(caller: &Option<Caller>, check: impl FnOnce(&Caller) -> Result<(), Error>) -> Result<(), Error> {
    caller.as_ref().map_or(Ok(()), check)
}

/// Kinds that take part in a ticket's life beyond opening and claiming it.
pub const TICKET_PARTIES: &[&str] = &["prefill", "decode", "router"];
/// Kinds that move KV.
pub const WORKERS: &[&str] = &["prefill", "decode"];
