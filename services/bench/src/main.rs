//! `pdmesh-bench`: measurements that need the engine or NIXL, kept out of
//! `meshctl` so the operator's tool links neither.
//!
//! - `pdmesh-bench mesh`: TTFT and output tokens/s through a running mesh
//!   and through the engine alone, same workload.
//! - `pdmesh-bench kv`: one prompt's KV moved between two processes with
//!   NIXL and TCP, beside a memcpy.

mod kv;
mod mesh;
mod vram;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "pdmesh-bench", version, about = "Benchmarks of the mesh, the engine and KV transfer (JSON out)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// TTFT and output tokens/s through the mesh and through the engine alone, same workload.
    Mesh(mesh::Args),
    /// Move one prompt's KV between two processes with NIXL and TCP, beside memcpy.
    Kv(kv::Args),
}

#[tokio::main]
async fn main() -> ExitCode {
    let r = match Cli::parse().cmd {
        Cmd::Mesh(a) => mesh::run(a).await,
        Cmd::Kv(a) => kv::run(a).await,
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
