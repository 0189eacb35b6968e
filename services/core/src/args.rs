//! Flags every service shares, flattened into each service's own `Config`.

use std::net::SocketAddr;

#[derive(clap::Args, Debug, Clone, Default, serde::Serialize)]
pub struct CommonArgs {
    /// HTTP address for /health, /metrics and /statusz (off when unset).
    #[arg(long, env = "PDMESH_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    /// Where to announce this instance and find the others (off when unset).
    #[command(flatten)]
    pub discovery: crate::discovery::DiscoveryArgs,
    /// How the instance drains on SIGTERM.
    #[command(flatten)]
    pub drain: crate::drain::DrainArgs,
    /// Instance id in the registry (default: `<service>-<pid>`).
    #[arg(long, env = "PDMESH_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Allow tests to set fault-injection switches over `PUT /faults/<name>/<value>` (never in production).
    #[arg(long, env = "PDMESH_ENABLE_FAULT_INJECTION")]
    pub enable_fault_injection: bool,
    #[command(flatten)]
    pub telemetry: crate::telemetry::TelemetryArgs,
    /// Mutual TLS between services.
    #[command(flatten)]
    pub tls: crate::tls::MeshTlsArgs,
}

impl CommonArgs {
    /// The discovery backend of `--discovery` / `--registry-dir`, if any.
    pub fn open_discovery(&self) -> Result<Option<std::sync::Arc<dyn crate::discovery::Discovery>>, String> {
        self.discovery.locator().map(|l| self.discovery.open(&l).map_err(|e| e.to_string())).transpose()
    }

    /// This instance's id: `--instance-id`, else `<service>-<pid>`.
    pub fn instance_id(&self, service: &str) -> String {
        self.instance_id.clone().unwrap_or_else(|| format!("{service}-{}", std::process::id()))
    }
}
