//! The autoscaler on a live mesh: `meshctl up --autoscale POLICY.toml`
//! runs the planner ([`pdmesh_planner`]) every `timing.interval_s` on
//! signals read from the instances' own /metrics, and scales by the same
//! operation as `meshctl scale` (new instances gated on health, surplus
//! ones drained, so running sequences are handed over). `meshctl
//! autoscale --dry-run` prints what it would do on a running mesh, and why.
//!
//! Every decision goes to meshctl's log, to its control endpoint's
//! /metrics (`pdmesh_autoscaler_desired_replicas{kind}`,
//! `pdmesh_autoscaler_decisions_total{kind,direction,reason}`) and to
//! `meshctl status`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_core::discovery::Discovery;
use pdmesh_core::http::metric;
use pdmesh_core::vocab::metric as m;
use pdmesh_planner::{
    Decision, DecodeSignals, Direction, Kind, Planner, Policy, PrefillSignals, RouterSignals, Signals,
};
use serde_json::{json, Value};

use crate::supervisor::{Asked, Op};

/// A histogram's cumulative bucket counts (upper bound, count), summed
/// over instances.
type Buckets = Vec<(f64, f64)>;

/// The family's buckets in one Prometheus text scrape.
fn buckets(text: &str, family: &str) -> Buckets {
    let prefix = format!("{family}_bucket{{");
    text.lines()
        .filter_map(|l| {
            let (labels, value) = l.strip_prefix(&prefix)?.rsplit_once("} ")?;
            let le = labels.split(',').find_map(|kv| kv.strip_prefix("le=\""))?.trim_end_matches('"');
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, value.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

fn add(into: &mut Buckets, b: Buckets) {
    if into.is_empty() {
        *into = b;
    } else {
        into.iter_mut().zip(b).for_each(|(x, (_, c))| x.1 += c);
    }
}

/// The p90 of what was observed between two snapshots, interpolated in
/// its bucket as Prometheus's `histogram_quantile` does; None when nothing was.
fn p90(now: &Buckets, then: &Buckets) -> Option<f64> {
    let d: Vec<(f64, f64)> =
        now.iter().enumerate().map(|(i, (le, c))| (*le, (c - then.get(i).map_or(0.0, |x| x.1)).max(0.0))).collect();
    let total = d.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let want = 0.9 * total;
    let mut prev = (0.0, 0.0);
    for (le, c) in d {
        if c >= want {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let frac = if c > prev.1 { (want - prev.1) / (c - prev.1) } else { 1.0 };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, c);
    }
    None
}

/// The counters and histograms a window is read from, summed over instances.
#[derive(Clone, Default)]
struct Totals {
    wait: Buckets,
    ttft: Buckets,
    itl: Buckets,
    prefill_wall_s: f64,
    refused: f64,
}

/// Reads the planner's signals from the live mesh.
pub struct Collector {
    reg: Arc<dyn Discovery>,
    window: Duration,
    history: VecDeque<(Instant, Totals)>,
    t0: Instant,
}

/// Every healthy instance's /metrics of `kind`; None when any could not be read.
async fn scrape(reg: &dyn Discovery, kind: &str) -> Option<Vec<String>> {
    let list = reg.healthy(kind).await.ok()?;
    let mut out = Vec::new();
    for i in list {
        let addr = i.http_addr?;
        let got =
            tokio::task::spawn_blocking(move || pdmesh_core::http::get(&addr, "/metrics", Duration::from_secs(2)));
        match got.await {
            Ok(Ok((200, text))) => out.push(text),
            _ => return None,
        }
    }
    (!out.is_empty()).then_some(out)
}

fn sum(texts: &[String], name: &str) -> f64 {
    texts.iter().filter_map(|t| metric(t, name)).sum()
}

impl Collector {
    pub fn new(reg: Arc<dyn Discovery>, policy: &Policy) -> Collector {
        let window = Duration::from_secs_f64(policy.timing.window_s);
        Collector { reg, window, history: VecDeque::new(), t0: Instant::now() }
    }

    /// Healthy instances of `kind` now (0 when discovery cannot say).
    pub async fn replicas(&self, kind: Kind) -> usize {
        self.reg.healthy(kind.name()).await.map_or(0, |l| l.len())
    }

    /// One sample: gauges as they are now, rates and p90s over the window.
    pub async fn sample(&mut self) -> Signals {
        let reg = self.reg.clone();
        let (p, d, r) = tokio::join!(scrape(&*reg, "prefill"), scrape(&*reg, "decode"), scrape(&*reg, "router"));
        let mut now = Totals::default();
        for t in p.iter().flatten() {
            add(&mut now.wait, buckets(t, m::prefill::QUEUE_WAIT_SECONDS));
            now.prefill_wall_s += metric(t, m::prefill::WORKER.step_wall_seconds_total).unwrap_or(0.0);
        }
        let refused = format!("{}{{outcome=\"resource_exhausted\"}}", m::decode::REQUESTS_TOTAL);
        now.refused = d.as_deref().map_or(0.0, |d| sum(d, &refused));
        // Between a stream's tokens is a decode step: its step time, not the
        // router's gaps, which also hold each stream's hand-over from prefill.
        for t in d.iter().flatten() {
            add(&mut now.itl, buckets(t, m::decode::STEP_SECONDS));
        }
        for t in r.iter().flatten() {
            add(&mut now.ttft, buckets(t, m::router::TTFT_SECONDS));
        }
        let at = Instant::now();
        while self.history.len() > 1 && at - self.history[1].0 >= self.window {
            self.history.pop_front();
        }
        let (then_at, then) = self.history.front().cloned().unwrap_or((at, now.clone()));
        self.history.push_back((at, now.clone()));
        let dt = (at - then_at).as_secs_f64();
        let rate = |a: f64, b: f64| if dt > 0.0 { (a - b).max(0.0) / dt } else { 0.0 };
        let prefill = p.map(|p| PrefillSignals {
            queue_wait_p90_s: p90(&now.wait, &then.wait).unwrap_or(0.0),
            queued_tokens: sum(&p, m::prefill::QUEUED_TOKENS),
            expected_wait_s: p.iter().filter_map(|t| metric(t, m::prefill::EXPECTED_WAIT_SECONDS)).fold(0.0, f64::max),
            busy: (rate(now.prefill_wall_s, then.prefill_wall_s) / p.len() as f64).min(1.0),
        });
        let itl = p90(&now.itl, &then.itl);
        let decode = d.map(|d| DecodeSignals {
            kv_use: sum(&d, m::decode::KV_BLOCKS_USED) / sum(&d, m::decode::KV_BLOCKS_TOTAL).max(1.0),
            refusals_per_s: rate(now.refused, then.refused),
            running: sum(&d, m::decode::RUNNING),
            inter_token_p90_s: itl,
        });
        let ttft_p90_s = r.as_ref().and_then(|_| p90(&now.ttft, &then.ttft));
        let router = r.map(|r| RouterSignals { in_flight: sum(&r, m::router::IN_FLIGHT) });
        Signals { at_s: (at - self.t0).as_secs_f64(), prefill, decode, router, ttft_p90_s }
    }
}

/// What the autoscaler has decided: for /metrics and `meshctl status`.
#[derive(Default)]
pub struct State {
    desired: BTreeMap<&'static str, usize>,
    decisions: BTreeMap<(&'static str, &'static str, &'static str), u64>,
    /// Each kind's latest decision in words.
    last: BTreeMap<&'static str, String>,
    /// The latest sample's signals (null where unread).
    signals: Value,
}

pub type Shared = Arc<Mutex<State>>;

impl State {
    fn observe(&mut self, s: &Signals) {
        self.signals = json!({
            "at_s": s.at_s,
            "ttft_p90_s": s.ttft_p90_s,
            "prefill_queue_wait_p90_s": s.prefill.map(|p| p.queue_wait_p90_s),
            "prefill_expected_wait_s": s.prefill.map(|p| p.expected_wait_s),
            "prefill_busy": s.prefill.map(|p| p.busy),
            "decode_inter_token_p90_s": s.decode.and_then(|d| d.inter_token_p90_s),
            "decode_kv_use": s.decode.map(|d| d.kv_use),
            "decode_refusals_per_s": s.decode.map(|d| d.refusals_per_s),
            "router_in_flight": s.router.map(|r| r.in_flight),
        });
    }

    fn record(&mut self, d: &Decision) {
        self.desired.insert(d.kind.name(), d.to);
        self.last.insert(d.kind.name(), d.reason.clone());
        if d.direction != Direction::Hold {
            *self.decisions.entry((d.kind.name(), d.direction.name(), d.signal)).or_default() += 1;
        }
    }

    /// Prometheus text of the autoscaler's metrics.
    pub fn render(&self) -> String {
        let mut t = pdmesh_core::metrics::Text::new(pdmesh_core::metrics::Format::Prometheus);
        let desired: Vec<(&str, f64)> = self.desired.iter().map(|(k, n)| (*k, *n as f64)).collect();
        t.labelled(
            m::autoscaler::DESIRED_REPLICAS,
            "gauge",
            "Replicas the autoscaler wants per kind.",
            "kind",
            &desired,
        );
        let samples: Vec<(Vec<&str>, f64)> =
            self.decisions.iter().map(|((k, d, r), n)| (vec![*k, *d, *r], *n as f64)).collect();
        t.family(
            m::autoscaler::DECISIONS_TOTAL,
            "counter",
            "Autoscaler decisions that were not holds, by kind, direction and the signal behind them.",
            &["kind", "direction", "reason"],
            &samples,
        );
        t.finish()
    }

    /// For `meshctl status`: each kind's desired replicas and latest reason.
    pub fn json(&self) -> Value {
        let kinds: Vec<Value> = self
            .desired
            .iter()
            .map(|(k, n)| json!({ "kind": k, "desired": n, "reason": self.last.get(k).cloned().unwrap_or_default() }))
            .collect();
        json!({ "kinds": kinds, "signals": self.signals })
    }
}

/// Carries a decision out: scale `kind` to `n` replicas.
pub type Act =
    Box<dyn Fn(Kind, usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>> + Send>;

/// Run the planner on the live mesh until the task is dropped: one sample
/// per `timing.interval_s`; decisions to the log and `state`, and, unless
/// `act` is None (dry run), carried out.
pub async fn drive(
    policy: Policy,
    mut c: Collector,
    state: Shared,
    act: Option<Act>,
    mut each: impl FnMut(&[Decision]),
) {
    let mut current = BTreeMap::new();
    for k in Kind::ALL {
        current.insert(k, c.replicas(k).await);
    }
    let interval = Duration::from_secs_f64(policy.timing.interval_s);
    let mut planner = Planner::new(policy, |k| current[&k]);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let signals = c.sample().await;
        state.lock().unwrap_or_else(|e| e.into_inner()).observe(&signals);
        let decisions = planner.decide(&signals);
        for d in &decisions {
            state.lock().unwrap_or_else(|e| e.into_inner()).record(d);
            if d.direction == Direction::Hold {
                continue;
            }
            eprintln!("meshctl: autoscale {}: {}", d.direction.name(), d.reason);
            let Some(act) = act.as_ref().filter(|_| matches!(d.direction, Direction::Up | Direction::Down)) else {
                continue;
            };
            if let Err(e) = act(d.kind, d.to).await {
                // What runs is what the next decision starts from.
                eprintln!("meshctl: autoscale: scaling {} to {} failed: {e}", d.kind, d.to);
                planner.set_replicas(d.kind, c.replicas(d.kind).await);
            }
        }
        each(&decisions);
    }
}

/// The autoscaler task of `meshctl up --autoscale`: its decisions go to
/// the supervisor as operators' requests do (`tx`). Dropped, it stops.
pub fn start(policy: Policy, reg: Arc<dyn Discovery>, state: Shared, tx: tokio::sync::mpsc::Sender<Asked>) -> Task {
    let act: Act = Box::new(move |kind, n| {
        let tx = tx.clone();
        Box::pin(async move {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let op = Op::Scale { replicas: [(kind.name().to_string(), n)].into() };
            tx.send(Asked { op, reply }).await.map_err(|_| "meshctl is stopping".to_string())?;
            answer.await.map_err(|_| "meshctl is stopping".to_string())?.map(|_| ())
        })
    });
    let collector = Collector::new(reg, &policy);
    pdmesh_core::task::spawn_owned(drive(policy, collector, state, Some(act), |_| {}))
}

/// A task aborted when dropped.
pub type Task = pdmesh_core::task::AbortOnDrop<()>;

#[derive(clap::Args)]
pub struct Args {
    /// The policy file (TOML).
    #[arg(long)]
    pub policy: std::path::PathBuf,
    /// Print the decisions and their reasons; change nothing (to act, run
    /// `meshctl up --autoscale POLICY.toml`).
    #[arg(long, required_unless_present = "advise", conflicts_with = "advise")]
    pub dry_run: bool,
    /// Advise mode: serve the planner's desired replicas on this address
    /// (`/metrics`: `pdmesh_autoscaler_desired_replicas{kind}` for a KEDA
    /// ScaledObject or an HPA on an external metric; `/v1/autoscaler`;
    /// `/health`) and log its decisions; change nothing. Runs until stopped.
    #[arg(long, value_name = "ADDR")]
    pub advise: Option<String>,
    /// Samples to take, one per `timing.interval_s` (the first only sets
    /// the window's start: rates and p90s need two).
    #[arg(long, default_value_t = 3)]
    pub samples: usize,
    /// One JSON object per decision instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
}

/// `meshctl autoscale --advise ADDR`: the planner on the mesh in
/// discovery, its state served for an external scaler, until stopped.
async fn advise(policy: Policy, reg: Arc<dyn Discovery>, addr: &str) -> Result<(), String> {
    let state = Shared::default();
    let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("--advise {addr}: {e}"))?;
    let s2 = state.clone();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/metrics",
            axum::routing::get(move || std::future::ready(s2.lock().unwrap_or_else(|e| e.into_inner()).render())),
        )
        .route("/v1/autoscaler", {
            let s3 = state.clone();
            axum::routing::get(move || {
                std::future::ready(s3.lock().unwrap_or_else(|e| e.into_inner()).json().to_string())
            })
        });
    eprintln!("meshctl: advising on http://{addr}/metrics (pdmesh_autoscaler_desired_replicas)");
    let collector = Collector::new(reg, &policy);
    tokio::select! {
        r = axum::serve(l, app) => r.map_err(|e| e.to_string()),
        () = drive(policy, collector, state, None, |_| {}) => Ok(()),
        () = pdmesh_core::signal::shutdown_signal() => Ok(()),
    }
}

/// `meshctl autoscale --dry-run`: sample the running mesh and print what
/// the planner decides, and why, without acting (or `--advise`).
pub async fn cmd(a: Args) -> Result<(), String> {
    let policy = Policy::load(&a.policy)?;
    let reg = a.discovery.open_or_default()?;
    if let Some(addr) = &a.advise {
        return advise(policy, reg, addr).await;
    }
    if reg.healthy("router").await.map_err(|e| e.to_string())?.is_empty() {
        return Err(format!("no running mesh in {}", reg.describe()));
    }
    let (state, samples, json_out) = (Shared::default(), a.samples.max(1), a.json);
    let mut seen = 0;
    let print = |ds: &[Decision]| {
        for d in ds {
            if json_out {
                let v = json!({ "kind": d.kind.name(), "from": d.from, "to": d.to, "direction": d.direction.name(), "signal": d.signal, "reason": d.reason });
                println!("{v}");
            } else {
                println!("{:<8} {} -> {} {:<9} {}", d.kind.name(), d.from, d.to, d.direction.name(), d.reason);
            }
        }
    };
    let interval = policy.timing.interval_s;
    let collector = Collector::new(reg, &policy);
    let run = drive(policy, collector, state, None, |ds| {
        seen += 1;
        if seen > 1 || samples == 1 {
            print(ds);
        }
    });
    let enough = Duration::from_secs_f64(interval * samples as f64 + interval / 2.0);
    let _ = tokio::time::timeout(enough, run).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p90_reads_a_window_of_a_prometheus_histogram() {
        let text = |counts: [u32; 4]| {
            format!(
                "# TYPE x histogram\nx_bucket{{le=\"0.1\"}} {}\nx_bucket{{le=\"0.5\"}} {}\nx_bucket{{le=\"1\"}} {}\nx_bucket{{le=\"+Inf\"}} {}\nx_sum 3\nx_count {}\n",
                counts[0], counts[1], counts[2], counts[3], counts[3]
            )
        };
        let then = buckets(&text([5, 5, 5, 5]), "x");
        assert_eq!(then.len(), 4);
        // 10 more, 1 under 0.1 s, 9 between 0.5 and 1 s: p90 in that bucket.
        let now = buckets(&text([6, 6, 15, 15]), "x");
        let got = p90(&now, &then).unwrap();
        assert!((got - (0.5 + 0.5 * (9.0 - 1.0) / 9.0)).abs() < 1e-9, "{got}");
        assert_eq!(p90(&then, &then), None, "nothing observed in the window");
        let mut two = then.clone();
        add(&mut two, then.clone());
        assert_eq!(two[3].1, 10.0);
    }
}
