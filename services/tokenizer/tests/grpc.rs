//! The tokenizer service booted for real on a loopback port.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use pb::tokenizer_client::TokenizerClient;
use pdmesh_proto::tokenizer::v1 as pb;
use serde_json::Value;
use tonic::Code;

async fn boot_with(common: pdmesh_core::args::CommonArgs) -> pdmesh_testkit::Running {
    let model = pdmesh_model::CacheArgs::from_env().ensure_model().expect("model");
    let svc = pdmesh_testkit::spawn(move |listener, stop| {
        let cfg = pdmesh_tokenizer::config::Config {
            listen: listener.local_addr().unwrap(),
            model: Some(model),
            cache: Default::default(),
            max_input_bytes: 4096,
            max_messages: 1000,
            common,
        };
        pdmesh_tokenizer::serve(cfg, listener, stop)
    })
    .await;
    pdmesh_testkit::wait_healthy(&svc.url, "pdmesh.tokenizer.v1.Tokenizer").await;
    svc
}

async fn boot() -> pdmesh_testkit::Running {
    boot_with(Default::default()).await
}

fn golden() -> Vec<Value> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/data/smollm2.golden.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn chat(role: &str, content: &str) -> pb::EncodeRequest {
    pb::EncodeRequest {
        input: Some(pb::encode_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: role.into(), content: content.into() }],
        })),
        parse_special: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encodes_like_llama_cpp_and_detokenizes_incrementally() {
    let svc = boot().await;
    let mut c = TokenizerClient::connect(svc.url.clone()).await.unwrap();
    for g in golden() {
        let prompt = g["prompt"].as_str().unwrap();
        let raw =
            pb::EncodeRequest { input: Some(pb::encode_request::Input::Prompt(prompt.into())), parse_special: false };
        assert_eq!(c.encode(raw).await.unwrap().into_inner().ids, ids(&g["raw_ids"]));
        assert_eq!(c.encode(chat("user", prompt)).await.unwrap().into_inner().ids, ids(&g["chat_ids"]));
    }
    let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.vocab_size, info.eos_id, info.context_length), (49152, 2, 8192));

    // Stream ids one at a time: text arrives whole characters only.
    let text = "emoji 🚀 and 日本語";
    let raw = pb::EncodeRequest { input: Some(pb::encode_request::Input::Prompt(text.into())), parse_special: false };
    let id_list = c.encode(raw).await.unwrap().into_inner().ids;
    let reqs: Vec<pb::DetokenizeRequest> =
        id_list.iter().map(|i| pb::DetokenizeRequest { ids: vec![*i], render_special: false }).collect();
    let mut out = c.detokenize(tokio_stream::iter(reqs)).await.unwrap().into_inner();
    let mut got = String::new();
    let mut pieces = 0;
    while let Some(r) = out.message().await.unwrap() {
        assert!(!r.text.contains('\u{FFFD}'));
        got.push_str(&r.text);
        pieces += 1;
    }
    assert_eq!(got, text);
    assert_eq!(pieces, id_list.len(), "one response per request");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument() {
    let svc = boot().await;
    let mut c = TokenizerClient::connect(svc.url.clone()).await.unwrap();
    let e = c.encode(chat("wizard", "hi")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("unknown role"), "{}", e.message());
    let empty = pb::EncodeRequest {
        input: Some(pb::encode_request::Input::Chat(pb::ChatMessages { messages: vec![] })),
        parse_special: false,
    };
    assert_eq!(c.encode(empty).await.unwrap_err().code(), Code::InvalidArgument);
    let none = pb::EncodeRequest { input: None, parse_special: false };
    assert_eq!(c.encode(none).await.unwrap_err().code(), Code::InvalidArgument);
    let big =
        pb::EncodeRequest { input: Some(pb::encode_request::Input::Prompt("x".repeat(5000))), parse_special: false };
    let e = c.encode(big).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("limit is 4096"), "{}", e.message());
    // Many messages: refused by count, and empty ones still count towards the size.
    let many = |n: usize| pb::EncodeRequest {
        input: Some(pb::encode_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: String::new() }; n],
        })),
        parse_special: false,
    };
    let e = c.encode(many(1001)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("1001 chat messages; the limit is 1000"), "{}", e.message());
    let e = c.encode(many(300)).await.unwrap_err();
    assert!(e.message().contains("6000 bytes; the limit is 4096"), "300 empty messages: {}", e.message());
    assert!(c.encode(many(50)).await.is_ok());
    let bad = pb::DetokenizeRequest { ids: vec![1_000_000], render_special: false };
    let mut s = c.detokenize(tokio_stream::iter(vec![bad])).await.unwrap().into_inner();
    assert_eq!(s.message().await.unwrap_err().code(), Code::InvalidArgument);
    // Still serving afterwards.
    assert!(c.info(pb::InfoRequest {}).await.is_ok());
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announces_itself_serves_admin_endpoints_and_withdraws_on_shutdown() {
    use pdmesh_core::discovery::{Discovery, FileRegistry};
    let dir = std::env::temp_dir().join(format!("pdmesh-tok-registry-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let common = pdmesh_core::args::CommonArgs {
        http_listen: Some("127.0.0.1:0".parse().unwrap()),
        discovery: pdmesh_core::discovery::DiscoveryArgs {
            registry_dir: Some(dir.clone()),
            registry_ttl_s: 10,
            ..Default::default()
        },
        instance_id: Some("tok-test".into()),
        ..Default::default()
    };
    let svc = boot_with(common).await;
    let addr = svc.url.clone();
    let reg = FileRegistry::new(&dir, std::time::Duration::from_secs(10));
    let live = reg.healthy("tokenizer").await.unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(format!("http://{}", live[0].grpc_addr), addr);
    let http = live[0].http_addr.clone().expect("http address announced");

    let mut c = TokenizerClient::connect(addr).await.unwrap();
    c.encode(chat("user", "hello")).await.unwrap();
    let _ = c.encode(chat("wizard", "hello")).await.unwrap_err();
    let h = http.clone();
    let get = pdmesh_testkit::http_get;
    let (health, metrics, statusz) =
        tokio::task::spawn_blocking(move || (get(&h, "/health"), get(&h, "/metrics"), get(&h, "/statusz")))
            .await
            .unwrap();
    assert_eq!(health, (200, "ok\n".to_string()));
    assert!(metrics.1.contains("pdmesh_tokenizer_requests_total{rpc=\"encode\",outcome=\"ok\"} 1"), "{}", metrics.1);
    assert!(
        metrics.1.contains("pdmesh_tokenizer_requests_total{rpc=\"encode\",outcome=\"invalid_argument\"} 1"),
        "{}",
        metrics.1
    );
    let v: Value = serde_json::from_str(&statusz.1).unwrap();
    assert_eq!(v["service"], "pdmesh-tokenizer");
    assert_eq!(v["config"]["max_input_bytes"], 4096);

    svc.stop().await;
    assert!(reg.healthy("tokenizer").await.unwrap().is_empty(), "a stopped tokenizer must leave the registry");
    std::fs::remove_dir_all(&dir).unwrap();
}
