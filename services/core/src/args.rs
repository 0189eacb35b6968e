//! Flags every service shares, flattened into each service's own `Config`.

use std::net::SocketAddr;

fn check_pool(s: &str) -> Result<String, String> {
    crate::discovery::check_pool(s).map(|_| s.to_string())
}

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
    /// The model pool this instance serves, in a mesh of several models:
    /// it registers and finds its peers as `KIND@POOL` in discovery, so it
    /// only meets its own model's instances (the gateway serves every pool
    /// and takes none). Unset: the mesh serves one model.
    #[arg(long, env = "PDMESH_POOL", value_parser = check_pool)]
    pub pool: Option<String>,
    /// The gRPC address peers reach this instance at, announced in
    /// discovery instead of the listen address: behind a proxy or NAT
    /// (`scripts/faults.sh` puts a fault proxy there). Default: the listen address.
    #[arg(long, env = "PDMESH_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
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
    /// Inside `--pool`, the pool's view of it.
    pub fn open_discovery(&self) -> Result<Option<std::sync::Arc<dyn crate::discovery::Discovery>>, String> {
        let d = self.discovery.locator().map(|l| self.discovery.open(&l).map_err(|e| e.to_string())).transpose()?;
        Ok(match (&self.pool, d) {
            (Some(p), Some(d)) => Some(crate::discovery::pooled(d, p)),
            (_, d) => d,
        })
    }

    /// This instance's id: `--instance-id`, else `<service>-<pid>`.
    pub fn instance_id(&self, service: &str) -> String {
        self.instance_id.clone().unwrap_or_else(|| format!("{service}-{}", std::process::id()))
    }
}
