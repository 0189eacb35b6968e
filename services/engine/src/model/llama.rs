//! The `llama` architecture (SmolLM2, Llama 2/3 and their kin): pre-norm
//! attention with normal-mode RoPE and a SwiGLU feed-forward, each block's
//! output added to the residual stream.

use pdmesh_kernels::activation;

use super::arch::ArchDef;
use super::{Layer, Model, Step};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

pub const ARCH: ArchDef = ArchDef {
    name: "llama",
    hparams,
    load_layer: Layer::load_common,
    embd_scale: |_| None,
    flash_attention: false,
    layer,
};

fn hparams(_: &Gguf, c: &mut ModelConfig) -> Result<()> {
    if c.q_dim() != c.n_embd {
        return Err(EngineError::Unsupported(format!(
            "llama with {} query heads of {} over width {}",
            c.n_heads, c.head_dim, c.n_embd
        )));
    }
    Ok(())
}

fn layer(m: &Model, st: &mut Step<'_, '_>, li: usize, l: &Layer) {
    m.norm_in(st, li, &l.attn_norm);
    m.dump("attn_norm", li, &st.s.xn);
    m.qkv(st, li, l);
    m.rope_and_write(st, li, false);
    m.dump("Qcur", li, &st.s.q);
    m.dump("Kcur", li, &st.s.k);
    m.dump("Vcur", li, &st.s.v);
    m.attend(st, li, 1.0 / (m.config.head_dim as f32).sqrt());
    m.dump("kqv_out", li, &st.s.att);
    m.out_proj(st, li, l);
    m.dump("attn_out", li, &st.s.proj);
    Model::residual(st);
    m.dump("ffn_inp", li, &st.s.x);

    m.norm_in(st, li, &l.ffn_norm);
    m.gate_up(st, li, l);
    m.dump("ffn_gate", li, &st.s.gate);
    m.dump("ffn_up", li, &st.s.up);
    let (be, ff) = (m.backend, m.config.n_ff);
    let s = &mut *st.s;
    st.kn.run("silu_mul", li, ff, ff, || activation::silu_mul_be(be, &mut s.gate, &s.up));
    m.dump("ffn_swiglu", li, &st.s.gate);
    m.down(st, li, l);
    m.dump("ffn_out", li, &st.s.proj);
    Model::residual(st);
    m.dump("l_out", li, &st.s.x);
}
