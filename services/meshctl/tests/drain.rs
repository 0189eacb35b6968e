//! Graceful drain on SIGTERM, on a real mesh: the instance leaves
//! discovery first, finishes what it holds, then exits; at the drain
//! deadline what is left ends with a clean retriable error, never a hang.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{alive, chat_request, meshctl_ok, pid_of, run, signal, Mesh};

/// Whether process `pid` still exists.
/// Wait until the decode `id` runs at least `n` sequences.
async fn running_on(mesh: &Mesh, id: &str, n: f64) {
    let t0 = Instant::now();
    loop {
        let m = mesh.metrics_all("decode").await;
        let running =
            m.iter().find(|(i, _)| i == id).and_then(|(_, t)| pdmesh_core::http::metric(t, "pdmesh_decode_running"));
        if running.is_some_and(|r| r >= n) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{id} never ran {n} sequences");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_drained_with_8_running_sequences_ships_their_kv_and_leaves_in_seconds() {
    drain_8_sequences(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_drained_with_8_running_sequences_hands_them_over_for_replay_and_leaves_in_seconds() {
    drain_8_sequences(false).await;
}

/// 8 sequences run on the one decode; a second joins; the first is drained.
/// It hands them over, shipping their KV along (`ships_kv`) or for their
/// routers to replay the tokens sent, and exits within seconds; every
/// answer equals the same request's undisturbed one.
async fn drain_8_sequences(ships_kv: bool) {
    let env = [("PDMESH_DECODE_DRAIN_SHIPS_KV", if ships_kv { "true" } else { "false" })];
    let mesh = tokio::task::block_in_place(|| Mesh::up_env(&["--threads", "1", "--drain-notice-ms", "1000"], &env));
    let victim = mesh.instance("decode").await;
    let pid = pid_of(&victim);
    let router = mesh.router().await;
    let tokens = 160;
    let ask = |i: usize| chat_request(&format!("Tell me about the number {i}"), tokens, true);
    let mut reqs = Vec::new();
    for i in 0..8 {
        let (mut r, req) = (router.clone(), ask(i));
        reqs.push(tokio::spawn(async move { tokio::time::timeout(Duration::from_secs(120), run(&mut r, req)).await }));
    }
    running_on(&mesh, &victim.id, 8.0).await;
    let registry = mesh.dir.join("registry").display().to_string();
    tokio::task::block_in_place(|| meshctl_ok(&["scale", "decode=2"], &["--registry-dir", &registry]));
    let counters = ["pdmesh_router_migrations_total", "pdmesh_router_handovers_total"];
    let before = [mesh.gauge("router", counters[0]).await, mesh.gauge("router", counters[1]).await];
    let t0 = Instant::now();
    let drain = tokio::task::spawn_blocking(move || {
        meshctl_ok(&["drain", "decode-0"], &["--registry-dir", &registry]);
        t0.elapsed()
    });
    // Out of discovery at once, while it still serves what it holds.
    while mesh.registry().healthy("decode").await.unwrap().iter().any(|i| i.id == victim.id) {
        assert!(t0.elapsed() < Duration::from_secs(5), "{} still listed while draining", victim.id);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // New requests go to the other decode meanwhile, once the router's
    // watch has caught up (a poll of 0.3 s, twice, and margin; within the
    // 1 s notice the draining decode still takes what it is sent, and a
    // request it takes is handed over too: CI once counted 9 moves).
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut r = router.clone();
    let extra =
        run(&mut r, chat_request("A new request during the drain", 8, true)).await.expect("served by the other decode");
    assert_eq!(extra.ids.len(), 8);
    let (mut moved, mut stalls) = (Vec::new(), Vec::new());
    for (i, q) in reqs.into_iter().enumerate() {
        let out =
            q.await.unwrap().expect("ends within its deadline").unwrap_or_else(|e| panic!("request {i} failed: {e}"));
        assert_eq!(out.ids.len(), tokens as usize, "request {i} got all its tokens");
        stalls.push(out.longest_gap.as_secs_f64());
        moved.push(out.ids);
    }
    stalls.sort_by(f64::total_cmp);
    let took = drain.await.unwrap();
    assert!(!alive(pid), "`meshctl drain` returns once the instance has exited");
    // After the notice (1 s) it hands its 8 sequences over instead of
    // running them out.
    let mode = if ships_kv { "kv" } else { "replay" };
    // The stall: each request's longest wait between tokens (the move).
    eprintln!(
        "{{\"drain_8_sequences_s\": {:.2}, \"handover\": \"{mode}\", \"notice_s\": 1.0, \"stall_s\": {{\"median\": {:.3}, \"max\": {:.3}}}}}",
        took.as_secs_f64(),
        stalls[4],
        stalls[7]
    );
    assert!(took < Duration::from_secs(5), "the drain took {took:?}");
    let after = [mesh.gauge("router", counters[0]).await, mesh.gauge("router", counters[1]).await];
    assert_eq!(after[0], before[0] + 8.0, "all 8 moved");
    let shipped = if ships_kv { 8.0 } else { 0.0 };
    assert_eq!(after[1], before[1] + shipped, "{shipped} moved with their KV");
    assert_eq!(mesh.gauge("router", "pdmesh_router_handover_fallbacks_total").await, 0.0);
    let log = std::fs::read_to_string(mesh.dir.join("logs").join(format!("{}.log", victim.id))).unwrap();
    assert!(log.contains("drained in"), "the decode says it drained clean:\n{log}");
    eprintln!("{}", log.lines().filter(|l| l.contains("drain")).collect::<Vec<_>>().join("\n"));
    // Each answer is the one the request gets undisturbed (greedy; batching
    // does not change a sequence's tokens).
    let again: Vec<_> = (0..8)
        .map(|i| {
            let (mut r, req) = (router.clone(), ask(i));
            tokio::spawn(async move { run(&mut r, req).await })
        })
        .collect();
    for (i, (got, alone)) in moved.iter().zip(again).enumerate() {
        let alone = alone.await.unwrap().unwrap();
        assert_eq!(got, &alone.ids, "request {i} moved ({mode}) differs from its undisturbed run");
    }
    // Not restarted: meshctl forgot it.
    let ids: Vec<String> = mesh.registry().healthy("decode").await.unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(ids, ["decode-1"]);
    mesh.assert_released(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_the_drain_deadline_what_is_left_ends_with_a_retriable_error() {
    // No decode comes back (--no-restart): the router waits 2 s for one, then fails it.
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up_env(
            &["--threads", "1", "--no-restart", "--drain-timeout-s", "1", "--drain-notice-ms", "1000"],
            &[("PDMESH_ROUTER_WORKER_WAIT_MS", "2000")],
        )
    });
    let decode = mesh.instance("decode").await;
    let pid = pid_of(&decode);
    let mut r = mesh.router().await;
    let long = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(120), run(&mut r, chat_request("Count to a million", 3000, true)))
            .await
    });
    running_on(&mesh, &decode.id, 1.0).await;
    let t0 = Instant::now();
    signal(pid, libc::SIGTERM);
    let out = long.await.unwrap().expect("no hang: the straggler ends soon after the deadline");
    let e = out.expect_err("3000 tokens cannot finish in a 1 s drain");
    eprintln!("straggler ended after {:?}: {e:?}", t0.elapsed());
    assert_eq!(e.code(), tonic::Code::Unavailable, "retriable: {e:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "notice 1 s + deadline 1 s + close + wait 2 s: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefill_drained_with_transfers_pending_loses_none() {
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up(&[
            "--prefill-replicas",
            "2",
            "--threads",
            "1",
            "--no-restart",
            "--enable-fault-injection",
            "--drain-notice-ms",
            "1000",
        ])
    });
    // Every transfer waits 1.5 s before it is written: they are pending when the drain starts.
    mesh.fault("prefill", "prefill.transfer_delay_ms", 1500).await;
    let victim = mesh.registry().healthy("prefill").await.unwrap().remove(0);
    let pid = pid_of(&victim);
    let router = mesh.router().await;
    let mut reqs = Vec::new();
    for i in 0..6 {
        let mut r = router.clone();
        reqs.push(tokio::spawn(async move {
            tokio::time::timeout(
                Duration::from_secs(60),
                run(&mut r, chat_request(&format!("Name a colour, {i}"), 8, true)),
            )
            .await
        }));
    }
    // Wait until the victim holds a transfer, then drain it.
    let t0 = Instant::now();
    loop {
        let m = mesh.metrics_all("prefill").await;
        let held = m.iter().find(|(i, _)| *i == victim.id).map(|(_, t)| {
            let running = pdmesh_core::http::metric(t, "pdmesh_prefill_running").unwrap_or(0.0);
            let queued = pdmesh_core::http::metric(t, "pdmesh_prefill_queued").unwrap_or(0.0);
            running + queued
        });
        if held.unwrap_or(0.0) >= 1.0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{} never held a prompt", victim.id);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    signal(pid, libc::SIGTERM);
    for (i, q) in reqs.into_iter().enumerate() {
        let out =
            q.await.unwrap().expect("ends within its deadline").unwrap_or_else(|e| panic!("request {i} failed: {e}"));
        assert_eq!(out.ids.len(), 8, "request {i}");
    }
    while alive(pid) {
        assert!(t0.elapsed() < Duration::from_secs(40), "the drained prefill never exited");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(mesh.dir.join("logs").join(format!("{}.log", victim.id))).unwrap();
    assert!(log.contains("drained in"), "the prefill says it drained clean:\n{log}");
    eprintln!("{}", log.lines().filter(|l| l.contains("drain")).collect::<Vec<_>>().join("\n"));
    assert_eq!(mesh.gauge("router", "pdmesh_router_prefill_retries_total").await, 0.0, "nothing needed a retry");
    mesh.fault("prefill", "prefill.transfer_delay_ms", 0).await;
    mesh.assert_released(Duration::from_secs(10)).await;
}

/// A request may reach a prefill worker at any moment of its drain: while
/// it leaves discovery, during the notice, as it stops serving, as it
/// exits. Each moment, from the SIGTERM on in 250 ms steps, is answered in
/// seconds (by the draining worker or the other one): none is lost and
/// none waits out its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_at_any_moment_of_a_prefill_drain_ends_in_seconds() {
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up(&["--threads", "1", "--prefill-replicas", "2", "--drain-notice-ms", "1000"])
    });
    let router = mesh.router().await;
    for step in 0..12u64 {
        let pid = pid_of(&mesh.registry().healthy("prefill").await.unwrap()[(step % 2) as usize]);
        signal(pid, libc::SIGTERM);
        tokio::time::sleep(Duration::from_millis(250 * step)).await;
        let t0 = Instant::now();
        let mut r = router.clone();
        let req = chat_request(&format!("Say a word for step {step}"), 4, true);
        let out = tokio::time::timeout(Duration::from_secs(30), run(&mut r, req)).await;
        let took = t0.elapsed();
        eprintln!("{{\"sent_after_sigterm_ms\": {}, \"took_s\": {:.2}}}", 250 * step, took.as_secs_f64());
        let out = out.unwrap_or_else(|_| panic!("sent {} ms after SIGTERM, no end in 30 s", 250 * step));
        assert_eq!(out.expect("answered").ids.len(), 4);
        // Both workers serve again (the drained one restarted) before the next step.
        let back = pdmesh_testkit::eventually_async(Duration::from_secs(30), || async {
            let l = mesh.registry().healthy("prefill").await.unwrap_or_default();
            l.len() == 2 && l.iter().all(|i| pid_of(i) != pid)
        })
        .await;
        assert!(back, "the drained prefill worker was not restarted");
    }
    mesh.assert_released(Duration::from_secs(10)).await;
}

/// With its only prefill or decode worker killed and restarting (local
/// prefill off), a request sent meanwhile waits for the restarted worker
/// (`--worker-wait-ms`) instead of failing at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_waits_for_the_only_worker_of_a_kind_to_restart() {
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--threads", "1"]));
    let router = mesh.router().await;
    for kind in ["prefill", "decode"] {
        let pid = mesh.pid(kind).await;
        signal(pid, libc::SIGKILL);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t0 = Instant::now();
        let mut r = router.clone();
        let req = chat_request(&format!("Wait for the {kind}"), 4, true);
        let out = tokio::time::timeout(Duration::from_secs(30), run(&mut r, req)).await;
        eprintln!("{{\"killed\": \"{kind}\", \"answered_after_s\": {:.2}}}", t0.elapsed().as_secs_f64());
        let out = out.expect("ends within 30 s").unwrap_or_else(|e| panic!("{kind} killed: {e:?}"));
        assert_eq!(out.ids.len(), 4);
        assert_ne!(mesh.pid(kind).await, pid, "a new {kind} worker served it");
    }
    mesh.assert_released(Duration::from_secs(10)).await;
}
