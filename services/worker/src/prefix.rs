//! A worker's prefix cache seen from outside its engine loop: counters,
//! block states and the log routers follow. The loop refreshes it after
//! each step; `/metrics` and the `Load` RPC read it.

use std::sync::{Mutex, MutexGuard};

use pdmesh_core::metrics::Text;
use pdmesh_core::vocab::metric;
use pdmesh_engine::blocks::{Blocks, PrefixCounters};
use pdmesh_prefix::{BlockHash, CacheLog};
use pdmesh_proto::common::v1 as common;

/// Events a router may lag behind before it must reload the whole set.
const CACHE_LOG_KEEP: usize = 16_384;

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

/// The view behind a lock, shared by the loop and the handlers.
pub struct SharedPrefix(Mutex<PrefixView>);

impl SharedPrefix {
    /// An empty view of `blocks` (a fresh epoch: routers forget what they knew).
    pub fn new(blocks: &Blocks) -> SharedPrefix {
        SharedPrefix(Mutex::new(PrefixView {
            hashing: blocks.hashing(),
            counters: PrefixCounters::default(),
            cached: 0,
            evictable: 0,
            free: blocks.total(),
            log: CacheLog::new(pdmesh_prefix::fresh_epoch(), CACHE_LOG_KEEP),
        }))
    }

    pub fn lock(&self) -> MutexGuard<'_, PrefixView> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take the cache's new events and counts (from the engine loop).
    pub fn refresh(&self, blocks: &mut Blocks) {
        let events = blocks.take_events();
        let mut p = self.lock();
        p.log.apply(events);
        p.counters = blocks.counters();
        p.cached = blocks.cached();
        p.evictable = blocks.evictable();
        p.free = blocks.available() - blocks.evictable();
    }

    /// What the caller at cursor `(epoch, seq)` lacks; None without a cache.
    pub fn delta(&self, epoch: u64, seq: u64) -> Option<common::PrefixCacheDelta> {
        let p = self.lock();
        let (seed, block_size) = p.hashing?;
        let d = p.log.since(epoch, seq);
        Some(common::PrefixCacheDelta {
            epoch: d.epoch,
            seq: d.seq,
            reset: d.reset,
            stored: d.stored,
            removed: d.removed,
            hash_seed: seed,
            block_size: block_size as u32,
            cached_blocks: p.log.len() as u32,
        })
    }

    /// The free-list and prefix-cache families, named for this worker's kind.
    pub fn render(&self, n: &metric::Worker, block_bytes: usize, t: &mut Text) {
        let p = self.lock();
        let bytes = p.cached as f64 * block_bytes as f64;
        t.gauge(n.kv_blocks_free, "KV blocks on the free list (neither held nor cached).", p.free as f64)
            .gauge(n.prefix_cached_blocks, "KV blocks in the prefix cache, held or not.", p.cached as f64)
            .gauge(
                n.prefix_evictable_blocks,
                "Prefix-cache blocks no request holds (evicted first when room is needed).",
                p.evictable as f64,
            )
            .gauge(n.prefix_cached_bytes, "Bytes of KV in the prefix cache.", bytes)
            .counter(n.prefix_lookups_total, "Prompts looked up in the prefix cache.", p.counters.lookups)
            .counter(n.prefix_hits_total, "Prompts that reused at least one cached block.", p.counters.hits)
            .counter(
                n.prefix_hit_tokens_total,
                "Prompt tokens whose KV came from the prefix cache instead of being computed.",
                p.counters.hit_tokens,
            )
            .counter(n.prefix_stored_blocks_total, "Blocks stored in the prefix cache.", p.counters.stored)
            .counter(n.prefix_evictions_total, "Prefix-cache blocks evicted.", p.counters.evictions);
    }
}
