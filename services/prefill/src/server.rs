//! The Prefill gRPC handlers: queue the prompt for a batched forward step,
//! claim the transfer ticket, write the KV into the decode worker's
//! reserved blocks (TCP transport: a WriteKv stream), complete the ticket.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pdmesh_core::metrics::Outcome;
use pdmesh_core::peers::Peers;

use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::prefill::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use pdmesh_core::telemetry::{self, SpanExt};

use crate::batcher::Batcher;
use crate::error::{claim_failure, ended, Error};
use pdmesh_core::vocab::{attr, rpc, span};
use pdmesh_worker::kv::send::KvTransport;

/// Least lease time left for a KV write to start, in milliseconds.
const WRITE_MARGIN_MS: u64 = 500;

pub struct Service {
    pub batcher: Batcher,
    /// In order of preference: NIXL (when it loaded), then TCP.
    pub transports: Vec<Box<dyn KvTransport>>,
    pub broker: Peers,
    pub worker_id: String,
    pub claim_timeout: Duration,
    /// How far each renewal extends the ticket's lease while the prompt waits, in ms.
    pub lease_renew_ms: u64,
}

impl Service {
    /// The decode worker's transfer endpoint, asked of the broker for every
    /// transfer (a restarted decode keeps its id but has a new arena and
    /// NIXL agent). A broker that restarted learns each worker again within
    /// one registration period: until then it is asked again.
    async fn agent(&self, broker: &mut pdmesh_worker::BrokerClient, worker: &str) -> Result<kpb::Agent, Status> {
        let until = Instant::now() + pdmesh_worker::REGISTER_EVERY + pdmesh_worker::BROKER_RETRY;
        loop {
            let (req, span) =
                telemetry::client_request(rpc::KVBROKER_GET_AGENT, kpb::GetAgentRequest { worker_id: worker.into() });
            let r = broker.get_agent(req).instrument(span.clone()).await;
            match telemetry::finish(&span, r) {
                Ok(a) => return Ok(a.into_inner()),
                Err(e) if e.code() == tonic::Code::NotFound && Instant::now() < until => {
                    tokio::time::sleep(pdmesh_worker::BROKER_RETRY).await
                }
                Err(e) => {
                    return Err(Error::UnknownDestination { worker: worker.into(), why: e.message().into() }.into())
                }
            }
        }
    }

    /// Claim the transfer ticket, waiting (up to `--claim-timeout`) for the
    /// decode worker to open it. A kvbroker lost meanwhile (killed, then
    /// restarted by its supervisor) is asked again: the decode opens its
    /// ticket again there, since no transfer had begun.
    async fn claim(&self, request_id: &str) -> Result<(kpb::Ticket, pdmesh_worker::BrokerClient), Status> {
        let req = kpb::ClaimTicketRequest { request_id: request_id.to_string(), source_worker: self.worker_id.clone() };
        let mut tries = 0;
        let claimed = pdmesh_worker::at_broker(&self.broker, self.claim_timeout, |mut b, left| {
            tries += 1;
            let (mut claim, span) = telemetry::client_request(rpc::KVBROKER_CLAIM_TICKET, req.clone());
            claim.set_timeout(left);
            async move { b.claim_ticket(claim).instrument(span).await.map(Response::into_inner) }
        })
        .await;
        if tries > 1 {
            tracing::Span::current().set_attribute(attr::TICKET_RECLAIMED, i64::from(tries - 1));
        }
        claimed.map_err(|e| claim_failure(e).into())
    }

    async fn run(&self, r: pb::PrefillRequest, deadline: Option<Instant>) -> Result<pb::PrefillResponse, Status> {
        if r.request_id.is_empty() {
            return Err(Error::BadRequest("request_id is required").into());
        }
        let params = pdmesh_worker::sampling(r.sampling.as_ref(), 1, &[], true, &[]);
        // While the prompt waits and runs, keep the decode's reservation
        // alive: this worker is alive and will write. If it dies, renewals
        // stop and the lease frees the decode's blocks.
        let job = self.batcher.prefill(r.prompt_ids, params, deadline);
        tokio::pin!(job);
        let period = Duration::from_millis((self.lease_renew_ms / 4).max(50));
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let pinned = loop {
            tokio::select! {
                p = &mut job => break p.map_err(|e| pdmesh_worker::status(&e))?,
                _ = renew.tick() => self.renew(&r.request_id).await,
            }
        };
        let first = pinned.p.first_token;
        let cached_tokens = pinned.p.cached_tokens as u32;
        let (ticket, mut broker) = self.claim(&r.request_id).await?;
        if ticket.n_tokens as usize != pinned.p.n_tokens {
            let why = format!("decode reserved {} positions, prefill has {}", ticket.n_tokens, pinned.p.n_tokens);
            let _ = broker.complete_ticket(fail(&r.request_id, &why)).await;
            return Err(Error::Mismatch(why).into());
        }
        // `kv_transfer`: finding the destination, the write itself, completing the ticket.
        let xfer = tracing::info_span!(
            span::KV_TRANSFER,
            { attr::KV_TRANSPORT } = tracing::field::Empty,
            { attr::KV_BYTES } = tracing::field::Empty,
            { attr::KV_BLOCKS } = pinned.p.blocks.len() as i64,
            { attr::KV_TOKENS } = pinned.p.n_tokens as i64,
            { attr::KV_DEST_WORKER } = ticket.dest_worker.as_str(),
            { attr::KV_WRITE_MS } = tracing::field::Empty,
            { attr::KV_GBPS } = tracing::field::Empty,
            { attr::FAULT_STALL_MS } = tracing::field::Empty,
        );
        let r2 = self.transfer(&r.request_id, ticket, pinned, first, &mut broker).instrument(xfer.clone()).await;
        let r2 = r2.map(|resp| pb::PrefillResponse { cached_tokens, ..resp });
        if let Err(e) = &r2 {
            telemetry::mark_error(&xfer, e.message());
        }
        r2
    }

    async fn transfer(
        &self,
        request_id: &str,
        ticket: kpb::Ticket,
        pinned: crate::batcher::Pinned,
        first: u32,
        broker: &mut pdmesh_worker::BrokerClient,
    ) -> Result<pb::PrefillResponse, Status> {
        let span = tracing::Span::current();
        let agent = self.agent(broker, &ticket.dest_worker).await?;
        let transport = self
            .transports
            .iter()
            .find(|t| t.reaches(&agent))
            .ok_or_else(|| Error::NoTransport(ticket.dest_worker.clone()))?;
        span.record(attr::KV_TRANSPORT, transport.name());
        let stall = pdmesh_core::faults::get("prefill.transfer_delay_ms");
        if stall > 0 {
            span.record(attr::FAULT_STALL_MS, stall as i64);
        }
        if stall > 0 {
            // While stalled, follow the ticket: if it ends, give up at once.
            let watch = broker.watch_ticket(kpb::WatchTicketRequest { request_id: request_id.to_string() }).await;
            let mut watch = watch.map_err(|_| Error::BrokerUnreachable)?.into_inner();
            let ended = async {
                while let Ok(Some(t)) = watch.message().await {
                    let s = kpb::TicketState::try_from(t.state).unwrap_or(kpb::TicketState::Unspecified);
                    let why = format!("transfer ticket {} while the write was pending: {}", s.as_str_name(), t.reason);
                    if matches!(s, kpb::TicketState::Expired | kpb::TicketState::Cancelled | kpb::TicketState::Failed) {
                        return Status::from(Error::TicketEnded(s, why));
                    }
                }
                std::future::pending::<Status>().await
            };
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(stall)) => {}
                e = ended => return Err(e),
            }
        }
        // Never start a write the lease may not cover: once it expires the
        // decode frees (and may reuse) the destination blocks.
        let now = pdmesh_core::now_ms();
        if ticket.lease_deadline_unix_ms < now + WRITE_MARGIN_MS {
            let why = format!(
                "transfer lease ends in {} ms; not starting the write",
                ticket.lease_deadline_unix_ms.saturating_sub(now)
            );
            let _ = broker.complete_ticket(fail(request_id, &why)).await;
            return Err(Error::LeaseEnding(why).into());
        }
        let (begin, bspan) = telemetry::client_request(
            rpc::KVBROKER_BEGIN_WRITE,
            kpb::BeginWriteRequest { request_id: request_id.to_string() },
        );
        let begun = broker.begin_write(begin).instrument(bspan.clone()).await;
        telemetry::finish(&bspan, begun).map_err(|e| ended("transfer ticket ended before the write began", &e))?;
        let t0 = Instant::now();
        let moved = transport.write(&agent, &ticket, &pinned).await;
        drop(pinned); // the KV is in the decode's blocks (or failed): free ours
        let name = transport.name();
        match moved {
            Ok(bytes) => {
                let st = &self.batcher.stats;
                let secs = t0.elapsed().as_secs_f64();
                span.record(attr::KV_BYTES, bytes as i64);
                span.record(attr::KV_WRITE_MS, secs * 1e3);
                span.record(attr::KV_GBPS, bytes as f64 / secs.max(1e-9) / 1e9);
                st.transfer_seconds.observe(secs);
                st.transfer_bytes.fetch_add(bytes, Ordering::Relaxed);
                if name == "nixl" { &st.transfers_nixl } else { &st.transfers_tcp }.fetch_add(1, Ordering::Relaxed);
                let done = kpb::CompleteTicketRequest {
                    request_id: request_id.to_string(),
                    outcome: Some(kpb::complete_ticket_request::Outcome::FirstToken(first)),
                    bytes,
                };
                let (done, cspan) = telemetry::client_request(rpc::KVBROKER_COMPLETE_TICKET, done);
                let completed = broker.complete_ticket(done).instrument(cspan.clone()).await;
                telemetry::finish(&cspan, completed).map_err(|e| ended("ticket could not be completed", &e))?;
                Ok(pb::PrefillResponse {
                    first_token: first,
                    kv_bytes: bytes,
                    transport: name.into(),
                    cached_tokens: 0,
                })
            }
            Err(e) => {
                let why = format!("writing the KV to {} over {name} failed: {}", ticket.dest_worker, e.message());
                let _ = broker.complete_ticket(fail(request_id, &why)).await;
                Err(Error::WriteFailed(why).into())
            }
        }
    }

    /// Best effort: the ticket may not be open yet, or gone.
    async fn renew(&self, request_id: &str) {
        let Ok(mut b) = pdmesh_worker::broker(&self.broker, Duration::from_millis(200)).await else { return };
        let (mut req, span) = telemetry::client_request(
            rpc::KVBROKER_RENEW_LEASE,
            kpb::RenewLeaseRequest { request_id: request_id.into(), lease_ms: self.lease_renew_ms as u32 },
        );
        req.set_timeout(Duration::from_secs(1));
        let r = b.renew_lease(req).instrument(span.clone()).await;
        let _ = telemetry::finish(&span, r);
    }
}

fn fail(request_id: &str, why: &str) -> kpb::CompleteTicketRequest {
    kpb::CompleteTicketRequest {
        request_id: request_id.into(),
        outcome: Some(kpb::complete_ticket_request::Outcome::Failure(why.into())),
        bytes: 0,
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Service {
    async fn prefill(&self, req: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let span = tracing::Span::current();
        let deadline = pdmesh_core::grpc::request_timeout(&req).map(|t| Instant::now() + t);
        let r = self.run(req.into_inner(), deadline).instrument(span.clone()).await;
        let r = telemetry::finish(&span, r);
        let code = r.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(|e| e.code());
        self.batcher.stats.outcomes.inc(Outcome::of_code(code));
        r.map(Response::new)
    }

    async fn load(&self, req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadResponse>, Status> {
        let st = &self.batcher.stats;
        let req = req.into_inner();
        Ok(Response::new(pb::LoadResponse {
            running: st.running.load(Ordering::Relaxed),
            queued: st.queued.load(Ordering::Relaxed),
            kv_blocks_used: st.kv_used.load(Ordering::Relaxed),
            kv_blocks_total: st.kv_total.load(Ordering::Relaxed),
            prefix_cache: st.prefix.delta(req.cache_epoch, req.cache_seq),
            queued_tokens: st.queued_tokens.load(Ordering::Relaxed),
            expected_wait_ms: st.expected_wait_ms.load(Ordering::Relaxed),
        }))
    }
}
