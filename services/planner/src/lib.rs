//! The autoscaling planner: from the mesh's own signals, sampled every few
//! seconds, the replicas each kind should have and why, in words a person
//! can check ("prefill queue wait p90 1.80 s > 0.50 s target for 6 s;
//! prefill 1 -> 2").
//!
//! [`Planner::decide`] is a pure step: no clock, no I/O. `meshctl up
//! --autoscale` feeds it live signals and acts on its decisions;
//! [`sim`] feeds it a model of the mesh's queues, to test it on loads no
//! small host could carry.

pub mod policy;
mod rules;
pub mod sim;

use std::fmt;

pub use policy::Policy;

/// Most replicas of one kind (as `meshctl up` allows).
pub const MAX_REPLICAS: usize = 64;

/// The kinds the planner scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Prefill,
    Decode,
    Router,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Prefill, Kind::Decode, Kind::Router];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Prefill => "prefill",
            Kind::Decode => "decode",
            Kind::Router => "router",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The prefill workers' signals over the last window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillSignals {
    /// p90 of the wait before compute, seconds (the oldest queued
    /// request's age where that is longer: a stuck queue shows).
    pub queue_wait_p90_s: f64,
    /// Prompt tokens waiting in the queues now.
    pub queued_tokens: f64,
    /// How long a prompt arriving now would wait (the queues' own
    /// estimate: queued tokens at the replicas' speed), seconds. It leads
    /// the waits seen, so a burst shows at once.
    pub expected_wait_s: f64,
    /// Share of the replicas' time spent computing, 0-1.
    pub busy: f64,
}

/// The decode workers' signals over the last window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeSignals {
    /// Share of the KV blocks in use, over the ready replicas, 0-1.
    pub kv_use: f64,
    /// Admissions refused for want of KV room, per second.
    pub refusals_per_s: f64,
    /// Sequences running now.
    pub running: f64,
    /// p90 of the time between a running stream's tokens (the decode
    /// workers' step time); None when no step ran.
    pub inter_token_p90_s: Option<f64>,
}

/// The routers' signals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RouterSignals {
    /// Requests in flight over all routers.
    pub in_flight: f64,
}

/// One sample of the mesh. A kind's signals are None when they could not
/// be read: the planner then holds that kind and says so.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Signals {
    /// Seconds since the planner started.
    pub at_s: f64,
    pub prefill: Option<PrefillSignals>,
    pub decode: Option<DecodeSignals>,
    pub router: Option<RouterSignals>,
    /// Time to first token, p90 (None when no request began in the window).
    pub ttft_p90_s: Option<f64>,
}

/// Which way a decision goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Up,
    Down,
    /// No change.
    Hold,
    /// At its max (or out of host room) and still missing a target:
    /// reported once per up-cooldown.
    Saturated,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Up => "up",
            Direction::Down => "down",
            Direction::Hold => "hold",
            Direction::Saturated => "saturated",
        }
    }
}

/// One kind's decision at one sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub kind: Kind,
    pub from: usize,
    pub to: usize,
    pub direction: Direction,
    /// The signal behind it, short, for a metric label: `queue_wait`,
    /// `inter_token`, `kv_use`, `refusals`, `in_flight`, `low_load`,
    /// `min`, `no_signal`, `steady`.
    pub signal: &'static str,
    /// In words: what was seen, against what, for how long, and the change.
    pub reason: String,
}

/// A kind's memory between samples: its desired replicas, since when a
/// target has been missed (or the load been low), and its last changes.
#[derive(Clone, Debug)]
struct KindState {
    replicas: usize,
    pressed_since: Option<f64>,
    low_since: Option<f64>,
    last_up: f64,
    last_change: f64,
    last_saturated: f64,
}

/// The planner: the policy and each scaled kind's state.
#[derive(Clone, Debug)]
pub struct Planner {
    policy: Policy,
    kinds: Vec<(Kind, KindState)>,
}

impl Planner {
    /// A planner starting from the replicas running now (clamped to the
    /// policy's bounds on the first decision).
    pub fn new(policy: Policy, running: impl Fn(Kind) -> usize) -> Planner {
        let kinds = Kind::ALL
            .into_iter()
            .filter(|k| policy.bounds(*k).is_some())
            .map(|k| {
                let state = KindState {
                    replicas: running(k),
                    pressed_since: None,
                    low_since: None,
                    last_up: f64::NEG_INFINITY,
                    last_change: f64::NEG_INFINITY,
                    last_saturated: f64::NEG_INFINITY,
                };
                (k, state)
            })
            .collect();
        Planner { policy, kinds }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The replicas each scaled kind should have now.
    pub fn desired(&self) -> Vec<(Kind, usize)> {
        self.kinds.iter().map(|(k, s)| (*k, s.replicas)).collect()
    }

    /// What runs of `kind` when it differs from what the planner decided
    /// (a scale that failed): the next decision starts from it.
    pub fn set_replicas(&mut self, kind: Kind, n: usize) {
        if let Some((_, s)) = self.kinds.iter_mut().find(|(k, _)| *k == kind) {
            s.replicas = n;
        }
    }

    /// One step: a decision per scaled kind (most are `Hold`).
    pub fn decide(&mut self, sig: &Signals) -> Vec<Decision> {
        let cores_in_use: usize = self.kinds.iter().map(|(k, s)| s.replicas * self.cores(*k)).sum();
        let mut room = match self.policy.host.cores {
            0 => usize::MAX,
            c => c.saturating_sub(cores_in_use),
        };
        let mut out = Vec::new();
        for i in 0..self.kinds.len() {
            let kind = self.kinds[i].0;
            let d = rules::step(&self.policy, kind, &mut self.kinds[i].1, sig, &mut room);
            out.push(d);
        }
        out
    }

    fn cores(&self, kind: Kind) -> usize {
        self.policy.bounds(kind).map_or(0, |b| b.cores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(extra: &str) -> Policy {
        Policy::parse(&format!("[prefill]\nmin = 1\nmax = 3\n[decode]\nmin = 1\nmax = 2\n{extra}")).unwrap()
    }

    fn sig(at_s: f64, wait: f64, busy: f64, decode: DecodeSignals) -> Signals {
        Signals {
            at_s,
            prefill: Some(PrefillSignals { queue_wait_p90_s: wait, busy, ..PrefillSignals::default() }),
            decode: Some(decode),
            router: None,
            ttft_p90_s: None,
        }
    }

    fn quiet() -> DecodeSignals {
        DecodeSignals { kv_use: 0.3, inter_token_p90_s: Some(0.02), running: 4.0, ..DecodeSignals::default() }
    }

    fn of(ds: &[Decision], kind: Kind) -> &Decision {
        ds.iter().find(|d| d.kind == kind).unwrap()
    }

    #[test]
    fn a_missed_target_held_long_enough_scales_up_and_says_why() {
        let mut p = Planner::new(policy(""), |_| 1);
        for t in [0.0, 2.0] {
            let d = p.decide(&sig(t, 1.8, 1.0, quiet()));
            assert_eq!(of(&d, Kind::Prefill).direction, Direction::Hold, "not yet: {}", of(&d, Kind::Prefill).reason);
        }
        let d = p.decide(&sig(4.0, 1.8, 1.0, quiet()));
        let up = of(&d, Kind::Prefill);
        assert_eq!((up.direction, up.from, up.to, up.signal), (Direction::Up, 1, 2, "queue_wait"));
        assert_eq!(up.reason, "prefill queue wait p90 1.80 s > 0.50 s target for 4 s; prefill 1 -> 2");
        assert_eq!(of(&d, Kind::Decode).direction, Direction::Hold);
        // Within the cooldown, no second step.
        let d = p.decide(&sig(10.0, 1.8, 1.0, quiet()));
        assert_eq!(of(&d, Kind::Prefill).direction, Direction::Hold, "{}", of(&d, Kind::Prefill).reason);
        assert_eq!(p.desired(), vec![(Kind::Prefill, 2), (Kind::Decode, 1)]);
    }

    #[test]
    fn a_signal_that_flickers_never_scales() {
        let mut p = Planner::new(policy(""), |_| 1);
        for i in 0..100 {
            let wait = if i % 2 == 0 { 1.8 } else { 0.1 };
            for d in p.decide(&sig(f64::from(i) * 2.0, wait, 0.5, quiet())) {
                assert_eq!(d.direction, Direction::Hold, "{}", d.reason);
            }
        }
    }

    #[test]
    fn missing_signals_hold_the_kind_and_say_so() {
        let mut p = Planner::new(policy(""), |_| 2);
        for t in 0..60 {
            let mut s = sig(f64::from(t) * 2.0, 0.0, 0.0, quiet());
            s.decode = None;
            let d = p.decide(&s);
            let dec = of(&d, Kind::Decode);
            assert_eq!((dec.direction, dec.signal), (Direction::Hold, "no_signal"));
            assert!(dec.reason.contains("could not be read"), "{}", dec.reason);
        }
        // Prefill, whose signals were there, came down meanwhile.
        assert_eq!(p.desired(), vec![(Kind::Prefill, 1), (Kind::Decode, 2)]);
    }

    #[test]
    fn a_kind_at_its_max_that_misses_its_target_is_reported_every_cooldown() {
        let mut p = Planner::new(policy(""), |_| 2);
        let hot = DecodeSignals { kv_use: 0.97, refusals_per_s: 3.0, ..quiet() };
        let mut saturated = Vec::new();
        for t in 0..30 {
            let at = f64::from(t) * 2.0;
            let d = p.decide(&sig(at, 0.0, 0.3, hot));
            let dec = of(&d, Kind::Decode);
            assert_ne!(dec.direction, Direction::Up);
            if dec.direction == Direction::Saturated {
                assert!(dec.reason.ends_with("decode is at its max (2)"), "{}", dec.reason);
                saturated.push(at);
            }
        }
        assert_eq!(saturated, [4.0, 14.0, 24.0, 34.0, 44.0, 54.0], "once per 10 s cooldown");
    }

    #[test]
    fn the_host_s_room_caps_a_scale_up() {
        let mut p = Planner::new(policy("[host]\ncores = 3\n"), |_| 1);
        let hot = DecodeSignals { inter_token_p90_s: Some(0.5), ..quiet() };
        let mut last = Vec::new();
        for t in 0..20 {
            last = p.decide(&sig(f64::from(t) * 2.0, 5.0, 1.0, hot));
        }
        let total: usize = p.desired().iter().map(|(_, n)| n).sum();
        assert_eq!(total, 3, "{:?}", p.desired());
        assert!(last.iter().any(|d| d.reason.contains("no room on the host")), "{last:#?}");
    }

    #[test]
    fn the_load_that_brought_a_scale_up_does_not_bring_it_down() {
        let mut p = Planner::new(policy(""), |_| 1);
        let mut ups = 0;
        // 1 replica 100% busy and queueing; 2 are 55% busy, calm.
        for t in 0..400 {
            let n = p.desired()[0].1;
            let (wait, busy) = if n == 1 { (2.0, 1.0) } else { (0.05, 0.55) };
            for d in p.decide(&sig(f64::from(t) * 2.0, wait, busy, quiet())) {
                assert_ne!((d.kind, d.direction), (Kind::Prefill, Direction::Down), "{}", d.reason);
                ups += usize::from(d.direction == Direction::Up);
            }
        }
        assert_eq!(ups, 1);
    }

    #[test]
    fn decode_that_needed_two_replicas_keeps_them() {
        let mut p = Planner::new(policy(""), |_| 1);
        let mut moves = Vec::new();
        // On 1: 150 ms a token and 60% KV; on 2: 70 ms and 30%, which on
        // one would be 140 ms again.
        for t in 0..400 {
            let n = p.desired()[1].1;
            let (itl, kv) = if n == 1 { (0.15, 0.6) } else { (0.07, 0.3) };
            let load = DecodeSignals { kv_use: kv, inter_token_p90_s: Some(itl), running: 8.0, refusals_per_s: 0.0 };
            for d in p.decide(&sig(f64::from(t) * 2.0, 0.0, 0.5, load)).into_iter().filter(|d| d.kind == Kind::Decode) {
                if d.direction != Direction::Hold {
                    moves.push((d.direction, d.signal));
                }
            }
        }
        assert_eq!(moves, [(Direction::Up, "inter_token")]);
    }

    #[test]
    fn low_load_held_long_enough_scales_down_one_at_a_time() {
        let mut p = Planner::new(policy(""), |k| if k == Kind::Prefill { 3 } else { 2 });
        let idle = DecodeSignals { kv_use: 0.0, inter_token_p90_s: None, running: 0.0, ..quiet() };
        let mut downs = Vec::new();
        for t in 0..200 {
            for d in p.decide(&sig(f64::from(t) * 2.0, 0.0, 0.02, idle)) {
                if d.direction == Direction::Down {
                    downs.push((f64::from(t) * 2.0, d.kind, d.to));
                }
            }
        }
        assert_eq!(downs, [(60.0, Kind::Prefill, 2), (60.0, Kind::Decode, 1), (122.0, Kind::Prefill, 1)]);
    }

    #[test]
    fn replicas_outside_the_bounds_move_inside_at_once() {
        let mut p = Planner::new(policy(""), |k| if k == Kind::Prefill { 0 } else { 5 });
        let d = p.decide(&sig(0.0, 0.0, 0.0, quiet()));
        assert_eq!((of(&d, Kind::Prefill).to, of(&d, Kind::Prefill).signal), (1, "min"));
        assert_eq!((of(&d, Kind::Decode).to, of(&d, Kind::Decode).signal), (2, "max"));
    }
}
