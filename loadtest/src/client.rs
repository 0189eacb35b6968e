//! One streamed OpenAI request over plain HTTP/1.1, timed: when the first
//! token arrived, the gaps between tokens, and how it ended. A stream that
//! goes quiet for longer than the stall threshold is ended by the client
//! and counted as stalled (with its request id), never waited on forever.

use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Outcome {
    Ok,
    /// An HTTP error status (with the error body's message).
    Http {
        status: u16,
        message: String,
    },
    /// An error event inside the stream.
    StreamError {
        message: String,
    },
    /// No token for longer than the stall threshold.
    Stalled,
    /// The whole request took longer than the client's timeout.
    Timeout,
    /// Connection refused, reset, malformed response.
    Transport {
        message: String,
    },
}

/// The timings of one request.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub request_id: String,
    /// Seconds since the run started, when the request was sent.
    pub start_s: f64,
    pub ttft_s: Option<f64>,
    /// Gaps between consecutive content chunks, in seconds.
    pub gaps_s: Vec<f64>,
    pub e2e_s: f64,
    /// Content chunks received (each carries one or more tokens).
    pub chunks: usize,
    /// Completion tokens, from the usage chunk when the server sends one, else `chunks`.
    pub output_tokens: usize,
    /// Prompt tokens and the share of them the server took from a prompt
    /// cache (`usage.prompt_tokens_details.cached_tokens`), when it says.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub outcome: Outcome,
    /// The generated text (kept for multi-turn sessions; never written out).
    #[serde(skip)]
    pub text: String,
}

pub struct Request<'a> {
    pub addr: &'a str,
    pub path: &'a str,
    pub body: String,
    pub request_id: String,
    pub stall: Duration,
    pub timeout: Duration,
}

/// Send `req` and time it. Never fails: every problem is an [`Outcome`].
pub async fn send(req: Request<'_>, t_run: Instant) -> Record {
    let t0 = Instant::now();
    let mut rec = Record {
        request_id: req.request_id.clone(),
        start_s: t0.duration_since(t_run).as_secs_f64(),
        ttft_s: None,
        gaps_s: Vec::new(),
        e2e_s: 0.0,
        chunks: 0,
        output_tokens: 0,
        prompt_tokens: None,
        cached_tokens: None,
        outcome: Outcome::Ok,
        text: String::new(),
    };
    let deadline = t0 + req.timeout;
    let outcome = match tokio::time::timeout_at(deadline.into(), exchange(&req, t0, &mut rec)).await {
        Ok(o) => o,
        Err(_) => Outcome::Timeout,
    };
    rec.e2e_s = t0.elapsed().as_secs_f64();
    if rec.output_tokens == 0 {
        rec.output_tokens = rec.chunks;
    }
    rec.outcome = outcome;
    rec
}

async fn exchange(req: &Request<'_>, t0: Instant, rec: &mut Record) -> Outcome {
    let mut s = match TcpStream::connect(req.addr).await {
        Ok(s) => s,
        Err(e) => return Outcome::Transport { message: format!("connect {}: {e}", req.addr) },
    };
    let _ = s.set_nodelay(true);
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nx-request-id: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        req.path,
        req.addr,
        req.request_id,
        req.body.len()
    );
    if let Err(e) = s.write_all(format!("{head}{}", req.body).as_bytes()).await {
        return Outcome::Transport { message: format!("send: {e}") };
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let mut header_end = None;
    let mut chunked = false;
    let mut status = 0u16;
    let mut scan = 0; // how much of the body was parsed
    let mut last: Option<Instant> = None;
    loop {
        let n = match tokio::time::timeout(req.stall, s.read(&mut chunk)).await {
            Err(_) => return Outcome::Stalled,
            Ok(Err(e)) => return Outcome::Transport { message: format!("read: {e}") },
            Ok(Ok(n)) => n,
        };
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if header_end.is_none() {
            if let Some(p) = find(&buf, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
                status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
                chunked = head.contains("transfer-encoding: chunked");
                header_end = Some(p + 4);
                scan = p + 4;
            }
        }
        let Some(_) = header_end else { continue };
        if status != 200 {
            continue; // read the whole error body
        }
        // Parse complete SSE events ("data: ...\n\n") from the body so far.
        let body =
            if chunked { dechunk(&buf[header_end.unwrap_or(0)..]) } else { buf[header_end.unwrap_or(0)..].to_vec() };
        let consumed_before = scan - header_end.unwrap_or(0);
        let mut pos = consumed_before.min(body.len());
        while let Some(e) = find(&body[pos..], b"\n\n") {
            let event = String::from_utf8_lossy(&body[pos..pos + e]).to_string();
            pos += e + 2;
            let Some(data) = event.strip_prefix("data: ") else { continue };
            if let Some(end) = on_event(data, t0, rec, &mut last) {
                return end;
            }
        }
        scan = header_end.unwrap_or(0) + pos;
    }
    if header_end.is_none() {
        return Outcome::Transport { message: "connection closed before the response".into() };
    }
    if status != 200 {
        let body = header_end.map(|h| if chunked { dechunk(&buf[h..]) } else { buf[h..].to_vec() }).unwrap_or_default();
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(String::from))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(200).collect());
        return Outcome::Http { status, message };
    }
    Outcome::Transport { message: "stream ended without [DONE]".into() }
}

/// One SSE event's data: timings, text and usage into `rec`; the outcome
/// when the event ends the stream.
fn on_event(data: &str, t0: Instant, rec: &mut Record, last: &mut Option<Instant>) -> Option<Outcome> {
    if data.trim() == "[DONE]" {
        return Some(Outcome::Ok);
    }
    let v: serde_json::Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => return Some(Outcome::Transport { message: format!("bad SSE event: {e}") }),
    };
    if let Some(err) = v.get("error") {
        return Some(Outcome::StreamError { message: err["message"].as_str().unwrap_or("error event").into() });
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        if let Some(c) = u.get("completion_tokens").and_then(|c| c.as_u64()) {
            rec.output_tokens = c as usize;
        }
        rec.prompt_tokens = u.get("prompt_tokens").and_then(|c| c.as_u64());
        rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
    }
    let mut piece = String::new();
    for c in v["choices"].as_array().into_iter().flatten() {
        if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
            piece.push_str(t);
        }
    }
    if !piece.is_empty() {
        rec.text.push_str(&piece);
        let now = Instant::now();
        match *last {
            None => rec.ttft_s = Some(now.duration_since(t0).as_secs_f64()),
            Some(p) => rec.gaps_s.push(now.duration_since(p).as_secs_f64()),
        }
        *last = Some(now);
        rec.chunks += 1;
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Undo HTTP/1.1 chunked encoding of what has arrived so far (a partial
/// last chunk is left out).
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(p) = find(b, b"\r\n") {
        let size = std::str::from_utf8(&b[..p]).ok().and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
        let Some(n) = size else { break };
        if n == 0 || b.len() < p + 2 + n {
            break;
        }
        out.extend_from_slice(&b[p + 2..p + 2 + n]);
        b = &b[(p + 4 + n).min(b.len())..];
    }
    out
}
