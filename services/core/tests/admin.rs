//! The admin endpoints over real HTTP on loopback.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pdmesh_core::admin::{serve_admin, AdminState};

/// A plain HTTP/1.1 GET (no client library: what a Consul check or curl does).
fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_readiness_and_statusz_shows_config() {
    let counter = Arc::new(AtomicU64::new(0));
    let c2 = counter.clone();
    let state = AdminState::new(
        "tokenizer",
        serde_json::json!({"max_input_bytes": 4096}),
        Arc::new(move |_| format!("pdmesh_requests_total {}\n", c2.load(Ordering::Relaxed))),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_admin(listener, state.clone(), async {
        let _ = rx.await;
    }));
    let (code, body) = tokio::task::spawn_blocking(move || get(addr, "/health")).await.unwrap();
    assert_eq!((code, body.as_str()), (503, "not ready\n"));
    state.set_ready(true);
    counter.store(7, Ordering::Relaxed);
    let (code, _) = tokio::task::spawn_blocking(move || get(addr, "/health")).await.unwrap();
    assert_eq!(code, 200);
    let (code, body) = tokio::task::spawn_blocking(move || get(addr, "/metrics")).await.unwrap();
    assert_eq!(code, 200);
    assert!(body.starts_with("pdmesh_requests_total 7\n"), "{body}");
    assert!(body.contains("\npdmesh_discovery_up 1\n"), "every service shows its discovery status: {body}");
    let (code, body) = tokio::task::spawn_blocking(move || get(addr, "/statusz")).await.unwrap();
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["service"], "pdmesh-tokenizer");
    assert_eq!(v["config"]["max_input_bytes"], 4096);
    assert_eq!(v["ready"], true);
    assert_eq!(v["pid"], std::process::id());
    let (code, _) = tokio::task::spawn_blocking(move || get(addr, "/nope")).await.unwrap();
    assert_eq!(code, 404);
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}
