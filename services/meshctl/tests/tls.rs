//! Mutual TLS between services (`meshctl up --tls`): the whole mesh
//! answers golden tokens over TLS, through its gRPC router and through the
//! gateway; every gRPC service refuses a plaintext client, a TLS client
//! with no certificate, and one whose certificate another CA signed; and
//! the kvbroker lets each identity do only its own part (a prefill cannot
//! register as a decode nor open tickets, a client cannot touch tickets).
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Mesh, Raw};
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::router::v1 as rpb;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A TLS client trusting the mesh's CA, with the identity in `<dir>/<file>.pem` (none if `file` is None).
fn tls(dir: &Path, file: Option<&str>) -> ClientTlsConfig {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    let t = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("ca.pem")));
    match file {
        Some(f) => t.identity(Identity::from_pem(read(&format!("{f}.pem")), read(&format!("{f}.key")))),
        None => t,
    }
}

/// A client certificate signed by a CA the mesh does not know.
fn stranger(dir: &Path) -> ClientTlsConfig {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    p.distinguished_name.push(DnType::CommonName, "decode/decode-0");
    let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
    let mesh_ca = std::fs::read_to_string(dir.join("ca.pem")).unwrap();
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(mesh_ca))
        .identity(Identity::from_pem(cert.pem(), key.serialize_pem()))
}

async fn channel(addr: &str, tls: Option<ClientTlsConfig>) -> Result<Channel, tonic::transport::Error> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}")).unwrap().connect_timeout(Duration::from_secs(2));
    if let Some(t) = tls {
        ep = ep.tls_config(t)?;
    }
    ep.connect().await
}

/// A gRPC health check of `addr` as this client; Err says why it failed.
async fn health(addr: &str, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let ch = channel(addr, tls).await.map_err(|e| format!("connect: {e:?}"))?;
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.map_err(|e| format!("ready: {e}"))?;
    let path = "/grpc.health.v1.Health/Check".parse().unwrap();
    let mut req = tonic::Request::new(Vec::new()); // HealthCheckRequest { service: "" }
    req.set_timeout(Duration::from_secs(3));
    grpc.unary(req, path, Raw).await.map(|_| ()).map_err(|e| format!("{:?}: {}", e.code(), e.message()))
}

/// The call was refused with PERMISSION_DENIED.
fn denied<T>(r: Result<tonic::Response<T>, tonic::Status>, what: &str) {
    let e = r.map(|_| ()).expect_err(what);
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{what}: {e:?}");
    eprintln!("{what}: {}", e.message());
}

/// A one-block ticket for `dest`.
fn one_block(id: &str, dest: &str) -> kpb::OpenTicketRequest {
    kpb::OpenTicketRequest {
        request_id: id.into(),
        dest_worker: dest.into(),
        dest_blocks: vec![1],
        n_tokens: 1,
        lease_ms: 1000,
    }
}

async fn broker(addr: &str, dir: &Path, who: &str) -> kpb::kv_broker_client::KvBrokerClient<Channel> {
    kpb::kv_broker_client::KvBrokerClient::new(channel(addr, Some(tls(dir, Some(who)))).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_tls_the_mesh_serves_and_every_service_refuses_strangers() {
    let mesh = Mesh::up(&["--tls"]);
    let dir = mesh.dir.join("tls");
    // Golden tokens through the router, as the mesh's own client ...
    let r = mesh.instance("router").await;
    let router =
        rpb::router_client::RouterClient::new(channel(&r.grpc_addr, Some(tls(&dir, Some("client")))).await.unwrap());
    common::golden_at_once(&router, 4).await;
    // ... and through the gateway, whose calls to the router are TLS too.
    let (status, body) = tokio::task::block_in_place(|| {
        mesh.post("/v1/chat/completions", &common::chat_body("The capital of France is", r#","max_tokens":4"#), &[])
    });
    assert_eq!(status, 200, "{body}");

    let mut refused = 0;
    for kind in ["tokenizer", "kvbroker", "prefill", "decode", "router"] {
        for i in mesh.registry().healthy(kind).await.unwrap() {
            let a = i.grpc_addr.as_str();
            health(a, Some(tls(&dir, Some("client"))))
                .await
                .unwrap_or_else(|e| panic!("{kind} with the mesh's cert: {e}"));
            for (who, t) in
                [("plaintext", None), ("no certificate", Some(tls(&dir, None))), ("another CA", Some(stranger(&dir)))]
            {
                let e = health(a, t).await.expect_err(&format!("{} must refuse a client with {who}", i.id));
                eprintln!("{} refused {who}: {e}", i.id);
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 15);

    // The kvbroker checks who does what.
    let b = mesh.instance("kvbroker").await.grpc_addr;
    let mut as_prefill = broker(&b, &dir, "prefill-0").await;
    let fake = kpb::Agent { worker_id: "decode-0".into(), address: "127.0.0.1:1".into(), ..Default::default() };
    let r = as_prefill.register_agent(kpb::RegisterAgentRequest { agent: Some(fake) }).await;
    denied(r, "a prefill registering the decode's agent");
    denied(as_prefill.open_ticket(one_block("tls-t1", "prefill-0")).await, "a prefill opening a ticket");
    let mut as_decode = broker(&b, &dir, "decode-0").await;
    let claim = kpb::ClaimTicketRequest { request_id: "tls-t1".into(), source_worker: "decode-0".into() };
    denied(as_decode.claim_ticket(claim).await, "a decode claiming a ticket");
    denied(
        as_decode.open_ticket(one_block("tls-t2", "decode-1")).await,
        "a decode opening a ticket for another decode",
    );
    let mut as_client = broker(&b, &dir, "client").await;
    let cancel = kpb::CancelTicketRequest { request_id: "tls-t1".into(), reason: "x".into() };
    denied(as_client.cancel_ticket(cancel).await, "a client cancelling a ticket");
    let get = kpb::GetAgentRequest { worker_id: "decode-0".into() };
    denied(as_client.get_agent(get).await, "a client reading a worker's agent");
    // The mesh serves on after all that.
    common::golden_at_once(&router, 2).await;
}
