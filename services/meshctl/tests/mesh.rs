//! The whole mesh as users run it: `meshctl up` starts six processes on
//! loopback; requests go through the router (gRPC) and the gateway (HTTP).
//! KV moves over NIXL (the `scale` test covers the TCP transport).
//! One mesh serves every check here, in order, ending with restarts.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]
// Whole-mesh scenarios read top to bottom as one story (issue 12 exempts tests).
#![allow(clippy::too_many_lines)]

mod common;

use std::time::Duration;

use common::{chat_body, chat_request, golden, ids, run, start_stream, Mesh};
use pdmesh_testkit::eventually_async;

/// Decode's KV is kept small so a single long request can fill it.
const DECODE_KV_BLOCKS: &str = "200";

async fn assert_nothing_held(mesh: &Mesh) {
    let ok = eventually_async(Duration::from_secs(10), || async {
        mesh.gauge("decode", "pdmesh_decode_kv_blocks_used").await == 0.0
            && mesh.gauge("decode", "pdmesh_decode_awaiting_kv").await == 0.0
            && mesh.gauge("decode", "pdmesh_decode_running").await == 0.0
            && mesh.gauge("prefill", "pdmesh_prefill_kv_blocks_used").await == 0.0
            && mesh.gauge("kvbroker", "pdmesh_kvbroker_tickets{state=\"open\"}").await == 0.0
            && mesh.gauge("kvbroker", "pdmesh_kvbroker_tickets{state=\"claimed\"}").await == 0.0
    })
    .await;
    assert!(
        ok,
        "blocks or tickets still held:\n{}\n{}\n{}",
        mesh.metrics("decode").await,
        mesh.metrics("prefill").await,
        mesh.metrics("kvbroker").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mesh_end_to_end() {
    let mesh = Mesh::up(&["--decode-kv-blocks", DECODE_KV_BLOCKS, "--decode-max-batch", "16"]);
    let mut router = mesh.router().await;

    // 1. Token-for-token equality with the engine's (llama.cpp's) greedy output.
    let g = golden();
    for item in &g {
        let want = ids(&item["greedy_ids_32_ignore_eos"]);
        let o = run(&mut router, chat_request(item["prompt"].as_str().unwrap(), 32, true)).await.expect("request");
        assert_eq!(o.ids, want, "prompt {:?}", item["prompt"]);
        let u = o.finished.as_ref().unwrap().usage.unwrap();
        assert_eq!(
            u.prompt_tokens as usize,
            item["chat_ids"].as_array().unwrap().len(),
            "prompt tokens = the chat template's ids"
        );
        assert_eq!(u.completion_tokens, 32);
        // Stopping at EOS: the golden greedy text exactly.
        let o = run(&mut router, chat_request(item["prompt"].as_str().unwrap(), 64, false)).await.expect("request");
        let want = ids(&item["greedy_ids"]);
        assert_eq!(&o.ids[..want.len()], &want[..], "prompt {:?}", item["prompt"]);
        if item["stopped_at_eos"].as_bool().unwrap() {
            assert_eq!(o.text, item["greedy_text"].as_str().unwrap());
        } else {
            assert!(o.text.starts_with(item["greedy_text"].as_str().unwrap()));
        }
    }
    // ... and 16 at once.
    common::golden_at_once(&router, 16).await;
    assert!(mesh.gauge("decode", "pdmesh_decode_steps_total").await > 0.0);
    // The KV moved over NIXL (CI installs the nixl-cu12 wheel), never over TCP.
    assert!(mesh.gauge("prefill", "pdmesh_prefill_kv_transfers_total{transport=\"nixl\"}").await >= 22.0);
    assert_eq!(mesh.gauge("prefill", "pdmesh_prefill_kv_transfers_total{transport=\"tcp\"}").await, 0.0);
    assert_nothing_held(&mesh).await;

    // 2. Bad input: each a clear error; the mesh keeps serving.
    let long = "hello ".repeat(9000);
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "not valid JSON"),
        (r#"{"model":"smollm2-135m-instruct"}"#.into(), 400, "messages is required"),
        (r#"{"model":"smollm2-135m-instruct","messages":[]}"#.into(), 400, "must not be empty"),
        (r#"{"model":"smollm2-135m-instruct","messages":[{"role":"wizard","content":"hi"}]}"#.into(), 400, "role"),
        (chat_body("hi", r#","max_tokens":0"#), 400, "max_tokens"),
        (chat_body("hi", r#","max_tokens":-5"#), 400, "max_tokens"),
        (chat_body("hi", r#","max_tokens":100000"#), 400, "context"),
        (chat_body("hi", r#","temperature":7"#), 400, "temperature"),
        (chat_body(&long, r#","max_tokens":4"#), 400, "context holds 8192"),
        (r#"{"model":"gpt-9","messages":[{"role":"user","content":"hi"}]}"#.into(), 404, "does not exist"),
    ];
    for (body, status, needle) in cases {
        let (st, resp) = mesh.post("/v1/chat/completions", &body, &[]);
        assert_eq!(st, status, "{}: {resp}", &body[..body.len().min(80)]);
        let v: serde_json::Value =
            serde_json::from_str(&resp).unwrap_or_else(|_| panic!("error body is not JSON: {resp}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
    }
    // A body declared larger than --max-body-bytes is refused before it is read.
    let (st, resp) = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&mesh.gateway).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
        write!(s, "{head}Content-Length: {}\r\nConnection: close\r\n\r\n", 5 << 20).unwrap();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        common::parse_response(&raw)
    };
    assert_eq!(st, 413, "{resp}");
    assert!(resp.contains("larger than the limit of 4194304 bytes") && resp.contains("\"error\""), "{resp}");
    let (st, resp) = pdmesh_testkit::http_get(&mesh.gateway, "/v1/chat/completions");
    assert_eq!(st, 405, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp).unwrap_or_else(|_| panic!("405 body is not JSON: {resp}"));
    assert_eq!(v["error"]["code"], "method_not_allowed", "{resp}");
    let (st, resp) = mesh.post("/v1/chat/completions", &chat_body("Say hi", r#","max_tokens":4,"temperature":0"#), &[]);
    assert_eq!(st, 200, "{resp}");
    // A client that reuses its request id is served every time.
    for _ in 0..2 {
        let (st, resp) = mesh.post(
            "/v1/chat/completions",
            &chat_body("Say hi", r#","max_tokens":4"#),
            &[("x-request-id", "client-retry-1")],
        );
        assert_eq!(st, 200, "{resp}");
        assert!(resp.contains("\"id\":\"client-retry-1\""), "{resp}");
    }

    // 3. Deadline shorter than the work: 504, nothing leaked.
    let (st, resp) = mesh.post(
        "/v1/chat/completions",
        &chat_body("Tell a long story", r#","max_tokens":150,"ignore_eos":true"#),
        &[("x-request-timeout", "0.5")],
    );
    assert_eq!(st, 504, "{resp}");
    assert_nothing_held(&mesh).await;

    // 4. Admission: a request that reserves nearly all of decode's KV makes
    // the next one get 429 at once; a client disconnect frees the blocks
    // (seen in /metrics) and requests succeed again.
    let gw = mesh.gateway.clone();
    let hog = std::thread::spawn(move || {
        start_stream(
            &gw,
            &chat_body("Count slowly to a million", r#","max_tokens":3000,"ignore_eos":true,"stream":true"#),
            4,
        )
    });
    assert!(
        eventually_async(Duration::from_secs(60), || async {
            mesh.gauge("decode", "pdmesh_decode_running").await == 1.0
        })
        .await,
        "the long request never started"
    );
    let conn = tokio::task::spawn_blocking(move || hog.join().unwrap()).await.unwrap();
    let used = mesh.gauge("decode", "pdmesh_decode_kv_blocks_used").await;
    assert!(used >= 180.0, "the long request should hold most blocks, holds {used}");
    let t0 = std::time::Instant::now();
    let (st, resp) = mesh.post("/v1/chat/completions", &chat_body("hi", r#","max_tokens":500"#), &[]);
    assert_eq!(st, 429, "{resp}");
    assert!(t0.elapsed() < Duration::from_secs(3), "refusal took {:?}", t0.elapsed());
    assert!(resp.contains("KV cache full"), "{resp}");
    drop(conn); // the client disconnects mid-stream
    assert_nothing_held(&mesh).await;
    assert!(mesh.gauge("decode", "pdmesh_decode_requests_total{outcome=\"cancelled\"}").await >= 1.0);
    let (st, resp) = mesh.post("/v1/chat/completions", &chat_body("hi", r#","max_tokens":20"#), &[]);
    assert_eq!(st, 200, "{resp}");

    // 5. Each service killed alone comes back; the others keep their processes.
    const ALL: [&str; 6] = ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"];
    for svc in ALL {
        let mut before = std::collections::HashMap::new();
        for s in ALL {
            before.insert(s, mesh.pid(s).await);
        }
        mesh.kill_and_wait(svc).await;
        let ok = eventually_async(Duration::from_secs(60), || async {
            matches!(mesh.post("/v1/chat/completions", &chat_body("Say hi", r#","max_tokens":4"#), &[]), (200, _))
        })
        .await;
        assert!(ok, "mesh does not serve after {svc} restarted");
        for s in ALL {
            if s != svc {
                assert_eq!(mesh.pid(s).await, before[s], "{s} was restarted when only {svc} died");
            }
        }
    }
}
