//! Dispatch: pick a decode and a prefill worker, send the prompt to both at
//! once (the decode reserves blocks and opens the ticket, the prefill fills
//! them), and retry on another pair when a decode worker refuses. When the
//! part of the prompt the decode worker lacks is short, it prefills the
//! prompt itself (local prefill) and no prefill worker is involved.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use pdmesh_core::discovery::Instance;
use pdmesh_core::peers::Peers;
use pdmesh_core::telemetry::{self, SpanExt};
use pdmesh_core::vocab::{attr, pick_key, rpc, span};
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::prefill::v1 as ppb;
use tonic::transport::Channel;
use tonic::Status;
use tracing::Instrument;

use crate::error::{decode_refusal, retryable, Error};
use crate::load::{Busy, Overlap, Prompt};
use crate::pick::{cache_aware, least_busy, prefill_mode, Branch, Candidate, Mode};
use crate::stall::Kind;
use crate::state::{AbortOnDrop, Router};
use crate::validate::Job;

/// A sequence a draining decode worker parked, with the KV of the prompt
/// and of every token sent but the last: it ships them (`HandOver`) into
/// the blocks of the decode worker that continues the request.
pub struct Handover {
    /// The draining worker's address.
    pub from: String,
    /// The parked sequence there.
    pub sequence: u64,
    pub kv_tokens: u32,
    /// Its stream, held open until the shipment is over (the worker's drain
    /// waits for it; dropped, the sequence is freed there).
    pub stream: tonic::Streaming<dpb::GenerateResponse>,
}

/// A worker chosen for one attempt, counted as busy while held.
pub struct Picked {
    inst: Instance,
    ch: Channel,
    busy: Busy,
    /// Prompt tokens the worker's prefix cache holds, as far as the router knows.
    cached_tokens: u32,
}

/// The prefill and decode worker serving a request: counted as busy, the
/// decode stream's client span, and their instance ids, while it runs.
pub struct Pair {
    _busy: (Busy, Option<Busy>),
    pub decode_rpc: telemetry::Held,
    /// [prefill, decode]: the same worker for a local prefill.
    pub workers: [String; 2],
}

/// Workers a request's earlier dispatches failed on: passed over while
/// others remain, tried again when none do.
#[derive(Default)]
pub struct Avoid {
    /// Prefill workers' gRPC addresses.
    pub prefill: Vec<String>,
    /// Decode workers' gRPC addresses.
    pub decode: Vec<String>,
    /// No KV transfer: the decode worker prefills the prompt itself (a
    /// transferred prompt's KV failed its checksum twice).
    pub no_transfer: bool,
    /// [prefill, decode]: a worker of that kind was lost (not reached),
    /// so with no other one left the next dispatch waits for it to come
    /// back (a supervisor restarting it on the same address).
    pub lost: [bool; 2],
}

pub type PrefillCall = AbortOnDrop<Result<tonic::Response<ppb::PrefillResponse>, Status>>;

/// A request admitted by a decode worker, its prefill under way.
pub struct Dispatched {
    pub stream: tonic::Streaming<dpb::GenerateResponse>,
    /// None for a local prefill.
    pub prefill: Option<PrefillCall>,
    pub pair: Pair,
    /// A local prefill's reused prompt tokens (a remote one's come with the prefill's answer).
    pub cached_tokens: u32,
    /// The prefill worker's address (None for a local prefill).
    pub prefill_addr: Option<String>,
    /// The decode worker's address.
    pub decode_addr: String,
}

impl Router {
    /// Dispatch `prompt` until a decode worker admits it, avoiding the
    /// workers in `avoid` while others (or local prefill) remain.
    /// `ticket` holds the ticket id in use, so the caller can cancel it if
    /// the request fails.
    pub async fn dispatch(
        &self,
        job: &Job,
        prompt: &[u32],
        ticket: &Mutex<String>,
        avoid: &Avoid,
        handover: Option<Handover>,
    ) -> Result<Dispatched, Status> {
        if let Some(h) = handover {
            return self.dispatch_handover(job, prompt, ticket, avoid, h).await;
        }
        let mut tried_d: Vec<String> = avoid.decode.clone();
        let mut tried_p: Vec<String> = avoid.prefill.clone();
        let mut attempt = 0u32;
        loop {
            let ticket_id = self.ticket_id(&job.request_id, attempt);
            *ticket.lock().unwrap_or_else(|e| e.into_inner()) = ticket_id.clone();
            let wait = job.deadline.map_or(self.worker_wait, |d| {
                d.saturating_duration_since(std::time::Instant::now()).min(self.worker_wait)
            });
            if avoid.lost[1] {
                wait_back(&self.decode, &mut tried_d, wait).await;
            }
            if avoid.lost[0] && self.max_local_prefill == 0 {
                wait_back(&self.prefill, &mut tried_p, wait).await;
            }
            let (d, p) = self.route(attempt, prompt, &mut tried_d, &mut tried_p, (avoid.no_transfer, wait)).await?;
            let d_addr = d.inst.grpc_addr.clone();
            let p_addr = p.as_ref().map(|p| p.inst.grpc_addr.clone());
            let feed = p.map_or(Feed::Local, Feed::Prefill);
            let e = match self.attempt(job, prompt, &ticket_id, d, feed).await {
                Ok(x) => return Ok(x),
                Err(e) => e,
            };
            self.cancel_ticket(&ticket_id, "decode refused the request").await;
            let other =
                self.decode.instances().iter().any(|i| i.grpc_addr != d_addr && !tried_d.contains(&i.grpc_addr));
            // The only decode worker lost: wait for it to come back.
            let lost = pdmesh_core::grpc::is_transport(&e);
            if !retryable(&e) || !(other || lost) || attempt >= self.retries {
                return Err(decode_refusal(e));
            }
            tried_d.push(d_addr);
            tried_p.extend(p_addr);
            if !other {
                wait_back(&self.decode, &mut tried_d, wait).await;
            }
            attempt += 1;
        }
    }

    /// Dispatch a request whose draining decode worker holds its KV: another
    /// decode worker reserves room and opens the ticket, the draining one
    /// ships the sequence into it (`HandOver`). One attempt: on a refusal
    /// the caller replays the request instead.
    async fn dispatch_handover(
        &self,
        job: &Job,
        prompt: &[u32],
        ticket: &Mutex<String>,
        avoid: &Avoid,
        h: Handover,
    ) -> Result<Dispatched, Status> {
        let ticket_id = self.ticket_id(&job.request_id, 0);
        *ticket.lock().unwrap_or_else(|e| e.into_inner()) = ticket_id.clone();
        let policy = self.policy.name();
        let route = tracing::info_span!(span::ROUTE, { attr::ROUTE_POLICY } = policy, { attr::ROUTE_ATTEMPT } = 0);
        route.set_attribute(attr::ROUTE_PREFILL_MODE, "handover");
        route.set_attribute(attr::HANDOVER_KV_TOKENS, i64::from(h.kv_tokens));
        let d = self.pick(&self.decode, &avoid.decode, None, Duration::ZERO).instrument(route.clone()).await;
        let d = d.inspect_err(|e| telemetry::mark_error(&route, e.message()))?;
        drop(route);
        let ch = self.decode.channel_to(&h.from).map_err(Error::Internal)?;
        let from = h.from.clone();
        let call = start_hand_over(job, &ticket_id, ch, h);
        let r = self.attempt(job, prompt, &ticket_id, d, Feed::HandOver(call, from)).await;
        if r.is_err() {
            self.cancel_ticket(&ticket_id, "no decode worker took the handed-over sequence").await;
        }
        r
    }

    /// The ticket id is the request id made unique: callers may reuse
    /// request ids, and the broker remembers ended tickets for a while.
    fn ticket_id(&self, request_id: &str, attempt: u32) -> String {
        let n = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        format!("{request_id}#{:x}.{n}.{attempt}", std::process::id())
    }

    /// The `route` span: a decode worker not yet tried, then where the
    /// prompt is prefilled: by that worker itself, or by a prefill worker
    /// (every decode or prefill worker may be tried again once all were).
    async fn route(
        &self,
        attempt: u32,
        prompt: &[u32],
        tried_d: &mut Vec<String>,
        tried_p: &mut Vec<String>,
        (no_transfer, wait): (bool, Duration),
    ) -> Result<(Picked, Option<Picked>), Status> {
        let policy = self.policy.name();
        let route =
            tracing::info_span!(span::ROUTE, { attr::ROUTE_POLICY } = policy, { attr::ROUTE_ATTEMPT } = attempt);
        let picked = async {
            let local_on = self.max_local_prefill > 0;
            let local = local_on.then_some(prompt);
            // (Waited once already: the second look takes what is there.)
            let d = match self.pick(&self.decode, tried_d, local, wait).await {
                Err(_) if !tried_d.is_empty() => {
                    tried_d.clear();
                    self.pick(&self.decode, tried_d, local, Duration::ZERO).await?
                }
                d => d?,
            };
            if self.prefill_mode(prompt, &d) == Mode::Local || no_transfer {
                self.metrics.count_mode(Mode::Local);
                return Ok((d, None));
            }
            // With local prefill on, no prefill worker means local at once.
            let p_wait = if local_on { Duration::ZERO } else { wait };
            let p = match self.pick(&self.prefill, tried_p, Some(prompt), p_wait).await {
                Ok(p) => p,
                // No prefill worker to be had (or every one failed this
                // request): the decode worker can still prefill the prompt
                // itself, slowly rather than not at all.
                Err(_) if local_on => {
                    self.local_fallback();
                    return Ok((d, None));
                }
                Err(_) if !tried_p.is_empty() => {
                    tried_p.clear();
                    self.pick(&self.prefill, tried_p, Some(prompt), Duration::ZERO).await?
                }
                Err(e) => return Err(e),
            };
            self.metrics.count_mode(Mode::Remote);
            Ok((d, Some(p)))
        }
        .instrument(route.clone())
        .await;
        if let Err(e) = &picked {
            telemetry::mark_error(&route, e.message());
        }
        picked
    }

    /// A live instance of `peers` not in `tried` (waiting up to `wait` for
    /// one when none is live), recorded on the current (`route`) span: for
    /// a prefill (`prompt` given) by the router's policy ([`cache_aware`] or
    /// [`least_busy`]), for a decode least busy.
    async fn pick(
        &self,
        peers: &Peers,
        tried: &[String],
        prompt: Option<&[u32]>,
        wait: Duration,
    ) -> Result<Picked, Status> {
        let kind = peers.service();
        let list = peers.wait_any(wait).await.ok_or_else(|| Error::NoWorker(kind.into()))?;
        let rotation = self.next_id.load(Ordering::Relaxed) as usize;
        let cache_aware_knobs = match (&self.policy, prompt) {
            (crate::config::Policy::CacheAware(k), Some(_)) => Some(*k),
            _ => None,
        };
        let policy = |c: &[Candidate], o: &Overlap| match &cache_aware_knobs {
            Some(k) => cache_aware(c, rotation, o.prompt_blocks, k),
            None => least_busy(c, rotation).map(|i| (i, Branch::LeastBusy)),
        };
        let (i, seen, overlap, branch, busy) = self
            .loads
            .pick(&list, tried, prompt.map(|tokens| Prompt { tokens, remember: kind == "prefill" }), policy)
            .ok_or_else(|| Error::AllRefused(kind.into()))?;
        let inst = list[i].clone();
        record_pick(kind, &inst, seen, list.len());
        if prompt.is_some() {
            self.record_branch(kind, branch, seen, overlap);
        }
        let ch = peers.channel(&inst).map_err(Error::Internal)?;
        Ok(Picked { inst, ch, busy, cached_tokens: seen.overlap_blocks * overlap.block_size })
    }

    /// A prompt over the threshold goes local after all: no prefill worker
    /// was live, or every one failed it (recorded on the `route` span and
    /// in the metrics).
    fn local_fallback(&self) {
        let span = tracing::Span::current();
        span.set_attribute(attr::ROUTE_PREFILL_MODE, Mode::Local.label());
        span.set_attribute(attr::ROUTE_PREFILL_MODE_REASON, "no_prefill_worker");
        self.metrics.count_mode(Mode::Local);
    }

    /// Local or remote prefill for `prompt` on decode worker `d`, recorded
    /// on the current (`route`) span (the caller counts the final choice).
    fn prefill_mode(&self, prompt: &[u32], d: &Picked) -> Mode {
        let (mode, reason, tail) = prefill_mode(self.max_local_prefill, prompt.len() as u32, d.cached_tokens);
        let span = tracing::Span::current();
        span.set_attribute(attr::ROUTE_PREFILL_MODE, mode.label());
        span.set_attribute(attr::ROUTE_PREFILL_MODE_REASON, reason);
        span.set_attribute(attr::ROUTE_LOCAL_TAIL_TOKENS, tail as i64);
        span.set_attribute(attr::ROUTE_MAX_LOCAL_PREFILL, self.max_local_prefill as i64);
        mode
    }

    /// One attempt: start the prefill (unless the decode worker prefills
    /// locally) or the handover, open the decode stream and wait for its
    /// admission. On refusal the prefill call is dropped (aborted).
    async fn attempt(
        &self,
        job: &Job,
        prompt: &[u32],
        ticket_id: &str,
        d: Picked,
        feed: Feed,
    ) -> Result<Dispatched, Status> {
        let continued = matches!(feed, Feed::HandOver(..));
        // The KV's source: its call, and its (id, address, busy count).
        let (prefill, source) = match feed {
            Feed::Local => (None, None),
            Feed::Prefill(p) => {
                let call = start_prefill(job, prompt, ticket_id, p.ch.clone());
                (Some(call), Some((p.inst.id, p.inst.grpc_addr, Some(p.busy))))
            }
            Feed::HandOver(call, from) => (Some(call), Some((from.clone(), from, None))),
        };
        let dreq = dpb::GenerateRequest {
            request_id: ticket_id.to_string(),
            prompt_ids: prompt.to_vec(),
            sampling: Some(job.sampling),
            max_tokens: job.max_tokens,
            stop_ids: vec![],
            ignore_eos: job.ignore_eos,
            local_prefill: source.is_none(),
            replay_ids: job.replay.clone(),
            continued,
        };
        // The decode client span lasts as long as the token stream.
        let (mut dreq, dspan) = telemetry::client_request(rpc::DECODE_GENERATE, dreq);
        set_deadline(&mut dreq, job.deadline);
        let opened = async {
            let mut s = dpb::decode_client::DecodeClient::new(d.ch).generate(dreq).await?.into_inner();
            match s.message().await? {
                Some(dpb::GenerateResponse { event: Some(dpb::generate_response::Event::Admitted(a)) }) => {
                    Ok((s, a.cached_tokens))
                }
                _ => Err(Error::Internal("decode worker did not admit the request".into()).into()),
            }
        }
        .instrument(dspan.clone());
        // A decode worker that stopped does not answer: go elsewhere.
        let opened = tokio::select! {
            r = opened => r,
            s = self.loads.outliers.stopped(&d.inst.grpc_addr, &self.decode) => Err(self.stalled(Kind::Decode, &d.inst.grpc_addr, &d.inst.id, s)),
        };
        match opened {
            Ok((stream, cached_tokens)) => {
                let (p_id, prefill_addr, p_busy) = match source {
                    Some((id, addr, busy)) => (id, Some(addr), busy),
                    None => (d.inst.id.clone(), None, None),
                };
                Ok(Dispatched {
                    stream,
                    prefill,
                    pair: Pair {
                        _busy: (d.busy, p_busy),
                        decode_rpc: telemetry::Held(dspan),
                        workers: [p_id, d.inst.id],
                    },
                    cached_tokens,
                    prefill_addr,
                    decode_addr: d.inst.grpc_addr,
                })
            }
            Err(e) => {
                telemetry::record_status(&dspan, Some(&e));
                Err(e)
            }
        }
    }
}

/// After a worker of `peers`' kind was lost: while every live one is in
/// `tried`, wait (up to `wait`) until one is not, or until a tried
/// address takes connections again (its restarted process listens) —
/// then it is tried again.
async fn wait_back(peers: &Peers, tried: &mut Vec<String>, wait: Duration) {
    let until = tokio::time::Instant::now() + wait;
    loop {
        let live = peers.instances();
        if live.iter().any(|i| !tried.contains(&i.grpc_addr)) {
            return;
        }
        for i in &live {
            let probe = tokio::net::TcpStream::connect(i.grpc_addr.as_str());
            if matches!(tokio::time::timeout(Duration::from_millis(200), probe).await, Ok(Ok(_))) {
                tried.retain(|a| a != &i.grpc_addr);
                return;
            }
        }
        if tokio::time::Instant::now() >= until {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An internal call carries what is left of the request's deadline
/// (`grpc-timeout`), so the worker can refuse work that cannot finish in
/// time and stops when the time is up.
pub fn set_deadline<T>(req: &mut tonic::Request<T>, deadline: Option<std::time::Instant>) {
    if let Some(d) = deadline {
        req.set_timeout(
            d.saturating_duration_since(std::time::Instant::now()).max(std::time::Duration::from_millis(1)),
        );
    }
}

/// Where the KV of an attempt's sequence comes from.
enum Feed {
    /// The decode worker prefills the prompt itself.
    Local,
    /// A prefill worker computes the prompt and ships it.
    Prefill(Picked),
    /// A draining decode worker (at this address) ships the sequence it
    /// parked: the call doing it.
    HandOver(PrefillCall, String),
}

/// The HandOver call at a draining decode worker, on its own task with its
/// client span, answering as a Prefill call would; the parked sequence's
/// stream stays open until it ends (dropped, the worker frees it).
fn start_hand_over(job: &Job, ticket_id: &str, ch: Channel, h: Handover) -> PrefillCall {
    let req = dpb::HandOverRequest { sequence: h.sequence, request_id: ticket_id.to_string() };
    let (mut req, span) = telemetry::client_request(rpc::DECODE_HAND_OVER, req);
    set_deadline(&mut req, job.deadline);
    let held = h.stream;
    AbortOnDrop(tokio::spawn(
        async move {
            let r = dpb::decode_client::DecodeClient::new(ch).hand_over(req).await;
            drop(held);
            let r = r.map(|r| {
                r.map(|h| ppb::PrefillResponse { kv_bytes: h.kv_bytes, transport: h.transport, ..Default::default() })
            });
            telemetry::finish(&tracing::Span::current(), r)
        }
        .instrument(span),
    ))
}

/// The Prefill call, running on its own task with its client span.
fn start_prefill(job: &Job, prompt: &[u32], ticket_id: &str, ch: Channel) -> PrefillCall {
    let preq = ppb::PrefillRequest {
        request_id: ticket_id.to_string(),
        prompt_ids: prompt.to_vec(),
        sampling: Some(job.sampling),
    };
    let (mut preq, pspan) = telemetry::client_request(rpc::PREFILL_PREFILL, preq);
    set_deadline(&mut preq, job.deadline);
    AbortOnDrop(tokio::spawn(
        async move {
            let r = ppb::prefill_client::PrefillClient::new(ch).prefill(preq).await;
            telemetry::finish(&tracing::Span::current(), r)
        }
        .instrument(pspan),
    ))
}

impl Router {
    /// The policy branch and the prefix overlap behind a pick, on the
    /// current span and in the router's metrics.
    fn record_branch(&self, kind: &str, branch: Branch, seen: Candidate, o: Overlap) {
        let span = tracing::Span::current();
        span.set_attribute(pick_key(kind, attr::PICK_BRANCH), branch.label());
        span.set_attribute(pick_key(kind, attr::PICK_OVERLAP_BLOCKS), seen.overlap_blocks as i64);
        span.set_attribute(pick_key(kind, attr::PICK_PROMPT_BLOCKS), o.prompt_blocks as i64);
        span.set_attribute(pick_key(kind, attr::PICK_QUEUED_TOKENS_POLLED), seen.polled.queued_tokens as i64);
        if kind != "prefill" {
            return;
        }
        self.metrics.routes.inc(branch);
        let overlap_tokens = u64::from(seen.overlap_blocks) * u64::from(o.block_size);
        self.metrics.route_overlap_tokens.fetch_add(overlap_tokens, Ordering::Relaxed);
    }
}

/// The chosen worker and the load the policy saw, on the current span.
fn record_pick(kind: &str, inst: &Instance, seen: Candidate, candidates: usize) {
    let span = tracing::Span::current();
    span.set_attribute(pick_key(kind, attr::PICK_INSTANCE), inst.id.clone());
    span.set_attribute(pick_key(kind, attr::PICK_ADDRESS), inst.grpc_addr.clone());
    span.set_attribute(pick_key(kind, attr::PICK_IN_FLIGHT_HERE), seen.in_flight_here as i64);
    span.set_attribute(pick_key(kind, attr::PICK_BUSY_POLLED), seen.polled.busy as i64);
    span.set_attribute(pick_key(kind, attr::PICK_KV_FREE_POLLED), seen.polled.kv_free as i64);
    span.set_attribute(pick_key(kind, attr::PICK_CANDIDATES), candidates as i64);
}
