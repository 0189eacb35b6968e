//! `pdmesh-gateway`: parse flags, serve until Ctrl-C or SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = pdmesh_gateway::config::Config::parse();
    let listen = match cfg.listen_fd {
        Some(fd) => pdmesh_core::serve::Listen::Fd(fd),
        None => pdmesh_core::serve::Listen::Addr(cfg.listen),
    };
    pdmesh_core::serve::run_main_on("pdmesh-gateway", listen, |l, stop| pdmesh_gateway::serve(cfg, l, stop)).await
}
