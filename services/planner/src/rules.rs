//! One kind's step: read its signals against the targets (a target missed,
//! or load low enough for one replica fewer), hold that view for long
//! enough, respect the cooldowns and the host's room, and say why.
//!
//! Hysteresis: a scale-down needs the load to fit one replica fewer with
//! margin (as if the same work went to fewer replicas, linearly: a
//! conservative guess), so the load that brought a scale-up cannot bring
//! the scale-down right after it.

use crate::policy::{Bounds, Policy};
use crate::{Decision, DecodeSignals, Direction, Kind, KindState, PrefillSignals, RouterSignals, Signals};

/// A remaining replica may be at most this busy after a scale-down.
const DOWN_BUSY: f64 = 0.6;
/// A scale-down of prefill needs its queue wait under this share of its target.
const DOWN_WAIT: f64 = 0.5;
/// After a scale-down, the inter-token p90 may be at most this share of its target.
const DOWN_LATENCY: f64 = 0.8;
/// One step up at most doubles a kind.
const MAX_RATIO: f64 = 2.0;
/// A scale-up sizes prefill so its replicas are at most this busy.
const UP_BUSY: f64 = 0.7;

/// A target missed: the metric label, the words, how far over (>1), and
/// the replicas the load needs where the signals tell.
struct Pressure {
    signal: &'static str,
    words: String,
    ratio: f64,
    need: Option<f64>,
}

/// A kind's signals read against the policy.
struct View {
    pressure: Option<Pressure>,
    /// Words when one replica fewer would carry the load.
    low: Option<String>,
    /// Words when neither.
    steady: String,
}

pub(crate) fn step(p: &Policy, kind: Kind, s: &mut KindState, sig: &Signals, room: &mut usize) -> Decision {
    let b = p.bounds(kind).cloned().unwrap_or_default();
    let (now, n) = (sig.at_s, s.replicas);
    if n < b.min || n > b.max {
        let to = n.clamp(b.min, b.max);
        let words =
            if n < b.min { format!("below its minimum {}", b.min) } else { format!("above its maximum {}", b.max) };
        take(room, &b, to as isize - n as isize);
        s.last_change = now;
        s.replicas = to;
        let dir = if to > n { Direction::Up } else { Direction::Down };
        let signal = if to > n { "min" } else { "max" };
        return decision(kind, n, to, dir, signal, format!("{kind} {n} is {words}; {kind} {n} -> {to}"));
    }
    let Some(view) = read(p, kind, sig, n) else {
        s.pressed_since = None;
        s.low_since = None;
        let why = format!("holding {kind} at {n}: its signals could not be read (never scaled on missing data)");
        return decision(kind, n, n, Direction::Hold, "no_signal", why);
    };
    match view.pressure {
        Some(pr) => {
            s.low_since = None;
            up(p, &b, kind, s, now, pr, room)
        }
        None => {
            s.pressed_since = None;
            match view.low {
                Some(words) if n > b.min => down(p, &b, kind, s, now, words, room),
                _ => {
                    s.low_since = None;
                    decision(kind, n, n, Direction::Hold, "steady", format!("{}; holding {kind} at {n}", view.steady))
                }
            }
        }
    }
}

fn up(p: &Policy, b: &Bounds, kind: Kind, s: &mut KindState, now: f64, pr: Pressure, room: &mut usize) -> Decision {
    let t = &p.timing;
    let n = s.replicas;
    let held = now - *s.pressed_since.get_or_insert(now);
    if held + 1e-6 < t.up_after_s {
        let why = format!("{} for {held:.0} s (acts after {:.0} s); holding {kind} at {n}", pr.words, t.up_after_s);
        return decision(kind, n, n, Direction::Hold, pr.signal, why);
    }
    if now - s.last_up + 1e-6 < t.up_cooldown_s {
        let why = format!("{}; holding {kind} at {n}, {:.0} s after its last scale-up", pr.words, now - s.last_up);
        return decision(kind, n, n, Direction::Hold, pr.signal, why);
    }
    let extra = match pr.need {
        Some(need) => (need.ceil() as usize).saturating_sub(n),
        None => (n.max(1) as f64 * (pr.ratio.min(MAX_RATIO) - 1.0)).ceil() as usize,
    };
    let want = (n + extra.clamp(1, n.max(1))).min(b.max);
    let fits = room.checked_div(b.cores).map_or(want, |more| want.min(n.saturating_add(more)));
    if fits > n {
        take(room, b, (fits - n) as isize);
        s.replicas = fits;
        s.last_up = now;
        s.last_change = now;
        s.pressed_since = None;
        let short = if fits < want { format!(" (the host has room for {fits}, not {want})") } else { String::new() };
        let why = format!("{} for {held:.0} s; {kind} {n} -> {fits}{short}", pr.words);
        return decision(kind, n, fits, Direction::Up, pr.signal, why);
    }
    let limit = if n >= b.max {
        format!("{kind} is at its max ({})", b.max)
    } else {
        format!("no room on the host for another {kind} replica ({} cores; host.cores {})", b.cores, p.host.cores)
    };
    let why = format!("{} for {held:.0} s; {limit}", pr.words);
    if now - s.last_saturated + 1e-6 >= t.up_cooldown_s {
        s.last_saturated = now;
        return decision(kind, n, n, Direction::Saturated, pr.signal, why);
    }
    decision(kind, n, n, Direction::Hold, pr.signal, why)
}

fn down(p: &Policy, b: &Bounds, kind: Kind, s: &mut KindState, now: f64, words: String, room: &mut usize) -> Decision {
    let t = &p.timing;
    let n = s.replicas;
    let held = now - *s.low_since.get_or_insert(now);
    if held + 1e-6 < t.down_after_s || now - s.last_change + 1e-6 < t.down_cooldown_s {
        let why = format!("{words} for {held:.0} s (acts after {:.0} s); holding {kind} at {n}", t.down_after_s);
        return decision(kind, n, n, Direction::Hold, "low_load", why);
    }
    take(room, b, -1);
    s.replicas = n - 1;
    s.last_change = now;
    s.low_since = None;
    decision(kind, n, n - 1, Direction::Down, "low_load", format!("{words} for {held:.0} s; {kind} {n} -> {}", n - 1))
}

/// Book `delta` replicas of `b.cores` against the host's room.
fn take(room: &mut usize, b: &Bounds, delta: isize) {
    if *room == usize::MAX {
        return;
    }
    let cores = delta.unsigned_abs() * b.cores;
    *room = if delta > 0 { room.saturating_sub(cores) } else { *room + cores };
}

fn decision(
    kind: Kind,
    from: usize,
    to: usize,
    direction: Direction,
    signal: &'static str,
    reason: String,
) -> Decision {
    Decision { kind, from, to, direction, signal, reason }
}

/// `x` as if the same work went to `n - 1` replicas instead of `n`.
fn on_fewer(x: f64, n: usize) -> f64 {
    if n <= 1 {
        f64::INFINITY
    } else {
        x * n as f64 / (n - 1) as f64
    }
}

fn read(p: &Policy, kind: Kind, sig: &Signals, n: usize) -> Option<View> {
    match kind {
        Kind::Prefill => sig.prefill.map(|s| prefill(p, &s, n)),
        Kind::Decode => sig.decode.map(|s| decode(p, &s, n)),
        Kind::Router => sig.router.map(|s| router(p, &s, n)),
    }
}

fn prefill(p: &Policy, s: &PrefillSignals, n: usize) -> View {
    let t = &p.targets;
    let (wait, busy) = (s.queue_wait_p90_s, s.busy);
    let need = Some(busy * n as f64 / UP_BUSY);
    let pressure = if wait > t.queue_wait_p90_s {
        Some(Pressure {
            signal: "queue_wait",
            words: format!("prefill queue wait p90 {wait:.2} s > {:.2} s target", t.queue_wait_p90_s),
            ratio: wait / t.queue_wait_p90_s,
            need,
        })
    } else {
        (s.expected_wait_s > t.queue_wait_p90_s).then(|| Pressure {
            signal: "queue_wait",
            words: format!(
                "prefill expected queue wait {:.2} s > {:.2} s target ({:.0} prompt tokens queued)",
                s.expected_wait_s, t.queue_wait_p90_s, s.queued_tokens
            ),
            ratio: s.expected_wait_s / t.queue_wait_p90_s,
            need,
        })
    };
    let idle = n == 1 && busy < 0.01 && s.queued_tokens == 0.0;
    let fewer = on_fewer(busy, n);
    let low = (idle || (fewer < DOWN_BUSY && wait < DOWN_WAIT * t.queue_wait_p90_s)).then(|| {
        format!(
            "prefill busy {:.0}%, queue wait p90 {wait:.2} s: {} would be {:.0}% busy",
            busy * 100.0,
            n - 1,
            fewer.min(1.0) * 100.0
        )
    });
    let steady = format!("prefill queue wait p90 {wait:.2} s, busy {:.0}%: within target", busy * 100.0);
    View { pressure, low, steady }
}

fn decode(p: &Policy, s: &DecodeSignals, n: usize) -> View {
    let t = &p.targets;
    let itl_words = s.inter_token_p90_s.map_or("none".to_string(), |i| format!("{:.0} ms", i * 1e3));
    let mut all = Vec::new();
    if let Some(itl) = s.inter_token_p90_s.filter(|i| *i > t.inter_token_p90_s) {
        all.push(Pressure {
            signal: "inter_token",
            words: format!("decode inter-token p90 {:.0} ms > {:.0} ms target", itl * 1e3, t.inter_token_p90_s * 1e3),
            ratio: itl / t.inter_token_p90_s,
            need: None,
        });
    }
    if s.kv_use > t.kv_use_high {
        all.push(Pressure {
            signal: "kv_use",
            words: format!("decode KV use {:.0}% > {:.0}%", s.kv_use * 100.0, t.kv_use_high * 100.0),
            ratio: s.kv_use / t.kv_use_high,
            need: None,
        });
    }
    if s.refusals_per_s > 0.0 {
        all.push(Pressure {
            signal: "refusals",
            words: format!("decode refused {:.1} admissions/s for want of KV room", s.refusals_per_s),
            ratio: 1.5,
            need: None,
        });
    }
    let pressure = all.into_iter().max_by(|a, b| a.ratio.total_cmp(&b.ratio));
    let itl_ok = s.inter_token_p90_s.is_none_or(|i| on_fewer(i, n) < DOWN_LATENCY * t.inter_token_p90_s);
    let idle = n == 1 && s.running == 0.0;
    let fits = on_fewer(s.kv_use, n) < 0.5 * t.kv_use_high && itl_ok && s.refusals_per_s == 0.0;
    let low = (idle || fits).then(|| {
        format!("decode KV use {:.0}%, inter-token p90 {itl_words}: {} would hold it", s.kv_use * 100.0, n - 1)
    });
    let steady = format!("decode KV use {:.0}%, inter-token p90 {itl_words}: within target", s.kv_use * 100.0);
    View { pressure, low, steady }
}

fn router(p: &Policy, s: &RouterSignals, n: usize) -> View {
    let t = &p.targets;
    let per = s.in_flight / n.max(1) as f64;
    let pressure = (per > t.router_in_flight).then(|| Pressure {
        signal: "in_flight",
        words: format!("{per:.0} requests in flight per router > {:.0} target", t.router_in_flight),
        ratio: per / t.router_in_flight,
        need: None,
    });
    let low = (n > 1 && s.in_flight / ((n - 1) as f64) < 0.5 * t.router_in_flight)
        .then(|| format!("{per:.0} requests in flight per router: {} would carry them", n - 1));
    let steady = format!("{per:.0} requests in flight per router: within target");
    View { pressure, low, steady }
}
