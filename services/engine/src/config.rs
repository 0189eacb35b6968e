//! Model hyper-parameters, read from GGUF metadata.

use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelConfig {
    pub arch: String,
    pub name: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub vocab_size: usize,
    pub context_length: usize,
    pub bos_id: u32,
    pub eos_id: u32,
    /// Tokens that end a generation ([`end_of_generation`]), sorted.
    pub eog_ids: Vec<u32>,
    /// How each layer attends: its window and RoPE base (the architecture
    /// file fills these in; a plain model has every layer global).
    pub layers: Vec<LayerAttn>,
}

/// One layer's attention: how far back it sees and its RoPE base.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LayerAttn {
    /// A query at position p sees keys at p - window + 1 ..= p; `None`:
    /// every earlier position (a global layer).
    pub window: Option<usize>,
    pub rope_base: f32,
}

/// Token texts that end a generation whatever their id, as llama.cpp
/// lists them (`llama-vocab.cpp`): chat turns' ends of several families.
const END_TEXTS: [&str; 13] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "</s>",
];

/// The tokens that end a generation, as llama.cpp counts them: EOS, the
/// EOT and EOM tokens the file names, and every token whose text is in
/// [`END_TEXTS`] (Gemma 3: `<eos>`, `<end_of_turn>`, `</s>`; SmolLM2:
/// `<|endoftext|>`, `<|im_end|>`).
fn end_of_generation(g: &Gguf) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = ["eos", "eot", "eom"]
        .iter()
        .filter_map(|k| g.get_u64(&format!("tokenizer.ggml.{k}_token_id")).ok().map(|v| v as u32))
        .collect();
    if ids.is_empty() {
        ids.push(2);
    }
    if let Ok(tokens) = g.get_str_array("tokenizer.ggml.tokens") {
        ids.extend(tokens.iter().enumerate().filter(|(_, t)| END_TEXTS.contains(t)).map(|(i, _)| i as u32));
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

impl ModelConfig {
    /// The hyper-parameters every architecture shares, read from the
    /// `{arch}.*` keys; the architecture's own file adjusts the rest.
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig> {
        let arch = g.get_str("general.architecture")?.to_string();
        let k = |s: &str| format!("{arch}.{s}");
        let n_embd = g.get_u64(&k("embedding_length"))? as usize;
        let n_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = g.get_u64(&k("attention.head_count_kv")).unwrap_or(n_heads as u64) as usize;
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(EngineError::Unsupported(format!("{n_heads} heads over {n_kv_heads} KV heads")));
        }
        let head_dim = match g.get_u64(&k("attention.key_length")) {
            Ok(v) => v as usize,
            Err(_) if n_embd.is_multiple_of(n_heads) => n_embd / n_heads,
            Err(_) => return Err(EngineError::Unsupported(format!("{n_heads} heads over width {n_embd}"))),
        };
        if g.get_u64(&k("attention.value_length")).is_ok_and(|v| v as usize != head_dim) {
            return Err(EngineError::Unsupported("value heads of another size than key heads".into()));
        }
        if head_dim == 0 || head_dim > 256 || !head_dim.is_multiple_of(32) {
            return Err(EngineError::Unsupported(format!(
                "head size {head_dim} (attention takes multiples of 32 up to 256)"
            )));
        }
        let vocab_size = match g.get_u64(&k("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let n_layers = g.get_u64(&k("block_count"))? as usize;
        let rope_base = g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0);
        Ok(ModelConfig {
            name: g.get_str("general.name").unwrap_or("unknown").to_string(),
            n_layers,
            n_embd,
            n_ff: g.get_u64(&k("feed_forward_length"))? as usize,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims: g.get_u64(&k("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim),
            rope_base,
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
            vocab_size,
            context_length: g.get_u64(&k("context_length"))? as usize,
            bos_id: g.get_u64("tokenizer.ggml.bos_token_id").unwrap_or(1) as u32,
            eos_id: g.get_u64("tokenizer.ggml.eos_token_id").unwrap_or(2) as u32,
            eog_ids: end_of_generation(g)?,
            layers: vec![LayerAttn { window: None, rope_base }; n_layers],
            arch,
        })
    }

    /// Width of all query heads together (`n_embd` in llama; Gemma 3's
    /// heads are wider than its embedding).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
