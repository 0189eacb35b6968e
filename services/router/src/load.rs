//! The load the router sees on each worker: its own in-flight requests per
//! worker (counted by a guard while a request runs) and each worker's own
//! load, polled.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_core::discovery::Instance;
use pdmesh_core::peers::Peers;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::prefill::v1 as ppb;
use tonic::Request;

use crate::pick::{Candidate, Polled};

/// This router's in-flight counts and the workers' polled loads, by address.
#[derive(Default)]
pub struct Loads {
    local: Arc<Mutex<HashMap<String, u32>>>,
    polled: Mutex<HashMap<String, Polled>>,
}

/// Counts a request against a worker while alive.
pub struct Busy {
    local: Arc<Mutex<HashMap<String, u32>>>,
    addr: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.local).get_mut(&self.addr) {
            *n = n.saturating_sub(1);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Loads {
    /// Choose one of `list` with `policy` and count a request against it
    /// until the returned guard drops (one lock: concurrent picks see each
    /// other). Returns the index and what the policy knew of it.
    pub fn pick(
        &self,
        list: &[Instance],
        tried: &[String],
        policy: impl FnOnce(&[Candidate]) -> Option<usize>,
    ) -> Option<(usize, Candidate, Busy)> {
        let mut local = lock(&self.local);
        let candidates: Vec<Candidate> = {
            let polled = lock(&self.polled);
            list.iter()
                .map(|i| Candidate {
                    in_flight_here: local.get(&i.grpc_addr).copied().unwrap_or(0),
                    polled: polled.get(&i.grpc_addr).copied().unwrap_or_default(),
                    tried: tried.contains(&i.grpc_addr),
                })
                .collect()
        };
        let i = policy(&candidates)?;
        let addr = list[i].grpc_addr.clone();
        *local.entry(addr.clone()).or_default() += 1;
        Some((i, candidates[i], Busy { local: self.local.clone(), addr }))
    }

    fn replace_polled(&self, fresh: HashMap<String, Polled>) {
        *lock(&self.polled) = fresh;
    }
}

/// One worker's Load, or None when it did not answer within a second.
async fn poll_one(peers: &Peers, inst: &Instance) -> Option<Polled> {
    let ch = peers.channel(inst).ok()?;
    let timeout = Duration::from_secs(1);
    let (running, queued, total, used) = if peers.service() == "decode" {
        let mut req = Request::new(dpb::LoadRequest {});
        req.set_timeout(timeout);
        let l = dpb::decode_client::DecodeClient::new(ch).load(req).await.ok()?.into_inner();
        (l.running, l.queued, l.kv_blocks_total, l.kv_blocks_used)
    } else {
        let mut req = Request::new(ppb::LoadRequest {});
        req.set_timeout(timeout);
        let l = ppb::prefill_client::PrefillClient::new(ch).load(req).await.ok()?.into_inner();
        (l.running, l.queued, l.kv_blocks_total, l.kv_blocks_used)
    };
    Some(Polled { busy: running + queued, kv_free: total.saturating_sub(used) })
}

/// Poll every prefill and decode worker's Load every `every`, forever.
pub async fn poll_loads(loads: Arc<Loads>, workers: [Peers; 2], every: Duration) {
    loop {
        let mut fresh = HashMap::new();
        for peers in &workers {
            for inst in peers.instances() {
                if let Some(p) = poll_one(peers, &inst).await {
                    fresh.insert(inst.grpc_addr.clone(), p);
                }
            }
        }
        loads.replace_polled(fresh);
        tokio::time::sleep(every).await;
    }
}
