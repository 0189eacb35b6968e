//! A GPU with pdmesh's kernels loaded, and one typed launch per kernel.
//!
//! Opening one checks for the driver first: cudarc's `CudaContext::new`
//! panics when there is none. The kernels are compiled with NVRTC for the
//! device's own compute capability when it is opened.
//!
//! Buffers are `CudaSlice`s on the GPU's stream. Quantized blocks (weights
//! straight from the model file, Q8 activations) travel as bytes.
//!
//! Every launch here is safe to call: it checks its counts against its
//! buffers' lengths before launching ([`GpuError::Invalid`] otherwise), and
//! ids that live on the device (tokens, KV blocks, positions) are guarded
//! by the kernels themselves, which never read or write past a buffer.
//! Failures are classified once ([`GpuErrorKind`]): out of memory, a lost
//! device, no usable GPU, or a bad call.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};

use crate::error::fits;
pub use crate::error::{classify, GpuError, GpuErrorKind};
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
    /// Steps of at least this many rows run their matrix products as f16
    /// GEMMs through cuBLAS (0: never; the dp4a matvec takes 8 rows a launch).
    pub gemm_min_rows: u32,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs { rows_per_cta: 4, gemm_min_rows: 9 }
    }
}

impl Knobs {
    /// `PDMESH_CUDA_ROWS_PER_CTA` and `PDMESH_CUDA_GEMM_MIN_ROWS` over the defaults.
    pub fn from_env() -> Result<Knobs, String> {
        let d = Knobs::default();
        let var = |name: &str| std::env::var(name).ok();
        Ok(Knobs {
            rows_per_cta: knob("PDMESH_CUDA_ROWS_PER_CTA", var("PDMESH_CUDA_ROWS_PER_CTA"), 1..=32, d.rows_per_cta)?,
            gemm_min_rows: knob(
                "PDMESH_CUDA_GEMM_MIN_ROWS",
                var("PDMESH_CUDA_GEMM_MIN_ROWS"),
                0..=65536,
                d.gemm_min_rows,
            )?,
        })
    }
}

/// A knob's value from its variable's text, if set, else `default`.
fn knob(name: &str, text: Option<String>, range: std::ops::RangeInclusive<u32>, default: u32) -> Result<u32, String> {
    let Some(v) = text else { return Ok(default) };
    v.trim()
        .parse()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| format!("{name}={v}: a whole number from {} to {}", range.start(), range.end()))
}

/// Weight storage on the GPU, as the model file holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl WeightType {
    /// Values per block, bytes per block, and the name the kernels use.
    fn block(self) -> (usize, usize, &'static str) {
        match self {
            WeightType::Q4_1 => (32, 20, "q4_1"),
            WeightType::Q8_0 => (32, 34, "q8_0"),
            WeightType::Q5_0 => (32, 22, "q5_0"),
            WeightType::Q5_1 => (32, 24, "q5_1"),
            WeightType::Q2K => (256, 84, "q2_k"),
            WeightType::Q3K => (256, 110, "q3_k"),
            WeightType::Q4K => (256, 144, "q4_k"),
            WeightType::Q5K => (256, 176, "q5_k"),
            WeightType::Q6K => (256, 210, "q6_k"),
        }
    }

    /// Values per block (32, or 256 for a K-quant).
    pub fn block_values(self) -> usize {
        self.block().0
    }
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
    /// cuBLAS on this GPU's stream, for the f16 GEMMs; `None` without it.
    blas: Option<crate::gemm::Blas>,
    /// Whether the GEMM path is there, or why not (`/statusz`).
    pub blas_note: String,
}

fn err(what: &str) -> impl Fn(DriverError) -> GpuError + '_ {
    move |e| GpuError::driver(what, e)
}

/// Bytes of one weight block of `ty` (32 values).
pub fn weight_block_bytes(ty: WeightType) -> usize {
    ty.block().1
}

/// A kernel's name for weights of `ty`: `{prefix}_{type}{suffix}`.
fn kernel_for(prefix: &str, ty: WeightType, suffix: &str) -> &'static str {
    let name = format!("{prefix}_{}{suffix}", ty.block().2);
    crate::SOURCES
        .iter()
        .flat_map(|s| s.kernels())
        .find(|k| *k == name)
        .unwrap_or_else(|| panic!("no kernel {name} in the CUDA sources"))
}

/// Weight blocks in a row of `cols` values of type `ty`.
fn weight_blocks_per_row(what: &str, ty: WeightType, cols: usize) -> Result<usize, GpuError> {
    let per = ty.block_values();
    if cols.is_multiple_of(per) {
        return Ok(cols / per);
    }
    Err(GpuError::invalid(format!("{what}: rows of {cols} values are not whole blocks of {per}")))
}

fn blocks_per_row(what: &str, cols: usize) -> Result<usize, GpuError> {
    if cols.is_multiple_of(32) {
        return Ok(cols / 32);
    }
    Err(GpuError::invalid(format!("{what}: rows of {cols} values are not whole blocks of 32")))
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
    pub fn open(ordinal: usize, knobs: Knobs) -> Result<Gpu, GpuError> {
        if !driver_present() {
            return Err(GpuError::unavailable("no CUDA driver (libcuda.so) on this machine"));
        }
        let count = CudaContext::device_count().map_err(err("counting CUDA devices"))?;
        if ordinal as i32 >= count {
            return Err(GpuError::unavailable(format!("no CUDA device {ordinal}: this machine has {count}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(err("creating the CUDA context"))?;
        let cc = ctx.compute_capability().map_err(err("reading the compute capability"))?;
        if cc < (6, 1) {
            return Err(GpuError::unavailable(format!(
                "CUDA device {ordinal} has compute capability {}.{}; the kernels need 6.1 (dp4a)",
                cc.0, cc.1
            )));
        }
        let name = ctx.name().map_err(err("reading the device name"))?;
        let mut funcs = HashMap::new();
        for src in &SOURCES {
            let ptx = compile(src, arch_for(cc)).map_err(GpuError::unavailable)?;
            let module = ctx.load_module(ptx).map_err(err(src.file))?;
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
        let (blas, blas_note) = match knobs.gemm_min_rows {
            0 => (None, "off (PDMESH_CUDA_GEMM_MIN_ROWS=0)".to_string()),
            n => match crate::gemm::Blas::open(&stream) {
                Ok(b) => (Some(b), format!("cuBLAS f16 GEMM for steps of {n} rows or more")),
                Err(e) => (None, e.what),
            },
        };
        Ok(Gpu {
            last: std::cell::Cell::new(None),
            ctx,
            stream,
            name,
            compute_capability: cc,
            knobs,
            funcs,
            blas,
            blas_note,
        })
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
    pub fn capture<E: From<GpuError>>(
        &self,
        f: impl FnOnce() -> Result<(), E>,
    ) -> Result<cudarc::driver::CudaGraph, E> {
        use cudarc::driver::sys;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(err("starting a graph capture"))?;
        let recorded = f();
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(err("ending a graph capture"));
        recorded?;
        graph?.ok_or_else(|| GpuError::invalid("the graph capture recorded nothing").into())
    }

    /// Run `f`'s launches between two timing events; their device time in
    /// ms. Timing never fails the work: where the events cannot be made or
    /// read, the time is `None`. A fault in the launches themselves is
    /// returned as it would be without timing.
    pub fn timed<E: From<GpuError>>(&self, f: impl FnOnce(&Gpu) -> Result<(), E>) -> Result<Option<f32>, E> {
        // Timing events: cudarc's `new_event(None)` makes events without
        // timing, whose elapsed time is INVALID_HANDLE.
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).ok().filter(|a| a.record(&self.stream).is_ok());
        f(self)?;
        let Some(start) = start else { return Ok(None) };
        let Some(end) = self.ctx.new_event(flags).ok().filter(|b| b.record(&self.stream).is_ok()) else {
            return Ok(None);
        };
        // Waiting on the end event is where a fault in the launches shows.
        end.synchronize().map_err(err("running the timed launches"))?;
        Ok(start.elapsed_ms(&end).ok())
    }

    pub fn sync(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(err("synchronizing"))
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, GpuError> {
        self.stream.clone_htod(host).map_err(err("copying to the GPU"))
    }

    pub fn download<T: cudarc::driver::DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, GpuError> {
        self.stream.clone_dtoh(dev).map_err(err("copying from the GPU"))
    }

    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, GpuError> {
        self.stream.alloc_zeros(n).map_err(err("allocating GPU memory"))
    }

    /// Whether matrix products can run as f16 GEMMs (cuBLAS loaded).
    pub fn gemm_ready(&self) -> bool {
        self.blas.is_some()
    }

    /// A weight matrix of `n_values` values (Q4_1 or Q8_0 blocks)
    /// dequantized into a new f16 buffer, row-major as the blocks lie.
    pub fn dequant_f16(&self, w: &CudaSlice<u8>, ty: WeightType, n_values: usize) -> Result<CudaSlice<u16>, GpuError> {
        let name = kernel_for("dequant", ty, "_f16");
        let n_blocks = weight_blocks_per_row(name, ty, n_values)?;
        fits(name, "weights (bytes)", w.len(), n_blocks * weight_block_bytes(ty))?;
        let mut out = self.zeros::<u16>(n_values)?;
        let n = n_values as i64;
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(w).arg(&mut out).arg(&n);
        // SAFETY: checked above: one thread per value, reading its block
        // inside `w` and writing its value inside `out`.
        unsafe { b.launch(self.note(grid(n_values, 256))) }.map_err(err(name))?;
        Ok(out)
    }

    /// `n` activations cast to f16 (the GEMMs' input).
    pub fn cast_f16(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<u16>, n: usize) -> Result<(), GpuError> {
        fits("cast_f16", "x", x.len(), n)?;
        fits("cast_f16", "out", out.len(), n)?;
        let n_ = n as i64;
        let mut b = self.stream.launch_builder(self.f("cast_f16"));
        b.arg(x).arg(out).arg(&n_);
        // SAFETY: checked above: one thread per value, within both buffers.
        unsafe { b.launch(self.note(grid(n, 256))) }.map(drop).map_err(err("cast_f16"))
    }

    /// `y[t][r] = W[r] . x[t]` for `n_tok` rows as one f16 GEMM (cuBLAS):
    /// `w` is `rows x cols` f16, `x` is `n_tok x cols` f16.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f16(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> Result<(), GpuError> {
        let blas = self.blas.as_ref().ok_or_else(|| GpuError::unavailable(self.blas_note.clone()))?;
        // cuBLAS picks its own grid: none to report.
        self.last.set(None);
        blas.linear_f16(&self.stream, w, x, y, rows, cols, n_tok)
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
    ) -> Result<(), GpuError> {
        let name = match ty {
            WeightType::Q4_1 => "embed_q4_1",
            WeightType::Q8_0 => "embed_q8_0",
            other => return Err(GpuError::invalid(format!("no embedding kernel for {other:?} tables"))),
        };
        let row_bytes = blocks_per_row(name, cols)? * weight_block_bytes(ty);
        fits(name, "tokens", tokens.len(), n_tok)?;
        fits(name, "out", out.len(), n_tok * cols)?;
        let vocab = (table.len() / row_bytes) as i32;
        let (n, c) = (n_tok as i32, cols as i32);
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(table).arg(tokens).arg(out).arg(&n).arg(&c).arg(&vocab);
        // SAFETY: checked above: n_tok tokens, n_tok * cols outputs; the
        // kernel reads only rows below `vocab`, which the table holds.
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
    ) -> Result<(), GpuError> {
        fits("rms_norm", "x", x.len(), rows * cols)?;
        fits("rms_norm", "out", out.len(), rows * cols)?;
        fits("rms_norm", "weight", w.len(), cols)?;
        let c = cols as i32;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(x).arg(w).arg(out).arg(&c).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: checked above: one CTA per row reads and writes `cols` values of it.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("rms_norm"))
    }

    /// `x` (a multiple of 32 values) into Q8 blocks (`Q8_BLOCK_BYTES` each).
    pub fn quantize_q8(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<u8>, n_values: usize) -> Result<(), GpuError> {
        let n_blocks = blocks_per_row("quantize_q8", n_values)?;
        fits("quantize_q8", "x", x.len(), n_values)?;
        fits("quantize_q8", "out (bytes)", out.len(), n_blocks * Q8_BLOCK_BYTES)?;
        let n_blocks = n_blocks as i32;
        let mut b = self.stream.launch_builder(self.f("quantize_q8"));
        b.arg(x).arg(out).arg(&n_blocks);
        let warps_per_cta = 8;
        let cfg = LaunchConfig {
            grid_dim: ((n_blocks as u32).div_ceil(warps_per_cta).max(1), 1, 1),
            block_dim: (32 * warps_per_cta, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: checked above: one warp per block of 32 values, within both buffers.
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
    ) -> Result<(), GpuError> {
        let name = kernel_for("matvec", ty, "");
        let bpr = weight_blocks_per_row(name, ty, cols)?;
        // Activations come in Q8 blocks of 32, whatever the weights' blocks.
        let xpr = cols / 32;
        fits(name, "weights (bytes)", w.len(), rows * bpr * weight_block_bytes(ty))?;
        fits(name, "x (bytes)", x.len(), n_tok * xpr * Q8_BLOCK_BYTES)?;
        fits(name, "y", y.len(), n_tok * rows)?;
        let rpc = self.knobs.rows_per_cta;
        let cfg = LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(rpc), 1, 1),
            block_dim: (32, rpc, 1),
            shared_mem_bytes: 0,
        };
        for t0 in (0..n_tok).step_by(MATVEC_MAX_TOK) {
            let n = (n_tok - t0).min(MATVEC_MAX_TOK) as i32;
            let xs = x.slice(t0 * xpr * Q8_BLOCK_BYTES..);
            let mut ys = y.slice_mut(t0 * rows..);
            let (r, b_) = (rows as i32, bpr as i32);
            let mut b = self.stream.launch_builder(self.f(name));
            b.arg(w).arg(&xs).arg(&mut ys).arg(&r).arg(&b_).arg(&n);
            // SAFETY: checked above: `rows` weight rows, and `n` tokens' blocks
            // of x and rows of y from these offsets, lie in the buffers.
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
    ) -> Result<(), GpuError> {
        fits("rope", "x", x.len(), n_rows * n_heads * head_dim)?;
        fits("rope", "pos", pos.len(), n_rows)?;
        if dims > head_dim || !dims.is_multiple_of(2) {
            return Err(GpuError::invalid(format!("rope: {dims} rotated dims of a {head_dim}-wide head")));
        }
        let a = [n_rows as i32, n_heads as i32, head_dim as i32, dims as i32];
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(x).arg(pos).arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(&a[3]).arg(&base);
        // SAFETY: checked above: one thread per (row, head, pair) within x.
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
    ) -> Result<(), GpuError> {
        let kvd = shape.n_kv_heads * shape.head_dim;
        fits("kv_write", "k", k.len(), n_rows * kvd)?;
        fits("kv_write", "v", v.len(), n_rows * kvd)?;
        fits("kv_write", "row_block", row_block.len(), n_rows)?;
        fits("kv_write", "row_slot", row_slot.len(), n_rows)?;
        let n_blocks = shape.blocks_in(arena.len(), layer)?;
        let a = [
            n_rows as i32,
            layer as i32,
            shape.n_layers as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
            n_blocks as i32,
        ];
        let mut b = self.stream.launch_builder(self.f("kv_write"));
        b.arg(k).arg(v).arg(arena).arg(row_block).arg(row_slot);
        for x in &a {
            b.arg(x);
        }
        // SAFETY: checked above: one thread per (row, kv head, dim) within
        // k, v and the row tables; the kernel skips a row whose block or
        // slot lies outside the arena's `n_blocks`.
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
    ) -> Result<(), GpuError> {
        let width = n_heads * shape.head_dim;
        fits("attention", "q", q.len(), rows.n * width)?;
        fits("attention", "out", out.len(), rows.n * width)?;
        fits("attention", "pos", rows.pos.len(), rows.n)?;
        fits("attention", "table_start", rows.table_start.len(), rows.n)?;
        if shape.n_kv_heads == 0 || !n_heads.is_multiple_of(shape.n_kv_heads) {
            return Err(GpuError::invalid(format!("attention: {n_heads} heads over {} KV heads", shape.n_kv_heads)));
        }
        let n_blocks = shape.blocks_in(arena.len(), layer)?;
        let shared = (rows.max_ctx + shape.head_dim) * 4;
        if shared > 48 * 1024 {
            return Err(GpuError::invalid(format!(
                "attention: {} positions need {shared} bytes of shared memory",
                rows.max_ctx
            )));
        }
        let a = [
            n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
            shape.n_layers as i32,
            layer as i32,
        ];
        let guards = [rows.max_ctx as i32, rows.tables.len() as i32, n_blocks as i32];
        let mut b = self.stream.launch_builder(self.f("attention"));
        b.arg(q).arg(out).arg(arena).arg(&rows.pos).arg(&rows.table_start).arg(&rows.tables);
        for x in &a {
            b.arg(x);
        }
        b.arg(&scale);
        for x in &guards {
            b.arg(x);
        }
        let cfg = LaunchConfig {
            grid_dim: (rows.n as u32, n_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: checked above: each CTA's query and output rows lie in q
        // and out; the kernel bounds a row's positions by max_ctx (the
        // shared memory) and by its table, and keeps block ids in the arena.
        unsafe { b.launch(self.note(cfg)) }.map(drop).map_err(err("attention"))
    }

    /// gate = silu(gate) * up.
    pub fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) -> Result<(), GpuError> {
        fits("silu_mul", "gate", gate.len(), n)?;
        fits("silu_mul", "up", up.len(), n)?;
        let n_ = n as i64;
        let mut b = self.stream.launch_builder(self.f("silu_mul"));
        b.arg(gate).arg(up).arg(&n_);
        // SAFETY: checked above: one thread per value, within both buffers.
        unsafe { b.launch(self.note(grid(n, 256))) }.map(drop).map_err(err("silu_mul"))
    }

    /// x += y.
    pub fn add_into(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), GpuError> {
        fits("add_into", "x", x.len(), n)?;
        fits("add_into", "y", y.len(), n)?;
        let n_ = n as i64;
        let mut b = self.stream.launch_builder(self.f("add_into"));
        b.arg(x).arg(y).arg(&n_);
        // SAFETY: checked above: one thread per value, within both buffers.
        unsafe { b.launch(self.note(grid(n, 256))) }.map(drop).map_err(err("add_into"))
    }

    /// The largest logit's index of each of `rows` rows.
    pub fn argmax(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        fits("argmax", "logits", logits.len(), rows * vocab)?;
        fits("argmax", "out", out.len(), rows)?;
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(self.f("argmax"));
        b.arg(logits).arg(&v).arg(out);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: checked above: one CTA per row of `vocab` logits, one output each.
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
    ) -> Result<(), GpuError> {
        fits("sample_temperature", "logits", logits.len(), rows * vocab)?;
        fits("sample_temperature", "u", u.len(), rows)?;
        fits("sample_temperature", "out", out.len(), rows)?;
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(self.f("sample_temperature"));
        b.arg(logits).arg(&v).arg(&temperature).arg(u).arg(out);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: checked above: one CTA per row of `vocab` logits, one output each.
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

impl KvShape {
    /// Values (f16) in one block: every layer's keys and values.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_layers * 2 * self.n_kv_heads * self.head_dim
    }

    /// Whole blocks in an arena of `len` values, checking `layer` is one of
    /// the shape's (a launch's bounds check).
    fn blocks_in(&self, len: usize, layer: usize) -> Result<usize, GpuError> {
        if layer >= self.n_layers || self.block_elems() == 0 {
            return Err(GpuError::invalid(format!("layer {layer} of a {}-layer KV shape", self.n_layers)));
        }
        Ok((len / self.block_elems()).min(i32::MAX as usize))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult as R;

    #[test]
    fn driver_errors_are_classified_by_what_the_worker_must_do() {
        assert_eq!(classify(R::CUDA_ERROR_OUT_OF_MEMORY), GpuErrorKind::OutOfMemory);
        for lost in [R::CUDA_ERROR_ILLEGAL_ADDRESS, R::CUDA_ERROR_LAUNCH_FAILED, R::CUDA_ERROR_ECC_UNCORRECTABLE] {
            assert_eq!(classify(lost), GpuErrorKind::DeviceLost, "{lost:?}");
        }
        assert_eq!(classify(R::CUDA_ERROR_INVALID_VALUE), GpuErrorKind::Invalid);
        let e = GpuError::driver("copying", DriverError(R::CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(e.kind, GpuErrorKind::OutOfMemory);
        assert_eq!(e.what, "copying: CUDA_ERROR_OUT_OF_MEMORY");
    }

    #[test]
    fn knobs_read_their_variables_within_range() {
        assert_eq!(knob("K", None, 1..=32, 4), Ok(4));
        assert_eq!(knob("K", Some(" 8 ".into()), 1..=32, 4), Ok(8));
        assert_eq!(knob("K", Some("0".into()), 0..=64, 9), Ok(0));
        let e = knob("PDMESH_CUDA_ROWS_PER_CTA", Some("33".into()), 1..=32, 4).unwrap_err();
        assert_eq!(e, "PDMESH_CUDA_ROWS_PER_CTA=33: a whole number from 1 to 32");
        assert!(knob("K", Some("four".into()), 1..=32, 4).is_err());
    }

    #[test]
    fn launch_bounds_are_checked_before_any_launch() {
        assert!(fits("matvec_q4_1", "y", 10, 10).is_ok());
        let e = fits("matvec_q4_1", "y", 9, 10).unwrap_err();
        assert_eq!(e.kind, GpuErrorKind::Invalid);
        assert!(e.what.contains("y holds 9 values, the launch needs 10"), "{}", e.what);
        assert_eq!(blocks_per_row("quantize_q8", 576).unwrap(), 18);
        assert!(blocks_per_row("quantize_q8", 577).is_err());
        // SmolLM2-135M's arena: 30 layers, 3 KV heads of 64, 16 slots a block.
        let shape = KvShape { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16 };
        assert_eq!(shape.blocks_in(shape.block_elems() * 5 + 7, 29).unwrap(), 5);
        assert!(shape.blocks_in(shape.block_elems(), 30).is_err(), "layer 30 of 30");
    }
}
