//! One process of the mesh under `meshctl up`: how it is started (nice,
//! CPU pinning, the gateway's socket, death with its parent, new ports when
//! one was taken), waited on, restarted (with backoff, up to a crash-loop
//! limit) and stopped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// The file descriptor a child inherits its listening socket as.
pub const INHERITED_FD: i32 = 3;
/// An exit this soon after a start is a step of a crash loop.
pub const QUICK_EXIT: Duration = Duration::from_secs(10);
/// First restart delay of a crash loop; it doubles per step, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The delay before restart number `step` of a crash loop (1-based).
pub fn backoff(step: u32) -> Duration {
    FIRST_BACKOFF.saturating_mul(1 << step.saturating_sub(1).min(16)).min(MAX_BACKOFF)
}

/// What the supervisor does about a child that exited.
#[derive(Debug, PartialEq, Eq)]
pub enum AfterExit {
    /// It was draining: forget it.
    Forget,
    /// Start it again at this time.
    RestartAt(Instant),
    /// Leave it down; the reason is in `gave_up`.
    GiveUp,
}

pub struct Svc {
    /// Service kind (`decode`) and its index (`decode-1` is index 1).
    pub kind: String,
    pub index: usize,
    /// Asked to drain (`meshctl drain`, scale-down, rolling restart): not
    /// restarted when it exits, and then forgotten.
    pub draining: bool,
    pub name: String,
    pub bin: PathBuf,
    pub args: Vec<String>,
    pub http: String,
    pub log: PathBuf,
    pub child: Option<Child>,
    pub restarts: u32,
    /// When the running child started.
    pub started: Option<Instant>,
    /// Exits in a row that each came soon after a start (a crash loop).
    pub quick_exits: u32,
    /// A restart waiting out its backoff.
    pub restart_at: Option<Instant>,
    /// Why meshctl stopped restarting it (crash loop, `--no-restart`).
    pub gave_up: Option<String>,
    /// How the last child ended.
    pub last_exit: Option<String>,
    /// Whether meshctl picked the gRPC port (not the gateway's --gateway-addr).
    pub own_listen: bool,
    /// The process's nice value (prefill workers: `--prefill-nice`).
    pub nice: i32,
    /// A listening socket the process inherits as [`INHERITED_FD`] (the gateway's).
    pub pass_fd: Option<i32>,
    /// CPUs the process may run on (`--prefill-cpus`, `--decode-cpus`); empty: any.
    pub cpus: Vec<usize>,
}

/// Write every service's /metrics address as a Prometheus file_sd list.
pub fn write_prometheus_sd(f: &Path, svcs: &[Svc]) -> Result<(), String> {
    let targets: Vec<serde_json::Value> = svcs
        .iter()
        .map(|s| {
            let (service, pool) = pdmesh_core::discovery::split_kind(&s.kind);
            let mut labels = serde_json::json!({ "service": format!("pdmesh-{service}"), "instance_id": s.name });
            if let Some(p) = pool {
                labels["model"] = serde_json::json!(p);
            }
            serde_json::json!({ "targets": [s.http], "labels": labels })
        })
        .collect();
    let tmp = f.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&targets).unwrap_or_default())
        .and_then(|_| std::fs::rename(&tmp, f))
        .map_err(|e| format!("cannot write --prometheus-sd {}: {e}", f.display()))
}

/// A free local address, never one this process handed out before: the
/// kernel may give a port back as soon as its probe closed, and two
/// services planned on one port would both look healthy through the one
/// that bound it (CI once saw a router planned on its kvbroker's port).
pub fn free_addr() -> Result<String, String> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    for _ in 0..64 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
        let a = l.local_addr().map_err(|e| e.to_string())?;
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&a.port()) {
            given.push(a.port());
            return Ok(a.to_string());
        }
    }
    Err("no free port not handed out already".into())
}

fn log_tail(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl Svc {
    /// Instance `index` of `kind`, not started: `bin` with `args`, its
    /// admin endpoint at `http`, its output appended to `log`; any CPU,
    /// nice 0, no inherited socket.
    pub fn new(kind: &str, index: usize, bin: PathBuf, args: Vec<String>, http: String, log: PathBuf) -> Svc {
        Svc {
            kind: kind.to_string(),
            index,
            draining: false,
            name: format!("{kind}-{index}"),
            bin,
            args,
            http,
            log,
            child: None,
            restarts: 0,
            started: None,
            quick_exits: 0,
            restart_at: None,
            gave_up: None,
            last_exit: None,
            own_listen: kind != "gateway",
            nice: 0,
            pass_fd: None,
            cpus: Vec::new(),
        }
    }

    /// The ports meshctl picks are free when picked, but another process
    /// may take one before the service binds it: then it gets new ones.
    pub fn port_was_taken(&self) -> bool {
        log_tail(&self.log).lines().last().is_some_and(|l| l.contains("Address already in use"))
    }

    pub fn new_ports(&mut self) -> Result<(), String> {
        for i in 0..self.args.len().saturating_sub(1) {
            match self.args[i].as_str() {
                "--listen" if self.own_listen => self.args[i + 1] = free_addr()?,
                "--http-listen" => {
                    self.http = free_addr()?;
                    self.args[i + 1] = self.http.clone();
                }
                _ => {}
            }
        }
        eprintln!("meshctl: {}: a port was taken meanwhile; retrying on new ports (http {})", self.name, self.http);
        Ok(())
    }

    /// Book an exit (`status`) and decide what follows: forget a drained
    /// one, restart after a backoff that doubles along a crash loop, or
    /// give up once `max_quick` exits in a row each came within
    /// [`QUICK_EXIT`] of a start (or when restarts are off).
    pub fn exited(&mut self, status: &str, restart: bool, max_quick: u32) -> AfterExit {
        self.child = None;
        self.last_exit = Some(status.to_string());
        if self.draining {
            return AfterExit::Forget;
        }
        if !restart {
            self.gave_up = Some("--no-restart".into());
            return AfterExit::GiveUp;
        }
        let quick = self.started.is_some_and(|t| t.elapsed() < QUICK_EXIT);
        self.quick_exits = if quick { self.quick_exits + 1 } else { 1 };
        if self.quick_exits > max_quick {
            self.gave_up = Some(format!(
                "crash loop: {} exits in a row, each within {} s of its start; last: {status}",
                self.quick_exits,
                QUICK_EXIT.as_secs()
            ));
            return AfterExit::GiveUp;
        }
        let at = Instant::now() + backoff(self.quick_exits);
        self.restart_at = Some(at);
        AfterExit::RestartAt(at)
    }

    /// The supervisor's view of this process, for `meshctl status`.
    pub fn state(&self) -> serde_json::Value {
        let state = match (&self.child, &self.gave_up, self.restart_at, self.draining) {
            (_, _, _, true) => "draining".to_string(),
            (Some(_), _, _, _) => "running".to_string(),
            (None, Some(why), _, _) => format!("down: {why}"),
            (None, None, Some(t), _) => {
                format!("restarting in {:.1} s", t.saturating_duration_since(Instant::now()).as_secs_f64())
            }
            (None, None, None, _) => "down".to_string(),
        };
        serde_json::json!({
            "name": self.name, "kind": self.kind, "http_addr": self.http, "state": state,
            "pid": self.child.as_ref().and_then(Child::id), "restarts": self.restarts,
            "crash_loop": self.quick_exits, "last_exit": self.last_exit,
        })
    }

    pub fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args).stdout(log).stderr(err).stdin(std::process::Stdio::null()).kill_on_drop(true);
        die_with_parent(&mut cmd);
        if self.nice != 0 || !self.cpus.is_empty() {
            with_priority(&mut cmd, self.nice, &self.cpus);
        }
        if let Some(fd) = self.pass_fd {
            with_socket(&mut cmd, fd);
        }
        let child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        self.started = Some(Instant::now());
        Ok(())
    }

    /// Wait for /health 200 from this process itself (its /statusz pid):
    /// a port another process holds answers for that one, which would
    /// count a service that could not bind it as healthy. An exit or the
    /// timeout is an error with the log's tail.
    pub async fn wait_healthy(&mut self, timeout: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(format!(
                        "{} exited ({st}) before becoming healthy; last lines of {}:\n{}",
                        self.name,
                        self.log.display(),
                        log_tail(&self.log)
                    ));
                }
            }
            if matches!(self.admin_get("/health").await, Some((200, _))) && self.answers_itself().await {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                return Err(format!(
                    "{} not healthy after {} s; last lines of {}:\n{}",
                    self.name,
                    timeout.as_secs(),
                    self.log.display(),
                    log_tail(&self.log)
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the process answering on this service's http address is
    /// its own child (the pid in /statusz).
    async fn answers_itself(&self) -> bool {
        let Some(pid) = self.child.as_ref().and_then(Child::id) else { return false };
        let got = self.admin_get("/statusz").await;
        let answered = got.and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok());
        answered.is_some_and(|v| v["pid"].as_u64() == Some(u64::from(pid)))
    }

    /// `GET path` on this service's admin endpoint (2 s bound); None if
    /// nothing answered.
    async fn admin_get(&self, path: &'static str) -> Option<(u16, String)> {
        let h = self.http.clone();
        tokio::task::spawn_blocking(move || pdmesh_core::http::get(&h, path, Duration::from_secs(2))).await.ok()?.ok()
    }

    /// SIGTERM: the service drains and exits.
    pub fn terminate(&self) {
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }

    /// Wait up to `grace` for a terminated service to exit, then SIGKILL it.
    pub async fn reap(&mut self, grace: Duration) {
        let Some(mut c) = self.child.take() else { return };
        if tokio::time::timeout(grace, c.wait()).await.is_err() {
            eprintln!("meshctl: {} did not exit within {} s of SIGTERM; killing it", self.name, grace.as_secs());
            let _ = c.kill().await;
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        self.terminate();
        self.reap(grace).await;
    }
}

/// The child gets SIGTERM (and drains) when meshctl dies, even by SIGKILL.
/// Linux ties this to the thread that forked: meshctl spawns from its
/// runtime's worker threads, which live as long as meshctl.
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: getpid(2) here; prctl(2) and getppid(2) are plain system
    // calls run in the forked child before exec.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and makes only the async-signal-safe prctl(2) and getppid(2) calls.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // meshctl died between fork and prctl: do not outlive it.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("meshctl exited while starting this service"));
            }
            Ok(())
        });
    }
}

/// Nice value and CPU pinning of the child.
fn with_priority(cmd: &mut Command, nice: i32, cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within it
    // (the CPUs were checked against CPU_SETSIZE).
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in cpus {
            libc::CPU_SET(*c, &mut set);
        }
        set
    };
    let pin = !cpus.is_empty();
    // SAFETY: setpriority(2) and sched_setaffinity(2) are plain system calls;
    // they run in the forked child before exec and touch no shared state.
    unsafe {
        cmd.pre_exec(move || {
            if nice != 0 && libc::setpriority(libc::PRIO_PROCESS, 0, nice) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if pin && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The child inherits the listening socket `fd` as [`INHERITED_FD`].
fn with_socket(cmd: &mut Command, fd: i32) {
    // SAFETY: dup2(2) and fcntl(2) are plain system calls run in the forked
    // child before exec; dup2 gives a copy without close-on-exec (fcntl
    // clears it when the socket is already there).
    unsafe {
        cmd.pre_exec(move || {
            let r = if fd == INHERITED_FD { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, INHERITED_FD) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An admin endpoint answering /health 200 and /statusz with the pid
    /// in `pid`; its address.
    async fn admin_answering_as(pid: std::sync::Arc<std::sync::atomic::AtomicU32>) -> String {
        use axum::routing::get;
        let statusz = move || {
            let pid = pid.load(std::sync::atomic::Ordering::Relaxed);
            async move { serde_json::json!({ "pid": pid }).to_string() }
        };
        let app = axum::Router::new().route("/health", get(|| async { "ok" })).route("/statusz", get(statusz));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(l, app).await });
        addr
    }

    /// CI once planned two services on one port: the second could not bind
    /// it and exited, and the first's /health counted it healthy. With the
    /// gateway so lost, clients waited in meshctl's socket for their own
    /// timeout (issue 29's 300 s wait).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_counts_only_when_the_process_itself_answers() {
        let pid = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(std::process::id()));
        let http = admin_answering_as(pid.clone()).await;
        let log = std::env::temp_dir().join(format!("meshctl-health-{}.log", std::process::id()));
        // A process that never serves: another one answers on its port.
        let mut s = Svc::new("router", 0, "sleep".into(), vec!["30".into()], http, log.clone());
        s.spawn().unwrap();
        let e = s.wait_healthy(Duration::from_millis(600)).await.unwrap_err();
        assert!(e.contains("router-0 not healthy"), "{e}");
        let own = s.child.as_ref().and_then(Child::id).unwrap();
        pid.store(own, std::sync::atomic::Ordering::Relaxed);
        s.wait_healthy(Duration::from_secs(5)).await.expect("its own pid answers: healthy");
        let _ = s.child.as_mut().unwrap().kill().await;
        let _ = std::fs::remove_file(log);
    }

    #[test]
    fn crash_loops_back_off_and_give_up() {
        assert_eq!(backoff(1), Duration::from_millis(250));
        assert_eq!(backoff(3), Duration::from_secs(1));
        assert_eq!(backoff(40), MAX_BACKOFF);
    }
}
