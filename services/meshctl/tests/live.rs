//! A live mesh changed under load: on pdmesh_testkit's FAKE Consul agent
//! (Consul cannot be installed here), `meshctl up --discovery consul://…`
//! serves a closed loop of 16 `pdmesh-loadtest` clients while `meshctl
//! scale` takes decode 1 → 2 → 1 and prefill 1 → 2 → 1, and `meshctl
//! restart --all` replaces every prefill, decode, tokenizer, router and
//! gateway process. No request may fail or stall.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Mesh;
use pdmesh_testkit::consul::FakeConsul;

/// `meshctl ARGS --discovery URL`: its JSON answer (panics with its stderr on failure).
fn meshctl(args: &[&str], discovery: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_meshctl"))
        .args(args)
        .args(["--discovery", discovery])
        .output()
        .expect("run meshctl");
    assert!(out.status.success(), "meshctl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("meshctl {args:?}: not JSON ({e})"))
}

/// Registered instance ids of `pdmesh-<kind>` at the agent.
fn registered(fake: &FakeConsul, kind: &str) -> Vec<String> {
    let name = format!("pdmesh-{kind}");
    fake.services().into_iter().filter(|(_, s)| s["Service"] == name.as_str()).map(|(id, _)| id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaling_and_a_rolling_restart_under_load_fail_no_request() {
    let fake = FakeConsul::start_new(None).await;
    let url = fake.url();
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up(&["--discovery", &url, "--threads", "1", "--consul-check-interval-ms", "500"])
    });
    let report = mesh.dir.join("load.json");
    let loadtest = Path::new(env!("CARGO_BIN_EXE_meshctl")).with_file_name("pdmesh-loadtest");
    let mut load = Command::new(&loadtest)
        .args(["--target", &mesh.gateway, "--mode", "closed", "--concurrency", "16", "--requests", "100000"])
        .args(["--max-tokens", "16", "--stall-s", "60", "--timeout-s", "120", "--out"])
        .arg(&report)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", loadtest.display()));
    // Load flowing first.
    let t0 = Instant::now();
    while mesh.gauge("gateway", "pdmesh_gateway_requests_total{outcome=\"ok\"}").await < 16.0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no load reached the gateway");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let steps: [(&[&str], &str, usize); 4] = [
        (&["scale", "decode=2"], "decode", 2),
        (&["scale", "decode=1"], "decode", 1),
        (&["scale", "prefill=2"], "prefill", 2),
        (&["scale", "prefill=1"], "prefill", 1),
    ];
    for (args, kind, n) in steps {
        let v = tokio::task::block_in_place(|| meshctl(args, &url));
        eprintln!("meshctl {args:?}: {v}");
        assert_eq!(registered(&fake, kind).len(), n, "{kind} after {args:?}: {:?}", registered(&fake, kind));
    }
    let before: Vec<String> = fake.services().into_keys().collect();
    let v = tokio::task::block_in_place(|| meshctl(&["restart", "--all"], &url));
    eprintln!("meshctl restart --all: {v}");
    assert_eq!(v["replaced"].as_array().map(Vec::len), Some(5), "one of each kind but the broker: {v}");
    let after: Vec<String> = fake.services().into_keys().collect();
    for kind in ["prefill", "decode", "tokenizer", "router", "gateway"] {
        let ids = registered(&fake, kind);
        assert_eq!(ids.len(), 1, "{kind}: {ids:?}");
        assert!(!before.contains(&ids[0]), "{kind} was replaced: {before:?} -> {after:?}");
    }
    // Let the load run on the new processes a little, then stop it (SIGINT: it finishes what is in flight).
    tokio::time::sleep(Duration::from_secs(2)).await;
    // SAFETY: kill(2) on the load generator this test started.
    unsafe {
        libc::kill(load.id() as libc::pid_t, libc::SIGINT);
    }
    let status = load.wait().unwrap();
    assert!(status.success(), "pdmesh-loadtest exited with {status}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let p = &r["points"][0];
    eprintln!(
        "under load: {} requests, {} ok, {} errors, {} stalled",
        p["requests"], p["ok"], p["errors"], p["stalled"]
    );
    assert!(p["ok"].as_u64().unwrap() >= 100, "{p}");
    assert_eq!((p["errors"].as_u64(), p["stalled"].as_u64()), (Some(0), Some(0)), "no request failed or stalled: {p}");
}
