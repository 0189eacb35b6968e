//! Flags of `pdmesh-decode` (each also an environment variable).

use std::net::SocketAddr;

#[derive(clap::Parser, Debug, Clone, serde::Serialize)]
#[command(name = "pdmesh-decode", version, about = "pdmesh decode worker (gRPC)")]
pub struct Config {
    /// gRPC listen address.
    #[arg(long, env = "PDMESH_DECODE_LISTEN", default_value = "127.0.0.1:50061")]
    pub listen: SocketAddr,
    /// Lease of a transfer ticket, in milliseconds: how long reserved blocks
    /// wait for the prefill's KV before the ticket expires and they are freed.
    #[arg(long, env = "PDMESH_DECODE_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u32,
    /// Prefix cache: most KV blocks of finished sequences (prompt and
    /// answer) kept for reuse by local prefills, evicted LRU when the arena
    /// needs room. 0 switches it off (local prefills then compute the whole
    /// prompt).
    #[arg(long, env = "PDMESH_DECODE_PREFIX_CACHE_BLOCKS", default_value_t = 1024)]
    pub prefix_cache_blocks: usize,
    /// `true`: the prefix cache keeps answers too (generated tokens' KV),
    /// so a chat's next turn computes only its new message. Their KV came
    /// from single-token decode kernels, so logits of a prompt reusing it
    /// are close to, not the same bits as, a cold prefill's. `false`: only
    /// prompt KV computed as a cold prefill would be is kept (exact).
    #[arg(long, env = "PDMESH_DECODE_PREFIX_CACHE_GENERATED", default_value_t = true, action = clap::ArgAction::Set)]
    pub prefix_cache_generated: bool,
    /// Most prompt tokens of local prefills fed per decode step (beside one
    /// token of each running sequence), so a local prefill delays running
    /// sequences by about one such step. 64 against 256 in an A/B run: the
    /// same throughput, half the TTFT p50 at 4-16 clients, inter-token p99
    /// ~250 ms instead of ~700 ms at 16-32.
    #[arg(long, env = "PDMESH_DECODE_LOCAL_STEP_TOKENS", default_value_t = 64)]
    pub local_step_tokens: usize,
    /// On drain, `true`: ship each running sequence's KV (prompt and tokens
    /// so far, NIXL where both ends have it, else TCP) to the decode worker
    /// its router picks next, which goes on from the last token. `false`:
    /// end the streams, and the routers replay the tokens so far elsewhere
    /// (decode steps recompute their KV).
    #[arg(long, env = "PDMESH_DECODE_DRAIN_SHIPS_KV", default_value_t = true, action = clap::ArgAction::Set)]
    pub drain_ships_kv: bool,
    #[command(flatten)]
    pub worker: pdmesh_worker::WorkerArgs,
}
