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
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}
