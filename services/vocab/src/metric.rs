//! Metric names: every family a service's `/metrics` serves, as a
//! constant. Services render with these; `meshctl status` and the tests
//! read with them; [`all`] lists them for the test that holds every served
//! family to this file (`services/meshctl/tests/prometheus.rs`).
//!
//! Names follow Prometheus: `pdmesh_<service>_<what>`, counters end in
//! `_total`, durations are `_seconds`.

/// `pdmesh_<service>_<what>`, spelled once at compile time.
macro_rules! name {
    ($service:literal, $what:literal) => {
        concat!("pdmesh_", $service, "_", $what)
    };
}

/// The families prefill and decode workers both serve, named per kind:
/// the prefix cache's and the step-cost counters.
#[derive(Clone, Copy, Debug)]
pub struct Worker {
    pub kv_blocks_free: &'static str,
    pub prefix_cached_blocks: &'static str,
    pub prefix_evictable_blocks: &'static str,
    pub prefix_cached_bytes: &'static str,
    pub prefix_lookups_total: &'static str,
    pub prefix_hits_total: &'static str,
    pub prefix_hit_tokens_total: &'static str,
    pub prefix_stored_blocks_total: &'static str,
    pub prefix_evictions_total: &'static str,
    pub step_wall_seconds_total: &'static str,
    pub step_judged_seconds_total: &'static str,
    pub step_normal_seconds_total: &'static str,
    pub step_cpu_seconds_total: &'static str,
    pub step_runq_seconds_total: &'static str,
    pub step_starved_total: &'static str,
}

macro_rules! worker {
    ($kind:literal) => {
        Worker {
            kv_blocks_free: name!($kind, "kv_blocks_free"),
            prefix_cached_blocks: name!($kind, "prefix_cached_blocks"),
            prefix_evictable_blocks: name!($kind, "prefix_evictable_blocks"),
            prefix_cached_bytes: name!($kind, "prefix_cached_bytes"),
            prefix_lookups_total: name!($kind, "prefix_lookups_total"),
            prefix_hits_total: name!($kind, "prefix_hits_total"),
            prefix_hit_tokens_total: name!($kind, "prefix_hit_tokens_total"),
            prefix_stored_blocks_total: name!($kind, "prefix_stored_blocks_total"),
            prefix_evictions_total: name!($kind, "prefix_evictions_total"),
            step_wall_seconds_total: name!($kind, "step_wall_seconds_total"),
            step_judged_seconds_total: name!($kind, "step_judged_seconds_total"),
            step_normal_seconds_total: name!($kind, "step_normal_seconds_total"),
            step_cpu_seconds_total: name!($kind, "step_cpu_seconds_total"),
            step_runq_seconds_total: name!($kind, "step_runq_seconds_total"),
            step_starved_total: name!($kind, "step_starved_total"),
        }
    };
}

impl Worker {
    /// Every name, for [`all`].
    pub const fn names(&self) -> [&'static str; 15] {
        [
            self.kv_blocks_free,
            self.prefix_cached_blocks,
            self.prefix_evictable_blocks,
            self.prefix_cached_bytes,
            self.prefix_lookups_total,
            self.prefix_hits_total,
            self.prefix_hit_tokens_total,
            self.prefix_stored_blocks_total,
            self.prefix_evictions_total,
            self.step_wall_seconds_total,
            self.step_judged_seconds_total,
            self.step_normal_seconds_total,
            self.step_cpu_seconds_total,
            self.step_runq_seconds_total,
            self.step_starved_total,
        ]
    }
}

/// Served by every service (the discovery backend's health).
pub mod shared {
    pub const DISCOVERY_UP: &str = "pdmesh_discovery_up";
    pub const DISCOVERY_ERRORS_TOTAL: &str = "pdmesh_discovery_errors_total";
}

pub mod gateway {
    pub const IN_FLIGHT: &str = name!("gateway", "in_flight");
    pub const REQUEST_SECONDS: &str = name!("gateway", "request_seconds");
    pub const REQUESTS_TOTAL: &str = name!("gateway", "requests_total");
    pub const CONNECTIONS: &str = name!("gateway", "connections");
    pub const CONNECTIONS_REFUSED_TOTAL: &str = name!("gateway", "connections_refused_total");
    pub const ROUTER_FAILOVERS_TOTAL: &str = name!("gateway", "router_failovers_total");
    /// Served only with `--api-keys-file`, like the next two.
    pub const API_KEYS: &str = name!("gateway", "api_keys");
    pub const AUTH_REFUSED_TOTAL: &str = name!("gateway", "auth_refused_total");
    pub const API_KEYS_RELOAD_ERRORS_TOTAL: &str = name!("gateway", "api_keys_reload_errors_total");
}

pub mod router {
    pub const IN_FLIGHT: &str = name!("router", "in_flight");
    pub const TTFT_SECONDS: &str = name!("router", "ttft_seconds");
    pub const INTER_TOKEN_SECONDS: &str = name!("router", "inter_token_seconds");
    pub const REQUEST_SECONDS: &str = name!("router", "request_seconds");
    pub const PROMPT_TOKENS_TOTAL: &str = name!("router", "prompt_tokens_total");
    pub const COMPLETION_TOKENS_TOTAL: &str = name!("router", "completion_tokens_total");
    pub const CACHED_TOKENS_TOTAL: &str = name!("router", "cached_tokens_total");
    pub const ROUTE_OVERLAP_TOKENS_TOTAL: &str = name!("router", "route_overlap_tokens_total");
    pub const PREFILL_PICKS_TOTAL: &str = name!("router", "prefill_picks_total");
    pub const PREFILL_MODE_TOTAL: &str = name!("router", "prefill_mode_total");
    pub const PREFILL_RETRIES_TOTAL: &str = name!("router", "prefill_retries_total");
    pub const DECODE_RETRIES_TOTAL: &str = name!("router", "decode_retries_total");
    pub const MIGRATIONS_TOTAL: &str = name!("router", "migrations_total");
    pub const HANDOVERS_TOTAL: &str = name!("router", "handovers_total");
    pub const HANDOVER_FALLBACKS_TOTAL: &str = name!("router", "handover_fallbacks_total");
    pub const KV_CORRUPT_RETRIES_TOTAL: &str = name!("router", "kv_corrupt_retries_total");
    pub const REQUESTS_TOTAL: &str = name!("router", "requests_total");
    /// Streams moved off a worker that stopped making progress, by `kind`.
    pub const STALLS_TOTAL: &str = name!("router", "stalls_total");
    /// Workers left out of picking after a stall or a lost call, by `kind`.
    pub const EJECTIONS_TOTAL: &str = name!("router", "ejections_total");
    /// Workers out of picking now (ejected, on probation or silent), by `kind`.
    pub const WORKERS_OUT: &str = name!("router", "workers_out");
}

pub mod tokenizer {
    pub const REQUESTS_TOTAL: &str = name!("tokenizer", "requests_total");
}

pub mod kvbroker {
    pub const TICKETS: &str = name!("kvbroker", "tickets");
    pub const LEASE_EXPIRIES_TOTAL: &str = name!("kvbroker", "lease_expiries_total");
}

pub mod prefill {
    use super::Worker;

    pub const RUNNING: &str = name!("prefill", "running");
    pub const QUEUED: &str = name!("prefill", "queued");
    pub const QUEUED_TOKENS: &str = name!("prefill", "queued_tokens");
    pub const EXPECTED_WAIT_SECONDS: &str = name!("prefill", "expected_wait_seconds");
    pub const QUEUE_WAIT_SECONDS: &str = name!("prefill", "queue_wait_seconds");
    pub const KV_BLOCKS_USED: &str = name!("prefill", "kv_blocks_used");
    pub const KV_BLOCKS_TOTAL: &str = name!("prefill", "kv_blocks_total");
    pub const KV_BLOCKS_PINNED: &str = name!("prefill", "kv_blocks_pinned");
    pub const STEPS_TOTAL: &str = name!("prefill", "steps_total");
    pub const PROMPT_TOKENS_TOTAL: &str = name!("prefill", "prompt_tokens_total");
    pub const KV_TRANSFER_BYTES_TOTAL: &str = name!("prefill", "kv_transfer_bytes_total");
    pub const STEP_SECONDS: &str = name!("prefill", "step_seconds");
    pub const KV_TRANSFER_SECONDS: &str = name!("prefill", "kv_transfer_seconds");
    pub const KV_TRANSFERS_TOTAL: &str = name!("prefill", "kv_transfers_total");
    pub const REQUESTS_TOTAL: &str = name!("prefill", "requests_total");
    /// The prefix-cache and step-cost families.
    pub const WORKER: Worker = worker!("prefill");
}

pub mod decode {
    use super::Worker;

    pub const RUNNING: &str = name!("decode", "running");
    pub const QUEUED: &str = name!("decode", "queued");
    pub const AWAITING_KV: &str = name!("decode", "awaiting_kv");
    pub const KV_BLOCKS_USED: &str = name!("decode", "kv_blocks_used");
    pub const KV_BLOCKS_PINNED: &str = name!("decode", "kv_blocks_pinned");
    pub const KV_BLOCKS_TOTAL: &str = name!("decode", "kv_blocks_total");
    pub const STEPS_TOTAL: &str = name!("decode", "steps_total");
    pub const TOKENS_TOTAL: &str = name!("decode", "tokens_total");
    pub const STEP_SECONDS: &str = name!("decode", "step_seconds");
    pub const LOCAL_PREFILLING: &str = name!("decode", "local_prefilling");
    pub const LOCAL_PREFILLS_TOTAL: &str = name!("decode", "local_prefills_total");
    pub const LOCAL_PREFILL_TOKENS_TOTAL: &str = name!("decode", "local_prefill_tokens_total");
    pub const TICKETS_REOPENED_TOTAL: &str = name!("decode", "tickets_reopened_total");
    pub const HANDED_OVER_TOTAL: &str = name!("decode", "handed_over_total");
    pub const HANDED_OVER_WITH_KV_TOTAL: &str = name!("decode", "handed_over_with_kv_total");
    pub const PARKED: &str = name!("decode", "parked");
    pub const KV_CORRUPT_TOTAL: &str = name!("decode", "kv_corrupt_total");
    pub const REQUESTS_TOTAL: &str = name!("decode", "requests_total");
    /// The prefix-cache and step-cost families.
    pub const WORKER: Worker = worker!("decode");
}

/// `meshctl up --autoscale`'s planner (on meshctl's control endpoint).
pub mod autoscaler {
    pub const DESIRED_REPLICAS: &str = "pdmesh_autoscaler_desired_replicas";
    pub const DECISIONS_TOTAL: &str = "pdmesh_autoscaler_decisions_total";
}

/// The single-kind families above.
const OWN: &[&str] = &[
    shared::DISCOVERY_UP,
    shared::DISCOVERY_ERRORS_TOTAL,
    gateway::IN_FLIGHT,
    gateway::REQUEST_SECONDS,
    gateway::REQUESTS_TOTAL,
    gateway::CONNECTIONS,
    gateway::CONNECTIONS_REFUSED_TOTAL,
    gateway::ROUTER_FAILOVERS_TOTAL,
    gateway::API_KEYS,
    gateway::AUTH_REFUSED_TOTAL,
    gateway::API_KEYS_RELOAD_ERRORS_TOTAL,
    router::IN_FLIGHT,
    router::TTFT_SECONDS,
    router::INTER_TOKEN_SECONDS,
    router::REQUEST_SECONDS,
    router::PROMPT_TOKENS_TOTAL,
    router::COMPLETION_TOKENS_TOTAL,
    router::CACHED_TOKENS_TOTAL,
    router::ROUTE_OVERLAP_TOKENS_TOTAL,
    router::PREFILL_PICKS_TOTAL,
    router::PREFILL_MODE_TOTAL,
    router::PREFILL_RETRIES_TOTAL,
    router::DECODE_RETRIES_TOTAL,
    router::MIGRATIONS_TOTAL,
    router::HANDOVERS_TOTAL,
    router::HANDOVER_FALLBACKS_TOTAL,
    router::KV_CORRUPT_RETRIES_TOTAL,
    router::REQUESTS_TOTAL,
    router::STALLS_TOTAL,
    router::EJECTIONS_TOTAL,
    router::WORKERS_OUT,
    tokenizer::REQUESTS_TOTAL,
    kvbroker::TICKETS,
    kvbroker::LEASE_EXPIRIES_TOTAL,
    prefill::RUNNING,
    prefill::QUEUED,
    prefill::QUEUED_TOKENS,
    prefill::EXPECTED_WAIT_SECONDS,
    prefill::QUEUE_WAIT_SECONDS,
    prefill::KV_BLOCKS_USED,
    prefill::KV_BLOCKS_TOTAL,
    prefill::KV_BLOCKS_PINNED,
    prefill::STEPS_TOTAL,
    prefill::PROMPT_TOKENS_TOTAL,
    prefill::KV_TRANSFER_BYTES_TOTAL,
    prefill::STEP_SECONDS,
    prefill::KV_TRANSFER_SECONDS,
    prefill::KV_TRANSFERS_TOTAL,
    prefill::REQUESTS_TOTAL,
    decode::RUNNING,
    decode::QUEUED,
    decode::AWAITING_KV,
    decode::KV_BLOCKS_USED,
    decode::KV_BLOCKS_PINNED,
    decode::KV_BLOCKS_TOTAL,
    decode::STEPS_TOTAL,
    decode::TOKENS_TOTAL,
    decode::STEP_SECONDS,
    decode::LOCAL_PREFILLING,
    decode::LOCAL_PREFILLS_TOTAL,
    decode::LOCAL_PREFILL_TOKENS_TOTAL,
    decode::TICKETS_REOPENED_TOTAL,
    decode::HANDED_OVER_TOTAL,
    decode::HANDED_OVER_WITH_KV_TOTAL,
    decode::PARKED,
    decode::KV_CORRUPT_TOTAL,
    decode::REQUESTS_TOTAL,
    autoscaler::DESIRED_REPLICAS,
    autoscaler::DECISIONS_TOTAL,
];

/// Every family name in this file.
pub fn all() -> impl Iterator<Item = &'static str> {
    OWN.iter().copied().chain(prefill::WORKER.names()).chain(decode::WORKER.names())
}

/// The family a sample line or `# TYPE` name belongs to: histogram series
/// (`_bucket`, `_sum`, `_count`) and OpenMetrics' counter family (no
/// `_total`) map back to the name listed in [`all`].
pub fn family_of(series: &str) -> Option<&'static str> {
    let listed = |name: &str| all().find(|n| *n == name);
    let histogram = || ["_bucket", "_sum", "_count"].iter().find_map(|s| series.strip_suffix(s)).and_then(listed);
    let counter = || all().find(|n| n.strip_suffix("_total") == Some(series));
    listed(series).or_else(histogram).or_else(counter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_listed_once_and_well_formed() {
        let mut seen = std::collections::HashSet::new();
        for n in all() {
            assert!(n.starts_with("pdmesh_") && !n.is_empty(), "{n}");
            assert!(n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'), "{n}");
            assert!(seen.insert(n), "{n} listed twice");
        }
    }

    #[test]
    fn series_map_to_their_family() {
        assert_eq!(family_of("pdmesh_router_ttft_seconds_bucket"), Some(router::TTFT_SECONDS));
        assert_eq!(family_of("pdmesh_router_requests"), Some(router::REQUESTS_TOTAL));
        assert_eq!(family_of("pdmesh_decode_prefix_hits_total"), Some(decode::WORKER.prefix_hits_total));
        assert_eq!(family_of("pdmesh_router_made_up"), None);
    }
}
