//! Which KV blocks are free, held by sequences, or cached for reuse.
//!
//! Every block is in exactly one state:
//! - **free**: on the free list, holding nothing anyone will read;
//! - **held**: referenced by one or more sequences (`refs > 0`); a block of
//!   a cached prefix is held by every sequence that reuses it, and by a
//!   prefilled sequence until its transfer ends;
//! - **cached, unreferenced**: holds the KV of a known prefix block (its
//!   chained hash and token ids) that no sequence uses now. These sit in
//!   LRU order and are evicted (freed) oldest first when an allocation needs
//!   room or when there are more than the cache's capacity.
//!
//! A cached block is only ever written before it is cached: once a full
//! prompt block has its KV it is stored and read-only, and eviction only
//! touches unreferenced blocks, so a block being read or transferred is
//! never freed under its reader.

use std::collections::{BTreeMap, HashMap};

use pdmesh_prefix::{BlockHash, Event};
use serde::Serialize;

use crate::error::{EngineError, Result};

/// Counters of the prefix cache since the engine started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixCounters {
    /// Prompts looked up.
    pub lookups: u64,
    /// Prompts that reused at least one block.
    pub hits: u64,
    /// Prompt tokens whose KV was reused instead of computed.
    pub hit_tokens: u64,
    /// Blocks stored for reuse.
    pub stored: u64,
    /// Cached blocks evicted (their KV dropped).
    pub evictions: u64,
}

/// A cached block's identity: checked on every hit, so a hash collision
/// can never hand out another prefix's KV. A *partial* block (fewer tokens
/// than the block size: a prompt's last block) is never shared: a request
/// whose prefix ends inside it gets a copy of the positions it matches.
#[derive(Debug)]
struct Entry {
    hash: BlockHash,
    parent: BlockHash,
    tokens: Box<[u32]>,
    /// Position in the LRU order while unreferenced.
    tick: u64,
}

/// What a prompt can reuse, from [`Blocks::lookup`]: whole cached blocks,
/// now held by the caller, and where to copy the head of the next block from.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reuse {
    pub blocks: Vec<u32>,
    /// `(cached block, positions)`: its first positions match the prompt
    /// after `blocks`. Held by the caller until it has copied them
    /// ([`Blocks::release`] it then).
    pub partial: Option<(u32, usize)>,
}

/// The prefix index over the arena's blocks.
#[derive(Debug)]
struct PrefixIndex {
    /// Most unreferenced cached blocks kept.
    capacity: usize,
    seed: BlockHash,
    block_size: usize,
    by_hash: HashMap<BlockHash, u32>,
    /// Cached blocks by their parent's hash (for partial matches).
    children: HashMap<BlockHash, Vec<u32>>,
    entries: Vec<Option<Entry>>,
    /// Unreferenced cached blocks, least recently used first.
    lru: BTreeMap<u64, u32>,
    next_tick: u64,
    /// Stored/removed since the last [`Blocks::take_events`].
    events: Vec<Event>,
    counters: PrefixCounters,
}

/// The arena's block states.
#[derive(Debug)]
pub struct Blocks {
    total: usize,
    free: Vec<u32>,
    refs: Vec<u32>,
    prefix: Option<PrefixIndex>,
}

/// How the prefix cache is set up: `capacity` 0 switches it off.
#[derive(Clone, Copy, Debug)]
pub struct PrefixConfig {
    pub capacity: usize,
    pub seed: BlockHash,
    pub block_size: usize,
}

impl Blocks {
    pub fn new(total: usize, prefix: Option<PrefixConfig>) -> Blocks {
        let prefix = prefix.filter(|p| p.capacity > 0 && p.block_size > 0).map(|p| PrefixIndex {
            capacity: p.capacity,
            seed: p.seed,
            block_size: p.block_size,
            by_hash: HashMap::new(),
            children: HashMap::new(),
            entries: (0..total).map(|_| None).collect(),
            lru: BTreeMap::new(),
            next_tick: 0,
            events: Vec::new(),
            counters: PrefixCounters::default(),
        });
        Blocks {
            total,
            // Pop from the end: lowest ids first.
            free: (0..total as u32).rev().collect(),
            refs: vec![0; total],
            prefix,
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks an allocation can take: free ones plus evictable cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable()
    }

    /// Blocks held by sequences.
    pub fn held(&self) -> usize {
        self.total - self.available()
    }

    /// Cached blocks no sequence holds (evicted first when room is needed).
    pub fn evictable(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.lru.len())
    }

    /// Cached blocks, held or not.
    pub fn cached(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.by_hash.len())
    }

    pub fn prefix_enabled(&self) -> bool {
        self.prefix.is_some()
    }

    pub fn counters(&self) -> PrefixCounters {
        self.prefix.as_ref().map(|p| p.counters).unwrap_or_default()
    }

    /// The chain seed and block size hashes are computed with, when caching.
    pub fn hashing(&self) -> Option<(BlockHash, usize)> {
        self.prefix.as_ref().map(|p| (p.seed, p.block_size))
    }

    /// Cache events since the last call (for readers of the worker's cache).
    pub fn take_events(&mut self) -> Vec<Event> {
        self.prefix.as_mut().map(|p| std::mem::take(&mut p.events)).unwrap_or_default()
    }

    /// Take `n` blocks, or none at all if fewer are available; cached
    /// blocks no one holds are evicted, least recently used first.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.available() {
            return Err(EngineError::KvFull { needed: n, free: self.available(), total: self.total });
        }
        while self.free.len() < n {
            self.evict_oldest();
        }
        let out = self.free.split_off(self.free.len() - n);
        for b in &out {
            self.refs[*b as usize] = 1;
        }
        Ok(out)
    }

    /// Drop one reference to each block (ids out of range are ignored). A
    /// block no one holds goes back to the free list, or, if cached, to the
    /// LRU order; blocks are visited last first, so a prefix's tail is
    /// evicted before its head.
    pub fn release(&mut self, blocks: &[u32]) {
        for b in blocks.iter().rev() {
            let Some(r) = self.refs.get_mut(*b as usize) else { continue };
            debug_assert!(*r > 0, "double free of KV block {b}");
            *r = r.saturating_sub(1);
            if *r > 0 {
                continue;
            }
            match self.prefix.as_mut().and_then(|p| p.touch(*b)) {
                Some(()) => {}
                None => self.free.push(*b),
            }
        }
        self.trim();
    }

    /// What the first `limit` positions of `tokens` (whose full blocks'
    /// chained hashes are `hashes`) can reuse: the cached blocks holding its
    /// leading full blocks, then the cached block sharing the longest head
    /// with the rest. Every hit is checked against the stored parent and
    /// token ids. Everything returned is held for the caller.
    pub fn lookup(&mut self, hashes: &[BlockHash], tokens: &[u32], limit: usize, at_least: usize) -> Reuse {
        let Some(p) = self.prefix.as_mut() else { return Reuse::default() };
        let bs = p.block_size;
        let limit = limit.min(tokens.len());
        let mut reuse = Reuse::default();
        let mut parent = p.seed;
        for (i, h) in hashes.iter().enumerate().take(limit / bs) {
            let want = &tokens[i * bs..(i + 1) * bs];
            let Some(b) = p.by_hash.get(h).copied().filter(|b| p.holds(*b, parent, want)) else { break };
            reuse.blocks.push(b);
            parent = *h;
        }
        let start = reuse.blocks.len() * bs;
        reuse.partial = p.best_head(parent, &tokens[start..limit.min(start + bs)]);
        p.counters.lookups += 1;
        let hit = start + reuse.partial.map_or(0, |(_, n)| n);
        if hit < at_least {
            return Reuse::default();
        }
        if hit > 0 {
            p.counters.hits += 1;
            p.counters.hit_tokens += hit as u64;
        }
        let held: Vec<u32> = reuse.blocks.iter().copied().chain(reuse.partial.map(|(b, _)| b)).collect();
        for b in held {
            self.hold(b);
        }
        reuse
    }

    /// One more reference to cached block `b` (out of the LRU order if it was unreferenced).
    fn hold(&mut self, b: u32) {
        if self.refs[b as usize] == 0 {
            if let Some(p) = self.prefix.as_mut() {
                let tick = p.entries[b as usize].as_ref().map(|e| e.tick);
                if let Some(t) = tick {
                    p.lru.remove(&t);
                }
            }
        }
        self.refs[b as usize] += 1;
    }

    /// Cache held block `block`, which now holds the KV of `tokens` after
    /// the prefix hashing to `parent`: a full block, or fewer tokens for a
    /// partial one (`hash` is then [`pdmesh_prefix::hash::block_hash`] of
    /// them, which no full block's hash equals). No-op if that prefix is
    /// cached already (in another block) or the block is. Only full blocks
    /// are told to routers ([`Blocks::take_events`]).
    pub fn store(&mut self, block: u32, hash: BlockHash, parent: BlockHash, tokens: &[u32]) {
        let Some(p) = self.prefix.as_mut() else { return };
        let b = block as usize;
        if tokens.is_empty() || tokens.len() > p.block_size {
            return;
        }
        if b >= self.total || self.refs[b] == 0 || p.entries[b].is_some() || p.by_hash.contains_key(&hash) {
            return;
        }
        p.entries[b] = Some(Entry { hash, parent, tokens: tokens.into(), tick: 0 });
        p.by_hash.insert(hash, block);
        p.children.entry(parent).or_default().push(block);
        if tokens.len() == p.block_size {
            p.events.push(Event::Stored(hash));
        }
        p.counters.stored += 1;
    }

    fn evict_oldest(&mut self) {
        let p = self.prefix.as_mut().expect("only cached blocks are evictable");
        let (_, b) = p.lru.pop_first().expect("an evictable block");
        p.forget(b);
        self.free.push(b);
    }

    /// Evict down to the capacity.
    fn trim(&mut self) {
        while self.prefix.as_ref().is_some_and(|p| p.lru.len() > p.capacity) {
            self.evict_oldest();
        }
    }
}

impl PrefixIndex {
    /// Put an unreferenced block in LRU order if cached; None if not cached.
    fn touch(&mut self, b: u32) -> Option<()> {
        let e = self.entries[b as usize].as_mut()?;
        e.tick = self.next_tick;
        self.next_tick += 1;
        self.lru.insert(e.tick, b);
        Some(())
    }

    fn forget(&mut self, b: u32) {
        let Some(e) = self.entries[b as usize].take() else { return };
        self.by_hash.remove(&e.hash);
        if let Some(siblings) = self.children.get_mut(&e.parent) {
            siblings.retain(|x| *x != b);
            if siblings.is_empty() {
                self.children.remove(&e.parent);
            }
        }
        if e.tokens.len() == self.block_size {
            self.events.push(Event::Removed(e.hash));
        }
        self.counters.evictions += 1;
    }

    /// Whether cached block `b` holds `tokens` (a full block) after `parent`.
    fn holds(&self, b: u32, parent: BlockHash, tokens: &[u32]) -> bool {
        self.entries[b as usize].as_ref().is_some_and(|e| e.parent == parent && *e.tokens == *tokens)
    }

    /// The cached block after `parent` whose tokens share the longest head
    /// with `want`, and that head's length (at least 1).
    fn best_head(&self, parent: BlockHash, want: &[u32]) -> Option<(u32, usize)> {
        let common = |e: &Entry| e.tokens.iter().zip(want).take_while(|(a, b)| a == b).count();
        self.children
            .get(&parent)?
            .iter()
            .filter_map(|b| self.entries[*b as usize].as_ref().map(|e| (*b, common(e))))
            .filter(|(_, n)| *n > 0)
            .max_by_key(|(_, n)| *n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_prefix::chain;

    const BS: usize = 2;

    fn cached(total: usize, capacity: usize) -> Blocks {
        Blocks::new(total, Some(PrefixConfig { capacity, seed: 42, block_size: BS }))
    }

    /// The whole cached blocks for `tokens` (a partial match is let go).
    fn full(b: &mut Blocks, hashes: &[BlockHash], tokens: &[u32]) -> Vec<u32> {
        let r = b.lookup(hashes, tokens, tokens.len(), 1);
        if let Some((src, _)) = r.partial {
            b.release(&[src]);
        }
        r.blocks
    }

    /// Allocate blocks for `tokens` and store its full blocks, as a prefill would.
    fn prefill(b: &mut Blocks, tokens: &[u32]) -> Vec<u32> {
        let hashes = chain(42, BS, tokens, usize::MAX);
        let mut got = full(b, &hashes, tokens);
        got.extend(b.allocate(tokens.len().div_ceil(BS) - got.len()).unwrap());
        for (i, h) in hashes.iter().enumerate() {
            let parent = if i == 0 { 42 } else { hashes[i - 1] };
            b.store(got[i], *h, parent, &tokens[i * BS..(i + 1) * BS]);
        }
        got
    }

    fn states_add_up(b: &Blocks) {
        let held = b.refs.iter().filter(|r| **r > 0).count();
        assert_eq!(held + b.free.len() + b.evictable(), b.total, "every block free, held or evictable");
        assert_eq!(b.held(), held);
    }

    #[test]
    fn a_repeated_prefix_reuses_the_same_blocks() {
        let mut b = cached(8, 8);
        let first = prefill(&mut b, &[1, 2, 3, 4, 5]);
        b.release(&first);
        assert_eq!(b.cached(), 2);
        assert_eq!(b.evictable(), 2);
        assert_eq!(b.available(), 8);
        let again = prefill(&mut b, &[1, 2, 3, 4, 9, 9]);
        assert_eq!(again[..2], first[..2], "the two full blocks are reused");
        assert_eq!(b.counters().hit_tokens, 4);
        assert_eq!(b.evictable(), 0, "held blocks are not evictable");
        states_add_up(&b);
        b.release(&again);
        states_add_up(&b);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_tail_first_and_never_a_held_block() {
        let mut b = cached(4, 4);
        let a = prefill(&mut b, &[1, 2, 3, 4]);
        b.release(&a);
        // Hold the first block again, then ask for every other block.
        let held = full(&mut b, &chain(42, BS, &[1, 2], 1), &[1, 2]);
        assert_eq!(held, a[..1]);
        let rest = b.allocate(3).unwrap();
        assert!(!rest.contains(&a[0]), "a held cached block is never handed out");
        assert_eq!(b.counters().evictions, 1, "the tail block was evicted");
        assert!(matches!(b.allocate(1), Err(EngineError::KvFull { needed: 1, free: 0, total: 4 })));
        assert!(b.take_events().contains(&Event::Removed(chain(42, BS, &[1, 2, 3, 4], 2)[1])));
        b.release(&rest);
        b.release(&held);
        states_add_up(&b);
    }

    #[test]
    fn capacity_bounds_the_unreferenced_cached_blocks() {
        let mut b = cached(8, 1);
        let a = prefill(&mut b, &[1, 2, 3, 4, 5, 6]);
        b.release(&a);
        assert_eq!(b.evictable(), 1);
        assert_eq!(b.cached(), 1, "the head is kept, the tail evicted");
        assert_eq!(full(&mut b, &chain(42, BS, &[1, 2], 1), &[1, 2]), a[..1]);
    }

    #[test]
    fn a_collision_or_a_different_parent_is_a_miss() {
        let mut b = cached(8, 8);
        let a = prefill(&mut b, &[1, 2, 3, 4]);
        b.release(&a);
        let hashes = chain(42, BS, &[1, 2, 3, 4], 2);
        // Right hashes, wrong tokens: a forged collision.
        assert!(full(&mut b, &hashes, &[1, 2, 7, 7]).len() == 1);
        assert!(full(&mut b, &hashes[1..], &[3, 4]).is_empty(), "block 2 under another parent");
        b.release(&a[..1]);
        states_add_up(&b);
    }

    #[test]
    fn storing_the_same_prefix_twice_keeps_one_copy() {
        let mut b = cached(8, 8);
        let x = b.allocate(1).unwrap();
        let y = b.allocate(1).unwrap();
        let h = chain(42, BS, &[5, 5], 1)[0];
        b.store(x[0], h, 42, &[5, 5]);
        b.store(y[0], h, 42, &[5, 5]);
        assert_eq!(b.cached(), 1);
        b.release(&y);
        assert_eq!(b.free.len(), 7, "the uncached duplicate is freed at once");
        b.release(&x);
        assert_eq!(b.evictable(), 1);
        assert_eq!(b.take_events(), vec![Event::Stored(h)]);
    }

    #[test]
    fn a_prefix_ending_inside_a_block_matches_its_head_to_copy() {
        let mut b = Blocks::new(8, Some(PrefixConfig { capacity: 8, seed: 42, block_size: 4 }));
        let x = b.allocate(2).unwrap();
        let h = chain(42, 4, &[1, 2, 3, 4], 1)[0];
        b.store(x[0], h, 42, &[1, 2, 3, 4]);
        // The prompt's last block: partial, never told to routers.
        b.store(x[1], pdmesh_prefix::hash::block_hash(h, &[5, 6]), h, &[5, 6]);
        assert_eq!(b.take_events(), vec![Event::Stored(h)]);
        b.release(&x);
        // The same prompt again, all but its last token reusable.
        let prompt = [1, 2, 3, 4, 5, 6];
        let r = b.lookup(&chain(42, 4, &prompt, 9), &prompt, 5, 1);
        assert_eq!(r, Reuse { blocks: vec![x[0]], partial: Some((x[1], 1)) });
        assert_eq!(b.counters().hit_tokens, 5);
        assert_eq!(b.evictable(), 0, "both are held until copied");
        b.release(&[x[1]]);
        b.release(&r.blocks);
        // Diverging inside a full block: its head is matched too.
        let other = [1, 2, 9, 9, 9];
        // A model whose arithmetic follows its steps asks for a whole block
        // at least: less is no hit, and nothing is held.
        assert_eq!(b.lookup(&chain(42, 4, &other, 9), &other, 4, 4), Reuse::default());
        let r = b.lookup(&chain(42, 4, &other, 9), &other, 4, 1);
        assert_eq!(r, Reuse { blocks: vec![], partial: Some((x[0], 2)) });
        b.release(&[x[0]]);
        states_add_up(&b);
        // Evicting the partial block forgets it quietly.
        let all = b.allocate(8).unwrap();
        assert_eq!(b.take_events(), vec![Event::Removed(h)]);
        b.release(&all);
        assert_eq!(b.lookup(&chain(42, 4, &prompt, 9), &prompt, 5, 1), Reuse::default());
    }

    #[test]
    fn without_a_cache_blocks_are_plain_free_and_held() {
        let mut b = Blocks::new(3, None);
        let a = b.allocate(2).unwrap();
        b.store(a[0], 1, 42, &[1, 2]);
        assert_eq!(b.cached(), 0);
        assert_eq!(b.lookup(&[1], &[1, 2], 2, 1), Reuse::default());
        b.release(&a);
        assert_eq!(b.available(), 3);
        states_add_up(&b);
    }
}
