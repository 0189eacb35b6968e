//! The transfer-ticket table: a ticket per request id, its state machine,
//! leases, and a watch channel per ticket so every party learns of a state
//! change at once.
//!
//! ```text
//!   (expected) --open--> OPEN --claim--> CLAIMED --complete--> DONE | FAILED
//!        \                 \               \
//!         `-- cancel / lease expiry from any non-terminal state --> CANCELLED | EXPIRED
//! ```
//!
//! A ticket can be asked about (claimed, watched, cancelled) before its
//! decode worker opens it: the router dispatches to prefill and decode at
//! once. Such an "expected" entry has state UNSPECIFIED. A cancel that comes
//! first leaves a CANCELLED entry, so a late open fails instead of pinning
//! blocks nobody will fill. Terminal tickets are kept for a while (so late
//! callers get the real outcome), then forgotten.
//!
//! The table is a plain struct behind one mutex held for microseconds by
//! each call; waiting happens on the watch channels, never under the lock.

use std::collections::HashMap;
use std::time::Duration;

use pdmesh_proto::kvbroker::v1::{Ticket, TicketState};
use tokio::sync::watch;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TicketError {
    #[error("ticket {0} is already {1:?}")]
    WrongState(String, TicketState),
    #[error("ticket {0} is not open")]
    NotFound(String),
    #[error("invalid ticket request: {0}")]
    Invalid(String),
    #[error("the broker holds {0} tickets, its limit; retry shortly")]
    Full(usize),
    #[error("{0} has {1} live tickets, the limit per worker; retry shortly")]
    FullFor(String, usize),
}

/// Longest ticket id accepted, in bytes (the router's are far shorter).
pub const MAX_ID_BYTES: usize = 512;

struct Entry {
    tx: watch::Sender<Ticket>,
    /// When the entry appeared (ms since the epoch): an expected ticket
    /// nobody opens within the retention is expired, not kept forever.
    created_ms: u64,
    /// When a terminal ticket may be forgotten (ms since the epoch).
    forget_at_ms: Option<u64>,
}

pub struct Tickets {
    map: HashMap<String, Entry>,
    /// How long terminal tickets are remembered.
    retention: Duration,
    /// Most tickets held (live, expected and remembered together); a new id
    /// past it is refused, never an existing ticket's change.
    max: usize,
    /// Live (opened, not ended) tickets by destination worker, and their cap.
    live_for: HashMap<String, usize>,
    max_per_worker: usize,
}

pub fn is_terminal(s: TicketState) -> bool {
    matches!(s, TicketState::Done | TicketState::Failed | TicketState::Cancelled | TicketState::Expired)
}

fn state(t: &Ticket) -> TicketState {
    TicketState::try_from(t.state).unwrap_or(TicketState::Unspecified)
}

impl Tickets {
    pub fn new(retention: Duration, max: usize) -> Tickets {
        Tickets {
            map: HashMap::new(),
            retention,
            max: max.max(1),
            live_for: HashMap::new(),
            max_per_worker: usize::MAX,
        }
    }

    /// Cap the live tickets naming one destination worker.
    pub fn with_max_per_worker(mut self, n: usize) -> Tickets {
        self.max_per_worker = n.max(1);
        self
    }

    /// The entry of `id`, made (as an expected ticket) if new and there is room.
    fn entry(&mut self, id: &str, now_ms: u64) -> Result<&mut Entry, TicketError> {
        if !self.map.contains_key(id) {
            if id.is_empty() || id.len() > MAX_ID_BYTES {
                return Err(TicketError::Invalid(format!("request_id must be 1..={MAX_ID_BYTES} bytes")));
            }
            if self.map.len() >= self.max {
                return Err(TicketError::Full(self.map.len()));
            }
        }
        Ok(self.map.entry(id.to_string()).or_insert_with(|| {
            let t = Ticket { request_id: id.to_string(), ..Default::default() };
            Entry { tx: watch::channel(t).0, created_ms: now_ms, forget_at_ms: None }
        }))
    }

    /// Change a ticket (one that exists) and tell its watchers.
    fn update(&mut self, id: &str, now_ms: u64, f: impl FnOnce(&mut Ticket)) -> Ticket {
        let retention = self.retention.as_millis() as u64;
        let e = self.map.get_mut(id).expect("callers update tickets that exist");
        e.tx.send_modify(f);
        let t = e.tx.borrow().clone();
        if is_terminal(state(&t)) && e.forget_at_ms.is_none() {
            e.forget_at_ms = Some(now_ms + retention);
            // An opened ticket ends once: its destination has one live less.
            if let Some(n) = self.live_for.get_mut(&t.dest_worker) {
                *n -= 1;
                if *n == 0 {
                    self.live_for.remove(&t.dest_worker);
                }
            }
        }
        t
    }

    /// The current ticket (an expected, UNSPECIFIED one if nobody opened it yet)
    /// and a receiver of its future changes.
    pub fn subscribe(&mut self, id: &str, now_ms: u64) -> Result<watch::Receiver<Ticket>, TicketError> {
        Ok(self.entry(id, now_ms)?.tx.subscribe())
    }

    pub fn get(&self, id: &str) -> Option<Ticket> {
        self.map.get(id).map(|e| e.tx.borrow().clone())
    }

    /// Decode: its blocks are reserved; the prefill may write.
    pub fn open(
        &mut self,
        id: &str,
        dest_worker: &str,
        dest_blocks: Vec<u32>,
        n_tokens: u32,
        lease_ms: u32,
        now_ms: u64,
    ) -> Result<Ticket, TicketError> {
        if id.is_empty() || dest_worker.is_empty() || dest_blocks.is_empty() || lease_ms == 0 {
            return Err(TicketError::Invalid("request_id, dest_worker, dest_blocks and lease_ms are required".into()));
        }
        let cur = state(&self.entry(id, now_ms)?.tx.borrow());
        if cur != TicketState::Unspecified {
            return Err(TicketError::WrongState(id.into(), cur));
        }
        let live = self.live_for.get(dest_worker).copied().unwrap_or(0);
        if live >= self.max_per_worker {
            return Err(TicketError::FullFor(dest_worker.into(), live));
        }
        *self.live_for.entry(dest_worker.into()).or_insert(0) += 1;
        Ok(self.update(id, now_ms, |t| {
            t.state = TicketState::Open as i32;
            t.dest_worker = dest_worker.into();
            t.dest_blocks = dest_blocks;
            t.n_tokens = n_tokens;
            t.lease_deadline_unix_ms = now_ms + lease_ms as u64;
        }))
    }

    /// Prefill: take an OPEN ticket (callers wait for OPEN on the watch first).
    pub fn claim(&mut self, id: &str, source_worker: &str, now_ms: u64) -> Result<Ticket, TicketError> {
        let cur = self.get(id).map(|t| state(&t)).ok_or_else(|| TicketError::NotFound(id.into()))?;
        if cur != TicketState::Open {
            return Err(TicketError::WrongState(id.into(), cur));
        }
        Ok(self.update(id, now_ms, |t| {
            t.state = TicketState::Claimed as i32;
            t.source_worker = source_worker.into();
        }))
    }

    /// Prefill: the write into the destination blocks starts now (CLAIMED
    /// -> WRITING). Refused once the ticket ended, so a prefill never starts
    /// writing into blocks the decode worker has freed.
    pub fn begin_write(&mut self, id: &str, now_ms: u64) -> Result<Ticket, TicketError> {
        let cur = self.get(id).map(|t| state(&t)).ok_or_else(|| TicketError::NotFound(id.into()))?;
        if cur != TicketState::Claimed {
            return Err(TicketError::WrongState(id.into(), cur));
        }
        Ok(self.update(id, now_ms, |t| t.state = TicketState::Writing as i32))
    }

    /// Prefill: the KV is written (`Ok(first_token, block checksums)`) or
    /// could not be (`Err(why)`).
    pub fn complete(
        &mut self,
        id: &str,
        outcome: Result<(u32, Vec<u32>), String>,
        bytes: u64,
        now_ms: u64,
    ) -> Result<Ticket, TicketError> {
        let cur = self.get(id).map(|t| state(&t)).ok_or_else(|| TicketError::NotFound(id.into()))?;
        if !matches!(cur, TicketState::Claimed | TicketState::Writing) {
            return Err(TicketError::WrongState(id.into(), cur));
        }
        Ok(self.update(id, now_ms, |t| {
            t.bytes = bytes;
            match outcome {
                Ok((first, sums)) => {
                    t.state = TicketState::Done as i32;
                    t.first_token = Some(first);
                    t.block_crc32c = sums;
                }
                Err(why) => {
                    t.state = TicketState::Failed as i32;
                    t.reason = why;
                }
            }
        }))
    }

    /// Anyone: end a ticket that is not over yet (also one not opened yet).
    /// Ending an already-ended ticket returns it unchanged.
    pub fn cancel(&mut self, id: &str, reason: &str, now_ms: u64) -> Result<Ticket, TicketError> {
        let cur = state(&self.entry(id, now_ms)?.tx.borrow());
        if is_terminal(cur) {
            return Ok(self.get(id).expect("entry exists"));
        }
        Ok(self.update(id, now_ms, |t| {
            t.state = TicketState::Cancelled as i32;
            t.reason = reason.into();
        }))
    }

    pub fn renew(&mut self, id: &str, lease_ms: u32, now_ms: u64) -> Result<Ticket, TicketError> {
        let cur = self.get(id).map(|t| state(&t)).ok_or_else(|| TicketError::NotFound(id.into()))?;
        if !matches!(cur, TicketState::Open | TicketState::Claimed | TicketState::Writing) {
            return Err(TicketError::WrongState(id.into(), cur));
        }
        // Extend only: a renewal never shortens a lease someone else set.
        Ok(self
            .update(id, now_ms, |t| t.lease_deadline_unix_ms = t.lease_deadline_unix_ms.max(now_ms + lease_ms as u64)))
    }

    /// Expire leased tickets past their deadline (and expected ones never
    /// opened within the retention), forget old terminal ones. Returns the
    /// tickets that expired now.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Ticket> {
        let retention = self.retention.as_millis() as u64;
        let due: Vec<(String, &'static str)> = self
            .map
            .iter()
            .filter_map(|(k, e)| {
                let t = e.tx.borrow();
                match state(&t) {
                    TicketState::Open | TicketState::Claimed | TicketState::Writing
                        if t.lease_deadline_unix_ms <= now_ms =>
                    {
                        Some((k.clone(), "lease expired"))
                    }
                    TicketState::Unspecified if e.created_ms + retention <= now_ms => Some((k.clone(), "never opened")),
                    _ => None,
                }
            })
            .collect();
        let expired = due
            .iter()
            .map(|(id, why)| {
                self.update(id, now_ms, |t| {
                    t.state = TicketState::Expired as i32;
                    t.reason = (*why).into();
                })
            })
            .collect();
        self.map.retain(|_, e| e.forget_at_ms.is_none_or(|at| at > now_ms));
        expired
    }

    /// Live tickets by state, for metrics.
    pub fn count_by_state(&self) -> HashMap<TicketState, usize> {
        let mut m = HashMap::new();
        for e in self.map.values() {
            *m.entry(state(&e.tx.borrow())).or_insert(0) += 1;
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_worker_cannot_fill_the_table() {
        let mut t = Tickets::new(Duration::from_secs(60), 1000).with_max_per_worker(2);
        t.open("a", "decode-0", vec![1], 1, 1000, 0).unwrap();
        t.open("b", "decode-0", vec![2], 1, 1000, 0).unwrap();
        let e = t.open("c", "decode-0", vec![3], 1, 1000, 0).unwrap_err();
        assert_eq!(e, TicketError::FullFor("decode-0".into(), 2));
        t.open("d", "decode-1", vec![1], 1, 1000, 0).expect("another worker has its own room");
        t.cancel("a", "done with it", 1).unwrap();
        t.open("c", "decode-0", vec![3], 1, 1000, 2).expect("an ended ticket frees its worker's room");
        t.tick(5000); // b, c and d expire
        assert!(t.live_for.is_empty(), "{:?}", t.live_for);
    }

    fn table() -> Tickets {
        Tickets::new(Duration::from_secs(60), 1000)
    }

    #[test]
    fn happy_path_open_claim_done() {
        let mut t = table();
        let mut rx = t.subscribe("r1", 0).unwrap();
        t.open("r1", "d0", vec![3, 4], 20, 1000, 0).unwrap();
        assert_eq!(state(&rx.borrow_and_update()), TicketState::Open);
        t.claim("r1", "p0", 1).unwrap();
        let done = t.complete("r1", Ok((42, vec![7, 9])), 1234, 2).unwrap();
        assert_eq!((state(&done), done.first_token, done.bytes), (TicketState::Done, Some(42), 1234));
        assert_eq!(done.block_crc32c, [7, 9], "the sender's checksums reach the watcher");
        assert!(rx.has_changed().unwrap());
        assert_eq!(state(&rx.borrow()), TicketState::Done);
    }

    #[test]
    fn a_write_begins_only_on_a_claimed_ticket_and_renewals_only_extend() {
        let mut t = table();
        t.open("w", "d0", vec![1, 2], 20, 5_000, 0).unwrap();
        assert!(matches!(t.begin_write("w", 1), Err(TicketError::WrongState(_, TicketState::Open))));
        // A shorter renewal does not cut the decode's lease.
        assert_eq!(t.renew("w", 1_000, 10).unwrap().lease_deadline_unix_ms, 5_000);
        assert_eq!(t.renew("w", 9_000, 10).unwrap().lease_deadline_unix_ms, 9_010);
        t.claim("w", "p0", 20).unwrap();
        assert_eq!(state(&t.begin_write("w", 30).unwrap()), TicketState::Writing);
        assert_eq!(state(&t.complete("w", Ok((7, vec![])), 10, 40).unwrap()), TicketState::Done);
        // Once cancelled, no write may begin.
        t.open("c", "d0", vec![3], 5, 5_000, 0).unwrap();
        t.claim("c", "p0", 1).unwrap();
        t.cancel("c", "client gone", 2).unwrap();
        assert!(matches!(t.begin_write("c", 3), Err(TicketError::WrongState(_, TicketState::Cancelled))));
    }

    #[test]
    fn wrong_order_is_refused() {
        let mut t = table();
        assert_eq!(t.claim("x", "p0", 0), Err(TicketError::NotFound("x".into())));
        t.open("x", "d0", vec![1], 5, 1000, 0).unwrap();
        assert!(matches!(t.open("x", "d0", vec![1], 5, 1000, 0), Err(TicketError::WrongState(_, TicketState::Open))));
        assert!(matches!(t.complete("x", Ok((1, vec![])), 0, 0), Err(TicketError::WrongState(_, TicketState::Open))));
        assert!(t.open("y", "", vec![1], 5, 1000, 0).is_err());
    }

    #[test]
    fn cancel_before_open_makes_the_late_open_fail() {
        let mut t = table();
        let c = t.cancel("r", "client gone", 0).unwrap();
        assert_eq!(state(&c), TicketState::Cancelled);
        assert!(matches!(
            t.open("r", "d0", vec![1], 5, 1000, 1),
            Err(TicketError::WrongState(_, TicketState::Cancelled))
        ));
        // Cancelling an ended ticket changes nothing.
        t.open("s", "d0", vec![1], 5, 1000, 0).unwrap();
        t.claim("s", "p0", 0).unwrap();
        t.complete("s", Ok((7, vec![])), 0, 0).unwrap();
        assert_eq!(state(&t.cancel("s", "late", 1).unwrap()), TicketState::Done);
    }

    #[test]
    fn leases_expire_unless_renewed_and_old_tickets_are_forgotten() {
        let mut t = Tickets::new(Duration::from_millis(500), 1000);
        t.open("a", "d0", vec![1], 5, 100, 0).unwrap();
        t.open("b", "d0", vec![2], 5, 100, 0).unwrap();
        t.renew("b", 1000, 50).unwrap();
        let expired = t.tick(150);
        assert_eq!(expired.iter().map(|x| x.request_id.as_str()).collect::<Vec<_>>(), ["a"]);
        assert_eq!(state(&t.get("a").unwrap()), TicketState::Expired);
        assert_eq!(state(&t.get("b").unwrap()), TicketState::Open);
        t.tick(700);
        assert!(t.get("a").is_none(), "terminal tickets are forgotten after the retention");
        assert!(t.get("b").is_some());
        // Asked about but never opened: expired after the retention, then forgotten.
        let _rx = t.subscribe("ghost", 700).unwrap();
        t.tick(1300);
        assert_eq!(t.get("ghost").map(|x| x.reason), Some("never opened".to_string()));
    }

    #[test]
    fn the_table_is_bounded_and_ids_are_checked() {
        let mut t = Tickets::new(Duration::from_millis(100), 3);
        t.open("a", "d0", vec![1], 5, 1000, 0).unwrap();
        t.subscribe("b", 0).unwrap();
        t.cancel("c", "x", 0).unwrap();
        // A new id past the bound is refused, by every call that would make one...
        assert_eq!(t.subscribe("d", 0).err(), Some(TicketError::Full(3)));
        assert_eq!(t.cancel("d", "x", 0).err(), Some(TicketError::Full(3)));
        assert!(matches!(t.open("d", "d0", vec![1], 5, 1000, 0), Err(TicketError::Full(3))));
        // ...but tickets already held still move.
        t.claim("a", "p0", 1).unwrap();
        t.open("b", "d0", vec![2], 5, 1000, 1).unwrap();
        // Once ended tickets are forgotten, there is room again.
        t.tick(200);
        assert!(t.subscribe("d", 200).is_ok());
        let long = "x".repeat(MAX_ID_BYTES + 1);
        assert!(matches!(t.subscribe(&long, 0), Err(TicketError::Invalid(_))));
        assert!(matches!(t.subscribe("", 0), Err(TicketError::Invalid(_))));
    }
}
