//! Protobuf fuzzing of every gRPC service of a live mesh: each method of
//! the tokenizer, kvbroker, prefill, decode and router gets seeded
//! messages — generated with odd values (empty, huge and out-of-range
//! numbers, long and odd strings, unknown ids) and mutated at the byte
//! level (flipped, cut, spliced, repeated bytes, unknown fields, lengths
//! that lie, pure noise) — unary, server-, client- and bidi-streaming as
//! the method is. Every call must end (a status or an answer) within its
//! deadline plus a margin; no process may die (same pids before and after);
//! then every KV block and ticket is released and the mesh still answers
//! golden tokens. Counts per service and status code are printed. A
//! message that does not parse is INTERNAL, as gRPC's status-code guide
//! prescribes for parse errors (tonic's codec); well-formed nonsense gets
//! INVALID_ARGUMENT, NOT_FOUND or FAILED_PRECONDITION from our handlers.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Mesh, Raw};
use pdmesh_core::vocab::rpc;
use pdmesh_proto::common::v1 as cpb;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::kvbroker::v1 as kpb;
use pdmesh_proto::prefill::v1 as ppb;
use pdmesh_proto::router::v1 as rpb;
use pdmesh_proto::tokenizer::v1 as tpb;
use prost::Message;
use tonic::codegen::http::uri::PathAndQuery;

/// Calls per method.
const PER_METHOD: usize = 600;
/// Calls in flight at once per method.
const AT_ONCE: usize = 32;
/// Each call's own deadline (sent as grpc-timeout).
const DEADLINE: Duration = Duration::from_millis(500);
/// A call with no end this long after its deadline hangs.
const HANG: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Unary,
    ServerStream,
    ClientStream,
    Bidi,
}

/// xorshift64: the same seed, the same run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn u32(&mut self) -> u32 {
        match self.below(6) {
            0 => 0,
            1 => 1,
            2 => u32::MAX,
            3 => i32::MAX as u32 + 1,
            4 => self.below(100_000) as u32,
            _ => self.next() as u32,
        }
    }
    fn string(&mut self) -> String {
        match self.below(6) {
            0 => String::new(),
            1 => "x".repeat(self.below(2000)),
            2 => "decode-0".into(),
            3 => "\u{0}\u{FFFF}<|im_start|>system\n\u{202E}".into(),
            4 => format!("fuzz-{}", self.next()),
            _ => (0..self.below(40)).map(|_| char::from_u32(self.below(0x3000) as u32).unwrap_or('?')).collect(),
        }
    }
    fn ids(&mut self) -> Vec<u32> {
        (0..self.below(48)).map(|_| if self.below(4) == 0 { self.u32() } else { self.below(49_152) as u32 }).collect()
    }
    fn float(&mut self) -> f32 {
        [0.0, -1.0, 1e30, f32::NAN, f32::INFINITY, 0.7, 2.5][self.below(7)]
    }
    fn sampling(&mut self) -> Option<cpb::SamplingParams> {
        (self.below(3) > 0).then(|| cpb::SamplingParams {
            temperature: self.float(),
            top_k: self.u32(),
            top_p: self.float(),
            seed: self.next(),
        })
    }
    fn layout(&mut self) -> Option<cpb::KvLayout> {
        (self.below(3) > 0).then(|| cpb::KvLayout {
            n_layers: self.u32(),
            n_kv_heads: self.u32(),
            head_dim: self.u32(),
            block_size: self.u32(),
            dtype: self.string(),
        })
    }
}

/// A message for `method` with odd values (well-formed protobuf).
fn generate(method: &str, g: &mut Rng) -> Vec<u8> {
    match method {
        rpc::ROUTER_GENERATE => rpb::GenerateRequest {
            request_id: g.string(),
            input: Some(if g.below(2) == 0 {
                rpb::generate_request::Input::Prompt(g.string())
            } else {
                let messages =
                    (0..g.below(5)).map(|_| rpb::ChatMessage { role: g.string(), content: g.string() }).collect();
                rpb::generate_request::Input::Chat(rpb::ChatMessages { messages })
            }),
            sampling: g.sampling(),
            max_tokens: g.u32() % 64,
            stop: (0..g.below(3)).map(|_| g.string()).collect(),
            ignore_eos: g.below(2) == 0,
            max_tokens_to_fit: g.below(2) == 0,
            resume_ids: g.ids(),
        }
        .encode_to_vec(),
        rpc::TOKENIZER_ENCODE => tpb::EncodeRequest {
            input: Some(tpb::encode_request::Input::Prompt(g.string())),
            parse_special: g.below(2) == 0,
        }
        .encode_to_vec(),
        rpc::TOKENIZER_DETOKENIZE => {
            tpb::DetokenizeRequest { ids: g.ids(), render_special: g.below(2) == 0 }.encode_to_vec()
        }
        rpc::TOKENIZER_INFO => tpb::InfoRequest {}.encode_to_vec(),
        rpc::PREFILL_PREFILL => {
            ppb::PrefillRequest { request_id: g.string(), prompt_ids: g.ids(), sampling: g.sampling() }.encode_to_vec()
        }
        rpc::PREFILL_LOAD => ppb::LoadRequest { cache_epoch: g.next(), cache_seq: g.next() }.encode_to_vec(),
        rpc::DECODE_GENERATE => dpb::GenerateRequest {
            request_id: g.string(),
            prompt_ids: g.ids(),
            sampling: g.sampling(),
            max_tokens: g.u32() % 64,
            stop_ids: g.ids(),
            ignore_eos: g.below(2) == 0,
            local_prefill: g.below(2) == 0,
            replay_ids: g.ids(),
            continued: g.below(2) == 0,
        }
        .encode_to_vec(),
        rpc::DECODE_HAND_OVER => dpb::HandOverRequest { sequence: g.next(), request_id: g.string() }.encode_to_vec(),
        rpc::DECODE_WRITE_KV => {
            let data = vec![g.below(256) as u8; g.below(4096)];
            dpb::KvChunk { request_id: g.string(), layout: g.layout(), n_tokens: g.u32(), data }.encode_to_vec()
        }
        rpc::DECODE_LOAD => dpb::LoadRequest { cache_epoch: g.next(), cache_seq: g.next() }.encode_to_vec(),
        rpc::KVBROKER_REGISTER_AGENT => kpb::RegisterAgentRequest {
            agent: (g.below(4) > 0).then(|| kpb::Agent {
                worker_id: format!("fuzz-agent-{}", g.below(64)),
                nixl_metadata: vec![g.below(256) as u8; g.below(512)],
                address: g.string(),
                layout: g.layout(),
                arena_addr: g.next(),
                block_bytes: g.next(),
                arena_len: g.next(),
                ..Default::default()
            }),
        }
        .encode_to_vec(),
        rpc::KVBROKER_GET_AGENT => kpb::GetAgentRequest { worker_id: g.string() }.encode_to_vec(),
        rpc::KVBROKER_OPEN_TICKET => kpb::OpenTicketRequest {
            request_id: g.string(),
            dest_worker: format!("fuzz-dest-{}", g.below(8)),
            dest_blocks: g.ids(),
            n_tokens: g.u32(),
            lease_ms: g.u32() % 5000,
        }
        .encode_to_vec(),
        rpc::KVBROKER_CLAIM_TICKET => {
            kpb::ClaimTicketRequest { request_id: g.string(), source_worker: g.string() }.encode_to_vec()
        }
        rpc::KVBROKER_BEGIN_WRITE => kpb::BeginWriteRequest { request_id: g.string() }.encode_to_vec(),
        rpc::KVBROKER_COMPLETE_TICKET => kpb::CompleteTicketRequest {
            request_id: g.string(),
            outcome: match g.below(3) {
                0 => None,
                1 => Some(kpb::complete_ticket_request::Outcome::FirstToken(g.u32())),
                _ => Some(kpb::complete_ticket_request::Outcome::Failure(g.string())),
            },
            bytes: g.next(),
            block_crc32c: g.ids(),
        }
        .encode_to_vec(),
        rpc::KVBROKER_CANCEL_TICKET => {
            kpb::CancelTicketRequest { request_id: g.string(), reason: g.string() }.encode_to_vec()
        }
        rpc::KVBROKER_RENEW_LEASE => {
            kpb::RenewLeaseRequest { request_id: g.string(), lease_ms: g.u32() }.encode_to_vec()
        }
        rpc::KVBROKER_WATCH_TICKET => kpb::WatchTicketRequest { request_id: g.string() }.encode_to_vec(),
        m => panic!("no generator for {m}"),
    }
}

/// `m` changed at the byte level.
fn mutate(mut m: Vec<u8>, g: &mut Rng) -> Vec<u8> {
    for _ in 0..1 + g.below(3) {
        let at = g.below(m.len() + 1);
        match g.below(8) {
            0 if !m.is_empty() => {
                let i = at.min(m.len() - 1);
                m[i] ^= 1 << g.below(8);
            }
            1 => m.truncate(at),
            2 => m.splice(at..at, (0..g.below(16)).map(|_| g.next() as u8)).for_each(drop),
            3 if at < m.len() => {
                let end = (at + g.below(32)).min(m.len());
                let piece = m[at..end].to_vec();
                m.splice(at..at, piece.iter().copied().chain(piece.iter().copied())).for_each(drop);
            }
            // An unknown field: tag (number, wire type), then a varint or a length.
            4 => {
                let tag = ((g.below(1 << 20) as u64) << 3) | g.below(6) as u64;
                prost::encoding::encode_varint(tag, &mut m);
                prost::encoding::encode_varint(g.next() >> g.below(64), &mut m);
            }
            // A length-delimited field whose length lies.
            5 => {
                m.push(0x12);
                prost::encoding::encode_varint(g.next() >> g.below(64), &mut m);
                m.extend((0..g.below(8)).map(|_| g.next() as u8));
            }
            // An overlong varint.
            6 => m.splice(at..at, std::iter::repeat_n(0xffu8, 11)).for_each(drop),
            _ => m = (0..g.below(64)).map(|_| g.next() as u8).collect(),
        }
    }
    m
}

/// One fuzzed call: how it ended (a status code, OK for an answer), or
/// `None` if it did not end in time (a hang).
async fn call(
    ch: tonic::transport::Channel,
    method: &'static str,
    shape: Shape,
    msgs: Vec<Vec<u8>>,
) -> Option<tonic::Code> {
    let mut grpc = tonic::client::Grpc::new(ch);
    let path: PathAndQuery = format!("/{method}").parse().expect("a method path");
    let work = async {
        grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let first = msgs[0].clone();
        match shape {
            Shape::Unary => {
                let mut req = tonic::Request::new(first);
                req.set_timeout(DEADLINE);
                grpc.unary(req, path, Raw).await.map(|_| ())
            }
            Shape::ServerStream => {
                let mut req = tonic::Request::new(first);
                req.set_timeout(DEADLINE);
                let mut s = grpc.server_streaming(req, path, Raw).await?.into_inner();
                for _ in 0..64 {
                    if s.message().await?.is_none() {
                        break;
                    }
                }
                Ok(())
            }
            Shape::ClientStream | Shape::Bidi => {
                let mut req = tonic::Request::new(tokio_stream::iter(msgs));
                req.set_timeout(DEADLINE);
                if shape == Shape::ClientStream {
                    grpc.client_streaming(req, path, Raw).await.map(|_| ())
                } else {
                    let mut s = grpc.streaming(req, path, Raw).await?.into_inner();
                    while s.message().await?.is_some() {}
                    Ok(())
                }
            }
        }
    };
    match tokio::time::timeout(DEADLINE + HANG, work).await {
        Ok(Ok(())) => Some(tonic::Code::Ok),
        Ok(Err(e)) => Some(e.code()),
        Err(_) => None,
    }
}

/// The methods of each service kind, and their shapes.
fn methods() -> Vec<(&'static str, &'static str, Shape)> {
    use Shape::*;
    vec![
        ("tokenizer", rpc::TOKENIZER_ENCODE, Unary),
        ("tokenizer", rpc::TOKENIZER_INFO, Unary),
        ("tokenizer", rpc::TOKENIZER_DETOKENIZE, Bidi),
        ("kvbroker", rpc::KVBROKER_REGISTER_AGENT, Unary),
        ("kvbroker", rpc::KVBROKER_GET_AGENT, Unary),
        ("kvbroker", rpc::KVBROKER_OPEN_TICKET, Unary),
        ("kvbroker", rpc::KVBROKER_CLAIM_TICKET, Unary),
        ("kvbroker", rpc::KVBROKER_BEGIN_WRITE, Unary),
        ("kvbroker", rpc::KVBROKER_COMPLETE_TICKET, Unary),
        ("kvbroker", rpc::KVBROKER_CANCEL_TICKET, Unary),
        ("kvbroker", rpc::KVBROKER_RENEW_LEASE, Unary),
        ("kvbroker", rpc::KVBROKER_WATCH_TICKET, ServerStream),
        ("prefill", rpc::PREFILL_PREFILL, Unary),
        ("prefill", rpc::PREFILL_LOAD, Unary),
        ("decode", rpc::DECODE_GENERATE, ServerStream),
        ("decode", rpc::DECODE_WRITE_KV, ClientStream),
        ("decode", rpc::DECODE_LOAD, Unary),
        ("decode", rpc::DECODE_HAND_OVER, Unary),
        ("router", rpc::ROUTER_GENERATE, ServerStream),
    ]
}

async fn pids(mesh: &Mesh) -> BTreeMap<String, i32> {
    let mut out = BTreeMap::new();
    for kind in ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"] {
        for i in mesh.registry().healthy(kind).await.unwrap() {
            out.insert(i.id.clone(), common::pid_of(&i));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutated_protobuf_against_every_grpc_service_crashes_nothing_and_hangs_nothing() {
    let mesh = Mesh::up_env(&["--decode-lease-ms", "3000"], &[("PDMESH_KVBROKER_MAX_LEASE_MS", "3000")]);
    let before = pids(&mesh).await;
    let mut g = Rng(0x5eed_f00d_cafe_d00d);
    let t0 = Instant::now();
    let mut by_service: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    let mut hangs = Vec::new();
    for (kind, method, shape) in methods() {
        let inst = mesh.instance(kind).await;
        let ch = tonic::transport::Channel::from_shared(format!("http://{}", inst.grpc_addr)).unwrap().connect_lazy();
        let gate = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..PER_METHOD {
            let n = if matches!(shape, Shape::ClientStream | Shape::Bidi) { 1 + g.below(3) } else { 1 };
            let msgs: Vec<Vec<u8>> = (0..n)
                .map(|_| {
                    let m = generate(method, &mut g);
                    // Half well-formed with odd values, half mutated bytes.
                    if i % 2 == 0 {
                        m
                    } else {
                        mutate(m, &mut g)
                    }
                })
                .collect();
            let permit = gate.clone().acquire_owned().await.unwrap();
            let ch = ch.clone();
            calls.spawn(async move {
                let r = call(ch, method, shape, msgs).await;
                drop(permit);
                r
            });
        }
        let counts = by_service.entry(kind).or_default();
        while let Some(r) = calls.join_next().await {
            match r.unwrap() {
                Some(code) => *counts.entry(format!("{code:?}")).or_default() += 1,
                None => hangs.push(method),
            }
        }
    }
    let total: usize = by_service.values().flat_map(|c| c.values()).sum::<usize>() + hangs.len();
    eprintln!(
        "{total} fuzzed gRPC calls in {:.1} s; by service and status: {by_service:?}",
        t0.elapsed().as_secs_f64()
    );
    assert!(hangs.is_empty(), "calls with no end {HANG:?} past their deadline: {hangs:?}");
    let after = pids(&mesh).await;
    assert_eq!(before, after, "no service died or was replaced");
    // Whatever the fuzz reserved or opened ends within the 3 s lease.
    mesh.assert_released(Duration::from_secs(20)).await;
    common::golden_at_once(&mesh.router().await, 4).await;
}
