//! `meshctl up`: the whole mesh on this machine, supervised.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pdmesh_core::discovery::Locator;

use crate::process::{free_addr, write_prometheus_sd, AfterExit, Svc};

#[derive(clap::Args)]
pub struct Args {
    /// Where the OpenAI-compatible gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub gateway_addr: String,
    /// API keys file passed to the gateway (see `pdmesh-gateway
    /// --api-keys-file`; per-key limits go on each key's line). Without
    /// it, the gateway asks for no key.
    #[arg(long)]
    pub api_keys_file: Option<PathBuf>,
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
    /// Mutual TLS between the services: make a development CA and a
    /// certificate per instance (identity `<kind>/<id>`), and start every
    /// service with them. Clients of the mesh's gRPC (`meshctl generate`,
    /// tests) use `client.pem` from the TLS folder. The gateway's OpenAI
    /// port and the admin HTTP endpoints stay plain HTTP.
    #[arg(long)]
    pub tls: bool,
    /// Folder for `--tls`'s CA and certificates (default: `tls` beside the log folder).
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
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
    /// KV blocks of the decode worker (each holds 16 positions of all
    /// layers; default: the worker's, 2048 on a CPU, 16384 on a GPU).
    #[arg(long)]
    pub decode_kv_blocks: Option<usize>,
    /// Most sequences in one decode step (default: the worker's, 32 on a
    /// CPU, 64 on a GPU).
    #[arg(long)]
    pub decode_max_batch: Option<usize>,
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
    /// Crash-loop limit: after this many exits in a row, each within 10 s
    /// of its start, a service is left down (`meshctl status` says why).
    /// Restarts wait 0.25 s, doubling along a crash loop up to 30 s.
    #[arg(long, default_value_t = 10)]
    pub max_quick_restarts: u32,
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
            // Decode sizes left unset are the worker's own, by its backend.
            let (blocks, batch) = match name {
                "decode" => (a.decode_kv_blocks, a.decode_max_batch),
                _ => (Some(a.prefill_kv_blocks), Some(32)),
            };
            let sizes = [("--kv-blocks", blocks), ("--max-batch", batch)];
            let mut args: Vec<String> =
                sizes.iter().filter_map(|(f, v)| v.map(|v| [f.to_string(), v.to_string()])).flatten().collect();
            args.extend([
                "--model".into(),
                model.to_string(),
                "--threads".into(),
                a.threads.to_string(),
                "--kv-transport".into(),
                a.kv_transport.clone(),
                "--trace-kernel-steps".into(),
                a.trace_kernel_steps.clone(),
            ]);
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
        // The socket meshctl holds (see `Ctx::gateway_socket`).
        "gateway" => {
            let mut args = vec!["--listen-fd".into(), crate::process::INHERITED_FD.to_string()];
            if let Some(f) = &a.api_keys_file {
                args.extend(["--api-keys-file".into(), f.display().to_string()]);
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

/// Everything a process of the mesh is started from.
pub struct Ctx {
    pub a: Args,
    pub locator: Locator,
    bin_dir: PathBuf,
    log_dir: PathBuf,
    model: String,
    prefill_cpus: Vec<usize>,
    decode_cpus: Vec<usize>,
    /// The gateway's listening socket: meshctl binds it once and hands it to
    /// every gateway process, so during a restart the new one accepts from
    /// the same queue the old one stops taking from (no refused or reset
    /// connections), and while none runs, clients wait in the queue.
    gateway_socket: std::net::TcpListener,
    /// `--tls`: the development CA that signs each instance's certificate.
    tls: Option<crate::devca::DevCa>,
}

impl Ctx {
    /// Instance `index` of `kind`, not started yet.
    pub fn svc(&self, kind: &str, index: usize) -> Result<Svc, String> {
        let a = &self.a;
        let id = format!("{kind}-{index}");
        let listen = if kind == "gateway" { a.gateway_addr.clone() } else { free_addr()? };
        let http = free_addr()?;
        let mut args = common_args(a, &self.locator, &id, listen, &http);
        args.extend(service_args(a, kind, &self.model));
        if let Some(ca) = &self.tls {
            args.extend(ca.issue(&format!("{kind}/{id}"), &id)?.args());
        }
        let cpus = match kind {
            "prefill" => self.prefill_cpus.clone(),
            "decode" => self.decode_cpus.clone(),
            _ => Vec::new(),
        };
        // Pinned workers with no --threads get one kernel thread per CPU of theirs.
        if a.threads == 0 && !cpus.is_empty() {
            if let Some(i) = args.iter().position(|x| x == "--threads") {
                args[i + 1] = cpus.len().to_string();
            }
        }
        Ok(Svc {
            kind: kind.to_string(),
            index,
            draining: false,
            name: id.clone(),
            bin: self.bin_dir.join(format!("pdmesh-{kind}")),
            args,
            http,
            log: self.log_dir.join(format!("{id}.log")),
            child: None,
            restarts: 0,
            started: None,
            quick_exits: 0,
            restart_at: None,
            gave_up: None,
            last_exit: None,
            own_listen: kind != "gateway",
            pass_fd: (kind == "gateway").then(|| std::os::fd::AsRawFd::as_raw_fd(&self.gateway_socket)),
            nice: if kind == "prefill" { a.prefill_nice } else { 0 },
            cpus,
        })
    }

    /// Every process of the mesh, in start order.
    fn plan(&self) -> Result<Vec<Svc>, String> {
        let mut svcs = Vec::new();
        for kind in crate::status::SERVICES {
            let replicas = match kind {
                "prefill" => self.a.prefill_replicas,
                "decode" => self.a.decode_replicas,
                _ => 1,
            };
            if replicas == 0 || replicas > crate::control::MAX_REPLICAS {
                return Err(format!("--{kind}-replicas must be 1..={}", crate::control::MAX_REPLICAS));
            }
            for r in 0..replicas {
                svcs.push(self.svc(kind, r)?);
            }
        }
        Ok(svcs)
    }

    /// Write the Prometheus target list, if asked for.
    pub fn write_targets(&self, svcs: &[Svc]) {
        if let Some(Err(e)) = self.a.prometheus_sd.as_ref().map(|f| write_prometheus_sd(f, svcs)) {
            eprintln!("meshctl: {e}");
        }
    }
}

async fn context(mut a: Args) -> Result<Ctx, String> {
    if let Some(f) = &a.api_keys_file {
        // The gateway runs elsewhere in time (restarts): give it an absolute path.
        let abs = std::fs::canonicalize(f).map_err(|e| format!("cannot read --api-keys-file {}: {e}", f.display()))?;
        a.api_keys_file = Some(abs);
    }
    if !(0..=19).contains(&a.prefill_nice) {
        return Err(format!("--prefill-nice must be 0..=19, got {}", a.prefill_nice));
    }
    let prefill_cpus = cpu_list("--prefill-cpus", a.prefill_cpus.as_deref())?;
    let decode_cpus = cpu_list("--decode-cpus", a.decode_cpus.as_deref())?;
    let bin_dir = bin_dir(&a)?;
    let locator = a.discovery.locator_or_default();
    let log_dir = folders(&a, &locator).await?;
    let gateway_socket = std::net::TcpListener::bind(&a.gateway_addr)
        .map_err(|e| format!("cannot listen on --gateway-addr {}: {e}", a.gateway_addr))?;
    let model = model_path(&a).await?;
    let tls = match a.tls {
        true => {
            let dir = a.tls_dir.clone().unwrap_or_else(|| log_dir.parent().unwrap_or(Path::new(".")).join("tls"));
            let ca = crate::devca::DevCa::create(&dir)?;
            eprintln!(
                "meshctl: mutual TLS between services (development CA in {0}); gRPC clients: \
                 PDMESH_TLS_CA={0}/ca.pem PDMESH_TLS_CERT={0}/client.pem PDMESH_TLS_KEY={0}/client.key",
                dir.display()
            );
            Some(ca)
        }
        false => None,
    };
    Ok(Ctx { a, locator, bin_dir, log_dir, model, prefill_cpus, decode_cpus, gateway_socket, tls })
}

/// Stop the mesh: the gateway drains first (its requests finish while
/// everything behind it still serves), then the rest drain together (with
/// no new requests coming in, each waits only for its own in-flight work).
async fn stop_all(svcs: &mut [Svc], grace: Duration) {
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
async fn start_all(
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
                    at.saturating_duration_since(std::time::Instant::now()).as_secs_f64(),
                    s.restarts + 1
                ),
            }
        }
        if s.child.is_none() && s.restart_at.is_some_and(|t| std::time::Instant::now() >= t) {
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

pub async fn run(a: Args) -> Result<(), String> {
    let ctx = context(a).await?;
    let mut svcs = ctx.plan()?;
    let mut stop = Box::pin(pdmesh_core::signal::shutdown_signal());
    let started = start_all(&mut svcs, Duration::from_secs(ctx.a.ready_timeout_s), &mut stop).await;
    let started = started.and_then(|_| ctx.a.prometheus_sd.as_ref().map_or(Ok(()), |f| write_prometheus_sd(f, &svcs)));
    if let Err(e) = started {
        stop_all(&mut svcs, Duration::from_secs(5)).await;
        return Err(e);
    }
    if let Some(f) = &ctx.a.prometheus_sd {
        eprintln!("meshctl: Prometheus targets in {}", f.display());
    }
    let mut mesh = crate::control::Mesh::new(ctx, svcs);
    let control = mesh.open_control().await;
    if let Err(e) = &control {
        eprintln!("meshctl: no control endpoint ({e}); scale, drain and restart are unavailable");
    }
    println!("pdmesh is up: http://{}/v1 (discovery {}); Ctrl-C stops it", mesh.ctx.a.gateway_addr, mesh.ctx.locator);
    mesh.supervise(control.ok(), &mut stop).await;
    eprintln!("meshctl: stopping (gateway first)");
    let grace = mesh.ctx.a.drain.grace();
    stop_all(&mut mesh.svcs, grace).await;
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
