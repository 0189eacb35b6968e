//! The control endpoint of a running `meshctl up` and the commands that
//! talk to it: `meshctl scale`, `meshctl drain` and `meshctl restart`. The
//! endpoint is an HTTP server on loopback that `meshctl up` registers in
//! discovery as service `meshctl` (Consul: `pdmesh-meshctl`), so the
//! commands find it with the same `--discovery` as everything else; the
//! [`crate::supervisor`] carries the operations out, one at a time (others
//! queue).
//!
//! `GET /v1/processes` is every process's supervisor state (running,
//! restarting after a backoff, left down after a crash loop), which
//! `meshctl status` shows.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use pdmesh_core::discovery::Instance;
use serde_json::{json, Value};

use crate::supervisor::{Asked, Control, Mesh, Op, Snapshot, RESTART_ORDER};

#[derive(Clone)]
struct Endpoint {
    tx: tokio::sync::mpsc::Sender<Asked>,
    processes: Snapshot,
    autoscaler: Option<crate::autoscale::Shared>,
}

/// Serve the control endpoint on loopback and register it in discovery;
/// with an autoscaler, its metrics (`GET /metrics`) and state
/// (`GET /v1/autoscaler`) too.
pub async fn open(mesh: &Mesh, autoscaler: Option<crate::autoscale::Shared>) -> Result<Control, String> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let addr = l.local_addr().map_err(|e| e.to_string())?.to_string();
    let (tx, rx) = tokio::sync::mpsc::channel::<Asked>(16);
    let ep = Endpoint { tx: tx.clone(), processes: mesh.snapshot(), autoscaler };
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/v1/op", post(ask))
        .route("/v1/processes", get(processes))
        .route("/v1/autoscaler", get(autoscaler_state))
        .route("/metrics", get(autoscaler_metrics))
        .with_state(ep);
    tokio::spawn(async move { axum::serve(l, app).await });
    let d = mesh.ctx.a.discovery.open(&mesh.ctx.locator).map_err(|e| e.to_string())?;
    let me = Instance {
        service: "meshctl".into(),
        id: format!("meshctl-{}", std::process::id()),
        grpc_addr: addr.clone(),
        http_addr: Some(addr.clone()),
        meta: [("role".to_string(), "meshctl".to_string())].into(),
    };
    let mut me = me;
    let pools: Vec<String> = mesh.ctx.pools.iter().filter_map(|p| p.name.clone()).collect();
    if !pools.is_empty() {
        me.meta.insert(crate::status::META_POOLS.to_string(), pools.join(","));
    }
    let registration = Some(d.register(me).await.map_err(|e| e.to_string())?);
    eprintln!("meshctl: control endpoint http://{addr} (meshctl scale / drain / restart)");
    Ok(Control { rx, registration, tx })
}

async fn autoscaler_state(State(ep): State<Endpoint>) -> axum::response::Response {
    match &ep.autoscaler {
        Some(a) => a.lock().unwrap_or_else(|e| e.into_inner()).json().to_string().into_response(),
        None => (StatusCode::NOT_FOUND, "this mesh runs no autoscaler (meshctl up --autoscale POLICY.toml)\n")
            .into_response(),
    }
}

async fn autoscaler_metrics(State(ep): State<Endpoint>) -> String {
    ep.autoscaler.as_ref().map(|a| a.lock().unwrap_or_else(|e| e.into_inner()).render()).unwrap_or_default()
}

async fn processes(State(ep): State<Endpoint>) -> axum::response::Response {
    let v = ep.processes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (StatusCode::OK, v.to_string()).into_response()
}

async fn ask(State(ep): State<Endpoint>, body: axum::body::Bytes) -> axum::response::Response {
    let tx = ep.tx;
    let op: Op = match serde_json::from_slice(&body) {
        Ok(op) => op,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, json!({ "error": format!("bad request: {e}") }).to_string())
                .into_response()
        }
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    if tx.send(Asked { op, reply }).await.is_err() {
        return (StatusCode::SERVICE_UNAVAILABLE, json!({ "error": "meshctl is stopping" }).to_string())
            .into_response();
    }
    match answer.await {
        Ok(Ok(v)) => (StatusCode::OK, v.to_string()).into_response(),
        Ok(Err(e)) => (StatusCode::CONFLICT, json!({ "error": e }).to_string()).into_response(),
        Err(_) => {
            (StatusCode::SERVICE_UNAVAILABLE, json!({ "error": "meshctl stopped before it finished" }).to_string())
                .into_response()
        }
    }
}

/// Flags of `meshctl scale`, `drain` and `restart`: where the mesh is.
#[derive(clap::Args)]
pub struct Where {
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Longest wait for the operation, in seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
}

#[derive(clap::Args)]
pub struct ScaleArgs {
    /// KIND=N pairs: `prefill=2 decode=3` (prefill, decode, tokenizer,
    /// router); in a mesh of several models, KIND@MODEL: `decode@gemma3-270m=2`.
    #[arg(required = true)]
    pub replicas: Vec<String>,
    #[command(flatten)]
    pub at: Where,
}

#[derive(clap::Args)]
pub struct DrainArgs {
    /// Instance id, as `meshctl status` shows it (`decode-1`).
    pub id: String,
    #[command(flatten)]
    pub at: Where,
}

#[derive(clap::Args)]
pub struct RestartArgs {
    /// Kinds to restart, in this order (prefill, decode, tokenizer, router,
    /// gateway); `decode@gemma3-270m` restarts one model's, `decode` every model's.
    pub kinds: Vec<String>,
    /// Every kind, in the order prefill, decode, tokenizer, router, gateway.
    #[arg(long, conflicts_with = "kinds")]
    pub all: bool,
    #[command(flatten)]
    pub at: Where,
}

/// Send `op` to the `meshctl up` found in discovery; print its answer.
async fn send(at: &Where, op: Op) -> Result<(), String> {
    let d = at.discovery.open_or_default()?;
    let up = d.healthy("meshctl").await.map_err(|e| e.to_string())?;
    let up = up.first().ok_or_else(|| format!("no running `meshctl up` in {}", d.describe()))?;
    let addr = up.http_addr.clone().unwrap_or_else(|| up.grpc_addr.clone());
    let body = serde_json::to_string(&op).map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(at.timeout_s.max(1));
    let (code, answer) =
        tokio::task::spawn_blocking(move || pdmesh_core::http::post_json(&addr, "/v1/op", &body, timeout))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("meshctl up at {}: {e}", up.id))?;
    let v: Value = serde_json::from_str(&answer).unwrap_or(json!({ "error": answer }));
    if code != 200 {
        return Err(v["error"].as_str().unwrap_or("failed").to_string());
    }
    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    Ok(())
}

pub async fn scale_cmd(a: ScaleArgs) -> Result<(), String> {
    let mut replicas = BTreeMap::new();
    for kv in &a.replicas {
        let (k, n) = kv.split_once('=').ok_or_else(|| format!("{kv:?}: give KIND=N, e.g. decode=2"))?;
        let n: usize = n.parse().map_err(|_| format!("{kv:?}: N must be a number"))?;
        replicas.insert(k.to_string(), n);
    }
    send(&a.at, Op::Scale { replicas }).await
}

pub async fn drain_cmd(a: DrainArgs) -> Result<(), String> {
    send(&a.at, Op::Drain { id: a.id }).await
}

pub async fn restart_cmd(a: RestartArgs) -> Result<(), String> {
    let kinds = if a.all { RESTART_ORDER.iter().map(|k| k.to_string()).collect() } else { a.kinds };
    if kinds.is_empty() {
        return Err("name the kinds to restart, or give --all".into());
    }
    send(&a.at, Op::Restart { kinds }).await
}
