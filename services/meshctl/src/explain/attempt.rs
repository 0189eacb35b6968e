//! One attempt of a request — a gateway request span, or a Router/Generate
//! span where no gateway took part — with the spans under it, the
//! milestones they mark, and the stretches of its time each stage
//! accounts for.
//!
//! The stretches between milestones are charged in causal order:
//!
//! | stretch | cause |
//! |---|---|
//! | gateway span start → router span start | gateway/proxy |
//! | → `tokenize` start, and `tokenize` end → the Prefill call | router |
//! | `tokenize` | tokenize |
//! | the Prefill call → `queued` end | queue wait (incl. a worker slow to take the call up) |
//! | → `prefill_forward` end | prefill compute |
//! | → decode `admit` end (only if admission ended later) | decode admission |
//! | → `decode_loop` start | KV transfer (a local prefill: prefill compute) |
//! | `decode_loop` | decode steps |
//! | → router span end | detokenize (after a decode loop), else router |
//! | → start of the client's final backlog | gateway/proxy |
//! | final backlog → gateway span end | client write |
//!
//! A stretch is only charged to a stage where one of that stage's spans
//! was open; the rest goes to whoever held the request (router, else
//! gateway). Failed and refused calls are painted over it all.

use std::collections::HashMap;

use super::timeline::{uncovered, Timeline};
use super::Cause;
use crate::trace::Span;
use pdmesh_core::vocab::{attr, rpc, span};

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ok,
    /// Refused for lack of room (429 / RESOURCE_EXHAUSTED), with its words.
    Refused(String),
    /// Failed, with its status in words.
    Failed(String),
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused(_) => "refused",
            Outcome::Failed(_) => "failed",
        }
    }
}

/// A call that failed or was refused inside an attempt.
#[derive(Debug, Clone)]
pub struct Fault<'a> {
    pub call: &'a Span,
    pub refused: bool,
    /// The worker it went to (its own spans, else the `route` span's pick).
    pub worker: String,
    /// Status code name and message.
    pub status: String,
    /// Whether the worker's own spans for this call arrived.
    pub worker_spans: bool,
    /// The stretch painted: from the end of the worker's last known work.
    pub from_ns: u64,
}

pub fn last<'a>(spans: &[&'a Span], pred: impl Fn(&Span) -> bool) -> Option<&'a Span> {
    // The last one started: with retries, the call that went through.
    spans.iter().copied().filter(|s| pred(s)).max_by_key(|s| s.start_ns)
}

fn is_rpc(s: &Span, method: &str, kind: &str) -> bool {
    s.name == method && s.kind == kind
}

fn child_of<'a>(spans: &[&'a Span], parent: Option<&Span>, name: &str) -> Option<&'a Span> {
    let p = parent?;
    last(spans, |s| s.name == name && s.parent_id == p.span_id)
}

fn parent_of<'a>(spans: &[&'a Span], s: Option<&Span>) -> Option<&'a Span> {
    let s = s?;
    spans.iter().copied().find(|p| p.span_id == s.parent_id)
}

pub fn instance(s: Option<&Span>) -> String {
    s.and_then(|s| s.attr_str(attr::SERVICE_INSTANCE_ID)).unwrap_or("?").to_string()
}

/// The spans that mark an attempt's milestones (its last call of each kind).
pub struct Marks<'a> {
    pub gateway: Option<&'a Span>,
    pub router: Option<&'a Span>,
    pub root: &'a Span,
    pub tokenize: Option<&'a Span>,
    pub encode: Option<&'a Span>,
    pub prefill_call: Option<&'a Span>,
    pub prefill: Option<&'a Span>,
    pub queued: Option<&'a Span>,
    pub forward: Option<&'a Span>,
    pub xfer: Option<&'a Span>,
    pub decode: Option<&'a Span>,
    pub decode_loop: Option<&'a Span>,
    pub admit: Option<&'a Span>,
    pub await_kv: Option<&'a Span>,
    pub detok: Option<&'a Span>,
}

impl<'a> Marks<'a> {
    fn find(root: &'a Span, spans: &[&'a Span]) -> Marks<'a> {
        let gateway = (root.service == "pdmesh-gateway").then_some(root);
        let router = last(spans, |s| is_rpc(s, rpc::ROUTER_GENERATE, "server"));
        let prefill = last(spans, |s| is_rpc(s, rpc::PREFILL_PREFILL, "server"));
        let decode_loop = last(spans, |s| s.name == span::DECODE_LOOP);
        let decode =
            parent_of(spans, decode_loop).or_else(|| last(spans, |s| is_rpc(s, rpc::DECODE_GENERATE, "server")));
        let tokenize = child_of(spans, router, span::TOKENIZE);
        Marks {
            gateway,
            router,
            root,
            tokenize,
            encode: last(spans, |s| is_rpc(s, rpc::TOKENIZER_ENCODE, "server")),
            prefill_call: parent_of(spans, prefill).filter(|c| c.kind == "client"),
            prefill,
            queued: child_of(spans, prefill, span::QUEUED),
            // A local prefill's forward hangs under the decode's Generate.
            forward: child_of(spans, prefill, span::PREFILL_FORWARD)
                .or_else(|| child_of(spans, decode, span::PREFILL_FORWARD)),
            xfer: child_of(spans, prefill, span::KV_TRANSFER),
            decode,
            decode_loop,
            admit: child_of(spans, decode, span::ADMIT),
            await_kv: child_of(spans, decode, span::AWAIT_KV),
            detok: child_of(spans, router, span::DETOKENIZE),
        }
    }

    /// The stretches of `[root start, root end)` each stage accounts for,
    /// in causal order, and where the attempt's known work ended.
    fn walk(&self) -> (Vec<(u64, u64, Cause)>, u64) {
        let (t0, t_end) = (self.root.start_ns, self.root.end_ns);
        let tail_ns = self.gateway.and_then(|g| g.attr_f64(attr::CLIENT_TAIL_MS)).map_or(0, |ms| (ms * 1e6) as u64);
        let limit = t_end.saturating_sub(tail_ns).max(t0);
        let mut out = Vec::new();
        let mut cursor = t0;
        let mut to = |cause: Cause, until: Option<u64>, cap: u64| {
            if let Some(u) = until.map(|u| u.min(cap)).filter(|u| *u > cursor) {
                out.push((cursor, u, cause));
                cursor = u;
            }
            cursor
        };
        let start = |s: Option<&Span>| s.map(|s| s.start_ns);
        let end = |s: Option<&Span>| s.map(|s| s.end_ns);
        let gw = self.gateway.is_some();
        if gw {
            to(Cause::Gateway, start(self.router), limit);
        }
        to(Cause::Router, start(self.tokenize), limit);
        to(Cause::Tokenize, end(self.tokenize), limit);
        to(Cause::Router, start(self.prefill_call.or(self.prefill).or(self.queued)), limit);
        to(Cause::QueueWait, end(self.queued), limit);
        to(Cause::PrefillCompute, end(self.forward), limit);
        to(Cause::DecodeAdmission, end(self.admit), limit);
        let handover = if self.xfer.is_some() { Cause::KvTransfer } else { Cause::PrefillCompute };
        to(handover, start(self.decode_loop), limit);
        let work_end = to(Cause::DecodeSteps, end(self.decode_loop), limit);
        if self.decode_loop.is_some() && gw {
            to(Cause::Detokenize, end(self.router), limit);
        }
        if gw {
            to(Cause::Router, end(self.router), limit);
        }
        to(if gw { Cause::Gateway } else { Cause::Router }, Some(limit), limit);
        to(Cause::ClientWrite, Some(t_end), t_end);
        (out, work_end)
    }

    /// The spans whose being open lets a stretch be charged to `cause`.
    fn cover(&self, cause: Cause) -> Vec<&'a Span> {
        let v = |xs: &[Option<&'a Span>]| xs.iter().flatten().copied().collect();
        match cause {
            Cause::Gateway | Cause::ClientWrite => v(&[self.gateway]),
            Cause::Router => v(&[self.router]),
            Cause::Tokenize => v(&[self.tokenize]),
            Cause::QueueWait => v(&[self.prefill_call, self.queued]),
            Cause::PrefillCompute => v(&[self.forward]),
            Cause::DecodeAdmission => v(&[self.admit]),
            Cause::KvTransfer => v(&[self.xfer, self.await_kv, self.prefill, self.prefill_call]),
            Cause::DecodeSteps => v(&[self.decode_loop]),
            Cause::Detokenize => v(&[self.detok]),
            Cause::Refused | Cause::Failed | Cause::BetweenAttempts => vec![],
        }
    }

    /// Who held the request at `t` when no stage's span was open.
    fn holder(&self, t: u64) -> Cause {
        match self.router {
            Some(r) if r.start_ns <= t && t < r.end_ns => Cause::Router,
            _ if self.gateway.is_some() => Cause::Gateway,
            _ => Cause::Router,
        }
    }
}

pub struct Attempt<'a> {
    pub root: &'a Span,
    pub spans: Vec<&'a Span>,
    pub marks: Marks<'a>,
    pub outcome: Outcome,
    pub faults: Vec<Fault<'a>>,
}

/// Every attempt in the trace, oldest first: gateway request spans, or
/// Router/Generate server spans where no gateway took part.
pub fn attempts(spans: &[Span]) -> Vec<Attempt<'_>> {
    let mut kids: HashMap<&str, Vec<&Span>> = HashMap::new();
    for s in spans {
        kids.entry(s.parent_id.as_str()).or_default().push(s);
    }
    let gateway: Vec<&Span> = spans.iter().filter(|s| s.service == "pdmesh-gateway" && s.kind == "server").collect();
    let mut roots = if gateway.is_empty() {
        spans.iter().filter(|s| is_rpc(s, rpc::ROUTER_GENERATE, "server")).collect()
    } else {
        gateway
    };
    roots.sort_by_key(|s| s.start_ns);
    roots
        .into_iter()
        .map(|root| {
            let mut sub = vec![root];
            let mut i = 0;
            while i < sub.len() {
                sub.extend(kids.get(sub[i].span_id.as_str()).into_iter().flatten().copied());
                i += 1;
            }
            let marks = Marks::find(root, &sub);
            let faults = faults(&sub);
            let outcome = outcome(&marks, &faults);
            Attempt { root, spans: sub, marks, outcome, faults }
        })
        .collect()
}

/// The status code of an RPC span (`rpc.grpc.status_code`).
fn code(s: &Span) -> Option<i64> {
    s.attr_f64(attr::RPC_STATUS_CODE).map(|c| c as i64)
}

pub fn code_name(c: i64) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(c).ok().and_then(|i| NAMES.get(i)).copied().unwrap_or("UNKNOWN")
}

/// The calls out of the router (and the gateway's call to it) that ended
/// in error, except those cancelled on purpose.
fn faults<'a>(spans: &[&'a Span]) -> Vec<Fault<'a>> {
    const CALLS: [&str; 4] = [rpc::PREFILL_PREFILL, rpc::DECODE_GENERATE, rpc::TOKENIZER_ENCODE, rpc::ROUTER_GENERATE];
    let mut out = Vec::new();
    for call in spans.iter().copied().filter(|s| s.kind == "client" && s.error && CALLS.contains(&s.name.as_str())) {
        let c = code(call).unwrap_or(2);
        if c == 1 {
            continue;
        }
        let below: Vec<&Span> = spans.iter().copied().filter(|s| descends(spans, s, call)).collect();
        let worker_span = below.iter().find(|s| s.kind == "server").copied();
        let from = below.iter().filter(|s| !s.error).map(|s| s.end_ns).max().unwrap_or(call.start_ns);
        let refused = c == 8;
        let words = worker_words(&below).unwrap_or_else(|| call.status_message.clone());
        out.push(Fault {
            call,
            refused,
            worker: worker_span.map(|w| instance(Some(w))).unwrap_or_else(|| picked(spans, call)),
            status: if words.is_empty() { code_name(c).to_string() } else { format!("{}: {words}", code_name(c)) },
            worker_spans: worker_span.is_some(),
            from_ns: if refused { call.start_ns } else { from.clamp(call.start_ns, call.end_ns) },
        });
    }
    // A call whose failure came from a failed call below it (the gateway's
    // call to the router, failed because the router's call to a worker
    // did) is told by the inner one, which names the worker.
    let inner: Vec<&Span> = out.iter().map(|f| f.call).collect();
    out.retain(|f| !inner.iter().any(|c| c.span_id != f.call.span_id && descends(spans, c, f.call)));
    out
}

/// The worker's own words for its failure: the first error status below the call.
fn worker_words(below: &[&Span]) -> Option<String> {
    below
        .iter()
        .filter(|s| s.error && !s.status_message.is_empty())
        .min_by_key(|s| s.start_ns)
        .map(|s| s.status_message.clone())
}

fn descends(spans: &[&Span], s: &Span, ancestor: &Span) -> bool {
    let mut cur = s.parent_id.as_str();
    for _ in 0..64 {
        if cur == ancestor.span_id {
            return true;
        }
        match spans.iter().find(|p| p.span_id == cur) {
            Some(p) => cur = p.parent_id.as_str(),
            None => return false,
        }
    }
    false
}

/// The instance a call went to: the one its client span names, else the
/// worker the `route` span picked for it (the latest route before it).
fn picked(spans: &[&Span], call: &Span) -> String {
    // A client span that names its peer (the gateway's router calls).
    if let Some(peer) = call.attr_str(attr::PEER_INSTANCE) {
        return peer.to_string();
    }
    let kind = if call.name == rpc::PREFILL_PREFILL {
        "prefill"
    } else if call.name == rpc::DECODE_GENERATE {
        "decode"
    } else {
        return call.name.split('/').next().unwrap_or("?").rsplit('.').nth(1).unwrap_or("?").to_string();
    };
    let route = last(spans, |s| s.name == span::ROUTE && s.start_ns <= call.start_ns);
    route
        .and_then(|r| r.attr_str(&pdmesh_core::vocab::pick_key(kind, attr::PICK_INSTANCE)))
        .map(str::to_string)
        .unwrap_or_else(|| format!("a {kind} worker"))
}

fn outcome(m: &Marks, faults: &[Fault]) -> Outcome {
    let root = m.root;
    let http = root.attr_f64(attr::HTTP_STATUS_CODE).map(|c| c as i64);
    let router_code = m.router.and_then(code);
    let why = || {
        faults.last().map(|f| format!("{} at {}", f.status, f.worker)).unwrap_or_else(|| {
            let inner = m.router.filter(|r| r.error).map(|r| r.status_message.clone()).unwrap_or_default();
            match (http, inner.is_empty()) {
                (Some(h), true) => format!("HTTP {h}"),
                (Some(h), false) => format!("HTTP {h} ({inner})"),
                (None, _) => code_name(code(root).unwrap_or(2)).to_string(),
            }
        })
    };
    let refused = http == Some(429) || (http.is_none() && code(root) == Some(8));
    if refused {
        return Outcome::Refused(why());
    }
    let failed = http.is_some_and(|h| h >= 400) || root.error || router_code.is_some_and(|c| c != 0);
    if failed {
        Outcome::Failed(why())
    } else {
        Outcome::Ok
    }
}

impl Attempt<'_> {
    /// Paint this attempt on `t`: its stages where their spans were open,
    /// then its failed and refused calls over them.
    pub fn paint(&self, t: &mut Timeline) {
        let (stretches, work_end) = self.marks.walk();
        for (a, b, cause) in stretches {
            t.paint(a, b, cause);
            let cover: Vec<(u64, u64)> = self.marks.cover(cause).iter().map(|s| (s.start_ns, s.end_ns)).collect();
            for (x, y) in uncovered(a, b, &cover) {
                t.paint(x, y, self.marks.holder(x));
            }
        }
        for f in &self.faults {
            t.paint(f.from_ns, f.call.end_ns, if f.refused { Cause::Refused } else { Cause::Failed });
        }
        if self.faults.is_empty() {
            match self.outcome {
                Outcome::Ok => {}
                Outcome::Refused(_) => t.paint(work_end, self.root.end_ns, Cause::Refused),
                Outcome::Failed(_) => t.paint(work_end, self.root.end_ns, Cause::Failed),
            }
        }
    }
}
