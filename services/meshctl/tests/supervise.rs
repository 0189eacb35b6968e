//! `meshctl up` as a supervisor: a crash loop is restarted with a growing
//! backoff, then left down with the reason in `meshctl status`, and
//! `meshctl scale` replaces it; and when meshctl itself is killed (even by
//! SIGKILL) its services do not outlive it; with no gateway running or
//! starting, meshctl answers the gateway's clients 503 itself.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{alive, meshctl, pid_of, signal, Mesh};

/// Wait for a live router whose pid is not `old`; how long that took.
async fn router_back(mesh: &Mesh, old: i32) -> (i32, Duration) {
    let t0 = Instant::now();
    loop {
        for i in mesh.registry().healthy("router").await.unwrap() {
            let pid = pid_of(&i);
            if pid != 0 && pid != old {
                return (pid, t0.elapsed());
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the router never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_loop_backs_off_then_is_left_down_and_status_says_why() {
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--threads", "1", "--max-quick-restarts", "2"]));
    let mut pid = pid_of(&mesh.instance("router").await);
    let mut delays = Vec::new();
    for _ in 0..2 {
        signal(pid, libc::SIGKILL);
        let (next, took) = router_back(&mesh, pid).await;
        delays.push(took);
        pid = next;
    }
    eprintln!("router restarts after kill -9: {delays:?}");
    assert!(delays[0] >= Duration::from_millis(250), "first backoff 0.25 s: {delays:?}");
    assert!(delays[1] >= Duration::from_millis(500), "second backoff 0.5 s: {delays:?}");
    // A third exit within 10 s of its start: past --max-quick-restarts 2, left down.
    signal(pid, libc::SIGKILL);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // (The file registry lists a killed instance until its heartbeat expires; none answers.)
    let answering: Vec<i32> =
        mesh.registry().healthy("router").await.unwrap().iter().map(pid_of).filter(|p| *p != 0).collect();
    assert!(answering.is_empty() && !alive(pid), "the crash-looping router stays down: {answering:?}");
    let registry = mesh.dir.join("registry").display().to_string();
    let out = meshctl(&["status", "--json"], &["--registry-dir", &registry]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let router = v["supervisor"].as_array().unwrap().iter().find(|p| p["name"] == "router-0").unwrap().clone();
    eprintln!("meshctl status: {router}");
    assert!(router["state"].as_str().unwrap().starts_with("down: crash loop: 3 exits in a row"), "{router}");
    assert!(router["last_exit"].as_str().unwrap().contains("signal: 9"), "{router}");
    let text = meshctl(&["status"], &["--registry-dir", &registry]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("meshctl up: router-0 down: crash loop"), "{text}");
    // An instance left down does not count as a replica: scaling to 1
    // starts a fresh router, and requests flow again.
    let out = meshctl(&["scale", "router=1"], &["--registry-dir", &registry]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["started"], serde_json::json!(["router-1"]), "{v}");
    let (_, took) = router_back(&mesh, pid).await;
    eprintln!("router-1 serving {took:?} after meshctl scale");
    let (code, body) = mesh.post("/v1/chat/completions", &common::chat_body("Hello", r#","max_tokens":2"#), &[]);
    assert_eq!(code, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_meshctl_takes_its_services_with_it() {
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--threads", "1"]));
    let mut pids = Vec::new();
    for s in ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"] {
        pids.push((s, pid_of(&mesh.instance(s).await)));
    }
    signal(mesh.meshctl_pid(), libc::SIGKILL);
    let t0 = Instant::now();
    while pids.iter().any(|(_, p)| alive(*p)) {
        let left: Vec<_> = pids.iter().filter(|(_, p)| alive(*p)).collect();
        assert!(t0.elapsed() < Duration::from_secs(40), "outlived meshctl: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("all six services exited {:?} after meshctl was killed", t0.elapsed());
}

/// POST a short chat to `gateway`, reading for at most 10 s: (status,
/// body, how long it took).
fn ask_within_10_s(gateway: &str) -> (u16, String, Duration) {
    use std::io::{Read, Write};
    let body = common::chat_body("Hello", r#","max_tokens":2"#);
    let t0 = Instant::now();
    let mut s = std::net::TcpStream::connect(gateway).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {gateway}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    assert!(read.is_ok(), "no answer within 10 s: {read:?}");
    let (code, text) = common::parse_response(&raw);
    (code, text, t0.elapsed())
}

/// With the gateway down and none starting (here `--no-restart`), a client
/// is answered 503 `gateway_down` at once by meshctl, which holds the
/// gateway's socket; `meshctl scale gateway=1` brings answers back. Before,
/// such a client waited in the socket's queue for its own timeout: issue
/// 29's 300 s wait was a test client queued for a gateway that had not
/// started (its admin port was planned on another service's).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_no_gateway_running_clients_get_503_at_once_not_a_wait() {
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--threads", "1", "--no-restart"]));
    let gateway = mesh.pid("gateway").await;
    signal(gateway, libc::SIGKILL);
    // Asked before meshctl has seen the exit (it looks every 0.25 s): the
    // client waits in the queue until meshctl answers it; then again.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..2 {
        let (code, body, took) = tokio::task::block_in_place(|| ask_within_10_s(&mesh.gateway));
        eprintln!("with the gateway down: {code} in {took:?}: {body}");
        assert_eq!(code, 503, "{body}");
        assert!(body.contains("gateway_down"), "{body}");
        assert!(took < Duration::from_secs(3), "answered in {took:?}");
        assert!(!alive(gateway));
    }
    let registry = mesh.dir.join("registry").display().to_string();
    let v = common::meshctl_ok(&["scale", "gateway=1"], &["--registry-dir", &registry]);
    assert_eq!(v["started"], serde_json::json!(["gateway-1"]), "{v}");
    let (code, body, _) = tokio::task::block_in_place(|| ask_within_10_s(&mesh.gateway));
    assert_eq!(code, 200, "the new gateway answers: {body}");
}
