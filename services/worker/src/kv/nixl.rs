//! NIXL (UCX backend) through `nixl-sys`: finding and loading the library,
//! the agent with this worker's KV arena registered once, one-sided WRITEs
//! of blocks into another worker's arena, and the progress poller.
//!
//! `nixl-sys` is built with `stub-api`: every NIXL call goes through a stub
//! that dlopens `libnixl_capi.so` on first use and *aborts the process* if
//! it is missing. So NIXL is only touched after [`load_library`] found and
//! loaded the real library (by full path, kept loaded, so the stub's own
//! dlopen by name finds it) and `nixl_sys::is_stub()` says it is real.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdmesh_engine::TransferArena;

use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle,
    ThreadSync, XferDescList, XferOp, XferStatus,
};

/// Where `libnixl_capi.so` is, if anywhere: `explicit`, else on the
/// loader's `LD_LIBRARY_PATH`, else in the `nixl-cu12` wheel of `python`.
pub fn find_library(explicit: Option<&Path>, python: &str) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Ok(dirs) = std::env::var("LD_LIBRARY_PATH") {
        for d in dirs.split(':').filter(|d| !d.is_empty()) {
            let p = Path::new(d).join("libnixl_capi.so");
            if p.exists() {
                return Some(p);
            }
        }
    }
    let out = std::process::Command::new(python)
        .args(["-c", "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|d| Path::new(d.trim()).join(".nixl_cu12.mesonpy.libs").join("libnixl_capi.so"))
        .find(|p| p.exists())
}

/// Load the real NIXL C API library (kept loaded for the process's life).
pub fn load_library(path: &Path) -> Result<(), String> {
    static LOADED: std::sync::OnceLock<Result<libloading::Library, String>> = std::sync::OnceLock::new();
    let r = LOADED.get_or_init(|| {
        // SAFETY: loading a shared library runs its initialisers; libnixl_capi
        // is the library nixl-sys is written against.
        let lib =
            unsafe { libloading::Library::new(path) }.map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        if nixl_sys::is_stub() {
            return Err(format!("{} loaded but nixl-sys still sees the stub", path.display()));
        }
        Ok(lib)
    });
    r.as_ref().map(|_| ()).map_err(Clone::clone)
}

/// The registered KV arena, as the engine gives it.
#[derive(Debug)]
struct Region(TransferArena);

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.addr as *const u8
    }
    fn size(&self) -> usize {
        self.0.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        mem_type(&self.0)
    }
    fn device_id(&self) -> u64 {
        self.0.gpu.unwrap_or(0)
    }
}

/// NIXL's memory type for an arena: VRAM of its GPU, or host DRAM.
fn mem_type(a: &TransferArena) -> MemType {
    if a.gpu.is_some() {
        MemType::Vram
    } else {
        MemType::Dram
    }
}

/// A remote agent loaded from its metadata.
struct Remote {
    md: Vec<u8>,
    name: String,
    /// Writes to it under way: it is not unloaded under them.
    in_flight: usize,
    /// A write to it failed: unload and load it afresh (a new connection)
    /// once the writes under way have ended.
    stale: bool,
}

/// A remote agent held for one write; released when dropped.
struct Held<'a> {
    nixl: &'a Nixl,
    worker: String,
    name: String,
    failed: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut m = self.nixl.remotes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = m.get_mut(&self.worker).filter(|r| r.name == self.name) {
            r.in_flight -= 1;
            r.stale |= self.failed;
        }
    }
}

/// A NIXL agent with this worker's KV arena registered.
pub struct Nixl {
    agent: Agent,
    _registration: RegistrationHandle,
    /// The registered arena: host memory, or a GPU's (VRAM).
    pub arena: TransferArena,
    /// Remote agents loaded from their metadata, by worker id.
    remotes: Mutex<HashMap<String, Remote>>,
}

impl Nixl {
    /// Create the agent (UCX backend, no progress thread: idle progress
    /// threads spin and take whole cores here; the receiving side polls
    /// instead, see [`Nixl::progress`]) and register the arena once.
    pub fn start(worker_id: &str, arena: TransferArena) -> Result<Nixl, String> {
        // Unique per process: a restarted worker keeps its worker id but is a
        // new NIXL peer (peers must not reuse the dead one's connection).
        let nonce =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let name = format!("{worker_id}.{}.{nonce:08x}", std::process::id());
        let name = name.as_str();
        let cfg = AgentConfig { enable_prog_thread: false, thread_sync: ThreadSync::Strict, ..Default::default() };
        let agent = Agent::new_configured(name, &cfg).map_err(|e| format!("NIXL agent: {e}"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| format!("NIXL UCX plugin: {e}"))?;
        agent.create_backend("UCX", &params).map_err(|e| format!("NIXL UCX backend: {e}"))?;
        let reg = agent.register_memory(&Region(arena), None).map_err(|e| {
            let at = arena.gpu.map(|g| format!(" in the VRAM of GPU {g}")).unwrap_or_default();
            format!("NIXL register KV arena{at}: {e}")
        })?;
        Ok(Nixl { agent, _registration: reg, arena, remotes: Mutex::default() })
    }

    /// This agent's metadata, for the kvbroker.
    pub fn metadata(&self) -> Result<Vec<u8>, String> {
        self.agent.get_local_md().map_err(|e| format!("NIXL metadata: {e}"))
    }

    /// The remote agent of `worker`, held for one write: loaded from `md`,
    /// or loaded again when `md` changed (a restarted worker) or an
    /// earlier write failed and no other write to it is under way. A
    /// failed write never unloads the agent under another thread's write.
    fn hold(&self, worker: &str, md: &[u8]) -> Result<Held<'_>, String> {
        let mut m = self.remotes.lock().unwrap_or_else(|e| e.into_inner());
        let reusable = m.get(worker).is_some_and(|r| r.md == md && !(r.stale && r.in_flight == 0));
        if !reusable {
            if let Some(old) = m.remove(worker) {
                let _ = self.agent.invalidate_remote_md(&old.name);
            }
            let name = self.agent.load_remote_md(md).map_err(|e| format!("NIXL load metadata of {worker}: {e}"))?;
            m.insert(worker.into(), Remote { md: md.to_vec(), name, in_flight: 0, stale: false });
        }
        let r = m.get_mut(worker).expect("just ensured");
        r.in_flight += 1;
        Ok(Held { nixl: self, worker: worker.into(), name: r.name.clone(), failed: false })
    }

    /// WRITE `pieces` (local arena offset, `remote` arena offset, length)
    /// of the local arena into the `remote` one. Either arena may be host
    /// memory or VRAM (UCX picks cuda_copy or cuda_ipc for the latter).
    /// Blocking: polls until done or `timeout`. Returns the bytes moved.
    pub fn write(
        &self,
        worker: &str,
        md: &[u8],
        remote: TransferArena,
        pieces: &[(usize, usize, usize)],
        note: &str,
        timeout: Duration,
    ) -> Result<u64, String> {
        let mut held = self.hold(worker, md)?;
        let r = self.post_and_wait(&held.name, pieces, remote, note, timeout);
        held.failed = r.is_err();
        r
    }

    fn post_and_wait(
        &self,
        peer: &str,
        pieces: &[(usize, usize, usize)],
        remote: TransferArena,
        note: &str,
        timeout: Duration,
    ) -> Result<u64, String> {
        let here = self.arena;
        let mut local = XferDescList::new(mem_type(&here)).map_err(|e| e.to_string())?;
        let mut far = XferDescList::new(mem_type(&remote)).map_err(|e| e.to_string())?;
        for &(so, doff, len) in pieces {
            if so + len > here.len || doff + len > remote.len {
                return Err(format!("bytes {so}+{len} -> {doff}+{len} lie outside an arena"));
            }
            local.add_desc(here.addr + so, len, here.gpu.unwrap_or(0));
            far.add_desc(remote.addr + doff, len, remote.gpu.unwrap_or(0));
        }
        let mut opt = OptArgs::new().map_err(|e| e.to_string())?;
        opt.set_notification_message(note.as_bytes()).map_err(|e| e.to_string())?;
        opt.set_has_notification(true).map_err(|e| e.to_string())?;
        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &local, &far, peer, Some(&opt))
            .map_err(|e| format!("NIXL transfer request: {e}"))?;
        let t0 = Instant::now();
        let mut in_progress = self.agent.post_xfer_req(&req, Some(&opt)).map_err(|e| format!("NIXL post: {e}"))?;
        while in_progress {
            if t0.elapsed() > timeout {
                return Err(format!("NIXL transfer still running after {timeout:?}"));
            }
            in_progress =
                self.agent.get_xfer_status(&req).map_err(|e| format!("NIXL transfer: {e}"))? == XferStatus::InProgress;
            if in_progress {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(pieces.iter().map(|p| p.2 as u64).sum())
    }

    /// Drive this agent's backend progress and drain its notifications (the
    /// receiving side calls this while it expects transfers): the messages
    /// of the writes that landed (each write's note is its request id).
    pub fn progress(&self, map: &mut NotificationMap) -> Vec<String> {
        if self.agent.get_notifications(map, None).is_err() {
            return Vec::new();
        }
        map.take_notifs().map(|m| m.into_values().flatten().collect()).unwrap_or_default()
    }
}

/// Poll `nixl`'s progress on a thread, every 1 ms while `busy()` says
/// transfers are expected, else every 10 ms, until `stop` is set; each
/// landed write's note goes to `landed`. Idle polls matter too: a write for
/// a request cancelled meanwhile still lands, and its notification must be
/// taken off the connection, or the writer's next transfers wait behind it.
pub fn spawn_progress(
    nixl: std::sync::Arc<Nixl>,
    busy: impl Fn() -> bool + Send + 'static,
    landed: impl Fn(&str) + Send + 'static,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    std::thread::Builder::new()
        .name("nixl-progress".into())
        .spawn(move || {
            let Ok(mut map) = NotificationMap::new() else { return };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for note in nixl.progress(&mut map) {
                    landed(&note);
                }
                std::thread::sleep(if busy() { Duration::from_micros(200) } else { Duration::from_millis(10) });
            }
        })
        .expect("spawn nixl progress thread");
}
