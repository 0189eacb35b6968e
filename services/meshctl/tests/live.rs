//! A live mesh changed under load: on pdmesh_testkit's FAKE Consul agent
//! (Consul cannot be installed here), `meshctl up --discovery consul://…`
//! serves a closed loop of 16 `pdmesh-loadtest` clients while `meshctl
//! scale` takes decode 1 → 2 → 1 and prefill 1 → 2 → 1, and `meshctl
//! restart --all` replaces every prefill, decode, tokenizer, router and
//! gateway process. No request may fail or stall. Then a decode is killed
//! with SIGKILL under the same load: the agent's check drops it, and only
//! the requests it was serving fail, each with a clean error.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::Mesh;
use pdmesh_testkit::consul::FakeConsul;

/// `meshctl ARGS --discovery URL`: its JSON answer (panics with its stderr on failure).
fn ctl(args: &[&str], discovery: &str) -> serde_json::Value {
    common::meshctl_ok(args, &["--discovery", discovery])
}

/// `meshctl ARGS --discovery URL`, which must fail: its stderr.
fn ctl_refused(args: &[&str], discovery: &str) -> String {
    let out = common::meshctl(args, &["--discovery", discovery]);
    assert!(!out.status.success(), "meshctl {args:?} should have been refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Registered instance ids of `pdmesh-<kind>` at the agent.
fn registered(fake: &FakeConsul, kind: &str) -> Vec<String> {
    let name = format!("pdmesh-{kind}");
    fake.services().into_iter().filter(|(_, s)| s["Service"] == name.as_str()).map(|(id, _)| id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaling_and_a_rolling_restart_under_load_fail_no_request_and_a_kill_fails_only_its_own() {
    let fake = FakeConsul::start_new(None).await;
    let url = fake.url();
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up(&[
            "--discovery",
            &url,
            "--threads",
            "1",
            "--consul-check-interval-ms",
            "500",
            "--drain-notice-ms",
            "1000",
        ])
    });
    let report = mesh.dir.join("load.json");
    let load = common::start_load(&mesh.gateway, &report, &[]);
    mesh.flowing(16.0).await;
    // What would break the mesh is refused, with the reason.
    let e = tokio::task::block_in_place(|| ctl_refused(&["drain", "decode-0"], &url));
    assert!(e.contains("the last decode"), "{e}");
    let e = tokio::task::block_in_place(|| ctl_refused(&["scale", "kvbroker=2"], &url));
    assert!(e.contains("tickets live in its memory"), "{e}");
    let e = tokio::task::block_in_place(|| ctl_refused(&["scale", "decode=x"], &url));
    assert!(e.contains("N must be a number"), "{e}");
    let steps: [(&[&str], &str, usize); 4] = [
        (&["scale", "decode=2"], "decode", 2),
        (&["scale", "decode=1"], "decode", 1),
        (&["scale", "prefill=2"], "prefill", 2),
        (&["scale", "prefill=1"], "prefill", 1),
    ];
    for (args, kind, n) in steps {
        let v = tokio::task::block_in_place(|| ctl(args, &url));
        eprintln!("meshctl {args:?}: {v}");
        assert_eq!(registered(&fake, kind).len(), n, "{kind} after {args:?}: {:?}", registered(&fake, kind));
    }
    let before: Vec<String> = fake.services().into_keys().collect();
    let v = tokio::task::block_in_place(|| ctl(&["restart", "--all"], &url));
    eprintln!("meshctl restart --all: {v}");
    assert_eq!(v["replaced"].as_array().map(Vec::len), Some(5), "one of each kind but the broker: {v}");
    let after: Vec<String> = fake.services().into_keys().collect();
    for kind in ["prefill", "decode", "tokenizer", "router", "gateway"] {
        let ids = registered(&fake, kind);
        assert_eq!(ids.len(), 1, "{kind}: {ids:?}");
        assert!(!before.contains(&ids[0]), "{kind} was replaced: {before:?} -> {after:?}");
    }
    // Let the load run on the new processes a little, then stop it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (p, _) = common::stop_load(load, &report);
    eprintln!(
        "under load: {} requests, {} ok, {} errors, {} stalled",
        p["requests"], p["ok"], p["errors"], p["stalled"]
    );
    assert!(p["ok"].as_u64().unwrap() >= 100, "{p}");
    assert_eq!((p["errors"].as_u64(), p["stalled"].as_u64()), (Some(0), Some(0)), "no request failed or stalled: {p}");

    kill_a_decode_under_load(&mesh, &fake, &url).await;
}

/// kill -9 of a decode under load: the agent's check drops it, and only
/// what it was serving fails (fewer: those without a token yet are
/// dispatched again), each with a clean error (an HTTP status, or an
/// error event in a stream that had started) saying a worker was lost.
async fn kill_a_decode_under_load(mesh: &Mesh, fake: &FakeConsul, url: &str) {
    tokio::task::block_in_place(|| ctl(&["scale", "decode=2"], url));
    let report = mesh.dir.join("load-kill.json");
    let load = common::start_load(&mesh.gateway, &report, &[]);
    mesh.flowing(16.0).await;
    let decodes = mesh.metrics_all("decode").await;
    let held = |t: &str| {
        ["pdmesh_decode_running", "pdmesh_decode_awaiting_kv", "pdmesh_decode_queued", "pdmesh_decode_local_prefilling"]
            .iter()
            .map(|g| pdmesh_core::http::metric(t, g).unwrap_or(0.0))
            .sum::<f64>()
    };
    let (victim, _) = decodes.iter().max_by(|a, b| held(&a.1).total_cmp(&held(&b.1))).unwrap();
    let inst = mesh.registry().healthy("decode").await.unwrap().into_iter().find(|i| &i.id == victim).unwrap();
    let pid = common::pid_of(&inst);
    let (_, m) = pdmesh_testkit::http_get(inst.http_addr.as_deref().unwrap(), "/metrics");
    let serving = held(&m);
    common::signal(pid, libc::SIGKILL);
    let t0 = Instant::now();
    while fake.checks()[&format!("service:{victim}")]["Status"] == "passing" {
        assert!(t0.elapsed() < Duration::from_secs(10), "{victim}'s check never failed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen = t0.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (p, run) = common::stop_load(load, &report);
    let records = run["records"].as_array().cloned().unwrap_or_default();
    let failed: Vec<&serde_json::Value> = records.iter().filter(|r| r["outcome"]["kind"] != "ok").collect();
    eprintln!(
        "kill -9 of {victim} serving {serving}: its check failed after {seen:?}; {} requests, {} failed: {:?}",
        p["requests"],
        failed.len(),
        failed.iter().map(|r| &r["outcome"]).collect::<Vec<_>>()
    );
    let retried: f64 = mesh
        .metrics_all("router")
        .await
        .iter()
        .map(|(_, t)| pdmesh_core::http::metric(t, "pdmesh_router_decode_retries_total").unwrap_or(0.0))
        .sum();
    eprintln!("requests dispatched again after the kill: {retried}");
    assert!(failed.len() as f64 <= serving + 1.0, "only what {victim} was serving fails: {} > {serving}", failed.len());
    if serving >= 3.0 {
        assert!(failed.len() as f64 + retried >= 1.0, "what {victim} held either failed or was dispatched again");
    }
    for r in failed {
        let kind = r["outcome"]["kind"].as_str().unwrap_or("");
        let clean =
            kind == "stream_error" || (kind == "http" && r["outcome"]["status"].as_u64().is_some_and(|s| s >= 500));
        assert!(clean, "a clean error, not a cut connection or a hang: {r}");
        let message = r["outcome"]["message"].as_str().unwrap_or("");
        assert!(
            message.contains("decode worker was lost") && !message.contains("h2") && !message.contains(victim.as_str()),
            "the error says what was lost, without the transport library's words or internal ids: {r}"
        );
    }
}
