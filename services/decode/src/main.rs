//! `pdmesh-decode`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_decode::config::Config::parse();
    pdmesh_core::serve::run_main("pdmesh-decode", cfg.listen, |l, stop| pdmesh_decode::serve(cfg, l, stop)).await
}
