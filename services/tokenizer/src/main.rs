//! `pdmesh-tokenizer`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_tokenizer::config::Config::parse();
    pdmesh_core::serve::run_main("pdmesh-tokenizer", cfg.listen, |l, stop| pdmesh_tokenizer::serve(cfg, l, stop)).await
}
