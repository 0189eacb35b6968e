//! The Consul backend against pdmesh_testkit's FAKE Consul agent (no Consul
//! can be installed on these machines; the fake follows HashiCorp's
//! documented API: see its module docs). What is real here: the backend's
//! HTTP calls, its blocking-query loop, and the admin /health endpoint the
//! fake agent checks over HTTP.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_core::admin::{serve_admin, AdminState};
use pdmesh_core::discovery::{health, watch, Consul, ConsulConfig, Discovery, Instance};
use pdmesh_core::tls::ClientTls;
use pdmesh_testkit::consul::{FakeConsul, TestCa};

const TOKEN: &str = "test-token-1";

fn config(fake: &FakeConsul, token: Option<&str>, tls: Option<ClientTls>) -> ConsulConfig {
    ConsulConfig {
        addr: fake.addr.to_string(),
        token: token.map(str::to_string),
        check_interval: Duration::from_millis(200),
        wait: Duration::from_secs(30),
        deregister_after: Duration::from_secs(60),
        tls,
    }
}

fn consul(fake: &FakeConsul, token: Option<&str>) -> Arc<Consul> {
    Arc::new(Consul::new(config(fake, token, None)).unwrap())
}

fn inst(id: &str, port: u16, http: Option<String>) -> Instance {
    Instance {
        service: "decode".into(),
        id: id.into(),
        grpc_addr: format!("127.0.0.1:{port}"),
        http_addr: http,
        meta: [("version".to_string(), "0.1.0".to_string())].into(),
    }
}

/// A real admin server (its /health is what the fake agent checks); the
/// sender stops it, as a crash would.
async fn admin() -> (String, tokio::sync::oneshot::Sender<()>) {
    let state = AdminState::new("decode", serde_json::json!({}), Arc::new(|_| String::new()));
    state.set_ready(true);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_admin(l, state, async {
        let _ = rx.await;
    }));
    (addr, tx)
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(tokio::time::Instant::now() < end, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ids(rx: &tokio::sync::watch::Receiver<Vec<Instance>>) -> Vec<String> {
    rx.borrow().iter().map(|i| i.id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_the_agent_and_is_followed_by_blocking_queries() {
    let fake = FakeConsul::start_new(Some(TOKEN)).await;
    let c = consul(&fake, Some(TOKEN));
    let (http, _stop) = admin().await;
    let reg = c.register(inst("decode-a", 7001, Some(http.clone()))).await.unwrap();

    // The registration, as the agent holds it.
    let svc = &fake.services()["decode-a"];
    assert_eq!(svc["Service"], "pdmesh-decode");
    assert_eq!((svc["Address"].as_str(), svc["Port"].as_u64()), (Some("127.0.0.1"), Some(7001)));
    assert_eq!(svc["Meta"]["http_addr"], http.as_str());
    assert_eq!(svc["Meta"]["version"], "0.1.0");
    let check = &fake.checks()["service:decode-a"];
    assert_eq!(check["Type"], "http");
    assert_eq!(check["Status"], "passing");

    let mut rx = watch(c.clone(), "decode", Duration::from_millis(50));
    until("the watch sees decode-a", || ids(&rx) == ["decode-a"]).await;
    assert_eq!(rx.borrow()[0].http_addr.as_deref(), Some(http.as_str()));
    assert_eq!(rx.borrow()[0].meta.get("version").map(String::as_str), Some("0.1.0"));

    // Quiet for 2 s: a blocking query waits instead of polling every 50 ms.
    let before = fake.requests().iter().filter(|r| r.path == "/v1/health/service/pdmesh-decode").count();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reads: Vec<_> = fake.requests().into_iter().filter(|r| r.path == "/v1/health/service/pdmesh-decode").collect();
    assert!(reads.len() - before <= 3, "{} reads in 2 quiet seconds: polling, not blocking", reads.len() - before);
    let last = reads.last().unwrap();
    assert!(
        last.query.contains("index=") && last.query.contains("wait=30s") && last.query.contains("passing"),
        "{}",
        last.query
    );

    // A second instance shows up at once, a drained one leaves at once.
    let (http_b, _stop_b) = admin().await;
    let mut b = c.register(inst("decode-b", 7002, Some(http_b))).await.unwrap();
    rx.changed().await.unwrap();
    until("the watch sees decode-b", || ids(&rx) == ["decode-a", "decode-b"]).await;
    b.drain().await.unwrap();
    until("the drained decode-b leaves", || ids(&rx) == ["decode-a"]).await;
    assert_eq!(fake.checks()["_service_maintenance:decode-b"]["Status"], "critical");
    assert!(fake.services().contains_key("decode-b"), "a drained instance stays registered");
    b.deregister().await.unwrap();
    reg.deregister().await.unwrap();
    assert!(fake.services().is_empty(), "deregistered on shutdown: {:?}", fake.services());
    until("the watch is empty", || rx.borrow().is_empty()).await;
    assert!(fake.requests().iter().all(|r| r.token.as_deref() == Some(TOKEN)), "every call carries the token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instance_is_dropped_by_its_check() {
    let fake = FakeConsul::start_new(None).await;
    let c = consul(&fake, None);
    // HTTP check: the process dies (its /health stops answering).
    let (http, stop) = admin().await;
    let _hc = c.register(inst("decode-http", 7101, Some(http))).await.unwrap();
    // TTL check: no HTTP address; dropping the registration stops its heartbeat.
    let ttl = c.register(inst("decode-ttl", 7102, None)).await.unwrap();
    assert_eq!(fake.checks()["service:decode-ttl"]["Type"], "ttl");
    let rx = watch(c.clone(), "decode", Duration::from_millis(50));
    until("both are seen", || ids(&rx).len() == 2).await;
    // Both stay passing for many check intervals while alive.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ids(&rx), ["decode-http", "decode-ttl"]);
    let _ = stop.send(());
    drop(ttl);
    let t0 = std::time::Instant::now();
    until("both dead instances leave routing", || rx.borrow().is_empty()).await;
    // One HTTP interval (0.2 s) or one TTL (0.6 s), plus one watch round.
    assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());
    assert!(fake.services().contains_key("decode-http"), "critical, not yet reaped (DeregisterCriticalServiceAfter)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_agent_keeps_the_last_view_and_is_recovered_from() {
    let mut fake = FakeConsul::start_new(None).await;
    let c = consul(&fake, None);
    let _a = c.register(inst("decode-x", 7201, None)).await.unwrap();
    let rx = watch(c.clone(), "decode", Duration::from_millis(50));
    until("decode-x is seen", || ids(&rx) == ["decode-x"]).await;
    fake.stop();
    until("the outage is noticed", || !health().is_up()).await;
    let detail = health().detail().unwrap();
    assert!(
        detail.contains("serving on the last known instances") && detail.contains(&fake.addr.to_string()),
        "{detail}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ids(&rx), ["decode-x"], "the last view is kept while the agent is away");
    fake.start().await;
    let _b = c.register(inst("decode-y", 7202, None)).await.unwrap();
    until("the watch recovers on its own", || ids(&rx) == ["decode-x", "decode-y"]).await;
    until("the outage is over", || health().is_up()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_the_agent_lost_is_made_again() {
    let fake = FakeConsul::start_new(None).await;
    let c = consul(&fake, None);
    let _r = c.register(inst("decode-lost", 7301, None)).await.unwrap();
    // The agent forgets it (e.g. restarted without its data folder).
    let (code, _) = tokio::task::spawn_blocking({
        let a = fake.addr.to_string();
        move || pdmesh_core::http::put(&a, "/v1/agent/service/deregister/decode-lost", Duration::from_secs(5))
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(code, 200);
    assert!(!fake.services().contains_key("decode-lost"));
    until("registered again by its heartbeat", || fake.services().contains_key("decode-lost")).await;
}

/// A raw call: status, headers and body.
fn raw(addr: &str, method: &str, path: &str, body: &str, token: Option<&str>) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let tok = token.map(|t| format!("X-Consul-Token: {t}\r\n")).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{tok}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (head.split_whitespace().nth(1).unwrap().parse().unwrap(), head.to_lowercase(), body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_agent_keeps_to_the_documented_shapes() {
    let fake = FakeConsul::start_new(Some(TOKEN)).await;
    let a = fake.addr.to_string();
    tokio::task::spawn_blocking(move || {
        let t = Some(TOKEN);
        assert_eq!(raw(&a, "GET", "/v1/health/service/nothing?passing", "", None).0, 403, "no token: refused");
        let (code, head, body) = raw(&a, "GET", "/v1/health/service/nothing?passing", "", t);
        assert_eq!((code, body.as_str()), (200, "[]"), "an empty list is [], never null");
        assert!(head.contains("x-consul-index: "), "reads carry X-Consul-Index: {head}");
        let reg = r#"{"Name": "web", "Port": 80, "Check": {"TTL": "30s"}}"#;
        assert_eq!(raw(&a, "PUT", "/v1/agent/service/register", reg, t).0, 200);
        let (_, _, body) = raw(&a, "GET", "/v1/health/service/web", "", t);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v[0]["Service"]["ID"], "web", "ID defaults to Name");
        assert!(v[0]["Service"]["Meta"].is_null(), "no Meta given: null");
        assert_eq!(v[0]["Service"]["Tags"], serde_json::json!([]));
        let check = v[0]["Checks"].as_array().unwrap().iter().find(|c| c["CheckID"] == "service:web").unwrap();
        assert_eq!(check["Status"], "critical", "a new check starts critical");
        let (_, _, body) = raw(&a, "GET", "/v1/health/service/web?passing", "", t);
        assert_eq!(body, "[]", "?passing drops it");
        assert_eq!(raw(&a, "PUT", "/v1/agent/check/pass/service:web", "", t).0, 200);
        let (_, _, body) = raw(&a, "GET", "/v1/health/service/web?passing", "", t);
        assert!(body.contains("\"ID\":\"web\""), "{body}");
        assert_eq!(raw(&a, "PUT", "/v1/agent/service/register", r#"{"Port": 1}"#, t).0, 400, "a name is required");
        assert_eq!(raw(&a, "PUT", "/v1/agent/service/maintenance/web", "", t).0, 400, "enable is required");
        assert_eq!(raw(&a, "PUT", "/v1/agent/service/deregister/none", "", t).0, 404);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_agent_is_verified_against_the_given_ca() {
    let dir = std::env::temp_dir().join(format!("pdmesh-consul-tls-{}", std::process::id()));
    let ca = TestCa::new(&dir.join("ca"));
    let fake = FakeConsul::start_tls(Some(TOKEN), &ca).await;
    let trusting = ClientTls { ca_file: Some(ca.ca_pem.clone()), ..Default::default() };
    let c = Arc::new(Consul::new(config(&fake, Some(TOKEN), Some(trusting))).unwrap());
    assert!(c.describe().contains("https"), "{}", c.describe());
    let _r = c.register(inst("decode-tls", 7401, None)).await.unwrap();
    let rx = watch(c.clone(), "decode", Duration::from_millis(50));
    until("the watch sees decode-tls over TLS", || ids(&rx) == ["decode-tls"]).await;
    assert!(fake.requests().iter().all(|r| r.token.as_deref() == Some(TOKEN)));

    // Trusting another CA: refused, and the error says it is the certificate.
    let other = TestCa::new(&dir.join("other"));
    let wrong = ClientTls { ca_file: Some(other.ca_pem.clone()), ..Default::default() };
    let e = Consul::new(config(&fake, Some(TOKEN), Some(wrong))).unwrap().healthy("decode").await.unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    // Plain HTTP to an HTTPS agent fails too (no answer it can read).
    assert!(Consul::new(config(&fake, Some(TOKEN), None)).unwrap().healthy("decode").await.is_err());
    // A CA file that is not PEM is a clear error when the client is made.
    std::fs::write(dir.join("junk.pem"), "not a certificate").unwrap();
    let junk = ClientTls { ca_file: Some(dir.join("junk.pem")), ..Default::default() };
    let e = Consul::new(config(&fake, None, Some(junk))).err().expect("junk CA refused").to_string();
    assert!(e.contains("junk.pem"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
