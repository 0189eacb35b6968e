//! The Decode gRPC handlers: admission (reserve + open ticket), waiting for
//! the KV through the ticket, token streaming; WriteKv (the TCP transport's
//! receiving end); Load.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_core::metrics::Outcome;
use pdmesh_core::peers::Peers;
use pdmesh_engine::{KvBlob, KvLayout, SeqId};
use pdmesh_proto::decode::v1 as pb;
use pdmesh_proto::kvbroker::v1 as kpb;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use pdmesh_core::telemetry::{self, SpanExt};

use crate::batcher::{Batcher, Events};
use crate::error::{broker_refusal, Error};
use pdmesh_core::vocab::{attr, rpc, span};
use pdmesh_worker::kv::ship::{self, Shipper};

pub struct Service {
    pub batcher: Batcher,
    /// Ships the KV of sequences parked by a drain (`HandOver`).
    pub ship: Shipper,
    pub broker: Peers,
    pub worker_id: String,
    pub layout: KvLayout,
    pub lease_ms: u32,
    /// Sequences reserved and waiting for their KV, by request id.
    pub pending: Pending,
    /// The host KV arena (address, length): reserved blocks are backed with
    /// memory before the transfer writes into them.
    pub host_arena: (usize, usize),
}

/// Sequences reserved and waiting for their KV, by request id: the
/// sequence and the positions its transfer brings (what a `WriteKv` may carry).
pub type Pending = Arc<Mutex<HashMap<String, (SeqId, u32)>>>;

/// Frees a reserved sequence that never started (client gone, ticket failed).
struct Reservation {
    batcher: Batcher,
    pending: Pending,
    request_id: String,
    seq: SeqId,
    started: bool,
    /// A prefill claimed the ticket (it may be writing into the blocks).
    claimed: bool,
}

/// How long blocks of a ticket that ended after a prefill claimed it stay
/// reserved: a one-sided NIXL write may still be landing in them (the
/// prefill bounds a write to 1.5 s).
const QUARANTINE: Duration = Duration::from_secs(2);

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.request_id);
        if self.started {
            return;
        }
        if self.claimed {
            let (b, seq) = (self.batcher.clone(), self.seq);
            tokio::spawn(async move {
                tokio::time::sleep(QUARANTINE).await;
                b.release(seq);
            });
        } else {
            self.batcher.release(self.seq);
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

fn ticket_state(t: &kpb::Ticket) -> kpb::TicketState {
    kpb::TicketState::try_from(t.state).unwrap_or(kpb::TicketState::Unspecified)
}

impl Service {
    fn count(&self, s: &Status) {
        self.batcher.stats.outcomes.inc(Outcome::of_code(s.code()));
    }

    /// Reserve, open the ticket and watch it (the `admit` span), then wait
    /// for the KV in the background (`await_kv`) and join the batch.
    /// `server` is the request's span; it ends with the token stream.
    async fn admit(&self, r: pb::GenerateRequest, server: tracing::Span) -> Result<EventStream, Status> {
        if r.request_id.is_empty() {
            return Err(Error::BadRequest("request_id is required".into()).into());
        }
        let st = &self.batcher.stats;
        let admit = tracing::info_span!(
            parent: &server,
            "admit",
            { attr::DECODE_RUNNING } = st.running.load(Ordering::Relaxed) as i64,
            { attr::DECODE_WAITING } = st.queued.load(Ordering::Relaxed) as i64,
            { attr::DECODE_AWAITING_KV } = st.awaiting_kv.load(Ordering::Relaxed) as i64,
            { attr::KV_BLOCKS_USED } = st.kv_used.load(Ordering::Relaxed) as i64,
            { attr::KV_BLOCKS_TOTAL } = st.kv_total.load(Ordering::Relaxed) as i64,
            { attr::KV_BLOCKS_RESERVED } = tracing::field::Empty,
        );
        let r2 = self.admit_inner(r, &server).instrument(admit.clone()).await;
        if let Err(e) = &r2 {
            telemetry::mark_error(&admit, e.message());
        }
        r2
    }

    async fn admit_inner(&self, r: pb::GenerateRequest, server: &tracing::Span) -> Result<EventStream, Status> {
        let params =
            pdmesh_worker::sampling(r.sampling.as_ref(), r.max_tokens, &r.stop_ids, r.ignore_eos, &r.replay_ids);
        if r.local_prefill {
            let (tx, rx): (Events, _) = tokio::sync::mpsc::unbounded_channel();
            self.batcher
                .local(r.prompt_ids, params, tx, server.clone())
                .await
                .map_err(|e| pdmesh_worker::status(&e))?;
            return Ok(Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)));
        }
        // Positions the transfer brings: the prompt, and for a sequence
        // handed over mid-stream its tokens so far but the last.
        let n_kv = (r.prompt_ids.len() + if r.continued { r.replay_ids.len().saturating_sub(1) } else { 0 }) as u32;
        let (seq, blocks) =
            self.batcher.reserve(r.prompt_ids, params, r.continued).await.map_err(|e| pdmesh_worker::status(&e))?;
        {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if p.contains_key(&r.request_id) {
                drop(p);
                self.batcher.release(seq);
                return Err(Error::AlreadyAdmitted(r.request_id).into());
            }
            p.insert(r.request_id.clone(), (seq, n_kv));
        }
        let res = Reservation {
            batcher: self.batcher.clone(),
            pending: self.pending.clone(),
            request_id: r.request_id.clone(),
            seq,
            started: false,
            claimed: false,
        };
        let (arena, block_bytes, filled) = (
            self.host_arena,
            self.layout.block_bytes(),
            blocks[..self.layout.blocks_for(n_kv as usize).min(blocks.len())].to_vec(),
        );
        tokio::task::spawn_blocking(move || pdmesh_engine::kv::prefault_blocks(arena, block_bytes, &filled));
        let n_blocks = blocks.len() as u32;
        tracing::Span::current().record(attr::KV_BLOCKS_RESERVED, n_blocks as i64);
        let open = kpb::OpenTicketRequest {
            request_id: r.request_id.clone(),
            dest_worker: self.worker_id.clone(),
            dest_blocks: blocks,
            n_tokens: n_kv,
            lease_ms: self.lease_ms,
        };
        let opened =
            pdmesh_worker::at_broker(&self.broker, BROKER_PATIENCE, |b, left| open_ticket(b, &open, left)).await;
        let ((), mut broker) = opened.map_err(|e| Status::from(broker_refusal(&e)))?;
        // The watch (and its span) lasts until the ticket ends.
        let await_kv = tracing::info_span!(parent: server, span::AWAIT_KV);
        let (watch, wspan) = {
            let _g = await_kv.enter();
            telemetry::client_request(
                rpc::KVBROKER_WATCH_TICKET,
                kpb::WatchTicketRequest { request_id: r.request_id.clone() },
            )
        };
        let (await_kv, wspan) = (telemetry::Held(await_kv), telemetry::Held(wspan));
        let watch = match broker.watch_ticket(watch).instrument(wspan.span().clone()).await {
            Ok(w) => w.into_inner(),
            Err(e) => {
                telemetry::record_status(wspan.span(), Some(&e));
                cancel(broker.clone(), &r.request_id, "decode could not watch the ticket");
                return Err(Error::BrokerUnreachable.into());
            }
        };
        let (tx, rx): (Events, _) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(Ok(pb::GenerateResponse {
            event: Some(pb::generate_response::Event::Admitted(pb::Admitted { kv_blocks: n_blocks, cached_tokens: 0 })),
        }));
        let waiting = Waiting {
            watch,
            tx,
            broker,
            peers: self.broker.clone(),
            open,
            reopened: 0,
            seen_claim: false,
            request_id: r.request_id,
            res,
            batcher: self.batcher.clone(),
            server: server.clone(),
            spans: (wspan, await_kv),
        };
        tokio::spawn(waiting.run());
        Ok(Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)))
    }
}

/// An admitted request waiting for its prompt's KV: the ticket's watch
/// turns DONE with the first token (then the sequence joins the batch), or
/// ends otherwise (then the request ends with the reason, its blocks freed).
struct Waiting {
    watch: tonic::Streaming<kpb::Ticket>,
    tx: Events,
    broker: pdmesh_worker::BrokerClient,
    /// Where kvbrokers are found, and the ticket as opened: a broker that
    /// restarts has lost it, and is told again (see [`Waiting::reopen`]).
    peers: Peers,
    open: kpb::OpenTicketRequest,
    reopened: u32,
    /// The watch said a prefill claimed the ticket (a write may have begun).
    seen_claim: bool,
    request_id: String,
    res: Reservation,
    batcher: Batcher,
    server: tracing::Span,
    /// The WatchTicket client span and `await_kv`, ended when the wait does.
    spans: (telemetry::Held, telemetry::Held),
}

impl Waiting {
    async fn run(mut self) {
        let end: Status = loop {
            tokio::select! {
                _ = self.tx.closed() => {
                    cancel(self.broker.clone(), &self.request_id, "client went away before the first token");
                    break Error::ClientGone.into();
                }
                m = self.watch.message() => match m {
                    Ok(Some(t)) => match ticket_state(&t) {
                        kpb::TicketState::Done => {
                            let Some(first) = t.first_token else {
                                break Error::Internal("ticket done without a first token".into()).into();
                            };
                            self.res.started = true;
                            drop(self.spans);
                            self.batcher.start_sequence(self.res.seq, first, t.block_crc32c, self.tx, self.server);
                            return;
                        }
                        kpb::TicketState::Failed | kpb::TicketState::Cancelled | kpb::TicketState::Expired => {
                            break Error::TicketEnded(t).into()
                        }
                        kpb::TicketState::Claimed | kpb::TicketState::Writing => {
                            self.res.claimed = true;
                            self.seen_claim = true;
                            continue;
                        }
                        _ => continue,
                    },
                    Ok(None) | Err(_) => {
                        // The broker is gone. If no prefill had claimed the
                        // ticket, no write can have begun: open it again at
                        // the (restarted) broker and keep waiting.
                        if !self.seen_claim {
                            if let Some(w) = self.reopen().await {
                                self.watch = w;
                                // A claim the lost broker made but never told
                                // us of may still write into the blocks: if
                                // the request ends now, they wait out the
                                // quarantine before reuse.
                                self.res.claimed = true;
                                continue;
                            }
                        }
                        // A prefill may have claimed meanwhile.
                        self.res.claimed = true;
                        cancel(self.broker.clone(), &self.request_id, "decode lost the kvbroker watch");
                        break Error::BrokerLost.into();
                    }
                }
            }
        };
        self.batcher.stats.outcomes.inc(Outcome::of_code(end.code()));
        telemetry::mark_error(self.spans.1.span(), end.message());
        telemetry::record_status(&self.server, Some(&end));
        let _ = self.tx.send(Err(end));
    }
}

impl Waiting {
    /// Open the ticket again at whichever kvbroker is live (a restarted
    /// one has an empty table), then watch it. Tried for up to one lease:
    /// the blocks stay reserved meanwhile, as they would for an open ticket.
    /// `None` if no broker took it in that time or the client left.
    async fn reopen(&mut self) -> Option<tonic::Streaming<kpb::Ticket>> {
        let patience = Duration::from_millis(u64::from(self.open.lease_ms));
        let (open, id) = (&self.open, &self.request_id);
        let again = pdmesh_worker::at_broker(&self.peers, patience, |mut b, left| async move {
            match open_ticket(b.clone(), open, left).await {
                // FAILED_PRECONDITION: this broker still has the ticket (only
                // the watch broke); the watch tells its state.
                Err(e) if e.code() != tonic::Code::FailedPrecondition => return Err(e),
                _ => {}
            }
            b.watch_ticket(kpb::WatchTicketRequest { request_id: id.clone() }).await.map(Response::into_inner)
        });
        let (watch, broker) = tokio::select! {
            r = again => r.ok()?,
            _ = self.tx.closed() => return None,
        };
        self.broker = broker;
        self.reopened += 1;
        self.batcher.stats.tickets_reopened.fetch_add(1, Ordering::Relaxed);
        self.spans.1.span().set_attribute(attr::TICKET_REOPENED, i64::from(self.reopened));
        Some(watch)
    }
}

/// How long admission waits for a kvbroker that cannot be reached (one
/// restarting) before refusing the request.
const BROKER_PATIENCE: Duration = Duration::from_secs(3);

/// OpenTicket at `b`, within `left`.
async fn open_ticket(
    mut b: pdmesh_worker::BrokerClient,
    open: &kpb::OpenTicketRequest,
    left: Duration,
) -> Result<(), Status> {
    let (mut req, span) = telemetry::client_request(rpc::KVBROKER_OPEN_TICKET, open.clone());
    req.set_timeout(left);
    let r = b.open_ticket(req).instrument(span.clone()).await;
    telemetry::finish(&span, r).map(|_| ())
}

/// Cancel a ticket in the background (best effort: leases cover failures).
fn cancel(mut broker: pdmesh_worker::BrokerClient, request_id: &str, reason: &str) {
    let req = kpb::CancelTicketRequest { request_id: request_id.into(), reason: reason.into() };
    tokio::spawn(async move {
        let _ = broker.cancel_ticket(req).await;
    });
}

#[tonic::async_trait]
impl pb::decode_server::Decode for Service {
    type GenerateStream = EventStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<EventStream>, Status> {
        let span = tracing::Span::current();
        match self.admit(req.into_inner(), span.clone()).await {
            Ok(s) => Ok(Response::new(s)),
            Err(e) => {
                self.count(&e);
                telemetry::record_status(&span, Some(&e));
                Err(e)
            }
        }
    }

    async fn write_kv(&self, req: Request<Streaming<pb::KvChunk>>) -> Result<Response<pb::WriteKvResponse>, Status> {
        let span = tracing::Span::current();
        let r = self.write_kv_inner(req.into_inner()).instrument(span.clone()).await;
        if let Ok(r) = &r {
            span.set_attribute(attr::TICKET_KV_BYTES, r.bytes as i64);
        }
        telemetry::finish(&span, r).map(Response::new)
    }

    async fn hand_over(&self, req: Request<pb::HandOverRequest>) -> Result<Response<pb::HandOverResponse>, Status> {
        let span = tracing::Span::current();
        let r = self.ship_parked(req.into_inner()).instrument(span.clone()).await;
        telemetry::finish(&span, r).map(Response::new)
    }

    async fn load(&self, req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadResponse>, Status> {
        let req = req.into_inner();
        let st = &self.batcher.stats;
        let local = st.local_prefilling.load(Ordering::Relaxed);
        Ok(Response::new(pb::LoadResponse {
            running: st.running.load(Ordering::Relaxed),
            queued: st.queued.load(Ordering::Relaxed) + st.awaiting_kv.load(Ordering::Relaxed) + local,
            kv_blocks_used: st.kv_used.load(Ordering::Relaxed),
            kv_blocks_total: st.kv_total.load(Ordering::Relaxed),
            kv_blocks_pinned: st.kv_reserved.load(Ordering::Relaxed),
            prefix_cache: st.prefix.delta(req.cache_epoch, req.cache_seq),
            local_prefilling: local,
            stalled_ms: self.batcher.alive.stalled().as_millis() as u32,
            step_ms: st.step_costs.recent_ms(),
        }))
    }
}

impl Service {
    /// Ship a parked sequence's KV into the ticket `r.request_id` (the
    /// `kv_transfer` span); it is freed here either way.
    async fn ship_parked(&self, r: pb::HandOverRequest) -> Result<pb::HandOverResponse, Status> {
        let src = self.batcher.take_parked(r.sequence).await.map_err(|e| pdmesh_worker::status(&e))?;
        let p = &src.parcel;
        let (ticket, mut broker, xfer) = self.ship.claim_for(&r.request_id, p.kv_tokens, p.blocks.len()).await?;
        let last = p.last_token;
        let shipped = self
            .ship
            .ship(ticket, &src, last, &mut broker, (ship::Faults::default(), |_: &ship::Shipped| ()))
            .instrument(xfer.clone())
            .await;
        match shipped {
            Ok(s) => {
                src.shipped();
                Ok(pb::HandOverResponse { kv_bytes: s.bytes, transport: s.transport.into() })
            }
            Err(e) => {
                telemetry::mark_error(&xfer, e.message());
                Err(e)
            }
        }
    }

    async fn write_kv_inner(&self, mut s: Streaming<pb::KvChunk>) -> Result<pb::WriteKvResponse, Status> {
        let bad = |m: &str| Status::from(Error::BadRequest(m.into()));
        let first = s.message().await?.ok_or_else(|| bad("empty KV stream"))?;
        let layout =
            pdmesh_worker::layout_from_wire(first.layout.as_ref().ok_or_else(|| bad("first chunk needs the layout"))?)?;
        if layout != self.layout {
            let why = format!("KV layout {layout:?} does not match this worker's {:?}", self.layout);
            return Err(Error::LayoutMismatch(why).into());
        }
        let (seq, n_kv) = *self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&first.request_id)
            .ok_or_else(|| Error::NoReservation(first.request_id.clone()))?;
        // Checked before anything is allocated: the sender does not size our buffers.
        if first.n_tokens != n_kv {
            let why =
                format!("the KV carries {} positions; request {} reserved {n_kv}", first.n_tokens, first.request_id);
            return Err(bad(&why));
        }
        let n_tokens = first.n_tokens as usize;
        let expected = layout.blocks_for(n_tokens) * layout.block_bytes();
        let mut bytes = Vec::with_capacity(expected);
        // Checksummed as the chunks arrive, for the check before the first step.
        let mut sums = pdmesh_engine::kv::StreamChecksums::new(layout.block_bytes());
        bytes.extend_from_slice(&first.data);
        sums.push(&first.data);
        while let Some(c) = s.message().await? {
            if bytes.len() + c.data.len() > expected {
                return Err(bad(&format!("more than the {expected} bytes {n_tokens} positions take")));
            }
            bytes.extend_from_slice(&c.data);
            sums.push(&c.data);
        }
        let n = bytes.len() as u64;
        let blob = KvBlob { layout, n_tokens, bytes };
        self.batcher.import(seq, blob, sums.finish()).await.map_err(|e| pdmesh_worker::status(&e))?;
        Ok(pb::WriteKvResponse { bytes: n })
    }
}
