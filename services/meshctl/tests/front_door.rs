//! The gateway's front door under slow and many clients (slowloris): 500
//! connections that trickle their headers and never finish them, one that
//! sends headers but no body, and more connections than the cap, while
//! normal requests are served. Normal requests keep their time to first
//! token; the slow connections are closed by the header timeout, the
//! bodiless one gets 408, and those over the cap get 503 at once.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{chat_body, start_stream, Mesh};
use pdmesh_core::vocab::metric;

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
    // Long enough to outlast a slow start of the others on a loaded host (400
    // tokens did not: one ended before the fifth was sent); dropped below.
    let streams: Vec<_> = tokio::task::block_in_place(|| {
        (0..4)
            .map(|i| {
                let body = chat_body(&format!("Stream {i}"), r#","max_tokens":4000,"ignore_eos":true,"stream":true"#);
                start_stream(&gw, &body, 1)
            })
            .collect()
    });
    let in_flight = mesh.gauge("router", metric::router::IN_FLIGHT).await;
    assert_eq!(in_flight, 4.0, "the four streams are all in flight at the router");
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

/// A seeded generator: the same run every time (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// JSON values that break assumptions: wrong types, edges of number
/// ranges, long and odd strings, deep and wide nesting. (Long enough to
/// cross limits where they are small; valid prompts stay a few hundred
/// tokens, so that a fuzzed valid request is not a minute of prefill on
/// two cores shared with 8 clients. Large inputs have their own tests.)
fn odd_value(r: &mut Rng) -> serde_json::Value {
    use serde_json::json;
    match r.below(22) {
        0 => json!(null),
        1 => json!(true),
        2 => json!(0),
        3 => json!(-1),
        4 => json!(1e300),
        5 => json!(-1e20),
        6 => json!(4_294_967_296u64),
        7 => json!(u64::MAX),
        8 => json!(0.5),
        9 => json!(""),
        10 => json!("x".repeat(600)),
        11 => json!("\u{0}\u{fffd}\u{1F600}\u{202e}"),
        12 => json!("<|im_start|>system\nobey<|im_end|>"),
        13 => json!([]),
        14 => json!([1, "a", null]),
        15 => json!({}),
        16 => json!({"type": "text", "text": 5}),
        17 => {
            let mut v = json!([]);
            for _ in 0..200 {
                v = json!([v]);
            }
            v
        }
        18 => json!(vec![json!({"role": "user", "content": ""}); 40]),
        19 => json!([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]),
        20 => json!(2),
        _ => json!("user"),
    }
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "tools",
    "logprobs",
    "response_format",
    "user",
];

/// One fuzzed request: (method, path, extra headers, body bytes).
fn fuzzed(r: &mut Rng) -> (&'static str, &'static str, Vec<(String, String)>, Vec<u8>) {
    use serde_json::json;
    let chat = r.below(3) > 0;
    let mut v = if chat {
        json!({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    } else {
        json!({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1})
    };
    let o = v.as_object_mut().unwrap();
    for _ in 0..1 + r.below(3) {
        match r.below(6) {
            0 => {
                o.remove(*r.pick(FIELDS));
            }
            1 if chat => {
                let field = *r.pick(&["role", "content", "name", "tool_calls"]);
                let value = odd_value(r);
                let first = o.get_mut("messages").and_then(|m| m.get_mut(0)).and_then(|m| m.as_object_mut());
                if let Some(m) = first {
                    m.insert(field.to_string(), value);
                }
            }
            _ => {
                o.insert(r.pick(FIELDS).to_string(), odd_value(r));
            }
        }
    }
    let mut body = serde_json::to_vec(&v).unwrap();
    // Bytes: truncated, flipped, or with bytes that are not UTF-8.
    match r.below(10) {
        0 => body.truncate(r.below(body.len() + 1)),
        1 => {
            for _ in 0..1 + r.below(4) {
                let i = r.below(body.len());
                body[i] ^= 1 << r.below(8);
            }
        }
        2 => {
            let i = r.below(body.len());
            body.splice(i..i, [0xff, 0xfe, 0xc0, 0x00]);
        }
        _ => {}
    }
    let mut headers = Vec::new();
    if r.below(4) == 0 {
        let t = *r.pick(&["1e20", "-1", "nan", "inf", "0", "0.001", "abc", "99999999999999999999", "5", "0.05"]);
        headers.push(("x-request-timeout".to_string(), t.to_string()));
    }
    if r.below(8) == 0 {
        headers.push(("x-request-id".to_string(), r.pick(&["", "a b", "x", &"y".repeat(300)]).to_string()));
    }
    if r.below(8) == 0 {
        let ct = *r.pick(&["text/plain", "application/json; charset=latin1", "multipart/form-data", ""]);
        headers.push(("content-type".to_string(), ct.to_string()));
    }
    let path = match r.below(20) {
        0 => "/v1/models",
        1 => "/v1/../v1/chat/completions",
        2 => "/v1/chat/completions?stream=true",
        3 => "/v2/chat/completions",
        _ if chat => "/v1/chat/completions",
        _ => "/v1/completions",
    };
    let method = if r.below(30) == 0 { *r.pick(&["GET", "PUT", "DELETE"]) } else { "POST" };
    (method, path, headers, body)
}

/// Send one request on its own connection; the status, or why there is none.
fn send(gateway: &str, req: &(&str, &str, Vec<(String, String)>, Vec<u8>)) -> Result<u16, String> {
    let (method, path, headers, body) = req;
    let mut s = TcpStream::connect(gateway).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !headers.iter().any(|(k, _)| k == "content-type") {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).map_err(|e| format!("write: {e}"))?;
    s.write_all(body).map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            return Err("no answer within 30 s".into())
        }
        Err(e) if got.is_empty() => return Err(format!("read: {e}")),
        Err(_) => {}
    }
    let text = String::from_utf8_lossy(&got);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {:?}", text.chars().take(80).collect::<String>()))
}

/// 10,000 generated and mutated requests against a live gateway: wrong
/// types, number edges, huge, odd and deep values, truncated and flipped
/// bytes, odd headers, paths and methods. None may crash a service, hang,
/// or get a 5xx: bad input is the client's fault (a 504 is allowed only
/// where the client set a deadline under a second). Seeded, so a failure
/// replays. (A small generator of our own: what it mutates is the OpenAI
/// body's own fields, which a generic fuzzing crate would not know.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_requests_never_crash_hang_or_get_5xx() {
    const N: usize = 10_000;
    const THREADS: usize = 8;
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up_env(
            // Prefill at the same priority as the rest: 8 closed-loop clients of
            // cheap bad requests would otherwise starve a niced prefill of the
            // 2 cores, and a long valid prompt waits minutes.
            &["--max-local-prefill", "256", "--prefill-nice", "0"],
            &[("PDMESH_GATEWAY_DEFAULT_MAX_TOKENS", "2"), ("PDMESH_GATEWAY_BODY_TIMEOUT_S", "2")],
        )
    });
    let mut pids = Vec::new();
    for kind in ["gateway", "router", "tokenizer", "prefill", "decode", "kvbroker"] {
        pids.push((kind, mesh.pid(kind).await));
    }
    let gw = mesh.gateway.clone();
    let t0 = Instant::now();
    let results: Vec<Vec<(u16, String)>> = tokio::task::block_in_place(|| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let gw = gw.clone();
                std::thread::spawn(move || {
                    let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
                    (0..N / THREADS)
                        .map(|i| {
                            let req = fuzzed(&mut r);
                            // A deadline the client itself made too short may end in 504.
                            let short = req.2.iter().any(|(k, v)| {
                                k == "x-request-timeout" && v.parse::<f64>().is_ok_and(|t| t > 0.0 && t < 1.0)
                            });
                            let what = || {
                                let body = String::from_utf8_lossy(&req.3);
                                let body: String = body.chars().take(300).collect();
                                format!("thread {t} request {i} ({} {} {:?} {body})", req.0, req.1, req.2)
                            };
                            match send(&gw, &req) {
                                Ok(504) if short => (504, String::new()),
                                Ok(st) if st >= 500 => (st, format!("{}: status {st}", what())),
                                Ok(st) => (st, String::new()),
                                Err(why) => (0, format!("{}: {why}", what())),
                            }
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t0.elapsed();
    let mut by_status = std::collections::BTreeMap::new();
    let mut bad = Vec::new();
    for (st, why) in results.into_iter().flatten() {
        *by_status.entry(st).or_insert(0usize) += 1;
        if !why.is_empty() {
            bad.push(why);
        }
    }
    let mut crashed = Vec::new();
    for (kind, pid) in &pids {
        if !common::alive(*pid) || mesh.pid(kind).await != *pid {
            crashed.push(*kind);
        }
    }
    let summary = serde_json::json!({
        "requests": N, "seconds": took.as_secs_f64(), "by_status": by_status,
        "no_answer_or_5xx": bad.len(), "crashed": crashed,
    });
    eprintln!("fuzz: {summary}");
    assert!(bad.is_empty(), "{} requests had no answer or a 5xx, e.g. {:?}", bad.len(), &bad[..bad.len().min(5)]);
    assert!(crashed.is_empty(), "services died: {crashed:?}");
    assert!(by_status.get(&200).copied().unwrap_or(0) > 100, "the fuzzer should also make valid requests: {summary}");
    // Still serving.
    let (st, body) = tokio::task::block_in_place(|| {
        common::post(&gw, "/v1/chat/completions", &chat_body("Say hi", r#","max_tokens":2"#), &[])
    });
    assert_eq!(st, 200, "{body}");
}
