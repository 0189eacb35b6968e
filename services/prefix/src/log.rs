//! What a worker's cache holds, told to any number of readers.
//!
//! The worker applies its cache's events to a [`CacheLog`]; each reader (a
//! router) keeps a [`Mirror`] and asks for what changed since its cursor.
//! The answer is the net change when the log still holds every event since
//! then, or the whole set (`reset`) when the reader is new, fell too far
//! behind, or the worker restarted (a new `epoch`). So several readers, and
//! workers that restart and forget their cache, stay correct.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::hash::BlockHash;

/// A change in the set of cached blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Stored(BlockHash),
    Removed(BlockHash),
}

/// What a reader needs to catch up, from [`CacheLog::since`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// The log's epoch (new on every start of the worker).
    pub epoch: u64,
    /// Events applied so far: the reader's next cursor.
    pub seq: u64,
    /// `stored` is the whole set: drop everything known before.
    pub reset: bool,
    pub stored: Vec<BlockHash>,
    pub removed: Vec<BlockHash>,
}

/// The worker's side: the set of cached block hashes and its recent events.
#[derive(Debug)]
pub struct CacheLog {
    epoch: u64,
    seq: u64,
    held: HashSet<BlockHash>,
    /// `(event number, event)`, oldest first, at most `keep` of them.
    recent: VecDeque<(u64, Event)>,
    keep: usize,
}

impl CacheLog {
    /// An empty log; `epoch` must differ from every earlier run's (see
    /// [`fresh_epoch`]); `keep` events are kept for readers that lag.
    pub fn new(epoch: u64, keep: usize) -> CacheLog {
        CacheLog { epoch, seq: 0, held: HashSet::new(), recent: VecDeque::new(), keep: keep.max(1) }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn apply(&mut self, events: impl IntoIterator<Item = Event>) {
        for e in events {
            match e {
                Event::Stored(h) => self.held.insert(h),
                Event::Removed(h) => self.held.remove(&h),
            };
            self.seq += 1;
            self.recent.push_back((self.seq, e));
            if self.recent.len() > self.keep {
                self.recent.pop_front();
            }
        }
    }

    /// What a reader whose cursor is `(epoch, seq)` lacks.
    pub fn since(&self, epoch: u64, seq: u64) -> Delta {
        let first_kept = self.recent.front().map_or(self.seq + 1, |(n, _)| *n);
        let follows = epoch == self.epoch && seq <= self.seq && first_kept <= seq + 1;
        if !follows {
            return Delta {
                epoch: self.epoch,
                seq: self.seq,
                reset: true,
                stored: self.held.iter().copied().collect(),
                removed: Vec::new(),
            };
        }
        // Net change: the last event of each hash decides.
        let mut last: HashMap<BlockHash, bool> = HashMap::new();
        for (_, e) in self.recent.iter().filter(|(n, _)| *n > seq) {
            match e {
                Event::Stored(h) => last.insert(*h, true),
                Event::Removed(h) => last.insert(*h, false),
            };
        }
        let mut d = Delta { epoch: self.epoch, seq: self.seq, ..Default::default() };
        for (h, stored) in last {
            if stored { &mut d.stored } else { &mut d.removed }.push(h);
        }
        d
    }
}

/// An epoch no earlier start of this process image is likely to have had:
/// the wall clock in nanoseconds mixed with the process id.
pub fn fresh_epoch() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    crate::hash::block_hash(nanos, &[std::process::id()]) | 1
}

/// A reader's copy of one worker's set of cached blocks.
#[derive(Debug, Default, Clone)]
pub struct Mirror {
    epoch: u64,
    seq: u64,
    held: HashSet<BlockHash>,
}

impl Mirror {
    /// The cursor to ask [`CacheLog::since`] with.
    pub fn cursor(&self) -> (u64, u64) {
        (self.epoch, self.seq)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn apply(&mut self, d: Delta) {
        if d.reset {
            self.held.clear();
        }
        self.held.extend(d.stored);
        for h in d.removed {
            self.held.remove(&h);
        }
        self.epoch = d.epoch;
        self.seq = d.seq;
    }

    /// Whether this worker holds the block hashing to `h`.
    pub fn holds(&self, h: &BlockHash) -> bool {
        self.held.contains(h)
    }

    /// How many leading blocks of a request (its chained `hashes`) this
    /// worker holds.
    pub fn overlap(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.holds(h)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<u64>) -> Vec<u64> {
        v.sort();
        v
    }

    #[test]
    fn a_reader_that_follows_gets_the_net_change() {
        let mut log = CacheLog::new(7, 100);
        let mut m = Mirror::default();
        let d = log.since(m.cursor().0, m.cursor().1);
        assert!(d.reset, "a new reader gets the whole set");
        m.apply(d);
        assert!(m.is_empty());
        log.apply([Event::Stored(1), Event::Stored(2), Event::Stored(3)]);
        let d = log.since(m.cursor().0, m.cursor().1);
        assert!(!d.reset);
        assert_eq!(sorted(d.stored.clone()), vec![1, 2, 3]);
        m.apply(d);
        assert_eq!(m.overlap(&[1, 2, 3, 4]), 3);
        log.apply([Event::Removed(2), Event::Stored(4), Event::Removed(4), Event::Removed(9), Event::Stored(9)]);
        let d = log.since(m.cursor().0, m.cursor().1);
        assert!(!d.reset);
        assert_eq!(sorted(d.stored.clone()), vec![9]);
        assert_eq!(sorted(d.removed.clone()), vec![2, 4]);
        m.apply(d);
        assert_eq!(m.overlap(&[1, 2, 3]), 1, "the chain breaks at the first missing block");
        assert_eq!(m.len(), log.len());
        let d = log.since(m.cursor().0, m.cursor().1);
        assert!(!d.reset && d.stored.is_empty() && d.removed.is_empty());
    }

    #[test]
    fn a_lagging_reader_or_a_restarted_worker_means_a_reset() {
        let mut log = CacheLog::new(7, 2);
        let mut m = Mirror::default();
        log.apply([Event::Stored(1)]);
        m.apply(log.since(0, 0));
        log.apply([Event::Stored(2), Event::Stored(3), Event::Removed(1)]);
        let d = log.since(m.cursor().0, m.cursor().1);
        assert!(d.reset, "events 2..4 are not all kept");
        m.apply(d);
        assert_eq!(sorted(m.held.iter().copied().collect()), vec![2, 3]);
        // The worker restarts: a new epoch and an empty cache.
        let log = CacheLog::new(8, 2);
        m.apply(log.since(m.cursor().0, m.cursor().1));
        assert!(m.is_empty(), "a restarted worker's mirror forgets its old blocks");
        // A reader ahead of the log (the log restarted with the same epoch) resets too.
        assert!(log.since(8, 99).reset);
    }
}
