//! pdmesh tokenizer service: `pdmesh.tokenizer.v1.Tokenizer` over gRPC —
//! encode (raw or chat-templated), incremental detokenize, model info —
//! plus `grpc.health.v1` and reflection. Reads only the GGUF's tokenizer
//! metadata; stateless, so any number of replicas can run.
//!
//! ```no_run
//! # async fn f(cfg: pdmesh_tokenizer::config::Config) -> Result<(), pdmesh_core::serve::ServeError> {
//! let listener = tokio::net::TcpListener::bind(cfg.listen).await.expect("bind");
//! pdmesh_tokenizer::serve(cfg, listener, std::future::pending()).await
//! # }
//! ```

pub mod config;
pub mod error;
pub mod metrics;
pub mod server;

use std::future::Future;
use std::sync::Arc;

use pdmesh_core::admin::AdminState;
use pdmesh_core::serve::{serve_grpc, Admin, Grpc, ServeError};
use pdmesh_engine::gguf::Gguf;
use pdmesh_engine::{ModelConfig, Tokenizer};
use pdmesh_proto::tokenizer::v1 as pb;
use tokio::net::TcpListener;

use crate::config::Config;

/// Load the tokenizer, then serve on `listener` until `shutdown` resolves.
/// gRPC health and `/health` report ready only once the tokenizer is
/// loaded; the instance is announced in the registry (if configured) while
/// it serves and withdrawn when it stops.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let metrics = Arc::new(metrics::Metrics::default());
    let m2 = metrics.clone();
    let admin = AdminState::new(
        "tokenizer",
        serde_json::to_value(&config).unwrap_or_default(),
        Arc::new(move |f| m2.render(f)),
    );
    let admin = Admin::start(&config.common, admin).await?;
    let cache = config.cache.clone();
    let explicit = config.model.clone();
    let path = tokio::task::spawn_blocking(move || cache.model_or_fetch(explicit.as_deref()))
        .await
        .map_err(|e| ServeError::Setup(e.to_string()))?
        .map_err(|e| ServeError::Setup(e.to_string()))?;
    let (tok, info) = tokio::task::spawn_blocking(move || -> Result<_, pdmesh_engine::EngineError> {
        let g = Gguf::open(&path)?;
        let tok = Tokenizer::from_gguf(&g)?;
        let mc = ModelConfig::from_gguf(&g)?;
        let info = pb::InfoResponse {
            model: mc.name.clone(),
            vocab_size: tok.vocab_size() as u32,
            bos_id: tok.bos_id,
            eos_id: tok.eos_id,
            context_length: mc.context_length as u32,
        };
        Ok((tok, info))
    })
    .await
    .map_err(|e| ServeError::Setup(e.to_string()))?
    .map_err(|e| ServeError::Setup(e.to_string()))?;
    let svc = server::Service {
        tok: Arc::new(tok),
        info,
        max_input_bytes: config.max_input_bytes,
        max_messages: config.max_messages,
        metrics,
    };
    let routes = tonic::service::Routes::new(pb::tokenizer_server::TokenizerServer::new(svc));
    let grpc = Grpc { service: "tokenizer", name: "pdmesh.tokenizer.v1.Tokenizer", routes, hand_over: None };
    serve_grpc(admin, &config.common, grpc, listener, shutdown, std::future::ready(())).await
}
