//! Compiles `proto/troupe/v1/*.proto` with protox (no system protoc) and writes the encoded
//! descriptor set next to the generated code for server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not with env!(): cargo may reuse a compiled build script for another
    // checkout of the workspace, and a baked-in path would compile that checkout's protos.
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [
        "common",
        "coordinator",
        "executor",
        "test_runner",
        "validator",
    ]
    .map(|name| proto_root.join(format!("troupe/v1/{name}.proto")));
    println!("cargo:rerun-if-changed={}", proto_root.display());
    println!("cargo:rerun-if-changed=build.rs");

    let descriptors = protox::compile(&files, [&proto_root])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("troupe_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        // Malformed requests are the caller's mistake (see src/codec.rs).
        .codec_path("crate::codec::Codec")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
