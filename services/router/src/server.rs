//! The router's Generate: validate, tokenize, pick a prefill and a decode
//! worker, dispatch to both at once, stream detokenized deltas, finish with
//! usage — or end with one clear status, cancelling the KV transfer so both
//! workers free their blocks.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_core::discovery::Instance;
use pdmesh_core::metrics::{outcome_of, Histogram, Outcomes};
use pdmesh_core::peers::Peers;
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::prefill::v1 as ppb;
use pdmesh_proto::router::v1 as pb;
use pdmesh_proto::tokenizer::v1 as tpb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use pdmesh_core::telemetry::{self, SpanExt};

use crate::stop::StopMatcher;
use pdmesh_core::vocab::{attr, pick_key, rpc, span};

/// How long to wait for a worker of some kind to appear.
const PEER_WAIT: Duration = Duration::from_secs(2);

#[derive(Default)]
pub struct Metrics {
    pub in_flight: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub outcomes: Outcomes,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
}

pub struct Router {
    pub tokenizer: Peers,
    pub prefill: Peers,
    pub decode: Peers,
    pub broker: Peers,
    pub timeout: Duration,
    pub retries: u32,
    pub max_stop: usize,
    pub metrics: Arc<Metrics>,
    /// Requests in flight from this router, per worker address.
    pub load: Arc<Mutex<HashMap<String, u32>>>,
    /// Each worker's own load as last polled (all routers' requests).
    pub polled: Arc<Mutex<HashMap<String, Polled>>>,
    pub info: tokio::sync::OnceCell<tpb::InfoResponse>,
    pub next_id: AtomicU64,
    pub next_ticket: AtomicU64,
}

/// A worker's load from its Load RPC.
#[derive(Clone, Copy, Debug, Default)]
pub struct Polled {
    /// Running plus queued (plus, for decode, waiting for KV).
    pub busy: u32,
    pub kv_free: u32,
}

/// Poll every prefill and decode worker's Load every `every`, forever.
pub async fn poll_loads(r: Arc<Router>, every: Duration) {
    loop {
        let mut fresh = HashMap::new();
        for inst in r.decode.instances() {
            if let Ok(ch) = r.decode.channel(&inst) {
                let mut req = Request::new(dpb::LoadRequest {});
                req.set_timeout(Duration::from_secs(1));
                if let Ok(l) = dpb::decode_client::DecodeClient::new(ch).load(req).await {
                    let l = l.into_inner();
                    fresh.insert(
                        inst.grpc_addr.clone(),
                        Polled {
                            busy: l.running + l.queued,
                            kv_free: l.kv_blocks_total.saturating_sub(l.kv_blocks_used),
                        },
                    );
                }
            }
        }
        for inst in r.prefill.instances() {
            if let Ok(ch) = r.prefill.channel(&inst) {
                let mut req = Request::new(ppb::LoadRequest {});
                req.set_timeout(Duration::from_secs(1));
                if let Ok(l) = ppb::prefill_client::PrefillClient::new(ch).load(req).await {
                    let l = l.into_inner();
                    fresh.insert(
                        inst.grpc_addr.clone(),
                        Polled {
                            busy: l.running + l.queued,
                            kv_free: l.kv_blocks_total.saturating_sub(l.kv_blocks_used),
                        },
                    );
                }
            }
        }
        *r.polled.lock().unwrap_or_else(|e| e.into_inner()) = fresh;
        tokio::time::sleep(every).await;
    }
}

/// Counts a request against a worker while alive.
struct Busy {
    load: Arc<Mutex<HashMap<String, u32>>>,
    addr: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(n) = self.load.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&self.addr) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Aborts a spawned task when dropped.
pub struct AbortOnDrop<T>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

type DeltaStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;
type Tx = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

fn delta(ids: Vec<u32>, text: String) -> pb::GenerateResponse {
    pb::GenerateResponse { event: Some(pb::generate_response::Event::Delta(pb::Delta { ids, text })) }
}

/// Validated request, ready to run.
struct Job {
    request_id: String,
    input: pb::generate_request::Input,
    sampling: common::SamplingParams,
    max_tokens: u32,
    stop: Vec<String>,
    ignore_eos: bool,
}

impl Router {
    fn validate(&self, r: pb::GenerateRequest) -> Result<Job, Status> {
        let input = r.input.ok_or_else(|| Status::invalid_argument("set prompt or chat"))?;
        match &input {
            pb::generate_request::Input::Prompt(p) if p.is_empty() => {
                return Err(Status::invalid_argument("prompt is empty"))
            }
            pb::generate_request::Input::Chat(c) if c.messages.is_empty() => {
                return Err(Status::invalid_argument("messages is empty"))
            }
            _ => {}
        }
        if r.max_tokens == 0 {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        let s = r.sampling.unwrap_or_default();
        if !(0.0..=2.0).contains(&s.temperature) {
            return Err(Status::invalid_argument(format!("temperature must be in [0, 2], got {}", s.temperature)));
        }
        if !(0.0..=1.0).contains(&s.top_p) {
            return Err(Status::invalid_argument(format!("top_p must be in (0, 1], got {}", s.top_p)));
        }
        if r.stop.len() > self.max_stop || r.stop.iter().any(|s| s.is_empty()) {
            return Err(Status::invalid_argument(format!("stop takes at most {} non-empty strings", self.max_stop)));
        }
        let request_id = if r.request_id.is_empty() {
            format!("req-{:x}-{}", std::process::id(), self.next_id.fetch_add(1, Ordering::Relaxed))
        } else if r.request_id.len() > 128 || !r.request_id.chars().all(|c| c.is_ascii_graphic()) {
            return Err(Status::invalid_argument("request_id must be at most 128 printable ASCII characters"));
        } else {
            r.request_id
        };
        Ok(Job { request_id, input, sampling: s, max_tokens: r.max_tokens, stop: r.stop, ignore_eos: r.ignore_eos })
    }

    fn tokenizer_client(&self) -> Result<tpb::tokenizer_client::TokenizerClient<Channel>, Status> {
        let list = self.tokenizer.instances();
        let inst = list.first().ok_or_else(|| Status::unavailable("no live tokenizer"))?;
        Ok(tpb::tokenizer_client::TokenizerClient::new(self.tokenizer.channel(inst).map_err(Status::internal)?))
    }

    async fn model_info(&self) -> Result<&tpb::InfoResponse, Status> {
        self.info
            .get_or_try_init(|| async {
                let _ = self.tokenizer.wait_any(PEER_WAIT).await;
                let mut c = self.tokenizer_client()?;
                let (req, span) = telemetry::client_request(rpc::TOKENIZER_INFO, tpb::InfoRequest {});
                let r = c.info(req).instrument(span.clone()).await;
                Ok::<_, Status>(telemetry::finish(&span, r)?.into_inner())
            })
            .await
    }

    async fn encode(&self, input: pb::generate_request::Input) -> Result<Vec<u32>, Status> {
        let _ = self.tokenizer.wait_any(PEER_WAIT).await;
        let mut c = self.tokenizer_client()?;
        let input = match input {
            pb::generate_request::Input::Prompt(p) => tpb::encode_request::Input::Prompt(p),
            pb::generate_request::Input::Chat(c) => tpb::encode_request::Input::Chat(tpb::ChatMessages {
                messages: c
                    .messages
                    .into_iter()
                    .map(|m| tpb::ChatMessage { role: m.role, content: m.content })
                    .collect(),
            }),
        };
        let (req, span) = telemetry::client_request(
            rpc::TOKENIZER_ENCODE,
            tpb::EncodeRequest { input: Some(input), parse_special: false },
        );
        let r = c.encode(req).instrument(span.clone()).await;
        let r = telemetry::finish(&span, r).map_err(|e| match e.code() {
            tonic::Code::InvalidArgument => e,
            _ => Status::unavailable(format!("tokenizer: {}", e.message())),
        })?;
        Ok(r.into_inner().ids)
    }

    /// The least busy live instance of `peers` not in `tried`: busy is the
    /// larger of this router's in-flight count and the worker's own polled
    /// running + queued (which includes other routers' requests); ties go to
    /// the one with more free KV blocks, then rotate.
    async fn pick(&self, peers: &Peers, tried: &[String]) -> Result<(Instance, Channel, Busy), Status> {
        let span = tracing::Span::current();
        let list = peers
            .wait_any(PEER_WAIT)
            .await
            .ok_or_else(|| Status::unavailable(format!("no live {} worker", peers.service())))?;
        let polled = self.polled.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut load = self.load.lock().unwrap_or_else(|e| e.into_inner());
        let rot = self.next_id.load(Ordering::Relaxed) as usize;
        let n = list.len();
        let best = (0..n)
            .map(|i| &list[(i + rot) % n])
            .filter(|inst| !tried.contains(&inst.grpc_addr))
            .min_by_key(|inst| {
                let local = load.get(&inst.grpc_addr).copied().unwrap_or(0);
                let p = polled.get(&inst.grpc_addr).copied().unwrap_or_default();
                (local.max(p.busy), std::cmp::Reverse(p.kv_free))
            })
            .cloned()
            .ok_or_else(|| Status::unavailable(format!("every {} worker refused or failed", peers.service())))?;
        let local = load.entry(best.grpc_addr.clone()).or_default();
        let p = polled.get(&best.grpc_addr).copied().unwrap_or_default();
        let kind = peers.service();
        span.set_attribute(pick_key(kind, attr::PICK_INSTANCE), best.id.clone());
        span.set_attribute(pick_key(kind, attr::PICK_ADDRESS), best.grpc_addr.clone());
        span.set_attribute(pick_key(kind, attr::PICK_IN_FLIGHT_HERE), *local as i64);
        span.set_attribute(pick_key(kind, attr::PICK_BUSY_POLLED), p.busy as i64);
        span.set_attribute(pick_key(kind, attr::PICK_KV_FREE_POLLED), p.kv_free as i64);
        span.set_attribute(pick_key(kind, attr::PICK_CANDIDATES), n as i64);
        *local += 1;
        drop(load);
        let ch = peers.channel(&best).map_err(Status::internal)?;
        let busy = Busy { load: self.load.clone(), addr: best.grpc_addr.clone() };
        Ok((best, ch, busy))
    }

    async fn cancel_ticket(&self, request_id: &str, reason: &str) {
        if let Some(inst) = self.broker.instances().first() {
            if let Ok(ch) = self.broker.channel(inst) {
                let mut c = kpb::kv_broker_client::KvBrokerClient::new(ch);
                let mut req =
                    Request::new(kpb::CancelTicketRequest { request_id: request_id.into(), reason: reason.into() });
                req.set_timeout(Duration::from_secs(2));
                let _ = c.cancel_ticket(req).await;
            }
        }
    }

    /// Run one validated request, sending events to `tx`. Returns the
    /// ticket id in use when it fails (so the caller cancels it).
    async fn run(&self, job: Job, tx: &Tx, ticket: &Mutex<String>) -> Result<(), Status> {
        let started = Instant::now();
        let tokenize = tracing::info_span!(span::TOKENIZE, { attr::PROMPT_TOKENS } = tracing::field::Empty);
        let prompt = async {
            let info = self.model_info().await?.clone();
            let prompt = self.encode(job.input).await?;
            tracing::Span::current().record(attr::PROMPT_TOKENS, prompt.len() as i64);
            Ok::<_, Status>((info, prompt))
        }
        .instrument(tokenize.clone())
        .await;
        drop(tokenize);
        let (info, prompt) = prompt?;
        if prompt.is_empty() {
            return Err(Status::invalid_argument("the prompt encodes to no tokens"));
        }
        let needed = prompt.len() as u64 + job.max_tokens as u64 - 1;
        if needed > info.context_length as u64 {
            return Err(Status::invalid_argument(format!(
                "prompt has {} tokens; with max_tokens {} it needs {needed} positions but the context holds {}",
                prompt.len(),
                job.max_tokens,
                info.context_length
            )));
        }
        let n_prompt = prompt.len() as u32;
        let mut tried_d: Vec<String> = Vec::new();
        let mut tried_p: Vec<String> = Vec::new();
        let mut attempt = 0u32;
        let (mut dstream, prefill_task, pair) = loop {
            // The ticket id is the request id made unique: callers may reuse
            // request ids, and the broker remembers ended tickets for a while.
            let ticket_id = format!(
                "{}#{:x}.{}.{attempt}",
                job.request_id,
                std::process::id(),
                self.next_ticket.fetch_add(1, Ordering::Relaxed)
            );
            *ticket.lock().unwrap_or_else(|e| e.into_inner()) = ticket_id.clone();
            let route = tracing::info_span!(span::ROUTE, { attr::ROUTE_POLICY } = "least_busy", { attr::ROUTE_ATTEMPT } = attempt);
            let picked = async {
                let (d, dch, dbusy) = self.pick(&self.decode, &tried_d).await?;
                let (p, pch, pbusy) = match self.pick(&self.prefill, &tried_p).await {
                    Ok(x) => x,
                    Err(e) if !tried_p.is_empty() => {
                        // Every prefill was tried once: allow them again.
                        tried_p.clear();
                        let _ = e;
                        self.pick(&self.prefill, &tried_p).await?
                    }
                    Err(e) => return Err(e),
                };
                Ok::<_, Status>((d, dch, dbusy, p, pch, pbusy))
            }
            .instrument(route.clone())
            .await;
            if let Err(e) = &picked {
                telemetry::mark_error(&route, e.message());
            }
            drop(route);
            let (d, dch, dbusy, p, pch, pbusy) = picked?;
            let preq = ppb::PrefillRequest {
                request_id: ticket_id.clone(),
                prompt_ids: prompt.clone(),
                sampling: Some(job.sampling),
            };
            let (preq, pspan) = telemetry::client_request(rpc::PREFILL_PREFILL, preq);
            let prefill_task = AbortOnDrop(tokio::spawn(
                async move {
                    let r = ppb::prefill_client::PrefillClient::new(pch).prefill(preq).await;
                    telemetry::finish(&tracing::Span::current(), r)
                }
                .instrument(pspan),
            ));
            let dreq = dpb::GenerateRequest {
                request_id: ticket_id.clone(),
                prompt_ids: prompt.clone(),
                sampling: Some(job.sampling),
                max_tokens: job.max_tokens,
                stop_ids: vec![],
                ignore_eos: job.ignore_eos,
            };
            // The decode client span lasts as long as the token stream.
            let (dreq, dspan) = telemetry::client_request(rpc::DECODE_GENERATE, dreq);
            let opened = async {
                let mut s = dpb::decode_client::DecodeClient::new(dch).generate(dreq).await?.into_inner();
                match s.message().await? {
                    Some(dpb::GenerateResponse { event: Some(dpb::generate_response::Event::Admitted(_)) }) => Ok(s),
                    _ => Err(Status::internal("decode worker did not admit the request")),
                }
            }
            .instrument(dspan.clone())
            .await;
            match opened {
                Ok(s) => {
                    break (
                        s,
                        prefill_task,
                        Pair {
                            _busy: (dbusy, pbusy),
                            decode_rpc: telemetry::Held(dspan),
                            workers: [p.id.clone(), d.id.clone()],
                        },
                    )
                }
                Err(e) => {
                    telemetry::record_status(&dspan, Some(&e));
                    drop(prefill_task);
                    self.cancel_ticket(&ticket_id, "decode refused the request").await;
                    let retryable = matches!(e.code(), tonic::Code::ResourceExhausted | tonic::Code::Unavailable);
                    let other = self
                        .decode
                        .instances()
                        .iter()
                        .any(|i| i.grpc_addr != d.grpc_addr && !tried_d.contains(&i.grpc_addr));
                    if !retryable || !other || attempt >= self.retries {
                        return Err(match e.code() {
                            tonic::Code::Unavailable => {
                                Status::unavailable(format!("decode worker {}: {}", d.id, e.message()))
                            }
                            _ => e,
                        });
                    }
                    tried_d.push(d.grpc_addr.clone());
                    tried_p.push(p.grpc_addr.clone());
                    attempt += 1;
                }
            }
        };
        // Stream: decode tokens -> detokenize -> stop strings -> client.
        let mut prefill_task = Some(prefill_task);
        let mut detok: Option<Detok> = None;
        let mut stops = StopMatcher::new(job.stop);
        let mut n_out = 0u32;
        let mut last_token: Option<Instant> = None;
        loop {
            let msg = tokio::select! {
                m = dstream.message() => m,
                p = async { (&mut prefill_task.as_mut().expect("guarded").0).await }, if prefill_task.is_some() => {
                    prefill_task = None;
                    match p {
                        Ok(Ok(_)) => continue,
                        Ok(Err(e)) => return Err(prefill_failure(e)),
                        Err(_) => return Err(Status::internal("prefill task failed")),
                    }
                }
            };
            let ev = match msg {
                Ok(Some(m)) => m.event,
                Ok(None) => {
                    telemetry::mark_error(pair.decode_rpc.span(), "stream ended without finishing");
                    return Err(Status::unavailable("decode worker ended the stream without finishing"));
                }
                Err(e) => {
                    telemetry::record_status(pair.decode_rpc.span(), Some(&e));
                    return Err(decode_failure(e));
                }
            };
            match ev {
                Some(dpb::generate_response::Event::Tokens(t)) => {
                    let now = Instant::now();
                    match last_token {
                        None => {
                            self.metrics.ttft.observe((now - started).as_secs_f64());
                            tracing::Span::current().set_attribute(attr::TTFT_MS, (now - started).as_secs_f64() * 1e3);
                        }
                        Some(prev) => self.metrics.itl.observe((now - prev).as_secs_f64() / t.ids.len().max(1) as f64),
                    }
                    last_token = Some(now);
                    n_out += t.ids.len() as u32;
                    let text = self.detokenize(&mut detok, t.ids.clone()).await?;
                    let step = stops.push(&text);
                    if tx.send(Ok(delta(t.ids, step.emit))).await.is_err() {
                        return Err(Status::cancelled("client went away"));
                    }
                    if step.stopped {
                        return self.finish(tx, common::FinishReason::Stop, n_prompt, n_out, &pair.workers).await;
                    }
                }
                Some(dpb::generate_response::Event::Finished(f)) => {
                    telemetry::record_status(pair.decode_rpc.span(), None);
                    let mut rest = String::new();
                    if let Some(mut d) = detok.take() {
                        drop(d.tx);
                        let t = Instant::now();
                        while let Ok(Some(m)) = d.rx.message().instrument(d.rpc.span().clone()).await {
                            rest.push_str(&m.text);
                        }
                        d.busy += t.elapsed();
                        d.span.span().set_attribute(attr::DETOKENIZE_BUSY_MS, d.busy.as_secs_f64() * 1e3);
                        d.span.span().set_attribute(attr::DETOKENIZE_CALLS, d.calls as i64);
                    }
                    let step = stops.push(&rest);
                    let mut tail = step.emit;
                    if !step.stopped {
                        tail.push_str(&stops.finish());
                    }
                    if !tail.is_empty() {
                        let _ = tx.send(Ok(delta(vec![], tail))).await;
                    }
                    let reason = if step.stopped {
                        common::FinishReason::Stop
                    } else {
                        common::FinishReason::try_from(f.reason).unwrap_or(common::FinishReason::Stop)
                    };
                    let _ = f.usage;
                    return self.finish(tx, reason, n_prompt, n_out, &pair.workers).await;
                }
                Some(dpb::generate_response::Event::Admitted(_)) | None => {}
            }
        }
    }

    async fn detokenize(&self, detok: &mut Option<Detok>, ids: Vec<u32>) -> Result<String, Status> {
        if detok.is_none() {
            let span = tracing::info_span!(span::DETOKENIZE);
            let (s, r) = mpsc::channel(16);
            let mut c = self.tokenizer_client()?;
            let (req, rpc) = {
                let _g = span.enter();
                telemetry::client_request(rpc::TOKENIZER_DETOKENIZE, tokio_stream::wrappers::ReceiverStream::new(r))
            };
            let resp = c.detokenize(req).instrument(rpc.clone()).await;
            let resp = telemetry::finish(&rpc, resp)
                .map_err(|e| Status::unavailable(format!("tokenizer: {}", e.message())))?;
            *detok = Some(Detok {
                tx: s,
                rx: resp.into_inner(),
                span: telemetry::Held(span),
                rpc: telemetry::Held(rpc),
                busy: Duration::ZERO,
                calls: 0,
            });
        }
        let d = detok.as_mut().expect("just set");
        let t = Instant::now();
        d.calls += 1;
        d.tx.send(tpb::DetokenizeRequest { ids, render_special: false })
            .await
            .map_err(|_| Status::unavailable("tokenizer stream closed"))?;
        let r = match d.rx.message().await {
            Ok(Some(m)) => Ok(m.text),
            Ok(None) => Err(Status::unavailable("tokenizer ended the detokenize stream")),
            Err(e) => Err(Status::unavailable(format!("tokenizer: {}", e.message()))),
        };
        d.busy += t.elapsed();
        r
    }

    async fn finish(
        &self,
        tx: &Tx,
        reason: common::FinishReason,
        prompt: u32,
        completion: u32,
        workers: &[String; 2],
    ) -> Result<(), Status> {
        self.metrics.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.metrics.completion_tokens.fetch_add(completion as u64, Ordering::Relaxed);
        let fin = pb::Finished {
            reason: reason as i32,
            usage: Some(common::Usage { prompt_tokens: prompt, completion_tokens: completion }),
            prefill_worker: workers[0].clone(),
            decode_worker: workers[1].clone(),
        };
        tx.send(Ok(pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(fin)) }))
            .await
            .map_err(|_| Status::cancelled("client went away"))
    }
}

fn prefill_failure(e: Status) -> Status {
    match e.code() {
        tonic::Code::InvalidArgument => e,
        tonic::Code::DeadlineExceeded => Status::deadline_exceeded(format!("prefill: {}", e.message())),
        _ => Status::unavailable(format!("prefill worker failed: {}", e.message())),
    }
}

fn decode_failure(e: Status) -> Status {
    match e.code() {
        tonic::Code::InvalidArgument
        | tonic::Code::ResourceExhausted
        | tonic::Code::DeadlineExceeded
        | tonic::Code::Cancelled => e,
        _ => Status::unavailable(format!("decode worker failed: {}", e.message())),
    }
}

/// The prefill and decode worker serving a request: counted as busy, the
/// decode stream's client span, and their instance ids, while it runs.
struct Pair {
    _busy: (Busy, Busy),
    decode_rpc: telemetry::Held,
    /// [prefill, decode]
    workers: [String; 2],
}

/// The open Detokenize stream of one request, with its spans: `detokenize`
/// lasts from the first token to the end of the stream.
struct Detok {
    tx: mpsc::Sender<tpb::DetokenizeRequest>,
    rx: tonic::Streaming<tpb::DetokenizeResponse>,
    span: telemetry::Held,
    rpc: telemetry::Held,
    busy: Duration,
    calls: u32,
}

pub struct Service(pub Arc<Router>);

#[tonic::async_trait]
impl pb::router_server::Router for Service {
    type GenerateStream = DeltaStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<DeltaStream>, Status> {
        let router = self.0.clone();
        let span = telemetry::server_span(rpc::ROUTER_GENERATE, &req);
        let deadline =
            pdmesh_core::grpc::request_timeout(&req).map(|t| t.min(router.timeout)).unwrap_or(router.timeout);
        let job = match router.validate(req.into_inner()) {
            Ok(j) => j,
            Err(e) => {
                router.metrics.outcomes.inc(outcome_of(e.code()));
                telemetry::record_status(&span, Some(&e));
                return Err(e);
            }
        };
        span.set_attribute(attr::REQUEST_ID, job.request_id.clone());
        span.set_attribute(attr::MAX_TOKENS, job.max_tokens as i64);
        let trace_id = telemetry::trace_id(&span);
        let (tx, rx) = mpsc::channel(64);
        router.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let t0 = Instant::now();
            let ticket = Mutex::new(String::new());
            let r = tokio::select! {
                r = tokio::time::timeout(deadline, router.run(job, &tx, &ticket)) => {
                    r.unwrap_or_else(|_| Err(Status::deadline_exceeded(format!("request did not finish within its deadline of {:.1} s", deadline.as_secs_f64()))))
                }
                _ = tx.closed() => Err(Status::cancelled("client went away")),
            };
            let code = r.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(|e| e.code());
            if let Err(e) = r {
                let id = ticket.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if !id.is_empty() {
                    router.cancel_ticket(&id, e.message()).await;
                }
                let _ = tx.send(Err(e)).await;
            }
            router.metrics.e2e.observe(t0.elapsed().as_secs_f64());
            router.metrics.outcomes.inc(outcome_of(code));
            router.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
            let span = tracing::Span::current();
            span.record(attr::RPC_STATUS_CODE, code as i64);
            if code != tonic::Code::Ok {
                telemetry::mark_error(&span, &format!("{code:?}"));
            }
        }.instrument(span));
        let mut resp = Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)) as DeltaStream);
        if let Some(id) = trace_id.and_then(|t| t.parse().ok()) {
            resp.metadata_mut().insert("x-pdmesh-trace-id", id);
        }
        Ok(resp)
    }
}
