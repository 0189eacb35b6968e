//! The numerics referee: the same llama forward pass with every weight
//! dequantized to f32 once, activations never quantized, the KV cache kept
//! in f32 and every sum taken in f64. It is slow (one token at a time,
//! plain loops) and shares nothing with the engine's kernels but the exact
//! block dequantizers, so both engines — the CPU's (bit-identical to
//! llama.cpp) and the GPU's (its own rounding) — can be judged against it:
//! the worst logit error, the greedy agreement, and layer by layer where a
//! gap begins (`services/engine/tests/referee.rs`).

use super::{Model, Weight};
use crate::sampler::argmax;

/// A weight matrix dequantized to f32, row-major (`rows x cols`).
struct Dense {
    cols: usize,
    w: Vec<f32>,
}

impl Dense {
    fn of(w: &Weight) -> Dense {
        let mut out = vec![0f32; w.rows * w.cols];
        for (r, row) in out.chunks_exact_mut(w.cols).enumerate() {
            w.dequant_row(r, row);
        }
        Dense { cols: w.cols, w: out }
    }

    /// `W x`, each output's dot product summed in f64.
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols);
        self.w.chunks_exact(self.cols).map(|row| dot(row, x) as f32).collect()
    }
}

/// A dot product in f64, four partial sums (so it vectorises).
fn dot(a: &[f32], b: &[f32]) -> f64 {
    let mut acc = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| *x as f64 * *y as f64).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            acc[i] += x[i] as f64 * y[i] as f64;
        }
    }
    acc.iter().sum::<f64>() + tail
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(v, g)| (*v as f64 * scale * *g as f64) as f32).collect()
}

/// RoPE, GGML "normal" mode (adjacent pairs), angles in f64.
fn rope(x: &mut [f32], head_dim: usize, dims: usize, pos: usize, base: f32) {
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..dims / 2 {
            let theta = pos as f64 * (base as f64).powf(-2.0 * i as f64 / dims as f64);
            let (s, c) = theta.sin_cos();
            let (x0, x1) = (head[2 * i] as f64, head[2 * i + 1] as f64);
            head[2 * i] = (x0 * c - x1 * s) as f32;
            head[2 * i + 1] = (x0 * s + x1 * c) as f32;
        }
    }
}

struct RefLayer {
    attn_norm: Vec<f32>,
    wq: Dense,
    wk: Dense,
    wv: Dense,
    wo: Dense,
    ffn_norm: Vec<f32>,
    w_gate: Dense,
    w_up: Dense,
    w_down: Dense,
}

/// The f32 model (about 4 bytes per weight: ~540 MB for SmolLM2-135M).
pub struct Reference {
    config: crate::config::ModelConfig,
    layers: Vec<RefLayer>,
    embd: Dense,
    output: Option<Dense>,
    output_norm: Vec<f32>,
}

/// One sequence's state in the reference: its f32 KV per layer, and the
/// residual stream after each layer for the last token it ran.
pub struct RefSequence {
    /// `keys[layer]`, `values[layer]`: `pos * kv_dim` values each.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    pos: usize,
    /// The residual stream after each layer (`n_embd` values) for the
    /// last token fed (llama.cpp's `l_out-N`).
    pub layer_out: Vec<Vec<f32>>,
}

impl Reference {
    /// Dequantize every weight of `model` (the referee knows the llama
    /// graph only).
    pub fn new(model: &Model) -> crate::error::Result<Reference> {
        if model.arch().name != "llama" {
            return Err(crate::error::EngineError::Unsupported(format!(
                "the f32 referee runs llama only, not {}",
                model.arch().name
            )));
        }
        let layers = model
            .layers
            .iter()
            .map(|l| RefLayer {
                attn_norm: l.attn_norm.clone(),
                wq: Dense::of(&l.wq),
                wk: Dense::of(&l.wk),
                wv: Dense::of(&l.wv),
                wo: Dense::of(&l.wo),
                ffn_norm: l.ffn_norm.clone(),
                w_gate: Dense::of(&l.w_gate),
                w_up: Dense::of(&l.w_up),
                w_down: Dense::of(&l.w_down),
            })
            .collect();
        Ok(Reference {
            config: model.config.clone(),
            layers,
            embd: Dense::of(&model.tok_embd),
            output: model.output.as_ref().map(Dense::of),
            output_norm: model.output_norm.clone(),
        })
    }

    pub fn sequence(&self) -> RefSequence {
        let n = self.layers.len();
        RefSequence { keys: vec![Vec::new(); n], values: vec![Vec::new(); n], pos: 0, layer_out: vec![Vec::new(); n] }
    }

    /// Feed `tokens` one at a time; the logits after the last one.
    pub fn feed(&self, seq: &mut RefSequence, tokens: &[u32]) -> Vec<f32> {
        let mut logits = Vec::new();
        for t in tokens {
            logits = self.step(seq, *t);
        }
        logits
    }

    /// Greedy continuation of `prompt` by `n` tokens (EOS not special).
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut seq = self.sequence();
        let mut logits = self.feed(&mut seq, prompt);
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let next = argmax(&logits);
            out.push(next);
            logits = self.step(&mut seq, next);
        }
        out
    }

    /// One token through every layer and the output head.
    fn step(&self, seq: &mut RefSequence, token: u32) -> Vec<f32> {
        let c = &self.config;
        let d = c.n_embd;
        let t = token as usize;
        let mut x = self.embd.w[t * d..(t + 1) * d].to_vec();
        for (li, l) in self.layers.iter().enumerate() {
            let att = self.attention(seq, li, l, &x);
            x.iter_mut().zip(&att).for_each(|(a, b)| *a += b);
            let h = rms_norm(&x, &l.ffn_norm, c.rms_eps);
            let (gate, up) = (l.w_gate.apply(&h), l.w_up.apply(&h));
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| {
                    let g = *g as f64;
                    (g / (1.0 + (-g).exp()) * *u as f64) as f32
                })
                .collect();
            let down = l.w_down.apply(&act);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            seq.layer_out[li] = x.clone();
        }
        seq.pos += 1;
        let h = rms_norm(&x, &self.output_norm, c.rms_eps);
        self.output.as_ref().unwrap_or(&self.embd).apply(&h)
    }

    /// Norm, projections, RoPE, causal GQA attention over the sequence's
    /// f32 cache (this token's key and value appended), output projection.
    fn attention(&self, seq: &mut RefSequence, li: usize, l: &RefLayer, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let (hd, kvd, group) = (c.head_dim, c.kv_dim(), c.group());
        let h = rms_norm(x, &l.attn_norm, c.rms_eps);
        let (mut q, mut k, v) = (l.wq.apply(&h), l.wk.apply(&h), l.wv.apply(&h));
        rope(&mut q, hd, c.rope_dims, seq.pos, c.rope_base);
        rope(&mut k, hd, c.rope_dims, seq.pos, c.rope_base);
        seq.keys[li].extend_from_slice(&k);
        seq.values[li].extend_from_slice(&v);
        let (keys, values) = (&seq.keys[li], &seq.values[li]);
        let n_ctx = seq.pos + 1;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0f32; c.n_embd];
        for head in 0..c.n_heads {
            let kv0 = (head / group) * hd;
            let qh = &q[head * hd..(head + 1) * hd];
            let scores: Vec<f64> =
                (0..n_ctx).map(|p| dot(qh, &keys[p * kvd + kv0..p * kvd + kv0 + hd]) * scale).collect();
            let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (i, o) in out[head * hd..(head + 1) * hd].iter_mut().enumerate() {
                let acc: f64 = (0..n_ctx).map(|p| w[p] * values[p * kvd + kv0 + i] as f64).sum();
                *o = (acc / sum) as f32;
            }
        }
        l.wo.apply(&out)
    }
}
