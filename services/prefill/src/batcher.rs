//! The prefill loop: one OS thread owns the engine; queued prompts are run
//! together in batched steps (up to `max_batch` sequences and
//! `batch_tokens` prompt tokens) and each gets its first token sampled.
//! Its blocks stay pinned until the caller has moved the KV (NIXL reads
//! them in place; TCP asks for a copy) and releases them — a [`Pinned`]
//! guard does that however the caller ends. Jobs whose caller went away
//! while queued are skipped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pdmesh_core::metrics::{Histogram, Outcomes, GRPC_OUTCOMES};
use pdmesh_core::vocab::{attr, span};
use pdmesh_engine::{Engine, EngineError, KvBlob, SamplingParams, SeqId};
use pdmesh_worker::KernelSpans;
use tokio::sync::oneshot;

pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub reply: oneshot::Sender<Result<Pinned, EngineError>>,
    /// The request's span (parent of `prefill_forward`).
    pub span: tracing::Span,
    /// `queued`: ends when the job is taken into a step.
    pub queued: tracing::Span,
    pub enqueued: Instant,
}

/// A prefilled sequence whose blocks are pinned in this worker's arena.
#[derive(Debug)]
pub struct Prefilled {
    pub first_token: u32,
    pub seq: SeqId,
    /// Blocks holding the prompt's positions, in order.
    pub blocks: Vec<u32>,
    pub n_tokens: usize,
}

enum Cmd {
    Export { seq: SeqId, reply: oneshot::Sender<Result<KvBlob, EngineError>> },
    Release { seq: SeqId },
}

pub struct Stats {
    pub running: AtomicU32,
    pub queued: AtomicU32,
    pub kv_used: AtomicU32,
    pub kv_total: AtomicU32,
    /// Blocks of prefilled sequences waiting for their transfer to end.
    pub kv_pinned: AtomicU32,
    pub steps: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub step_seconds: Histogram,
    pub transfer_seconds: Histogram,
    pub transfer_bytes: AtomicU64,
    pub transfers_nixl: AtomicU64,
    pub transfers_tcp: AtomicU64,
    pub outcomes: Outcomes,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    cmds: Vec<Cmd>,
    stop: bool,
}

struct Queue {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Clone)]
pub struct Batcher {
    q: Arc<Queue>,
    pub stats: Arc<Stats>,
    _stop: Arc<StopOnDrop>,
}

struct StopOnDrop(Arc<Queue>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        self.0.wake.notify_all();
    }
}

impl Batcher {
    pub fn start(engine: Engine, max_batch: usize, batch_tokens: usize, kernel_spans: KernelSpans) -> Batcher {
        let stats = Arc::new(Stats {
            running: AtomicU32::new(0),
            queued: AtomicU32::new(0),
            kv_used: AtomicU32::new(0),
            kv_total: AtomicU32::new(engine.kv.total() as u32),
            kv_pinned: AtomicU32::new(0),
            steps: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            step_seconds: Histogram::latency(),
            transfer_seconds: Histogram::latency(),
            transfer_bytes: AtomicU64::new(0),
            transfers_nixl: AtomicU64::new(0),
            transfers_tcp: AtomicU64::new(0),
            outcomes: Outcomes::new(GRPC_OUTCOMES),
        });
        let q = Arc::new(Queue { state: Mutex::new(State::default()), wake: Condvar::new() });
        let (q2, s2) = (q.clone(), stats.clone());
        std::thread::Builder::new()
            .name("prefill-loop".into())
            .spawn(move || run(engine, q2, s2, max_batch.max(1), batch_tokens.max(1), kernel_spans))
            .expect("spawn prefill loop");
        Batcher { _stop: Arc::new(StopOnDrop(q.clone())), q, stats }
    }

    /// Queue a prompt; resolves with its first token and pinned blocks.
    /// The returned guard releases the blocks when dropped. Spans: `queued`
    /// (with the queue depth and running count on arrival) and
    /// `prefill_forward`, children of the current span.
    pub async fn prefill(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Pinned, EngineError> {
        let (reply, rx) = oneshot::channel();
        {
            let mut g = self.q.state.lock().unwrap_or_else(|e| e.into_inner());
            let span = tracing::Span::current();
            let queued = tracing::info_span!(
                span::QUEUED,
                { attr::PREFILL_QUEUE_DEPTH } = g.jobs.len() as i64,
                { attr::PREFILL_RUNNING } = self.stats.running.load(Ordering::Relaxed) as i64,
                { attr::PROMPT_TOKENS } = prompt.len() as i64,
                { attr::QUEUE_HELD_MS } = tracing::field::Empty,
            );
            g.jobs.push_back(Job { prompt, params, reply, span, queued, enqueued: Instant::now() });
            self.stats.queued.store(g.jobs.len() as u32, Ordering::Relaxed);
        }
        self.q.wake.notify_one();
        rx.await.map_err(|_| EngineError::InvalidArgument("prefill loop has stopped".into()))?
    }
}

impl Queue {
    fn command(&self, c: Cmd) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).cmds.push(c);
        self.wake.notify_one();
    }
}

/// Pinned blocks of one prefilled sequence; dropping it frees them (also
/// when it is dropped undelivered, its caller gone).
pub struct Pinned {
    q: Arc<Queue>,
    pub p: Prefilled,
}

impl Pinned {
    /// A copy of the prompt's KV (for the TCP transport).
    pub async fn export(&self) -> Result<KvBlob, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.q.command(Cmd::Export { seq: self.p.seq, reply });
        rx.await.map_err(|_| EngineError::InvalidArgument("prefill loop has stopped".into()))?
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.q.command(Cmd::Release { seq: self.p.seq });
    }
}

fn run(
    mut engine: Engine,
    q: Arc<Queue>,
    stats: Arc<Stats>,
    max_batch: usize,
    batch_tokens: usize,
    kernel_spans: KernelSpans,
) {
    let mut pinned: std::collections::HashMap<SeqId, u32> = Default::default();
    loop {
        let mut batch: Vec<Job> = Vec::new();
        let cmds = {
            let mut g = q.state.lock().unwrap_or_else(|e| e.into_inner());
            while g.jobs.is_empty() && g.cmds.is_empty() && !g.stop {
                g = q.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            if g.stop {
                return;
            }
            // Test-only fault: keep each prompt queued at least this long.
            let hold = Duration::from_millis(pdmesh_core::faults::get("prefill.queue_hold_ms"));
            let mut tokens = 0;
            while let Some(j) = g.jobs.front() {
                if j.reply.is_closed() {
                    g.jobs.pop_front();
                    stats.outcomes.inc("cancelled");
                    continue;
                }
                let waited = j.enqueued.elapsed();
                if waited < hold {
                    if batch.is_empty() && g.cmds.is_empty() {
                        let (g2, _) = q.wake.wait_timeout(g, hold - waited).unwrap_or_else(|e| e.into_inner());
                        g = g2;
                        continue;
                    }
                    break;
                }
                if !hold.is_zero() {
                    j.queued.record(attr::QUEUE_HELD_MS, hold.as_millis() as i64);
                }
                // Always take one, however long; then fill up to the budgets.
                if !batch.is_empty() && (batch.len() >= max_batch || tokens + j.prompt.len() > batch_tokens) {
                    break;
                }
                tokens += j.prompt.len();
                batch.push(g.jobs.pop_front().expect("front exists"));
            }
            stats.queued.store(g.jobs.len() as u32, Ordering::Relaxed);
            std::mem::take(&mut g.cmds)
        };
        for c in cmds {
            match c {
                Cmd::Export { seq, reply } => {
                    let _ = reply.send(engine.export_kv(seq));
                }
                Cmd::Release { seq } => {
                    if engine.release(seq).is_ok() {
                        pinned.remove(&seq);
                    }
                }
            }
        }
        stats.kv_pinned.store(pinned.values().sum(), Ordering::Relaxed);
        stats.kv_used.store(engine.kv.used() as u32, Ordering::Relaxed);
        if batch.is_empty() {
            continue;
        }
        stats.running.store(batch.len() as u32, Ordering::Relaxed);
        let mut ids = Vec::new();
        let mut admitted = Vec::new();
        let n_batch = batch.len();
        let batch_tokens: usize = batch.iter().map(|j| j.prompt.len()).sum();
        let forwards: Vec<tracing::Span> = batch
            .iter_mut()
            .map(|job| {
                job.queued = tracing::Span::none(); // ends the `queued` span
                tracing::info_span!(parent: &job.span, span::PREFILL_FORWARD, { attr::BATCH_SIZE } = n_batch as i64, { attr::BATCH_TOKENS } = batch_tokens as i64, { attr::PROMPT_TOKENS } = job.prompt.len() as i64)
            })
            .collect();
        for job in batch {
            // Only the prompt is run here; the decode worker holds the rest.
            let params = SamplingParams { max_tokens: 1, ..job.params.clone() };
            match engine.add_sequence(job.prompt.clone(), params) {
                Ok(id) => {
                    ids.push(id);
                    admitted.push((id, job));
                }
                Err(e) => {
                    let _ = job.reply.send(Err(e));
                }
            }
        }
        stats.kv_used.store(engine.kv.used() as u32, Ordering::Relaxed);
        if !ids.is_empty() {
            let step = pdmesh_worker::step_span(span::PREFILL_STEP, forwards.iter(), n_batch);
            let t = Instant::now();
            let result = {
                let _in = step.enter();
                pdmesh_engine::model::set_kernel_spans(!step.is_disabled() && kernel_spans.covers(1));
                let r = engine.prefill(&ids);
                pdmesh_engine::model::set_kernel_spans(false);
                r
            };
            drop(step);
            stats.step_seconds.observe(t.elapsed().as_secs_f64());
            stats.steps.fetch_add(1, Ordering::Relaxed);
            let events = match result {
                Ok(ev) => ev,
                Err(e) => {
                    for (id, job) in admitted.drain(..) {
                        let _ = engine.release(id);
                        let _ = job.reply.send(Err(EngineError::InvalidArgument(format!("prefill step failed: {e}"))));
                    }
                    Vec::new()
                }
            };
            for (id, job) in admitted {
                stats.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
                let n_tokens = job.prompt.len();
                let blocks = engine.blocks(id).map(|b| b[..engine.kv.layout.blocks_for(n_tokens)].to_vec());
                let r = match (events.iter().find(|e| e.seq == id), blocks) {
                    (Some(ev), Ok(blocks)) => Ok(Prefilled { first_token: ev.token, seq: id, blocks, n_tokens }),
                    (None, _) => Err(EngineError::InvalidArgument("prefill produced no token".into())),
                    (_, Err(e)) => Err(e),
                };
                match r {
                    Ok(p) => {
                        pinned.insert(id, engine.blocks(id).map(|b| b.len() as u32).unwrap_or(0));
                        // Undelivered, the guard is dropped and queues its own release.
                        let _ = job.reply.send(Ok(Pinned { q: q.clone(), p }));
                    }
                    Err(e) => {
                        let _ = engine.release(id);
                        let _ = job.reply.send(Err(e));
                    }
                }
            }
        }
        drop(forwards);
        stats.running.store(0, Ordering::Relaxed);
        stats.kv_pinned.store(pinned.values().sum(), Ordering::Relaxed);
        stats.kv_used.store(engine.kv.used() as u32, Ordering::Relaxed);
    }
}
