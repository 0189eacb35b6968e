//! pdmesh gateway: the OpenAI-compatible HTTP API (`/v1/chat/completions`,
//! `/v1/completions`, streaming via SSE or not, `/v1/models`) in front of
//! the router's gRPC `Generate`. Errors use OpenAI's body shape with the
//! status a client expects: 400 bad input, 404 unknown model, 429 no KV
//! room, 503 no healthy worker, 504 deadline. A client that disconnects
//! cancels its request all the way down to the decode worker.

pub mod auth;
pub mod config;
mod error;
pub mod front;
pub mod openai;
mod upstream;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pdmesh_core::admin::AdminState;
use pdmesh_core::metrics::{Format, Histogram, Outcome, Outcomes, Text};
use pdmesh_core::peers::Peers;
use pdmesh_core::serve::{Admin, ServeError};
use pdmesh_core::vocab::metric;
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tracing::Instrument;

use pdmesh_core::telemetry::{self, SpanExt};

use crate::config::Config;
use crate::error::{bad_request, error_body, from_router, http_of, refused_response, status_response, unavailable};
use crate::openai::Kind;
use crate::upstream::Upstream;
use pdmesh_core::vocab::{attr, span};

pub struct Gateway {
    config: Config,
    /// Each served model's name and its routers, in `/v1/models` order.
    routers: Vec<(String, Peers)>,
    in_flight: AtomicU64,
    next_id: AtomicU64,
    outcomes: Outcomes,
    e2e: Histogram,
    /// API keys, with `--api-keys-file`.
    keys: Option<Arc<auth::Keys>>,
    conns: Arc<front::ConnStats>,
    /// Requests moved to another router after tokens reached their client.
    router_failovers: AtomicU64,
    /// Each router's liveness, polled (see [`pdmesh_core::outlier`]).
    watch: Arc<pdmesh_core::outlier::Watch>,
}

fn render(g: &Gateway, f: Format) -> String {
    let mut t = Text::new(f);
    t.gauge(metric::gateway::IN_FLIGHT, "HTTP requests being served.", g.in_flight.load(Ordering::Relaxed) as f64)
        .histogram(
            metric::gateway::REQUEST_SECONDS,
            "Time from request arrival to the last byte handed to the client.",
            &g.e2e,
        );
    g.outcomes.render(&mut t, metric::gateway::REQUESTS_TOTAL, "Finished API requests by outcome.");
    t.counter(
        metric::gateway::ROUTER_FAILOVERS_TOTAL,
        "Requests sent to another router, with the tokens streamed so far, after theirs was lost mid-stream.",
        g.router_failovers.load(Ordering::Relaxed),
    );
    t.gauge(metric::gateway::CONNECTIONS, "Client connections open.", g.conns.open.load(Ordering::Relaxed) as f64);
    t.counter(
        metric::gateway::CONNECTIONS_REFUSED_TOTAL,
        "Client connections answered 503 and closed because --max-connections were open.",
        g.conns.refused.load(Ordering::Relaxed),
    );
    if let Some(k) = &g.keys {
        t.gauge(metric::gateway::API_KEYS, "API keys in force.", k.count() as f64);
        let refused = k.refused_counts();
        let v: Vec<(&str, f64)> = refused.iter().map(|(l, n)| (l.as_str(), *n as f64)).collect();
        t.labelled(
            metric::gateway::AUTH_REFUSED_TOTAL,
            "counter",
            "Requests refused at the front door, by reason: missing_key, invalid_key (401), rate, concurrency (429).",
            "reason",
            &v,
        );
        t.counter(
            metric::gateway::API_KEYS_RELOAD_ERRORS_TOTAL,
            "Versions of the API keys file that did not parse (the last good keys stayed in force).",
            k.reload_errors.load(Ordering::Relaxed),
        );
    }
    t.finish()
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn finish_reason(f: &pb::Finished) -> &'static str {
    match common::FinishReason::try_from(f.reason).unwrap_or(common::FinishReason::Stop) {
        common::FinishReason::Length => "length",
        _ => "stop",
    }
}

fn usage_json(f: &pb::Finished) -> Value {
    let u = f.usage.unwrap_or_default();
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        // OpenAI's field for prompt tokens served from a prompt cache.
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Counts the request and its time when dropped (also when the client
/// disconnects and the response is abandoned); its span ends then too.
struct Tracked {
    g: Arc<Gateway>,
    outcome: Outcome,
    /// The request's trace, for the latency histogram's exemplar.
    trace_id: Option<String>,
    t0: std::time::Instant,
    span: tracing::Span,
    /// How long data waited for the client to take it.
    wait: ClientWait,
    /// The API key's hold on one of its requests in flight.
    key: Option<auth::Admitted>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.g.outcomes.inc(self.outcome);
        self.g.e2e.observe_traced(self.t0.elapsed().as_secs_f64(), self.trace_id.as_deref());
        self.g.in_flight.fetch_sub(1, Ordering::Relaxed);
        let end = std::time::Instant::now();
        self.span.record(attr::CLIENT_WAIT_MS, self.wait.total.as_secs_f64() * 1e3);
        self.span.record(attr::CLIENT_TAIL_MS, self.wait.tail(end).as_secs_f64() * 1e3);
        self.span.record(attr::CHUNKS, self.wait.chunks as i64);
        // Its end is the last byte handed to the client (see telemetry::Held).
        let _last = self.span.enter();
    }
}

/// Time response data spent ready but not yet taken by the client (its
/// reads, or a proxy in between, were the bottleneck). `tail` is the last
/// unbroken stretch of such waiting up to the end of the response: the part
/// of the request's latency the client alone accounts for.
#[derive(Default)]
struct ClientWait {
    total: Duration,
    chunks: u64,
    prev_taken: Option<std::time::Instant>,
    backlog_since: Option<std::time::Instant>,
}

impl ClientWait {
    /// Waiting shorter than this is scheduling noise, not a slow client.
    const NOISE: Duration = Duration::from_millis(2);

    /// A chunk ready at `ready` was handed to the client at `taken`.
    fn taken(&mut self, ready: std::time::Instant, taken: std::time::Instant) {
        self.chunks += 1;
        let from = self.prev_taken.map_or(ready, |p| ready.max(p));
        if taken.saturating_duration_since(ready) > Self::NOISE {
            self.total += taken.saturating_duration_since(from);
            let contiguous = self.prev_taken.is_some_and(|p| ready <= p);
            if !(contiguous && self.backlog_since.is_some()) {
                self.backlog_since = Some(ready);
            }
        } else {
            self.backlog_since = None;
        }
        self.prev_taken = Some(taken);
    }

    fn tail(&self, end: std::time::Instant) -> Duration {
        self.backlog_since.map_or(Duration::ZERO, |b| end.saturating_duration_since(b))
    }
}

/// The request body, or the error response for a body that could not be
/// read (larger than `--max-body-bytes`: 413).
type ReqBody = Result<Bytes, Response>;

async fn completions(State(g): State<Arc<Gateway>>, req: axum::extract::Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = read_body(&parts.headers, body, &g.config).await;
    handle(g, parts.headers, body, Kind::Completion).await
}

async fn chat(State(g): State<Arc<Gateway>>, req: axum::extract::Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = read_body(&parts.headers, body, &g.config).await;
    handle(g, parts.headers, body, Kind::Chat).await
}

/// Read at most `--max-body-bytes` of body within `--body-timeout-s`. A
/// body declared larger is refused before any of it is read; one that
/// does not arrive in time gets 408.
async fn read_body(headers: &HeaderMap, body: Body, config: &Config) -> ReqBody {
    use http_body_util::BodyExt;
    let limit = config.max_body_bytes;
    let too_large = || {
        let msg = format!("request body is larger than the limit of {limit} bytes");
        error_body(413, &msg, "invalid_request_error", None, Some("request_too_large"))
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let within = config.front.body_timeout();
    let Ok(read) = tokio::time::timeout(within, http_body_util::Limited::new(body, limit).collect()).await else {
        let msg = format!("request body not received within {} s", within.as_secs_f64());
        return Err(error_body(408, &msg, "invalid_request_error", None, Some("request_timeout")));
    };
    match read {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => {
            Err(error_body(400, &format!("request body could not be read: {e}"), "invalid_request_error", None, None))
        }
    }
}

async fn handle(g: Arc<Gateway>, headers: HeaderMap, body: ReqBody, kind: Kind) -> Response {
    g.in_flight.fetch_add(1, Ordering::Relaxed);
    let path = match kind {
        Kind::Chat => "/v1/chat/completions",
        Kind::Completion => "/v1/completions",
    };
    // The request's root span (or a child of the caller's `traceparent`);
    // it ends when the last byte is handed to the client.
    let span = tracing::info_span!(
        span::HTTP_SERVER,
        otel.name = format!("POST {path}"),
        otel.kind = "server",
        http.request.method = "POST",
        url.path = path,
        { attr::HTTP_STATUS_CODE } = tracing::field::Empty,
        { attr::REQUEST_ID } = tracing::field::Empty,
        { attr::MODEL } = tracing::field::Empty,
        { attr::CLIENT_WAIT_MS } = tracing::field::Empty,
        { attr::CLIENT_TAIL_MS } = tracing::field::Empty,
        { attr::CHUNKS } = tracing::field::Empty,
    );
    if telemetry::enabled() {
        let _ = span.set_parent(telemetry::extract_http(&headers));
    }
    let trace_id = telemetry::trace_id(&span);
    let mut tracked = Tracked {
        g: g.clone(),
        outcome: Outcome::Internal,
        trace_id: trace_id.clone(),
        t0: std::time::Instant::now(),
        span: span.clone(),
        wait: ClientWait::default(),
        key: None,
    };
    let admitted = match &g.keys {
        Some(k) => k.admit(&headers).map(Some),
        None => Ok(None),
    };
    let reply = match admitted {
        Err(refused) => Reply::Done(refused_response(&refused)),
        Ok(key) => {
            if let Some(k) = &key {
                span.set_attribute(attr::API_KEY_NAME, k.name().to_string());
            }
            tracked.key = key;
            respond(&g, headers, body, kind).instrument(span.clone()).await
        }
    };
    let (mut r, sse) = match reply {
        Reply::Done(r) => (r, None),
        Reply::Sse(rx) => (
            (StatusCode::OK, [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")])
                .into_response(),
            Some(rx),
        ),
    };
    tracked.outcome = Outcome::of_http(r.status().as_u16());
    span.record(attr::HTTP_STATUS_CODE, r.status().as_u16() as i64);
    if r.status().is_server_error() {
        telemetry::mark_error(&span, r.status().as_str());
    }
    if let Some(id) = trace_id.and_then(|t| t.parse().ok()) {
        r.headers_mut().insert("x-pdmesh-trace-id", id);
    }
    if r.status() == StatusCode::OK {
        // Bodies keep `tracked` (and the span) until their last byte is handed over.
        let (parts, body) = r.into_parts();
        let body = match sse {
            Some(rx) => Body::from_stream(TrackedBody { inner: Some(rx), t: tracked, delay: None }),
            None => {
                tracked.wait.chunks = 1;
                Body::from_stream(PlainBody { inner: body.into_data_stream(), _t: tracked })
            }
        };
        return Response::from_parts(parts, body);
    }
    r
}

/// What `respond` produced: a whole response (errors, non-streamed
/// answers), or the SSE chunks of a streamed one, each with the time it was
/// ready, for `handle` to wrap in a [`TrackedBody`].
enum Reply {
    Done(Response),
    Sse(tokio::sync::mpsc::Receiver<(std::time::Instant, Bytes)>),
}

struct PlainBody<S> {
    inner: S,
    _t: Tracked,
}

impl<S: tokio_stream::Stream + Unpin> tokio_stream::Stream for PlainBody<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// An SSE body that records, per chunk, how long it waited for the client.
/// Test-only fault `gateway.slow_client_ms`: hand each chunk over that much
/// later, as a client (or proxy) that reads slowly would take it.
struct TrackedBody {
    inner: Option<tokio::sync::mpsc::Receiver<(std::time::Instant, Bytes)>>,
    t: Tracked,
    delay: Option<(std::pin::Pin<Box<tokio::time::Sleep>>, std::time::Instant, Bytes)>,
}

impl tokio_stream::Stream for TrackedBody {
    type Item = Result<Bytes, std::io::Error>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        loop {
            if let Some((sleep, ready, _)) = self.delay.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let ready = *ready;
                let (_, _, bytes) = self.delay.take().expect("checked");
                self.t.wait.taken(ready, std::time::Instant::now());
                return Poll::Ready(Some(Ok(bytes)));
            }
            let Some(rx) = self.inner.as_mut() else { return Poll::Ready(None) };
            match rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.inner = None;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some((ready, bytes))) => {
                    let slow = pdmesh_core::faults::get("gateway.slow_client_ms");
                    if slow > 0 {
                        self.delay = Some((Box::pin(tokio::time::sleep(Duration::from_millis(slow))), ready, bytes));
                        continue;
                    }
                    self.t.wait.taken(ready, std::time::Instant::now());
                    return Poll::Ready(Some(Ok(bytes)));
                }
            }
        }
    }
}

/// The request id: the caller's `x-request-id` when usable, else a fresh one.
fn request_id(g: &Gateway, headers: &HeaderMap, chat: bool) -> String {
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    match headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        Some(v) if !v.is_empty() && v.len() <= 100 && v.chars().all(|c| c.is_ascii_graphic()) => v.to_string(),
        _ => format!("{prefix}-{:x}{:06x}", now_s(), g.next_id.fetch_add(1, Ordering::Relaxed)),
    }
}

/// The server's limit, shortened by the caller's `x-request-timeout` (seconds).
fn deadline(g: &Gateway, headers: &HeaderMap) -> Duration {
    let limit = Duration::from_secs_f64(g.config.request_timeout_s.max(0.001));
    let asked =
        headers.get("x-request-timeout").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok());
    match asked {
        Some(t) if t > 0.0 && t.is_finite() && t < limit.as_secs_f64() => Duration::from_secs_f64(t),
        _ => limit,
    }
}

/// What every response object of one request repeats.
#[derive(Clone)]
struct Answer {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

impl Answer {
    /// The whole (non-streamed) response.
    fn whole(&self, text: String, f: &pb::Finished) -> Response {
        let (id, created, model, fr) = (&self.id, self.created, &self.model, finish_reason(f));
        let body = if self.chat {
            json!({ "id": id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": null, "finish_reason": fr }],
                    "usage": usage_json(f) })
        } else {
            json!({ "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{ "index": 0, "text": text, "logprobs": null, "finish_reason": fr }],
                    "usage": usage_json(f) })
        };
        ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }

    /// One SSE chunk carrying `delta` (chat) or its content (completions).
    fn chunk(&self, delta: Value, fr: Value) -> Bytes {
        let (id, created, model) = (&self.id, self.created, &self.model);
        let v = if self.chat {
            json!({ "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": fr }] })
        } else {
            json!({ "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{ "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": fr }] })
        };
        sse(&v)
    }

    fn usage_chunk(&self, f: &pb::Finished) -> Bytes {
        let object = if self.chat { "chat.completion.chunk" } else { "text_completion" };
        sse(&json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [],
                     "usage": usage_json(f) }))
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

async fn respond(g: &Arc<Gateway>, headers: HeaderMap, body: ReqBody, kind: Kind) -> Reply {
    let chat = matches!(kind, Kind::Chat);
    let body = match body {
        Ok(b) => b,
        Err(r) => return Reply::Done(r),
    };
    let mut parsed = match openai::parse(&body, kind, &g.served(), g.config.default_max_tokens) {
        Ok(p) => p,
        Err(e) => return Reply::Done(bad_request(e)),
    };
    tracing::Span::current().record(attr::MODEL, parsed.model.as_str());
    let router = g.routers_of(&parsed.model);
    let id = request_id(g, &headers, chat);
    parsed.request.request_id = id.clone();
    tracing::Span::current().record(attr::REQUEST_ID, id.as_str());
    let deadline = deadline(g, &headers);
    let up = match Upstream::open((router, g.watch.clone()), parsed.request, deadline).await {
        Ok(o) => o,
        Err(r) => return Reply::Done(r),
    };
    let answer = Answer { id, created: now_s(), model: parsed.model, chat };
    if !parsed.stream {
        return Reply::Done(collect(g, up, &answer).await);
    }
    // Roomy: the router should never wait on a slow client; the body records
    // how long each chunk waited for it instead.
    let (tx, rx) = tokio::sync::mpsc::channel::<(std::time::Instant, Bytes)>(1024);
    // In the request's span: a failover's call and event belong to its trace.
    tokio::spawn(
        stream_sse(g.clone(), up, answer, parsed.include_usage, Timed(tx)).instrument(tracing::Span::current()),
    );
    Reply::Sse(rx)
}

/// A non-streamed answer: every delta, then the whole response.
/// Like every read of `up`, it ends at the request's deadline.
async fn collect(g: &Gateway, mut up: Upstream, answer: &Answer) -> Response {
    let mut text = String::new();
    let r = loop {
        let m = match up.next().await {
            Ok(m) => m,
            Err(s) => {
                telemetry::record_status(up.span(), Some(&s));
                break status_response(&from_router(s));
            }
        };
        match m.and_then(|m| m.event) {
            Some(pb::generate_response::Event::Delta(d)) => text.push_str(&d.text),
            Some(pb::generate_response::Event::Finished(f)) => {
                telemetry::record_status(up.span(), None);
                break answer.whole(text, &f);
            }
            None => break unavailable("the router ended the stream without finishing"),
        }
    };
    g.router_failovers.fetch_add(u64::from(up.failovers), Ordering::Relaxed);
    r
}

/// SSE: one chunk per delta, a final chunk with the finish reason, usage
/// if asked, [DONE]; an error event if the router's stream fails.
async fn stream_sse(g: Arc<Gateway>, mut up: Upstream, answer: Answer, include_usage: bool, tx: Timed) {
    sse_events(&mut up, answer, include_usage, tx).await;
    g.router_failovers.fetch_add(u64::from(up.failovers), Ordering::Relaxed);
}

async fn sse_events(up: &mut Upstream, answer: Answer, include_usage: bool, tx: Timed) {
    if answer.chat && tx.send(answer.chunk(json!({ "role": "assistant", "content": "" }), Value::Null)).await.is_err() {
        return;
    }
    loop {
        let next = tokio::select! {
            m = up.next() => m,
            _ = tx.0.closed() => {
                telemetry::mark_error(up.span(), "client went away");
                return;
            }
        };
        let ev = match next {
            Ok(m) => m.and_then(|m| m.event),
            Err(s) => {
                telemetry::record_status(up.span(), Some(&s));
                let s = from_router(s);
                let (st, kind, code) = http_of(&s);
                let e = json!({ "error": { "message": s.message(), "type": kind, "param": null, "code": code, "status": st } });
                let _ = tx.send(sse(&e)).await;
                return;
            }
        };
        match ev {
            Some(pb::generate_response::Event::Delta(d)) => {
                if !d.text.is_empty() && tx.send(answer.chunk(json!({ "content": d.text }), Value::Null)).await.is_err()
                {
                    return; // client gone: dropping the stream cancels the request
                }
            }
            Some(pb::generate_response::Event::Finished(f)) => {
                telemetry::record_status(up.span(), None);
                let _ = tx.send(answer.chunk(json!({}), json!(finish_reason(&f)))).await;
                if include_usage {
                    let _ = tx.send(answer.usage_chunk(&f)).await;
                }
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                return;
            }
            None => {
                telemetry::mark_error(up.span(), "stream ended without finishing");
                let e = json!({ "error": { "message": "the router ended the stream without finishing", "type": "service_unavailable", "param": null, "code": "unavailable" } });
                let _ = tx.send(sse(&e)).await;
                return;
            }
        }
    }
}

/// Sends each chunk with the time it became ready.
struct Timed(tokio::sync::mpsc::Sender<(std::time::Instant, Bytes)>);

impl Timed {
    async fn send(&self, b: Bytes) -> Result<(), ()> {
        self.0.send((std::time::Instant::now(), b)).await.map_err(|_| ())
    }
}

async fn models(State(g): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Some(Err(refused)) = g.keys.as_ref().map(|k| k.verify(&headers)) {
        return refused_response(&refused);
    }
    let data: Vec<Value> =
        g.served().iter().map(|m| json!({ "id": m, "object": "model", "created": 0, "owned_by": "pdmesh" })).collect();
    let body = json!({ "object": "list", "data": data });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// 200 while some model has a router; the text names any model without one.
async fn health(State(g): State<Arc<Gateway>>) -> Response {
    let lacking: Vec<&str> =
        g.routers.iter().filter(|(_, p)| p.instances().is_empty()).map(|(m, _)| m.as_str()).collect();
    match (lacking.len(), g.routers.len() > 1) {
        (0, _) => (StatusCode::OK, "ok\n").into_response(),
        (_, false) => (StatusCode::SERVICE_UNAVAILABLE, "no router\n").into_response(),
        (n, true) if n == g.routers.len() => {
            (StatusCode::SERVICE_UNAVAILABLE, "no router for any model\n").into_response()
        }
        _ => (StatusCode::OK, format!("ok\nno router for {}\n", lacking.join(", "))).into_response(),
    }
}

impl Gateway {
    /// The model names clients may ask for.
    fn served(&self) -> Vec<String> {
        self.routers.iter().map(|(m, _)| m.clone()).collect()
    }

    /// The routers of `model` (one the parser accepted).
    fn routers_of(&self, model: &str) -> Peers {
        self.routers.iter().find(|(m, _)| m == model).map_or_else(|| self.routers[0].1.clone(), |(_, p)| p.clone())
    }

    /// Until some model has a router.
    async fn wait_for_a_router(&self) {
        while self.routers.iter().all(|(_, p)| p.instances().is_empty()) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Each served model with its routers: `--models`' pools through
/// discovery, else `--model-name` with `--router-addr` or plain `router`.
fn routers(config: &Config) -> Result<Vec<(String, Peers)>, ServeError> {
    let setup = |m: String| Err(ServeError::Setup(m));
    if config.common.pool.is_some() {
        return setup("the gateway serves every model pool and is in none: give it --models, not --pool".into());
    }
    if config.models.is_empty() {
        let router = Peers::resolve(&config.common, "router", &config.router_addr).map_err(ServeError::Setup)?;
        return Ok(vec![(config.model_name.clone(), router)]);
    }
    if !config.router_addr.is_empty() {
        return setup("--router-addr serves one model; with --models each pool's routers come from discovery".into());
    }
    let Some(d) = config.common.open_discovery().map_err(ServeError::Setup)? else {
        return setup("--models needs --discovery: each pool's routers are found there".into());
    };
    let mut out: Vec<(String, Peers)> = Vec::new();
    for m in &config.models {
        pdmesh_core::discovery::check_pool(m).map_err(ServeError::Setup)?;
        if out.iter().any(|(n, _)| n == m) {
            return setup(format!("--models names {m} twice"));
        }
        out.push((m.clone(), Peers::discovered(pdmesh_core::discovery::pooled(d.clone(), m), "router")));
    }
    Ok(out)
}

async fn method_not_allowed() -> Response {
    let msg = "method not allowed: use POST for /v1/chat/completions and /v1/completions, GET for /v1/models";
    error_body(405, msg, "invalid_request_error", None, Some("method_not_allowed"))
}

async fn not_found() -> Response {
    error_body(
        404,
        "unknown path; this server serves /v1/chat/completions, /v1/completions and /v1/models",
        "invalid_request_error",
        None,
        Some("unknown_url"),
    )
}

/// The API keys of `--api-keys-file`, followed for changes every second.
fn load_keys(config: &Config) -> Result<Option<Arc<auth::Keys>>, ServeError> {
    let Some(file) = &config.keys.api_keys_file else { return Ok(None) };
    let defaults = auth::Limits { concurrency: config.keys.key_max_concurrency, rpm: config.keys.key_rpm };
    let keys = Arc::new(auth::Keys::load(file, defaults).map_err(ServeError::Setup)?);
    if keys.count() == 0 {
        eprintln!("pdmesh-gateway: {} holds no API key: every /v1 request gets 401", file.display());
    }
    keys.clone().follow(Duration::from_secs(1));
    Ok(Some(keys))
}

/// Serve the OpenAI API on `listener` until `shutdown` resolves.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let g = Arc::new(Gateway {
        config: config.clone(),
        routers: routers(&config)?,
        in_flight: AtomicU64::new(0),
        next_id: AtomicU64::new(0),
        outcomes: Outcomes::default(),
        router_failovers: AtomicU64::new(0),
        watch: Arc::new(pdmesh_core::outlier::Watch::polling(
            config.router_knobs().map_err(ServeError::Setup)?,
            "health check",
        )),
        e2e: Histogram::latency(),
        keys: load_keys(&config)?,
        conns: Arc::default(),
    });
    config.front.check().map_err(ServeError::Setup)?;
    let g2 = g.clone();
    let admin = AdminState::new("gateway", json!({ "config": config }), Arc::new(move |f| render(&g2, f)));
    let admin = Admin::start(&config.common, admin).await?;
    // Each pool's routers' health, polled: a frozen router is noticed in about
    // a second. After Admin::start, which installs mesh TLS: the channels the
    // pollers open speak it.
    let _pollers: Vec<_> = g
        .routers
        .iter()
        .map(|(_, peers)| {
            let poll = pdmesh_core::outlier::poll_health(peers.clone(), g.watch.clone(), Duration::from_millis(250));
            pdmesh_core::task::spawn_owned(poll)
        })
        .collect();
    let _report =
        pdmesh_core::task::spawn_owned(pdmesh_core::outlier::publish(g.watch.clone(), admin.state.clone(), |_| {}));
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(g.clone());
    let addr = listener.local_addr()?;
    // Serve at once (requests get 503 until a router appears); ready and
    // announced once a router is reachable.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = front::serve(listener, app, config.front.clone(), g.conns.clone(), async {
        let _ = stopped.await;
    });
    tokio::pin!(server);
    tokio::pin!(shutdown);
    let announced = tokio::select! {
        r = &mut server => {
            admin.shut_down(pdmesh_core::serve::Announced::none()).await?;
            r?;
            return Ok(());
        }
        _ = &mut shutdown => pdmesh_core::serve::Announced::none(),
        _ = g.wait_for_a_router() => {
            let mut a = admin.announce("gateway", &config.common, addr).await?;
            tokio::select! {
                r = &mut server => {
                    admin.shut_down(a).await?;
                    r?;
                    return Ok(());
                }
                _ = &mut shutdown => {}
            }
            // Out of discovery, then stop accepting: with a socket shared
            // by a supervisor, waiting connections go to the new gateway.
            admin.leave(&mut a, None, &config.common).await;
            a
        }
    };
    let _ = stop.send(());
    let limit = Duration::from_secs(config.common.drain.drain_timeout_s);
    let r = match tokio::time::timeout(limit, &mut server).await {
        Ok(r) => {
            eprintln!("pdmesh-gateway: drained");
            r
        }
        Err(_) => {
            let n = g.in_flight.load(Ordering::Relaxed);
            eprintln!("pdmesh-gateway: drain deadline passed with {n} request(s) in flight; cutting them");
            Ok(())
        }
    };
    admin.shut_down(announced).await?;
    r?;
    Ok(())
}
