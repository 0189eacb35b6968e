//! How a prefill worker moves a prompt's KV into the blocks a decode worker
//! reserved: [`KvTransport`], with NIXL (one-sided WRITE from the source
//! blocks, arena registered once) and TCP (a copy streamed to the decode's
//! `WriteKv`). The prefill uses the first transport that reaches the decode.

use std::sync::Arc;
use std::time::Duration;

use pdmesh_core::grpc::Channels;
use pdmesh_core::vocab::rpc;
use pdmesh_engine::{KvBlob, KvLayout, TransferArena};
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::kvbroker::v1 as kpb;
use tonic::Status;

use super::{layout_to_wire, Nixl};

/// The prompt KV a transfer moves: blocks held (pinned) in this worker's
/// arena for as long as the source lives.
#[tonic::async_trait]
pub trait KvSource: Sync {
    /// The source blocks in this worker's arena, in prompt order.
    fn blocks(&self) -> &[u32];
    /// CRC-32C of what moves of each of [`KvSource::blocks`], taken when
    /// the KV was made.
    fn checksums(&self) -> &[u32];
    /// What of each block moves (NIXL writes only that; TCP copies whole
    /// blocks, and the receiver checks what it reads).
    fn shipped(&self) -> &pdmesh_engine::kv::Shipped;
    /// A copy of the prompt's KV (for transports that copy).
    async fn export_kv(&self) -> Result<KvBlob, Status>;
    /// Fault injection: flip one byte of the last block in place; a
    /// second call restores it.
    async fn flip_byte(&self) -> Result<(), Status>;
}

/// A worker's transports, in order of preference: NIXL (when it loaded),
/// then TCP in `chunk_bytes` messages.
pub fn transports(nixl: Option<Arc<Nixl>>, layout: KvLayout, chunk_bytes: usize) -> Vec<Box<dyn KvTransport>> {
    let mut t: Vec<Box<dyn KvTransport>> = Vec::new();
    if let Some(nixl) = nixl {
        t.push(Box::new(NixlTransport { nixl, layout }));
    }
    t.push(Box::new(TcpTransport { chunk_bytes, channels: Default::default() }));
    t
}

/// Longest a NIXL write may run (the decode quarantines abandoned blocks for 2 s).
pub const MAX_WRITE_MS: u64 = 1_500;

#[tonic::async_trait]
pub trait KvTransport: Send + Sync {
    /// "nixl" or "tcp": in /statusz, metrics and responses.
    fn name(&self) -> &'static str;
    /// Whether this transport can write into `agent`'s blocks.
    fn reaches(&self, agent: &kpb::Agent) -> bool;
    /// Write the pinned prompt KV into the ticket's destination blocks;
    /// returns the bytes moved.
    /// A failed write leaves the transport able to write to the worker again
    /// (NIXL loads its agent afresh once no write to it is under way).
    async fn write(&self, w: Write<'_>) -> Result<u64, Status>;
}

/// One transfer: where to (the decode's agent and the ticket's blocks) and
/// what (the pinned source).
pub struct Write<'a> {
    pub agent: &'a kpb::Agent,
    pub ticket: &'a kpb::Ticket,
    pub src: &'a dyn KvSource,
    /// Fault injection: flip one byte on the way, after the checksums were taken.
    pub corrupt: bool,
}

pub struct NixlTransport {
    pub nixl: Arc<Nixl>,
    pub layout: KvLayout,
}

#[tonic::async_trait]
impl KvTransport for NixlTransport {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn reaches(&self, agent: &kpb::Agent) -> bool {
        agent.transport == kpb::Transport::Nixl as i32
            && agent.layout.as_ref() == Some(&layout_to_wire(&self.layout))
            && !agent.nixl_metadata.is_empty()
    }

    /// Bounded by the ticket's lease and by [`MAX_WRITE_MS`]. Corrupted,
    /// the source block is flipped for the write and restored after it.
    async fn write(&self, w: Write<'_>) -> Result<u64, Status> {
        let Write { agent, ticket, src, corrupt } = w;
        let n = src.blocks().len();
        if ticket.dest_blocks.len() < n {
            return Err(Status::failed_precondition(format!(
                "decode reserved {} blocks, the prompt fills {n}",
                ticket.dest_blocks.len()
            )));
        }
        let block_bytes = self.layout.block_bytes();
        if agent.block_bytes as usize != block_bytes {
            return Err(Status::failed_precondition(format!(
                "decode blocks are {} bytes, ours {block_bytes}",
                agent.block_bytes
            )));
        }
        let nixl = self.nixl.clone();
        let source = src;
        let plan = src.shipped();
        // (source offset, destination offset, length) of each piece.
        let pieces: Vec<(usize, usize, usize)> = src
            .blocks()
            .iter()
            .zip(&ticket.dest_blocks[..n])
            .enumerate()
            .flat_map(|(i, (s, d))| {
                let (so, doff) = (*s as usize * block_bytes, *d as usize * block_bytes);
                plan.ranges(i, block_bytes).into_iter().map(move |r| (so + r.start, doff + r.start, r.len()))
            })
            .collect();
        let (worker, md, remote) = (ticket.dest_worker.clone(), agent.nixl_metadata.clone(), remote_arena(agent));
        let now = pdmesh_core::now_ms();
        let timeout = Duration::from_millis(ticket.lease_deadline_unix_ms.saturating_sub(now).clamp(100, MAX_WRITE_MS));
        let note = ticket.request_id.clone();
        if corrupt {
            source.flip_byte().await?;
        }
        let r = tokio::task::spawn_blocking(move || nixl.write(&worker, &md, remote, &pieces, &note, timeout)).await;
        if corrupt {
            source.flip_byte().await?;
        }
        r.map_err(|e| Status::internal(e.to_string()))?.map_err(Status::unavailable)
    }
}

/// The arena a decode worker registered, as its agent announces it.
fn remote_arena(agent: &kpb::Agent) -> TransferArena {
    TransferArena {
        addr: agent.arena_addr as usize,
        len: agent.arena_len as usize,
        gpu: agent.arena_in_vram.then_some(u64::from(agent.arena_gpu)),
    }
}

pub struct TcpTransport {
    pub chunk_bytes: usize,
    /// Channels to decode workers, by address.
    pub channels: Channels,
}

#[tonic::async_trait]
impl KvTransport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn reaches(&self, agent: &kpb::Agent) -> bool {
        !agent.address.is_empty()
    }

    /// A copy of the blocks, streamed in `chunk_bytes` messages; corrupted,
    /// one byte of the copy is flipped.
    async fn write(&self, w: Write<'_>) -> Result<u64, Status> {
        let Write { agent, ticket, src, corrupt } = w;
        let mut blob = src.export_kv().await?;
        if corrupt {
            let last = blob.bytes.len().saturating_sub(blob.layout.block_bytes()) + 1;
            if let Some(b) = blob.bytes.get_mut(last) {
                *b ^= 0x40;
            }
        }
        let layout = layout_to_wire(&blob.layout);
        let chunks: Vec<dpb::KvChunk> = blob
            .bytes
            .chunks(self.chunk_bytes.max(1))
            .enumerate()
            .map(|(i, c)| {
                let mut k = dpb::KvChunk { data: c.to_vec(), ..Default::default() };
                if i == 0 {
                    k.request_id = ticket.request_id.clone();
                    k.layout = Some(layout.clone());
                    k.n_tokens = blob.n_tokens as u32;
                }
                k
            })
            .collect();
        let mut client =
            dpb::decode_client::DecodeClient::new(self.channels.get(&agent.address).map_err(Status::internal)?)
                .max_encoding_message_size(64 << 20);
        let (req, span) = pdmesh_core::telemetry::client_request(rpc::DECODE_WRITE_KV, tokio_stream::iter(chunks));
        let r = tracing::Instrument::instrument(client.write_kv(req), span.clone()).await;
        Ok(pdmesh_core::telemetry::finish(&span, r)?.into_inner().bytes)
    }
}
