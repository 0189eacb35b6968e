//! Shared runtime of pdmesh services: the flags they share ([`args`]),
//! service discovery ([`discovery`]: file registry and Consul backends),
//! graceful drain ([`drain`]) and the HTTP admin endpoints every service serves ([`admin`]:
//! /health, /metrics, /statusz), metrics text ([`metrics`]) and tracing
//! ([`telemetry`]: OTLP export, W3C trace context on every hop).

pub mod admin;
pub mod args;
pub mod discovery;
pub mod drain;
pub mod faults;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod outlier;
pub mod peers;
pub mod refusal;
pub mod serve;
pub mod signal;
pub mod task;
pub mod telemetry;
pub mod tls;
pub use pdmesh_vocab as vocab;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
