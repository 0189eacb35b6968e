//! The prefix cache and cache-aware routing through the whole mesh: the
//! official `openai` client gets the same greedy answers with the cache on
//! (repeats and second turns reusing KV) as with it off; two prefill
//! workers keep a conversation on the one that holds it; a restarted
//! worker starts cold and the router stops counting on its old cache; a
//! decode worker prefills short prompts (and the new tail of a chat it
//! holds) itself, with the answers of the disaggregated path.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{pid_of, Mesh};
use serde_json::Value;

/// `scripts/openai_prefix_answers.py` against `mesh`.
fn answers(mesh: &Mesh) -> Value {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let probe = Command::new("python3").args(["-c", "import openai"]).status().expect("python3");
    assert!(probe.success(), "the `openai` Python package is missing: python3 -m pip install openai");
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/openai_prefix_answers.py"))
        .args(["--base-url", &format!("http://{}/v1", mesh.gateway)])
        .args(["--golden", &format!("{root}/services/engine/tests/data/smollm2.golden.json")])
        .output()
        .expect("run the openai prefix script");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai prefix script failed:\n{stderr}");
    serde_json::from_slice(&out.stdout).expect("JSON from the script")
}

fn num(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("expected a count, got {v}"))
}

/// A counter or gauge summed over every instance of `service`.
async fn total(mesh: &Mesh, service: &str, name: &str) -> f64 {
    let all = mesh.metrics_all(service).await;
    all.iter().map(|(_, m)| pdmesh_core::http::metric(m, name).unwrap_or(0.0)).sum()
}

/// A chat answer's usage: (prompt tokens, cached tokens).
fn usage(mesh: &Mesh, content: &str) -> (u64, u64) {
    let (st, body) = mesh.post("/v1/chat/completions", &common::chat_body(content, r#","max_tokens":4"#), &[]);
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    (num(&v["usage"]["prompt_tokens"]), num(&v["usage"]["prompt_tokens_details"]["cached_tokens"]))
}

/// A prompt of about 100 tokens that no other test sends.
fn long_prompt(tag: &str) -> String {
    format!(
        "{tag}: a lighthouse keeper writes in her log every evening. She notes the wind, the swell, the ships \
         that passed, the colour of the sky at dusk and the state of the lamp. Summarise tonight's entry, in \
         which a fishing boat came in late under a red sky and the lamp needed a new wick."
    )
}

#[test]
fn cache_hits_answer_as_the_cache_off() {
    // One prefill worker: with two, a second turn whose first turn is under
    // --cache-threshold of its blocks may go to the other one (low_match),
    // and the reuse asserted below would depend on the rotation.
    let on = answers(&Mesh::up(&[]));
    let off = answers(&Mesh::up(&["--prefix-cache-blocks", "0", "--router-policy", "least-busy"]));
    let golden = common::golden();
    for ((a, b), g) in on["golden"].as_array().unwrap().iter().zip(off["golden"].as_array().unwrap()).zip(&golden) {
        let text = a["first"]["text"].as_str().unwrap();
        assert_eq!(a["first"]["text"], b["first"]["text"], "{}", a["prompt"]);
        assert_eq!(a["again"]["text"], b["first"]["text"], "a repeat from the cache differs: {}", a["prompt"]);
        assert!(g["greedy_text"].as_str().unwrap().starts_with(text), "llama.cpp's answer to {} differs", a["prompt"]);
        let n = num(&a["again"]["prompt_tokens"]);
        assert_eq!(num(&a["again"]["cached_tokens"]), n - 1, "a repeat reuses all but its last token");
        assert_eq!(num(&b["again"]["cached_tokens"]), 0, "the cache is off");
    }
    for (a, b) in on["chats"].as_array().unwrap().iter().zip(off["chats"].as_array().unwrap()) {
        for turn in ["turn1", "turn2", "turn2_again"] {
            assert_eq!(a[turn]["text"], b[turn]["text"], "{turn} of a chat differs with the cache on");
        }
        let second = &a["turn2"];
        assert!(
            num(&second["cached_tokens"]) > num(&a["turn1"]["prompt_tokens"]) / 2,
            "turn two reuses turn one's prompt: {second}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn routing_follows_the_cache_and_forgets_a_restarted_worker() {
    let mesh = Mesh::up(&["--prefill-replicas", "2"]);
    let poll = Duration::from_millis(700); // two of the router's 250 ms load polls, and margin
    let prompt = long_prompt("Log 1");
    let (n, first) = usage(&mesh, &prompt);
    assert!(n >= 90, "the prompt should be about 100 tokens, it is {n}");
    tokio::time::sleep(poll).await;
    let matched = total(&mesh, "router", "pdmesh_router_prefill_picks_total{branch=\"cache_match\"}").await;
    for k in 0..4 {
        let (_, cached) = usage(&mesh, &prompt);
        assert_eq!(cached, n - 1, "repeat {k} went to the worker holding the prompt (first run reused {first})");
    }
    let after = total(&mesh, "router", "pdmesh_router_prefill_picks_total{branch=\"cache_match\"}").await;
    assert_eq!(after - matched, 4.0, "four picks by cache match");

    // Restart the worker holding the prompt: its cache is gone, and within
    // a poll the router no longer expects it there.
    let holder = holder(&mesh).await;
    let old_pid = pid_of(&holder);
    let cached_before = total(&mesh, "prefill", "pdmesh_prefill_prefix_cached_blocks").await;
    // SAFETY: kill(2) on a mesh child process.
    unsafe {
        libc::kill(old_pid, libc::SIGKILL);
    }
    let back = pdmesh_testkit::eventually_async(Duration::from_secs(120), || async {
        let list = mesh.registry().healthy("prefill").await.unwrap_or_default();
        list.len() == 2 && list.iter().all(|i| ![0, old_pid].contains(&pid_of(i)))
    })
    .await;
    assert!(back, "the killed prefill worker did not come back");
    tokio::time::sleep(poll).await;
    let cached_now = total(&mesh, "prefill", "pdmesh_prefill_prefix_cached_blocks").await;
    assert!(
        cached_now < cached_before,
        "the restarted worker came back with its cache: {cached_now} >= {cached_before}"
    );
    let overlap = total(&mesh, "router", "pdmesh_router_route_overlap_tokens_total").await;
    let (_, cached) = usage(&mesh, &prompt);
    let expected = total(&mesh, "router", "pdmesh_router_route_overlap_tokens_total").await - overlap;
    assert!(cached < n / 2, "the restarted worker's cache is empty, yet {cached} of {n} tokens were reused");
    assert!(expected < (n / 2) as f64, "the router still counted on the old cache: expected {expected} tokens");
    mesh.assert_released(Duration::from_secs(10)).await;
}

/// The prefill instance holding the most cached blocks.
async fn holder(mesh: &Mesh) -> pdmesh_core::discovery::Instance {
    let list = mesh.registry().healthy("prefill").await.unwrap();
    let blocks = |i: &pdmesh_core::discovery::Instance| {
        let (_, m) = pdmesh_testkit::http_get(i.http_addr.as_deref().unwrap(), "/metrics");
        pdmesh_core::http::metric(&m, "pdmesh_prefill_prefix_cached_blocks").unwrap_or(0.0)
    };
    list.into_iter().max_by(|a, b| blocks(a).total_cmp(&blocks(b))).expect("a prefill worker")
}

/// An instance's pid from its /statusz (0 when it does not answer).
/// `pdmesh_router_prefill_mode_total` by mode: (local, remote).
async fn modes(mesh: &Mesh) -> (f64, f64) {
    let m = |mode: &str| format!("pdmesh_router_prefill_mode_total{{mode=\"{mode}\"}}");
    (total(mesh, "router", &m("local")).await, total(mesh, "router", &m("remote")).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_prefill_answers_as_the_prefill_workers_do() {
    // Every prompt local: golden prompts, their repeats and two-turn chats
    // (the second turn reusing the first answer's KV on the decode worker).
    let mesh = Mesh::up(&["--max-local-prefill", "100000"]);
    let local = answers(&mesh);
    let (n_local, n_remote) = modes(&mesh).await;
    assert!(n_local > 0.0 && n_remote == 0.0, "every prompt local: {n_local} local, {n_remote} remote");
    assert_eq!(total(&mesh, "prefill", "pdmesh_prefill_requests_total{outcome=\"ok\"}").await, 0.0);
    assert!(total(&mesh, "decode", "pdmesh_decode_local_prefills_total").await >= n_local);
    mesh.assert_released(Duration::from_secs(10)).await;
    drop(mesh);
    let remote = answers(&Mesh::up(&["--max-local-prefill", "0"]));
    for (a, b) in local["golden"].as_array().unwrap().iter().zip(remote["golden"].as_array().unwrap()) {
        assert_eq!(a["first"]["text"], b["first"]["text"], "local prefill changed the answer to {}", a["prompt"]);
        assert_eq!(a["again"]["text"], b["again"]["text"], "a local repeat changed the answer to {}", a["prompt"]);
        let n = num(&a["again"]["prompt_tokens"]);
        assert_eq!(num(&a["again"]["cached_tokens"]), n - 1, "a local repeat reuses all but its last token");
    }
    for (a, b) in local["chats"].as_array().unwrap().iter().zip(remote["chats"].as_array().unwrap()) {
        for turn in ["turn1", "turn2", "turn2_again"] {
            assert_eq!(a[turn]["text"], b[turn]["text"], "{turn} of a chat differs with local prefill");
        }
        let (t1, t2) = (&a["turn1"], &a["turn2"]);
        assert!(
            num(&t2["cached_tokens"]) > num(&t1["prompt_tokens"]),
            "turn two reuses turn one and its answer on the decode worker: {t2}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prompt_goes_local_below_the_threshold_and_remote_above_it() {
    let mesh = Mesh::up(&["--max-local-prefill", "64"]);
    let poll = Duration::from_millis(700);
    let (short, _) = usage(&mesh, "Hi!");
    assert!(short <= 64, "a short chat prompt is {short} tokens");
    assert_eq!(modes(&mesh).await, (1.0, 0.0), "a {short}-token prompt is prefilled locally");
    let prompt = long_prompt("Log 2");
    let (n, cached) = usage(&mesh, &prompt);
    assert!(n > 64);
    assert_eq!(cached, 0);
    assert_eq!(modes(&mesh).await, (1.0, 1.0), "a {n}-token prompt goes to a prefill worker");
    // The decode worker kept that prompt (imported) and its answer: asked
    // again, only the last token is computed, locally.
    tokio::time::sleep(poll).await;
    let (_, cached) = usage(&mesh, &prompt);
    assert_eq!(cached, n - 1, "the repeat reuses the decode worker's copy");
    assert_eq!(modes(&mesh).await, (2.0, 1.0), "the repeat's tail is short: local");
    mesh.assert_released(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_no_prefill_worker_left_the_decode_worker_prefills_any_prompt() {
    // Threshold 1: every prompt would go to a prefill worker.
    let mesh = Mesh::up(&["--max-local-prefill", "1", "--no-restart"]);
    let pid = mesh.pid("prefill").await;
    // SAFETY: kill(2) on a mesh child process (it deregisters and exits).
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let gone = pdmesh_testkit::eventually_async(Duration::from_secs(30), || async {
        mesh.registry().healthy("prefill").await.unwrap_or_default().is_empty()
    })
    .await;
    assert!(gone, "the prefill worker did not leave the registry");
    tokio::time::sleep(Duration::from_millis(700)).await; // the router's registry poll (300 ms), and margin
    let (n, _) = usage(&mesh, &long_prompt("Log 3"));
    assert!(n > 64);
    assert_eq!(modes(&mesh).await, (1.0, 0.0), "the {n}-token prompt was prefilled by the decode worker");
    mesh.assert_released(Duration::from_secs(10)).await;
}

/// A registry can list a prefill worker that is gone (an entry within its
/// TTL, a watch that lags): the router finds out by calling it, and the
/// request is answered by the decode worker within seconds, never left
/// waiting. The entry is written back, fresh, for as long as the request runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefill_listed_after_it_exited_costs_seconds_not_a_hang() {
    let mesh = Mesh::up(&["--max-local-prefill", "1", "--no-restart"]);
    let dir = mesh.dir.join("registry").join("prefill");
    let entries = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).map(|e| e.path());
    let file = entries.into_iter().find(|p| p.extension().is_some_and(|x| x == "json")).unwrap();
    let saved: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let pid = mesh.pid("prefill").await;
    // SAFETY: kill(2) on a mesh child process (it deregisters and exits).
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let exited = pdmesh_testkit::eventually_async(Duration::from_secs(30), || async { !common::alive(pid) }).await;
    assert!(exited, "the prefill worker did not exit");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (d2, f2) = (done.clone(), file.clone());
    let ghost = std::thread::spawn(move || {
        while !d2.load(std::sync::atomic::Ordering::Relaxed) {
            let mut v = saved.clone();
            v["heartbeat_unix_ms"] = serde_json::json!(pdmesh_core::now_ms());
            std::fs::write(&f2, serde_json::to_vec(&v).unwrap()).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = std::fs::remove_file(&f2);
    });
    let listed = pdmesh_testkit::eventually_async(Duration::from_secs(5), || async {
        !mesh.registry().healthy("prefill").await.unwrap_or_default().is_empty()
    })
    .await;
    assert!(listed, "the gone prefill worker is listed again");
    tokio::time::sleep(Duration::from_millis(700)).await; // the router's registry poll (300 ms), and margin
    let t0 = std::time::Instant::now();
    let (n, _) = usage(&mesh, &long_prompt("Log 4"));
    let took = t0.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    ghost.join().unwrap();
    assert!(n > 64);
    assert!(took < Duration::from_secs(15), "answered in {took:?}");
    let retries = total(&mesh, "router", "pdmesh_router_prefill_retries_total").await;
    assert!(retries >= 1.0, "the router called the listed prefill worker first ({retries} retries)");
    assert_eq!(modes(&mesh).await.0, 1.0, "the prompt was prefilled by the decode worker");
    mesh.assert_released(Duration::from_secs(10)).await;
}
