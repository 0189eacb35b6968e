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

use pdmesh_core::telemetry;

use crate::batcher::Batcher;
use crate::error::Error;
use pdmesh_core::vocab::rpc;
use pdmesh_worker::kv::ship::{self, Shipper};

pub struct Service {
    pub batcher: Batcher,
    /// Claims tickets and writes the KV (NIXL when it loaded, else TCP).
    pub ship: Shipper,
    pub broker: Peers,
    /// How far each renewal extends the ticket's lease while the prompt waits, in ms.
    pub lease_renew_ms: u64,
}

impl Service {
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
        let (n_tokens, n_blocks) = (pinned.p.n_tokens as u32, pinned.p.blocks.len());
        let (ticket, mut broker, xfer) = self.ship.claim_for(&r.request_id, n_tokens, n_blocks).await?;
        let r2 = self.transfer(ticket, pinned, first, &mut broker).instrument(xfer.clone()).await;
        let r2 = r2.map(|resp| pb::PrefillResponse { cached_tokens, ..resp });
        if let Err(e) = &r2 {
            telemetry::mark_error(&xfer, e.message());
        }
        r2
    }

    /// Ship the pinned prompt KV into the ticket's blocks, then free ours.
    async fn transfer(
        &self,
        ticket: kpb::Ticket,
        pinned: crate::batcher::Pinned,
        first: u32,
        broker: &mut pdmesh_worker::BrokerClient,
    ) -> Result<pb::PrefillResponse, Status> {
        let faults = ship::Faults {
            stall_ms: pdmesh_core::faults::get("prefill.transfer_delay_ms"),
            corrupt: pdmesh_core::faults::take("prefill.kv_corrupt"),
        };
        let st = &self.batcher.stats;
        let written = |s: &ship::Shipped| {
            st.transfer_seconds.observe(s.write_secs);
            st.transfer_bytes.fetch_add(s.bytes, Ordering::Relaxed);
            if s.transport == "nixl" { &st.transfers_nixl } else { &st.transfers_tcp }.fetch_add(1, Ordering::Relaxed);
        };
        let shipped = self.ship.ship(ticket, &pinned, first, broker, (faults, written)).await;
        drop(pinned);
        let s = shipped?;
        Ok(pb::PrefillResponse {
            first_token: first,
            kv_bytes: s.bytes,
            transport: s.transport.into(),
            cached_tokens: 0,
        })
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
            stalled_ms: self.batcher.alive.stalled().as_millis() as u32,
            step_ms: st.step_costs.recent_ms(),
        }))
    }
}
