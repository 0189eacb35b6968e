//! pdmesh prefill worker: batches queued prompts into forward steps,
//! samples each one's first token, writes its KV into the blocks a decode
//! worker reserved (the transfer ticket named by the request id), and
//! frees its own blocks right away.

pub mod batcher;
pub mod config;
pub mod error;
pub mod server;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pdmesh_core::metrics::{Format, Text};
use pdmesh_proto::prefill::v1 as pb;
use pdmesh_worker::kv::send::{KvTransport, NixlTransport, TcpTransport};
use pdmesh_worker::ServeError;
use tokio::net::TcpListener;

use crate::batcher::{Batcher, Stats};
use crate::config::Config;

fn render(st: &Stats, f: Format) -> String {
    let mut t = Text::new(f);
    let g = |a: &std::sync::atomic::AtomicU32| a.load(Ordering::Relaxed) as f64;
    t.gauge("pdmesh_prefill_running", "Prompts in the forward step now running.", g(&st.running))
        .gauge("pdmesh_prefill_queued", "Prompts waiting for a forward step.", g(&st.queued))
        .gauge(
            "pdmesh_prefill_queued_tokens",
            "Prompt tokens of the queued prompts.",
            st.queued_tokens.load(Ordering::Relaxed) as f64,
        )
        .gauge(
            "pdmesh_prefill_expected_wait_seconds",
            "How long a prompt arriving now would wait for the prefill ahead of it (queued and unfinished prompt tokens at the measured speed).",
            st.expected_wait_ms.load(Ordering::Relaxed) as f64 / 1e3,
        )
        .gauge("pdmesh_prefill_kv_blocks_used", "KV blocks in use (only during a step).", g(&st.kv_used))
        .gauge("pdmesh_prefill_kv_blocks_total", "KV blocks in the arena.", g(&st.kv_total))
        .gauge(
            "pdmesh_prefill_kv_blocks_pinned",
            "Blocks of prefilled prompts waiting for their transfer to end.",
            g(&st.kv_pinned),
        )
        .counter("pdmesh_prefill_steps_total", "Batched prefill steps run.", st.steps.load(Ordering::Relaxed))
        .counter(
            "pdmesh_prefill_prompt_tokens_total",
            "Prompt tokens run forward.",
            st.prompt_tokens.load(Ordering::Relaxed),
        )
        .counter(
            "pdmesh_prefill_kv_transfer_bytes_total",
            "KV bytes written to decode workers.",
            st.transfer_bytes.load(Ordering::Relaxed),
        )
        .histogram("pdmesh_prefill_step_seconds", "Duration of one batched prefill step.", &st.step_seconds)
        .histogram(
            "pdmesh_prefill_kv_transfer_seconds",
            "Duration of one KV transfer to a decode worker.",
            &st.transfer_seconds,
        );
    t.labelled(
        "pdmesh_prefill_kv_transfers_total",
        "counter",
        "KV transfers to decode workers, by transport.",
        "transport",
        &[
            ("nixl", st.transfers_nixl.load(Ordering::Relaxed) as f64),
            ("tcp", st.transfers_tcp.load(Ordering::Relaxed) as f64),
        ],
    );
    st.outcomes.render(&mut t, "pdmesh_prefill_requests_total", "Finished prefill requests by outcome.");
    st.prefix.render("prefill", st.block_bytes, &mut t);
    st.step_costs.render("prefill", &mut t);
    t.finish()
}

/// Load the model, then serve on `listener` until `shutdown` resolves.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    if config.chunk_bytes == 0 || config.chunk_bytes > 32 << 20 {
        return Err(ServeError::Setup(format!("--chunk-bytes must be 1..=33554432, got {}", config.chunk_bytes)));
    }
    let config_json = serde_json::to_value(&config).unwrap_or_default();
    let mut worker = config.worker.clone();
    worker.engine.prefix_cache_blocks = config.prefix_cache_blocks;
    let w = pdmesh_worker::start_worker("prefill", config_json, &worker, render).await?;
    let agent = w.agent();
    let pdmesh_worker::Started { admin, engine, stats, worker_id, nixl, broker } = w;
    let layout = engine.kv.layout;
    let ek = &config.worker.engine;
    let mut batcher = Batcher::start(engine, ek.max_batch(), config.batch_tokens, ek.trace_kernel_steps);
    batcher.max_queue = config.max_queue.max(1);
    let alive = batcher.alive.clone();
    let _ = stats.set(batcher.stats.clone());
    let mut transports: Vec<Box<dyn KvTransport>> = Vec::new();
    if let Some(n) = nixl.clone() {
        transports.push(Box::new(NixlTransport { nixl: n, layout }));
    }
    transports.push(Box::new(TcpTransport { chunk_bytes: config.chunk_bytes, channels: Default::default() }));
    let svc = server::Service {
        batcher,
        transports,
        broker: broker.clone(),
        worker_id,
        claim_timeout: Duration::from_millis(config.claim_timeout_ms),
        lease_renew_ms: config.lease_renew_ms.clamp(100, 60_000),
    };
    let routes = tonic::service::Routes::new(pb::prefill_server::PrefillServer::new(svc));
    pdmesh_worker::serve_worker(
        pdmesh_core::serve::Grpc { service: "prefill", name: "pdmesh.prefill.v1.Prefill", routes },
        &config.worker.common,
        admin,
        listener,
        shutdown,
        pdmesh_worker::BrokerLink { agent, broker, engine: alive },
    )
    .await
}
