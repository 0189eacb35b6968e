//! Prometheus text exposition without a metrics framework: counters and
//! gauges are plain atomics owned by each service; [`Histogram`] is a
//! fixed-bucket histogram; [`Text`] writes the exposition format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Latency buckets in seconds, from 1 ms to 5 min.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// A histogram with fixed upper bounds (cumulative on output).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }

    pub fn latency() -> Histogram {
        Histogram::new(LATENCY_BUCKETS)
    }

    pub fn observe(&self, v: f64) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            g.0[i] += 1;
        }
        g.1 += v;
        g.2 += 1;
    }

    /// (count, sum) so far.
    pub fn count_sum(&self) -> (u64, f64) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (g.2, g.1)
    }
}

/// Builder of one exposition document.
#[derive(Default)]
pub struct Text(pub String);

impl Text {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.head(name, "gauge", help);
        let _ = writeln!(self.0, "{name} {value}");
        self
    }

    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.head(name, "counter", help);
        let _ = writeln!(self.0, "{name} {value}");
        self
    }

    /// A family with one label: `(label value, sample)` pairs.
    pub fn labelled(&mut self, name: &str, kind: &str, help: &str, label: &str, values: &[(&str, f64)]) -> &mut Self {
        self.head(name, kind, help);
        for (l, v) in values {
            let _ = writeln!(self.0, "{name}{{{label}=\"{l}\"}} {v}");
        }
        self
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) -> &mut Self {
        self.head(name, "histogram", help);
        let g = h.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut cum = 0;
        for (b, c) in h.bounds.iter().zip(&g.0) {
            cum += c;
            let _ = writeln!(self.0, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(self.0, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", g.2, g.1, g.2);
        self
    }
}

impl Default for Histogram {
    /// Latency buckets.
    fn default() -> Self {
        Histogram::latency()
    }
}

impl Default for Outcomes {
    /// The gRPC outcome labels.
    fn default() -> Self {
        Outcomes::new(GRPC_OUTCOMES)
    }
}

/// Counters of finished requests by outcome label.
pub struct Outcomes {
    names: &'static [&'static str],
    counts: Vec<AtomicU64>,
}

impl Outcomes {
    pub fn new(names: &'static [&'static str]) -> Outcomes {
        Outcomes { names, counts: names.iter().map(|_| AtomicU64::new(0)).collect() }
    }

    /// Count one request ending in `outcome` (unknown names count as the last one).
    pub fn inc(&self, outcome: &str) {
        let i = self.names.iter().position(|n| *n == outcome).unwrap_or(self.names.len() - 1);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, outcome: &str) -> u64 {
        self.names.iter().position(|n| *n == outcome).map(|i| self.counts[i].load(Ordering::Relaxed)).unwrap_or(0)
    }

    pub fn render(&self, t: &mut Text, name: &str, help: &str) {
        let v: Vec<(&str, f64)> =
            self.names.iter().zip(&self.counts).map(|(n, c)| (*n, c.load(Ordering::Relaxed) as f64)).collect();
        t.labelled(name, "counter", help, "outcome", &v);
    }
}

/// The outcome label of a gRPC status code (snake_case of the code name).
pub fn outcome_of(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        InvalidArgument | OutOfRange => "invalid_argument",
        ResourceExhausted => "resource_exhausted",
        DeadlineExceeded => "deadline_exceeded",
        Cancelled => "cancelled",
        Unavailable => "unavailable",
        NotFound => "not_found",
        FailedPrecondition => "failed_precondition",
        _ => "internal",
    }
}

/// Every label [`outcome_of`] produces, for [`Outcomes::new`].
pub const GRPC_OUTCOMES: &[&str] = &[
    "ok",
    "invalid_argument",
    "resource_exhausted",
    "deadline_exceeded",
    "cancelled",
    "unavailable",
    "not_found",
    "failed_precondition",
    "internal",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_counts_everything() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut t = Text::default();
        t.histogram("x_seconds", "x", &h);
        assert!(t.0.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{}", t.0);
        assert!(t.0.contains("x_seconds_bucket{le=\"1\"} 3\n"), "{}", t.0);
        assert!(t.0.contains("x_seconds_bucket{le=\"+Inf\"} 4\n"), "{}", t.0);
        assert!(t.0.contains("x_seconds_count 4\n"), "{}", t.0);
        assert_eq!(h.count_sum().0, 4);
    }

    #[test]
    fn outcomes_count_by_label() {
        let o = Outcomes::new(GRPC_OUTCOMES);
        o.inc("ok");
        o.inc(outcome_of(tonic::Code::ResourceExhausted));
        o.inc("weird");
        assert_eq!(o.get("ok"), 1);
        assert_eq!(o.get("resource_exhausted"), 1);
        assert_eq!(o.get("internal"), 1);
    }
}
