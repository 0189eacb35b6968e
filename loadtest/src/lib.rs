//! pdmesh-loadtest: how an OpenAI-compatible deployment behaves under load.
//!
//! Workloads, all seeded: closed-loop concurrency sweeps, open-loop Poisson
//! arrivals, and agentic multi-turn sessions (each round re-sends the whole
//! history plus the previous answer and a synthetic tool result, after a
//! think time). Per request: TTFT, inter-token gaps, time per output token,
//! end-to-end latency, outcome (stalls counted apart from errors, with their
//! request ids). Aggregates: percentiles, throughput, goodput within an SLO.
//! While load runs, the targets' /metrics load gauges are sampled beside the
//! timeline. Output: JSON, Markdown and plots (PNG and SVG). Load goes only to the address
//! given, bounded in requests and time; Ctrl-C stops launching and still
//! reports what was measured.

pub mod ab;
pub mod client;
pub mod plot;
pub mod report;
pub mod run;
pub mod sampler;

/// Prompts built into the tool (no downloads): short questions and tasks.
pub const CORPUS: &[&str] = &[
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Translate to French: Good morning, how are you?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue? Answer in one sentence.",
    "Give me a short story about a robot who learns to paint.",
    "What are the first five prime numbers?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I boil an egg?",
    "Name three planets and one fact about each.",
];

/// A small seeded generator (xorshift64*), so runs are reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}
