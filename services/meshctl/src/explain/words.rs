//! The words: one line per cause, each naming the spans and attributes it
//! was read from, and the sentence that leads the report.

use super::attempt::{instance, Attempt, Fault, Marks, Outcome};
use super::judge::{device_time, knobs, Judgment};
use super::timeline::Timeline;
use super::{AttemptSummary, Cause, Evidence, Finding, Part};
use crate::trace::{Event, Span};
use pdmesh_core::vocab::{attr, event, kernel, pick_key, span};

fn int(s: Option<&Span>, key: &str) -> i64 {
    s.and_then(|s| s.attr_f64(key)).map_or(0, |v| v as i64)
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The attempt holding `t` (the latest one started by then).
fn attempt_at(all: &[Attempt], t: u64) -> usize {
    all.iter().rposition(|a| a.root.start_ns <= t).unwrap_or(0)
}

/// Nanoseconds each attempt spent on `cause`.
fn per_attempt(cause: Cause, all: &[Attempt], t: &Timeline) -> Vec<u64> {
    let mut per = vec![0u64; all.len()];
    for s in t.segs().iter().filter(|s| s.cause == cause) {
        per[attempt_at(all, s.start)] += s.end - s.start;
    }
    per
}

/// The attempt that spent the most on `cause`.
fn busiest(cause: Cause, all: &[Attempt], t: &Timeline) -> usize {
    let per = per_attempt(cause, all, t);
    per.iter().enumerate().max_by_key(|(_, n)| **n).map_or(0, |(i, _)| i)
}

fn evidence(spans: &[Option<&Span>]) -> Vec<Evidence> {
    spans.iter().flatten().map(|s| Evidence::of(s)).collect()
}

/// The line for `cause` and the spans it comes from.
pub fn detail(cause: Cause, all: &[Attempt], t: &Timeline) -> (String, Vec<Evidence>) {
    match cause {
        Cause::Refused | Cause::Failed => faults(cause, all),
        Cause::BetweenAttempts => between(all),
        _ => {
            // The words from the attempt that spent the most on it; the
            // evidence from every attempt that spent any.
            let per = per_attempt(cause, all, t);
            let i = busiest(cause, all, t);
            let a = &all[i];
            let (mut line, _) = stage(cause, &a.marks, &a.spans);
            if let Some((j, worker, s)) = judged(cause, a) {
                line += &format!("; {}", j.words(&worker, &s.name));
            }
            if all.len() > 1 {
                line = format!("attempt {}: {line}", i + 1);
            }
            let ev = all
                .iter()
                .zip(&per)
                .filter(|(_, n)| **n > 0)
                .flat_map(|(a, _)| stage(cause, &a.marks, &a.spans).1)
                .collect();
            (line, ev)
        }
    }
}

/// Every refused (or failed) call and attempt, in order.
fn faults(cause: Cause, all: &[Attempt]) -> (String, Vec<Evidence>) {
    let refused = cause == Cause::Refused;
    let mut lines = Vec::new();
    let mut ev = Vec::new();
    // Calls that failed at once, the same way at the same worker, are told once.
    let mut instant: Vec<(String, String, Vec<usize>)> = Vec::new();
    for (i, a) in all.iter().enumerate() {
        for f in a.faults.iter().filter(|f| f.refused == refused) {
            let took = ms(f.call.end_ns - f.from_ns);
            ev.push(Evidence::of(f.call));
            if took < 1.0 {
                match instant.iter_mut().find(|(w, st, _)| *w == f.worker && *st == f.status) {
                    Some((_, _, at)) => at.push(i + 1),
                    None => instant.push((f.worker.clone(), f.status.clone(), vec![i + 1])),
                }
                continue;
            }
            let what = f.call.name.rsplit('/').next().unwrap_or(&f.call.name);
            lines.push(format!(
                "attempt {}: {} {} it: {} after {:.0} ms ({} client span {}{})",
                i + 1,
                f.worker,
                if refused { "refused" } else { "failed" },
                f.status,
                took,
                what,
                short(&f.call.span_id),
                if f.worker_spans || refused {
                    ""
                } else {
                    "; the worker's own spans never arrived: it died or was cut off"
                }
            ));
        }
        let whole = match (&a.outcome, refused) {
            (Outcome::Refused(w), true) | (Outcome::Failed(w), false) if a.faults.is_empty() => Some(w),
            _ => None,
        };
        if let Some(w) = whole {
            lines.push(format!(
                "attempt {} ended {}: {w} ({} span {})",
                i + 1,
                a.outcome.label(),
                a.root.name,
                short(&a.root.span_id)
            ));
            ev.push(Evidence::of(a.root));
        }
        if let Some(e) =
            a.spans.iter().flat_map(|s| s.events.iter().filter(|e| e.is_error()).map(move |e| (s, e))).next()
        {
            lines.push(format!("error event on {} ({}): {}", e.0.name, instance(Some(e.0)), e.1.message()));
        }
    }
    for (worker, status, at) in instant {
        let mut at_list: Vec<String> = at.iter().map(usize::to_string).collect();
        at_list.dedup();
        lines.push(format!(
            "{} call{} to {worker} {} at once: {status} (attempt {})",
            at.len(),
            if at.len() == 1 { "" } else { "s" },
            if refused { "refused" } else { "failed" },
            at_list.join(", ")
        ));
    }
    (lines.join("; "), ev)
}

/// The client's waits between attempts, and what each followed.
fn between(all: &[Attempt]) -> (String, Vec<Evidence>) {
    let mut lines = Vec::new();
    let mut ev = Vec::new();
    for (i, w) in all.windows(2).enumerate() {
        let gap = w[1].root.start_ns.saturating_sub(w[0].root.end_ns);
        if gap == 0 {
            continue;
        }
        lines.push(format!(
            "the client sent attempt {} {:.0} ms after attempt {} ended {} (no span covers this: it is the client's own wait, between {} spans {} and {})",
            i + 2,
            ms(gap),
            i + 1,
            w[0].outcome.label(),
            w[0].root.name,
            short(&w[0].root.span_id),
            short(&w[1].root.span_id)
        ));
        ev.extend([Evidence::of(w[0].root), Evidence::of(w[1].root)]);
    }
    (lines.join("; "), ev)
}

fn short(id: &str) -> &str {
    &id[..id.len().min(8)]
}

/// What a late server span does and does not show.
const NOT_TAKEN_UP: &str = "the time passed before the worker took the call up (the trace cannot tell whether it was stopped, starved of CPU or still starting; its process's scheduler records would)";
/// The same, in the sentence.
const NOT_TAKEN_UP_BRIEF: &str = "not taken up (stopped, starved of CPU or still starting)";

/// How long after a call the worker's server span began (a worker stopped,
/// or not serving its socket, takes calls up late).
fn late_pickup(call: Option<&Span>, server: Option<&Span>) -> Option<f64> {
    let (c, s) = (call?, server?);
    let late = ms(s.start_ns.saturating_sub(c.start_ns));
    (late >= 20.0).then_some(late)
}

/// A stage's line, from the attempt's marks.
/// The gateway's line, with its evidence: how far its request span
/// reaches past the router's on either side, and how much of that the
/// client owns (data waiting for it to read).
fn gateway_line(m: &Marks) -> (String, Vec<Evidence>) {
    let mut line = format!("gateway {} (request span)", instance(m.gateway));
    if let (Some(g), Some(r)) = (m.gateway, m.router) {
        let (before, after) = (ms(r.start_ns.saturating_sub(g.start_ns)), ms(g.end_ns.saturating_sub(r.end_ns)));
        let client = g.attr_f64(attr::CLIENT_TAIL_MS).unwrap_or(0.0);
        line += &format!(
            ": it began {before:.0} ms before the router's Generate span and outlived it by {after:.0} ms, \
             {client:.0} ms of that with data waiting on the client"
        );
    }
    (line, evidence(&[m.gateway, m.router]))
}

fn stage(cause: Cause, m: &Marks, spans: &[&Span]) -> (String, Vec<Evidence>) {
    match cause {
        Cause::Gateway => gateway_line(m),
        Cause::Router => {
            let picked = route(spans);
            let sep = if picked.is_empty() { "" } else { "; " };
            (format!("router {} (Router/Generate span){sep}{picked}", instance(m.router)), evidence(&[m.router]))
        }
        Cause::Tokenize => {
            let own = m.encode.map_or(0.0, |e| ms(e.duration_ns()));
            let mut line = format!("{} prompt tokens (tokenize span on {})", int(m.tokenize, attr::PROMPT_TOKENS), instance(m.router));
            if let Some(late) = late_pickup(m.tokenize, m.encode) {
                line += &format!(
                    "; {}'s Encode server span began {late:.0} ms after the router sent the call and took {own:.1} ms: {}",
                    instance(m.encode),
                    NOT_TAKEN_UP
                );
            }
            (line, evidence(&[m.tokenize, m.encode]))
        }
        Cause::QueueWait => {
            let mut line = format!(
                "behind {} running and {} queued on {} (queued span){}",
                int(m.queued, attr::PREFILL_RUNNING),
                int(m.queued, attr::PREFILL_QUEUE_DEPTH),
                instance(m.prefill),
                m.queued
                    .and_then(|q| q.attr_f64(attr::QUEUE_HELD_MS))
                    .map(|h| format!(" (queue held {h:.0} ms by a fault switch)"))
                    .unwrap_or_default()
            );
            if let Some(late) = late_pickup(m.prefill_call, m.prefill) {
                line += &format!(
                    "; {}'s Prefill server span began {late:.0} ms after the router's Prefill client span: {}",
                    instance(m.prefill),
                    NOT_TAKEN_UP
                );
            }
            (line, evidence(&[m.prefill_call, m.queued]))
        }
        Cause::PrefillCompute => {
            let device = device_time(spans, "pdmesh-prefill").map(|d| format!("; {d}")).unwrap_or_default();
            (prefill_line(m) + &device, evidence(&[m.forward]))
        }
        Cause::DecodeAdmission => (
            format!(
                "{} running, {} awaiting KV on {} (admit span)",
                int(m.admit, attr::DECODE_RUNNING),
                int(m.admit, attr::DECODE_AWAITING_KV),
                instance(m.decode)
            ),
            evidence(&[m.admit]),
        ),
        Cause::KvTransfer => (
            format!(
                "{} bytes over {} (kv_transfer span, write {:.1} ms){}",
                int(m.xfer, attr::KV_BYTES),
                m.xfer.and_then(|x| x.attr_str(attr::KV_TRANSPORT)).unwrap_or("?"),
                m.xfer.and_then(|x| x.attr_f64(attr::KV_WRITE_MS)).unwrap_or(0.0),
                m.xfer
                    .and_then(|x| x.attr_f64(attr::FAULT_STALL_MS))
                    .map(|s| format!(", stalled {s:.0} ms by a fault switch"))
                    .unwrap_or_default()
            ),
            evidence(&[m.xfer, m.await_kv]),
        ),
        Cause::DecodeSteps => (
            format!(
                "{} steps, batch mean {:.1} max {}, {} already running on {} when it joined (decode_loop span){}",
                int(m.decode_loop, attr::DECODE_STEPS),
                m.decode_loop.and_then(|l| l.attr_f64(attr::DECODE_BATCH_MEAN)).unwrap_or(0.0),
                int(m.decode_loop, attr::DECODE_BATCH_MAX),
                int(m.decode_loop, attr::DECODE_RUNNING_ON_JOIN),
                instance(m.decode),
                device_time(spans, "pdmesh-decode").map(|d| format!("; {d}")).unwrap_or_default()
            ),
            evidence(&[m.decode_loop]),
        ),
        Cause::Detokenize => (
            format!(
                "the tail after the last token: {} detokenize calls, {:.1} ms busy in all (detokenize span)",
                int(m.detok, attr::DETOKENIZE_CALLS),
                m.detok.and_then(|d| d.attr_f64(attr::DETOKENIZE_BUSY_MS)).unwrap_or(0.0)
            ),
            evidence(&[m.detok]),
        ),
        Cause::ClientWrite => (
            format!(
                "response data waited {:.0} ms in all for the client to read it ({} chunks; gateway.client_wait_ms, gateway.client_tail_ms)",
                m.gateway.and_then(|g| g.attr_f64(attr::CLIENT_WAIT_MS)).unwrap_or(0.0),
                int(m.gateway, attr::CHUNKS)
            ),
            evidence(&[m.gateway]),
        ),
        Cause::Refused | Cause::Failed | Cause::BetweenAttempts => (String::new(), vec![]),
    }
}

fn prefill_line(m: &Marks) -> String {
    let f = m.forward;
    let steps = match int(f, attr::PREFILL_STEPS) {
        1 => "1 step".to_string(),
        n => format!("{n} steps"),
    };
    if f.is_some_and(|f| f.attr_bool(attr::PREFILL_LOCAL) == Some(true)) {
        return format!(
            "{} prompt tokens prefilled locally by {} beside its decode steps, in {steps}{} (prefill_forward span)",
            int(f, attr::PROMPT_TOKENS),
            instance(m.decode),
            cached_note(f)
        );
    }
    format!(
        "{} prompt tokens in a batch of {} ({} tokens), in {steps}{} (prefill_forward span on {})",
        int(f, attr::PROMPT_TOKENS),
        int(f, attr::BATCH_SIZE),
        int(f, attr::BATCH_TOKENS),
        cached_note(f),
        instance(m.prefill)
    )
}

/// "; prefill skipped N cached tokens, computed M" when `forward` reused any.
fn cached_note(forward: Option<&Span>) -> String {
    match int(forward, attr::PREFILL_CACHED_TOKENS) {
        0 => String::new(),
        n => format!("; prefill skipped {n} cached tokens, computed {}", int(forward, attr::PREFILL_COMPUTED_TOKENS)),
    }
}

/// Which workers the `route` span says were picked, and why.
fn route(spans: &[&Span]) -> String {
    let Some(r) = super::attempt::last(spans, |s| s.name == span::ROUTE) else { return String::new() };
    let num = |k: &str| r.attr_f64(k).unwrap_or(0.0) as i64;
    let decode = r.attr_str(&pick_key("decode", attr::PICK_INSTANCE)).unwrap_or("?");
    if r.attr_str(attr::ROUTE_PREFILL_MODE) == Some("local") {
        return format!(
            "picked {decode}, which prefilled locally ({} uncached prompt tokens, at most {}; route span)",
            num(attr::ROUTE_LOCAL_TAIL_TOKENS),
            num(attr::ROUTE_MAX_LOCAL_PREFILL)
        );
    }
    let branch = r
        .attr_str(&pick_key("prefill", attr::PICK_BRANCH))
        .map(|b| {
            format!(
                " ({b}: holds {} of {} prompt blocks)",
                num(&pick_key("prefill", attr::PICK_OVERLAP_BLOCKS)),
                num(&pick_key("prefill", attr::PICK_PROMPT_BLOCKS))
            )
        })
        .unwrap_or_default();
    format!(
        "picked {}{branch} and {decode} (route span)",
        r.attr_str(&pick_key("prefill", attr::PICK_INSTANCE)).unwrap_or("?")
    )
}

/// The judgment of the steps behind `cause` (decode steps, prefill
/// compute) in attempt `a`: the judgment, the worker, the span it is read from.
fn judged<'a>(cause: Cause, a: &Attempt<'a>) -> Option<(Judgment, String, &'a Span)> {
    let m = &a.marks;
    let local = m.forward.is_some_and(|f| f.attr_bool(attr::PREFILL_LOCAL) == Some(true));
    let (s, worker) = match cause {
        Cause::DecodeSteps => (m.decode_loop?, m.decode),
        Cause::PrefillCompute => (m.forward?, if local { m.decode } else { m.prefill }),
        _ => return None,
    };
    let kernels: Vec<&Span> = a.spans.iter().copied().filter(|k| k.attrs.contains_key(kernel::BACKEND)).collect();
    Some((Judgment::of(s, knobs(&kernels))?, instance(worker), s))
}

/// Steps far from their worker's normal, in every attempt, where they cost
/// the request something: 50 ms or 5% of its time (a refused attempt's
/// prefill, cancelled and run on after the refusal, cost it nothing).
pub fn findings(all: &[Attempt], t: &Timeline) -> Vec<Finding> {
    let total: u64 = t.segs().iter().map(|s| s.end - s.start).sum();
    let mut out = Vec::new();
    for cause in [Cause::DecodeSteps, Cause::PrefillCompute] {
        let per = per_attempt(cause, all, t);
        for a in all
            .iter()
            .zip(&per)
            .filter(|(_, ns)| **ns > 0 && (**ns >= 50_000_000 || **ns * 20 >= total))
            .map(|(a, _)| a)
        {
            let Some((j, worker, s)) = judged(cause, a).filter(|(j, _, _)| j.abnormal()) else { continue };
            out.push(Finding {
                cause: cause.label(),
                factor: j.factor(),
                wait_share: j.wait_share(),
                starved: j.starved(),
                slow: j.slow(),
                words: j.words(&worker, &s.name),
                worker,
                evidence: Evidence::of(s),
            });
        }
    }
    out
}

/// The dominant cause's line in short, for the sentence: its evidence in
/// one clause (the spans it is read from), and its steps' verdict with the
/// reason in a few words, not the attributes (the table has those).
pub fn brief(cause: Cause, all: &[Attempt], t: &Timeline) -> String {
    if matches!(cause, Cause::Refused | Cause::Failed | Cause::BetweenAttempts) {
        return detail(cause, all, t).0;
    }
    let a = &all[busiest(cause, all, t)];
    let mut line = stage(cause, &a.marks, &a.spans).0.replace(NOT_TAKEN_UP, NOT_TAKEN_UP_BRIEF);
    if let Some((j, worker, _)) = judged(cause, a) {
        line += &format!("; {}", j.brief(&worker));
    }
    line
}

/// The report's first sentence when nothing went wrong: the dominant cause
/// in short ([`brief`]), then how the attempts ended. Secondary
/// abnormalities are in the table and the JSON, not here.
pub fn sentence(top: &Part, brief: &str, total_ms: f64, attempts: &[AttemptSummary]) -> String {
    let across = if attempts.len() > 1 { format!(" across {} attempts", attempts.len()) } else { String::new() };
    let mut out = format!(
        "{} took {:.0}% of the request ({:.0} of {:.0} ms{across}): {brief}.",
        capitalise(top.cause),
        top.share * 100.0,
        top.ms,
        total_ms,
    );
    if attempts.len() > 1 {
        // Runs of attempts that ended the same way are told once ("1-6 refused (...)").
        let mut runs: Vec<(usize, usize, &AttemptSummary)> = Vec::new();
        for (i, a) in attempts.iter().enumerate() {
            match runs.last_mut() {
                Some((_, last, b)) if b.outcome == a.outcome && b.status == a.status => *last = i + 1,
                _ => runs.push((i + 1, i + 1, a)),
            }
        }
        let each: Vec<String> = runs
            .iter()
            .map(|(first, last, a)| {
                let at = if first == last { first.to_string() } else { format!("{first}-{last}") };
                format!(
                    "{at} {}{}",
                    a.outcome,
                    if a.status.is_empty() { String::new() } else { format!(" ({})", a.status) }
                )
            })
            .collect();
        out += &format!(" Attempts: {}.", each.join(", "));
    }
    out
}

/// What went wrong, as the sentence's first clause (empty when nothing
/// did): a router lost mid-stream (the gateway's `router failover` events),
/// a decode worker lost or drained mid-stream (the router's `decode
/// migration` events, or its `router.migrations` count in traces from
/// before them); lost or drained as the lost call's status says, and
/// where the request went on; else failed calls (a worker that died under
/// a call) and refusals, counted, not listed. `failed` and `refused` are
/// the time the timeline charges to each (ms, share), named as the cost.
/// How a peer was lost, from its call's status: `stalled` (it stopped
/// answering; the words after the caller's `stalled: `) or `was lost`
/// (the status in full), and that detail in parentheses.
fn lost_or_stalled(status: Option<&str>) -> (&'static str, String) {
    match status {
        Some(s) => match s.split_once(" stalled: ") {
            Some((_, why)) => ("stalled", format!(" ({why})")),
            None => ("was lost", format!(" ({s})")),
        },
        None => ("was lost", String::new()),
    }
}

pub fn mishaps(spans: &[Span], all: &[Attempt], failed: (f64, f64), refused: (f64, f64)) -> String {
    let mut said: Vec<String> = Vec::new();
    let events = |name: &'static str| {
        let mut v: Vec<&Event> = spans.iter().flat_map(|s| s.events.iter()).filter(|e| e.name == name).collect();
        v.sort_by_key(|e| e.time_ns);
        v
    };
    let a = |e: &Event, k: &str| e.attrs.get(k).map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string));
    for e in events(event::ROUTER_FAILOVER) {
        let (from, to) = (a(e, attr::FAILOVER_FROM).unwrap_or_default(), a(e, attr::FAILOVER_TO).unwrap_or_default());
        let (after, why) = (a(e, attr::FAILOVER_AFTER_TOKENS).unwrap_or_default(), a(e, attr::FAILOVER_STATUS));
        let (lost, why) = lost_or_stalled(why.as_deref());
        said.push(if to == "none" || to.is_empty() {
            format!("Router {from} {lost} after {after} tokens{why} and no other router took the request")
        } else {
            format!("Router {from} {lost} after {after} tokens{why}; the gateway resumed the stream on {to}")
        });
    }
    // Where each migration went: the decode worker of the `route` span after it.
    let mut routes: Vec<&Span> = spans.iter().filter(|s| s.name == span::ROUTE).collect();
    routes.sort_by_key(|s| s.start_ns);
    let migrations = events(event::DECODE_MIGRATION);
    for e in &migrations {
        let from = a(e, attr::FAILOVER_FROM).unwrap_or_default();
        let after = a(e, attr::FAILOVER_AFTER_TOKENS).unwrap_or_default();
        let to = routes
            .iter()
            .find(|r| r.start_ns >= e.time_ns)
            .and_then(|r| r.attr_str(&pick_key("decode", attr::PICK_INSTANCE)))
            .map_or_else(|| "another decode worker".to_string(), str::to_string);
        said.push(match a(e, attr::FAILOVER_STATUS).as_deref() {
            Some("draining") => match spans.iter().find_map(|s| s.attr_str(attr::HANDOVER_FAILED)) {
                Some(why) => format!("Decode worker {from} drained after {after} tokens; shipping their KV to {to} failed ({why}), so {to} replayed them"),
                None => format!("Decode worker {from} drained after {after} tokens and shipped their KV to {to} (nothing replayed)"),
            },
            why => {
                let (lost, why) = lost_or_stalled(why);
                format!("Decode worker {from} {lost} after {after} tokens{why}; the request moved to {to} and replayed {after} tokens")
            }
        });
    }
    if migrations.is_empty() {
        said.extend(counted_migrations(spans));
    }
    let cost = |(ms, share): (f64, f64)| {
        if ms >= 1.0 {
            format!(", costing {ms:.0} ms ({:.0}%)", share * 100.0)
        } else {
            String::new()
        }
    };
    if !said.is_empty() {
        return format!("{}{}. Then ", said.join("; "), cost(failed));
    }
    let faults: Vec<&Fault> = all.iter().flat_map(|a| a.faults.iter()).collect();
    let mut lead = Vec::new();
    if let Some(f) = faults.iter().find(|f| !f.refused) {
        let call = f.call.name.rsplit('/').next().unwrap_or(&f.call.name);
        let died = if f.worker_spans { "" } else { "; its spans never arrived: it died or was cut off" };
        let n = faults.iter().filter(|f| !f.refused).count();
        let more = if n > 1 { format!(" ({n} failed calls in all)") } else { String::new() };
        lead.push(format!("{} failed a {call} call ({}{died}){more}{}", f.worker, f.status, cost(failed)));
    }
    // Refusals, counted per worker and status.
    let mut counted: Vec<(&str, &str, usize)> = Vec::new();
    for f in faults.iter().filter(|f| f.refused) {
        match counted.iter_mut().find(|(w, st, _)| *w == f.worker && *st == f.status) {
            Some(c) => c.2 += 1,
            None => counted.push((&f.worker, &f.status, 1)),
        }
    }
    for (worker, status, n) in &counted {
        lead.push(format!(
            "{n} call{} refused ({status} at {worker}){}",
            if *n == 1 { "" } else { "s" },
            cost(refused)
        ));
    }
    if lead.is_empty() {
        return String::new();
    }
    let ran = match all.iter().rposition(|a| a.outcome == Outcome::Ok) {
        Some(i) if all.len() > 1 => format!("; attempt {} of {} went through", i + 1, all.len()),
        Some(_) => String::new(),
        None => "; no attempt went through".to_string(),
    };
    format!("{}{ran}. Then ", lead.join("; "))
}

/// The short sentence after a lead clause: the largest other cause, its
/// share, and its verdict where its steps were judged (the table has the
/// evidence).
pub fn then_clause(cause: Cause, part: &Part, total_ms: f64, all: &[Attempt], t: &Timeline) -> String {
    let verdict = judged(cause, &all[busiest(cause, all, t)])
        .map(|(j, worker, _)| format!(", {}", j.verdict(&worker)))
        .unwrap_or_default();
    format!(
        "{} took {:.0}% of the request ({:.0} of {total_ms:.0} ms){verdict}.",
        capitalise(part.cause),
        part.share * 100.0,
        part.ms
    )
}

/// A migration told by the router's counts alone (`router.migrations`,
/// `router.handovers`, `router.handover_failed`): traces without the event.
fn counted_migrations(spans: &[Span]) -> Option<String> {
    let moved = spans.iter().filter_map(|s| {
        let n = s.attr_f64(attr::MIGRATIONS)?;
        Some((n as u64, s.attr_f64(attr::MIGRATED_AFTER_TOKENS).unwrap_or(0.0) as u64))
    });
    let (n, after) = moved.max().filter(|(n, _)| *n > 0)?;
    let times = format!("{n} time{}", if n == 1 { "" } else { "s" });
    let failed = spans.iter().find_map(|s| s.attr_str(attr::HANDOVER_FAILED));
    let shipped = spans.iter().any(|s| s.attr_f64(attr::HANDOVERS).is_some());
    Some(match (shipped, failed) {
        (_, Some(why)) => format!(
            "Its decode worker drained mid-stream: the request moved {times}, the last after {after} tokens; shipping their KV failed ({why}), so they were replayed"
        ),
        (true, None) => format!(
            "Its decode worker drained mid-stream: the request moved {times}, the last after {after} tokens, whose KV was shipped along (nothing replayed)"
        ),
        (false, None) => format!(
            "Its decode worker was lost or drained mid-stream: the request moved {times}, the last after {after} tokens, which were replayed"
        ),
    })
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().collect::<String>() + c.as_str()).unwrap_or_default()
}
