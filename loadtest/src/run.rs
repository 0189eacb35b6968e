//! Closed-loop load: at each concurrency C, C clients each send their next
//! request as soon as the previous one ends, until the point's request
//! budget is spent (or its time budget, or Ctrl-C).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{Outcome, Record, Request};

/// Pause of a closed-loop client after a transport failure (refused, reset).
const TRANSPORT_PAUSE: Duration = Duration::from_millis(100);

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
    /// What the prompts share (or do not), for prompt-cache studies.
    pub prompts: PromptStyle,
}

/// How prompts are built, so a run can measure prompt caches or defeat them.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PromptStyle {
    /// A random tag opens every request (its first message), so no prompt
    /// cache, ours or the peer's, can reuse anything past a few tokens.
    pub unique: bool,
    /// Every request sends the same question (closed and Poisson modes).
    pub repeat: bool,
    /// A system prompt of about this many tokens, shared by every request.
    pub system_tokens: usize,
}

/// A system prompt of about `tokens` tokens (English prose runs about four
/// characters a token), the same every time.
pub fn system_prompt(tokens: usize) -> String {
    const PARA: &str = "You are a meticulous assistant for a travel company. Answer briefly and politely, \
        check every date and price twice, never invent a booking reference, and say so when you do not know. ";
    let mut s = String::new();
    while s.len() < tokens * 4 {
        s.push_str(PARA);
    }
    s.truncate(tokens * 4);
    s
}

impl Workload {
    fn body(&self, prompt: &str, rng: &mut Rng) -> String {
        let mut messages = vec![serde_json::json!({ "role": "user", "content": prompt })];
        if let Some(system) = self.system(None, rng) {
            messages.insert(0, serde_json::json!({ "role": "system", "content": system }));
        }
        self.chat_body(&serde_json::Value::Array(messages))
    }

    /// The system message: `base` (or none) behind the shared system
    /// prompt, behind a random tag when prompts must be unique.
    fn system(&self, base: Option<&str>, rng: &mut Rng) -> Option<String> {
        let p = &self.prompts;
        let mut parts: Vec<String> = Vec::new();
        if p.unique {
            // Random first (the run's id after it): no two requests, runs or sides share more than "[".
            parts.push(format!("[{:016x} {}]", rng.next_u64(), self.id_prefix));
        }
        if p.system_tokens > 0 {
            parts.push(system_prompt(p.system_tokens));
        }
        parts.extend(base.map(str::to_string));
        (!parts.is_empty()).then(|| parts.join(" "))
    }

    /// The question of the `i`-th request.
    fn question(&self, rng: &mut Rng) -> &'static str {
        if self.prompts.repeat {
            CORPUS[0]
        } else {
            CORPUS[rng.below(CORPUS.len())]
        }
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
    let prompts: Arc<Vec<String>> = Arc::new(
        (0..requests)
            .map(|_| {
                let q = w.question(&mut rng);
                w.body(q, &mut rng)
            })
            .collect(),
    );
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
                    body: prompts[i].clone(),
                    request_id: format!("{}-{point}-{i}", w.id_prefix),
                    stall: w.stall,
                    timeout: w.timeout,
                };
                let r = send(req, t_run).await;
                // A client that could not reach the server waits a little
                // before its next request, as a real one would, instead of
                // spinning through the prompts while the target restarts.
                if matches!(r.outcome, Outcome::Transport { .. }) {
                    tokio::time::sleep(TRANSPORT_PAUSE).await;
                }
                out.push(r);
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
        let q = w.question(&mut rng);
        let body = w.body(q, &mut rng);
        tasks.push(tokio::spawn(async move {
            let req = Request {
                addr: &w.addr,
                path: "/v1/chat/completions",
                body,
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
            let agent = "You are an agent. Use the tool results to finish the task.";
            let system = w.system(Some(agent), &mut rng).unwrap_or_default();
            let mut history = vec![
                serde_json::json!({ "role": "system", "content": system }),
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

    fn workload(prompts: PromptStyle) -> Workload {
        Workload {
            addr: String::new(),
            model: "m".into(),
            max_tokens: 4,
            seed: 1,
            stall: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            temperature: 0.0,
            id_prefix: "lt-run".into(),
            ignore_eos: false,
            prompts,
        }
    }

    /// The messages of `n` request bodies.
    fn messages(w: &Workload, n: usize) -> Vec<serde_json::Value> {
        let mut rng = Rng::new(3);
        (0..n)
            .map(|_| {
                let q = w.question(&mut rng);
                let b: serde_json::Value = serde_json::from_str(&w.body(q, &mut rng)).unwrap();
                b["messages"].clone()
            })
            .collect()
    }

    #[test]
    fn unique_prompts_differ_from_their_first_characters_on() {
        let m = messages(&workload(PromptStyle { unique: true, ..Default::default() }), 8);
        let firsts: std::collections::HashSet<String> =
            m.iter().map(|m| m[0]["content"].as_str().unwrap()[..8].to_string()).collect();
        assert_eq!(firsts.len(), 8, "every request opens differently");
        assert_eq!(m[0][0]["role"], "system");
    }

    #[test]
    fn a_shared_system_prompt_and_exact_repeats() {
        let m = messages(&workload(PromptStyle { repeat: true, system_tokens: 300, ..Default::default() }), 4);
        let system = m[0][0]["content"].as_str().unwrap();
        assert_eq!(system.len(), 1200, "about four characters a token");
        assert!(m.iter().all(|x| *x == m[0]), "every request is the same");
        let plain = messages(&workload(PromptStyle::default()), 1);
        assert_eq!(plain[0].as_array().unwrap().len(), 1, "no system message unless asked");
    }
}
