//! `meshctl up --jaeger`: a local Jaeger (v2, all-in-one, in-memory
//! storage) that every service of the mesh exports its spans to, its UI
//! and query API on one loopback address. `scripts/gotool.sh jaeger` builds the
//! binary once per machine into the pdmesh cache, where this looks first.
//!
//! Jaeger's own configuration binds several fixed ports; the one written
//! here binds only three, all on loopback: OTLP/gRPC in, the query API and
//! UI (HTTP), and the query gRPC API (Jaeger requires it). Its own metrics
//! and health endpoints are off.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::free_addr;

/// The Jaeger release `scripts/gotool.sh jaeger` builds (keep the two equal).
pub const VERSION: &str = "v1.75.0";

/// How long Jaeger may take to answer on its UI address.
const READY: Duration = Duration::from_secs(60);

/// Jaeger's flags of `meshctl up`.
#[derive(clap::Args, Debug, Clone)]
pub struct JaegerArgs {
    /// Start a local Jaeger, export every service's traces to it and print
    /// its UI address (the binary from `scripts/gotool.sh jaeger`, see
    /// `--jaeger-bin`). Overrides `--otlp-endpoint`.
    #[arg(long)]
    pub jaeger: bool,
    /// The Jaeger binary (default: `jaeger-v1.75.0/jaeger` in the pdmesh
    /// cache, where `scripts/gotool.sh jaeger` builds it, else `jaeger` on PATH).
    #[arg(long, env = "PDMESH_JAEGER_BIN")]
    pub jaeger_bin: Option<PathBuf>,
    /// Where Jaeger's UI and query API (`/api/traces`) listen.
    #[arg(long, default_value = "127.0.0.1:16686")]
    pub jaeger_ui_addr: String,
    /// Jaeger also forwards every span it receives to this OTLP/gRPC
    /// endpoint (e.g. a `meshctl collect`, to keep a file of them).
    #[arg(long)]
    pub jaeger_forward: Option<String>,
    /// A built Jaeger UI (the jaeger-ui project's `packages/jaeger-ui/build`)
    /// for Jaeger to serve: its Go module ships without one, so without this
    /// flag the UI address serves Jaeger's placeholder page beside the query API.
    #[arg(long)]
    pub jaeger_ui_assets: Option<PathBuf>,
}

/// A running Jaeger, stopped when dropped.
pub struct Jaeger {
    child: Child,
    /// The UI and query API, `http://host:port`.
    pub ui: String,
    /// Where services export: `http://host:port` (OTLP/gRPC).
    pub otlp: String,
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The binary to run: the flag, else the cache's, else `jaeger` on `path`
/// (the PATH variable's value).
fn binary(a: &JaegerArgs, cache: &Path, path: Option<std::ffi::OsString>) -> Result<PathBuf, String> {
    if let Some(b) = &a.jaeger_bin {
        return Ok(b.clone());
    }
    let cached = cache.join(format!("jaeger-{VERSION}")).join("jaeger");
    if cached.exists() {
        return Ok(cached);
    }
    let on_path = path
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("jaeger"))
        .find(|p| p.exists());
    on_path.ok_or_else(|| {
        format!(
            "no Jaeger binary: build it with `bash scripts/gotool.sh jaeger` (into {}) or give --jaeger-bin",
            cached.display()
        )
    })
}

/// Jaeger's configuration: OTLP/gRPC in on `otlp`, memory storage, the
/// query API and UI on `--jaeger-ui-addr` (with `--jaeger-ui-assets`), and
/// a copy of every span to `--jaeger-forward`.
pub fn config(a: &JaegerArgs, otlp: &str, query_grpc: &str) -> String {
    let ui = &a.jaeger_ui_addr;
    let assets = match &a.jaeger_ui_assets {
        Some(d) => format!("    ui:\n      assets_path: {}\n", d.display()),
        None => String::new(),
    };
    let (exporters, forward_exporter) = match a.jaeger_forward.as_deref() {
        Some(f) => {
            let f = f.trim_start_matches("http://");
            (
                "[jaeger_storage_exporter, otlp/forward]",
                format!("  otlp/forward:\n    endpoint: {f}\n    compression: none\n    tls:\n      insecure: true\n"),
            )
        }
        None => ("[jaeger_storage_exporter]", String::new()),
    };
    format!(
        "service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: {exporters}
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: {ui}
    grpc:
      endpoint: {query_grpc}
    enable_tracing: false
{assets}  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: {otlp}
processors:
  batch:
    timeout: 200ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
{forward_exporter}"
    )
}

impl Jaeger {
    /// Start Jaeger with its configuration and log in `dir`; return once
    /// its UI address accepts connections.
    pub fn start(a: &JaegerArgs, cache: &Path, dir: &Path) -> Result<Jaeger, String> {
        let bin = binary(a, cache, std::env::var_os("PATH"))?;
        let (otlp, query_grpc) = (free_addr()?, free_addr()?);
        let cfg = dir.join("jaeger.yaml");
        std::fs::write(&cfg, config(a, &otlp, &query_grpc)).map_err(|e| format!("{}: {e}", cfg.display()))?;
        let log = dir.join("jaeger.log");
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(&bin)
            .arg(format!("--config={}", cfg.display()))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run Jaeger {}: {e}", bin.display()))?;
        let mut j = Jaeger { child, ui: format!("http://{}", a.jaeger_ui_addr), otlp: format!("http://{otlp}") };
        let t0 = Instant::now();
        while TcpStream::connect(&a.jaeger_ui_addr).is_err() || TcpStream::connect(&otlp).is_err() {
            if let Ok(Some(st)) = j.child.try_wait() {
                return Err(format!("Jaeger exited ({st}) before it served; its log: {}", log.display()));
            }
            if t0.elapsed() > READY {
                return Err(format!("Jaeger did not listen within {READY:?}; its log: {}", log.display()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("meshctl: Jaeger {} (log {})", j.ui, log.display());
        j.ui = j.ui.trim_end_matches('/').to_string();
        Ok(j)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_binds_only_the_given_addresses_and_forwards_when_asked() {
        let mut a = args("127.0.0.1:2");
        let c = config(&a, "127.0.0.1:1", "127.0.0.1:3");
        for addr in ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"] {
            assert!(c.contains(&format!("endpoint: {addr}")), "{c}");
        }
        assert_eq!(c.matches("endpoint:").count(), 3, "no other listener: {c}");
        assert!(!c.contains("otlp/forward") && !c.contains("assets_path"));
        a.jaeger_forward = Some("http://127.0.0.1:9".into());
        a.jaeger_ui_assets = Some("/srv/jaeger-ui".into());
        let f = config(&a, "127.0.0.1:1", "127.0.0.1:3");
        assert!(f.contains("exporters: [jaeger_storage_exporter, otlp/forward]"), "{f}");
        assert!(f.contains("endpoint: 127.0.0.1:9\n    compression: none\n    tls:\n      insecure: true"), "{f}");
        assert!(f.contains("    ui:\n      assets_path: /srv/jaeger-ui\n"), "{f}");
    }

    fn args(ui: &str) -> JaegerArgs {
        JaegerArgs {
            jaeger: true,
            jaeger_bin: None,
            jaeger_ui_addr: ui.into(),
            jaeger_forward: None,
            jaeger_ui_assets: None,
        }
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let a = args("127.0.0.1:0");
        let e = binary(&a, Path::new("/nonexistent-pdmesh-cache"), None).unwrap_err();
        assert!(e.contains("scripts/gotool.sh jaeger") && e.contains("--jaeger-bin"), "{e}");
        let given = JaegerArgs { jaeger_bin: Some("/opt/j".into()), ..a };
        assert_eq!(binary(&given, Path::new("/x"), None).unwrap(), PathBuf::from("/opt/j"));
    }
}
