//! The step API: sequences with reserved KV blocks, batched prefill and
//! decode steps, KV export/import, and a simple continuous-batching loop.

use std::collections::HashMap;

use pdmesh_kernels::pool::Pool;
use serde::Serialize;

use crate::error::{EngineError, Result};
use crate::kv::{KvBlob, KvCache, KvLayout};
use crate::model::{BatchItem, Model, Scratch, StepOptions};
use crate::sampler::{sample, SamplingParams};

pub type SeqId = u64;

/// Engine sizing.
#[derive(Clone, Debug, Serialize)]
pub struct EngineOptions {
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks in the arena.
    pub kv_blocks: usize,
    /// Kernel threads (0 = all cores).
    pub threads: usize,
    /// Most prompt tokens one prefill step feeds (chunked prefill).
    pub prefill_chunk: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { block_size: 16, kv_blocks: 2048, threads: 0, prefill_chunk: 512 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop id was generated.
    Stop,
    /// max_tokens reached, or the context is full.
    Length,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub seq: SeqId,
    pub token: u32,
    pub finish: Option<FinishReason>,
}

#[derive(Debug)]
struct Sequence {
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    n_prompt: usize,
    /// Positions whose KV is in the cache.
    n_cached: usize,
    blocks: Vec<u32>,
    params: SamplingParams,
    finish: Option<FinishReason>,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.n_prompt
    }
}

pub struct Engine {
    pub model: Model,
    pub kv: KvCache,
    pool: Pool,
    scratch: Scratch,
    seqs: HashMap<SeqId, Sequence>,
    next_id: SeqId,
    pub options: EngineOptions,
}

impl Engine {
    pub fn new(model: Model, options: EngineOptions) -> Result<Engine> {
        if options.block_size == 0 || options.kv_blocks == 0 || options.prefill_chunk == 0 {
            return Err(EngineError::InvalidArgument(
                "block_size, kv_blocks and prefill_chunk must be positive".into(),
            ));
        }
        let c = &model.config;
        let layout = KvLayout {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size: options.block_size,
        };
        Ok(Engine {
            kv: KvCache::new(layout, options.kv_blocks),
            pool: Pool::new(options.threads),
            scratch: Scratch::default(),
            seqs: HashMap::new(),
            next_id: 1,
            model,
            options,
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Most positions a sequence may use (model context, capped by the arena).
    pub fn max_context(&self) -> usize {
        self.model.config.context_length.min(self.kv.total() * self.kv.layout.block_size)
    }

    /// Admit a sequence: validate, and reserve KV blocks for the prompt plus
    /// `max_tokens` (so it can never run out mid-generation). Fails with
    /// `KvFull` without side effects when the blocks are not free.
    pub fn add_sequence(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(t) = prompt.iter().find(|t| **t as usize >= self.model.config.vocab_size) {
            return Err(EngineError::BadToken(*t));
        }
        // The last generated token is never fed back, hence the -1.
        let needed = prompt.len() + params.max_tokens - 1;
        let context = self.model.config.context_length;
        if needed > context {
            return Err(EngineError::PromptTooLong {
                len: prompt.len(),
                max_tokens: params.max_tokens,
                needed,
                context,
            });
        }
        let blocks = self.kv.allocate(self.kv.layout.blocks_for(needed))?;
        let id = self.next_id;
        self.next_id += 1;
        let n_prompt = prompt.len();
        self.seqs.insert(id, Sequence { tokens: prompt, n_prompt, n_cached: 0, blocks, params, finish: None });
        Ok(id)
    }

    /// Free a sequence's blocks and forget it. Unknown ids are an error.
    pub fn release(&mut self, id: SeqId) -> Result<()> {
        let s = self.seqs.remove(&id).ok_or(EngineError::UnknownSequence(id))?;
        self.kv.release(&s.blocks);
        Ok(())
    }

    pub fn generated(&self, id: SeqId) -> Result<&[u32]> {
        let s = self.seq(id)?;
        Ok(&s.tokens[s.n_prompt..])
    }

    /// The KV blocks reserved for a sequence, in position order.
    pub fn blocks(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.blocks)
    }

    pub fn prompt_len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.n_prompt)
    }

    pub fn finish_reason(&self, id: SeqId) -> Result<Option<FinishReason>> {
        Ok(self.seq(id)?.finish)
    }

    pub fn active(&self) -> usize {
        self.seqs.len()
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))
    }

    /// Feed up to `chunk` pending tokens of each sequence in one forward
    /// step. Returns, for each sequence whose pending tokens are now all in
    /// the cache, the logits of its last position.
    pub fn forward_pending(
        &mut self,
        ids: &[SeqId],
        chunk: usize,
        opts: StepOptions,
    ) -> Result<Vec<(SeqId, Vec<f32>)>> {
        let mut plan = Vec::with_capacity(ids.len());
        for id in ids {
            let s = self.seq(*id)?;
            if s.finish.is_some() {
                return Err(EngineError::InvalidArgument(format!("sequence {id} has finished")));
            }
            let pending = s.tokens.len() - s.n_cached;
            if pending == 0 {
                return Err(EngineError::InvalidArgument(format!("sequence {id} has no pending tokens")));
            }
            let n = pending.min(chunk.max(1));
            plan.push((*id, s.n_cached, n, n == pending));
        }
        let items: Vec<BatchItem<'_>> = plan
            .iter()
            .map(|(id, start, n, last)| {
                let s = &self.seqs[id];
                BatchItem { tokens: &s.tokens[*start..start + n], start_pos: *start, blocks: &s.blocks, logits: *last }
            })
            .collect();
        let logits = self.model.forward(&self.pool, &mut self.kv, &items, &mut self.scratch, opts)?;
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::new();
        let mut li = 0;
        for (id, _, n, last) in plan {
            let s = self.seqs.get_mut(&id).expect("planned sequence exists");
            s.n_cached += n;
            if last {
                out.push((id, logits[li * vocab..(li + 1) * vocab].to_vec()));
                li += 1;
            }
        }
        Ok(out)
    }

    /// Append a token chosen from `logits` and decide whether the sequence ends.
    pub fn accept(&mut self, id: SeqId, logits: &[f32]) -> Result<TokenEvent> {
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        let token = sample(&s.params, logits, s.generated());
        self.push_token(id, token)
    }

    /// Write the KV of a sequence's whole prompt, computed elsewhere, into
    /// its reserved blocks (the decode side of a prefill/decode split).
    pub fn import_prompt_kv(&mut self, id: SeqId, blob: &KvBlob) -> Result<()> {
        let s = self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))?;
        if s.n_cached != 0 || s.tokens.len() != s.n_prompt {
            return Err(EngineError::InvalidArgument(format!("sequence {id} already has KV")));
        }
        if blob.n_tokens != s.n_prompt {
            return Err(EngineError::KvMismatch(format!(
                "blob holds {} positions, the prompt has {}",
                blob.n_tokens, s.n_prompt
            )));
        }
        self.kv.import(&s.blocks, blob)
    }

    /// After [`Engine::import_prompt_kv`]: mark the prompt cached and append
    /// the first token, sampled by whoever ran the prompt. The sequence can
    /// then join decode steps (unless the first token already ends it).
    pub fn attach_first_token(&mut self, id: SeqId, token: u32) -> Result<TokenEvent> {
        let vocab = self.model.config.vocab_size;
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        if s.n_cached != 0 || s.tokens.len() != s.n_prompt {
            return Err(EngineError::InvalidArgument(format!("sequence {id} already started")));
        }
        if token as usize >= vocab {
            return Err(EngineError::BadToken(token));
        }
        s.n_cached = s.n_prompt;
        self.push_token(id, token)
    }

    fn push_token(&mut self, id: SeqId, token: u32) -> Result<TokenEvent> {
        let eos = self.model.config.eos_id;
        let max_ctx = self.max_context();
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        s.tokens.push(token);
        let stop = (!s.params.ignore_eos && token == eos) || s.params.stop_ids.contains(&token);
        s.finish = if stop {
            Some(FinishReason::Stop)
        } else if s.generated() >= s.params.max_tokens || s.tokens.len() >= max_ctx {
            Some(FinishReason::Length)
        } else {
            None
        };
        Ok(TokenEvent { seq: id, token, finish: s.finish })
    }

    /// Prefill the prompts of `ids` (in chunks of `prefill_chunk` tokens per
    /// sequence and step) and sample each one's first token.
    pub fn prefill(&mut self, ids: &[SeqId]) -> Result<Vec<TokenEvent>> {
        self.prefill_with(ids, StepOptions::default())
    }

    /// [`Engine::prefill`] with the caller's step options (kernel spans).
    pub fn prefill_with(&mut self, ids: &[SeqId], opts: StepOptions) -> Result<Vec<TokenEvent>> {
        let chunk = self.options.prefill_chunk;
        let mut todo: Vec<SeqId> = ids.to_vec();
        let mut events = Vec::new();
        while !todo.is_empty() {
            for (id, logits) in self.forward_pending(&todo, chunk, opts)? {
                events.push(self.accept(id, &logits)?);
                todo.retain(|t| *t != id);
            }
        }
        Ok(events)
    }

    /// One decode step for every sequence in `ids` (each must have its
    /// prompt prefilled and be unfinished).
    pub fn decode(&mut self, ids: &[SeqId]) -> Result<Vec<TokenEvent>> {
        self.decode_with(ids, StepOptions::default())
    }

    /// [`Engine::decode`] with the caller's step options (kernel spans).
    pub fn decode_with(&mut self, ids: &[SeqId], opts: StepOptions) -> Result<Vec<TokenEvent>> {
        for id in ids {
            let s = self.seq(*id)?;
            if s.tokens.len() - s.n_cached != 1 {
                return Err(EngineError::InvalidArgument(format!("sequence {id} is not ready to decode")));
            }
        }
        let out = self.forward_pending(ids, 1, opts)?;
        out.into_iter().map(|(id, l)| self.accept(id, &l)).collect()
    }

    /// The KV of a sequence's cached positions, for moving it elsewhere.
    pub fn export_kv(&self, id: SeqId) -> Result<KvBlob> {
        let s = self.seq(id)?;
        self.kv.export(&s.blocks, s.n_cached)
    }

    /// Admit a sequence whose prompt was prefilled elsewhere: `tokens` is the
    /// prompt followed by the tokens already generated there (at least one),
    /// and `blob` holds the KV of every position but the last token.
    pub fn import_sequence(
        &mut self,
        prompt_len: usize,
        tokens: Vec<u32>,
        params: SamplingParams,
        blob: &KvBlob,
    ) -> Result<SeqId> {
        if prompt_len == 0 || tokens.len() <= prompt_len {
            return Err(EngineError::InvalidArgument("an imported sequence needs its prompt and a first token".into()));
        }
        if blob.n_tokens != tokens.len() - 1 {
            return Err(EngineError::KvMismatch(format!(
                "blob holds {} positions, expected {}",
                blob.n_tokens,
                tokens.len() - 1
            )));
        }
        let prompt = tokens[..prompt_len].to_vec();
        let id = self.add_sequence(prompt, params)?;
        let s = self.seqs.get_mut(&id).expect("just added");
        if let Err(e) = self.kv.import(&s.blocks, blob) {
            self.release(id)?;
            return Err(e);
        }
        s.tokens = tokens;
        s.n_cached = blob.n_tokens;
        Ok(id)
    }

    /// Run many prompts to completion with continuous batching: up to
    /// `max_batch` sequences decode together; new ones are admitted (and
    /// prefilled) as others finish. Returns each prompt's generated tokens.
    pub fn generate_all(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        max_batch: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let mut results = vec![Vec::new(); prompts.len()];
        let mut waiting: std::collections::VecDeque<usize> = (0..prompts.len()).collect();
        let mut running: Vec<(SeqId, usize)> = Vec::new();
        while !waiting.is_empty() || !running.is_empty() {
            let mut admitted = Vec::new();
            while running.len() + admitted.len() < max_batch.max(1) {
                let Some(i) = waiting.front().copied() else { break };
                match self.add_sequence(prompts[i].clone(), params.clone()) {
                    Ok(id) => {
                        waiting.pop_front();
                        admitted.push((id, i));
                    }
                    Err(EngineError::KvFull { .. }) if !running.is_empty() || !admitted.is_empty() => break,
                    Err(e) => return Err(e),
                }
            }
            let new_ids: Vec<SeqId> = admitted.iter().map(|(id, _)| *id).collect();
            let mut events = if new_ids.is_empty() { Vec::new() } else { self.prefill(&new_ids)? };
            let old_ids: Vec<SeqId> = running.iter().map(|(id, _)| *id).collect();
            if !old_ids.is_empty() {
                events.extend(self.decode(&old_ids)?);
            }
            running.extend(admitted);
            for ev in events.iter().filter(|e| e.finish.is_some()) {
                if let Some(pos) = running.iter().position(|(id, _)| *id == ev.seq) {
                    let (id, i) = running.remove(pos);
                    results[i] = self.generated(id)?.to_vec();
                    self.release(id)?;
                }
            }
        }
        Ok(results)
    }
}
