//! Faults around the KV transfer, each checked through /metrics: every
//! reserved or pinned block is free again within the lease (plus the
//! decode's quarantine of blocks a write may still reach), no ticket stays
//! live, and the affected request ends promptly with a clear status.
//! Test-only switches (`--enable-fault-injection`) stall the prefill's
//! transfer. KV moves over NIXL here.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{chat_request, raw_request, run, Mesh};
use tonic::Code;

const LEASE_MS: u64 = 3000;
/// Lease + quarantine + slack.
const RELEASED_WITHIN: Duration = Duration::from_secs(10);

/// A WriteKv claiming more positions than its request reserved is refused
/// before anything is allocated; the decode frees the reservation and keeps
/// serving.
async fn oversized_write_kv_is_refused(mesh: &Mesh) {
    use pdmesh_proto::common::v1 as cpb;
    use pdmesh_proto::decode::v1 as dpb;
    let d = mesh.instance("decode").await;
    let ch =
        tonic::transport::Channel::from_shared(format!("http://{}", d.grpc_addr)).unwrap().connect().await.unwrap();
    let mut dc = dpb::decode_client::DecodeClient::new(ch);
    let gen = dpb::GenerateRequest {
        request_id: "hostile-writer".into(),
        prompt_ids: vec![1, 2, 3],
        max_tokens: 4,
        ..Default::default()
    };
    let mut admitted = dc.generate(gen).await.unwrap().into_inner();
    admitted.message().await.unwrap().expect("the decode admits the request");
    let layout = cpb::KvLayout { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16, dtype: "f16".into() };
    let chunk = dpb::KvChunk {
        request_id: "hostile-writer".into(),
        layout: Some(layout),
        n_tokens: u32::MAX,
        ..Default::default()
    };
    let e = dc.write_kv(tokio_stream::iter(vec![chunk])).await.expect_err("an oversized WriteKv is refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("reserved 3"), "{e:?}");
    drop(admitted);
    mesh.assert_released(RELEASED_WITHIN).await;
    works(mesh).await;
}

async fn works(mesh: &Mesh) {
    let mut r = mesh.router().await;
    let o = run(&mut r, raw_request("The capital of France is", 4)).await.expect("a request after the fault");
    assert_eq!(o.ids.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kv_transfer_faults_free_everything() {
    let mesh = Mesh::up(&[
        "--decode-lease-ms",
        &LEASE_MS.to_string(),
        "--enable-fault-injection",
        "--decode-kv-blocks",
        "600",
    ]);
    let mut router = mesh.router().await;
    works(&mesh).await;

    // 1. The client cancels before the first token (the transfer is stalled).
    mesh.fault("prefill", "prefill.transfer_delay_ms", 1500).await;
    let s = router.generate(chat_request("Tell me a story", 64, true)).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(400)).await;
    drop(s);
    mesh.assert_released(RELEASED_WITHIN).await;
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    works(&mesh).await;

    // 2. The client cancels while tokens stream.
    let mut s = router.generate(chat_request("Tell me a long story", 300, true)).await.unwrap().into_inner();
    for _ in 0..3 {
        s.message().await.unwrap().unwrap();
    }
    drop(s);
    mesh.assert_released(RELEASED_WITHIN).await;

    // 3. A transfer stalled past its lease: the mesh's fault (UNAVAILABLE,
    // never the caller's deadline), retried once, then said in words soon
    // after the second lease.
    mesh.fault("prefill", "prefill.transfer_delay_ms", LEASE_MS + 1500).await;
    // Either worker may report the expired lease first: a prefill or a decode retry.
    let retried = || async {
        mesh.gauge("router", "pdmesh_router_decode_retries_total").await
            + mesh.gauge("router", "pdmesh_router_prefill_retries_total").await
    };
    let retries = retried().await;
    let t0 = Instant::now();
    let e = run(&mut router, raw_request("Hello", 8)).await.expect_err("a stalled transfer must fail");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("lease"), "{e:?}");
    assert!(t0.elapsed() < Duration::from_millis(2 * LEASE_MS + 3000), "took {:?}", t0.elapsed());
    assert_eq!(retried().await, retries + 1.0, "retried once");
    mesh.assert_released(RELEASED_WITHIN).await;
    assert!(mesh.gauge("kvbroker", "pdmesh_kvbroker_lease_expiries_total").await >= 1.0);
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    works(&mesh).await;

    // 4. The prefill dies after the ticket opened. The router retries once
    // (on the same worker: it is the only one), which succeeds only if the
    // replacement is up by then; either way the request ends promptly and
    // cleanly.
    mesh.fault("prefill", "prefill.transfer_delay_ms", 2000).await;
    let retries = mesh.gauge("router", "pdmesh_router_prefill_retries_total").await;
    let mut r2 = router.clone();
    let req = tokio::spawn(async move { run(&mut r2, raw_request("Hello there", 8)).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    mesh.kill_and_wait("prefill").await;
    match req.await.unwrap() {
        Ok(_) => assert!(
            mesh.gauge("router", "pdmesh_router_prefill_retries_total").await > retries,
            "served without a retry?"
        ),
        Err(e) => assert!(matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded), "{e:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(60));
    mesh.assert_released(RELEASED_WITHIN).await;
    works(&mesh).await;

    // 5. The decode dies during the transfer. It is the only one: the
    // router waits for its replacement (--worker-wait-ms) and dispatches
    // again, or, if it is not back in time, fails cleanly.
    mesh.fault("prefill", "prefill.transfer_delay_ms", 1500).await;
    let retries = mesh.gauge("router", "pdmesh_router_decode_retries_total").await;
    let mut r2 = router.clone();
    let req = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(15), run(&mut r2, raw_request("Hello again", 8))).await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    mesh.kill_and_wait("decode").await;
    match req.await.unwrap().expect("ends promptly") {
        Ok(o) => {
            assert_eq!(o.ids.len(), 8);
            assert!(
                mesh.gauge("router", "pdmesh_router_decode_retries_total").await > retries,
                "served without a retry?"
            );
        }
        Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e:?}"),
    }
    mesh.assert_released(RELEASED_WITHIN).await;
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    works(&mesh).await;

    // 6. The broker restarts with transfers in flight: they fail cleanly, new ones succeed.
    mesh.fault("prefill", "prefill.transfer_delay_ms", 1500).await;
    let mut inflight = Vec::new();
    for i in 0..3 {
        let mut r2 = router.clone();
        inflight.push(tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(15), run(&mut r2, raw_request(&format!("Count to {i}"), 8))).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    mesh.kill_and_wait("kvbroker").await;
    for t in inflight {
        let e = t.await.unwrap().expect("ends promptly").expect_err("in-flight transfers fail");
        assert!(matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled), "{e:?}");
    }
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    mesh.assert_released(RELEASED_WITHIN).await;
    let ok = pdmesh_testkit::eventually_async(Duration::from_secs(20), || async {
        let mut r = mesh.router().await;
        run(&mut r, raw_request("The capital of France is", 4)).await.is_ok()
    })
    .await;
    assert!(ok, "new transfers never succeeded after the broker restart");

    // 7. A hostile KV write.
    oversized_write_kv_is_refused(&mesh).await;
}

/// What every storm prompt starts with: more than two KV blocks.
const STORM_PREFIX: &str = "You are the weather reporter of a small coastal town. Keep every report short, \
    cheerful and accurate, mention the wind and the tide, and never promise sunshine you cannot see.";

/// 200 requests at concurrency 32, half cancelled at random moments, all
/// sharing a prefix (so most hit the prefill's prefix cache): no block stays
/// pinned or reserved, every prefill block ends free or cached and
/// unreferenced, and the next requests run at normal speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_storm_leaves_nothing_pinned() {
    let mesh = Mesh::up(&["--decode-kv-blocks", "800", "--decode-max-batch", "32"]);
    let router = mesh.router().await;
    let mut r = router.clone();
    let t0 = Instant::now();
    run(&mut r, raw_request("The capital of France is", 16)).await.unwrap();
    let baseline = t0.elapsed();

    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let plan: Vec<(bool, u64)> = (0..200).map(|_| (next() % 2 == 0, next() % 1500)).collect();
    let plan = std::sync::Arc::new(std::sync::Mutex::new(plan.into_iter().enumerate().collect::<Vec<_>>()));
    let mut workers = Vec::new();
    for _ in 0..32 {
        let (plan, router) = (plan.clone(), router.clone());
        workers.push(tokio::spawn(async move {
            let (mut ok, mut cancelled, mut failed) = (0, 0, Vec::new());
            loop {
                let Some((i, (cancel, after_ms))) = plan.lock().unwrap().pop() else { return (ok, cancelled, failed) };
                let mut r = router.clone();
                let prompt = format!("{STORM_PREFIX} Item {i}: the weather today is");
                let fut = run(&mut r, raw_request(&prompt, 24));
                if cancel {
                    if tokio::time::timeout(Duration::from_millis(after_ms), fut).await.is_err() {
                        cancelled += 1;
                    } else {
                        ok += 1;
                    }
                } else {
                    match tokio::time::timeout(Duration::from_secs(120), fut).await {
                        Ok(Ok(_)) => ok += 1,
                        Ok(Err(e)) => failed.push(format!("{:?}: {}", e.code(), e.message())),
                        Err(_) => failed.push("no end within 120 s".to_string()),
                    }
                }
            }
        }));
    }
    let (mut ok, mut cancelled, mut failed) = (0, 0, Vec::new());
    for w in workers {
        let (a, b, c) = w.await.unwrap();
        ok += a;
        cancelled += b;
        failed.extend(c);
    }
    assert_eq!(ok + cancelled + failed.len(), 200);
    assert_eq!(failed.len(), 0, "requests that were not cancelled must succeed: {failed:?}");
    assert!(cancelled >= 50, "the storm should cancel many requests, cancelled {cancelled}");
    mesh.assert_released(RELEASED_WITHIN).await;
    let hits = mesh.gauge("prefill", "pdmesh_prefill_prefix_hit_tokens_total").await;
    assert!(hits >= 50.0 * 32.0, "the storm's shared prefix should be reused: {hits} tokens");
    let t0 = Instant::now();
    let mut r = router.clone();
    run(&mut r, raw_request("The capital of France is", 16)).await.unwrap();
    let after = t0.elapsed();
    assert!(
        after < baseline * 3 + Duration::from_millis(300),
        "after the storm a request took {after:?}, before {baseline:?}"
    );
}

/// Kill one of two prefill workers while four requests wait on their
/// transfers: the ones it held are retried on the other, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefill_killed_before_the_first_token_fails_no_request() {
    let mesh = Mesh::up(&["--prefill-replicas", "2", "--enable-fault-injection", "--router-policy", "least-busy"]);
    works(&mesh).await;
    mesh.fault("prefill", "prefill.transfer_delay_ms", 2500).await;
    let mut reqs = Vec::new();
    for i in 0..4 {
        let mut r = mesh.router().await;
        reqs.push(tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(30), run(&mut r, raw_request(&format!("Count to {i}"), 8))).await
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let victim = mesh.registry().healthy("prefill").await.unwrap().remove(0);
    let pid = common::pid_of(&victim);
    // SAFETY: kill(2) on a mesh child process.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    for r in reqs {
        let out = r.await.unwrap().expect("ends within 30 s");
        out.expect("a request whose prefill died before its first token is retried");
    }
    assert!(mesh.gauge("router", "pdmesh_router_prefill_retries_total").await >= 1.0);
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    mesh.assert_released(RELEASED_WITHIN).await;
}

/// A prefill worker whose engine loop dies (an injected panic, as a bug in
/// a kernel would cause) leaves service and exits with an error; `meshctl
/// up` starts a fresh one, and requests are served again. The request that
/// met the dead loop ends with a clean UNAVAILABLE, never a client error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_engine_loop_takes_its_worker_out_and_a_fresh_one_serves() {
    let mesh = Mesh::up(&["--enable-fault-injection"]);
    let before = mesh.pid("prefill").await;
    mesh.fault("prefill", "engine.loop_panic", 1).await;
    let mut r = mesh.router().await;
    let t0 = Instant::now();
    let met = run(&mut r, raw_request("The capital of France is", 4)).await;
    eprintln!("the request that met the dead loop: {:?} after {:?}", met.as_ref().map(|_| "ok"), t0.elapsed());
    if let Err(e) = &met {
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    }
    let t0 = Instant::now();
    loop {
        if !common::alive(before) {
            let i = mesh.registry().healthy("prefill").await.unwrap();
            if !i.is_empty() && mesh.pid("prefill").await != before {
                break;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no fresh prefill worker after 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("a fresh prefill worker serves {:?} after the dead loop's request ended", t0.elapsed());
    let mut r = mesh.router().await;
    run(&mut r, raw_request("The capital of France is", 4)).await.expect("served again");
}

/// A router that stops answering mid-stream without closing it (frozen:
/// SIGSTOP; or stuck) cannot hold a streamed request past its deadline:
/// the gateway ends it there with a `deadline_exceeded` error event, long
/// before HTTP/2 keepalive would notice the router (10 s + 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_router_cannot_hold_a_stream_past_its_deadline() {
    let mesh = Mesh::up(&[]);
    let router = mesh.pid("router").await;
    let gateway = mesh.gateway.clone();
    let body = common::chat_body("Count to a thousand", r#","max_tokens":4000,"ignore_eos":true,"stream":true"#);
    let t0 = Instant::now();
    let headers = [("x-request-timeout", "4"), ("Connection", "close")];
    let mut s = tokio::task::block_in_place(|| common::start_stream_with(&gateway, &body, 2, &headers));
    common::signal(router, libc::SIGSTOP);
    let mut rest = String::new();
    let read = tokio::task::block_in_place(|| std::io::Read::read_to_string(&mut s, &mut rest));
    let took = t0.elapsed();
    common::signal(router, libc::SIGCONT);
    read.unwrap();
    assert!(rest.contains("deadline_exceeded"), "the stream ended without a deadline error: {rest}");
    assert!(took < Duration::from_secs(6), "the 4 s stream ended after {took:?}");
    mesh.assert_released(Duration::from_secs(30)).await;
}
