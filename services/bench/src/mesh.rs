//! `pdmesh-bench mesh`: the same closed-loop workload through the mesh (router
//! gRPC, streamed) and through the engine alone (in this process, with the
//! same continuous batching), in one run, so TTFT and output tokens/s can be
//! compared like for like. Prints JSON.
//!
//! Workload: chat prompts (the golden prompts' user texts, cycled), greedy,
//! `--max-tokens` tokens each with EOS ignored; at each concurrency C, C
//! clients each send their next request as soon as the previous one ends,
//! `--requests` requests in all. TTFT is from the moment a request is sent
//! (mesh) or admitted to the loop (engine) to its first token; output
//! tokens/s is all generated tokens over the wall time of the load point.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use pdmesh_engine::{ChatMessage, Engine, EngineOptions, Model, SamplingParams, SeqId, Tokenizer};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use serde_json::json;

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tell me a short story about a robot who learns to paint.",
    "Explain why the sky is blue in one sentence.",
    "List the first five prime numbers.",
    "Translate to French: Good morning, how are you?",
];

#[derive(clap::Args)]
pub struct Args {
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// Requests per load point (at least the concurrency).
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Router address; default: found in the registry.
    #[arg(long, env = "PDMESH_ROUTER_ADDR")]
    pub router_addr: Option<String>,
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// GGUF model for the engine-alone runs (default: the cached model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Kernel threads of the engine-alone runs (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Skip the engine-alone runs.
    #[arg(long)]
    pub mesh_only: bool,
}

/// One request's timings.
struct Sample {
    ttft: f64,
    tokens: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn summary(samples: &[Sample], wall: f64) -> serde_json::Value {
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    ttft.sort_by(|a, b| a.total_cmp(b));
    let p90 = ttft.get(((ttft.len() as f64 * 0.9).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN);
    json!({
        "requests": samples.len(),
        "output_tokens": tokens,
        "wall_s": wall,
        "median_ttft_ms": median(ttft.clone()) * 1e3,
        "p90_ttft_ms": p90 * 1e3,
        "output_tokens_per_s": tokens as f64 / wall,
    })
}

async fn mesh_point(addr: &str, c: usize, n: usize, max_tokens: u32) -> Result<serde_json::Value, String> {
    let ch = pdmesh_core::grpc::lazy_channel(addr)?;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (ch, next) = (ch.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, String>(out);
                }
                let req = pb::GenerateRequest {
                    request_id: String::new(),
                    input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
                        messages: vec![pb::ChatMessage {
                            role: "user".into(),
                            content: PROMPTS[i % PROMPTS.len()].into(),
                        }],
                    })),
                    sampling: Some(common::SamplingParams::default()),
                    max_tokens,
                    stop: vec![],
                    ignore_eos: true,
                    max_tokens_to_fit: false,
                    resume_ids: Vec::new(),
                };
                let sent = Instant::now();
                let mut s = pb::router_client::RouterClient::new(ch.clone())
                    .generate(req)
                    .await
                    .map_err(|e| e.to_string())?
                    .into_inner();
                let mut first = None;
                let mut tokens = 0;
                while let Some(m) = s.message().await.map_err(|e| e.to_string())? {
                    if let Some(pb::generate_response::Event::Delta(d)) = m.event {
                        if first.is_none() && !d.ids.is_empty() {
                            first = Some(sent.elapsed().as_secs_f64());
                        }
                        tokens += d.ids.len();
                    }
                }
                out.push(Sample { ttft: first.unwrap_or(f64::NAN), tokens });
            }
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.map_err(|e| e.to_string())??);
    }
    Ok(summary(&samples, t0.elapsed().as_secs_f64()))
}

/// The engine alone: C sequences in flight, a new one admitted as soon as
/// one finishes; new ones are prefilled, then all running ones take a
/// decode step (as `Engine::generate_all` does).
fn engine_point(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    c: usize,
    n: usize,
    max_tokens: u32,
) -> Result<serde_json::Value, String> {
    let params = SamplingParams { max_tokens: max_tokens as usize, ignore_eos: true, ..Default::default() };
    let t0 = Instant::now();
    let mut next = 0;
    let mut running: Vec<(SeqId, Instant, Option<f64>, usize)> = Vec::new();
    let mut samples = Vec::new();
    while next < n || !running.is_empty() {
        let mut fresh = Vec::new();
        while running.len() + fresh.len() < c && next < n {
            let id = engine
                .add_sequence(prompts[next % prompts.len()].clone(), params.clone())
                .map_err(|e| e.to_string())?;
            fresh.push((id, Instant::now()));
            next += 1;
        }
        let mut events = Vec::new();
        if !fresh.is_empty() {
            let ids: Vec<SeqId> = fresh.iter().map(|f| f.0).collect();
            events.extend(engine.prefill(&ids).map_err(|e| e.to_string())?);
        }
        let old: Vec<SeqId> = running.iter().map(|r| r.0).collect();
        for (id, at) in fresh {
            running.push((id, at, None, 0));
        }
        if !old.is_empty() {
            events.extend(engine.decode(&old).map_err(|e| e.to_string())?);
        }
        for ev in events {
            let r = running.iter_mut().find(|r| r.0 == ev.seq).expect("running");
            r.3 += 1;
            if r.2.is_none() {
                r.2 = Some(r.1.elapsed().as_secs_f64());
            }
            if ev.finish.is_some() {
                samples.push(Sample { ttft: r.2.unwrap_or(f64::NAN), tokens: r.3 });
                engine.release(ev.seq).map_err(|e| e.to_string())?;
                running.retain(|x| x.0 != ev.seq);
            }
        }
    }
    Ok(summary(&samples, t0.elapsed().as_secs_f64()))
}

pub async fn run(a: Args) -> Result<(), String> {
    let addr = pdmesh_core::discovery::address_of(a.router_addr.as_deref(), "router", &*a.discovery.open_or_default()?)
        .await?;
    let mut points = Vec::new();
    // Warm-up through the mesh (first-touch of weights and arenas).
    mesh_point(&addr, 1, 2, 8).await?;
    for &c in &a.concurrency {
        let n = a.requests.max(c);
        let mesh = mesh_point(&addr, c, n, a.max_tokens).await?;
        eprintln!("pdmesh-bench mesh: mesh c={c}: {mesh}");
        points.push(json!({ "concurrency": c, "mesh": mesh }));
    }
    if !a.mesh_only {
        let (model, cache) = (a.model.clone(), a.cache.clone());
        let threads = a.threads;
        let conc = a.concurrency.clone();
        let (requests, max_tokens) = (a.requests, a.max_tokens);
        let engine_points = tokio::task::spawn_blocking(move || -> Result<Vec<serde_json::Value>, String> {
            let path = cache.model_or_fetch(model.as_deref()).map_err(|e| e.to_string())?;
            let (m, g) = Model::load(&path).map_err(|e| e.to_string())?;
            let tok = Tokenizer::from_gguf(&g).map_err(|e| e.to_string())?;
            let prompts: Vec<Vec<u32>> = PROMPTS
                .iter()
                .map(|p| tok.encode_chat(&[ChatMessage::user(*p)]))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            let mut engine =
                Engine::new(m, EngineOptions { threads, ..Default::default() }).map_err(|e| e.to_string())?;
            engine_point(&mut engine, &prompts, 1, 2, 8)?;
            let mut out = Vec::new();
            for c in conc {
                let p = engine_point(&mut engine, &prompts, c, requests.max(c), max_tokens)?;
                eprintln!("pdmesh-bench mesh: engine c={c}: {p}");
                out.push(p);
            }
            Ok(out)
        })
        .await
        .map_err(|e| e.to_string())??;
        for (p, e) in points.iter_mut().zip(engine_points) {
            let ratio_tps = p["mesh"]["output_tokens_per_s"].as_f64().unwrap_or(0.0)
                / e["output_tokens_per_s"].as_f64().unwrap_or(1.0);
            let ratio_ttft =
                p["mesh"]["median_ttft_ms"].as_f64().unwrap_or(0.0) / e["median_ttft_ms"].as_f64().unwrap_or(1.0);
            p["engine"] = e;
            p["mesh_over_engine"] = json!({ "output_tokens_per_s": ratio_tps, "median_ttft": ratio_ttft });
        }
    }
    let report = json!({ "workload": { "max_tokens": a.max_tokens, "requests": a.requests, "prompts": "chat, 6 fixed prompts cycled (35-41 tokens)", "greedy": true, "ignore_eos": true }, "points": points });
    println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    Ok(())
}
