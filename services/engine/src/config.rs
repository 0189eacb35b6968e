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
}

impl ModelConfig {
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig> {
        let arch = g.get_str("general.architecture")?.to_string();
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!("architecture {arch:?} (only llama is implemented)")));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let n_embd = g.get_u64(&k("embedding_length"))? as usize;
        let n_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = g.get_u64(&k("attention.head_count_kv")).unwrap_or(n_heads as u64) as usize;
        if n_heads == 0 || !n_embd.is_multiple_of(n_heads) || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(EngineError::Unsupported(format!(
                "{n_heads} heads / {n_kv_heads} KV heads over width {n_embd}"
            )));
        }
        let head_dim = n_embd / n_heads;
        let vocab_size = match g.get_u64(&k("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        Ok(ModelConfig {
            name: g.get_str("general.name").unwrap_or("unknown").to_string(),
            n_layers: g.get_u64(&k("block_count"))? as usize,
            n_embd,
            n_ff: g.get_u64(&k("feed_forward_length"))? as usize,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims: g.get_u64(&k("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim),
            rope_base: g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0),
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
            vocab_size,
            context_length: g.get_u64(&k("context_length"))? as usize,
            bos_id: g.get_u64("tokenizer.ggml.bos_token_id").unwrap_or(1) as u32,
            eos_id: g.get_u64("tokenizer.ggml.eos_token_id").unwrap_or(2) as u32,
            arch,
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
