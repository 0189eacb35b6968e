//! KV transfer between workers: the one home of both transports and the
//! arena registration.
//!
//! - `nixl` ([`nixl`]): NVIDIA NIXL (UCX backend) through `nixl-sys`; each
//!   worker registers its whole KV arena once at start, and a prefill WRITEs
//!   its pinned blocks straight into the decode worker's reserved blocks.
//! - `tcp`: the prefill streams the blocks' bytes to the decode worker's
//!   `WriteKv` RPC.
//!
//! [`send`] holds the sending side ([`send::KvTransport`]); a transfer
//! uses NIXL when both ends have it. [`ship`] runs a whole shipment
//! through a ticket (claim, write, complete): a prefill worker's prompt, or
//! a draining decode worker's sequence. The receiving side is the decode's
//! `WriteKv` handler and the arena NIXL writes into.

pub mod nixl;
pub mod send;
pub mod ship;

use std::path::PathBuf;

use pdmesh_engine::KvLayout;
use pdmesh_proto::common::v1 as common;
use tonic::Status;

pub use nixl::{find_library, load_library, spawn_progress, Nixl};

/// Which transport a worker offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportChoice {
    /// NIXL if its library loads, else TCP.
    Auto,
    /// NIXL or fail at start.
    Nixl,
    /// TCP only.
    Tcp,
}

/// Transport flags of a worker (each also an environment variable).
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct TransportArgs {
    /// KV transport: auto (NIXL when its library loads, else tcp), nixl, tcp.
    #[arg(long, env = "PDMESH_KV_TRANSPORT", value_enum, default_value = "auto")]
    pub kv_transport: TransportChoice,
    /// Path of libnixl_capi.so (default: found on LD_LIBRARY_PATH, else in
    /// the `nixl-cu12` wheel of the Python that `--python` names).
    #[arg(long, env = "PDMESH_NIXL_LIB")]
    pub nixl_lib: Option<PathBuf>,
}

/// Decide the transport at start: `Some(library)` for NIXL, `None` for TCP.
/// `python` is the one whose `nixl-cu12` wheel may hold the library.
pub fn choose(args: &TransportArgs, python: &str) -> Result<Option<PathBuf>, String> {
    if args.kv_transport == TransportChoice::Tcp {
        return Ok(None);
    }
    let found = find_library(args.nixl_lib.as_deref(), python);
    let loaded = match &found {
        Some(p) => load_library(p).map(|_| p.clone()),
        None => Err("libnixl_capi.so not found (pip install nixl-cu12==1.5.1, or give --nixl-lib)".into()),
    };
    match (args.kv_transport, loaded) {
        (_, Ok(p)) => {
            eprintln!("KV transport: nixl ({})", p.display());
            Ok(Some(p))
        }
        (TransportChoice::Nixl, Err(e)) => Err(format!("--kv-transport nixl: {e}")),
        (_, Err(e)) => {
            eprintln!("KV transport: tcp ({e})");
            Ok(None)
        }
    }
}

/// The KV layout as the wire carries it.
pub fn layout_to_wire(l: &KvLayout) -> common::KvLayout {
    common::KvLayout {
        n_layers: l.n_layers as u32,
        n_kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_size: l.block_size as u32,
        dtype: "f16".into(),
    }
}

/// A KV layout from the wire (f16 only).
pub fn layout_from_wire(l: &common::KvLayout) -> Result<KvLayout, Status> {
    if l.dtype != "f16" {
        return Err(Status::failed_precondition(format!("KV dtype {:?} is not supported (f16 only)", l.dtype)));
    }
    Ok(KvLayout {
        n_layers: l.n_layers as usize,
        n_kv_heads: l.n_kv_heads as usize,
        head_dim: l.head_dim as usize,
        block_size: l.block_size as usize,
    })
}
