//! A real Prometheus (the Debian package; scripts/deps.sh installs it)
//! scrapes every service of a running mesh with the shipped
//! infra/prometheus.yml, through the target file `meshctl up
//! --prometheus-sd` writes. With tracing on and exemplar storage enabled,
//! Prometheus keeps the trace ids the latency histograms carry
//! (OpenMetrics exemplars), and they name the traces the mesh exported.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn query(addr: &str, q: &str) -> serde_json::Value {
    let (code, body) = pdmesh_testkit::http_get(addr, &format!("/api/v1/query?query={q}"));
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prometheus_scrapes_every_service() {
    let dir = std::env::temp_dir().join(format!("pdmesh-prom-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sd = dir.join("pdmesh.json");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sink = rt.block_on(pdmesh_meshctl::sink::Sink::start("127.0.0.1:0".parse().unwrap(), None)).unwrap();
    let ep = sink.endpoint();
    let mesh = Mesh::up(&["--prometheus-sd", sd.to_str().unwrap(), "--otlp-endpoint", &ep]);
    let targets: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sd).unwrap()).unwrap();
    assert_eq!(targets.as_array().unwrap().len(), 6, "{targets}");

    // The shipped configuration, pointed at this mesh's target file.
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../infra/prometheus.yml")).unwrap();
    assert!(shipped.contains("/etc/prometheus/sd/pdmesh.json"));
    let cfg = dir.join("prometheus.yml");
    std::fs::write(&cfg, shipped.replace("/etc/prometheus/sd/pdmesh.json", sd.to_str().unwrap())).unwrap();
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let prom = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--web.listen-address={addr}"))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg("--enable-feature=exemplar-storage")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run prometheus (scripts/deps.sh installs the Debian package)");
    let _prom = KillOnDrop(prom);

    // A request, so the request counters have something to say.
    let (code, tid, text) = post_header(
        &mesh.gateway,
        "/v1/chat/completions",
        &chat_body("Hi", r#","max_tokens":4"#),
        &[],
        "x-pdmesh-trace-id",
    );
    assert_eq!(code, 200, "{text}");
    let tid = tid.expect("traced: the gateway names the trace");

    let t0 = Instant::now();
    let up = loop {
        if let Ok((200, body)) = pdmesh_core::http::get(&addr, "/api/v1/query?query=up", Duration::from_secs(5)) {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let res = v["data"]["result"].as_array().cloned().unwrap_or_default();
            if res.len() == 6 && res.iter().all(|r| r["value"][1] == "1") {
                break res;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(90), "Prometheus did not see all six services up");
        std::thread::sleep(Duration::from_millis(500));
    };
    let services: HashSet<String> = up.iter().map(|r| r["metric"]["service"].as_str().unwrap().to_string()).collect();
    for s in ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"] {
        assert!(services.contains(&format!("pdmesh-{s}")), "{services:?}");
    }
    let kv = query(&addr, "pdmesh_decode_kv_blocks_total");
    let v: f64 = kv["data"]["result"][0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(v > 0.0, "{kv}");
    let t1 = Instant::now();
    loop {
        let r = query(&addr, "sum(pdmesh_gateway_requests_total)");
        if r["data"]["result"][0]["value"][1].as_str().and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0) >= 1.0 {
            break;
        }
        assert!(t1.elapsed() < Duration::from_secs(30), "the gateway's request counter never reached Prometheus: {r}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // Every series Prometheus scraped belongs to a family named in the one
    // vocabulary (pdmesh_vocab::metric); nothing else comes from the mesh.
    let (code, body) = pdmesh_core::http::get(&addr, "/api/v1/label/__name__/values", Duration::from_secs(5)).unwrap();
    assert_eq!(code, 200, "{body}");
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    let names: Vec<String> = serde_json::from_value(doc["data"].clone()).unwrap();
    let ours: Vec<&String> = names.iter().filter(|n| !(*n == "up" || n.starts_with("scrape_"))).collect();
    let unlisted: Vec<&&String> = ours.iter().filter(|n| pdmesh_core::vocab::metric::family_of(n).is_none()).collect();
    assert!(unlisted.is_empty(), "served but not in pdmesh_vocab::metric: {unlisted:?}");
    assert!(ours.len() >= 50, "too few series scraped to judge: {ours:?}");
    // The TTFT histogram's exemplar in Prometheus names the request's trace,
    // and that trace reached the collector.
    let t2 = Instant::now();
    let q = "/api/v1/query_exemplars?query=pdmesh_router_ttft_seconds_bucket&start=0&end=9999999999";
    let found = loop {
        let (code, body) = pdmesh_testkit::http_get(&addr, q);
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let ids: Vec<String> = v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["exemplars"].as_array().cloned().unwrap_or_default())
            .filter_map(|e| e["labels"]["trace_id"].as_str().map(str::to_string))
            .collect();
        if !ids.is_empty() {
            break ids;
        }
        assert!(t2.elapsed() < Duration::from_secs(30), "no exemplar reached Prometheus: {body}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(found.as_slice(), std::slice::from_ref(&tid), "the exemplar is the request's trace");
    let spans = rt.block_on(sink.wait_trace(&tid, Duration::from_secs(20), |s| !s.is_empty()));
    assert!(!spans.is_empty(), "the exemplar's trace {tid} was exported");
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}
