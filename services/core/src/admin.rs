//! The HTTP side every service exposes beside its gRPC port:
//!
//! - `GET /health`: 200 `ok` when the service is ready, 503 `not ready`
//!   otherwise (what Consul's HTTP check and `meshctl up` wait on); a
//!   second line says when discovery is unreachable (the instance keeps
//!   serving on its last view, so it stays 200);
//! - `GET /metrics`: Prometheus text (`pdmesh_*`), or OpenMetrics with
//!   trace-id exemplars on the latency histograms when the scraper's
//!   `Accept` asks for `application/openmetrics-text`;
//! - `GET /statusz`: JSON with the effective configuration, build, pid and
//!   start time — "is the knob live in the running process?" is one call;
//! - `PUT /threads/N` (prefill and decode workers): run kernel loops on N
//!   of the worker's threads, so replicas sharing a host divide its cores.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use crate::metrics::Format;

/// Renders the service's current metrics in the format asked for.
pub type MetricsFn = Arc<dyn Fn(Format) -> String + Send + Sync>;

/// Sets how many kernel threads a compute worker's loops run on; returns
/// the number it now runs on.
pub type ThreadsFn = Arc<dyn Fn(usize) -> usize + Send + Sync>;

/// What the admin endpoints report. Cheap to clone; share it with the service.
#[derive(Clone)]
pub struct AdminState {
    ready: Arc<AtomicBool>,
    statusz: Arc<serde_json::Value>,
    metrics: MetricsFn,
    service: Arc<str>,
    config: Arc<serde_json::Value>,
    /// Facts learnt after start-up (e.g. which device the engine chose), under `runtime`.
    runtime: Arc<std::sync::Mutex<serde_json::Map<String, serde_json::Value>>>,
    /// A compute worker's share of its host, once its engine is loaded.
    threads: Arc<std::sync::OnceLock<ThreadsFn>>,
}

impl AdminState {
    /// `service` is the short name (`tokenizer`, `decode`, ...); `config` the
    /// effective configuration, serialised as the process sees it.
    pub fn new(service: &str, config: serde_json::Value, metrics: MetricsFn) -> AdminState {
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let statusz = serde_json::json!({
            "service": format!("pdmesh-{service}"),
            "version": env!("CARGO_PKG_VERSION"),
            "build": {
                "version": env!("CARGO_PKG_VERSION"),
                "profile": if cfg!(debug_assertions) { "debug" } else { "release" },
                "arch": std::env::consts::ARCH,
                "os": std::env::consts::OS,
            },
            "pid": std::process::id(),
            "start_time_unix": started,
            "config_hash": crate::telemetry::config_hash(&config),
            "config": config,
        });
        AdminState {
            ready: Arc::new(AtomicBool::new(false)),
            statusz: Arc::new(statusz),
            metrics,
            service: service.into(),
            config: Arc::new(config),
            runtime: Default::default(),
            threads: Default::default(),
        }
    }

    /// Let `PUT /threads/N` set the kernel threads loops run on (now:
    /// `threads`, shown in /statusz as `runtime.threads`).
    pub fn set_threads_control(&self, set: ThreadsFn, threads: usize) {
        let _ = self.threads.set(set);
        self.note("threads", serde_json::json!(threads));
    }

    /// Short service name (`tokenizer`, `decode`, ...).
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The effective configuration given to [`AdminState::new`].
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Show `value` under `runtime.<key>` in /statusz from now on.
    pub fn note(&self, key: &str, value: serde_json::Value) {
        self.runtime.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string(), value);
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}

/// Serve the admin endpoints on `listener` until `shutdown` resolves.
pub async fn serve_admin(
    listener: TcpListener,
    state: AdminState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/statusz", get(statusz))
        .route("/faults/{name}/{value}", axum::routing::put(set_fault))
        .route("/threads/{n}", axum::routing::put(set_threads))
        .with_state(state);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn health(axum::extract::State(s): axum::extract::State<AdminState>) -> impl IntoResponse {
    let (code, word) =
        if s.is_ready() { (StatusCode::OK, "ok") } else { (StatusCode::SERVICE_UNAVAILABLE, "not ready") };
    match crate::discovery::health().detail() {
        Some(d) => (code, format!("{word}\n{d}\n")),
        None => (code, format!("{word}\n")),
    }
}

async fn metrics(
    axum::extract::State(s): axum::extract::State<AdminState>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let format = Format::from_accept(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    let mut shared = crate::metrics::Text::new(format);
    crate::discovery::health().render(&mut shared);
    let doc = crate::metrics::splice((s.metrics)(format), shared);
    ([(header::CONTENT_TYPE, format.content_type())], doc)
}

async fn set_fault(axum::extract::Path((name, value)): axum::extract::Path<(String, u64)>) -> impl IntoResponse {
    match crate::faults::set(&name, value) {
        Ok(()) => (StatusCode::OK, format!("{name} = {value}\n")),
        Err(e) => (StatusCode::FORBIDDEN, format!("{e}\n")),
    }
}

/// `PUT /threads/N`: a compute worker's loops run on N of its kernel
/// threads from now on (1 up to the threads it started with).
async fn set_threads(
    axum::extract::State(s): axum::extract::State<AdminState>,
    axum::extract::Path(n): axum::extract::Path<usize>,
) -> impl IntoResponse {
    match s.threads.get() {
        Some(set) if n > 0 => {
            let now = set(n);
            s.note("threads", serde_json::json!(now));
            (StatusCode::OK, format!("threads = {now}\n"))
        }
        Some(_) => (StatusCode::BAD_REQUEST, "threads must be at least 1\n".to_string()),
        None => {
            (StatusCode::NOT_FOUND, format!("pdmesh-{} has no kernel pool (or has not loaded it yet)\n", s.service))
        }
    }
}

async fn statusz(axum::extract::State(s): axum::extract::State<AdminState>) -> impl IntoResponse {
    let mut v = (*s.statusz).clone();
    v["ready"] = serde_json::Value::Bool(s.is_ready());
    v["runtime"] = serde_json::Value::Object(s.runtime.lock().unwrap_or_else(|e| e.into_inner()).clone());
    ([(header::CONTENT_TYPE, "application/json")], v.to_string())
}
