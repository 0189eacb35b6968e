//! The forward pass over a batch of sequence chunks, and the layers every
//! architecture is built from.
//!
//! Each architecture has one file (`model/llama.rs`, `model/gemma3.rs`):
//! its hyper-parameters, tensor names and layer graph, over the shared
//! steps here (norms, projections, RoPE and the KV write, attention, the
//! feed-forward); `model/arch.rs` is the table that names them. All tokens of a batch (prompt chunks and single decode tokens alike) are
//! stacked into one activation matrix, so every weight is read once per step
//! whatever the batch; attention runs per sequence against the paged cache.
//! A token's arithmetic never depends on other sequences in the batch, so
//! a sequence gets bit-identical logits alone or batched. With Q4_1, Q5_0
//! and Q8_0 weights it does not depend on its own neighbours either, so
//! chunking a prompt changes nothing. Q4_K and Q6_K products follow
//! llama.cpp, whose order depends on the shape of the step: Q4_K rows in
//! whole fours of a sequence go through its 4-row GEMM order, Q6_K rows of
//! a sequence with 8 or more in the step through its tiled GEMM order
//! (`QActs::group_rows`). So for those models a prompt's logits depend on
//! how it is chunked, exactly as llama.cpp's depend on its batches.

use std::cell::RefCell;
use std::sync::Arc;

use memmap2::Mmap;
use std::path::Path;

pub use pdmesh_kernels::attention::SumOrder;
use pdmesh_kernels::attention::{attend_flash, attend_flash_tiled, attend_window, KvView, FA_TILE_Q, VALUE_PAD};
use pdmesh_kernels::formats::WeightError;
use pdmesh_kernels::matmul::{acts_for, matmul_many, quantize_acts, QActs, QData, QMatrix};
use pdmesh_kernels::pool::{Pool, SyncPtr};
use pdmesh_kernels::{norm, rope, Backend};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::{Gguf, TensorType};
use crate::kv::KvCache;

pub mod arch;
pub mod cuda;
mod gemma3;
mod llama;
pub mod reference;

pub use arch::ArchDef;

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
        match QData::from_bytes(info.ty, g.tensor_bytes(info)) {
            Ok(q) if cols.is_multiple_of(q.block_len()) => {}
            Ok(q) => {
                return Err(bad(format!("row length {cols} is not a multiple of {}'s {}", info.ty, q.block_len())))
            }
            Err(WeightError::Misaligned) => return Err(bad("data is misaligned".into())),
            Err(WeightError::Unsupported(t)) => {
                return Err(EngineError::Unsupported(format!(
                "tensor {name} has type {t}; the matmuls take Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K"
            )))
            }
        }
        let start = info.offset as usize;
        Ok(Weight { rows, cols, ty: info.ty, map: g.map(), range: start..start + info.size as usize })
    }

    pub fn matrix(&self) -> QMatrix<'_> {
        // Type, alignment and length were checked at load.
        let data = QData::from_bytes(self.ty, &self.map[self.range.clone()]).expect("checked at load");
        QMatrix { rows: self.rows, cols: self.cols, data }
    }

    fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let q = self.matrix().data;
        q.dequantize(r * self.cols / q.block_len(), out);
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

/// One layer's weights. `q_norm` .. `post_ffn_norm` are the extra norms
/// some architectures have (Gemma 3: per-head RMS norms of Q and K, and
/// norms of the attention and feed-forward outputs).
pub(crate) struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
}

impl Layer {
    /// The weights every architecture here has, under GGUF's names.
    fn load_common(g: &Gguf, c: &ModelConfig, i: usize) -> Result<Layer> {
        let (d, qd, kvd, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        Ok(Layer {
            attn_norm: load_f32(g, &n("attn_norm"), d)?,
            wq: Weight::load(g, &n("attn_q"), qd, d)?,
            wk: Weight::load(g, &n("attn_k"), kvd, d)?,
            wv: Weight::load(g, &n("attn_v"), kvd, d)?,
            wo: Weight::load(g, &n("attn_output"), d, qd)?,
            ffn_norm: load_f32(g, &n("ffn_norm"), d)?,
            w_gate: Weight::load(g, &n("ffn_gate"), ff, d)?,
            w_up: Weight::load(g, &n("ffn_up"), ff, d)?,
            w_down: Weight::load(g, &n("ffn_down"), d, ff)?,
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            post_ffn_norm: None,
        })
    }

    fn matrices(&self) -> [&Weight; 7] {
        [&self.wq, &self.wk, &self.wv, &self.wo, &self.w_gate, &self.w_up, &self.w_down]
    }

    fn norm_values(&self) -> usize {
        let extra = [&self.q_norm, &self.k_norm, &self.post_attn_norm, &self.post_ffn_norm];
        self.attn_norm.len() + self.ffn_norm.len() + extra.iter().map(|n| n.as_ref().map_or(0, Vec::len)).sum::<usize>()
    }
}

pub struct Model {
    pub config: ModelConfig,
    arch: &'static ArchDef,
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

impl Model {
    /// Whether a position's arithmetic depends on the shape of the step
    /// that computes it (llama.cpp's flash attention kernels, chosen by the
    /// step's rows), beyond the summation order every model has.
    pub fn step_shaped(&self) -> bool {
        self.arch.flash_attention
    }
}

/// `f(x rows, out rows)` over whole rows of `x` (rows of `in_w` values,
/// out rows of `out_w`) split between the pool's threads: for
/// row-independent element-wise work (norms, activations), the same
/// result as one call over everything.
fn par_rows(pool: &Pool, x: &[f32], out: &mut [f32], in_w: usize, out_w: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    let rows = x.len() / in_w;
    let per = rows.div_ceil(pool.threads()).max(1);
    if rows < 2 * pool.threads() {
        return f(x, out);
    }
    let dst = SyncPtr::new(out);
    pool.run(rows.div_ceil(per), |t| {
        let (r0, r1) = (t * per, ((t + 1) * per).min(rows));
        // SAFETY: tasks write disjoint row ranges.
        let o = unsafe { dst.slice(r0 * out_w, (r1 - r0) * out_w) };
        f(&x[r0 * in_w..r1 * in_w], o);
    });
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
    /// The step llama.cpp would run these rows in (they lie in it): its
    /// first position and its rows. Its batch-shape choices (Q4_K and Q6_K
    /// GEMM orders, tiled flash attention) follow that step, so a prompt
    /// whose head came from the prefix cache computes its rest as a cold
    /// prompt would.
    pub step_first: usize,
    pub step_rows: usize,
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
    /// Room for a norm that writes over its input.
    tmp: Vec<f32>,
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

/// One forward step's state, handed to each layer of the graph.
pub(crate) struct Step<'a, 'b> {
    pool: &'a Pool,
    kv: &'a mut KvCache,
    batch: &'a [BatchItem<'b>],
    s: &'a mut Scratch,
    kn: Kernels,
}

impl Model {
    pub fn load(path: &Path) -> Result<(Model, Gguf)> {
        let g = Gguf::open(path)?;
        let model = Model::from_gguf(&g)?;
        Ok((model, g))
    }

    pub fn from_gguf(g: &Gguf) -> Result<Model> {
        // The architecture first: an unknown one is named, whatever keys it lacks.
        let arch = arch::find(g.get_str("general.architecture")?)?;
        let mut c = ModelConfig::from_gguf(g)?;
        (arch.hparams)(g, &mut c)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            layers.push((arch.load_layer)(g, &c, i)?);
        }
        let tok_embd = Weight::load(g, "token_embd.weight", c.vocab_size, c.n_embd)?;
        let output = match g.tensors.contains_key("output.weight") {
            true => Some(Weight::load(g, "output.weight", c.vocab_size, c.n_embd)?),
            false => None,
        };
        Ok(Model {
            output_norm: load_f32(g, "output_norm.weight", c.n_embd)?,
            config: c,
            arch,
            layers,
            tok_embd,
            output,
            backend: Backend::detect(),
            dump_dir: None,
        })
    }

    /// The architecture's entry in the table (`model/arch.rs`).
    pub fn arch(&self) -> &'static ArchDef {
        self.arch
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
            .map(|l| l.matrices().iter().map(|w| w.bytes()).sum::<usize>() + l.norm_values() * 4)
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
        let mut st = Step { pool, kv, batch, s, kn };
        for (li, layer) in self.layers.iter().enumerate() {
            (self.arch.layer)(self, &mut st, li, layer);
        }
        self.output_head(pool, batch, st.s, &kn)
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

    /// Embed every token of the batch into `s.x` (times the architecture's
    /// embedding scale), and size the scratch.
    fn embed(&self, batch: &[BatchItem<'_>], n_tok: usize, s: &mut Scratch) {
        let c = &self.config;
        let (d, qd, kvd, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        s.x.resize(n_tok * d, 0.0);
        let mut row = 0;
        for item in batch {
            for t in item.tokens {
                self.tok_embd.dequant_row(*t as usize, &mut s.x[row * d..(row + 1) * d]);
                row += 1;
            }
        }
        if let Some(scale) = (self.arch.embd_scale)(c) {
            s.x.iter_mut().for_each(|v| *v *= scale);
        }
        for (buf, width) in
            [(&mut s.xn, d), (&mut s.q, qd), (&mut s.k, kvd), (&mut s.v, kvd), (&mut s.att, qd), (&mut s.proj, d)]
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

    // The shared steps the architecture files build their layers from.

    /// `s.xn = rms_norm(s.x) * w`.
    fn norm_in(&self, st: &mut Step<'_, '_>, li: usize, w: &[f32]) {
        let (s, eps, d, pool) = (&mut *st.s, self.config.rms_eps, self.config.n_embd, st.pool);
        st.kn.run("rms_norm", li, d, d, || par_rows(pool, &s.x, &mut s.xn, d, d, |x, o| norm::rms_norm(x, w, eps, o)));
    }

    /// `v = rms_norm(v) * w` in place, over rows of `w.len()` (a whole
    /// embedding, or one head).
    fn norm_over(st: &mut Step<'_, '_>, li: usize, v: &mut Vec<f32>, tmp: &mut Vec<f32>, w: &[f32], eps: f32) {
        tmp.resize(v.len(), 0.0);
        let (n, pool) = (w.len(), st.pool);
        st.kn.run("rms_norm", li, n, n, || par_rows(pool, v, tmp, n, n, |x, o| norm::rms_norm(x, w, eps, o)));
        std::mem::swap(v, tmp);
    }

    /// Products of `x` (rows of `cols`) with weights sharing those inputs,
    /// in one parallel loop; activations quantized as the weights need.
    fn project<const N: usize>(
        &self,
        st: &mut Step<'_, '_>,
        (li, name): (usize, &'static str),
        x: &[f32],
        ws: [&Weight; N],
        outs: [&mut [f32]; N],
    ) {
        let (be, pool, n_tok) = (self.backend, st.pool, st.kn.rows);
        let ms = ws.map(|w| w.matrix());
        let refs: [&QMatrix<'_>; N] = std::array::from_fn(|i| &ms[i]);
        let cols = ms[0].cols;
        let n: usize = ms.iter().map(|m| m.rows).sum();
        let (qa, batch) = (&mut st.s.qa, st.batch);
        st.kn.run("quantize_q8", li, cols, cols, || quantize_acts(be, pool, x, n_tok, cols, &acts_for(&refs), qa));
        qa.group_rows(batch.iter().map(|b| (b.tokens.len(), b.start_pos - b.step_first, b.step_rows)));
        st.kn.run(name, li, n, cols, || matmul_many(be, pool, refs, qa, outs));
    }

    /// Q, K and V of the normed input `s.xn`.
    fn qkv(&self, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
        let s = &mut *st.s;
        let (xn, q, k, v) =
            (std::mem::take(&mut s.xn), std::mem::take(&mut s.q), std::mem::take(&mut s.k), std::mem::take(&mut s.v));
        let (mut q, mut k, mut v) = (q, k, v);
        self.project(st, (li, "matmul_qkv"), &xn, [&l.wq, &l.wk, &l.wv], [&mut q, &mut k, &mut v]);
        let s = &mut *st.s;
        (s.xn, s.q, s.k, s.v) = (xn, q, k, v);
    }

    /// Per-head RMS norms of this step's queries and keys (Gemma 3).
    fn qk_norms(&self, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
        let eps = self.config.rms_eps;
        let (mut q, mut k, mut tmp) =
            (std::mem::take(&mut st.s.q), std::mem::take(&mut st.s.k), std::mem::take(&mut st.s.tmp));
        if let Some(w) = &l.q_norm {
            Self::norm_over(st, li, &mut q, &mut tmp, w, eps);
        }
        if let Some(w) = &l.k_norm {
            Self::norm_over(st, li, &mut k, &mut tmp, w, eps);
        }
        (st.s.q, st.s.k, st.s.tmp) = (q, k, tmp);
    }

    /// RoPE on this step's queries and keys (at the layer's base); keys and
    /// values into the cache.
    fn rope_and_write(&self, st: &mut Step<'_, '_>, li: usize, neox: bool) {
        let c = &self.config;
        let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let base = c.layers[li].rope_base;
        let rope = if neox { rope::rope_row_neox } else { rope::rope_row };
        let (s, kv) = (&mut *st.s, &mut *st.kv);
        st.kn.run("rope_kv_write", li, qd + kvd, hd, || {
            let mut row = 0;
            for item in st.batch {
                for i in 0..item.tokens.len() {
                    let pos = item.start_pos + i;
                    rope(&mut s.q[row * qd..(row + 1) * qd], hd, c.rope_dims, pos, base);
                    rope(&mut s.k[row * kvd..(row + 1) * kvd], hd, c.rope_dims, pos, base);
                    for h in 0..c.n_kv_heads {
                        let at = row * kvd + h * hd..row * kvd + (h + 1) * hd;
                        kv.write(item.blocks, li, 0, h, pos, &s.k[at.clone()]);
                        kv.write(item.blocks, li, 1, h, pos, &s.v[at]);
                    }
                    row += 1;
                }
            }
        });
    }

    /// Attention of `s.q` over the cache into `s.att`, each query's dot
    /// products scaled by `kq_scale`, within the layer's window.
    fn attend(&self, st: &mut Step<'_, '_>, li: usize, kq_scale: f32) {
        let longest = st.batch.iter().map(|b| b.start_pos + b.tokens.len()).max().unwrap_or(0);
        let (s, kv, batch, pool) = (&mut *st.s, &*st.kv, st.batch, st.pool);
        let qd = self.config.q_dim();
        st.kn.run("attention", li, qd, longest, || self.attention(pool, kv, batch, li, &s.q, kq_scale, &mut s.att));
    }

    /// `s.proj = s.att · Woᵀ`.
    fn out_proj(&self, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
        let (att, mut proj) = (std::mem::take(&mut st.s.att), std::mem::take(&mut st.s.proj));
        self.project(st, (li, "matmul_o"), &att, [&l.wo], [&mut proj]);
        (st.s.att, st.s.proj) = (att, proj);
    }

    /// `s.gate`, `s.up` from the normed input `s.xn`.
    fn gate_up(&self, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
        let s = &mut *st.s;
        let (xn, mut gate, mut up) =
            (std::mem::take(&mut s.xn), std::mem::take(&mut s.gate), std::mem::take(&mut s.up));
        self.project(st, (li, "matmul_gate_up"), &xn, [&l.w_gate, &l.w_up], [&mut gate, &mut up]);
        (st.s.xn, st.s.gate, st.s.up) = (xn, gate, up);
    }

    /// `s.gate = gelu(s.gate) * s.up` (GGML's GeGLU), rows split between threads.
    fn geglu(&self, st: &mut Step<'_, '_>, li: usize) {
        let (s, ff, pool) = (&mut *st.s, self.config.n_ff, st.pool);
        let mut gate = std::mem::take(&mut s.gate);
        st.kn.run("gelu_mul", li, ff, ff, || {
            let g = SyncPtr::new(&mut gate);
            let rows = s.up.len() / ff;
            let per = rows.div_ceil(pool.threads()).max(1);
            pool.run(rows.div_ceil(per), |t| {
                let (r0, r1) = (t * per, ((t + 1) * per).min(rows));
                // SAFETY: tasks touch disjoint row ranges of the gate.
                let gr = unsafe { g.slice(r0 * ff, (r1 - r0) * ff) };
                pdmesh_kernels::activation::gelu_mul(gr, &s.up[r0 * ff..r1 * ff]);
            });
        });
        s.gate = gate;
    }

    /// `s.proj = s.gate · W_downᵀ` (the activation already applied).
    fn down(&self, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
        let (gate, mut proj) = (std::mem::take(&mut st.s.gate), std::mem::take(&mut st.s.proj));
        self.project(st, (li, "matmul_down"), &gate, [&l.w_down], [&mut proj]);
        (st.s.gate, st.s.proj) = (gate, proj);
    }

    /// `s.proj = rms_norm(s.proj) * w` (a norm of a block's output).
    fn post_norm(&self, st: &mut Step<'_, '_>, li: usize, w: &[f32]) {
        let (mut proj, mut tmp) = (std::mem::take(&mut st.s.proj), std::mem::take(&mut st.s.tmp));
        Self::norm_over(st, li, &mut proj, &mut tmp, w, self.config.rms_eps);
        (st.s.proj, st.s.tmp) = (proj, tmp);
    }

    /// `s.x += s.proj`.
    fn residual(st: &mut Step<'_, '_>) {
        let s = &mut *st.s;
        s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
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
        self.dump("result_norm", 0, &normed);
        let head = self.output.as_ref().unwrap_or(&self.tok_embd).matrix();
        quantize_acts(be, pool, &normed, rows.len(), d, &acts_for(&[&head]), &mut s.qa);
        let mut logits = vec![0f32; rows.len() * c.vocab_size];
        let head_kn = Kernels { rows: rows.len(), ..*kn };
        head_kn.run("matmul_lm_head", self.layers.len(), c.vocab_size, d, || {
            matmul_many(be, pool, [&head], &s.qa, [&mut logits])
        });
        self.dump("result_output", 0, &logits);
        Ok(logits)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &Pool,
        kv: &KvCache,
        batch: &[BatchItem<'_>],
        layer: usize,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (qd, hd, group) = (c.q_dim(), c.head_dim, c.group());
        let window = c.layers[layer].window;
        let flash = self.arch.flash_attention;
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
        let be = self.backend;
        let dst = SyncPtr::new(out);
        pool.run(tasks.len(), |t| {
            let (i, h, row0, q0, q1) = tasks[t];
            let item = &batch[i];
            let n_ctx = item.start_pos + q1;
            let order = item.order;
            ATT_SCRATCH.with(|cell| {
                let (keys, vals, scores) = &mut *cell.borrow_mut();
                let stride = n_ctx.next_multiple_of(VALUE_PAD);
                // What the chunk's first query sees: a window layer reads
                // nothing before it (zeros stand in: they weigh nothing).
                let seen = window.map_or(0, |w| (item.start_pos + q0 + 1).saturating_sub(w))..n_ctx;
                // llama.cpp's tiled kernel for a sequence's steps of 64+ rows.
                let tiled = flash && item.step_rows >= FA_TILE_Q;
                if tiled {
                    keys.resize(hd * stride, 0.0);
                    kv.gather_transposed(item.blocks, layer, 0, h, seen.clone(), stride, keys);
                } else {
                    keys.resize(n_ctx * hd, 0.0);
                    kv.gather(item.blocks, layer, 0, h, seen.clone(), keys);
                }
                if flash {
                    vals.resize(n_ctx * hd, 0.0);
                    kv.gather(item.blocks, layer, 1, h, seen, vals);
                } else {
                    vals.resize(hd * stride, 0.0);
                    kv.gather_transposed(item.blocks, layer, 1, h, seen, stride, vals);
                }
                for qi in q0..q1 {
                    let r = row0 + qi;
                    let cols = r * qd + h * group * hd..r * qd + (h + 1) * group * hd;
                    // SAFETY: each (row, kv head) output range belongs to exactly one task.
                    let o = unsafe { dst.slice(cols.start, cols.len()) };
                    let end = item.start_pos + qi + 1;
                    let first = window.map_or(0, |w| end.saturating_sub(w));
                    if tiled {
                        attend_flash_tiled(be, &q[cols], keys, stride, vals, hd, first..end, scale, o);
                    } else if flash {
                        attend_flash(be, &q[cols], keys, vals, hd, first..end, scale, o);
                    } else {
                        let view = KvView { keys, values_t: vals, stride, head_dim: hd };
                        attend_window(be, &q[cols], view, first..end, scale, order, scores, o);
                    }
                }
            });
        });
    }
}
