//! A drain that hands sequences over with their KV. A draining decode
//! worker parks each sequence instead of running it on: it stops stepping
//! it, keeps its blocks, and tells its router (`HandingOver`) on the
//! stream, which stays open. The router reserves room on another decode
//! worker and asks this one to ship the KV there (`HandOver`): the KV of
//! the prompt and of every generated token but the last, through a
//! transfer ticket, as a prefill worker ships a prompt (NIXL where both
//! ends have it, else TCP). The other worker goes on from the last token
//! with no step replaying the ones before. A parked sequence nobody asks
//! for within [`PARK_TTL`] (or whose router went away) is freed, and its
//! router continues it by replay instead.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pdmesh_core::metrics::Outcome;
use pdmesh_engine::{EngineError, KvBlob, SeqId};
use pdmesh_proto::decode::v1 as pb;
use tokio::sync::oneshot;
use tonic::Status;

use super::{gone, Batcher, Cmd, Loop, Seq, HANDED_OVER};

/// How long a parked sequence waits for its router to ask for its KV.
pub const PARK_TTL: Duration = Duration::from_secs(5);

/// A parked sequence.
pub(super) struct Parked {
    seq: Seq,
    since: Instant,
    /// A `HandOver` is shipping it.
    shipping: bool,
}

/// What shipping a parked sequence needs: its blocks (those holding KV),
/// their checksums, and the token the receiver goes on from.
pub struct Parcel {
    pub blocks: Vec<u32>,
    pub checksums: Vec<u32>,
    /// What of `blocks` a transfer moves (sliding windows trim the oldest).
    pub shipped: pdmesh_engine::kv::Shipped,
    pub last_token: u32,
    /// Positions with KV: the prompt and every generated token but the last.
    pub kv_tokens: u32,
}

/// A parked sequence being shipped: the source of its `HandOver`'s write.
/// Dropped, the sequence is freed (its KV shipped, or the shipment failed
/// and its router replays it elsewhere).
pub struct ParkedSource {
    tx: std::sync::mpsc::Sender<Cmd>,
    seq: SeqId,
    pub parcel: Parcel,
    shipped: bool,
}

impl ParkedSource {
    /// The KV reached the other worker: count the sequence handed over.
    pub fn shipped(mut self) {
        self.shipped = true;
    }
}

impl Drop for ParkedSource {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Shipped { seq: self.seq, ok: self.shipped });
    }
}

#[tonic::async_trait]
impl pdmesh_worker::kv::send::KvSource for ParkedSource {
    fn blocks(&self) -> &[u32] {
        &self.parcel.blocks
    }

    fn checksums(&self) -> &[u32] {
        &self.parcel.checksums
    }

    fn shipped(&self) -> &pdmesh_engine::kv::Shipped {
        &self.parcel.shipped
    }

    async fn export_kv(&self) -> Result<KvBlob, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::ExportParked { seq: self.seq, reply }).map_err(|_| pdmesh_worker::status(&gone()))?;
        rx.await.map_err(|_| gone()).and_then(|r| r).map_err(|e| pdmesh_worker::status(&e))
    }

    async fn flip_byte(&self) -> Result<(), Status> {
        Err(Status::unimplemented("no fault injection on a handed-over sequence"))
    }
}

impl Batcher {
    /// Take parked sequence `seq` for shipping (NOT_FOUND when it is not
    /// parked here: never was, freed, or already taken).
    pub async fn take_parked(&self, seq: SeqId) -> Result<ParkedSource, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::TakeParked { seq, reply }).map_err(|_| gone())?;
        let parcel = rx.await.map_err(|_| gone())??;
        Ok(ParkedSource { tx: self.tx.clone(), seq, parcel, shipped: false })
    }
}

impl Loop {
    /// Park `s`: stop stepping it, keep its KV, tell its router.
    pub(super) fn park(&mut self, mut s: Seq) {
        s.end_span();
        let generated = self.engine.generated(s.id).map_or(0, <[u32]>::len);
        let kv_tokens = (self.engine.prompt_len(s.id).unwrap_or(0) + generated.saturating_sub(1)) as u32;
        let ev = pb::HandingOver { sequence: s.id, kv_tokens };
        let ev = pb::GenerateResponse { event: Some(pb::generate_response::Event::HandingOver(ev)) };
        if s.events.send(Ok(ev)).is_err() {
            let _ = self.engine.release(s.id);
            self.stats.outcomes.inc(Outcome::Cancelled);
            return;
        }
        self.parked.insert(s.id, Parked { seq: s, since: Instant::now(), shipping: false });
    }

    pub(super) fn take_parked(&mut self, seq: SeqId, reply: oneshot::Sender<Result<Parcel, EngineError>>) {
        let r = self.parcel(seq);
        if r.is_ok() {
            if let Some(p) = self.parked.get_mut(&seq) {
                p.shipping = true;
            }
        }
        if reply.send(r).is_err() {
            self.unpark(seq, false);
        }
    }

    fn parcel(&mut self, seq: SeqId) -> Result<Parcel, EngineError> {
        if self.parked.get(&seq).is_none_or(|p| p.shipping) {
            return Err(EngineError::UnknownSequence(seq));
        }
        self.engine.stage_for_send(seq)?;
        let generated = self.engine.generated(seq)?;
        let last_token = *generated.last().ok_or(EngineError::UnknownSequence(seq))?;
        let kv_tokens = (self.engine.prompt_len(seq)? + generated.len() - 1) as u32;
        let n = self.engine.kv.layout.blocks_for(kv_tokens as usize);
        let blocks = self.engine.blocks(seq)?[..n].to_vec();
        let (checksums, shipped) = (self.engine.kv_checksums(seq)?, self.engine.shipped(seq)?);
        Ok(Parcel { blocks, checksums, shipped, last_token, kv_tokens })
    }

    pub(super) fn export_parked(&mut self, seq: SeqId, reply: oneshot::Sender<Result<KvBlob, EngineError>>) {
        let r = match self.parked.get(&seq) {
            Some(p) if p.shipping => self.engine.export_kv(seq),
            _ => Err(EngineError::UnknownSequence(seq)),
        };
        let _ = reply.send(r);
    }

    /// Free a parked sequence: shipped (`ok`), or given up (its router
    /// replays it elsewhere).
    pub(super) fn unpark(&mut self, seq: SeqId, ok: bool) {
        let Some(p) = self.parked.remove(&seq) else { return };
        let why =
            if ok { "this decode worker drained: the request went on elsewhere with its KV" } else { HANDED_OVER };
        let _ = p.seq.events.send(Err(Status::unavailable(why)));
        let _ = self.engine.release(seq);
        self.stats.outcomes.inc(Outcome::of_code(tonic::Code::Unavailable));
        self.stats.handed_over.fetch_add(1, Ordering::Relaxed);
        if ok {
            self.stats.handed_over_with_kv.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Free parked sequences nobody will ship: their router went away, or
    /// did not ask within [`PARK_TTL`].
    pub(super) fn expire_parked(&mut self) {
        let stale: Vec<SeqId> = self
            .parked
            .iter()
            .filter(|(_, p)| !p.shipping && (p.seq.events.is_closed() || p.since.elapsed() > PARK_TTL))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.unpark(id, false);
        }
    }
}
