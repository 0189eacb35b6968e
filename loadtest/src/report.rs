//! Aggregates of a load point: percentiles, throughput, goodput, outcomes.

use serde::Serialize;

use crate::client::{Outcome, Record};

#[derive(Clone, Debug, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// Nearest-rank percentiles of `v` (NaN-free); `None` when empty.
pub fn percentiles(mut v: Vec<f64>) -> Option<Percentiles> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99), mean: v.iter().sum::<f64>() / v.len() as f64 })
}

/// Service-level objective for goodput.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Slo {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub concurrency: usize,
    pub requests: usize,
    pub wall_s: f64,
    pub ok: usize,
    pub errors: usize,
    pub stalled: usize,
    /// Request ids of stalled requests (to look up their traces).
    pub stalled_ids: Vec<String>,
    pub ttft_s: Option<Percentiles>,
    pub inter_token_s: Option<Percentiles>,
    pub tpot_s: Option<Percentiles>,
    pub e2e_s: Option<Percentiles>,
    /// The longest any successful stream went without a token, between
    /// its first and its last (a stall a client saw), in seconds.
    pub longest_gap_s: f64,
    pub output_tokens: usize,
    /// Prompt tokens of successful requests, and how many of them the
    /// server said came from its prompt cache (when it reports usage).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    /// Successful requests per second that met the SLO.
    pub goodput_rps: f64,
    pub error_kinds: std::collections::BTreeMap<String, usize>,
}

/// Time per output token of one request (after the first).
pub fn tpot(r: &Record) -> Option<f64> {
    let ttft = r.ttft_s?;
    (r.output_tokens > 1).then(|| (r.e2e_s - ttft) / (r.output_tokens - 1) as f64)
}

pub fn aggregate(concurrency: usize, records: &[Record], wall_s: f64, slo: Slo) -> Point {
    let ok: Vec<&Record> = records.iter().filter(|r| r.outcome == Outcome::Ok).collect();
    let stalled: Vec<&Record> = records.iter().filter(|r| r.outcome == Outcome::Stalled).collect();
    let mut kinds = std::collections::BTreeMap::new();
    for r in records {
        let k = match &r.outcome {
            Outcome::Ok | Outcome::Stalled => continue,
            Outcome::Http { status, .. } => format!("http_{status}"),
            Outcome::StreamError { .. } => "stream_error".into(),
            Outcome::Timeout => "client_timeout".into(),
            Outcome::Transport { .. } => "transport".into(),
        };
        *kinds.entry(k).or_insert(0) += 1;
    }
    let output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let good = ok
        .iter()
        .filter(|r| r.ttft_s.is_some_and(|t| t <= slo.ttft_s) && tpot(r).is_none_or(|t| t <= slo.tpot_s))
        .count();
    let wall = wall_s.max(1e-9);
    Point {
        concurrency,
        requests: records.len(),
        wall_s,
        ok: ok.len(),
        errors: records.len() - ok.len() - stalled.len(),
        stalled: stalled.len(),
        stalled_ids: stalled.iter().map(|r| r.request_id.clone()).collect(),
        ttft_s: percentiles(ok.iter().filter_map(|r| r.ttft_s).collect()),
        inter_token_s: percentiles(ok.iter().flat_map(|r| r.gaps_s.iter().copied()).collect()),
        tpot_s: percentiles(ok.iter().filter_map(|r| tpot(r)).collect()),
        e2e_s: percentiles(ok.iter().map(|r| r.e2e_s).collect()),
        longest_gap_s: ok.iter().flat_map(|r| r.gaps_s.iter().copied()).fold(0.0, f64::max),
        output_tokens,
        prompt_tokens: ok.iter().filter_map(|r| r.prompt_tokens).sum(),
        cached_tokens: ok.iter().filter_map(|r| r.cached_tokens).sum(),
        output_tokens_per_s: output_tokens as f64 / wall,
        requests_per_s: ok.len() as f64 / wall,
        goodput_rps: good as f64 / wall,
        error_kinds: kinds,
    }
}

fn ms(p: &Option<Percentiles>, f: fn(&Percentiles) -> f64) -> String {
    p.as_ref().map(|p| format!("{:.0}", f(p) * 1e3)).unwrap_or_else(|| "-".into())
}

/// The share of prompt tokens served from the server's prompt cache, or
/// "-" when it did not report usage.
fn cached_share(p: &Point) -> String {
    match p.prompt_tokens {
        0 => "-".into(),
        n => format!("{:.0}", p.cached_tokens as f64 * 100.0 / n as f64),
    }
}

/// A Markdown table of the points.
pub fn markdown(target: &str, points: &[Point]) -> String {
    let mut s = format!("# Load test: {target}\n\n| concurrency | requests | ok | errors | stalled | TTFT p50 / p90 / p99 ms | inter-token p50 / p99 ms | TPOT p50 ms | e2e p50 ms | output tok/s | req/s | goodput req/s | prompt cached % |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for p in points {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} / {} / {} | {} / {} | {} | {} | {:.1} | {:.2} | {:.2} | {} |\n",
            p.concurrency,
            p.requests,
            p.ok,
            p.errors,
            p.stalled,
            ms(&p.ttft_s, |p| p.p50),
            ms(&p.ttft_s, |p| p.p90),
            ms(&p.ttft_s, |p| p.p99),
            ms(&p.inter_token_s, |p| p.p50),
            ms(&p.inter_token_s, |p| p.p99),
            ms(&p.tpot_s, |p| p.p50),
            ms(&p.e2e_s, |p| p.p50),
            p.output_tokens_per_s,
            p.requests_per_s,
            p.goodput_rps,
            cached_share(p)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let p = percentiles((1..=100).map(|x| x as f64).collect()).unwrap();
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert!(percentiles(vec![]).is_none());
        let one = percentiles(vec![7.0]).unwrap();
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
    }
}
