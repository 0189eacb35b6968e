//! Metrics exposition without a metrics framework: counters and gauges are
//! plain atomics owned by each service; [`Histogram`] is a fixed-bucket
//! histogram that keeps, per bucket, the trace id of its latest observation
//! (an OpenMetrics exemplar); [`Text`] writes either the Prometheus text
//! format or OpenMetrics 1.0, chosen per scrape by the `Accept` header.
//! [`Outcome`] is the one vocabulary of request outcomes.
//!
//! Why not the `prometheus-client` crate: every service keeps its live load
//! in atomics that its scheduler and its `Load` RPC read too, so metrics
//! would be copied into a second registry, and exemplars there need a
//! label-set type per histogram; the exposition here is ~150 lines, checked
//! by a real Prometheus in the `prometheus` test.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Latency buckets in seconds, from 1 ms to 5 min.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// The exposition format of one scrape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4 (no exemplars).
    Prometheus,
    /// OpenMetrics 1.0 text, with exemplars on histogram buckets.
    OpenMetrics,
}

impl Format {
    /// OpenMetrics when the scraper asks for it (Prometheus does), else the
    /// classic text format.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// The trace of one observation, shown beside its bucket.
#[derive(Clone, Debug, PartialEq)]
struct Exemplar {
    trace_id: String,
    value: f64,
    unix_s: f64,
}

struct Inner {
    /// Per bucket, then one for +Inf.
    counts: Vec<u64>,
    exemplars: Vec<Option<Exemplar>>,
    sum: f64,
    count: u64,
}

/// A histogram with fixed upper bounds (cumulative on output).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<Inner>,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        let n = bounds.len() + 1;
        Histogram {
            bounds,
            inner: Mutex::new(Inner { counts: vec![0; n], exemplars: vec![None; n], sum: 0.0, count: 0 }),
        }
    }

    pub fn latency() -> Histogram {
        Histogram::new(LATENCY_BUCKETS)
    }

    pub fn observe(&self, v: f64) {
        self.observe_traced(v, None);
    }

    /// Observe `v`; with a trace id, it becomes its bucket's exemplar, so a
    /// slow bucket leads to a trace that shows why.
    pub fn observe_traced(&self, v: f64, trace_id: Option<&str>) {
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        let unix_s = trace_id.map(|_| crate::now_ms() as f64 / 1e3);
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.counts[i] += 1;
        g.sum += v;
        g.count += 1;
        if let (Some(t), Some(unix_s)) = (trace_id, unix_s) {
            // Reuse the bucket's string: traced inter-token gaps come once per token.
            match &mut g.exemplars[i] {
                Some(e) => {
                    e.trace_id.clear();
                    e.trace_id.push_str(t);
                    (e.value, e.unix_s) = (v, unix_s);
                }
                slot => *slot = Some(Exemplar { trace_id: t.to_string(), value: v, unix_s }),
            }
        }
    }

    /// (count, sum) so far.
    pub fn count_sum(&self) -> (u64, f64) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (g.count, g.sum)
    }
}

impl Default for Histogram {
    /// Latency buckets.
    fn default() -> Self {
        Histogram::latency()
    }
}

/// Builder of one exposition document.
pub struct Text {
    out: String,
    format: Format,
}

impl Text {
    pub fn new(format: Format) -> Text {
        Text { out: String::new(), format }
    }

    /// The document (OpenMetrics ends with `# EOF`).
    pub fn finish(mut self) -> String {
        if self.format == Format::OpenMetrics {
            self.out.push_str("# EOF\n");
        }
        self.out
    }

    /// The families written so far, without the end marker.
    pub fn body(self) -> String {
        self.out
    }

    /// HELP and TYPE. OpenMetrics names a counter family without `_total`.
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let family = match (self.format, kind) {
            (Format::OpenMetrics, "counter") => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        let _ = writeln!(self.out, "# HELP {family} {help}\n# TYPE {family} {kind}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.head(name, "gauge", help);
        let _ = writeln!(self.out, "{name} {value}");
        self
    }

    /// A counter; `name` ends in `_total`.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.head(name, "counter", help);
        let _ = writeln!(self.out, "{name} {value}");
        self
    }

    /// A counter of a real quantity (seconds, bytes); `name` ends in `_total`.
    pub fn counter_f64(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.head(name, "counter", help);
        let _ = writeln!(self.out, "{name} {value}");
        self
    }

    /// A family with labels: `(label values, sample)` pairs, the values in
    /// the order of `labels`.
    pub fn family(&mut self, name: &str, kind: &str, help: &str, labels: &[&str], samples: &[(Vec<&str>, f64)]) {
        self.head(name, kind, help);
        for (values, v) in samples {
            let set: Vec<String> = labels.iter().zip(values).map(|(l, x)| format!("{l}=\"{x}\"")).collect();
            let _ = writeln!(self.out, "{name}{{{}}} {v}", set.join(","));
        }
    }

    /// A family with one label: `(label value, sample)` pairs.
    pub fn labelled(&mut self, name: &str, kind: &str, help: &str, label: &str, values: &[(&str, f64)]) -> &mut Self {
        let samples: Vec<(Vec<&str>, f64)> = values.iter().map(|(l, v)| (vec![*l], *v)).collect();
        self.family(name, kind, help, &[label], &samples);
        self
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) -> &mut Self {
        self.head(name, "histogram", help);
        let g = h.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut cum = 0;
        let les = h.bounds.iter().map(|b| b.to_string()).chain(["+Inf".to_string()]);
        for ((le, c), ex) in les.zip(&g.counts).zip(&g.exemplars) {
            cum += c;
            let _ = write!(self.out, "{name}_bucket{{le=\"{le}\"}} {cum}");
            if let (Format::OpenMetrics, Some(e)) = (self.format, ex) {
                let _ = write!(self.out, " # {{trace_id=\"{}\"}} {} {:.3}", e.trace_id, e.value, e.unix_s);
            }
            self.out.push('\n');
        }
        let _ = writeln!(self.out, "{name}_sum {}\n{name}_count {}", g.sum, g.count);
        self
    }
}

/// `doc` (a finished exposition) with the families of `more` added before
/// its end marker: process-wide families every service shares.
pub fn splice(doc: String, more: Text) -> String {
    let more = more.body();
    match doc.strip_suffix("# EOF\n") {
        Some(head) => format!("{head}{more}# EOF\n"),
        None => doc + &more,
    }
}

/// How a request ended: the one outcome vocabulary of every service's
/// request counters (`outcome` label), named after the gRPC code class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    InvalidArgument,
    ResourceExhausted,
    DeadlineExceeded,
    Cancelled,
    Unavailable,
    NotFound,
    FailedPrecondition,
    /// No valid credentials (HTTP 401).
    Unauthenticated,
    Internal,
}

impl Outcome {
    pub const ALL: [Outcome; 10] = [
        Outcome::Ok,
        Outcome::InvalidArgument,
        Outcome::ResourceExhausted,
        Outcome::DeadlineExceeded,
        Outcome::Cancelled,
        Outcome::Unavailable,
        Outcome::NotFound,
        Outcome::FailedPrecondition,
        Outcome::Unauthenticated,
        Outcome::Internal,
    ];

    /// The label value (snake_case of the gRPC code name).
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::InvalidArgument => "invalid_argument",
            Outcome::ResourceExhausted => "resource_exhausted",
            Outcome::DeadlineExceeded => "deadline_exceeded",
            Outcome::Cancelled => "cancelled",
            Outcome::Unavailable => "unavailable",
            Outcome::NotFound => "not_found",
            Outcome::FailedPrecondition => "failed_precondition",
            Outcome::Unauthenticated => "unauthenticated",
            Outcome::Internal => "internal",
        }
    }

    pub fn of_code(code: tonic::Code) -> Outcome {
        use tonic::Code::*;
        match code {
            Ok => Outcome::Ok,
            InvalidArgument | OutOfRange => Outcome::InvalidArgument,
            ResourceExhausted => Outcome::ResourceExhausted,
            DeadlineExceeded => Outcome::DeadlineExceeded,
            Cancelled => Outcome::Cancelled,
            Unavailable => Outcome::Unavailable,
            NotFound => Outcome::NotFound,
            FailedPrecondition => Outcome::FailedPrecondition,
            Unauthenticated | PermissionDenied => Outcome::Unauthenticated,
            _ => Outcome::Internal,
        }
    }

    /// The outcome an HTTP status stands for (the gateway's answers; 499 is
    /// a client that went away).
    pub fn of_http(status: u16) -> Outcome {
        match status {
            200..=299 => Outcome::Ok,
            400 | 405 | 408 | 413 | 422 => Outcome::InvalidArgument,
            404 => Outcome::NotFound,
            401 | 403 => Outcome::Unauthenticated,
            429 => Outcome::ResourceExhausted,
            499 => Outcome::Cancelled,
            503 => Outcome::Unavailable,
            504 => Outcome::DeadlineExceeded,
            _ => Outcome::Internal,
        }
    }
}

/// Counters of finished requests by [`Outcome`].
#[derive(Default)]
pub struct Outcomes {
    counts: [AtomicU64; Outcome::ALL.len()],
}

impl Outcomes {
    pub fn inc(&self, outcome: Outcome) {
        self.counts[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome as usize].load(Ordering::Relaxed)
    }

    /// `(outcome label, count)` for every outcome.
    pub fn samples(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        Outcome::ALL.into_iter().map(|o| (o.label(), self.get(o) as f64))
    }

    pub fn render(&self, t: &mut Text, name: &str, help: &str) {
        let v: Vec<(&str, f64)> = self.samples().collect();
        t.labelled(name, "counter", help, "outcome", &v);
    }
}

/// The trace ids of the exemplars on `histogram`'s buckets in an
/// OpenMetrics document, slowest bucket first.
pub fn exemplar_trace_ids(text: &str, histogram: &str) -> Vec<String> {
    let bucket = format!("{histogram}_bucket{{");
    let mut ids: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with(&bucket))
        .filter_map(|l| {
            let (_, ex) = l.split_once(" # {trace_id=\"")?;
            Some(ex.split('"').next()?.to_string())
        })
        .collect();
    ids.reverse();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_counts_everything() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut t = Text::new(Format::Prometheus);
        t.histogram("x_seconds", "x", &h);
        let t = t.finish();
        assert!(t.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{t}");
        assert!(t.contains("x_seconds_bucket{le=\"1\"} 3\n"), "{t}");
        assert!(t.contains("x_seconds_bucket{le=\"+Inf\"} 4\n"), "{t}");
        assert!(t.contains("x_seconds_count 4\n"), "{t}");
        assert_eq!(h.count_sum().0, 4);
    }

    #[test]
    fn openmetrics_carries_exemplars_and_names_counter_families_without_total() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe_traced(0.5, Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        h.observe_traced(7.0, Some("00f067aa0ba902b7a3ce929d0e0e4736"));
        h.observe(0.05);
        let mut om = Text::new(Format::OpenMetrics);
        om.histogram("x_seconds", "x", &h).counter("y_total", "y", 3);
        let om = om.finish();
        assert!(
            om.contains("x_seconds_bucket{le=\"1\"} 2 # {trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\"} 0.5 "),
            "{om}"
        );
        assert!(om.contains("x_seconds_bucket{le=\"+Inf\"} 3 # {trace_id=\"00f067aa0ba902b7a3ce929d0e0e4736\"} 7 "));
        assert!(om.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "no exemplar without a trace: {om}");
        assert!(om.contains("# TYPE y counter\ny_total 3\n"), "{om}");
        assert!(om.ends_with("# EOF\n"));
        let ids = exemplar_trace_ids(&om, "x_seconds");
        assert_eq!(ids, ["00f067aa0ba902b7a3ce929d0e0e4736", "4bf92f3577b34da6a3ce929d0e0e4736"]);
        let mut prom = Text::new(Format::Prometheus);
        prom.histogram("x_seconds", "x", &h).counter("y_total", "y", 3);
        let prom = prom.finish();
        assert!(!prom.contains("trace_id") && !prom.contains("# EOF"), "{prom}");
        assert!(prom.contains("# TYPE y_total counter\n"), "{prom}");
    }

    #[test]
    fn the_scrapers_accept_header_picks_the_format() {
        let prom = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::from_accept(Some(prom)), Format::OpenMetrics);
        assert_eq!(Format::from_accept(Some("*/*")), Format::Prometheus);
        assert_eq!(Format::from_accept(None), Format::Prometheus);
    }

    #[test]
    fn outcomes_count_by_one_vocabulary() {
        let o = Outcomes::default();
        o.inc(Outcome::Ok);
        o.inc(Outcome::of_code(tonic::Code::ResourceExhausted));
        o.inc(Outcome::of_code(tonic::Code::DataLoss));
        o.inc(Outcome::of_http(429));
        assert_eq!(o.get(Outcome::Ok), 1);
        assert_eq!(o.get(Outcome::ResourceExhausted), 2);
        assert_eq!(o.get(Outcome::Internal), 1);
        let mut t = Text::new(Format::Prometheus);
        o.render(&mut t, "r_total", "r");
        assert!(t.finish().contains("r_total{outcome=\"resource_exhausted\"} 2\n"));
    }
}
