//! `pdmesh-gateway`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_gateway::config::Config::parse();
    pdmesh_core::serve::run_main("pdmesh-gateway", cfg.listen, |l, stop| pdmesh_gateway::serve(cfg, l, stop)).await
}
