//! `pdmesh-prefill`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_prefill::config::Config::parse();
    pdmesh_core::serve::run_main("pdmesh-prefill", cfg.listen, |l, stop| pdmesh_prefill::serve(cfg, l, stop)).await
}
