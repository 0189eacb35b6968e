//! The router's shared state: its peers, limits and counters, one `Arc`
//! for every request's task. The request flow works on it from its own
//! modules, each importing only this one (and those below it):
//! [`crate::flow`] (tokenize, retry, end each request), [`crate::dispatch`]
//! (pick a pair, send to both), [`crate::relay`] (stream the answer);
//! [`crate::server`] is only the tonic face.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_core::metrics::{Histogram, Outcomes};
use pdmesh_core::peers::Peers;
use pdmesh_proto::router::v1 as pb;
use pdmesh_proto::tokenizer::v1 as tpb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::load::Loads;

/// How long to wait for a worker of some kind to appear.
pub const PEER_WAIT: Duration = Duration::from_secs(2);
/// Pause before asking a peer that could not be reached again.
pub const PEER_RETRY: Duration = Duration::from_millis(100);

#[derive(Default)]
pub struct Metrics {
    pub in_flight: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub outcomes: Outcomes,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Prompt tokens reused from prefill workers' prefix caches (as the workers reported).
    pub cached_tokens: AtomicU64,
    /// Prefill picks by policy branch.
    pub routes: Branches,
    /// Prompt tokens the chosen prefill workers were expected to hold.
    pub route_overlap_tokens: AtomicU64,
    /// Requests by where their prompt was prefilled ([`crate::pick::Mode::ALL`] order).
    pub modes: [AtomicU64; 2],
    /// Dispatches repeated because a prefill failed before the first token.
    pub prefill_retries: AtomicU64,
    pub decode_retries: AtomicU64,
    /// Requests moved to another decode worker after tokens had been sent.
    pub migrations: AtomicU64,
    /// Dispatches repeated because the prompt's KV failed its checksum.
    pub kv_corrupt_retries: AtomicU64,
    /// Migrations whose KV a draining decode worker shipped along, and
    /// those that replayed instead because the shipment failed.
    pub handovers: AtomicU64,
    pub handover_fallbacks: AtomicU64,
    /// Calls ended because their worker stopped making progress, and
    /// strikes that ejected a worker, by [`crate::stall::Kind`].
    pub stalls: [AtomicU64; 2],
    pub ejections: [AtomicU64; 2],
    /// Workers out of picking now, by kind (refreshed with /statusz).
    pub workers_out: [AtomicU64; 2],
}

impl Metrics {
    pub fn count_mode(&self, m: crate::pick::Mode) {
        let i = crate::pick::Mode::ALL.iter().position(|x| *x == m).unwrap_or(0);
        self.modes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// `(label, count)` of every prefill mode.
    pub fn mode_counts(&self) -> Vec<(&'static str, f64)> {
        crate::pick::Mode::ALL
            .iter()
            .zip(&self.modes)
            .map(|(m, n)| (m.label(), n.load(Ordering::Relaxed) as f64))
            .collect()
    }
}

/// Counts of prefill picks by policy branch.
#[derive(Default)]
pub struct Branches([AtomicU64; 4]);

impl Branches {
    pub fn inc(&self, b: crate::pick::Branch) {
        let i = crate::pick::Branch::ALL.iter().position(|x| *x == b).unwrap_or(0);
        self.0[i].fetch_add(1, Ordering::Relaxed);
    }

    /// `(label, count)` of every branch.
    pub fn counts(&self) -> Vec<(&'static str, f64)> {
        crate::pick::Branch::ALL
            .iter()
            .zip(&self.0)
            .map(|(b, n)| (b.label(), n.load(Ordering::Relaxed) as f64))
            .collect()
    }
}

pub struct Router {
    pub tokenizer: Peers,
    pub prefill: Peers,
    pub decode: Peers,
    pub broker: Peers,
    pub timeout: Duration,
    pub retries: u32,
    pub max_migrations: u32,
    /// `--worker-wait-ms`: how long a request waits for a live worker.
    pub worker_wait: Duration,
    pub max_stop: usize,
    pub max_in_flight: u64,
    /// How prefill workers are picked.
    pub policy: crate::config::Policy,
    /// `--max-local-prefill` (0: never).
    pub max_local_prefill: u32,
    pub metrics: Arc<Metrics>,
    /// In-flight counts of this router and the workers' polled loads.
    pub loads: Arc<Loads>,
    pub info: tokio::sync::OnceCell<tpb::InfoResponse>,
    pub next_id: AtomicU64,
    pub next_ticket: AtomicU64,
}

pub use pdmesh_core::task::AbortOnDrop;

pub type Tx = mpsc::Sender<Result<pb::GenerateResponse, Status>>;
