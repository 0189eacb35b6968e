//! The supervisor of a `meshctl up` mesh: it starts the processes in
//! order, restarts one that dies, and runs what operators ask for (scale,
//! drain, rolling restart) one operation at a time; [`crate::control`] is
//! the HTTP face that brings those requests in.
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
//! The kvbroker is neither scaled nor restarted this way: its tickets live
//! in its memory, and two brokers at once would split transfers between them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pdmesh_core::discovery::Registration;
use serde_json::{json, Value};

use crate::flags::Args;
use crate::plan::{Ctx, MAX_REPLICAS};
use crate::process::{AfterExit, Svc};
use crate::standin::{self, StandIn};

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

/// An operator's request with the channel its answer goes back on.
pub struct Asked {
    pub op: Op,
    pub reply: tokio::sync::oneshot::Sender<Result<Value, String>>,
}

/// The supervised mesh.
pub struct Mesh {
    pub ctx: Ctx,
    pub svcs: Vec<Svc>,
    processes: Snapshot,
    /// Answering the gateway's clients while no gateway runs or is due.
    stand_in: Option<StandIn>,
    /// A gateway is being started (`scale`): the stand-in waits for it.
    adding_gateway: bool,
}

/// Where operators' requests come from while the control endpoint serves,
/// and its registration in discovery (dropped when supervision ends).
pub struct Control {
    pub rx: tokio::sync::mpsc::Receiver<Asked>,
    pub registration: Option<Registration>,
    /// Where requests are sent (the autoscaler's go the operators' way).
    pub tx: tokio::sync::mpsc::Sender<Asked>,
}

/// Every process's supervisor state, refreshed each tick for `GET /v1/processes`.
pub type Snapshot = std::sync::Arc<std::sync::Mutex<Value>>;

/// Kinds meshctl cannot scale or restart, and unknown ones (a pool's
/// kind, `decode@gemma3-270m`, is judged by its `decode`).
fn refuse_kind(kind: &str) -> Result<(), String> {
    match pdmesh_core::discovery::split_kind(kind).0 {
        "prefill" | "decode" | "tokenizer" | "router" | "gateway" => Ok(()),
        "kvbroker" => Err("the kvbroker cannot be scaled or restarted by meshctl: its tickets live in its memory, and two brokers at once would split transfers between them".into()),
        k => Err(format!("unknown kind {k:?}: use prefill, decode, tokenizer, router or gateway")),
    }
}

impl Mesh {
    pub fn new(ctx: Ctx, svcs: Vec<Svc>) -> Mesh {
        let processes = Snapshot::default();
        let mesh = Mesh { ctx, svcs, processes, stand_in: None, adding_gateway: false };
        mesh.publish();
        mesh
    }

    fn publish(&self) {
        let v = Value::Array(self.svcs.iter().map(Svc::state).collect());
        *self.processes.lock().unwrap_or_else(|e| e.into_inner()) = v;
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
        self.mind_the_front_door();
        self.publish();
    }

    /// Start the gateway's stand-in when no gateway runs or is due within
    /// [`standin::DUE_WITHIN`]; stop it when one is.
    fn mind_the_front_door(&mut self) {
        let due = Instant::now() + standin::DUE_WITHIN;
        let coming = self.adding_gateway
            || self
                .svcs
                .iter()
                .any(|s| s.kind == "gateway" && (s.child.is_some() || s.restart_at.is_some_and(|t| t <= due)));
        match (coming, self.stand_in.is_some()) {
            (false, false) => match self.ctx.stand_in() {
                Ok(s) => {
                    eprintln!("meshctl: no gateway runs or is starting; answering its clients 503 {} until one does (meshctl scale gateway=1)", standin::CODE);
                    self.stand_in = Some(s);
                }
                Err(e) => eprintln!("meshctl: cannot answer the gateway's clients: {e}"),
            },
            (true, true) => self.end_stand_in(),
            _ => {}
        }
    }

    fn end_stand_in(&mut self) {
        if self.stand_in.take().is_some() {
            eprintln!("meshctl: a gateway is starting; its clients wait for it");
        }
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

    /// Instances of `kind` that serve or will again: not draining, and not
    /// left down (`--no-restart`, a crash loop), which `scale` replaces.
    fn live(&self, kind: &str) -> Vec<String> {
        let serves = |s: &&Svc| s.kind == kind && !s.draining && s.gave_up.is_none();
        self.svcs.iter().filter(serves).map(|s| s.name.clone()).collect()
    }

    /// Start one more instance of `kind`, gated on its health; its id.
    async fn add(&mut self, kind: &str) -> Result<String, String> {
        let index = self.svcs.iter().filter(|s| s.kind == kind).map(|s| s.index + 1).max().unwrap_or(0);
        let role = pdmesh_core::discovery::split_kind(kind).0;
        let sharing = self.sharing(role) + 1;
        self.reshare(role, sharing).await;
        let mut s = self.ctx.svc(kind, index, sharing)?;
        if kind == "gateway" {
            // Its clients queue for it from now on.
            self.adding_gateway = true;
            self.end_stand_in();
        }
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
        self.adding_gateway = false;
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

    /// Live replicas of compute role `role` (every pool's), which share the host.
    fn sharing(&self, role: &str) -> usize {
        let of_role = |s: &&Svc| pdmesh_core::discovery::split_kind(&s.kind).0 == role;
        self.svcs.iter().filter(of_role).filter(|s| !s.draining && s.gave_up.is_none()).count()
    }

    /// The live replicas of compute role `role` divide the cores as
    /// `sharing` replicas do (`PUT /threads/N` on each): before a new one
    /// starts, and after a drain. One that could not be told keeps its
    /// share, and meshctl's log says so.
    async fn reshare(&self, role: &str, sharing: usize) {
        let Some(n) = self.ctx.threads_in_use(role, sharing) else { return };
        let of_role = |s: &&Svc| pdmesh_core::discovery::split_kind(&s.kind).0 == role && !s.draining;
        for s in self.svcs.iter().filter(of_role) {
            let (addr, path) = (s.http.clone(), format!("/threads/{n}"));
            let put = move || pdmesh_core::http::put(&addr, &path, Duration::from_secs(2));
            let why = match tokio::task::spawn_blocking(put).await {
                Ok(Ok((200, _))) => continue,
                Ok(Ok((code, body))) => format!("{code} {}", body.trim()),
                Ok(Err(e)) => e.to_string(),
                Err(e) => e.to_string(),
            };
            eprintln!("meshctl: {} keeps its kernel threads: {why}", s.name);
        }
    }

    /// Every compute role's replicas divide the cores as they are now.
    async fn reshare_all(&self) {
        for role in ["prefill", "decode"] {
            self.reshare(role, self.sharing(role)).await;
        }
    }

    async fn scale(&mut self, asked: &BTreeMap<String, usize>) -> Result<Value, String> {
        let mut want = BTreeMap::new();
        for (kind, &n) in asked {
            refuse_kind(kind)?;
            for k in self.ctx.kinds_of(kind, false)? {
                want.insert(k, n);
            }
        }
        for (kind, &n) in &want {
            if kind == "gateway" && n != 1 {
                return Err("the gateway listens on one --gateway-addr: scale it to 1 only".into());
            }
            if n == 0 || n > MAX_REPLICAS {
                return Err(format!("{kind}={n}: give 1..={MAX_REPLICAS}"));
            }
        }
        let (mut started, mut drained) = (Vec::new(), Vec::new());
        for (kind, &n) in &want {
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
        self.reshare_all().await;
        Ok(json!({ "started": started, "drained": drained }))
    }

    /// Restart these kinds; one without a pool is restarted in every pool.
    async fn restart(&mut self, asked: &[String]) -> Result<Value, String> {
        let mut kinds = Vec::new();
        for k in asked {
            refuse_kind(k)?;
            kinds.extend(self.ctx.kinds_of(k, true)?);
        }
        let mut replaced = Vec::new();
        for kind in &kinds {
            for old in self.live(kind) {
                let new = self.add(kind).await?;
                self.drain(std::slice::from_ref(&old)).await?;
                // The new one started sharing the cores with the old: its share back.
                let role = pdmesh_core::discovery::split_kind(kind).0;
                self.reshare(role, self.sharing(role)).await;
                replaced.push(json!({ "old": old, "new": new }));
            }
        }
        self.reshare_all().await;
        Ok(json!({ "replaced": replaced }))
    }

    /// What `GET /v1/processes` serves, kept fresh by the supervisor.
    pub fn snapshot(&self) -> Snapshot {
        self.processes.clone()
    }
}

/// Stop the mesh: the gateway drains first (its requests finish while
/// everything behind it still serves), then the rest drain together (with
/// no new requests coming in, each waits only for its own in-flight work).
pub async fn stop_all(svcs: &mut [Svc], grace: Duration) {
    for s in svcs.iter_mut().filter(|s| s.kind == "gateway") {
        s.stop(grace).await;
    }
    for s in svcs.iter() {
        s.terminate();
    }
    for s in svcs.iter_mut() {
        s.reap(grace).await;
    }
}

/// Start `s` and wait for its health; a service whose port was taken
/// before it bound gets new ports (up to 4 tries).
pub async fn start_one(s: &mut Svc, timeout: Duration) -> Result<(), String> {
    let mut tries = 0;
    loop {
        s.spawn()?;
        let r = s.wait_healthy(timeout).await;
        tries += 1;
        if r.is_err() && tries < 4 && s.port_was_taken() {
            s.new_ports()?;
            continue;
        }
        r?;
        eprintln!("meshctl: {:<9} healthy (http {}, log {})", s.name, s.http, s.log.display());
        return Ok(());
    }
}

/// Start in order, each gated on the previous one's health.
pub async fn start_all(
    svcs: &mut [Svc],
    timeout: Duration,
    stop: &mut (impl std::future::Future<Output = ()> + Unpin),
) -> Result<(), String> {
    for s in svcs.iter_mut() {
        tokio::select! {
            r = start_one(s, timeout) => r?,
            _ = &mut *stop => return Err("interrupted".into()),
        }
    }
    Ok(())
}

/// Book each service that exited and restart those whose backoff is over
/// (a drained one is forgotten; a crash loop past `--max-quick-restarts`,
/// or any exit with `--no-restart`, is left down); whether the Prometheus
/// target list needs rewriting (a service got new ports, or one left).
pub fn restart_exited(a: &Args, svcs: &mut Vec<Svc>) -> bool {
    let mut moved = false;
    for s in svcs.iter_mut() {
        if let Some(st) = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            match s.exited(&st.to_string(), !a.no_restart, a.max_quick_restarts) {
                AfterExit::Forget => {
                    eprintln!("meshctl: {} drained and exited ({st})", s.name);
                    moved = true;
                }
                AfterExit::GiveUp => {
                    eprintln!(
                        "meshctl: {} exited ({st}); leaving it down: {}",
                        s.name,
                        s.gave_up.as_deref().unwrap_or("")
                    );
                }
                AfterExit::RestartAt(at) => eprintln!(
                    "meshctl: {} exited ({st}); restarting it alone in {:.2} s (restart {})",
                    s.name,
                    at.saturating_duration_since(Instant::now()).as_secs_f64(),
                    s.restarts + 1
                ),
            }
        }
        if s.child.is_none() && s.restart_at.is_some_and(|t| Instant::now() >= t) {
            s.restart_at = None;
            s.restarts += 1;
            if s.port_was_taken() {
                if let Err(e) = s.new_ports() {
                    eprintln!("meshctl: {e}");
                }
                moved = true;
            }
            if let Err(e) = s.spawn() {
                eprintln!("meshctl: {e}");
            }
        }
    }
    svcs.retain(|s| !(s.draining && s.child.is_none()));
    moved
}
