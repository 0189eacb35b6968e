//! Flags every service shares, flattened into each service's own `Config`.

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone, Default, serde::Serialize)]
pub struct CommonArgs {
    /// HTTP address for /health, /metrics and /statusz (off when unset).
    #[arg(long, env = "PDMESH_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    /// File-registry folder to announce this instance in (off when unset).
    #[arg(long, env = "PDMESH_REGISTRY_DIR")]
    pub registry_dir: Option<PathBuf>,
    /// Seconds after which a registry entry without heartbeat counts as dead.
    #[arg(long, env = "PDMESH_REGISTRY_TTL_S", default_value_t = 10)]
    pub registry_ttl_s: u64,
    /// Instance id in the registry (default: `<service>-<pid>`).
    #[arg(long, env = "PDMESH_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Allow tests to set fault-injection switches over `PUT /faults/<name>/<value>` (never in production).
    #[arg(long, env = "PDMESH_ENABLE_FAULT_INJECTION")]
    pub enable_fault_injection: bool,
    #[command(flatten)]
    pub telemetry: crate::telemetry::TelemetryArgs,
}

impl CommonArgs {
    /// This instance's id: `--instance-id`, else `<service>-<pid>`.
    pub fn instance_id(&self, service: &str) -> String {
        self.instance_id.clone().unwrap_or_else(|| format!("{service}-{}", std::process::id()))
    }
}
