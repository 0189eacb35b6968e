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
    match pdmesh_tokenizer::serve(cfg, listener, shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return ctrl_c.await.unwrap_or(()),
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
