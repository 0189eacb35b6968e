//! pdmesh gateway: the OpenAI-compatible HTTP API (`/v1/chat/completions`,
//! `/v1/completions`, streaming via SSE or not, `/v1/models`) in front of
//! the router's gRPC `Generate`. Errors use OpenAI's body shape with the
//! status a client expects: 400 bad input, 404 unknown model, 429 no KV
//! room, 503 no healthy worker, 504 deadline. A client that disconnects
//! cancels its request all the way down to the decode worker.

pub mod config;
pub mod openai;

use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pdmesh_core::admin::AdminState;
use pdmesh_core::metrics::{Histogram, Outcomes, Text};
use pdmesh_core::peers::Peers;
use pdmesh_core::serve::{Admin, ServeError};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::router::v1 as pb;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::config::Config;
use crate::openai::{BadRequest, Kind};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("HTTP server: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Setup(String),
}

const STATUSES: &[&str] = &["200", "400", "404", "413", "429", "499", "503", "504", "500"];

pub struct Gateway {
    config: Config,
    router: Peers,
    in_flight: AtomicU64,
    next_id: AtomicU64,
    by_status: Outcomes,
    e2e: Histogram,
}

fn render(g: &Gateway) -> String {
    let mut t = Text::default();
    t.gauge("pdmesh_gateway_in_flight", "HTTP requests being served.", g.in_flight.load(Ordering::Relaxed) as f64)
        .histogram("pdmesh_gateway_request_seconds", "Time from request arrival to the last byte handed to the client.", &g.e2e);
    let v: Vec<(&str, f64)> = STATUSES.iter().map(|s| (*s, g.by_status.get(s) as f64)).collect();
    t.labelled("pdmesh_gateway_requests_total", "counter", "Finished API requests by HTTP status.", "status", &v);
    t.0
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn error_body(status: u16, message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Response {
    let body = json!({ "error": { "message": message, "type": kind, "param": param, "code": code } });
    let st = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (st, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn bad_request(e: BadRequest) -> Response {
    let kind = if e.status == 404 { "invalid_request_error" } else { "invalid_request_error" };
    error_body(e.status, &e.message, kind, e.param, e.code)
}

/// HTTP status, OpenAI error type and code for a router status.
fn http_of(s: &tonic::Status) -> (u16, &'static str, &'static str) {
    use tonic::Code::*;
    match s.code() {
        InvalidArgument | OutOfRange => (400, "invalid_request_error", "invalid_request"),
        NotFound => (404, "invalid_request_error", "not_found"),
        ResourceExhausted => (429, "rate_limit_error", "kv_cache_full"),
        DeadlineExceeded => (504, "timeout_error", "deadline_exceeded"),
        Unavailable => (503, "service_unavailable", "unavailable"),
        Cancelled => (499, "cancelled", "cancelled"),
        _ => (500, "internal_error", "internal"),
    }
}

fn status_response(s: &tonic::Status) -> Response {
    let (st, kind, code) = http_of(s);
    error_body(st, s.message(), kind, None, Some(code))
}

fn finish_reason(f: &pb::Finished) -> &'static str {
    match common::FinishReason::try_from(f.reason).unwrap_or(common::FinishReason::Stop) {
        common::FinishReason::Length => "length",
        _ => "stop",
    }
}

fn usage_json(f: &pb::Finished) -> Value {
    let u = f.usage.unwrap_or_default();
    json!({ "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens })
}

/// Counts the request and its time when dropped (also when the client
/// disconnects and the response is abandoned).
struct Tracked {
    g: Arc<Gateway>,
    status: &'static str,
    t0: std::time::Instant,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.g.by_status.inc(self.status);
        self.g.e2e.observe(self.t0.elapsed().as_secs_f64());
        self.g.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn status_label(code: u16) -> &'static str {
    STATUSES.iter().find(|s| s.parse::<u16>().ok() == Some(code)).copied().unwrap_or("500")
}

async fn completions(State(g): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(g, headers, body, Kind::Completion).await
}

async fn chat(State(g): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(g, headers, body, Kind::Chat).await
}

async fn handle(g: Arc<Gateway>, headers: HeaderMap, body: Bytes, kind: Kind) -> Response {
    g.in_flight.fetch_add(1, Ordering::Relaxed);
    let mut tracked = Tracked { g: g.clone(), status: "500", t0: std::time::Instant::now() };
    let r = respond(&g, headers, body, kind).await;
    tracked.status = status_label(r.status().as_u16());
    if r.status() == StatusCode::OK {
        // Streaming bodies keep `tracked` until their last byte is written.
        let (parts, body) = r.into_parts();
        let body = Body::from_stream(TrackedBody { inner: body.into_data_stream(), _t: tracked });
        return Response::from_parts(parts, body);
    }
    r
}

struct TrackedBody<S> {
    inner: S,
    _t: Tracked,
}

impl<S: tokio_stream::Stream + Unpin> tokio_stream::Stream for TrackedBody<S> {
    type Item = S::Item;
    fn poll_next(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

async fn respond(g: &Arc<Gateway>, headers: HeaderMap, body: Bytes, kind: Kind) -> Response {
    let chat = matches!(kind, Kind::Chat);
    let mut parsed = match openai::parse(&body, kind, &g.config.model_name, g.config.default_max_tokens) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    let id = match headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        Some(v) if !v.is_empty() && v.len() <= 100 && v.chars().all(|c| c.is_ascii_graphic()) => v.to_string(),
        _ => format!("{prefix}-{:x}{:06x}", now_s(), g.next_id.fetch_add(1, Ordering::Relaxed)),
    };
    parsed.request.request_id = id.clone();
    let mut deadline = Duration::from_secs_f64(g.config.request_timeout_s.max(0.001));
    if let Some(t) = headers.get("x-request-timeout").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok()) {
        if t > 0.0 && t.is_finite() {
            deadline = deadline.min(Duration::from_secs_f64(t));
        }
    }
    let Some(list) = g.router.wait_any(Duration::from_secs(2)).await else {
        return error_body(503, "no router is available", "service_unavailable", None, Some("unavailable"));
    };
    let ch = match g.router.channel(&list[0]) {
        Ok(c) => c,
        Err(e) => return error_body(500, &e, "internal_error", None, None),
    };
    let mut req = tonic::Request::new(parsed.request);
    req.set_timeout(deadline);
    let mut client = pb::router_client::RouterClient::new(ch);
    let call = async {
        let mut s = client.generate(req).await?.into_inner();
        // Wait for the first event so that refusals get their own HTTP status.
        let first = s.message().await?;
        Ok::<_, tonic::Status>((s, first))
    };
    let (mut stream, first) = match tokio::time::timeout(deadline + Duration::from_millis(500), call).await {
        Ok(Ok(x)) => x,
        Ok(Err(s)) => return status_response(&s),
        Err(_) => return error_body(504, "request did not finish within its deadline", "timeout_error", None, Some("deadline_exceeded")),
    };
    let created = now_s();
    let model = parsed.model.clone();
    if !parsed.stream {
        let mut text = String::new();
        let mut next = first;
        let until = tokio::time::Instant::now() + deadline + Duration::from_millis(500);
        loop {
            let ev = match next.and_then(|m| m.event) {
                Some(e) => e,
                None => return error_body(503, "the router ended the stream without finishing", "service_unavailable", None, Some("unavailable")),
            };
            match ev {
                pb::generate_response::Event::Delta(d) => text.push_str(&d.text),
                pb::generate_response::Event::Finished(f) => {
                    let fr = finish_reason(&f);
                    let body = if chat {
                        json!({ "id": id, "object": "chat.completion", "created": created, "model": model,
                                "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": null, "finish_reason": fr }],
                                "usage": usage_json(&f) })
                    } else {
                        json!({ "id": id, "object": "text_completion", "created": created, "model": model,
                                "choices": [{ "index": 0, "text": text, "logprobs": null, "finish_reason": fr }],
                                "usage": usage_json(&f) })
                    };
                    return ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response();
                }
            }
            next = match tokio::time::timeout_at(until, stream.message()).await {
                Ok(Ok(m)) => m,
                Ok(Err(s)) => return status_response(&s),
                Err(_) => return error_body(504, "request did not finish within its deadline", "timeout_error", None, Some("deadline_exceeded")),
            };
        }
    }
    // SSE: one chunk per delta, a final chunk with the finish reason, usage if asked, [DONE].
    let include_usage = parsed.include_usage;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    tokio::spawn(async move {
        let chunk = |delta: Value, fr: Value| -> Bytes {
            let v = if chat {
                json!({ "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": fr }] })
            } else {
                json!({ "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{ "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": fr }] })
            };
            Bytes::from(format!("data: {v}\n\n"))
        };
        if chat && tx.send(Ok(chunk(json!({ "role": "assistant", "content": "" }), Value::Null))).await.is_err() {
            return;
        }
        let mut next = Ok(first);
        loop {
            let ev = match next {
                Ok(Some(m)) => m.event,
                Ok(None) => None,
                Err(s) => {
                    let (st, kind, code) = http_of(&s);
                    let e = json!({ "error": { "message": s.message(), "type": kind, "param": null, "code": code, "status": st } });
                    let _ = tx.send(Ok(Bytes::from(format!("data: {e}\n\n")))).await;
                    return;
                }
            };
            match ev {
                Some(pb::generate_response::Event::Delta(d)) => {
                    if !d.text.is_empty() && tx.send(Ok(chunk(json!({ "content": d.text }), Value::Null))).await.is_err() {
                        return; // client gone: dropping `stream` cancels the request
                    }
                }
                Some(pb::generate_response::Event::Finished(f)) => {
                    let _ = tx.send(Ok(chunk(json!({}), json!(finish_reason(&f))))).await;
                    if include_usage {
                        let u = json!({ "id": id, "object": if chat { "chat.completion.chunk" } else { "text_completion" }, "created": created, "model": model, "choices": [], "usage": usage_json(&f) });
                        let _ = tx.send(Ok(Bytes::from(format!("data: {u}\n\n")))).await;
                    }
                    let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
                    return;
                }
                None => {
                    let e = json!({ "error": { "message": "the router ended the stream without finishing", "type": "service_unavailable", "param": null, "code": "unavailable" } });
                    let _ = tx.send(Ok(Bytes::from(format!("data: {e}\n\n")))).await;
                    return;
                }
            }
            next = tokio::select! {
                m = stream.message() => m,
                _ = tx.closed() => return,
            };
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

async fn models(State(g): State<Arc<Gateway>>) -> Response {
    let body = json!({ "object": "list", "data": [{ "id": g.config.model_name, "object": "model", "created": 0, "owned_by": "pdmesh" }] });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

async fn health(State(g): State<Arc<Gateway>>) -> Response {
    if g.router.instances().is_empty() {
        (StatusCode::SERVICE_UNAVAILABLE, "no router\n").into_response()
    } else {
        (StatusCode::OK, "ok\n").into_response()
    }
}

async fn not_found() -> Response {
    error_body(404, "unknown path; this server serves /v1/chat/completions, /v1/completions and /v1/models", "invalid_request_error", None, Some("unknown_url"))
}

/// Serve the OpenAI API on `listener` until `shutdown` resolves.
pub async fn serve(config: Config, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), Error> {
    let router = Peers::resolve(&config.common, "router", &config.router_addr).map_err(Error::Setup)?;
    let g = Arc::new(Gateway { config: config.clone(), router, in_flight: AtomicU64::new(0), next_id: AtomicU64::new(0), by_status: Outcomes::new(STATUSES), e2e: Histogram::latency() });
    let g2 = g.clone();
    let admin = AdminState::new("gateway", json!({ "config": config }), Arc::new(move || render(&g2)));
    let admin = Admin::start(&config.common, admin).await?;
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(g.clone());
    let addr = listener.local_addr()?;
    // Serve at once (requests get 503 until a router appears); ready and
    // announced once a router is reachable.
    // TCP_NODELAY: SSE chunks are small; without it each waits on a delayed ACK.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown).into_future();
    tokio::pin!(server);
    let announced = tokio::select! {
        r = &mut server => {
            admin.shut_down(pdmesh_core::serve::Announced::none())?;
            r?;
            return Ok(());
        }
        _ = g.router.wait_any(Duration::from_secs(10 * 365 * 86400)) => admin.announce("gateway", &config.common, addr).await?,
    };
    let r = server.await;
    admin.shut_down(announced)?;
    r?;
    Ok(())
}
