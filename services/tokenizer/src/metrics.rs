//! The tokenizer's Prometheus metrics: requests by RPC and outcome.

use std::sync::atomic::{AtomicU64, Ordering};

/// Outcomes a request can end in (the gRPC code class).
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    Ok,
    InvalidArgument,
    Internal,
}

const RPCS: [&str; 3] = ["encode", "detokenize", "info"];
const OUTCOMES: [&str; 3] = ["ok", "invalid_argument", "internal"];

#[derive(Default)]
pub struct Metrics {
    requests: [[AtomicU64; 3]; 3],
}

impl Metrics {
    /// Count one finished request; `rpc` is an index into encode, detokenize, info.
    pub fn record(&self, rpc: usize, outcome: Outcome) {
        self.requests[rpc][outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut s = String::from("# HELP pdmesh_tokenizer_requests_total Finished tokenizer requests by RPC and outcome.\n# TYPE pdmesh_tokenizer_requests_total counter\n");
        for (r, rpc) in RPCS.iter().enumerate() {
            for (o, outcome) in OUTCOMES.iter().enumerate() {
                let v = self.requests[r][o].load(Ordering::Relaxed);
                s.push_str(&format!("pdmesh_tokenizer_requests_total{{rpc=\"{rpc}\",outcome=\"{outcome}\"}} {v}\n"));
            }
        }
        s
    }
}

pub const ENCODE: usize = 0;
pub const DETOKENIZE: usize = 1;
pub const INFO: usize = 2;

/// The outcome a gRPC status stands for.
pub fn outcome_of(status: &tonic::Status) -> Outcome {
    match status.code() {
        tonic::Code::Ok => Outcome::Ok,
        tonic::Code::InvalidArgument => Outcome::InvalidArgument,
        _ => Outcome::Internal,
    }
}
