//! A caller's own evidence about each peer it calls, which wins over what
//! discovery says: whether it answers its polls (a router polls its
//! workers' Load, the gateway its routers' gRPC health), whether its
//! engine loop moves, and the stalls and losses its calls met. A peer that
//! stops making progress is routed around: the calls waiting on it move
//! elsewhere and it is ejected from picking for a backoff that doubles with
//! each strike in a row, then probed with one request; a request it serves
//! to the end clears its strikes.
//!
//! [`Outliers`] is pure bookkeeping over instants, tested with no network;
//! [`Watch`] shares it between a poller and the calls, and
//! [`poll_health`] is the poller for peers that have only gRPC health.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::discovery::Instance;
use crate::peers::Peers;

/// The patience and ejection knobs (`--stall-floor-ms`, `--stall-steps`,
/// `--eject-ms`, `--eject-max-ms`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Knobs {
    pub floor: Duration,
    pub steps: u32,
    pub eject: Duration,
    pub eject_max: Duration,
}

impl Default for Knobs {
    /// A second's patience (or 8 steps), ejections from 1 s up to 30 s.
    fn default() -> Knobs {
        Knobs {
            floor: Duration::from_secs(1),
            steps: 8,
            eject: Duration::from_secs(1),
            eject_max: Duration::from_secs(30),
        }
    }
}

/// How far back `meshctl status` counts a worker's strikes.
pub const RECENT: Duration = Duration::from_secs(10);

/// Why a worker got a strike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strike {
    /// A stream on it made no progress past its patience.
    Stall,
    /// A call to it failed at the transport (refused, reset, gone).
    Lost,
}

impl Strike {
    fn label(self, n: usize) -> &'static str {
        match (self, n) {
            (Strike::Stall, 1) => "stall",
            (Strike::Stall, _) => "stalls",
            (Strike::Lost, 1) => "lost call",
            (Strike::Lost, _) => "lost calls",
        }
    }
}

/// Why a worker is taken to have stopped (see [`Outliers::silence`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Silence {
    /// Its Load poll has gone unanswered this long.
    Silent(Duration),
    /// It answers, but says its engine loop has not moved for this long.
    Stuck(Duration),
}

impl Silence {
    /// In words, for the stalled stream's status and span; `poll` names
    /// what went unanswered (see [`Outliers::poll`]).
    pub fn describe(&self, poll: &str) -> String {
        match self {
            Silence::Silent(d) => format!("no answer to its {poll} for {:.1} s", d.as_secs_f64()),
            Silence::Stuck(d) => format!("its engine loop made no progress for {:.1} s", d.as_secs_f64()),
        }
    }
}

/// Where a worker stands for picking.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Standing {
    /// Pick freely.
    Good,
    /// Its ejection ended: one request at a time, until one succeeds.
    Probe,
    /// Ejected: picked only when nothing better is left.
    Ejected,
    /// Not answering or stuck: picked only when nothing else is left.
    Silent,
}

#[derive(Debug, Default)]
struct Evidence {
    /// The worker's kind and name (its service id), for reports.
    kind: String,
    name: String,
    /// Sent a Load that has not been answered yet, since then.
    unanswered_since: Option<Instant>,
    answered_at: Option<Instant>,
    /// From its latest answer.
    stalled_ms: u32,
    step_ms: u32,
    /// Strikes in a row (cleared by a request served to its end).
    strikes: u32,
    ejected_until: Option<Instant>,
    /// Strikes of the last [`RECENT`], for the report.
    recent: VecDeque<(Instant, Strike)>,
}

/// Every worker's evidence, by gRPC address.
#[derive(Debug, Default)]
pub struct Outliers {
    knobs: Option<Knobs>,
    /// What the poller asks (`load poll`, `health check`), for the words.
    poll: Option<&'static str>,
    by_addr: HashMap<String, Evidence>,
}

impl Outliers {
    pub fn new(knobs: Knobs) -> Outliers {
        Outliers { knobs: Some(knobs), poll: None, by_addr: HashMap::new() }
    }

    /// What the poller asks, in words: `load poll` unless set otherwise.
    pub fn poll(&self) -> &'static str {
        self.poll.unwrap_or("load poll")
    }

    fn knobs(&self) -> Knobs {
        self.knobs.unwrap_or_default()
    }

    /// A Load poll is about to be sent to `addr`, a `kind` worker named `name`.
    pub fn asked(&mut self, addr: &str, (kind, name): (&str, &str), now: Instant) {
        let e = self.by_addr.entry(addr.to_string()).or_default();
        e.kind = kind.to_string();
        e.name = name.to_string();
        e.unanswered_since.get_or_insert(now);
    }

    /// `addr` answered its Load poll.
    pub fn answered(&mut self, addr: &str, now: Instant, stalled_ms: u32, step_ms: u32) {
        let e = self.by_addr.entry(addr.to_string()).or_default();
        e.unanswered_since = None;
        e.answered_at = Some(now);
        e.stalled_ms = stalled_ms;
        e.step_ms = step_ms;
    }

    /// Forget workers no longer in discovery, but only [`RECENT`] after
    /// their last strike: a frozen worker drops out of discovery too, and
    /// when it comes back it is probed, not trusted at once.
    pub fn retain(&mut self, live: impl Fn(&str) -> bool, now: Instant) {
        self.by_addr.retain(|a, e| {
            live(a) || e.recent.back().is_some_and(|(t, _)| now.saturating_duration_since(*t) <= RECENT)
        });
    }

    /// How long `addr`'s engine loop may go without progress before it
    /// counts as stuck: the floor, or `steps` of its recent step time if
    /// longer (a long step on a device shows no progress inside it). An
    /// unanswered poll needs only the floor: another thread answers it,
    /// however long the steps.
    pub fn patience(&self, addr: &str) -> Duration {
        let k = self.knobs();
        let step = self.by_addr.get(addr).map_or(0, |e| e.step_ms);
        k.floor.max(Duration::from_millis(u64::from(step) * u64::from(k.steps)))
    }

    /// Whether `addr` has stopped as far as the caller can tell, at `now`:
    /// a poll unanswered for the floor, or an answer saying its loop has
    /// not moved for its patience (counting the time since the answer).
    pub fn silence(&self, addr: &str, now: Instant) -> Option<Silence> {
        let e = self.by_addr.get(addr)?;
        let patience = self.patience(addr);
        if let Some(t) = e.unanswered_since {
            let d = now.saturating_duration_since(t);
            if d >= self.knobs().floor {
                return Some(Silence::Silent(d));
            }
        }
        if e.stalled_ms > 0 {
            let since = e.answered_at.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
            let d = Duration::from_millis(u64::from(e.stalled_ms)) + since;
            if d >= patience {
                return Some(Silence::Stuck(d));
            }
        }
        None
    }

    /// A strike against `addr`: ejected for the backoff (doubling with
    /// each strike in a row, up to the most). Returns the ejection's length.
    pub fn strike(&mut self, addr: &str, why: Strike, now: Instant) -> Duration {
        let k = self.knobs();
        let e = self.by_addr.entry(addr.to_string()).or_default();
        e.strikes = e.strikes.saturating_add(1);
        let factor = 1u32 << (e.strikes - 1).min(16);
        let backoff = k.eject.saturating_mul(factor).min(k.eject_max);
        e.ejected_until = Some(now + backoff);
        e.recent.push_back((now, why));
        while e.recent.front().is_some_and(|(t, _)| now.saturating_duration_since(*t) > RECENT) {
            e.recent.pop_front();
        }
        backoff
    }

    /// A request `addr` served to its end: its strikes are cleared.
    pub fn cleared(&mut self, addr: &str) {
        if let Some(e) = self.by_addr.get_mut(addr) {
            e.strikes = 0;
            e.ejected_until = None;
        }
    }

    /// The instance of `list` to try first, from `start` in rotation: the
    /// first in the best standing (None when `list` is empty).
    pub fn rotate_best(&self, list: &[Instance], start: usize, now: Instant) -> Option<usize> {
        let n = list.len();
        (0..n).map(|k| (start + k) % n).min_by_key(|&i| self.standing(&list[i].grpc_addr, now))
    }

    /// Where `addr` stands for picking at `now`.
    pub fn standing(&self, addr: &str, now: Instant) -> Standing {
        let Some(e) = self.by_addr.get(addr) else { return Standing::Good };
        if self.silence(addr, now).is_some() {
            Standing::Silent
        } else if e.ejected_until.is_some_and(|t| now < t) {
            Standing::Ejected
        } else if e.strikes > 0 {
            Standing::Probe
        } else {
            Standing::Good
        }
    }

    /// Workers out of picking now, each with why in words
    /// (`3 stalls in 10 s; ejected for 4.0 s more`), for /statusz.
    pub fn report(&self, now: Instant) -> Vec<serde_json::Value> {
        let mut out: Vec<serde_json::Value> = self
            .by_addr
            .iter()
            .filter(|(a, _)| self.standing(a, now) != Standing::Good)
            .map(|(addr, e)| {
                let standing = self.standing(addr, now);
                serde_json::json!({
                    "kind": e.kind,
                    "worker": e.name,
                    "addr": addr,
                    "standing": format!("{standing:?}").to_lowercase(),
                    "why": self.why(e, standing, addr, now),
                })
            })
            .collect();
        out.sort_by(|a, b| a["worker"].as_str().cmp(&b["worker"].as_str()));
        out
    }

    fn why(&self, e: &Evidence, standing: Standing, addr: &str, now: Instant) -> String {
        let mut parts = Vec::new();
        for kind in [Strike::Stall, Strike::Lost] {
            let n = e.recent.iter().filter(|(t, s)| *s == kind && now.saturating_duration_since(*t) <= RECENT).count();
            if n > 0 {
                parts.push(format!("{n} {} in {} s", kind.label(n), RECENT.as_secs()));
            }
        }
        match standing {
            Standing::Silent => {
                parts.push(self.silence(addr, now).map(|s| s.describe(self.poll())).unwrap_or_default())
            }
            Standing::Ejected => {
                let left = e.ejected_until.map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
                parts.push(format!("ejected for {:.1} s more", left.as_secs_f64()));
            }
            Standing::Probe => parts.push("on probation: one request at a time".into()),
            Standing::Good => {}
        }
        parts.join("; ")
    }
}

/// [`Outliers`] shared between a poller and the calls that wait on peers.
#[derive(Debug, Default)]
pub struct Watch(Mutex<Outliers>);

/// How often a call in progress checks whether its peer has stopped.
const WATCH_EVERY: Duration = Duration::from_millis(100);

impl Watch {
    pub fn new(knobs: Knobs) -> Watch {
        Watch(Mutex::new(Outliers::new(knobs)))
    }

    /// [`Watch::new`] for peers polled by `poll` (its name in the words).
    pub fn polling(knobs: Knobs, poll: &'static str) -> Watch {
        Watch(Mutex::new(Outliers { poll: Some(poll), ..Outliers::new(knobs) }))
    }

    pub fn lock(&self) -> MutexGuard<'_, Outliers> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once `addr` has stopped (see [`Outliers::silence`]), this
    /// has waited at least the floor, and another instance of `peers` is
    /// not silent (with nowhere better to go, a call waits on: the peer may
    /// come back, and the call still ends at its deadline). Race it against
    /// a call to that peer, started when the call last heard from it.
    pub async fn stopped(&self, addr: &str, peers: &Peers) -> Silence {
        let t0 = Instant::now();
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            let now = Instant::now();
            if now.duration_since(t0) < self.lock().knobs().floor {
                continue;
            }
            let others = peers.instances();
            let o = self.lock();
            let Some(s) = o.silence(addr, now) else { continue };
            if others.iter().any(|i| i.grpc_addr != addr && o.silence(&i.grpc_addr, now).is_none()) {
                return s;
            }
        }
    }
}

/// Poll the gRPC health of every instance of `peers` every `every` (one
/// poller per instance: one that does not answer delays no other) into
/// `watch`, and forget the instances that left discovery, forever.
pub async fn poll_health(peers: Peers, watch: Arc<Watch>, every: Duration) {
    let mut pollers: HashMap<String, crate::task::AbortOnDrop<()>> = HashMap::new();
    loop {
        let live: Vec<Instance> = peers.instances();
        for inst in &live {
            if !pollers.contains_key(&inst.grpc_addr) {
                let task = crate::task::spawn_owned(poll_one_health(peers.clone(), watch.clone(), inst.clone(), every));
                pollers.insert(inst.grpc_addr.clone(), task);
            }
        }
        pollers.retain(|a, _| live.iter().any(|i| &i.grpc_addr == a));
        watch.lock().retain(|a| live.iter().any(|i| i.grpc_addr == a), Instant::now());
        tokio::time::sleep(every).await;
    }
}

/// Keep `admin`'s /statusz `runtime.workers_out` (the peers left out of
/// picking, and why) current every half second, handing each report to
/// `also` (the router counts them for a gauge), forever.
pub async fn publish(watch: Arc<Watch>, admin: crate::admin::AdminState, also: impl Fn(&[serde_json::Value])) {
    loop {
        let r = watch.lock().report(Instant::now());
        also(&r);
        admin.note("workers_out", serde_json::Value::Array(r));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn poll_one_health(peers: Peers, watch: Arc<Watch>, inst: Instance, every: Duration) {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    loop {
        if let Ok(ch) = peers.channel(&inst) {
            watch.lock().asked(&inst.grpc_addr, (peers.service(), &inst.id), Instant::now());
            let mut req = tonic::Request::new(HealthCheckRequest { service: String::new() });
            req.set_timeout(Duration::from_secs(5));
            // Any answer is an answer (NOT_SERVING is a draining peer, not
            // a frozen one); a timeout or a lost connection is none.
            let answered = match HealthClient::new(ch).check(req).await {
                Ok(_) => true,
                Err(e) => {
                    !crate::grpc::peer_lost(&e)
                        && !matches!(e.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded)
                }
            };
            if answered {
                watch.lock().answered(&inst.grpc_addr, Instant::now(), 0, 0);
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn knobs() -> Knobs {
        Knobs { floor: MS(1000), steps: 8, eject: MS(1000), eject_max: MS(30_000) }
    }

    #[test]
    fn an_unanswered_poll_is_silence_only_after_the_patience() {
        let mut o = Outliers::new(knobs());
        let t0 = Instant::now();
        o.asked("a", ("decode", "decode-0"), t0);
        o.answered("a", t0 + MS(5), 0, 20);
        o.asked("a", ("decode", "decode-0"), t0 + MS(250));
        assert_eq!(o.silence("a", t0 + MS(1200)), None);
        assert_eq!(o.silence("a", t0 + MS(1250)), Some(Silence::Silent(MS(1000))));
        // Asking again while unanswered keeps the first ask's time.
        o.asked("a", ("decode", "decode-0"), t0 + MS(1300));
        assert_eq!(o.standing("a", t0 + MS(1300)), Standing::Silent);
        o.answered("a", t0 + MS(1400), 0, 20);
        assert_eq!(o.standing("a", t0 + MS(1400)), Standing::Good);
        assert_eq!(o.silence("nobody", t0), None, "a worker never polled is not judged");
    }

    #[test]
    fn a_stuck_loop_counts_from_its_answer_and_slow_workers_get_more_patience() {
        let mut o = Outliers::new(knobs());
        let t0 = Instant::now();
        o.answered("a", t0, 700, 20);
        assert_eq!(o.silence("a", t0 + MS(200)), None);
        assert_eq!(o.silence("a", t0 + MS(300)), Some(Silence::Stuck(MS(1000))));
        // Steps of 250 ms: 8 of them (2 s) before a stuck loop counts.
        o.answered("b", t0, 1500, 250);
        assert_eq!(o.patience("b"), MS(2000));
        assert_eq!(o.silence("b", t0 + MS(400)), None);
        assert!(o.silence("b", t0 + MS(500)).is_some());
        // An unanswered poll needs only the floor, however long its steps.
        o.asked("b", ("prefill", "prefill-1"), t0 + MS(100));
        assert_eq!(o.silence("b", t0 + MS(1100)), Some(Silence::Silent(MS(1000))));
    }

    #[test]
    fn ejection_doubles_with_strikes_in_a_row_then_probes_and_clears() {
        let mut o = Outliers::new(knobs());
        let t0 = Instant::now();
        o.answered("a", t0, 0, 10);
        assert_eq!(o.strike("a", Strike::Stall, t0), MS(1000));
        assert_eq!(o.standing("a", t0 + MS(999)), Standing::Ejected);
        assert_eq!(o.standing("a", t0 + MS(1000)), Standing::Probe);
        assert_eq!(o.strike("a", Strike::Stall, t0 + MS(1100)), MS(2000));
        assert_eq!(o.strike("a", Strike::Lost, t0 + MS(1200)), MS(4000));
        for _ in 0..10 {
            o.strike("a", Strike::Stall, t0 + MS(1300));
        }
        assert_eq!(o.strike("a", Strike::Stall, t0 + MS(1300)), MS(30_000), "capped");
        o.cleared("a");
        assert_eq!(o.standing("a", t0 + MS(1400)), Standing::Good);
        assert_eq!(o.strike("a", Strike::Stall, t0 + MS(1500)), MS(1000), "a fresh start after a success");
    }

    #[test]
    fn a_worker_that_left_discovery_keeps_its_strikes_for_a_while() {
        let mut o = Outliers::new(knobs());
        let t0 = Instant::now();
        o.answered("a", t0, 0, 10);
        o.answered("b", t0, 0, 10);
        o.strike("a", Strike::Stall, t0);
        o.retain(|_| false, t0 + MS(5000));
        assert_eq!(o.standing("a", t0 + MS(5000)), Standing::Probe, "back within 10 s: probed, not trusted");
        assert_eq!(o.by_addr.len(), 1, "a worker with no strike is forgotten at once");
        o.retain(|_| false, t0 + MS(10_001));
        assert_eq!(o.by_addr.len(), 0);
    }

    #[test]
    fn the_report_says_how_many_strikes_and_for_how_long() {
        let mut o = Outliers::new(knobs());
        let t0 = Instant::now();
        o.asked("a", ("decode", "decode-0"), t0);
        o.answered("a", t0, 0, 10);
        for i in 0..3 {
            o.strike("a", Strike::Stall, t0 + MS(i * 100));
        }
        let r = o.report(t0 + MS(1000));
        assert_eq!(r.len(), 1);
        assert_eq!(r[0]["worker"], "decode-0");
        assert_eq!(r[0]["standing"], "ejected");
        assert_eq!(r[0]["why"], "3 stalls in 10 s; ejected for 3.2 s more");
        // Strikes older than RECENT leave the count.
        o.strike("a", Strike::Lost, t0 + MS(10_150));
        let why = o.report(t0 + MS(10_150))[0]["why"].as_str().unwrap().to_string();
        assert!(why.starts_with("1 stall in 10 s; 1 lost call in 10 s"), "{why}");
    }
}
