//! Shared runtime of pdmesh services. For now: service discovery
//! ([`discovery`]) with the single-machine `file` backend; the Consul backend,
//! shared flags, health, metrics and tracing helpers join it as the mesh grows.

pub mod discovery;
