//! Prefill and decode scale apart: a mesh with two decode workers and one
//! prefill. Requests spread over both decodes (by live load), tokens stay
//! identical, and when one decode's KV is full the router uses the other;
//! only when both are full does a client get 429. KV moves over TCP here
//! (the `mesh` test covers NIXL), with the same tokens.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{chat_body, start_stream, Mesh};
use pdmesh_core::http::metric;
use pdmesh_testkit::eventually_async;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_decode_workers_share_the_load() {
    let mesh = Mesh::up(&[
        "--decode-replicas",
        "2",
        "--decode-kv-blocks",
        "200",
        "--prefill-replicas",
        "1",
        "--threads",
        "1",
        "--kv-transport",
        "tcp",
    ]);
    assert!(eventually_async(Duration::from_secs(30), || async { mesh.metrics_all("decode").await.len() == 2 }).await);
    let router = mesh.router().await;
    common::golden_at_once(&router, 8).await;
    let p = mesh.metrics("prefill").await;
    assert!(metric(&p, "pdmesh_prefill_kv_transfers_total{transport=\"tcp\"}").unwrap() >= 8.0, "{p}");
    assert_eq!(metric(&p, "pdmesh_prefill_kv_transfers_total{transport=\"nixl\"}"), Some(0.0));
    for (id, m) in mesh.metrics_all("decode").await {
        let ok = metric(&m, "pdmesh_decode_requests_total{outcome=\"ok\"}").unwrap();
        assert!(ok >= 1.0, "decode {id} served no request of 8");
    }

    // Fill one decode; the next long request must land on the other.
    let hog = |gw: String| {
        std::thread::spawn(move || {
            start_stream(
                &gw,
                &chat_body("Count to a million", r#","max_tokens":3000,"ignore_eos":true,"stream":true"#),
                3,
            )
        })
    };
    let first = tokio::task::spawn_blocking({
        let h = hog(mesh.gateway.clone());
        move || h.join().unwrap()
    })
    .await
    .unwrap();
    let second = tokio::task::spawn_blocking({
        let h = hog(mesh.gateway.clone());
        move || h.join().unwrap()
    })
    .await
    .unwrap();
    let used: Vec<f64> = mesh
        .metrics_all("decode")
        .await
        .iter()
        .map(|(_, m)| metric(m, "pdmesh_decode_kv_blocks_used").unwrap())
        .collect();
    assert!(used.iter().all(|u| *u >= 180.0), "each decode should hold one long request: {used:?}");
    let (st, resp) = mesh.post("/v1/chat/completions", &chat_body("hi", r#","max_tokens":500"#), &[]);
    assert_eq!(st, 429, "both decodes are full: {resp}");
    drop(first);
    assert!(
        eventually_async(Duration::from_secs(10), || async {
            mesh.metrics_all("decode").await.iter().any(|(_, m)| metric(m, "pdmesh_decode_kv_blocks_used") == Some(0.0))
        })
        .await
    );
    // Admitted again (200 and tokens flowing); no need to wait for the end.
    let gw = mesh.gateway.clone();
    let third = tokio::task::spawn_blocking(move || {
        start_stream(&gw, &chat_body("hi", r#","max_tokens":500,"stream":true"#), 2)
    })
    .await
    .unwrap();
    drop(third);
    drop(second);
}
