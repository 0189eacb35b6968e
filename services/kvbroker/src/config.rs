//! Flags of `pdmesh-kvbroker` (each also an environment variable).

use std::net::SocketAddr;

#[derive(clap::Parser, Debug, Clone, serde::Serialize)]
#[command(name = "pdmesh-kvbroker", version, about = "pdmesh KV-transfer broker (gRPC)")]
pub struct Config {
    /// gRPC listen address.
    #[arg(long, env = "PDMESH_KVBROKER_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// How often leases are checked, in milliseconds.
    #[arg(long, env = "PDMESH_KVBROKER_TICK_MS", default_value_t = 50)]
    pub tick_ms: u64,
    /// How long ended tickets are remembered (so late callers learn the outcome), in seconds.
    #[arg(long, env = "PDMESH_KVBROKER_RETENTION_S", default_value_t = 60)]
    pub retention_s: u64,
    /// Longest lease a worker may ask for, in milliseconds.
    #[arg(long, env = "PDMESH_KVBROKER_MAX_LEASE_MS", default_value_t = 60_000)]
    pub max_lease_ms: u32,
    /// Most tickets held at once (live, not yet opened, and ended ones
    /// remembered); past it, a new request id gets RESOURCE_EXHAUSTED.
    #[arg(long, env = "PDMESH_KVBROKER_MAX_TICKETS", default_value_t = 65_536)]
    pub max_tickets: usize,
    /// Most workers registered; past it, a new worker id gets
    /// RESOURCE_EXHAUSTED (a known one may always register again).
    #[arg(long, env = "PDMESH_KVBROKER_MAX_AGENTS", default_value_t = 4096)]
    pub max_agents: usize,
    /// Most live tickets (open, claimed or writing) naming one decode
    /// worker as their destination; past it, that worker's next open gets
    /// RESOURCE_EXHAUSTED, so no one worker fills the table.
    #[arg(long, env = "PDMESH_KVBROKER_MAX_TICKETS_PER_WORKER", default_value_t = 8192)]
    pub max_tickets_per_worker: usize,
    /// A worker's agent not registered again for this long is forgotten
    /// (live workers register every 2 s), in seconds.
    #[arg(long, env = "PDMESH_KVBROKER_AGENT_TTL_S", default_value_t = 30)]
    pub agent_ttl_s: u64,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}
