//! The tokenizer service booted for real on a loopback port.

use pdmesh_proto::tokenizer::v1 as pb;
use pb::tokenizer_client::TokenizerClient;
use serde_json::Value;
use tonic::Code;

async fn boot() -> (String, tokio::sync::oneshot::Sender<()>) {
    let model = pdmesh_engine::fetch::ensure_model().expect("model");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let cfg = pdmesh_tokenizer::config::Config { listen: listener.local_addr().unwrap(), model: Some(model), max_input_bytes: 4096 };
    tokio::spawn(async move {
        pdmesh_tokenizer::serve(cfg, listener, async {
            let _ = rx.await;
        })
        .await
        .expect("serve");
    });
    // Wait on health, with a deadline (no sleeps).
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Ok(ch) = tonic::transport::Channel::from_shared(addr.clone()).unwrap().connect().await {
            let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
            let req = tonic_health::pb::HealthCheckRequest { service: "pdmesh.tokenizer.v1.Tokenizer".into() };
            if let Ok(r) = h.check(req).await {
                if r.into_inner().status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
                    return (addr, tx);
                }
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "tokenizer never became healthy");
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
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
    let (addr, stop) = boot().await;
    let mut c = TokenizerClient::connect(addr).await.unwrap();
    for g in golden() {
        let prompt = g["prompt"].as_str().unwrap();
        let raw = pb::EncodeRequest { input: Some(pb::encode_request::Input::Prompt(prompt.into())), parse_special: false };
        assert_eq!(c.encode(raw).await.unwrap().into_inner().ids, ids(&g["raw_ids"]));
        assert_eq!(c.encode(chat("user", prompt)).await.unwrap().into_inner().ids, ids(&g["chat_ids"]));
    }
    let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.vocab_size, info.eos_id, info.context_length), (49152, 2, 8192));

    // Stream ids one at a time: text arrives whole characters only.
    let text = "emoji 🚀 and 日本語";
    let raw = pb::EncodeRequest { input: Some(pb::encode_request::Input::Prompt(text.into())), parse_special: false };
    let id_list = c.encode(raw).await.unwrap().into_inner().ids;
    let reqs: Vec<pb::DetokenizeRequest> = id_list.iter().map(|i| pb::DetokenizeRequest { ids: vec![*i], render_special: false }).collect();
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
    let _ = stop.send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument() {
    let (addr, stop) = boot().await;
    let mut c = TokenizerClient::connect(addr).await.unwrap();
    let e = c.encode(chat("wizard", "hi")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("unknown role"), "{}", e.message());
    let empty = pb::EncodeRequest { input: Some(pb::encode_request::Input::Chat(pb::ChatMessages { messages: vec![] })), parse_special: false };
    assert_eq!(c.encode(empty).await.unwrap_err().code(), Code::InvalidArgument);
    let none = pb::EncodeRequest { input: None, parse_special: false };
    assert_eq!(c.encode(none).await.unwrap_err().code(), Code::InvalidArgument);
    let big = pb::EncodeRequest { input: Some(pb::encode_request::Input::Prompt("x".repeat(5000))), parse_special: false };
    let e = c.encode(big).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("limit is 4096"), "{}", e.message());
    let bad = pb::DetokenizeRequest { ids: vec![1_000_000], render_special: false };
    let mut s = c.detokenize(tokio_stream::iter(vec![bad])).await.unwrap().into_inner();
    assert_eq!(s.message().await.unwrap_err().code(), Code::InvalidArgument);
    // Still serving afterwards.
    assert!(c.info(pb::InfoRequest {}).await.is_ok());
    let _ = stop.send(());
}
