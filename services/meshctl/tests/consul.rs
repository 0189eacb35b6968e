//! The whole mesh on Consul discovery: `meshctl up --discovery consul://…`
//! against pdmesh_testkit's FAKE Consul agent (Consul cannot be installed
//! here; the fake follows HashiCorp's documented agent API). Real: the six
//! service processes, their registrations, the agent's HTTP checks of their
//! /health, the routers' blocking-query watches, the model and its tokens.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::Mesh;
use pdmesh_testkit::consul::FakeConsul;

const TOKEN: &str = "mesh-test-token";
const KINDS: [&str; 6] = ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"];

fn passing_ids(fake: &FakeConsul, name: &str) -> Vec<String> {
    let checks = fake.checks();
    let mut ids: Vec<String> = fake
        .services()
        .into_iter()
        .filter(|(_, s)| s["Service"] == name)
        .filter(|(id, _)| checks.values().filter(|c| c["ServiceID"] == id.as_str()).all(|c| c["Status"] == "passing"))
        .map(|(id, _)| id)
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mesh_registers_in_consul_and_routes_by_its_checks() {
    let fake = FakeConsul::start_new(Some(TOKEN)).await;
    // The one test of this binary: meshctl, its services and this test's
    // own reads all take the token from the environment, as Consul tools do.
    std::env::set_var("CONSUL_HTTP_TOKEN", TOKEN);
    let url = fake.url();
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up(&[
            "--discovery",
            &url,
            "--consul-check-interval-ms",
            "500",
            "--decode-replicas",
            "2",
            "--threads",
            "1",
            "--no-restart",
        ])
    });

    // Every instance is registered as pdmesh-<kind>, with its meta and an HTTP check of its /health.
    let services = fake.services();
    let checks = fake.checks();
    for kind in KINDS {
        let name = format!("pdmesh-{kind}");
        let of_kind: Vec<_> = services.values().filter(|s| s["Service"] == name.as_str()).collect();
        assert_eq!(of_kind.len(), if kind == "decode" { 2 } else { 1 }, "{name}: {services:?}");
        for s in of_kind {
            let id = s["ID"].as_str().unwrap();
            let meta = &s["Meta"];
            assert_eq!(meta["role"], kind);
            assert_eq!(meta["version"], env!("CARGO_PKG_VERSION"));
            assert_eq!(meta["config_hash"].as_str().map(str::len), Some(16), "{meta}");
            let http = meta["http_addr"].as_str().unwrap();
            if matches!(kind, "prefill" | "decode") {
                assert!(matches!(meta["kv_transport"].as_str(), Some("nixl" | "tcp")), "{meta}");
            }
            let check = &checks[&format!("service:{id}")];
            assert_eq!(check["Type"], "http");
            assert_eq!(check["Status"], "passing", "{check}");
            assert!(check["Output"].as_str().unwrap().contains(&format!("http://{http}/health")), "{check}");
        }
    }

    // Requests find their way through Consul, token for token.
    let router = mesh.router().await;
    common::golden_at_once(&router, 4).await;
    let reqs = fake.requests();
    assert!(reqs.iter().all(|r| r.token.as_deref() == Some(TOKEN)), "every call carries CONSUL_HTTP_TOKEN");
    let watched = reqs.iter().filter(|r| r.path == "/v1/health/service/pdmesh-decode" && r.query.contains("index="));
    assert!(watched.count() >= 1, "the router follows decode workers with blocking queries");

    // kill -9 of a decode: its check fails and it leaves routing within
    // one check interval plus one watch round; requests keep working.
    let victim = mesh.registry().healthy("decode").await.unwrap().pop().unwrap();
    let pid = common::pid_of(&victim);
    common::signal(pid, libc::SIGKILL);
    let t0 = Instant::now();
    while passing_ids(&fake, "pdmesh-decode").contains(&victim.id) {
        assert!(t0.elapsed() < Duration::from_secs(10), "{} still passing", victim.id);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen_dead = t0.elapsed();
    while mesh.registry().healthy("decode").await.unwrap().iter().any(|i| i.id == victim.id) {
        assert!(t0.elapsed() < Duration::from_secs(10), "{} still listed as passing", victim.id);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("decode {} killed: critical after {seen_dead:?}, out of ?passing after {:?}", victim.id, t0.elapsed());
    assert!(seen_dead < Duration::from_millis(500 + 1500), "one check interval (0.5 s) and its timeout: {seen_dead:?}");
    // The router's own watch follows within one round (its queries are >= 0.3 s apart).
    tokio::time::sleep(Duration::from_millis(600)).await;
    common::golden_at_once(&router, 4).await;

    // Shutdown deregisters every live instance; the killed one stays, critical, until the agent reaps it.
    drop(mesh);
    let left: Vec<String> = fake.services().into_keys().collect();
    assert_eq!(left, vec![victim.id.clone()], "only the killed instance is left");
    assert_eq!(fake.checks()[&format!("service:{}", victim.id)]["Status"], "critical");
}
