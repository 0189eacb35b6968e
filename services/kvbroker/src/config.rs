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
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}
