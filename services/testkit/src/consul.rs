//! A FAKE Consul agent, for tests. No Consul can be installed on the
//! machines pdmesh is built on (it is not in Debian, PyPI or npm), so the
//! Consul backend is tested against this stand-in. It is not Consul: it
//! implements only the agent endpoints pdmesh calls, with the shapes and
//! rules of HashiCorp's API documentation:
//!
//! - `PUT /v1/agent/service/register` (`ID` defaults to `Name`; one `Check`
//!   gets the id `service:<ID>`, `Checks` get `service:<ID>:<n>`; a check
//!   starts `critical` unless `Status` says otherwise; HTTP checks run
//!   every `Interval`: 2xx passing, 429 warning, anything else critical;
//!   TTL checks turn critical when not passed in time; a check critical for
//!   `DeregisterCriticalServiceAfter` removes its service);
//! - `PUT /v1/agent/service/deregister/:id`, `PUT
//!   /v1/agent/service/maintenance/:id?enable=&reason=` (a critical
//!   `_service_maintenance:<id>` check), `PUT /v1/agent/check/{pass,warn,fail}/:id`;
//! - `GET /v1/agent/service/:id`, `GET /v1/agent/services`, `GET /v1/agent/checks`;
//! - `GET /v1/health/service/:name` with `passing` (drops warning and
//!   critical), and blocking queries (`index`, `wait`, default 5 min, at
//!   most 10): every read carries `X-Consul-Index`; lists are `[]`, never
//!   `null`; a service registered without `Meta` shows `"Meta": null`.
//!
//! With TLS ([`FakeConsul::start_tls`]) it answers HTTPS only, with a
//! certificate for 127.0.0.1 signed by a CA of its own ([`TestCa`]).
//!
//! With a token set, every call without that `X-Consul-Token` gets 403
//! `ACL not found`. Every call is logged ([`FakeConsul::requests`]), so
//! tests can see blocking queries and tokens. [`FakeConsul::stop`] and
//! [`FakeConsul::start`] make the agent unreachable and back, on the
//! same port, with its state kept.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// One call the fake answered.
#[derive(Clone, Debug)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub query: String,
    pub token: Option<String>,
}

#[derive(Clone, Debug)]
enum Kind {
    Http { url: String, interval: Duration, timeout: Duration, next: Instant },
    Ttl { ttl: Duration, expires: Instant },
    Maintenance,
}

#[derive(Clone, Debug)]
struct Check {
    id: String,
    name: String,
    status: String,
    output: String,
    notes: String,
    kind: Kind,
    deregister_after: Option<Duration>,
    critical_since: Option<Instant>,
}

#[derive(Clone, Debug)]
struct Service {
    /// `ID`, `Service` (the name), `Tags`, `Address`, `Port`, `Meta`, as the agent shows them.
    def: Value,
    checks: Vec<Check>,
}

#[derive(Default)]
struct Inner {
    index: u64,
    services: BTreeMap<String, Service>,
    log: Vec<Logged>,
}

struct State {
    inner: Mutex<Inner>,
    changed: tokio::sync::watch::Sender<u64>,
    token: Option<String>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Raise the index (a change) and wake blocking queries.
    fn bump(&self, inner: &mut Inner) {
        inner.index += 1;
        self.changed.send_replace(inner.index);
    }
}

/// The fake agent (see the module docs).
pub struct FakeConsul {
    pub addr: SocketAddr,
    state: Arc<State>,
    server: Option<JoinHandle<()>>,
    checker: JoinHandle<()>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// A certificate authority made for a test, and a server certificate it
/// signed for 127.0.0.1 and localhost; written as PEM files into a folder.
pub struct TestCa {
    /// The CA certificate (what `CONSUL_CACERT` names).
    pub ca_pem: std::path::PathBuf,
    server_cert: String,
    server_key: String,
}

impl TestCa {
    /// A new CA and server certificate, with the CA's PEM written into `dir`.
    pub fn new(dir: &std::path::Path) -> TestCa {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).expect("a self-signed CA");
        let key = KeyPair::generate().expect("a server key");
        let server =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).expect("server parameters");
        let cert = server.signed_by(&key, &ca_cert, &ca_key).expect("a signed server certificate");
        std::fs::create_dir_all(dir).expect("the CA folder");
        let ca_pem = dir.join("ca.pem");
        std::fs::write(&ca_pem, ca_cert.pem()).expect("write ca.pem");
        TestCa { ca_pem, server_cert: cert.pem(), server_key: key.serialize_pem() }
    }

    fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = vec![CertificateDer::from_pem_slice(self.server_cert.as_bytes()).expect("server certificate PEM")];
        let key = PrivateKeyDer::from_pem_slice(self.server_key.as_bytes()).expect("server key PEM");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("a server TLS configuration");
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }
}

/// A Go duration such as `1s`, `1500ms`, `1m30s`.
pub fn go_duration(s: &str) -> Option<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let n: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += Duration::from_secs_f64(n * scale);
    }
    Some(total)
}

fn reply(code: u16, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder().status(code).body(Full::new(body.into())).expect("a valid response")
}

fn json_reply(index: Option<u64>, v: &Value) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(200).header("Content-Type", "application/json");
    if let Some(i) = index {
        b = b.header("X-Consul-Index", i.to_string());
    }
    b.body(Full::new(Bytes::from(v.to_string()))).expect("a valid response")
}

fn query_map(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_string(), v.replace("%20", " ")),
            None => (p.to_string(), String::new()),
        })
        .collect()
}

fn check_json(c: &Check, svc: &Service) -> Value {
    json!({
        "Node": "fake-agent", "CheckID": c.id, "Name": c.name, "Status": c.status, "Notes": c.notes,
        "Output": c.output, "ServiceID": svc.def["ID"], "ServiceName": svc.def["Service"],
        "ServiceTags": svc.def["Tags"], "Type": match c.kind { Kind::Http { .. } => "http", Kind::Ttl { .. } => "ttl", Kind::Maintenance => "" },
    })
}

/// One check definition of a registration, or why it is refused.
fn parse_check(def: &Value, id: String, now: Instant) -> Result<Check, String> {
    let dur = |k: &str| def[k].as_str().map(|s| go_duration(s).ok_or(format!("invalid {k} {s:?}"))).transpose();
    let status = def["Status"].as_str().unwrap_or("critical").to_string();
    if !["passing", "warning", "critical"].contains(&status.as_str()) {
        return Err(format!("invalid check status {status:?}"));
    }
    let kind = if let Some(url) = def["HTTP"].as_str() {
        let interval = dur("Interval")?.ok_or("Interval is required for HTTP checks")?;
        Kind::Http { url: url.into(), interval, timeout: dur("Timeout")?.unwrap_or(Duration::from_secs(10)), next: now }
    } else if let Some(ttl) = dur("TTL")? {
        Kind::Ttl { ttl, expires: now + ttl }
    } else {
        return Err("check needs HTTP with Interval, or TTL (the only kinds this fake runs)".into());
    };
    Ok(Check {
        id: def["CheckID"].as_str().map_or(id, str::to_string),
        name: def["Name"].as_str().unwrap_or("Service check").into(),
        critical_since: (status == "critical").then_some(now),
        status,
        output: String::new(),
        notes: def["Notes"].as_str().unwrap_or("").into(),
        kind,
        deregister_after: dur("DeregisterCriticalServiceAfter")?,
    })
}

/// A registration body as the agent keeps it, or why it is refused.
fn parse_registration(body: &[u8], now: Instant) -> Result<Service, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("Request decode failed: {e}"))?;
    let name = v["Name"].as_str().filter(|n| !n.is_empty()).ok_or("Missing service name")?;
    let id = v["ID"].as_str().filter(|n| !n.is_empty()).unwrap_or(name);
    if let Some(meta) = v["Meta"].as_object() {
        for (k, val) in meta {
            let key_ok =
                !k.is_empty() && k.len() <= 128 && k.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c));
            if !key_ok || !val.is_string() || val.as_str().unwrap_or("").len() > 512 {
                return Err(format!("Invalid Service Meta: key {k:?}"));
            }
        }
    }
    let mut checks = Vec::new();
    if v["Check"].is_object() {
        checks.push(parse_check(&v["Check"], format!("service:{id}"), now)?);
    }
    for (n, c) in v["Checks"].as_array().into_iter().flatten().enumerate() {
        checks.push(parse_check(c, format!("service:{id}:{}", n + 1), now)?);
    }
    let def = json!({
        "ID": id, "Service": name, "Tags": v["Tags"].as_array().cloned().unwrap_or_default(),
        "Address": v["Address"].as_str().unwrap_or(""), "Port": v["Port"].as_u64().unwrap_or(0),
        "Meta": if v["Meta"].is_object() { v["Meta"].clone() } else { Value::Null },
        "Weights": {"Passing": 1, "Warning": 1}, "EnableTagOverride": false,
    });
    Ok(Service { def, checks })
}

fn set_status(c: &mut Check, status: &str, output: String, now: Instant) -> bool {
    let changed = c.status != status;
    if changed {
        c.critical_since = (status == "critical").then_some(now);
    }
    c.status = status.into();
    c.output = output;
    changed
}

impl FakeConsul {
    /// A fake agent on a free loopback port; with `token`, calls must carry it.
    pub async fn start_new(token: Option<&str>) -> FakeConsul {
        FakeConsul::start_with(token, None).await
    }

    /// A fake agent that answers HTTPS only, with `ca`'s server certificate.
    pub async fn start_tls(token: Option<&str>, ca: &TestCa) -> FakeConsul {
        FakeConsul::start_with(token, Some(ca.acceptor())).await
    }

    async fn start_with(token: Option<&str>, tls: Option<tokio_rustls::TlsAcceptor>) -> FakeConsul {
        let (changed, _) = tokio::sync::watch::channel(1);
        let state = Arc::new(State {
            inner: Mutex::new(Inner { index: 1, ..Default::default() }),
            changed,
            token: token.map(str::to_string),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the fake agent");
        let addr = listener.local_addr().expect("local address");
        let checker = tokio::spawn(run_checks(state.clone()));
        let server = Some(tokio::spawn(serve(listener, state.clone(), tls.clone())));
        FakeConsul { addr, state, server, checker, tls }
    }

    /// `consul://addr`, for `--discovery`.
    pub fn url(&self) -> String {
        format!("consul://{}", self.addr)
    }

    /// Unreachable from now: the port is closed and open calls are cut.
    pub fn stop(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
    }

    /// Reachable again on the same port, with the same registrations.
    pub async fn start(&mut self) {
        self.stop();
        let end = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if Instant::now() < end => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("cannot bind the fake agent again on {}: {e}", self.addr),
            }
        };
        self.server = Some(tokio::spawn(serve(listener, self.state.clone(), self.tls.clone())));
    }

    /// Every registered service as `GET /v1/agent/services` shows it, by id.
    pub fn services(&self) -> BTreeMap<String, Value> {
        self.state.lock().services.iter().map(|(id, s)| (id.clone(), s.def.clone())).collect()
    }

    /// Every check as `GET /v1/agent/checks` shows it, by check id.
    pub fn checks(&self) -> BTreeMap<String, Value> {
        let g = self.state.lock();
        g.services.values().flat_map(|s| s.checks.iter().map(move |c| (c.id.clone(), check_json(c, s)))).collect()
    }

    /// Every call answered so far.
    pub fn requests(&self) -> Vec<Logged> {
        self.state.lock().log.clone()
    }

    /// The current index.
    pub fn index(&self) -> u64 {
        self.state.lock().index
    }
}

impl Drop for FakeConsul {
    fn drop(&mut self) {
        self.stop();
        self.checker.abort();
    }
}

/// Accept connections until aborted; aborting also cuts every open connection.
async fn serve(listener: tokio::net::TcpListener, state: Arc<State>, tls: Option<tokio_rustls::TlsAcceptor>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let state = state.clone();
        let tls = tls.clone();
        conns.spawn(async move {
            match tls {
                Some(acceptor) => {
                    // A client that does not finish the handshake is dropped.
                    if let Ok(s) = acceptor.accept(stream).await {
                        serve_connection(s, state).await;
                    }
                }
                None => serve_connection(stream, state).await,
            }
        });
        while conns.try_join_next().is_some() {}
    }
}

async fn serve_connection<S>(stream: S, state: Arc<State>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
}

/// Run HTTP checks when due, expire TTLs, reap long-critical services.
async fn run_checks(state: Arc<State>) {
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = Instant::now();
        let due: Vec<(String, String, String, Duration)> = {
            let mut g = state.lock();
            let mut due = Vec::new();
            for (sid, s) in g.services.iter_mut() {
                for c in s.checks.iter_mut() {
                    if let Kind::Http { url, interval, timeout, next } = &mut c.kind {
                        if *next <= now {
                            *next = now + *interval;
                            due.push((sid.clone(), c.id.clone(), url.clone(), *timeout));
                        }
                    }
                }
            }
            due
        };
        for (sid, cid, url, timeout) in due {
            let target = url.trim_start_matches("http://").to_string();
            let (host, path) =
                target.split_once('/').map_or((target.clone(), "/".to_string()), |(h, p)| (h.into(), format!("/{p}")));
            let got = tokio::task::spawn_blocking(move || pdmesh_core::http::get(&host, &path, timeout)).await.ok();
            let (status, output) = match got {
                Some(Ok((code, body))) if (200..300).contains(&code) => {
                    ("passing", format!("HTTP GET {url}: {code} Output: {body}"))
                }
                Some(Ok((429, body))) => ("warning", format!("HTTP GET {url}: 429 Output: {body}")),
                Some(Ok((code, body))) => ("critical", format!("HTTP GET {url}: {code} Output: {body}")),
                Some(Err(e)) => ("critical", format!("Get {url}: {e}")),
                None => ("critical", "check panicked".into()),
            };
            let mut g = state.lock();
            let changed = g
                .services
                .get_mut(&sid)
                .and_then(|s| s.checks.iter_mut().find(|c| c.id == cid))
                .is_some_and(|c| set_status(c, status, output, Instant::now()));
            if changed {
                state.bump(&mut g);
            }
        }
        let mut g = state.lock();
        let mut changed = false;
        for s in g.services.values_mut() {
            for c in s.checks.iter_mut() {
                if let Kind::Ttl { expires, .. } = c.kind {
                    if expires <= now {
                        changed |= set_status(c, "critical", "TTL expired".into(), now);
                    }
                }
            }
        }
        let before = g.services.len();
        g.services.retain(|_, s| {
            !s.checks
                .iter()
                .any(|c| matches!((c.critical_since, c.deregister_after), (Some(t), Some(d)) if now >= t + d))
        });
        if changed || g.services.len() != before {
            state.bump(&mut g);
        }
    }
}

async fn handle(state: Arc<State>, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let token = req.headers().get("X-Consul-Token").and_then(|v| v.to_str().ok()).map(str::to_string);
    state.lock().log.push(Logged {
        method: method.clone(),
        path: path.clone(),
        query: query.clone(),
        token: token.clone(),
    });
    if state.token.is_some() && token != state.token {
        return reply(403, "ACL not found");
    }
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let q = query_map(&query);
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method.as_str(), segs.as_slice()) {
        ("PUT", ["v1", "agent", "service", "register"]) => register(&state, &body),
        ("PUT", ["v1", "agent", "service", "deregister", id]) => deregister(&state, id),
        ("PUT", ["v1", "agent", "service", "maintenance", id]) => maintenance(&state, id, &q),
        ("PUT", ["v1", "agent", "check", verb @ ("pass" | "warn" | "fail"), id]) => ttl_update(&state, verb, id, &q),
        ("GET", ["v1", "agent", "service", id]) => match state.lock().services.get(*id) {
            Some(s) => json_reply(None, &s.def),
            None => reply(404, format!("unknown service ID: {id}")),
        },
        ("GET", ["v1", "agent", "services"]) => {
            let g = state.lock();
            json_reply(None, &Value::Object(g.services.iter().map(|(k, s)| (k.clone(), s.def.clone())).collect()))
        }
        ("GET", ["v1", "agent", "checks"]) => {
            let g = state.lock();
            let all = g.services.values().flat_map(|s| s.checks.iter().map(move |c| (c.id.clone(), check_json(c, s))));
            json_reply(None, &Value::Object(all.collect()))
        }
        ("GET", ["v1", "health", "service", name]) => health_service(&state, name, &q).await,
        _ => reply(405, format!("fake Consul agent: {method} {path} is not implemented")),
    }
}

fn register(state: &State, body: &[u8]) -> Response<Full<Bytes>> {
    match parse_registration(body, Instant::now()) {
        Ok(s) => {
            let mut g = state.lock();
            let id = s.def["ID"].as_str().unwrap_or_default().to_string();
            g.services.insert(id, s);
            state.bump(&mut g);
            reply(200, "")
        }
        Err(e) => reply(400, e),
    }
}

fn deregister(state: &State, id: &str) -> Response<Full<Bytes>> {
    let mut g = state.lock();
    if g.services.remove(id).is_none() {
        return reply(404, format!("Unknown service ID {id:?}"));
    }
    state.bump(&mut g);
    reply(200, "")
}

fn maintenance(state: &State, id: &str, q: &BTreeMap<String, String>) -> Response<Full<Bytes>> {
    let enable = match q.get("enable").map(String::as_str) {
        Some("true") => true,
        Some("false") => false,
        _ => return reply(400, "Missing value for enable"),
    };
    let mut g = state.lock();
    let Some(s) = g.services.get_mut(id) else { return reply(404, format!("Unknown service ID {id:?}")) };
    let cid = format!("_service_maintenance:{id}");
    s.checks.retain(|c| c.id != cid);
    if enable {
        s.checks.push(Check {
            id: cid,
            name: "Service Maintenance Mode".into(),
            status: "critical".into(),
            output: String::new(),
            notes: q.get("reason").cloned().unwrap_or_default(),
            kind: Kind::Maintenance,
            deregister_after: None,
            critical_since: None,
        });
    }
    state.bump(&mut g);
    reply(200, "")
}

fn ttl_update(state: &State, verb: &str, id: &str, q: &BTreeMap<String, String>) -> Response<Full<Bytes>> {
    let status = match verb {
        "pass" => "passing",
        "warn" => "warning",
        _ => "critical",
    };
    let now = Instant::now();
    let mut g = state.lock();
    let check = g.services.values_mut().flat_map(|s| s.checks.iter_mut()).find(|c| c.id == id);
    let Some(c) = check else { return reply(404, format!("Unknown check ID {id:?}")) };
    let Kind::Ttl { ttl, expires } = &mut c.kind else {
        return reply(500, format!("CheckID {id:?} does not have associated TTL"));
    };
    *expires = now + *ttl;
    let changed = set_status(c, status, q.get("note").cloned().unwrap_or_default(), now);
    if changed {
        state.bump(&mut g);
    }
    reply(200, "")
}

async fn health_service(state: &State, name: &str, q: &BTreeMap<String, String>) -> Response<Full<Bytes>> {
    let passing_only = q.get("passing").is_some_and(|v| v != "false" && v != "0");
    let index: u64 = match q.get("index").map(|i| i.parse()) {
        None => 0,
        Some(Ok(i)) => i,
        Some(Err(_)) => return reply(400, "Invalid index"),
    };
    let wait = match q.get("wait") {
        None => Duration::from_secs(300),
        Some(w) => match go_duration(w) {
            Some(d) => d.min(Duration::from_secs(600)),
            None => return reply(400, "Invalid wait time"),
        },
    };
    if index > 0 {
        let mut rx = state.changed.subscribe();
        let _ = tokio::time::timeout(wait, rx.wait_for(|i| *i > index)).await;
    }
    let g = state.lock();
    let entries: Vec<Value> = g
        .services
        .values()
        .filter(|s| s.def["Service"] == name)
        .filter(|s| !passing_only || s.checks.iter().all(|c| c.status == "passing"))
        .map(|s| {
            let serf = json!({"Node": "fake-agent", "CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing",
                "Notes": "", "Output": "Agent alive and reachable", "ServiceID": "", "ServiceName": "", "ServiceTags": [], "Type": ""});
            let checks: Vec<Value> = std::iter::once(serf).chain(s.checks.iter().map(|c| check_json(c, s))).collect();
            json!({
                "Node": {"ID": "00000000-0000-0000-0000-000000000001", "Node": "fake-agent", "Address": "127.0.0.1",
                         "Datacenter": "dc1", "TaggedAddresses": {"lan": "127.0.0.1", "wan": "127.0.0.1"}, "Meta": {}},
                "Service": s.def,
                "Checks": checks,
            })
        })
        .collect();
    json_reply(Some(g.index), &Value::Array(entries))
}

#[cfg(test)]
mod tests {
    use super::go_duration;
    use std::time::Duration;

    #[test]
    fn go_durations_parse() {
        assert_eq!(go_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(go_duration("1500ms"), Some(Duration::from_millis(1500)));
        assert_eq!(go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(go_duration("x"), None);
        assert_eq!(go_duration(""), None);
    }
}
