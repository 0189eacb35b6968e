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
    /// Open every request with a random tag, so no prompt cache (the
    /// target's or the peer's) can reuse more than a few tokens.
    #[arg(long, conflicts_with = "repeat_prompt")]
    unique_prompts: bool,
    /// Every request asks the same question (closed and Poisson modes): exact repeats.
    #[arg(long)]
    repeat_prompt: bool,
    /// A system prompt of about this many tokens, the same in every request (0 = none).
    #[arg(long, default_value_t = 0)]
    system_prompt_tokens: usize,
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

type Record = pdmesh_loadtest::client::Record;
type Sample = pdmesh_loadtest::sampler::Sample;
type Point = pdmesh_loadtest::report::Point;

impl Args {
    fn valid(&self) -> bool {
        !(self.concurrency.contains(&0)
            || self.rate.iter().any(|r| r.is_nan() || *r <= 0.0)
            || self.requests == 0
            || self.sessions == 0
            || self.rounds == 0
            || self.stall_s <= 0.0
            || self.timeout_s <= 0.0)
    }

    /// The workload of target A, and of target B when given.
    fn workloads(&self) -> (Workload, Option<Workload>) {
        let w = Workload {
            addr: self.target.clone(),
            model: self.model.clone(),
            max_tokens: self.max_tokens,
            seed: self.seed,
            stall: Duration::from_secs_f64(self.stall_s),
            timeout: Duration::from_secs_f64(self.timeout_s),
            temperature: self.temperature,
            id_prefix: String::new(),
            ignore_eos: self.ignore_eos,
            prompts: pdmesh_loadtest::run::PromptStyle {
                unique: self.unique_prompts,
                repeat: self.repeat_prompt,
                system_tokens: self.system_prompt_tokens,
            },
        };
        let b = self.target_b.as_ref().map(|t| Workload {
            addr: t.clone(),
            model: self.model_b.clone().unwrap_or_else(|| self.model.clone()),
            ..w.clone()
        });
        (w, b)
    }

    /// One load point per concurrency / rate (agentic: one point).
    fn levels(&self) -> Vec<f64> {
        match self.mode {
            Mode::Closed => self.concurrency.iter().map(|c| *c as f64).collect(),
            Mode::Poisson => self.rate.clone(),
            Mode::Agentic => vec![self.sessions as f64],
        }
    }

    /// The /metrics addresses to sample: given ones plus the mesh's.
    fn metrics_targets(&self) -> Vec<String> {
        let mut metrics = self.metrics.clone();
        if let Some(d) = &self.registry_dir {
            match from_meshctl(&self.meshctl, d) {
                Ok(m) => metrics.extend(m),
                Err(e) => eprintln!("warning: not sampling the mesh's metrics: {e}"),
            }
        }
        metrics
    }

    fn describe(&self, level: f64) -> String {
        match self.mode {
            Mode::Closed => format!("concurrency {level}"),
            Mode::Poisson => format!("{level} requests/s"),
            Mode::Agentic => format!("{} sessions x {} rounds", self.sessions, self.rounds),
        }
    }
}

/// Everything measured, by side.
#[derive(Default)]
struct Sweep {
    points: Vec<Point>,
    points_b: Vec<Point>,
    ab: Vec<pdmesh_loadtest::ab::AbPoint>,
    runs: Vec<serde_json::Value>,
    /// Target A's last run, for the timeline plot.
    last_a: Option<(String, Vec<Record>, Vec<Sample>)>,
}

/// Seconds of the clock, modulo a million: tells invocations apart.
fn run_nonce() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() % 1_000_000).unwrap_or(0)
}

/// Sets `stop` on Ctrl-C: no new requests, those in flight finish.
fn stop_on_ctrl_c() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\nstopping: no new requests; waiting for those in flight");
            s2.store(true, Ordering::Relaxed);
        }
    });
    stop
}

/// A live status line on stderr while a point runs.
fn progress_ticker(total: usize) -> tokio::task::JoinHandle<()> {
    pdmesh_loadtest::run::PROGRESS.reset();
    tokio::spawn(async move {
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
    })
}

/// Where one run sits in the sweep.
struct At<'a> {
    index: usize,
    level: f64,
    side: &'a str,
    round: usize,
}

/// Run one load point against `wl`; its records and wall time.
async fn run_point(a: &Args, wl: &Workload, at: &At<'_>, stop: &Arc<AtomicBool>) -> (Vec<Record>, f64) {
    let max_time = Duration::from_secs_f64(a.max_point_s);
    let tag = if a.target_b.is_some() { format!(" [{} round {}]", at.side, at.round) } else { String::new() };
    let (level, i, stop) = (at.level, at.index, stop.clone());
    match a.mode {
        Mode::Closed => {
            eprintln!("concurrency {level}{tag}: {} requests ...", a.requests);
            closed_loop(wl, level as usize, a.requests, max_time, stop, i).await
        }
        Mode::Poisson => {
            eprintln!("rate {level}/s{tag}: {} requests ...", a.requests);
            poisson(wl, level, a.requests, a.max_in_flight, max_time, stop, i).await
        }
        Mode::Agentic => {
            eprintln!("{} agentic sessions x {} rounds{tag} ...", a.sessions, a.rounds);
            agentic(wl, a.sessions, a.rounds, Duration::from_secs_f64(a.think_s.max(0.0)), stop, i).await
        }
    }
}

/// Run one point with its status line and metrics sampler; its aggregate.
async fn measure(
    a: &Args,
    wl: &Workload,
    at: &At<'_>,
    stop: &Arc<AtomicBool>,
    metrics: &[String],
    sw: &mut Sweep,
) -> Point {
    let t_point = std::time::Instant::now();
    let total = if a.mode == Mode::Agentic { a.sessions * a.rounds } else { a.requests };
    let ticker = progress_ticker(total);
    let sampler = Sampler::start(metrics.to_vec(), Duration::from_millis(a.sample_ms.max(50)), t_point);
    // Records' start_s counts from here: the wall clock lets a reader line
    // them up with traces, logs and outside events (a kill in a chaos test).
    let started_unix_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let (records, wall) = run_point(a, wl, at, stop).await;
    ticker.abort();
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!();
    }
    let samples = sampler.take();
    let slo = Slo { ttft_s: a.slo_ttft_ms / 1e3, tpot_s: a.slo_tpot_ms / 1e3 };
    let p = aggregate(at.level.round() as usize, &records, wall, slo);
    eprintln!("  ok {} errors {} stalled {}; {:.1} output tok/s", p.ok, p.errors, p.stalled, p.output_tokens_per_s);
    sw.runs.push(serde_json::json!({
        "level": at.level, "side": at.side, "round": at.round, "target": wl.addr,
        "started_unix_ms": started_unix_ms, "records": records, "metrics_samples": samples,
    }));
    if at.side == "A" {
        sw.last_a = Some((format!("{}: {}", a.label_a, a.describe(at.level)), records, samples));
    }
    p
}

/// Every level, A and B alternating per round.
async fn sweep(a: &Args, stop: &Arc<AtomicBool>) -> Sweep {
    // Unique request ids across invocations (time) and runs (side, round).
    let nonce = run_nonce();
    let metrics = a.metrics_targets();
    let (w, w_b) = a.workloads();
    let mut sides: Vec<(&str, &Workload)> = vec![("A", &w)];
    if let Some(b) = &w_b {
        sides.push(("B", b));
    }
    let rounds = if w_b.is_some() { a.ab_rounds.max(1) } else { 1 };
    let mut sw = Sweep::default();
    for (index, level) in a.levels().into_iter().enumerate() {
        let (mut runs_a, mut runs_b) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            for &(side, wl) in &sides {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                // Both sides of a round send the same prompts; each round
                // its own (seed + round), so a round never finds the last
                // round's exact prompts in a server's prompt cache.
                let wl = Workload {
                    id_prefix: format!("lt-{}-{nonce}-{side}{round}", a.seed),
                    seed: a.seed + round as u64,
                    ..wl.clone()
                };
                let at = At { index, level, side, round };
                let p = measure(a, &wl, &at, stop, &metrics, &mut sw).await;
                if side == "A" {
                    runs_a.push(p)
                } else {
                    runs_b.push(p)
                }
            }
        }
        if w_b.is_some() && !runs_a.is_empty() && runs_a.len() == runs_b.len() {
            sw.ab.push(pdmesh_loadtest::ab::compare(level, &runs_a, &runs_b));
        }
        sw.points.extend(runs_a);
        sw.points_b.extend(runs_b);
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    sw
}

/// The levels at which a side's best throughput falls as load rises.
fn falling(ps: &[Point]) -> Vec<f64> {
    let mut by_level: Vec<(f64, f64)> = Vec::new();
    for p in ps {
        match by_level.iter_mut().find(|(l, _)| *l == p.concurrency as f64) {
            Some(e) => e.1 = e.1.max(p.output_tokens_per_s),
            None => by_level.push((p.concurrency as f64, p.output_tokens_per_s)),
        }
    }
    pdmesh_loadtest::ab::falling(&by_level)
}

fn to_json(a: &Args, sw: &Sweep, command: &[String], falls: &[Vec<f64>; 2]) -> serde_json::Value {
    serde_json::json!({
        "command": command,
        "target": a.target,
        "model": a.model,
        "workload": {
            "mode": format!("{:?}", a.mode).to_lowercase(), "levels": a.levels(), "requests_per_point": a.requests,
            "sessions": a.sessions, "rounds": a.rounds, "think_s": a.think_s, "max_tokens": a.max_tokens,
            "temperature": a.temperature, "seed": a.seed, "stall_s": a.stall_s,
        },
        "slo": Slo { ttft_s: a.slo_ttft_ms / 1e3, tpot_s: a.slo_tpot_ms / 1e3 },
        "points": sw.points,
        "points_b": sw.points_b,
        "ab": sw.ab,
        "labels": [a.label_a, a.label_b],
        "throughput_falls_at": { "a": falls[0], "b": falls[1] },
        "runs": sw.runs,
    })
}

fn to_markdown(a: &Args, sw: &Sweep, command: &[String], falls: &[Vec<f64>; 2]) -> String {
    let mut md = format!("Command: `{}`\n\n", command.join(" "));
    md.push_str(&markdown(&a.target, &sw.points));
    if let Some(b) = &a.target_b {
        md.push_str(&markdown(b, &sw.points_b).replacen("# Load test", "\n# Load test", 1));
        md.push_str(&pdmesh_loadtest::ab::markdown(&a.label_a, &a.label_b, &sw.ab));
    }
    for (label, f) in [(&a.label_a, &falls[0]), (&a.label_b, &falls[1])] {
        if !f.is_empty() {
            md.push_str(&format!("\n**{label}: throughput falls as load rises** (levels {f:?}).\n"));
        }
    }
    md
}

fn write_plots(a: &Args, sw: &Sweep, prefix: &std::path::Path) -> Result<(), String> {
    use pdmesh_loadtest::plot::{write_all, Curve};
    let mut curves = vec![Curve::from_points(&a.label_a, &sw.points)];
    if a.target_b.is_some() {
        curves.push(Curve::from_points(&a.label_b, &sw.points_b));
    }
    let xdesc = match a.mode {
        Mode::Closed => "concurrency (log scale)",
        Mode::Poisson => "arrival rate, requests/s (log scale)",
        Mode::Agentic => "sessions (log scale)",
    };
    let timeline = sw.last_a.as_ref().map(|(t, r, s)| (t.as_str(), r.as_slice(), s.as_slice()));
    let files = write_all(prefix, &curves, xdesc, timeline)?;
    eprintln!("plots: {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let a = Args::parse();
    if !a.valid() {
        eprintln!("error: concurrency, rate, requests, sessions, rounds, stall and timeout must be positive");
        return ExitCode::from(2);
    }
    let stop = stop_on_ctrl_c();
    let sw = sweep(&a, &stop).await;
    let falls = [falling(&sw.points), falling(&sw.points_b)];
    for (label, f) in [(&a.label_a, &falls[0]), (&a.label_b, &falls[1])] {
        if !f.is_empty() {
            eprintln!("warning: {label}: throughput falls as load rises, at levels {f:?}");
        }
    }
    let command: Vec<String> = std::env::args().collect();
    let json = serde_json::to_string_pretty(&to_json(&a, &sw, &command, &falls)).unwrap_or_default();
    if !write_or(a.out.as_deref(), &json, |t| println!("{t}")) {
        return ExitCode::FAILURE;
    }
    let md = to_markdown(&a, &sw, &command, &falls);
    if !write_or(a.markdown.as_deref(), &md, |t| eprintln!("{t}")) {
        return ExitCode::FAILURE;
    }
    if let Some(prefix) = &a.plots {
        if let Err(e) = write_plots(&a, &sw, prefix) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
