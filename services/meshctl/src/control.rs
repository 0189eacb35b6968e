//! A running `meshctl up` and how operators change it: `meshctl scale`,
//! `meshctl drain` and `meshctl restart` talk to the supervisor's control
//! endpoint, an HTTP server on loopback that `meshctl up` registers in
//! discovery as service `meshctl` (Consul: `pdmesh-meshctl`), so the
//! commands find it with the same `--discovery` as everything else.
//!
//! - scale: a kind's new instances start one at a time, each gated on its
//!   /health (routers pick it up within one watch round); surplus ones, the
//!   highest-numbered, drain together;
//! - drain: SIGTERM to one instance, which leaves discovery, finishes its
//!   work and exits; meshctl then forgets it instead of restarting it;
//! - restart: for each instance of a kind, a new one comes up first, is
//!   gated on /health, and only then is the old one drained. `--all` goes
//!   prefill, decode, tokenizer, router, gateway (the gateway's new process
//!   shares the old one's port through SO_REUSEPORT while the old drains).
//!
//! `GET /v1/processes` is every process's supervisor state (running,
//! restarting after a backoff, left down after a crash loop), which
//! `meshctl status` shows.
//!
//! One operation runs at a time; others queue. The kvbroker is neither
//! scaled nor restarted this way: its tickets live in its memory, and two
//! brokers at once would split transfers between them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use pdmesh_core::discovery::{Instance, Registration};
use serde_json::{json, Value};

use crate::process::Svc;
use crate::up::{restart_exited, start_one, Ctx};

/// Most instances of one kind.
pub const MAX_REPLICAS: usize = 64;
/// The order of `meshctl restart --all`.
pub const RESTART_ORDER: [&str; 5] = ["prefill", "decode", "tokenizer", "router", "gateway"];

/// What an operator asked for.
#[derive(Debug, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Op {
    /// Instances wanted per kind.
    Scale { replicas: BTreeMap<String, usize> },
    /// Drain one instance by id.
    Drain { id: String },
    /// Rolling restart of these kinds, in this order.
    Restart { kinds: Vec<String> },
}

struct Asked {
    op: Op,
    reply: tokio::sync::oneshot::Sender<Result<Value, String>>,
}

/// The supervised mesh.
pub struct Mesh {
    pub ctx: Ctx,
    pub svcs: Vec<Svc>,
    processes: Snapshot,
}

/// The control endpoint while it serves.
pub struct Control {
    rx: tokio::sync::mpsc::Receiver<Asked>,
    registration: Option<Registration>,
}

/// Every process's supervisor state, refreshed each tick for `GET /v1/processes`.
type Snapshot = std::sync::Arc<std::sync::Mutex<Value>>;

#[derive(Clone)]
struct Endpoint {
    tx: tokio::sync::mpsc::Sender<Asked>,
    processes: Snapshot,
}

fn refuse_kind(kind: &str) -> Result<(), String> {
    match kind {
        "prefill" | "decode" | "tokenizer" | "router" | "gateway" => Ok(()),
        "kvbroker" => Err("the kvbroker cannot be scaled or restarted by meshctl: its tickets live in its memory, and two brokers at once would split transfers between them".into()),
        k => Err(format!("unknown kind {k:?}: use prefill, decode, tokenizer, router or gateway")),
    }
}

impl Mesh {
    pub fn new(ctx: Ctx, svcs: Vec<Svc>) -> Mesh {
        let processes = Snapshot::default();
        let mesh = Mesh { ctx, svcs, processes };
        mesh.publish();
        mesh
    }

    fn publish(&self) {
        let v = Value::Array(self.svcs.iter().map(Svc::state).collect());
        *self.processes.lock().unwrap_or_else(|e| e.into_inner()) = v;
    }

    /// Serve the control endpoint on loopback and register it in discovery.
    pub async fn open_control(&self) -> Result<Control, String> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
        let addr = l.local_addr().map_err(|e| e.to_string())?.to_string();
        let (tx, rx) = tokio::sync::mpsc::channel::<Asked>(16);
        let ep = Endpoint { tx, processes: self.processes.clone() };
        let app = axum::Router::new()
            .route("/health", get(|| async { "ok\n" }))
            .route("/v1/op", post(ask))
            .route("/v1/processes", get(processes))
            .with_state(ep);
        tokio::spawn(async move { axum::serve(l, app).await });
        let d = self.ctx.a.discovery.open(&self.ctx.locator).map_err(|e| e.to_string())?;
        let me = Instance {
            service: "meshctl".into(),
            id: format!("meshctl-{}", std::process::id()),
            grpc_addr: addr.clone(),
            http_addr: Some(addr.clone()),
            meta: [("role".to_string(), "meshctl".to_string())].into(),
        };
        let registration = Some(d.register(me).await.map_err(|e| e.to_string())?);
        eprintln!("meshctl: control endpoint http://{addr} (meshctl scale / drain / restart)");
        Ok(Control { rx, registration })
    }

    /// Supervise until `stop`: restart what dies, run operators' requests.
    pub async fn supervise(
        &mut self,
        control: Option<Control>,
        stop: &mut (impl std::future::Future<Output = ()> + Unpin),
    ) {
        let (mut rx, registration) = match control {
            Some(c) => (Some(c.rx), c.registration),
            None => (None, None),
        };
        loop {
            let asked = async {
                match rx.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut *stop => break,
                Some(a) = asked => {
                    eprintln!("meshctl: operator asks: {}", serde_json::to_string(&a.op).unwrap_or_default());
                    let r = tokio::select! {
                        r = self.run_op(a.op) => r,
                        _ = &mut *stop => break,
                    };
                    if let Err(e) = &r {
                        eprintln!("meshctl: refused or failed: {e}");
                    }
                    let _ = a.reply.send(r);
                }
                _ = tokio::time::sleep(Duration::from_millis(250)) => self.tick(),
            }
        }
        if let Some(r) = registration {
            let _ = r.deregister().await;
        }
    }

    fn tick(&mut self) {
        if restart_exited(&self.ctx.a, &mut self.svcs) {
            self.ctx.write_targets(&self.svcs);
        }
        self.publish();
    }

    async fn run_op(&mut self, op: Op) -> Result<Value, String> {
        let t0 = Instant::now();
        let mut v = match op {
            Op::Scale { replicas } => self.scale(&replicas).await?,
            Op::Drain { id } => {
                let kind = self.svcs.iter().find(|s| s.name == id && !s.draining).map(|s| s.kind.clone());
                let kind = kind.ok_or_else(|| format!("no live instance {id:?} under this meshctl"))?;
                if self.live(&kind).len() == 1 {
                    return Err(format!(
                        "{id} is the last {kind}: draining it would stop the mesh serving; scale {kind} up first, or use `meshctl restart {kind}` to replace it"
                    ));
                }
                self.drain(std::slice::from_ref(&id)).await?;
                json!({ "drained": [id] })
            }
            Op::Restart { kinds } => self.restart(&kinds).await?,
        };
        v["took_s"] = json!((t0.elapsed().as_secs_f64() * 10.0).round() / 10.0);
        v["instances"] = json!(self.svcs.iter().filter(|s| !s.draining).map(|s| s.name.clone()).collect::<Vec<_>>());
        Ok(v)
    }

    fn live(&self, kind: &str) -> Vec<String> {
        self.svcs.iter().filter(|s| s.kind == kind && !s.draining).map(|s| s.name.clone()).collect()
    }

    /// Start one more instance of `kind`, gated on its health; its id.
    async fn add(&mut self, kind: &str) -> Result<String, String> {
        let index = self.svcs.iter().filter(|s| s.kind == kind).map(|s| s.index + 1).max().unwrap_or(0);
        let mut s = self.ctx.svc(kind, index)?;
        let r = {
            let start = start_one(&mut s, Duration::from_secs(self.ctx.a.ready_timeout_s));
            tokio::pin!(start);
            // Keep supervising the others while the new one comes up.
            loop {
                tokio::select! {
                    r = &mut start => break r,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => self.tick(),
                }
            }
        };
        let name = s.name.clone();
        if let Err(e) = r {
            s.stop(Duration::from_secs(5)).await;
            return Err(e);
        }
        // Keep the start order (the gateway last) for the stop order.
        let at = self.svcs.iter().rposition(|x| x.kind == kind).map_or(self.svcs.len(), |i| i + 1);
        self.svcs.insert(at, s);
        self.ctx.write_targets(&self.svcs);
        Ok(name)
    }

    /// Drain these instances together and wait until they exit (SIGKILL after the grace).
    async fn drain(&mut self, ids: &[String]) -> Result<(), String> {
        for id in ids {
            let s = self.svcs.iter_mut().find(|s| &s.name == id && !s.draining);
            let s = s.ok_or_else(|| format!("no live instance {id:?} under this meshctl"))?;
            s.draining = true;
            s.terminate();
        }
        let grace = self.ctx.a.drain.grace();
        let t0 = Instant::now();
        while self.svcs.iter().any(|s| ids.contains(&s.name)) {
            if t0.elapsed() > grace {
                for s in self.svcs.iter_mut().filter(|s| ids.contains(&s.name)) {
                    s.reap(Duration::ZERO).await;
                }
                self.svcs.retain(|s| !ids.contains(&s.name));
                break;
            }
            self.tick();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.ctx.write_targets(&self.svcs);
        Ok(())
    }

    async fn scale(&mut self, want: &BTreeMap<String, usize>) -> Result<Value, String> {
        for (kind, &n) in want {
            refuse_kind(kind)?;
            if kind == "gateway" && n != 1 {
                return Err("the gateway listens on one --gateway-addr: scale it to 1 only".into());
            }
            if n == 0 || n > MAX_REPLICAS {
                return Err(format!("{kind}={n}: give 1..={MAX_REPLICAS}"));
            }
        }
        let (mut started, mut drained) = (Vec::new(), Vec::new());
        for (kind, &n) in want {
            let live = self.live(kind);
            for _ in live.len()..n {
                started.push(self.add(kind).await?);
            }
            if live.len() > n {
                let surplus = live[n..].to_vec();
                self.drain(&surplus).await?;
                drained.extend(surplus);
            }
        }
        Ok(json!({ "started": started, "drained": drained }))
    }

    async fn restart(&mut self, kinds: &[String]) -> Result<Value, String> {
        for k in kinds {
            refuse_kind(k)?;
        }
        let mut replaced = Vec::new();
        for kind in kinds {
            for old in self.live(kind) {
                let new = self.add(kind).await?;
                self.drain(std::slice::from_ref(&old)).await?;
                replaced.push(json!({ "old": old, "new": new }));
            }
        }
        Ok(json!({ "replaced": replaced }))
    }
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
    /// KIND=N pairs: `prefill=2 decode=3` (prefill, decode, tokenizer, router).
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
    /// Kinds to restart, in this order (prefill, decode, tokenizer, router, gateway).
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
