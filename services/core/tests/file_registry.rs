//! The file discovery backend, for real, on a temporary folder.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use pdmesh_core::discovery::{watch, Discovery, FileRegistry, Instance};

fn inst(service: &str, id: &str, port: u16) -> Instance {
    Instance {
        service: service.into(),
        id: id.into(),
        grpc_addr: format!("127.0.0.1:{port}"),
        http_addr: None,
        meta: Default::default(),
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pdmesh-registry-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[tokio::test]
async fn register_list_deregister() {
    let dir = tmpdir("basic");
    let reg = FileRegistry::new(&dir, Duration::from_secs(5));
    let a = reg.register(inst("decode", "d-1", 1001)).await.unwrap();
    let b = reg.register(inst("decode", "d-0", 1000)).await.unwrap();
    let _t = reg.register(inst("tokenizer", "t-0", 2000)).await.unwrap();
    let ids: Vec<String> = reg.healthy("decode").await.unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(ids, ["d-0", "d-1"]);
    a.deregister().await.unwrap();
    assert_eq!(reg.healthy("decode").await.unwrap(), vec![inst("decode", "d-0", 1000)]);
    assert!(reg.healthy("prefill").await.unwrap().is_empty());
    drop(b);
    assert!(reg.register(inst("../etc", "x", 1)).await.is_err(), "path-like names are refused");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn heartbeats_keep_an_entry_alive_and_a_dead_one_expires() {
    let dir = tmpdir("ttl");
    let reg = FileRegistry::new(&dir, Duration::from_secs(1));
    let alive = reg.register(inst("prefill", "p-alive", 3000)).await.unwrap();
    let crashed = reg.register(inst("prefill", "p-crashed", 3001)).await.unwrap();
    // A crash: the heartbeat stops but nobody deregisters.
    drop(crashed);
    let deadline = Duration::from_secs(10);
    let end = tokio::time::Instant::now() + deadline;
    loop {
        let ids: Vec<String> = reg.healthy("prefill").await.unwrap().into_iter().map(|i| i.id).collect();
        if ids == ["p-alive"] {
            break;
        }
        assert!(tokio::time::Instant::now() < end, "crashed entry never expired: {ids:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Well past several TTLs the heartbeated one is still listed.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(reg.healthy("prefill").await.unwrap().len(), 1);
    alive.deregister().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn watch_sees_instances_come_and_go() {
    let dir = tmpdir("watch");
    let reg = Arc::new(FileRegistry::new(&dir, Duration::from_secs(5)));
    let mut rx = watch(reg.clone(), "decode", Duration::from_millis(20));
    let r = reg.register(inst("decode", "d-new", 4000)).await.unwrap();
    let ok = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|v| v.len() == 1)).await.is_ok_and(|r| r.is_ok());
    assert!(ok, "watch never saw the new instance");
    r.deregister().await.unwrap();
    let ok = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|v| v.is_empty())).await.is_ok_and(|r| r.is_ok());
    assert!(ok, "watch never saw the instance leave");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A drain removes the entry for good: a heartbeat that was already under
/// way when the drain began must not write it back (it did, now and then:
/// the drained instance was listed healthy again for a whole TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_entry_never_comes_back() {
    let dir = tmpdir("drain-race");
    // A beat every 10 ms, so that drains land on beats in flight.
    let reg = FileRegistry::new(&dir, Duration::from_millis(30));
    let mut back = 0;
    for i in 0..300u64 {
        let mut r = reg.register(inst("prefill", "p-0", 1000)).await.unwrap();
        // Spread the drains over a beat period.
        tokio::time::sleep(Duration::from_micros(10_000 + (i * 37) % 10_000)).await;
        r.drain().await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
        if !reg.healthy("prefill").await.unwrap().is_empty() {
            back += 1;
        }
        r.deregister().await.unwrap();
    }
    assert_eq!(back, 0, "a drained entry was listed again in {back} of 300 drains");
    std::fs::remove_dir_all(&dir).unwrap();
}
