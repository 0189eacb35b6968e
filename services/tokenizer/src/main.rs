//! `pdmesh-tokenizer`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_tokenizer::config::Config::parse();
    let listener = match tokio::net::TcpListener::bind(cfg.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", cfg.listen);
            return std::process::ExitCode::FAILURE;
        }
    };
    eprintln!("pdmesh-tokenizer: listening on {}", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    match pdmesh_tokenizer::serve(cfg, listener, pdmesh_core::signal::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
