//! The step API: sequences with reserved KV blocks, batched prefill and
//! decode steps, KV export/import, and a simple continuous-batching loop.

use crate::PoolShare;
use std::collections::HashMap;

use pdmesh_kernels::pool::Pool;
use serde::Serialize;

use pdmesh_prefix::BlockHash;

use crate::blocks::{PrefixConfig, Reuse};
use crate::error::{EngineError, Result};
use crate::kv::{KvBlob, KvCache, KvLayout};
use crate::model::cuda::CudaModel;
use crate::model::{BatchItem, Model, Scratch, StepOptions, SumOrder};
use crate::sampler::{NextToken, SamplingParams};

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
    /// Prefix cache: most full prompt blocks kept for reuse once no
    /// sequence holds them (0 = no prefix cache).
    pub prefix_cache_blocks: usize,
    /// With a prefix cache: a released sequence leaves every position it
    /// computed or imported, generated tokens included, in the cache (the
    /// decode side, where the next turn of a chat extends the last answer).
    /// Positions computed by decode steps run the single-token kernels, so
    /// a prompt reusing them gets logits close to a cold prefill's, not
    /// the same bits (greedy tokens can differ at near-ties). Without it,
    /// only prompt positions computed as a cold prefill would are cached.
    pub cache_generated: bool,
    /// Where the forward pass runs.
    pub backend: ComputeBackend,
}

/// Where the forward pass runs (`--backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ComputeBackend {
    /// The CPU kernels (pdmesh-kernels).
    #[default]
    Cpu,
    /// GPU 0 (CUDA_VISIBLE_DEVICES chooses it); an error when there is none.
    Cuda,
    /// CUDA where a GPU and its driver are found, else the CPU.
    Auto,
}

/// A worker's engine sizes where its flags do not set them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    pub kv_blocks: usize,
    pub max_batch: usize,
}

impl ComputeBackend {
    /// Whether the forward pass will run on a GPU: `cuda`, or `auto` where
    /// a CUDA driver is found.
    pub fn sized_for_gpu(self) -> bool {
        match self {
            ComputeBackend::Cpu => false,
            ComputeBackend::Cuda => true,
            ComputeBackend::Auto => pdmesh_cuda::gpu::driver_present(),
        }
    }

    /// Default sizes: on a CPU, 2048 KV blocks (32,768 positions) and 32
    /// sequences a step; on a GPU, 16,384 blocks (about 6 GB of VRAM for
    /// SmolLM2-135M) and 64 sequences, every decode step a CUDA graph.
    pub fn default_sizing(self) -> Sizing {
        if self.sized_for_gpu() {
            Sizing { kv_blocks: 16_384, max_batch: 64 }
        } else {
            Sizing { kv_blocks: 2048, max_batch: 32 }
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            block_size: 16,
            kv_blocks: 2048,
            threads: 0,
            prefill_chunk: 512,
            prefix_cache_blocks: 0,
            cache_generated: false,
            backend: ComputeBackend::Cpu,
        }
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
    /// The token was replayed (`SamplingParams::replay`), not generated:
    /// its caller has it already.
    pub replayed: bool,
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
    /// Chained hashes of the prompt's full blocks (empty without a prefix cache).
    hashes: Vec<BlockHash>,
    /// Leading prompt blocks stored in (or found in) the prefix cache.
    n_stored: usize,
    /// The prompt's last, partial block was offered to the prefix cache.
    tail_stored: bool,
    /// Prompt positions whose KV came from the prefix cache.
    n_reused: usize,
    /// Positions whose KV a transfer brings to a reserved sequence: its
    /// prompt, or for one handed over mid-stream ([`Engine::reserve_continued`])
    /// its prompt and all but the last of its replayed tokens.
    n_transfer: usize,
    /// Its KV came by a transfer that left out what its windows no longer
    /// see ([`crate::kv::Shipped`]): its blocks never join the prefix
    /// cache, where a shorter prompt would read those parts.
    trimmed: bool,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.n_prompt
    }

    /// Append `token` and decide whether the sequence ends there.
    fn push(&mut self, token: u32, eog: &[u32], max_ctx: usize, replayed: bool) -> TokenEvent {
        self.tokens.push(token);
        let stop =
            (!self.params.ignore_eos && eog.binary_search(&token).is_ok()) || self.params.stop_ids.contains(&token);
        self.finish = if stop {
            Some(FinishReason::Stop)
        } else if self.generated() >= self.params.max_tokens || self.tokens.len() >= max_ctx {
            Some(FinishReason::Length)
        } else {
            None
        };
        TokenEvent { seq: 0, token, finish: self.finish, replayed }
    }

    /// How many pending tokens the next step feeds (at most `chunk`), and
    /// in which summation order. Prompt positions run in the chunks a cold
    /// prefill of the whole prompt would use (`[k * chunk, (k + 1) *
    /// chunk)`), in that chunk's order, so a prompt whose head came from
    /// the prefix cache gets the same bits as one computed from scratch.
    /// Past the prompt, pending tokens are a migrated sequence's replayed
    /// ones: each runs as a decode step of its own would (see
    /// [`Engine::forward_runs`]), however many feed at once.
    fn next_run(&self, chunk: usize) -> (usize, SumOrder) {
        let pending = self.tokens.len() - self.n_cached;
        if self.n_cached >= self.n_prompt {
            return (pending.min(chunk), SumOrder::VecDot);
        }
        let cold_start = self.n_cached / chunk * chunk;
        let cold_end = (cold_start + chunk).min(self.n_prompt);
        let order = if cold_end - cold_start == 1 { SumOrder::VecDot } else { SumOrder::Gemm };
        (cold_end - self.n_cached, order)
    }

    /// Put the prompt's newly computed blocks in the prefix cache: each full
    /// block once computed, and the last, partial one once the whole prompt
    /// is in. Only positions a cold prefill of a longer prompt would compute
    /// alike are offered: a one-token last chunk runs in the single-token
    /// summation order, so that position is left out.
    fn store_blocks(&mut self, kv: &mut KvCache, chunk: usize, keep_tail_open: bool) {
        let Some((seed, bs)) = kv.blocks.hashing().filter(|_| !self.trimmed) else { return };
        let last_chunk = (self.n_prompt - 1) % chunk + 1;
        let cacheable = self.n_prompt - usize::from(last_chunk == 1);
        let done = self.n_cached.min(cacheable);
        let parent = |i: usize| if i == 0 { seed } else { self.hashes[i - 1] };
        let full = (done / bs).min(self.hashes.len());
        for i in self.n_stored..full {
            kv.blocks.store(self.blocks[i], self.hashes[i], parent(i), &self.tokens[i * bs..(i + 1) * bs]);
        }
        self.n_stored = self.n_stored.max(full);
        // A sequence that goes on decoding here stores its partial block
        // when released, with the generated positions in it.
        if self.n_cached >= self.n_prompt && !self.tail_stored && !keep_tail_open {
            self.tail_stored = true;
            let i = cacheable / bs;
            let tail = &self.tokens[i * bs..cacheable];
            if !tail.is_empty() && i >= self.n_stored {
                let p = parent(i);
                kv.blocks.store(self.blocks[i], pdmesh_prefix::hash::block_hash(p, tail), p, tail);
            }
        }
    }
}

impl Sequence {
    /// Offer every position with KV (prompt and generated) to the prefix
    /// cache: its full blocks under the chain of all its tokens, then its
    /// last, partial block. Blocks already stored stay as they are.
    fn store_all(&self, kv: &mut KvCache) {
        let Some((seed, bs)) = kv.blocks.hashing().filter(|_| !self.trimmed) else { return };
        let done = &self.tokens[..self.n_cached];
        let hashes = pdmesh_prefix::chain(seed, bs, done, usize::MAX);
        let mut parent = seed;
        for (i, h) in hashes.iter().enumerate() {
            kv.blocks.store(self.blocks[i], *h, parent, &done[i * bs..(i + 1) * bs]);
            parent = *h;
        }
        let tail = &done[hashes.len() * bs..];
        if !tail.is_empty() {
            let b = self.blocks[hashes.len()];
            kv.blocks.store(b, pdmesh_prefix::hash::block_hash(parent, tail), parent, tail);
        }
    }
}

/// The GPU for `options.backend`, and a line saying where the forward pass runs.
/// The single-row item of sequence `s` at `pos`, as its decode step feeds it.
fn decode_row(s: &Sequence, pos: usize, logits: bool) -> BatchItem<'_> {
    BatchItem {
        tokens: &s.tokens[pos..pos + 1],
        start_pos: pos,
        blocks: &s.blocks,
        logits,
        order: SumOrder::VecDot,
        step_first: pos,
        step_rows: 1,
    }
}

fn open_backend(model: &Model, layout: KvLayout, options: &EngineOptions) -> Result<(Option<Box<CudaModel>>, String)> {
    let on_gpu = |g: CudaModel, why: &str| {
        let (major, minor) = g.gpu.compute_capability;
        let note = format!("cuda: {} (compute {major}.{minor}{why})", g.gpu.name);
        (Some(Box::new(g)), note)
    };
    match options.backend {
        ComputeBackend::Cpu => Ok((None, "cpu".into())),
        ComputeBackend::Cuda => Ok(on_gpu(CudaModel::load(model, layout, options.kv_blocks, 0)?, "")),
        ComputeBackend::Auto => match CudaModel::load(model, layout, options.kv_blocks, 0) {
            Ok(g) => Ok(on_gpu(g, "; chosen by auto")),
            Err(e) => Ok((None, format!("cpu (auto: {e})"))),
        },
    }
}

/// Memory other workers' KV transfers read or write (what NIXL registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferArena {
    pub addr: usize,
    pub len: usize,
    /// The GPU whose memory it is; `None` for host memory.
    pub gpu: Option<u64>,
}

pub struct Engine {
    pub model: Model,
    pub kv: KvCache,
    /// The GPU running the forward pass (`--backend cuda|auto`); its VRAM
    /// arena mirrors `kv`'s layout, and `kv`'s host arena stages transfers.
    cuda: Option<Box<CudaModel>>,
    /// Where the forward pass runs, and why (for /statusz and logs).
    pub backend_note: String,
    /// On a GPU: greedy rows are picked there (only ids come back).
    device_sampling: bool,
    /// On a GPU: other workers' KV transfers read and write the VRAM arena
    /// (registered with NIXL), not the host arena.
    transfers_in_vram: bool,
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
        let prefix = PrefixConfig {
            capacity: options.prefix_cache_blocks,
            seed: pdmesh_prefix::seed(&model.identity(), options.block_size),
            block_size: options.block_size,
        };
        let (cuda, backend_note) = open_backend(&model, layout, &options)?;
        let mut kv = KvCache::with_prefix(layout, options.kv_blocks, Some(prefix));
        kv.set_windows(model.config.layers.iter().map(|l| l.window).collect());
        Ok(Engine {
            transfers_in_vram: cuda.is_some(),
            device_sampling: true,
            cuda,
            backend_note,
            kv,
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

    /// The handle that sets how many of the kernel pool's threads loops
    /// run on (replicas sharing a host divide its cores).
    pub fn pool_share(&self) -> PoolShare {
        self.pool.share()
    }

    /// Whether the forward pass runs on a GPU.
    pub fn on_gpu(&self) -> bool {
        self.cuda.is_some()
    }

    /// On a GPU: the kernels' tuning knobs and whether decode steps replay
    /// CUDA graphs (for /statusz).
    pub fn cuda_knobs(&self) -> Option<serde_json::Value> {
        self.cuda.as_ref().map(|g| g.knobs())
    }

    /// On a GPU: replay decode steps from CUDA graphs (the default; also
    /// `PDMESH_CUDA_GRAPHS=0`), or launch every kernel. No effect on the CPU.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        if let Some(g) = &mut self.cuda {
            g.set_graphs(on);
        }
    }

    /// On a GPU: pick greedy rows' tokens on the device (the default), or
    /// bring every row's logits back to the host. No effect on the CPU.
    pub fn set_device_sampling(&mut self, on: bool) {
        self.device_sampling = on;
    }

    /// The arena other workers' KV transfers use (NIXL registers it): the
    /// VRAM arena on a GPU, unless [`Engine::stage_transfers_on_host`] was
    /// called; else the host arena.
    pub fn transfer_arena(&self) -> TransferArena {
        match &self.cuda {
            Some(g) if self.transfers_in_vram => {
                let (addr, len) = g.arena();
                TransferArena { addr, len, gpu: Some(g.gpu.ctx.ordinal() as u64) }
            }
            _ => {
                let (addr, len) = self.kv.arena();
                TransferArena { addr, len, gpu: None }
            }
        }
    }

    /// On a GPU whose VRAM the transfer library cannot register: transfers
    /// go through the host arena, which [`Engine::stage_for_send`] fills
    /// from VRAM on the sending side and [`Engine::attach_first_token`]
    /// uploads from on the receiving side.
    pub fn stage_transfers_on_host(&mut self) {
        self.transfers_in_vram = false;
    }

    /// Before a transfer reads this sequence's prompt KV from the transfer
    /// arena: on a GPU staging through the host, copy its blocks out of
    /// VRAM. Nothing to do on the CPU, or when transfers read VRAM.
    pub fn stage_for_send(&mut self, id: SeqId) -> Result<()> {
        let Some(g) = &self.cuda else { return Ok(()) };
        if self.transfers_in_vram {
            return Ok(());
        }
        let s = self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))?;
        let n = self.kv.layout.blocks_for(s.n_cached);
        g.download_blocks(&mut self.kv, &s.blocks[..n])
    }

    /// Kernel thread ids of the compute pool's workers (the thread that
    /// calls `forward_*` is the pool's other member).
    pub fn pool_thread_ids(&self) -> Vec<u32> {
        self.pool.os_thread_ids()
    }

    /// Most positions a sequence may use (model context, capped by the arena).
    pub fn max_context(&self) -> usize {
        self.model.config.context_length.min(self.kv.total() * self.kv.layout.block_size)
    }

    /// Admit a sequence: validate, and reserve KV blocks for the prompt plus
    /// `max_tokens` (so it can never run out mid-generation). Fails with
    /// `KvFull` without side effects when the blocks are not free.
    /// With a prefix cache, the prompt's longest cached prefix is reused
    /// and only the rest is computed.
    pub fn add_sequence(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        self.admit(prompt, params, true)
    }

    /// [`Engine::add_sequence`] without prefix reuse: for a sequence whose
    /// prompt KV will be imported (the decode side), which must own every
    /// block it writes into.
    pub fn reserve_sequence(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        self.admit(prompt, params, false)
    }

    /// [`Engine::reserve_sequence`] for a sequence handed over mid-stream
    /// by another worker: the transfer brings the KV of the prompt and of
    /// every replayed token but the last (`params.replay`, what the other
    /// worker generated), and the sequence goes on from there with no step
    /// replaying them.
    pub fn reserve_continued(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        if params.replay.is_empty() {
            return Err(EngineError::InvalidArgument("a continued sequence needs the tokens it generated".into()));
        }
        let more = params.replay.len() - 1;
        let id = self.admit(prompt, params, false)?;
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        s.n_transfer += more;
        Ok(id)
    }

    fn admit(&mut self, prompt: Vec<u32>, params: SamplingParams, reuse: bool) -> Result<SeqId> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(t) = prompt.iter().chain(&params.replay).find(|t| **t as usize >= self.model.config.vocab_size) {
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
        let (hashes, found) = if reuse { self.reuse(&prompt) } else { (Vec::new(), Reuse::default()) };
        let (mut blocks, partial) = (found.blocks, found.partial);
        let n_shared = blocks.len();
        let fresh = self.kv.allocate(self.kv.layout.blocks_for(needed) - n_shared);
        let copied = partial.map_or(0, |(_, n)| n);
        if let Some((src, n)) = partial {
            if let Ok(f) = &fresh {
                self.kv.copy_positions(src, f[0], n);
                if let Some(g) = &mut self.cuda {
                    g.copy_positions(src, f[0], n)?;
                }
            }
            self.kv.release(&[src]);
        }
        match fresh {
            Ok(f) => blocks.extend(f),
            Err(e) => {
                self.kv.release(&blocks);
                return Err(e);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let n_prompt = prompt.len();
        let n_reused = n_shared * self.kv.layout.block_size + copied;
        let seq = Sequence {
            tokens: prompt,
            n_prompt,
            n_cached: n_reused,
            blocks,
            params,
            finish: None,
            hashes,
            n_stored: n_shared,
            tail_stored: false,
            n_reused,
            n_transfer: n_prompt,
            trimmed: false,
        };
        self.seqs.insert(id, seq);
        Ok(id)
    }

    /// The prompt's full-block hashes and what of its longest cached
    /// prefix can be reused (held for the caller). The last prompt token is
    /// always computed (its logits pick the first token), so a prompt that
    /// is all cached still runs one position.
    fn reuse(&mut self, prompt: &[u32]) -> (Vec<BlockHash>, Reuse) {
        let Some((seed, bs)) = self.kv.blocks.hashing() else { return (Vec::new(), Reuse::default()) };
        let hashes = pdmesh_prefix::chain(seed, bs, prompt, usize::MAX);
        // Where a position's arithmetic follows its step's shape, KV cached
        // from a step of another shape differs in its last bits: a whole
        // block at least must come back (not just the BOS all prompts share).
        let at_least = if self.model.step_shaped() { bs } else { 1 };
        let found = self.kv.blocks.lookup(&hashes, prompt, prompt.len() - 1, at_least);
        (hashes, found)
    }

    /// Prompt positions of a sequence whose KV came from the prefix cache.
    pub fn reused_tokens(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.n_reused)
    }

    /// Free a sequence's blocks and forget it. Unknown ids are an error.
    /// With [`EngineOptions::cache_generated`], its computed positions stay
    /// in the prefix cache first.
    pub fn release(&mut self, id: SeqId) -> Result<()> {
        let s = self.seqs.remove(&id).ok_or(EngineError::UnknownSequence(id))?;
        if self.options.cache_generated {
            s.store_all(&mut self.kv);
        }
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
    ) -> Result<Vec<(SeqId, NextToken)>> {
        let chunk = chunk.max(1);
        let plan: Vec<(SeqId, usize)> = ids.iter().map(|id| (*id, chunk)).collect();
        self.forward_runs(&plan, chunk, opts)
    }

    /// One forward step feeding at most `n` pending tokens of each `(id, n)`
    /// (a prefill step under a token budget). Prompts keep the chunking and
    /// summation order of a cold prefill in `prefill_chunk` chunks, however
    /// the budget splits them, so the logits do not depend on the budget.
    /// Returns the logits of each sequence whose pending tokens are all in.
    pub fn forward_some(&mut self, plan: &[(SeqId, usize)], opts: StepOptions) -> Result<Vec<(SeqId, NextToken)>> {
        self.forward_runs(plan, self.options.prefill_chunk, opts)
    }

    /// Pending tokens of a sequence (prompt positions not yet computed, or
    /// the one token a decode step feeds).
    pub fn pending(&self, id: SeqId) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(s.tokens.len() - s.n_cached)
    }

    fn forward_runs(
        &mut self,
        runs: &[(SeqId, usize)],
        cold_chunk: usize,
        opts: StepOptions,
    ) -> Result<Vec<(SeqId, NextToken)>> {
        let mut plan = Vec::with_capacity(runs.len());
        for (id, most) in runs {
            let s = self.seq(*id)?;
            if s.finish.is_some() {
                return Err(EngineError::InvalidArgument(format!("sequence {id} has finished")));
            }
            let pending = s.tokens.len() - s.n_cached;
            if pending == 0 || *most == 0 {
                return Err(EngineError::InvalidArgument(format!("sequence {id} has no pending tokens to feed")));
            }
            let (n, order) = s.next_run(cold_chunk.max(1));
            let n = n.min(*most);
            // The first rows computed after a prefix reuse form one step
            // with the reused ones, as in a cold prefill of the prompt.
            let first = if s.n_cached == s.n_reused && s.n_reused > 0 {
                s.n_cached / cold_chunk.max(1) * cold_chunk.max(1)
            } else {
                s.n_cached
            };
            plan.push((*id, s.n_cached, n, n == pending, order, first));
        }
        let items: Vec<BatchItem<'_>> = plan
            .iter()
            .flat_map(|(id, start, n, last, order, first)| {
                let s = &self.seqs[id];
                if *start >= s.n_prompt && *n > 1 {
                    // Replayed tokens: one single-row item each, in one
                    // step. A row's arithmetic does not depend on the other
                    // items (nor, alone in its item, on neighbours), and
                    // each item's KV is written before any attends, so each
                    // row gets the bits its own decode step would have.
                    return (0..*n).map(|j| decode_row(s, start + j, *last && j + 1 == *n)).collect::<Vec<_>>();
                }
                let tokens = &s.tokens[*start..start + n];
                let (step_first, step_rows) = (*first, start + n - first);
                vec![BatchItem {
                    tokens,
                    start_pos: *start,
                    blocks: &s.blocks,
                    logits: *last,
                    order: *order,
                    step_first,
                    step_rows,
                }]
            })
            .collect();
        let mut next = match &mut self.cuda {
            Some(g) => {
                // Greedy rows are picked on the device: only their ids come back.
                let picks: Vec<bool> = (plan.iter().filter(|p| p.3))
                    .map(|p| self.device_sampling && self.seqs[&p.0].params.is_greedy())
                    .collect();
                g.forward(&self.model, &items, opts, &picks)?
            }
            None => {
                let logits = self.model.forward(&self.pool, &mut self.kv, &items, &mut self.scratch, opts)?;
                let vocab = self.model.config.vocab_size;
                logits.chunks_exact(vocab).map(|l| NextToken::Logits(l.to_vec())).collect()
            }
        }
        .into_iter();
        let mut out = Vec::new();
        for (id, _, n, last, _, _) in plan {
            let s = self.seqs.get_mut(&id).expect("planned sequence exists");
            s.n_cached += n;
            s.store_blocks(&mut self.kv, cold_chunk.max(1), self.options.cache_generated);
            if last {
                out.push((id, next.next().expect("one output per finished row")));
            }
        }
        Ok(out)
    }

    /// Append the token `next` gives (sampled from its logits, or picked
    /// on the GPU) and decide whether the sequence ends.
    pub fn accept(&mut self, id: SeqId, next: &NextToken) -> Result<TokenEvent> {
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        let token = next.sample(&s.params, s.generated());
        self.push_token(id, token)
    }

    /// Write the KV of a sequence's whole prompt (and, continued, of its
    /// replayed tokens but the last), computed elsewhere, into its reserved
    /// blocks (the decode side of a prefill/decode split).
    pub fn import_prompt_kv(&mut self, id: SeqId, blob: &KvBlob) -> Result<()> {
        let s = self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))?;
        if s.n_cached != 0 || s.tokens.len() != s.n_prompt {
            return Err(EngineError::InvalidArgument(format!("sequence {id} already has KV")));
        }
        if blob.n_tokens != s.n_transfer {
            return Err(EngineError::KvMismatch(format!(
                "blob holds {} positions, the sequence expects {}",
                blob.n_tokens, s.n_transfer
            )));
        }
        self.kv.import(&s.blocks, blob)?;
        // Where transfers land in VRAM, the first token's attach uploads
        // nothing: this copy goes up now.
        match &mut self.cuda {
            Some(g) if self.transfers_in_vram => {
                g.upload(&self.kv, &s.blocks[..self.kv.layout.blocks_for(blob.n_tokens)])
            }
            _ => Ok(()),
        }
    }

    /// After [`Engine::import_prompt_kv`]: mark the prompt cached and append
    /// the first token, sampled by whoever ran the prompt. The sequence can
    /// then join decode steps (unless the first token already ends it).
    /// A continued sequence takes its replayed tokens instead, all at once
    /// (their KV came with the prompt's); the event is its last one's.
    pub fn attach_first_token(&mut self, id: SeqId, token: u32) -> Result<TokenEvent> {
        let vocab = self.model.config.vocab_size;
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        if s.n_cached != 0 || s.tokens.len() != s.n_prompt {
            return Err(EngineError::InvalidArgument(format!("sequence {id} already started")));
        }
        if token as usize >= vocab {
            return Err(EngineError::BadToken(token));
        }
        s.n_cached = s.n_transfer;
        s.trimmed = self.kv.shipped(s.n_transfer).trimmed > 0;
        let before_last = s.n_transfer - s.n_prompt;
        s.tokens.extend_from_slice(&s.params.replay[..before_last]);
        // The prompt's KV is in VRAM already (written there by NIXL, or
        // uploaded by `import_prompt_kv`), unless transfers stage through
        // the host arena: then the GPU takes its copy now.
        if let Some(g) = self.cuda.as_mut().filter(|_| !self.transfers_in_vram) {
            let n = self.kv.layout.blocks_for(s.n_transfer);
            g.upload(&self.kv, &s.blocks[..n])?;
        }
        // The imported prompt joins the prefix cache (where the prefill
        // worker computed it as a cold prefill would).
        if let Some((seed, bs)) = self.kv.blocks.hashing() {
            s.hashes = pdmesh_prefix::chain(seed, bs, &s.tokens[..s.n_prompt], usize::MAX);
            s.store_blocks(&mut self.kv, self.options.prefill_chunk, self.options.cache_generated);
        }
        self.push_token(id, token)
    }

    fn push_token(&mut self, id: SeqId, token: u32) -> Result<TokenEvent> {
        let eog = &self.model.config.eog_ids;
        let max_ctx = self.max_context();
        let s = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSequence(id))?;
        // A migrated sequence's next token is the one it already sent.
        let replayed = s.params.replay.get(s.generated()).copied();
        let token = replayed.unwrap_or(token);
        let event = s.push(token, eog, max_ctx, replayed.is_some());
        // On the CPU the rest of the replayed tokens go in now, to be fed in
        // one step (their logits would only be replaced by them).
        if replayed.is_some() && self.cuda.is_none() {
            while let (None, Some(t)) = (s.finish, s.params.replay.get(s.generated()).copied()) {
                s.push(t, eog, max_ctx, true);
            }
        }
        Ok(TokenEvent { seq: id, ..event })
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
    /// A migrated sequence's replayed tokens all feed in its first decode
    /// step (on the CPU), each row as its own step would compute it.
    pub fn decode_with(&mut self, ids: &[SeqId], opts: StepOptions) -> Result<Vec<TokenEvent>> {
        let mut plan = Vec::with_capacity(ids.len());
        for id in ids {
            let s = self.seq(*id)?;
            let pending = s.tokens.len() - s.n_cached;
            if pending == 0 || s.n_cached < s.n_prompt {
                return Err(EngineError::InvalidArgument(format!("sequence {id} is not ready to decode")));
            }
            plan.push((*id, pending));
        }
        let out = self.forward_some(&plan, opts)?;
        out.into_iter().map(|(id, l)| self.accept(id, &l)).collect()
    }

    /// The KV of a sequence's cached positions, for moving it elsewhere.
    pub fn export_kv(&self, id: SeqId) -> Result<KvBlob> {
        let s = self.seq(id)?;
        match &self.cuda {
            Some(g) => g.export(&s.blocks, s.n_cached),
            None => self.kv.export(&s.blocks, s.n_cached),
        }
    }

    /// CRC-32C of each block of a sequence's cached positions, as a
    /// transfer moves them (from VRAM where transfers read VRAM).
    pub fn kv_checksums(&self, id: SeqId) -> Result<Vec<u32>> {
        let s = self.seq(id)?;
        self.checksums_of(&s.blocks, s.n_cached)
    }

    /// What a transfer of a sequence's cached positions moves of each of
    /// its blocks (all of each, unless sliding windows trim the oldest).
    pub fn shipped(&self, id: SeqId) -> Result<crate::kv::Shipped> {
        Ok(self.kv.shipped(self.seq(id)?.n_cached))
    }

    /// Whether the KV a transfer brings a reserved sequence leaves parts
    /// out (its checksums are then taken from its blocks once it landed).
    pub fn transfer_trimmed(&self, id: SeqId) -> Result<bool> {
        Ok(self.kv.shipped(self.seq(id)?.n_transfer).trimmed > 0)
    }

    /// CRC-32C of each block of the positions a transfer brought a
    /// reserved sequence (its prompt; continued, also its replayed tokens
    /// but the last): what a receiver checks before the first decode step
    /// (see [`crate::kv::verify_checksums`]).
    pub fn transfer_checksums(&self, id: SeqId) -> Result<Vec<u32>> {
        let s = self.seq(id)?;
        self.checksums_of(&s.blocks, s.n_transfer)
    }

    fn checksums_of(&self, blocks: &[u32], n_tokens: usize) -> Result<Vec<u32>> {
        match &self.cuda {
            Some(g) if self.transfers_in_vram => {
                Ok(crate::kv::block_checksums(&g.export(blocks, n_tokens)?.bytes, self.kv.layout.block_bytes()))
            }
            _ => self.kv.checksums(blocks, n_tokens),
        }
    }

    /// Fault injection: flip one byte of a sequence's last prompt block in
    /// the memory transfers read (the host arena), after its checksums were
    /// taken; flipping it again restores it.
    pub fn flip_prompt_byte(&mut self, id: SeqId) -> Result<()> {
        let s = self.seq(id)?;
        let n = self.kv.layout.blocks_for(s.n_cached);
        let b = *s.blocks.get(n.saturating_sub(1)).ok_or(EngineError::UnknownSequence(id))?;
        self.kv.flip_byte(b, 1, 0x40);
        Ok(())
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
        let id = self.reserve_sequence(prompt, params)?;
        let s = self.seqs.get_mut(&id).expect("just added");
        let imported = self.kv.import(&s.blocks, blob).and_then(|()| match &mut self.cuda {
            Some(g) => g.upload(&self.kv, &s.blocks[..self.kv.layout.blocks_for(blob.n_tokens)]),
            None => Ok(()),
        });
        if let Err(e) = imported {
            self.release(id)?;
            return Err(e);
        }
        let s = self.seqs.get_mut(&id).expect("just added");
        s.tokens = tokens;
        s.n_cached = blob.n_tokens;
        s.trimmed = self.kv.shipped(blob.n_tokens).trimmed > 0;
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
