//! The prefill loop: one OS thread owns the engine; queued prompts are run
//! together in batched steps (up to `max_batch` sequences and
//! `batch_tokens` prompt tokens) and each gets its first token sampled.
//! Its blocks stay pinned until the caller has moved the KV (NIXL reads
//! them in place; TCP asks for a copy) and releases them — a [`Pinned`]
//! guard does that however the caller ends. Jobs whose caller went away
//! while queued are skipped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::MutexGuard;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pdmesh_core::metrics::{Histogram, Outcome, Outcomes};
use pdmesh_core::vocab::{attr, span};
use pdmesh_engine::blocks::PrefixCounters;
use pdmesh_engine::model::StepOptions;
use pdmesh_engine::{Engine, EngineError, KvBlob, SamplingParams, SeqId, TokenEvent};
use pdmesh_prefix::{BlockHash, CacheLog};
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
    /// Prompt positions whose KV came from the prefix cache.
    pub cached_tokens: usize,
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
    /// Prompt tokens queued, not yet in a step.
    pub queued_tokens: AtomicU64,
    /// Bytes of one KV block.
    pub block_bytes: usize,
    /// The prefix cache as the loop last published it.
    pub prefix: Mutex<PrefixView>,
}

/// The prefix cache seen from outside the loop: its counters, its block
/// states, and the log of what it holds that routers follow.
pub struct PrefixView {
    /// `(seed, block_size)` of the chained hashes; None: no prefix cache.
    pub hashing: Option<(BlockHash, usize)>,
    pub counters: PrefixCounters,
    /// Cached blocks, held or not.
    pub cached: usize,
    /// Cached blocks no sequence holds (evictable).
    pub evictable: usize,
    /// Blocks on the free list.
    pub free: usize,
    pub log: CacheLog,
}

impl Stats {
    pub fn prefix(&self) -> MutexGuard<'_, PrefixView> {
        self.prefix.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Events a router may lag behind before it must reload the whole set.
const CACHE_LOG_KEEP: usize = 16_384;

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
            outcomes: Outcomes::default(),
            queued_tokens: AtomicU64::new(0),
            block_bytes: engine.kv.layout.block_bytes(),
            prefix: Mutex::new(PrefixView {
                hashing: engine.kv.blocks.hashing(),
                counters: PrefixCounters::default(),
                cached: 0,
                evictable: 0,
                free: engine.kv.total(),
                log: CacheLog::new(pdmesh_prefix::fresh_epoch(), CACHE_LOG_KEEP),
            }),
        });
        let q = Arc::new(Queue { state: Mutex::new(State::default()), wake: Condvar::new() });
        let (q2, s2) = (q.clone(), stats.clone());
        std::thread::Builder::new()
            .name("prefill-loop".into())
            .spawn(move || {
                run(Loop {
                    engine,
                    q: q2,
                    stats: s2,
                    max_batch: max_batch.max(1),
                    batch_tokens: batch_tokens.max(1),
                    kernel_spans,
                    pinned: Default::default(),
                })
            })
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
            self.stats.queued_tokens.fetch_add(prompt.len() as u64, Ordering::Relaxed);
            g.jobs.push_back(Job { prompt, params, reply, span, queued, enqueued: Instant::now() });
            self.stats.queued.store(g.jobs.len() as u32, Ordering::Relaxed);
        }
        self.q.wake.notify_one();
        rx.await.map_err(|_| EngineError::Unavailable("the prefill loop has stopped".into()))?
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
        rx.await.map_err(|_| EngineError::Unavailable("the prefill loop has stopped".into()))?
    }
}

#[tonic::async_trait]
impl pdmesh_worker::kv::send::KvSource for Pinned {
    fn blocks(&self) -> &[u32] {
        &self.p.blocks
    }

    async fn export_kv(&self) -> Result<KvBlob, tonic::Status> {
        self.export().await.map_err(|e| pdmesh_worker::status(&e))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.q.command(Cmd::Release { seq: self.p.seq });
    }
}

/// Whether the next queued prompt (of `next` tokens) joins a batch that
/// already has `taken` prompts and `tokens` tokens. The first one always
/// goes, however long; the rest fill up to both budgets.
fn joins(taken: usize, tokens: usize, next: usize, max_batch: usize, batch_tokens: usize) -> bool {
    taken == 0 || (taken < max_batch && tokens + next <= batch_tokens)
}

/// The prefill loop's own state: the engine, the queue it serves and the
/// blocks pinned for transfers.
struct Loop {
    engine: Engine,
    q: Arc<Queue>,
    stats: Arc<Stats>,
    max_batch: usize,
    batch_tokens: usize,
    kernel_spans: KernelSpans,
    pinned: std::collections::HashMap<SeqId, u32>,
}

fn run(mut l: Loop) {
    while let Some((batch, cmds)) = l.next() {
        l.apply(cmds);
        if !batch.is_empty() {
            l.step(batch);
        }
    }
}

impl Loop {
    /// Wait for work; take the next batch and the pending commands. None once stopped.
    fn next(&mut self) -> Option<(Vec<Job>, Vec<Cmd>)> {
        let (q, stats) = (&self.q, &self.stats);
        let mut batch: Vec<Job> = Vec::new();
        let mut g = q.state.lock().unwrap_or_else(|e| e.into_inner());
        while g.jobs.is_empty() && g.cmds.is_empty() && !g.stop {
            g = q.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.stop {
            return None;
        }
        // Test-only fault: keep each prompt queued at least this long.
        let hold = Duration::from_millis(pdmesh_core::faults::get("prefill.queue_hold_ms"));
        let mut tokens = 0;
        while let Some(j) = g.jobs.front() {
            if j.reply.is_closed() {
                g.jobs.pop_front();
                stats.outcomes.inc(Outcome::Cancelled);
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
            if !joins(batch.len(), tokens, j.prompt.len(), self.max_batch, self.batch_tokens) {
                break;
            }
            tokens += j.prompt.len();
            batch.push(g.jobs.pop_front().expect("front exists"));
        }
        stats.queued.store(g.jobs.len() as u32, Ordering::Relaxed);
        stats.queued_tokens.store(g.jobs.iter().map(|j| j.prompt.len() as u64).sum(), Ordering::Relaxed);
        Some((batch, std::mem::take(&mut g.cmds)))
    }

    fn apply(&mut self, cmds: Vec<Cmd>) {
        for c in cmds {
            match c {
                Cmd::Export { seq, reply } => {
                    let _ = reply.send(self.engine.export_kv(seq));
                }
                Cmd::Release { seq } => {
                    if self.engine.release(seq).is_ok() {
                        self.pinned.remove(&seq);
                    }
                }
            }
        }
        self.publish();
    }

    fn publish(&mut self) {
        self.stats.kv_pinned.store(self.pinned.values().sum(), Ordering::Relaxed);
        self.stats.kv_used.store(self.engine.kv.used() as u32, Ordering::Relaxed);
        let blocks = &mut self.engine.kv.blocks;
        let events = blocks.take_events();
        let mut p = self.stats.prefix();
        p.log.apply(events);
        p.counters = blocks.counters();
        p.cached = blocks.cached();
        p.evictable = blocks.evictable();
        p.free = blocks.available() - blocks.evictable();
    }

    /// One batched prompt forward: admit, run, deliver each first token.
    fn step(&mut self, mut batch: Vec<Job>) {
        self.stats.running.store(batch.len() as u32, Ordering::Relaxed);
        let n_batch = batch.len();
        let batch_tokens: usize = batch.iter().map(|j| j.prompt.len()).sum();
        let forwards: Vec<tracing::Span> = batch
            .iter_mut()
            .map(|job| {
                job.queued = tracing::Span::none(); // ends the `queued` span
                tracing::info_span!(parent: &job.span, span::PREFILL_FORWARD, { attr::BATCH_SIZE } = n_batch as i64,
                    { attr::BATCH_TOKENS } = batch_tokens as i64, { attr::PROMPT_TOKENS } = job.prompt.len() as i64,
                    { attr::PREFILL_CACHED_TOKENS } = tracing::field::Empty,
                    { attr::PREFILL_COMPUTED_TOKENS } = tracing::field::Empty)
            })
            .collect();
        let admitted = self.admit(batch, &forwards);
        if !admitted.is_empty() {
            let ids: Vec<SeqId> = admitted.iter().map(|(id, _)| *id).collect();
            let step = pdmesh_worker::step_span(span::PREFILL_STEP, forwards.iter(), n_batch);
            let trace_id = pdmesh_core::telemetry::trace_id(&step);
            let t = Instant::now();
            let result = {
                let _in = step.enter();
                let kernel_spans = !step.is_disabled() && self.kernel_spans.covers(1);
                self.engine.prefill_with(&ids, StepOptions { kernel_spans })
            };
            drop(step);
            self.stats.step_seconds.observe_traced(t.elapsed().as_secs_f64(), trace_id.as_deref());
            self.stats.steps.fetch_add(1, Ordering::Relaxed);
            self.deliver(admitted, result);
        }
        drop(forwards);
        self.stats.running.store(0, Ordering::Relaxed);
        self.publish();
    }

    /// Add each prompt to the engine (only the prompt: the decode worker
    /// holds the rest); a prompt that cannot be added is answered at once.
    fn admit(&mut self, batch: Vec<Job>, forwards: &[tracing::Span]) -> Vec<(SeqId, Job)> {
        let mut admitted = Vec::new();
        for (job, forward) in batch.into_iter().zip(forwards) {
            let params = SamplingParams { max_tokens: 1, ..job.params.clone() };
            match self.engine.add_sequence(job.prompt.clone(), params) {
                Ok(id) => {
                    let cached = self.engine.reused_tokens(id).unwrap_or(0);
                    forward.record(attr::PREFILL_CACHED_TOKENS, cached as i64);
                    forward.record(attr::PREFILL_COMPUTED_TOKENS, (job.prompt.len() - cached) as i64);
                    admitted.push((id, job));
                }
                Err(e) => {
                    let _ = job.reply.send(Err(e));
                }
            }
        }
        self.stats.kv_used.store(self.engine.kv.used() as u32, Ordering::Relaxed);
        admitted
    }

    /// Answer each admitted prompt: its first token and pinned blocks, or the error.
    fn deliver(&mut self, admitted: Vec<(SeqId, Job)>, result: Result<Vec<TokenEvent>, EngineError>) {
        let events = match result {
            Ok(ev) => ev,
            Err(e) => {
                for (id, job) in admitted {
                    let _ = self.engine.release(id);
                    let _ = job.reply.send(Err(EngineError::StepFailed(format!("prefill: {e}"))));
                }
                return;
            }
        };
        for (id, job) in admitted {
            let computed = job.prompt.len() - self.engine.reused_tokens(id).unwrap_or(0);
            self.stats.prompt_tokens.fetch_add(computed as u64, Ordering::Relaxed);
            let n_tokens = job.prompt.len();
            let engine = &self.engine;
            let blocks = engine.blocks(id).map(|b| b[..engine.kv.layout.blocks_for(n_tokens)].to_vec());
            let cached_tokens = engine.reused_tokens(id).unwrap_or(0);
            let r = match (events.iter().find(|e| e.seq == id), blocks) {
                (Some(ev), Ok(blocks)) => {
                    Ok(Prefilled { first_token: ev.token, seq: id, blocks, n_tokens, cached_tokens })
                }
                (None, _) => Err(EngineError::InvalidArgument("prefill produced no token".into())),
                (_, Err(e)) => Err(e),
            };
            match r {
                Ok(p) => {
                    self.pinned.insert(id, engine.blocks(id).map(|b| b.len() as u32).unwrap_or(0));
                    // Undelivered, the guard is dropped and queues its own release.
                    let _ = job.reply.send(Ok(Pinned { q: self.q.clone(), p }));
                }
                Err(e) => {
                    let _ = self.engine.release(id);
                    let _ = job.reply.send(Err(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::joins;

    #[test]
    fn the_first_prompt_always_goes_however_long() {
        assert!(joins(0, 0, 100_000, 32, 2048));
    }

    #[test]
    fn later_prompts_fill_up_to_both_budgets() {
        assert!(joins(1, 1000, 1048, 32, 2048));
        assert!(!joins(1, 1000, 1049, 32, 2048), "token budget");
        assert!(!joins(32, 32, 1, 32, 2048), "batch size");
        assert!(joins(31, 31, 1, 32, 2048));
    }
}
