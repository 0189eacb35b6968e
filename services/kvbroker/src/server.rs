//! The gRPC handlers over the ticket table and the agent registry.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use pb::{Ticket, TicketState};
use pdmesh_proto::kvbroker::v1 as pb;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use pdmesh_core::telemetry::{self, SpanExt};

use crate::caller::{check, Caller, TICKET_PARTIES, WORKERS};
use crate::error::Error;
use crate::tickets::{is_terminal, Tickets};
use pdmesh_core::vocab::attr;

pub use pdmesh_core::now_ms;

pub struct Broker {
    pub tickets: Arc<Mutex<Tickets>>,
    /// Each worker's agent and when it last registered (ms since the epoch).
    pub agents: Mutex<HashMap<String, (pb::Agent, u64)>>,
    pub max_lease_ms: u32,
    pub max_agents: usize,
    /// An agent not registered again for this long is forgotten.
    pub agent_ttl_ms: u64,
}

impl Broker {
    fn table(&self) -> std::sync::MutexGuard<'_, Tickets> {
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Under mesh TLS, only the prefill that claimed ticket `id` may `what`.
    fn claimant(&self, caller: &Option<Caller>, id: &str, what: &str) -> Result<(), Error> {
        let Some(t) = self.table().get(id) else { return Ok(()) }; // the table answers NOT_FOUND
        check(caller, |c| c.acts_as("prefill", &t.source_worker, &format!("{what} (ticket {id})")))
    }

    fn lease(&self, ms: u32) -> Result<u32, Error> {
        if ms == 0 || ms > self.max_lease_ms {
            return Err(Error::Invalid(format!("lease_ms must be 1..={}, got {ms}", self.max_lease_ms)));
        }
        Ok(ms)
    }
}

/// Record a ticket RPC's outcome (status, the ticket's state after it) on its span.
fn traced(span: tracing::Span, r: Result<Ticket, Error>) -> Result<Response<Ticket>, Status> {
    let r = r.map_err(Status::from);
    if let Ok(t) = &r {
        span.set_attribute(attr::TICKET, t.request_id.clone());
        span.set_attribute(attr::TICKET_STATE, state(t).as_str_name());
    }
    telemetry::finish(&span, r).map(Response::new)
}

fn state(t: &Ticket) -> TicketState {
    TicketState::try_from(t.state).unwrap_or(TicketState::Unspecified)
}

type TicketStream = Pin<Box<dyn Stream<Item = Result<Ticket, Status>> + Send>>;

#[tonic::async_trait]
impl pb::kv_broker_server::KvBroker for Broker {
    async fn register_agent(
        &self,
        req: Request<pb::RegisterAgentRequest>,
    ) -> Result<Response<pb::RegisterAgentResponse>, Status> {
        let caller = Caller::of(&req);
        let agent = req.into_inner().agent.ok_or_else(|| Error::Invalid("agent is required".into()))?;
        check(&caller, |c| {
            c.is(WORKERS, "register an agent")?;
            c.acts_as(&c.kind, &agent.worker_id, "register an agent")
        })?;
        if agent.worker_id.is_empty() {
            return Err(Error::Invalid("agent.worker_id is required".into()).into());
        }
        if agent.worker_id.len() > crate::tickets::MAX_ID_BYTES {
            return Err(Error::Invalid("agent.worker_id is too long".into()).into());
        }
        let now = now_ms();
        let mut agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        if !agents.contains_key(&agent.worker_id) && agents.len() >= self.max_agents {
            agents.retain(|_, (_, seen)| *seen + self.agent_ttl_ms > now);
            if agents.len() >= self.max_agents {
                return Err(Error::TooManyAgents(agents.len()).into());
            }
        }
        agents.insert(agent.worker_id.clone(), (agent, now));
        Ok(Response::new(pb::RegisterAgentResponse {}))
    }

    async fn get_agent(&self, req: Request<pb::GetAgentRequest>) -> Result<Response<pb::Agent>, Status> {
        let span = tracing::Span::current();
        check(&Caller::of(&req), |c| c.is(WORKERS, "look up agents"))?;
        let id = req.into_inner().worker_id;
        let agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        // A worker that stopped registering (dead, or gone) is unknown.
        let live = agents.get(&id).filter(|(_, seen)| seen + self.agent_ttl_ms > now_ms());
        let a = live.map(|(a, _)| a.clone()).ok_or(Error::UnknownAgent(id)).map_err(Status::from);
        telemetry::finish(&span, a).map(Response::new)
    }

    async fn open_ticket(&self, req: Request<pb::OpenTicketRequest>) -> Result<Response<Ticket>, Status> {
        let span = tracing::Span::current();
        let caller = Caller::of(&req);
        let r = req.into_inner();
        check(&caller, |c| c.acts_as("decode", &r.dest_worker, "open a ticket"))?;
        span.set_attribute(attr::TICKET_BLOCKS, r.dest_blocks.len() as i64);
        span.set_attribute(attr::TICKET_LEASE_MS, r.lease_ms as i64);
        let t = self.lease(r.lease_ms).and_then(|lease| {
            Ok(self.table().open(&r.request_id, &r.dest_worker, r.dest_blocks, r.n_tokens, lease, now_ms())?)
        });
        traced(span, t)
    }

    /// Waits (bounded by the caller's deadline) for the decode worker to open the ticket.
    async fn claim_ticket(&self, req: Request<pb::ClaimTicketRequest>) -> Result<Response<Ticket>, Status> {
        let span = tracing::Span::current();
        let caller = Caller::of(&req);
        let r = req.into_inner();
        check(&caller, |c| c.acts_as("prefill", &r.source_worker, "claim a ticket"))?;
        let sub = self.table().subscribe(&r.request_id, now_ms());
        let mut rx = match sub {
            Ok(rx) => rx,
            Err(e) => return traced(span, Err(e.into())),
        };
        let cur = match rx.wait_for(|t| state(t) != TicketState::Unspecified).instrument(span.clone()).await {
            Ok(t) => t.clone(),
            Err(_) => return telemetry::finish(&span, Err(Status::unavailable("broker shutting down"))),
        };
        if state(&cur) != TicketState::Open {
            return traced(span, Err(crate::tickets::TicketError::WrongState(r.request_id, state(&cur)).into()));
        }
        let t = self.table().claim(&r.request_id, &r.source_worker, now_ms());
        traced(span, t.map_err(Error::from))
    }

    async fn begin_write(&self, req: Request<pb::BeginWriteRequest>) -> Result<Response<Ticket>, Status> {
        let span = tracing::Span::current();
        let caller = Caller::of(&req);
        let r = req.into_inner();
        self.claimant(&caller, &r.request_id, "begin its write")?;
        let t = self.table().begin_write(&r.request_id, now_ms());
        traced(span, t.map_err(Error::from))
    }

    async fn complete_ticket(&self, req: Request<pb::CompleteTicketRequest>) -> Result<Response<Ticket>, Status> {
        let span = tracing::Span::current();
        let caller = Caller::of(&req);
        let r = req.into_inner();
        self.claimant(&caller, &r.request_id, "complete it")?;
        span.set_attribute(attr::TICKET_KV_BYTES, r.bytes as i64);
        let outcome = match r.outcome {
            Some(pb::complete_ticket_request::Outcome::FirstToken(t)) => Ok((t, r.block_crc32c)),
            Some(pb::complete_ticket_request::Outcome::Failure(why)) => Err(why),
            None => return traced(span, Err(Error::Invalid("outcome is required".into()))),
        };
        let t = self.table().complete(&r.request_id, outcome, r.bytes, now_ms());
        traced(span, t.map_err(Error::from))
    }

    async fn cancel_ticket(&self, req: Request<pb::CancelTicketRequest>) -> Result<Response<Ticket>, Status> {
        let span = tracing::Span::current();
        check(&Caller::of(&req), |c| c.is(TICKET_PARTIES, "cancel tickets"))?;
        let r = req.into_inner();
        if r.request_id.is_empty() {
            return traced(span, Err(Error::Invalid("request_id is required".into())));
        }
        let t = self.table().cancel(&r.request_id, &r.reason, now_ms());
        traced(span, t.map_err(Error::from))
    }

    async fn renew_lease(&self, req: Request<pb::RenewLeaseRequest>) -> Result<Response<Ticket>, Status> {
        let span = tracing::Span::current();
        check(&Caller::of(&req), |c| c.is(WORKERS, "renew leases"))?;
        let r = req.into_inner();
        let t = self.lease(r.lease_ms).and_then(|lease| Ok(self.table().renew(&r.request_id, lease, now_ms())?));
        traced(span, t)
    }

    type WatchTicketStream = TicketStream;

    /// The current ticket, then each change, ending after a terminal state.
    async fn watch_ticket(&self, req: Request<pb::WatchTicketRequest>) -> Result<Response<TicketStream>, Status> {
        // The span lasts until the ticket ends (or the watcher goes away).
        let span = tracing::Span::current();
        // A caller's deadline ends the watch (tonic enforces it only until
        // the response starts, not over a stream).
        let deadline = pdmesh_core::grpc::request_timeout(&req).map(|t| tokio::time::Instant::now() + t);
        check(&Caller::of(&req), |c| c.is(TICKET_PARTIES, "watch tickets"))?;
        let id = req.into_inner().request_id;
        if id.is_empty() {
            return telemetry::finish(&span, Err(Error::Invalid("request_id is required".into()).into()));
        }
        span.set_attribute(attr::TICKET, id.clone());
        let sub = self.table().subscribe(&id, now_ms());
        let mut rx = match sub {
            Ok(rx) => rx,
            Err(e) => return telemetry::finish(&span, Err(Error::from(e).into())),
        };
        let (tx, out) = tokio::sync::mpsc::channel(8);
        tokio::spawn(
            async move {
                loop {
                    let t = rx.borrow_and_update().clone();
                    let end = is_terminal(state(&t));
                    tracing::Span::current().set_attribute(attr::TICKET_STATE, state(&t).as_str_name());
                    if tx.send(Ok(t)).await.is_err() || end {
                        return;
                    }
                    let expired = async {
                        match deadline {
                            Some(d) => tokio::time::sleep_until(d).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        changed = rx.changed() => if changed.is_err() { return },
                        _ = expired => {
                            let _ = tx.send(Err(Status::deadline_exceeded("the watch's deadline passed"))).await;
                            return;
                        }
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))))
    }
}
