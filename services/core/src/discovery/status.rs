//! Whether this process can reach its discovery backend. Watchers and
//! heartbeats report here; `/health` shows it as detail (the instance keeps
//! serving on its last view, so it stays healthy) and `/metrics` as
//! `pdmesh_discovery_up` and `pdmesh_discovery_errors_total`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::metrics::Text;
use crate::vocab::metric;

/// The process's discovery status (see the module docs).
#[derive(Default)]
pub struct DiscoveryHealth {
    /// Unix ms of the first failure of the current outage; 0 when reachable.
    failing_since_ms: AtomicU64,
    errors: AtomicU64,
    last_error: Mutex<String>,
}

static HEALTH: std::sync::OnceLock<DiscoveryHealth> = std::sync::OnceLock::new();

/// This process's discovery status.
pub fn health() -> &'static DiscoveryHealth {
    HEALTH.get_or_init(DiscoveryHealth::default)
}

impl DiscoveryHealth {
    /// A call to the backend succeeded: any outage is over.
    pub fn ok(&self) {
        if self.failing_since_ms.swap(0, Ordering::AcqRel) != 0 {
            eprintln!("discovery: reachable again");
        }
    }

    /// A call failed; `what` says which and why (logged at the start of an outage).
    pub fn failed(&self, what: &str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = what.to_string();
        let now = crate::now_ms().max(1);
        if self.failing_since_ms.compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            eprintln!("discovery: {what}; serving on the last known instances until it is back");
        }
    }

    pub fn is_up(&self) -> bool {
        self.failing_since_ms.load(Ordering::Acquire) == 0
    }

    /// A line for `/health` while the backend is unreachable.
    pub fn detail(&self) -> Option<String> {
        let since = self.failing_since_ms.load(Ordering::Acquire);
        (since != 0).then(|| {
            let secs = crate::now_ms().saturating_sub(since) / 1000;
            let last = self.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone();
            format!("discovery unreachable for {secs} s ({last}); serving on the last known instances")
        })
    }

    /// The discovery families of `/metrics`.
    pub fn render(&self, t: &mut Text) {
        t.gauge(
            metric::shared::DISCOVERY_UP,
            "1 while the discovery backend answers; 0 while this instance serves on its last view",
            if self.is_up() { 1.0 } else { 0.0 },
        );
        t.counter(
            metric::shared::DISCOVERY_ERRORS_TOTAL,
            "Failed calls to the discovery backend (watches, heartbeats)",
            self.errors.load(Ordering::Relaxed),
        );
    }
}
