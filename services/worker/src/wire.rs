//! Conversions between wire and engine types.

use pdmesh_engine::SamplingParams;
use pdmesh_proto::common::v1 as common;

/// Engine sampling parameters from the wire (validated by the engine).
pub fn sampling(
    s: Option<&common::SamplingParams>,
    max_tokens: u32,
    stop_ids: &[u32],
    ignore_eos: bool,
    replay: &[u32],
) -> SamplingParams {
    let s = s.cloned().unwrap_or_default();
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        seed: s.seed,
        max_tokens: max_tokens as usize,
        stop_ids: stop_ids.to_vec(),
        ignore_eos,
        replay: replay.to_vec(),
    }
}
