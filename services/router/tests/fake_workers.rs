//! The router against scripted FAKE workers (pdmesh_testkit::fake: a
//! tokenizer, prefill and decode workers that follow a script instead of
//! running the model) and a real kvbroker, in this process: its retry,
//! refusal, detokenize replay and deadline logic in seconds. The
//! whole-mesh tests in services/meshctl/tests check the same paths with
//! the real workers and the real model.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pdmesh_proto::router::v1 as pb;
use pdmesh_testkit::fake::{
    self, fake_text, Board, DecodeReply, FakeDecode, FakePrefill, FakeTokenizer, PrefillReply, Script, Seen,
    TokenizerScript,
};
use pdmesh_testkit::Running;
use tonic::Code;

/// A router in front of fakes: its address and everything kept running.
struct Setup {
    router: Running,
    decodes: Vec<Arc<Seen>>,
    _rest: Vec<Running>,
}

fn addr(r: &Running) -> String {
    r.addr.to_string()
}

/// `prefills` and `decodes` fake instances, each kind sharing one script.
async fn setup(
    tok: TokenizerScript,
    prefill: Arc<Script<PrefillReply>>,
    prefills: usize,
    decode: Arc<Script<DecodeReply>>,
    decodes: usize,
    router_flags: &[&str],
) -> Setup {
    let board = Board::default();
    let tokenizer = fake::serve(FakeTokenizer::routes(tok)).await;
    let mut p = Vec::new();
    for _ in 0..prefills {
        p.push(fake::serve(FakePrefill::routes(prefill.clone(), board.clone())).await);
    }
    let (mut d, mut seen) = (Vec::new(), Vec::new());
    for _ in 0..decodes {
        let (routes, s) = FakeDecode::routes(decode.clone(), board.clone());
        d.push(fake::serve(routes).await);
        seen.push(s);
    }
    let broker_cfg = pdmesh_kvbroker::config::Config::parse_from(["pdmesh-kvbroker"]);
    let broker = pdmesh_testkit::spawn(|l, stop| pdmesh_kvbroker::serve(broker_cfg, l, stop)).await;
    pdmesh_testkit::wait_healthy(&broker.url, "pdmesh.kvbroker.v1.KvBroker").await;
    let join = |v: &[Running]| v.iter().map(addr).collect::<Vec<_>>().join(",");
    let mut args = vec![
        "pdmesh-router".to_string(),
        "--tokenizer-addr".into(),
        addr(&tokenizer),
        "--prefill-addr".into(),
        join(&p),
        "--decode-addr".into(),
        join(&d),
        "--kvbroker-addr".into(),
        addr(&broker),
        // Every prompt goes to a prefill worker unless a test says otherwise.
        "--max-local-prefill".into(),
        "0".into(),
    ];
    args.extend(router_flags.iter().map(|f| f.to_string()));
    let cfg = pdmesh_router::config::Config::parse_from(args);
    let router = pdmesh_testkit::spawn(|l, stop| pdmesh_router::serve(cfg, l, stop)).await;
    pdmesh_testkit::wait_healthy(&router.url, "pdmesh.router.v1.Router").await;
    let mut rest = vec![tokenizer, broker];
    rest.extend(p);
    rest.extend(d);
    Setup { router, decodes: seen, _rest: rest }
}

/// What the caller of Generate saw: the text, or the status that ended it.
async fn generate(
    router: &Running,
    prompt: &str,
    max_tokens: u32,
    timeout: Option<Duration>,
) -> Result<String, tonic::Status> {
    generate_resumed(router, prompt, max_tokens, timeout, vec![]).await
}

/// [`generate`] for a request resumed after `resume_ids` (a gateway's failover).
async fn generate_resumed(
    router: &Running,
    prompt: &str,
    max_tokens: u32,
    timeout: Option<Duration>,
    resume_ids: Vec<u32>,
) -> Result<String, tonic::Status> {
    let mut c = pb::router_client::RouterClient::connect(router.url.clone()).await.unwrap();
    let mut req = tonic::Request::new(pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(prompt.into())),
        max_tokens,
        resume_ids,
        ..Default::default()
    });
    if let Some(t) = timeout {
        req.set_timeout(t);
    }
    let mut s = c.generate(req).await?.into_inner();
    let mut text = String::new();
    while let Some(m) = s.message().await? {
        match m.event {
            Some(pb::generate_response::Event::Delta(d)) => text.push_str(&d.text),
            Some(pb::generate_response::Event::Finished(_)) => return Ok(text),
            None => {}
        }
    }
    Err(tonic::Status::internal("the stream ended without a Finished event"))
}

fn ids(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

#[tokio::test]
async fn a_prefill_that_fails_before_the_first_token_is_retried_on_another_worker() {
    // Whichever of the two prefill workers is tried first fails; the other answers.
    let prefill = Script::new(vec![PrefillReply::Fail(Code::Unavailable), PrefillReply::Answer { first_token: 104 }]);
    let decode = Script::new(vec![DecodeReply::Serve(ids("hello"))]);
    let s = setup(TokenizerScript::default(), prefill.clone(), 2, decode.clone(), 1, &[]).await;
    let text = generate(&s.router, "hi", 5, None).await.unwrap();
    assert_eq!(text, "hello");
    assert_eq!(prefill.calls(), 2, "one failed prefill, one retried");
    assert_eq!(decode.calls(), 2, "the decode side is dispatched again with the retry");
}

#[tokio::test]
async fn a_decode_worker_that_refuses_is_passed_over_for_another() {
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 111 }]);
    let decode = Script::new(vec![DecodeReply::Refuse(Code::ResourceExhausted), DecodeReply::Serve(ids("ok"))]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode.clone(), 2, &[]).await;
    assert_eq!(generate(&s.router, "hi", 2, None).await.unwrap(), "ok");
    let per_worker: Vec<usize> = s.decodes.iter().map(|d| d.calls()).collect();
    assert_eq!(per_worker, vec![1, 1], "the refusing worker once, the other once");
}

#[tokio::test]
async fn a_refusal_from_the_only_decode_worker_reaches_the_caller_as_no_room() {
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 111 }]);
    let decode = Script::new(vec![DecodeReply::Refuse(Code::ResourceExhausted)]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode, 1, &[]).await;
    let e = generate(&s.router, "hi", 2, None).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
}

#[tokio::test]
async fn a_detokenize_stream_lost_midway_is_replayed_with_no_text_lost_or_repeated() {
    let tok = TokenizerScript { dying_streams: 1, die_after: 3, ..Default::default() };
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 112 }]);
    let answer = "pdmesh streams on";
    let decode = Script::new(vec![DecodeReply::Serve(ids(answer))]);
    let s = setup(tok, prefill, 1, decode, 1, &[]).await;
    let text = generate(&s.router, "hi", 64, None).await.unwrap();
    assert_eq!(text, fake_text(&ids(answer)));
}

#[tokio::test]
async fn a_decode_worker_lost_before_the_first_token_is_replaced() {
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    let decode =
        Script::new(vec![DecodeReply::DieAfter { tokens: ids("abc"), after: 0 }, DecodeReply::Serve(ids("abc"))]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode, 2, &[]).await;
    assert_eq!(generate(&s.router, "hi", 3, None).await.unwrap(), "abc", "retried before the first token");
}

#[tokio::test]
async fn a_decode_worker_lost_mid_stream_hands_the_request_to_another_with_nothing_repeated_or_lost() {
    let answer = "the stream goes on";
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    let decode =
        Script::new(vec![DecodeReply::DieAfter { tokens: ids(answer), after: 5 }, DecodeReply::Serve(ids(answer))]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode, 2, &[]).await;
    assert_eq!(generate(&s.router, "hi", 64, None).await.unwrap(), answer);
    // The second worker got the same prompt and budget, and the five tokens
    // sent to replay.
    let mut reqs: Vec<_> = s.decodes.iter().flat_map(|d| d.requests()).collect();
    reqs.sort_by_key(|r| r.replay_ids.len());
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    let (first, second) = (&reqs[0], &reqs[1]);
    assert_eq!((first.prompt_ids.clone(), first.replay_ids.clone()), (ids("hi"), vec![]));
    assert_eq!((second.prompt_ids.clone(), second.max_tokens), (ids("hi"), first.max_tokens));
    assert_eq!(second.replay_ids, ids(&answer[..5]));
    assert!(s.decodes.iter().all(|d| d.calls() == 1), "the lost worker is not tried again");
}

#[tokio::test]
async fn a_draining_decode_worker_ships_the_kv_and_another_goes_on_with_nothing_replayed() {
    let answer = "the stream goes on";
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    let decode = Script::new(vec![
        DecodeReply::HandOverAfter { tokens: ids(answer), after: 5, ships: true },
        DecodeReply::Serve(ids(answer)),
    ]);
    let s = setup(TokenizerScript::default(), prefill.clone(), 1, decode, 2, &[]).await;
    assert_eq!(generate(&s.router, "hi", 64, None).await.unwrap(), answer);
    let mut reqs: Vec<_> = s.decodes.iter().flat_map(|d| d.requests()).collect();
    reqs.sort_by_key(|r| r.replay_ids.len());
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    let second = &reqs[1];
    assert!(second.continued && !second.local_prefill, "the KV comes from the draining worker: {second:?}");
    assert_eq!((second.prompt_ids.clone(), second.replay_ids.clone()), (ids("hi"), ids(&answer[..5])));
    assert_eq!(prefill.calls(), 1, "no prefill for the move");
}

#[tokio::test]
async fn a_handover_whose_shipment_fails_is_replayed_instead() {
    let answer = "the stream goes on";
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    let decode = Script::new(vec![
        DecodeReply::HandOverAfter { tokens: ids(answer), after: 5, ships: false },
        DecodeReply::Serve(ids(answer)),
    ]);
    let s = setup(TokenizerScript::default(), prefill.clone(), 1, decode, 2, &[]).await;
    let t0 = Instant::now();
    assert_eq!(generate(&s.router, "hi", 64, None).await.unwrap(), answer);
    assert!(t0.elapsed() < Duration::from_secs(5), "the failure is seen at once: {:?}", t0.elapsed());
    let reqs: Vec<_> = s.decodes.iter().flat_map(|d| d.requests()).collect();
    let last = reqs.iter().max_by_key(|r| (r.replay_ids.len(), !r.continued)).unwrap();
    assert!(!last.continued && last.replay_ids == ids(&answer[..5]), "replayed: {reqs:?}");
    assert_eq!(prefill.calls(), 2, "the replay's prompt is prefilled again");
}

#[tokio::test]
async fn a_resumed_request_sends_only_what_follows_the_tokens_its_caller_has() {
    // The gateway's failover: another router was lost after "the ".
    let answer = "the stream goes on";
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    let decode = Script::new(vec![DecodeReply::Serve(ids(answer))]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode, 1, &[]).await;
    let text = generate_resumed(&s.router, "hi", 64, None, ids("the ")).await.unwrap();
    assert_eq!(text, "stream goes on");
    assert_eq!(s.decodes[0].requests()[0].replay_ids, ids("the "), "the decode worker replays them");
    // Its router was lost after the last token, before the finish: the
    // finish comes at once, nothing is generated or streamed again.
    let text = generate_resumed(&s.router, "hi", 4, None, ids("the ")).await.unwrap();
    assert_eq!(text, "", "all 4 tokens are the caller's already");
    assert_eq!(s.decodes[0].requests().len(), 1, "no decode worker was asked");
    let e = generate_resumed(&s.router, "hi", 3, None, ids("the ")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "more tokens than the request may have: {e:?}");
}

#[tokio::test]
async fn migrations_stop_at_the_limit_and_the_caller_hears_the_meshs_fault() {
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    // Every worker dies after two tokens of its part.
    let decode = Script::new(vec![DecodeReply::DieAfter { tokens: ids("abcdefgh"), after: 2 }]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode.clone(), 3, &["--max-migrations", "1"]).await;
    let e = generate(&s.router, "hi", 8, None).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "never the client's fault: {e:?}");
    assert_eq!(decode.calls(), 2, "the first worker and one migration");
}

#[tokio::test]
async fn a_deadline_passing_while_tokenizing_ends_the_request_by_its_deadline() {
    let tok = TokenizerScript { encode_delay: Duration::from_secs(30), ..Default::default() };
    let prefill = Script::new(vec![PrefillReply::Answer { first_token: 1 }]);
    let decode = Script::new(vec![DecodeReply::Serve(ids("x"))]);
    let s = setup(tok, prefill.clone(), 1, decode, 1, &[]).await;
    let t0 = Instant::now();
    let e = generate(&s.router, "hi", 1, Some(Duration::from_millis(800))).await.unwrap_err();
    // The caller's own deadline or the router's answer, whichever came first:
    // either way a deadline, and well before the tokenizer's 30 s.
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "ended after {:?}", t0.elapsed());
    assert_eq!(prefill.calls(), 0, "nothing was dispatched");
}

#[tokio::test]
async fn a_stalled_prefill_ends_by_the_routers_own_deadline() {
    let prefill = Script::new(vec![PrefillReply::Stall]);
    let decode = Script::new(vec![DecodeReply::Serve(ids("x"))]);
    let s = setup(TokenizerScript::default(), prefill, 1, decode, 1, &["--request-timeout-s", "1"]).await;
    let t0 = Instant::now();
    // No deadline from the caller: the router's --request-timeout-s holds.
    let e = generate(&s.router, "hi", 1, None).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "ended after {:?}", t0.elapsed());
}
