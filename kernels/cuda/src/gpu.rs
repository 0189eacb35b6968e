//! A GPU with pdmesh's kernels loaded, and one typed launch per kernel.
//!
//! Opening one checks for the driver first: cudarc's `CudaContext::new`
//! panics when there is none. The kernels are compiled with NVRTC for the
//! device's own compute capability when it is opened.
//!
//! Buffers are `CudaSlice`s on the GPU's stream. Quantized blocks (weights
//! straight from the model file, Q8 activations) travel as bytes.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::{compile, SOURCES};

/// Bytes of one Q8 activation block on the GPU (`block_q8`).
pub const Q8_BLOCK_BYTES: usize = 40;
/// Most tokens one matvec launch takes (`MAX_TOK` in matvec.cu).
pub const MATVEC_MAX_TOK: usize = 8;

/// Launch parameters worth tuning, reported on kernel spans and in `/statusz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// Weight rows (one warp each) per CTA of a matvec: 1 to 32.
    pub rows_per_cta: u32,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs { rows_per_cta: 4 }
    }
}

impl Knobs {
    /// `PDMESH_CUDA_ROWS_PER_CTA` over the default.
    pub fn from_env() -> Result<Knobs, String> {
        let mut k = Knobs::default();
        if let Ok(v) = std::env::var("PDMESH_CUDA_ROWS_PER_CTA") {
            k.rows_per_cta = v
                .parse()
                .ok()
                .filter(|n| (1..=32).contains(n))
                .ok_or_else(|| format!("PDMESH_CUDA_ROWS_PER_CTA={v}: a number of rows from 1 to 32"))?;
        }
        Ok(k)
    }
}

/// Weight storage on the GPU, as the model file holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    Q4_1,
    Q8_0,
}

/// Whether this machine has a CUDA driver (`libcuda.so`); nothing else is touched.
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the library can be opened.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub struct Gpu {
    /// The configuration of the last launch (kernel spans report it).
    last: std::cell::Cell<Option<LaunchConfig>>,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub knobs: Knobs,
    funcs: HashMap<&'static str, CudaFunction>,
}

fn err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// The PTX target for a device of capability `cc` (its own, where known;
/// else compute_80, which newer devices JIT-compile).
fn arch_for(cc: (i32, i32)) -> &'static str {
    match cc {
        (9, _) => "compute_90",
        (8, 9) => "compute_89",
        (8, 6) => "compute_86",
        _ => "compute_80",
    }
}

fn grid(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(threads).max(1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Gpu {
    /// Open GPU `ordinal` and load every kernel; an error says why not
    /// (no driver, no such device, NVRTC missing, a kernel that did not compile).
    pub fn open(ordinal: usize, knobs: Knobs) -> Result<Gpu, String> {
        if !driver_present() {
            return Err("no CUDA driver (libcuda.so) on this machine".into());
        }
        let count = CudaContext::device_count().map_err(err("counting CUDA devices"))?;
        if ordinal as i32 >= count {
            return Err(format!("no CUDA device {ordinal}: this machine has {count}"));
        }
        let ctx = CudaContext::new(ordinal).map_err(err("creating the CUDA context"))?;
        let cc = ctx.compute_capability().map_err(err("reading the compute capability"))?;
        if cc < (6, 1) {
            return Err(format!(
                "CUDA device {ordinal} has compute capability {}.{}; the kernels need 6.1 (dp4a)",
                cc.0, cc.1
            ));
        }
        let name = ctx.name().map_err(err("reading the device name"))?;
        let mut funcs = HashMap::new();
        for src in &SOURCES {
            let module = ctx.load_module(compile(src, arch_for(cc))?).map_err(err(src.file))?;
            for k in src.kernels() {
                funcs.insert(k, module.load_function(k).map_err(err(k))?);
            }
        }
        // One stream does all the work, in order, so cudarc need not track
        // buffers with events (which would also break graph capture); and
        // not the legacy default stream, which cannot be captured.
        // SAFETY: every buffer of this Gpu is used on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(err("creating a stream"))?;
        Ok(Gpu { last: std::cell::Cell::new(None), ctx, stream, name, compute_capability: cc, knobs, funcs })
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// The last launch's configuration (grid and block dimensions).
    pub fn last_launch(&self) -> Option<LaunchConfig> {
        self.last.get()
    }

    fn note(&self, cfg: LaunchConfig) -> LaunchConfig {
        self.last.set(Some(cfg));
        cfg
    }

    /// Record the launches `f` makes into a graph that replays them (with
    /// the same buffers; write new inputs into those buffers before each replay).
    pub fn capture(&self, f: impl FnOnce() -> Result<(), String>) -> Result<cudarc::driver::CudaGraph, String> {
        use cudarc::driver::sys;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(err("starting a graph capture"))?;
        let recorded = f();
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(err("ending a graph capture"));
        recorded?;
        graph?.ok_or_else(|| "the graph capture recorded nothing".to_string())
    }

    pub fn sync(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(err("synchronizing"))
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, String> {
        self.stream.clone_htod(host).map_err(err("copying to the GPU"))
    }

    pub fn download<T: cudarc::driver::DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, String> {
        self.stream.clone_dtoh(dev).map_err(err("copying from the GPU"))
    }

    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, String> {
        self.stream.alloc_zeros(n).map_err(err("allocating GPU memory"))
    }

    /// Rows `tokens` of an embedding table into `out` (`n_tok x cols`).
    pub fn embed(
        &self,
        table: &CudaSlice<u8>,
        ty: WeightType,
        tokens: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
        n_tok: usize,
        cols: usize,
    ) -> Result<(), String> {
        let name = match ty {
            WeightType::Q4_1 => "embed_q4_1",
            WeightType::Q8_0 => "embed_q8_0",
        };
        let (n, c) = (n_tok as i32, cols as i32);
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(table).arg(tokens).arg(out).arg(&n).arg(&c);
        // SAFETY: the kernel reads n_tok * cols values within the buffers' sizes.
        unsafe { b.launch(self.note(grid(n_tok * cols, 256))) }.map(drop).map_err(err(name))
    }

    /// RMSNorm of `rows` rows of `cols` values.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(), String> {
        let c = cols as i32;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(x).arg(w).arg(out).arg(&c).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: one CTA per row, reads and writes `cols` values of it.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("rms_norm"))
    }

    /// `x` (a multiple of 32 values) into Q8 blocks (`Q8_BLOCK_BYTES` each).
    pub fn quantize_q8(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<u8>, n_values: usize) -> Result<(), String> {
        let n_blocks = (n_values / 32) as i32;
        let mut b = self.stream.launch_builder(self.f("quantize_q8"));
        b.arg(x).arg(out).arg(&n_blocks);
        let warps_per_cta = 8;
        let cfg = LaunchConfig {
            grid_dim: ((n_blocks as u32).div_ceil(warps_per_cta).max(1), 1, 1),
            block_dim: (32 * warps_per_cta, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one warp per block of 32 values, within both buffers.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("quantize_q8"))
    }

    /// `y[t][r] = W[r] . x[t]` for `n_tok` tokens (launched in chunks of
    /// `MATVEC_MAX_TOK`), `rows x cols` weights; `rows_per_cta` from the knobs.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        w: &CudaSlice<u8>,
        ty: WeightType,
        x: &CudaSlice<u8>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> Result<(), String> {
        let name = match ty {
            WeightType::Q4_1 => "matvec_q4_1",
            WeightType::Q8_0 => "matvec_q8_0",
        };
        let bpr = cols / 32;
        let rpc = self.knobs.rows_per_cta;
        let cfg = LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(rpc), 1, 1),
            block_dim: (32, rpc, 1),
            shared_mem_bytes: 0,
        };
        for t0 in (0..n_tok).step_by(MATVEC_MAX_TOK) {
            let n = (n_tok - t0).min(MATVEC_MAX_TOK) as i32;
            let xs = x.slice(t0 * bpr * Q8_BLOCK_BYTES..);
            let mut ys = y.slice_mut(t0 * rows..);
            let (r, b_) = (rows as i32, bpr as i32);
            let mut b = self.stream.launch_builder(self.f(name));
            b.arg(w).arg(&xs).arg(&mut ys).arg(&r).arg(&b_).arg(&n);
            // SAFETY: reads `n` tokens' blocks of x and writes `n` rows of y from their offsets.
            unsafe { b.launch(self.note(cfg)) }.map_err(err(name))?;
        }
        Ok(())
    }

    /// RoPE in place on `n_rows` rows of `n_heads` heads; row r at `pos[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        n_rows: usize,
        n_heads: usize,
        head_dim: usize,
        dims: usize,
        base: f32,
    ) -> Result<(), String> {
        let a = [n_rows as i32, n_heads as i32, head_dim as i32, dims as i32];
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(x).arg(pos).arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(&a[3]).arg(&base);
        // SAFETY: one thread per (row, head, pair) within x.
        unsafe { b.launch(self.note(grid(n_rows * n_heads * dims / 2, 128))) }.map(drop).map_err(err("rope"))
    }

    /// Keys and values of `n_rows` rows into the paged arena (f16 bits).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        arena: &mut CudaSlice<u16>,
        row_block: &CudaSlice<i32>,
        row_slot: &CudaSlice<i32>,
        n_rows: usize,
        layer: usize,
        shape: KvShape,
    ) -> Result<(), String> {
        let a = [
            n_rows as i32,
            layer as i32,
            shape.n_layers as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
        ];
        let mut b = self.stream.launch_builder(self.f("kv_write"));
        b.arg(k).arg(v).arg(arena).arg(row_block).arg(row_slot);
        for x in &a {
            b.arg(x);
        }
        // SAFETY: one thread per (row, kv head, dim); blocks named by row_block lie in the arena.
        unsafe { b.launch(self.note(grid(n_rows * shape.n_kv_heads * shape.head_dim, 128))) }
            .map(drop)
            .map_err(err("kv_write"))
    }

    /// Causal GQA attention of `n_rows` query rows over the paged arena.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        arena: &CudaSlice<u16>,
        rows: &AttentionRows,
        n_heads: usize,
        layer: usize,
        shape: KvShape,
        scale: f32,
    ) -> Result<(), String> {
        let a = [
            n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
            shape.n_layers as i32,
            layer as i32,
        ];
        let mut b = self.stream.launch_builder(self.f("attention"));
        b.arg(q).arg(out).arg(arena).arg(&rows.pos).arg(&rows.table_start).arg(&rows.tables);
        for x in &a {
            b.arg(x);
        }
        b.arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (rows.n as u32, n_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: ((rows.max_ctx + shape.head_dim) * 4) as u32,
        };
        // SAFETY: each CTA reads positions 0..=pos of its row through its block table.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("attention"))
    }

    /// gate = silu(gate) * up.
    pub fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) -> Result<(), String> {
        let n_ = n as i64;
        let mut b = self.stream.launch_builder(self.f("silu_mul"));
        b.arg(gate).arg(up).arg(&n_);
        // SAFETY: one thread per value.
        unsafe { b.launch(self.note(grid(n, 256))) }.map(drop).map_err(err("silu_mul"))
    }

    /// x += y.
    pub fn add_into(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), String> {
        let n_ = n as i64;
        let mut b = self.stream.launch_builder(self.f("add_into"));
        b.arg(x).arg(y).arg(&n_);
        // SAFETY: one thread per value.
        unsafe { b.launch(self.note(grid(n, 256))) }.map(drop).map_err(err("add_into"))
    }

    /// The largest logit's index of each of `rows` rows.
    pub fn argmax(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), String> {
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(self.f("argmax"));
        b.arg(logits).arg(&v).arg(out);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: one CTA per row of `vocab` logits.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("argmax"))
    }

    /// A token per row, drawn at `temperature` with the row's uniform `u`.
    pub fn sample_temperature(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        temperature: f32,
        u: &CudaSlice<f32>,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), String> {
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(self.f("sample_temperature"));
        b.arg(logits).arg(&v).arg(&temperature).arg(u).arg(out);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: one CTA per row of `vocab` logits.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("sample_temperature"))
    }
}

/// The paged arena's shape (as `pdmesh_engine::KvLayout`, which this crate does not link).
#[derive(Debug, Clone, Copy)]
pub struct KvShape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// Where each query row of an attention launch is: its position, and its
/// sequence's block table (an offset into `tables`).
pub struct AttentionRows {
    pub n: usize,
    pub pos: CudaSlice<i32>,
    pub table_start: CudaSlice<i32>,
    pub tables: CudaSlice<i32>,
    /// The longest context of any row (sizes the shared memory).
    pub max_ctx: usize,
}
