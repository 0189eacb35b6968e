//! Prefill scheduling through the whole mesh: a ~5,000-token prompt is
//! spread over budgeted steps, a short request sent meanwhile is answered
//! while the long one is still being computed, and when the long one's
//! client disconnects its prefill stops within about a step.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::Mesh;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_prompt_neither_blocks_short_ones_nor_outlives_its_client() {
    let mesh = Mesh::up(&["--prefill-batch-tokens", "128"]);
    let gauge = |name: &'static str| {
        let mesh = &mesh;
        async move { mesh.gauge("prefill", name).await }
    };
    // About 5,000 prompt tokens (" lighthouse keeper" is two tokens), one token out.
    let long = common::chat_body(&"lighthouse keeper ".repeat(2500), r#","max_tokens":1,"stream":true"#);
    let mut client = TcpStream::connect(&mesh.gateway).unwrap();
    write!(
        client,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let started = pdmesh_testkit::eventually_async(Duration::from_secs(30), || async {
        gauge("pdmesh_prefill_running").await >= 1.0
    })
    .await;
    assert!(started, "the long prompt never reached the prefill loop");
    let steps_before = gauge("pdmesh_prefill_steps_total").await;

    // A short request meanwhile: answered while the long prompt still runs.
    let t0 = Instant::now();
    let (st, body) = mesh.post("/v1/chat/completions", &common::chat_body("Hi", r#","max_tokens":2"#), &[]);
    let short = t0.elapsed();
    assert_eq!(st, 200, "{body}");
    assert_eq!(gauge("pdmesh_prefill_running").await, 1.0, "the long prompt should still be running");
    let computed = gauge("pdmesh_prefill_prompt_tokens_total").await;
    assert!(
        computed < 4500.0,
        "the short request waited for most of the long prompt ({computed} tokens in, {short:?})"
    );
    assert!(gauge("pdmesh_prefill_steps_total").await - steps_before >= 2.0, "the long prompt is spread over steps");
    let wait = gauge("pdmesh_prefill_expected_wait_seconds").await;
    assert!(wait > 0.5, "the rest of the long prompt is work ahead of any newcomer: expected wait {wait} s");

    // The long prompt's client goes away: its prefill stops between steps.
    drop(client);
    let t1 = Instant::now();
    let stopped = pdmesh_testkit::eventually_async(Duration::from_secs(10), || async {
        gauge("pdmesh_prefill_running").await == 0.0
    })
    .await;
    assert!(stopped, "the abandoned prompt kept the prefill busy");
    let left = gauge("pdmesh_prefill_prompt_tokens_total").await;
    assert!(left < 4900.0, "the abandoned prompt was computed to the end ({left} tokens) in {:?}", t1.elapsed());
    mesh.assert_released(Duration::from_secs(10)).await;
}
