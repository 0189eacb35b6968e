//! pdmesh decode worker: admits a request by reserving KV blocks for its
//! prompt plus max_tokens (RESOURCE_EXHAUSTED at once when they are not
//! free), opens the transfer ticket, receives the prompt's KV from a
//! prefill worker, then decodes it in a continuous batch and streams the
//! tokens. Blocks are freed whenever the stream ends, for any reason.

pub mod batcher;
pub mod config;
pub mod error;
pub mod server;

use std::future::Future;
use std::sync::atomic::Ordering;

use pdmesh_core::metrics::{Format, Text};
use pdmesh_core::vocab::metric;
use pdmesh_proto::decode::v1 as pb;
use pdmesh_worker::ServeError;
use tokio::net::TcpListener;

use crate::batcher::{Batcher, Stats, PARK_TTL};
use crate::config::Config;
use pdmesh_worker::kv::send::transports;
use pdmesh_worker::kv::ship::Shipper;

fn render(st: &Stats, f: Format) -> String {
    let mut t = Text::new(f);
    let g = |a: &std::sync::atomic::AtomicU32| a.load(Ordering::Relaxed) as f64;
    t.gauge(metric::decode::RUNNING, "Sequences in the running batch.", g(&st.running))
        .gauge(metric::decode::QUEUED, "Sequences with their KV, waiting for a batch slot.", g(&st.queued))
        .gauge(metric::decode::AWAITING_KV, "Admitted sequences waiting for their prompt's KV.", g(&st.awaiting_kv))
        .gauge(metric::decode::KV_BLOCKS_USED, "KV blocks reserved or in use.", g(&st.kv_used))
        .gauge(metric::decode::KV_BLOCKS_PINNED, "KV blocks held for requests not yet started (waiting for their KV, or quarantined after a failed transfer).", g(&st.kv_reserved))
        .gauge(metric::decode::KV_BLOCKS_TOTAL, "KV blocks in the arena.", g(&st.kv_total))
        .counter(metric::decode::STEPS_TOTAL, "Decode steps run.", st.steps.load(Ordering::Relaxed))
        .counter(metric::decode::TOKENS_TOTAL, "Tokens streamed (including each first token).", st.tokens.load(Ordering::Relaxed))
        .histogram(metric::decode::STEP_SECONDS, "Duration of one decode step.", &st.step_seconds)
        .gauge(metric::decode::LOCAL_PREFILLING, "Local prefills admitted and not yet at their first token.", g(&st.local_prefilling))
        .counter(metric::decode::LOCAL_PREFILLS_TOTAL, "Prompts prefilled by this decode worker itself (local prefill).", st.local_prefills.load(Ordering::Relaxed))
        .counter(metric::decode::LOCAL_PREFILL_TOKENS_TOTAL, "Prompt tokens computed by local prefills (cached ones not counted).", st.local_prefill_tokens.load(Ordering::Relaxed))
        .counter(metric::decode::TICKETS_REOPENED_TOTAL, "Transfer tickets opened again at a kvbroker that had lost them (restarted) before their transfer began.", st.tickets_reopened.load(Ordering::Relaxed))
        .counter(metric::decode::HANDED_OVER_TOTAL, "Sequences handed over to other decode workers on drain (their routers migrate them).", st.handed_over.load(Ordering::Relaxed))
        .counter(metric::decode::HANDED_OVER_WITH_KV_TOTAL, "Sequences handed over on drain with their KV shipped along (no replay).", st.handed_over_with_kv.load(Ordering::Relaxed))
        .gauge(metric::decode::PARKED, "Sequences parked by a drain, waiting for their KV to be shipped.", g(&st.parked))
        .counter(metric::decode::KV_CORRUPT_TOTAL, "Transferred prompts whose KV failed its checksum before the first decode step (ended UNAVAILABLE; the router transfers again).", st.kv_corrupt.load(Ordering::Relaxed));
    st.outcomes.render(&mut t, metric::decode::REQUESTS_TOTAL, "Finished decode requests by outcome.");
    st.prefix.render(&metric::decode::WORKER, st.block_bytes, &mut t);
    st.step_costs.render(&metric::decode::WORKER, &mut t);
    t.finish()
}

/// Load the model, then serve on `listener` until `shutdown` resolves.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    if config.local_step_tokens == 0 {
        return Err(ServeError::Setup("--local-step-tokens must be at least 1".into()));
    }
    let config_json = serde_json::to_value(&config).unwrap_or_default();
    let mut worker = config.worker.clone();
    worker.engine.prefix_cache_blocks = config.prefix_cache_blocks;
    worker.engine.cache_generated = config.prefix_cache_generated;
    let w = pdmesh_worker::start_worker("decode", config_json, &worker, render).await?;
    let mut agent = w.agent();
    let pdmesh_worker::Started { admin, engine, stats, worker_id, nixl, broker } = w;
    let layout = engine.kv.layout;
    let host_arena = engine.kv.arena();
    let batcher = Batcher::start(
        engine,
        config.worker.engine.max_batch(),
        config.local_step_tokens,
        config.worker.engine.trace_kernel_steps,
        config.drain_ships_kv,
    );
    let _ = stats.set(batcher.stats.clone());
    let alive = batcher.alive.clone();
    let grpc_addr = listener.local_addr().map_err(|e| ServeError::Setup(e.to_string()))?;
    // Prefill workers send KV where everyone else reaches it.
    agent.address = config.worker.common.advertise_addr.clone().unwrap_or_else(|| grpc_addr.to_string());
    agent.block_bytes = layout.block_bytes() as u64;
    // With NIXL, prefill workers write straight into the registered arena;
    // WriteKv (tcp) stays available for those without it.
    let stop_progress = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pending = server::Pending::default();
    if let Some(n) = &nixl {
        agent.nixl_metadata = n.metadata().map_err(ServeError::Setup)?;
        agent.arena_addr = n.arena.addr as u64;
        agent.arena_len = n.arena.len as u64;
        agent.arena_in_vram = n.arena.gpu.is_some();
        agent.arena_gpu = n.arena.gpu.unwrap_or(0) as u32;
        let st = batcher.stats.clone();
        // A write landed: its sequence's blocks are checksummed at once,
        // while the ticket's completion travels through the kvbroker.
        let (b, p) = (batcher.clone(), pending.clone());
        let landed = move |request_id: &str| {
            if let Some((seq, _)) = p.lock().unwrap_or_else(|e| e.into_inner()).get(request_id) {
                b.landed(*seq);
            }
        };
        pdmesh_worker::kv::spawn_progress(
            n.clone(),
            move || st.awaiting_kv.load(Ordering::Relaxed) > 0,
            landed,
            stop_progress.clone(),
        );
    }
    let hand_over = batcher.hand_over();
    let ship = Shipper {
        transports: transports(nixl.clone(), layout, 1 << 20),
        broker: broker.clone(),
        worker_id: worker_id.clone(),
        claim_timeout: PARK_TTL,
    };
    let svc = server::Service {
        batcher,
        ship,
        broker: broker.clone(),
        worker_id,
        layout,
        lease_ms: config.lease_ms,
        pending,
        host_arena,
    };
    let routes =
        tonic::service::Routes::new(pb::decode_server::DecodeServer::new(svc).max_decoding_message_size(64 << 20));
    let r = pdmesh_worker::serve_worker(
        pdmesh_core::serve::Grpc {
            service: "decode",
            name: "pdmesh.decode.v1.Decode",
            routes,
            hand_over: Some(hand_over),
        },
        &config.worker.common,
        admin,
        listener,
        shutdown,
        pdmesh_worker::BrokerLink { agent, broker, engine: alive, unhealthy_after: config.worker.unhealthy_after() },
    )
    .await;
    stop_progress.store(true, Ordering::Relaxed);
    let t0 = std::time::Instant::now();
    drop(nixl);
    eprintln!("pdmesh-decode: stopped; KV transport released in {:.2} s", t0.elapsed().as_secs_f64());
    r
}
