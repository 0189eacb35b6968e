//! `meshctl explain`, `meshctl collect` and `meshctl probe`: the tools for
//! "why was this request slow?".

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pdmesh_meshctl::explain::explain;
use pdmesh_meshctl::explain::judge::Judgment;
use pdmesh_meshctl::sink::Sink;
use pdmesh_meshctl::trace::{from_jaeger, parse_trace_id, random_hex, read_otlp_file};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct ExplainArgs {
    /// The trace id (32 hex digits; the gateway returns it in `x-pdmesh-trace-id`).
    pub trace_id: String,
    /// Jaeger's query address, e.g. `http://127.0.0.1:16686` (reads `/api/traces/<id>`).
    #[arg(long, env = "PDMESH_JAEGER_URL", conflicts_with = "otlp_file")]
    pub jaeger: Option<String>,
    /// An OTLP/JSON-lines file (as `meshctl collect` or the Collector's file exporter write it).
    #[arg(long)]
    pub otlp_file: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn strip_scheme(url: &str) -> &str {
    url.trim_start_matches("http://").trim_end_matches('/')
}

pub async fn explain_cmd(a: ExplainArgs) -> Result<(), String> {
    let id = parse_trace_id(&a.trace_id)?;
    let spans = match (&a.jaeger, &a.otlp_file) {
        (Some(url), _) => {
            if url.starts_with("https://") {
                return Err("--jaeger takes an http:// address".into());
            }
            let (addr, path) = (strip_scheme(url).to_string(), format!("/api/traces/{id}"));
            let (code, body) =
                tokio::task::spawn_blocking(move || pdmesh_core::http::get(&addr, &path, Duration::from_secs(10)))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("cannot reach Jaeger at {url}: {e}"))?;
            if code == 404 {
                return Err(format!(
                    "Jaeger at {url} does not know trace {id} (not sampled, not exported yet, or expired)"
                ));
            }
            if code != 200 {
                return Err(format!("Jaeger at {url} answered HTTP {code}"));
            }
            let doc: Value = serde_json::from_str(&body).map_err(|e| format!("Jaeger's answer is not JSON: {e}"))?;
            from_jaeger(&doc)?
        }
        (None, Some(f)) => read_otlp_file(f, &id)?,
        (None, None) => return Err("say where the trace is: --jaeger URL or --otlp-file PATH".into()),
    };
    if spans.is_empty() {
        return Err(format!("trace {id} is not there (not sampled, or not exported yet: spans leave each service within --trace-export-delay-ms)"));
    }
    let e = explain(&spans)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&e.to_json()).unwrap_or_default());
    } else {
        print!("{}", e.table());
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct CollectArgs {
    /// OTLP/gRPC address to receive spans on.
    #[arg(long, default_value = "127.0.0.1:4317")]
    pub listen: SocketAddr,
    /// OTLP/JSON-lines file to append every export to.
    #[arg(long, default_value = "pdmesh-traces.jsonl")]
    pub out: PathBuf,
}

pub async fn collect_cmd(a: CollectArgs) -> Result<(), String> {
    let sink = Sink::start(a.listen, Some(a.out.clone())).await?;
    eprintln!(
        "meshctl collect: receiving OTLP/gRPC on {} (start the mesh with --otlp-endpoint {}), writing {}",
        sink.addr,
        sink.endpoint(),
        a.out.display()
    );
    pdmesh_core::signal::shutdown_signal().await;
    eprintln!("meshctl collect: {} spans received", sink.spans().len());
    Ok(())
}

#[derive(clap::Args)]
pub struct ProbeArgs {
    /// Router address; default: found in the registry.
    #[arg(long, env = "PDMESH_ROUTER_ADDR")]
    pub router_addr: Option<String>,
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Refuse to probe when any prefill or decode worker has more than this many sequences running or queued.
    #[arg(long, default_value_t = 4)]
    pub max_busy: u32,
    /// Probe even when the mesh is busier than --max-busy.
    #[arg(long)]
    pub force: bool,
    /// Tokens the probe asks for.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// Deadline of the probe, in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub timeout_s: f64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Sequences running or waiting on a worker, from its load gauges.
fn busy(load: &Value) -> u64 {
    ["running", "queued", "awaiting_kv"].iter().filter_map(|k| load[*k].as_u64()).sum()
}

fn worker_loads(list: &[Value]) -> Vec<Value> {
    list.iter().filter(|i| matches!(i["service"].as_str(), Some("prefill" | "decode"))).cloned().collect()
}

pub async fn probe_cmd(a: ProbeArgs) -> Result<(), String> {
    let registry = a.discovery.open_or_default()?;
    let before = worker_loads(&crate::status::collect(&*registry).await?);
    let busiest = before.iter().max_by_key(|i| busy(&i["load"]));
    if let Some(b) = busiest {
        let n = busy(&b["load"]);
        if n > a.max_busy as u64 && !a.force {
            return Err(format!(
                "not probing: {} has {n} sequences running or queued (more than --max-busy {}); a probe now would measure that load, not the mesh. Use --force to probe anyway.",
                b["id"].as_str().unwrap_or("?"),
                a.max_busy
            ));
        }
    }
    let addr = pdmesh_core::discovery::address_of(a.router_addr.as_deref(), "router", &*registry).await?;
    let ch = pdmesh_core::grpc::lazy_channel(&addr)?;
    let trace_id = random_hex(16);
    let mut req = tonic::Request::new(pb::GenerateRequest {
        request_id: format!("probe-{}", &trace_id[..12]),
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: "Say hello.".into() }],
        })),
        sampling: Some(common::SamplingParams::default()),
        max_tokens: a.max_tokens,
        stop: vec![],
        ignore_eos: true,
        max_tokens_to_fit: false,
        resume_ids: Vec::new(),
    });
    req.set_timeout(Duration::from_secs_f64(a.timeout_s.max(0.001)));
    // Our own sampled trace context: the probe's trace id is known even before the answer.
    if let Ok(v) = format!("00-{trace_id}-{}-01", random_hex(8)).parse() {
        req.metadata_mut().insert("traceparent", v);
    }
    let t0 = Instant::now();
    let mut s = pb::router_client::RouterClient::new(ch)
        .generate(req)
        .await
        .map_err(|e| format!("probe failed: {:?}: {}", e.code(), e.message()))?
        .into_inner();
    let mut ttft = None;
    let fin = loop {
        match s.message().await {
            Ok(Some(pb::GenerateResponse { event: Some(pb::generate_response::Event::Delta(d)) })) => {
                if ttft.is_none() && !d.ids.is_empty() {
                    ttft = Some(t0.elapsed());
                }
            }
            Ok(Some(pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(f)) })) => break f,
            Ok(Some(_)) => {}
            Ok(None) => return Err("probe failed: the router ended the stream without finishing".into()),
            Err(e) => return Err(format!("probe failed: {:?}: {}", e.code(), e.message())),
        }
    };
    let total = t0.elapsed();
    let after = worker_loads(&crate::status::collect(&*registry).await?);
    let chosen = [fin.prefill_worker.as_str(), fin.decode_worker.as_str()];
    let pick =
        |list: &[Value], id: &str| list.iter().find(|i| i["id"] == id).map(|i| i["load"].clone()).unwrap_or(json!({}));
    let steps: Vec<Value> = chosen
        .iter()
        .filter(|id| !id.is_empty())
        .filter_map(|id| {
            let kind = before.iter().find(|i| i["id"] == *id).and_then(|i| i["service"].as_str()).unwrap_or("worker");
            steps_during(id, kind, &pick(&before, id), &pick(&after, id))
        })
        .collect();
    let report = json!({
        "ttft_ms": ttft.map(|t| t.as_secs_f64() * 1e3),
        "steps": steps,
        "total_ms": total.as_secs_f64() * 1e3,
        "completion_tokens": fin.usage.map(|u| u.completion_tokens).unwrap_or(0),
        "trace_id": trace_id,
        "workers": chosen.iter().filter(|id| !id.is_empty()).map(|id| json!({ "id": id, "load_before": pick(&before, id), "load_after": pick(&after, id) })).collect::<Vec<_>>(),
        "all_workers_before": before,
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
        return Ok(());
    }
    print_probe(&report, &before, &trace_id);
    Ok(())
}

/// How worker `id`'s steps during the probe compared with its normal, from
/// its step counters before and after (`load.steps`), in explain's words.
fn steps_during(id: &str, kind: &str, before: &Value, after: &Value) -> Option<Value> {
    let d = |k: &str| after["steps"][k].as_f64().zip(before["steps"][k].as_f64()).map(|(a, b)| (a - b) * 1e3);
    let wall = d("wall_seconds").filter(|w| *w > 0.0)?;
    let j = Judgment {
        steps: 0,
        wall_ms: wall,
        cpu_ms: d("cpu_seconds").unwrap_or(0.0),
        runq_ms: d("runq_seconds").unwrap_or(0.0),
        judged_ms: d("judged_seconds").unwrap_or(0.0),
        normal_ms: d("normal_seconds").unwrap_or(0.0),
        with_prefill: 0,
        batch_mean: None,
        batch_usual: 0.0,
        knobs: vec![],
    };
    Some(json!({
        "id": id,
        "step_ms": wall,
        "factor": j.factor(),
        "cpu_wait_share": j.wait_share(),
        "abnormal": j.abnormal(),
        "words": j.words(id, &format!("pdmesh_{kind}_step_*_seconds_total over the probe:")),
    }))
}

/// The probe's report for people: its latency, the chosen workers' load
/// before and after, and the wait the prefill queue implied.
fn print_probe(report: &Value, before: &[Value], trace_id: &str) {
    println!(
        "probe: {} tokens, TTFT {:.1} ms, total {:.1} ms",
        report["completion_tokens"],
        report["ttft_ms"].as_f64().unwrap_or(f64::NAN),
        report["total_ms"].as_f64().unwrap_or(f64::NAN)
    );
    for w in report["workers"].as_array().into_iter().flatten() {
        let b = &w["load_before"];
        let af = &w["load_after"];
        println!(
            "  {}: before running {} queued {} KV {}/{}; after running {} queued {}",
            w["id"].as_str().unwrap_or("?"),
            b["running"],
            b["queued"].as_u64().unwrap_or(0) + b["awaiting_kv"].as_u64().unwrap_or(0),
            b["kv_blocks_used"],
            b["kv_blocks_total"],
            af["running"],
            af["queued"].as_u64().unwrap_or(0) + af["awaiting_kv"].as_u64().unwrap_or(0)
        );
    }
    for w in before.iter().filter(|w| w["load"].get("expected_wait_seconds").is_some()) {
        let l = &w["load"];
        println!(
            "  {}: a prompt arriving before the probe would have waited ~{:.1} s for the prefill ahead of it ({} prompts running, {} prompt tokens queued)",
            w["id"].as_str().unwrap_or("?"),
            l["expected_wait_seconds"].as_f64().unwrap_or(0.0),
            l["running"].as_u64().unwrap_or(0),
            l["queued_tokens"].as_u64().unwrap_or(0)
        );
    }
    for s in report["steps"].as_array().into_iter().flatten() {
        println!("  {} steps during the probe: {}", s["id"].as_str().unwrap_or("?"), s["words"].as_str().unwrap_or(""));
    }
    println!("trace {trace_id} (if tracing is on: meshctl explain {trace_id} --jaeger URL | --otlp-file FILE)");
}
