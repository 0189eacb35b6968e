//! The Prefill gRPC handlers: queue the prompt for a batched forward step,
//! claim the transfer ticket, write the KV into the decode worker's
//! reserved blocks (TCP transport: a WriteKv stream), complete the ticket.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdmesh_core::metrics::outcome_of;
use pdmesh_core::peers::Peers;
use std::sync::Arc;

use pdmesh_engine::{KvBlob, KvLayout};
use pdmesh_worker::transport::Nixl;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::prefill::v1 as pb;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::batcher::{Batcher, Pinned};

/// Least lease time left for a KV write to start, in milliseconds.
const WRITE_MARGIN_MS: u64 = 500;
/// Longest a NIXL write may run (the decode quarantines abandoned blocks for 2 s).
const MAX_WRITE_MS: u64 = 1_500;

pub struct Service {
    pub batcher: Batcher,
    /// This worker's NIXL agent (its arena registered), when NIXL loaded.
    pub nixl: Option<Arc<Nixl>>,
    pub layout: KvLayout,
    pub broker: Peers,
    pub worker_id: String,
    pub claim_timeout: Duration,
    /// How far each renewal extends the ticket's lease while the prompt waits, in ms.
    pub lease_renew_ms: u64,
    pub chunk_bytes: usize,
    /// Channels to decode workers, by address.
    pub channels: Mutex<HashMap<String, Channel>>,
}

impl Service {
    /// The decode worker's transfer endpoint, asked of the broker for every
    /// transfer (a restarted decode keeps its id but has a new arena and
    /// NIXL agent); channels are cached by address.
    async fn agent(&self, broker: &mut pdmesh_worker::BrokerClient, worker: &str) -> Result<(kpb::Agent, Channel), Status> {
        let agent = broker
            .get_agent(kpb::GetAgentRequest { worker_id: worker.into() })
            .await
            .map_err(|e| Status::unavailable(format!("decode worker {worker} is unknown to the kvbroker: {}", e.message())))?
            .into_inner();
        let mut m = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        let ch = match m.get(&agent.address) {
            Some(c) => c.clone(),
            None => {
                let c = pdmesh_core::grpc::lazy_channel(&agent.address).map_err(Status::internal)?;
                m.insert(agent.address.clone(), c.clone());
                c
            }
        };
        Ok((agent, ch))
    }

    /// Stream the blob into the decode worker's reserved blocks.
    async fn write_tcp(&self, ch: Channel, request_id: &str, blob: &KvBlob) -> Result<u64, Status> {
        let layout = pdmesh_worker::layout_to_wire(&blob.layout);
        let mut chunks = Vec::new();
        for (i, c) in blob.bytes.chunks(self.chunk_bytes.max(1)).enumerate() {
            let mut k = dpb::KvChunk { data: c.to_vec(), ..Default::default() };
            if i == 0 {
                k.request_id = request_id.into();
                k.layout = Some(layout.clone());
                k.n_tokens = blob.n_tokens as u32;
            }
            chunks.push(k);
        }
        let mut client = dpb::decode_client::DecodeClient::new(ch).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20);
        let r = client.write_kv(tokio_stream::iter(chunks)).await?;
        Ok(r.into_inner().bytes)
    }

    async fn run(&self, r: pb::PrefillRequest) -> Result<pb::PrefillResponse, Status> {
        if r.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        let params = pdmesh_worker::sampling(r.sampling.as_ref(), 1, &[], true);
        // While the prompt waits and runs, keep the decode's reservation
        // alive: this worker is alive and will write. If it dies, renewals
        // stop and the lease frees the decode's blocks.
        let job = self.batcher.prefill(r.prompt_ids, params);
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
        let mut broker = pdmesh_worker::broker(&self.broker, Duration::from_secs(2)).await?;
        let mut claim = Request::new(kpb::ClaimTicketRequest { request_id: r.request_id.clone(), source_worker: self.worker_id.clone() });
        claim.set_timeout(self.claim_timeout);
        let ticket = broker.claim_ticket(claim).await.map_err(|e| match e.code() {
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => Status::deadline_exceeded("no decode worker opened the transfer ticket in time"),
            tonic::Code::FailedPrecondition => Status::failed_precondition(format!("transfer ticket ended before the KV was written: {}", e.message())),
            _ => Status::unavailable(format!("kvbroker: {}", e.message())),
        })?;
        let ticket = ticket.into_inner();
        if ticket.n_tokens as usize != pinned.p.n_tokens {
            let why = format!("decode reserved {} positions, prefill has {}", ticket.n_tokens, pinned.p.n_tokens);
            let _ = broker.complete_ticket(fail(&r.request_id, &why)).await;
            return Err(Status::failed_precondition(why));
        }
        let (agent, ch) = self.agent(&mut broker, &ticket.dest_worker).await?;
        let stall = pdmesh_core::faults::get("prefill.transfer_delay_ms");
        if stall > 0 {
            tokio::time::sleep(Duration::from_millis(stall)).await;
        }
        // Never start a write the lease may not cover: once it expires the
        // decode frees (and may reuse) the destination blocks.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        if ticket.lease_deadline_unix_ms < now + WRITE_MARGIN_MS {
            let why = format!("transfer lease ends in {} ms; not starting the write", ticket.lease_deadline_unix_ms.saturating_sub(now));
            let _ = broker.complete_ticket(fail(&r.request_id, &why)).await;
            return Err(Status::deadline_exceeded(why));
        }
        broker
            .begin_write(kpb::BeginWriteRequest { request_id: r.request_id.clone() })
            .await
            .map_err(|e| Status::failed_precondition(format!("transfer ticket ended before the write began: {}", e.message())))?;
        let t0 = Instant::now();
        let use_nixl = self.nixl.is_some() && agent.transport == kpb::Transport::Nixl as i32 && agent.layout.as_ref() == Some(&pdmesh_worker::layout_to_wire(&self.layout));
        let moved = if use_nixl { self.write_nixl(&agent, &ticket, &pinned).await } else { self.write_tcp_pinned(ch, &r.request_id, &pinned).await };
        drop(pinned); // the KV is in the decode's blocks (or failed): free ours
        let transport = if use_nixl { "nixl" } else { "tcp" };
        match moved {
            Ok(bytes) => {
                let st = &self.batcher.stats;
                st.transfer_seconds.observe(t0.elapsed().as_secs_f64());
                st.transfer_bytes.fetch_add(bytes, Ordering::Relaxed);
                if use_nixl { &st.transfers_nixl } else { &st.transfers_tcp }.fetch_add(1, Ordering::Relaxed);
                let done = kpb::CompleteTicketRequest { request_id: r.request_id.clone(), outcome: Some(kpb::complete_ticket_request::Outcome::FirstToken(first)), bytes };
                broker.complete_ticket(done).await.map_err(|e| Status::failed_precondition(format!("ticket could not be completed: {}", e.message())))?;
                Ok(pb::PrefillResponse { first_token: first, kv_bytes: bytes, transport: transport.into() })
            }
            Err(e) => {
                if let Some(n) = &self.nixl {
                    n.forget(&ticket.dest_worker);
                }
                let why = format!("writing the KV to {} over {transport} failed: {}", ticket.dest_worker, e.message());
                let _ = broker.complete_ticket(fail(&r.request_id, &why)).await;
                Err(Status::unavailable(why))
            }
        }
    }

    /// Best effort: the ticket may not be open yet, or gone.
    async fn renew(&self, request_id: &str) {
        let Ok(mut b) = pdmesh_worker::broker(&self.broker, Duration::from_millis(200)).await else { return };
        let mut req = Request::new(kpb::RenewLeaseRequest { request_id: request_id.into(), lease_ms: self.lease_renew_ms as u32 });
        req.set_timeout(Duration::from_secs(1));
        let _ = b.renew_lease(req).await;
    }

    async fn write_tcp_pinned(&self, ch: Channel, request_id: &str, pinned: &Pinned) -> Result<u64, Status> {
        let blob = pinned.export().await.map_err(|e| pdmesh_worker::status(&e))?;
        self.write_tcp(ch, request_id, &blob).await
    }

    /// NIXL WRITE of the pinned blocks into the ticket's destination blocks,
    /// bounded by the ticket's lease.
    async fn write_nixl(&self, agent: &kpb::Agent, ticket: &kpb::Ticket, pinned: &Pinned) -> Result<u64, Status> {
        let nixl = self.nixl.clone().expect("checked by the caller");
        let n = pinned.p.blocks.len();
        if ticket.dest_blocks.len() < n {
            return Err(Status::failed_precondition(format!("decode reserved {} blocks, the prompt fills {n}", ticket.dest_blocks.len())));
        }
        let (src, dst) = (pinned.p.blocks.clone(), ticket.dest_blocks[..n].to_vec());
        let (worker, md, addr) = (ticket.dest_worker.clone(), agent.nixl_metadata.clone(), agent.arena_addr as usize);
        let remote_len = agent.arena_len as usize;
        let block_bytes = self.layout.block_bytes();
        if agent.block_bytes as usize != block_bytes {
            return Err(Status::failed_precondition(format!("decode blocks are {} bytes, ours {block_bytes}", agent.block_bytes)));
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        // Bounded by the lease and by the decode's quarantine of abandoned blocks.
        let timeout = Duration::from_millis(ticket.lease_deadline_unix_ms.saturating_sub(now).clamp(100, MAX_WRITE_MS));
        let note = ticket.request_id.clone();
        tokio::task::spawn_blocking(move || nixl.write(&worker, &md, addr, remote_len, &src, &dst, block_bytes, &note, timeout))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(Status::unavailable)
    }
}

fn fail(request_id: &str, why: &str) -> kpb::CompleteTicketRequest {
    kpb::CompleteTicketRequest { request_id: request_id.into(), outcome: Some(kpb::complete_ticket_request::Outcome::Failure(why.into())), bytes: 0 }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Service {
    async fn prefill(&self, req: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let r = self.run(req.into_inner()).await;
        let code = r.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(|e| e.code());
        self.batcher.stats.outcomes.inc(outcome_of(code));
        r.map(Response::new)
    }

    async fn load(&self, _req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadResponse>, Status> {
        let st = &self.batcher.stats;
        Ok(Response::new(pb::LoadResponse {
            running: st.running.load(Ordering::Relaxed),
            queued: st.queued.load(Ordering::Relaxed),
            kv_blocks_used: st.kv_used.load(Ordering::Relaxed),
            kv_blocks_total: st.kv_total.load(Ordering::Relaxed),
        }))
    }
}
