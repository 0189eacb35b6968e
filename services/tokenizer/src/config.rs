//! Flags of `pdmesh-tokenizer` (each also an environment variable).

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(clap::Parser, Debug, Clone, serde::Serialize)]
#[command(name = "pdmesh-tokenizer", version, about = "pdmesh tokenizer service (gRPC)")]
pub struct Config {
    /// gRPC listen address.
    #[arg(long, env = "PDMESH_TOKENIZER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// GGUF model file (only its tokenizer metadata is read). Default: the cached SmolLM2 model, fetched on first use.
    #[arg(long, env = "PDMESH_TOKENIZER_MODEL")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Largest prompt or chat content accepted, in bytes; larger requests get INVALID_ARGUMENT.
    #[arg(long, env = "PDMESH_TOKENIZER_MAX_INPUT_BYTES", default_value_t = 1 << 20)]
    pub max_input_bytes: usize,
    /// Most chat messages in one request; more get INVALID_ARGUMENT (checked
    /// before the template is rendered).
    #[arg(long, env = "PDMESH_TOKENIZER_MAX_MESSAGES", default_value_t = 4096)]
    pub max_messages: usize,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}
