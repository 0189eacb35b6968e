//! One mesh serving two models: `meshctl up --model smollm2 --model
//! gemma3-270m` gives each its own pool (tokenizer, kvbroker, prefill,
//! decode, router) behind one gateway. Each model answers greedily as its
//! engine alone does, with its KV moved over NIXL and its prefix cache
//! hit; the same prompt never hits across models; a third name is a 404 in
//! OpenAI's shape; each pool scales alone; traces and Prometheus targets
//! carry the model's name.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]
#![allow(clippy::too_many_lines)]

mod common;

use std::process::Command;

use std::time::Duration;

use common::Mesh;
use pdmesh_meshctl::sink::Sink;
use pdmesh_meshctl::trace::Span;
use serde_json::Value;

const SMOL: &str = "smollm2-135m-instruct";
const GEMMA: &str = "gemma3-270m";

/// A prompt of a few blocks (16 positions each) for both tokenizers.
const PROMPT: &str = "The lighthouse keeper wrote in her log every evening: the wind, the swell, the ships that \
                      passed, the colour of the sky at dusk and the state of the lamp. Tonight she wrote that";

/// `pdmesh-engine generate` alone on `model` (a catalogue name): its text.
fn engine_alone(model: &str, prompt: &str, max_tokens: u32) -> String {
    let engine = std::path::Path::new(env!("CARGO_BIN_EXE_meshctl")).with_file_name("pdmesh-engine");
    let out = Command::new(engine)
        .args(["generate", "--model", model, "--text", prompt, "--ignore-eos"])
        .args(["--max-tokens", &max_tokens.to_string()])
        .output()
        .expect("run pdmesh-engine");
    assert!(out.status.success(), "pdmesh-engine generate failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON from pdmesh-engine generate");
    v["text"].as_str().unwrap().to_string()
}

/// A greedy completion through the gateway: (text, prompt tokens, cached tokens).
fn complete(mesh: &Mesh, model: &str, prompt: &str, max_tokens: u32) -> (String, u64, u64) {
    let body = serde_json::json!({ "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true });
    let (st, text) = mesh.post("/v1/completions", &body.to_string(), &[]);
    assert_eq!(st, 200, "{model}: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], model);
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], max_tokens, "{v}");
    let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    (v["choices"][0]["text"].as_str().unwrap().to_string(), u["prompt_tokens"].as_u64().unwrap(), cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_models_behind_one_gateway() {
    let dir = std::env::temp_dir().join(format!("pdmesh-models-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sd = dir.join("targets.json");
    let sink = Sink::start("127.0.0.1:0".parse().unwrap(), None).await.unwrap();
    let ep = sink.endpoint();
    let mesh = Mesh::up(&[
        "--model",
        "smollm2",
        "--model",
        "gemma3-270m",
        "--prometheus-sd",
        sd.to_str().unwrap(),
        "--otlp-endpoint",
        &ep,
        "--trace-export-delay-ms",
        "100",
    ]);

    // Each request's trace names its model: the gateway's span the one
    // asked for, every span of a pool's services that pool.
    for model in [SMOL, GEMMA] {
        let body = serde_json::json!({ "model": model, "prompt": "Hello", "max_tokens": 2 }).to_string();
        let (st, tid, text) = common::post_header(&mesh.gateway, "/v1/completions", &body, &[], "x-pdmesh-trace-id");
        assert_eq!(st, 200, "{text}");
        let spans = sink
            .wait_trace(&tid.unwrap(), Duration::from_secs(20), |sp| {
                sp.iter().any(|s| s.service == "pdmesh-decode") && sp.iter().any(|s| s.service == "pdmesh-gateway")
            })
            .await;
        let model_of = |s: &Span| s.attrs.get("pdmesh.model").and_then(|v| v.as_str()).map(str::to_string);
        let pooled: Vec<&Span> = spans.iter().filter(|s| s.service != "pdmesh-gateway").collect();
        assert!(pooled.len() > 3, "{model}: spans of the pool's services");
        for s in pooled {
            assert_eq!(model_of(s).as_deref(), Some(model), "{model}: {} of {}", s.name, s.service);
        }
        let root = spans.iter().find(|s| s.service == "pdmesh-gateway" && s.parent_id.is_empty()).unwrap();
        assert_eq!(model_of(root).as_deref(), Some(model), "the gateway's request span");
    }

    // Every model is listed.
    let (st, body) = pdmesh_testkit::http_get(&mesh.gateway, "/v1/models");
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let listed: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(listed, [SMOL, GEMMA]);

    // A third name: 404 in OpenAI's shape, naming the models served.
    let (st, body) = mesh.post("/v1/completions", r#"{"model":"llama-70b","prompt":"hi","max_tokens":2}"#, &[]);
    assert_eq!(st, 404, "{body}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(e["error"]["code"], "model_not_found", "{body}");
    assert_eq!(e["error"]["param"], "model", "{body}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("llama-70b") && msg.contains(SMOL) && msg.contains(GEMMA), "{msg}");

    // Each model answers greedily as its engine alone does; its prompt
    // went through its prefill worker and its KV over NIXL.
    for (model, name) in [(SMOL, "smollm2"), (GEMMA, "gemma3-270m")] {
        let (text, n, cached) = complete(&mesh, model, PROMPT, 16);
        assert_eq!(cached, 0, "{model}: a cold prompt (Gemma's BOS alone is not reused)");
        assert!(n > 32, "{model}: the prompt spans blocks ({n} tokens)");
        assert_eq!(text, engine_alone(name, PROMPT, 16), "{model}: the mesh's answer against its engine alone");
        let moved =
            mesh.gauge(&format!("prefill@{model}"), "pdmesh_prefill_kv_transfers_total{transport=\"nixl\"}").await;
        assert!(moved >= 1.0, "{model}: the KV moved over NIXL ({moved} transfers)");
        // The same prompt again: its prefix comes from the cache, same answer.
        let (again, _, cached) = complete(&mesh, model, PROMPT, 16);
        assert_eq!(cached, n - 1, "{model}: a repeat reuses all but its last token");
        assert_eq!(again, text, "{model}: a cache hit answers as the cold prompt");
    }
    // A long prompt to the window model (Gemma 3: 5 of 6 layers see the
    // last 512 positions): its oldest blocks move with the global layers'
    // KV only, and the answer is still its engine's alone.
    let long = PROMPT.repeat(30);
    let bytes = "pdmesh_prefill_kv_transfer_bytes_total";
    let before = mesh.gauge(&format!("prefill@{GEMMA}"), bytes).await;
    let (text, n, _) = complete(&mesh, GEMMA, &long, 4);
    let moved = mesh.gauge(&format!("prefill@{GEMMA}"), bytes).await - before;
    assert!(n > 1000, "{n} prompt tokens");
    let (block, layer) = (294_912u64, 16_384u64); // 18 layers of 16 positions x 256 x K, V in f16
    let (blocks, trimmed) = (n.div_ceil(16), (n + 1 - 512) / 16);
    let want = trimmed * 3 * layer + (blocks - trimmed) * block;
    assert_eq!(moved as u64, want, "{n} positions: {want} bytes, not {} for whole blocks", blocks * block);
    eprintln!("gemma3-270m, {n} prompt tokens: {want} KV bytes moved, {} for whole blocks", blocks * block);
    assert_eq!(text, engine_alone("gemma3-270m", &long, 4), "a trimmed transfer answers as the engine alone");

    // A prompt one model cached is cold for the other: prefix hashes never meet.
    let fresh = "A ferry crossed the bay at noon with forty passengers, two cars, a dog and a crate of \
                 oranges; the captain logged the wind from the west and a calm sea all the way over.";
    let (_, _, cached) = complete(&mesh, GEMMA, fresh, 2);
    assert_eq!(cached, 0);
    let (_, _, cached) = complete(&mesh, GEMMA, fresh, 2);
    assert!(cached > 16, "gemma3-270m holds the prompt now ({cached} cached)");
    let (_, _, cached) = complete(&mesh, SMOL, fresh, 2);
    assert_eq!(cached, 0, "smollm2 reuses nothing gemma3-270m computed");

    // Metrics carry the model: Prometheus' targets are labelled with it.
    let targets: Value = serde_json::from_str(&std::fs::read_to_string(&sd).unwrap()).unwrap();
    let labelled = |m: &str| targets.as_array().unwrap().iter().filter(|t| t["labels"]["model"] == m).count();
    assert_eq!((labelled(SMOL), labelled(GEMMA)), (5, 5), "five services per model: {targets}");

    // Each pool scales alone; a kind without its pool is ambiguous here.
    let reg_dir = mesh.dir.join("registry").display().to_string();
    let at = ["--registry-dir", reg_dir.as_str()];
    let out = common::meshctl(&["scale", "decode=2"], &at);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("decode@"), "{err}");
    common::meshctl_ok(&["scale", &format!("decode@{GEMMA}=2")], &at);
    let reg = mesh.registry();
    assert_eq!(reg.healthy(&format!("decode@{GEMMA}")).await.unwrap().len(), 2);
    assert_eq!(reg.healthy(&format!("decode@{SMOL}")).await.unwrap().len(), 1);
    for model in [SMOL, GEMMA] {
        let (text, _, _) = complete(&mesh, model, "Once upon a time", 4);
        assert!(!text.is_empty(), "{model} serves after the scale");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
