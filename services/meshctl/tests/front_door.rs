//! The gateway's front door under slow and many clients (slowloris): 500
//! connections that trickle their headers and never finish them, one that
//! sends headers but no body, and more connections than the cap, while
//! normal requests are served. Normal requests keep their time to first
//! token; the slow connections are closed by the header timeout, the
//! bodiless one gets 408, and those over the cap get 503 at once.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{chat_body, start_stream, Mesh};

const SLOW: usize = 500;
const HEADER_TIMEOUT_S: u64 = 8;

/// Time to the first SSE event of a short streamed chat request (each
/// with a prompt of its own, so no prefix cache shortens it).
fn ttft(gateway: &str) -> Duration {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prompt = format!("Request {n}: name three colours that go well with the number {}.", n * 7919);
    let body = chat_body(&prompt, r#","max_tokens":4,"stream":true,"temperature":0"#);
    let t0 = Instant::now();
    let s = start_stream(gateway, &body, 1);
    let t = t0.elapsed();
    drop(s);
    t
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A connection that starts a request and sends one more header byte now
/// and then, never the blank line that ends the headers.
fn slow_connection(gateway: &str) -> TcpStream {
    let mut s = TcpStream::connect(gateway).unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a").unwrap();
    s
}

/// Whether the server closed `s` (EOF or reset), waiting up to `within`.
fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_neither_starve_requests_nor_stay_open() {
    let timeout = HEADER_TIMEOUT_S.to_string();
    let cap = (SLOW + 20).to_string();
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up_env(
            &[],
            &[
                ("PDMESH_GATEWAY_HEADER_TIMEOUT_S", timeout.as_str()),
                ("PDMESH_GATEWAY_BODY_TIMEOUT_S", "2"),
                ("PDMESH_GATEWAY_MAX_CONNECTIONS", cap.as_str()),
            ],
        )
    });
    let gw = mesh.gateway.clone();
    let (idle, loaded, mut slow, refused) = tokio::task::block_in_place(|| {
        let _warm = ttft(&gw);
        let idle = median((0..3).map(|_| ttft(&gw)).collect());
        let t0 = Instant::now();
        let mut slow: Vec<TcpStream> = (0..SLOW).map(|_| slow_connection(&gw)).collect();
        // Trickle: one more byte on each, a second later.
        std::thread::sleep(Duration::from_secs(1));
        for s in &mut slow {
            let _ = s.write_all(b"b");
        }
        let loaded = median((0..3).map(|_| ttft(&gw)).collect());
        // Over the cap: answered 503 and closed, not left waiting.
        let mut refused = 0;
        let extra: Vec<TcpStream> = (0..40).map(|_| TcpStream::connect(&gw).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(500));
        for mut s in extra {
            // What has arrived by now (the accepted ones have nothing to say).
            s.set_nonblocking(true).unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while let Ok(n @ 1..) = s.read(&mut buf) {
                got.extend_from_slice(&buf[..n]);
            }
            let got = String::from_utf8_lossy(&got);
            if got.starts_with("HTTP/1.1 503") && got.contains("too_many_connections") {
                refused += 1;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(HEADER_TIMEOUT_S), "the slow part took too long to measure");
        (idle, loaded, slow, refused)
    });
    eprintln!("TTFT idle {idle:?}, with {SLOW} slow connections {loaded:?}; {refused} of 40 over the cap refused");
    assert!(loaded <= idle * 2 + Duration::from_millis(50), "TTFT {loaded:?} with slow clients, {idle:?} without");
    assert!(refused >= 19, "connections over the cap get 503 at once: {refused} of 40");

    // The 40 extra connections closed (by this side): their slots come back.
    let t0 = Instant::now();
    while mesh.gauge("gateway", "pdmesh_gateway_connections").await > SLOW as f64 {
        assert!(t0.elapsed() < Duration::from_secs(5), "closed connections still counted open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A body that never comes: 408 once the body timeout passes.
    let body_wait = tokio::task::block_in_place(|| {
        let mut s = TcpStream::connect(&gw).unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t0 = Instant::now();
        let mut got = vec![0u8; 4096];
        let n = s.read(&mut got).unwrap();
        let got = String::from_utf8_lossy(&got[..n]).to_string();
        assert!(got.starts_with("HTTP/1.1 408") && got.contains("request_timeout"), "{got}");
        t0.elapsed()
    });
    assert!(body_wait < Duration::from_secs(4), "408 after the 2 s body timeout, got it after {body_wait:?}");

    // The slow ones are closed by the server at the header timeout.
    let closed = tokio::task::block_in_place(|| {
        slow.iter_mut().map(|s| closed_by_server(s, Duration::from_secs(HEADER_TIMEOUT_S + 5))).filter(|c| *c).count()
    });
    eprintln!("{closed} of {SLOW} slow connections closed by the gateway; 408 after {body_wait:?}");
    assert_eq!(closed, SLOW);
    let open = mesh.gauge("gateway", "pdmesh_gateway_connections").await;
    assert!(open <= 2.0, "connections left open: {open}");
    let n = mesh.gauge("gateway", "pdmesh_gateway_connections_refused_total").await;
    assert!(n >= refused as f64, "{n}");
    // And it still serves.
    assert!(tokio::task::block_in_place(|| ttft(&gw)) < Duration::from_secs(5));
}

/// The prefill queue and the router's requests in flight are bounded:
/// past each bound a request is refused at once with a status that says
/// to retry (503 or 429, `Retry-After`), not queued without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_queues_refuse_at_once_with_retry_after() {
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up_env(
            &["--enable-fault-injection"],
            &[("PDMESH_PREFILL_MAX_QUEUE", "2"), ("PDMESH_ROUTER_MAX_IN_FLIGHT", "4")],
        )
    });
    let gw = mesh.gateway.clone();
    // Two prompts held in the prefill queue fill it.
    mesh.fault("prefill", "prefill.queue_hold_ms", 4000).await;
    let held: Vec<_> = (0..2)
        .map(|i| {
            let gw = gw.clone();
            std::thread::spawn(move || {
                common::post(
                    &gw,
                    "/v1/chat/completions",
                    &chat_body(&format!("Held {i}: hello"), r#","max_tokens":1"#),
                    &[],
                )
            })
        })
        .collect();
    let t0 = Instant::now();
    while mesh.gauge("prefill", "pdmesh_prefill_queued").await < 2.0 {
        assert!(t0.elapsed() < Duration::from_secs(3), "the two prompts never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, retry, body) = tokio::task::block_in_place(|| {
        let t = Instant::now();
        let r = common::post_header(
            &gw,
            "/v1/chat/completions",
            &chat_body("One too many", r#","max_tokens":1"#),
            &[],
            "retry-after",
        );
        assert!(t.elapsed() < Duration::from_secs(2), "refused at once, not after {:?}", t.elapsed());
        r
    });
    eprintln!("over the prefill queue bound: {st} retry-after {retry:?}: {body}");
    assert_eq!((st, retry.as_deref()), (503, Some("1")), "{body}");
    assert!(body.contains("wait for a prefill step") && !body.contains("prefill-0"), "{body}");
    mesh.fault("prefill", "prefill.queue_hold_ms", 0).await;
    for h in held {
        let (st, body) = h.join().unwrap();
        assert_eq!(st, 200, "the queued ones are served: {body}");
    }

    // Four long streams are the router's limit; a fifth request gets 429.
    let streams: Vec<_> = tokio::task::block_in_place(|| {
        (0..4)
            .map(|i| {
                let body = chat_body(&format!("Stream {i}"), r#","max_tokens":400,"ignore_eos":true,"stream":true"#);
                start_stream(&gw, &body, 1)
            })
            .collect()
    });
    let (st, retry, body) = tokio::task::block_in_place(|| {
        common::post_header(&gw, "/v1/chat/completions", &chat_body("Fifth", r#","max_tokens":1"#), &[], "retry-after")
    });
    eprintln!("over the router's in-flight bound: {st} retry-after {retry:?}: {body}");
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "{body}");
    assert!(body.contains("router_busy"), "{body}");
    drop(streams);
    // Once they end, requests are served again.
    let t0 = Instant::now();
    loop {
        let (st, _) = tokio::task::block_in_place(|| {
            common::post(&gw, "/v1/chat/completions", &chat_body("After", r#","max_tokens":1"#), &[])
        });
        if st == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "still refused: {st}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
