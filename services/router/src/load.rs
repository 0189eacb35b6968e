//! The load the router sees on each worker: its own in-flight requests per
//! worker (counted by a guard while a request runs) and each worker's own
//! load, polled; and, for workers with a prefix cache, a mirror of
//! which prompt blocks each one holds, kept from the worker's own cache log
//! (so other routers' requests count, and a restarted worker's empty cache
//! is known at the next poll).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_prefix::{BlockHash, Mirror};

use pdmesh_core::discovery::Instance;
use pdmesh_core::peers::Peers;
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::prefill::v1 as ppb;
use tonic::Request;

use crate::pick::{Candidate, Polled};
use pdmesh_core::outlier::{Standing, Watch};
use pdmesh_core::task::AbortOnDrop;

/// This router's in-flight counts and the workers' polled loads, by
/// address, and its own evidence of which workers have stopped.
#[derive(Default)]
pub struct Loads {
    local: Arc<Mutex<HashMap<String, u32>>>,
    polled: Mutex<HashMap<String, Polled>>,
    caches: Mutex<HashMap<String, WorkerCache>>,
    pub outliers: Arc<Watch>,
}

/// What the router knows of one worker's prefix cache.
#[derive(Default)]
struct WorkerCache {
    mirror: Mirror,
    seed: BlockHash,
    block_size: usize,
    /// Blocks of prompts this router just sent there, until the worker's
    /// log reports them (a burst of equal prompts sticks together).
    sent: HashMap<BlockHash, Instant>,
}

/// How long blocks this router sent count as held before the worker's
/// own log confirms them.
const SENT_TTL: Duration = Duration::from_secs(2);

impl WorkerCache {
    fn overlap(&self, hashes: &[BlockHash], now: Instant) -> u32 {
        let held =
            |h: &BlockHash| self.mirror.holds(h) || self.sent.get(h).is_some_and(|t| now.duration_since(*t) < SENT_TTL);
        hashes.iter().take_while(|h| held(h)).count() as u32
    }
}

/// A request's prompt, for cache-aware picks: its tokens, hashed per worker
/// (workers of different block sizes or models hash differently).
pub struct Prompt<'a> {
    pub tokens: &'a [u32],
    /// Count its blocks as held by the chosen worker until its log says
    /// so: right for a prefill worker, which caches a prompt as it computes
    /// it; not for a decode worker, which holds it only once the KV arrived.
    pub remember: bool,
}

/// What a cache-aware pick saw of the prompt on the chosen worker.
#[derive(Clone, Copy, Debug, Default)]
pub struct Overlap {
    /// The prompt's full blocks (by the chosen worker's block size).
    pub prompt_blocks: u32,
    pub block_size: u32,
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
    /// No load known yet; workers judged with `knobs`.
    pub fn new(knobs: pdmesh_core::outlier::Knobs) -> Loads {
        Loads { outliers: Arc::new(Watch::new(knobs)), ..Default::default() }
    }

    /// Choose one of `list` with `policy` and count a request against it
    /// until the returned guard drops (one lock: concurrent picks see each
    /// other). Returns the index and what the policy knew of it.
    /// Workers the router has evidence against are passed over while
    /// better ones are left: ejected ones, then silent ones, are picked
    /// only when nothing else is; one on probation takes one request at a time.
    pub fn pick<B>(
        &self,
        list: &[Instance],
        tried: &[String],
        prompt: Option<Prompt<'_>>,
        policy: impl Fn(&[Candidate], &Overlap) -> Option<(usize, B)>,
    ) -> Option<(usize, Candidate, Overlap, B, Busy)> {
        let now = Instant::now();
        let standing: Vec<Standing> = {
            let o = self.outliers.lock();
            let busy = lock(&self.local);
            list.iter()
                .map(|i| match o.standing(&i.grpc_addr, now) {
                    Standing::Probe if busy.get(&i.grpc_addr).copied().unwrap_or(0) > 0 => Standing::Ejected,
                    s => s,
                })
                .collect()
        };
        [Standing::Probe, Standing::Ejected, Standing::Silent].into_iter().find_map(|worst| {
            let shut: Vec<String> = list
                .iter()
                .zip(&standing)
                .filter(|(_, s)| **s > worst)
                .map(|(i, _)| i.grpc_addr.clone())
                .chain(tried.iter().cloned())
                .collect();
            self.pick_among(list, &shut, prompt.as_ref(), &policy)
        })
    }

    fn pick_among<B>(
        &self,
        list: &[Instance],
        tried: &[String],
        prompt: Option<&Prompt<'_>>,
        policy: &impl Fn(&[Candidate], &Overlap) -> Option<(usize, B)>,
    ) -> Option<(usize, Candidate, Overlap, B, Busy)> {
        let mut local = lock(&self.local);
        let mut caches = lock(&self.caches);
        let now = Instant::now();
        let mut hashed: HashMap<(BlockHash, usize), Vec<BlockHash>> = HashMap::new();
        // The prompt's full blocks by some worker's block size, for the policy.
        let mut prompt_blocks = 0;
        let candidates: Vec<Candidate> = {
            let polled = lock(&self.polled);
            list.iter()
                .map(|i| {
                    let cache = caches.get(&i.grpc_addr).filter(|c| c.block_size > 0);
                    let overlap_blocks = match (prompt, cache) {
                        (Some(p), Some(c)) => {
                            let hashes = hashed
                                .entry((c.seed, c.block_size))
                                .or_insert_with(|| pdmesh_prefix::chain(c.seed, c.block_size, p.tokens, usize::MAX));
                            prompt_blocks = hashes.len() as u32;
                            c.overlap(hashes, now)
                        }
                        _ => 0,
                    };
                    Candidate {
                        in_flight_here: local.get(&i.grpc_addr).copied().unwrap_or(0),
                        polled: polled.get(&i.grpc_addr).copied().unwrap_or_default(),
                        tried: tried.contains(&i.grpc_addr),
                        overlap_blocks,
                    }
                })
                .collect()
        };
        let (i, branch) = policy(&candidates, &Overlap { prompt_blocks, block_size: 0 })?;
        let remember = prompt.is_some_and(|p| p.remember);
        let addr = list[i].grpc_addr.clone();
        let mut overlap = Overlap::default();
        if let Some(c) = caches.get_mut(&addr) {
            if let Some(h) = hashed.get(&(c.seed, c.block_size)) {
                // The chosen worker's own view: its block size, its count.
                overlap = Overlap { prompt_blocks: h.len() as u32, block_size: c.block_size as u32 };
                c.sent.retain(|_, t| now.duration_since(*t) < SENT_TTL);
                if remember {
                    c.sent.extend(h.iter().map(|h| (*h, now)));
                }
            }
        }
        *local.entry(addr.clone()).or_default() += 1;
        Some((i, candidates[i], overlap, branch, Busy { local: self.local.clone(), addr }))
    }

    /// The cursor to poll `addr`'s prefix-cache log from.
    fn cache_cursor(&self, addr: &str) -> (u64, u64) {
        lock(&self.caches).get(addr).map(|c| c.mirror.cursor()).unwrap_or_default()
    }

    /// Apply what a worker's Load said of its prefix cache (None: it has none).
    fn follow_cache(&self, addr: &str, d: Option<common::PrefixCacheDelta>) {
        match d {
            Some(d) => self.apply_cache(addr, d),
            None => self.drop_cache(addr),
        }
    }

    /// `addr` has no prefix cache (any more).
    fn drop_cache(&self, addr: &str) {
        lock(&self.caches).remove(addr);
    }

    /// Apply a polled change of `addr`'s prefix cache.
    fn apply_cache(&self, addr: &str, d: common::PrefixCacheDelta) {
        let mut caches = lock(&self.caches);
        let c = caches.entry(addr.to_string()).or_default();
        c.seed = d.hash_seed;
        c.block_size = d.block_size as usize;
        if d.reset {
            c.sent.clear();
        }
        c.mirror.apply(pdmesh_prefix::Delta {
            epoch: d.epoch,
            seq: d.seq,
            reset: d.reset,
            stored: d.stored,
            removed: d.removed,
        });
    }

    /// Forget what was known of workers no longer in discovery (gone, or moved).
    fn forget_gone(&self, live: &HashSet<String>) {
        lock(&self.caches).retain(|addr, _| live.contains(addr));
        lock(&self.polled).retain(|addr, _| live.contains(addr));
        self.outliers.lock().retain(|addr| live.contains(addr), Instant::now());
    }
}

/// One worker's Load, or None when it did not answer within a few
/// seconds; its liveness goes to the outliers either way.
async fn poll_one(loads: &Loads, peers: &Peers, inst: &Instance) -> Option<Polled> {
    let ch = peers.channel(inst).ok()?;
    let timeout = Duration::from_secs(5);
    let addr = &inst.grpc_addr;
    let (cache_epoch, cache_seq) = loads.cache_cursor(addr);
    loads.outliers.lock().asked(addr, (peers.service(), &inst.id), Instant::now());
    let answered = |stalled_ms, step_ms| loads.outliers.lock().answered(addr, Instant::now(), stalled_ms, step_ms);
    if peers.service() == "decode" {
        let mut req = Request::new(dpb::LoadRequest { cache_epoch, cache_seq });
        req.set_timeout(timeout);
        let l = dpb::decode_client::DecodeClient::new(ch).load(req).await.ok()?.into_inner();
        answered(l.stalled_ms, l.step_ms);
        loads.follow_cache(addr, l.prefix_cache);
        let kv_free = l.kv_blocks_total.saturating_sub(l.kv_blocks_used);
        return Some(Polled { busy: l.running + l.queued, kv_free, queued_tokens: 0 });
    }
    let mut req = Request::new(ppb::LoadRequest { cache_epoch, cache_seq });
    req.set_timeout(timeout);
    let l = ppb::prefill_client::PrefillClient::new(ch).load(req).await.ok()?.into_inner();
    answered(l.stalled_ms, l.step_ms);
    loads.follow_cache(addr, l.prefix_cache);
    let kv_free = l.kv_blocks_total.saturating_sub(l.kv_blocks_used);
    Some(Polled { busy: l.running + l.queued, kv_free, queued_tokens: l.queued_tokens })
}

/// Poll one worker's Load every `every`, until aborted. Each worker has
/// its own poller, so one that does not answer delays no other.
async fn poll_worker(loads: Arc<Loads>, peers: Peers, inst: Instance, every: Duration) {
    loop {
        if let Some(p) = poll_one(&loads, &peers, &inst).await {
            lock(&loads.polled).insert(inst.grpc_addr.clone(), p);
        }
        tokio::time::sleep(every).await;
    }
}

/// Keep a poller on every prefill and decode worker in discovery (each
/// polls every `every`), and forget the workers that left, forever.
pub async fn poll_loads(loads: Arc<Loads>, workers: [Peers; 2], every: Duration) {
    let mut pollers: HashMap<String, AbortOnDrop<()>> = HashMap::new();
    loop {
        let mut live = HashSet::new();
        for peers in &workers {
            for inst in peers.instances() {
                live.insert(inst.grpc_addr.clone());
                if !pollers.contains_key(&inst.grpc_addr) {
                    let task = tokio::spawn(poll_worker(loads.clone(), peers.clone(), inst.clone(), every));
                    pollers.insert(inst.grpc_addr.clone(), AbortOnDrop(task));
                }
            }
        }
        pollers.retain(|a, _| live.contains(a));
        loads.forget_gone(&live);
        tokio::time::sleep(every).await;
    }
}
