//! `meshctl`: the operator's tool for a pdmesh mesh.
//!
//! - `meshctl up`: start tokenizer, kvbroker, prefill, decode, router and
//!   gateway as child processes on loopback, each gated on the previous
//!   one's health; supervise them (a child that dies is restarted alone);
//!   Ctrl-C or SIGTERM drains and stops them all.
//! - `meshctl status [--json]`: every instance in the registry with its
//!   addresses, health and load.
//! - `meshctl generate "text"`: one request through the router, streamed.
//! - `meshctl bench`: the mesh against the engine alone, same workload.
//! - `meshctl explain TRACE_ID`: where a request's time went, from its trace.
//! - `meshctl probe`: one small request, beside the live load it met.
//! - `meshctl collect`: a small OTLP receiver writing spans to a file.

mod bench;
mod generate;
mod inspect;
mod kvbench;
mod status;
mod up;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The registry folder `up` and `status` share unless told otherwise.
pub fn default_registry_dir() -> PathBuf {
    std::env::temp_dir().join("pdmesh").join("registry")
}

/// `explicit`, else the first live router in the registry folder.
pub async fn router_addr(explicit: Option<&str>, registry_dir: &std::path::Path) -> Result<String, String> {
    use pdmesh_core::discovery::{Discovery, FileRegistry};
    if let Some(r) = explicit {
        return Ok(r.to_string());
    }
    let reg = FileRegistry::new(registry_dir, std::time::Duration::from_secs(10));
    let list = reg.healthy("router").await.map_err(|e| e.to_string())?;
    list.first()
        .map(|i| i.grpc_addr.clone())
        .ok_or_else(|| format!("no live router in {} (is `meshctl up` running?)", registry_dir.display()))
}

#[derive(Parser)]
#[command(name = "meshctl", version, about = "Run and inspect a pdmesh mesh")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the whole mesh on this machine and stay in the foreground.
    Up(up::Args),
    /// List every instance with its addresses, health and load.
    Status(status::Args),
    /// Send one request through the router and stream the answer.
    Generate(generate::Args),
    /// TTFT and output tokens/s through the mesh and through the engine alone, same workload.
    Bench(bench::Args),
    /// Move one prompt's KV between two processes with NIXL and TCP, beside memcpy.
    Kvbench(kvbench::Args),
    /// Where one request's time went, from its trace (Jaeger or an OTLP/JSON file).
    Explain(inspect::ExplainArgs),
    /// Send one small request and report its latency beside the load it met.
    Probe(inspect::ProbeArgs),
    /// Receive OTLP/gRPC spans and append them to an OTLP/JSON-lines file (when there is no Jaeger).
    Collect(inspect::CollectArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Up(a) => up::run(a).await,
        Cmd::Status(a) => status::run(a).await,
        Cmd::Generate(a) => generate::run(a).await,
        Cmd::Bench(a) => bench::run(a).await,
        Cmd::Kvbench(a) => kvbench::run(a).await,
        Cmd::Explain(a) => inspect::explain_cmd(a).await,
        Cmd::Probe(a) => inspect::probe_cmd(a).await,
        Cmd::Collect(a) => inspect::collect_cmd(a).await,
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshctl: {e}");
            ExitCode::FAILURE
        }
    }
}
