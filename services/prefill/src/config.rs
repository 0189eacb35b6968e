//! Flags of `pdmesh-prefill` (each also an environment variable).

use std::net::SocketAddr;

#[derive(clap::Parser, Debug, Clone, serde::Serialize)]
#[command(name = "pdmesh-prefill", version, about = "pdmesh prefill worker (gRPC)")]
pub struct Config {
    /// gRPC listen address.
    #[arg(long, env = "PDMESH_PREFILL_LISTEN", default_value = "127.0.0.1:50071")]
    pub listen: SocketAddr,
    /// Most prompt tokens one prefill step feeds, over all prompts: longer
    /// prompts are spread over several steps, so a short prompt waits at
    /// most about one step behind a long one.
    #[arg(long, env = "PDMESH_PREFILL_BATCH_TOKENS", default_value_t = 2048)]
    pub batch_tokens: usize,
    /// Most prompts waiting for a prefill step (a full arena makes them
    /// wait); one more is refused with RESOURCE_EXHAUSTED, which the router
    /// takes elsewhere.
    #[arg(long, env = "PDMESH_PREFILL_MAX_QUEUE", default_value_t = 1024)]
    pub max_queue: usize,
    /// How long to wait for the decode worker to open the transfer ticket, in milliseconds.
    #[arg(long, env = "PDMESH_PREFILL_CLAIM_TIMEOUT_MS", default_value_t = 10_000)]
    pub claim_timeout_ms: u64,
    /// While a prompt waits and runs, its ticket's lease is kept at least this
    /// far ahead (renewed every quarter of it), in milliseconds.
    #[arg(long, env = "PDMESH_PREFILL_LEASE_RENEW_MS", default_value_t = 10_000)]
    pub lease_renew_ms: u64,
    /// Prefix cache: most full prompt blocks kept for reuse once no request
    /// holds them (evicted least recently used first, and sooner when the
    /// arena needs room). 0 switches the prefix cache off.
    #[arg(long, env = "PDMESH_PREFILL_PREFIX_CACHE_BLOCKS", default_value_t = 1024)]
    pub prefix_cache_blocks: usize,
    /// Bytes per KV chunk on the TCP transport.
    #[arg(long, env = "PDMESH_PREFILL_CHUNK_BYTES", default_value_t = 1 << 20)]
    pub chunk_bytes: usize,
    #[command(flatten)]
    pub worker: pdmesh_worker::WorkerArgs,
}
