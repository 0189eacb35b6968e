//! The prefill loop: one OS thread owns the engine. Queued prompts enter
//! it first come first served (up to `max_batch` at once) and are computed
//! in forward steps of at most `step_tokens` prompt tokens in all, so a
//! long prompt is spread over steps and no step runs for seconds. A prompt
//! that is all in gets its first token sampled and leaves at once; one
//! whose caller went away or whose deadline passed stops at the next step.
//! Its blocks stay pinned until the caller has moved the KV (NIXL reads
//! them in place; TCP asks for a copy) and releases them — a [`Pinned`]
//! guard does that however the caller ends. Jobs whose caller went away
//! while queued are skipped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pdmesh_core::metrics::{Histogram, Outcome, Outcomes};
use pdmesh_core::vocab::{attr, span};
use pdmesh_engine::model::StepOptions;
use pdmesh_engine::{Engine, EngineError, KvBlob, NextToken, SamplingParams, SeqId};
use pdmesh_worker::prefix::SharedPrefix;
use pdmesh_worker::steps::{self, Meter};
use pdmesh_worker::KernelSpans;
use tokio::sync::oneshot;

pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub reply: oneshot::Sender<Result<Pinned, EngineError>>,
    /// The request's span (parent of `prefill_forward`).
    pub span: tracing::Span,
    /// `queued`: ends when the job is taken into the engine.
    pub queued: tracing::Span,
    pub enqueued: Instant,
    /// When the caller gives up: not started if it cannot finish by then,
    /// and stopped between steps once it has passed.
    pub deadline: Option<Instant>,
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
    /// CRC-32C of each of `blocks`, taken as the prompt finished (the
    /// receiver checks them before its first decode step).
    pub checksums: Vec<u32>,
    /// What of `blocks` a transfer moves (sliding windows trim the oldest).
    pub shipped: pdmesh_engine::kv::Shipped,
}

enum Cmd {
    Export {
        seq: SeqId,
        reply: oneshot::Sender<Result<KvBlob, EngineError>>,
    },
    /// Fault injection: flip one byte of the prompt's last block (again: restore it).
    Flip {
        seq: SeqId,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Release {
        seq: SeqId,
    },
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
    /// From a prompt's arrival to its start in the engine.
    pub queue_wait_seconds: Histogram,
    pub transfer_bytes: AtomicU64,
    pub transfers_nixl: AtomicU64,
    pub transfers_tcp: AtomicU64,
    pub outcomes: Outcomes,
    /// Prompt tokens queued, not yet in a step.
    pub queued_tokens: AtomicU64,
    /// How long a prompt arriving now would wait for the prefill ahead of
    /// it (queued and unfinished prompt tokens at the measured speed), in ms.
    pub expected_wait_ms: AtomicU64,
    /// Bytes of one KV block.
    pub block_bytes: usize,
    /// The prefix cache as the loop last published it.
    pub prefix: SharedPrefix,
    /// Step time against this worker's normal.
    pub step_costs: Arc<steps::Counters>,
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
    /// Most prompts waiting; one more is refused (`Overloaded`).
    pub max_queue: usize,
    /// Whether the loop's thread still runs.
    pub alive: pdmesh_worker::LoopAlive,
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
    pub fn start(engine: Engine, max_batch: usize, step_tokens: usize, kernel_spans: KernelSpans) -> Batcher {
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
            queue_wait_seconds: Histogram::latency(),
            transfer_bytes: AtomicU64::new(0),
            transfers_nixl: AtomicU64::new(0),
            transfers_tcp: AtomicU64::new(0),
            outcomes: Outcomes::default(),
            queued_tokens: AtomicU64::new(0),
            expected_wait_ms: AtomicU64::new(0),
            block_bytes: engine.kv.layout.block_bytes(),
            prefix: SharedPrefix::new(&engine.kv.blocks),
            step_costs: Arc::default(),
        });
        let q = Arc::new(Queue { state: Mutex::new(State::default()), wake: Condvar::new() });
        let (q2, s2) = (q.clone(), stats.clone());
        let (alive, guard) = pdmesh_worker::LoopAlive::start(Some(engine.pool_share()));
        std::thread::Builder::new()
            .name("prefill-loop".into())
            .spawn(move || {
                run(Loop {
                    alive: guard,
                    meter: Meter::new(&engine.pool_thread_ids(), s2.step_costs.clone())
                        .backing_off(engine.pool_share()),
                    engine,
                    q: q2,
                    stats: s2,
                    max_batch: max_batch.max(1),
                    step_tokens: step_tokens.max(1),
                    kernel_spans,
                    pinned: Default::default(),
                    active: Vec::new(),
                    pace: Pace::default(),
                    lost: None,
                })
            })
            .expect("spawn prefill loop");
        Batcher { _stop: Arc::new(StopOnDrop(q.clone())), q, stats, max_queue: usize::MAX, alive }
    }

    /// Queue a prompt; resolves with its first token and pinned blocks.
    /// The returned guard releases the blocks when dropped. Spans: `queued`
    /// (with the queue depth and running count on arrival) and
    /// `prefill_forward`, children of the current span.
    pub async fn prefill(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        deadline: Option<Instant>,
    ) -> Result<Pinned, EngineError> {
        let (reply, rx) = oneshot::channel();
        {
            let mut g = self.q.state.lock().unwrap_or_else(|e| e.into_inner());
            if g.stop || !self.alive.is_alive() {
                return Err(EngineError::Unavailable("the prefill loop has stopped".into()));
            }
            if g.jobs.len() >= self.max_queue {
                return Err(EngineError::Overloaded(format!(
                    "{} prompts already wait for a prefill step, the limit",
                    g.jobs.len()
                )));
            }
            let span = tracing::Span::current();
            let queued = tracing::info_span!(
                span::QUEUED,
                { attr::PREFILL_QUEUE_DEPTH } = g.jobs.len() as i64,
                { attr::PREFILL_RUNNING } = self.stats.running.load(Ordering::Relaxed) as i64,
                { attr::PROMPT_TOKENS } = prompt.len() as i64,
                { attr::QUEUE_HELD_MS } = tracing::field::Empty,
            );
            self.stats.queued_tokens.fetch_add(prompt.len() as u64, Ordering::Relaxed);
            g.jobs.push_back(Job { prompt, params, reply, span, queued, enqueued: Instant::now(), deadline });
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

    /// Fault injection: flip one byte of the prompt's last block in the
    /// arena (a second call restores it).
    pub async fn flip(&self) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.q.command(Cmd::Flip { seq: self.p.seq, reply });
        rx.await.map_err(|_| EngineError::Unavailable("the prefill loop has stopped".into()))?
    }
}

#[tonic::async_trait]
impl pdmesh_worker::kv::send::KvSource for Pinned {
    fn blocks(&self) -> &[u32] {
        &self.p.blocks
    }

    fn checksums(&self) -> &[u32] {
        &self.p.checksums
    }

    fn shipped(&self) -> &pdmesh_engine::kv::Shipped {
        &self.p.shipped
    }

    async fn export_kv(&self) -> Result<KvBlob, tonic::Status> {
        self.export().await.map_err(|e| pdmesh_worker::status(&e))
    }

    async fn flip_byte(&self) -> Result<(), tonic::Status> {
        self.flip().await.map_err(|e| pdmesh_worker::status(&e))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.q.command(Cmd::Release { seq: self.p.seq });
    }
}

/// How many tokens each active prompt feeds in the next step (`pending[i]`:
/// tokens the i-th oldest prompt has left). The oldest prompt always gets
/// up to half the `budget`, so a long prompt keeps moving and none starves
/// (each in turn becomes the oldest); the rest goes to the prompts with the
/// fewest tokens left, so a short prompt behind a long one finishes in its
/// first step and each step hands out as many first tokens as it can.
/// A step never feeds more than
/// `budget` tokens (at least one).
pub fn plan_step(pending: &[usize], budget: usize) -> Vec<usize> {
    let mut take = vec![0; pending.len()];
    let Some(first) = pending.first() else { return take };
    let mut left = budget.max(1);
    take[0] = (*first).min(left.div_ceil(2));
    left -= take[0];
    let mut shortest: Vec<usize> = (0..pending.len()).collect();
    shortest.sort_by_key(|&i| (pending[i] - take[i], i));
    for i in shortest {
        let more = (pending[i] - take[i]).min(left);
        take[i] += more;
        left -= more;
    }
    take
}

/// A prompt in the engine, computed over one or more steps.
struct Active {
    id: SeqId,
    job: Job,
    /// `prefill_forward`: from admission until the first token.
    forward: tracing::Span,
    steps: u32,
    /// What its steps cost against the worker's normal.
    costs: steps::Totals,
}

/// How long a step takes, learnt from the steps run: a step costs a fixed
/// part (the output projection of a large vocabulary, the threads'
/// wake-up) plus a part per token, so seconds per token are learnt from
/// steps of many tokens only (a 2-token step's cost per token says nothing
/// of a 1,000-token prompt's), and a short step's seconds apart.
#[derive(Debug, Default)]
pub struct Pace {
    /// Seconds per token of steps of [`Pace::MANY`] tokens or more, smoothed; 0 before one.
    token_s: f64,
    /// Seconds of a step of fewer tokens, smoothed.
    step_s: f64,
}

impl Pace {
    pub const MANY: usize = 64;

    fn smooth(cur: f64, v: f64) -> f64 {
        if cur == 0.0 {
            v
        } else {
            0.8 * cur + 0.2 * v
        }
    }

    pub fn observe(&mut self, secs: f64, tokens: usize) {
        if tokens >= Self::MANY {
            self.token_s = Self::smooth(self.token_s, secs / tokens as f64);
        } else {
            self.step_s = Self::smooth(self.step_s, secs);
        }
    }

    /// Seconds `tokens` prompt tokens take, in steps of at most `step_tokens`.
    pub fn estimate_s(&self, tokens: usize, step_tokens: usize) -> f64 {
        let steps = tokens.div_ceil(step_tokens.max(1)) as f64;
        (tokens as f64 * self.token_s).max(steps * self.step_s)
    }
}

/// The prefill loop's own state: the engine, the queue it serves, the
/// prompts being computed, and the blocks pinned for transfers.
struct Loop {
    /// Held while the loop runs; each turn beats it (see [`pdmesh_worker::LoopAlive`]).
    alive: pdmesh_worker::AliveGuard,
    engine: Engine,
    meter: Meter,
    q: Arc<Queue>,
    stats: Arc<Stats>,
    max_batch: usize,
    /// Most prompt tokens one step feeds, over all prompts.
    step_tokens: usize,
    kernel_spans: KernelSpans,
    pinned: std::collections::HashMap<SeqId, u32>,
    active: Vec<Active>,
    /// How long prompts take (for the deadline check and the expected wait).
    pace: Pace,
    /// The GPU was lost in a step: the loop stops (the worker leaves service).
    lost: Option<EngineError>,
}

fn run(mut l: Loop) {
    while let Some(cmds) = l.wait() {
        pdmesh_worker::loop_panic_fault();
        pdmesh_worker::loop_stall_fault();
        l.apply(cmds);
        l.drop_gone();
        l.admit_queued();
        if !l.active.is_empty() {
            l.step();
        }
        l.publish();
        if let Some(e) = l.lost.take() {
            l.leave(&e);
            return;
        }
    }
}

impl Loop {
    /// Wait until there is something to do; the pending commands. None once stopped.
    fn wait(&mut self) -> Option<Vec<Cmd>> {
        let q = self.q.clone();
        let mut g = q.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            self.alive.beat();
            if g.stop {
                return None;
            }
            if !g.cmds.is_empty() || !self.active.is_empty() {
                return Some(std::mem::take(&mut g.cmds));
            }
            // Test-only fault: keep each prompt queued at least this long.
            let hold = Duration::from_millis(pdmesh_core::faults::get("prefill.queue_hold_ms"));
            match g.jobs.front().map(|j| j.enqueued.elapsed()) {
                Some(waited) if waited >= hold => return Some(Vec::new()),
                Some(waited) => g = q.wake.wait_timeout(g, hold - waited).unwrap_or_else(|e| e.into_inner()).0,
                // Idle: wake now and then to beat.
                None => {
                    g = q.wake.wait_timeout(g, pdmesh_worker::alive::IDLE_BEAT).unwrap_or_else(|e| e.into_inner()).0
                }
            }
        }
    }

    /// Release the prompts whose caller went away or whose deadline passed
    /// (between steps: a long prompt stops consuming prefill at once).
    fn drop_gone(&mut self) {
        let now = Instant::now();
        let (gone, keep): (Vec<Active>, Vec<Active>) = std::mem::take(&mut self.active)
            .into_iter()
            .partition(|a| a.job.reply.is_closed() || a.job.deadline.is_some_and(|d| d <= now));
        self.active = keep;
        for a in gone {
            let _ = self.engine.release(a.id);
            if a.job.reply.is_closed() {
                self.stats.outcomes.inc(Outcome::Cancelled);
                pdmesh_core::telemetry::mark_error(&a.forward, "the caller went away; prefill stopped");
            } else {
                let why = "the request's deadline passed during its prefill";
                pdmesh_core::telemetry::mark_error(&a.forward, why);
                let _ = a.job.reply.send(Err(EngineError::DeadlineExceeded(why.into())));
            }
        }
    }

    /// Move queued prompts into the engine, first come first served, while
    /// fewer than `max_batch` are active and the arena has room. A prompt
    /// that cannot finish before its deadline is refused, not started.
    fn admit_queued(&mut self) {
        let q = self.q.clone();
        let mut g = q.state.lock().unwrap_or_else(|e| e.into_inner());
        let hold = Duration::from_millis(pdmesh_core::faults::get("prefill.queue_hold_ms"));
        while self.active.len() < self.max_batch {
            let Some(front) = g.jobs.front() else { break };
            if front.enqueued.elapsed() < hold {
                break;
            }
            let job = g.jobs.pop_front().expect("front exists");
            if !hold.is_zero() {
                job.queued.record(attr::QUEUE_HELD_MS, hold.as_millis() as i64);
            }
            if let Some(job) = self.admit(job) {
                g.jobs.push_front(job); // no KV room until a prompt finishes
                break;
            }
        }
        self.stats.queued.store(g.jobs.len() as u32, Ordering::Relaxed);
        self.stats.queued_tokens.store(g.jobs.iter().map(|j| j.prompt.len() as u64).sum(), Ordering::Relaxed);
        self.stats.running.store(self.active.len() as u32, Ordering::Relaxed);
    }

    /// Add one prompt to the engine (only the prompt: the decode worker
    /// holds the rest), or answer it at once. Returns the job when the
    /// arena is full but other prompts will free room.
    fn admit(&mut self, job: Job) -> Option<Job> {
        if job.reply.is_closed() {
            self.stats.outcomes.inc(Outcome::Cancelled);
            return None;
        }
        let params = SamplingParams { max_tokens: 1, ..job.params.clone() };
        let id = match self.engine.add_sequence(job.prompt.clone(), params) {
            Ok(id) => id,
            Err(EngineError::KvFull { .. }) if !self.active.is_empty() => return Some(job),
            Err(e) => {
                let _ = job.reply.send(Err(e));
                return None;
            }
        };
        self.stats.queue_wait_seconds.observe(job.enqueued.elapsed().as_secs_f64());
        let cached = self.engine.reused_tokens(id).unwrap_or(0);
        let computed = job.prompt.len() - cached;
        if let Some(d) = job.deadline {
            let need = Duration::from_secs_f64(self.pace.estimate_s(computed, self.step_tokens));
            if Instant::now() + need > d {
                let _ = self.engine.release(id);
                let why = format!(
                    "its {computed} prompt tokens need about {:.0} ms, past the deadline",
                    need.as_secs_f64() * 1e3
                );
                let _ = job.reply.send(Err(EngineError::DeadlineExceeded(why)));
                return None;
            }
        }
        let mut job = job;
        job.queued = tracing::Span::none(); // ends the `queued` span
        let forward = tracing::info_span!(parent: &job.span, span::PREFILL_FORWARD,
            { attr::BATCH_SIZE } = tracing::field::Empty, { attr::BATCH_TOKENS } = tracing::field::Empty,
            { attr::PROMPT_TOKENS } = job.prompt.len() as i64,
            { attr::PREFILL_CACHED_TOKENS } = cached as i64, { attr::PREFILL_COMPUTED_TOKENS } = computed as i64,
            { attr::PREFILL_STEPS } = tracing::field::Empty);
        self.active.push(Active { id, job, forward, steps: 0, costs: steps::Totals::default() });
        None
    }

    fn apply(&mut self, cmds: Vec<Cmd>) {
        for c in cmds {
            match c {
                Cmd::Export { seq, reply } => {
                    let _ = reply.send(self.engine.export_kv(seq));
                }
                Cmd::Flip { seq, reply } => {
                    let _ = reply.send(self.engine.flip_prompt_byte(seq));
                }
                Cmd::Release { seq } => {
                    if self.engine.release(seq).is_ok() {
                        self.pinned.remove(&seq);
                    }
                }
            }
        }
    }

    fn publish(&mut self) {
        self.stats.running.store(self.active.len() as u32, Ordering::Relaxed);
        let ahead: usize = self.active.iter().map(|a| self.engine.pending(a.id).unwrap_or(0)).sum::<usize>()
            + self.stats.queued_tokens.load(Ordering::Relaxed) as usize;
        let wait_s = if ahead == 0 { 0.0 } else { self.pace.estimate_s(ahead, self.step_tokens) };
        self.stats.expected_wait_ms.store((wait_s * 1e3) as u64, Ordering::Relaxed);
        self.stats.kv_pinned.store(self.pinned.values().sum(), Ordering::Relaxed);
        self.stats.kv_used.store(self.engine.kv.used() as u32, Ordering::Relaxed);
        self.stats.prefix.refresh(&mut self.engine.kv.blocks);
    }

    /// One forward step under the token budget; every prompt it completes
    /// gets its first token and is delivered at once.
    fn step(&mut self) {
        let pending: Vec<usize> = self.active.iter().map(|a| self.engine.pending(a.id).unwrap_or(0)).collect();
        let take = plan_step(&pending, self.step_tokens);
        let runs: Vec<(SeqId, usize)> =
            self.active.iter().zip(&take).filter(|(_, n)| **n > 0).map(|(a, n)| (a.id, *n)).collect();
        let tokens: usize = take.iter().sum();
        for (a, _) in self.active.iter_mut().zip(&take).filter(|(_, n)| **n > 0) {
            a.steps += 1;
            if a.steps == 1 {
                a.forward.record(attr::BATCH_SIZE, runs.len() as i64);
                a.forward.record(attr::BATCH_TOKENS, tokens as i64);
            }
        }
        let in_step = self.active.iter().zip(&take).filter(|(_, n)| **n > 0).map(|(a, _)| &a.forward);
        let step = pdmesh_worker::step_span(span::PREFILL_STEP, in_step, runs.len());
        let trace_id = pdmesh_core::telemetry::trace_id(&step);
        let mark = self.meter.start();
        let result = {
            let _in = step.enter();
            let kernel_spans = !step.is_disabled() && self.kernel_spans.covers(1);
            self.engine.forward_some(&runs, StepOptions { kernel_spans })
        };
        let cost = self.meter.finish(mark, runs.len(), tokens);
        cost.record(&step);
        drop(step);
        for (a, _) in self.active.iter_mut().zip(&take).filter(|(_, n)| **n > 0) {
            a.costs.add(&cost);
        }
        let secs = cost.wall_ms / 1e3;
        self.stats.step_seconds.observe_traced(secs, trace_id.as_deref());
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats.prompt_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.pace.observe(secs, tokens);
        match result {
            Ok(done) => {
                for (id, next) in done {
                    self.finish(id, &next);
                }
            }
            Err(e) => self.fail(&runs, &e),
        }
    }

    /// A step failed: every prompt in it gets the error (not its fault).
    fn fail(&mut self, runs: &[(SeqId, usize)], e: &EngineError) {
        let (failed, keep): (Vec<Active>, Vec<Active>) =
            std::mem::take(&mut self.active).into_iter().partition(|a| runs.iter().any(|(id, _)| *id == a.id));
        self.active = keep;
        for a in failed {
            let _ = self.engine.release(a.id);
            let _ = a.job.reply.send(Err(pdmesh_worker::step_error("prefill", e)));
        }
        if pdmesh_worker::is_fatal(e) {
            self.lost = Some(pdmesh_worker::step_error("prefill", e));
        }
    }

    /// The GPU is lost: every prompt still here or queued gets the error,
    /// and the queue takes no more (the loop then stops).
    fn leave(&mut self, e: &EngineError) {
        eprintln!("pdmesh-prefill: the GPU is lost; the engine loop stops and the worker leaves service");
        for a in std::mem::take(&mut self.active) {
            let _ = self.engine.release(a.id);
            let _ = a.job.reply.send(Err(pdmesh_worker::step_error("prefill", e)));
        }
        let mut g = self.q.state.lock().unwrap_or_else(|p| p.into_inner());
        g.stop = true;
        for j in g.jobs.drain(..) {
            let _ = j.reply.send(Err(pdmesh_worker::step_error("prefill", e)));
        }
    }

    /// A prompt is all in: sample its first token and hand its pinned blocks over.
    fn finish(&mut self, id: SeqId, next: &NextToken) {
        let Some(i) = self.active.iter().position(|a| a.id == id) else { return };
        let a = self.active.remove(i);
        a.forward.record(attr::PREFILL_STEPS, a.steps as i64);
        a.costs.record(&a.forward, self.meter.batch_usual());
        let n_tokens = a.job.prompt.len();
        let engine = &mut self.engine;
        let r = engine.accept(id, next).and_then(|ev| {
            // On a GPU whose transfers stage through host memory, the
            // prompt's blocks go there before anyone reads them.
            engine.stage_for_send(id)?;
            let blocks = engine.blocks(id)?[..engine.kv.layout.blocks_for(n_tokens)].to_vec();
            let cached_tokens = engine.reused_tokens(id)?;
            let checksums = engine.kv_checksums(id)?;
            let shipped = engine.shipped(id)?;
            Ok(Prefilled { first_token: ev.token, seq: id, blocks, n_tokens, cached_tokens, checksums, shipped })
        });
        match r {
            Ok(p) => {
                self.pinned.insert(id, self.engine.blocks(id).map(|b| b.len() as u32).unwrap_or(0));
                // Undelivered, the guard is dropped and queues its own release.
                let _ = a.job.reply.send(Ok(Pinned { q: self.q.clone(), p }));
            }
            Err(e) => {
                let _ = self.engine.release(id);
                let _ = a.job.reply.send(Err(e));
            }
        }
        drop(a.forward);
    }
}

#[cfg(test)]
mod tests {
    use super::{plan_step, Pace};

    /// Gemma 3 on 2 cores: a 2-token step takes 0.28 s (the 262,144-row
    /// output projection), 512 tokens 3.2 s. Learnt from the short step
    /// alone, 1,131 tokens were once judged to need 161 s.
    #[test]
    fn a_short_step_does_not_make_long_prompts_look_slow() {
        let mut p = Pace::default();
        p.observe(0.28, 2);
        assert!(p.estimate_s(1131, 2048) < 1.0, "{}", p.estimate_s(1131, 2048));
        p.observe(3.2, 512);
        let e = p.estimate_s(1131, 2048);
        assert!((6.0..8.0).contains(&e), "{e}");
        assert!((p.estimate_s(3, 2048) - 0.28).abs() < 1e-9, "a short prompt: one short step");
    }

    #[test]
    fn a_step_never_feeds_more_than_its_budget() {
        assert_eq!(plan_step(&[5000], 128), vec![128]);
        assert_eq!(plan_step(&[100, 100, 100], 128), vec![100, 28, 0]);
        let plan = plan_step(&[300, 20, 7], 128);
        assert_eq!(plan.iter().sum::<usize>(), 128);
        assert_eq!(plan_step(&[4, 4], 0), vec![1, 0], "a zero budget still moves one token");
        assert!(plan_step(&[], 128).is_empty());
    }

    #[test]
    fn a_short_prompt_behind_a_long_one_finishes_in_one_step() {
        assert_eq!(plan_step(&[5000, 2], 128), vec![126, 2]);
        assert_eq!(plan_step(&[10, 2000, 5, 3000], 128), vec![10, 113, 5, 0]);
        // Many short prompts: the shortest finish first, as many as fit.
        assert_eq!(plan_step(&[50, 40, 30, 20, 60], 128), vec![50, 28, 30, 20, 0]);
    }

    #[test]
    fn the_oldest_prompt_moves_every_step_so_none_starves() {
        // A stream of new short prompts behind an old long one.
        let mut old = 1000usize;
        let mut steps = 0;
        while old > 0 {
            let plan = plan_step(&[old, 3, 3, 3, 3], 128);
            assert!(plan[0] >= 64.min(old), "the oldest got {}", plan[0]);
            old -= plan[0];
            steps += 1;
        }
        assert!(steps <= 16, "{steps} steps for 1000 tokens at 64 or more a step");
    }
}
