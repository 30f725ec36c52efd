//! The `troupe.v1` wire contract (`proto/troupe/v1/*.proto`), generated at build time with
//! protox, and [`FILE_DESCRIPTOR_SET`] for gRPC server reflection.
//!
//! Services import messages from [`v1`] and keep tonic types inside their `grpc.rs` adapters.

/// Generated messages, clients and servers of package `troupe.v1`.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("troupe.v1");
}

/// Encoded `FileDescriptorSet` of every troupe.v1 file (with its imports), for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/troupe_descriptor.bin"));

pub mod codec;
pub mod json;
pub mod legacy;
pub mod names;

pub use prost_types;

#[cfg(test)]
mod tests {
    use prost::Message;

    #[test]
    fn descriptor_set_decodes_and_names_every_service() {
        let set = prost_types::FileDescriptorSet::decode(super::FILE_DESCRIPTOR_SET)
            .expect("embedded descriptor set decodes");
        let services: Vec<String> = set
            .file
            .iter()
            .filter(|file| file.package() == "troupe.v1")
            .flat_map(|file| file.service.iter().map(|s| s.name().to_owned()))
            .collect();
        for expected in ["Coordinator", "Executor", "TestRunner", "Validator"] {
            assert!(
                services.iter().any(|s| s == expected),
                "missing service {expected}: {services:?}"
            );
        }
    }
}
