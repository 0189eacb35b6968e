//! The tool's numbers against an in-test OpenAI-compatible server whose
//! latencies are programmed: what it reports must be what the server was
//! told to do, within stated tolerances; a server that stops mid-stream
//! yields stalled requests (with ids), not a hung tool; refusals are errors
//! by kind.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pdmesh_loadtest::client::Outcome;
use pdmesh_loadtest::report::{aggregate, Slo};
use pdmesh_loadtest::run::{agentic, closed_loop, poisson, Workload};

#[derive(Clone)]
struct Program {
    ttft: Duration,
    interval: Duration,
    tokens: usize,
    /// Stop sending (but keep the connection open) after this many tokens.
    stall_after: Option<usize>,
    status: u16,
    /// Messages in each request received, with its arrival time.
    seen: Arc<std::sync::Mutex<Vec<(Instant, usize)>>>,
}

async fn chat(State(p): State<Arc<Program>>, body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    p.seen.lock().unwrap().push((Instant::now(), v["messages"].as_array().map(|m| m.len()).unwrap_or(0)));
    if p.status != 200 {
        let body = serde_json::json!({ "error": { "message": "programmed refusal", "type": "rate_limit_error" } });
        return (StatusCode::from_u16(p.status).unwrap(), body.to_string()).into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        tokio::time::sleep(p.ttft).await;
        for i in 0..p.tokens {
            if i > 0 {
                tokio::time::sleep(p.interval).await;
            }
            if p.stall_after == Some(i) {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            let c = serde_json::json!({ "choices": [{ "index": 0, "delta": { "content": "tok " }, "finish_reason": null }] });
            if tx.send(Ok(Bytes::from(format!("data: {c}\n\n")))).await.is_err() {
                return;
            }
        }
        let u = serde_json::json!({ "choices": [], "usage": { "prompt_tokens": 5, "completion_tokens": p.tokens } });
        let _ = tx.send(Ok(Bytes::from(format!("data: {u}\n\ndata: [DONE]\n\n")))).await;
    });
    ([("content-type", "text/event-stream")], Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .into_response()
}

async fn server(p: Program) -> String {
    server_arc(Arc::new(p)).await
}

async fn server_arc(p: Arc<Program>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = axum::Router::new().route("/v1/chat/completions", axum::routing::post(chat)).with_state(p);
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

fn workload(addr: String, stall: Duration) -> Workload {
    Workload {
        addr,
        model: "m".into(),
        max_tokens: 16,
        seed: 7,
        stall,
        timeout: Duration::from_secs(30),
        temperature: 0.0,
        id_prefix: "lt-7".into(),
        ignore_eos: false,
        prompts: Default::default(),
    }
}

fn stop() -> Arc<std::sync::atomic::AtomicBool> {
    Arc::new(std::sync::atomic::AtomicBool::new(false))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_what_the_server_was_programmed_to_do() {
    let (ttft, interval, tokens) = (Duration::from_millis(200), Duration::from_millis(20), 16);
    let addr =
        server(Program { ttft, interval, tokens, stall_after: None, status: 200, seen: Default::default() }).await;
    let w = workload(addr, Duration::from_secs(5));
    let (records, wall) = closed_loop(&w, 4, 12, Duration::from_secs(60), stop(), 0).await;
    let p = aggregate(4, &records, wall, Slo { ttft_s: 0.5, tpot_s: 0.05 });
    assert_eq!((p.ok, p.errors, p.stalled), (12, 0, 0));
    assert_eq!(p.output_tokens, 12 * tokens, "usage chunks give the token count");
    // Tolerances: TTFT within +60 ms (scheduling, loopback), never below; gaps within +-10 ms at the median.
    let t = p.ttft_s.as_ref().unwrap();
    assert!(t.p50 >= 0.2 && t.p50 < 0.26, "TTFT p50 {}", t.p50);
    let g = p.inter_token_s.as_ref().unwrap();
    assert!((g.p50 - 0.020).abs() < 0.010, "inter-token p50 {}", g.p50);
    let tpot = p.tpot_s.as_ref().unwrap();
    assert!((tpot.p50 - 0.020).abs() < 0.010, "TPOT p50 {}", tpot.p50);
    // Each client does 3 requests of ~0.2 + 15 x 0.02 = 0.5 s: about 1.5 s of wall, 4 x 16 tokens per 0.5 s.
    let expected_tps = 4.0 * tokens as f64 / 0.5;
    assert!(
        p.output_tokens_per_s > expected_tps * 0.75 && p.output_tokens_per_s <= expected_tps * 1.05,
        "{} tok/s vs {expected_tps}",
        p.output_tokens_per_s
    );
    // All met the SLO.
    assert!((p.goodput_rps - p.requests_per_s).abs() < 1e-9);
    // A tighter TTFT SLO than the server's: no goodput.
    let p2 = aggregate(4, &records, wall, Slo { ttft_s: 0.1, tpot_s: 0.05 });
    assert_eq!(p2.goodput_rps, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_mid_stream_gives_stalled_requests_not_a_hang() {
    let addr = server(Program {
        ttft: Duration::from_millis(50),
        interval: Duration::from_millis(10),
        tokens: 16,
        stall_after: Some(5),
        status: 200,
        seen: Default::default(),
    })
    .await;
    let w = workload(addr, Duration::from_millis(500));
    let t0 = Instant::now();
    let (records, wall) = closed_loop(&w, 2, 4, Duration::from_secs(60), stop(), 0).await;
    assert!(t0.elapsed() < Duration::from_secs(5), "the tool hung for {:?}", t0.elapsed());
    let p = aggregate(2, &records, wall, Slo { ttft_s: 1.0, tpot_s: 1.0 });
    assert_eq!((p.ok, p.errors, p.stalled), (0, 0, 4));
    assert_eq!(p.stalled_ids.len(), 4);
    assert!(p.stalled_ids.iter().all(|id| id.starts_with("lt-7-0-")), "{:?}", p.stalled_ids);
    assert!(records.iter().all(|r| r.outcome == Outcome::Stalled && r.chunks == 5 && r.ttft_s.is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_dead_targets_are_errors_by_kind() {
    let addr = server(Program {
        ttft: Duration::ZERO,
        interval: Duration::ZERO,
        tokens: 1,
        stall_after: None,
        status: 429,
        seen: Default::default(),
    })
    .await;
    let (records, wall) =
        closed_loop(&workload(addr, Duration::from_secs(5)), 2, 4, Duration::from_secs(60), stop(), 0).await;
    let p = aggregate(2, &records, wall, Slo { ttft_s: 1.0, tpot_s: 1.0 });
    assert_eq!(p.errors, 4);
    assert_eq!(p.error_kinds.get("http_429"), Some(&4));
    assert!(matches!(&records[0].outcome, Outcome::Http { status: 429, message } if message == "programmed refusal"));
    // Nothing listens: transport errors, quickly.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (records, wall) =
        closed_loop(&workload(dead, Duration::from_secs(5)), 2, 2, Duration::from_secs(60), stop(), 0).await;
    let p = aggregate(2, &records, wall, Slo { ttft_s: 1.0, tpot_s: 1.0 });
    assert_eq!(p.error_kinds.get("transport"), Some(&2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_follow_the_rate_whatever_is_in_flight() {
    // Requests last 300 ms; arrivals at 40/s must not wait for them.
    let p = Arc::new(Program {
        ttft: Duration::from_millis(100),
        interval: Duration::from_millis(50),
        tokens: 5,
        stall_after: None,
        status: 200,
        seen: Default::default(),
    });
    let addr = server_arc(p.clone()).await;
    let (records, wall) =
        poisson(&workload(addr, Duration::from_secs(5)), 40.0, 80, 256, Duration::from_secs(60), stop(), 0).await;
    assert_eq!(records.len(), 80);
    assert!(records.iter().all(|r| r.outcome == Outcome::Ok));
    let seen = p.seen.lock().unwrap().clone();
    let span = seen.last().unwrap().0.duration_since(seen[0].0).as_secs_f64();
    // 79 gaps of mean 25 ms: about 2 s (the sum of 79 exponentials has a 11% relative spread).
    assert!(span > 1.3 && span < 2.9, "arrivals spanned {span} s");
    assert!(wall < span + 1.0);
    // Several in flight at once: open loop, not closed.
    let mut starts: Vec<f64> = records.iter().map(|r| r.start_s).collect();
    starts.sort_by(|a, b| a.total_cmp(b));
    let overlapping = starts.windows(8).any(|w| w[7] - w[0] < 0.3);
    assert!(overlapping, "no burst of 8 arrivals within one request's duration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentic_sessions_resend_the_growing_history_with_think_time() {
    let p = Arc::new(Program {
        ttft: Duration::from_millis(20),
        interval: Duration::from_millis(5),
        tokens: 4,
        stall_after: None,
        status: 200,
        seen: Default::default(),
    });
    let addr = server_arc(p.clone()).await;
    let t0 = Instant::now();
    let (records, _) =
        agentic(&workload(addr, Duration::from_secs(5)), 2, 3, Duration::from_millis(200), stop(), 0).await;
    assert_eq!(records.len(), 6);
    assert!(records.iter().all(|r| r.outcome == Outcome::Ok && r.text == "tok tok tok tok "));
    // Rounds carry system + user, then + answer + tool result each round: 2, 4, 6 messages.
    let mut counts: Vec<usize> = p.seen.lock().unwrap().iter().map(|(_, n)| *n).collect();
    counts.sort();
    assert_eq!(counts, vec![2, 2, 4, 4, 6, 6]);
    // Two think times per session.
    assert!(t0.elapsed() >= Duration::from_millis(400));
    let ids: Vec<&str> = records.iter().map(|r| r.request_id.as_str()).collect();
    assert!(ids.contains(&"lt-7-0-s1-r2"), "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ab_reports_the_ratio_of_two_servers_run_interleaved() {
    let fast = server(Program {
        ttft: Duration::from_millis(50),
        interval: Duration::from_millis(10),
        tokens: 10,
        stall_after: None,
        status: 200,
        seen: Default::default(),
    })
    .await;
    let slow = server(Program {
        ttft: Duration::from_millis(100),
        interval: Duration::from_millis(20),
        tokens: 10,
        stall_after: None,
        status: 200,
        seen: Default::default(),
    })
    .await;
    let slo = Slo { ttft_s: 1.0, tpot_s: 1.0 };
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        for (addr, out) in [(&fast, &mut a), (&slow, &mut b)] {
            let (records, wall) =
                closed_loop(&workload(addr.clone(), Duration::from_secs(5)), 2, 6, Duration::from_secs(60), stop(), 0)
                    .await;
            out.push(aggregate(2, &records, wall, slo));
        }
    }
    let p = pdmesh_loadtest::ab::compare(2.0, &a, &b);
    // B takes twice as long per request: half the throughput, twice the TTFT.
    assert!((p.ratio_tps - 0.5).abs() < 0.12, "B/A {}", p.ratio_tps);
    assert!(p.ratio_min <= p.ratio_tps && p.ratio_tps <= p.ratio_max);
    let t = p.ratio_ttft_p50.unwrap();
    assert!((t - 2.0).abs() < 0.5, "TTFT B/A {t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_writes_json_markdown_and_plots_for_an_ab_sweep() {
    let fast = server(Program {
        ttft: Duration::from_millis(30),
        interval: Duration::from_millis(5),
        tokens: 8,
        stall_after: None,
        status: 200,
        seen: Default::default(),
    })
    .await;
    let slow = server(Program {
        ttft: Duration::from_millis(60),
        interval: Duration::from_millis(10),
        tokens: 8,
        stall_after: None,
        status: 200,
        seen: Default::default(),
    })
    .await;
    let dir = std::env::temp_dir().join(format!("pdmesh-loadtest-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_pdmesh-loadtest"))
            .args(["--target", &fast, "--target-b", &slow, "--label-a", "fastserver", "--label-b", "slowserver"])
            .args(["--concurrency", "1,2,4", "--requests", "6", "--ab-rounds", "1", "--max-tokens", "8"])
            .arg("--out")
            .arg(d.join("run.json"))
            .arg("--markdown")
            .arg(d.join("run.md"))
            .arg("--plots")
            .arg(d.join("run"))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    assert_eq!(v["points"].as_array().unwrap().len(), 3);
    assert_eq!(v["ab"].as_array().unwrap().len(), 3);
    let md = std::fs::read_to_string(dir.join("run.md")).unwrap();
    assert!(md.contains("fastserver") && md.contains("slowserver"), "{md}");
    for name in ["throughput", "latency", "timeline"] {
        let png = std::fs::read(dir.join(format!("run-{name}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{name}.png: {} bytes", png.len());
        let svg = std::fs::read_to_string(dir.join(format!("run-{name}.svg"))).unwrap();
        assert!(svg.contains("<svg"), "{name}.svg");
        if name != "timeline" {
            assert!(svg.contains("fastserver") && svg.contains("slowserver"), "{name}.svg lacks the legend");
        }
    }
    // Three levels: the throughput plot has a marker per level per target.
    let svg = std::fs::read_to_string(dir.join("run-throughput.svg")).unwrap();
    assert!(svg.matches("<circle").count() >= 6, "markers in the throughput plot");
    let _ = std::fs::remove_dir_all(&dir);
}
