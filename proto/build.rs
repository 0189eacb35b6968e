//! Compiles the .proto files with protox (no system protoc) and keeps the
//! encoded descriptor set for gRPC reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "pdmesh/common/v1/common.proto",
        "pdmesh/tokenizer/v1/tokenizer.proto",
        "pdmesh/router/v1/router.proto",
        "pdmesh/prefill/v1/prefill.proto",
        "pdmesh/decode/v1/decode.proto",
        "pdmesh/kvbroker/v1/kvbroker.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("pdmesh_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
