//! Tracing through the whole mesh, checked with an OTLP receiver inside
//! this test process (`pdmesh_meshctl::sink`, built on opentelemetry-proto):
//! one request makes one trace across all six services with every parent
//! present; 16 concurrent requests make 16 traces, joined by step spans
//! that link to several; and `meshctl explain` names a planted delay as
//! the dominant cause with the share it really took. A prompt the decode
//! worker prefills itself is one trace too, and says so.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]
// Whole-mesh scenarios read top to bottom as one story (issue 12 exempts tests).
#![allow(clippy::too_many_lines)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use pdmesh_core::vocab::kernel;
use pdmesh_meshctl::explain::{explain, Explanation};
use pdmesh_meshctl::sink::Sink;
use pdmesh_meshctl::trace::Span;

const SERVICES: [&str; 6] =
    ["pdmesh-gateway", "pdmesh-router", "pdmesh-tokenizer", "pdmesh-prefill", "pdmesh-decode", "pdmesh-kvbroker"];

fn ids(spans: &[Span]) -> HashSet<&str> {
    spans.iter().map(|s| s.span_id.as_str()).collect()
}

/// Spans whose parent is not in the trace.
fn roots(spans: &[Span]) -> Vec<&Span> {
    let have = ids(spans);
    spans.iter().filter(|s| s.parent_id.is_empty() || !have.contains(s.parent_id.as_str())).collect()
}

/// A request's trace is complete once the gateway span (which ends last)
/// and the decode loop are in, and every span's parent has arrived.
fn complete(spans: &[Span]) -> bool {
    spans.iter().any(|s| s.service == "pdmesh-gateway" && s.kind == "server")
        && spans.iter().any(|s| s.name == "decode_loop")
        && spans.iter().any(|s| s.name == "detokenize")
        // The tokenizer's side of the detokenize stream ends (and is
        // exported) on its own clock, at about the time the router's does.
        && spans.iter().any(|s| s.service == "pdmesh-tokenizer" && s.name.ends_with("/Detokenize") && s.kind == "server")
        && roots(spans).len() == 1
}

fn find<'a>(spans: &'a [Span], service: &str, name: &str) -> &'a Span {
    let mut m = spans.iter().filter(|s| s.service == service && s.name == name && s.kind != "client");
    let s = m.next().unwrap_or_else(|| panic!("no {name} span from {service} in {:#?}", names(spans)));
    s
}

fn names(spans: &[Span]) -> Vec<String> {
    let mut v: Vec<String> = spans.iter().map(|s| format!("{}:{}:{}", s.service, s.name, s.kind)).collect();
    v.sort();
    v.dedup();
    v
}

fn ancestors<'a>(spans: &'a [Span], s: &Span) -> Vec<&'a Span> {
    let by: HashMap<&str, &Span> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let mut out = Vec::new();
    let mut cur = s.parent_id.as_str();
    while let Some(p) = by.get(cur) {
        out.push(*p);
        cur = p.parent_id.as_str();
    }
    out
}

async fn send(gateway: &str, body: String, headers: Vec<(String, String)>) -> (u16, Option<String>, String) {
    let g = gateway.to_string();
    tokio::task::spawn_blocking(move || {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        post_header(&g, "/v1/chat/completions", &body, &h, "x-pdmesh-trace-id")
    })
    .await
    .unwrap()
}

/// Send one request; its explanation, spans, and the SSE events the client got.
async fn traced(mesh: &Mesh, sink: &Sink, body: String) -> (Explanation, Vec<Span>, usize) {
    let (code, tid, text) = send(&mesh.gateway, body, vec![]).await;
    assert_eq!(code, 200, "{text}");
    let tid = tid.expect("the gateway returns x-pdmesh-trace-id when tracing");
    let spans = sink.wait_trace(&tid, Duration::from_secs(20), complete).await;
    assert!(complete(&spans), "trace {tid} incomplete: {:#?}", names(&spans));
    (explain(&spans).unwrap(), spans, text.matches("data:").count())
}

/// A streamed chat request read as it arrives: (trace id, seconds from
/// sending to each token event, seconds to the end of the response).
fn timed_stream(gateway: &str, body: &str) -> (String, Vec<f64>, f64) {
    use std::io::{Read, Write};
    let t0 = std::time::Instant::now();
    let mut s = std::net::TcpStream::connect(gateway).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let (mut raw, mut buf, mut seen, mut times) = (String::new(), [0u8; 8192], 0usize, Vec::new());
    loop {
        let k = s.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        let now = t0.elapsed().as_secs_f64();
        raw.push_str(&String::from_utf8_lossy(&buf[..k]));
        // Complete events received so far.
        while let Some(start) = raw[seen..].find("data: ").map(|i| seen + i) {
            let Some(end) = raw[start..].find("\n\n").map(|i| start + i) else { break };
            let ev: serde_json::Value = serde_json::from_str(&raw[start + 6..end]).unwrap_or_default();
            let delta = &ev["choices"][0]["delta"];
            if delta.get("role").is_none() && delta["content"].as_str().is_some_and(|c| !c.is_empty()) {
                times.push(now);
            }
            seen = end;
        }
    }
    let total = t0.elapsed().as_secs_f64();
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    let head = raw.split("\r\n\r\n").next().unwrap();
    let tid =
        head.lines().find_map(|l| l.strip_prefix("x-pdmesh-trace-id: ")).expect("trace id header").trim().to_string();
    (tid, times, total)
}

fn share(e: &Explanation, cause: &str) -> f64 {
    e.parts.iter().find(|p| p.cause == cause).unwrap().share
}

fn gateway_ms(spans: &[Span]) -> f64 {
    roots(spans)[0].duration_ns() as f64 / 1e6
}

/// Check that explain names `cause` as dominant and that its share is
/// within 10% of `expected`: the planted delay's share of the request.
fn check_attribution(e: &Explanation, cause: &str, expected: f64, what: &str) {
    eprintln!("{what}:\n{}", e.table());
    assert_eq!(e.dominant, cause, "{what}: dominant cause\n{}", e.table());
    assert!(e.sentence.len() <= 320, "{what}: the sentence runs to {} characters: {}", e.sentence.len(), e.sentence);
    let got = share(e, cause);
    assert!(
        (got - expected).abs() <= 0.10 * expected,
        "{what}: {cause} share {got:.3}, planted delay's share {expected:.3} (more than 10% apart)\n{}",
        e.table()
    );
    let sum: f64 = e.parts.iter().map(|p| p.share).sum();
    assert!((sum - 1.0).abs() < 0.01, "{what}: shares add up to {sum}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn traces_span_the_mesh_and_explain_finds_the_cause() {
    let dir = std::env::temp_dir().join(format!("pdmesh-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("traces.jsonl");
    let _ = std::fs::remove_file(&file);
    let sink = Sink::start("127.0.0.1:0".parse().unwrap(), Some(file.clone())).await.unwrap();
    let ep = sink.endpoint();
    let mesh = Mesh::up(&[
        "--otlp-endpoint",
        &ep,
        "--trace-export-delay-ms",
        "100",
        "--trace-kernel-steps",
        "1",
        "--enable-fault-injection",
    ]);

    // 1. One streamed request, continuing a caller's trace context.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let body = chat_body("Tell me a fact about the sea.", r#","max_tokens":12,"stream":true"#);
    let (code, tid, text) =
        send(&mesh.gateway, body, vec![("traceparent".into(), format!("00-{caller_trace}-{caller_span}-01"))]).await;
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("[DONE]"), "{text}");
    assert_eq!(tid.as_deref(), Some(caller_trace), "the gateway continues the caller's trace");
    let spans = sink.wait_trace(caller_trace, Duration::from_secs(20), complete).await;
    assert!(complete(&spans), "incomplete trace: {:#?}", names(&spans));
    let root = roots(&spans);
    assert_eq!(root.len(), 1, "one root: {root:#?}");
    assert_eq!(root[0].service, "pdmesh-gateway");
    assert_eq!(root[0].name, "POST /v1/chat/completions");
    assert_eq!(root[0].parent_id, caller_span, "the root's parent is the caller's span");
    let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    for s in SERVICES {
        assert!(services.contains(s), "no span from {s}: {:#?}", names(&spans));
    }
    for s in &spans {
        assert_eq!(s.attr_str("service.name"), Some(s.service.as_str()), "service.name repeated on span {}", s.name);
        assert!(
            s.attr_str("service.instance.id").is_some() && s.attr_str("pdmesh.config_hash").is_some(),
            "identity on span {}",
            s.name
        );
    }
    // The span model, in causal order.
    let gw = root[0];
    let router = find(&spans, "pdmesh-router", "pdmesh.router.v1.Router/Generate");
    let tokenize = find(&spans, "pdmesh-router", "tokenize");
    let encode = find(&spans, "pdmesh-tokenizer", "pdmesh.tokenizer.v1.Tokenizer/Encode");
    let route = find(&spans, "pdmesh-router", "route");
    let prefill = find(&spans, "pdmesh-prefill", "pdmesh.prefill.v1.Prefill/Prefill");
    let queued = find(&spans, "pdmesh-prefill", "queued");
    let forward = find(&spans, "pdmesh-prefill", "prefill_forward");
    let pstep = find(&spans, "pdmesh-prefill", "prefill_step");
    let xfer = find(&spans, "pdmesh-prefill", "kv_transfer");
    let claim = find(&spans, "pdmesh-kvbroker", "pdmesh.kvbroker.v1.KvBroker/ClaimTicket");
    let decode = find(&spans, "pdmesh-decode", "pdmesh.decode.v1.Decode/Generate");
    let admit = find(&spans, "pdmesh-decode", "admit");
    let open = find(&spans, "pdmesh-kvbroker", "pdmesh.kvbroker.v1.KvBroker/OpenTicket");
    let dloop = find(&spans, "pdmesh-decode", "decode_loop");
    let detok = find(&spans, "pdmesh-router", "detokenize");
    let detok_srv = find(&spans, "pdmesh-tokenizer", "pdmesh.tokenizer.v1.Tokenizer/Detokenize");
    let chain = [gw, router, tokenize, route, prefill, queued, forward, xfer, dloop, detok];
    for w in chain.windows(2) {
        assert!(w[0].start_ns <= w[1].start_ns, "{} starts after {}", w[0].name, w[1].name);
    }
    for w in [router, decode, admit, dloop].windows(2) {
        assert!(w[0].start_ns <= w[1].start_ns, "{} starts after {}", w[0].name, w[1].name);
    }
    assert!(
        open.start_ns >= admit.start_ns && claim.start_ns >= open.start_ns,
        "ticket opened by admission, then claimed"
    );
    // Parents: who calls whom.
    let has = |s: &Span, a: &Span| ancestors(&spans, s).iter().any(|x| x.span_id == a.span_id);
    assert_eq!(tokenize.parent_id, router.span_id);
    assert!(has(encode, tokenize) && has(detok_srv, detok) && has(detok, router));
    assert!(has(queued, prefill) && has(prefill, router) && has(router, gw));
    assert!(has(dloop, decode) && has(decode, router) && has(admit, decode));
    assert!(has(xfer, prefill) && has(claim, prefill) && has(open, admit));
    assert_eq!(pstep.parent_id, forward.span_id, "the prefill step hangs under the request's forward span");
    assert!(
        pstep.links.iter().any(|(t, s)| t == caller_trace && s == &forward.span_id),
        "the step links to the request"
    );
    // The transfer says what moved how, and the decode checked every block
    // it moved before the first decode step.
    assert!(xfer.attr_f64("kv.bytes").unwrap_or(0.0) > 0.0, "{xfer:?}");
    let verify = find(&spans, "pdmesh-decode", "kv_verify");
    assert!(has(verify, decode) && verify.start_ns <= dloop.start_ns, "checked before the loop: {verify:?}");
    assert_eq!(verify.attr_f64("kv.verified_blocks"), xfer.attr_f64("kv.blocks"), "every block moved is checked");
    eprintln!(
        "kv_verify: {:?} ms on the path, checksums taken on landing: {:?} ms",
        verify.attr_f64("kv.verify_ms"),
        verify.attr_f64("kv.verified_on_landing_ms")
    );
    assert!(matches!(xfer.attr_str("kv.transport"), Some("nixl" | "tcp")), "{xfer:?}");
    assert!(queued.attr_f64("prefill.queue_depth").is_some() && queued.attr_f64("prefill.running").is_some());
    assert!(admit.attr_f64("decode.running").is_some());
    // Kernel spans: under the prefill step (step 1), none under decode steps (--trace-kernel-steps 1).
    let kernels: Vec<&Span> = spans.iter().filter(|s| s.attrs.contains_key(kernel::BACKEND)).collect();
    assert!(
        kernels.iter().any(|k| k.parent_id == pstep.span_id && k.name.starts_with("matmul")),
        "no kernel spans under the prefill step"
    );
    for k in &kernels {
        assert!(k.attr_f64(kernel::TILE_B).is_some() && k.attr_f64(kernel::M).is_some(), "{k:?}");
        assert!(!ancestors(&spans, k).iter().any(|a| a.name == "decode_step"), "kernel span under a decode step");
    }
    let dsteps = spans.iter().filter(|s| s.name == "decode_step").count();
    assert!(dsteps >= 10, "{dsteps} decode steps in the trace");
    // Streaming keeps the chain: the gateway's span ends after the last token.
    assert!(
        gw.end_ns >= dloop.end_ns && router.end_ns >= dloop.end_ns,
        "gateway/router spans end before decoding ended"
    );
    assert!(gw.attr_f64("gateway.chunks").unwrap_or(0.0) >= 3.0);
    // Exemplars: the latency histograms in OpenMetrics lead to this trace,
    // and `meshctl explain` opens it.
    for (service, histogram) in [
        ("router", "pdmesh_router_ttft_seconds"),
        ("router", "pdmesh_router_request_seconds"),
        ("gateway", "pdmesh_gateway_request_seconds"),
        ("decode", "pdmesh_decode_step_seconds"),
        ("prefill", "pdmesh_prefill_step_seconds"),
    ] {
        let inst = mesh.instance(service).await;
        let (code, om) = pdmesh_testkit::http_get_openmetrics(inst.http_addr.as_deref().unwrap(), "/metrics");
        assert_eq!(code, 200);
        assert!(om.ends_with("# EOF\n"), "{service}: not OpenMetrics");
        let ids = pdmesh_core::metrics::exemplar_trace_ids(&om, histogram);
        assert!(!ids.is_empty() && ids.iter().all(|t| t == caller_trace), "{histogram}: exemplars {ids:?}\n{om}");
    }
    let e = explain(&spans).expect("explain opens the exemplar's trace");
    assert_eq!(e.trace_id, caller_trace);

    // 2. 16 at once: 16 separate complete traces; step spans link several.
    let mut handles = Vec::new();
    for i in 0..16 {
        let g = mesh.gateway.clone();
        let stream = if i % 2 == 0 { "true" } else { "false" };
        handles.push(tokio::task::spawn_blocking(move || {
            post_header(
                &g,
                "/v1/chat/completions",
                &chat_body(
                    &format!("Give me word number {i}."),
                    &format!(r#","max_tokens":16,"ignore_eos":true,"stream":{stream}"#),
                ),
                &[],
                "x-pdmesh-trace-id",
            )
        }));
    }
    let mut tids = HashSet::new();
    for h in handles {
        let (code, tid, text) = h.await.unwrap();
        assert_eq!(code, 200, "{text}");
        tids.insert(tid.expect("trace id"));
    }
    assert_eq!(tids.len(), 16, "16 separate traces");
    let mut step_links: Vec<HashSet<String>> = Vec::new();
    for t in &tids {
        let sp = sink.wait_trace(t, Duration::from_secs(20), complete).await;
        assert!(complete(&sp), "trace {t} incomplete: {:#?}", names(&sp));
        assert_eq!(roots(&sp).len(), 1, "trace {t}");
        let svcs: HashSet<&str> = sp.iter().map(|s| s.service.as_str()).collect();
        assert_eq!(svcs.len(), 6, "trace {t} has spans from {svcs:?}");
        for s in sp.iter().filter(|s| s.name == "decode_step" || s.name == "prefill_step") {
            step_links.push(s.links.iter().map(|(t, _)| t.clone()).filter(|t| tids.contains(t)).collect());
        }
    }
    let widest = step_links.iter().map(|l| l.len()).max().unwrap_or(0);
    assert!(widest >= 4, "some step should serve (and link) several of the 16 requests; widest links {widest}");

    // 3. Attribution. Baselines first (no faults): 8 and 32 tokens.
    let short = || chat_body("Count from one to twenty.", r#","max_tokens":8,"ignore_eos":true,"stream":true"#);
    let long = || chat_body("Count from one to twenty.", r#","max_tokens":32,"ignore_eos":true,"stream":true"#);
    let (e, _, _) = traced(&mesh, &sink, short()).await;
    assert_ne!(e.dominant, "client write", "{}", e.table());
    // Without faults neither cause is more than scheduling noise. On 2
    // shared cores a wake-up of the prefill loop alone has taken 4.7 ms of
    // an 82 ms request (5.8%, CI); the faults below plant 50%+.
    assert!(share(&e, "client write") < 0.15 && share(&e, "queue wait") < 0.15, "{}", e.table());

    // A slow client: each SSE chunk is taken 150 ms late, so the delay
    // planted is 150 ms times the chunks the client received.
    mesh.fault("gateway", "gateway.slow_client_ms", 150).await;
    let (e, sp, chunks) = traced(&mesh, &sink, short()).await;
    mesh.fault("gateway", "gateway.slow_client_ms", 0).await;
    check_attribution(&e, "client write", 150.0 * chunks as f64 / gateway_ms(&sp), "slow client");

    // A held prefill queue: 1.5 s.
    mesh.fault("prefill", "prefill.queue_hold_ms", 1500).await;
    let (e, sp, _) = traced(&mesh, &sink, short()).await;
    mesh.fault("prefill", "prefill.queue_hold_ms", 0).await;
    check_attribution(&e, "queue wait", 1500.0 / gateway_ms(&sp), "held prefill queue");
    assert!(e.sentence.contains("queue held 1500 ms"), "{}", e.sentence);

    // A slowed KV transfer: 1.5 s.
    mesh.fault("prefill", "prefill.transfer_delay_ms", 1500).await;
    let (e, sp, _) = traced(&mesh, &sink, short()).await;
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    check_attribution(&e, "KV transfer", 1500.0 / gateway_ms(&sp), "slowed transfer");

    // The same through the CLI, from the OTLP/JSON file the receiver wrote.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshctl"))
        .args(["explain", &e.trace_id, "--otlp-file"])
        .arg(&file)
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["dominant"], "KV transfer", "{v}");
    assert!((v["total_ms"].as_f64().unwrap() - e.total_ms).abs() < 0.01, "{v}");

    // A decode saturated with other requests: 12 long streams running.
    let busy: Vec<_> = (0..12)
        .map(|i| {
            start_stream(
                &mesh.gateway,
                &chat_body(
                    &format!("Write a long story number {i}."),
                    r#","max_tokens":600,"ignore_eos":true,"stream":true"#,
                ),
                3,
            )
        })
        .collect();
    let t_wait = std::time::Instant::now();
    while mesh.gauge("decode", "pdmesh_decode_running").await < 12.0 {
        assert!(t_wait.elapsed() < Duration::from_secs(30), "the 12 streams did not all start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A probe refuses to measure a mesh this busy, unless forced; forced,
    // it reports the load it met on the workers that served it.
    let probe = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_meshctl"))
            .args(["probe", "--json", "--registry-dir"])
            .arg(mesh.dir.join("registry"))
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = probe(&[]);
    assert!(!refused.status.success(), "probe ran on a busy mesh");
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("not probing") && why.contains("decode-0"), "{why}");
    let forced = probe(&["--force", "--max-tokens", "32"]);
    assert!(forced.status.success(), "{}", String::from_utf8_lossy(&forced.stderr));
    let v: serde_json::Value = serde_json::from_slice(&forced.stdout).unwrap();
    let dw = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == "decode-0")
        .expect("decode-0 served the probe")
        .clone();
    assert!(dw["load_before"]["running"].as_u64().unwrap() >= 12, "{v}");
    assert!(v["total_ms"].as_f64().unwrap() > 0.0 && v["trace_id"].as_str().unwrap().len() == 32, "{v}");
    let ptid = v["trace_id"].as_str().unwrap().to_string();
    let psp = sink
        .wait_trace(&ptid, Duration::from_secs(20), |s| {
            s.iter().any(|x| x.name == "decode_loop") && roots(s).len() == 1
        })
        .await;
    let pe = explain(&psp).unwrap();
    assert_eq!(pe.dominant, "decode steps", "the probe's own trace, started by meshctl:\n{}", pe.table());

    // The load plants no fixed delay; the client measures, on its own clock,
    // how long its tokens took to come after the first one: that is the
    // share the decode steps should account for.
    let g = mesh.gateway.clone();
    let (tid, times, total) = tokio::task::spawn_blocking(move || timed_stream(&g, &long())).await.unwrap();
    drop(busy);
    // (Tokens whose text is still incomplete come with a later event.)
    assert!(times.len() >= 20, "{} token events", times.len());
    let sp = sink.wait_trace(&tid, Duration::from_secs(20), complete).await;
    let e = explain(&sp).unwrap();
    check_attribution(&e, "decode steps", (times[times.len() - 1] - times[0]) / total, "saturated decode");
    let d = e.parts.iter().find(|p| p.cause == "decode steps").unwrap();
    assert!(d.detail.contains("already running"), "{}", d.detail);
    let dl = sp.iter().find(|s| s.name == "decode_loop").unwrap();
    assert!(dl.attr_f64("decode.batch_mean").unwrap() >= 10.0, "{dl:?}");
    mesh.assert_released(Duration::from_secs(20)).await;

    // Unloaded, the probe runs without --force.
    let ok = probe(&[]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_local_prefill_is_one_trace_and_explain_says_so() {
    let sink = Sink::start("127.0.0.1:0".parse().unwrap(), None).await.unwrap();
    let ep = sink.endpoint();
    let mesh = Mesh::up(&["--otlp-endpoint", &ep, "--trace-export-delay-ms", "100", "--max-local-prefill", "256"]);
    let body = chat_body("Tell me a fact about the moon.", r#","max_tokens":8"#);
    let (e, spans, _) = traced(&mesh, &sink, body).await;
    eprintln!("{}", e.table());
    assert_eq!(roots(&spans).len(), 1, "one trace");
    let route = find(&spans, "pdmesh-router", "route");
    assert_eq!(route.attr_str("prefill.mode"), Some("local"), "{route:?}");
    assert_eq!(route.attr_str("prefill.mode_reason"), Some("tail_within_threshold"));
    assert_eq!(route.attr_f64("prefill.max_local_prefill"), Some(256.0));
    let tail = route.attr_f64("prefill.local_tail_tokens").unwrap_or(0.0);
    assert!(tail > 0.0 && tail <= 256.0, "{route:?}");
    // The prompt's forward ran on the decode worker, under its Generate.
    let forward = find(&spans, "pdmesh-decode", "prefill_forward");
    let decode = find(&spans, "pdmesh-decode", "pdmesh.decode.v1.Decode/Generate");
    assert!(ancestors(&spans, forward).iter().any(|a| a.span_id == decode.span_id));
    assert_eq!(forward.attr_bool("prefill.local"), Some(true), "{forward:?}");
    assert!(forward.attr_f64("prefill.computed_tokens").unwrap_or(0.0) > 0.0);
    assert!(!spans.iter().any(|s| s.service == "pdmesh-prefill"), "no prefill worker took part");
    assert!(!spans.iter().any(|s| s.name == "kv_transfer" || s.name.ends_with("/OpenTicket")), "no transfer");
    assert!(e.table().contains("which prefilled locally"), "explain: {}", e.table());
    // Its time is prefill compute on the decode worker, never a KV transfer.
    let part = |cause: &str| e.parts.iter().find(|p| p.cause == cause).cloned();
    let compute = part("prefill compute").expect("a prefill compute stretch");
    assert!(compute.detail.contains("prefilled locally by"), "{}", e.table());
    assert!(part("KV transfer").map_or(0.0, |p| p.ms) < 2.0, "no transfer happened: {}", e.table());
}
