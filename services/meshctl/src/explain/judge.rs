//! Normal or not: a request's steps against the worker's own normal, from
//! the totals the worker put on `decode_loop` and `prefill_forward`
//! (`pdmesh_worker::steps`): wall time against what steps of the same
//! shapes normally take there, and CPU time against time spent waiting
//! for a CPU.

use crate::trace::Span;
use pdmesh_core::vocab::steps::{SLOW_FACTOR, STARVED_SHARE};
use pdmesh_core::vocab::{attr, kernel};

/// Run-queue time below this is noise, whatever its share.
const MIN_RUNQ_MS: f64 = 20.0;
/// Where no normal is known yet, steps count as abnormal only when their
/// threads waited for a CPU at least this share of their runnable time,
/// and this long.
const STARVED_UNJUDGED_SHARE: f64 = 0.5;
const STARVED_UNJUDGED_MS: f64 = 100.0;
/// Steps are slow only when they also took at least this much longer than
/// their normal: a short request's steps a few ms slower cost nothing worth
/// naming (a process that just woke up, a neighbour's burst).
const MIN_EXCESS_MS: f64 = 100.0;

#[derive(Debug, Clone)]
pub struct Judgment {
    pub steps: i64,
    pub wall_ms: f64,
    pub cpu_ms: f64,
    pub runq_ms: f64,
    pub judged_ms: f64,
    pub normal_ms: f64,
    pub with_prefill: i64,
    pub batch_mean: Option<f64>,
    pub batch_usual: f64,
    /// `knob.*` values on kernel spans under this request's steps.
    pub knobs: Vec<String>,
}

impl Judgment {
    /// The totals on `s` (None for a worker that records none).
    pub fn of(s: &Span, knobs: Vec<String>) -> Option<Judgment> {
        let f = |k: &str| s.attr_f64(k).unwrap_or(0.0);
        let steps = s.attr_f64(attr::STEPS_WALL_MS).map(|_| f(attr::DECODE_STEPS).max(f(attr::PREFILL_STEPS)))?;
        Some(Judgment {
            steps: steps as i64,
            wall_ms: f(attr::STEPS_WALL_MS),
            cpu_ms: f(attr::STEPS_CPU_MS),
            runq_ms: f(attr::STEPS_RUNQ_MS),
            judged_ms: f(attr::STEPS_JUDGED_MS),
            normal_ms: f(attr::STEPS_NORMAL_MS),
            with_prefill: f(attr::STEPS_WITH_PREFILL) as i64,
            batch_mean: s.attr_f64(attr::DECODE_BATCH_MEAN),
            batch_usual: f(attr::STEPS_BATCH_USUAL),
            knobs,
        })
    }

    /// Wall over normal, for the steps that had a normal.
    pub fn factor(&self) -> Option<f64> {
        (self.judged_ms > 0.0 && self.normal_ms > 0.0).then(|| self.judged_ms / self.normal_ms)
    }

    /// The share of the threads' runnable time spent waiting for a CPU.
    pub fn wait_share(&self) -> f64 {
        let runnable = self.cpu_ms + self.runq_ms;
        if runnable > 0.0 {
            self.runq_ms / runnable
        } else {
            0.0
        }
    }

    pub fn slow(&self) -> bool {
        self.judged_ms - self.normal_ms >= MIN_EXCESS_MS && self.factor().is_some_and(|f| f >= SLOW_FACTOR)
    }

    pub fn starved(&self) -> bool {
        self.runq_ms >= MIN_RUNQ_MS && self.wait_share() >= STARVED_SHARE
    }

    /// Slow against the worker's normal; or, where none is known yet,
    /// starved for most of the steps' time.
    pub fn abnormal(&self) -> bool {
        self.slow()
            || (self.factor().is_none()
                && self.runq_ms >= STARVED_UNJUDGED_MS
                && self.wait_share() >= STARVED_UNJUDGED_SHARE)
    }

    fn bigger_batch(&self) -> bool {
        self.batch_mean.is_some_and(|b| b >= 2.0 && b > 1.5 * self.batch_usual.max(1.0))
    }

    /// The verdict alone, for a short sentence: "within normal",
    /// "2.3x decode-0's normal, CPU starved", or "not judged".
    pub fn verdict(&self, worker: &str) -> String {
        let starved = if self.starved() { ", CPU starved" } else { "" };
        match self.factor() {
            Some(_) if !self.abnormal() => "within normal".to_string(),
            Some(f) => format!("{f:.1}x {worker}'s normal{starved}"),
            None if self.abnormal() => format!("no normal known yet{starved}"),
            None => "not judged".to_string(),
        }
    }

    /// The verdict and, when abnormal, why in a few words: "178.8x
    /// prefill-0's normal, CPU starved (waited for a CPU 95% of its
    /// runnable time)".
    pub fn brief(&self, worker: &str) -> String {
        let mut out = self.verdict(worker);
        if self.starved() {
            out += &format!(" (waited for a CPU {:.0}% of its runnable time)", 100.0 * self.wait_share());
        } else if self.abnormal() && self.with_prefill > 0 {
            out += &format!(" ({} steps also fed local prefill)", self.with_prefill);
        } else if self.abnormal() && self.bigger_batch() {
            out += &format!(" (batch mean {:.1}, usually {:.1})", self.batch_mean.unwrap_or(0.0), self.batch_usual);
        }
        out
    }

    /// One sentence on these steps, naming the attributes it reads.
    pub fn words(&self, worker: &str, span_name: &str) -> String {
        let mut out = match self.factor() {
            Some(f) => format!(
                "its steps took {f:.1}x {worker}'s normal for their shapes ({span_name} steps.judged_ms {:.0} against steps.normal_ms {:.0})",
                self.judged_ms,
                self.normal_ms
            ),
            None => format!("no normal was known yet on {worker} for these step shapes ({span_name} steps.judged_ms 0)"),
        };
        if !self.abnormal() {
            out += if self.factor().is_some() { ": within normal" } else { ": not judged" };
            return out;
        }
        let mut why = Vec::new();
        if self.starved() {
            why.push(format!(
                "CPU starved: the step threads waited for a CPU {:.0}% of their runnable time (steps.runq_ms {:.0}, steps.cpu_ms {:.0}), so the host's CPUs are oversubscribed",
                100.0 * self.wait_share(),
                self.runq_ms,
                self.cpu_ms
            ));
        }
        if self.with_prefill > 0 {
            why.push(format!(
                "prefill beside decode: {} of its steps also fed local prefill tokens (steps.with_prefill)",
                self.with_prefill
            ));
        }
        if self.bigger_batch() {
            why.push(format!(
                "a batch larger than usual: mean {:.1} against this worker's usual {:.1} (decode.batch_mean, steps.batch_usual)",
                self.batch_mean.unwrap_or(0.0),
                self.batch_usual
            ));
        }
        if why.is_empty() {
            why.push(format!(
                "with no CPU wait, no prefill beside it and a usual batch, the trace cannot tell why: it would need kernel spans (--trace-kernel-steps) or the host's own counters{}",
                if self.knobs.is_empty() { String::new() } else { format!("; kernel knobs seen: {}", self.knobs.join(", ")) }
            ));
        }
        format!("{out}; {}", why.join("; "))
    }
}

/// What the GPU kernel spans of `service` in `spans` say of their device
/// time (`kernel.device_ms`): the total, the launches, and the kernel that
/// took most of it. None where no launch carried device time (the CPU's
/// kernel spans carry wall time only).
pub fn device_time(spans: &[&Span], service: &str) -> Option<String> {
    let mut by_kernel: std::collections::BTreeMap<&str, f64> = Default::default();
    let mut launches = 0;
    for (s, ms) in
        spans.iter().filter(|s| s.service == service).filter_map(|s| Some((s, s.attr_f64(kernel::DEVICE_MS)?)))
    {
        *by_kernel.entry(s.name.as_str()).or_default() += ms;
        launches += 1;
    }
    let total: f64 = by_kernel.values().sum();
    let (top, top_ms) = by_kernel.iter().max_by(|a, b| a.1.total_cmp(b.1))?;
    Some(format!(
        "GPU kernels ran {total:.1} ms of device time in {launches} traced launches, most in {top} ({top_ms:.1} ms; kernel.device_ms)"
    ))
}

/// `knob.*` values on the kernel spans in `spans`, deduplicated.
pub fn knobs(spans: &[&Span]) -> Vec<String> {
    let mut out: Vec<String> = spans
        .iter()
        .flat_map(|s| s.attrs.iter().filter(|(k, _)| k.starts_with("knob.")).map(|(k, v)| format!("{k}={v}")))
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn j(judged: f64, normal: f64, cpu: f64, runq: f64) -> Judgment {
        Judgment {
            steps: 10,
            wall_ms: judged,
            cpu_ms: cpu,
            runq_ms: runq,
            judged_ms: judged,
            normal_ms: normal,
            with_prefill: 0,
            batch_mean: Some(1.0),
            batch_usual: 1.0,
            knobs: vec![],
        }
    }

    #[test]
    fn gpu_kernel_device_time_is_charged_to_its_workers_steps() {
        use crate::trace::testing::span;
        use serde_json::json;
        let k = |id: &str, name: &str, service: &str, ms: Option<f64>| {
            let mut attrs = vec![(kernel::BACKEND, json!("cuda"))];
            attrs.extend(ms.map(|m| (kernel::DEVICE_MS, json!(m))));
            span(id, "00000000000000aa", name, service, "internal", 0, 1, &attrs)
        };
        let spans = [
            k("01", "matmul_gate", "pdmesh-decode", Some(0.25)),
            k("02", "matmul_gate", "pdmesh-decode", Some(0.25)),
            k("03", "attention", "pdmesh-decode", Some(0.125)),
            k("04", "matmul_q", "pdmesh-prefill", Some(2.0)),
        ];
        let all: Vec<&Span> = spans.iter().collect();
        let d = device_time(&all, "pdmesh-decode").unwrap();
        assert_eq!(d, "GPU kernels ran 0.6 ms of device time in 3 traced launches, most in matmul_gate (0.5 ms; kernel.device_ms)");
        assert!(device_time(&all, "pdmesh-prefill").unwrap().contains("1 traced launches, most in matmul_q (2.0 ms"));
        // CPU kernel spans carry no device time: nothing to charge.
        let cpu = [k("05", "matmul_q", "pdmesh-decode", None)];
        assert_eq!(device_time(&cpu.iter().collect::<Vec<_>>(), "pdmesh-decode"), None);
    }

    #[test]
    fn slow_and_starved_are_told_apart() {
        let normal = j(130.0, 120.0, 250.0, 3.0);
        assert!(!normal.abnormal(), "{}", normal.words("decode-0", "decode_loop"));
        let a_little_cpu_wait = j(67.0, 49.0, 77.0, 21.0);
        assert!(a_little_cpu_wait.starved() && !a_little_cpu_wait.abnormal(), "1.4x is within normal");
        let twice_but_brief = j(92.0, 46.0, 114.0, 47.0);
        assert!(!twice_but_brief.abnormal(), "2x, but 46 ms in all, is not worth naming");
        assert!(normal.words("decode-0", "decode_loop").contains("within normal"));
        let starved = j(4500.0, 120.0, 1000.0, 3500.0);
        assert!(starved.slow() && starved.starved());
        let w = starved.words("decode-0", "decode_loop");
        assert!(w.contains("took 37.5x") && w.contains("CPU starved") && w.contains("78%"), "{w}");
        let unexplained = j(600.0, 120.0, 1200.0, 0.0);
        assert!(unexplained.slow() && !unexplained.starved());
        assert!(unexplained.words("decode-0", "decode_loop").contains("cannot tell why"));
    }
}
