//! A real mesh for tests: `meshctl up` as a child process (six service
//! processes on loopback, a temporary registry), plus plain HTTP and gRPC
//! helpers to talk to it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pdmesh_core::discovery::{Discovery, Instance};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;

pub struct Mesh {
    pub dir: PathBuf,
    pub gateway: String,
    /// Where the mesh registers: its file registry, or `--discovery` when given.
    discovery: std::sync::Arc<dyn Discovery>,
    child: Child,
    // One mesh at a time per test binary: two would fight over 2 cores and
    // make timing assertions meaningless. Dropped last (declared last).
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

static ONE_MESH: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn free_addr() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string()
}

impl Mesh {
    /// Start the mesh with extra `meshctl up` flags; waits until it says it
    /// is up. Prompts go through prefill workers (`--max-local-prefill 0`)
    /// unless `extra` sets `--max-local-prefill`: most tests are about the
    /// disaggregated path (transfers, tickets, prefill scheduling).
    pub fn up(extra: &[&str]) -> Mesh {
        Mesh::up_env(extra, &[])
    }

    /// [`Mesh::up`] with environment variables for meshctl and the
    /// services it starts (flags meshctl does not pass on, such as the
    /// gateway's `PDMESH_GATEWAY_*`).
    pub fn up_env(extra: &[&str], env: &[(&str, &str)]) -> Mesh {
        let remote: &[&str] = if extra.contains(&"--max-local-prefill") { &[] } else { &["--max-local-prefill", "0"] };
        // Stopping a mesh drains every service: a short notice keeps test
        // teardown quick (routers' watches poll every 0.3 s); drain tests set their own.
        let notice: &[&str] = if extra.contains(&"--drain-notice-ms") { &[] } else { &["--drain-notice-ms", "300"] };
        let guard = ONE_MESH.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!("pdmesh-test-{}-{}", std::process::id(), rand_suffix()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gateway = free_addr();
        let mut child = Command::new(env!("CARGO_BIN_EXE_meshctl"))
            .args(["up", "--gateway-addr", &gateway, "--registry-dir"])
            .arg(dir.join("registry"))
            .arg("--log-dir")
            .arg(dir.join("logs"))
            .args(["--ready-timeout-s", "300"])
            .args(remote)
            .args(notice)
            .args(extra)
            // No test request runs for minutes: a request that hangs ends at
            // this deadline with the mesh's own error and trace id, well
            // before a test client's 300 s read timeout (`env` may override).
            .envs([("PDMESH_GATEWAY_REQUEST_TIMEOUT_S", "120"), ("PDMESH_ROUTER_REQUEST_TIMEOUT_S", "120")])
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start meshctl");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("meshctl> {line}");
                let _ = tx.send(line);
            }
        });
        let t0 = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(l) if l.starts_with("pdmesh is up") => break,
                _ => {}
            }
            if let Ok(Some(st)) = child.try_wait() {
                panic!("meshctl up exited early: {st}");
            }
            assert!(t0.elapsed() < Duration::from_secs(400), "mesh did not come up");
        }
        let args = pdmesh_core::discovery::DiscoveryArgs {
            discovery: extra.iter().position(|a| *a == "--discovery").map(|i| extra[i + 1].to_string()),
            registry_dir: Some(dir.join("registry")),
            registry_ttl_s: 10,
            ..Default::default()
        };
        let discovery = args.open_or_default().expect("the mesh's discovery opens");
        Mesh { dir, gateway, discovery, child, _one_at_a_time: guard }
    }

    /// The `meshctl up` process's id.
    pub fn meshctl_pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn registry(&self) -> std::sync::Arc<dyn Discovery> {
        self.discovery.clone()
    }

    pub async fn instance(&self, service: &str) -> Instance {
        let l = self.registry().healthy(service).await.unwrap();
        l.into_iter().next().unwrap_or_else(|| panic!("no live {service}"))
    }

    pub async fn router(&self) -> pb::router_client::RouterClient<tonic::transport::Channel> {
        let r = self.instance("router").await;
        let ch =
            tonic::transport::Channel::from_shared(format!("http://{}", r.grpc_addr)).unwrap().connect().await.unwrap();
        pb::router_client::RouterClient::new(ch)
    }

    /// The /metrics text of a service's (first) instance.
    pub async fn metrics(&self, service: &str) -> String {
        let i = self.instance(service).await;
        pdmesh_testkit::http_get(i.http_addr.as_deref().unwrap(), "/metrics").1
    }

    pub async fn gauge(&self, service: &str, name: &str) -> f64 {
        let t = self.metrics(service).await;
        pdmesh_core::http::metric(&t, name).unwrap_or_else(|| panic!("{name} missing from {service} metrics:\n{t}"))
    }

    /// POST JSON to the gateway: (status, body with chunked encoding undone).
    pub fn post(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> (u16, String) {
        post(&self.gateway, path, body, headers)
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        if std::thread::panicking() {
            dump_processes(self.child.id());
            // Show what the services said; keep their logs for a look.
            if let Ok(rd) = std::fs::read_dir(self.dir.join("logs")) {
                for e in rd.flatten() {
                    let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    eprintln!(
                        "==> {} (last lines)\n{}",
                        e.path().display(),
                        lines[lines.len().saturating_sub(30)..].join("\n")
                    );
                }
            }
        }
        // SAFETY: kill(2) on our own child; SIGTERM makes meshctl stop the mesh.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.child.try_wait() {
                if !std::thread::panicking() {
                    let _ = std::fs::remove_dir_all(&self.dir);
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
    }
}

/// On a failed test, before the mesh stops: where each service process's
/// threads wait in the kernel, and its TCP connections with their unread
/// (Recv-Q) and unsent (Send-Q) bytes, so that a request that waited shows
/// which process held it and on which connection.
fn dump_processes(meshctl: u32) {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    let tasks =
        |pid: &str| std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten().map(|t| t.path());
    let pids: Vec<String> = tasks(&meshctl.to_string())
        .flat_map(|t| read(&t.join("children")).split_whitespace().map(String::from).collect::<Vec<_>>())
        .collect();
    for pid in &pids {
        let mut waits = std::collections::BTreeMap::<String, usize>::new();
        for t in tasks(pid) {
            *waits.entry(read(&t.join("wchan"))).or_default() += 1;
        }
        eprintln!(
            "==> pid {pid} {}: threads by kernel wait point {waits:?}",
            read(format!("/proc/{pid}/comm").as_ref()).trim()
        );
    }
    let Ok(ss) = Command::new("ss").arg("-tanpH").output() else { return };
    let ss = String::from_utf8_lossy(&ss.stdout);
    let ours = ss.lines().filter(|l| pids.iter().any(|p| l.contains(&format!("pid={p},"))));
    eprintln!(
        "==> TCP of the mesh's processes (state, Recv-Q, Send-Q, local, peer, process)\n{}",
        ours.collect::<Vec<_>>().join("\n")
    );
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as u64
}

pub fn post(addr: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let (code, _, body) = post_header(addr, path, body, headers, "");
    (code, body)
}

/// POST and return (status, a response header's value if present, body).
pub fn post_header(
    addr: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
    want: &str,
) -> (u16, Option<String>, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut h = String::new();
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    write!(s, "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{h}Connection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let head = text.split_once("\r\n\r\n").map(|(h, _)| h).unwrap_or(&text);
    let value = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(want).then(|| v.trim().to_string())
    });
    let (code, body) = parse_response(&raw);
    (code, value, body)
}

pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() };
    (code, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

pub fn golden() -> Vec<serde_json::Value> {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../engine/tests/data/smollm2.golden.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("golden file")).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// What one router request produced.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub ids: Vec<u32>,
    pub text: String,
    pub finished: Option<pb::Finished>,
    /// The longest wait between two deltas (a migration's stall).
    pub longest_gap: Duration,
    last_delta: Option<Instant>,
}

pub fn chat_request(user: &str, max_tokens: u32, ignore_eos: bool) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: String::new(),
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: user.into() }],
        })),
        sampling: Some(common::SamplingParams::default()),
        max_tokens,
        stop: vec![],
        ignore_eos,
        max_tokens_to_fit: false,
        resume_ids: Vec::new(),
    }
}

pub async fn run(
    client: &mut pb::router_client::RouterClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
) -> Result<Outcome, tonic::Status> {
    let mut s = client.generate(req).await?.into_inner();
    let mut o = Outcome::default();
    while let Some(m) = s.message().await? {
        o.take(m);
    }
    Ok(o)
}

impl Outcome {
    /// Add one event of the router's stream.
    pub fn take(&mut self, m: pb::GenerateResponse) {
        match m.event {
            Some(pb::generate_response::Event::Delta(d)) => {
                self.ids.extend(d.ids);
                self.text.push_str(&d.text);
                let now = Instant::now();
                if let Some(t) = self.last_delta.replace(now) {
                    self.longest_gap = self.longest_gap.max(now - t);
                }
            }
            Some(pb::generate_response::Event::Finished(f)) => self.finished = Some(f),
            None => {}
        }
    }
}

/// A Go-built tool the tests run for real: `env` (a path), else the binary
/// `scripts/gotool.sh` builds into the pdmesh cache (`<tool>-<version>/<tool>`).
pub fn cached_tool(env: &str, tool: &str, version: &str) -> Option<PathBuf> {
    if let Some(b) = std::env::var_os(env) {
        return Some(PathBuf::from(b));
    }
    let cache = pdmesh_model::CacheArgs::from_env().dir();
    Some(cache.join(format!("{tool}-{version}")).join(tool)).filter(|p| p.exists())
}

impl Mesh {
    /// /metrics of every live instance of `service`, by instance id.
    pub async fn metrics_all(&self, service: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for i in self.registry().healthy(service).await.unwrap() {
            let (_, body) = pdmesh_testkit::http_get(i.http_addr.as_deref().unwrap(), "/metrics");
            out.push((i.id, body));
        }
        out
    }
}

/// Start a streamed chat request over plain TCP and return once `n` SSE
/// events arrived; the request lives until the returned stream is dropped
/// (dropping it is a client disconnect).
pub fn start_stream(gateway: &str, body: &str, n: usize) -> TcpStream {
    start_stream_with(gateway, body, n, &[])
}

/// [`start_stream`] with extra request headers.
pub fn start_stream_with(gateway: &str, body: &str, n: usize, headers: &[(&str, &str)]) -> TcpStream {
    let mut s = TcpStream::connect(gateway).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let h: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{h}\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 4096];
    let mut got = String::new();
    while got.matches("data:").count() < n {
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "stream ended early: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..k]));
    }
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    s
}

pub fn chat_body(content: &str, extra: &str) -> String {
    format!(
        r#"{{"model":"smollm2-135m-instruct","messages":[{{"role":"user","content":{}}}]{extra}}}"#,
        serde_json::Value::String(content.into())
    )
}

impl Mesh {
    /// The pid of a service's (first) live instance, from its /statusz.
    pub async fn pid(&self, service: &str) -> i32 {
        let i = self.instance(service).await;
        let (_, body) = pdmesh_testkit::http_get(i.http_addr.as_deref().unwrap(), "/statusz");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["pid"].as_u64().unwrap() as i32
    }

    /// Set a fault-injection switch on every live instance of `service`.
    pub async fn fault(&self, service: &str, name: &str, value: u64) {
        for i in self.registry().healthy(service).await.unwrap() {
            let (st, body) = pdmesh_core::http::put(
                i.http_addr.as_deref().unwrap(),
                &format!("/faults/{name}/{value}"),
                Duration::from_secs(5),
            )
            .unwrap();
            assert_eq!(st, 200, "{body}");
        }
    }

    /// SIGKILL a service's instance and wait until its replacement (started
    /// by `meshctl up`) is ready.
    pub async fn kill_and_wait(&self, service: &str) {
        let old = self.pid(service).await;
        // SAFETY: kill(2) on a mesh child process.
        unsafe {
            libc::kill(old, libc::SIGKILL);
        }
        let back = pdmesh_testkit::eventually_async(Duration::from_secs(120), || async {
            let Ok(list) = self.registry().healthy(service).await else { return false };
            let Some(i) = list.first() else { return false };
            let Ok((200, body)) =
                pdmesh_core::http::get(i.http_addr.as_deref().unwrap(), "/statusz", Duration::from_secs(2))
            else {
                return false;
            };
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            v["pid"].as_u64() != Some(old as u64) && v["ready"] == true
        })
        .await;
        assert!(back, "{service} did not come back");
    }

    /// Wait until no KV block is reserved, pinned or in use anywhere and no
    /// ticket is live; panics with the metrics otherwise.
    pub async fn assert_released(&self, within: Duration) {
        let g = |t: &str, n: &str| pdmesh_core::http::metric(t, n).unwrap_or(-1.0);
        let t0 = Instant::now();
        loop {
            let mut snapshot = String::new();
            let mut fine = true;
            for (_, m) in self.metrics_all("decode").await {
                fine &= [
                    "pdmesh_decode_kv_blocks_used",
                    "pdmesh_decode_kv_blocks_pinned",
                    "pdmesh_decode_awaiting_kv",
                    "pdmesh_decode_running",
                    "pdmesh_decode_queued",
                    "pdmesh_decode_local_prefilling",
                ]
                .iter()
                .all(|n| g(&m, n) == 0.0);
                fine &= g(&m, "pdmesh_decode_kv_blocks_free") + g(&m, "pdmesh_decode_prefix_evictable_blocks")
                    == g(&m, "pdmesh_decode_kv_blocks_total");
                snapshot.push_str(&m);
            }
            for (_, m) in self.metrics_all("prefill").await {
                fine &= ["pdmesh_prefill_kv_blocks_used", "pdmesh_prefill_kv_blocks_pinned"]
                    .iter()
                    .all(|n| g(&m, n) == 0.0);
                // Every block is free, or cached and held by no one.
                fine &= g(&m, "pdmesh_prefill_kv_blocks_free") + g(&m, "pdmesh_prefill_prefix_evictable_blocks")
                    == g(&m, "pdmesh_prefill_kv_blocks_total");
                snapshot.push_str(&m);
            }
            let b = self.metrics("kvbroker").await;
            fine &= ["open", "claimed", "writing"]
                .iter()
                .all(|s| g(&b, &format!("pdmesh_kvbroker_tickets{{state=\"{s}\"}}")) == 0.0);
            snapshot.push_str(&b);
            if fine {
                return;
            }
            assert!(t0.elapsed() < within, "KV blocks or tickets still held after {within:?}:\n{snapshot}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

pub fn raw_request(prompt: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: String::new(),
        input: Some(pb::generate_request::Input::Prompt(prompt.into())),
        sampling: Some(common::SamplingParams::default()),
        max_tokens,
        stop: vec![],
        ignore_eos: true,
        max_tokens_to_fit: false,
        resume_ids: Vec::new(),
    }
}

/// `n` greedy chat requests at once (the golden prompts, cycled), 32 tokens
/// each with EOS ignored; every one must equal the golden ids.
pub async fn golden_at_once(router: &pb::router_client::RouterClient<tonic::transport::Channel>, n: usize) {
    let g = golden();
    let mut tasks = Vec::new();
    for i in 0..n {
        let item = g[i % g.len()].clone();
        let mut r = router.clone();
        tasks.push(tokio::spawn(async move {
            let o = run(&mut r, chat_request(item["prompt"].as_str().unwrap(), 32, true)).await.expect("request");
            (o.ids, ids(&item["greedy_ids_32_ignore_eos"]))
        }));
    }
    for t in tasks {
        let (got, want) = t.await.unwrap();
        assert_eq!(got, want, "a request changed tokens when {n} ran at once");
    }
}

/// The process id of a live instance (from its /statusz; 0 if it does not answer).
pub fn pid_of(i: &Instance) -> i32 {
    let got = pdmesh_core::http::get(i.http_addr.as_deref().unwrap_or(""), "/statusz", Duration::from_secs(2));
    let Ok((200, body)) = got else { return 0 };
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["pid"].as_u64().unwrap_or(0) as i32
}

/// Whether process `pid` exists.
pub fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Send `sig` to `pid`, a process this test started (a service, meshctl, a load generator).
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process of this test's own making.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// `meshctl ARGS` plus `at`, where the mesh is (`--discovery URL` or `--registry-dir DIR`).
pub fn meshctl(args: &[&str], at: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_meshctl")).args(args).args(at).output().expect("run meshctl")
}

/// [`meshctl`], which must succeed: its answer as JSON (Null when it printed none).
pub fn meshctl_ok(args: &[&str], at: &[&str]) -> serde_json::Value {
    let out = meshctl(args, at);
    assert!(out.status.success(), "meshctl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_default()
}

/// A closed loop of 16 `pdmesh-loadtest` clients on `gateway` (16 tokens
/// each), reporting to `report`; `extra` holds flag/value pairs that
/// replace the defaults or add to them.
pub fn start_load(gateway: &str, report: &std::path::Path, extra: &[(&str, &str)]) -> Child {
    let loadtest = std::path::Path::new(env!("CARGO_BIN_EXE_meshctl")).with_file_name("pdmesh-loadtest");
    let mut flags: Vec<(&str, &str)> = vec![
        ("--target", gateway),
        ("--mode", "closed"),
        ("--concurrency", "16"),
        ("--requests", "100000"),
        ("--max-tokens", "16"),
        ("--stall-s", "60"),
        ("--timeout-s", "120"),
    ];
    for &(flag, value) in extra {
        match flags.iter_mut().find(|(f, _)| *f == flag) {
            Some(f) => f.1 = value,
            None => flags.push((flag, value)),
        }
    }
    Command::new(&loadtest)
        // A switch (no value) is given with "".
        .args(flags.iter().flat_map(|&(f, v)| if v.is_empty() { vec![f] } else { vec![f, v] }))
        .arg("--out")
        .arg(report)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", loadtest.display()))
}

/// Stop the load (SIGINT: it finishes what is in flight): its point (the
/// aggregate) and its run (`records`, `started_unix_ms`).
pub fn stop_load(mut load: Child, report: &std::path::Path) -> (serde_json::Value, serde_json::Value) {
    signal(load.id() as i32, libc::SIGINT);
    let status = load.wait().unwrap();
    assert!(status.success(), "pdmesh-loadtest exited with {status}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    (r["points"][0].clone(), r["runs"][0].clone())
}

impl Mesh {
    /// Wait until the gateway has answered `n` more requests ok.
    pub async fn flowing(&self, n: f64) {
        let ok = "pdmesh_gateway_requests_total{outcome=\"ok\"}";
        let start = self.gauge("gateway", ok).await;
        let t0 = Instant::now();
        while self.gauge("gateway", ok).await < start + n {
            assert!(t0.elapsed() < Duration::from_secs(60), "no load reached the gateway");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A gRPC codec of raw bytes: what is sent is exactly what the caller made
/// (fuzzing, or a call with no generated client).
#[derive(Clone, Copy, Default)]
pub struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n).to_vec()))
    }
}
