//! The forward pass on a GPU: the same model, batch API and KV layout as
//! the CPU path (`model.rs`), through pdmesh-cuda's kernels. Weights are
//! uploaded once, as the model file holds them (Q4_1, Q8_0); the KV arena
//! lives in VRAM, block for block the layout of [`KvCache`].
//!
//! - Decode steps replay CUDA graphs (one per row count).
//! - Greedy rows are picked on the device (`argmax`); only their ids come
//!   back. Other rows bring their logits to the host's sampler.
//! - NIXL registers the VRAM arena ([`CudaModel::arena`]), so transfers go
//!   GPU to GPU. Where it cannot, transfers stage through the host arena:
//!   [`CudaModel::download_blocks`] before a send, [`CudaModel::upload`]
//!   after a receive. TCP exports read VRAM ([`CudaModel::export`]).

use std::collections::HashMap;

use pdmesh_cuda::gemm::{product_path, ProductPath};
use pdmesh_cuda::gpu::{AttentionRows, Gpu, GpuError, Knobs, KvShape, WeightType, Q8_BLOCK_BYTES};

use super::{BatchItem, Model, StepOptions, Weight};
use crate::error::{EngineError, Result};
use crate::gguf::TensorType;
use crate::kv::{KvBlob, KvCache, KvLayout};
use crate::sampler::NextToken;
use cudarc::driver::{CudaSlice, DevicePtr};

fn gpu_err(e: GpuError) -> EngineError {
    EngineError::from(e)
}

/// A driver error while doing `what`, classified ([`GpuError::driver`]).
fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> EngineError + '_ {
    move |e| EngineError::from(GpuError::driver(what, e))
}

struct DevWeight {
    data: CudaSlice<u8>,
    ty: WeightType,
    rows: usize,
    cols: usize,
    /// The same matrix dequantized to f16, for the GEMM path (when cuBLAS is there).
    f16: Option<CudaSlice<u16>>,
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
    /// f16 activations of the GEMM path.
    x16: CudaSlice<u16>,
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
    /// Decode steps replayed from a CUDA graph, by rows in the step.
    graphs: HashMap<usize, DecodeGraph>,
    /// `PDMESH_CUDA_GRAPHS=0` turns graphs off (default on).
    use_graphs: bool,
    /// Positions of the model's context (graph steps size attention for it).
    context: usize,
    /// Every weight has its f16 copy and cuBLAS is loaded: steps of
    /// `knobs.gemm_min_rows` rows or more run their products as GEMMs.
    gemm: bool,
}

/// A decode step of a fixed number of rows, captured once and replayed:
/// each replay writes the step's rows into `rows`' buffers first.
struct DecodeGraph {
    rows: Rows,
    logits: CudaSlice<f32>,
    graph: Graph,
}

/// A captured graph that may move to another thread with its engine.
struct Graph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graphs must not be used from two threads at once; the engine
// owns its graphs and uses them only through `&mut self`, so at most one
// thread touches one at a time, whichever thread that is.
unsafe impl Send for Graph {}

/// Graph steps take at most this many rows (larger decode batches run eagerly).
const MAX_GRAPH_ROWS: usize = 64;

/// Per-step row tables on the GPU.
struct Rows {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    block: CudaSlice<i32>,
    slot: CudaSlice<i32>,
    att: AttentionRows,
    /// Rows whose logits are wanted.
    logit_rows: Vec<usize>,
}

/// A step's rows on the host: token, position, KV block and slot of each,
/// and the block tables attention reads.
struct RowData {
    tokens: Vec<i32>,
    pos: Vec<i32>,
    block: Vec<i32>,
    slot: Vec<i32>,
    starts: Vec<i32>,
    tables: Vec<i32>,
    logit_rows: Vec<usize>,
    max_ctx: usize,
}

impl RowData {
    /// With `stride`, row r's table starts at `r * stride` (zero-padded):
    /// a fixed layout for graph steps, whose items are one row each.
    fn of(batch: &[BatchItem<'_>], block_size: usize, stride: Option<usize>) -> RowData {
        let mut d = RowData {
            tokens: Vec::new(),
            pos: Vec::new(),
            block: Vec::new(),
            slot: Vec::new(),
            starts: Vec::new(),
            tables: Vec::new(),
            logit_rows: Vec::new(),
            max_ctx: 0,
        };
        for item in batch {
            let start = d.tables.len() as i32;
            d.tables.extend(item.blocks.iter().map(|b| *b as i32));
            if let Some(w) = stride {
                d.tables.resize(start as usize + w, 0);
            }
            for (i, t) in item.tokens.iter().enumerate() {
                let p = item.start_pos + i;
                d.tokens.push(*t as i32);
                d.pos.push(p as i32);
                d.block.push(item.blocks[p / block_size] as i32);
                d.slot.push((p % block_size) as i32);
                d.starts.push(start);
                d.max_ctx = d.max_ctx.max(p + 1);
            }
            if item.logits {
                d.logit_rows.push(d.tokens.len() - 1);
            }
        }
        d
    }
}

impl Rows {
    fn upload(g: &Gpu, d: &RowData, max_ctx: usize) -> Result<Rows> {
        let up = |v: &[i32]| g.upload(v).map_err(gpu_err);
        Ok(Rows {
            att: AttentionRows {
                n: d.tokens.len(),
                pos: up(&d.pos)?,
                table_start: up(&d.starts)?,
                tables: up(&d.tables)?,
                max_ctx,
            },
            tokens: up(&d.tokens)?,
            pos: up(&d.pos)?,
            block: up(&d.block)?,
            slot: up(&d.slot)?,
            logit_rows: d.logit_rows.clone(),
        })
    }

    /// Write `d` (the same shape as at upload) into these buffers.
    fn write(&mut self, g: &Gpu, d: &RowData) -> Result<()> {
        let w = |v: &[i32], dst: &mut CudaSlice<i32>| {
            g.stream.memcpy_htod(v, dst).map_err(driver_err("writing a step's rows"))
        };
        w(&d.tokens, &mut self.tokens)?;
        w(&d.pos, &mut self.pos)?;
        w(&d.block, &mut self.block)?;
        w(&d.slot, &mut self.slot)?;
        w(&d.pos, &mut self.att.pos)?;
        w(&d.starts, &mut self.att.table_start)?;
        w(&d.tables, &mut self.att.tables)
    }
}

impl CudaModel {
    /// Open GPU `ordinal`, upload `model`'s weights, and make a VRAM arena
    /// of `kv_blocks` blocks shaped as `layout`.
    pub fn load(model: &Model, layout: KvLayout, kv_blocks: usize, ordinal: usize) -> Result<CudaModel> {
        if model.arch().name != "llama" {
            return Err(EngineError::Unsupported(format!(
                "the CUDA backend runs the llama architecture only; {} runs on the CPU (--backend cpu)",
                model.arch().name
            )));
        }
        let knobs = Knobs::from_env().map_err(EngineError::InvalidArgument)?;
        let gpu = Gpu::open(ordinal, knobs).map_err(gpu_err)?;
        let gemm = gpu.gemm_ready();
        let up = |w: &Weight| -> Result<DevWeight> {
            let ty = match w.ty {
                TensorType::Q4_1 => WeightType::Q4_1,
                TensorType::Q8_0 => WeightType::Q8_0,
                TensorType::Q5_0 => WeightType::Q5_0,
                TensorType::Q5_1 => WeightType::Q5_1,
                TensorType::Q2K => WeightType::Q2K,
                TensorType::Q3K => WeightType::Q3K,
                TensorType::Q4K => WeightType::Q4K,
                TensorType::Q5K => WeightType::Q5K,
                TensorType::Q6K => WeightType::Q6K,
                other => return Err(EngineError::Unsupported(format!("the CUDA backend has no {other} kernels yet"))),
            };
            let data = gpu.upload(&w.map[w.range.clone()]).map_err(gpu_err)?;
            let f16 = if gemm { Some(gpu.dequant_f16(&data, ty, w.rows * w.cols).map_err(gpu_err)?) } else { None };
            Ok(DevWeight { data, ty, rows: w.rows, cols: w.cols, f16 })
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
        if !matches!(model.tok_embd.ty, TensorType::Q4_1 | TensorType::Q8_0) {
            return Err(EngineError::Unsupported(format!(
                "the CUDA backend embeds tokens from Q4_1 or Q8_0 tables; this file's token_embd is {}",
                model.tok_embd.ty
            )));
        }
        let tok_embd = up(&model.tok_embd)?;
        let output = model.output.as_ref().map(up).transpose()?;
        let output_norm = f(&model.output_norm)?;
        let arena = gpu.zeros::<u16>(kv_blocks * layout.block_elems()).map_err(gpu_err)?;
        let use_graphs = std::env::var("PDMESH_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let context = model.config.context_length;
        Ok(CudaModel {
            gemm,
            gpu,
            layers,
            tok_embd,
            output,
            output_norm,
            arena,
            layout,
            scratch: None,
            graphs: HashMap::new(),
            use_graphs,
            context,
        })
    }

    /// The knob values and graph setting, as /statusz shows them.
    pub fn knobs(&self) -> serde_json::Value {
        let k = self.gpu.knobs;
        serde_json::json!({
            "rows_per_cta": k.rows_per_cta,
            "gemm_min_rows": k.gemm_min_rows,
            "gemm": self.gpu.blas_note,
            "graphs": self.use_graphs,
        })
    }

    /// Replay decode steps from CUDA graphs (the default), or launch every kernel.
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
        self.graphs.clear();
    }

    fn shape(&self) -> KvShape {
        let l = self.layout;
        KvShape { n_layers: l.n_layers, n_kv_heads: l.n_kv_heads, head_dim: l.head_dim, block_size: l.block_size }
    }

    fn scratch(&mut self, m: &Model, n_tok: usize) -> Result<Scratch> {
        if let Some(s) = self.scratch.take().filter(|s| s.cap >= n_tok) {
            return Ok(s);
        }
        // Graphs hold the old buffers' addresses.
        self.graphs.clear();
        let c = &m.config;
        let cap = n_tok.next_power_of_two().max(MAX_GRAPH_ROWS);
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
            x16: self.gpu.zeros::<u16>(if self.gemm { cap * c.n_ff.max(c.n_embd) } else { 0 }).map_err(gpu_err)?,
        })
    }

    /// One step for `batch` (the CPU's `Model::forward`): the logits of
    /// the rows that want them, `[row][vocab]`. With `opts.kernel_spans`,
    /// each launch gets a span with its grid, block, knobs and device time.
    ///
    /// `picks[i]` says whether logit row i is picked here (its argmax, only
    /// the id copied back) or comes back as logits for the host's sampler.
    pub fn forward(
        &mut self,
        m: &Model,
        batch: &[BatchItem<'_>],
        opts: StepOptions,
        picks: &[bool],
    ) -> Result<Vec<NextToken>> {
        let n_tok: usize = batch.iter().map(|b| b.tokens.len()).sum();
        if n_tok == 0 {
            return Ok(Vec::new());
        }
        let decode_only = batch.iter().all(|b| b.tokens.len() == 1 && b.logits);
        let fits = (self.context + m.config.head_dim) * 4 <= 48 * 1024;
        let eager = opts.kernel_spans || m.dump_dir.is_some();
        if self.use_graphs && decode_only && fits && !eager && n_tok <= MAX_GRAPH_ROWS {
            self.forward_graph(m, batch)?;
            let dg = &self.graphs[&n_tok];
            return self.read_out(&dg.logits, picks, m.config.vocab_size, false);
        }
        let data = RowData::of(batch, self.layout.block_size, None);
        let rows = Rows::upload(&self.gpu, &data, data.max_ctx)?;
        let mut s = self.scratch(m, n_tok)?;
        let mut logits = self.gpu.zeros::<f32>(rows.logit_rows.len() * m.config.vocab_size).map_err(gpu_err)?;
        let shape = self.shape();
        let k = Launches::new(&self.gpu, opts.kernel_spans, n_tok, self.gemm);
        let head = (&self.tok_embd, self.output.as_ref(), &self.output_norm);
        let r = step(&k, &self.layers, &mut self.arena, head, shape, m, &rows, &mut s, &mut logits);
        self.scratch = Some(s);
        r?;
        self.read_out(&logits, picks, m.config.vocab_size, opts.kernel_spans)
    }

    /// Each logit row's output: the device's argmax for picked rows (one
    /// launch, ids copied back), the row's logits for the others.
    fn read_out(&self, logits: &CudaSlice<f32>, picks: &[bool], vocab: usize, spans: bool) -> Result<Vec<NextToken>> {
        let rows = picks.len();
        if !picks.iter().any(|p| *p) {
            // Every row's logits: one copy, not one per row.
            let all = self.gpu.download(logits).map_err(gpu_err)?;
            return Ok(all.chunks_exact(vocab).map(|l| NextToken::Logits(l.to_vec())).collect());
        }
        let ids = {
            let mut ids = self.gpu.zeros::<i32>(rows).map_err(gpu_err)?;
            let k = Launches::new(&self.gpu, spans, rows, false);
            k.run("argmax", 0, rows, vocab, |g| g.argmax(logits, rows, vocab, &mut ids))?;
            self.gpu.download(&ids).map_err(gpu_err)?
        };
        let row = |r: usize| {
            (self.gpu.stream.clone_dtoh(&logits.slice(r * vocab..(r + 1) * vocab)))
                .map_err(driver_err("copying logits to the host"))
        };
        (0..rows)
            .map(|r| Ok(if picks[r] { NextToken::Picked(ids[r] as u32) } else { NextToken::Logits(row(r)?) }))
            .collect()
    }

    /// The VRAM arena's device address and length in bytes (NIXL registers it).
    pub fn arena(&self) -> (usize, usize) {
        let (ptr, _synced) = self.arena.device_ptr(&self.gpu.stream);
        (ptr as usize, self.arena.len() * 2)
    }

    /// Copy `blocks` of the VRAM arena into `kv`'s host arena (a transfer
    /// staged through the host reads them there).
    pub fn download_blocks(&self, kv: &mut KvCache, blocks: &[u32]) -> Result<()> {
        let e = self.layout.block_elems();
        for b in blocks {
            let at = *b as usize * e..(*b as usize + 1) * e;
            self.gpu
                .stream
                .memcpy_dtoh(&self.arena.slice(at), kv.block_bits_mut(*b))
                .map_err(|e| driver_err(&format!("copying KV block {b} to the host"))(e))?;
        }
        self.gpu.sync().map_err(gpu_err)
    }

    /// A decode step (one token per item) replayed from its graph, captured
    /// the first time a step of this many rows runs.
    fn forward_graph(&mut self, m: &Model, batch: &[BatchItem<'_>]) -> Result<()> {
        let n = batch.len();
        let stride = self.layout.blocks_for(self.context);
        let data = RowData::of(batch, self.layout.block_size, Some(stride));
        let mut s = self.scratch(m, n)?;
        if !self.graphs.contains_key(&n) {
            let captured = self.capture(m, &data, &mut s);
            if let Err(e) = captured {
                self.scratch = Some(s);
                return Err(e);
            }
        }
        self.scratch = Some(s);
        let dg = self.graphs.get_mut(&n).expect("captured above");
        dg.rows.write(&self.gpu, &data)?;
        dg.graph.0.launch().map_err(driver_err("replaying the decode graph"))
    }

    /// Capture the decode step for `data`'s rows (its launches record, they do not run).
    fn capture(&mut self, m: &Model, data: &RowData, s: &mut Scratch) -> Result<()> {
        let n = data.tokens.len();
        let rows = Rows::upload(&self.gpu, data, self.context)?;
        let mut logits = self.gpu.zeros::<f32>(n * m.config.vocab_size).map_err(gpu_err)?;
        let shape = self.shape();
        let CudaModel { gpu, layers, arena, tok_embd, output, output_norm, gemm, .. } = self;
        let k = Launches::new(gpu, false, n, *gemm);
        let head = (&*tok_embd, output.as_ref(), &*output_norm);
        let graph = gpu.capture(|| step(&k, layers, arena, head, shape, m, &rows, s, &mut logits))?;
        self.graphs.insert(n, DecodeGraph { rows, logits, graph: Graph(graph) });
        Ok(())
    }

    /// The KV of `n_tokens` positions held in `blocks`, copied out of VRAM
    /// (the same bytes `KvCache::export` gives on the CPU path).
    pub fn export(&self, blocks: &[u32], n_tokens: usize) -> Result<KvBlob> {
        let blocks = self.layout.covering(blocks, n_tokens)?;
        let e = self.layout.block_elems();
        let mut bits = vec![0u16; blocks.len() * e];
        for (b, dst) in blocks.iter().zip(bits.chunks_exact_mut(e)) {
            let at = *b as usize * e..(*b as usize + 1) * e;
            self.gpu
                .stream
                .memcpy_dtoh(&self.arena.slice(at), dst)
                .map_err(|e| driver_err(&format!("copying KV block {b} to the host"))(e))?;
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
                .map_err(|e| driver_err(&format!("copying KV block {b} to the GPU"))(e))?;
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
                    copied.map_err(driver_err("copying cached KV positions"))?;
                }
            }
        }
        Ok(())
    }
}

/// Runs a step's launches, each under its own span when asked.
#[derive(Clone, Copy)]
struct Launches<'a> {
    gpu: &'a Gpu,
    on: bool,
    /// Rows in the step (m).
    rows: usize,
    /// The f16 weights and cuBLAS are there.
    gemm: bool,
    /// How this many rows run their matrix products.
    path: ProductPath,
}

impl<'a> Launches<'a> {
    fn new(gpu: &'a Gpu, on: bool, rows: usize, gemm: bool) -> Launches<'a> {
        let path = product_path(rows, gpu.knobs.gemm_min_rows, gemm);
        Launches { gpu, on, rows, gemm, path }
    }

    /// The same launches for a step of `rows` rows (the output head's).
    fn with_rows(&self, rows: usize) -> Launches<'a> {
        Launches::new(self.gpu, self.on, rows, self.gemm)
    }

    /// Run `f` (one kernel, or a few launches of it) as `name` for `layer`
    /// with outputs `n` and inputs `k` per row.
    fn run(
        &self,
        name: &'static str,
        layer: usize,
        n: usize,
        k: usize,
        f: impl FnOnce(&Gpu) -> std::result::Result<(), GpuError>,
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
            { ka::GEMM_MIN_ROWS } = self.gpu.knobs.gemm_min_rows as i64,
            { ka::PATH } = self.path.name(),
            { ka::GRID } = tracing::field::Empty,
            { ka::BLOCK } = tracing::field::Empty,
            { ka::DEVICE_MS } = tracing::field::Empty,
        )
        .entered();
        // Timing that cannot be had leaves the field empty; it never fails the step.
        if let Some(ms) = self.gpu.timed(f).map_err(gpu_err)? {
            span.record(ka::DEVICE_MS, ms as f64);
        }
        if let Some(c) = self.gpu.last_launch() {
            let (g, b) = (c.grid_dim, c.block_dim);
            span.record(ka::GRID, format!("{},{},{}", g.0, g.1, g.2));
            span.record(ka::BLOCK, format!("{},{},{}", b.0, b.1, b.2));
        }
        Ok(())
    }
}

/// A step's activations for its matrix products, as its path wants them:
/// Q8 blocks (matvec) or f16 (GEMM).
fn acts(
    k: &Launches,
    li: usize,
    width: usize,
    x: &CudaSlice<f32>,
    (qa, x16): (&mut CudaSlice<u8>, &mut CudaSlice<u16>),
) -> Result<()> {
    let n = k.rows * width;
    match k.path {
        ProductPath::Matvec => k.run("quantize_q8", li, width, width, |g| g.quantize_q8(x, qa, n)),
        ProductPath::Gemm => k.run("cast_f16", li, width, width, |g| g.cast_f16(x, x16, n)),
    }
}

/// `y = x · Wᵀ` for the step's rows, from the activations [`acts`] made.
fn linear(
    k: &Launches,
    name: &'static str,
    li: usize,
    w: &DevWeight,
    (qa, x16): (&CudaSlice<u8>, &CudaSlice<u16>),
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    match (k.path, &w.f16) {
        (ProductPath::Gemm, Some(w16)) => {
            k.run(name, li, w.rows, w.cols, |g| g.linear_f16(w16, x16, y, w.rows, w.cols, k.rows))
        }
        _ => k.run(name, li, w.rows, w.cols, |g| g.matvec(&w.data, w.ty, qa, y, w.rows, w.cols, k.rows)),
    }
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
    logits: &mut CudaSlice<f32>,
) -> Result<()> {
    let (embd, output, output_norm) = head;
    let (d, n) = (m.config.n_embd, k.rows);
    k.run("embed", 0, d, d, |g| g.embed(&embd.data, embd.ty, &rows.tokens, &mut s.x, n, d))?;
    for (li, l) in layers.iter().enumerate() {
        attention_block(k, l, li, arena, shape, m, rows, s)?;
        ffn_block(k, l, li, m, s)?;
        dump_layer(k.gpu, m, li, &s.x, n * d)?;
    }
    output_head(k, embd, output, output_norm, m, rows, s, logits)
}

/// Debugging (`Model::with_dump_dir`; never in a graph): the residual
/// stream after layer `li`, as the CPU path dumps it (`l_out-N`).
fn dump_layer(g: &Gpu, m: &Model, li: usize, x: &CudaSlice<f32>, len: usize) -> Result<()> {
    if let Some(dir) = &m.dump_dir {
        let host = g.download(x).map_err(gpu_err)?;
        super::dump_tensor(dir, &format!("l_out-{li}"), &host[..len]);
    }
    Ok(())
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
    acts(k, li, d, &s.xn, (&mut s.qa, &mut s.x16))?;
    linear(k, "matmul_q", li, &l.wq, (&s.qa, &s.x16), &mut s.q)?;
    linear(k, "matmul_k", li, &l.wk, (&s.qa, &s.x16), &mut s.k)?;
    linear(k, "matmul_v", li, &l.wv, (&s.qa, &s.x16), &mut s.v)?;
    k.run("rope", li, d + kvd, hd, |g| {
        g.rope(&mut s.q, &rows.pos, n, c.n_heads, hd, c.rope_dims, c.rope_base)?;
        g.rope(&mut s.k, &rows.pos, n, c.n_kv_heads, hd, c.rope_dims, c.rope_base)
    })?;
    k.run("kv_write", li, kvd, hd, |g| g.kv_write(&s.k, &s.v, arena, &rows.block, &rows.slot, n, li, shape))?;
    let scale = 1.0 / (hd as f32).sqrt();
    k.run("attention", li, d, rows.att.max_ctx, |g| {
        g.attention(&s.q, &mut s.att, arena, &rows.att, c.n_heads, li, shape, scale)
    })?;
    acts(k, li, d, &s.att, (&mut s.qa, &mut s.x16))?;
    linear(k, "matmul_o", li, &l.wo, (&s.qa, &s.x16), &mut s.proj)?;
    k.run("add", li, d, d, |g| g.add_into(&mut s.x, &s.proj, n * d))
}

fn ffn_block(k: &Launches, l: &DevLayer, li: usize, m: &Model, s: &mut Scratch) -> Result<()> {
    let c = &m.config;
    let (d, ff, n) = (c.n_embd, c.n_ff, k.rows);
    k.run("rms_norm", li, d, d, |g| g.rms_norm(&s.x, &l.ffn_norm, &mut s.xn, n, d, c.rms_eps))?;
    acts(k, li, d, &s.xn, (&mut s.qa, &mut s.x16))?;
    linear(k, "matmul_gate", li, &l.w_gate, (&s.qa, &s.x16), &mut s.gate)?;
    linear(k, "matmul_up", li, &l.w_up, (&s.qa, &s.x16), &mut s.up)?;
    k.run("silu_mul", li, ff, ff, |g| g.silu_mul(&mut s.gate, &s.up, n * ff))?;
    acts(k, li, ff, &s.gate, (&mut s.qa, &mut s.x16))?;
    linear(k, "matmul_down", li, &l.w_down, (&s.qa, &s.x16), &mut s.proj)?;
    k.run("add", li, d, d, |g| g.add_into(&mut s.x, &s.proj, n * d))
}

/// The final norm and the output projection, for the rows that want
/// logits, into `logits` (`[row][vocab]`).
#[allow(clippy::too_many_arguments)]
fn output_head(
    k: &Launches,
    embd: &DevWeight,
    output: Option<&DevWeight>,
    output_norm: &CudaSlice<f32>,
    m: &Model,
    rows: &Rows,
    s: &mut Scratch,
    logits: &mut CudaSlice<f32>,
) -> Result<()> {
    let c = &m.config;
    let (g, d, n) = (k.gpu, c.n_embd, rows.logit_rows.len());
    if n == 0 {
        return Ok(());
    }
    for (i, r) in rows.logit_rows.iter().enumerate() {
        let src = s.x.slice(r * d..(r + 1) * d);
        let mut dst = s.xn.slice_mut(i * d..(i + 1) * d);
        g.stream.memcpy_dtod(&src, &mut dst).map_err(driver_err("gathering rows"))?;
    }
    let layer = m.layers.len();
    let head_k = k.with_rows(n);
    head_k.run("rms_norm", layer, d, d, |g| g.rms_norm(&s.xn, output_norm, &mut s.att, n, d, c.rms_eps))?;
    acts(&head_k, layer, d, &s.att, (&mut s.qa, &mut s.x16))?;
    linear(&head_k, "matmul_lm_head", layer, output.unwrap_or(embd), (&s.qa, &s.x16), logits)
}
