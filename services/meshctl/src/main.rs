//! `meshctl`: the operator's tool for a pdmesh mesh.
//!
//! - `meshctl up`: start tokenizer, kvbroker, prefill, decode, router and
//!   gateway as child processes on loopback, each gated on the previous
//!   one's health; supervise them (a child that dies is restarted alone);
//!   Ctrl-C or SIGTERM drains and stops them all.
//! - `meshctl scale KIND=N ...`, `meshctl drain ID`, `meshctl restart
//!   KIND... | --all`: change a running `meshctl up` (its control endpoint).
//! - `meshctl status [--json]`: every instance in the registry with its
//!   addresses, health and load.
//! - `meshctl generate "text"`: one request through the router, streamed.
//! - `meshctl explain TRACE_ID`: where a request's time went, from its trace.
//! - `meshctl probe`: one small request, beside the live load it met.
//! - `meshctl collect`: a small OTLP receiver writing spans to a file.
//!
//! `meshctl` does not link the engine: it fetches the model through
//! `pdmesh-model`; the benchmarks live in `pdmesh-bench`.

mod autoscale;
mod control;
mod devca;
mod flags;
mod generate;
mod inspect;
mod jaeger;
mod plan;
mod process;
mod standin;
mod status;
mod supervisor;
mod up;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "meshctl", version, about = "Run and inspect a pdmesh mesh")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the whole mesh on this machine and stay in the foreground.
    Up(Box<flags::Args>),
    /// List every instance with its addresses, health and load.
    Status(status::Args),
    /// Send one request through the router and stream the answer.
    Generate(generate::Args),
    /// Where one request's time went, from its trace (Jaeger or an OTLP/JSON file).
    Explain(inspect::ExplainArgs),
    /// Send one small request and report its latency beside the load it met.
    Probe(inspect::ProbeArgs),
    /// Change how many instances of a kind run: `meshctl scale prefill=2 decode=3`.
    Scale(control::ScaleArgs),
    /// Drain one instance (it finishes its work, leaves and is not restarted).
    Drain(control::DrainArgs),
    /// Rolling restart: per instance, a new one first, then the old one drained.
    Restart(control::RestartArgs),
    /// What the autoscaler would do on a running mesh, and why: `meshctl autoscale --policy P.toml --dry-run`.
    Autoscale(autoscale::Args),
    /// Receive OTLP/gRPC spans and append them to an OTLP/JSON-lines file (when there is no Jaeger).
    Collect(inspect::CollectArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Clients of the mesh's gRPC take its TLS identity from the environment.
    if matches!(cli.cmd, Cmd::Generate(_) | Cmd::Probe(_)) {
        if let Err(e) = pdmesh_core::tls::MeshTlsArgs::install_client_from_env() {
            eprintln!("meshctl: {e}");
            return ExitCode::FAILURE;
        }
    }
    let r = match cli.cmd {
        Cmd::Up(a) => up::run(*a).await,
        Cmd::Status(a) => status::run(a).await,
        Cmd::Generate(a) => generate::run(a).await,
        Cmd::Explain(a) => inspect::explain_cmd(a).await,
        Cmd::Probe(a) => inspect::probe_cmd(a).await,
        Cmd::Collect(a) => inspect::collect_cmd(a).await,
        Cmd::Scale(a) => control::scale_cmd(a).await,
        Cmd::Drain(a) => control::drain_cmd(a).await,
        Cmd::Restart(a) => control::restart_cmd(a).await,
        Cmd::Autoscale(a) => autoscale::cmd(a).await,
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshctl: {e}");
            ExitCode::FAILURE
        }
    }
}
