//! Fake workers for fast router tests: a tokenizer, a prefill and a decode
//! worker that speak the real gRPC APIs and follow a script instead of
//! running the model. They are labelled fakes: a test that uses them checks
//! the router's own logic (retry, refusal, replay, deadlines) in seconds;
//! the whole-mesh tests check the real workers.
//!
//! - [`FakeTokenizer`]: one id per byte of the prompt (chat: the contents
//!   joined), and back; Encode can stall, Detokenize streams can die after
//!   a number of answers.
//! - [`FakePrefill`] and [`FakeDecode`] share a [`Board`], the fakes' KV
//!   transfer: a prefill that answers posts its request id there, and a
//!   decode worker streams its tokens only once the id is posted (or at
//!   once for a local prefill), as a real decode waits for its KV.
//! - A [`Script`] is the replies to successive calls, the last one
//!   repeating; one script may be shared by several fakes (the first call
//!   to any of them takes the first reply), which makes "the worker tried
//!   first refuses, the next one serves" deterministic whatever the
//!   router's pick.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_proto::common::v1 as common;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_proto::prefill::v1 as ppb;
use pdmesh_proto::tokenizer::v1 as tpb;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::Running;

/// How long a fake decode waits for its prompt's KV before it fails the
/// request, as a real one whose ticket's lease expired.
pub const KV_WAIT: Duration = Duration::from_secs(10);

type Events<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Replies to successive calls; the last one repeats.
pub struct Script<R> {
    replies: Vec<R>,
    calls: AtomicUsize,
}

impl<R: Clone> Script<R> {
    pub fn new(replies: Vec<R>) -> Arc<Script<R>> {
        assert!(!replies.is_empty(), "a script needs at least one reply");
        Arc::new(Script { replies, calls: AtomicUsize::new(0) })
    }

    fn next(&self) -> R {
        let i = self.calls.fetch_add(1, Ordering::SeqCst);
        self.replies[i.min(self.replies.len() - 1)].clone()
    }

    /// Calls taken so far, by every fake sharing this script.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// The fakes' KV transfer: the request ids whose prefill has answered.
#[derive(Clone)]
pub struct Board(Arc<watch::Sender<HashSet<String>>>);

impl Default for Board {
    fn default() -> Board {
        Board(Arc::new(watch::channel(HashSet::new()).0))
    }
}

impl Board {
    fn post(&self, request_id: &str) {
        self.0.send_modify(|s| {
            s.insert(request_id.to_string());
        });
    }

    /// Whether `request_id`'s KV arrived within `wait`.
    async fn arrived(&self, request_id: &str, wait: Duration) -> bool {
        let mut rx = self.0.subscribe();
        tokio::time::timeout(wait, rx.wait_for(|s| s.contains(request_id))).await.is_ok_and(|r| r.is_ok())
    }
}

/// Serve `routes` on `127.0.0.1:0` until the returned handle stops it.
pub async fn serve(routes: tonic::service::Routes) -> Running {
    crate::spawn(|listener, stop| {
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), stop)
    })
    .await
}

/// What a fake tokenizer does.
#[derive(Clone, Default)]
pub struct TokenizerScript {
    /// How long each Encode takes.
    pub encode_delay: Duration,
    /// The first this-many Detokenize streams fail (UNAVAILABLE) after
    /// `die_after` answers, as when the tokenizer is lost mid-stream.
    pub dying_streams: usize,
    pub die_after: usize,
}

/// A tokenizer whose ids are the prompt's bytes.
pub struct FakeTokenizer {
    script: TokenizerScript,
    streams: AtomicUsize,
}

/// The text the fake tokenizer gives `ids` (one character per id).
pub fn fake_text(ids: &[u32]) -> String {
    ids.iter().map(|&i| char::from_u32(i).unwrap_or('?')).collect()
}

impl FakeTokenizer {
    pub fn routes(script: TokenizerScript) -> tonic::service::Routes {
        let me = FakeTokenizer { script, streams: AtomicUsize::new(0) };
        tonic::service::Routes::new(tpb::tokenizer_server::TokenizerServer::new(me))
    }
}

#[tonic::async_trait]
impl tpb::tokenizer_server::Tokenizer for FakeTokenizer {
    type DetokenizeStream = Events<tpb::DetokenizeResponse>;

    async fn encode(&self, req: Request<tpb::EncodeRequest>) -> Result<Response<tpb::EncodeResponse>, Status> {
        tokio::time::sleep(self.script.encode_delay).await;
        let text = match req.into_inner().input {
            Some(tpb::encode_request::Input::Prompt(p)) => p,
            Some(tpb::encode_request::Input::Chat(c)) => c.messages.into_iter().map(|m| m.content).collect(),
            None => return Err(Status::invalid_argument("no input")),
        };
        Ok(Response::new(tpb::EncodeResponse { ids: text.bytes().map(u32::from).collect() }))
    }

    async fn detokenize(
        &self,
        req: Request<Streaming<tpb::DetokenizeRequest>>,
    ) -> Result<Response<Self::DetokenizeStream>, Status> {
        let mut rx = req.into_inner();
        let dies = self.streams.fetch_add(1, Ordering::SeqCst) < self.script.dying_streams;
        let die_after = self.script.die_after;
        let (tx, out) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut answered = 0;
            while let Ok(Some(m)) = rx.message().await {
                if dies && answered == die_after {
                    let _ = tx.send(Err(Status::unavailable("fake tokenizer: lost mid-stream"))).await;
                    return;
                }
                answered += 1;
                if tx.send(Ok(tpb::DetokenizeResponse { text: fake_text(&m.ids) })).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))))
    }

    async fn info(&self, _: Request<tpb::InfoRequest>) -> Result<Response<tpb::InfoResponse>, Status> {
        let info =
            tpb::InfoResponse { model: "fake".into(), vocab_size: 256, bos_id: 1, eos_id: 2, context_length: 4096 };
        Ok(Response::new(info))
    }
}

/// A fake prefill worker's reply to one Prefill call.
#[derive(Clone, Debug)]
pub enum PrefillReply {
    /// The KV is "written" (posted on the board) and this is the first token.
    Answer { first_token: u32 },
    /// The call fails with this code.
    Fail(Code),
    /// No answer until the caller gives up.
    Stall,
}

pub struct FakePrefill {
    script: Arc<Script<PrefillReply>>,
    board: Board,
}

impl FakePrefill {
    pub fn routes(script: Arc<Script<PrefillReply>>, board: Board) -> tonic::service::Routes {
        tonic::service::Routes::new(ppb::prefill_server::PrefillServer::new(FakePrefill { script, board }))
    }
}

#[tonic::async_trait]
impl ppb::prefill_server::Prefill for FakePrefill {
    async fn prefill(&self, req: Request<ppb::PrefillRequest>) -> Result<Response<ppb::PrefillResponse>, Status> {
        match self.script.next() {
            PrefillReply::Answer { first_token } => {
                self.board.post(&req.get_ref().request_id);
                let r = ppb::PrefillResponse { first_token, kv_bytes: 0, transport: "fake".into(), cached_tokens: 0 };
                Ok(Response::new(r))
            }
            PrefillReply::Fail(code) => Err(Status::new(code, "fake prefill: scripted failure")),
            PrefillReply::Stall => std::future::pending().await,
        }
    }

    async fn load(&self, _: Request<ppb::LoadRequest>) -> Result<Response<ppb::LoadResponse>, Status> {
        Ok(Response::new(ppb::LoadResponse { kv_blocks_total: 1024, ..Default::default() }))
    }
}

/// A fake decode worker's reply to one Generate call. The tokens are the
/// whole answer, as a deterministic model would give it: a request
/// continued after n tokens (n `replay_ids`) gets the answer from its
/// n-th token on.
#[derive(Clone, Debug)]
pub enum DecodeReply {
    /// Refuse admission with this code (RESOURCE_EXHAUSTED: no KV room).
    Refuse(Code),
    /// Admit, wait for the KV, stream these tokens one message each, finish.
    Serve(Vec<u32>),
    /// Admit, wait for the KV, stream `after` tokens, then fail
    /// (UNAVAILABLE), as a worker lost mid-stream.
    DieAfter { tokens: Vec<u32>, after: usize },
    /// Admit, wait for the KV, then send nothing more.
    Stall,
    /// Admit, wait for the KV, stream `after` tokens, then park the
    /// sequence as a draining worker does (`HandingOver`, the stream held
    /// open); a `HandOver` for it then "ships" its KV (posts the ticket on
    /// the board) if `ships`, else fails NOT_FOUND.
    HandOverAfter { tokens: Vec<u32>, after: usize, ships: bool },
}

pub struct FakeDecode {
    script: Arc<Script<DecodeReply>>,
    board: Board,
    seen: Arc<Seen>,
    parked: Parked,
}

/// A fake decode worker's parked sequences: whether each one's shipment
/// will succeed, by sequence id.
#[derive(Clone, Default)]
struct Parked(Arc<std::sync::Mutex<std::collections::HashMap<u64, bool>>>, Arc<AtomicUsize>);

/// The Generate calls one fake decode worker took, in order.
#[derive(Default)]
pub struct Seen(std::sync::Mutex<Vec<dpb::GenerateRequest>>);

impl Seen {
    pub fn requests(&self) -> Vec<dpb::GenerateRequest> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn calls(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl FakeDecode {
    /// Its routes and the calls it takes.
    pub fn routes(script: Arc<Script<DecodeReply>>, board: Board) -> (tonic::service::Routes, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let me = FakeDecode { script, board, seen: seen.clone(), parked: Parked::default() };
        (tonic::service::Routes::new(dpb::decode_server::DecodeServer::new(me)), seen)
    }
}

fn event(e: dpb::generate_response::Event) -> Result<dpb::GenerateResponse, Status> {
    Ok(dpb::GenerateResponse { event: Some(e) })
}

/// What a fake decode stream sends after admission, on `tx`.
async fn stream(
    reply: DecodeReply,
    (board, parked): (Board, Parked),
    req: dpb::GenerateRequest,
    tx: mpsc::Sender<Result<dpb::GenerateResponse, Status>>,
) {
    use dpb::generate_response::Event;
    if !req.local_prefill && !board.arrived(&req.request_id, KV_WAIT).await {
        let _ = tx.send(Err(Status::unavailable("fake decode: the KV never arrived"))).await;
        return;
    }
    let (tokens, die_at, park) = match reply {
        DecodeReply::Serve(t) => (t, None, None),
        DecodeReply::DieAfter { tokens, after } => (tokens, Some(after), None),
        DecodeReply::HandOverAfter { tokens, after, ships } => (tokens, Some(after), Some(ships)),
        DecodeReply::Stall | DecodeReply::Refuse(_) => return std::future::pending().await,
    };
    let from = req.replay_ids.len().min(tokens.len());
    let n = (tokens.len() - from).min((req.max_tokens as usize).saturating_sub(from).max(1));
    for (i, t) in tokens.into_iter().skip(from).take(n).enumerate() {
        if let (Some(ships), true) = (park, die_at == Some(i)) {
            let sequence = parked.1.fetch_add(1, Ordering::SeqCst) as u64;
            parked.0.lock().unwrap_or_else(|e| e.into_inner()).insert(sequence, ships);
            let kv_tokens = (req.prompt_ids.len() + from + i).saturating_sub(1) as u32;
            let _ = tx.send(event(Event::HandingOver(dpb::HandingOver { sequence, kv_tokens }))).await;
            return tx.closed().await;
        }
        if die_at == Some(i) {
            let _ = tx.send(Err(Status::unavailable("fake decode: lost mid-stream"))).await;
            return;
        }
        if tx.send(event(Event::Tokens(dpb::Tokens { ids: vec![t] }))).await.is_err() {
            return;
        }
    }
    let usage =
        common::Usage { prompt_tokens: req.prompt_ids.len() as u32, completion_tokens: n as u32, cached_tokens: 0 };
    let fin = dpb::Finished { reason: common::FinishReason::Length as i32, usage: Some(usage) };
    let _ = tx.send(event(Event::Finished(fin))).await;
}

#[tonic::async_trait]
impl dpb::decode_server::Decode for FakeDecode {
    type GenerateStream = Events<dpb::GenerateResponse>;

    async fn generate(&self, req: Request<dpb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        self.seen.0.lock().unwrap_or_else(|e| e.into_inner()).push(req.get_ref().clone());
        let reply = self.script.next();
        if let DecodeReply::Refuse(code) = reply {
            return Err(Status::new(code, "fake decode: scripted refusal"));
        }
        let (tx, rx) = mpsc::channel(16);
        let admitted = dpb::Admitted { kv_blocks: 1, cached_tokens: 0 };
        let _ = tx.send(event(dpb::generate_response::Event::Admitted(admitted))).await;
        tokio::spawn(stream(reply, (self.board.clone(), self.parked.clone()), req.into_inner(), tx));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn write_kv(&self, _: Request<Streaming<dpb::KvChunk>>) -> Result<Response<dpb::WriteKvResponse>, Status> {
        Err(Status::unimplemented("fake decode: no KV over gRPC"))
    }

    async fn hand_over(&self, req: Request<dpb::HandOverRequest>) -> Result<Response<dpb::HandOverResponse>, Status> {
        let r = req.into_inner();
        match self.parked.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&r.sequence) {
            Some(true) => {
                self.board.post(&r.request_id);
                Ok(Response::new(dpb::HandOverResponse { kv_bytes: 0, transport: "fake".into() }))
            }
            // As a real worker answers once the sequence was freed (its
            // park timed out): not a transient failure.
            Some(false) => Err(Status::not_found("fake decode: scripted shipment failure")),
            None => Err(Status::not_found(format!("fake decode: sequence {} is not parked here", r.sequence))),
        }
    }

    async fn load(&self, _: Request<dpb::LoadRequest>) -> Result<Response<dpb::LoadResponse>, Status> {
        Ok(Response::new(dpb::LoadResponse { kv_blocks_total: 1024, ..Default::default() }))
    }
}
