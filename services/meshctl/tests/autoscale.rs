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

/// The autoscaler's latest signals, from meshctl's control endpoint.
async fn signals(mesh: &Mesh) -> serde_json::Value {
    let up = mesh.registry().healthy("meshctl").await.unwrap();
    let addr = up[0].http_addr.clone().unwrap();
    let (code, body) = pdmesh_testkit::http_get(&addr, "/v1/autoscaler");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["signals"].clone()
}

/// Each second: the replicas and the autoscaler's signals, for the report.
struct Timeline {
    t0: Instant,
    rows: Vec<serde_json::Value>,
}

impl Timeline {
    /// Record each second until `done` holds (within `within`).
    async fn until(&mut self, mesh: &Mesh, what: &str, within: Duration, done: impl Fn((usize, usize)) -> bool) {
        let start = Instant::now();
        loop {
            let now = replicas(mesh).await;
            let row = serde_json::json!({
                "t_s": self.t0.elapsed().as_secs_f64(), "phase": what, "prefill": now.0, "decode": now.1,
                "signals": signals(mesh).await,
            });
            println!("{row}");
            self.rows.push(row);
            if done(now) {
                return;
            }
            assert!(start.elapsed() < within, "{what}: not within {within:?}; replicas {now:?}");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The plot: replicas per kind, and TTFT p90, prefill queue wait p90
    /// and decode step p90 beneath, beside `prefix` (PNG and SVG).
    fn plot(&self, prefix: &std::path::Path) -> Vec<std::path::PathBuf> {
        use pdmesh_loadtest::plot::{write_series, Panel};
        let series = |label: &str, f: &dyn Fn(&serde_json::Value) -> Option<f64>| {
            let pts = self.rows.iter().filter_map(|r| Some((r["t_s"].as_f64()?, f(r)?))).collect();
            (label.to_string(), pts)
        };
        let sig = |k: &'static str| move |r: &serde_json::Value| r["signals"][k].as_f64();
        let panels = [
            Panel {
                y_desc: "replicas".into(),
                series: vec![
                    series("prefill", &|r| r["prefill"].as_f64()),
                    series("decode", &|r| r["decode"].as_f64()),
                ],
            },
            Panel {
                y_desc: "seconds (p90 over 4 s)".into(),
                series: vec![
                    series("TTFT", &sig("ttft_p90_s")),
                    series("prefill queue wait", &sig("prefill_queue_wait_p90_s")),
                    series("decode step", &sig("decode_inter_token_p90_s")),
                ],
            },
        ];
        write_series(prefix, "meshctl up --autoscale: prefill-heavy, then decode-heavy, then idle", &panels).unwrap()
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
    let mut tl = Timeline { t0: Instant::now(), rows: Vec::new() };
    // Long prompts that no cache can reuse, one token each.
    let report = dir.join("prefill.json");
    let long =
        [("--concurrency", "4"), ("--max-tokens", "2"), ("--unique-prompts", ""), ("--system-prompt-tokens", "300")];
    let load = start_load(&mesh.gateway, &report, &long);
    tl.until(&mesh, "prefill-heavy", Duration::from_secs(60), |(p, _)| p == 2).await;
    let (point, _) = tokio::task::block_in_place(|| stop_load(load, &report));
    no_failures(&point, "prefill-heavy");
    // Short prompts, long answers.
    let report = dir.join("decode.json");
    let load =
        start_load(&mesh.gateway, &report, &[("--concurrency", "8"), ("--max-tokens", "128"), ("--ignore-eos", "")]);
    tl.until(&mesh, "decode-heavy", Duration::from_secs(120), |(p, d)| d == 2 && p == 1).await;
    let (point, _) = tokio::task::block_in_place(|| stop_load(load, &report));
    no_failures(&point, "decode-heavy");
    tl.until(&mesh, "idle", Duration::from_secs(60), |now| now == (1, 1)).await;
    let status = tokio::task::block_in_place(|| {
        let reg = mesh.dir.join("registry").display().to_string();
        meshctl_ok(&["status", "--json"], &["--registry-dir", &reg])
    });
    let kinds = status["autoscaler"]["kinds"].as_array().cloned().unwrap_or_default();
    assert_eq!(kinds.len(), 2, "meshctl status shows the autoscaler: {status:#}");
    // The report's plot (PDMESH_AUTOSCALE_REPORT=docs/benchmarks/autoscale
    // keeps it and the rows; otherwise it is drawn and thrown away).
    let prefix = std::env::var_os("PDMESH_AUTOSCALE_REPORT").map_or(dir.join("autoscale"), std::path::PathBuf::from);
    let files = tl.plot(&prefix);
    assert!(files.iter().all(|f| std::fs::metadata(f).is_ok_and(|m| m.len() > 1000)), "{files:?}");
    let rows: Vec<String> = tl.rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(prefix.with_extension("jsonl"), rows.join("\n") + "\n").unwrap();
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

/// Advise mode (`meshctl autoscale --advise`, as the Helm chart runs it):
/// the planner's desired replicas on /metrics for KEDA or an HPA. Here on
/// an empty registry: no signals, so each kind is brought to its minimum
/// and held there, and nothing else is decided.
#[test]
fn advise_mode_serves_the_desired_replicas_for_an_external_scaler() {
    let dir = std::env::temp_dir().join(format!("pdmesh-autoscale-advise-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("registry")).unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, "[timing]\ninterval_s = 0.2\n[prefill]\nmin = 1\nmax = 3\n[decode]\nmin = 2\nmax = 3\n")
        .unwrap();
    let addr = free_addr();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_meshctl"))
        .args(["autoscale", "--policy", policy.to_str().unwrap(), "--advise", &addr, "--registry-dir"])
        .arg(dir.join("registry"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let metrics = loop {
        let (code, body) =
            pdmesh_core::http::get(&addr, "/metrics", Duration::from_secs(1)).unwrap_or((0, String::new()));
        if code == 200 && body.contains("kind=\"decode\"") {
            break body;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no desired replicas served: {code} {body}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(metrics.contains("pdmesh_autoscaler_desired_replicas{kind=\"prefill\"} 1"), "{metrics}");
    assert!(metrics.contains("pdmesh_autoscaler_desired_replicas{kind=\"decode\"} 2"), "{metrics}");
    assert!(
        metrics.contains("pdmesh_autoscaler_decisions_total{kind=\"decode\",direction=\"up\",reason=\"min\"} 1"),
        "{metrics}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
