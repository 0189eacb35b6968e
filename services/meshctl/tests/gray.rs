//! Gray failures with the real model: a decode worker that stops without
//! dying. Frozen (SIGSTOP) mid-stream, it stays registered and its port
//! takes connections, but nothing comes back; with its engine loop stuck
//! (a fault: the loop sleeps while the worker's other threads answer), it
//! answers its load polls and says it is stuck. Either way the router
//! moves the stream to the other decode worker within about a second of
//! patience, the caller's tokens equal an undisturbed run (none repeated,
//! none missing), the worker is ejected (the router's /statusz says why)
//! and, once it moves again, it is picked again.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use pdmesh_core::vocab::metric;
use pdmesh_proto::router::v1 as pb;

type Router = pb::router_client::RouterClient<tonic::transport::Channel>;

/// The decode worker running a sequence now (by its /metrics): id, pid, admin address.
async fn busy_decode(mesh: &Mesh) -> (String, i32, String) {
    for i in mesh.registry().healthy("decode").await.unwrap() {
        let http = i.http_addr.clone().unwrap();
        let (_, m) = pdmesh_testkit::http_get(&http, "/metrics");
        if pdmesh_core::http::metric(&m, metric::decode::RUNNING).unwrap_or(0.0) >= 1.0 {
            return (i.id.clone(), pid_of(&i), http);
        }
    }
    panic!("no decode worker is running the request");
}

/// The router's /statusz `runtime.workers_out`.
async fn workers_out(mesh: &Mesh) -> Vec<serde_json::Value> {
    let r = mesh.instance("router").await;
    let (_, body) = pdmesh_testkit::http_get(r.http_addr.as_deref().unwrap(), "/statusz");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["runtime"]["workers_out"].as_array().cloned().unwrap_or_default()
}

/// `stalls_total{kind="decode"}` at the router.
async fn decode_stalls(mesh: &Mesh) -> f64 {
    let t = mesh.metrics("router").await;
    pdmesh_core::http::metric(&t, &format!("{}{{kind=\"decode\"}}", metric::router::STALLS_TOTAL)).unwrap_or(0.0)
}

/// Run `req`, calling `hit` with the busy decode worker once `after`
/// tokens arrived; the outcome and what `hit` returned.
async fn disturbed<T>(
    mesh: &Mesh,
    router: &mut Router,
    req: pb::GenerateRequest,
    after: usize,
    hit: impl AsyncFnOnce(&(String, i32, String)) -> T,
) -> (Outcome, (String, T)) {
    let mut s = router.generate(req).await.unwrap().into_inner();
    let (mut o, mut hit, mut done) = (Outcome::default(), Some(hit), None);
    while let Some(m) = s.message().await.unwrap() {
        o.take(m);
        if o.ids.len() >= after {
            if let Some(h) = hit.take() {
                let w = busy_decode(mesh).await;
                let t = h(&w).await;
                done = Some((w.0, t));
            }
        }
    }
    (o, done.expect("the request outlived the fault"))
}

/// Requests until one is served by `worker` (picked again after its
/// ejection), within `within`.
async fn served_again(router: &mut Router, req: &pb::GenerateRequest, worker: &str, within: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        let o = run(router, req.clone()).await.unwrap();
        if o.finished.unwrap().decode_worker == worker {
            return true;
        }
    }
    false
}

fn check_undisturbed(name: &str, o: &Outcome, calm: &Outcome, worker: &str) {
    let f = o.finished.as_ref().expect("the request finished");
    eprintln!("{name}: {worker} -> {}, longest gap {:?}", f.decode_worker, o.longest_gap);
    assert_ne!(f.decode_worker, worker, "{name}: finished on the other decode worker");
    assert_eq!(o.ids, calm.ids, "{name}: the same tokens as undisturbed, none repeated or missing");
    assert_eq!(o.text, calm.text, "{name}");
    // A second of patience, then the prompt and tokens so far prefilled on the other worker.
    assert!(o.longest_gap < Duration::from_millis(3500), "{name}: the stream stalled {:?}", o.longest_gap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_or_stuck_decode_worker_costs_a_stream_a_second_and_is_ejected_then_readmitted() {
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up_env(
            &["--decode-replicas", "2", "--threads", "1", "--enable-fault-injection"],
            &[("PDMESH_UNHEALTHY_AFTER_STALL_S", "1.5")],
        )
    });
    let mut router = mesh.router().await;
    let req = chat_request("Write a short story about a lighthouse keeper.", 64, true);
    let calm = run(&mut router, req.clone()).await.unwrap();
    assert_eq!(calm.ids.len(), 64);

    // Frozen: SIGSTOP for 5 s (the registry's and the transport's timers are longer).
    let before = decode_stalls(&mesh).await;
    let (o, (frozen, pid)) = disturbed(&mesh, &mut router, req.clone(), 16, async |(_, pid, _)| {
        signal(*pid, libc::SIGSTOP);
        *pid
    })
    .await;
    check_undisturbed("frozen", &o, &calm, &frozen);
    assert!(decode_stalls(&mesh).await > before, "the router counted the stall");
    // Still frozen: the router says whom it leaves out, and why.
    let out = workers_out(&mesh).await;
    eprintln!("router statusz workers_out: {out:?}");
    let said = out.iter().find(|w| w["worker"] == frozen.as_str()).unwrap_or_else(|| panic!("{out:?}"));
    assert!(said["why"].as_str().unwrap().contains("1 stall in 10 s"), "{said}");
    let status = tokio::task::block_in_place(|| {
        let reg = mesh.dir.join("registry").display().to_string();
        String::from_utf8(meshctl(&["status"], &["--registry-dir", &reg]).stdout).unwrap()
    });
    let line = format!("by router-0: decode {frozen}: 1 stall in 10 s");
    assert!(status.contains(&line), "meshctl status says {line:?}:\n{status}");
    // Frozen, it is not picked: requests meanwhile go to the other worker, undelayed.
    let o = run(&mut router, req.clone()).await.unwrap();
    assert_ne!(o.finished.unwrap().decode_worker, frozen);
    assert!(o.longest_gap < Duration::from_secs(1), "{:?}", o.longest_gap);
    tokio::time::sleep(Duration::from_secs(3)).await;
    signal(pid, libc::SIGCONT);
    assert!(served_again(&mut router, &req, &frozen, Duration::from_secs(60)).await, "{frozen} was not picked again");

    // Stuck: the engine loop sleeps 4 s; the worker answers and says so,
    // and its health fails meanwhile (1.5 s without progress).
    let before = decode_stalls(&mesh).await;
    let (o, (stuck, health)) = disturbed(&mesh, &mut router, req.clone(), 16, async |(id, _, http)| {
        let (st, body) =
            pdmesh_core::http::put(http, "/faults/engine.loop_stall_ms/4000", Duration::from_secs(5)).unwrap();
        assert_eq!(st, 200, "{id}: {body}");
        let t0 = Instant::now();
        let mut worst = 200;
        while t0.elapsed() < Duration::from_secs(4) && worst == 200 {
            worst = pdmesh_core::http::get(http, "/health", Duration::from_secs(2)).map(|r| r.0).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        worst
    })
    .await;
    check_undisturbed("stuck", &o, &calm, &stuck);
    assert!(decode_stalls(&mesh).await > before, "the router counted the stall");
    assert_eq!(health, 503, "{stuck}: /health failed while its engine loop was stuck");
    assert!(served_again(&mut router, &req, &stuck, Duration::from_secs(60)).await, "{stuck} was not picked again");
    mesh.assert_released(Duration::from_secs(30)).await;
}

/// The router serving a stream now (by its in-flight gauge): id and pid.
async fn busy_router(mesh: &Mesh) -> (String, i32) {
    for i in mesh.registry().healthy("router").await.unwrap() {
        let (_, m) = pdmesh_testkit::http_get(i.http_addr.as_deref().unwrap(), "/metrics");
        if pdmesh_core::http::metric(&m, metric::router::IN_FLIGHT).unwrap_or(0.0) >= 1.0 {
            return (i.id.clone(), pid_of(&i));
        }
    }
    panic!("no router is serving the request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_router_costs_a_stream_a_second_at_the_gateway() {
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--router-replicas", "2", "--threads", "1"]));
    let body = chat_body(
        "Write a short story about a lighthouse keeper.",
        r#","max_tokens":64,"ignore_eos":true,"stream":true"#,
    );
    let (calm, _) = tokio::task::block_in_place(|| sse(&mesh.gateway, &body, 0, || {}));
    // Frozen after 16 tokens: the gateway moves the stream on.
    let rt = tokio::runtime::Handle::current();
    let mut frozen = None;
    let (text, gap) = tokio::task::block_in_place(|| {
        sse(&mesh.gateway, &body, 16, || {
            let (id, pid) = rt.block_on(busy_router(&mesh));
            signal(pid, libc::SIGSTOP);
            frozen = Some((id, pid));
        })
    });
    let frozen = frozen.expect("the stream outlived the freeze");
    eprintln!("frozen router {}: longest gap {gap:?}", frozen.0);
    assert_eq!(text, calm, "the same text as undisturbed, nothing repeated or missing");
    assert!(gap < Duration::from_millis(3500), "the stream stalled {gap:?}");
    let gw = mesh.instance("gateway").await;
    let (_, body) = pdmesh_testkit::http_get(gw.http_addr.as_deref().unwrap(), "/statusz");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let out = v["runtime"]["workers_out"].as_array().cloned().unwrap_or_default();
    assert!(out.iter().any(|w| w["worker"] == frozen.0.as_str()), "the gateway leaves {} out: {out:?}", frozen.0);
    signal(frozen.1, libc::SIGCONT);
}

/// Stream `body` through the gateway, calling `hit` once `after` events
/// arrived: the text of the deltas, and the longest gap between events.
fn sse(gateway: &str, body: &str, after: usize, mut hit: impl FnMut()) -> (String, Duration) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(gateway).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close";
    write!(s, "{head}\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let (mut raw, mut buf, mut gap, mut last, mut hit) =
        (Vec::new(), [0u8; 4096], Duration::ZERO, None, Some(&mut hit));
    loop {
        let k = s.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..k]);
        let now = Instant::now();
        if let Some(t) = last.replace(now) {
            gap = gap.max(now - t);
        }
        if String::from_utf8_lossy(&raw).matches("data:").count() >= after.max(1) {
            if let Some(h) = hit.take().filter(|_| after > 0) {
                h();
            }
        }
    }
    let (code, text) = parse_response(&raw);
    assert_eq!(code, 200, "{text}");
    let deltas = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok());
    (deltas.filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(String::from)).collect(), gap)
}
