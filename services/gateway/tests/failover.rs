//! The gateway's router failover against two FAKE routers (scripted gRPC
//! servers in this process, not the real router): the real gateway, its
//! real HTTP front, and a TCP relay in front of the first router that the
//! test cuts, as a router's death would. The whole-mesh chaos test
//! (services/meshctl/tests/chaos.rs) kills real routers, but hits each
//! moment of a stream only by chance; here the cut lands exactly where it
//! is asked to.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use pdmesh_testkit::Running;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

type Events = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

fn delta(id: u32) -> pb::GenerateResponse {
    let d = pb::Delta { ids: vec![id], text: format!("<{id}>") };
    pb::GenerateResponse { event: Some(pb::generate_response::Event::Delta(d)) }
}

fn finished(prompt: u32, completion: u32) -> pb::GenerateResponse {
    let f = pb::Finished {
        reason: common::FinishReason::Length as i32,
        usage: Some(common::Usage { prompt_tokens: prompt, completion_tokens: completion, cached_tokens: 0 }),
        prefill_worker: "fake".into(),
        decode_worker: "fake".into(),
    };
    pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(f)) }
}

/// A FAKE router. With `upto` set it streams one delta per token (ids
/// 100, 101, ...) up to that many and then holds the stream open without
/// finishing, as a router that dies there would. Without it, it serves the
/// request to its finish: the tokens after `resume_ids`, then the finish
/// (a resumed request). It keeps every request it got.
#[derive(Clone)]
struct FakeRouter {
    upto: Option<u32>,
    seen: Arc<Mutex<Vec<pb::GenerateRequest>>>,
}

#[tonic::async_trait]
impl pb::router_server::Router for FakeRouter {
    type GenerateStream = Events;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<Events>, Status> {
        let r = req.into_inner();
        self.seen.lock().unwrap().push(r.clone());
        let from = r.resume_ids.len() as u32;
        let to = self.upto.unwrap_or(r.max_tokens).min(r.max_tokens);
        let mut events: Vec<_> = (from..to).map(|i| Ok(delta(100 + i))).collect();
        if self.upto.is_none() {
            events.push(Ok(finished(7, r.max_tokens)));
            return Ok(Response::new(Box::pin(tokio_stream::iter(events))));
        }
        let held = tokio_stream::StreamExt::chain(tokio_stream::iter(events), tokio_stream::pending());
        Ok(Response::new(Box::pin(held)))
    }
}

async fn fake_router(upto: Option<u32>) -> (Running, Arc<Mutex<Vec<pb::GenerateRequest>>>) {
    let r = FakeRouter { upto, seen: Arc::default() };
    let seen = r.seen.clone();
    let routes = tonic::service::Routes::new(pb::router_server::RouterServer::new(r));
    (pdmesh_testkit::fake::serve(routes).await, seen)
}

/// A TCP relay to `to`: `cut` closes every connection through it and its
/// listener at once, which is what a router process's death looks like
/// from the gateway (the stream breaks; new connections are refused).
struct Relay {
    addr: String,
    cut: watch::Sender<bool>,
}

impl Relay {
    async fn to(to: String) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (cut, mut cut_rx) = watch::channel(false);
        let conn_cut = cut.subscribe();
        tokio::spawn(async move {
            loop {
                let (mut a, _) = tokio::select! {
                    a = listener.accept() => a.unwrap(),
                    _ = cut_rx.wait_for(|c| *c) => return,
                };
                let (to, mut cut) = (to.clone(), conn_cut.clone());
                tokio::spawn(async move {
                    let mut b = TcpStream::connect(&to).await.unwrap();
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Relay { addr, cut }
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

/// A gateway whose routers are `routers`, in that order (the first one is
/// asked first).
async fn gateway(routers: &[&str]) -> Running {
    let cfg = pdmesh_gateway::config::Config::parse_from([
        "pdmesh-gateway",
        "--router-addr",
        &routers.join(","),
        "--request-timeout-s",
        "30",
    ]);
    pdmesh_testkit::spawn(|l, stop| pdmesh_gateway::serve(cfg, l, stop)).await
}

/// Start a streamed chat request and read until `n` content chunks came.
fn start_stream(gateway: &str, max_tokens: u32, n: usize) -> (std::net::TcpStream, String) {
    let body = format!(
        r#"{{"model":"smollm2-135m-instruct","stream":true,"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let mut s = std::net::TcpStream::connect(gateway).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut got = String::new();
    let mut buf = [0u8; 4096];
    while got.matches(r#""content":"<"#).count() < n {
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "the stream ended early: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..k]));
    }
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    (s, got)
}

/// What the client and the routers saw of one request whose first router
/// streamed `upto` of `max_tokens` tokens and was cut once the client had
/// read them.
struct Failover {
    /// The client's whole response.
    got: String,
    first: Vec<pb::GenerateRequest>,
    second: Vec<pb::GenerateRequest>,
}

async fn fail_over(upto: u32, max_tokens: u32) -> Failover {
    let (first, first_seen) = fake_router(Some(upto)).await;
    let (second, second_seen) = fake_router(None).await;
    let relay = Relay::to(first.addr.to_string()).await;
    let gw = gateway(&[&relay.addr, &second.addr.to_string()]).await;
    let addr = gw.addr.to_string();
    let (mut s, mut got) = tokio::task::block_in_place(|| start_stream(&addr, max_tokens, upto as usize));
    relay.cut();
    let mut rest = String::new();
    tokio::task::block_in_place(|| s.read_to_string(&mut rest)).unwrap();
    got.push_str(&rest);
    gw.stop().await;
    let seen = |s: &Mutex<Vec<pb::GenerateRequest>>| s.lock().unwrap().clone();
    Failover { got, first: seen(&first_seen), second: seen(&second_seen) }
}

impl Failover {
    /// Each of the `n` tokens once, the finish and [DONE], no error.
    fn assert_whole(&self, n: u32) {
        let got = &self.got;
        for id in 100..100 + n {
            assert_eq!(got.matches(&format!("<{id}>")).count(), 1, "token {id} not exactly once: {got}");
        }
        assert!(!got.contains("error"), "the client saw an error: {got}");
        assert!(got.contains(r#""finish_reason":"length""#), "no finish: {got}");
        assert!(got.contains("data: [DONE]"), "no [DONE]: {got}");
        assert_eq!(self.first.len(), 1, "the first router got {} calls", self.first.len());
        assert_eq!(self.second.len(), 1, "the second router got {} calls", self.second.len());
    }
}

/// The failover's hardest moment: the router dies after it streamed the
/// request's last token but before its finish. The gateway resumes the
/// request on the other router with every token id (all of max_tokens),
/// which answers with the finish alone; the client sees each token once,
/// the finish and [DONE], and no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_lost_after_the_last_token_costs_the_client_nothing() {
    let f = fail_over(4, 4).await;
    f.assert_whole(4);
    assert_eq!(f.second[0].resume_ids, vec![100, 101, 102, 103], "resumed with every token sent");
}

/// A router lost mid-stream: the other router goes on after the tokens
/// already sent, and the client sees each token once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_lost_mid_stream_is_resumed_after_the_tokens_sent() {
    let f = fail_over(2, 6).await;
    f.assert_whole(6);
    assert_eq!(f.second[0].resume_ids, vec![100, 101], "resumed after the 2 tokens sent");
}

/// A router that took the call up and died before its first event, after
/// longer than the gateway's patience for an unreachable router (a long
/// wait for the first token under load), is replaced like one that could
/// not be reached: the patience runs from the loss, not from the call.
/// (The chaos test once saw 6 such requests answered 503 on a slow host.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_lost_before_its_first_event_after_a_long_wait_is_replaced() {
    let (first, first_seen) = fake_router(Some(0)).await;
    let (second, second_seen) = fake_router(None).await;
    let relay = Relay::to(first.addr.to_string()).await;
    let gw = gateway(&[&relay.addr, &second.addr.to_string()]).await;
    let addr = gw.addr.to_string();
    let client = tokio::task::spawn_blocking(move || {
        let body = r#"{"model":"smollm2-135m-instruct","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}"#;
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
        let mut got = String::new();
        s.read_to_string(&mut got).unwrap();
        got
    });
    // Past the 3 s the gateway waits for a router it cannot reach.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(first_seen.lock().unwrap().len(), 1, "the first router holds the call");
    relay.cut();
    let got = client.await.unwrap();
    gw.stop().await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("<100><101><102>"), "{got}");
    assert_eq!(second_seen.lock().unwrap().len(), 1);
}
