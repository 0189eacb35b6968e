//! The autoscaler on a real mesh (issue 42): `meshctl up --autoscale`
//! with bounds 1 to 2 for prefill and decode. A prefill-heavy load (long
//! unique prompts) brings a second prefill worker; a decode-heavy one
//! (short prompts, long answers) brings a second decode worker and returns
//! prefill to one; after the load, decode returns to one. No request fails
//! throughout. A policy that does not parse is refused before anything starts.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;

/// Tight targets and short hysteresis, so each phase acts within seconds.
const POLICY: &str = "\
[targets]
queue_wait_p90_s = 1.0
inter_token_p90_s = 0.05
[timing]
interval_s = 1.0
window_s = 4.0
up_after_s = 2.0
down_after_s = 8.0
up_cooldown_s = 4.0
down_cooldown_s = 8.0
[prefill]
min = 1
max = 2
[decode]
min = 1
max = 2
";

/// Prefill and decode workers now.
async fn replicas(mesh: &Mesh) -> (usize, usize) {
    let reg = mesh.registry();
    (reg.healthy("prefill").await.unwrap().len(), reg.healthy("decode").await.unwrap().len())
}

/// Wait (printing the replicas each second, as JSON) until `done` holds.
async fn until(mesh: &Mesh, t0: Instant, what: &str, within: Duration, done: impl Fn((usize, usize)) -> bool) {
    let start = Instant::now();
    loop {
        let now = replicas(mesh).await;
        println!(
            "{{\"t_s\": {:.0}, \"prefill\": {}, \"decode\": {}, \"phase\": \"{what}\"}}",
            t0.elapsed().as_secs_f64(),
            now.0,
            now.1
        );
        if done(now) {
            return;
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}; replicas {now:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn no_failures(point: &serde_json::Value, what: &str) {
    assert_eq!(point["errors"], 0, "{what}: {point:#}");
    assert_eq!(point["stalled"], 0, "{what}: {point:#}");
    assert!(point["ok"].as_u64().unwrap() > 0, "{what}: {point:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_autoscaler_follows_a_prefill_heavy_then_a_decode_heavy_load_and_fails_nothing() {
    let dir = std::env::temp_dir().join(format!("pdmesh-autoscale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--autoscale", policy.to_str().unwrap()]));
    let t0 = Instant::now();
    // Long prompts that no cache can reuse, one token each.
    let report = dir.join("prefill.json");
    let long =
        [("--concurrency", "4"), ("--max-tokens", "2"), ("--unique-prompts", ""), ("--system-prompt-tokens", "300")];
    let load = start_load(&mesh.gateway, &report, &long);
    until(&mesh, t0, "prefill-heavy", Duration::from_secs(60), |(p, _)| p == 2).await;
    let (point, _) = tokio::task::block_in_place(|| stop_load(load, &report));
    no_failures(&point, "prefill-heavy");
    // Short prompts, long answers.
    let report = dir.join("decode.json");
    let load =
        start_load(&mesh.gateway, &report, &[("--concurrency", "8"), ("--max-tokens", "128"), ("--ignore-eos", "")]);
    until(&mesh, t0, "decode-heavy", Duration::from_secs(120), |(p, d)| d == 2 && p == 1).await;
    let (point, _) = tokio::task::block_in_place(|| stop_load(load, &report));
    no_failures(&point, "decode-heavy");
    until(&mesh, t0, "idle", Duration::from_secs(60), |now| now == (1, 1)).await;
    let status = tokio::task::block_in_place(|| {
        let reg = mesh.dir.join("registry").display().to_string();
        meshctl_ok(&["status", "--json"], &["--registry-dir", &reg])
    });
    let kinds = status["autoscaler"]["kinds"].as_array().cloned().unwrap_or_default();
    assert_eq!(kinds.len(), 2, "meshctl status shows the autoscaler: {status:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_policy_is_refused_before_anything_starts() {
    let dir = std::env::temp_dir().join(format!("pdmesh-autoscale-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, "[decode]\nmin = 3\nmax = 2\n").unwrap();
    let reg = dir.join("registry");
    let out = meshctl(&["up", "--autoscale", policy.to_str().unwrap()], &["--registry-dir", reg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("decode.min (3) is above decode.max (2)"), "{err}");
    assert!(!reg.exists() || std::fs::read_dir(&reg).unwrap().next().is_none(), "nothing registered");
    let out = meshctl(&["up", "--autoscale", "/nonexistent/policy.toml"], &["--registry-dir", reg.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/policy.toml"));
    let _ = std::fs::remove_dir_all(&dir);
}
