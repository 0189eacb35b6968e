//! Flags of `pdmesh-gateway` (each also an environment variable).

use std::net::SocketAddr;

#[derive(clap::Parser, Debug, Clone, serde::Serialize)]
#[command(
    name = "pdmesh-gateway",
    version,
    about = "pdmesh gateway: OpenAI-compatible HTTP API in front of the router"
)]
pub struct Config {
    /// HTTP listen address of the OpenAI API (also serves /health).
    #[arg(long, env = "PDMESH_GATEWAY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve on a listening socket inherited as this file descriptor
    /// instead of binding --listen (`meshctl up` holds the gateway's port
    /// and hands it to each gateway process, so a restarted gateway takes
    /// over the same socket while the old one drains: no connection is
    /// refused or reset).
    #[arg(long, env = "PDMESH_GATEWAY_LISTEN_FD")]
    pub listen_fd: Option<i32>,
    /// Router address(es); default: found in the registry.
    #[arg(long, env = "PDMESH_ROUTER_ADDR", value_delimiter = ',')]
    pub router_addr: Vec<String>,
    /// The model name clients must ask for (listed by /v1/models), in a
    /// mesh of one model.
    #[arg(long, env = "PDMESH_GATEWAY_MODEL_NAME", default_value = "smollm2-135m-instruct")]
    pub model_name: String,
    /// Serve several models: each name is a model pool (the `--pool` of
    /// that model's tokenizer, prefill, decode, router and kvbroker).
    /// Clients name the pool in `model`; its routers are found in discovery
    /// as `router@NAME`. Replaces --model-name; needs --discovery.
    #[arg(long, env = "PDMESH_GATEWAY_MODELS", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Longest a request may take, in seconds. A client's `x-request-timeout`
    /// header (seconds) can only shorten it.
    #[arg(long, env = "PDMESH_GATEWAY_REQUEST_TIMEOUT_S", default_value_t = 600.0)]
    pub request_timeout_s: f64,
    /// Largest request body accepted, in bytes.
    #[arg(long, env = "PDMESH_GATEWAY_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// max_tokens used when a request gives none.
    #[arg(long, env = "PDMESH_GATEWAY_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: u32,
    /// Patience for a router that stops answering, in ms (at least 100):
    /// the gateway polls each router's gRPC health every 250 ms; a stream
    /// with no event this long from a router whose health check has gone
    /// unanswered as long moves to another router (as when a router dies),
    /// and the router is left out of picking for a while.
    #[arg(long, env = "PDMESH_GATEWAY_ROUTER_STALL_FLOOR_MS", default_value_t = 1000)]
    pub router_stall_floor_ms: u64,
    #[command(flatten)]
    pub keys: KeyArgs,
    #[command(flatten)]
    pub front: crate::front::FrontArgs,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}

/// API keys (see `auth`): without `--api-keys-file`, no key is asked for.
#[derive(clap::Args, Clone, Debug, Default, serde::Serialize)]
pub struct KeyArgs {
    /// File of API keys, one per line: the key or `sha256:<hex>` of it,
    /// then optionally `name=`, `concurrency=`, `rpm=`. Read again within a
    /// second of changing. Requests to /v1/* then need `Authorization:
    /// Bearer KEY` (401 without a known key, 429 over its limits).
    #[arg(long, env = "PDMESH_GATEWAY_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Default cap on one key's requests in flight (0 = none).
    #[arg(long, env = "PDMESH_GATEWAY_KEY_MAX_CONCURRENCY", default_value_t = 0)]
    pub key_max_concurrency: u32,
    /// Default cap on one key's requests per minute (0 = none).
    #[arg(long, env = "PDMESH_GATEWAY_KEY_RPM", default_value_t = 0)]
    pub key_rpm: u32,
}

impl Config {
    /// How routers are judged (`--router-stall-floor-ms`), checked.
    pub fn router_knobs(&self) -> Result<pdmesh_core::outlier::Knobs, String> {
        if self.router_stall_floor_ms < 100 {
            return Err(format!("--router-stall-floor-ms must be at least 100, got {}", self.router_stall_floor_ms));
        }
        Ok(pdmesh_core::outlier::Knobs {
            floor: std::time::Duration::from_millis(self.router_stall_floor_ms),
            ..pdmesh_core::outlier::Knobs::default()
        })
    }
}
