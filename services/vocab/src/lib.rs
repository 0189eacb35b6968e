//! One vocabulary for spans and metrics: the names every service writes and
//! `meshctl explain` reads. A name lives here once; services use the
//! constant (in `tracing` macros as `{ attr::KV_BYTES } = value`) and readers
//! match on the same constant, so a rename cannot split writer from reader.
//!
//! Internal spans are short snake_case verbs; attribute keys are dotted
//! (`kv.bytes`, `decode.running`), OpenTelemetry's own keys where one exists.

/// gRPC response metadata a service sets on RESOURCE_EXHAUSTED to say
/// which bound was hit (`router_busy`); the gateway turns it into the
/// OpenAI error code. Without it, RESOURCE_EXHAUSTED means no KV room.
pub const OVERLOAD_HEADER: &str = "x-pdmesh-overload";

/// How a decode worker's status begins when its prompt's KV did not arrive
/// before the transfer ticket's lease ran out (a prefill worker died or
/// stalled): UNAVAILABLE, the mesh's fault; the router retries it and
/// names it to its caller.
pub const LEASE_EXPIRED: &str = "KV transfer lease expired";

/// How a decode worker's status begins when a prompt's KV arrived with a
/// block whose CRC-32C differs from the sender's: UNAVAILABLE, the mesh's
/// fault; the router transfers it again once, then has the decode worker
/// prefill the prompt itself.
pub const KV_CORRUPT: &str = "KV arrived corrupted";

pub mod metric;

/// Span names (the OpenTelemetry span name is the `tracing` span name,
/// except RPC spans, whose name is the gRPC method: see [`rpc`]).
pub mod span {
    /// Router: encoding the prompt at the tokenizer.
    pub const TOKENIZE: &str = "tokenize";
    /// Router: choosing the prefill and decode worker.
    pub const ROUTE: &str = "route";
    /// Router: the incremental detokenize stream, first token to last.
    pub const DETOKENIZE: &str = "detokenize";
    /// Prefill: waiting in the queue for a step.
    pub const QUEUED: &str = "queued";
    /// Prefill: the request's prompt forward (all its steps).
    pub const PREFILL_FORWARD: &str = "prefill_forward";
    /// Prefill: one batched engine step (links to its requests).
    pub const PREFILL_STEP: &str = "prefill_step";
    /// Prefill: finding the destination, writing the KV, completing the ticket.
    pub const KV_TRANSFER: &str = "kv_transfer";
    /// Decode: reserving blocks and opening the ticket.
    pub const ADMIT: &str = "admit";
    /// Decode: waiting for the prefill's KV (the ticket's watch).
    pub const AWAIT_KV: &str = "await_kv";
    /// Decode: checking a transferred prompt's blocks against the sender's
    /// checksums, before the first decode step.
    pub const KV_VERIFY: &str = "kv_verify";
    /// Decode: the request's life in the running batch.
    pub const DECODE_LOOP: &str = "decode_loop";
    /// Decode: one batched engine step (links to its requests).
    pub const DECODE_STEP: &str = "decode_step";
    /// Gateway: the HTTP request (root span; its OpenTelemetry name is `POST <path>`).
    pub const HTTP_SERVER: &str = "http.server";
    /// Any gRPC call (its OpenTelemetry name is the method).
    pub const GRPC: &str = "grpc";
}

/// gRPC methods, which are the names of RPC spans.
pub mod rpc {
    pub const ROUTER_GENERATE: &str = "pdmesh.router.v1.Router/Generate";
    pub const TOKENIZER_ENCODE: &str = "pdmesh.tokenizer.v1.Tokenizer/Encode";
    pub const TOKENIZER_DETOKENIZE: &str = "pdmesh.tokenizer.v1.Tokenizer/Detokenize";
    pub const TOKENIZER_INFO: &str = "pdmesh.tokenizer.v1.Tokenizer/Info";
    pub const PREFILL_PREFILL: &str = "pdmesh.prefill.v1.Prefill/Prefill";
    pub const DECODE_GENERATE: &str = "pdmesh.decode.v1.Decode/Generate";
    pub const DECODE_WRITE_KV: &str = "pdmesh.decode.v1.Decode/WriteKv";
    pub const DECODE_HAND_OVER: &str = "pdmesh.decode.v1.Decode/HandOver";
    pub const KVBROKER_OPEN_TICKET: &str = "pdmesh.kvbroker.v1.KvBroker/OpenTicket";
    pub const KVBROKER_CLAIM_TICKET: &str = "pdmesh.kvbroker.v1.KvBroker/ClaimTicket";
    pub const KVBROKER_BEGIN_WRITE: &str = "pdmesh.kvbroker.v1.KvBroker/BeginWrite";
    pub const KVBROKER_COMPLETE_TICKET: &str = "pdmesh.kvbroker.v1.KvBroker/CompleteTicket";
    pub const KVBROKER_WATCH_TICKET: &str = "pdmesh.kvbroker.v1.KvBroker/WatchTicket";
    pub const KVBROKER_CANCEL_TICKET: &str = "pdmesh.kvbroker.v1.KvBroker/CancelTicket";
    pub const KVBROKER_RENEW_LEASE: &str = "pdmesh.kvbroker.v1.KvBroker/RenewLease";
    pub const KVBROKER_GET_AGENT: &str = "pdmesh.kvbroker.v1.KvBroker/GetAgent";
    // Polling and registration (not traced).
    pub const PREFILL_LOAD: &str = "pdmesh.prefill.v1.Prefill/Load";
    pub const DECODE_LOAD: &str = "pdmesh.decode.v1.Decode/Load";
    pub const KVBROKER_REGISTER_AGENT: &str = "pdmesh.kvbroker.v1.KvBroker/RegisterAgent";

    /// The methods served under a span of their own (the per-request ones;
    /// polling and registration RPCs are left out so they do not flood the
    /// trace backend with traces of one span).
    pub const TRACED: &[&str] = &[
        ROUTER_GENERATE,
        TOKENIZER_ENCODE,
        TOKENIZER_DETOKENIZE,
        TOKENIZER_INFO,
        PREFILL_PREFILL,
        DECODE_GENERATE,
        DECODE_WRITE_KV,
        DECODE_HAND_OVER,
        KVBROKER_OPEN_TICKET,
        KVBROKER_CLAIM_TICKET,
        KVBROKER_BEGIN_WRITE,
        KVBROKER_COMPLETE_TICKET,
        KVBROKER_WATCH_TICKET,
        KVBROKER_CANCEL_TICKET,
        KVBROKER_RENEW_LEASE,
        KVBROKER_GET_AGENT,
    ];
}

/// Span attribute keys.
pub mod attr {
    // Identity (resource attributes, repeated on every span).
    pub const SERVICE_NAME: &str = "service.name";
    pub const SERVICE_INSTANCE_ID: &str = "service.instance.id";
    pub const SERVICE_VERSION: &str = "service.version";
    pub const CONFIG_HASH: &str = "pdmesh.config_hash";
    /// The model pool an instance serves (meshes of several models), and
    /// on the gateway's request span the model the client asked for.
    pub const MODEL: &str = "pdmesh.model";

    // RPC and HTTP (OpenTelemetry semantic conventions).
    pub const RPC_STATUS_CODE: &str = "rpc.grpc.status_code";
    pub const HTTP_STATUS_CODE: &str = "http.response.status_code";

    // The request.
    pub const REQUEST_ID: &str = "pdmesh.request_id";
    pub const MAX_TOKENS: &str = "pdmesh.max_tokens";
    pub const TTFT_MS: &str = "pdmesh.ttft_ms";
    pub const PROMPT_TOKENS: &str = "prompt_tokens";

    // Gateway: the client's side of the response.
    pub const CLIENT_WAIT_MS: &str = "gateway.client_wait_ms";
    pub const CLIENT_TAIL_MS: &str = "gateway.client_tail_ms";
    pub const CHUNKS: &str = "gateway.chunks";
    /// Gateway: the name of the API key the request came with (never the key).
    pub const API_KEY_NAME: &str = "gateway.api_key";

    // Router: `route` (each key is prefixed by the worker kind: `prefill.`, `decode.`).
    pub const ROUTE_POLICY: &str = "policy";
    pub const ROUTE_ATTEMPT: &str = "attempt";
    pub const PICK_INSTANCE: &str = "instance";
    pub const PICK_ADDRESS: &str = "address";
    pub const PICK_IN_FLIGHT_HERE: &str = "in_flight_here";
    pub const PICK_BUSY_POLLED: &str = "busy_polled";
    pub const PICK_KV_FREE_POLLED: &str = "kv_free_polled";
    pub const PICK_CANDIDATES: &str = "candidates";
    /// The policy's branch: `least_busy`, `imbalanced`, `cache_match`, `low_match`.
    pub const PICK_BRANCH: &str = "branch";
    /// Leading prompt blocks the chosen worker holds in its prefix cache.
    pub const PICK_OVERLAP_BLOCKS: &str = "overlap_blocks";
    /// The prompt's full blocks (what the overlap is out of).
    pub const PICK_PROMPT_BLOCKS: &str = "prompt_blocks";
    pub const PICK_QUEUED_TOKENS_POLLED: &str = "queued_tokens_polled";
    /// Where the prompt is prefilled: `local` (by the decode worker itself)
    /// or `remote` (by a prefill worker, the KV moved over).
    pub const ROUTE_PREFILL_MODE: &str = "prefill.mode";
    /// Why: `tail_within_threshold`, `tail_over_threshold`, `disabled`, or
    /// `no_prefill_worker` (over the threshold, but no prefill worker was live).
    pub const ROUTE_PREFILL_MODE_REASON: &str = "prefill.mode_reason";
    /// Prompt tokens the decode worker would compute (not in its prefix cache).
    pub const ROUTE_LOCAL_TAIL_TOKENS: &str = "prefill.local_tail_tokens";
    /// The router's `--max-local-prefill`.
    pub const ROUTE_MAX_LOCAL_PREFILL: &str = "prefill.max_local_prefill";
    /// Router's Generate: dispatches repeated after a prefill failed before the first token.
    pub const PREFILL_RETRIES: &str = "router.prefill_retries";
    /// Attempts whose transferred KV failed its checksum at the decode worker.
    pub const KV_CORRUPT_RETRIES: &str = "router.kv_corrupt_retries";
    /// Router's Generate: dispatches repeated after a decode worker died or broke before the first token.
    pub const DECODE_RETRIES: &str = "router.decode_retries";
    /// Router: times the request moved to another decode worker mid-stream.
    pub const MIGRATIONS: &str = "router.migrations";
    /// Router: a request resumed after its router was lost, with this many
    /// tokens already at the caller.
    pub const RESUMED_AFTER_TOKENS: &str = "router.resumed_after_tokens";
    /// Gateway: times the request moved to another router mid-stream.
    pub const GATEWAY_FAILOVERS: &str = "gateway.router_failovers";
    /// An RPC client span: the instance called (its service id, `router-1`).
    pub const PEER_INSTANCE: &str = "peer.instance";
    /// A [`super::event::ROUTER_FAILOVER`] or
    /// [`super::event::DECODE_MIGRATION`] event: the instance lost, the one
    /// the request went on at, the tokens the client had then, and how the
    /// lost call ended (its gRPC status, or `draining`).
    pub const FAILOVER_FROM: &str = "failover.from";
    pub const FAILOVER_TO: &str = "failover.to";
    pub const FAILOVER_AFTER_TOKENS: &str = "failover.after_tokens";
    pub const FAILOVER_STATUS: &str = "failover.status";
    /// Router: tokens the caller had when the request last migrated.
    pub const MIGRATED_AFTER_TOKENS: &str = "router.migrated_after_tokens";
    /// Router: the request's migrations so far when one went off a draining
    /// decode worker that ships the KV along.
    pub const HANDOVERS: &str = "router.handovers";
    /// Router: why a KV shipment off a draining decode worker failed (the
    /// request replayed its tokens instead).
    pub const HANDOVER_FAILED: &str = "router.handover_failed";
    /// Router (`route`): positions of KV the draining decode worker ships.
    pub const HANDOVER_KV_TOKENS: &str = "handover.kv_tokens";
    pub const DETOKENIZE_CALLS: &str = "detokenize.calls";
    /// Router (`detokenize`): the tokenizer was lost mid-stream and the
    /// stream replayed on a fresh one.
    pub const DETOKENIZE_REOPENED: &str = "detokenize.reopened";
    pub const DETOKENIZE_BUSY_MS: &str = "detokenize.busy_ms";

    // Prefill.
    pub const PREFILL_QUEUE_DEPTH: &str = "prefill.queue_depth";
    pub const PREFILL_RUNNING: &str = "prefill.running";
    pub const QUEUE_HELD_MS: &str = "queue.held_ms";
    pub const BATCH_SIZE: &str = "batch_size";
    pub const BATCH_TOKENS: &str = "batch_tokens";
    /// `prefill_forward`: prompt tokens whose KV came from the prefix cache.
    pub const PREFILL_CACHED_TOKENS: &str = "prefill.cached_tokens";
    /// `prefill_forward`: prompt tokens computed in this request's prefill.
    pub const PREFILL_COMPUTED_TOKENS: &str = "prefill.computed_tokens";
    /// `prefill_forward`: the forward steps this prompt was spread over.
    pub const PREFILL_STEPS: &str = "prefill.steps";
    /// `prefill_forward`: true when the decode worker ran it (local prefill).
    pub const PREFILL_LOCAL: &str = "prefill.local";

    // KV transfer.
    pub const KV_TRANSPORT: &str = "kv.transport";
    pub const KV_BYTES: &str = "kv.bytes";
    pub const KV_BLOCKS: &str = "kv.blocks";
    pub const KV_TOKENS: &str = "kv.tokens";
    pub const KV_DEST_WORKER: &str = "kv.dest_worker";
    pub const KV_WRITE_MS: &str = "kv.write_ms";
    pub const KV_GBPS: &str = "kv.gbps";
    /// Decode: blocks checked against the sender's CRC-32C, and how long
    /// it took (a mismatch marks the span an error that names the block).
    pub const KV_VERIFIED_BLOCKS: &str = "kv.verified_blocks";
    pub const KV_VERIFY_MS: &str = "kv.verify_ms";
    /// Decode: the blocks' checksums were taken before the ticket said DONE
    /// (off the request's path): as the NIXL write landed (how long that
    /// took on the engine loop) or as the TCP chunks arrived (0).
    pub const KV_VERIFIED_ON_LANDING_MS: &str = "kv.verified_on_landing_ms";
    pub const FAULT_STALL_MS: &str = "fault.stall_ms";

    // Decode.
    pub const DECODE_RUNNING: &str = "decode.running";
    pub const DECODE_WAITING: &str = "decode.waiting";
    pub const DECODE_AWAITING_KV: &str = "decode.awaiting_kv";
    pub const KV_BLOCKS_USED: &str = "kv_blocks_used";
    pub const KV_BLOCKS_TOTAL: &str = "kv_blocks_total";
    pub const KV_BLOCKS_RESERVED: &str = "kv_blocks_reserved";
    pub const DECODE_RUNNING_ON_JOIN: &str = "decode.running_on_join";
    pub const DECODE_WAITING_ON_JOIN: &str = "decode.waiting_on_join";
    pub const DECODE_STEPS: &str = "decode.steps";
    pub const DECODE_TOKENS: &str = "decode.tokens";
    pub const DECODE_BATCH_MAX: &str = "decode.batch_max";
    pub const DECODE_BATCH_MEAN: &str = "decode.batch_mean";

    // Broker tickets.
    pub const TICKET: &str = "pdmesh.ticket";
    pub const TICKET_STATE: &str = "pdmesh.ticket.state";
    pub const TICKET_BLOCKS: &str = "pdmesh.ticket.blocks";
    pub const TICKET_LEASE_MS: &str = "pdmesh.ticket.lease_ms";
    pub const TICKET_KV_BYTES: &str = "pdmesh.kv.bytes";
    /// Decode (`await_kv`): times the ticket was opened again at a
    /// kvbroker that had lost it (restarted) before any transfer began.
    pub const TICKET_REOPENED: &str = "pdmesh.ticket.reopened";
    /// Prefill (its server span): times the claim was asked again of a
    /// kvbroker after the one it waited on went away.
    pub const TICKET_RECLAIMED: &str = "pdmesh.ticket.reclaimed";

    // What steps cost against the worker's own normal (`pdmesh_worker::steps`).
    // On a step span: that step; on `decode_loop` and `prefill_forward`:
    // the totals over the steps that served the request.
    /// CPU time of the step's threads (the loop thread and the compute pool).
    pub const STEP_CPU_MS: &str = "step.cpu_ms";
    /// Time the step's threads were runnable but waiting for a CPU.
    pub const STEP_RUNQ_MS: &str = "step.runq_ms";
    /// What a step of this shape (batch, tokens) normally takes on this worker.
    pub const STEP_NORMAL_MS: &str = "step.normal_ms";
    /// Wall time over normal time.
    pub const STEP_SLOWDOWN: &str = "step.slowdown";
    /// Threads whose scheduler statistics were read.
    pub const STEP_THREADS: &str = "step.threads";
    pub const STEPS_WALL_MS: &str = "steps.wall_ms";
    pub const STEPS_CPU_MS: &str = "steps.cpu_ms";
    pub const STEPS_RUNQ_MS: &str = "steps.runq_ms";
    /// Wall time of the steps that had a normal to compare with.
    pub const STEPS_JUDGED_MS: &str = "steps.judged_ms";
    /// The sum of those steps' normals.
    pub const STEPS_NORMAL_MS: &str = "steps.normal_ms";
    /// Steps that took at least `SLOW_FACTOR` times their normal.
    pub const STEPS_SLOW: &str = "steps.slow";
    /// Steps whose threads waited for a CPU for a large part of their time.
    pub const STEPS_STARVED: &str = "steps.starved";
    /// The worker's usual batch size (a running mean over its recent steps).
    pub const STEPS_BATCH_USUAL: &str = "steps.batch_usual";
    /// Decode steps that also fed local prefill tokens.
    pub const STEPS_WITH_PREFILL: &str = "steps.with_prefill";

    // Tokenizer.
    pub const TOKENS: &str = "tokens";
    pub const OUTCOME: &str = "outcome";
}

/// Kernel-launch spans: children of a worker's step span, one per launch
/// (`--trace-kernel-steps`), written by the engine, read by `meshctl explain`.
pub mod kernel {
    pub const SPAN: &str = "kernel";
    pub const BACKEND: &str = "kernel.backend";
    pub const LAYER: &str = "kernel.layer";
    pub const M: &str = "kernel.m";
    pub const N: &str = "kernel.n";
    pub const K: &str = "kernel.k";
    pub const THREADS: &str = "knob.threads";
    pub const TILE_B: &str = "knob.tile_b";
    pub const ROW_SLICE: &str = "knob.row_slice";
    pub const ATT_CHUNK: &str = "knob.att_chunk";
    // The GPU path (model/cuda.rs).
    /// Device time of the launch, from CUDA events around it.
    pub const DEVICE_MS: &str = "kernel.device_ms";
    /// The launch's grid and block dimensions, "x,y,z".
    pub const GRID: &str = "kernel.grid";
    pub const BLOCK: &str = "kernel.block";
    pub const ROWS_PER_CTA: &str = "knob.rows_per_cta";
    pub const GEMM_MIN_ROWS: &str = "knob.gemm_min_rows";
    /// How the launch's matrix products ran: `matvec` (Q8, dp4a) or `gemm` (f16, cuBLAS).
    pub const PATH: &str = "kernel.path";
}

/// Span event names (an event's OpenTelemetry name is its message).
pub mod event {
    /// Gateway, on the request's span: its router was lost mid-stream and
    /// the request went on at another (attributes `failover.*`).
    pub const ROUTER_FAILOVER: &str = "router failover";
    /// Router, on the request's span: its decode worker was lost (or
    /// drained) mid-stream and the request moved to another (attributes
    /// `failover.from`, `failover.after_tokens`, `failover.status`; where
    /// it went is the next `route` span's pick).
    pub const DECODE_MIGRATION: &str = "decode migration";
}

/// Request limits, one home for every layer that checks them: the gateway
/// (OpenAI's API), the router (the gRPC API) and the engine.
pub mod limits {
    /// Highest sampling `temperature` (OpenAI's range is 0 to 2).
    pub const MAX_TEMPERATURE: f32 = 2.0;
    /// Most stop strings in a request (OpenAI's limit; the router's
    /// `--max-stop` default for its gRPC clients).
    pub const MAX_STOP_STRINGS: usize = 4;
    /// Longest stop string, in bytes.
    pub const MAX_STOP_BYTES: usize = 256;
}

/// What counts as an abnormal step: shared by the workers, which count
/// slow and starved steps, and `meshctl explain`, which names them.
pub mod steps {
    /// A step that took at least this many times its shape's normal is slow.
    pub const SLOW_FACTOR: f64 = 2.0;
    /// Steps whose threads waited for a CPU at least this share of their
    /// runnable time (on a CPU or waiting for one) were starved.
    pub const STARVED_SHARE: f64 = 0.2;
}

/// The attribute key `<kind>.<key>` of a worker pick on the `route` span
/// (`prefill.instance`, `decode.busy_polled`, ...).
pub fn pick_key(kind: &str, key: &str) -> String {
    format!("{kind}.{key}")
}
