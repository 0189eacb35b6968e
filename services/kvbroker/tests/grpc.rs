//! The broker booted for real on a loopback port.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use pb::kv_broker_client::KvBrokerClient;
use pb::TicketState;
use pdmesh_proto::kvbroker::v1 as pb;
use tonic::transport::Channel;
use tonic::Code;

fn config(
    listener: &tokio::net::TcpListener,
    common: pdmesh_core::args::CommonArgs,
) -> pdmesh_kvbroker::config::Config {
    pdmesh_kvbroker::config::Config {
        listen: listener.local_addr().unwrap(),
        tick_ms: 10,
        retention_s: 60,
        max_lease_ms: 10_000,
        max_tickets: 64,
        max_agents: 3,
        max_tickets_per_worker: 48,
        agent_ttl_s: 30,
        common,
    }
}

async fn boot_with(common: pdmesh_core::args::CommonArgs) -> (KvBrokerClient<Channel>, pdmesh_testkit::Running) {
    let svc = pdmesh_testkit::spawn(move |l, stop| pdmesh_kvbroker::serve(config(&l, common), l, stop)).await;
    pdmesh_testkit::wait_healthy(&svc.url, "pdmesh.kvbroker.v1.KvBroker").await;
    (KvBrokerClient::connect(svc.url.clone()).await.unwrap(), svc)
}

async fn boot() -> (KvBrokerClient<Channel>, pdmesh_testkit::Running) {
    boot_with(Default::default()).await
}

fn open(id: &str, lease_ms: u32) -> pb::OpenTicketRequest {
    pb::OpenTicketRequest {
        request_id: id.into(),
        dest_worker: "decode-0".into(),
        dest_blocks: vec![5, 6, 7],
        n_tokens: 40,
        lease_ms,
    }
}

fn st(t: &pb::Ticket) -> TicketState {
    TicketState::try_from(t.state).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_dispatch_flow_and_watchers_see_every_state() {
    let (mut c, svc) = boot().await;
    c.register_agent(pb::RegisterAgentRequest {
        agent: Some(pb::Agent {
            worker_id: "decode-0".into(),
            transport: pb::Transport::Tcp as i32,
            address: "127.0.0.1:1".into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    assert_eq!(
        c.get_agent(pb::GetAgentRequest { worker_id: "decode-0".into() }).await.unwrap().into_inner().address,
        "127.0.0.1:1"
    );
    assert_eq!(c.get_agent(pb::GetAgentRequest { worker_id: "nope".into() }).await.unwrap_err().code(), Code::NotFound);

    // The prefill claims before the decode opened: the claim waits.
    let mut watch = c.watch_ticket(pb::WatchTicketRequest { request_id: "r1".into() }).await.unwrap().into_inner();
    let mut c2 = c.clone();
    let claim = tokio::spawn(async move {
        c2.claim_ticket(pb::ClaimTicketRequest { request_id: "r1".into(), source_worker: "prefill-0".into() }).await
    });
    c.open_ticket(open("r1", 5000)).await.unwrap();
    let claimed = claim.await.unwrap().unwrap().into_inner();
    assert_eq!(
        (st(&claimed), claimed.dest_blocks.clone(), claimed.source_worker.as_str()),
        (TicketState::Claimed, vec![5, 6, 7], "prefill-0")
    );
    let done = c
        .complete_ticket(pb::CompleteTicketRequest {
            request_id: "r1".into(),
            outcome: Some(pb::complete_ticket_request::Outcome::FirstToken(42)),
            bytes: 999,
            block_crc32c: vec![0xdead_beef, 7],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.first_token, Some(42));
    assert_eq!(done.block_crc32c, [0xdead_beef, 7], "the watcher gets the sender's checksums");
    let mut seen = Vec::new();
    while let Some(t) = watch.message().await.unwrap() {
        seen.push(st(&t));
    }
    // Watch coalesces fast changes, but always starts with the current state and ends terminal.
    assert_eq!(*seen.last().unwrap(), TicketState::Done, "{seen:?}");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_and_cancel_end_tickets_for_everyone() {
    let (mut c, svc) = boot().await;
    // A transfer stalled past its lease: the watcher (the decode) learns promptly.
    // The lease leaves time for the claim on a loaded machine; a renewal
    // asking for less does not shorten it (renewals only extend).
    c.open_ticket(open("slow", 1500)).await.unwrap();
    c.claim_ticket(pb::ClaimTicketRequest { request_id: "slow".into(), source_worker: "p".into() }).await.unwrap();
    let r =
        c.renew_lease(pb::RenewLeaseRequest { request_id: "slow".into(), lease_ms: 100 }).await.unwrap().into_inner();
    assert!(r.lease_deadline_unix_ms >= kvbroker_now_ms() + 500, "a short renewal cut the lease");
    let mut w = c.watch_ticket(pb::WatchTicketRequest { request_id: "slow".into() }).await.unwrap().into_inner();
    let last = tokio::time::timeout(Duration::from_secs(5), async {
        let mut last = None;
        while let Some(t) = w.message().await.unwrap() {
            last = Some(t);
        }
        last.unwrap()
    })
    .await
    .expect("watcher never saw the lease expire");
    assert_eq!((st(&last), last.reason.as_str()), (TicketState::Expired, "lease expired"));
    // Completing after expiry is refused: the decode already freed its blocks.
    let late = c
        .complete_ticket(pb::CompleteTicketRequest {
            request_id: "slow".into(),
            outcome: Some(pb::complete_ticket_request::Outcome::FirstToken(1)),
            ..Default::default()
        })
        .await;
    assert_eq!(late.unwrap_err().code(), Code::FailedPrecondition);

    // The client went away before the decode admitted the request: the late open fails.
    let t = c
        .cancel_ticket(pb::CancelTicketRequest { request_id: "gone".into(), reason: "client disconnected".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st(&t), TicketState::Cancelled);
    assert_eq!(c.open_ticket(open("gone", 1000)).await.unwrap_err().code(), Code::FailedPrecondition);
    // A waiting claim is released by the cancel instead of hanging.
    let mut c2 = c.clone();
    let claim = tokio::spawn(async move {
        c2.claim_ticket(pb::ClaimTicketRequest { request_id: "r2".into(), source_worker: "p".into() }).await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.cancel_ticket(pb::CancelTicketRequest { request_id: "r2".into(), reason: "decode died".into() }).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), claim).await.expect("claim hung").unwrap();
    assert_eq!(r.unwrap_err().code(), Code::FailedPrecondition);

    assert_eq!(c.open_ticket(open("bad-lease", 0)).await.unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(c.open_ticket(open("too-long", 3_600_000)).await.unwrap_err().code(), Code::InvalidArgument);
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_tickets_by_state_and_lease_expiries() {
    use pdmesh_core::discovery::{Discovery, FileRegistry};
    let dir = std::env::temp_dir().join(format!("pdmesh-broker-registry-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut c, svc) = boot_with(pdmesh_core::args::CommonArgs {
        http_listen: Some("127.0.0.1:0".parse().unwrap()),
        discovery: pdmesh_core::discovery::DiscoveryArgs {
            registry_dir: Some(dir.clone()),
            registry_ttl_s: 10,
            ..Default::default()
        },
        instance_id: Some("broker-0".into()),
        ..Default::default()
    })
    .await;
    let reg = FileRegistry::new(&dir, Duration::from_secs(10));
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    let http = loop {
        if let Some(i) = reg.healthy("kvbroker").await.unwrap().pop() {
            break i.http_addr.unwrap();
        }
        assert!(tokio::time::Instant::now() < end, "broker never registered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    c.open_ticket(open("live", 10_000)).await.unwrap();
    c.open_ticket(open("stall", 50)).await.unwrap();
    let mut w = c.watch_ticket(pb::WatchTicketRequest { request_id: "stall".into() }).await.unwrap().into_inner();
    while w.message().await.unwrap().is_some() {}
    let h = http.clone();
    let (_, body) = tokio::task::spawn_blocking(move || pdmesh_testkit::http_get(&h, "/metrics")).await.unwrap();
    assert!(body.contains("pdmesh_kvbroker_tickets{state=\"open\"} 1"), "{body}");
    assert!(body.contains("pdmesh_kvbroker_tickets{state=\"expired\"} 1"), "{body}");
    assert!(body.contains("pdmesh_kvbroker_lease_expiries_total 1"), "{body}");
    svc.stop().await;
    assert!(reg.healthy("kvbroker").await.unwrap().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The ticket and agent tables are bounded: new ids past the bounds get
/// RESOURCE_EXHAUSTED while known ones keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_are_bounded() {
    let (mut c, svc) = boot().await;
    let agent = |id: &str| pb::RegisterAgentRequest {
        agent: Some(pb::Agent {
            worker_id: id.into(),
            transport: pb::Transport::Tcp as i32,
            address: "127.0.0.1:1".into(),
            ..Default::default()
        }),
    };
    let mut refused_at = None;
    for i in 0..10 {
        if let Err(e) = c.register_agent(agent(&format!("decode-{i}"))).await {
            assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
            refused_at = Some(i);
            break;
        }
    }
    assert_eq!(refused_at, Some(3), "the fourth worker id is refused");
    c.register_agent(agent("decode-0")).await.expect("a known worker registers again");
    let mut made = 0;
    let e = loop {
        let r =
            c.cancel_ticket(pb::CancelTicketRequest { request_id: format!("junk-{made}"), reason: "x".into() }).await;
        match r {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
        assert!(made <= 64, "no bound on tickets");
    };
    assert_eq!((e.code(), made), (Code::ResourceExhausted, 64), "{e:?}");
    let e = c.watch_ticket(pb::WatchTicketRequest { request_id: "one-more".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    let long = "x".repeat(600);
    let e = c.cancel_ticket(pb::CancelTicketRequest { request_id: long, reason: "x".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    svc.stop().await;
}

fn kvbroker_now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}
