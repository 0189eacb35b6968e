//! A simulator of the mesh's queues, to test the planner on loads no small
//! host could carry, in seconds of simulated time.
//!
//! It models what the planner reads, not the engine: prefill replicas
//! compute prompts from one shared FIFO queue at a set token rate; decode
//! replicas admit a sequence when it has KV blocks for its prompt and
//! answer (else it waits, and the router's retry every 0.1 s counts as a
//! refusal), and step their whole batch at a time that grows with the
//! batch. New replicas are ready after a start-up time; a replica scaled
//! down drains: a prefill replica finishes its prompt, a decode replica
//! hands its sequences to others with room (their KV shipped) or runs
//! them out. A request not finished by its deadline fails.

use std::collections::VecDeque;

use crate::{Decision, DecodeSignals, Direction, Kind, Planner, Policy, PrefillSignals, RouterSignals, Signals};

/// The set speeds of the simulated workers.
#[derive(Clone, Copy, Debug)]
pub struct Speeds {
    /// Prompt tokens per second one prefill replica computes.
    pub prefill_tokens_per_s: f64,
    /// A decode step's time: `step_s + step_per_seq_s × batch`.
    pub step_s: f64,
    pub step_per_seq_s: f64,
    /// KV blocks per decode replica, and tokens per block.
    pub kv_blocks: usize,
    pub block_tokens: usize,
    /// Seconds from a scale-up to a ready replica.
    pub startup_s: f64,
    /// A request not finished this long after it arrived fails.
    pub deadline_s: f64,
}

impl Default for Speeds {
    fn default() -> Speeds {
        Speeds {
            prefill_tokens_per_s: 2000.0,
            step_s: 0.020,
            step_per_seq_s: 0.0002,
            kv_blocks: 2000,
            block_tokens: 16,
            startup_s: 3.0,
            deadline_s: 120.0,
        }
    }
}

/// A stretch of load: requests per second (Poisson arrivals), each with
/// this many prompt and answer tokens.
#[derive(Clone, Copy, Debug)]
pub struct Phase {
    pub seconds: f64,
    pub rps: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

/// One planner sample as the simulator saw it.
#[derive(Clone, Debug)]
pub struct Sample {
    pub at_s: f64,
    /// Replicas per kind, starting ones included (the planner's view).
    pub prefill: usize,
    pub decode: usize,
    pub signals: Signals,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub samples: Vec<Sample>,
    /// Every decision that was not a hold, with its time.
    pub decisions: Vec<(f64, Decision)>,
    pub finished: usize,
    pub failed: usize,
}

impl Report {
    /// Changes (up or down) of any kind between `from_s` and `to_s`.
    pub fn changes_between(&self, from_s: f64, to_s: f64) -> usize {
        self.decisions
            .iter()
            .filter(|(t, d)| *t >= from_s && *t < to_s && matches!(d.direction, Direction::Up | Direction::Down))
            .count()
    }

    /// The replicas of `kind` at the last sample.
    pub fn last(&self, kind: Kind) -> usize {
        self.samples.last().map_or(0, |s| if kind == Kind::Prefill { s.prefill } else { s.decode })
    }
}

struct Request {
    arrived: f64,
    prompt: usize,
    output: usize,
    done_tokens: usize,
    last_token: f64,
}

#[derive(Default)]
struct PrefillRep {
    ready_at: f64,
    draining: bool,
    /// The request it computes and the prompt tokens left.
    current: Option<(usize, f64)>,
}

#[derive(Default)]
struct DecodeRep {
    ready_at: f64,
    draining: bool,
    seqs: Vec<usize>,
    blocks: usize,
    step_left: f64,
}

/// Events in the current sampling window.
#[derive(Default)]
struct Window {
    waits: Vec<f64>,
    ttfts: Vec<f64>,
    gaps: Vec<f64>,
    refusals: f64,
    busy_s: f64,
    ready_s: f64,
}

/// The simulated mesh.
struct Mesh {
    speeds: Speeds,
    now: f64,
    reqs: Vec<Request>,
    queue: VecDeque<usize>,
    awaiting: VecDeque<usize>,
    prefill: Vec<PrefillRep>,
    decode: Vec<DecodeRep>,
    win: Window,
    finished: usize,
    failed: usize,
    rng: u64,
    /// When the last sample was taken (the window's start).
    sampled_at: f64,
    /// The last sampling windows, with their lengths.
    history: VecDeque<(f64, Window)>,
    ticks: u64,
}

/// Simulation step, seconds.
const DT: f64 = 0.002;
/// The router retries a refused admission this often.
const RETRY_S: f64 = 0.1;

/// Run `phases` against a mesh starting with `start` (prefill, decode)
/// replicas, the planner sampling every `policy.timing.interval_s`.
pub fn run(policy: Policy, speeds: Speeds, phases: &[Phase], start: (usize, usize)) -> Report {
    let mut m = Mesh::new(speeds, start);
    let mut planner = Planner::new(policy, |k| match k {
        Kind::Prefill => start.0,
        Kind::Decode => start.1,
        Kind::Router => 1,
    });
    let interval = planner.policy().timing.interval_s;
    let keep = (planner.policy().timing.window_s / interval).round() as usize;
    let end: f64 = phases.iter().map(|p| p.seconds).sum();
    let mut report = Report::default();
    let (mut next_arrival, mut next_sample) = (0.0, interval);
    let mut rps = 0.0;
    while m.now < end {
        let phase = phase_at(phases, m.now);
        if phase.rps != rps {
            // A new phase's arrivals start with it.
            rps = phase.rps;
            next_arrival = m.now + if rps > 0.0 { m.exp(1.0 / rps) } else { 0.0 };
        }
        while phase.rps > 0.0 && next_arrival <= m.now {
            m.arrive(phase);
            next_arrival += m.exp(1.0 / phase.rps);
        }
        m.tick();
        if m.now >= next_sample {
            next_sample += interval;
            let signals = m.signals(keep);
            for d in planner.decide(&signals) {
                m.apply(&d);
                if d.direction != Direction::Hold {
                    report.decisions.push((m.now, d));
                }
            }
            report.samples.push(Sample {
                at_s: m.now,
                prefill: m.prefill.iter().filter(|r| !r.draining).count(),
                decode: m.decode.iter().filter(|r| !r.draining).count(),
                signals,
            });
        }
    }
    report.finished = m.finished;
    report.failed = m.failed;
    report
}

fn phase_at(phases: &[Phase], t: f64) -> Phase {
    let mut at = 0.0;
    for p in phases {
        at += p.seconds;
        if t < at {
            return *p;
        }
    }
    phases.last().copied().unwrap_or(Phase { seconds: 0.0, rps: 0.0, prompt_tokens: 0, output_tokens: 0 })
}

fn p90(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[((v.len() as f64 * 0.9).ceil() as usize).clamp(1, v.len()) - 1])
}

impl Mesh {
    fn new(speeds: Speeds, (p, d): (usize, usize)) -> Mesh {
        Mesh {
            speeds,
            now: 0.0,
            reqs: Vec::new(),
            queue: VecDeque::new(),
            awaiting: VecDeque::new(),
            prefill: (0..p).map(|_| PrefillRep::default()).collect(),
            decode: (0..d).map(|_| DecodeRep::default()).collect(),
            win: Window::default(),
            finished: 0,
            failed: 0,
            rng: 0x9e37_79b9_7f4a_7c15,
            sampled_at: 0.0,
            history: VecDeque::new(),
            ticks: 0,
        }
    }

    /// An exponential draw with mean `mean` (a fixed-seed xorshift: runs repeat).
    fn exp(&mut self, mean: f64) -> f64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let u = ((self.rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        -mean * u.ln()
    }

    fn arrive(&mut self, p: Phase) {
        self.queue.push_back(self.reqs.len());
        self.reqs.push(Request {
            arrived: self.now,
            prompt: p.prompt_tokens,
            output: p.output_tokens,
            done_tokens: 0,
            last_token: 0.0,
        });
    }

    fn blocks(&self, r: usize) -> usize {
        let q = &self.reqs[r];
        (q.prompt + q.output).div_ceil(self.speeds.block_tokens)
    }

    fn tick(&mut self) {
        self.ticks += 1;
        self.now = self.ticks as f64 * DT;
        self.prefill_tick();
        self.admit();
        self.decode_tick();
        self.expire();
    }

    fn prefill_tick(&mut self) {
        let now = self.now;
        for i in 0..self.prefill.len() {
            if self.prefill[i].ready_at > now {
                continue;
            }
            self.win.ready_s += DT;
            if self.prefill[i].current.is_none() && !self.prefill[i].draining {
                if let Some(r) = self.queue.pop_front() {
                    self.win.waits.push(now - self.reqs[r].arrived);
                    self.prefill[i].current = Some((r, self.reqs[r].prompt as f64));
                }
            }
            if let Some((r, left)) = self.prefill[i].current.as_mut() {
                self.win.busy_s += DT;
                *left -= self.speeds.prefill_tokens_per_s * DT;
                if *left <= 0.0 {
                    self.awaiting.push_back(*r);
                    self.prefill[i].current = None;
                }
            }
        }
        self.prefill.retain(|r| !(r.draining && r.current.is_none()));
    }

    /// The decode replica, ready and not draining, with the most free blocks
    /// if it has `need`.
    fn room_for(&self, need: usize, except: Option<usize>) -> Option<usize> {
        (0..self.decode.len())
            .filter(|&i| Some(i) != except && self.decode[i].ready_at <= self.now && !self.decode[i].draining)
            .filter(|&i| self.speeds.kv_blocks - self.decode[i].blocks >= need)
            .max_by_key(|&i| self.speeds.kv_blocks - self.decode[i].blocks)
    }

    fn admit(&mut self) {
        while let Some(&r) = self.awaiting.front() {
            let need = self.blocks(r);
            let Some(i) = self.room_for(need, None) else {
                self.win.refusals += self.awaiting.len() as f64 * DT / RETRY_S;
                return;
            };
            self.awaiting.pop_front();
            let d = &mut self.decode[i];
            d.blocks += need;
            d.seqs.push(r);
            // The prefill's first token: the stream begins.
            self.win.ttfts.push(self.now - self.reqs[r].arrived);
            self.reqs[r].done_tokens = 1;
            self.reqs[r].last_token = self.now;
        }
    }

    fn decode_tick(&mut self) {
        let now = self.now;
        for i in 0..self.decode.len() {
            if self.decode[i].ready_at > now || self.decode[i].seqs.is_empty() {
                continue;
            }
            self.decode[i].step_left -= DT;
            if self.decode[i].step_left > 0.0 {
                continue;
            }
            let seqs = std::mem::take(&mut self.decode[i].seqs);
            let mut kept = Vec::with_capacity(seqs.len());
            for r in seqs {
                let q = &mut self.reqs[r];
                if q.done_tokens == 0 {
                    continue; // expired
                }
                self.win.gaps.push(now - q.last_token);
                q.last_token = now;
                q.done_tokens += 1;
                if q.done_tokens >= q.output {
                    self.finished += 1;
                    q.done_tokens = usize::MAX;
                    self.decode[i].blocks -= (q.prompt + q.output).div_ceil(self.speeds.block_tokens);
                } else {
                    kept.push(r);
                }
            }
            let d = &mut self.decode[i];
            // The remainder carries, so steps keep their time on average.
            d.step_left += self.speeds.step_s + self.speeds.step_per_seq_s * kept.len() as f64;
            d.seqs = kept;
        }
        self.hand_over();
        self.decode.retain(|d| !(d.draining && d.seqs.is_empty()));
    }

    /// Draining decode replicas hand each sequence to a replica with room.
    fn hand_over(&mut self) {
        for i in 0..self.decode.len() {
            if !self.decode[i].draining {
                continue;
            }
            let seqs = std::mem::take(&mut self.decode[i].seqs);
            for r in seqs {
                let need = self.blocks(r);
                match self.room_for(need, Some(i)) {
                    Some(j) => {
                        self.decode[i].blocks -= need;
                        self.decode[j].blocks += need;
                        self.decode[j].seqs.push(r);
                    }
                    None => self.decode[i].seqs.push(r),
                }
            }
        }
    }

    /// Requests past their deadline fail, wherever they are.
    fn expire(&mut self) {
        let (now, deadline) = (self.now, self.speeds.deadline_s);
        let late = |q: &Request| q.done_tokens != usize::MAX && now - q.arrived > deadline;
        let before = self.queue.len() + self.awaiting.len();
        let reqs = &self.reqs;
        self.queue.retain(|&r| !late(&reqs[r]));
        self.awaiting.retain(|&r| !late(&reqs[r]));
        self.failed += before - self.queue.len() - self.awaiting.len();
        for d in &mut self.decode {
            let (bt, before) = (self.speeds.block_tokens, d.seqs.len());
            d.seqs.retain(|&r| {
                let keep = !late(&reqs[r]);
                if !keep {
                    d.blocks -= (reqs[r].prompt + reqs[r].output).div_ceil(bt);
                }
                keep
            });
            self.failed += before - d.seqs.len();
        }
    }

    /// The signals over the last `keep` sampling windows (p90s need more
    /// than one short window's events), as the live collector reads them.
    fn signals(&mut self, keep: usize) -> Signals {
        let w = std::mem::take(&mut self.win);
        self.history.push_back((self.now - std::mem::replace(&mut self.sampled_at, self.now), w));
        while self.history.len() > keep.max(1) {
            self.history.pop_front();
        }
        let all = |f: fn(&Window) -> &Vec<f64>| -> Vec<f64> {
            self.history.iter().flat_map(|(_, w)| f(w).iter().copied()).collect()
        };
        let (mut waits, mut ttfts, mut gaps) = (all(|w| &w.waits), all(|w| &w.ttfts), all(|w| &w.gaps));
        let sum = |f: fn(&Window) -> f64| -> f64 { self.history.iter().map(|(_, w)| f(w)).sum() };
        let (window_s, refusals) = (self.history.iter().map(|(s, _)| s).sum::<f64>().max(DT), sum(|w| w.refusals));
        let (busy_s, ready_s) = (sum(|w| w.busy_s), sum(|w| w.ready_s));
        let oldest = self.queue.front().map_or(0.0, |&r| self.now - self.reqs[r].arrived);
        let queued_tokens: f64 = self.queue.iter().map(|&r| self.reqs[r].prompt as f64).sum();
        let ready_prefill = self.prefill.iter().filter(|p| p.ready_at <= self.now && !p.draining).count();
        let ready: Vec<&DecodeRep> = self.decode.iter().filter(|d| d.ready_at <= self.now).collect();
        let kv_total = (ready.len() * self.speeds.kv_blocks).max(1) as f64;
        Signals {
            at_s: self.now,
            prefill: Some(PrefillSignals {
                queue_wait_p90_s: p90(&mut waits).unwrap_or(0.0).max(oldest),
                queued_tokens,
                expected_wait_s: queued_tokens / (self.speeds.prefill_tokens_per_s * ready_prefill.max(1) as f64),
                busy: if ready_s > 0.0 { busy_s / ready_s } else { 0.0 },
            }),
            decode: Some(DecodeSignals {
                kv_use: ready.iter().map(|d| d.blocks).sum::<usize>() as f64 / kv_total,
                refusals_per_s: refusals / window_s,
                running: self.decode.iter().map(|d| d.seqs.len()).sum::<usize>() as f64,
                inter_token_p90_s: p90(&mut gaps),
            }),
            router: Some(RouterSignals { in_flight: (self.queue.len() + self.awaiting.len()) as f64 }),
            ttft_p90_s: p90(&mut ttfts),
        }
    }

    fn apply(&mut self, d: &Decision) {
        let ready_at = self.now + self.speeds.startup_s;
        match (d.kind, d.direction) {
            (Kind::Prefill, Direction::Up) => {
                for _ in d.from..d.to {
                    self.prefill.push(PrefillRep { ready_at, ..PrefillRep::default() });
                }
            }
            (Kind::Decode, Direction::Up) => {
                for _ in d.from..d.to {
                    self.decode.push(DecodeRep { ready_at, ..DecodeRep::default() });
                }
            }
            (Kind::Prefill, Direction::Down) => {
                for _ in d.to..d.from {
                    if let Some(r) = self.prefill.iter_mut().filter(|r| !r.draining).min_by_key(|r| r.current.is_some())
                    {
                        r.draining = true;
                    }
                }
            }
            (Kind::Decode, Direction::Down) => {
                for _ in d.to..d.from {
                    if let Some(r) = self.decode.iter_mut().filter(|r| !r.draining).min_by_key(|r| r.seqs.len()) {
                        r.draining = true;
                    }
                }
            }
            _ => {}
        }
    }
}
