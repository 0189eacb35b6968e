//! A worker that stopped making progress under a call: the strike against
//! it (it leaves picking for a while, see [`crate::outlier`]), the counts,
//! and the status the call ends with, which the request flow treats as a
//! lost worker (retried or migrated elsewhere, no token repeated: the old
//! stream is dropped, so a worker that wakes up sends into nothing).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tonic::Status;

use crate::error::Error;
use crate::state::Router;
use pdmesh_core::outlier::{Silence, Strike};

/// The kinds of worker a stream waits on, as the stall metrics label them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Prefill = 0,
    Decode = 1,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Prefill, Kind::Decode];

    pub fn label(self) -> &'static str {
        match self {
            Kind::Prefill => "prefill",
            Kind::Decode => "decode",
        }
    }
}

impl Router {
    /// `kind` worker `name` (at `addr`) stopped under a call: a strike
    /// against it, counted; the status that ends the call.
    pub(crate) fn stalled(&self, kind: Kind, addr: &str, name: &str, s: Silence) -> Status {
        let (backoff, why) = {
            let mut o = self.loads.outliers.lock();
            (o.strike(addr, Strike::Stall, Instant::now()), s.describe(o.poll()))
        };
        self.metrics.stalls[kind as usize].fetch_add(1, Ordering::Relaxed);
        self.metrics.ejections[kind as usize].fetch_add(1, Ordering::Relaxed);
        tracing::warn!(worker = name, kind = kind.label(), why = %why, ejected_s = backoff.as_secs_f64(), "worker stalled; its stream moves elsewhere");
        Error::Stalled { kind: kind.label(), name: name.to_string(), why }.into()
    }

    /// A call to `addr` was lost at the transport: a strike against it.
    pub(crate) fn lost(&self, kind: Kind, addr: &str) {
        self.loads.outliers.lock().strike(addr, Strike::Lost, Instant::now());
        self.metrics.ejections[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// `addrs` served a request to its end: their strikes are cleared.
    pub(crate) fn served(&self, addrs: &[&str]) {
        let mut o = self.loads.outliers.lock();
        for a in addrs {
            o.cleared(a);
        }
    }
}
