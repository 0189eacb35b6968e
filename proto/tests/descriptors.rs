//! The descriptor set served by reflection holds every pdmesh service.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use prost::Message;

#[test]
fn descriptor_set_lists_every_service() {
    let fds = prost_types::FileDescriptorSet::decode(pdmesh_proto::FILE_DESCRIPTOR_SET).unwrap();
    let mut services: Vec<String> =
        fds.file.iter().flat_map(|f| f.service.iter().map(move |s| format!("{}.{}", f.package(), s.name()))).collect();
    services.sort();
    assert_eq!(
        services,
        [
            "pdmesh.decode.v1.Decode",
            "pdmesh.kvbroker.v1.KvBroker",
            "pdmesh.prefill.v1.Prefill",
            "pdmesh.router.v1.Router",
            "pdmesh.tokenizer.v1.Tokenizer",
        ]
    );
}
