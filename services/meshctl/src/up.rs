//! `meshctl up`: the whole mesh on this machine, supervised.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pdmesh_core::discovery::Locator;
use tokio::process::{Child, Command};

#[derive(clap::Args)]
pub struct Args {
    /// Where the OpenAI-compatible gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub gateway_addr: String,
    /// GGUF model file. Default: the cached SmolLM2 model, fetched now if missing.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Where the services register and find each other (passed to each;
    /// default: the file registry in $TMPDIR/pdmesh/registry).
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Folder for the services' logs (default: `logs` beside the file
    /// registry's folder, or $TMPDIR/pdmesh/logs with Consul).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Folder holding the service binaries (default: meshctl's own folder).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Seconds each service may take to become healthy.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_s: u64,
    /// Kernel threads of each prefill and decode worker (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Nice value (0-19) of the prefill workers: with a higher one, the
    /// host's scheduler runs decode steps first when both want the cores.
    /// 10 against 0, long unique prompts at 4 and 16 clients (A/B): 1.30x
    /// and 1.43x output tok/s, the same TTFT p50, inter-token p99 a fifth.
    #[arg(long, default_value_t = 10)]
    pub prefill_nice: i32,
    /// CPUs the prefill workers run on, e.g. `0` or `0-3,6` (default: any).
    /// With `--threads 0`, a pinned worker gets one kernel thread per CPU.
    #[arg(long)]
    pub prefill_cpus: Option<String>,
    /// CPUs the decode workers run on (default: any).
    #[arg(long)]
    pub decode_cpus: Option<String>,
    /// KV blocks of the decode worker (each holds 16 positions of all layers).
    #[arg(long, default_value_t = 2048)]
    pub decode_kv_blocks: usize,
    /// Most sequences in one decode step.
    #[arg(long, default_value_t = 32)]
    pub decode_max_batch: usize,
    /// KV blocks of the prefill worker.
    #[arg(long, default_value_t = 512)]
    pub prefill_kv_blocks: usize,
    /// Step budget of each prefill worker: most prompt tokens one forward step feeds.
    #[arg(long, default_value_t = 2048)]
    pub prefill_batch_tokens: usize,
    /// Prefix cache of each prefill worker: most blocks kept for reuse (0 = off).
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache_blocks: usize,
    /// How the router picks a prefill worker: cache-aware or least-busy.
    #[arg(long, default_value = "cache-aware")]
    pub router_policy: String,
    /// Prefix cache of each decode worker (finished sequences, answers
    /// included, reused by local prefills): most blocks kept (0 = off).
    #[arg(long, default_value_t = 1024)]
    pub decode_prefix_cache_blocks: usize,
    /// Whether decode workers' prefix caches keep answers (generated
    /// tokens' KV; close to, not the same bits as, a cold prefill's).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub decode_prefix_cache_generated: bool,
    /// Most prompt tokens of local prefills one decode step feeds.
    #[arg(long, default_value_t = 64)]
    pub decode_local_step_tokens: usize,
    /// Local prefill: the decode worker prefills a prompt itself when it
    /// lacks at most this many of its tokens (0 = always a prefill worker).
    #[arg(long, default_value_t = 256)]
    pub max_local_prefill: u32,
    /// KV transport of prefill and decode workers: auto (NIXL when it loads), nixl, tcp.
    #[arg(long, default_value = "auto")]
    pub kv_transport: String,
    /// Lease of a decode worker's transfer tickets, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub decode_lease_ms: u32,
    /// Start every service with `--enable-fault-injection` (tests only).
    #[arg(long)]
    pub enable_fault_injection: bool,
    /// Prefill workers to run.
    #[arg(long, default_value_t = 1)]
    pub prefill_replicas: usize,
    /// Decode workers to run.
    #[arg(long, default_value_t = 1)]
    pub decode_replicas: usize,
    /// How each service drains on SIGTERM (passed to every service).
    #[command(flatten)]
    pub drain: pdmesh_core::drain::DrainArgs,
    /// Do not restart a service that exits on its own.
    #[arg(long)]
    pub no_restart: bool,
    /// Write a Prometheus file_sd target list of every service's /metrics
    /// address to this file once the mesh is up (see infra/prometheus.yml).
    #[arg(long)]
    pub prometheus_sd: Option<PathBuf>,
    /// Tracing flags, passed to every service.
    #[command(flatten)]
    pub telemetry: pdmesh_core::telemetry::TelemetryArgs,
    /// Which engine steps of prefill and decode carry kernel-launch spans: off, all, or the first N steps of each request.
    #[arg(long, env = "PDMESH_TRACE_KERNEL_STEPS", default_value = "off")]
    pub trace_kernel_steps: String,
}

struct Svc {
    name: String,
    bin: PathBuf,
    args: Vec<String>,
    http: String,
    log: PathBuf,
    child: Option<Child>,
    restarts: u32,
    /// Whether meshctl picked the gRPC port (not the gateway's --gateway-addr).
    own_listen: bool,
    /// The process's nice value (prefill workers: `--prefill-nice`).
    nice: i32,
    /// CPUs the process may run on (`--prefill-cpus`, `--decode-cpus`); empty: any.
    cpus: Vec<usize>,
}

/// Write every service's /metrics address as a Prometheus file_sd list.
fn write_prometheus_sd(f: &Path, svcs: &[Svc]) -> Result<(), String> {
    let targets: Vec<serde_json::Value> = svcs
        .iter()
        .map(|s| {
            let service = s.name.rsplit_once('-').map_or(s.name.as_str(), |(n, _)| n);
            serde_json::json!({ "targets": [s.http], "labels": { "service": format!("pdmesh-{service}"), "instance_id": s.name } })
        })
        .collect();
    let tmp = f.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&targets).unwrap_or_default())
        .and_then(|_| std::fs::rename(&tmp, f))
        .map_err(|e| format!("cannot write --prometheus-sd {}: {e}", f.display()))
}

fn free_addr() -> Result<String, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.to_string())
}

fn log_tail(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl Svc {
    /// The ports meshctl picks are free when picked, but another process
    /// may take one before the service binds it: then it gets new ones.
    fn port_was_taken(&self) -> bool {
        log_tail(&self.log).lines().last().is_some_and(|l| l.contains("Address already in use"))
    }

    fn new_ports(&mut self) -> Result<(), String> {
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

    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args).stdout(log).stderr(err).stdin(std::process::Stdio::null()).kill_on_drop(true);
        if self.nice != 0 || !self.cpus.is_empty() {
            let nice = self.nice;
            // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes
            // within it (the CPUs were checked against CPU_SETSIZE).
            let set = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for c in &self.cpus {
                    libc::CPU_SET(*c, &mut set);
                }
                set
            };
            let pin = !self.cpus.is_empty();
            // SAFETY: setpriority(2) and sched_setaffinity(2) are plain
            // system calls; they run in the forked child before exec and
            // touch no shared state.
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
        let child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Wait for /health 200; an exit or the timeout is an error with the log's tail.
    async fn wait_healthy(&mut self, timeout: Duration) -> Result<(), String> {
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
            let h = self.http.clone();
            let ok = tokio::task::spawn_blocking(move || pdmesh_core::http::get(&h, "/health", Duration::from_secs(2)))
                .await
                .ok()
                .and_then(Result::ok);
            if matches!(ok, Some((200, _))) {
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

    /// SIGTERM: the service drains and exits.
    fn terminate(&self) {
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }

    /// Wait up to `grace` for a terminated service to exit, then SIGKILL it.
    async fn reap(&mut self, grace: Duration) {
        let Some(mut c) = self.child.take() else { return };
        if tokio::time::timeout(grace, c.wait()).await.is_err() {
            eprintln!("meshctl: {} did not exit within {} s of SIGTERM; killing it", self.name, grace.as_secs());
            let _ = c.kill().await;
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    async fn stop(&mut self, grace: Duration) {
        self.terminate();
        self.reap(grace).await;
    }
}

fn bin_dir(a: &Args) -> Result<PathBuf, String> {
    match &a.bin_dir {
        Some(d) => Ok(d.clone()),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| "no folder for meshctl".to_string()),
    }
}

/// The registry and log folders, refusing a registry a live mesh uses.
async fn folders(a: &Args, locator: &Locator) -> Result<PathBuf, String> {
    let reg = a.discovery.open(locator).map_err(|e| e.to_string())?;
    if let Some(g) = reg.healthy("gateway").await.map_err(|e| e.to_string())?.first() {
        return Err(format!(
            "a mesh is already running in {} (gateway at {}); stop it or give another --discovery",
            reg.describe(),
            g.grpc_addr
        ));
    }
    let default_logs = match locator {
        Locator::File(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            dir.parent().unwrap_or(Path::new(".")).join("logs")
        }
        Locator::Consul(_) => std::env::temp_dir().join("pdmesh").join("logs"),
    };
    let log_dir = a.log_dir.clone().unwrap_or(default_logs);
    std::fs::create_dir_all(&log_dir).map_err(|e| format!("{}: {e}", log_dir.display()))?;
    Ok(log_dir)
}

async fn model_path(a: &Args) -> Result<String, String> {
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            eprintln!("meshctl: making sure the model is in the cache (first run downloads it)");
            let cache = a.cache.clone();
            tokio::task::spawn_blocking(move || cache.ensure_model())
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?
        }
    };
    Ok(model.display().to_string())
}

/// The flags every service of the mesh gets.
fn common_args(a: &Args, locator: &Locator, id: &str, listen: String, http: &str) -> Vec<String> {
    let mut args = vec!["--listen".into(), listen, "--http-listen".into(), http.to_string()];
    args.extend(a.discovery.to_args(locator));
    args.extend(["--instance-id".into(), id.to_string()]);
    args.extend(["--drain-timeout-s".into(), a.drain.drain_timeout_s.to_string()]);
    args.extend(["--drain-notice-ms".into(), a.drain.drain_notice_ms.to_string()]);
    if a.enable_fault_injection {
        args.push("--enable-fault-injection".into());
    }
    if let Some(e) = &a.telemetry.otlp_endpoint {
        args.extend(["--otlp-endpoint".into(), e.clone()]);
    }
    args.extend([
        "--trace-sample-ratio".into(),
        a.telemetry.trace_sample_ratio.to_string(),
        "--trace-export-delay-ms".into(),
        a.telemetry.trace_export_delay_ms.to_string(),
    ]);
    args
}

/// The flags only `name` gets.
fn service_args(a: &Args, name: &str, model: &str) -> Vec<String> {
    match name {
        "tokenizer" => vec!["--model".into(), model.to_string()],
        "prefill" | "decode" => {
            let (blocks, batch) =
                if name == "decode" { (a.decode_kv_blocks, a.decode_max_batch) } else { (a.prefill_kv_blocks, 32) };
            let mut args = vec![
                "--model".into(),
                model.to_string(),
                "--threads".into(),
                a.threads.to_string(),
                "--kv-blocks".into(),
                blocks.to_string(),
                "--max-batch".into(),
                batch.to_string(),
                "--kv-transport".into(),
                a.kv_transport.clone(),
                "--trace-kernel-steps".into(),
                a.trace_kernel_steps.clone(),
            ];
            if name == "decode" {
                args.extend(["--lease-ms".into(), a.decode_lease_ms.to_string()]);
                args.extend(["--prefix-cache-blocks".into(), a.decode_prefix_cache_blocks.to_string()]);
                args.extend(["--prefix-cache-generated".into(), a.decode_prefix_cache_generated.to_string()]);
                args.extend(["--local-step-tokens".into(), a.decode_local_step_tokens.to_string()]);
            } else {
                args.extend(["--prefix-cache-blocks".into(), a.prefix_cache_blocks.to_string()]);
                args.extend(["--batch-tokens".into(), a.prefill_batch_tokens.to_string()]);
            }
            args
        }
        "router" => vec![
            "--policy".into(),
            a.router_policy.clone(),
            "--max-local-prefill".into(),
            a.max_local_prefill.to_string(),
        ],
        _ => vec![],
    }
}

/// A CPU list such as `0-3,6` (None or empty: no pinning).
fn cpu_list(flag: &str, list: Option<&str>) -> Result<Vec<usize>, String> {
    let Some(list) = list.filter(|l| !l.trim().is_empty()) else { return Ok(Vec::new()) };
    let bad = || format!("{flag} takes CPU numbers and ranges such as 0-3,6; got {list:?}");
    let mut cpus = Vec::new();
    for part in list.split(',') {
        let (lo, hi) = match part.trim().split_once('-') {
            Some((a, b)) => {
                (a.trim().parse::<usize>().map_err(|_| bad())?, b.trim().parse::<usize>().map_err(|_| bad())?)
            }
            None => {
                let c = part.trim().parse::<usize>().map_err(|_| bad())?;
                (c, c)
            }
        };
        if lo > hi || hi >= libc::CPU_SETSIZE as usize {
            return Err(bad());
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Every process of the mesh, in start order.
fn plan(a: &Args, locator: &Locator, bin_dir: &Path, log_dir: &Path, model: &str) -> Result<Vec<Svc>, String> {
    if !(0..=19).contains(&a.prefill_nice) {
        return Err(format!("--prefill-nice must be 0..=19, got {}", a.prefill_nice));
    }
    let prefill_cpus = cpu_list("--prefill-cpus", a.prefill_cpus.as_deref())?;
    let decode_cpus = cpu_list("--decode-cpus", a.decode_cpus.as_deref())?;
    let mut svcs = Vec::new();
    for name in crate::status::SERVICES {
        let replicas = match name {
            "prefill" => a.prefill_replicas,
            "decode" => a.decode_replicas,
            _ => 1,
        };
        if replicas == 0 || replicas > 64 {
            return Err(format!("--{name}-replicas must be 1..=64"));
        }
        for r in 0..replicas {
            let id = format!("{name}-{r}");
            let listen = if name == "gateway" { a.gateway_addr.clone() } else { free_addr()? };
            let http = free_addr()?;
            let mut args = common_args(a, locator, &id, listen, &http);
            args.extend(service_args(a, name, model));
            let cpus = match name {
                "prefill" => prefill_cpus.clone(),
                "decode" => decode_cpus.clone(),
                _ => Vec::new(),
            };
            // Pinned workers with no --threads get one kernel thread per CPU of theirs.
            if a.threads == 0 && !cpus.is_empty() {
                if let Some(i) = args.iter().position(|x| x == "--threads") {
                    args[i + 1] = cpus.len().to_string();
                }
            }
            svcs.push(Svc {
                name: id.clone(),
                bin: bin_dir.join(format!("pdmesh-{name}")),
                args,
                http,
                log: log_dir.join(format!("{id}.log")),
                child: None,
                restarts: 0,
                own_listen: name != "gateway",
                nice: if name == "prefill" { a.prefill_nice } else { 0 },
                cpus,
            });
        }
    }
    Ok(svcs)
}

/// Stop the mesh: the gateway drains first (its requests finish while
/// everything behind it still serves), then the rest drain together (with
/// no new requests coming in, each waits only for its own in-flight work).
async fn stop_all(svcs: &mut [Svc], grace: Duration) {
    for s in svcs.iter_mut().filter(|s| s.name.starts_with("gateway")) {
        s.stop(grace).await;
    }
    for s in svcs.iter() {
        s.terminate();
    }
    for s in svcs.iter_mut() {
        s.reap(grace).await;
    }
}

/// Start in order, each gated on the previous one's health; a service
/// whose port was taken before it bound gets new ports (up to 4 tries).
async fn start_all(
    svcs: &mut [Svc],
    timeout: Duration,
    stop: &mut (impl std::future::Future<Output = ()> + Unpin),
) -> Result<(), String> {
    for s in svcs.iter_mut() {
        let mut tries = 0;
        loop {
            s.spawn()?;
            let r = tokio::select! {
                r = s.wait_healthy(timeout) => r,
                _ = &mut *stop => Err("interrupted".into()),
            };
            tries += 1;
            if r.is_err() && tries < 4 && s.port_was_taken() {
                s.new_ports()?;
                continue;
            }
            r?;
            break;
        }
        eprintln!("meshctl: {:<9} healthy (http {}, log {})", s.name, s.http, s.log.display());
    }
    Ok(())
}

/// Restart each service that exited (unless `--no-restart`); whether the
/// Prometheus target list needs rewriting (a service got new ports).
fn restart_exited(a: &Args, svcs: &mut [Svc]) -> bool {
    let mut moved = false;
    for s in svcs.iter_mut() {
        let Some(st) = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) else { continue };
        s.child = None;
        if a.no_restart {
            eprintln!("meshctl: {} exited ({st}); not restarting (--no-restart)", s.name);
            continue;
        }
        s.restarts += 1;
        eprintln!("meshctl: {} exited ({st}); restarting it alone (restart {})", s.name, s.restarts);
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
    moved
}

pub async fn run(a: Args) -> Result<(), String> {
    let bin_dir = bin_dir(&a)?;
    let locator = a.discovery.locator_or_default();
    let log_dir = folders(&a, &locator).await?;
    let model = model_path(&a).await?;
    let mut svcs = plan(&a, &locator, &bin_dir, &log_dir, &model)?;
    let mut stop = Box::pin(pdmesh_core::signal::shutdown_signal());
    let started = start_all(&mut svcs, Duration::from_secs(a.ready_timeout_s), &mut stop).await;
    let started = started.and_then(|_| a.prometheus_sd.as_ref().map_or(Ok(()), |f| write_prometheus_sd(f, &svcs)));
    if let Err(e) = started {
        stop_all(&mut svcs, Duration::from_secs(5)).await;
        return Err(e);
    }
    if let Some(f) = &a.prometheus_sd {
        eprintln!("meshctl: Prometheus targets in {}", f.display());
    }
    println!("pdmesh is up: http://{}/v1 (discovery {locator}); Ctrl-C stops it", a.gateway_addr);
    // Supervise until a signal.
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        if restart_exited(&a, &mut svcs) {
            if let Some(Err(e)) = a.prometheus_sd.as_ref().map(|f| write_prometheus_sd(f, &svcs)) {
                eprintln!("meshctl: {e}");
            }
        }
    }
    eprintln!("meshctl: stopping (gateway first)");
    stop_all(&mut svcs, a.drain.grace()).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cpu_list;

    #[test]
    fn cpu_lists_parse_and_bad_ones_say_why() {
        assert_eq!(cpu_list("--x", None), Ok(vec![]));
        assert_eq!(cpu_list("--x", Some("1")), Ok(vec![1]));
        assert_eq!(cpu_list("--x", Some("0-2, 6,1")), Ok(vec![0, 1, 2, 6]));
        for bad in ["a", "3-1", "1-", "99999"] {
            let e = cpu_list("--decode-cpus", Some(bad)).unwrap_err();
            assert!(e.contains("--decode-cpus") && e.contains(bad), "{e}");
        }
    }
}
