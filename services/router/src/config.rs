//! Flags of `pdmesh-router` (each also an environment variable).

use std::net::SocketAddr;

#[derive(clap::Parser, Debug, Clone, serde::Serialize)]
#[command(name = "pdmesh-router", version, about = "pdmesh router: the public Generate API (gRPC)")]
pub struct Config {
    /// gRPC listen address.
    #[arg(long, env = "PDMESH_ROUTER_LISTEN", default_value = "127.0.0.1:50081")]
    pub listen: SocketAddr,
    /// Tokenizer address(es); default: found in the registry.
    #[arg(long, env = "PDMESH_TOKENIZER_ADDR", value_delimiter = ',')]
    pub tokenizer_addr: Vec<String>,
    /// Prefill worker address(es); default: found in the registry.
    #[arg(long, env = "PDMESH_PREFILL_ADDR", value_delimiter = ',')]
    pub prefill_addr: Vec<String>,
    /// Decode worker address(es); default: found in the registry.
    #[arg(long, env = "PDMESH_DECODE_ADDR", value_delimiter = ',')]
    pub decode_addr: Vec<String>,
    /// kvbroker address(es), used to cancel transfers of aborted requests; default: found in the registry.
    #[arg(long = "kvbroker-addr", env = "PDMESH_KVBROKER_ADDR", value_delimiter = ',')]
    pub kvbroker_addr: Vec<String>,
    /// Longest a request may take, in seconds, when the caller sets no shorter deadline.
    #[arg(long, env = "PDMESH_ROUTER_REQUEST_TIMEOUT_S", default_value_t = 600)]
    pub request_timeout_s: u64,
    /// Further prefill/decode pairs tried when a decode refuses, and further
    /// dispatches when a prefill or decode worker fails (died, broke or had
    /// no room), before the first token reached the caller.
    #[arg(long, env = "PDMESH_ROUTER_RETRIES", default_value_t = 1)]
    pub retries: u32,
    /// Times one request may move to another decode worker after tokens
    /// reached the caller (its worker died, broke or was drained): the
    /// prompt and the tokens so far are prefilled again elsewhere and the
    /// stream goes on, with no token repeated or missing.
    #[arg(long, env = "PDMESH_ROUTER_MAX_MIGRATIONS", default_value_t = 2)]
    pub max_migrations: u32,
    /// How long a request waits, within its deadline, for a decode worker
    /// (or, with local prefill off, a prefill worker) when none is live: a
    /// supervisor restarting the only one takes a few seconds.
    #[arg(long, env = "PDMESH_ROUTER_WORKER_WAIT_MS", default_value_t = 10_000)]
    pub worker_wait_ms: u64,
    /// How a prefill worker is chosen: `cache-aware` (the worker whose
    /// prefix cache holds most of the prompt, unless loads are out of
    /// balance) or `least-busy`. Decode workers are picked alike when local
    /// prefill is on (`--max-local-prefill`), least busy otherwise.
    #[arg(long, env = "PDMESH_ROUTER_POLICY", value_enum, default_value = "cache-aware")]
    pub policy: PolicyName,
    /// cache-aware: least share (0..=1) of the prompt's full blocks a
    /// prefill worker must hold to be chosen over the least busy one.
    #[arg(long, env = "PDMESH_ROUTER_CACHE_THRESHOLD", default_value_t = 0.5)]
    pub cache_threshold: f64,
    /// cache-aware: loads are out of balance (and the least busy worker is
    /// chosen) when the busiest prefill worker has more than this many
    /// requests over the least busy one ...
    #[arg(long, env = "PDMESH_ROUTER_BALANCE_ABS_THRESHOLD", default_value_t = 8)]
    pub balance_abs_threshold: u32,
    /// ... and more than this many times its load (>= 1).
    #[arg(long, env = "PDMESH_ROUTER_BALANCE_REL_THRESHOLD", default_value_t = 1.5)]
    pub balance_rel_threshold: f64,
    /// Conditional disaggregation: the chosen decode worker prefills a
    /// prompt itself when the tokens it would compute (the prompt less what
    /// its prefix cache holds, e.g. the earlier turns of a chat) are at most
    /// this many; longer ones go to a prefill worker. 0: always a prefill worker.
    #[arg(long, env = "PDMESH_ROUTER_MAX_LOCAL_PREFILL", default_value_t = 256)]
    pub max_local_prefill: u32,
    /// Most requests this router serves at once; one more is refused with
    /// RESOURCE_EXHAUSTED (HTTP 429 `router_busy` at the gateway).
    #[arg(long, env = "PDMESH_ROUTER_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub max_in_flight: u64,
    /// Patience for a worker that stops making progress, in ms: a stream
    /// with no event for this long, on a worker that has not answered its
    /// load poll for as long or says its engine loop is stuck (see
    /// `--stall-steps`), moves to another worker (no token repeated) and
    /// the worker is ejected.
    #[arg(long, env = "PDMESH_ROUTER_STALL_FLOOR_MS", default_value_t = 1000)]
    pub stall_floor_ms: u64,
    /// A worker whose engine loop has not moved counts as stuck after this
    /// many of its own recent step times, when longer than `--stall-floor-ms`.
    #[arg(long, env = "PDMESH_ROUTER_STALL_STEPS", default_value_t = 8)]
    pub stall_steps: u32,
    /// A worker whose call stalled or was lost is left out of picking this
    /// long (ms), doubling with each such strike in a row up to
    /// `--eject-max-ms`; then it is probed with one request at a time until
    /// one is served to its end.
    #[arg(long, env = "PDMESH_ROUTER_EJECT_MS", default_value_t = 1000)]
    pub eject_ms: u64,
    /// Longest ejection, in ms (see `--eject-ms`).
    #[arg(long, env = "PDMESH_ROUTER_EJECT_MAX_MS", default_value_t = 30_000)]
    pub eject_max_ms: u64,
    /// Most stop strings per request (default: the gateway's, OpenAI's 4).
    #[arg(long, env = "PDMESH_ROUTER_MAX_STOP", default_value_t = pdmesh_core::vocab::limits::MAX_STOP_STRINGS)]
    pub max_stop: usize,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}

/// `--policy`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    CacheAware,
    LeastBusy,
}

/// The prefill-picking policy, checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    CacheAware(crate::pick::CacheAware),
    LeastBusy,
}

impl Policy {
    /// The name on the `route` span.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::CacheAware(_) => "cache_aware",
            Policy::LeastBusy => "least_busy",
        }
    }
}

impl Config {
    /// The stall and ejection knobs, checked.
    pub fn outlier_knobs(&self) -> Result<pdmesh_core::outlier::Knobs, String> {
        if self.stall_floor_ms < 100 {
            return Err(format!("--stall-floor-ms must be at least 100, got {}", self.stall_floor_ms));
        }
        if self.eject_ms == 0 || self.eject_max_ms < self.eject_ms {
            return Err(format!(
                "--eject-ms must be above 0 and at most --eject-max-ms, got {} and {}",
                self.eject_ms, self.eject_max_ms
            ));
        }
        Ok(pdmesh_core::outlier::Knobs {
            floor: std::time::Duration::from_millis(self.stall_floor_ms),
            steps: self.stall_steps,
            eject: std::time::Duration::from_millis(self.eject_ms),
            eject_max: std::time::Duration::from_millis(self.eject_max_ms),
        })
    }

    /// The policy the flags describe, or what is wrong with them.
    pub fn policy(&self) -> Result<Policy, String> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(format!("--cache-threshold must be within 0..=1, got {}", self.cache_threshold));
        }
        if self.balance_rel_threshold.is_nan() || self.balance_rel_threshold < 1.0 {
            return Err(format!("--balance-rel-threshold must be at least 1, got {}", self.balance_rel_threshold));
        }
        Ok(match self.policy {
            PolicyName::LeastBusy => Policy::LeastBusy,
            PolicyName::CacheAware => Policy::CacheAware(crate::pick::CacheAware {
                cache_threshold: self.cache_threshold,
                balance_abs: self.balance_abs_threshold,
                balance_rel: self.balance_rel_threshold,
            }),
        })
    }
}
