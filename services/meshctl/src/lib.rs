//! The parts of `meshctl` that tests use too: the span model and its
//! readers ([`trace`]), a small OTLP receiver ([`sink`]) and the latency
//! attribution behind `meshctl explain` ([`explain`]).

pub mod explain;
pub mod sink;
pub mod trace;
