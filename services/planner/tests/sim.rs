//! The planner against the simulated mesh (issue 42's four figures), in
//! seconds of simulated time; each prints its run as JSON.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use pdmesh_planner::sim::{run, Phase, Report, Speeds};
use pdmesh_planner::{Direction, Kind, Policy};

fn policy() -> Policy {
    Policy::parse(
        "[targets]\nqueue_wait_p90_s = 0.5\ninter_token_p90_s = 0.030\n\
         [prefill]\nmin = 1\nmax = 6\n[decode]\nmin = 1\nmax = 6\n",
    )
    .unwrap()
}

/// Long prompts, short answers: about 1.5 prefill replicas of work.
const PREFILL_HEAVY: Phase = Phase { seconds: 120.0, rps: 2.0, prompt_tokens: 1500, output_tokens: 16 };
/// Short prompts, long answers: more than one decode replica holds to 30 ms a token.
const DECODE_HEAVY: Phase = Phase { seconds: 120.0, rps: 4.0, prompt_tokens: 64, output_tokens: 512 };

fn print(name: &str, r: &Report) {
    let decisions: Vec<String> = r
        .decisions
        .iter()
        .map(|(t, d)| {
            format!(
                "{{\"at_s\": {t:.1}, \"kind\": \"{}\", \"to\": {}, \"direction\": \"{}\", \"reason\": {:?}}}",
                d.kind,
                d.to,
                d.direction.name(),
                d.reason
            )
        })
        .collect();
    println!(
        "{{\"sim\": \"{name}\", \"finished\": {}, \"failed\": {}, \"decisions\": [{}]}}",
        r.finished,
        r.failed,
        decisions.join(", ")
    );
}

fn replicas_at(r: &Report, t: f64) -> (usize, usize) {
    let s = r.samples.iter().rev().find(|s| s.at_s <= t).unwrap();
    (s.prefill, s.decode)
}

#[test]
fn a_shift_from_long_prompts_to_long_answers_moves_the_ratio_within_30_s() {
    let r = run(policy(), Speeds::default(), &[PREFILL_HEAVY, DECODE_HEAVY], (1, 1));
    print("shift", &r);
    let (p, d) = replicas_at(&r, 119.0);
    assert!(p >= 2 && d == 1, "the prefill-heavy phase ends with more prefill: {p}:{d}");
    let (p2, d2) = replicas_at(&r, 150.0);
    assert!(d2 > d, "within 30 s of the shift decode has grown: {p}:{d} -> {p2}:{d2}");
    let (p3, d3) = replicas_at(&r, 239.0);
    assert!(p3 < p && d3 >= 2, "by the end prefill has shrunk and decode holds: {p3}:{d3}");
    assert_eq!(r.failed, 0);
}

#[test]
fn a_steady_load_makes_at_most_one_change_in_5_minutes() {
    let steady = Phase { seconds: 420.0, ..PREFILL_HEAVY };
    let r = run(policy(), Speeds::default(), &[steady], (1, 1));
    print("steady", &r);
    let settled = r.decisions.first().map_or(0.0, |(t, _)| *t) + 30.0;
    let changes = r.changes_between(settled, settled + 300.0);
    assert!(changes <= 1, "{changes} changes in the 5 minutes after {settled:.0} s");
    assert_eq!(r.failed, 0);
}

#[test]
fn a_4x_burst_gets_its_scale_up_within_10_s() {
    let base = Phase { seconds: 90.0, rps: 0.5, ..PREFILL_HEAVY };
    let burst = Phase { seconds: 60.0, rps: 2.0, ..PREFILL_HEAVY };
    let r = run(policy(), Speeds::default(), &[base, burst], (1, 1));
    print("burst", &r);
    assert!(r.changes_between(30.0, 90.0) == 0, "the base load is steady");
    let up = r.decisions.iter().find(|(t, d)| *t >= 90.0 && d.direction == Direction::Up).expect("a scale-up");
    assert!(up.0 - 90.0 <= 10.0, "the scale-up came {:.1} s into the burst: {}", up.0 - 90.0, up.1.reason);
    assert_eq!(r.failed, 0);
}

#[test]
fn after_the_load_ends_the_mesh_returns_to_the_minimum_losing_nothing() {
    let quiet = Phase { seconds: 240.0, rps: 0.0, ..PREFILL_HEAVY };
    let r = run(policy(), Speeds::default(), &[PREFILL_HEAVY, DECODE_HEAVY, quiet], (1, 1));
    print("ends", &r);
    assert!(r.samples.iter().any(|s| s.prefill >= 2) && r.samples.iter().any(|s| s.decode >= 2), "it scaled up first");
    assert_eq!((r.last(Kind::Prefill), r.last(Kind::Decode)), (1, 1), "back to the minimum");
    assert_eq!(r.failed, 0, "no request failed");
    assert!(r.finished > 500, "{} finished", r.finished);
}
