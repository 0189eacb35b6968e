//! The `gemma3` architecture (Gemma 3, text): embeddings scaled by
//! √width; RMS norms before and after both attention and the feed-forward,
//! and on each head of Q and K; NEOX-mode RoPE; queries scaled by
//! 1/√head before attention; a GeGLU feed-forward (tanh GELU); five of
//! every six layers attend through a sliding window with their own RoPE
//! base. As llama.cpp's `src/models/gemma3.cpp`.

use super::arch::ArchDef;
use super::{load_f32, Layer, Model, Step};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::{Gguf, Value};

pub const ARCH: ArchDef = ArchDef {
    name: "gemma3",
    hparams,
    load_layer,
    embd_scale: |c| Some((c.n_embd as f32).sqrt()),
    flash_attention: true,
    layer,
};

/// Layers in a window/global cycle when the file does not say (llama.cpp's
/// default for Gemma 3: five windowed, then one global).
const SWA_PATTERN: usize = 6;
/// RoPE base of the windowed layers when the file does not say.
const SWA_ROPE_BASE: f32 = 10_000.0;

fn hparams(g: &Gguf, c: &mut ModelConfig) -> Result<()> {
    let k = |s: &str| format!("gemma3.{s}");
    if !c.head_dim.is_multiple_of(64) {
        return Err(EngineError::Unsupported(format!(
            "gemma3 with heads of {} (flash attention takes multiples of 64)",
            c.head_dim
        )));
    }
    if g.get_f32(&k("rope.scaling.factor")).is_ok_and(|f| f != 1.0) {
        return Err(EngineError::Unsupported("gemma3 with RoPE scaling (the 4B and larger models)".into()));
    }
    if g.get_f32(&k("final_logit_softcapping")).is_ok_and(|f| f != 0.0) {
        return Err(EngineError::Unsupported("gemma3 with final logit soft-capping".into()));
    }
    let window = g.get_u64(&k("attention.sliding_window")).unwrap_or(0) as usize;
    if window == 0 {
        return Ok(());
    }
    let swa_base = g.get_f32(&k("rope.freq_base_swa")).unwrap_or(SWA_ROPE_BASE);
    let pattern: Vec<bool> = match g.metadata.get(&k("attention.sliding_window_pattern")) {
        Some(Value::Array(a)) => a.iter().map(|v| matches!(v, Value::Bool(true))).collect(),
        Some(v) => {
            let n = v.as_u64().unwrap_or(SWA_PATTERN as u64).max(1) as usize;
            (0..c.n_layers).map(|i| i % n < n - 1).collect()
        }
        None => (0..c.n_layers).map(|i| i % SWA_PATTERN < SWA_PATTERN - 1).collect(),
    };
    for (i, l) in c.layers.iter_mut().enumerate() {
        if pattern.get(i).copied().unwrap_or(false) {
            l.window = Some(window);
            l.rope_base = swa_base;
        }
    }
    Ok(())
}

fn load_layer(g: &Gguf, c: &ModelConfig, i: usize) -> Result<Layer> {
    let mut l = Layer::load_common(g, c, i)?;
    let n = |s: &str| format!("blk.{i}.{s}.weight");
    l.q_norm = Some(load_f32(g, &n("attn_q_norm"), c.head_dim)?);
    l.k_norm = Some(load_f32(g, &n("attn_k_norm"), c.head_dim)?);
    l.post_attn_norm = Some(load_f32(g, &n("post_attention_norm"), c.n_embd)?);
    l.post_ffn_norm = Some(load_f32(g, &n("post_ffw_norm"), c.n_embd)?);
    Ok(l)
}

/// Gemma's query scale: 1/√head (1/√(width/heads) for the 27B model, as
/// Google's reference sets `query_pre_attn_scalar`).
pub(crate) fn query_scale(c: &ModelConfig) -> f32 {
    let d = if c.n_layers == 62 { c.n_embd / c.n_heads } else { c.head_dim };
    1.0 / (d as f32).sqrt()
}

fn layer(m: &Model, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
    let c = &m.config;
    let missing = "gemma3 layers are loaded with their extra norms";
    m.norm_in(st, li, &l.attn_norm);
    m.dump("attn_norm", li, &st.s.xn);
    m.qkv(st, li, l);
    m.qk_norms(st, li, l);
    m.rope_and_write(st, li, true);
    m.dump("Qcur", li, &st.s.q);
    m.dump("Kcur", li, &st.s.k);
    let scale = query_scale(c);
    st.s.q.iter_mut().for_each(|v| *v *= scale);
    m.attend(st, li, 1.0);
    m.dump("kqv_out", li, &st.s.att);
    m.out_proj(st, li, l);
    m.dump("attn_out", li, &st.s.proj);
    m.post_norm(st, li, l.post_attn_norm.as_deref().expect(missing));
    m.dump("attn_post_norm", li, &st.s.proj);
    Model::residual(st);
    m.dump("sa_out", li, &st.s.x);

    m.norm_in(st, li, &l.ffn_norm);
    m.gate_up(st, li, l);
    m.geglu(st, li);
    m.dump("ffn_geglu", li, &st.s.gate);
    m.down(st, li, l);
    m.dump("ffn_out", li, &st.s.proj);
    m.post_norm(st, li, l.post_ffn_norm.as_deref().expect(missing));
    m.dump("ffn_post_norm", li, &st.s.proj);
    Model::residual(st);
    m.dump("l_out", li, &st.s.x);
}
