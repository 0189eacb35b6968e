//! Llama forward pass over a batch of sequence chunks.
//!
//! All tokens of a batch (prompt chunks and single decode tokens alike) are
//! stacked into one activation matrix, so every weight is read once per step
//! whatever the batch; attention runs per sequence against the paged cache.
//! Each token's arithmetic is independent of its neighbours in the batch, so
//! a sequence gets bit-identical logits alone, batched, or chunked.

use std::cell::RefCell;
use std::sync::Arc;

use memmap2::Mmap;
use std::path::Path;

pub use pdmesh_kernels::attention::SumOrder;
use pdmesh_kernels::attention::{attend_group, KvView, VALUE_PAD};
use pdmesh_kernels::matmul::{matmul, matmul_many, quantize_rows, QActs, QData, QMatrix};
use pdmesh_kernels::pool::{Pool, SyncPtr};
use pdmesh_kernels::quant::{cast_blocks, dequantize_q4_1, dequantize_q8_0, BlockQ4_1, BlockQ8_0, QK};
use pdmesh_kernels::{activation, norm, rope, Backend};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::{Gguf, TensorType};
use crate::kv::KvCache;

pub mod cuda;
pub mod reference;

/// A quantized matrix (rows = output features) living in the model file's
/// memory map: weights are never copied, so resident memory holds them once.
pub struct Weight {
    rows: usize,
    cols: usize,
    ty: TensorType,
    map: Arc<Mmap>,
    range: std::ops::Range<usize>,
}

impl Weight {
    fn load(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let info = g.tensor(name)?;
        let bad = |why: String| EngineError::BadModel { path: g.path.clone(), why: format!("tensor {name}: {why}") };
        if info.dims.len() != 2 || info.dims[0] as usize != cols || info.dims[1] as usize != rows {
            return Err(bad(format!("shape {:?}, expected [{cols}, {rows}]", info.dims)));
        }
        if !cols.is_multiple_of(QK) {
            return Err(bad(format!("row length {cols} is not a multiple of {QK}")));
        }
        let bytes = g.tensor_bytes(info);
        let aligned = match info.ty {
            TensorType::Q4_1 => cast_blocks::<BlockQ4_1>(bytes).is_some(),
            TensorType::Q8_0 => cast_blocks::<BlockQ8_0>(bytes).is_some(),
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name} has type {other:?}; matmuls support Q4_1 and Q8_0"
                )))
            }
        };
        if !aligned {
            return Err(bad("data is misaligned".into()));
        }
        let start = info.offset as usize;
        Ok(Weight { rows, cols, ty: info.ty, map: g.map(), range: start..start + info.size as usize })
    }

    pub fn matrix(&self) -> QMatrix<'_> {
        let bytes = &self.map[self.range.clone()];
        // Alignment and length were checked at load.
        let data = match self.ty {
            TensorType::Q4_1 => QData::Q4_1(cast_blocks(bytes).expect("checked at load")),
            _ => QData::Q8_0(cast_blocks(bytes).expect("checked at load")),
        };
        QMatrix { rows: self.rows, cols: self.cols, data }
    }

    fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let nb = self.cols / QK;
        match self.matrix().data {
            QData::Q4_1(b) => dequantize_q4_1(&b[r * nb..(r + 1) * nb], out),
            QData::Q8_0(b) => dequantize_q8_0(&b[r * nb..(r + 1) * nb], out),
        }
    }

    fn bytes(&self) -> usize {
        self.range.len()
    }
}

fn load_f32(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>> {
    let info = g.tensor(name)?;
    if info.ty != TensorType::F32 || info.elements() as usize != len {
        return Err(EngineError::BadModel {
            path: g.path.clone(),
            why: format!("tensor {name}: expected {len} f32 values"),
        });
    }
    Ok(g.tensor_bytes(info).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
}

pub struct Model {
    pub config: ModelConfig,
    layers: Vec<Layer>,
    tok_embd: Weight,
    output_norm: Vec<f32>,
    /// `None` when the output projection is tied to the token embedding.
    output: Option<Weight>,
    pub backend: Backend,
    /// Debug: write every layer's intermediate tensors of each step here
    /// (`PDMESH_DEBUG_DUMP_DIR`), named as llama.cpp's eval callback names
    /// them, so `scripts/compare_with_llama_cpp.py` can diff them.
    dump_dir: Option<std::path::PathBuf>,
}

/// Write `v` as raw little-endian f32 to `dir/name.f32` (debug dumps only;
/// a failure is reported on stderr and otherwise ignored).
fn dump_tensor(dir: &std::path::Path, name: &str, v: &[f32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    if let Err(e) = std::fs::write(dir.join(format!("{name}.f32")), bytes) {
        eprintln!("pdmesh: debug dump of {name} failed: {e}");
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("config", &self.config).finish()
    }
}

/// One sequence's share of a forward step.
#[derive(Clone, Copy, Debug)]
pub struct BatchItem<'a> {
    /// Tokens to feed, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// The sequence's block table (covering at least the last position).
    pub blocks: &'a [u32],
    /// Return logits for the last token of this item.
    pub logits: bool,
    /// Summation order of this item's attention (llama.cpp's choice for
    /// the step that would have run these positions; see [`SumOrder`]).
    pub order: SumOrder,
}

/// Reusable activation buffers for one engine.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    qa: QActs,
}

thread_local! {
    /// Per-thread attention scratch: gathered keys, transposed values, scores.
    static ATT_SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Query positions one attention task handles (they share one gather).
const ATT_CHUNK: usize = 32;

/// What the caller of one engine step chooses for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// One span per kernel launch, children of the current span (the
    /// worker's step span); set per step from the worker's kernel-span knob.
    pub kernel_spans: bool,
}

/// Attribute keys of kernel-launch spans (one home: `pdmesh-vocab`).
pub use pdmesh_vocab::kernel as kernel_attr;

/// Runs one step's kernels, each under its own span when asked: name,
/// backend, shape (m rows x n outputs x k inputs), layer, and the values of
/// the kernel tuning knobs.
#[derive(Clone, Copy)]
struct Kernels {
    on: bool,
    be: pdmesh_kernels::Backend,
    threads: usize,
    /// Rows in the step (m).
    rows: usize,
}

impl Kernels {
    fn run<R>(&self, name: &'static str, layer: usize, n: usize, k: usize, f: impl FnOnce() -> R) -> R {
        use kernel_attr as ka;
        let _span = self.on.then(|| {
            tracing::info_span!(
                ka::SPAN,
                otel.name = name,
                { ka::BACKEND } = self.be.name(),
                { ka::LAYER } = layer as i64,
                { ka::M } = self.rows as i64,
                { ka::N } = n as i64,
                { ka::K } = k as i64,
                { ka::THREADS } = self.threads as i64,
                { ka::TILE_B } = pdmesh_kernels::matmul::TILE_B as i64,
                { ka::ROW_SLICE } = pdmesh_kernels::matmul::ROW_SLICE as i64,
                { ka::ATT_CHUNK } = ATT_CHUNK as i64,
            )
            .entered()
        });
        f()
    }
}

impl Model {
    pub fn load(path: &Path) -> Result<(Model, Gguf)> {
        let g = Gguf::open(path)?;
        let model = Model::from_gguf(&g)?;
        Ok((model, g))
    }

    pub fn from_gguf(g: &Gguf) -> Result<Model> {
        let c = ModelConfig::from_gguf(g)?;
        let (d, kvd, ff) = (c.n_embd, c.kv_dim(), c.n_ff);
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: load_f32(g, &n("attn_norm"), d)?,
                wq: Weight::load(g, &n("attn_q"), d, d)?,
                wk: Weight::load(g, &n("attn_k"), kvd, d)?,
                wv: Weight::load(g, &n("attn_v"), kvd, d)?,
                wo: Weight::load(g, &n("attn_output"), d, d)?,
                ffn_norm: load_f32(g, &n("ffn_norm"), d)?,
                w_gate: Weight::load(g, &n("ffn_gate"), ff, d)?,
                w_up: Weight::load(g, &n("ffn_up"), ff, d)?,
                w_down: Weight::load(g, &n("ffn_down"), d, ff)?,
            });
        }
        let tok_embd = Weight::load(g, "token_embd.weight", c.vocab_size, d)?;
        let output = match g.tensors.contains_key("output.weight") {
            true => Some(Weight::load(g, "output.weight", c.vocab_size, d)?),
            false => None,
        };
        Ok(Model {
            output_norm: load_f32(g, "output_norm.weight", d)?,
            config: c,
            layers,
            tok_embd,
            output,
            backend: Backend::detect(),
            dump_dir: None,
        })
    }

    /// Debugging only: write every layer's intermediate tensors of each
    /// step into `dir` (`--debug-dump-dir`, for comparing with llama.cpp).
    pub fn with_dump_dir(mut self, dir: Option<std::path::PathBuf>) -> Model {
        self.dump_dir = dir;
        self
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].iter().map(|w| w.bytes()).sum::<usize>()
                    + (l.attn_norm.len() + l.ffn_norm.len()) * 4
            })
            .sum();
        l + self.tok_embd.bytes() + self.output.as_ref().map_or(0, |w| w.bytes()) + self.output_norm.len() * 4
    }

    /// What, beside the tokens, decides a KV block's contents: the config,
    /// the weights' size, and a sample of the weights (the first bytes of
    /// every layer's key and value projections). Seeds the prefix hashes.
    pub fn identity(&self) -> Vec<u8> {
        let mut id = serde_json::to_vec(&self.config).unwrap_or_default();
        id.extend_from_slice(&(self.weight_bytes() as u64).to_le_bytes());
        for l in &self.layers {
            for w in [&l.wk, &l.wv] {
                let bytes = &w.map[w.range.clone()];
                id.extend_from_slice(&bytes[..bytes.len().min(64)]);
            }
        }
        id
    }

    /// Run one step. Returns `vocab_size` logits for each item with
    /// `logits: true`, in item order, concatenated.
    pub fn forward(
        &self,
        pool: &Pool,
        kv: &mut KvCache,
        batch: &[BatchItem<'_>],
        s: &mut Scratch,
        opts: StepOptions,
    ) -> Result<Vec<f32>> {
        let n_tok: usize = batch.iter().map(|b| b.tokens.len()).sum();
        if n_tok == 0 {
            return Ok(Vec::new());
        }
        self.check_batch(kv, batch)?;
        self.embed(batch, n_tok, s);
        let kn = Kernels { on: opts.kernel_spans, be: self.backend, threads: pool.threads(), rows: n_tok };
        for (li, layer) in self.layers.iter().enumerate() {
            self.attention_block(pool, kv, batch, li, layer, s, &kn);
            self.ffn_block(pool, li, layer, s, &kn);
        }
        self.output_head(pool, batch, s, &kn)
    }

    fn check_batch(&self, kv: &KvCache, batch: &[BatchItem<'_>]) -> Result<()> {
        let c = &self.config;
        for item in batch {
            let end = item.start_pos + item.tokens.len();
            if end > c.context_length || kv.layout.blocks_for(end) > item.blocks.len() {
                return Err(EngineError::InvalidArgument(format!(
                    "positions up to {end} exceed the sequence's KV reservation"
                )));
            }
            if let Some(t) = item.tokens.iter().find(|t| **t as usize >= c.vocab_size) {
                return Err(EngineError::BadToken(*t));
            }
        }
        Ok(())
    }

    /// Embed every token of the batch into `s.x`, and size the scratch.
    fn embed(&self, batch: &[BatchItem<'_>], n_tok: usize, s: &mut Scratch) {
        let c = &self.config;
        let (d, kvd, ff) = (c.n_embd, c.kv_dim(), c.n_ff);
        s.x.resize(n_tok * d, 0.0);
        let mut row = 0;
        for item in batch {
            for t in item.tokens {
                self.tok_embd.dequant_row(*t as usize, &mut s.x[row * d..(row + 1) * d]);
                row += 1;
            }
        }
        for (buf, width) in
            [(&mut s.xn, d), (&mut s.q, d), (&mut s.k, kvd), (&mut s.v, kvd), (&mut s.att, d), (&mut s.proj, d)]
        {
            buf.resize(n_tok * width, 0.0);
        }
        s.gate.resize(n_tok * ff, 0.0);
        s.up.resize(n_tok * ff, 0.0);
    }

    /// `PDMESH_DEBUG_DUMP_DIR`: write an intermediate tensor (debugging only).
    fn dump(&self, name: &str, li: usize, v: &[f32]) {
        if let Some(dir) = &self.dump_dir {
            dump_tensor(dir, &format!("{name}-{li}"), v);
        }
    }

    /// Norm, Q/K/V projections, RoPE and the KV write, attention, output
    /// projection and the residual add.
    fn attention_block(
        &self,
        pool: &Pool,
        kv: &mut KvCache,
        batch: &[BatchItem<'_>],
        li: usize,
        layer: &Layer,
        s: &mut Scratch,
        kn: &Kernels,
    ) {
        let c = &self.config;
        let (be, n_tok) = (self.backend, kn.rows);
        let (d, kvd, hd) = (c.n_embd, c.kv_dim(), c.head_dim);
        kn.run("rms_norm", li, d, d, || norm::rms_norm(&s.x, &layer.attn_norm, c.rms_eps, &mut s.xn));
        self.dump("attn_norm", li, &s.xn);
        kn.run("quantize_q8", li, d, d, || quantize_rows(be, pool, &s.xn, n_tok, d, &mut s.qa));
        let qkv = [&layer.wq.matrix(), &layer.wk.matrix(), &layer.wv.matrix()];
        kn.run("matmul_qkv", li, d + 2 * kvd, d, || matmul_many(be, pool, qkv, &s.qa, [&mut s.q, &mut s.k, &mut s.v]));
        kn.run("rope_kv_write", li, d + kvd, hd, || self.rope_and_write(kv, batch, li, s));
        self.dump("Qcur", li, &s.q);
        self.dump("Kcur", li, &s.k);
        self.dump("Vcur", li, &s.v);
        let longest = batch.iter().map(|b| b.start_pos + b.tokens.len()).max().unwrap_or(0);
        kn.run("attention", li, d, longest, || self.attention(pool, kv, batch, li, &s.q, &mut s.att));
        self.dump("kqv_out", li, &s.att);
        kn.run("quantize_q8", li, d, d, || quantize_rows(be, pool, &s.att, n_tok, d, &mut s.qa));
        kn.run("matmul_o", li, d, d, || matmul(be, pool, &layer.wo.matrix(), &s.qa, &mut s.proj));
        self.dump("attn_out", li, &s.proj);
        s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
        self.dump("ffn_inp", li, &s.x);
    }

    /// RoPE on this step's queries and keys; keys and values into the cache.
    fn rope_and_write(&self, kv: &mut KvCache, batch: &[BatchItem<'_>], li: usize, s: &mut Scratch) {
        let c = &self.config;
        let (d, kvd, hd) = (c.n_embd, c.kv_dim(), c.head_dim);
        let mut row = 0;
        for item in batch {
            for i in 0..item.tokens.len() {
                let pos = item.start_pos + i;
                rope::rope_row(&mut s.q[row * d..(row + 1) * d], hd, c.rope_dims, pos, c.rope_base);
                rope::rope_row(&mut s.k[row * kvd..(row + 1) * kvd], hd, c.rope_dims, pos, c.rope_base);
                for h in 0..c.n_kv_heads {
                    kv.write(item.blocks, li, 0, h, pos, &s.k[row * kvd + h * hd..row * kvd + (h + 1) * hd]);
                    kv.write(item.blocks, li, 1, h, pos, &s.v[row * kvd + h * hd..row * kvd + (h + 1) * hd]);
                }
                row += 1;
            }
        }
    }

    /// Norm, gate and up projections, SwiGLU, down projection and the residual add.
    fn ffn_block(&self, pool: &Pool, li: usize, layer: &Layer, s: &mut Scratch, kn: &Kernels) {
        let c = &self.config;
        let (be, n_tok) = (self.backend, kn.rows);
        let (d, ff) = (c.n_embd, c.n_ff);
        kn.run("rms_norm", li, d, d, || norm::rms_norm(&s.x, &layer.ffn_norm, c.rms_eps, &mut s.xn));
        kn.run("quantize_q8", li, d, d, || quantize_rows(be, pool, &s.xn, n_tok, d, &mut s.qa));
        let gate_up = [&layer.w_gate.matrix(), &layer.w_up.matrix()];
        kn.run("matmul_gate_up", li, 2 * ff, d, || matmul_many(be, pool, gate_up, &s.qa, [&mut s.gate, &mut s.up]));
        self.dump("ffn_gate", li, &s.gate);
        self.dump("ffn_up", li, &s.up);
        kn.run("silu_mul", li, ff, ff, || activation::silu_mul_be(be, &mut s.gate, &s.up));
        self.dump("ffn_swiglu", li, &s.gate);
        kn.run("quantize_q8", li, ff, ff, || quantize_rows(be, pool, &s.gate, n_tok, ff, &mut s.qa));
        kn.run("matmul_down", li, d, ff, || matmul(be, pool, &layer.w_down.matrix(), &s.qa, &mut s.proj));
        self.dump("ffn_out", li, &s.proj);
        s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
        self.dump("l_out", li, &s.x);
    }

    /// Output head, only for the rows that want logits.
    fn output_head(&self, pool: &Pool, batch: &[BatchItem<'_>], s: &mut Scratch, kn: &Kernels) -> Result<Vec<f32>> {
        let c = &self.config;
        let (be, d) = (self.backend, c.n_embd);
        let mut rows = Vec::new();
        let mut row = 0;
        for item in batch {
            row += item.tokens.len();
            if item.logits {
                rows.push(row - 1);
            }
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut last = Vec::with_capacity(rows.len() * d);
        for r in &rows {
            last.extend_from_slice(&s.x[r * d..(r + 1) * d]);
        }
        let mut normed = vec![0f32; last.len()];
        norm::rms_norm(&last, &self.output_norm, c.rms_eps, &mut normed);
        quantize_rows(be, pool, &normed, rows.len(), d, &mut s.qa);
        let head = self.output.as_ref().unwrap_or(&self.tok_embd);
        let mut logits = vec![0f32; rows.len() * c.vocab_size];
        let head_kn = Kernels { rows: rows.len(), ..*kn };
        head_kn.run("matmul_lm_head", self.layers.len(), c.vocab_size, d, || {
            matmul(be, pool, &head.matrix(), &s.qa, &mut logits)
        });
        Ok(logits)
    }

    fn attention(&self, pool: &Pool, kv: &KvCache, batch: &[BatchItem<'_>], layer: usize, q: &[f32], out: &mut [f32]) {
        let c = &self.config;
        let (d, hd, group) = (c.n_embd, c.head_dim, c.group());
        // Tasks: (item, kv head, chunk of query positions).
        let mut tasks = Vec::new();
        let mut row0 = 0;
        for (i, item) in batch.iter().enumerate() {
            let n = item.tokens.len();
            for h in 0..c.n_kv_heads {
                for q0 in (0..n).step_by(ATT_CHUNK) {
                    tasks.push((i, h, row0, q0, (q0 + ATT_CHUNK).min(n)));
                }
            }
            row0 += n;
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let be = self.backend;
        let dst = SyncPtr::new(out);
        pool.run(tasks.len(), |t| {
            let (i, h, row0, q0, q1) = tasks[t];
            let item = &batch[i];
            let n_ctx = item.start_pos + q1;
            let order = item.order;
            ATT_SCRATCH.with(|cell| {
                let (keys, vals_t, scores) = &mut *cell.borrow_mut();
                let stride = n_ctx.next_multiple_of(VALUE_PAD);
                keys.resize(n_ctx * hd, 0.0);
                vals_t.resize(hd * stride, 0.0);
                kv.gather(item.blocks, layer, 0, h, n_ctx, keys);
                kv.gather_transposed(item.blocks, layer, 1, h, n_ctx, stride, vals_t);
                let view = KvView { keys, values_t: vals_t, stride, head_dim: hd };
                for qi in q0..q1 {
                    let r = row0 + qi;
                    let cols = r * d + h * group * hd..r * d + (h + 1) * group * hd;
                    // SAFETY: each (row, kv head) output range belongs to exactly one task.
                    let o = unsafe { dst.slice(cols.start, cols.len()) };
                    let visible = item.start_pos + qi + 1;
                    attend_group(be, &q[cols], view, visible, scale, order, scores, o);
                }
            });
        });
    }
}
