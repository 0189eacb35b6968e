//! pdmesh decode worker: admits a request by reserving KV blocks for its
//! prompt plus max_tokens (RESOURCE_EXHAUSTED at once when they are not
//! free), opens the transfer ticket, receives the prompt's KV from a
//! prefill worker, then decodes it in a continuous batch and streams the
//! tokens. Blocks are freed whenever the stream ends, for any reason.

pub mod batcher;
pub mod config;
pub mod server;

use std::future::Future;
use std::sync::atomic::Ordering;

use pdmesh_core::metrics::Text;
use pdmesh_core::peers::Peers;
use pdmesh_proto::decode::v1 as pb;
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_worker::ServeError;
use tokio::net::TcpListener;

use crate::batcher::{Batcher, Stats};
use crate::config::Config;

fn render(st: &Stats) -> String {
    let mut t = Text::default();
    let g = |a: &std::sync::atomic::AtomicU32| a.load(Ordering::Relaxed) as f64;
    t.gauge("pdmesh_decode_running", "Sequences in the running batch.", g(&st.running))
        .gauge("pdmesh_decode_queued", "Sequences with their KV, waiting for a batch slot.", g(&st.queued))
        .gauge("pdmesh_decode_awaiting_kv", "Admitted sequences waiting for their prompt's KV.", g(&st.awaiting_kv))
        .gauge("pdmesh_decode_kv_blocks_used", "KV blocks reserved or in use.", g(&st.kv_used))
        .gauge("pdmesh_decode_kv_blocks_pinned", "KV blocks held for requests not yet started (waiting for their KV, or quarantined after a failed transfer).", g(&st.kv_reserved))
        .gauge("pdmesh_decode_kv_blocks_total", "KV blocks in the arena.", g(&st.kv_total))
        .counter("pdmesh_decode_steps_total", "Decode steps run.", st.steps.load(Ordering::Relaxed))
        .counter("pdmesh_decode_tokens_total", "Tokens streamed (including each first token).", st.tokens.load(Ordering::Relaxed))
        .histogram("pdmesh_decode_step_seconds", "Duration of one decode step.", &st.step_seconds);
    st.outcomes.render(&mut t, "pdmesh_decode_requests_total", "Finished decode requests by outcome.");
    t.0
}

/// Load the model, then serve on `listener` until `shutdown` resolves.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let nixl_lib = pdmesh_worker::transport::choose(&config.worker.transport).map_err(ServeError::Setup)?;
    let transport = if nixl_lib.is_some() { "nixl" } else { "tcp" };
    let (admin, engine, stats_slot) = pdmesh_worker::boot(
        "decode",
        serde_json::to_value(&config).unwrap_or_default(),
        &config.worker.common,
        &config.worker.engine,
        transport,
        render,
    )
    .await?;
    let layout = engine.kv.layout;
    let worker_id =
        config.worker.common.instance_id.clone().unwrap_or_else(|| format!("decode-{}", std::process::id()));
    let nixl = match nixl_lib {
        Some(_) => {
            let (addr, len) = engine.kv.arena();
            Some(std::sync::Arc::new(
                pdmesh_worker::transport::Nixl::start(&worker_id, addr, len).map_err(ServeError::Setup)?,
            ))
        }
        None => None,
    };
    let batcher = Batcher::start(engine, config.worker.engine.max_batch, config.worker.engine.trace_kernel_steps);
    let _ = stats_slot.set(batcher.stats.clone());
    let broker =
        Peers::resolve(&config.worker.common, "kvbroker", &config.worker.kvbroker_addr).map_err(ServeError::Setup)?;
    let grpc_addr = listener.local_addr().map_err(|e| ServeError::Setup(e.to_string()))?;
    let mut agent = kpb::Agent {
        worker_id: worker_id.clone(),
        transport: kpb::Transport::Tcp as i32,
        address: config.advertise_addr.clone().unwrap_or_else(|| grpc_addr.to_string()),
        layout: Some(pdmesh_worker::layout_to_wire(&layout)),
        block_bytes: layout.block_bytes() as u64,
        ..Default::default()
    };
    // With NIXL, prefill workers write straight into the registered arena;
    // WriteKv (tcp) stays available for those without it.
    let stop_progress = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(n) = &nixl {
        agent.transport = kpb::Transport::Nixl as i32;
        agent.nixl_metadata = n.metadata().map_err(ServeError::Setup)?;
        agent.arena_addr = n.arena_addr as u64;
        agent.arena_len = n.arena_len as u64;
        let st = batcher.stats.clone();
        pdmesh_worker::transport::spawn_progress(
            n.clone(),
            move || st.awaiting_kv.load(Ordering::Relaxed) > 0,
            stop_progress.clone(),
        );
    }
    let svc = server::Service {
        batcher,
        broker: broker.clone(),
        worker_id,
        layout,
        lease_ms: config.lease_ms,
        pending: Default::default(),
    };
    let routes =
        tonic::service::Routes::new(pb::decode_server::DecodeServer::new(svc).max_decoding_message_size(64 << 20));
    let r = pdmesh_worker::serve_worker(
        "decode",
        "pdmesh.decode.v1.Decode",
        routes,
        &config.worker.common,
        admin,
        listener,
        shutdown,
        pdmesh_worker::BrokerLink { agent, broker },
    )
    .await;
    stop_progress.store(true, Ordering::Relaxed);
    drop(nixl);
    r
}
