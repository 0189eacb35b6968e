//! The gRPC handlers (thin: the work is in `pdmesh_engine::Tokenizer`).

use std::pin::Pin;
use std::sync::Arc;

use pdmesh_engine::{ChatMessage, IncrementalDecoder, Tokenizer};
use pdmesh_proto::tokenizer::v1 as pb;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use pdmesh_core::telemetry::{self, SpanExt};

use crate::error::Error;
use crate::metrics::{self, outcome_of, Metrics};
use pdmesh_core::metrics::Outcome;
use pdmesh_core::vocab::attr;

pub struct Service {
    pub tok: Arc<Tokenizer>,
    pub info: pb::InfoResponse,
    pub max_input_bytes: usize,
    pub max_messages: usize,
    pub metrics: Arc<Metrics>,
}

/// Bytes a chat message is counted as beyond its content and role: the
/// template's text around it, so that many empty messages count too.
const MESSAGE_OVERHEAD_BYTES: usize = 16;

impl Service {
    fn check_size(&self, size: usize) -> Result<(), Error> {
        if size > self.max_input_bytes {
            return Err(Error::TooLarge { size, limit: self.max_input_bytes });
        }
        Ok(())
    }

    /// Bounds on a chat, checked before its template is rendered.
    fn check_chat(&self, chat: &pb::ChatMessages) -> Result<(), Error> {
        let n = chat.messages.len();
        if n > self.max_messages {
            return Err(Error::TooManyMessages { n, limit: self.max_messages });
        }
        self.check_size(chat.messages.iter().map(|m| m.content.len() + m.role.len() + MESSAGE_OVERHEAD_BYTES).sum())
    }
}

type TextStream = Pin<Box<dyn Stream<Item = Result<pb::DetokenizeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::tokenizer_server::Tokenizer for Service {
    async fn encode(&self, req: Request<pb::EncodeRequest>) -> Result<Response<pb::EncodeResponse>, Status> {
        let span = tracing::Span::current();
        let r = self.encode_inner(req.into_inner()).instrument(span.clone()).await;
        if let Ok(r) = &r {
            span.set_attribute(attr::TOKENS, r.ids.len() as i64);
        }
        let r = telemetry::finish(&span, r);
        self.metrics.record(metrics::ENCODE, r.as_ref().map_or_else(outcome_of, |_| Outcome::Ok));
        r.map(Response::new)
    }

    type DetokenizeStream = TextStream;

    async fn detokenize(&self, req: Request<Streaming<pb::DetokenizeRequest>>) -> Result<Response<TextStream>, Status> {
        // The span lasts as long as the stream.
        let span = tracing::Span::current();
        let mut input = req.into_inner();
        let tok = self.tok.clone();
        let vocab = tok.vocab_size() as u32;
        let metrics = self.metrics.clone();
        let out = async_stream(move |tx| {
            async move {
                let outcome = detokenize_loop(&tok, vocab, &mut input, &tx).await;
                metrics.record(metrics::DETOKENIZE, outcome);
                let span = tracing::Span::current();
                span.set_attribute(attr::OUTCOME, format!("{outcome:?}"));
                if !matches!(outcome, Outcome::Ok) {
                    telemetry::mark_error(&span, &format!("{outcome:?}"));
                }
            }
            .instrument(span)
        });
        Ok(Response::new(out))
    }

    async fn info(&self, _req: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        self.metrics.record(metrics::INFO, Outcome::Ok);
        Ok(Response::new(self.info.clone()))
    }
}

impl Service {
    async fn encode_inner(&self, req: pb::EncodeRequest) -> Result<pb::EncodeResponse, Status> {
        let tok = self.tok.clone();
        let ids = match req.input {
            Some(pb::encode_request::Input::Prompt(text)) => {
                self.check_size(text.len())?;
                let parse = req.parse_special;
                // Long texts take milliseconds: keep them off the async workers.
                // BOS first where the model's tokenizer adds it (Gemma).
                tokio::task::spawn_blocking(move || tok.encode_prompt_special(&text, parse))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
            }
            Some(pb::encode_request::Input::Chat(chat)) => {
                self.check_chat(&chat)?;
                let msgs: Vec<ChatMessage> =
                    chat.messages.into_iter().map(|m| ChatMessage { role: m.role, content: m.content }).collect();
                tokio::task::spawn_blocking(move || tok.encode_chat(&msgs))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
            }
            None => return Err(Error::NoInput.into()),
        };
        Ok(pb::EncodeResponse { ids: ids.map_err(Error::from)? })
    }
}

/// Feed the detokenizer until the client's stream ends; returns the outcome.
async fn detokenize_loop(
    tok: &Tokenizer,
    vocab: u32,
    input: &mut Streaming<pb::DetokenizeRequest>,
    tx: &tokio::sync::mpsc::Sender<Result<pb::DetokenizeResponse, Status>>,
) -> Outcome {
    let mut dec: Option<IncrementalDecoder> = None;
    while let Some(msg) = input.next().await {
        let msg = match msg {
            Ok(m) => m,
            Err(status) => {
                let o = outcome_of(&status);
                let _ = tx.send(Err(status)).await;
                return o;
            }
        };
        let d = dec.get_or_insert_with(|| IncrementalDecoder::new(msg.render_special));
        let mut text = String::new();
        for id in msg.ids {
            if id >= vocab {
                let _ = tx.send(Err(Error::BadToken(id).into())).await;
                return Outcome::InvalidArgument;
            }
            text.push_str(&d.push(tok, id));
        }
        if tx.send(Ok(pb::DetokenizeResponse { text })).await.is_err() {
            return Outcome::Ok; // the client went away; nothing failed here
        }
    }
    if let Some(mut d) = dec {
        let rest = d.finish();
        if !rest.is_empty() {
            let _ = tx.send(Ok(pb::DetokenizeResponse { text: rest })).await;
        }
    }
    Outcome::Ok
}

/// A response stream fed by a task through a small channel; the task ends
/// when the client goes away (its sends fail).
fn async_stream<F, Fut>(f: F) -> TextStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<pb::DetokenizeResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
