//! Token sampling: greedy, temperature, top-k, top-p, seeded.
//!
//! The random draw for the n-th generated token depends only on the seed and
//! n, not on how many draws came before in this process, so a sequence whose
//! first token was sampled on a prefill worker and the rest on a decode
//! worker gets the same tokens as one sampled in a single place.

use pdmesh_kernels::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

pub use pdmesh_vocab::limits::MAX_TEMPERATURE;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1.0 disables.
    pub top_p: f32,
    pub seed: u64,
    /// Tokens to generate at most (>= 1).
    pub max_tokens: usize,
    /// Extra token ids that end the sequence (EOS always does unless ignored).
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Tokens the sequence already produced elsewhere (a migrated request):
    /// taken in order as its first tokens instead of sampled, their events
    /// marked `replayed`. Seeded draws go on from the index after them.
    pub replay: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            max_tokens: 16,
            stop_ids: Vec::new(),
            ignore_eos: false,
            replay: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams { max_tokens, ..Default::default() }
    }

    /// Whether the next token is the argmax (no randomness): such rows
    /// may be picked on the GPU, with only the token id coming back.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidArgument(m));
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if !self.temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return bad(format!("temperature must be between 0 and {MAX_TEMPERATURE}, got {}", self.temperature));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.replay.len() >= self.max_tokens {
            return bad(format!(
                "{} tokens to replay leave none of max_tokens {} to generate",
                self.replay.len(),
                self.max_tokens
            ));
        }
        Ok(())
    }
}

/// Pick the next token from `logits`; `step` is the index of the token being
/// generated (0 for the first).
pub fn sample(p: &SamplingParams, logits: &[f32], step: usize) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, l)| (i as u32, *l)).collect();
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, by_logit);
        cand.truncate(p.top_k);
    }
    cand.sort_by(by_logit);
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|(_, l)| ((l - max) / p.temperature).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, x) in probs.iter().enumerate() {
            acc += x;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let t: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= t);
    }
    let mut rng = Rng::new(p.seed ^ (step as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let r = rng.next_f32();
    let mut acc = 0.0;
    for (i, x) in probs.iter().enumerate() {
        acc += x;
        if r < acc {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

/// What a forward step gives a sequence whose pending tokens are all in.
#[derive(Clone, Debug, PartialEq)]
pub enum NextToken {
    /// The last position's logits: the host samples them.
    Logits(Vec<f32>),
    /// The token the GPU already picked (a greedy row: only its id crossed
    /// the bus). The device's argmax breaks ties as [`argmax`] does.
    Picked(u32),
}

impl NextToken {
    /// The logits, where they came back to the host (always on the CPU).
    pub fn logits(&self) -> Option<&[f32]> {
        match self {
            NextToken::Logits(l) => Some(l),
            NextToken::Picked(_) => None,
        }
    }

    /// The token for the `step`-th generated position.
    pub fn sample(&self, p: &SamplingParams, step: usize) -> u32 {
        match self {
            NextToken::Logits(l) => sample(p, l, step),
            NextToken::Picked(t) => *t,
        }
    }
}

/// Index of the largest logit (lowest index on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_max() {
        assert_eq!(sample(&SamplingParams::greedy(1), &[0.1, 3.0, 2.9, 3.0], 0), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 5, seed: 42, ..Default::default() };
        let a: Vec<u32> = (0..20).map(|s| sample(&p, &logits, s)).collect();
        let b: Vec<u32> = (0..20).map(|s| sample(&p, &logits, s)).collect();
        assert_eq!(a, b);
        // Only tokens with the top logit value (i % 7 == 6) are in the top 5.
        assert!(a.iter().all(|t| t % 7 == 6), "{a:?}");
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "sampling never varied: {a:?}");
    }

    #[test]
    fn top_p_keeps_the_dominant_token() {
        let mut logits = vec![0.0f32; 100];
        logits[17] = 20.0;
        let p = SamplingParams { temperature: 1.0, top_p: 0.5, seed: 1, ..Default::default() };
        assert!((0..30).all(|s| sample(&p, &logits, s) == 17));
    }

    #[test]
    fn validation_rejects_out_of_range() {
        let ok = SamplingParams::greedy(4);
        assert!(ok.validate().is_ok());
        assert!(SamplingParams { max_tokens: 0, ..ok.clone() }.validate().is_err());
        assert!(SamplingParams { temperature: -0.1, ..ok.clone() }.validate().is_err());
        assert!(SamplingParams { temperature: f32::NAN, ..ok.clone() }.validate().is_err());
        assert!(SamplingParams { top_p: 0.0, ..ok.clone() }.validate().is_err());
    }
}
