//! The Prefill gRPC handlers: queue the prompt for a batched forward step,
//! claim the transfer ticket, write the KV into the decode worker's
//! reserved blocks (TCP transport: a WriteKv stream), complete the ticket.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdmesh_core::metrics::outcome_of;
use pdmesh_core::peers::Peers;
use pdmesh_engine::KvBlob;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::prefill::v1 as pb;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::batcher::Batcher;

pub struct Service {
    pub batcher: Batcher,
    pub broker: Peers,
    pub worker_id: String,
    pub claim_timeout: Duration,
    pub chunk_bytes: usize,
    /// Transfer endpoints of decode workers, by worker id.
    pub agents: Mutex<HashMap<String, (kpb::Agent, Channel)>>,
}

impl Service {
    async fn agent(&self, broker: &mut pdmesh_worker::BrokerClient, worker: &str) -> Result<(kpb::Agent, Channel), Status> {
        if let Some(a) = self.agents.lock().unwrap_or_else(|e| e.into_inner()).get(worker) {
            return Ok(a.clone());
        }
        let agent = broker
            .get_agent(kpb::GetAgentRequest { worker_id: worker.into() })
            .await
            .map_err(|e| Status::unavailable(format!("decode worker {worker} is unknown to the kvbroker: {}", e.message())))?
            .into_inner();
        let ch = pdmesh_core::grpc::lazy_channel(&agent.address).map_err(Status::internal)?;
        self.agents.lock().unwrap_or_else(|e| e.into_inner()).insert(worker.into(), (agent.clone(), ch.clone()));
        Ok((agent, ch))
    }

    fn forget_agent(&self, worker: &str) {
        self.agents.lock().unwrap_or_else(|e| e.into_inner()).remove(worker);
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
        let (first, blob) = self.batcher.prefill(r.prompt_ids, params).await.map_err(|e| pdmesh_worker::status(&e))?;
        let mut broker = pdmesh_worker::broker(&self.broker, Duration::from_secs(2)).await?;
        let mut claim = Request::new(kpb::ClaimTicketRequest { request_id: r.request_id.clone(), source_worker: self.worker_id.clone() });
        claim.set_timeout(self.claim_timeout);
        let ticket = broker.claim_ticket(claim).await.map_err(|e| match e.code() {
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => Status::deadline_exceeded("no decode worker opened the transfer ticket in time"),
            tonic::Code::FailedPrecondition => Status::failed_precondition(format!("transfer ticket ended before the KV was written: {}", e.message())),
            _ => Status::unavailable(format!("kvbroker: {}", e.message())),
        })?;
        let ticket = ticket.into_inner();
        if ticket.n_tokens as usize != blob.n_tokens {
            let why = format!("decode reserved {} positions, prefill has {}", ticket.n_tokens, blob.n_tokens);
            let _ = broker.complete_ticket(fail(&r.request_id, &why)).await;
            return Err(Status::failed_precondition(why));
        }
        let (_agent, ch) = self.agent(&mut broker, &ticket.dest_worker).await?;
        let t0 = Instant::now();
        match self.write_tcp(ch, &r.request_id, &blob).await {
            Ok(bytes) => {
                let st = &self.batcher.stats;
                st.transfer_seconds.observe(t0.elapsed().as_secs_f64());
                st.transfer_bytes.fetch_add(bytes, Ordering::Relaxed);
                let done = kpb::CompleteTicketRequest { request_id: r.request_id.clone(), outcome: Some(kpb::complete_ticket_request::Outcome::FirstToken(first)), bytes };
                broker.complete_ticket(done).await.map_err(|e| Status::failed_precondition(format!("ticket could not be completed: {}", e.message())))?;
                Ok(pb::PrefillResponse { first_token: first, kv_bytes: bytes, transport: "tcp".into() })
            }
            Err(e) => {
                self.forget_agent(&ticket.dest_worker);
                let why = format!("writing the KV to {} failed: {}", ticket.dest_worker, e.message());
                let _ = broker.complete_ticket(fail(&r.request_id, &why)).await;
                Err(Status::unavailable(why))
            }
        }
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
