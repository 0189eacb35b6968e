//! Closed-loop load: at each concurrency C, C clients each send their next
//! request as soon as the previous one ends, until the point's request
//! budget is spent (or its time budget, or Ctrl-C).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{Outcome, Record, Request};

/// Live counts for the progress line.
#[derive(Default)]
pub struct Progress {
    pub sent: AtomicUsize,
    pub done: AtomicUsize,
    pub ok: AtomicUsize,
    pub errors: AtomicUsize,
    pub stalled: AtomicUsize,
}

pub static PROGRESS: Progress = Progress {
    sent: AtomicUsize::new(0),
    done: AtomicUsize::new(0),
    ok: AtomicUsize::new(0),
    errors: AtomicUsize::new(0),
    stalled: AtomicUsize::new(0),
};

impl Progress {
    /// `done/total ok errors stalled in-flight`, for one status line.
    pub fn line(&self, total: usize) -> String {
        let (sent, done) = (self.sent.load(Ordering::Relaxed), self.done.load(Ordering::Relaxed));
        format!(
            "{done}/{total} done  ok {}  errors {}  stalled {}  in flight {}",
            self.ok.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.stalled.load(Ordering::Relaxed),
            sent.saturating_sub(done)
        )
    }

    pub fn reset(&self) {
        for c in [&self.sent, &self.done, &self.ok, &self.errors, &self.stalled] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// [`crate::client::send`], counted in [`PROGRESS`].
async fn send(req: Request<'_>, t_run: Instant) -> Record {
    PROGRESS.sent.fetch_add(1, Ordering::Relaxed);
    let r = crate::client::send(req, t_run).await;
    let c = match r.outcome {
        Outcome::Ok => &PROGRESS.ok,
        Outcome::Stalled => &PROGRESS.stalled,
        _ => &PROGRESS.errors,
    };
    c.fetch_add(1, Ordering::Relaxed);
    PROGRESS.done.fetch_add(1, Ordering::Relaxed);
    r
}
use crate::{Rng, CORPUS};

#[derive(Clone, Debug)]
pub struct Workload {
    pub addr: String,
    pub model: String,
    pub max_tokens: u32,
    pub seed: u64,
    pub stall: Duration,
    pub timeout: Duration,
    /// Temperature of every request (0 = greedy).
    pub temperature: f64,
    /// Request ids are `<id_prefix>-<point>-<n>`: make it unique per run
    /// (servers may refuse a reused id).
    pub id_prefix: String,
    /// Send `"ignore_eos": true` (pdmesh and llama.cpp's server honour it), so every answer is max_tokens long.
    pub ignore_eos: bool,
}

impl Workload {
    fn body(&self, prompt: &str) -> String {
        self.chat_body(&serde_json::json!([{ "role": "user", "content": prompt }]))
    }

    fn chat_body(&self, messages: &serde_json::Value) -> String {
        let mut b = serde_json::json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": true,
            "stream_options": { "include_usage": true },
        });
        if self.ignore_eos {
            b["ignore_eos"] = serde_json::json!(true);
        }
        b.to_string()
    }
}

/// Run one closed-loop point. `stop` ends it early (no new requests).
pub async fn closed_loop(
    w: &Workload,
    concurrency: usize,
    requests: usize,
    max_time: Duration,
    stop: Arc<AtomicBool>,
    point: usize,
) -> (Vec<Record>, f64) {
    let t_run = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    // Prompts drawn up front from the seed: the same run sends the same prompts.
    let mut rng = Rng::new(w.seed ^ (point as u64) << 32);
    let prompts: Arc<Vec<&'static str>> = Arc::new((0..requests).map(|_| CORPUS[rng.below(CORPUS.len())]).collect());
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (w, next, prompts, stop) = (w.clone(), next.clone(), prompts.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                if stop.load(Ordering::Relaxed) || t_run.elapsed() > max_time {
                    return out;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= prompts.len() {
                    return out;
                }
                let req = Request {
                    addr: &w.addr,
                    path: "/v1/chat/completions",
                    body: w.body(prompts[i]),
                    request_id: format!("{}-{point}-{i}", w.id_prefix),
                    stall: w.stall,
                    timeout: w.timeout,
                };
                out.push(send(req, t_run).await);
            }
        }));
    }
    let mut records = Vec::new();
    for t in tasks {
        if let Ok(r) = t.await {
            records.extend(r);
        }
    }
    (records, t_run.elapsed().as_secs_f64())
}

/// Open loop: `requests` arrivals at Poisson times of mean rate `rate`
/// per second (seeded), each sent when it arrives whatever is in flight (at
/// most `max_in_flight` at once, so the load stays bounded).
pub async fn poisson(
    w: &Workload,
    rate: f64,
    requests: usize,
    max_in_flight: usize,
    max_time: Duration,
    stop: Arc<AtomicBool>,
    point: usize,
) -> (Vec<Record>, f64) {
    let t_run = Instant::now();
    let mut rng = Rng::new(w.seed ^ (point as u64) << 32 ^ 0x5050);
    let gate = Arc::new(tokio::sync::Semaphore::new(max_in_flight.max(1)));
    let mut at = 0.0f64;
    let mut tasks = Vec::new();
    for i in 0..requests {
        // Exponential inter-arrival time: -ln(U) / rate.
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        at += -(1.0 - u).ln() / rate.max(1e-9);
        let when = t_run + Duration::from_secs_f64(at);
        if stop.load(Ordering::Relaxed) || when.duration_since(t_run) > max_time {
            break;
        }
        tokio::time::sleep_until(when.into()).await;
        let Ok(permit) = gate.clone().acquire_owned().await else { break };
        let w = w.clone();
        let prompt = CORPUS[rng.below(CORPUS.len())];
        tasks.push(tokio::spawn(async move {
            let req = Request {
                addr: &w.addr,
                path: "/v1/chat/completions",
                body: w.body(prompt),
                request_id: format!("{}-{point}-{i}", w.id_prefix),
                stall: w.stall,
                timeout: w.timeout,
            };
            let r = send(req, t_run).await;
            drop(permit);
            r
        }));
    }
    let mut records = Vec::new();
    for t in tasks {
        if let Ok(r) = t.await {
            records.push(r);
        }
    }
    (records, t_run.elapsed().as_secs_f64())
}

/// Agentic sessions: `sessions` run at once; each does `rounds` rounds,
/// every round re-sending the whole history plus the previous answer and a
/// synthetic tool result, with `think` between rounds. A failed round ends
/// its session (the rest of its rounds are not sent).
pub async fn agentic(
    w: &Workload,
    sessions: usize,
    rounds: usize,
    think: Duration,
    stop: Arc<AtomicBool>,
    point: usize,
) -> (Vec<Record>, f64) {
    let t_run = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..sessions {
        let (w, stop) = (w.clone(), stop.clone());
        let mut rng = Rng::new(w.seed ^ (point as u64) << 32 ^ (s as u64) << 8 ^ 0xA6E7);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut history = vec![
                serde_json::json!({ "role": "system", "content": "You are an agent. Use the tool results to finish the task." }),
                serde_json::json!({ "role": "user", "content": CORPUS[rng.below(CORPUS.len())] }),
            ];
            for r in 0..rounds {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if r > 0 {
                    tokio::time::sleep(think).await;
                }
                let body = w.chat_body(&serde_json::Value::Array(history.clone()));
                let rec = send(Request { addr: &w.addr, path: "/v1/chat/completions", body, request_id: format!("{}-{point}-s{s}-r{r}", w.id_prefix), stall: w.stall, timeout: w.timeout }, t_run).await;
                let ok = rec.outcome == Outcome::Ok;
                history.push(serde_json::json!({ "role": "assistant", "content": rec.text }));
                history.push(serde_json::json!({ "role": "tool", "content": format!("tool result {r}: status=ok items={}", rng.below(100)) }));
                out.push(rec);
                if !ok {
                    break;
                }
            }
            out
        }));
    }
    let mut records = Vec::new();
    for t in tasks {
        if let Ok(r) = t.await {
            records.extend(r);
        }
    }
    (records, t_run.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_counts_in_flight() {
        let p = Progress::default();
        p.sent.store(5, Ordering::Relaxed);
        p.done.store(3, Ordering::Relaxed);
        p.ok.store(2, Ordering::Relaxed);
        p.stalled.store(1, Ordering::Relaxed);
        assert_eq!(p.line(10), "3/10 done  ok 2  errors 0  stalled 1  in flight 2");
        p.reset();
        assert_eq!(p.line(10), "0/10 done  ok 0  errors 0  stalled 0  in flight 0");
    }
}
