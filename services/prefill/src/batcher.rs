//! The prefill loop: one OS thread owns the engine; queued prompts are run
//! together in batched steps (up to `max_batch` sequences and
//! `batch_tokens` prompt tokens), each gets its first token sampled, its KV
//! exported, and its blocks freed at once. Jobs whose caller went away
//! while queued are skipped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use pdmesh_core::metrics::{Histogram, Outcomes, GRPC_OUTCOMES};
use pdmesh_engine::{Engine, EngineError, KvBlob, SamplingParams};
use tokio::sync::oneshot;

pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub reply: oneshot::Sender<Result<(u32, KvBlob), EngineError>>,
}

pub struct Stats {
    pub running: AtomicU32,
    pub queued: AtomicU32,
    pub kv_used: AtomicU32,
    pub kv_total: AtomicU32,
    pub steps: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub step_seconds: Histogram,
    pub transfer_seconds: Histogram,
    pub transfer_bytes: AtomicU64,
    pub outcomes: Outcomes,
}

struct Queue {
    jobs: Mutex<(VecDeque<Job>, bool)>,
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
        self.0.jobs.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.0.wake.notify_all();
    }
}

impl Batcher {
    pub fn start(engine: Engine, max_batch: usize, batch_tokens: usize) -> Batcher {
        let stats = Arc::new(Stats {
            running: AtomicU32::new(0),
            queued: AtomicU32::new(0),
            kv_used: AtomicU32::new(0),
            kv_total: AtomicU32::new(engine.kv.total() as u32),
            steps: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            step_seconds: Histogram::latency(),
            transfer_seconds: Histogram::latency(),
            transfer_bytes: AtomicU64::new(0),
            outcomes: Outcomes::new(GRPC_OUTCOMES),
        });
        let q = Arc::new(Queue { jobs: Mutex::new((VecDeque::new(), false)), wake: Condvar::new() });
        let (q2, s2) = (q.clone(), stats.clone());
        std::thread::Builder::new()
            .name("prefill-loop".into())
            .spawn(move || run(engine, q2, s2, max_batch.max(1), batch_tokens.max(1)))
            .expect("spawn prefill loop");
        Batcher { _stop: Arc::new(StopOnDrop(q.clone())), q, stats }
    }

    /// Queue a prompt; resolves with its first token and KV.
    pub async fn prefill(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<(u32, KvBlob), EngineError> {
        let (reply, rx) = oneshot::channel();
        {
            let mut g = self.q.jobs.lock().unwrap_or_else(|e| e.into_inner());
            g.0.push_back(Job { prompt, params, reply });
            self.stats.queued.store(g.0.len() as u32, Ordering::Relaxed);
        }
        self.q.wake.notify_one();
        rx.await.map_err(|_| EngineError::InvalidArgument("prefill loop has stopped".into()))?
    }
}

fn run(mut engine: Engine, q: Arc<Queue>, stats: Arc<Stats>, max_batch: usize, batch_tokens: usize) {
    loop {
        let mut batch: Vec<Job> = Vec::new();
        {
            let mut g = q.jobs.lock().unwrap_or_else(|e| e.into_inner());
            while g.0.is_empty() && !g.1 {
                g = q.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            if g.1 {
                return;
            }
            let mut tokens = 0;
            while let Some(j) = g.0.front() {
                if j.reply.is_closed() {
                    g.0.pop_front();
                    stats.outcomes.inc("cancelled");
                    continue;
                }
                // Always take one, however long; then fill up to the budgets.
                if !batch.is_empty() && (batch.len() >= max_batch || tokens + j.prompt.len() > batch_tokens) {
                    break;
                }
                tokens += j.prompt.len();
                batch.push(g.0.pop_front().expect("front exists"));
            }
            stats.queued.store(g.0.len() as u32, Ordering::Relaxed);
        }
        if batch.is_empty() {
            continue;
        }
        stats.running.store(batch.len() as u32, Ordering::Relaxed);
        let mut ids = Vec::new();
        let mut admitted = Vec::new();
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
            let t = Instant::now();
            let result = engine.prefill(&ids);
            stats.step_seconds.observe(t.elapsed().as_secs_f64());
            stats.steps.fetch_add(1, Ordering::Relaxed);
            match result {
                Ok(events) => {
                    for (id, job) in admitted {
                        stats.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
                        let r = match events.iter().find(|e| e.seq == id) {
                            Some(ev) => engine.export_kv(id).map(|blob| (ev.token, blob)),
                            None => Err(EngineError::InvalidArgument("prefill produced no token".into())),
                        };
                        let _ = engine.release(id);
                        let _ = job.reply.send(r);
                    }
                }
                Err(e) => {
                    for (id, job) in admitted {
                        let _ = engine.release(id);
                        let _ = job.reply.send(Err(EngineError::InvalidArgument(format!("prefill step failed: {e}"))));
                    }
                }
            }
        }
        stats.running.store(0, Ordering::Relaxed);
        stats.kv_used.store(engine.kv.used() as u32, Ordering::Relaxed);
    }
}
