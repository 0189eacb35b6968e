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
use pdmesh_core::vocab::metric;
use pdmesh_proto::prefill::v1 as pb;
use pdmesh_worker::kv::send::transports;
use pdmesh_worker::kv::ship::Shipper;
use pdmesh_worker::ServeError;
use tokio::net::TcpListener;

use crate::batcher::{Batcher, Stats};
use crate::config::Config;

fn render(st: &Stats, f: Format) -> String {
    let mut t = Text::new(f);
    let g = |a: &std::sync::atomic::AtomicU32| a.load(Ordering::Relaxed) as f64;
    t.gauge(metric::prefill::RUNNING, "Prompts in the forward step now running.", g(&st.running))
        .gauge(metric::prefill::QUEUED, "Prompts waiting for a forward step.", g(&st.queued))
        .gauge(
            metric::prefill::QUEUED_TOKENS,
            "Prompt tokens of the queued prompts.",
            st.queued_tokens.load(Ordering::Relaxed) as f64,
        )
        .gauge(
            metric::prefill::EXPECTED_WAIT_SECONDS,
            "How long a prompt arriving now would wait for the prefill ahead of it (queued and unfinished prompt tokens at the measured speed).",
            st.expected_wait_ms.load(Ordering::Relaxed) as f64 / 1e3,
        )
        .gauge(metric::prefill::KV_BLOCKS_USED, "KV blocks in use (only during a step).", g(&st.kv_used))
        .gauge(metric::prefill::KV_BLOCKS_TOTAL, "KV blocks in the arena.", g(&st.kv_total))
        .gauge(
            metric::prefill::KV_BLOCKS_PINNED,
            "Blocks of prefilled prompts waiting for their transfer to end.",
            g(&st.kv_pinned),
        )
        .counter(metric::prefill::STEPS_TOTAL, "Batched prefill steps run.", st.steps.load(Ordering::Relaxed))
        .counter(
            metric::prefill::PROMPT_TOKENS_TOTAL,
            "Prompt tokens run forward.",
            st.prompt_tokens.load(Ordering::Relaxed),
        )
        .counter(
            metric::prefill::KV_TRANSFER_BYTES_TOTAL,
            "KV bytes written to decode workers.",
            st.transfer_bytes.load(Ordering::Relaxed),
        )
        .histogram(metric::prefill::STEP_SECONDS, "Duration of one batched prefill step.", &st.step_seconds)
        .histogram(
            metric::prefill::QUEUE_WAIT_SECONDS,
            "How long a prompt waited from its arrival to its start in a forward step.",
            &st.queue_wait_seconds,
        )
        .histogram(
            metric::prefill::KV_TRANSFER_SECONDS,
            "Duration of one KV transfer to a decode worker.",
            &st.transfer_seconds,
        );
    t.labelled(
        metric::prefill::KV_TRANSFERS_TOTAL,
        "counter",
        "KV transfers to decode workers, by transport.",
        "transport",
        &[
            ("nixl", st.transfers_nixl.load(Ordering::Relaxed) as f64),
            ("tcp", st.transfers_tcp.load(Ordering::Relaxed) as f64),
        ],
    );
    st.outcomes.render(&mut t, metric::prefill::REQUESTS_TOTAL, "Finished prefill requests by outcome.");
    st.prefix.render(&metric::prefill::WORKER, st.block_bytes, &mut t);
    st.step_costs.render(&metric::prefill::WORKER, &mut t);
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
    let ship = Shipper {
        transports: transports(nixl.clone(), layout, config.chunk_bytes),
        broker: broker.clone(),
        worker_id,
        claim_timeout: Duration::from_millis(config.claim_timeout_ms),
    };
    let svc = server::Service {
        batcher,
        ship,
        broker: broker.clone(),
        lease_renew_ms: config.lease_renew_ms.clamp(100, 60_000),
    };
    let routes = tonic::service::Routes::new(pb::prefill_server::PrefillServer::new(svc));
    pdmesh_worker::serve_worker(
        pdmesh_core::serve::Grpc { service: "prefill", name: "pdmesh.prefill.v1.Prefill", routes, hand_over: None },
        &config.worker.common,
        admin,
        listener,
        shutdown,
        pdmesh_worker::BrokerLink { agent, broker, engine: alive, unhealthy_after: config.worker.unhealthy_after() },
    )
    .await
}
