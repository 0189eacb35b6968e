//! Samples the targets' Prometheus /metrics while load runs, keeping the
//! load gauges (running, queued, waiting for KV, KV blocks used and pinned,
//! in flight), so a report shows queueing as queueing.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Gauge name endings worth keeping.
const KEEP: &[&str] = &["_running", "_queued", "_awaiting_kv", "_kv_blocks_used", "_kv_blocks_pinned", "_in_flight"];

#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub addr: String,
    pub values: std::collections::BTreeMap<String, f64>,
}

fn get(addr: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

/// The load gauges in a Prometheus text body.
pub fn load_gauges(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(k, _)| !k.contains('{') && KEEP.iter().any(|e| k.ends_with(e)))
        .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_string(), v)))
        .collect()
}

/// Samples every `every` until dropped; `take` returns what was gathered.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl Sampler {
    pub fn start(addrs: Vec<String>, every: Duration, t_run: Instant) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (s2, out) = (stop.clone(), samples.clone());
        std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) && !addrs.is_empty() {
                for a in &addrs {
                    if let Some(text) = get(a) {
                        let values = load_gauges(&text);
                        out.lock().unwrap_or_else(|e| e.into_inner()).push(Sample {
                            t_s: t_run.elapsed().as_secs_f64(),
                            addr: a.clone(),
                            values,
                        });
                    }
                }
                std::thread::sleep(every);
            }
        });
        Sampler { stop, samples }
    }

    pub fn take(&self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The HTTP (admin) addresses of every instance `meshctl status --json` lists.
pub fn from_meshctl(meshctl: &str, registry_dir: &str) -> Result<Vec<String>, String> {
    let out = std::process::Command::new(meshctl)
        .args(["status", "--json", "--registry-dir", registry_dir])
        .output()
        .map_err(|e| format!("{meshctl}: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("meshctl status --json: {e}"))?;
    Ok(v["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["http_addr"].as_str().map(String::from))
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn keeps_only_load_gauges() {
        let t = "# HELP x\npdmesh_decode_running 3\npdmesh_decode_steps_total 9\npdmesh_decode_kv_blocks_used 12\npdmesh_router_requests_total{outcome=\"ok\"} 4\n";
        let g = super::load_gauges(t);
        assert_eq!(g.len(), 2);
        assert_eq!(g["pdmesh_decode_running"], 3.0);
    }
}
