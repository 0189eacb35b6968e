//! `pdmesh-loadtest`: closed-loop concurrency sweep against an
//! OpenAI-compatible endpoint; JSON results and a Markdown summary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pdmesh_loadtest::report::{aggregate, markdown, Slo};
use pdmesh_loadtest::run::{closed_loop, Workload};

#[derive(Parser)]
#[command(name = "pdmesh-loadtest", version, about = "Load an OpenAI-compatible server and report latency and throughput")]
struct Args {
    /// Target `host:port` (the gateway, or any OpenAI-compatible server).
    #[arg(long, default_value = "127.0.0.1:8080")]
    target: String,
    /// Model name sent in each request.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    model: String,
    /// Concurrency levels, comma-separated (closed loop).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Requests per load point.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Longest a load point may run, in seconds.
    #[arg(long, default_value_t = 600.0)]
    max_point_s: f64,
    /// max_tokens of each request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Sampling temperature of each request.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Seed of the prompt choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A request with no token for this long is stalled (ended and counted apart), in seconds.
    #[arg(long, default_value_t = 30.0)]
    stall_s: f64,
    /// Client timeout of one request, in seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// SLO for goodput: time to first token, in milliseconds.
    #[arg(long, default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    /// SLO for goodput: time per output token, in milliseconds.
    #[arg(long, default_value_t = 200.0)]
    slo_tpot_ms: f64,
    /// Write the JSON results here (default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the Markdown summary here (default: stderr).
    #[arg(long)]
    markdown: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let a = Args::parse();
    if a.concurrency.iter().any(|c| *c == 0) || a.requests == 0 || a.stall_s <= 0.0 || a.timeout_s <= 0.0 {
        eprintln!("error: concurrency, requests, stall and timeout must be positive");
        return ExitCode::from(2);
    }
    let w = Workload {
        addr: a.target.clone(),
        model: a.model.clone(),
        max_tokens: a.max_tokens,
        seed: a.seed,
        stall: Duration::from_secs_f64(a.stall_s),
        timeout: Duration::from_secs_f64(a.timeout_s),
        temperature: a.temperature,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\nstopping: no new requests; waiting for those in flight");
            s2.store(true, Ordering::Relaxed);
        }
    });
    let slo = Slo { ttft_s: a.slo_ttft_ms / 1e3, tpot_s: a.slo_tpot_ms / 1e3 };
    let mut points = Vec::new();
    let mut all = Vec::new();
    for (i, &c) in a.concurrency.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        eprintln!("concurrency {c}: {} requests ...", a.requests);
        let (records, wall) = closed_loop(&w, c, a.requests, Duration::from_secs_f64(a.max_point_s), stop.clone(), i).await;
        let p = aggregate(c, &records, wall, slo);
        eprintln!("  ok {} errors {} stalled {}; {:.1} output tok/s", p.ok, p.errors, p.stalled, p.output_tokens_per_s);
        points.push(p);
        all.push(serde_json::json!({ "concurrency": c, "records": records }));
    }
    let result = serde_json::json!({
        "target": a.target,
        "model": a.model,
        "workload": { "kind": "closed_loop", "requests_per_point": a.requests, "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": a.seed, "stall_s": a.stall_s },
        "slo": slo,
        "points": points,
        "requests": all,
    });
    let json = serde_json::to_string_pretty(&result).unwrap_or_default();
    match &a.out {
        Some(p) => {
            if let Err(e) = std::fs::write(p, json) {
                eprintln!("error: writing {}: {e}", p.display());
                return ExitCode::FAILURE;
            }
        }
        None => println!("{json}"),
    }
    let md = markdown(&a.target, &points);
    match &a.markdown {
        Some(p) => {
            if let Err(e) = std::fs::write(p, md) {
                eprintln!("error: writing {}: {e}", p.display());
                return ExitCode::FAILURE;
            }
        }
        None => eprintln!("{md}"),
    }
    ExitCode::SUCCESS
}
