//! `meshctl explain`: where one request's time went, from its trace.
//!
//! The request's life is cut at milestones its spans mark, in causal order;
//! each stretch between two milestones is charged to the one cause the
//! request was waiting on then:
//!
//! | stretch | cause |
//! |---|---|
//! | gateway span start → router span start | gateway/proxy |
//! | → `tokenize` start, and `tokenize` end → prefill `queued` start | router |
//! | `tokenize` | tokenize |
//! | `queued` | queue wait (behind N running, M queued) |
//! | → `prefill_forward` end | prefill compute |
//! | → decode `admit` end (only if admission ended later) | decode admission |
//! | → `decode_loop` start | KV transfer (claim, write, ticket done) |
//! | `decode_loop` | decode steps (count, batch sizes) |
//! | → router span end | detokenize (the tail after the last token) |
//! | → start of the client's final backlog | gateway/proxy |
//! | final backlog → gateway span end | client write |
//!
//! The client's final backlog is the last unbroken stretch during which
//! response data was ready at the gateway but not yet taken by the client
//! (`gateway.client_tail_ms`). The stretches add up to the whole request.

use serde_json::{json, Value};

use crate::trace::Span;
use pdmesh_core::vocab::{attr, pick_key, rpc, span};

pub const CAUSES: &[&str] = &[
    "gateway/proxy",
    "router",
    "tokenize",
    "queue wait",
    "prefill compute",
    "decode admission",
    "KV transfer",
    "decode steps",
    "detokenize",
    "client write",
];

#[derive(Debug, Clone)]
pub struct Part {
    pub cause: &'static str,
    pub ms: f64,
    pub share: f64,
    pub detail: String,
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
}

fn find(spans: &[Span], pred: impl Fn(&Span) -> bool) -> Option<&Span> {
    // The last one started: with retries, the attempt that went through.
    spans.iter().filter(|s| pred(s)).max_by_key(|s| s.start_ns)
}

fn is_rpc(s: &Span, method: &str, kind: &str) -> bool {
    s.name == method && s.kind == kind
}

fn child_of<'a>(spans: &'a [Span], parent: Option<&Span>, name: &str) -> Option<&'a Span> {
    let p = parent?;
    find(spans, |s| s.name == name && s.parent_id == p.span_id)
}

fn int(s: Option<&Span>, key: &str) -> Option<i64> {
    s.and_then(|s| s.attr_f64(key)).map(|v| v as i64)
}

fn instance(s: Option<&Span>) -> String {
    s.and_then(|s| s.attr_str(attr::SERVICE_INSTANCE_ID)).unwrap_or("?").to_string()
}

/// The spans that mark a request's milestones (the last attempt's).
struct Marks<'a> {
    spans: &'a [Span],
    gateway: Option<&'a Span>,
    router: Option<&'a Span>,
    outer: &'a Span,
    tokenize: Option<&'a Span>,
    prefill: Option<&'a Span>,
    queued: Option<&'a Span>,
    forward: Option<&'a Span>,
    xfer: Option<&'a Span>,
    decode: Option<&'a Span>,
    decode_loop: Option<&'a Span>,
    admit: Option<&'a Span>,
    detok: Option<&'a Span>,
}

impl<'a> Marks<'a> {
    fn find(spans: &'a [Span]) -> Result<Marks<'a>, String> {
        let gateway = find(spans, |s| s.service == "pdmesh-gateway" && s.kind == "server");
        let router = find(spans, |s| is_rpc(s, rpc::ROUTER_GENERATE, "server"));
        let outer =
            gateway.or(router).ok_or("the trace has neither a gateway request span nor a router Generate span")?;
        let prefill = find(spans, |s| is_rpc(s, rpc::PREFILL_PREFILL, "server"));
        let decode_loop = find(spans, |s| s.name == span::DECODE_LOOP);
        let decode = decode_loop
            .and_then(|l| spans.iter().find(|s| s.span_id == l.parent_id))
            .or_else(|| find(spans, |s| is_rpc(s, rpc::DECODE_GENERATE, "server")));
        Ok(Marks {
            spans,
            gateway,
            router,
            outer,
            tokenize: child_of(spans, router, span::TOKENIZE),
            prefill,
            queued: child_of(spans, prefill, span::QUEUED),
            // A local prefill's forward hangs under the decode's Generate.
            forward: child_of(spans, prefill, span::PREFILL_FORWARD)
                .or_else(|| child_of(spans, decode, span::PREFILL_FORWARD)),
            xfer: child_of(spans, prefill, span::KV_TRANSFER),
            decode,
            decode_loop,
            admit: child_of(spans, decode, span::ADMIT),
            detok: child_of(spans, router, span::DETOKENIZE),
        })
    }

    /// Nanoseconds charged to each of [`CAUSES`], walking the milestones in order.
    fn charge(&self) -> Vec<(&'static str, u64)> {
        let (t0, t_end) = (self.outer.start_ns, self.outer.end_ns);
        let tail_ns = self.gateway.and_then(|g| g.attr_f64(attr::CLIENT_TAIL_MS)).map_or(0, |ms| (ms * 1e6) as u64);
        let limit = t_end.saturating_sub(tail_ns).max(t0);
        let mut acc: Vec<(&'static str, u64)> = CAUSES.iter().map(|c| (*c, 0u64)).collect();
        let mut cursor = t0;
        let mut charge = |cause: &'static str, until: Option<u64>, cap: u64| {
            if let Some(u) = until {
                let u = u.min(cap);
                if u > cursor {
                    if let Some(a) = acc.iter_mut().find(|(c, _)| *c == cause) {
                        a.1 += u - cursor;
                    }
                    cursor = u;
                }
            }
        };
        let gw = self.gateway.is_some();
        if gw {
            charge("gateway/proxy", self.router.map(|r| r.start_ns), limit);
        }
        charge("router", self.tokenize.map(|s| s.start_ns), limit);
        charge("tokenize", self.tokenize.map(|s| s.end_ns), limit);
        charge("router", self.queued.or(self.prefill).map(|s| s.start_ns), limit);
        charge("queue wait", self.queued.map(|s| s.end_ns), limit);
        charge("prefill compute", self.forward.map(|s| s.end_ns), limit);
        charge("decode admission", self.admit.map(|s| s.end_ns), limit);
        charge("KV transfer", self.decode_loop.map(|s| s.start_ns), limit);
        charge("decode steps", self.decode_loop.map(|s| s.end_ns), limit);
        charge("detokenize", self.router.filter(|_| gw).map(|s| s.end_ns), limit);
        charge(if gw { "gateway/proxy" } else { "router" }, Some(limit), limit);
        charge("client write", Some(t_end), t_end);
        acc
    }

    /// One line of evidence for `cause`, from the attributes of its spans.
    fn detail(&self, cause: &str) -> String {
        let Marks {
            spans,
            gateway,
            router,
            tokenize,
            prefill,
            queued,
            forward,
            xfer,
            decode,
            decode_loop,
            admit,
            detok,
            ..
        } = *self;
        match cause {
            "gateway/proxy" => format!("gateway {}", instance(gateway)),
            "router" => format!("router {}; {}", instance(router), route_detail(spans)),
            "tokenize" => format!("{} prompt tokens", int(tokenize, attr::PROMPT_TOKENS).unwrap_or(0)),
            "queue wait" => format!(
                "behind {} running and {} queued on {}{}",
                int(queued, attr::PREFILL_RUNNING).unwrap_or(0),
                int(queued, attr::PREFILL_QUEUE_DEPTH).unwrap_or(0),
                instance(prefill),
                int(queued, attr::QUEUE_HELD_MS)
                    .map(|h| format!(" (queue held {h} ms by a fault switch)"))
                    .unwrap_or_default()
            ),
            "prefill compute" if forward.is_some_and(|f| f.attr_bool(attr::PREFILL_LOCAL) == Some(true)) => format!(
                "{} prompt tokens prefilled locally by {} beside its decode steps, in {}{}",
                int(forward, attr::PROMPT_TOKENS).unwrap_or(0),
                instance(decode),
                match int(forward, attr::PREFILL_STEPS).unwrap_or(0) {
                    1 => "1 step".to_string(),
                    n => format!("{n} steps"),
                },
                cached_note(forward)
            ),
            "prefill compute" => format!(
                "{} prompt tokens in a batch of {} ({} tokens){}{}",
                int(forward, attr::PROMPT_TOKENS).unwrap_or(0),
                int(forward, attr::BATCH_SIZE).unwrap_or(0),
                int(forward, attr::BATCH_TOKENS).unwrap_or(0),
                int(forward, attr::PREFILL_STEPS)
                    .filter(|n| *n > 1)
                    .map(|n| format!(", over {n} steps"))
                    .unwrap_or_default(),
                cached_note(forward)
            ),
            "decode admission" => format!(
                "{} running, {} awaiting KV on {}",
                int(admit, attr::DECODE_RUNNING).unwrap_or(0),
                int(admit, attr::DECODE_AWAITING_KV).unwrap_or(0),
                instance(decode)
            ),
            "KV transfer" => format!(
                "{} bytes over {} (write {:.1} ms){}",
                int(xfer, attr::KV_BYTES).unwrap_or(0),
                xfer.and_then(|x| x.attr_str(attr::KV_TRANSPORT)).unwrap_or("?"),
                xfer.and_then(|x| x.attr_f64(attr::KV_WRITE_MS)).unwrap_or(0.0),
                int(xfer, attr::FAULT_STALL_MS)
                    .map(|s| format!(", stalled {s} ms by a fault switch"))
                    .unwrap_or_default()
            ),
            "decode steps" => format!(
                "{} steps, batch mean {:.1} max {}, {} already running on {} when it joined",
                int(decode_loop, attr::DECODE_STEPS).unwrap_or(0),
                decode_loop.and_then(|l| l.attr_f64(attr::DECODE_BATCH_MEAN)).unwrap_or(0.0),
                int(decode_loop, attr::DECODE_BATCH_MAX).unwrap_or(0),
                int(decode_loop, attr::DECODE_RUNNING_ON_JOIN).unwrap_or(0),
                instance(decode)
            ),
            "detokenize" => format!(
                "{} calls, {:.1} ms busy in all",
                int(detok, attr::DETOKENIZE_CALLS).unwrap_or(0),
                detok.and_then(|d| d.attr_f64(attr::DETOKENIZE_BUSY_MS)).unwrap_or(0.0)
            ),
            "client write" => format!(
                "response data waited {:.0} ms in all for the client to read it ({} chunks)",
                gateway.and_then(|g| g.attr_f64(attr::CLIENT_WAIT_MS)).unwrap_or(0.0),
                int(gateway, attr::CHUNKS).unwrap_or(0)
            ),
            _ => String::new(),
        }
    }
}

/// Attribute a trace's time to causes.
pub fn explain(spans: &[Span]) -> Result<Explanation, String> {
    if spans.is_empty() {
        return Err("the trace has no spans".into());
    }
    let marks = Marks::find(spans)?;
    let total = marks.outer.end_ns.saturating_sub(marks.outer.start_ns).max(1);
    let ms = |ns: u64| ns as f64 / 1e6;
    let parts: Vec<Part> = marks
        .charge()
        .iter()
        .map(|(c, ns)| Part {
            cause: c,
            ms: ms(*ns),
            share: *ns as f64 / total as f64,
            detail: if *ns > 0 { marks.detail(c) } else { String::new() },
        })
        .collect();
    let top = parts.iter().max_by(|a, b| a.ms.total_cmp(&b.ms)).expect("causes are not empty");
    let sentence = format!(
        "{} took {:.0}% of the request ({:.0} of {:.0} ms): {}.",
        capitalise(top.cause),
        top.share * 100.0,
        top.ms,
        ms(total),
        top.detail
    );
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
    })
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().collect::<String>() + c.as_str()).unwrap_or_default()
}

impl Explanation {
    pub fn to_json(&self) -> Value {
        json!({
            "trace_id": self.trace_id,
            "total_ms": self.total_ms,
            "dominant": self.dominant,
            "sentence": self.sentence,
            "services": self.services,
            "spans": self.spans,
            "parts": self.parts.iter().map(|p| json!({ "cause": p.cause, "ms": p.ms, "share": p.share, "detail": p.detail })).collect::<Vec<_>>(),
        })
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "trace {}: {:.1} ms, {} spans from {}\n\n",
            self.trace_id,
            self.total_ms,
            self.spans,
            self.services.join(", ")
        );
        out += &format!("{:<18} {:>10} {:>7}  {}\n", "where", "ms", "share", "detail");
        for p in &self.parts {
            out += &format!("{:<18} {:>10.1} {:>6.1}%  {}\n", p.cause, p.ms, p.share * 100.0, p.detail);
        }
        out += &format!("\n{}\n", self.sentence);
        out
    }
}

/// "; prefill skipped N cached tokens, computed M" when `forward` reused any.
fn cached_note(forward: Option<&Span>) -> String {
    int(forward, attr::PREFILL_CACHED_TOKENS)
        .filter(|n| *n > 0)
        .map(|n| {
            format!(
                "; prefill skipped {n} cached tokens, computed {}",
                int(forward, attr::PREFILL_COMPUTED_TOKENS).unwrap_or(0)
            )
        })
        .unwrap_or_default()
}

/// Which workers the `route` span says were picked, and why.
fn route_detail(spans: &[Span]) -> String {
    let route = find(spans, |s| s.name == span::ROUTE);
    route
        .map(|r| {
            let branch = r
                .attr_str(&pick_key("prefill", attr::PICK_BRANCH))
                .map(|b| {
                    let int = |k| r.attr_f64(&pick_key("prefill", k)).unwrap_or(0.0) as i64;
                    let (held, of) = (int(attr::PICK_OVERLAP_BLOCKS), int(attr::PICK_PROMPT_BLOCKS));
                    format!(" ({b}: holds {held} of {of} prompt blocks)")
                })
                .unwrap_or_default();
            let decode = r.attr_str(&pick_key("decode", attr::PICK_INSTANCE)).unwrap_or("?");
            if r.attr_str(attr::ROUTE_PREFILL_MODE) == Some("local") {
                let int = |k| r.attr_f64(k).unwrap_or(0.0) as i64;
                return format!(
                    "picked {decode}, which prefilled locally ({} uncached prompt tokens, at most {})",
                    int(attr::ROUTE_LOCAL_TAIL_TOKENS),
                    int(attr::ROUTE_MAX_LOCAL_PREFILL)
                );
            }
            format!(
                "picked {}{branch} and {decode}",
                r.attr_str(&pick_key("prefill", attr::PICK_INSTANCE)).unwrap_or("?"),
            )
        })
        .unwrap_or_default()
}
