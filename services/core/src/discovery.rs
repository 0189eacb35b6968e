//! Service discovery: register an instance (kept alive by heartbeats),
//! deregister it on drain, list or watch a service's live instances.
//!
//! Backends implement [`Discovery`]. [`FileRegistry`] is the single-machine
//! backend used by `meshctl up`: one JSON file per instance under
//! `<dir>/<service>/<id>.json`, rewritten every `ttl / 3`; an entry whose
//! heartbeat is older than `ttl` counts as dead (its process crashed or
//! hangs) and is not listed. Files are written to a temporary name and
//! renamed, so readers never see half an entry.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One running instance of a service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// Service name, e.g. `tokenizer`, `decode`.
    pub service: String,
    /// Unique among the service's instances.
    pub id: String,
    /// gRPC address, `host:port`.
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
    #[error("invalid name {0:?}: use letters, digits, '-', '_' and '.'")]
    BadName(String),
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A discovery backend.
pub trait Discovery: Send + Sync {
    /// Announce `instance` until the returned registration is deregistered
    /// or dropped (dropping stops the heartbeat; the entry then expires).
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<Registration, DiscoveryError>>;
    /// Live instances of `service`, sorted by id.
    fn healthy(&self, service: &str) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>>;
}

/// A live registration. `deregister` removes the entry at once (drain);
/// dropping without it stops the heartbeat, and the entry expires.
pub struct Registration {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    remove: Option<Box<dyn FnOnce() -> Result<(), DiscoveryError> + Send>>,
}

impl Registration {
    pub fn deregister(mut self) -> Result<(), DiscoveryError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.remove.take() {
            Some(f) => f(),
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Follow a service's live instances: the receiver sees a new value each
/// time the set changes, polling every `every`. The task ends when the
/// receiver is dropped.
pub fn watch(d: Arc<dyn Discovery>, service: &str, every: Duration) -> tokio::sync::watch::Receiver<Vec<Instance>> {
    let (tx, rx) = tokio::sync::watch::channel(Vec::new());
    let service = service.to_string();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            if let Ok(list) = d.healthy(&service).await {
                tx.send_if_modified(|cur| {
                    let changed = *cur != list;
                    if changed {
                        *cur = list;
                    }
                    changed
                });
            }
            if tx.is_closed() {
                return;
            }
        }
    });
    rx
}

#[derive(Serialize, Deserialize)]
struct Entry {
    instance: Instance,
    heartbeat_unix_ms: u64,
}

/// The file backend (see the module docs).
#[derive(Clone, Debug)]
pub struct FileRegistry {
    dir: PathBuf,
    ttl: Duration,
}

fn check_name(s: &str) -> Result<(), DiscoveryError> {
    let ok =
        !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) && s != "." && s != "..";
    if ok {
        Ok(())
    } else {
        Err(DiscoveryError::BadName(s.to_string()))
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DiscoveryError + '_ {
    move |source| DiscoveryError::Io { path: path.to_path_buf(), source }
}

impl FileRegistry {
    /// A registry rooted at `dir` (created if missing); entries older than `ttl` are dead.
    pub fn new(dir: impl Into<PathBuf>, ttl: Duration) -> FileRegistry {
        FileRegistry { dir: dir.into(), ttl }
    }

    fn entry_path(&self, service: &str, id: &str) -> PathBuf {
        self.dir.join(service).join(format!("{id}.json"))
    }

    fn write_entry(path: &Path, instance: &Instance) -> Result<(), DiscoveryError> {
        let entry = Entry { instance: instance.clone(), heartbeat_unix_ms: crate::now_ms() };
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec(&entry).expect("entry serialises")).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    }

    fn list(&self, service: &str) -> Result<Vec<Instance>, DiscoveryError> {
        check_name(service)?;
        let dir = self.dir.join(service);
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&dir)(e)),
        };
        let cutoff = crate::now_ms().saturating_sub(self.ttl.as_millis() as u64);
        let mut out: Vec<Instance> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            // A file vanishing or being replaced mid-read is normal: skip it.
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<Entry>(&b).ok())
            .filter(|e| e.heartbeat_unix_ms >= cutoff)
            .map(|e| e.instance)
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }
}

impl Discovery for FileRegistry {
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            check_name(&instance.service)?;
            check_name(&instance.id)?;
            let path = self.entry_path(&instance.service, &instance.id);
            let parent = path.parent().expect("entry has a parent").to_path_buf();
            std::fs::create_dir_all(&parent).map_err(io(&parent))?;
            Self::write_entry(&path, &instance)?;
            let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
            let every = (self.ttl / 3).max(Duration::from_millis(10));
            let beat_path = path.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        _ = tick.tick() => {
                            // A failed heartbeat is retried on the next tick; if the
                            // registry stays unwritable the entry expires, which is
                            // the truth: nobody can see this instance.
                            let _ = Self::write_entry(&beat_path, &instance);
                        }
                    }
                }
            });
            let remove = Box::new(move || match std::fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io(&path)(e)),
            });
            Ok(Registration { stop: Some(stop), remove: Some(remove) })
        })
    }

    fn healthy(&self, service: &str) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        let service = service.to_string();
        Box::pin(async move { self.list(&service) })
    }
}

/// The registry folder `meshctl up` and the tools that read a local mesh
/// share unless told otherwise: `$TMPDIR/pdmesh/registry`.
pub fn default_registry_dir() -> PathBuf {
    std::env::temp_dir().join("pdmesh").join("registry")
}

/// `explicit`, else the gRPC address of the first live `service` instance
/// in the registry folder.
pub async fn address_of(explicit: Option<&str>, service: &str, registry_dir: &Path) -> Result<String, String> {
    if let Some(a) = explicit {
        return Ok(a.to_string());
    }
    let reg = FileRegistry::new(registry_dir, std::time::Duration::from_secs(10));
    let list = reg.healthy(service).await.map_err(|e| e.to_string())?;
    list.first()
        .map(|i| i.grpc_addr.clone())
        .ok_or_else(|| format!("no live {service} in {} (is `meshctl up` running?)", registry_dir.display()))
}
