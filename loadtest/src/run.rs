//! Closed-loop load: at each concurrency C, C clients each send their next
//! request as soon as the previous one ends, until the point's request
//! budget is spent (or its time budget, or Ctrl-C).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{send, Record, Request};
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
}

impl Workload {
    fn body(&self, prompt: &str) -> String {
        serde_json::json!({
            "model": self.model,
            "messages": [{ "role": "user", "content": prompt }],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": true,
            "stream_options": { "include_usage": true },
        })
        .to_string()
    }
}

/// Run one closed-loop point. `stop` ends it early (no new requests).
pub async fn closed_loop(w: &Workload, concurrency: usize, requests: usize, max_time: Duration, stop: Arc<AtomicBool>, point: usize) -> (Vec<Record>, f64) {
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
                let req = Request { addr: &w.addr, path: "/v1/chat/completions", body: w.body(prompts[i]), request_id: format!("lt-{}-{point}-{i}", w.seed), stall: w.stall, timeout: w.timeout };
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
