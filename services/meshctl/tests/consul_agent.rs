//! The whole mesh on a REAL Consul agent: Consul v1.16.1 (the last 1.16
//! release under MPL-2.0; scripts/gotool.sh consul builds it, which
//! scripts/test.sh runs) as `consul agent -dev` on loopback with ACLs on
//! and deny by default, so every call the mesh makes needs its token.
//! Checked through the agent's own API and log: registration with HTTP
//! checks, the routers' blocking queries, a kill -9 of a decode worker
//! replaced and passing again, a frozen one (SIGSTOP) going critical and
//! out of `?passing` until it answers again, and `meshctl scale`
//! and `meshctl drain` showing in the catalog and as maintenance. The fast
//! discovery tests keep the fake agent (tests/consul.rs).
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Mesh;
use serde_json::Value;

const TOKEN: &str = "pdmesh-test-management-token";

/// The Consul binary: PDMESH_CONSUL_BIN, else where scripts/gotool.sh consul builds it.
fn consul_bin() -> Option<PathBuf> {
    common::cached_tool("PDMESH_CONSUL_BIN", "consul", "v1.16.1")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `consul agent -dev` on loopback, killed when dropped.
struct Agent {
    child: Child,
    http: String,
    log: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn start(bin: &PathBuf, dir: &std::path::Path) -> Agent {
        let acl = dir.join("acl.hcl");
        // The agent needs a token of its own for anti-entropy: without one
        // it cannot sync a deregistration to the catalog ("Service
        // deregistration blocked by ACLs"), and drained instances stay listed.
        let hcl = format!(
            "acl {{\n  enabled = true\n  default_policy = \"deny\"\n  tokens {{\n    initial_management = \"{TOKEN}\"\n    agent = \"{TOKEN}\"\n  }}\n}}\n"
        );
        std::fs::write(&acl, hcl).unwrap();
        let http_port = free_port();
        let log = dir.join("consul.log");
        let out = std::fs::File::create(&log).unwrap();
        let port = |p: u16| p.to_string();
        let child = Command::new(bin)
            .args(["agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1", "-node", "pdmesh-test"])
            .args(["-http-port", &port(http_port), "-dns-port", "-1", "-grpc-port", "-1"])
            .args(["-serf-lan-port", &port(free_port()), "-serf-wan-port", &port(free_port())])
            .args(["-server-port", &port(free_port())])
            .arg(format!("-config-file={}", acl.display()))
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .expect("run consul");
        let a = Agent { child, http: format!("127.0.0.1:{http_port}"), log };
        // Ready once it has a leader and the management token reads the catalog.
        let t0 = Instant::now();
        while a.get("/v1/catalog/services").0 != 200 {
            assert!(t0.elapsed() < Duration::from_secs(60), "consul agent not ready: {}", a.log_text());
            std::thread::sleep(Duration::from_millis(200));
        }
        a
    }

    /// GET with the management token: (status, JSON).
    fn get(&self, path: &str) -> (u16, Value) {
        self.get_as(path, Some(TOKEN))
    }

    fn get_as(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        // Not listening yet (starting): status 0.
        let Ok(mut s) = std::net::TcpStream::connect(&self.http) else { return (0, Value::Null) };
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let auth = token.map(|t| format!("X-Consul-Token: {t}\r\n")).unwrap_or_default();
        use std::io::{Read, Write};
        write!(s, "GET {path} HTTP/1.1\r\nHost: {}\r\n{auth}Connection: close\r\n\r\n", self.http).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let (code, body) = common::parse_response(&raw);
        (code, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Instance ids of `pdmesh-<kind>` in the catalog.
    fn catalog(&self, kind: &str) -> Vec<String> {
        let (_, v) = self.get(&format!("/v1/catalog/service/pdmesh-{kind}"));
        let mut ids: Vec<String> =
            v.as_array().into_iter().flatten().filter_map(|e| e["ServiceID"].as_str().map(str::to_string)).collect();
        ids.sort();
        ids
    }

    /// Instance ids of `pdmesh-<kind>` whose every check passes.
    fn passing(&self, kind: &str) -> Vec<String> {
        let (_, v) = self.get(&format!("/v1/health/service/pdmesh-{kind}?passing"));
        let mut ids: Vec<String> = v
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["Service"]["ID"].as_str().map(str::to_string))
            .collect();
        ids.sort();
        ids
    }

    /// The status of check `id` on this agent ("" when absent).
    fn check(&self, id: &str) -> String {
        let (_, v) = self.get("/v1/agent/checks");
        v[id]["Status"].as_str().unwrap_or_default().to_string()
    }
}

fn wait(what: &str, within: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mesh_runs_on_a_real_consul_agent_with_acls() {
    let Some(bin) = consul_bin() else {
        let why = "no Consul binary (run scripts/gotool.sh consul, or set PDMESH_CONSUL_BIN)";
        assert!(std::env::var_os("PDMESH_REQUIRE_CONSUL").is_none(), "{why}");
        pdmesh_testkit::skip("the_mesh_runs_on_a_real_consul_agent_with_acls", why);
        return;
    };
    let dir = std::env::temp_dir().join(format!("pdmesh-consul-agent-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let agent = tokio::task::block_in_place(|| Agent::start(&bin, &dir));
    // The one test of this binary: meshctl, its services and meshctl's
    // commands take the token from the environment, as Consul tools do.
    std::env::set_var("CONSUL_HTTP_TOKEN", TOKEN);
    let url = format!("consul://{}", agent.http);
    let at = ["--discovery", url.as_str()];
    let mesh = tokio::task::block_in_place(|| {
        Mesh::up(&[at[0], at[1], "--consul-check-interval-ms", "500", "--decode-replicas", "2", "--threads", "1"])
    });

    // Registration: every instance as pdmesh-<kind>, each with a passing HTTP check of its /health.
    let (_, services) = agent.get("/v1/agent/services");
    let (_, checks) = agent.get("/v1/agent/checks");
    for kind in ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"] {
        let ids = agent.catalog(kind);
        assert_eq!(ids.len(), if kind == "decode" { 2 } else { 1 }, "{kind}: {services}");
        for id in ids {
            assert_eq!(services[&id]["Meta"]["role"], kind, "{services}");
            let check = &checks[format!("service:{id}")];
            assert_eq!((check["Type"].as_str(), check["Status"].as_str()), (Some("http"), Some("passing")), "{check}");
        }
    }
    assert_eq!(agent.catalog("meshctl").len(), 1, "meshctl up's control endpoint");
    let (_, anonymous) = agent.get_as("/v1/agent/services", None);
    assert_eq!(anonymous, serde_json::json!({}), "ACLs deny by default: without the token nothing is seen");

    // Requests route through it; the routers follow workers with blocking queries.
    let router = mesh.router().await;
    common::golden_at_once(&router, 4).await;
    // kill -9 of a decode worker: meshctl's replacement registers again and
    // passes. (The agent may not see the dead one critical first: its checks
    // run at most once a second, and the replacement can re-register sooner.)
    let victim = agent.passing("decode").pop().unwrap();
    let inst = mesh.registry().healthy("decode").await.unwrap().into_iter().find(|i| i.id == victim).unwrap();
    let old_pid = common::pid_of(&inst);
    common::signal(old_pid, libc::SIGKILL);
    let back = tokio::task::block_in_place(|| {
        let rt = tokio::runtime::Handle::current();
        wait("the replacement registered and passing", Duration::from_secs(120), || {
            let list = rt.block_on(mesh.registry().healthy("decode")).unwrap_or_default();
            let replaced = list.iter().any(|i| i.id == victim && common::pid_of(i) > 0 && common::pid_of(i) != old_pid);
            replaced && agent.passing("decode").contains(&victim)
        })
    });
    eprintln!("decode {victim} killed: replaced and passing after {back:?}");
    common::golden_at_once(&router, 2).await;
    // An instance that stops answering (SIGSTOP) goes critical at the agent
    // and out of ?passing, so routers drop it; answering again, it passes.
    let frozen = agent.passing("decode").into_iter().find(|id| *id != victim).unwrap();
    let inst = mesh.registry().healthy("decode").await.unwrap().into_iter().find(|i| i.id == frozen).unwrap();
    let pid = common::pid_of(&inst);
    common::signal(pid, libc::SIGSTOP);
    let check = format!("service:{frozen}");
    // The agent's own check turns critical first; its catalog (what
    // ?passing reads) follows when the agent syncs, a moment later.
    let critical = tokio::task::block_in_place(|| {
        wait("the frozen decode's check critical", Duration::from_secs(15), || agent.check(&check) == "critical")
    });
    tokio::task::block_in_place(|| {
        wait("the critical instance out of ?passing", Duration::from_secs(10), || {
            !agent.passing("decode").contains(&frozen)
        })
    });
    eprintln!("decode {frozen} frozen: critical after {critical:?}");
    common::golden_at_once(&router, 2).await;
    common::signal(pid, libc::SIGCONT);
    tokio::task::block_in_place(|| {
        wait("the thawed decode passing", Duration::from_secs(15), || agent.passing("decode").contains(&frozen))
    });
    // The routers saw all that through blocking queries: the agent logs each
    // one when it returns (held, here, until a change).
    let blocking = |l: &&str| l.contains("/v1/health/service/pdmesh-decode?") && l.contains("index=");
    let log = agent.log_text();
    assert!(log.lines().any(|l| blocking(&l)), "no blocking query for pdmesh-decode in the agent's log");

    // meshctl scale shows in the catalog; meshctl drain puts the instance in maintenance, then it leaves.
    tokio::task::block_in_place(|| common::meshctl_ok(&["scale", "decode=3"], &at));
    assert_eq!(agent.catalog("decode").len(), 3);
    tokio::task::block_in_place(|| {
        wait("three decode workers passing", Duration::from_secs(30), || agent.passing("decode").len() == 3)
    });
    let drained = agent.catalog("decode").pop().unwrap();
    tokio::task::block_in_place(|| common::meshctl_ok(&["drain", &drained], &at));
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains(&format!("/v1/agent/service/maintenance/{drained}?enable=true"))),
        "the drained instance went into maintenance"
    );
    tokio::task::block_in_place(|| {
        wait("the drained instance gone from the catalog", Duration::from_secs(30), || {
            !agent.catalog("decode").contains(&drained)
        })
    });
    assert_eq!(agent.catalog("decode").len(), 2);
    common::golden_at_once(&router, 2).await;

    // Stopping the mesh deregisters everything it registered.
    drop(mesh);
    let (_, left) = agent.get("/v1/agent/services");
    assert_eq!(left.as_object().map(|o| o.len()), Some(0), "left registered: {left}");
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}
