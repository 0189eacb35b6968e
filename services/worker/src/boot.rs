//! A worker's start and its serving: admin endpoints, the engine loaded
//! off the async threads, NIXL, and serving while the kvbroker knows it.

use pdmesh_core::peers::Peers;
use pdmesh_engine::Engine;
use pdmesh_proto::kvbroker::v1 as kpb;

use crate::args::{EngineArgs, WorkerArgs};
use crate::broker::{keep_registered, BrokerLink, REGISTER_EVERY};
use crate::kv::{self, layout_to_wire};
use crate::ServeError;

/// Serve a worker's `routes` until `shutdown`. gRPC health, `/health` and
/// the registry entry follow the broker registration of `link.agent`: the
/// worker is in service only while the kvbroker knows how to reach it.
pub async fn serve_worker(
    grpc: pdmesh_core::serve::Grpc,
    common: &pdmesh_core::args::CommonArgs,
    admin: pdmesh_core::serve::Admin,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
    link: BrokerLink,
) -> Result<(), ServeError> {
    use pdmesh_core::serve::Announced;
    use std::sync::{Arc, Mutex};
    let service = grpc.service;
    let (routes, health) =
        pdmesh_core::grpc::standard_routes(grpc.routes, grpc.name).await.map_err(ServeError::Setup)?;
    let grpc_addr = listener.local_addr().map_err(|e| ServeError::Setup(format!("local address: {e}")))?;
    let (ready_tx, mut ready_rx) = tokio::sync::watch::channel(false);
    let registrar = tokio::spawn(keep_registered(link.broker, link.agent, REGISTER_EVERY, ready_tx));
    let announced: Arc<Mutex<Option<Announced>>> = Arc::default();
    let (progress, unhealthy_after) = (link.engine.clone(), link.unhealthy_after);
    let gate = async {
        let (mut was, mut was_stuck) = (false, false);
        loop {
            tokio::select! {
                r = ready_rx.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(std::time::Duration::from_millis(250)) => {}
            }
            // In service while the broker knows it and its engine loop moves.
            let stalled = progress.stalled();
            let stuck = !unhealthy_after.is_zero() && stalled >= unhealthy_after;
            if stuck != was_stuck {
                was_stuck = stuck;
                let s = stalled.as_secs_f64();
                match stuck {
                    true => eprintln!("pdmesh-{service}: the engine loop made no progress for {s:.1} s; out of service until it moves"),
                    false => eprintln!("pdmesh-{service}: the engine loop moves again; back in service"),
                }
            }
            let now = *ready_rx.borrow_and_update() && !stuck;
            if now == was {
                continue;
            }
            was = now;
            health.set(now).await;
            let first = announced.lock().unwrap_or_else(|e| e.into_inner()).is_none();
            if now && first {
                match admin.announce(service, common, grpc_addr).await {
                    Ok(a) => *announced.lock().unwrap_or_else(|e| e.into_inner()) = Some(a),
                    Err(e) => eprintln!("{service}: registry announcement failed: {e}"),
                }
            } else {
                admin.state.set_ready(now);
            }
        }
    };
    let in_flight = pdmesh_core::drain::InFlight::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = pdmesh_core::grpc::serve_routes(routes, listener, in_flight.clone(), async {
        let _ = stopped.await;
    });
    tokio::pin!(server);
    let engine = link.engine.clone();
    let mut engine_stopped = false;
    let result = tokio::select! {
        r = &mut server => Some(r),
        _ = shutdown => None,
        _ = engine.stopped() => {
            engine_stopped = true;
            Some(Ok(()))
        }
        _ = async { gate.await; std::future::pending::<()>().await } => unreachable!(),
    };
    let mut a = announced.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_else(Announced::none);
    if engine_stopped {
        // Nothing here can serve again: out of service at once, then exit
        // with an error so that the supervisor starts a fresh worker.
        eprintln!("pdmesh-{service}: the engine loop stopped; leaving service and exiting");
        health.set(false).await;
        registrar.abort();
        admin.shut_down(a).await?;
        return Err(ServeError::Setup(format!("pdmesh-{service}: the engine loop stopped")));
    }
    let result = match result {
        Some(r) => r,
        None => {
            // Still registered with the broker while draining: transfers
            // for the requests in flight need this worker's agent.
            admin.drain(&mut a, Some(&health), common, grpc.hand_over, || in_flight.get()).await;
            let _ = stop.send(());
            let t0 = std::time::Instant::now();
            let r = tokio::time::timeout(pdmesh_core::serve::CLOSE_GRACE, &mut server).await.unwrap_or(Ok(()));
            eprintln!("pdmesh-{service}: connections closed in {:.2} s", t0.elapsed().as_secs_f64());
            r
        }
    };
    registrar.abort();
    admin.shut_down(a).await?;
    result?;
    Ok(())
}

/// The slot a worker's stats land in once its engine is loaded; /metrics
/// renders from it (empty before).
pub type StatsSlot<T> = std::sync::Arc<std::sync::OnceLock<std::sync::Arc<T>>>;

/// A worker's start: admin endpoints up (not ready), then the engine
/// loaded off the async threads. `render` draws /metrics from the stats
/// put in the returned slot.
pub async fn boot<T: Send + Sync + 'static>(
    service: &'static str,
    config: serde_json::Value,
    common: &pdmesh_core::args::CommonArgs,
    engine: &EngineArgs,
    transport: &'static str,
    render: fn(&T, pdmesh_core::metrics::Format) -> String,
) -> Result<(pdmesh_core::serve::Admin, Engine, StatsSlot<T>), ServeError> {
    let slot: StatsSlot<T> = Default::default();
    let s2 = slot.clone();
    let statusz = serde_json::json!({ "config": config, "transport": transport, "engine": engine.options() });
    let admin = pdmesh_core::admin::AdminState::new(
        service,
        statusz,
        std::sync::Arc::new(move |f| s2.get().map(|s| render(s, f)).unwrap_or_default()),
    );
    let admin = pdmesh_core::serve::Admin::start(common, admin).await?;
    let (args, in_use) = (engine.clone(), engine.threads_in_use);
    let engine = tokio::task::spawn_blocking(move || args.load())
        .await
        .map_err(|e| ServeError::Setup(e.to_string()))?
        .map_err(|e| ServeError::Setup(format!("engine: {e}")))?;
    admin.state.note("backend", serde_json::json!(engine.backend_note));
    // Replicas sharing a host divide its cores: loops run on a share of the pool.
    let share = engine.pool_share();
    if in_use > 0 {
        share.set(in_use);
    }
    let now = share.get().0;
    admin.state.set_threads_control(std::sync::Arc::new(move |n| share.set(n)), now);
    if let Some(knobs) = engine.cuda_knobs() {
        admin.state.note("cuda_knobs", knobs);
    }
    Ok((admin, engine, slot))
}

/// A worker after start-up: admin endpoints up (not ready yet), engine
/// loaded, its KV arena registered with NIXL when that transport was
/// chosen, and the kvbroker(s) it will register with.
pub struct Started<T> {
    pub admin: pdmesh_core::serve::Admin,
    pub engine: Engine,
    /// Where the worker's stats go once its batcher runs (/metrics reads them).
    pub stats: StatsSlot<T>,
    pub worker_id: String,
    pub nixl: Option<std::sync::Arc<kv::Nixl>>,
    pub broker: Peers,
}

/// The start-up every worker shares: choose the KV transport, boot the
/// admin endpoints and the engine, start NIXL on the arena, find the broker.
pub async fn start_worker<T: Send + Sync + 'static>(
    service: &'static str,
    config: serde_json::Value,
    args: &WorkerArgs,
    render: fn(&T, pdmesh_core::metrics::Format) -> String,
) -> Result<Started<T>, ServeError> {
    let nixl_lib = kv::choose(&args.transport, args.engine.cache.python()).map_err(ServeError::Setup)?;
    let name = if nixl_lib.is_some() { "nixl" } else { "tcp" };
    let (admin, mut engine, stats) = boot(service, config, &args.common, &args.engine, name, render).await?;
    let worker_id = args.common.instance_id.clone().unwrap_or_else(|| format!("{service}-{}", std::process::id()));
    let nixl = match nixl_lib {
        Some(_) => Some(std::sync::Arc::new(start_nixl(&worker_id, &mut engine).map_err(ServeError::Setup)?)),
        None => None,
    };
    if let Some(n) = &nixl {
        let memory = n.arena.gpu.map(|g| format!("vram (GPU {g})")).unwrap_or_else(|| "host".into());
        admin.state.note("kv_arena", serde_json::json!(memory));
    }
    let broker = Peers::resolve(&args.common, "kvbroker", &args.kvbroker_addr).map_err(ServeError::Setup)?;
    Ok(Started { admin, engine, stats, worker_id, nixl, broker })
}

/// A NIXL agent on the engine's transfer arena: its VRAM on a GPU, so
/// transfers go GPU to GPU. Where the NIXL build cannot register VRAM
/// (UCX without CUDA), transfers stage through the host arena instead.
fn start_nixl(worker_id: &str, engine: &mut Engine) -> Result<kv::Nixl, String> {
    let arena = engine.transfer_arena();
    match kv::Nixl::start(worker_id, arena) {
        Err(e) if arena.gpu.is_some() => {
            tracing::warn!(error = %e, "KV arena: NIXL cannot register VRAM; transfers stage through host memory");
            engine.stage_transfers_on_host();
            kv::Nixl::start(worker_id, engine.transfer_arena())
        }
        r => r,
    }
}

impl<T> Started<T> {
    /// The worker's transfer endpoint as the broker will know it: id,
    /// transport and KV layout (decode adds where to write).
    pub fn agent(&self) -> kpb::Agent {
        let transport = if self.nixl.is_some() { kpb::Transport::Nixl } else { kpb::Transport::Tcp };
        kpb::Agent {
            worker_id: self.worker_id.clone(),
            transport: transport as i32,
            layout: Some(layout_to_wire(&self.engine.kv.layout)),
            ..Default::default()
        }
    }
}
