//! The gateway's one table from failures to HTTP: the status, OpenAI's
//! error body (`{"error":{"message","type","param","code"}}`) and
//! `Retry-After` where trying again helps. The client's fault is 4xx,
//! overload 429 or 503, the mesh's fault 5xx.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::auth;
use crate::openai::BadRequest;

pub(crate) fn error_body(status: u16, message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Response {
    let body = json!({ "error": { "message": message, "type": kind, "param": param, "code": code } });
    let st = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (st, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

pub(crate) fn bad_request(e: BadRequest) -> Response {
    error_body(e.status, &e.message, "invalid_request_error", e.param, e.code)
}

/// HTTP status, OpenAI error type and code for a router status.
pub(crate) fn http_of(s: &tonic::Status) -> (u16, &'static str, &'static str) {
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

/// The router's status as the client should see it: the call's own
/// timeout is the request's deadline (never a cancellation), and a broken
/// connection is the mesh's fault, named without the library's text.
pub(crate) fn from_router(s: tonic::Status) -> tonic::Status {
    if pdmesh_core::grpc::timed_out(&s) {
        tonic::Status::deadline_exceeded(DEADLINE_MESSAGE)
    } else if pdmesh_core::grpc::is_transport(&s) {
        tonic::Status::unavailable("the connection to the router failed")
    } else {
        s
    }
}

/// 401 or 429 (with `Retry-After`) for a request the API keys refused.
pub(crate) fn refused_response(r: &auth::Refused) -> Response {
    use auth::Refused::*;
    let mut resp = match r {
        Missing => error_body(
            401,
            "no API key: send it as `Authorization: Bearer KEY`",
            "invalid_request_error",
            None,
            Some("missing_api_key"),
        ),
        Invalid => {
            error_body(401, "invalid or revoked API key", "invalid_request_error", None, Some("invalid_api_key"))
        }
        Rate { retry_after_s } => {
            let msg = format!("this API key's requests per minute are spent; retry in {retry_after_s} s");
            let mut r = error_body(429, &msg, "rate_limit_error", None, Some("rate_limit_exceeded"));
            r.headers_mut().insert(header::RETRY_AFTER, (*retry_after_s).into());
            return r;
        }
        Concurrency { limit } => {
            let msg = format!("this API key already has {limit} request(s) in flight, its limit");
            error_body(429, &msg, "rate_limit_error", None, Some("concurrency_limit_exceeded"))
        }
    };
    if matches!(r, Concurrency { .. }) {
        resp.headers_mut().insert(header::RETRY_AFTER, 1u64.into());
    }
    resp
}

pub(crate) fn status_response(s: &tonic::Status) -> Response {
    let (st, kind, mut code) = http_of(s);
    if let Some(why) = s.metadata().get(pdmesh_core::vocab::OVERLOAD_HEADER).and_then(|v| v.to_str().ok()) {
        code = if why == "router_busy" { "router_busy" } else { "overloaded" };
    }
    let mut r = error_body(st, s.message(), kind, None, Some(code));
    // Overload and unavailability pass: say when to try again.
    if st == 429 || st == 503 {
        r.headers_mut().insert(header::RETRY_AFTER, 1u64.into());
    }
    r
}

/// What a request that ran out of time is told.
pub(crate) const DEADLINE_MESSAGE: &str = "request did not finish within its deadline";

pub(crate) fn timed_out() -> Response {
    error_body(504, DEADLINE_MESSAGE, "timeout_error", None, Some("deadline_exceeded"))
}

pub(crate) fn unavailable(message: &str) -> Response {
    error_body(503, message, "service_unavailable", None, Some("unavailable"))
}
