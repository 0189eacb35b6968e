//! `meshctl explain`: where one request's time went, from its whole trace.
//!
//! A trace may hold several attempts: a client that retried under one
//! `traceparent`, each a gateway request span (or a Router/Generate span
//! where no gateway took part). They are laid on one timeline, from the
//! first attempt's start to the last one's end: the client's wall time.
//! Each attempt's stages are charged from its milestones ([`attempt`]),
//! only where a span of that stage was open; failed and refused calls
//! (span status, `rpc.grpc.status_code`) are charged as such over them;
//! the time between attempts is the client's. Every cause comes with the
//! spans it was read from, and the steps that served the request are
//! judged against their worker's own normal ([`judge`]).

pub mod attempt;
pub mod judge;
pub mod timeline;
mod words;

use serde_json::{json, Value};

use crate::trace::Span;
use attempt::{attempts, Attempt, Outcome};
use timeline::Timeline;

/// Where time goes. The order is the table's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    Gateway,
    Router,
    Tokenize,
    QueueWait,
    PrefillCompute,
    DecodeAdmission,
    KvTransfer,
    DecodeSteps,
    Detokenize,
    ClientWrite,
    Refused,
    Failed,
    BetweenAttempts,
}

impl Cause {
    pub const ALL: [Cause; 13] = [
        Cause::Gateway,
        Cause::Router,
        Cause::Tokenize,
        Cause::QueueWait,
        Cause::PrefillCompute,
        Cause::DecodeAdmission,
        Cause::KvTransfer,
        Cause::DecodeSteps,
        Cause::Detokenize,
        Cause::ClientWrite,
        Cause::Refused,
        Cause::Failed,
        Cause::BetweenAttempts,
    ];

    pub const fn label(self) -> &'static str {
        match self {
            Cause::Gateway => "gateway/proxy",
            Cause::Router => "router",
            Cause::Tokenize => "tokenize",
            Cause::QueueWait => "queue wait",
            Cause::PrefillCompute => "prefill compute",
            Cause::DecodeAdmission => "decode admission",
            Cause::KvTransfer => "KV transfer",
            Cause::DecodeSteps => "decode steps",
            Cause::Detokenize => "detokenize",
            Cause::ClientWrite => "client write",
            Cause::Refused => "refused",
            Cause::Failed => "failed",
            Cause::BetweenAttempts => "between attempts",
        }
    }
}

/// The causes' labels, in table order.
pub const CAUSES: [&str; 13] = {
    let mut out = [""; 13];
    let mut i = 0;
    while i < 13 {
        out[i] = Cause::ALL[i].label();
        i += 1;
    }
    out
};

/// A span a cause was read from.
#[derive(Debug, Clone)]
pub struct Evidence {
    pub span: String,
    pub span_id: String,
    pub instance: String,
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Evidence {
    fn of(s: &Span) -> Evidence {
        Evidence {
            span: s.name.clone(),
            span_id: s.span_id.clone(),
            instance: attempt::instance(Some(s)),
            start_ns: s.start_ns,
            end_ns: s.end_ns,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Part {
    pub cause: &'static str,
    pub ms: f64,
    pub share: f64,
    pub detail: String,
    pub evidence: Vec<Evidence>,
}

/// One attempt as the client saw it.
#[derive(Debug, Clone)]
pub struct AttemptSummary {
    pub start_ms: f64,
    pub ms: f64,
    pub outcome: &'static str,
    pub status: String,
    pub span_id: String,
}

/// Steps far from their worker's normal.
#[derive(Debug, Clone)]
pub struct Finding {
    pub cause: &'static str,
    pub worker: String,
    pub factor: Option<f64>,
    pub wait_share: f64,
    pub starved: bool,
    pub slow: bool,
    pub words: String,
    pub evidence: Evidence,
}

#[derive(Debug, Clone)]
pub struct Explanation {
    pub trace_id: String,
    pub total_ms: f64,
    pub parts: Vec<Part>,
    pub dominant: &'static str,
    pub sentence: String,
    pub services: Vec<String>,
    pub spans: usize,
    pub attempts: Vec<AttemptSummary>,
    pub abnormal: Vec<Finding>,
    /// The first attempt's start (the timeline's zero).
    pub start_ns: u64,
}

/// Attribute a trace's time to causes.
pub fn explain(spans: &[Span]) -> Result<Explanation, String> {
    if spans.is_empty() {
        return Err("the trace has no spans".into());
    }
    let all = attempts(spans);
    if all.is_empty() {
        return Err("the trace has neither a gateway request span nor a router Generate span".into());
    }
    let t0 = all.iter().map(|a| a.root.start_ns).min().unwrap_or(0);
    let t_end = all.iter().map(|a| a.root.end_ns).max().unwrap_or(t0);
    let total = t_end.saturating_sub(t0).max(1);
    let mut t = Timeline::default();
    t.paint(t0, t_end, Cause::BetweenAttempts);
    // A failed attempt first, so one that went through wins where they overlap (hedges).
    let mut order: Vec<&Attempt> = all.iter().collect();
    order.sort_by_key(|a| (a.outcome == Outcome::Ok, a.root.start_ns));
    for a in &order {
        a.paint(&mut t);
    }
    let ms = |ns: u64| ns as f64 / 1e6;
    let abnormal = words::findings(&all, &t);
    let parts: Vec<Part> = Cause::ALL
        .iter()
        .map(|&c| {
            let ns = t.total(c);
            let (detail, evidence) = if ns > 0 { words::detail(c, &all, &t) } else { (String::new(), vec![]) };
            Part { cause: c.label(), ms: ms(ns), share: ns as f64 / total as f64, detail, evidence }
        })
        .collect();
    let (top_cause, top) =
        Cause::ALL.iter().zip(&parts).max_by(|a, b| a.1.ms.total_cmp(&b.1.ms)).expect("causes are not empty");
    let summaries: Vec<AttemptSummary> = all.iter().map(|a| summary(a, t0)).collect();
    let cost = |c: Cause| parts.iter().find(|p| p.cause == c.label()).map_or((0.0, 0.0), |p| (p.ms, p.share));
    let sentence = match words::mishaps(spans, &all, cost(Cause::Failed), cost(Cause::Refused)) {
        lead if lead.is_empty() => words::sentence(top, &words::brief(*top_cause, &all, &t), ms(total), &summaries),
        lead => {
            // The lead told the failed and refused calls; "then" names the
            // largest of the rest and its verdict, in short.
            let (cause, next) = Cause::ALL
                .iter()
                .zip(&parts)
                .filter(|(c, _)| !matches!(c, Cause::Failed | Cause::Refused))
                .max_by(|a, b| a.1.ms.total_cmp(&b.1.ms))
                .expect("causes are not empty");
            lead + &lower_first(&words::then_clause(*cause, next, ms(total), &all, &t))
        }
    };
    let mut services: Vec<String> = spans.iter().map(|s| s.service.clone()).collect();
    services.sort();
    services.dedup();
    Ok(Explanation {
        trace_id: spans[0].trace_id.clone(),
        total_ms: ms(total),
        dominant: top.cause,
        sentence,
        parts,
        services,
        spans: spans.len(),
        attempts: summaries,
        abnormal,
        start_ns: t0,
    })
}

/// `s` with its first letter in lower case (a sentence after "Then ").
fn lower_first(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_lowercase().collect::<String>() + c.as_str()).unwrap_or_default()
}

fn summary(a: &Attempt, t0: u64) -> AttemptSummary {
    AttemptSummary {
        start_ms: a.root.start_ns.saturating_sub(t0) as f64 / 1e6,
        ms: a.root.duration_ns() as f64 / 1e6,
        outcome: a.outcome.label(),
        status: match &a.outcome {
            Outcome::Ok => String::new(),
            Outcome::Refused(w) | Outcome::Failed(w) => w.clone(),
        },
        span_id: a.root.span_id.clone(),
    }
}

fn evidence_json(e: &Evidence, t0: u64) -> Value {
    json!({
        "span": e.span, "span_id": e.span_id, "instance": e.instance,
        "start_ms": e.start_ns.saturating_sub(t0) as f64 / 1e6, "end_ms": e.end_ns.saturating_sub(t0) as f64 / 1e6,
    })
}

impl Explanation {
    pub fn to_json(&self) -> Value {
        let t0 = self.start_ns;
        json!({
            "trace_id": self.trace_id,
            "total_ms": self.total_ms,
            "dominant": self.dominant,
            "sentence": self.sentence,
            "services": self.services,
            "spans": self.spans,
            "attempts": self.attempts.iter().map(|a| json!({ "start_ms": a.start_ms, "ms": a.ms, "outcome": a.outcome, "status": a.status, "span_id": a.span_id })).collect::<Vec<_>>(),
            "abnormal": self.abnormal.iter().map(|f| json!({ "cause": f.cause, "worker": f.worker, "factor": f.factor, "wait_share": f.wait_share, "starved": f.starved, "slow": f.slow, "words": f.words, "evidence": evidence_json(&f.evidence, t0) })).collect::<Vec<_>>(),
            "parts": self.parts.iter().map(|p| json!({
                "cause": p.cause, "ms": p.ms, "share": p.share, "detail": p.detail,
                "evidence": p.evidence.iter().map(|e| evidence_json(e, t0)).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "trace {}: {:.1} ms, {} spans from {}\n",
            self.trace_id,
            self.total_ms,
            self.spans,
            self.services.join(", ")
        );
        if self.attempts.len() > 1 {
            for (i, a) in self.attempts.iter().enumerate() {
                out += &format!(
                    "attempt {} at +{:.0} ms: {:.0} ms, {} {}\n",
                    i + 1,
                    a.start_ms,
                    a.ms,
                    a.outcome,
                    a.status
                );
            }
        }
        out += &format!("\n{:<18} {:>10} {:>7}  {}\n", "where", "ms", "share", "detail");
        for p in self.parts.iter().filter(|p| p.ms > 0.0 || Cause::ALL[..10].iter().any(|c| c.label() == p.cause)) {
            out += &format!("{:<18} {:>10.1} {:>6.1}%  {}\n", p.cause, p.ms, p.share * 100.0, p.detail);
        }
        for f in &self.abnormal {
            out += &format!("\nabnormal: {} on {}: {}\n", f.cause, f.worker, f.words);
        }
        out += &format!("\n{}\n", self.sentence);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::from_jaeger;
    use crate::trace::testing::{as_jaeger, sample, span};
    use pdmesh_core::vocab::{attr, rpc};

    #[test]
    fn explain_reads_jaeger_documents_as_otlp_ones() {
        let spans = sample();
        let j = from_jaeger(&as_jaeger(&spans)).unwrap();
        let e1 = explain(&spans).unwrap();
        let e2 = explain(&j).unwrap();
        assert_eq!(e1.dominant, "decode steps");
        assert_eq!(e1.dominant, e2.dominant);
        for (p, q) in e1.parts.iter().zip(&e2.parts) {
            assert!((p.ms - q.ms).abs() < 0.01, "{} {} vs {}", p.cause, p.ms, q.ms);
        }
    }

    #[test]
    fn explain_charges_each_stretch_once_and_sums_to_the_request() {
        let e = explain(&sample()).unwrap();
        let get = |c: &str| e.parts.iter().find(|p| p.cause == c).unwrap().ms;
        assert!((e.total_ms - 1000.0).abs() < 1e-6);
        assert!(
            (get("gateway/proxy") - (2.0 + 10.0)).abs() < 1e-6,
            "before the router and after it until the client's backlog"
        );
        assert!((get("tokenize") - 5.0).abs() < 1e-6);
        assert!((get("queue wait") - 289.0).abs() < 1e-6);
        assert!((get("prefill compute") - 50.0).abs() < 1e-6);
        assert!((get("KV transfer") - 50.0).abs() < 1e-6);
        assert!((get("decode steps") - 480.0).abs() < 1e-6);
        assert!((get("client write") - 100.0).abs() < 1e-6);
        let sum: f64 = e.parts.iter().map(|p| p.ms).sum();
        assert!((sum - 1000.0).abs() < 1e-6, "{sum}");
        assert!((get("router") - 4.0).abs() < 1e-6 && (get("detokenize") - 10.0).abs() < 1e-6);
        assert!(e.sentence.starts_with("Decode steps took 48%"), "{}", e.sentence);
    }

    #[test]
    fn a_migration_is_named_with_the_tokens_it_replayed() {
        let plain = explain(&sample()).unwrap();
        assert!(!plain.sentence.contains("moved"), "{}", plain.sentence);
        let mut spans = sample();
        let router = spans.iter_mut().find(|s| s.name == rpc::ROUTER_GENERATE).unwrap();
        router.attrs.insert(attr::MIGRATIONS.into(), serde_json::json!(1));
        router.attrs.insert(attr::MIGRATED_AFTER_TOKENS.into(), serde_json::json!(24));
        let e = explain(&spans).unwrap();
        assert!(
            e.sentence.starts_with("Its decode worker was lost or drained mid-stream: the request moved 1 time, the last after 24 tokens, which were replayed. Then decode steps took"),
            "{}",
            e.sentence
        );
        // Off a draining worker that shipped the KV along; then one whose shipment failed.
        let router = spans.iter_mut().find(|s| s.name == rpc::ROUTER_GENERATE).unwrap();
        router.attrs.insert(attr::HANDOVERS.into(), serde_json::json!(1));
        let e = explain(&spans).unwrap();
        assert!(e.sentence.contains("drained mid-stream") && e.sentence.contains("shipped along"), "{}", e.sentence);
        let router = spans.iter_mut().find(|s| s.name == rpc::ROUTER_GENERATE).unwrap();
        router.attrs.insert(attr::HANDOVER_FAILED.into(), serde_json::json!("the ticket expired"));
        let e = explain(&spans).unwrap();
        assert!(e.sentence.contains("shipping their KV failed (the ticket expired)"), "{}", e.sentence);
    }

    /// The failover and migration events lead the sentence: which instance
    /// was lost, how (its status), after how many tokens, and where the
    /// request went on.
    #[test]
    fn a_lost_router_or_decode_worker_leads_the_sentence() {
        use crate::trace::Event;
        use pdmesh_core::vocab::event;
        let mut spans = sample();
        let at = spans[0].start_ns + 500_000_000;
        let ev = |name: &str, kv: &[(&str, serde_json::Value)]| Event {
            name: name.into(),
            time_ns: at,
            attrs: kv.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
        };
        let root = spans.iter_mut().find(|s| s.parent_id.is_empty()).unwrap();
        root.events.push(ev(
            event::ROUTER_FAILOVER,
            &[
                (attr::FAILOVER_FROM, "router-0".into()),
                (attr::FAILOVER_TO, "router-1".into()),
                (attr::FAILOVER_AFTER_TOKENS, 20.into()),
                (attr::FAILOVER_STATUS, "Unavailable: connection reset".into()),
            ],
        ));
        let e = explain(&spans).unwrap();
        assert!(
            e.sentence.starts_with("Router router-0 was lost after 20 tokens (Unavailable: connection reset); the gateway resumed the stream on router-1. Then decode steps took"),
            "{}",
            e.sentence
        );
        let mut spans = sample();
        let router = spans.iter_mut().find(|s| s.name == rpc::ROUTER_GENERATE).unwrap();
        router.events.push(ev(
            event::DECODE_MIGRATION,
            &[
                (attr::FAILOVER_FROM, "decode-0".into()),
                (attr::FAILOVER_AFTER_TOKENS, 20.into()),
                (attr::FAILOVER_STATUS, "Unavailable: transport error".into()),
            ],
        ));
        let e = explain(&spans).unwrap();
        assert!(
            e.sentence.starts_with("Decode worker decode-0 was lost after 20 tokens (Unavailable: transport error); the request moved to another decode worker and replayed 20 tokens. Then "),
            "{}",
            e.sentence
        );
        let router = spans.iter_mut().find(|s| s.name == rpc::ROUTER_GENERATE).unwrap();
        router.events[0].attrs.insert(attr::FAILOVER_STATUS.into(), "draining".into());
        let e = explain(&spans).unwrap();
        assert!(
            e.sentence.starts_with("Decode worker decode-0 drained after 20 tokens and shipped their KV"),
            "{}",
            e.sentence
        );
        // A worker that stopped answering stalled, in the router's words.
        let stalled = "Unavailable: decode worker decode-0 stalled: no answer to its load poll for 1.0 s";
        let router = spans.iter_mut().find(|s| s.name == rpc::ROUTER_GENERATE).unwrap();
        router.events[0].attrs.insert(attr::FAILOVER_STATUS.into(), stalled.into());
        let e = explain(&spans).unwrap();
        assert!(
            e.sentence.starts_with("Decode worker decode-0 stalled after 20 tokens (no answer to its load poll for 1.0 s); the request moved"),
            "{}",
            e.sentence
        );
    }

    fn shifted(spans: Vec<Span>, ms: u64, tag: char) -> Vec<Span> {
        let re = |id: &str| if id.is_empty() { String::new() } else { format!("{tag}{}", &id[1..]) };
        spans
            .into_iter()
            .map(|mut s| {
                s.start_ns += ms * 1_000_000;
                s.end_ns += ms * 1_000_000;
                s.span_id = re(&s.span_id);
                s.parent_id = re(&s.parent_id);
                s
            })
            .collect()
    }

    fn failed(mut s: Span, code: i64, message: &str) -> Span {
        s.error = true;
        s.status_message = message.into();
        s.attrs.insert("rpc.grpc.status_code".into(), json!(code));
        s
    }

    fn get(e: &Explanation, c: &str) -> f64 {
        e.parts.iter().find(|p| p.cause == c).unwrap().ms
    }

    #[test]
    fn a_refused_attempt_the_wait_and_the_retry_are_all_on_one_timeline() {
        let mut spans = vec![
            span(
                "a000000000000001",
                "",
                "POST /v1/chat/completions",
                "pdmesh-gateway",
                "server",
                0,
                50,
                &[("http.response.status_code", json!(429))],
            ),
            failed(
                span(
                    "a000000000000002",
                    "a000000000000001",
                    rpc::ROUTER_GENERATE,
                    "pdmesh-router",
                    "server",
                    1,
                    48,
                    &[],
                ),
                8,
                "ResourceExhausted",
            ),
            span("a000000000000003", "a000000000000002", "tokenize", "pdmesh-router", "internal", 2, 8, &[]),
            failed(
                span(
                    "a000000000000004",
                    "a000000000000002",
                    rpc::DECODE_GENERATE,
                    "pdmesh-router",
                    "client",
                    10,
                    40,
                    &[],
                ),
                8,
                "no KV room",
            ),
            span(
                "a000000000000005",
                "a000000000000004",
                rpc::DECODE_GENERATE,
                "pdmesh-decode",
                "server",
                11,
                39,
                &[("service.instance.id", json!("decode-0"))],
            ),
            failed(
                span(
                    "a000000000000006",
                    "a000000000000005",
                    "admit",
                    "pdmesh-decode",
                    "internal",
                    11,
                    38,
                    &[("service.instance.id", json!("decode-0"))],
                ),
                0,
                "no KV room: 40 blocks wanted, 3 free",
            ),
        ];
        spans.extend(shifted(sample(), 350, 'b'));
        let e = explain(&spans).unwrap();
        eprintln!("{}", e.table());
        assert!((e.total_ms - 1350.0).abs() < 1e-6, "{}", e.table());
        assert_eq!(e.attempts.len(), 2);
        assert_eq!((e.attempts[0].outcome, e.attempts[1].outcome), ("refused", "ok"));
        assert!((get(&e, "between attempts") - 300.0).abs() < 1e-6, "{}", e.table());
        assert!((get(&e, "refused") - 30.0).abs() < 1e-6, "{}", e.table());
        assert_eq!(e.dominant, "decode steps");
        let sum: f64 = e.parts.iter().map(|p| p.ms).sum();
        assert!((sum - 1350.0).abs() < 1e-6);
        let refused = e.parts.iter().find(|p| p.cause == "refused").unwrap();
        assert!(
            refused.detail.contains("decode-0 refused it") && refused.detail.contains("40 blocks wanted"),
            "{}",
            refused.detail
        );
        assert!(
            e.sentence.starts_with("1 call refused (RESOURCE_EXHAUSTED: no KV room")
                && e.sentence.contains("attempt 2 of 2 went through"),
            "{}",
            e.sentence
        );
    }

    #[test]
    fn a_failed_call_is_named_and_no_stage_takes_its_time() {
        let spans = vec![
            span(
                "c000000000000001",
                "",
                "POST /v1/chat/completions",
                "pdmesh-gateway",
                "server",
                0,
                1000,
                &[("http.response.status_code", json!(503))],
            ),
            failed(
                span(
                    "c000000000000002",
                    "c000000000000001",
                    rpc::ROUTER_GENERATE,
                    "pdmesh-router",
                    "server",
                    2,
                    990,
                    &[],
                ),
                14,
                "Unavailable",
            ),
            span("c000000000000003", "c000000000000002", "tokenize", "pdmesh-router", "internal", 3, 8, &[]),
            span(
                "c000000000000004",
                "c000000000000002",
                "route",
                "pdmesh-router",
                "internal",
                8,
                9,
                &[("prefill.instance", json!("prefill-0"))],
            ),
            failed(
                span(
                    "c000000000000005",
                    "c000000000000002",
                    rpc::PREFILL_PREFILL,
                    "pdmesh-router",
                    "client",
                    10,
                    860,
                    &[],
                ),
                14,
                "transport error",
            ),
            span(
                "c000000000000006",
                "c000000000000002",
                "detokenize",
                "pdmesh-router",
                "internal",
                9,
                990,
                &[("detokenize.busy_ms", json!(0.0))],
            ),
        ];
        let e = explain(&spans).unwrap();
        eprintln!("{}", e.table());
        assert_eq!(e.dominant, "failed", "{}", e.table());
        assert!((get(&e, "failed") - 850.0).abs() < 1e-6, "{}", e.table());
        assert_eq!(get(&e, "detokenize"), 0.0, "no decode loop ran, so no detokenize tail: {}", e.table());
        assert!(
            e.sentence.starts_with("prefill-0 failed a Prefill call (UNAVAILABLE")
                && e.sentence.contains("never arrived"),
            "{}",
            e.sentence
        );
        assert_eq!(e.attempts[0].outcome, "failed");
    }
}
