//! Shipping KV into the blocks a transfer ticket names, for any worker that
//! holds KV another needs: a prefill worker (a prompt it computed) and a
//! draining decode worker (a sequence it hands over). Claim the ticket,
//! find the destination's endpoint, write over the first transport that
//! reaches it, complete the ticket with the blocks' checksums and the
//! token the destination goes on from.

use std::time::{Duration, Instant};

use pdmesh_core::peers::Peers;
use pdmesh_core::telemetry::{self, SpanExt};
use pdmesh_core::vocab::{attr, rpc, span, LEASE_EXPIRED};
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::kvbroker::v1::TicketState;
use tonic::{Response, Status};
use tracing::Instrument;

use super::send::{KvSource, KvTransport, Write};
use crate::broker::{at_broker, BrokerClient, BROKER_RETRY, REGISTER_EVERY};

/// Least lease time left for a KV write to start, in milliseconds.
const WRITE_MARGIN_MS: u64 = 500;

/// Why KV could not be shipped, each mapped once to its gRPC status.
/// Messages may name workers and transports (for operators); never prompt text.
#[derive(Debug)]
pub enum ShipError {
    /// The destination's transfer endpoint is unknown to the kvbroker.
    UnknownDestination { worker: String, why: String },
    /// No KV transport of this worker reaches the destination.
    NoTransport(String),
    /// No decode worker opened the transfer ticket within the claim timeout.
    NotOpened,
    /// The ticket ended (cancelled, expired, failed) before the KV was written.
    TicketEnded(TicketState, String),
    /// The ticket asks for what this worker does not have (its positions).
    Mismatch(String),
    /// The lease ends too soon for a write to start.
    LeaseEnding(String),
    /// The kvbroker could not be reached.
    BrokerUnreachable,
    /// The KV write itself failed.
    WriteFailed(String),
}

impl From<ShipError> for Status {
    fn from(e: ShipError) -> Status {
        use ShipError::*;
        match e {
            UnknownDestination { worker, why } => {
                Status::unavailable(format!("decode worker {worker} is unknown to the kvbroker: {why}"))
            }
            NoTransport(w) => Status::failed_precondition(format!("no transport reaches decode worker {w}")),
            NotOpened => Status::deadline_exceeded("no decode worker opened the transfer ticket in time"),
            // The same status the decode reports for this ticket: the mesh's
            // fault (this write was too late), never the caller's deadline.
            TicketEnded(TicketState::Expired, why) => Status::unavailable(format!("{LEASE_EXPIRED}: {why}")),
            TicketEnded(TicketState::Cancelled, why) => Status::cancelled(why),
            TicketEnded(_, why) | Mismatch(why) => Status::failed_precondition(why),
            LeaseEnding(why) => Status::deadline_exceeded(why),
            BrokerUnreachable => Status::unavailable("the kvbroker could not be reached"),
            WriteFailed(why) => Status::unavailable(why),
        }
    }
}

/// A broker call that failed once the ticket was ours: it ended meanwhile.
pub fn ended(what: &str, e: &Status) -> ShipError {
    ShipError::TicketEnded(TicketState::Failed, format!("{what}: {}", e.message()))
}

/// The status of a claim that failed for good.
fn claim_failure(e: Status) -> ShipError {
    match e.code() {
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => ShipError::NotOpened,
        tonic::Code::FailedPrecondition => ended("transfer ticket ended before the KV was written", &e),
        _ => ShipError::BrokerUnreachable,
    }
}

/// A ticket's failure, for `CompleteTicket`.
pub fn fail(request_id: &str, why: &str) -> kpb::CompleteTicketRequest {
    kpb::CompleteTicketRequest {
        request_id: request_id.into(),
        outcome: Some(kpb::complete_ticket_request::Outcome::Failure(why.into())),
        ..Default::default()
    }
}

/// What a worker ships KV with.
pub struct Shipper {
    /// In order of preference: NIXL (when it loaded), then TCP.
    pub transports: Vec<Box<dyn KvTransport>>,
    pub broker: Peers,
    pub worker_id: String,
    /// How long a claim waits for the destination to open the ticket.
    pub claim_timeout: Duration,
}

/// One shipment, done.
pub struct Shipped {
    pub bytes: u64,
    /// "nixl" or "tcp".
    pub transport: &'static str,
    pub write_secs: f64,
}

/// Test-only faults on a shipment.
#[derive(Clone, Copy, Default)]
pub struct Faults {
    /// Hold the write this long first (giving up at once if the ticket ends).
    pub stall_ms: u64,
    /// Flip one byte on the way, after the checksums were taken.
    pub corrupt: bool,
}

impl Shipper {
    /// The destination's transfer endpoint, asked of the broker for every
    /// transfer (a restarted decode keeps its id but has a new arena and
    /// NIXL agent). A broker that restarted learns each worker again within
    /// one registration period: until then it is asked again.
    async fn agent(&self, broker: &mut BrokerClient, worker: &str) -> Result<kpb::Agent, Status> {
        let until = Instant::now() + REGISTER_EVERY + BROKER_RETRY;
        loop {
            let (req, span) =
                telemetry::client_request(rpc::KVBROKER_GET_AGENT, kpb::GetAgentRequest { worker_id: worker.into() });
            let r = broker.get_agent(req).instrument(span.clone()).await;
            match telemetry::finish(&span, r) {
                Ok(a) => return Ok(a.into_inner()),
                Err(e) if e.code() == tonic::Code::NotFound && Instant::now() < until => {
                    tokio::time::sleep(BROKER_RETRY).await
                }
                Err(e) => {
                    return Err(ShipError::UnknownDestination { worker: worker.into(), why: e.message().into() }.into())
                }
            }
        }
    }

    /// Claim the transfer ticket, waiting (up to the claim timeout) for the
    /// decode worker to open it. A kvbroker lost meanwhile (killed, then
    /// restarted by its supervisor) is asked again: the decode opens its
    /// ticket again there, since no transfer had begun.
    pub async fn claim(&self, request_id: &str) -> Result<(kpb::Ticket, BrokerClient), Status> {
        let req = kpb::ClaimTicketRequest { request_id: request_id.to_string(), source_worker: self.worker_id.clone() };
        let mut tries = 0;
        let claimed = at_broker(&self.broker, self.claim_timeout, |mut b, left| {
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

    /// [`Shipper::claim`], then check the ticket asks for the `n_tokens`
    /// positions this worker has (else fail it), and open the
    /// `kv_transfer` span the shipment runs under.
    pub async fn claim_for(
        &self,
        request_id: &str,
        n_tokens: u32,
        n_blocks: usize,
    ) -> Result<(kpb::Ticket, BrokerClient, tracing::Span), Status> {
        let (ticket, mut broker) = self.claim(request_id).await?;
        if ticket.n_tokens != n_tokens {
            let why = format!("the receiver reserved {} positions, the sender has {n_tokens}", ticket.n_tokens);
            let _ = broker.complete_ticket(fail(request_id, &why)).await;
            return Err(ShipError::Mismatch(why).into());
        }
        // Finding the destination, the write itself, completing the ticket.
        let xfer = tracing::info_span!(
            span::KV_TRANSFER,
            { attr::KV_TRANSPORT } = tracing::field::Empty,
            { attr::KV_BYTES } = tracing::field::Empty,
            { attr::KV_BLOCKS } = n_blocks as i64,
            { attr::KV_TOKENS } = i64::from(n_tokens),
            { attr::KV_DEST_WORKER } = ticket.dest_worker.as_str(),
            { attr::KV_WRITE_MS } = tracing::field::Empty,
            { attr::KV_GBPS } = tracing::field::Empty,
            { attr::FAULT_STALL_MS } = tracing::field::Empty,
        );
        Ok((ticket, broker, xfer))
    }

    /// Write `src` into the claimed `ticket`'s blocks and complete it with
    /// `next_token` (what the destination goes on from) and the source's
    /// checksums; a failed write fails the ticket. Records the transport,
    /// bytes and write time on the current (`kv_transfer`) span, and hands
    /// them to `written` before the ticket completes (so a worker's
    /// counters include a transfer before its destination can go on).
    pub async fn ship(
        &self,
        ticket: kpb::Ticket,
        src: &dyn KvSource,
        next_token: u32,
        broker: &mut BrokerClient,
        (faults, written): (Faults, impl FnOnce(&Shipped) + Send),
    ) -> Result<Shipped, Status> {
        let request_id = ticket.request_id.clone();
        let span = tracing::Span::current();
        let agent = self.agent(broker, &ticket.dest_worker).await?;
        let transport = self
            .transports
            .iter()
            .find(|t| t.reaches(&agent))
            .ok_or_else(|| ShipError::NoTransport(ticket.dest_worker.clone()))?;
        span.record(attr::KV_TRANSPORT, transport.name());
        if faults.stall_ms > 0 {
            span.record(attr::FAULT_STALL_MS, faults.stall_ms as i64);
            stall(broker, &request_id, faults.stall_ms).await?;
        }
        begin_write(broker, &ticket).await?;
        let t0 = Instant::now();
        let moved = transport.write(Write { agent: &agent, ticket: &ticket, src, corrupt: faults.corrupt }).await;
        let name = transport.name();
        let bytes = match moved {
            Ok(bytes) => bytes,
            Err(e) => {
                let why = format!("writing the KV to {} over {name} failed: {}", ticket.dest_worker, e.message());
                let _ = broker.complete_ticket(fail(&request_id, &why)).await;
                return Err(ShipError::WriteFailed(why).into());
            }
        };
        let secs = t0.elapsed().as_secs_f64();
        span.record(attr::KV_BYTES, bytes as i64);
        span.record(attr::KV_WRITE_MS, secs * 1e3);
        span.record(attr::KV_GBPS, bytes as f64 / secs.max(1e-9) / 1e9);
        let shipped = Shipped { bytes, transport: name, write_secs: secs };
        written(&shipped);
        let done = kpb::CompleteTicketRequest {
            request_id,
            outcome: Some(kpb::complete_ticket_request::Outcome::FirstToken(next_token)),
            bytes,
            block_crc32c: src.checksums().to_vec(),
        };
        let (done, cspan) = telemetry::client_request(rpc::KVBROKER_COMPLETE_TICKET, done);
        let completed = broker.complete_ticket(done).instrument(cspan.clone()).await;
        telemetry::finish(&cspan, completed).map_err(|e| ended("ticket could not be completed", &e))?;
        Ok(shipped)
    }
}

/// Never start a write the lease may not cover (once it expires the decode
/// frees, and may reuse, the destination blocks); then say the write begins.
async fn begin_write(broker: &mut BrokerClient, ticket: &kpb::Ticket) -> Result<(), Status> {
    let request_id = &ticket.request_id;
    let now = pdmesh_core::now_ms();
    if ticket.lease_deadline_unix_ms < now + WRITE_MARGIN_MS {
        let why = format!(
            "transfer lease ends in {} ms; not starting the write",
            ticket.lease_deadline_unix_ms.saturating_sub(now)
        );
        let _ = broker.complete_ticket(fail(request_id, &why)).await;
        return Err(ShipError::LeaseEnding(why).into());
    }
    let (begin, bspan) = telemetry::client_request(
        rpc::KVBROKER_BEGIN_WRITE,
        kpb::BeginWriteRequest { request_id: request_id.to_string() },
    );
    let begun = broker.begin_write(begin).instrument(bspan.clone()).await;
    telemetry::finish(&bspan, begun).map_err(|e| ended("transfer ticket ended before the write began", &e))?;
    Ok(())
}

/// Fault injection: wait `ms` before the write, following the ticket: if it
/// ends meanwhile, give up at once.
async fn stall(broker: &mut BrokerClient, request_id: &str, ms: u64) -> Result<(), Status> {
    let watch = broker.watch_ticket(kpb::WatchTicketRequest { request_id: request_id.to_string() }).await;
    let mut watch = watch.map_err(|_| ShipError::BrokerUnreachable)?.into_inner();
    let ended = async {
        while let Ok(Some(t)) = watch.message().await {
            let s = TicketState::try_from(t.state).unwrap_or(TicketState::Unspecified);
            let why = format!("transfer ticket {} while the write was pending: {}", s.as_str_name(), t.reason);
            if matches!(s, TicketState::Expired | TicketState::Cancelled | TicketState::Failed) {
                return Status::from(ShipError::TicketEnded(s, why));
            }
        }
        std::future::pending::<Status>().await
    };
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => Ok(()),
        e = ended => Err(e),
    }
}
