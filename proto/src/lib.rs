//! pdmesh's gRPC APIs, one versioned package per service
//! (`proto/pdmesh/<service>/v1/<service>.proto`, package `pdmesh.<service>.v1`),
//! generated at build time with protox, so no `protoc` is needed.
//! Field numbers are never reused; new fields are optional.

pub mod tokenizer {
    pub mod v1 {
        tonic::include_proto!("pdmesh.tokenizer.v1");
    }
}

/// Encoded `FileDescriptorSet` of every pdmesh proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pdmesh_descriptor.bin"));
