//! `pdmesh-loadtest`: closed-loop concurrency sweep against an
//! OpenAI-compatible endpoint; JSON results and a Markdown summary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pdmesh_loadtest::report::{aggregate, markdown, Slo};
use pdmesh_loadtest::run::{agentic, closed_loop, poisson, Workload};
use pdmesh_loadtest::sampler::{from_meshctl, Sampler};

#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
enum Mode {
    /// `--concurrency` clients, each sending its next request when the last ends.
    Closed,
    /// Poisson arrivals at each of `--rate` requests per second.
    Poisson,
    /// `--sessions` multi-turn sessions of `--rounds` rounds with `--think-s` between.
    Agentic,
}

#[derive(Parser)]
#[command(
    name = "pdmesh-loadtest",
    version,
    about = "Load an OpenAI-compatible server and report latency and throughput"
)]
struct Args {
    /// Target `host:port` (the gateway, or any OpenAI-compatible server).
    #[arg(long, default_value = "127.0.0.1:8080")]
    target: String,
    /// Model name sent in each request.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    model: String,
    /// Workload.
    #[arg(long, value_enum, default_value = "closed")]
    mode: Mode,
    /// Arrival rates for `--mode poisson`, requests per second, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rate: Vec<f64>,
    /// Most requests in flight in `--mode poisson` (keeps the load bounded).
    #[arg(long, default_value_t = 256)]
    max_in_flight: usize,
    /// Sessions at once for `--mode agentic`.
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// Rounds per session for `--mode agentic`.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Think time between rounds for `--mode agentic`, in seconds.
    #[arg(long, default_value_t = 1.0)]
    think_s: f64,
    /// Admin (HTTP) addresses whose /metrics to sample while loading, comma-separated.
    #[arg(long, value_delimiter = ',')]
    metrics: Vec<String>,
    /// Sample every instance `meshctl status --json` lists for this registry folder.
    #[arg(long)]
    registry_dir: Option<String>,
    /// The meshctl binary used with `--registry-dir`.
    #[arg(long, default_value = "meshctl")]
    meshctl: String,
    /// Sampling period of /metrics, in milliseconds.
    #[arg(long, default_value_t = 500)]
    sample_ms: u64,
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
    /// Ask for exactly max_tokens per answer (`"ignore_eos": true`; pdmesh and llama-server honour it).
    #[arg(long)]
    ignore_eos: bool,
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
    /// A second target for A/B: at each level, runs alternate A, B, A, B ...
    #[arg(long)]
    target_b: Option<String>,
    /// Model name sent to the second target (default: --model).
    #[arg(long)]
    model_b: Option<String>,
    /// Labels of the two targets in the report.
    #[arg(long, default_value = "A")]
    label_a: String,
    #[arg(long, default_value = "B")]
    label_b: String,
    /// A/B rounds per level (each round runs A once and B once).
    #[arg(long, default_value_t = 3)]
    ab_rounds: usize,
    /// Write the JSON results here (default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the Markdown summary here (default: stderr).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Write plots as PNG and SVG beside this path prefix: PREFIX-throughput,
    /// PREFIX-latency (against load, one line per target) and PREFIX-timeline
    /// (the last run of the first target, with the sampled load).
    #[arg(long)]
    plots: Option<PathBuf>,
}

/// Write `text` to `path`, or hand it to `otherwise` when no path was given;
/// false (after saying why) when the file cannot be written.
fn write_or(path: Option<&std::path::Path>, text: &str, otherwise: impl Fn(&str)) -> bool {
    match path {
        Some(p) => std::fs::write(p, text).map_err(|e| eprintln!("error: writing {}: {e}", p.display())).is_ok(),
        None => {
            otherwise(text);
            true
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let a = Args::parse();
    if a.concurrency.contains(&0)
        || a.rate.iter().any(|r| r.is_nan() || *r <= 0.0)
        || a.requests == 0
        || a.sessions == 0
        || a.rounds == 0
        || a.stall_s <= 0.0
        || a.timeout_s <= 0.0
    {
        eprintln!("error: concurrency, rate, requests, sessions, rounds, stall and timeout must be positive");
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
        id_prefix: String::new(),
        ignore_eos: a.ignore_eos,
    };
    // Unique request ids across invocations (time) and runs (side, round).
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() % 1_000_000)
        .unwrap_or(0);
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\nstopping: no new requests; waiting for those in flight");
            s2.store(true, Ordering::Relaxed);
        }
    });
    let slo = Slo { ttft_s: a.slo_ttft_ms / 1e3, tpot_s: a.slo_tpot_ms / 1e3 };
    let mut metrics = a.metrics.clone();
    if let Some(d) = &a.registry_dir {
        match from_meshctl(&a.meshctl, d) {
            Ok(m) => metrics.extend(m),
            Err(e) => eprintln!("warning: not sampling the mesh's metrics: {e}"),
        }
    }
    // One load point per concurrency / rate (agentic: one point).
    let levels: Vec<f64> = match a.mode {
        Mode::Closed => a.concurrency.iter().map(|c| *c as f64).collect(),
        Mode::Poisson => a.rate.clone(),
        Mode::Agentic => vec![a.sessions as f64],
    };
    let mut w_b = w.clone();
    if let Some(t) = &a.target_b {
        w_b.addr = t.clone();
        w_b.model = a.model_b.clone().unwrap_or_else(|| a.model.clone());
    }
    let ab = a.target_b.is_some();
    let rounds = if ab { a.ab_rounds.max(1) } else { 1 };
    let mut points = Vec::new();
    let mut points_b = Vec::new();
    let mut ab_points = Vec::new();
    let mut all = Vec::new();
    let mut last_a: Option<(String, Vec<pdmesh_loadtest::client::Record>, Vec<pdmesh_loadtest::sampler::Sample>)> =
        None;
    for (i, &level) in levels.iter().enumerate() {
        let (mut runs_a, mut runs_b) = (Vec::new(), Vec::new());
        for r in 0..rounds {
            let sides: &[(&str, &Workload)] = if ab { &[("A", &w), ("B", &w_b)] } else { &[("A", &w)] };
            for (side, wl) in sides {
                let mut wl = (*wl).clone();
                wl.id_prefix = format!("lt-{}-{nonce}-{side}{r}", a.seed);
                let wl = &wl;
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let t_point = std::time::Instant::now();
                // A live status line on stderr while the point runs.
                pdmesh_loadtest::run::PROGRESS.reset();
                let total = match a.mode {
                    Mode::Agentic => a.sessions * a.rounds,
                    _ => a.requests,
                };
                let ticker = tokio::spawn(async move {
                    use std::io::{IsTerminal, Write};
                    let tty = std::io::stderr().is_terminal();
                    let every = Duration::from_millis(if tty { 250 } else { 5000 });
                    loop {
                        tokio::time::sleep(every).await;
                        let line = pdmesh_loadtest::run::PROGRESS.line(total);
                        if tty {
                            eprint!("\r  {line}   ");
                        } else {
                            eprintln!("  {line}");
                        }
                        let _ = std::io::stderr().flush();
                    }
                });
                let sampler = Sampler::start(metrics.clone(), Duration::from_millis(a.sample_ms.max(50)), t_point);
                let max_time = Duration::from_secs_f64(a.max_point_s);
                let tag = if ab { format!(" [{side} round {r}]") } else { String::new() };
                let (records, wall) = match a.mode {
                    Mode::Closed => {
                        eprintln!("concurrency {level}{tag}: {} requests ...", a.requests);
                        closed_loop(wl, level as usize, a.requests, max_time, stop.clone(), i).await
                    }
                    Mode::Poisson => {
                        eprintln!("rate {level}/s{tag}: {} requests ...", a.requests);
                        poisson(wl, level, a.requests, a.max_in_flight, max_time, stop.clone(), i).await
                    }
                    Mode::Agentic => {
                        eprintln!("{} agentic sessions x {} rounds{tag} ...", a.sessions, a.rounds);
                        agentic(wl, a.sessions, a.rounds, Duration::from_secs_f64(a.think_s.max(0.0)), stop.clone(), i)
                            .await
                    }
                };
                ticker.abort();
                if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                    eprintln!();
                }
                let samples = sampler.take();
                let p = aggregate(level.round() as usize, &records, wall, slo);
                eprintln!(
                    "  ok {} errors {} stalled {}; {:.1} output tok/s",
                    p.ok, p.errors, p.stalled, p.output_tokens_per_s
                );
                all.push(serde_json::json!({ "level": level, "side": side, "round": r, "target": wl.addr, "records": records, "metrics_samples": samples }));
                if *side == "A" {
                    let what = match a.mode {
                        Mode::Closed => format!("concurrency {level}"),
                        Mode::Poisson => format!("{level} requests/s"),
                        Mode::Agentic => format!("{} sessions x {} rounds", a.sessions, a.rounds),
                    };
                    last_a = Some((format!("{}: {what}", a.label_a), records.clone(), samples.clone()));
                }
                if *side == "A" {
                    runs_a.push(p)
                } else {
                    runs_b.push(p)
                }
            }
        }
        if ab && !runs_a.is_empty() && runs_a.len() == runs_b.len() {
            ab_points.push(pdmesh_loadtest::ab::compare(level, &runs_a, &runs_b));
        }
        points.extend(runs_a);
        points_b.extend(runs_b);
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    let curve = |ps: &[pdmesh_loadtest::report::Point]| -> Vec<f64> {
        let mut by_level: Vec<(f64, f64)> = Vec::new();
        for p in ps {
            match by_level.iter_mut().find(|(l, _)| *l == p.concurrency as f64) {
                Some(e) => e.1 = e.1.max(p.output_tokens_per_s),
                None => by_level.push((p.concurrency as f64, p.output_tokens_per_s)),
            }
        }
        pdmesh_loadtest::ab::falling(&by_level)
    };
    let (falling_a, falling_b) = (curve(&points), curve(&points_b));
    for (label, f) in [(&a.label_a, &falling_a), (&a.label_b, &falling_b)] {
        if !f.is_empty() {
            eprintln!("warning: {label}: throughput falls as load rises, at levels {f:?}");
        }
    }
    let command: Vec<String> = std::env::args().collect();
    let result = serde_json::json!({
        "command": command,
        "target": a.target,
        "model": a.model,
        "workload": { "mode": format!("{:?}", a.mode).to_lowercase(), "levels": levels, "requests_per_point": a.requests, "sessions": a.sessions, "rounds": a.rounds, "think_s": a.think_s, "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": a.seed, "stall_s": a.stall_s },
        "slo": slo,
        "points": points,
        "points_b": points_b,
        "ab": ab_points,
        "labels": [a.label_a, a.label_b],
        "throughput_falls_at": { "a": falling_a, "b": falling_b },
        "runs": all,
    });
    let json = serde_json::to_string_pretty(&result).unwrap_or_default();
    if !write_or(a.out.as_deref(), &json, |t| println!("{t}")) {
        return ExitCode::FAILURE;
    }
    let mut md = format!("Command: `{}`\n\n", command.join(" "));
    md.push_str(&markdown(&a.target, &points));
    if ab {
        md.push_str(&markdown(a.target_b.as_deref().unwrap_or(""), &points_b).replacen(
            "# Load test",
            "\n# Load test",
            1,
        ));
        md.push_str(&pdmesh_loadtest::ab::markdown(&a.label_a, &a.label_b, &ab_points));
    }
    for (label, f) in [(&a.label_a, &falling_a), (&a.label_b, &falling_b)] {
        if !f.is_empty() {
            md.push_str(&format!("\n**{label}: throughput falls as load rises** (levels {f:?}).\n"));
        }
    }
    if !write_or(a.markdown.as_deref(), &md, |t| eprintln!("{t}")) {
        return ExitCode::FAILURE;
    }
    if let Some(prefix) = &a.plots {
        use pdmesh_loadtest::plot::{write_all, Curve};
        let mut curves = vec![Curve::from_points(&a.label_a, &points)];
        if ab {
            curves.push(Curve::from_points(&a.label_b, &points_b));
        }
        let xdesc = match a.mode {
            Mode::Closed => "concurrency (log scale)",
            Mode::Poisson => "arrival rate, requests/s (log scale)",
            Mode::Agentic => "sessions (log scale)",
        };
        let timeline = last_a.as_ref().map(|(t, r, s)| (t.as_str(), r.as_slice(), s.as_slice()));
        match write_all(prefix, &curves, xdesc, timeline) {
            Ok(files) => {
                eprintln!("plots: {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "))
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
