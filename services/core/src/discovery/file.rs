//! The single-machine backend: one JSON file per instance under
//! `<dir>/<service>/<id>.json`, rewritten every `ttl / 3`; an entry whose
//! heartbeat is older than `ttl` counts as dead (its process crashed or
//! hangs) and is not listed. Files are written to a temporary name and
//! renamed, so readers never see half an entry.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{check_name, health, BoxFuture, Discovery, DiscoveryError, Instance, Listing, Registration, Withdraw};

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

/// Removing the entry file both drains and deregisters. The flag, set
/// under its lock before the file goes, is what the heartbeat checks under
/// the same lock before each write: a beat already past its `select!` when
/// a drain begins would otherwise write the entry back after the removal,
/// listing a draining instance as healthy again for a whole TTL.
struct EntryFile {
    path: PathBuf,
    withdrawn: Arc<std::sync::Mutex<bool>>,
}

impl EntryFile {
    fn remove_now(&self) -> Result<(), DiscoveryError> {
        let mut withdrawn = self.withdrawn.lock().unwrap_or_else(|e| e.into_inner());
        *withdrawn = true;
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&self.path)(e)),
        }
    }
}

impl Withdraw for EntryFile {
    fn drain(&self) -> BoxFuture<'_, Result<(), DiscoveryError>> {
        Box::pin(async move { self.remove_now() })
    }

    fn remove(&self) -> BoxFuture<'_, Result<(), DiscoveryError>> {
        Box::pin(async move { self.remove_now() })
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
            let withdrawn = Arc::new(std::sync::Mutex::new(false));
            let entry = EntryFile { path, withdrawn: withdrawn.clone() };
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
                            let gone = withdrawn.lock().unwrap_or_else(|e| e.into_inner());
                            if *gone {
                                return;
                            }
                            match Self::write_entry(&beat_path, &instance) {
                                Ok(()) => health().ok(),
                                Err(e) => health().failed(&format!("heartbeat: {e}")),
                            }
                        }
                    }
                }
            });
            Ok(Registration::new(stop, Arc::new(entry)))
        })
    }

    fn changes(&self, service: &str, _index: u64) -> BoxFuture<'_, Result<Listing, DiscoveryError>> {
        let service = service.to_string();
        Box::pin(async move { self.list(&service).map(|instances| Listing { instances, index: 0 }) })
    }

    fn describe(&self) -> String {
        format!("file://{}", self.dir.display())
    }
}
