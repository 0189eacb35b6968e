//! What the prefill and decode workers share: engine flags and loading,
//! the one mapping of engine errors to gRPC statuses, conversions between
//! wire and engine types, and the kvbroker client.

pub mod kv;
pub mod prefix;
pub mod steps;

pub use kv::{layout_from_wire, layout_to_wire};

use std::path::PathBuf;
use std::time::Duration;

use pdmesh_core::peers::Peers;
use pdmesh_core::vocab::attr;
use pdmesh_engine::{Engine, EngineError, EngineOptions, Model, SamplingParams};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::kvbroker::v1 as kpb;
use tonic::Status;

/// Flags every worker (prefill, decode) has beside its own.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct WorkerArgs {
    /// kvbroker address(es); default: found in the registry.
    #[arg(long = "kvbroker-addr", env = "PDMESH_KVBROKER_ADDR", value_delimiter = ',')]
    pub kvbroker_addr: Vec<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub transport: kv::TransportArgs,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}

/// Engine flags of a worker (each also an environment variable).
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct EngineArgs {
    /// GGUF model file. Default: the cached SmolLM2 model, fetched on first use.
    #[arg(long, env = "PDMESH_MODEL")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Debugging only: write every layer's intermediate tensors of each step into this folder.
    #[arg(long, env = "PDMESH_DEBUG_DUMP_DIR")]
    pub debug_dump_dir: Option<PathBuf>,
    /// Kernel threads (0 = all cores).
    #[arg(long, env = "PDMESH_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// KV cache blocks in this worker's arena (default: 2048 on a CPU,
    /// 16384 on a GPU).
    #[arg(long, env = "PDMESH_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Positions per KV block (prefill and decode must agree).
    #[arg(long, env = "PDMESH_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Most sequences in one forward step (default: 32 on a CPU, 64 on a GPU).
    #[arg(long, env = "PDMESH_MAX_BATCH")]
    pub max_batch: Option<usize>,
    /// Most prompt tokens of one sequence per prefill step (chunked prefill).
    #[arg(long, env = "PDMESH_PREFILL_CHUNK", default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Which engine steps carry one span per kernel launch (when tracing is
    /// on): `off`, `all`, or N = the first N steps of each request (its
    /// prefill is step 1).
    #[arg(long, env = "PDMESH_TRACE_KERNEL_STEPS", default_value = "off")]
    pub trace_kernel_steps: KernelSpans,
    /// Where the forward pass runs: cpu, cuda (GPU 0, KV in VRAM,
    /// registered with NIXL as VRAM; an error without a GPU) or auto
    /// (CUDA where a GPU and driver are found).
    #[arg(long, env = "PDMESH_BACKEND", value_enum, default_value = "cpu")]
    pub backend: pdmesh_engine::ComputeBackend,
    /// Set by each worker from its own `--prefix-cache-blocks`.
    #[arg(skip)]
    pub prefix_cache_blocks: usize,
    /// Set by the decode worker: finished sequences stay in its prefix cache.
    #[arg(skip)]
    pub cache_generated: bool,
}

/// The kernel-span knob (`--trace-kernel-steps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum KernelSpans {
    Off,
    /// The first N steps of each request.
    First(u32),
    All,
}

impl std::str::FromStr for KernelSpans {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "0" => Ok(KernelSpans::Off),
            "all" => Ok(KernelSpans::All),
            n => n
                .parse()
                .map(KernelSpans::First)
                .map_err(|_| format!("expected off, all or a number of steps, got {n:?}")),
        }
    }
}

impl KernelSpans {
    /// Whether a step in which some request runs its `step`-th step (1 =
    /// its prefill) carries kernel spans.
    pub fn covers(self, step: u32) -> bool {
        match self {
            KernelSpans::Off => false,
            KernelSpans::All => true,
            KernelSpans::First(n) => step <= n,
        }
    }
}

/// One span per engine step, child of the first request's span in the
/// batch and linked to every request's span (`requests`), so each request's
/// trace shows the steps it rode in and a step shows whom it served.
pub fn step_span<'a>(
    name: &'static str,
    requests: impl Iterator<Item = &'a tracing::Span>,
    batch: usize,
) -> tracing::Span {
    use pdmesh_core::telemetry::SpanExt;
    if !pdmesh_core::telemetry::enabled() {
        return tracing::Span::none();
    }
    let mut parent = None;
    let mut links = Vec::new();
    for r in requests {
        if parent.is_none() {
            parent = Some(r.clone());
        }
        if let Some(cx) = pdmesh_core::telemetry::span_context(r) {
            links.push(cx);
        }
    }
    let Some(parent) = parent else { return tracing::Span::none() };
    let span = tracing::info_span!(parent: &parent, "step", otel.name = name, { attr::BATCH_SIZE } = batch as i64);
    for cx in links {
        span.add_link(cx);
    }
    span
}

impl EngineArgs {
    /// KV blocks: the flag, else the default for the backend.
    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks.unwrap_or(self.backend.default_sizing().kv_blocks)
    }

    /// Most sequences a step: the flag, else the default for the backend.
    pub fn max_batch(&self) -> usize {
        self.max_batch.unwrap_or(self.backend.default_sizing().max_batch)
    }

    pub fn options(&self) -> EngineOptions {
        EngineOptions {
            block_size: self.block_size,
            kv_blocks: self.kv_blocks(),
            threads: self.threads,
            prefill_chunk: self.prefill_chunk,
            prefix_cache_blocks: self.prefix_cache_blocks,
            cache_generated: self.cache_generated,
            backend: self.backend,
        }
    }

    /// Fetch the model if needed and build the engine (blocking; call it
    /// from a blocking thread).
    pub fn load(&self) -> Result<Engine, EngineError> {
        if self.max_batch() == 0 {
            return Err(EngineError::InvalidArgument("--max-batch must be at least 1".into()));
        }
        let path = self.cache.model_or_fetch(self.model.as_deref())?;
        let (model, _gguf) = Model::load(&path)?;
        Engine::new(model.with_dump_dir(self.debug_dump_dir.clone()), self.options())
    }
}

/// The gRPC status for an engine error.
pub fn status(e: &EngineError) -> Status {
    let msg = e.to_string();
    match e {
        EngineError::KvFull { .. } | EngineError::Overloaded(_) | EngineError::DeviceOutOfMemory(_) => {
            Status::resource_exhausted(msg)
        }
        EngineError::UnknownSequence(_) => Status::not_found(msg),
        EngineError::KvMismatch(_) => Status::failed_precondition(msg),
        EngineError::Unavailable(_) | EngineError::DeviceLost(_) => Status::unavailable(msg),
        EngineError::DeadlineExceeded(_) => Status::deadline_exceeded(msg),
        e if e.is_bad_input() => Status::invalid_argument(msg),
        _ => Status::internal(msg),
    }
}

/// What a failed batched step means for the requests in it: a GPU out of
/// memory or lost keeps its class (RESOURCE_EXHAUSTED, UNAVAILABLE); any
/// other failure is the worker's bug (`StepFailed`, INTERNAL), never the
/// client's fault.
pub fn step_error(stage: &str, e: &EngineError) -> EngineError {
    match e {
        EngineError::DeviceOutOfMemory(m) => EngineError::DeviceOutOfMemory(m.clone()),
        EngineError::DeviceLost(m) => EngineError::DeviceLost(m.clone()),
        e => EngineError::StepFailed(format!("{stage}: {e}")),
    }
}

/// Whether a failed step leaves the engine unable to run another: its loop
/// then stops, which takes the worker out of service ([`LoopAlive`]).
pub fn is_fatal(e: &EngineError) -> bool {
    matches!(e, EngineError::DeviceLost(_))
}

/// Engine sampling parameters from the wire (validated by the engine).
pub fn sampling(
    s: Option<&common::SamplingParams>,
    max_tokens: u32,
    stop_ids: &[u32],
    ignore_eos: bool,
) -> SamplingParams {
    let s = s.cloned().unwrap_or_default();
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        seed: s.seed,
        max_tokens: max_tokens as usize,
        stop_ids: stop_ids.to_vec(),
        ignore_eos,
    }
}

pub type BrokerClient = kpb::kv_broker_client::KvBrokerClient<tonic::transport::Channel>;

/// A client of a live kvbroker (waits up to `timeout` for one to appear).
pub async fn broker(peers: &Peers, timeout: Duration) -> Result<BrokerClient, Status> {
    let (_, ch) = peers.first(timeout).await.map_err(Status::unavailable)?;
    Ok(kpb::kv_broker_client::KvBrokerClient::new(ch))
}

/// Pause before asking a kvbroker again after losing one.
pub const BROKER_RETRY: Duration = Duration::from_millis(200);

/// Run `call` (given a client and the time left) at a live kvbroker. While
/// the broker cannot be reached — killed, restarting — ask again, the
/// restarted one or another, until `patience` has passed. The answer, and
/// the client that gave it.
pub async fn at_broker<T, Fut>(
    peers: &Peers,
    patience: Duration,
    mut call: impl FnMut(BrokerClient, Duration) -> Fut,
) -> Result<(T, BrokerClient), Status>
where
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let until = tokio::time::Instant::now() + patience;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let r = match broker(peers, left.min(Duration::from_secs(2))).await {
            Ok(c) => call(c.clone(), left).await.map(|t| (t, c)),
            Err(e) => Err(e),
        };
        match r {
            Err(e) if pdmesh_core::grpc::peer_lost(&e) && left > BROKER_RETRY * 2 => {
                tokio::time::sleep(BROKER_RETRY).await
            }
            r => return r,
        }
    }
}

/// How often a worker registers its transfer endpoint again: a kvbroker
/// that restarted knows every worker again within this period.
pub const REGISTER_EVERY: Duration = Duration::from_secs(2);

/// Keep `agent` registered at the broker: now, and again every `every`
/// (a restarted broker learns it again). Returns once the first
/// registration succeeded; `ready` is told each outcome.
pub async fn keep_registered(
    peers: Peers,
    agent: kpb::Agent,
    every: Duration,
    ready: tokio::sync::watch::Sender<bool>,
) {
    let mut first = true;
    loop {
        let ok = match broker(&peers, every).await {
            Ok(mut c) => {
                let mut req = tonic::Request::new(kpb::RegisterAgentRequest { agent: Some(agent.clone()) });
                req.set_timeout(Duration::from_secs(2));
                c.register_agent(req).await.is_ok()
            }
            Err(_) => false,
        };
        if ok != *ready.borrow() || first {
            let _ = ready.send(ok);
        }
        first = false;
        tokio::time::sleep(if ok { every } else { Duration::from_millis(200) }).await;
        if ready.is_closed() {
            return;
        }
    }
}

pub use pdmesh_core::serve::ServeError;

/// A worker's transfer endpoint and the kvbroker(s) it registers it with.
pub struct BrokerLink {
    pub agent: kpb::Agent,
    pub broker: Peers,
    /// The engine loop: if it stops, the worker leaves service and exits
    /// with an error, so that its supervisor starts a fresh one.
    pub engine: LoopAlive,
}

/// Whether a worker's engine loop (its own thread) still runs. The loop
/// holds the [`AliveGuard`]; when the thread ends — a panic, or any exit
/// while the worker serves — the flag drops.
#[derive(Clone)]
pub struct LoopAlive(std::sync::Arc<std::sync::atomic::AtomicBool>);

/// Held by the engine loop's thread for as long as it runs.
pub struct AliveGuard(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

impl LoopAlive {
    /// A running loop's flag and the guard its thread keeps.
    pub fn start() -> (LoopAlive, AliveGuard) {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        (LoopAlive(flag.clone()), AliveGuard(flag))
    }

    pub fn is_alive(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves once the loop has stopped (checked every 100 ms).
    pub async fn stopped(&self) {
        while self.is_alive() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Test-only fault (`--enable-fault-injection`): the engine loop panics at
/// its next turn, as a bug in a kernel would make it.
pub fn loop_panic_fault() {
    if pdmesh_core::faults::get("engine.loop_panic") > 0 {
        panic!("fault injected: engine.loop_panic");
    }
}

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
    let gate = async {
        let mut was = false;
        loop {
            if ready_rx.changed().await.is_err() {
                return;
            }
            let now = *ready_rx.borrow_and_update();
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
            admin.drain(&mut a, Some(&health), common, || in_flight.get()).await;
            let _ = stop.send(());
            tokio::time::timeout(pdmesh_core::serve::CLOSE_GRACE, &mut server).await.unwrap_or(Ok(()))
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
    let args = engine.clone();
    let engine = tokio::task::spawn_blocking(move || args.load())
        .await
        .map_err(|e| ServeError::Setup(e.to_string()))?
        .map_err(|e| ServeError::Setup(format!("engine: {e}")))?;
    admin.state.note("backend", serde_json::json!(engine.backend_note));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_failures_are_never_the_clients_fault() {
        let code = |e: EngineError| status(&e).code();
        assert_eq!(code(EngineError::Unavailable("loop stopped".into())), tonic::Code::Unavailable);
        assert_eq!(code(EngineError::StepFailed("x".into())), tonic::Code::Internal);
        assert_eq!(code(EngineError::KvFull { needed: 2, free: 1, total: 8 }), tonic::Code::ResourceExhausted);
        assert_eq!(code(EngineError::BadToken(99_999)), tonic::Code::InvalidArgument);
        assert_eq!(code(EngineError::DeviceOutOfMemory("x".into())), tonic::Code::ResourceExhausted);
        assert_eq!(code(EngineError::DeviceLost("x".into())), tonic::Code::Unavailable);
        // A failed step keeps a GPU's class; anything else is the worker's bug.
        let oom = step_error("decode", &EngineError::DeviceOutOfMemory("x".into()));
        assert_eq!(code(oom), tonic::Code::ResourceExhausted);
        assert_eq!(code(step_error("decode", &EngineError::BadToken(1))), tonic::Code::Internal);
        assert!(is_fatal(&step_error("prefill", &EngineError::DeviceLost("x".into()))));
        assert!(!is_fatal(&EngineError::DeviceOutOfMemory("x".into())));
        assert!(!EngineError::StepFailed("x".into()).is_bad_input());
    }
}
