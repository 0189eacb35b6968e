//! `pdmesh-kvbroker`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_kvbroker::config::Config::parse();
    pdmesh_core::serve::run_main("pdmesh-kvbroker", cfg.listen, |l, stop| pdmesh_kvbroker::serve(cfg, l, stop)).await
}
