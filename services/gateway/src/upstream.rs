//! The router call behind one API request, and its failover. Nothing has
//! reached the client before the router's first event, so a router that
//! cannot be reached, or dies first, is asked again (the restarted one or
//! another) for up to `ROUTER_PATIENCE` from its loss (a router that held
//! a call for seconds before dying leaves the next the full patience). A router lost after tokens
//! reached the client is replaced too: the request is sent again to another
//! router with the token ids streamed so far (`resume_ids`), which goes on
//! after them, so the client sees one unbroken answer. A router that
//! stops answering without dying (frozen, partitioned) counts as lost once
//! its health check and its stream have both been silent for the patience
//! (`--router-stall-floor-ms`), and is left out of picking for a while.

use std::time::Duration;

use axum::response::Response;
use pdmesh_core::outlier::{Silence, Strike, Watch};
use pdmesh_core::peers::Peers;
use pdmesh_core::telemetry::{self, SpanExt};
use pdmesh_core::vocab::{attr, event, rpc};
use pdmesh_proto::router::v1 as pb;
use std::sync::Arc;
use tokio::time::Instant;
use tracing::Instrument;

use crate::error::{error_body, from_router, status_response, timed_out, unavailable, DEADLINE_MESSAGE};

/// How long a request waits for a router that cannot be reached.
const ROUTER_PATIENCE: Duration = Duration::from_secs(3);
/// Pause before asking a router that could not be reached again.
const ROUTER_RETRY: Duration = Duration::from_millis(100);
/// Most routers one request moves to after tokens reached its client.
const MAX_FAILOVERS: u32 = 2;
/// Past the deadline, how long the router has to send its own
/// DEADLINE_EXCEEDED before the gateway ends the request itself.
const DEADLINE_SLACK: Duration = Duration::from_millis(500);

/// One request's router stream, resumed on another router if it is lost.
pub struct Upstream {
    routers: Peers,
    /// What the gateway knows of each router's liveness.
    watch: Arc<Watch>,
    request: pb::GenerateRequest,
    /// When the request must end.
    until: Instant,
    stream: tonic::Streaming<pb::GenerateResponse>,
    /// The first event, not yet handed out.
    first: Option<Option<pb::GenerateResponse>>,
    /// The client span of the current call; it ends when this is dropped.
    rpc: telemetry::Held,
    /// The request's span (the gateway's root): every call it makes, the
    /// failovers' too, is its child, so the request stays one trace.
    parent: tracing::Span,
    /// The router serving the current call: its service id and address.
    router: String,
    addr: String,
    /// Token ids handed out so far.
    sent: Vec<u32>,
    pub failovers: u32,
}

impl Upstream {
    /// Call a router and wait for its first event, so that refusals get
    /// their own HTTP status.
    pub async fn open(
        (routers, watch): (Peers, Arc<Watch>),
        request: pb::GenerateRequest,
        deadline: Duration,
    ) -> Result<Upstream, Response> {
        let until = Instant::now() + deadline;
        let parent = tracing::Span::current();
        let (stream, first, rpc, (router, addr)) =
            call(&routers, &watch, &request, until).await.map_err(|e| e.response())?;
        let first = Some(first);
        let rpc = telemetry::Held(rpc);
        let sent = Vec::new();
        Ok(Upstream { routers, watch, request, until, stream, first, rpc, parent, router, addr, sent, failovers: 0 })
    }

    /// The request's client span (the current router call's).
    pub fn span(&self) -> &tracing::Span {
        self.rpc.span()
    }

    /// The next event; a router lost mid-stream is replaced within the
    /// deadline, up to `MAX_FAILOVERS` times.
    pub async fn next(&mut self) -> Result<Option<pb::GenerateResponse>, tonic::Status> {
        loop {
            let m = match self.first.take() {
                Some(first) => Ok(first),
                // A router that stops sending without closing (frozen, or
                // stuck) cannot hold the request past its deadline. (The
                // caller records the error on the span, as for any other.)
                None => tokio::select! {
                    m = tokio::time::timeout_at(self.until + DEADLINE_SLACK, self.stream.message()) => match m {
                        Ok(m) => m,
                        Err(_) => return Err(tonic::Status::deadline_exceeded(DEADLINE_MESSAGE)),
                    },
                    s = self.watch.stopped(&self.addr, &self.routers) => Err(stalled(&self.watch, (&self.router, &self.addr), s)),
                },
            };
            match m {
                Err(s) if lost(&s) && self.failovers < MAX_FAILOVERS => {
                    telemetry::record_status(self.rpc.span(), Some(&s));
                    self.fail_over(s).await?;
                }
                Ok(Some(m)) => {
                    if let Some(pb::generate_response::Event::Delta(d)) = &m.event {
                        self.sent.extend_from_slice(&d.ids);
                    }
                    return Ok(Some(m));
                }
                other => return other,
            }
        }
    }

    /// Send the request again, with the ids streamed so far, to a router
    /// that answers; its first event is the next one handed out. The new
    /// call is the request span's child, and the span gets an event that
    /// says which router was lost, how, after how many tokens, and where
    /// the request went on.
    async fn fail_over(&mut self, lost: tonic::Status) -> Result<(), tonic::Status> {
        self.failovers += 1;
        let mut request = self.request.clone();
        // All max_tokens may be here already (the router was lost before
        // the finish): the next router then sends just the finish and usage.
        request.resume_ids = self.sent.clone();
        let why = pdmesh_core::grpc::status_text(&lost);
        let opened = call(&self.routers, &self.watch, &request, self.until).instrument(self.parent.clone()).await;
        let (stream, first, rpc, (router, addr)) = match opened {
            Ok(o) => o,
            Err(e) => {
                self.failed_over("none", &why);
                return Err(e.status(lost));
            }
        };
        rpc.set_attribute(attr::GATEWAY_FAILOVERS, i64::from(self.failovers));
        self.parent.set_attribute(attr::GATEWAY_FAILOVERS, i64::from(self.failovers));
        self.failed_over(&router, &why);
        (self.stream, self.first, self.rpc, self.router, self.addr) =
            (stream, Some(first), telemetry::Held(rpc), router, addr);
        Ok(())
    }

    /// The failover's event on the request span (`to`: "none" when no
    /// router could take the request).
    fn failed_over(&self, to: &str, why: &str) {
        use telemetry::KeyValue;
        self.parent.add_event(
            event::ROUTER_FAILOVER,
            vec![
                KeyValue::new(attr::FAILOVER_FROM, self.router.clone()),
                KeyValue::new(attr::FAILOVER_TO, to.to_string()),
                KeyValue::new(attr::FAILOVER_AFTER_TOKENS, self.sent.len() as i64),
                KeyValue::new(attr::FAILOVER_STATUS, why.to_string()),
            ],
        );
        // The log line (also an event on the span, under its own name).
        tracing::warn!(from = %self.router, to, after_tokens = self.sent.len(), status = why, "router lost mid-stream");
    }
}

/// Why no router call could be opened.
enum Refused {
    /// The router's own answer (a refusal, a bad request).
    Router(tonic::Status),
    /// No router could be reached in time.
    NoRouter,
    Deadline,
    Internal(String),
}

impl Refused {
    fn response(self) -> Response {
        match self {
            Refused::Router(s) => status_response(&from_router(s)),
            Refused::NoRouter => unavailable("no router is available"),
            Refused::Deadline => timed_out(),
            Refused::Internal(e) => error_body(500, &e, "internal_error", None, None),
        }
    }

    /// The status a failover that could not be made ends the stream with.
    fn status(self, lost: tonic::Status) -> tonic::Status {
        match self {
            Refused::Router(s) => s,
            Refused::Deadline => tonic::Status::deadline_exceeded(DEADLINE_MESSAGE),
            Refused::NoRouter | Refused::Internal(_) => lost,
        }
    }
}

/// A router call open to its first event: the stream, that event, the
/// call's client span, and the router's service id and address.
type Opened = (tonic::Streaming<pb::GenerateResponse>, Option<pb::GenerateResponse>, tracing::Span, (String, String));

/// The status of a call whose router stopped answering (`who`: its id and
/// address): a strike against it; the call counts as lost.
fn stalled(watch: &Watch, (id, addr): (&str, &str), s: Silence) -> tonic::Status {
    let (backoff, why) = {
        let mut o = watch.lock();
        (o.strike(addr, Strike::Stall, std::time::Instant::now()), s.describe(o.poll()))
    };
    tracing::warn!(router = id, why = %why, ejected_s = backoff.as_secs_f64(), "router stalled; its stream moves to another");
    tonic::Status::unavailable(format!("{STALLED}router {id} stalled: {why}"))
}

/// Marks the status of a stalled router's call (see [`lost`]).
const STALLED: &str = "[stalled] ";

/// Whether a call's router was lost: its connection failed, or it stalled.
fn lost(s: &tonic::Status) -> bool {
    pdmesh_core::grpc::is_transport(s) || (s.code() == tonic::Code::Unavailable && s.message().starts_with(STALLED))
}

/// A router call up to its first event, asking again (the same router
/// restarted, or another) while none can be reached, for `ROUTER_PATIENCE`.
async fn call(
    routers: &Peers,
    watch: &Watch,
    request: &pb::GenerateRequest,
    until: Instant,
) -> Result<Opened, Refused> {
    // The patience runs from the last time a router held the call: one that
    // took it up and died seconds later (a long wait for the first token)
    // leaves the full patience for the next.
    let mut t0 = Instant::now();
    let patience = |from: Instant| ROUTER_PATIENCE.min(until.saturating_duration_since(from));
    let mut attempt = 0usize;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let wait = patience(t0).saturating_sub(t0.elapsed()).max(Duration::from_millis(1));
        let list = routers.wait_any(wait).await.ok_or(Refused::NoRouter)?;
        // In rotation, but a router the gateway has evidence against goes last.
        let best = watch.lock().rotate_best(&list, attempt, std::time::Instant::now()).unwrap_or(0);
        let inst = &list[best];
        let ch = routers.channel(inst).map_err(Refused::Internal)?;
        attempt += 1;
        let (mut req, rpc) = telemetry::client_request(rpc::ROUTER_GENERATE, request.clone());
        rpc.set_attribute(attr::PEER_INSTANCE, inst.id.clone());
        req.set_timeout(left);
        let mut client = pb::router_client::RouterClient::new(ch);
        let opened = async {
            let mut s = client.generate(req).await?.into_inner();
            let first = s.message().await?;
            Ok::<_, tonic::Status>((s, first))
        };
        // A router that stops answering before its first event is lost too.
        let opened = async {
            tokio::select! {
                r = opened => r,
                s = watch.stopped(&inst.grpc_addr, routers) => Err(stalled(watch, (&inst.id, &inst.grpc_addr), s)),
            }
        };
        let sent = Instant::now();
        match tokio::time::timeout(left + DEADLINE_SLACK, opened.instrument(rpc.clone())).await {
            Ok(Ok((stream, first))) => return Ok((stream, first, rpc, (inst.id.clone(), inst.grpc_addr.clone()))),
            Ok(Err(s)) => {
                telemetry::record_status(&rpc, Some(&s));
                if sent.elapsed() >= ROUTER_RETRY {
                    t0 = Instant::now(); // it held the call a while: lost, not unreachable
                }
                let again = t0.elapsed() + ROUTER_RETRY;
                if lost(&s) && again < patience(t0) {
                    tokio::time::sleep(ROUTER_RETRY).await;
                    continue;
                }
                return Err(Refused::Router(s));
            }
            Err(_) => {
                telemetry::mark_error(&rpc, "deadline exceeded");
                return Err(Refused::Deadline);
            }
        }
    }
}
