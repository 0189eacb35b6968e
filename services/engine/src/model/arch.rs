//! The architecture table: each GGUF `general.architecture` the engine
//! runs, and its file's hooks. Adding an architecture is one new file in
//! `model/` and one row here.

use super::{gemma3, llama, Layer, Model, Step};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

/// What one architecture file provides.
pub struct ArchDef {
    /// `general.architecture` in the GGUF file.
    pub name: &'static str,
    /// Adjust the shared hyper-parameters from the architecture's own keys
    /// (windows, RoPE bases), refusing what the file cannot run.
    pub(crate) hparams: fn(&Gguf, &mut ModelConfig) -> Result<()>,
    /// Load layer `i`'s weights.
    pub(crate) load_layer: fn(&Gguf, &ModelConfig, usize) -> Result<Layer>,
    /// Scale applied to the token embeddings, if any.
    pub(crate) embd_scale: fn(&ModelConfig) -> Option<f32>,
    /// Attention arithmetic: llama.cpp's flash-attention kernel (`true`) or
    /// its classic soft-max path. Each architecture follows the llama.cpp
    /// configuration its golden tokens were made with: SmolLM2's with
    /// flash attention off (llama-cpp-python 0.3.36), Gemma 3's with
    /// llama-server's default (on).
    pub flash_attention: bool,
    /// Run one layer of a step.
    pub(crate) layer: fn(&Model, &mut Step<'_, '_>, usize, &Layer),
}

/// Every architecture the engine runs.
pub const ARCHS: &[&ArchDef] = &[&llama::ARCH, &gemma3::ARCH];

/// The table's entry for `name`, or an error naming what runs.
pub fn find(name: &str) -> Result<&'static ArchDef> {
    ARCHS.iter().copied().find(|a| a.name == name).ok_or_else(|| {
        let known: Vec<&str> = ARCHS.iter().map(|a| a.name).collect();
        EngineError::Unsupported(format!("architecture {name:?} (pdmesh runs {})", known.join(", ")))
    })
}
