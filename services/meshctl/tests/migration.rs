//! Decode migration with the real model: a decode worker killed (-9) while
//! it streams a request; the router prefills the prompt and the tokens
//! already sent on another worker and the stream goes on. The caller's
//! tokens equal an undisturbed run of the same request, greedy and seeded.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use pdmesh_core::vocab::metric;
use pdmesh_proto::common::v1 as cpb;
use pdmesh_proto::router::v1 as pb;

/// The decode worker running a sequence now (by its /metrics), and its pid.
async fn busy_decode(mesh: &Mesh) -> (String, i32) {
    for i in mesh.registry().healthy("decode").await.unwrap() {
        let (_, m) = pdmesh_testkit::http_get(i.http_addr.as_deref().unwrap(), "/metrics");
        if pdmesh_core::http::metric(&m, metric::decode::RUNNING).unwrap_or(0.0) >= 1.0 {
            return (i.id.clone(), pid_of(&i));
        }
    }
    panic!("no decode worker is running the request");
}

/// The request's tokens when its decode worker is killed after `after` of them.
async fn disturbed(
    mesh: &Mesh,
    router: &mut pb::router_client::RouterClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
    after: usize,
) -> (Outcome, String) {
    let mut s = router.generate(req).await.unwrap().into_inner();
    let (mut o, mut killed) = (Outcome::default(), None);
    while let Some(m) = s.message().await.unwrap() {
        o.take(m);
        if killed.is_none() && o.ids.len() >= after {
            let (id, pid) = busy_decode(mesh).await;
            signal(pid, libc::SIGKILL);
            killed = Some(id);
        }
    }
    (o, killed.expect("the request outlived its decode worker"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_whose_decode_worker_is_killed_goes_on_elsewhere_as_if_undisturbed() {
    // Two decode workers per case; meshctl restarts the killed one.
    let mesh = tokio::task::block_in_place(|| Mesh::up(&["--decode-replicas", "2", "--threads", "1"]));
    let mut router = mesh.router().await;
    let seeded = cpb::SamplingParams { temperature: 0.9, top_k: 40, seed: 7, ..Default::default() };
    for (name, sampling) in [("greedy", cpb::SamplingParams::default()), ("seeded", seeded)] {
        let mut req = chat_request("Write a short story about a lighthouse keeper.", 96, true);
        req.sampling = Some(sampling);
        let calm = run(&mut router, req.clone()).await.unwrap();
        assert_eq!(calm.ids.len(), 96, "{name}");
        let before = mesh.gauge("router", metric::router::MIGRATIONS_TOTAL).await;
        let (o, killed) = disturbed(&mesh, &mut router, req, 24).await;
        let f = o.finished.as_ref().expect("the request finished");
        assert_ne!(f.decode_worker, killed, "{name}: finished on another decode worker");
        assert_eq!(f.usage.unwrap().completion_tokens, 96, "{name}");
        assert_eq!(o.ids, calm.ids, "{name}: the same tokens as undisturbed, none repeated or missing");
        assert_eq!(o.text, calm.text, "{name}");
        assert_eq!(mesh.gauge("router", metric::router::MIGRATIONS_TOTAL).await, before + 1.0, "{name}");
        // The killed worker's replacement serves again before the next case.
        let t0 = std::time::Instant::now();
        while mesh.registry().healthy("decode").await.unwrap().len() < 2 {
            assert!(t0.elapsed() < std::time::Duration::from_secs(120), "the killed decode was not replaced");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}
