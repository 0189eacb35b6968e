//! What the prefill and decode workers share, a module per concern:
//! [`args`] (flags and the engine they build), [`errors`] (engine errors to
//! gRPC statuses, failed steps), [`wire`] (wire to engine types),
//! [`broker`] (the kvbroker client and registration), [`alive`] (the
//! engine loop's liveness), [`boot`] (start and serve), [`steps`] (what a
//! step costs, its span), [`kv`] (transfers) and [`prefix`] (the cache log).

pub mod alive;
pub mod args;
pub mod boot;
pub mod broker;
pub mod errors;
pub mod kv;
pub mod prefix;
pub mod steps;
pub mod wire;

pub use alive::{loop_panic_fault, loop_stall_fault, AliveGuard, LoopAlive};
pub use args::{EngineArgs, KernelSpans, WorkerArgs};
pub use boot::{boot, serve_worker, start_worker, Started, StatsSlot};
pub use broker::{at_broker, broker, keep_registered, BrokerClient, BrokerLink, BROKER_RETRY, REGISTER_EVERY};
pub use errors::{is_fatal, status, step_error};
pub use kv::{layout_from_wire, layout_to_wire};
pub use pdmesh_core::serve::ServeError;
pub use steps::step_span;
pub use wire::sampling;
