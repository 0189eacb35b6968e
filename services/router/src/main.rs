//! `pdmesh-router`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_router::config::Config::parse();
    pdmesh_core::serve::run_main("pdmesh-router", cfg.listen, |l, stop| pdmesh_router::serve(cfg, l, stop)).await
}
