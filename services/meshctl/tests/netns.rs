//! The mesh across "hosts": each part in its own Linux network namespace
//! with its own address on a bridge, as separate machines would be.
//! Nothing may depend on loopback or on one process tree:
//!
//! - gateway + router, tokenizer + kvbroker, prefill, decode: four
//!   namespaces, 10.213.0.2-5, bridged through 10.213.0.1 in the root one;
//! - every service binds its namespace address (never 0.0.0.0) and finds
//!   the others through a file registry in a shared folder;
//! - KV moves prefill → decode over NIXL (UCX) between namespaces: once as
//!   UCX chooses (the namespaces share one IPC namespace, so its shared
//!   memory transports cross them: only control traffic leaves the
//!   prefill's eth0), once forced onto TCP (`UCX_TLS=tcp`), when the KV
//!   bytes are seen leaving the prefill's namespace.
//!
//! Needs root (namespaces, veth, bridge). Where they cannot be made the
//! test prints why and records a skip (see `pdmesh_testkit::skip`); it does
//! not pass.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BRIDGE: &str = "pdmtestbr0";
const SUBNET: &str = "10.213.0";
/// The namespaces and what runs in each.
const HOSTS: [(&str, &[&str]); 4] = [
    ("pdmtest-front", &["router", "gateway"]),
    ("pdmtest-ctl", &["tokenizer", "kvbroker"]),
    ("pdmtest-prefill", &["prefill"]),
    ("pdmtest-decode", &["decode"]),
];

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// The namespaces, the bridge and the processes; all removed on drop.
struct Hosts {
    procs: Vec<(String, Child)>,
    logs: PathBuf,
}

fn clean_up() {
    for (ns, _) in HOSTS {
        let _ = ip(&["netns", "del", ns]);
    }
    let _ = ip(&["link", "del", BRIDGE]);
}

fn addr_of(host: usize) -> String {
    format!("{SUBNET}.{}", host + 2)
}

impl Hosts {
    fn create(logs: &Path) -> Result<Hosts, String> {
        clean_up();
        ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{SUBNET}.1/24"), "dev", BRIDGE])?;
        ip(&["link", "set", BRIDGE, "up"])?;
        for (i, (ns, _)) in HOSTS.iter().enumerate() {
            let host_end = format!("pdmtestv{i}");
            ip(&["netns", "add", ns])?;
            ip(&["link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
            ip(&["link", "set", &host_end, "master", BRIDGE])?;
            ip(&["link", "set", &host_end, "up"])?;
            ip(&["-n", ns, "addr", "add", &format!("{}/24", addr_of(i)), "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(Hosts { procs: Vec::new(), logs: logs.to_path_buf() })
    }

    /// Start `bin args` inside namespace `host`, with `env` added.
    fn start(&mut self, host: usize, name: &str, args: &[String], env: &[(&str, &str)]) {
        let log = std::fs::File::create(self.logs.join(format!("{name}.log"))).unwrap();
        let bin = Path::new(env!("CARGO_BIN_EXE_meshctl")).with_file_name(format!("pdmesh-{name}"));
        let child = Command::new("ip")
            .args(["netns", "exec", HOSTS[host].0])
            .arg(&bin)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        self.procs.push((name.to_string(), child));
    }

    /// Stop every process (SIGTERM: each drains), waiting up to 15 s each.
    fn stop_all(&mut self) {
        for (_, c) in self.procs.iter_mut().rev() {
            // SAFETY: kill(2) on the `ip netns exec` child, which exec'd the service.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
        }
        for (_, c) in self.procs.iter_mut() {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(15) && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.procs.clear();
    }

    fn dump_logs(&self) {
        for (name, _) in &self.procs {
            let text = std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!("==> {name} (last lines)\n{}", lines[lines.len().saturating_sub(20)..].join("\n"));
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        self.stop_all();
        clean_up();
    }
}

fn wait_healthy(http: &str) {
    let t0 = Instant::now();
    loop {
        if let Ok((200, _)) = pdmesh_core::http::get(http, "/health", Duration::from_secs(2)) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "{http} never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Bytes the prefill's namespace has sent out of its eth0 so far (its veth
/// peer in the root namespace receives them).
fn prefill_sent() -> u64 {
    std::fs::read_to_string("/sys/class/net/pdmtestv2/statistics/rx_bytes")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// The mesh over the namespaces; golden tokens through it; the NIXL
/// transfers it made. `ucx` is the environment of prefill and decode.
async fn split_mesh(hosts: &mut Hosts, dir: &Path, model: &str, ucx: &[(&str, &str)]) -> f64 {
    let registry = dir.join(format!("registry{}", ucx.len())).display().to_string();
    // Start order and placement: each service on its host's address.
    let plan: [(&str, usize, Vec<&str>); 6] = [
        ("tokenizer", 1, vec!["--model", model]),
        ("kvbroker", 1, vec![]),
        ("prefill", 2, vec!["--model", model, "--threads", "1", "--kv-transport", "nixl"]),
        ("decode", 3, vec!["--model", model, "--threads", "1", "--kv-transport", "nixl"]),
        // Every prompt through the prefill worker: every request moves KV.
        ("router", 0, vec!["--max-local-prefill", "0"]),
        ("gateway", 0, vec![]),
    ];
    let mut https = Vec::new();
    for (name, host, extra) in &plan {
        let a = addr_of(*host);
        let port = 7000 + https.len();
        let http = format!("{a}:{}", 9000 + https.len());
        let mut args: Vec<String> = vec![
            "--listen".into(),
            format!("{a}:{port}"),
            "--http-listen".into(),
            http.clone(),
            "--registry-dir".into(),
            registry.clone(),
            "--instance-id".into(),
            format!("{name}-0"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let env = if matches!(*name, "prefill" | "decode") { ucx } else { &[] };
        hosts.start(*host, name, &args, env);
        tokio::task::block_in_place(|| wait_healthy(&http));
        eprintln!("netns: {name} healthy in {} at {a}:{port}", HOSTS[*host].0);
        https.push((name.to_string(), http));
    }

    // Every announced address is a namespace address, never loopback or 0.0.0.0.
    let reg = pdmesh_core::discovery::FileRegistry::new(&registry, Duration::from_secs(10));
    use pdmesh_core::discovery::Discovery;
    for s in ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"] {
        for i in reg.healthy(s).await.unwrap() {
            assert!(i.grpc_addr.starts_with(SUBNET), "{s} announced {}", i.grpc_addr);
        }
    }
    let router = reg.healthy("router").await.unwrap().remove(0);
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", router.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = pdmesh_proto::router::v1::router_client::RouterClient::new(ch);
    common::golden_at_once(&client, 4).await;

    let prefill_http = &https.iter().find(|(n, _)| n == "prefill").unwrap().1;
    let (_, m) = pdmesh_testkit::http_get(prefill_http, "/metrics");
    let nixl = pdmesh_core::http::metric(&m, "pdmesh_prefill_kv_transfers_total{transport=\"nixl\"}").unwrap_or(0.0);
    assert!(nixl >= 4.0, "transfers over NIXL: {nixl}\n{m}");
    tokio::task::block_in_place(|| hosts.stop_all());
    nixl
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn golden_tokens_through_a_mesh_split_over_four_network_namespaces() {
    let dir = std::env::temp_dir().join(format!("pdmesh-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("logs")).unwrap();
    let mut hosts = match Hosts::create(&dir.join("logs")) {
        Ok(h) => h,
        Err(e) => {
            clean_up();
            pdmesh_testkit::skip("netns", &format!("cannot make network namespaces here ({e}); needs root"));
            return;
        }
    };
    let model = tokio::task::block_in_place(|| pdmesh_model::CacheArgs::default().ensure_model())
        .expect("the model is in the cache")
        .display()
        .to_string();
    // UCX as it chooses (the namespaces share IPC, so shared memory may cross them) ...
    let before = prefill_sent();
    let n = split_mesh(&mut hosts, &dir, &model, &[]).await;
    let sent = prefill_sent() - before;
    eprintln!("netns: {n} KV transfers over NIXL (UCX's own choice of transport); the prefill host sent {sent} bytes");
    // ... and forced onto TCP over the namespaces' eth0: the KV crosses the bridge.
    let before = prefill_sent();
    let n = split_mesh(&mut hosts, &dir, &model, &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "eth0")]).await;
    let crossed = prefill_sent() - before;
    eprintln!("netns: {n} KV transfers over NIXL with UCX_TLS=tcp; the prefill host sent {crossed} bytes");
    // 4 prompts of ~35 tokens: 30 layers x K and V x 3 heads x 64 x 2 bytes is ~23 KB a token.
    assert!(crossed > 2_000_000, "the KV went over the network: {crossed} bytes");
    drop(hosts);
    let _ = std::fs::remove_dir_all(&dir);
}
