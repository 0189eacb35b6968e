//! How each process of a `meshctl up` mesh is started: its binary, flags,
//! ports, folders, CPUs and TLS identity ([`Ctx`]), and the processes the
//! mesh starts with ([`Ctx::plan`]).

use std::path::{Path, PathBuf};

use pdmesh_core::discovery::{pooled_kind, Locator};

use crate::flags::Args;
use crate::process::{free_addr, write_prometheus_sd, Svc};

/// Most instances of one kind.
pub const MAX_REPLICAS: usize = 64;

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

/// One model the mesh serves.
pub struct Pool {
    /// Its pool (`--pool` of its services); None in a mesh of one model.
    pub name: Option<String>,
    /// The name clients ask for in `model`.
    pub served: String,
    /// Its GGUF file.
    pub path: String,
}

/// The models of `--model` (default: SmolLM2), fetched if missing; with
/// two or more, each is a pool named as clients ask for it.
async fn pools(a: &Args) -> Result<Vec<Pool>, String> {
    let given: Vec<PathBuf> =
        if a.model.is_empty() { vec![PathBuf::from(pdmesh_model::SMOLLM2.name)] } else { a.model.clone() };
    let mut pools: Vec<Pool> = Vec::new();
    for g in &given {
        let served = pdmesh_model::served_name(g);
        if pools.iter().any(|p| p.served == served) {
            return Err(format!("--model {} is given twice (both served as {served})", g.display()));
        }
        eprintln!("meshctl: making sure {} is at hand (first run downloads it)", g.display());
        let (cache, g2) = (a.cache.clone(), g.clone());
        let path = tokio::task::spawn_blocking(move || cache.model_or_fetch(Some(&g2)))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        if !path.is_file() {
            return Err(format!(
                "--model {}: no such file, and not a catalogue name ({})",
                g.display(),
                pdmesh_model::CATALOGUE.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
            ));
        }
        let name = (given.len() > 1).then(|| served.clone());
        pools.push(Pool { name, served, path: path.display().to_string() });
    }
    Ok(pools)
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

/// The flags only `name` gets; `model` is its pool's GGUF file.
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
    /// The models served, each with its pool.
    pub pools: Vec<Pool>,
    prefill_cpus: Vec<usize>,
    decode_cpus: Vec<usize>,
    /// The gateway's listening socket: meshctl binds it once and hands it to
    /// every gateway process, so during a restart the new one accepts from
    /// the same queue the old one stops taking from (no refused or reset
    /// connections). Clients wait in the queue for a gateway about to
    /// start; while none is, meshctl answers them ([`crate::standin`]).
    gateway_socket: std::net::TcpListener,
    /// `--tls`: the development CA that signs each instance's certificate.
    tls: Option<crate::devca::DevCa>,
}

impl Ctx {
    /// Answer the gateway's clients until the returned guard is dropped.
    pub fn stand_in(&self) -> std::io::Result<crate::standin::StandIn> {
        crate::standin::StandIn::start(&self.gateway_socket)
    }

    /// The pool called `name` (None: the only model of a one-model mesh).
    fn pool(&self, name: Option<&str>) -> Result<&Pool, String> {
        self.pools.iter().find(|p| p.name.as_deref() == name).ok_or_else(|| match name {
            Some(n) => format!("this mesh serves no model pool {n:?}; its pools: {}", self.pool_names()),
            None => format!("this mesh serves several models: name the pool, as in decode@{}", self.pools[0].served),
        })
    }

    fn pool_names(&self) -> String {
        self.pools.iter().filter_map(|p| p.name.clone()).collect::<Vec<_>>().join(", ")
    }

    /// The gateway's flags for the models served.
    fn gateway_models(&self) -> Vec<String> {
        match self.pools.as_slice() {
            [one] => vec!["--model-name".into(), one.served.clone()],
            _ => vec!["--models".into(), self.pools.iter().map(|p| p.served.clone()).collect::<Vec<_>>().join(",")],
        }
    }

    /// The kinds meant by `kind` as an operator gives it (`decode`,
    /// `decode@gemma3-270m`): the gateway has no pool; in a mesh of
    /// several models a worker kind needs its pool unless `every_pool`.
    pub fn kinds_of(&self, kind: &str, every_pool: bool) -> Result<Vec<String>, String> {
        let (role, pool) = pdmesh_core::discovery::split_kind(kind);
        match (role, pool) {
            ("gateway", Some(_)) => Err(format!("{kind}: the gateway serves every model and is in no pool")),
            ("gateway", None) => Ok(vec![role.to_string()]),
            (_, None) if every_pool => Ok(self.pools.iter().map(|p| pooled_kind(role, p.name.as_deref())).collect()),
            _ => self.pool(pool).map(|p| vec![pooled_kind(role, p.name.as_deref())]),
        }
    }

    /// Kernel threads each of `sharing` replicas of a compute role (all
    /// pools) runs its loops on: they divide the role's CPUs (its pinned
    /// ones, else the host's), at least 1 each. None where `--threads`
    /// fixes each worker's, and for the other kinds.
    pub fn threads_in_use(&self, role: &str, sharing: usize) -> Option<usize> {
        let cpus = match role {
            "prefill" => &self.prefill_cpus,
            "decode" => &self.decode_cpus,
            _ => return None,
        };
        if self.a.threads > 0 {
            return None;
        }
        let cores =
            if cpus.is_empty() { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { cpus.len() };
        Some((cores / sharing.max(1)).max(1))
    }

    /// Instance `index` of `kind` (`decode`, `decode@gemma3-270m`), not
    /// started yet, one of `sharing` replicas of its role on this host.
    pub fn svc(&self, kind: &str, index: usize, sharing: usize) -> Result<Svc, String> {
        let a = &self.a;
        let (role, pool) = pdmesh_core::discovery::split_kind(kind);
        let pool = if role == "gateway" { None } else { Some(self.pool(pool)?) };
        let id = format!("{kind}-{index}");
        let listen = if role == "gateway" { a.gateway_addr.clone() } else { free_addr()? };
        let http = free_addr()?;
        let mut args = common_args(a, &self.locator, &id, listen, &http);
        match pool {
            Some(p) => {
                if let Some(n) = &p.name {
                    args.extend(["--pool".into(), n.clone()]);
                }
                args.extend(service_args(a, role, &p.path));
            }
            None => {
                args.extend(service_args(a, role, ""));
                args.extend(self.gateway_models());
            }
        }
        if let Some(ca) = &self.tls {
            args.extend(ca.issue(&format!("{role}/{id}"), &id)?.args());
        }
        let cpus = match role {
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
        if let Some(n) = self.threads_in_use(role, sharing) {
            args.extend(["--threads-in-use".into(), n.to_string()]);
        }
        let log = self.log_dir.join(format!("{id}.log"));
        let mut s = Svc::new(kind, index, self.bin_dir.join(format!("pdmesh-{role}")), args, http, log);
        s.pass_fd = (role == "gateway").then(|| std::os::fd::AsRawFd::as_raw_fd(&self.gateway_socket));
        s.nice = if role == "prefill" { a.prefill_nice } else { 0 };
        s.cpus = cpus;
        Ok(s)
    }

    /// Every process of the mesh, in start order: each kind for every
    /// model's pool, the gateway last.
    pub fn plan(&self) -> Result<Vec<Svc>, String> {
        let mut svcs = Vec::new();
        for kind in crate::status::SERVICES {
            let replicas = match kind {
                "prefill" => self.a.prefill_replicas,
                "decode" => self.a.decode_replicas,
                "router" => self.a.router_replicas,
                _ => 1,
            };
            if replicas == 0 || replicas > MAX_REPLICAS {
                return Err(format!("--{kind}-replicas must be 1..={}", MAX_REPLICAS));
            }
            let kinds = self.kinds_of(kind, true)?;
            let sharing = replicas * kinds.len();
            for k in kinds {
                for r in 0..replicas {
                    svcs.push(self.svc(&k, r, sharing)?);
                }
            }
        }
        Ok(svcs)
    }

    /// Where the services' logs go.
    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// Write the Prometheus target list, if asked for.
    pub fn write_targets(&self, svcs: &[Svc]) {
        if let Some(Err(e)) = self.a.prometheus_sd.as_ref().map(|f| write_prometheus_sd(f, svcs)) {
            eprintln!("meshctl: {e}");
        }
    }
}

/// Check the flags and prepare what every process is started from.
pub async fn context(mut a: Args) -> Result<Ctx, String> {
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
    let pools = pools(&a).await?;
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
    Ok(Ctx { a, locator, bin_dir, log_dir, pools, prefill_cpus, decode_cpus, gateway_socket, tls })
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
