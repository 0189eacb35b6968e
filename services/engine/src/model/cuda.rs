//! The forward pass on a GPU: the same model, batch API and KV layout as
//! the CPU path (`model.rs`), through pdmesh-cuda's kernels. Weights are
//! uploaded once, as the model file holds them (Q4_1, Q8_0); the KV arena
//! lives in VRAM, block for block the layout of [`KvCache`], whose host
//! arena stays the staging area for transfers: [`CudaModel::download`]
//! before an export, [`CudaModel::upload`] after an import.
//!
//! Not yet here: CUDA graphs for the decode step, and registering the VRAM
//! arena with NIXL (transfers go through host memory).

use pdmesh_cuda::gpu::{AttentionRows, Gpu, Knobs, KvShape, WeightType, Q8_BLOCK_BYTES};

use super::{BatchItem, Model, StepOptions, Weight};
use crate::error::{EngineError, Result};
use crate::gguf::TensorType;
use crate::kv::{KvBlob, KvCache, KvLayout};
use cudarc::driver::CudaSlice;

fn gpu_err(e: String) -> EngineError {
    EngineError::Unavailable(format!("CUDA: {e}"))
}

struct DevWeight {
    data: CudaSlice<u8>,
    ty: WeightType,
    rows: usize,
    cols: usize,
}

struct DevLayer {
    attn_norm: CudaSlice<f32>,
    wq: DevWeight,
    wk: DevWeight,
    wv: DevWeight,
    wo: DevWeight,
    ffn_norm: CudaSlice<f32>,
    w_gate: DevWeight,
    w_up: DevWeight,
    w_down: DevWeight,
}

/// Activations of one step, grown to the largest batch seen.
struct Scratch {
    cap: usize,
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    qa: CudaSlice<u8>,
}

pub struct CudaModel {
    pub gpu: Gpu,
    layers: Vec<DevLayer>,
    tok_embd: DevWeight,
    output: Option<DevWeight>,
    output_norm: CudaSlice<f32>,
    arena: CudaSlice<u16>,
    layout: KvLayout,
    scratch: Option<Scratch>,
}

/// Per-step row tables, uploaded once per step.
struct Rows {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    block: CudaSlice<i32>,
    slot: CudaSlice<i32>,
    att: AttentionRows,
    /// Rows whose logits are wanted.
    logit_rows: Vec<usize>,
}

impl CudaModel {
    /// Open GPU `ordinal`, upload `model`'s weights, and make a VRAM arena
    /// of `kv_blocks` blocks shaped as `layout`.
    pub fn load(model: &Model, layout: KvLayout, kv_blocks: usize, ordinal: usize) -> Result<CudaModel> {
        let knobs = Knobs::from_env().map_err(EngineError::InvalidArgument)?;
        let gpu = Gpu::open(ordinal, knobs).map_err(gpu_err)?;
        let up = |w: &Weight| -> Result<DevWeight> {
            let ty = match w.ty {
                TensorType::Q4_1 => WeightType::Q4_1,
                _ => WeightType::Q8_0,
            };
            Ok(DevWeight {
                data: gpu.upload(&w.map[w.range.clone()]).map_err(gpu_err)?,
                ty,
                rows: w.rows,
                cols: w.cols,
            })
        };
        let f = |v: &[f32]| gpu.upload(v).map_err(gpu_err);
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DevLayer {
                attn_norm: f(&l.attn_norm)?,
                wq: up(&l.wq)?,
                wk: up(&l.wk)?,
                wv: up(&l.wv)?,
                wo: up(&l.wo)?,
                ffn_norm: f(&l.ffn_norm)?,
                w_gate: up(&l.w_gate)?,
                w_up: up(&l.w_up)?,
                w_down: up(&l.w_down)?,
            });
        }
        let tok_embd = up(&model.tok_embd)?;
        let output = model.output.as_ref().map(up).transpose()?;
        let output_norm = f(&model.output_norm)?;
        let arena = gpu.zeros::<u16>(kv_blocks * layout.block_elems()).map_err(gpu_err)?;
        Ok(CudaModel { gpu, layers, tok_embd, output, output_norm, arena, layout, scratch: None })
    }

    fn shape(&self) -> KvShape {
        let l = self.layout;
        KvShape { n_layers: l.n_layers, n_kv_heads: l.n_kv_heads, head_dim: l.head_dim, block_size: l.block_size }
    }

    fn scratch(&mut self, m: &Model, n_tok: usize) -> Result<Scratch> {
        if let Some(s) = self.scratch.take().filter(|s| s.cap >= n_tok) {
            return Ok(s);
        }
        let c = &m.config;
        let cap = n_tok.next_power_of_two();
        let z = |n: usize| self.gpu.zeros::<f32>(cap * n).map_err(gpu_err);
        Ok(Scratch {
            cap,
            x: z(c.n_embd)?,
            xn: z(c.n_embd)?,
            q: z(c.n_embd)?,
            k: z(c.kv_dim())?,
            v: z(c.kv_dim())?,
            att: z(c.n_embd)?,
            proj: z(c.n_embd)?,
            gate: z(c.n_ff)?,
            up: z(c.n_ff)?,
            qa: self.gpu.zeros::<u8>(cap * c.n_ff.max(c.n_embd) / 32 * Q8_BLOCK_BYTES).map_err(gpu_err)?,
        })
    }

    fn rows(&self, batch: &[BatchItem<'_>]) -> Result<Rows> {
        let bs = self.layout.block_size;
        let (mut tokens, mut pos, mut block, mut slot) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut tables, mut starts, mut logit_rows) = (Vec::new(), Vec::new(), Vec::new());
        let mut max_ctx = 0;
        for item in batch {
            let start = tables.len() as i32;
            tables.extend(item.blocks.iter().map(|b| *b as i32));
            for (i, t) in item.tokens.iter().enumerate() {
                let p = item.start_pos + i;
                tokens.push(*t as i32);
                pos.push(p as i32);
                block.push(item.blocks[p / bs] as i32);
                slot.push((p % bs) as i32);
                starts.push(start);
                max_ctx = max_ctx.max(p + 1);
            }
            if item.logits {
                logit_rows.push(tokens.len() - 1);
            }
        }
        let up = |v: &[i32]| self.gpu.upload(v).map_err(gpu_err);
        Ok(Rows {
            att: AttentionRows {
                n: tokens.len(),
                pos: up(&pos)?,
                table_start: up(&starts)?,
                tables: up(&tables)?,
                max_ctx,
            },
            tokens: up(&tokens)?,
            pos: up(&pos)?,
            block: up(&block)?,
            slot: up(&slot)?,
            logit_rows,
        })
    }

    /// One step for `batch` (the CPU's `Model::forward`): the logits of
    /// the rows that want them, `[row][vocab]`. With `opts.kernel_spans`,
    /// each launch gets a span with its grid, block, knobs and device time.
    pub fn forward(&mut self, m: &Model, batch: &[BatchItem<'_>], opts: StepOptions) -> Result<Vec<f32>> {
        let n_tok: usize = batch.iter().map(|b| b.tokens.len()).sum();
        if n_tok == 0 {
            return Ok(Vec::new());
        }
        let rows = self.rows(batch)?;
        let mut s = self.scratch(m, n_tok)?;
        let shape = self.shape();
        let k = Launches { gpu: &self.gpu, on: opts.kernel_spans, rows: n_tok };
        let head = (&self.tok_embd, self.output.as_ref(), &self.output_norm);
        let r = step(&k, &self.layers, &mut self.arena, head, shape, m, &rows, &mut s);
        self.scratch = Some(s);
        r
    }

    /// The KV of `n_tokens` positions held in `blocks`, copied out of VRAM
    /// (the same bytes `KvCache::export` gives on the CPU path).
    pub fn export(&self, blocks: &[u32], n_tokens: usize) -> Result<KvBlob> {
        let need = self.layout.blocks_for(n_tokens);
        if blocks.len() < need {
            return Err(EngineError::KvMismatch(format!(
                "{n_tokens} tokens need {need} blocks, sequence has {}",
                blocks.len()
            )));
        }
        let e = self.layout.block_elems();
        let mut bits = vec![0u16; need * e];
        for (b, dst) in blocks[..need].iter().zip(bits.chunks_exact_mut(e)) {
            let at = *b as usize * e..(*b as usize + 1) * e;
            self.gpu
                .stream
                .memcpy_dtoh(&self.arena.slice(at), dst)
                .map_err(|x| gpu_err(format!("copying KV block {b} to the host: {x:?}")))?;
        }
        self.gpu.sync().map_err(gpu_err)?;
        let bytes = bits.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(KvBlob { layout: self.layout, n_tokens, bytes })
    }

    /// Copy blocks `blocks` of `kv`'s host arena into the VRAM arena (after an import).
    pub fn upload(&mut self, kv: &KvCache, blocks: &[u32]) -> Result<()> {
        let e = self.layout.block_elems();
        for b in blocks {
            let at = *b as usize * e..(*b as usize + 1) * e;
            let src = kv.block_bits(*b);
            self.gpu
                .stream
                .memcpy_htod(src, &mut self.arena.slice_mut(at))
                .map_err(|x| gpu_err(format!("copying KV block {b} to the GPU: {x:?}")))?;
        }
        Ok(())
    }

    /// Positions `0..n` of block `src` into block `dst`, every layer, keys
    /// and values (a prompt reusing the head of a cached block).
    pub fn copy_positions(&mut self, src: u32, dst: u32, n: usize) -> Result<()> {
        let l = self.layout;
        let e = l.block_elems();
        let len = n * l.head_dim;
        for layer in 0..l.n_layers {
            for kv in 0..2 {
                for head in 0..l.n_kv_heads {
                    let off = l.offset_in_block(layer, kv, head, 0);
                    let (s0, d0) = (src as usize * e + off, dst as usize * e + off);
                    let copied = if s0 < d0 {
                        let (a, mut b) = self.arena.split_at_mut(d0);
                        self.gpu.stream.memcpy_dtod(&a.slice(s0..s0 + len), &mut b.slice_mut(0..len))
                    } else {
                        let (mut a, b) = self.arena.split_at_mut(s0);
                        self.gpu.stream.memcpy_dtod(&b.slice(0..len), &mut a.slice_mut(d0..d0 + len))
                    };
                    copied.map_err(|x| gpu_err(format!("copying cached KV positions: {x:?}")))?;
                }
            }
        }
        Ok(())
    }
}

/// Runs a step's launches, each under its own span when asked.
struct Launches<'a> {
    gpu: &'a Gpu,
    on: bool,
    /// Rows in the step (m).
    rows: usize,
}

impl Launches<'_> {
    /// Run `f` (one kernel, or a few launches of it) as `name` for `layer`
    /// with outputs `n` and inputs `k` per row.
    fn run(
        &self,
        name: &'static str,
        layer: usize,
        n: usize,
        k: usize,
        f: impl FnOnce(&Gpu) -> std::result::Result<(), String>,
    ) -> Result<()> {
        if !self.on {
            return f(self.gpu).map_err(gpu_err);
        }
        use super::kernel_attr as ka;
        let span = tracing::info_span!(
            ka::SPAN,
            otel.name = name,
            { ka::BACKEND } = "cuda",
            { ka::LAYER } = layer as i64,
            { ka::M } = self.rows as i64,
            { ka::N } = n as i64,
            { ka::K } = k as i64,
            { ka::ROWS_PER_CTA } = self.gpu.knobs.rows_per_cta as i64,
            { ka::GRID } = tracing::field::Empty,
            { ka::BLOCK } = tracing::field::Empty,
            { ka::DEVICE_MS } = tracing::field::Empty,
        )
        .entered();
        let timed = |e: cudarc::driver::DriverError| gpu_err(format!("timing {name}: {e:?}"));
        let (a, b) = (self.gpu.ctx.new_event(None).map_err(timed)?, self.gpu.ctx.new_event(None).map_err(timed)?);
        a.record(&self.gpu.stream).map_err(timed)?;
        f(self.gpu).map_err(gpu_err)?;
        b.record(&self.gpu.stream).map_err(timed)?;
        b.synchronize().map_err(timed)?;
        span.record(ka::DEVICE_MS, a.elapsed_ms(&b).map_err(timed)? as f64);
        if let Some(c) = self.gpu.last_launch() {
            let (g, b) = (c.grid_dim, c.block_dim);
            span.record(ka::GRID, format!("{},{},{}", g.0, g.1, g.2));
            span.record(ka::BLOCK, format!("{},{},{}", b.0, b.1, b.2));
        }
        Ok(())
    }
}

fn matvec(
    k: &Launches,
    name: &'static str,
    li: usize,
    w: &DevWeight,
    x: &CudaSlice<u8>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    k.run(name, li, w.rows, w.cols, |g| g.matvec(&w.data, w.ty, x, y, w.rows, w.cols, k.rows))
}

#[allow(clippy::too_many_arguments)]
fn step(
    k: &Launches,
    layers: &[DevLayer],
    arena: &mut CudaSlice<u16>,
    head: (&DevWeight, Option<&DevWeight>, &CudaSlice<f32>),
    shape: KvShape,
    m: &Model,
    rows: &Rows,
    s: &mut Scratch,
) -> Result<Vec<f32>> {
    let (embd, output, output_norm) = head;
    let (d, n) = (m.config.n_embd, k.rows);
    k.run("embed", 0, d, d, |g| g.embed(&embd.data, embd.ty, &rows.tokens, &mut s.x, n, d))?;
    for (li, l) in layers.iter().enumerate() {
        attention_block(k, l, li, arena, shape, m, rows, s)?;
        ffn_block(k, l, li, m, s)?;
    }
    output_head(k, embd, output, output_norm, m, rows, s)
}

#[allow(clippy::too_many_arguments)]
fn attention_block(
    k: &Launches,
    l: &DevLayer,
    li: usize,
    arena: &mut CudaSlice<u16>,
    shape: KvShape,
    m: &Model,
    rows: &Rows,
    s: &mut Scratch,
) -> Result<()> {
    let c = &m.config;
    let (d, hd, n, kvd) = (c.n_embd, c.head_dim, k.rows, c.kv_dim());
    k.run("rms_norm", li, d, d, |g| g.rms_norm(&s.x, &l.attn_norm, &mut s.xn, n, d, c.rms_eps))?;
    k.run("quantize_q8", li, d, d, |g| g.quantize_q8(&s.xn, &mut s.qa, n * d))?;
    matvec(k, "matmul_q", li, &l.wq, &s.qa, &mut s.q)?;
    matvec(k, "matmul_k", li, &l.wk, &s.qa, &mut s.k)?;
    matvec(k, "matmul_v", li, &l.wv, &s.qa, &mut s.v)?;
    k.run("rope", li, d + kvd, hd, |g| {
        g.rope(&mut s.q, &rows.pos, n, c.n_heads, hd, c.rope_dims, c.rope_base)?;
        g.rope(&mut s.k, &rows.pos, n, c.n_kv_heads, hd, c.rope_dims, c.rope_base)
    })?;
    k.run("kv_write", li, kvd, hd, |g| g.kv_write(&s.k, &s.v, arena, &rows.block, &rows.slot, n, li, shape))?;
    let scale = 1.0 / (hd as f32).sqrt();
    k.run("attention", li, d, rows.att.max_ctx, |g| {
        g.attention(&s.q, &mut s.att, arena, &rows.att, c.n_heads, li, shape, scale)
    })?;
    k.run("quantize_q8", li, d, d, |g| g.quantize_q8(&s.att, &mut s.qa, n * d))?;
    matvec(k, "matmul_o", li, &l.wo, &s.qa, &mut s.proj)?;
    k.run("add", li, d, d, |g| g.add_into(&mut s.x, &s.proj, n * d))
}

fn ffn_block(k: &Launches, l: &DevLayer, li: usize, m: &Model, s: &mut Scratch) -> Result<()> {
    let c = &m.config;
    let (d, ff, n) = (c.n_embd, c.n_ff, k.rows);
    k.run("rms_norm", li, d, d, |g| g.rms_norm(&s.x, &l.ffn_norm, &mut s.xn, n, d, c.rms_eps))?;
    k.run("quantize_q8", li, d, d, |g| g.quantize_q8(&s.xn, &mut s.qa, n * d))?;
    matvec(k, "matmul_gate", li, &l.w_gate, &s.qa, &mut s.gate)?;
    matvec(k, "matmul_up", li, &l.w_up, &s.qa, &mut s.up)?;
    k.run("silu_mul", li, ff, ff, |g| g.silu_mul(&mut s.gate, &s.up, n * ff))?;
    k.run("quantize_q8", li, ff, ff, |g| g.quantize_q8(&s.gate, &mut s.qa, n * ff))?;
    matvec(k, "matmul_down", li, &l.w_down, &s.qa, &mut s.proj)?;
    k.run("add", li, d, d, |g| g.add_into(&mut s.x, &s.proj, n * d))
}

/// The final norm and the output projection, for the rows that want logits.
fn output_head(
    k: &Launches,
    embd: &DevWeight,
    output: Option<&DevWeight>,
    output_norm: &CudaSlice<f32>,
    m: &Model,
    rows: &Rows,
    s: &mut Scratch,
) -> Result<Vec<f32>> {
    let c = &m.config;
    let (g, d, n) = (k.gpu, c.n_embd, rows.logit_rows.len());
    if n == 0 {
        return Ok(Vec::new());
    }
    for (i, r) in rows.logit_rows.iter().enumerate() {
        let src = s.x.slice(r * d..(r + 1) * d);
        let mut dst = s.xn.slice_mut(i * d..(i + 1) * d);
        g.stream.memcpy_dtod(&src, &mut dst).map_err(|e| gpu_err(format!("gathering rows: {e:?}")))?;
    }
    let layer = m.layers.len();
    let head_k = Launches { rows: n, ..*k };
    head_k.run("rms_norm", layer, d, d, |g| g.rms_norm(&s.xn, output_norm, &mut s.att, n, d, c.rms_eps))?;
    head_k.run("quantize_q8", layer, d, d, |g| g.quantize_q8(&s.att, &mut s.qa, n * d))?;
    let head = output.unwrap_or(embd);
    let mut logits = g.zeros::<f32>(n * c.vocab_size).map_err(gpu_err)?;
    matvec(&head_k, "matmul_lm_head", layer, head, &s.qa, &mut logits)?;
    g.download(&logits).map_err(gpu_err)
}
