//! Relay: decode tokens -> incremental detokenize -> stop strings -> the
//! caller, then the finish with usage. A prefill or decode worker failure
//! seen while no token has reached the caller ends the relay as
//! [`Failed::Prefill`] or [`Failed::Decode`], which the caller may retry
//! elsewhere.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pdmesh_core::telemetry::{self, SpanExt};
use pdmesh_core::vocab::{attr, rpc, span};
use pdmesh_proto::common::v1 as common;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::router::v1 as pb;
use pdmesh_proto::tokenizer::v1 as tpb;
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument;

use crate::dispatch::{Dispatched, Handover, Pair};
use crate::error::{decode_failure, decode_retryable, prefill_failure, prefill_retryable, Error};
use crate::stall::Kind;
use crate::state::{Router, Tx, PEER_RETRY, PEER_WAIT};
use crate::stop::StopMatcher;
use pdmesh_core::grpc::is_transport;

fn delta(ids: Vec<u32>, text: String) -> pb::GenerateResponse {
    pb::GenerateResponse { event: Some(pb::generate_response::Event::Delta(pb::Delta { ids, text })) }
}

/// The Detokenize stream of one request and its `detokenize` span, which
/// lasts from the first token to the end of the stream.
struct Detok {
    stream: DetokStream,
    span: telemetry::Held,
    busy: Duration,
    calls: u32,
    /// Every id sent and the bytes of text received, so that a stream lost
    /// with its tokenizer can be replayed on a fresh one.
    sent: Vec<u32>,
    text_len: usize,
}

/// One open Detokenize call and its client span.
struct DetokStream {
    tx: mpsc::Sender<tpb::DetokenizeRequest>,
    rx: tonic::Streaming<tpb::DetokenizeResponse>,
    rpc: telemetry::Held,
}

/// What the relay has sent so far. It outlives one decode worker: a
/// request that migrates goes on with the same detokenize stream, stop
/// matcher and counts.
pub struct Out {
    detok: Option<Detok>,
    stops: StopMatcher,
    n_prompt: u32,
    /// Prompt tokens the prefill (or, locally, the decode) worker took from its prefix cache.
    n_cached: u32,
    /// Every token id sent to the caller, in order.
    pub generated: Vec<u32>,
    started: Instant,
    last_token: Option<Instant>,
    /// The request's trace, as the latency histograms' exemplar.
    trace_id: Option<String>,
}

impl Out {
    pub fn new(stop: Vec<String>, n_prompt: u32, started: Instant) -> Out {
        Out {
            detok: None,
            stops: StopMatcher::new(stop),
            n_prompt,
            n_cached: 0,
            generated: Vec::new(),
            started,
            last_token: None,
            trace_id: telemetry::trace_id(&tracing::Span::current()),
        }
    }

    fn n_out(&self) -> u32 {
        self.generated.len() as u32
    }
}

/// How a relay ended short of its finish.
pub enum Failed {
    /// The prefill failed before any token reached the caller: another
    /// worker may still serve the request. True: its worker was lost
    /// (could not be reached), not merely refusing.
    Prefill(Status, bool),
    /// The decode worker died or broke before any token reached the
    /// caller: another dispatch may still serve the request. True: lost.
    Decode(Status, bool),
    /// The decode worker died or broke after tokens reached the caller:
    /// the request may go on elsewhere from the tokens so far.
    Migrate(Status),
    /// The decode worker is draining and holds the sequence's KV for
    /// another one to take (see [`Handover`]).
    HandingOver(Box<Handover>),
    Other(Status),
}

impl From<Status> for Failed {
    fn from(s: Status) -> Failed {
        Failed::Other(s)
    }
}

impl Router {
    /// Relay a dispatched request's tokens to `tx` until it finishes.
    pub async fn relay(&self, d: Dispatched, out: &mut Out, tx: &Tx) -> Result<(), Failed> {
        let Dispatched { stream: mut dstream, mut prefill, pair, cached_tokens, decode_addr, prefill_addr } = d;
        // The prompt is the same on every dispatch (tokens already sent are
        // replayed, not prefilled): the latest worker's reuse counts.
        out.n_cached = cached_tokens;
        let out = &mut *out;
        // Tokens the caller had before this dispatch (a migration's).
        let before = out.generated.len();
        loop {
            // Until the first token the prefill worker may stop the stream too.
            let waits_on_prefill = prefill.is_some() && out.generated.len() == before;
            let msg = tokio::select! {
                m = dstream.message() => m,
                s = self.loads.outliers.stopped(&decode_addr, &self.decode) => {
                    let e = self.stalled(Kind::Decode, &decode_addr, &pair.workers[1], s);
                    telemetry::record_status(pair.decode_rpc.span(), Some(&e));
                    return Err(if out.generated.is_empty() { Failed::Decode(e, true) } else { Failed::Migrate(e) });
                }
                s = self.loads.outliers.stopped(prefill_addr.as_deref().unwrap_or_default(), &self.prefill), if waits_on_prefill => {
                    let addr = prefill_addr.as_deref().unwrap_or_default();
                    return Err(Failed::Prefill(self.stalled(Kind::Prefill, addr, &pair.workers[0], s), true));
                }
                p = async { (&mut prefill.as_mut().expect("guarded").0).await }, if prefill.is_some() => {
                    prefill = None;
                    match p {
                        Ok(Ok(r)) => {
                            out.n_cached = r.into_inner().cached_tokens;
                            continue;
                        }
                        // Its answer lost after the KV went over: the tokens flow on.
                        Ok(Err(_)) if out.generated.len() > before => continue,
                        // After a migration the caller holds tokens: a
                        // source that fails (a handover's sequence gone,
                        // say) is never the end of the request.
                        Ok(Err(e)) if prefill_retryable(&e) || before > 0 => {
                            let lost = is_transport(&e);
                            return Err(Failed::Prefill(prefill_failure(e), lost));
                        }
                        Ok(Err(e)) => return Err(Failed::Other(prefill_failure(e))),
                        Err(_) => {
                            let e = Error::Internal("its call ended without an answer".into()).into();
                            return Err(Failed::Prefill(prefill_failure(e), false));
                        }
                    }
                }
            };
            let lost = matches!(&msg, Err(e) if is_transport(e));
            if lost {
                self.lost(Kind::Decode, &decode_addr);
            }
            let ev = match event(msg, &pair) {
                Ok(ev) => ev,
                Err(e) if out.generated.is_empty() && decode_retryable(&e) => return Err(Failed::Decode(e, lost)),
                Err(e) if decode_retryable(&e) => return Err(Failed::Migrate(e)),
                Err(e) => return Err(Failed::Other(e)),
            };
            match ev {
                Some(dpb::generate_response::Event::Tokens(t)) => {
                    if self.on_tokens(out, t.ids, tx).await? {
                        settle(prefill.take(), out).await;
                        return Ok(self.finish(tx, common::FinishReason::Stop, out, &pair.workers).await?);
                    }
                }
                Some(dpb::generate_response::Event::Finished(f)) => {
                    telemetry::record_status(pair.decode_rpc.span(), None);
                    self.served(&[decode_addr.as_str(), prefill_addr.as_deref().unwrap_or_default()]);
                    let reason = self.on_finished(out, f.reason, tx).await;
                    settle(prefill.take(), out).await;
                    return Ok(self.finish(tx, reason, out, &pair.workers).await?);
                }
                Some(dpb::generate_response::Event::HandingOver(h)) => {
                    // Its KV holds the prompt and every token sent but the last.
                    let expected = (out.n_prompt + out.n_out()).saturating_sub(1);
                    if h.kv_tokens != expected || out.generated.is_empty() {
                        return Err(Failed::Migrate(Error::DecodeDraining.into()));
                    }
                    let (from, sequence, kv_tokens) = (decode_addr, h.sequence, h.kv_tokens);
                    return Err(Failed::HandingOver(Box::new(Handover { from, sequence, kv_tokens, stream: dstream })));
                }
                Some(dpb::generate_response::Event::Admitted(_)) | None => {}
            }
        }
    }

    /// Send newly generated tokens on; true when a stop string matched.
    async fn on_tokens(&self, out: &mut Out, ids: Vec<u32>, tx: &Tx) -> Result<bool, Status> {
        let now = Instant::now();
        match out.last_token {
            None => {
                let ttft = (now - out.started).as_secs_f64();
                self.metrics.ttft.observe_traced(ttft, out.trace_id.as_deref());
                tracing::Span::current().set_attribute(attr::TTFT_MS, ttft * 1e3);
            }
            Some(prev) => {
                let gap = (now - prev).as_secs_f64() / ids.len().max(1) as f64;
                self.metrics.itl.observe_traced(gap, out.trace_id.as_deref());
            }
        }
        out.last_token = Some(now);
        out.generated.extend_from_slice(&ids);
        let text = self.detokenize(&mut out.detok, ids.clone()).await?;
        let step = out.stops.push(&text);
        if tx.send(Ok(delta(ids, step.emit))).await.is_err() {
            return Err(Error::ClientGone.into());
        }
        Ok(step.stopped)
    }

    /// Drain the detokenizer's tail and the held-back text; the finish reason.
    async fn on_finished(&self, out: &mut Out, reason: i32, tx: &Tx) -> common::FinishReason {
        let mut rest = String::new();
        if let Some(mut d) = out.detok.take() {
            drop(d.stream.tx);
            let t = Instant::now();
            while let Ok(Some(m)) = d.stream.rx.message().instrument(d.stream.rpc.span().clone()).await {
                rest.push_str(&m.text);
            }
            d.busy += t.elapsed();
            d.span.span().set_attribute(attr::DETOKENIZE_BUSY_MS, d.busy.as_secs_f64() * 1e3);
            d.span.span().set_attribute(attr::DETOKENIZE_CALLS, d.calls as i64);
        }
        let step = out.stops.push(&rest);
        let mut tail = step.emit;
        if !step.stopped {
            tail.push_str(&out.stops.finish());
        }
        if !tail.is_empty() {
            let _ = tx.send(Ok(delta(vec![], tail))).await;
        }
        if step.stopped {
            common::FinishReason::Stop
        } else {
            common::FinishReason::try_from(reason).unwrap_or(common::FinishReason::Stop)
        }
    }

    /// A Detokenize call under `span` (the request's `detokenize` span).
    async fn open_stream(&self, span: &tracing::Span) -> Result<DetokStream, Status> {
        let (tx, r) = mpsc::channel(16);
        let mut c = self.tokenizer_client()?;
        let (req, rpc) = {
            let _g = span.enter();
            telemetry::client_request(rpc::TOKENIZER_DETOKENIZE, tokio_stream::wrappers::ReceiverStream::new(r))
        };
        let resp = c.detokenize(req).instrument(rpc.clone()).await;
        let rx = telemetry::finish(&rpc, resp)?.into_inner();
        Ok(DetokStream { tx, rx, rpc: telemetry::Held(rpc) })
    }

    /// The text of the next `ids`.
    async fn detokenize(&self, detok: &mut Option<Detok>, ids: Vec<u32>) -> Result<String, Status> {
        if detok.is_none() {
            let span = tracing::info_span!(span::DETOKENIZE);
            let until = Instant::now() + PEER_WAIT;
            let stream = self.open_patiently(&span, until).await?;
            let span = telemetry::Held(span);
            *detok = Some(Detok { stream, span, busy: Duration::ZERO, calls: 0, sent: Vec::new(), text_len: 0 });
        }
        let d = detok.as_mut().expect("just set");
        let t = Instant::now();
        d.calls += 1;
        let r = match d.stream.next(ids.clone()).await {
            Ok(text) => Ok(text),
            Err(e) => {
                telemetry::mark_error(d.stream.rpc.span(), e.message());
                self.replay(d, &ids).await
            }
        };
        d.busy += t.elapsed();
        let text = r?;
        d.sent.extend_from_slice(&ids);
        d.text_len += text.len();
        Ok(text)
    }

    /// A Detokenize call under `span`; a tokenizer that cannot be reached
    /// (killed, restarting) is asked again, the restarted one or another,
    /// until `until`.
    async fn open_patiently(&self, span: &tracing::Span, until: Instant) -> Result<DetokStream, Status> {
        loop {
            let _ = self.tokenizer.wait_any(until.saturating_duration_since(Instant::now())).await;
            match self.open_stream(span).await {
                Ok(s) => return Ok(s),
                Err(_) if Instant::now() + PEER_RETRY < until => tokio::time::sleep(PEER_RETRY).await,
                Err(_) => return Err(tokenizer_lost()),
            }
        }
    }

    /// The tokenizer was lost mid-stream (killed, restarting): open a fresh
    /// stream, at the restarted tokenizer or another, send it every id so
    /// far and `ids`, and return only the text not yet received
    /// (detokenizing is deterministic). Tried for up to `PEER_WAIT`.
    async fn replay(&self, d: &mut Detok, ids: &[u32]) -> Result<String, Status> {
        let until = Instant::now() + PEER_WAIT;
        let all: Vec<u32> = d.sent.iter().chain(ids).copied().collect();
        loop {
            let mut fresh = self.open_patiently(d.span.span(), until).await?;
            match fresh.next(all.clone()).await {
                Ok(full) => {
                    d.stream = fresh;
                    d.span.span().set_attribute(attr::DETOKENIZE_REOPENED, true);
                    return Ok(full.get(d.text_len..).unwrap_or_default().to_string());
                }
                Err(e) => telemetry::mark_error(fresh.rpc.span(), e.message()),
            }
            if Instant::now() + PEER_RETRY >= until {
                return Err(tokenizer_lost());
            }
            tokio::time::sleep(PEER_RETRY).await;
        }
    }

    /// A resumed request: the tokens its caller already has go through the
    /// detokenizer and the stop matcher as they did on the lost router, so
    /// the text that follows continues theirs, and nothing is sent.
    pub async fn resume(&self, out: &mut Out, ids: &[u32]) -> Result<(), Status> {
        let text = self.detokenize(&mut out.detok, ids.to_vec()).await?;
        let _already_sent = out.stops.push(&text);
        out.generated.extend_from_slice(ids);
        // Its first token reached the caller from the lost router.
        out.last_token = Some(Instant::now());
        tracing::Span::current().set_attribute(attr::RESUMED_AFTER_TOKENS, ids.len() as i64);
        Ok(())
    }

    /// End a request whose decode worker was lost after its last token
    /// but before it said so: flush the text held back, then the finish.
    pub async fn conclude(&self, out: &mut Out, tx: &Tx, workers: &[String; 2]) -> Result<(), Status> {
        let reason = self.on_finished(out, common::FinishReason::Length as i32, tx).await;
        self.finish(tx, reason, out, workers).await
    }

    async fn finish(
        &self,
        tx: &Tx,
        reason: common::FinishReason,
        out: &Out,
        workers: &[String; 2],
    ) -> Result<(), Status> {
        self.metrics.prompt_tokens.fetch_add(out.n_prompt as u64, Ordering::Relaxed);
        self.metrics.completion_tokens.fetch_add(u64::from(out.n_out()), Ordering::Relaxed);
        self.metrics.cached_tokens.fetch_add(out.n_cached as u64, Ordering::Relaxed);
        let fin = pb::Finished {
            reason: reason as i32,
            usage: Some(common::Usage {
                prompt_tokens: out.n_prompt,
                completion_tokens: out.n_out(),
                cached_tokens: out.n_cached,
            }),
            prefill_worker: workers[0].clone(),
            decode_worker: workers[1].clone(),
        };
        tx.send(Ok(pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(fin)) }))
            .await
            .map_err(|_| Error::ClientGone.into())
    }
}

impl DetokStream {
    /// Send `ids`; their text.
    async fn next(&mut self, ids: Vec<u32>) -> Result<String, Status> {
        self.tx
            .send(tpb::DetokenizeRequest { ids, render_special: false })
            .await
            .map_err(|_| Status::from(Error::Tokenizer("the detokenize stream closed")))?;
        match self.rx.message().instrument(self.rpc.span().clone()).await {
            Ok(Some(m)) => Ok(m.text),
            Ok(None) => Err(Error::Tokenizer("the tokenizer ended the detokenize stream").into()),
            Err(e) => Err(e),
        }
    }
}

/// A tokenizer that could not be reached, or was lost mid-request and not
/// replaced in time (the detail is on the Detokenize span).
fn tokenizer_lost() -> Status {
    Error::Tokenizer("the tokenizer was lost mid-request").into()
}

/// The prefill's answer (its cached-token count) when the decode finished
/// first: the prefill returns right after the ticket completes, so this is
/// short; past a second the count is left at 0 rather than hold the caller.
async fn settle(prefill: Option<crate::dispatch::PrefillCall>, out: &mut Out) {
    let Some(mut p) = prefill else { return };
    if let Ok(Ok(Ok(r))) = tokio::time::timeout(Duration::from_secs(1), &mut p.0).await {
        out.n_cached = r.into_inner().cached_tokens;
    }
}

/// The next decode event, or the status that ends the request.
fn event(
    msg: Result<Option<dpb::GenerateResponse>, Status>,
    pair: &Pair,
) -> Result<Option<dpb::generate_response::Event>, Status> {
    match msg {
        Ok(Some(m)) => Ok(m.event),
        Ok(None) => {
            telemetry::mark_error(pair.decode_rpc.span(), "stream ended without finishing");
            Err(Error::DecodeEnded.into())
        }
        Err(e) => {
            telemetry::record_status(pair.decode_rpc.span(), Some(&e));
            Err(decode_failure(e))
        }
    }
}
