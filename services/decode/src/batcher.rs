//! The decode loop: one OS thread owns the engine. Requests reserve blocks,
//! receive their prompt's KV, then join the running batch with their first
//! token; every iteration admits waiting sequences (up to `max_batch`), runs
//! one decode step for all running ones, streams each its token, and
//! releases the finished and the abandoned (their stream's receiver is gone).
//!
//! A local prefill (conditional disaggregation) skips the transfer: the
//! prompt reuses what this worker's prefix cache holds (earlier turns of
//! the same chat, answers included) and its tail rides in the decode steps,
//! at most `local_step_tokens` prompt tokens per step, oldest first, so
//! running sequences keep their pace.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_core::metrics::{Histogram, Outcome, Outcomes};
use pdmesh_core::telemetry::{self, SpanExt};
use pdmesh_core::vocab::{attr, span};
use pdmesh_engine::model::StepOptions;
use pdmesh_engine::{Engine, EngineError, FinishReason, KvBlob, NextToken, SamplingParams, SeqId, TokenEvent};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::decode::v1 as pb;
use pdmesh_worker::prefix::SharedPrefix;
use pdmesh_worker::steps::{self, Meter};
use pdmesh_worker::KernelSpans;
use tokio::sync::oneshot;
use tonic::Status;

mod park;
pub use park::PARK_TTL;

/// What a stream handed over for its router to replay ends with.
const HANDED_OVER: &str = "this decode worker is draining: the request continues on another";

/// Where a sequence's events go: the gRPC response stream.
pub type Events = tokio::sync::mpsc::UnboundedSender<Result<pb::GenerateResponse, Status>>;

enum Cmd {
    Reserve {
        prompt: Vec<u32>,
        params: SamplingParams,
        /// Handed over mid-stream: the KV covers the replayed tokens too.
        continued: bool,
        reply: oneshot::Sender<Result<(SeqId, Vec<u32>), EngineError>>,
    },
    Import {
        seq: SeqId,
        blob: KvBlob,
        sums: Vec<u32>,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Start {
        seq: SeqId,
        first_token: u32,
        /// The sender's CRC-32C of each prompt block (empty: not checked).
        checksums: Vec<u32>,
        events: Events,
        span: tracing::Span,
    },
    Local {
        prompt: Vec<u32>,
        params: SamplingParams,
        events: Events,
        span: tracing::Span,
        reply: oneshot::Sender<Result<u32, EngineError>>,
    },
    /// A NIXL write into this sequence's blocks landed: checksum them now.
    Landed {
        seq: SeqId,
    },
    Release {
        seq: SeqId,
    },
    /// Draining: hand every sequence over (see `Loop::hand_over_all`).
    HandOver,
    /// Ship a parked sequence (see [`park`]).
    TakeParked {
        seq: SeqId,
        reply: oneshot::Sender<Result<park::Parcel, EngineError>>,
    },
    /// A copy of a parked sequence's KV being shipped (TCP).
    ExportParked {
        seq: SeqId,
        reply: oneshot::Sender<Result<KvBlob, EngineError>>,
    },
    /// A parked sequence's shipment ended (`ok`: its KV arrived).
    Shipped {
        seq: SeqId,
        ok: bool,
    },
}

/// Live load, read by /metrics and the Load RPC.
pub struct Stats {
    pub running: AtomicU32,
    pub queued: AtomicU32,
    /// Reserved and waiting for their KV.
    pub awaiting_kv: AtomicU32,
    /// Blocks held for sequences that have not started (waiting for their
    /// KV, or quarantined after a failed transfer).
    pub kv_reserved: AtomicU32,
    pub kv_used: AtomicU32,
    pub kv_total: AtomicU32,
    pub steps: AtomicU64,
    pub tokens: AtomicU64,
    pub step_seconds: Histogram,
    pub outcomes: Outcomes,
    /// Local prefills admitted and not yet at their first token.
    pub local_prefilling: AtomicU32,
    /// Local prefills admitted.
    pub local_prefills: AtomicU64,
    /// Prompt tokens computed by local prefills.
    pub local_prefill_tokens: AtomicU64,
    /// Tickets opened again at a kvbroker that had lost them.
    pub tickets_reopened: AtomicU64,
    /// Sequences handed over to other decode workers on drain.
    pub handed_over: AtomicU64,
    /// Of those, the ones whose KV was shipped along (not replayed).
    pub handed_over_with_kv: AtomicU64,
    /// Parked on drain, waiting for their KV to be shipped.
    pub parked: AtomicU32,
    /// Transferred prompts whose KV failed its checksum.
    pub kv_corrupt: AtomicU64,
    pub prefix: SharedPrefix,
    pub block_bytes: usize,
    /// Step time against this worker's normal.
    pub step_costs: Arc<steps::Counters>,
}

/// Handle to the decode loop.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Cmd>,
    pub stats: Arc<Stats>,
    /// Whether the loop's thread still runs.
    pub alive: pdmesh_worker::LoopAlive,
}

fn gone() -> EngineError {
    EngineError::Unavailable("the decode loop has stopped".into())
}

impl Batcher {
    /// Start the loop on its own thread; it ends when every handle is dropped.
    /// `ship_on_drain`: a drain parks sequences for their KV to be shipped
    /// (see [`park`]) rather than ending them for their routers to replay.
    pub fn start(
        engine: Engine,
        max_batch: usize,
        local_step_tokens: usize,
        kernel_spans: KernelSpans,
        ship_on_drain: bool,
    ) -> Batcher {
        let stats = Arc::new(Stats {
            running: AtomicU32::new(0),
            queued: AtomicU32::new(0),
            awaiting_kv: AtomicU32::new(0),
            kv_reserved: AtomicU32::new(0),
            kv_used: AtomicU32::new(0),
            kv_total: AtomicU32::new(engine.kv.total() as u32),
            steps: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            step_seconds: Histogram::latency(),
            outcomes: Outcomes::default(),
            local_prefilling: AtomicU32::new(0),
            local_prefills: AtomicU64::new(0),
            local_prefill_tokens: AtomicU64::new(0),
            tickets_reopened: AtomicU64::new(0),
            handed_over: AtomicU64::new(0),
            handed_over_with_kv: AtomicU64::new(0),
            parked: AtomicU32::new(0),
            kv_corrupt: AtomicU64::new(0),
            prefix: SharedPrefix::new(&engine.kv.blocks),
            block_bytes: engine.kv.layout.block_bytes(),
            step_costs: Arc::default(),
        });
        let (tx, rx) = mpsc::channel();
        let s = stats.clone();
        let (alive, guard) = pdmesh_worker::LoopAlive::start(Some(engine.pool_share()));
        std::thread::Builder::new()
            .name("decode-loop".into())
            .spawn(move || {
                Loop {
                    alive: guard,
                    meter: Meter::new(&engine.pool_thread_ids(), s.step_costs.clone()).backing_off(engine.pool_share()),
                    engine,
                    max_batch: max_batch.max(1),
                    local_step_tokens: local_step_tokens.max(1),
                    kernel_spans,
                    stats: s,
                    ready: VecDeque::new(),
                    running: Vec::new(),
                    prefilling: VecDeque::new(),
                    reserved: Default::default(),
                    landed: Default::default(),
                    lost: false,
                    handing_over: false,
                    ship_on_drain,
                    parked: HashMap::new(),
                }
                .run(rx)
            })
            .expect("spawn decode loop");
        Batcher { tx, stats, alive }
    }

    /// Reserve blocks for prompt + max_tokens; KvFull when they are not free.
    /// `continued`: a sequence handed over mid-stream, whose KV will cover
    /// its replayed tokens but the last too (`Engine::reserve_continued`).
    pub async fn reserve(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        continued: bool,
    ) -> Result<(SeqId, Vec<u32>), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Reserve { prompt, params, continued, reply }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Write the prompt's KV into the sequence's blocks; `sums` are its
    /// blocks' checksums as received, for the check at its start.
    pub async fn import(&self, seq: SeqId, blob: KvBlob, sums: Vec<u32>) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Import { seq, blob, sums, reply }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// A NIXL write into `seq`'s blocks landed (its note arrived): the loop
    /// takes the blocks' checksums before the ticket says DONE, so the check
    /// at the start compares numbers only.
    pub fn landed(&self, seq: SeqId) {
        let _ = self.tx.send(Cmd::Landed { seq });
    }

    /// Join the batch with the first token; events go to `events` from now
    /// on, and the loop releases the sequence when it ends or `events` closes.
    /// `span` (the request's server span) ends with the sequence.
    /// `checksums`: the sender's, checked against the blocks first (a
    /// mismatch ends the request UNAVAILABLE, `KV_CORRUPT`).
    pub fn start_sequence(
        &self,
        seq: SeqId,
        first_token: u32,
        checksums: Vec<u32>,
        events: Events,
        span: tracing::Span,
    ) {
        let _ = self.tx.send(Cmd::Start { seq, first_token, checksums, events, span });
    }

    /// Prefill `prompt` here and decode it: events go to `events` (the
    /// first token once the prompt is in). Returns the prompt tokens reused
    /// from the prefix cache; KvFull when the blocks are not free.
    pub async fn local(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        events: Events,
        span: tracing::Span,
    ) -> Result<u32, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Local { prompt, params, events, span, reply }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Free a sequence that never started (unknown ids are ignored).
    pub fn release(&self, seq: SeqId) {
        let _ = self.tx.send(Cmd::Release { seq });
    }

    /// What a drain calls: from then on every sequence is handed over.
    pub fn hand_over(&self) -> Box<dyn FnOnce() + Send> {
        let tx = self.tx.clone();
        Box::new(move || {
            let _ = tx.send(Cmd::HandOver);
        })
    }
}

struct Seq {
    id: SeqId,
    events: Events,
    n_prompt: u32,
    /// Prompt tokens a local prefill reused from the prefix cache.
    n_cached: u32,
    n_generated: u32,
    /// `decode_loop`: from joining the batch to the end; records the steps
    /// it rode in and their batch sizes.
    span: tracing::Span,
    _server: tracing::Span,
    steps: u32,
    batch_sum: u64,
    batch_max: u32,
    /// What its steps cost against the worker's normal.
    costs: steps::Totals,
    /// Its steps that also fed local prefill tokens.
    with_prefill: u32,
    /// The worker's usual batch size when it last stepped.
    batch_usual: f64,
}

impl Seq {
    /// Record the loop's totals and end `decode_loop` (once).
    fn end_span(&mut self) {
        let span = std::mem::replace(&mut self.span, tracing::Span::none());
        self.costs.record(&span, self.batch_usual);
        if self.costs.steps > 0 && !span.is_disabled() {
            span.set_attribute(attr::STEPS_WITH_PREFILL, self.with_prefill as i64);
        }
        span.record(attr::DECODE_STEPS, self.steps as i64);
        span.record(attr::DECODE_TOKENS, self.n_generated as i64);
        span.record(attr::DECODE_BATCH_MAX, self.batch_max as i64);
        span.record(
            attr::DECODE_BATCH_MEAN,
            if self.steps > 0 { self.batch_sum as f64 / self.steps as f64 } else { 0.0 },
        );
    }
}

impl Drop for Seq {
    fn drop(&mut self) {
        self.end_span();
    }
}

/// A local prefill on its way to the first token.
struct Prefilling {
    id: SeqId,
    events: Events,
    server: tracing::Span,
    /// `prefill_forward` (with `prefill.local`): all the prompt's steps.
    forward: tracing::Span,
    n_cached: u32,
    steps: u32,
    costs: steps::Totals,
}

struct Loop {
    /// Held while the loop runs; each turn beats it (see [`pdmesh_worker::LoopAlive`]).
    alive: pdmesh_worker::AliveGuard,
    engine: Engine,
    meter: Meter,
    max_batch: usize,
    /// Most prompt tokens of local prefills one step feeds.
    local_step_tokens: usize,
    kernel_spans: KernelSpans,
    stats: Arc<Stats>,
    /// Started, waiting for a batch slot.
    ready: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Local prefills, oldest first.
    prefilling: VecDeque<Prefilling>,
    /// Blocks of sequences reserved but not started.
    reserved: HashMap<SeqId, u32>,
    /// Checksums of reserved sequences' blocks, taken as their NIXL write
    /// landed or their TCP chunks arrived (and how long that took on the
    /// loop), for the check at their start.
    landed: HashMap<SeqId, (Vec<u32>, Duration)>,
    /// The GPU was lost in a step: the loop stops (the worker leaves service).
    lost: bool,
    /// Draining: sequences are handed over instead of run to their end.
    handing_over: bool,
    /// Handing over parks sequences for their KV to be shipped.
    ship_on_drain: bool,
    /// Parked sequences, by id.
    parked: HashMap<SeqId, park::Parked>,
}

fn reason(f: FinishReason) -> i32 {
    match f {
        FinishReason::Stop => common::FinishReason::Stop as i32,
        FinishReason::Length => common::FinishReason::Length as i32,
    }
}

impl Loop {
    fn run(mut self, rx: mpsc::Receiver<Cmd>) {
        loop {
            self.alive.beat();
            pdmesh_worker::loop_stall_fault();
            // Idle: block for work (waking to beat). Busy: take what has arrived and step.
            let idle = self.running.is_empty() && self.ready.is_empty() && self.prefilling.is_empty();
            let first = if idle {
                match rx.recv_timeout(pdmesh_worker::alive::IDLE_BEAT) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            if let Some(c) = first {
                pdmesh_worker::loop_panic_fault();
                self.handle(c);
                while let Ok(c) = rx.try_recv() {
                    self.handle(c);
                }
            }
            self.drop_abandoned();
            if self.handing_over {
                self.hand_over_all();
            }
            self.expire_parked();
            while self.running.len() < self.max_batch {
                let Some(s) = self.ready.pop_front() else { break };
                self.running.push(s);
            }
            if !self.running.is_empty() || !self.prefilling.is_empty() {
                self.step();
            }
            self.publish();
            if self.lost {
                eprintln!("pdmesh-decode: the GPU is lost; the engine loop stops and the worker leaves service");
                return;
            }
        }
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Reserve { prompt, params, continued, reply } => {
                let r = if continued {
                    self.engine.reserve_continued(prompt, params)
                } else {
                    self.engine.reserve_sequence(prompt, params)
                };
                let r = r.and_then(|id| {
                    let blocks = self.engine.blocks(id)?.to_vec();
                    Ok((id, blocks))
                });
                match r {
                    Ok((id, blocks)) => {
                        self.stats.awaiting_kv.fetch_add(1, Ordering::Relaxed);
                        self.reserved.insert(id, blocks.len() as u32);
                        if reply.send(Ok((id, blocks))).is_err() {
                            // The caller is gone already.
                            self.release_reserved(id);
                        }
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Cmd::Import { seq, blob, sums, reply } => {
                let r = self.engine.import_prompt_kv(seq, &blob);
                if r.is_ok() {
                    // TCP copies whole blocks; the sender checksummed what
                    // a trimmed transfer moves, so that is taken here.
                    let t0 = Instant::now();
                    let sums = match self.engine.transfer_trimmed(seq) {
                        Ok(true) => self.engine.transfer_checksums(seq).unwrap_or(sums),
                        _ => sums,
                    };
                    self.landed.insert(seq, (sums, t0.elapsed()));
                }
                let _ = reply.send(r);
            }
            Cmd::Start { seq, first_token, checksums, events, span: server } => {
                self.stats.awaiting_kv.fetch_sub(1, Ordering::Relaxed);
                self.reserved.remove(&seq);
                let ev = self
                    .verify(seq, &checksums, &server)
                    .and_then(|()| self.engine.attach_first_token(seq, first_token));
                self.join(seq, ev, events, server, 0);
            }
            Cmd::Local { prompt, params, events, span, reply } => self.admit_local(prompt, params, events, span, reply),
            Cmd::Landed { seq } => {
                if self.reserved.contains_key(&seq) {
                    let t0 = Instant::now();
                    if let Ok(sums) = self.engine.transfer_checksums(seq) {
                        self.landed.insert(seq, (sums, t0.elapsed()));
                    }
                }
            }
            Cmd::Release { seq } => self.release_reserved(seq),
            Cmd::HandOver => self.handing_over = true,
            Cmd::TakeParked { seq, reply } => self.take_parked(seq, reply),
            Cmd::ExportParked { seq, reply } => self.export_parked(seq, reply),
            Cmd::Shipped { seq, ok } => self.unpark(seq, ok),
        }
    }

    /// Check a transferred prompt's blocks against the sender's checksums
    /// (the `kv_verify` span, under the request's), with those taken as its
    /// NIXL write landed if there are any; a mismatch is counted.
    fn verify(&mut self, seq: SeqId, checksums: &[u32], server: &tracing::Span) -> Result<(), EngineError> {
        if checksums.is_empty() {
            return Ok(());
        }
        let span = tracing::info_span!(parent: server, span::KV_VERIFY,
            { attr::KV_VERIFIED_BLOCKS } = checksums.len() as i64, { attr::KV_VERIFY_MS } = tracing::field::Empty,
            { attr::KV_VERIFIED_ON_LANDING_MS } = tracing::field::Empty);
        let t0 = Instant::now();
        let got = match self.landed.remove(&seq) {
            Some((sums, took)) => {
                span.record(attr::KV_VERIFIED_ON_LANDING_MS, took.as_secs_f64() * 1e3);
                Ok(sums)
            }
            None => self.engine.transfer_checksums(seq),
        };
        let r = got.and_then(|got| pdmesh_engine::kv::verify_checksums(&got, checksums));
        span.record(attr::KV_VERIFY_MS, t0.elapsed().as_secs_f64() * 1e3);
        if let Err(e) = &r {
            self.stats.kv_corrupt.fetch_add(1, Ordering::Relaxed);
            telemetry::mark_error(&span, &e.to_string());
        }
        r
    }

    /// A sequence with its first token joins the waiting line (or ends,
    /// when that token ends it); `server` is the request's span.
    fn join(
        &mut self,
        seq: SeqId,
        first: Result<TokenEvent, EngineError>,
        events: Events,
        server: tracing::Span,
        n_cached: u32,
    ) {
        let n_prompt = self.engine.prompt_len(seq).unwrap_or(0) as u32;
        match first {
            Ok(ev) => {
                let span = tracing::info_span!(
                    parent: &server,
                    "decode_loop",
                    { attr::DECODE_RUNNING_ON_JOIN } = self.running.len() as i64,
                    { attr::DECODE_WAITING_ON_JOIN } = self.ready.len() as i64,
                    { attr::DECODE_STEPS } = tracing::field::Empty,
                    { attr::DECODE_TOKENS } = tracing::field::Empty,
                    { attr::DECODE_BATCH_MAX } = tracing::field::Empty,
                    { attr::DECODE_BATCH_MEAN } = tracing::field::Empty,
                );
                // A continued sequence's first event is its last replayed token.
                let before = self.engine.generated(seq).map_or(0, |g| g.len().saturating_sub(1)) as u32;
                let mut s = Seq {
                    id: seq,
                    events,
                    n_prompt,
                    n_cached,
                    n_generated: before,
                    span,
                    _server: server,
                    steps: 0,
                    batch_sum: 0,
                    batch_max: 0,
                    costs: steps::Totals::default(),
                    with_prefill: 0,
                    batch_usual: 0.0,
                };
                if self.emit(&mut s, &ev) {
                    self.ready.push_back(s);
                }
            }
            Err(e) => self.end_with(seq, &events, pdmesh_worker::status(&e)),
        }
    }

    /// End a sequence on our fault: tell its caller, free it, count it.
    fn end_with(&mut self, id: SeqId, events: &Events, status: Status) {
        let _ = events.send(Err(status));
        let _ = self.engine.release(id);
        self.stats.outcomes.inc(Outcome::Internal);
    }

    /// Admit a local prefill: reuse the cached prefix, queue the rest.
    fn admit_local(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        events: Events,
        server: tracing::Span,
        reply: oneshot::Sender<Result<u32, EngineError>>,
    ) {
        let n_prompt = prompt.len() as u32;
        let id = match self.engine.add_sequence(prompt, params) {
            Ok(id) => id,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let n_cached = self.engine.reused_tokens(id).unwrap_or(0) as u32;
        // Admitted goes first on the stream, before any token this loop sends.
        let admitted = pb::Admitted { kv_blocks: 0, cached_tokens: n_cached };
        let sent =
            events.send(Ok(pb::GenerateResponse { event: Some(pb::generate_response::Event::Admitted(admitted)) }));
        if sent.is_err() || reply.send(Ok(n_cached)).is_err() {
            let _ = self.engine.release(id);
            return;
        }
        let computed = n_prompt - n_cached;
        self.stats.local_prefills.fetch_add(1, Ordering::Relaxed);
        self.stats.local_prefill_tokens.fetch_add(computed as u64, Ordering::Relaxed);
        let forward = tracing::info_span!(parent: &server, span::PREFILL_FORWARD,
            { attr::PREFILL_LOCAL } = true,
            { attr::PROMPT_TOKENS } = n_prompt as i64,
            { attr::PREFILL_CACHED_TOKENS } = n_cached as i64, { attr::PREFILL_COMPUTED_TOKENS } = computed as i64,
            { attr::PREFILL_STEPS } = tracing::field::Empty);
        self.prefilling.push_back(Prefilling {
            id,
            events,
            server,
            forward,
            n_cached,
            steps: 0,
            costs: steps::Totals::default(),
        });
    }

    fn release_reserved(&mut self, seq: SeqId) {
        self.reserved.remove(&seq);
        self.landed.remove(&seq);
        if self.engine.release(seq).is_ok() {
            self.stats.awaiting_kv.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Send a token (and the end, if it is the last). Returns whether the
    /// sequence goes on; a finished one has been released.
    fn emit(&mut self, s: &mut Seq, ev: &TokenEvent) -> bool {
        s.n_generated += 1;
        if !ev.replayed {
            self.stats.tokens.fetch_add(1, Ordering::Relaxed);
        }
        let tok = pb::GenerateResponse {
            event: Some(pb::generate_response::Event::Tokens(pb::Tokens { ids: vec![ev.token] })),
        };
        // A replayed token (a migrated request's) reached its caller before.
        let mut alive = ev.replayed || s.events.send(Ok(tok)).is_ok();
        if let Some(f) = ev.finish {
            // The loop's span ends before the caller can hear of the end, so
            // it never outlives the spans upstream that wait for it.
            s.end_span();
            let usage = common::Usage {
                prompt_tokens: s.n_prompt,
                completion_tokens: s.n_generated,
                cached_tokens: s.n_cached,
            };
            let fin = pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Finished(pb::Finished {
                    reason: reason(f),
                    usage: Some(usage),
                })),
            };
            alive = s.events.send(Ok(fin)).is_ok();
            let _ = self.engine.release(s.id);
            self.stats.outcomes.inc(if alive { Outcome::Ok } else { Outcome::Cancelled });
            return false;
        }
        if !alive {
            let _ = self.engine.release(s.id);
            self.stats.outcomes.inc(Outcome::Cancelled);
        }
        alive
    }

    /// Draining: hand every sequence over. With KV shipping on, a started
    /// sequence is parked for its KV to go along (see [`park`]); otherwise,
    /// and for local prefills not at their first token, its stream ends
    /// UNAVAILABLE and its router migrates it, replaying the tokens already
    /// sent. Either way the drain ends within a step or a shipment instead
    /// of waiting for the longest answer; sequences that start later (their
    /// KV was on its way) are handed over alike.
    fn hand_over_all(&mut self) {
        let seqs: Vec<Seq> = self.running.drain(..).chain(self.ready.drain(..)).collect();
        let mut ended: Vec<(SeqId, Events)> = self.prefilling.drain(..).map(|p| (p.id, p.events)).collect();
        for s in seqs {
            if self.ship_on_drain {
                self.park(s);
            } else {
                // Its span ends as it is dropped here.
                ended.push((s.id, s.events.clone()));
            }
        }
        for (id, events) in ended {
            let _ = events.send(Err(Status::unavailable(HANDED_OVER)));
            let _ = self.engine.release(id);
            self.stats.outcomes.inc(Outcome::of_code(tonic::Code::Unavailable));
            self.stats.handed_over.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Release sequences whose client has gone (stream closed).
    fn drop_abandoned(&mut self) {
        let engine = &mut self.engine;
        let stats = &self.stats;
        // Whether the sequence `id` streaming to `events` stays.
        let mut keep = |id: SeqId, events: &Events| {
            let gone = events.is_closed();
            if gone {
                let _ = engine.release(id);
                stats.outcomes.inc(Outcome::Cancelled);
            }
            !gone
        };
        self.running.retain(|s| keep(s.id, &s.events));
        self.ready.retain(|s| keep(s.id, &s.events));
        self.prefilling.retain(|p| keep(p.id, &p.events));
    }

    /// The local prefills' share of the next step: up to
    /// `local_step_tokens` prompt tokens, oldest prompt first.
    fn plan_local(&self) -> Vec<(SeqId, usize)> {
        let mut left = self.local_step_tokens;
        let mut runs = Vec::new();
        for p in &self.prefilling {
            let n = self.engine.pending(p.id).unwrap_or(0).min(left);
            if n == 0 {
                break;
            }
            runs.push((p.id, n));
            left -= n;
        }
        runs
    }

    /// One engine step: a token for every running sequence, and the next
    /// slice of the local prefills.
    fn step(&mut self) {
        let local = self.plan_local();
        // A migrated sequence feeds all its replayed tokens in its first step.
        let mut runs: Vec<(SeqId, usize)> =
            self.running.iter().map(|s| (s.id, self.engine.pending(s.id).unwrap_or(1).max(1))).collect();
        runs.extend_from_slice(&local);
        let n = self.running.len() as u32;
        for s in &mut self.running {
            s.steps += 1;
            s.batch_sum += n as u64;
            s.batch_max = s.batch_max.max(n);
        }
        for p in self.prefilling.iter_mut().take(local.len()) {
            p.steps += 1;
        }
        let requests = self.running.iter().map(|s| &s.span).chain(self.prefilling.iter().map(|p| &p.forward));
        let span = pdmesh_worker::step_span(span::DECODE_STEP, requests, runs.len());
        let trace_id = pdmesh_core::telemetry::trace_id(&span);
        let kernels = !span.is_disabled() && self.running.iter().any(|s| self.kernel_spans.covers(s.n_generated + 1));
        let mark = self.meter.start();
        let result = {
            let _in = span.enter();
            self.engine.forward_some(&runs, StepOptions { kernel_spans: kernels })
        };
        let tokens = runs.iter().map(|(_, k)| k).sum();
        let cost = self.meter.finish(mark, runs.len(), tokens);
        cost.record(&span);
        drop(span);
        self.charge(&cost, local.len());
        self.stats.step_seconds.observe_traced(cost.wall_ms / 1e3, trace_id.as_deref());
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(done) => self.after_step(done),
            Err(e) => {
                // Never bad input: end every request in the step with it
                // rather than retrying forever. A lost GPU ends the waiting
                // ones too, and the loop.
                let e = pdmesh_worker::step_error("decode step", &e);
                self.lost = pdmesh_worker::is_fatal(&e);
                let waiting = if self.lost { std::mem::take(&mut self.ready) } else { VecDeque::new() };
                let ended: Vec<(SeqId, Events)> = (self.running.drain(..).map(|s| (s.id, s.events.clone())))
                    .chain(self.prefilling.drain(..).map(|p| (p.id, p.events)))
                    .chain(waiting.into_iter().map(|s| (s.id, s.events.clone())))
                    .collect();
                for (id, events) in ended {
                    self.end_with(id, &events, pdmesh_worker::status(&e));
                }
            }
        }
    }

    /// Add a step's cost to the requests it served: every running one, and
    /// the local prefills it fed (the oldest first, as `plan_local` picks).
    fn charge(&mut self, cost: &steps::Step, fed: usize) {
        let usual = self.meter.batch_usual();
        for s in &mut self.running {
            s.costs.add(cost);
            s.with_prefill += u32::from(fed > 0);
            s.batch_usual = usual;
        }
        for p in self.prefilling.iter_mut().take(fed) {
            p.costs.add(cost);
        }
    }

    /// Sample each finished position: running sequences stream their
    /// token, local prefills whose prompt is in get their first one.
    fn after_step(&mut self, done: Vec<(SeqId, NextToken)>) {
        let mut events = HashMap::with_capacity(done.len());
        for (id, next) in done {
            events.insert(id, self.engine.accept(id, &next));
        }
        let mut running = std::mem::take(&mut self.running);
        running.retain_mut(|s| match events.remove(&s.id) {
            Some(Ok(ev)) => self.emit(s, &ev),
            Some(Err(e)) => {
                self.end_with(s.id, &s.events, pdmesh_worker::status(&e));
                false
            }
            None => true,
        });
        self.running = running;
        let (done, waiting): (Vec<_>, Vec<_>) = self.prefilling.drain(..).partition(|p| events.contains_key(&p.id));
        self.prefilling = waiting.into();
        for p in done {
            p.forward.record(attr::PREFILL_STEPS, p.steps as i64);
            p.costs.record(&p.forward, self.meter.batch_usual());
            let first = events.remove(&p.id).expect("partitioned on it");
            drop(p.forward);
            self.join(p.id, first, p.events, p.server, p.n_cached);
        }
    }

    fn publish(&mut self) {
        self.stats.running.store(self.running.len() as u32, Ordering::Relaxed);
        self.stats.queued.store(self.ready.len() as u32, Ordering::Relaxed);
        self.stats.kv_used.store(self.engine.kv.used() as u32, Ordering::Relaxed);
        self.stats.kv_reserved.store(self.reserved.values().sum(), Ordering::Relaxed);
        self.stats.local_prefilling.store(self.prefilling.len() as u32, Ordering::Relaxed);
        self.stats.parked.store(self.parked.len() as u32, Ordering::Relaxed);
        self.stats.prefix.refresh(&mut self.engine.kv.blocks);
    }
}
