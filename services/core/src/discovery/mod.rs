//! Service discovery: register an instance, withdraw it on drain, list or
//! watch a service's live instances.
//!
//! Backends implement [`Discovery`]; a [`Locator`] (the `--discovery` URL)
//! names one:
//! - `file://DIR` — [`FileRegistry`], one machine: one JSON file per
//!   instance, kept alive by heartbeats;
//! - `consul://HOST:PORT` — [`Consul`], the local Consul agent's HTTP API:
//!   agent registration with a health check, blocking-query watches.
//!
//! Watchers ([`watch`]) keep the last view when the backend cannot be
//! reached, and say so in [`health`] (shown in `/health` and `/metrics`).

mod consul;
mod file;
mod pool;
mod status;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use consul::{Consul, ConsulConfig};
pub use file::FileRegistry;
pub use pool::{check_pool, pooled, pooled_kind, split_kind, META_MODEL};
pub use status::{health, DiscoveryHealth};

/// One running instance of a service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// Service kind, e.g. `tokenizer`, `decode` (Consul: `pdmesh-<kind>`).
    pub service: String,
    /// Unique among the service's instances.
    pub id: String,
    /// gRPC address, `host:port` (the gateway: its HTTP address).
    pub grpc_addr: String,
    /// HTTP address for /health, /metrics, /statusz, if the instance has one.
    pub http_addr: Option<String>,
    /// Free-form attributes (version, role, transport, ...).
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("registry {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("invalid name {0:?}: use letters, digits, '-', '_', '.' and '@'")]
    BadName(String),
    /// The Consul agent could not be reached or refused a call: the message
    /// names the agent, the call and the reason.
    #[error("{0}")]
    Consul(String),
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A service's live instances and the backend's index of that view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    /// Sorted by id.
    pub instances: Vec<Instance>,
    /// Consul's `X-Consul-Index`; 0 from backends without one.
    pub index: u64,
}

/// A discovery backend.
pub trait Discovery: Send + Sync {
    /// Announce `instance` until the returned registration is deregistered
    /// or dropped (dropping stops its heartbeat, if any; the backend then
    /// finds it dead).
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<Registration, DiscoveryError>>;
    /// `service`'s live instances. With `index` 0 the answer comes at once;
    /// otherwise a backend that can (Consul's blocking queries) waits until
    /// its view changes past `index`, or its wait time passes.
    fn changes(&self, service: &str, index: u64) -> BoxFuture<'_, Result<Listing, DiscoveryError>>;
    /// Where the registry is, for messages: `file:///tmp/...`, `consul://...`.
    fn describe(&self) -> String;
    /// Live instances of `service` now, sorted by id.
    fn healthy(&self, service: &str) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        let service = service.to_string();
        Box::pin(async move { self.changes(&service, 0).await.map(|l| l.instances) })
    }
}

/// How a backend withdraws one registration.
pub trait Withdraw: Send + Sync {
    /// Stop being picked while staying known (Consul: maintenance mode; the
    /// file backend removes the entry).
    fn drain(&self) -> BoxFuture<'_, Result<(), DiscoveryError>>;
    /// Remove the registration.
    fn remove(&self) -> BoxFuture<'_, Result<(), DiscoveryError>>;
}

/// A live registration. `drain` takes it out of routing, `deregister`
/// removes it; dropping it without either stops its heartbeat.
pub struct Registration {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    withdraw: Arc<dyn Withdraw>,
}

impl Registration {
    /// A registration whose heartbeat task ends when `stop` fires or drops.
    pub fn new(stop: tokio::sync::oneshot::Sender<()>, withdraw: Arc<dyn Withdraw>) -> Registration {
        Registration { stop: Some(stop), withdraw }
    }

    fn stop_heartbeat(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// Out of routing at once (watchers drop it on their next round), still
    /// registered: what a drain does first.
    pub async fn drain(&mut self) -> Result<(), DiscoveryError> {
        self.stop_heartbeat();
        self.withdraw.drain().await
    }

    /// Remove the registration (after a drain, or on shutdown).
    pub async fn deregister(mut self) -> Result<(), DiscoveryError> {
        self.stop_heartbeat();
        self.withdraw.remove().await
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop_heartbeat();
    }
}

/// The next index to send after a query that answered `got` (Consul's
/// blocking-query rules): back to 0 (a plain read) when it went backwards,
/// and never 0 after a read, which would make every query return at once.
fn next_index(sent: u64, got: u64) -> u64 {
    if got < sent {
        0
    } else {
        got.max(1)
    }
}

/// Longest pause between retries while the backend is unreachable.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Follow a service's live instances: the receiver sees a new value each
/// time the set changes. Queries are at least `every` apart (the file
/// backend is polled at that period; Consul's block until a change). While
/// the backend fails, the last view stays, [`health`] says so, and retries
/// back off up to 5 s. The task ends when the receiver is dropped.
pub fn watch(d: Arc<dyn Discovery>, service: &str, every: Duration) -> tokio::sync::watch::Receiver<Vec<Instance>> {
    let (tx, rx) = tokio::sync::watch::channel(Vec::new());
    let service = service.to_string();
    tokio::spawn(async move {
        let mut index = 0;
        let mut backoff = every;
        loop {
            let next = tokio::time::Instant::now() + every;
            let changed = tokio::select! {
                r = d.changes(&service, index) => Some(r),
                _ = tx.closed() => None,
            };
            match changed {
                None => return,
                Some(Ok(l)) => {
                    health().ok();
                    index = next_index(index, l.index);
                    backoff = every;
                    tx.send_if_modified(|cur| {
                        let changed = *cur != l.instances;
                        if changed {
                            *cur = l.instances;
                        }
                        changed
                    });
                    tokio::time::sleep_until(next).await;
                }
                Some(Err(e)) => {
                    health().failed(&format!("watching {service} at {}: {e}", d.describe()));
                    index = 0;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    });
    rx
}

/// Where instances register and find each other: the `--discovery` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Locator {
    /// `file://DIR`: the file registry in a folder all instances share.
    File(PathBuf),
    /// `consul://HOST:PORT` (or `consul://`: `CONSUL_HTTP_ADDR`, else
    /// 127.0.0.1:8500): the local Consul agent's HTTP API.
    Consul(String),
}

impl std::str::FromStr for Locator {
    type Err = String;

    fn from_str(s: &str) -> Result<Locator, String> {
        if let Some(dir) = s.strip_prefix("file://") {
            if dir.is_empty() {
                return Err("file:// needs a folder, e.g. file:///tmp/pdmesh/registry".into());
            }
            return Ok(Locator::File(PathBuf::from(dir)));
        }
        if let Some(addr) = s.strip_prefix("consul://") {
            let addr = addr.trim_end_matches('/');
            if !addr.is_empty() && !addr.contains(':') {
                return Err(format!("consul://{addr} needs a port, e.g. consul://{addr}:8500"));
            }
            return Ok(Locator::Consul(addr.to_string()));
        }
        Err(format!("unknown discovery URL {s:?}: use file://DIR or consul://HOST:PORT"))
    }
}

impl std::fmt::Display for Locator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Locator::File(d) => write!(f, "file://{}", d.display()),
            Locator::Consul(a) => write!(f, "consul://{a}"),
        }
    }
}

fn check_locator(s: &str) -> Result<String, String> {
    s.parse::<Locator>().map(|_| s.to_string())
}

/// The discovery flags of every service and of `meshctl`.
#[derive(clap::Args, Debug, Clone, Default, serde::Serialize)]
pub struct DiscoveryArgs {
    /// Where instances register and find each other: `file://DIR` (a
    /// folder all instances share) or `consul://HOST:PORT` (the local
    /// Consul agent; `consul://` alone reads CONSUL_HTTP_ADDR, else
    /// 127.0.0.1:8500; CONSUL_HTTP_TOKEN is sent as X-Consul-Token).
    /// Wins over --registry-dir.
    #[arg(long, env = "PDMESH_DISCOVERY", value_parser = check_locator)]
    pub discovery: Option<String>,
    /// Shorthand for `--discovery file://DIR`.
    #[arg(long, env = "PDMESH_REGISTRY_DIR")]
    pub registry_dir: Option<PathBuf>,
    /// File registry: seconds after which an entry without heartbeat counts as dead.
    #[arg(long, env = "PDMESH_REGISTRY_TTL_S", default_value_t = 10)]
    pub registry_ttl_s: u64,
    /// Consul: how often the agent checks each instance's /health (an
    /// instance without an HTTP address passes a TTL check this often).
    #[arg(long, env = "PDMESH_CONSUL_CHECK_INTERVAL_MS", default_value_t = 1000)]
    pub consul_check_interval_ms: u64,
    /// Consul: longest wait of one blocking query (Consul caps it at 600).
    #[arg(long, env = "PDMESH_CONSUL_WATCH_WAIT_S", default_value_t = 60)]
    pub consul_watch_wait_s: u64,
    /// Consul: seconds an instance may stay critical before the agent
    /// removes it (Consul's minimum is 60).
    #[arg(long, env = "PDMESH_CONSUL_DEREGISTER_AFTER_S", default_value_t = 60)]
    pub consul_deregister_after_s: u64,
}

impl DiscoveryArgs {
    /// The configured backend: `--discovery`, else `--registry-dir`, else none.
    pub fn locator(&self) -> Option<Locator> {
        match (&self.discovery, &self.registry_dir) {
            (Some(url), _) => url.parse().ok(),
            (None, Some(dir)) => Some(Locator::File(dir.clone())),
            (None, None) => None,
        }
    }

    /// The configured backend, else the file registry of a local mesh
    /// ([`default_registry_dir`]): what `meshctl` reads.
    pub fn locator_or_default(&self) -> Locator {
        self.locator().unwrap_or_else(|| Locator::File(default_registry_dir()))
    }

    /// The backend [`DiscoveryArgs::locator_or_default`] names, opened.
    pub fn open_or_default(&self) -> Result<Arc<dyn Discovery>, String> {
        self.open(&self.locator_or_default()).map_err(|e| e.to_string())
    }

    /// Open `locator` with these flags.
    pub fn open(&self, locator: &Locator) -> Result<Arc<dyn Discovery>, DiscoveryError> {
        Ok(match locator {
            Locator::File(dir) => Arc::new(FileRegistry::new(dir, Duration::from_secs(self.registry_ttl_s.max(1)))),
            Locator::Consul(addr) => Arc::new(Consul::new(ConsulConfig::from_env(
                addr,
                Duration::from_millis(self.consul_check_interval_ms.max(100)),
                Duration::from_secs(self.consul_watch_wait_s.clamp(1, 600)),
                Duration::from_secs(self.consul_deregister_after_s.max(60)),
            )?)?),
        })
    }

    /// The flags that hand this configuration to a child service.
    pub fn to_args(&self, locator: &Locator) -> Vec<String> {
        let mut v = vec!["--discovery".into(), locator.to_string()];
        v.extend(["--registry-ttl-s".into(), self.registry_ttl_s.to_string()]);
        v.extend(["--consul-check-interval-ms".into(), self.consul_check_interval_ms.to_string()]);
        v.extend(["--consul-watch-wait-s".into(), self.consul_watch_wait_s.to_string()]);
        v.extend(["--consul-deregister-after-s".into(), self.consul_deregister_after_s.to_string()]);
        v
    }
}

/// The registry folder `meshctl up` and the tools that read a local mesh
/// share unless told otherwise: `$TMPDIR/pdmesh/registry`.
pub fn default_registry_dir() -> PathBuf {
    std::env::temp_dir().join("pdmesh").join("registry")
}

/// `explicit`, else the gRPC address of the first live `service` instance.
pub async fn address_of(explicit: Option<&str>, service: &str, d: &dyn Discovery) -> Result<String, String> {
    if let Some(a) = explicit {
        return Ok(a.to_string());
    }
    let list = d.healthy(service).await.map_err(|e| e.to_string())?;
    list.first()
        .map(|i| i.grpc_addr.clone())
        .ok_or_else(|| format!("no live {service} in {} (is `meshctl up` running?)", d.describe()))
}

/// Service kinds and instance ids: they name files and URL paths. '@'
/// joins a kind and its model pool (`decode@gemma3-270m`).
pub(crate) fn check_name(s: &str) -> Result<(), DiscoveryError> {
    let ok =
        !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c)) && s != "." && s != "..";
    if ok {
        Ok(())
    } else {
        Err(DiscoveryError::BadName(s.to_string()))
    }
}

/// `host:port` split into host (brackets of an IPv6 literal removed) and port.
pub fn split_host_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    Some((host, port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_follow_the_blocking_query_rules() {
        assert_eq!(next_index(0, 0), 1, "never 0 after a read");
        assert_eq!(next_index(5, 9), 9);
        assert_eq!(next_index(9, 9), 9);
        assert_eq!(next_index(9, 4), 0, "backwards: reset");
    }

    #[test]
    fn locators_parse_and_bad_ones_say_why() {
        assert_eq!("file:///tmp/r".parse(), Ok(Locator::File("/tmp/r".into())));
        assert_eq!("consul://10.0.0.1:8500".parse(), Ok(Locator::Consul("10.0.0.1:8500".into())));
        assert_eq!("consul://".parse(), Ok(Locator::Consul(String::new())));
        assert_eq!(Locator::Consul("a:1".into()).to_string(), "consul://a:1");
        for (bad, says) in [("consul://host", "port"), ("zk://x", "file://DIR"), ("file://", "folder")] {
            let e = bad.parse::<Locator>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert_eq!(split_host_port("[::1]:80"), Some(("::1", 80)));
        assert_eq!(split_host_port("10.1.2.3:8080"), Some(("10.1.2.3", 8080)));
        assert_eq!(split_host_port("nope"), None);
    }
}
