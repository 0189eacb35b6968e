//! The tokenizer's metrics: requests by RPC and [`Outcome`].

use pdmesh_core::metrics::{Format, Outcome, Outcomes, Text};
use pdmesh_core::vocab::metric;

const RPCS: [&str; 3] = ["encode", "detokenize", "info"];

#[derive(Default)]
pub struct Metrics {
    requests: [Outcomes; 3],
}

impl Metrics {
    /// Count one finished request; `rpc` is an index into encode, detokenize, info.
    pub fn record(&self, rpc: usize, outcome: Outcome) {
        self.requests[rpc].inc(outcome);
    }

    pub fn render(&self, f: Format) -> String {
        let mut samples = Vec::new();
        for (rpc, outcomes) in RPCS.iter().zip(&self.requests) {
            samples.extend(outcomes.samples().map(|(o, v)| (vec![*rpc, o], v)));
        }
        let mut t = Text::new(f);
        let help = "Finished tokenizer requests by RPC and outcome.";
        t.family(metric::tokenizer::REQUESTS_TOTAL, "counter", help, &["rpc", "outcome"], &samples);
        t.finish()
    }
}

pub const ENCODE: usize = 0;
pub const DETOKENIZE: usize = 1;
pub const INFO: usize = 2;

/// The outcome a gRPC status stands for.
pub fn outcome_of(status: &tonic::Status) -> Outcome {
    Outcome::of_code(status.code())
}
