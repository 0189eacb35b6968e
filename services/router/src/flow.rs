//! One request's flow: tokenize, dispatch to a prefill and a decode worker
//! ([`crate::dispatch`]), relay detokenized deltas ([`crate::relay`]),
//! retry elsewhere when a worker fails before the first token — or end
//! with one clear status, cancelling the KV transfer so both workers free
//! their blocks.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_core::grpc::peer_lost;
use pdmesh_core::metrics::Outcome;
use pdmesh_core::telemetry::{self, KeyValue, SpanExt};
use pdmesh_core::vocab::{attr, event, rpc, span};
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::router::v1 as pb;
use pdmesh_proto::tokenizer::v1 as tpb;
use tonic::transport::Channel;
use tonic::Request;
use tonic::Status;
use tracing::Instrument;

use crate::dispatch::{Avoid, Handover};
use crate::error::Error;
use crate::relay::{Failed, Out};
use crate::state::{Router, Tx, PEER_RETRY, PEER_WAIT};
use crate::validate::{check_fits, fit_max_tokens, Input, Job};

impl Router {
    pub fn tokenizer_client(&self) -> Result<tpb::tokenizer_client::TokenizerClient<Channel>, Status> {
        let list = self.tokenizer.instances();
        let inst = list.first().ok_or_else(|| Error::NoWorker("tokenizer".into()))?;
        Ok(tpb::tokenizer_client::TokenizerClient::new(self.tokenizer.channel(inst).map_err(Error::Internal)?))
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

    /// The prompt's ids from the tokenizer. Encoding has no side effects:
    /// a tokenizer that cannot be reached (killed, restarting) is asked
    /// again, the restarted one or another, for up to `PEER_WAIT` within
    /// the deadline.
    async fn encode(&self, input: Input, deadline: Option<Instant>) -> Result<Vec<u32>, Status> {
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
        let encode = tpb::EncodeRequest { input: Some(input), parse_special: false };
        let until = Instant::now() + PEER_WAIT;
        let r = loop {
            let _ = self.tokenizer.wait_any(until.saturating_duration_since(Instant::now())).await;
            let r = match self.tokenizer_client() {
                Ok(mut c) => {
                    let (mut req, span) = telemetry::client_request(rpc::TOKENIZER_ENCODE, encode.clone());
                    crate::dispatch::set_deadline(&mut req, deadline);
                    let r = c.encode(req).instrument(span.clone()).await;
                    telemetry::finish(&span, r)
                }
                Err(e) => Err(e),
            };
            let again = Instant::now() + PEER_RETRY;
            match r {
                Err(e) if peer_lost(&e) && again < until && deadline.is_none_or(|d| again < d) => {
                    tokio::time::sleep(PEER_RETRY).await
                }
                r => break r,
            }
        };
        let r = r.map_err(|e| match e.code() {
            // Our own timeout, or the tokenizer enforcing the deadline we sent it.
            _ if crate::error::timed_out(&e)
                || matches!(e.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded)
                    && deadline
                        .is_some_and(|d| d.saturating_duration_since(Instant::now()) < Duration::from_millis(20)) =>
            {
                Error::Deadline("the request's deadline passed while tokenizing".into()).into()
            }
            tonic::Code::InvalidArgument => e,
            _ if peer_lost(&e) => Error::Tokenizer("the tokenizer could not be reached").into(),
            // The detail is on the Encode span; the client hears what failed.
            _ => Error::Tokenizer("the tokenizer failed").into(),
        })?;
        Ok(r.into_inner().ids)
    }

    /// The `tokenize` span: the model's context length and the prompt's ids.
    async fn tokenize(&self, input: Input, deadline: Option<Instant>) -> Result<(u32, Vec<u32>), Status> {
        let tokenize = tracing::info_span!(span::TOKENIZE, { attr::PROMPT_TOKENS } = tracing::field::Empty);
        async {
            let context = self.model_info().await?.context_length;
            let prompt = self.encode(input, deadline).await?;
            tracing::Span::current().record(attr::PROMPT_TOKENS, prompt.len() as i64);
            Ok((context, prompt))
        }
        .instrument(tokenize)
        .await
    }

    pub async fn cancel_ticket(&self, request_id: &str, reason: &str) {
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

    /// Run one validated request, sending events to `tx`. `ticket` holds
    /// the ticket id in use, so the caller can cancel it when this fails.
    /// A prefill or decode worker that fails before the first token reached
    /// the caller is avoided on another dispatch (up to `--retries` times).
    async fn run(&self, input: Input, mut job: Job, tx: &Tx, ticket: &Mutex<String>) -> Result<(), Status> {
        let started = Instant::now();
        let (context, prompt) = self.tokenize(input, job.deadline).await?;
        if job.max_tokens_to_fit {
            job.max_tokens = fit_max_tokens(prompt.len(), job.max_tokens, context);
        }
        check_fits(prompt.len(), job.max_tokens, context)?;
        let mut out = Out::new(job.stop.clone(), prompt.len() as u32, started);
        if !job.replay.is_empty() {
            self.resume(&mut out, &job.replay).await?;
        }
        let mut tries = Tries::default();
        let mut workers = [String::new(), String::new()];
        loop {
            // A migrated request goes on from the tokens it already sent.
            let job_now = continued(&job, &out.generated);
            if out.generated.len() >= job.max_tokens as usize {
                return self.conclude(&mut out, tx, &workers).await;
            }
            let handing = tries.handover.is_some();
            let dispatched = match self.dispatch(&job_now, &prompt, ticket, &tries.avoid, tries.handover.take()).await {
                Ok(d) => d,
                Err(e) if handing => {
                    self.handover_failed(&e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if handing {
                self.metrics.handovers.fetch_add(1, Ordering::Relaxed);
                tracing::Span::current().set_attribute(attr::HANDOVERS, i64::from(tries.migrations));
            }
            workers = dispatched.pair.workers.clone();
            let addrs = (dispatched.prefill_addr.clone(), (dispatched.decode_addr.clone(), workers[1].clone()));
            let sent = out.generated.len();
            let failed = match self.relay(dispatched, &mut out, tx).await {
                Ok(()) => return Ok(()),
                Err(f) => f,
            };
            let handover_failed = handing && out.generated.len() == sent;
            self.on_failed(failed, handover_failed, addrs, &mut tries, ticket, out.generated.len()).await?;
        }
    }

    /// After a failed relay: `Ok` to dispatch again (on another worker, as a
    /// migration, as a replay of a handover that failed before a token), or
    /// the request's error. `sent`: tokens at the caller.
    async fn on_failed(
        &self,
        failed: Failed,
        handover_failed: bool,
        (prefill, (decode, decode_id)): (Option<String>, (String, String)),
        t: &mut Tries,
        ticket: &Mutex<String>,
        sent: usize,
    ) -> Result<(), Status> {
        let (e, counter, attr_key) = match failed {
            Failed::Other(e) => return Err(e),
            // The shipment of a handed-over sequence, or the worker taking
            // it, failed before it sent a token: replay the tokens instead
            // (no retry used up; a worker that died is found out then).
            Failed::Prefill(e, _) | Failed::Decode(e, _) | Failed::Migrate(e) if handover_failed => {
                let id = ticket.lock().unwrap_or_else(|e| e.into_inner()).clone();
                self.cancel_ticket(&id, "the handed-over sequence's KV did not arrive; replaying it").await;
                self.handover_failed(&e);
                return Ok(());
            }
            Failed::Migrate(e) => {
                let why = pdmesh_core::grpc::status_text(&e);
                return if self.migrate(t, (decode, decode_id), ticket, (sent, &why)).await { Ok(()) } else { Err(e) };
            }
            Failed::HandingOver(h) => {
                if !self.migrate(t, (decode, decode_id), ticket, (sent, "draining")).await {
                    return Err(Error::DecodeDraining.into());
                }
                t.handover = Some(*h);
                return Ok(());
            }
            Failed::Prefill(e, lost) => {
                t.avoid.prefill.extend(prefill);
                t.avoid.lost[0] |= lost;
                (e, &self.metrics.prefill_retries, attr::PREFILL_RETRIES)
            }
            // The prompt's KV failed its checksum: transfer it once more,
            // then have a decode worker prefill it itself (no transfer left
            // to corrupt). Not a worker's death: no worker is avoided and no
            // retry used up.
            Failed::Decode(e, _) if crate::error::is_kv_corrupt(&e) && t.corrupt < 2 => {
                t.corrupt += 1;
                t.avoid.no_transfer = t.corrupt >= 2;
                let id = ticket.lock().unwrap_or_else(|e| e.into_inner()).clone();
                self.cancel_ticket(&id, "its KV failed the checksum; transferring again").await;
                self.metrics.kv_corrupt_retries.fetch_add(1, Ordering::Relaxed);
                tracing::Span::current().set_attribute(attr::KV_CORRUPT_RETRIES, i64::from(t.corrupt));
                return Ok(());
            }
            Failed::Decode(e, lost) => {
                t.avoid.decode.push(decode);
                t.avoid.lost[1] |= lost;
                (e, &self.metrics.decode_retries, attr::DECODE_RETRIES)
            }
        };
        if t.retries >= self.retries {
            return Err(e);
        }
        t.retries += 1;
        let id = ticket.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.cancel_ticket(&id, "a worker failed; retrying elsewhere").await;
        counter.fetch_add(1, Ordering::Relaxed);
        // The failed attempt's worker span holds the cause; this says it was retried.
        tracing::Span::current().set_attribute(attr_key, i64::from(t.retries));
        Ok(())
    }

    /// Move the request off decode worker `decode` (its address and id: a
    /// draining worker has left discovery by now), unless it has moved
    /// `--max-migrations` times already (false).
    /// `how`: the tokens sent by then, and how the worker's call ended
    /// (its status, or `draining`).
    async fn migrate(
        &self,
        t: &mut Tries,
        (decode, name): (String, String),
        ticket: &Mutex<String>,
        how: (usize, &str),
    ) -> bool {
        if t.migrations >= self.max_migrations {
            return false;
        }
        t.migrations += 1;
        self.migrated(ticket, t.migrations, how.0).await;
        // The request's span says which worker, after how many tokens and how.
        tracing::Span::current().add_event(
            event::DECODE_MIGRATION,
            vec![
                KeyValue::new(attr::FAILOVER_FROM, name),
                KeyValue::new(attr::FAILOVER_AFTER_TOKENS, how.0 as i64),
                KeyValue::new(attr::FAILOVER_STATUS, how.1.to_string()),
            ],
        );
        t.avoid.decode.push(decode);
        true
    }

    /// A handed-over sequence goes on by replay after all: counted, and on
    /// the request's span with the cause.
    fn handover_failed(&self, e: &Status) {
        self.metrics.handover_fallbacks.fetch_add(1, Ordering::Relaxed);
        tracing::Span::current().set_attribute(attr::HANDOVER_FAILED, e.message().to_string());
    }

    /// Book a migration: the lost worker's ticket cancelled, the count and
    /// the tokens sent by then on the request's span, and the metric.
    async fn migrated(&self, ticket: &Mutex<String>, migrations: u32, sent: usize) {
        let id = ticket.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.cancel_ticket(&id, "its decode worker was lost; continuing elsewhere").await;
        self.metrics.migrations.fetch_add(1, Ordering::Relaxed);
        let span = tracing::Span::current();
        span.set_attribute(attr::MIGRATIONS, i64::from(migrations));
        span.set_attribute(attr::MIGRATED_AFTER_TOKENS, sent as i64);
    }

    /// Run `job` within `deadline` or until the caller goes away; on failure
    /// cancel its ticket and send the status; count it in the metrics.
    pub(crate) async fn serve(self: Arc<Self>, input: Input, mut job: Job, deadline: Duration, tx: Tx) {
        let t0 = Instant::now();
        job.deadline = Some(t0 + deadline);
        let ticket = Mutex::new(String::new());
        let r = tokio::select! {
            r = tokio::time::timeout(deadline, self.run(input, job, &tx, &ticket)) => r.unwrap_or_else(|_| {
                Err(Error::Deadline(format!(
                    "request did not finish within its deadline of {:.1} s",
                    deadline.as_secs_f64()
                ))
                .into())
            }),
            _ = tx.closed() => Err(Error::ClientGone.into()),
        };
        let code = r.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(|e| e.code());
        if let Err(e) = r {
            let id = ticket.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if !id.is_empty() {
                self.cancel_ticket(&id, e.message()).await;
            }
            let _ = tx.send(Err(e)).await;
        }
        let trace_id = telemetry::trace_id(&tracing::Span::current());
        self.metrics.e2e.observe_traced(t0.elapsed().as_secs_f64(), trace_id.as_deref());
        self.metrics.outcomes.inc(Outcome::of_code(code));
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        let span = tracing::Span::current();
        span.record(attr::RPC_STATUS_CODE, code as i64);
        if code != tonic::Code::Ok {
            telemetry::mark_error(&span, &format!("{code:?}"));
        }
    }

    pub(crate) fn fresh_request_id(&self) -> String {
        format!("req-{:x}-{}", std::process::id(), self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

/// What a request's dispatches have met so far.
#[derive(Default)]
struct Tries {
    /// Workers that failed it.
    avoid: Avoid,
    retries: u32,
    migrations: u32,
    /// Transfers whose KV failed its checksum.
    corrupt: u32,
    /// A draining decode worker's parked sequence, to ship to the next one.
    handover: Option<Handover>,
}

/// The job of a request continued after `sent` tokens (a migration, or a
/// resumed request): a decode worker replays them (computing their KV as
/// the lost worker's decode steps did, so what follows is what it would
/// have sent) and goes on.
fn continued(job: &Job, sent: &[u32]) -> Job {
    Job { replay: sent.to_vec(), ..job.clone() }
}
