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
    /// Further prefill/decode pairs tried when a pair refuses or fails before the first token.
    #[arg(long, env = "PDMESH_ROUTER_RETRIES", default_value_t = 1)]
    pub retries: u32,
    /// Most stop strings per request.
    #[arg(long, env = "PDMESH_ROUTER_MAX_STOP", default_value_t = 8)]
    pub max_stop: usize,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}
