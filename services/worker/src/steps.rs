//! What a worker's steps cost, against what is normal for this worker.
//!
//! Each step is timed on the wall clock and, from the scheduler's own
//! per-thread accounting (`/proc/self/task/<tid>/schedstat`: nanoseconds on
//! a CPU, nanoseconds runnable but waiting for one), for the threads that
//! run it: the loop thread and the compute pool. A step whose threads spent
//! a large part of their runnable time waiting for a CPU was starved: the
//! host's CPUs are oversubscribed. Every step that was not starved teaches
//! the worker what a step of its shape (batch size and tokens, in half
//! powers of two) normally takes, as a running average; each step is then
//! judged against that normal. `meshctl explain` reads the result from the
//! spans, `meshctl probe` from the counters in `/metrics`.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use pdmesh_core::metrics::Text;
use pdmesh_core::telemetry::SpanExt;
use pdmesh_core::vocab::attr;
use pdmesh_core::vocab::metric;

pub use pdmesh_core::vocab::steps::{SLOW_FACTOR, STARVED_SHARE};
/// Steps of one shape seen before its normal is trusted.
const WARM_STEPS: u32 = 4;
/// Weight of each new clean step in its shape's normal (a log-domain average).
const ALPHA: f64 = 0.1;

/// One step, measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct Step {
    pub wall_ms: f64,
    pub cpu_ms: f64,
    pub runq_ms: f64,
    /// What a step of this shape normally takes here; None until known.
    pub normal_ms: Option<f64>,
    pub threads: usize,
}

impl Step {
    pub fn starved(&self) -> bool {
        self.runq_ms > STARVED_SHARE * (self.cpu_ms + self.runq_ms)
    }

    pub fn slowdown(&self) -> Option<f64> {
        self.normal_ms.map(|n| self.wall_ms / n.max(1e-3))
    }

    /// Put the measurement on the step's span.
    pub fn record(&self, span: &tracing::Span) {
        if span.is_disabled() {
            return;
        }
        span.set_attribute(attr::STEP_CPU_MS, self.cpu_ms);
        span.set_attribute(attr::STEP_RUNQ_MS, self.runq_ms);
        span.set_attribute(attr::STEP_THREADS, self.threads as i64);
        if let (Some(n), Some(f)) = (self.normal_ms, self.slowdown()) {
            span.set_attribute(attr::STEP_NORMAL_MS, n);
            span.set_attribute(attr::STEP_SLOWDOWN, f);
        }
    }
}

/// The steps that served one request, added up.
#[derive(Debug, Clone, Copy, Default)]
pub struct Totals {
    pub steps: u32,
    pub wall_ms: f64,
    pub cpu_ms: f64,
    pub runq_ms: f64,
    pub judged_ms: f64,
    pub normal_ms: f64,
    pub slow: u32,
    pub starved: u32,
    pub threads: usize,
}

impl Totals {
    pub fn add(&mut self, s: &Step) {
        self.steps += 1;
        self.wall_ms += s.wall_ms;
        self.cpu_ms += s.cpu_ms;
        self.runq_ms += s.runq_ms;
        if let Some(n) = s.normal_ms {
            self.judged_ms += s.wall_ms;
            self.normal_ms += n;
            self.slow += u32::from(s.wall_ms >= SLOW_FACTOR * n);
        }
        self.starved += u32::from(s.starved());
        self.threads = self.threads.max(s.threads);
    }

    /// Put the totals on the request's span (`decode_loop`, `prefill_forward`),
    /// with the worker's usual batch size.
    pub fn record(&self, span: &tracing::Span, batch_usual: f64) {
        if span.is_disabled() || self.steps == 0 {
            return;
        }
        let r = |v: f64| (v * 1000.0).round() / 1000.0;
        span.set_attribute(attr::STEPS_WALL_MS, r(self.wall_ms));
        span.set_attribute(attr::STEPS_CPU_MS, r(self.cpu_ms));
        span.set_attribute(attr::STEPS_RUNQ_MS, r(self.runq_ms));
        span.set_attribute(attr::STEPS_JUDGED_MS, r(self.judged_ms));
        span.set_attribute(attr::STEPS_NORMAL_MS, r(self.normal_ms));
        span.set_attribute(attr::STEPS_SLOW, self.slow as i64);
        span.set_attribute(attr::STEPS_STARVED, self.starved as i64);
        span.set_attribute(attr::STEP_THREADS, self.threads as i64);
        span.set_attribute(attr::STEPS_BATCH_USUAL, r(batch_usual));
    }
}

/// A worker's step time against its normal, for `/metrics` (microseconds,
/// shown as seconds): a probe compares two readings.
#[derive(Debug, Default)]
pub struct Counters {
    wall_us: AtomicU64,
    judged_us: AtomicU64,
    normal_us: AtomicU64,
    cpu_us: AtomicU64,
    runq_us: AtomicU64,
    starved: AtomicU64,
    /// Recent steps' wall time, a running mean (the Load RPC reports it).
    recent_us: AtomicU64,
}

impl Counters {
    fn add(&self, s: &Step) {
        let us = |ms: f64| (ms * 1e3) as u64;
        self.wall_us.fetch_add(us(s.wall_ms), Ordering::Relaxed);
        self.cpu_us.fetch_add(us(s.cpu_ms), Ordering::Relaxed);
        self.runq_us.fetch_add(us(s.runq_ms), Ordering::Relaxed);
        if let Some(n) = s.normal_ms {
            self.judged_us.fetch_add(us(s.wall_ms), Ordering::Relaxed);
            self.normal_us.fetch_add(us(n), Ordering::Relaxed);
        }
        self.starved.fetch_add(u64::from(s.starved()), Ordering::Relaxed);
        // Only the loop's thread writes it: load and store is enough.
        let old = self.recent_us.load(Ordering::Relaxed) as f64;
        let new = if old == 0.0 { us(s.wall_ms) as f64 } else { 0.8 * old + 0.2 * us(s.wall_ms) as f64 };
        self.recent_us.store(new as u64, Ordering::Relaxed);
    }

    /// What a step takes here lately (a running mean of wall times), in ms.
    pub fn recent_ms(&self) -> u32 {
        (self.recent_us.load(Ordering::Relaxed) / 1000) as u32
    }

    /// The step-cost families, named for this worker's kind.
    pub fn render(&self, n: &metric::Worker, t: &mut Text) {
        let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e6;
        t.counter_f64(n.step_wall_seconds_total, "Wall time of all steps.", secs(&self.wall_us))
            .counter_f64(
                n.step_judged_seconds_total,
                "Wall time of the steps that had a normal to be judged against.",
                secs(&self.judged_us),
            )
            .counter_f64(
                n.step_normal_seconds_total,
                "What those steps would normally have taken on this worker (their shapes' running normals).",
                secs(&self.normal_us),
            )
            .counter_f64(n.step_cpu_seconds_total, "CPU time of the step threads during steps.", secs(&self.cpu_us))
            .counter_f64(
                n.step_runq_seconds_total,
                "Time the step threads were runnable but waiting for a CPU, during steps.",
                secs(&self.runq_us),
            )
            .counter(
                n.step_starved_total,
                "Steps whose threads waited for a CPU for a fifth or more of their runnable time.",
                self.starved.load(Ordering::Relaxed),
            );
    }
}

/// One thread's scheduler statistics file, kept open and read again per step.
struct SchedStat(File);

impl SchedStat {
    fn open(tid: u32) -> Option<SchedStat> {
        File::open(format!("/proc/self/task/{tid}/schedstat")).ok().map(SchedStat)
    }

    /// (ns on a CPU, ns waiting on a run queue).
    fn read(&self) -> Option<(u64, u64)> {
        let mut buf = [0u8; 96];
        let n = self.0.read_at(&mut buf, 0).ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let mut f = text.split_ascii_whitespace().map(|x| x.parse::<u64>().ok());
        Some((f.next()??, f.next()??))
    }
}

/// Where a step began.
pub struct Mark {
    t: Instant,
    cpu_ns: u64,
    runq_ns: u64,
}

/// A step's shape: half powers of two of its batch size and tokens.
type Shape = (u32, u32);

fn bucket(n: usize) -> u32 {
    (2.0 * (n.max(1) as f64).log2()).round() as u32
}

#[derive(Debug, Clone, Copy)]
struct Normal {
    seen: u32,
    /// ln of the normal step time in ms.
    ln_ms: f64,
}

/// Measures the steps of one worker loop (built on the loop's thread).
pub struct Meter {
    threads: Vec<SchedStat>,
    /// Told each step's CPU wait, so the pool stops spinning on a crowded host.
    pool: Option<pdmesh_engine::PoolShare>,
    normals: HashMap<Shape, Normal>,
    batch_usual: f64,
    counters: Arc<Counters>,
}

impl Meter {
    /// Watch the calling thread and the compute pool's `pool_threads`,
    /// adding every step to `counters`.
    pub fn new(pool_threads: &[u32], counters: Arc<Counters>) -> Meter {
        let me = pdmesh_engine::os_thread_id();
        let threads = me.iter().chain(pool_threads).filter_map(|t| SchedStat::open(*t)).collect();
        Meter { threads, pool: None, normals: HashMap::new(), batch_usual: 0.0, counters }
    }

    /// Tell `pool` each step's CPU wait (see [`pdmesh_engine::PoolShare::note_cpu_wait`]).
    pub fn backing_off(mut self, pool: pdmesh_engine::PoolShare) -> Meter {
        self.pool = Some(pool);
        self
    }

    fn read(&self) -> (u64, u64) {
        self.threads.iter().filter_map(SchedStat::read).fold((0, 0), |(c, r), (c2, r2)| (c + c2, r + r2))
    }

    pub fn start(&self) -> Mark {
        let (cpu_ns, runq_ns) = self.read();
        Mark { t: Instant::now(), cpu_ns, runq_ns }
    }

    /// The step begun at `m`, which ran `batch` sequences over `tokens`
    /// tokens, judged against its shape's normal; a step that was not
    /// starved then updates that normal.
    pub fn finish(&mut self, m: Mark, batch: usize, tokens: usize) -> Step {
        let wall_ms = m.t.elapsed().as_secs_f64() * 1e3;
        let (cpu_ns, runq_ns) = self.read();
        let ms = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1e6;
        let shape = (bucket(batch), bucket(tokens));
        let known = self.normals.get(&shape).filter(|n| n.seen >= WARM_STEPS).map(|n| n.ln_ms.exp());
        let step = Step {
            wall_ms,
            cpu_ms: ms(cpu_ns, m.cpu_ns),
            runq_ms: ms(runq_ns, m.runq_ns),
            normal_ms: known,
            threads: self.threads.len(),
        };
        if !step.starved() {
            self.learn(shape, wall_ms);
        }
        if let Some(p) = &self.pool {
            p.note_cpu_wait(step.runq_ms / (step.cpu_ms + step.runq_ms).max(1e-9));
        }
        self.batch_usual =
            if self.batch_usual == 0.0 { batch as f64 } else { 0.98 * self.batch_usual + 0.02 * batch as f64 };
        self.counters.add(&step);
        step
    }

    /// A clean step of `shape`: the first few set the normal to their
    /// fastest (a cold first step must not make slowness look normal), later
    /// ones move it by [`ALPHA`].
    fn learn(&mut self, shape: Shape, wall_ms: f64) {
        let ln = wall_ms.max(1e-3).ln();
        let n = self.normals.entry(shape).or_insert(Normal { seen: 0, ln_ms: ln });
        n.ln_ms = if n.seen < WARM_STEPS { n.ln_ms.min(ln) } else { (1.0 - ALPHA) * n.ln_ms + ALPHA * ln };
        n.seen += 1;
    }

    /// The worker's usual batch size (a running mean over recent steps).
    pub fn batch_usual(&self) -> f64 {
        self.batch_usual
    }
}

/// One span per engine step, child of the first request's span in the
/// batch and linked to every request's span (`requests`), so each request's
/// trace shows the steps it rode in and a step shows whom it served.
pub fn step_span<'a>(
    name: &'static str,
    requests: impl Iterator<Item = &'a tracing::Span>,
    batch: usize,
) -> tracing::Span {
    use pdmesh_core::telemetry::SpanExt;
    if !pdmesh_core::telemetry::enabled() {
        return tracing::Span::none();
    }
    let mut parent = None;
    let mut links = Vec::new();
    for r in requests {
        if parent.is_none() {
            parent = Some(r.clone());
        }
        if let Some(cx) = pdmesh_core::telemetry::span_context(r) {
            links.push(cx);
        }
    }
    let Some(parent) = parent else { return tracing::Span::none() };
    let span = tracing::info_span!(parent: &parent, "step", otel.name = name, { attr::BATCH_SIZE } = batch as i64);
    for cx in links {
        span.add_link(cx);
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_half_powers_of_two() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 0);
        assert_eq!(bucket(2), 2);
        assert_eq!(bucket(3), 3);
        assert_eq!(bucket(4), 4);
        assert_eq!(bucket(128), 14);
        assert_ne!(bucket(64), bucket(128));
    }

    #[test]
    fn a_normal_is_known_after_warm_steps_and_starved_steps_teach_nothing() {
        let mut m = Meter::new(&[], Arc::default());
        for _ in 0..WARM_STEPS {
            m.learn((0, 0), 10.0);
        }
        let n = m.normals[&(0, 0)];
        assert!((n.ln_ms.exp() - 10.0).abs() < 1e-9 && n.seen == WARM_STEPS);
        // A cold first step does not become the normal.
        let mut m = Meter::new(&[], Arc::default());
        for ms in [80.0, 10.0, 11.0, 10.5] {
            m.learn((0, 0), ms);
        }
        assert!((m.normals[&(0, 0)].ln_ms.exp() - 10.0).abs() < 1e-9);
        let starved = Step { wall_ms: 400.0, cpu_ms: 20.0, runq_ms: 380.0, normal_ms: Some(10.0), threads: 2 };
        assert!(starved.starved());
        assert!((starved.slowdown().unwrap() - 40.0).abs() < 1e-9);
        let mut t = Totals::default();
        t.add(&starved);
        t.add(&Step { wall_ms: 10.0, cpu_ms: 20.0, runq_ms: 0.0, normal_ms: None, threads: 2 });
        assert_eq!((t.steps, t.slow, t.starved), (2, 1, 1));
        assert!((t.judged_ms - 400.0).abs() < 1e-9 && (t.normal_ms - 10.0).abs() < 1e-9);
    }

    #[test]
    fn this_threads_scheduler_statistics_can_be_read() {
        let m = Meter::new(&[], Arc::default());
        assert_eq!(m.threads.len(), 1, "/proc/self/task/<tid>/schedstat (pdmesh runs on Linux)");
        let a = m.start();
        let t = Instant::now();
        while t.elapsed().as_millis() < 30 {
            std::hint::spin_loop();
        }
        let mut m = m;
        let s = m.finish(a, 1, 1);
        assert!(s.cpu_ms + s.runq_ms >= 20.0, "{s:?}: a 30 ms spin was neither on a CPU nor waiting for one");
        // What measuring costs a step (printed, not asserted: machines differ).
        let t = Instant::now();
        for _ in 0..1000 {
            let a = m.start();
            m.finish(a, 1, 1);
        }
        eprintln!(
            "one step's measurement (two reads of {} thread(s)): {:.1} us",
            m.threads.len(),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}
