//! pdmesh's gRPC APIs, one versioned package per service
//! (`proto/pdmesh/<service>/v1/<service>.proto`, package `pdmesh.<service>.v1`),
//! generated at build time with protox, so no `protoc` is needed.
//! Field numbers are never reused; new fields are optional.

macro_rules! package {
    ($name:ident, $pkg:literal) => {
        pub mod $name {
            pub mod v1 {
                tonic::include_proto!($pkg);
            }
        }
    };
}

package!(common, "pdmesh.common.v1");
package!(tokenizer, "pdmesh.tokenizer.v1");
package!(router, "pdmesh.router.v1");
package!(prefill, "pdmesh.prefill.v1");
package!(decode, "pdmesh.decode.v1");
package!(kvbroker, "pdmesh.kvbroker.v1");

/// Encoded `FileDescriptorSet` of every pdmesh proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pdmesh_descriptor.bin"));
