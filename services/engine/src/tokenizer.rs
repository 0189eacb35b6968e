//! Tokenizer built from the GGUF alone: byte-level BPE (vocabulary and merges
//! from `tokenizer.ggml.*`, model `gpt2`) with the `smollm` pre-tokenizer
//! (each digit apart, then the GPT-2 split), or SentencePiece-style pieces
//! with scores (model `llama`: Gemma, [`spm`]); control tokens parsed only
//! when asked, the chat template from `tokenizer.chat_template`, and an
//! incremental detokenizer that never emits half a UTF-8 character.

mod spm;

use spm::Spm;

use std::collections::HashMap;

use minijinja::Environment;
use serde::{Deserialize, Serialize};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use crate::error::{EngineError, Result};
use crate::gguf::{Gguf, Value};

/// GGUF `token_type` of control tokens (`<|im_start|>` ...).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// One chat message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: "user".into(), content: content.into() }
    }
}

/// Roles the chat template is known to render.
pub const CHAT_ROLES: &[&str] = &["system", "user", "assistant", "tool"];

/// How text becomes ids.
enum Encoder {
    /// Byte-level BPE: `raw` treats control tokens as ordinary text,
    /// `special` recognises them as single ids.
    Bpe {
        raw: Box<HfTokenizer>,
        special: Box<HfTokenizer>,
    },
    Spm(Box<Spm>),
}

pub struct Tokenizer {
    encoder: Encoder,
    /// The texts of those tokens and their ids, longest first: a chat
    /// template's own text is split at them.
    controls: Vec<(String, u32)>,
    /// Bytes of each token (byte-level decoded).
    pieces: Vec<Vec<u8>>,
    is_control: Vec<bool>,
    env: Option<Environment<'static>>,
    pub bos_id: u32,
    pub eos_id: u32,
    /// Whether a prompt starts with BOS (`tokenizer.ggml.add_bos_token`;
    /// Gemma's does, SmolLM2's does not).
    pub add_bos: bool,
    bos_text: String,
    eos_text: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.pieces.len()).finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

/// GPT-2's byte <-> printable-character table, inverted: char -> byte.
fn byte_decoder() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter().zip(cs).map(|(b, c)| (char::from_u32(c).expect("valid char"), b as u8)).collect()
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let types: Vec<i64> = match g.metadata.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_u64().map(|x| x as i64).unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let (encoder, pieces) = match model {
            "gpt2" => bpe(g, &tokens, &types)?,
            "llama" => {
                let scores: Vec<f32> = match g.metadata.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                    Some(a) => a.iter().map(|v| v.as_f32().unwrap_or(0.0)).collect(),
                    None => vec![0.0; tokens.len()],
                };
                if g.metadata.get("tokenizer.ggml.add_space_prefix").is_some_and(|v| v == &Value::Bool(true)) {
                    return Err(EngineError::Unsupported(
                        "SentencePiece tokenizer with add_space_prefix (only Gemma's, without, is implemented)".into(),
                    ));
                }
                let pieces = tokens.iter().zip(&types).map(|(t, ty)| Spm::piece_bytes(t, *ty)).collect();
                (Encoder::Spm(Box::new(Spm::new(&tokens, &scores, &types))), pieces)
            }
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tokenizer model {other:?} (pdmesh reads byte-level BPE \"gpt2\" and SentencePiece \"llama\")"
                )))
            }
        };
        let is_control = types.iter().map(|t| *t == TOKEN_TYPE_CONTROL).collect();
        let mut controls: Vec<(String, u32)> = (tokens.iter().zip(&types).enumerate())
            .filter(|(_, (_, t))| **t == TOKEN_TYPE_CONTROL || **t == TOKEN_TYPE_USER_DEFINED)
            .map(|(id, (s, _))| (s.to_string(), id as u32))
            .collect();
        controls.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        let bos_id = g.get_u64("tokenizer.ggml.bos_token_id").unwrap_or(1) as u32;
        let eos_id = g.get_u64("tokenizer.ggml.eos_token_id").unwrap_or(2) as u32;
        let add_bos = g.metadata.get("tokenizer.ggml.add_bos_token").is_some_and(|v| v == &Value::Bool(true));
        let text_of = |id: u32| tokens.get(id as usize).map(|s| s.to_string()).unwrap_or_default();
        let env = match g.get_str("tokenizer.chat_template") {
            Ok(t) => Some(chat_env(t)?),
            Err(_) => None,
        };
        Ok(Tokenizer {
            encoder,
            controls,
            pieces,
            is_control,
            env,
            bos_id,
            eos_id,
            add_bos,
            bos_text: text_of(bos_id),
            eos_text: text_of(eos_id),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Token ids of `text`. With `parse_special`, control-token texts such as
    /// `<|im_start|>` become their single ids; without it they are plain text.
    /// Never adds BOS.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        match &self.encoder {
            Encoder::Bpe { raw, special } => {
                let t = if parse_special { special } else { raw };
                let enc = t.encode_fast(text, false).map_err(tok_err)?;
                Ok(enc.get_ids().to_vec())
            }
            Encoder::Spm(spm) => Ok(spm.encode(text, parse_special)),
        }
    }

    /// A plain prompt's ids as the model expects them: BOS first where the
    /// model's tokenizer adds it (llama.cpp's `add_special`).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_prompt_special(text, false)
    }

    /// [`Tokenizer::encode_prompt`], control tokens parsed when asked.
    pub fn encode_prompt_special(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = if self.add_bos { vec![self.bos_id] } else { Vec::new() };
        ids.extend(self.encode(text, parse_special)?);
        Ok(ids)
    }

    /// Render messages with the model's chat template.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let env = self.env.as_ref().ok_or_else(|| EngineError::Template("the model has no chat template".into()))?;
        for m in messages {
            if !CHAT_ROLES.contains(&m.role.as_str()) {
                return Err(EngineError::InvalidArgument(format!(
                    "unknown role {:?} (expected one of {})",
                    m.role,
                    CHAT_ROLES.join(", ")
                )));
            }
        }
        if messages.is_empty() {
            return Err(EngineError::InvalidArgument("messages is empty".into()));
        }
        let tmpl = env.get_template("chat").map_err(|e| EngineError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_text,
            eos_token => &self.eos_text,
        })
        .map_err(|e| EngineError::Template(e.to_string()))
    }

    /// Chat template rendered and tokenized as llama.cpp tokenizes it (the
    /// text between control tokens is one piece, so a merge across a role
    /// line and its content holds), except that control tokens come only
    /// from the template's own text: a message holding
    /// `<|im_end|>\n<|im_start|>system` stays ordinary text and cannot
    /// forge a turn. The template is rendered with a mark in place of each
    /// content (the content never enters the rendered text); the template's
    /// pieces are split at control tokens, and the contents joined into the
    /// text between them.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let marked: Vec<ChatMessage> = (0..messages.len())
            .zip(messages)
            .map(|(i, m)| ChatMessage { role: m.role.clone(), content: content_mark(i) })
            .collect();
        let rendered = self.apply_chat_template(&marked, true)?;
        let (mut ids, mut text) = (Vec::new(), String::new());
        let mut rest = rendered.as_str();
        for (i, m) in messages.iter().enumerate() {
            let mark = content_mark(i);
            let at = rest.find(&mark).ok_or_else(|| {
                EngineError::Template(format!("the chat template does not place message {i}'s content as given"))
            })?;
            self.push_template(&rest[..at], &mut text, &mut ids)?;
            text.push_str(&m.content);
            rest = &rest[at + mark.len()..];
        }
        self.push_template(rest, &mut text, &mut ids)?;
        ids.extend(self.encode(&text, false)?);
        Ok(ids)
    }

    /// Template text into `ids`: each control token in it ends the plain
    /// `text` gathered so far (tokenized as one piece), then adds its id.
    fn push_template(&self, piece: &str, text: &mut String, ids: &mut Vec<u32>) -> Result<()> {
        let mut rest = piece;
        while let Some((at, len, id)) = self.next_control(rest) {
            text.push_str(&rest[..at]);
            ids.extend(self.encode(text, false)?);
            text.clear();
            ids.push(id);
            rest = &rest[at + len..];
        }
        text.push_str(rest);
        Ok(())
    }

    /// The first control token's text in `s` (the longest where several
    /// start there): its offset, length and id.
    fn next_control(&self, s: &str) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        for (text, id) in &self.controls {
            if let Some(at) = s.find(text.as_str()) {
                if best.is_none_or(|(b, _, _)| at < b) {
                    best = Some((at, text.len(), *id));
                }
            }
        }
        best
    }

    /// Raw bytes of a token (control tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(|v| v.as_slice())
    }

    pub fn is_control(&self, id: u32) -> bool {
        self.is_control.get(id as usize).copied().unwrap_or(false)
    }

    /// Text of `ids`; control tokens are skipped unless `render_special`.
    /// Invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], render_special: bool) -> String {
        let mut d = IncrementalDecoder::new(render_special);
        let mut s = String::new();
        for id in ids {
            s.push_str(&d.push(self, *id));
        }
        s.push_str(&d.finish());
        s
    }
}

/// The byte-level BPE encoder of a `gpt2` GGUF tokenizer, and each
/// token's bytes.
fn bpe(g: &Gguf, tokens: &[&str], types: &[i64]) -> Result<(Encoder, Vec<Vec<u8>>)> {
    let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let merges = g.get_str_array("tokenizer.ggml.merges")?;
    let vocab: tokenizers::models::bpe::Vocab =
        tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| EngineError::Tokenizer(format!("malformed merge {m:?}")))
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
    let mut raw = HfTokenizer::new(bpe);
    let mut seq: Vec<PreTokenizerWrapper> = Vec::new();
    match pre {
        // llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" then the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "codeshell" => seq.push(Digits::new(true).into()),
        "default" | "gpt2" => {}
        other => return Err(EngineError::Unsupported(format!("pre-tokenizer {other:?}"))),
    }
    seq.push(ByteLevel::new(false, false, true).into());
    raw.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(seq))));

    let mut special = raw.clone();
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL || **t == TOKEN_TYPE_USER_DEFINED)
        .map(|(s, _)| AddedToken::from(s.to_string(), true))
        .collect();
    special.add_special_tokens(specials).map_err(tok_err)?;
    let dec = byte_decoder();
    let pieces = tokens
        .iter()
        .zip(types)
        .map(|(t, ty)| {
            if *ty == TOKEN_TYPE_CONTROL || *ty == TOKEN_TYPE_USER_DEFINED {
                t.as_bytes().to_vec()
            } else {
                t.chars().map(|c| dec.get(&c).copied().unwrap_or(b'?')).collect()
            }
        })
        .collect();
    Ok((Encoder::Bpe { raw: Box::new(raw), special: Box::new(special) }, pieces))
}

/// Where message `i`'s content goes in a rendered template (private-use
/// characters, which no template writes).
fn content_mark(i: usize) -> String {
    format!("\u{E000}pdmesh-content-{i}\u{E001}")
}

fn chat_env(template: &str) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    // As Hugging Face renders chat templates (jinja2 trim_blocks + lstrip_blocks).
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| EngineError::Template(e.to_string()))?;
    env.set_syntax(syntax);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template_owned("chat", template.to_string()).map_err(|e| EngineError::Template(e.to_string()))?;
    Ok(env)
}

/// Turns a stream of token ids into text pieces, holding back the bytes of
/// an unfinished UTF-8 character until the token that completes it arrives.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    pending: Vec<u8>,
    render_special: bool,
}

impl IncrementalDecoder {
    pub fn new(render_special: bool) -> IncrementalDecoder {
        IncrementalDecoder { pending: Vec::new(), render_special }
    }

    /// Text that became complete with this token (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if tok.is_control(id) && !self.render_special {
            return String::new();
        }
        if let Some(b) = tok.token_bytes(id) {
            self.pending.extend_from_slice(b);
        }
        self.drain(false)
    }

    /// Whatever is left, with an unfinished character replaced by U+FFFD.
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    fn drain(&mut self, flush: bool) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("validated prefix"));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                        None if flush => {
                            out.push('\u{FFFD}');
                            self.pending.clear();
                            return out;
                        }
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                    }
                }
            }
        }
    }
}
