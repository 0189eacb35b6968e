//! The Consul backend: the local agent's HTTP API, spoken by a small
//! client of our own (hyper, already in the build).
//!
//! Why not the `rs-consul` crate: it registers through the catalog (no
//! agent health checks, no TTL, no maintenance mode), drops `Meta` and
//! `Checks` from health results and caps queries at 5 s, which breaks
//! blocking queries. The calls used here are few and documented:
//!
//! - `PUT /v1/agent/service/register`: `ID` = instance id, `Name` =
//!   `pdmesh-<kind>`, `Address`/`Port` = the gRPC address (the gateway's
//!   HTTP address), `Meta` = the instance's meta plus `http_addr`. One
//!   check, id `service:<id>`: an HTTP check of `/health` when the instance
//!   has an HTTP address (so the agent itself sees a dead or hung
//!   instance), else a TTL check the instance passes; both with
//!   `DeregisterCriticalServiceAfter`. It starts `passing`: an instance
//!   registers only once its own /health says ready.
//! - `PUT /v1/agent/check/pass/service:<id>`: the TTL heartbeat.
//! - `GET /v1/agent/service/<id>`: is the registration still there (an
//!   agent that lost it, e.g. restarted without its data folder, gets it
//!   again)?
//! - `PUT /v1/agent/service/maintenance/<id>?enable=true`: drain (out of
//!   `?passing` answers at once, still registered).
//! - `PUT /v1/agent/service/deregister/<id>`: shutdown.
//! - `GET /v1/health/service/pdmesh-<kind>?passing&index=N&wait=Ws`: the
//!   blocking-query watch. The HTTP timeout is wait + wait/16 + 5 s, since
//!   Consul adds up to wait/16 of jitter.
//!
//! `CONSUL_HTTP_TOKEN` (or the file named by `CONSUL_HTTP_TOKEN_FILE`) is
//! sent as `X-Consul-Token`; it is never logged or shown in /statusz.
//! `CONSUL_HTTP_SSL=true` (or an `https://` address) talks TLS to the agent,
//! trusting `CONSUL_CACERT` / `CONSUL_CAPATH` (else the system's roots),
//! with `CONSUL_CLIENT_CERT` and `CONSUL_CLIENT_KEY` for agents that verify
//! clients and `CONSUL_TLS_SERVER_NAME` to verify another name.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde::Deserialize;
use serde_json::json;

use super::{
    check_name, health, split_host_port, BoxFuture, Discovery, DiscoveryError, Instance, Listing, Registration,
    Withdraw,
};

/// Timeout of the agent calls that do not block.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The heartbeat checks that the agent still has the registration every this many beats.
const VERIFY_EVERY: u32 = 5;

/// How to reach the agent and how to register.
#[derive(Clone, Debug)]
pub struct ConsulConfig {
    /// `host:port` of the agent's HTTP API.
    pub addr: String,
    /// ACL token (`X-Consul-Token`).
    pub token: Option<String>,
    /// The health check's interval (a TTL check's TTL is three of them).
    pub check_interval: Duration,
    /// Longest wait of one blocking query.
    pub wait: Duration,
    /// `DeregisterCriticalServiceAfter`.
    pub deregister_after: Duration,
    /// TLS to the agent (`https`); `None`: plain HTTP.
    pub tls: Option<crate::tls::ClientTls>,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

impl ConsulConfig {
    /// `addr` (empty: `CONSUL_HTTP_ADDR`, else 127.0.0.1:8500) with the
    /// token from `CONSUL_HTTP_TOKEN` or `CONSUL_HTTP_TOKEN_FILE`.
    pub fn from_env(
        addr: &str,
        check_interval: Duration,
        wait: Duration,
        deregister_after: Duration,
    ) -> Result<ConsulConfig, DiscoveryError> {
        let raw =
            if addr.is_empty() { env("CONSUL_HTTP_ADDR").unwrap_or("127.0.0.1:8500".into()) } else { addr.into() };
        let ssl_env = env("CONSUL_HTTP_SSL").is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true"));
        let (ssl, hostport) = match raw.split_once("://") {
            Some(("https", r)) => (true, r.to_string()),
            Some(("http", r)) => (ssl_env, r.to_string()),
            Some((scheme, _)) => {
                return Err(DiscoveryError::Consul(format!(
                    "Consul agent address {raw:?}: the {scheme}:// scheme is not supported; give HOST:PORT"
                )))
            }
            None => (ssl_env, raw.clone()),
        };
        let tls = if ssl { Some(tls_from_env()?) } else { None };
        let hostport = hostport.trim_end_matches('/').to_string();
        if split_host_port(&hostport).is_none() {
            return Err(DiscoveryError::Consul(format!("Consul agent address {raw:?}: give HOST:PORT")));
        }
        let token = match env("CONSUL_HTTP_TOKEN") {
            Some(t) => Some(t),
            None => match env("CONSUL_HTTP_TOKEN_FILE") {
                Some(f) => Some(
                    std::fs::read_to_string(&f)
                        .map_err(|e| DiscoveryError::Consul(format!("CONSUL_HTTP_TOKEN_FILE {f}: {e}")))?
                        .trim()
                        .to_string(),
                ),
                None => None,
            },
        };
        Ok(ConsulConfig { addr: hostport, token, check_interval, wait, deregister_after, tls })
    }
}

/// TLS to the agent from Consul's own variables.
fn tls_from_env() -> Result<crate::tls::ClientTls, DiscoveryError> {
    if env("CONSUL_HTTP_SSL_VERIFY").is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "0" | "false")) {
        return Err(DiscoveryError::Consul(
            "CONSUL_HTTP_SSL_VERIFY=false is not supported: give the agent's CA in CONSUL_CACERT".into(),
        ));
    }
    Ok(crate::tls::ClientTls {
        ca_file: env("CONSUL_CACERT").map(Into::into),
        ca_dir: env("CONSUL_CAPATH").map(Into::into),
        client_cert: env("CONSUL_CLIENT_CERT").map(Into::into),
        client_key: env("CONSUL_CLIENT_KEY").map(Into::into),
        server_name: env("CONSUL_TLS_SERVER_NAME"),
    })
}

/// A Consul agent (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct Consul {
    cfg: Arc<ConsulConfig>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

/// One answer of the agent.
struct Reply {
    status: u16,
    index: Option<u64>,
    body: Bytes,
}

/// An error with its causes, `outer: inner: root` (hyper's client error
/// says only "client error (Connect)"; the cause is what an operator needs).
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !out.contains(&s) {
            out = format!("{out}: {s}");
        }
        cur = c.source();
    }
    out
}

/// A Go duration, as Consul reads them.
fn go_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

/// The Consul service name of a pdmesh service kind.
pub fn service_name(kind: &str) -> String {
    format!("pdmesh-{kind}")
}

impl Consul {
    /// A client of the agent `cfg` names; an error when its TLS files are unusable.
    pub fn new(cfg: ConsulConfig) -> Result<Consul, DiscoveryError> {
        let tls = cfg.tls.clone().unwrap_or_default();
        let config = if cfg.tls.is_some() {
            tls.config().map_err(|e| DiscoveryError::Consul(format!("TLS to the Consul agent: {e}")))?
        } else {
            // Plain HTTP: the connector never uses it.
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| DiscoveryError::Consul(e.to_string()))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        };
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http();
        let builder = match &tls.server_name {
            Some(n) => {
                let name = rustls::pki_types::ServerName::try_from(n.clone())
                    .map_err(|e| DiscoveryError::Consul(format!("CONSUL_TLS_SERVER_NAME {n:?}: {e}")))?;
                builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
            }
            None => builder,
        };
        let connector = builder.enable_http1().build();
        let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        Ok(Consul { cfg: Arc::new(cfg), client })
    }

    fn scheme(&self) -> &'static str {
        if self.cfg.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// One call; an unreachable agent or a timeout is an error, any HTTP status is a reply.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<Reply, DiscoveryError> {
        let what = || format!("Consul agent {}: {method} {path}", self.cfg.addr);
        let uri = format!("{}://{}{path}", self.scheme(), self.cfg.addr);
        let mut req = Request::builder().method(method.clone()).uri(uri);
        if let Some(t) = &self.cfg.token {
            req = req.header("X-Consul-Token", t);
        }
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = req
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| DiscoveryError::Consul(format!("{}: {e}", what())))?;
        let exchange = async {
            let resp = self.client.request(req).await.map_err(|e| causes(&e))?;
            let status = resp.status().as_u16();
            let index = resp.headers().get("X-Consul-Index").and_then(|v| v.to_str().ok()?.parse().ok());
            let body = resp.into_body().collect().await.map_err(|e| format!("{e}"))?.to_bytes();
            Ok::<_, String>(Reply { status, index, body })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(DiscoveryError::Consul(format!("{}: {e}", what()))),
            Err(_) => Err(DiscoveryError::Consul(format!("{}: no answer in {} s", what(), timeout.as_secs()))),
        }
    }

    /// A call that must answer 2xx.
    async fn call_ok(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<Reply, DiscoveryError> {
        let r = self.call(method.clone(), path, body, timeout).await?;
        if (200..300).contains(&r.status) {
            return Ok(r);
        }
        let text = String::from_utf8_lossy(&r.body);
        let hint = if r.status == 403 { " (check CONSUL_HTTP_TOKEN)" } else { "" };
        Err(DiscoveryError::Consul(format!(
            "Consul agent {}: {method} {path}: HTTP {}{hint}: {}",
            self.cfg.addr,
            r.status,
            text.trim().chars().take(200).collect::<String>()
        )))
    }

    /// The agent registration of `inst` (see the module docs).
    fn registration(&self, inst: &Instance) -> Result<serde_json::Value, DiscoveryError> {
        let (host, port) = split_host_port(&inst.grpc_addr)
            .ok_or_else(|| DiscoveryError::Consul(format!("address {:?} is not HOST:PORT", inst.grpc_addr)))?;
        let mut meta = inst.meta.clone();
        let deregister = go_duration(self.cfg.deregister_after);
        let check = match &inst.http_addr {
            Some(h) => {
                meta.insert("http_addr".into(), h.clone());
                json!({
                    "Name": "pdmesh /health",
                    "HTTP": format!("http://{h}/health"),
                    "Interval": go_duration(self.cfg.check_interval),
                    "Timeout": go_duration(self.cfg.check_interval.clamp(Duration::from_millis(500), Duration::from_secs(5))),
                    "Status": "passing",
                    "DeregisterCriticalServiceAfter": deregister,
                })
            }
            None => json!({
                "Name": "pdmesh heartbeat",
                "TTL": go_duration(self.cfg.check_interval * 3),
                "Status": "passing",
                "DeregisterCriticalServiceAfter": deregister,
            }),
        };
        Ok(json!({
            "ID": inst.id,
            "Name": service_name(&inst.service),
            "Tags": ["pdmesh", inst.service],
            "Address": host,
            "Port": port,
            "Meta": meta,
            "Check": check,
        }))
    }

    async fn put_registration(&self, body: &serde_json::Value) -> Result<(), DiscoveryError> {
        self.call_ok(Method::PUT, "/v1/agent/service/register", Some(body.clone()), CALL_TIMEOUT).await.map(drop)
    }

    /// One heartbeat: pass the TTL check (if it is one); every
    /// [`VERIFY_EVERY`] beats, register again if the agent lost the entry.
    async fn beat(&self, id: &str, ttl: bool, verify: bool, body: &serde_json::Value) -> Result<(), DiscoveryError> {
        let mut verify = verify;
        if ttl {
            let r = self.call(Method::PUT, &format!("/v1/agent/check/pass/service:{id}"), None, CALL_TIMEOUT).await?;
            // An unknown check: find out whether the registration is gone.
            verify |= !(200..300).contains(&r.status);
        }
        if verify {
            let r = self.call(Method::GET, &format!("/v1/agent/service/{id}"), None, CALL_TIMEOUT).await?;
            if r.status == 404 {
                eprintln!("consul: the agent lost the registration of {id} (restarted?); registering again");
                self.put_registration(body).await?;
            }
        }
        Ok(())
    }
}

/// How a registration withdraws: drain = maintenance mode, remove = deregister.
struct AgentEntry {
    consul: Consul,
    id: String,
}

impl Withdraw for AgentEntry {
    fn drain(&self) -> BoxFuture<'_, Result<(), DiscoveryError>> {
        Box::pin(async move {
            let path = format!("/v1/agent/service/maintenance/{}?enable=true&reason=pdmesh%20drain", self.id);
            self.consul.call_ok(Method::PUT, &path, None, CALL_TIMEOUT).await.map(drop)
        })
    }

    fn remove(&self) -> BoxFuture<'_, Result<(), DiscoveryError>> {
        Box::pin(async move {
            let path = format!("/v1/agent/service/deregister/{}", self.id);
            self.consul.call_ok(Method::PUT, &path, None, CALL_TIMEOUT).await.map(drop)
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HealthEntry {
    node: HealthNode,
    service: HealthService,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HealthNode {
    #[serde(default)]
    address: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HealthService {
    #[serde(rename = "ID")]
    id: String,
    #[serde(default)]
    address: String,
    port: u16,
    #[serde(default)]
    meta: Option<BTreeMap<String, String>>,
}

/// `GET /v1/health/service/...` entries as instances of `kind`, sorted by id.
fn instances(kind: &str, body: &[u8]) -> Result<Vec<Instance>, String> {
    let entries: Vec<HealthEntry> = serde_json::from_slice(body).map_err(|e| format!("unexpected answer: {e}"))?;
    let mut out: Vec<Instance> = entries
        .into_iter()
        .map(|e| {
            let host = if e.service.address.is_empty() { e.node.address } else { e.service.address };
            let mut meta = e.service.meta.unwrap_or_default();
            let http_addr = meta.remove("http_addr");
            let grpc_addr = if host.contains(':') {
                format!("[{host}]:{}", e.service.port)
            } else {
                format!("{host}:{}", e.service.port)
            };
            Instance { service: kind.into(), id: e.service.id, grpc_addr, http_addr, meta }
        })
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

impl Discovery for Consul {
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            check_name(&instance.service)?;
            check_name(&instance.id)?;
            let body = self.registration(&instance)?;
            self.put_registration(&body).await?;
            let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
            let ttl = instance.http_addr.is_none();
            let (me, id, every) = (self.clone(), instance.id.clone(), self.cfg.check_interval);
            tokio::spawn(async move {
                let mut n = 0u32;
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                    n += 1;
                    match me.beat(&id, ttl, n.is_multiple_of(VERIFY_EVERY), &body).await {
                        Ok(()) => health().ok(),
                        Err(e) => health().failed(&format!("heartbeat of {id}: {e}")),
                    }
                }
            });
            Ok(Registration::new(stop, Arc::new(AgentEntry { consul: self.clone(), id: instance.id })))
        })
    }

    fn changes(&self, service: &str, index: u64) -> BoxFuture<'_, Result<Listing, DiscoveryError>> {
        let service = service.to_string();
        Box::pin(async move {
            check_name(&service)?;
            let name = service_name(&service);
            let (path, timeout) = if index == 0 {
                (format!("/v1/health/service/{name}?passing"), CALL_TIMEOUT)
            } else {
                let w = self.cfg.wait;
                (
                    format!("/v1/health/service/{name}?passing&index={index}&wait={}s", w.as_secs()),
                    w + w / 16 + CALL_TIMEOUT / 2,
                )
            };
            let r = self.call_ok(Method::GET, &path, None, timeout).await?;
            let instances = instances(&service, &r.body)
                .map_err(|e| DiscoveryError::Consul(format!("Consul agent {}: GET {path}: {e}", self.cfg.addr)))?;
            Ok(Listing { instances, index: r.index.unwrap_or(0) })
        })
    }

    fn describe(&self) -> String {
        match self.cfg.tls {
            Some(_) => format!("consul://{} (https)", self.cfg.addr),
            None => format!("consul://{}", self.cfg.addr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_entries_become_instances() {
        // The shape of HashiCorp's documented sample answer, trimmed.
        let body = br#"[
          {"Node": {"ID": "40e4a748", "Node": "foobar", "Address": "10.1.10.12", "Datacenter": "dc1"},
           "Service": {"ID": "decode-1", "Service": "pdmesh-decode", "Tags": [], "Address": "", "Port": 7001, "Meta": null},
           "Checks": []},
          {"Node": {"Node": "foobar", "Address": "10.1.10.12"},
           "Service": {"ID": "decode-0", "Service": "pdmesh-decode", "Tags": ["pdmesh"], "Address": "10.0.0.5", "Port": 7000,
                       "Meta": {"http_addr": "10.0.0.5:9000", "version": "0.1.0"}},
           "Checks": [{"CheckID": "service:decode-0", "Status": "passing"}]}
        ]"#;
        let got = instances("decode", body).unwrap();
        assert_eq!(got[0].id, "decode-0");
        assert_eq!(got[0].grpc_addr, "10.0.0.5:7000");
        assert_eq!(got[0].http_addr.as_deref(), Some("10.0.0.5:9000"));
        assert_eq!(got[0].meta.get("version").map(String::as_str), Some("0.1.0"));
        assert_eq!(got[1].grpc_addr, "10.1.10.12:7001", "an empty service address falls back to the node's");
        assert_eq!(got[1].http_addr, None);
        assert!(instances("decode", b"{}").is_err(), "not a list");
    }

    #[test]
    fn agent_addresses_follow_the_consul_conventions() {
        let d = Duration::from_secs(1);
        assert_eq!(ConsulConfig::from_env("10.0.0.1:8500", d, d, d).unwrap().addr, "10.0.0.1:8500");
        assert_eq!(ConsulConfig::from_env("http://h:1/", d, d, d).unwrap().addr, "h:1");
        assert!(ConsulConfig::from_env("https://h:8501", d, d, d).unwrap().tls.is_some(), "https:// means TLS");
        assert!(ConsulConfig::from_env("http://h:8500", d, d, d).unwrap().tls.is_none());
        let e = ConsulConfig::from_env("unix:///x", d, d, d).unwrap_err().to_string();
        assert!(e.contains("unix://"), "{e}");
    }
}
