//! The numerics referee: the same forward pass (llama or gemma3) with every weight
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

    /// `W x`, each output's dot product summed in f64 (rows shared out
    /// over the machine's threads: a 262,144-row output head is most of a
    /// token's work).
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols);
        let mut out = vec![0f32; self.w.len() / self.cols];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = out.len().div_ceil(threads).max(1024);
        std::thread::scope(|s| {
            for (o, w) in out.chunks_mut(per).zip(self.w.chunks(per * self.cols)) {
                s.spawn(move || {
                    o.iter_mut().zip(w.chunks_exact(self.cols)).for_each(|(o, row)| *o = dot(row, x) as f32)
                });
            }
        });
        out
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

/// RoPE, angles in f64: GGML's "normal" mode rotates adjacent pairs
/// (llama), NEOX mode dimension `i` with `i + dims / 2` (gemma3).
fn rope(x: &mut [f32], head_dim: usize, dims: usize, pos: usize, base: f32, neox: bool) {
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..dims / 2 {
            let theta = pos as f64 * (base as f64).powf(-2.0 * i as f64 / dims as f64);
            let (s, c) = theta.sin_cos();
            let (a, b) = if neox { (i, i + dims / 2) } else { (2 * i, 2 * i + 1) };
            let (x0, x1) = (head[a] as f64, head[b] as f64);
            head[a] = (x0 * c - x1 * s) as f32;
            head[b] = (x0 * s + x1 * c) as f32;
        }
    }
}

/// What the two graphs do differently.
#[derive(Clone, Copy)]
struct Graph {
    /// NEOX-mode RoPE, RMS norms on each head of Q and K and after
    /// attention and the feed-forward, a tanh-GELU GLU (gemma3); else
    /// llama's: normal RoPE, SwiGLU, no extra norms.
    gemma: bool,
    /// Factor on the token embeddings.
    embd_scale: Option<f32>,
    /// Factor on the attention scores.
    score_scale: f64,
}

/// The feed-forward's activation of `gate`, times `up`, in f64.
fn glu(gemma: bool, gate: f32, up: f32) -> f32 {
    let (g, u) = (gate as f64, up as f64);
    let act = if gemma {
        // GELU, tanh form (GGML's `gelu`, Gemma's `gelu_pytorch_tanh`).
        0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
    } else {
        g / (1.0 + (-g).exp())
    };
    (act * u) as f32
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
    /// gemma3's extra norms: per head on Q and K, after attention, after the feed-forward.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
}

/// The f32 model (about 4 bytes per weight: ~540 MB for SmolLM2-135M).
pub struct Reference {
    config: crate::config::ModelConfig,
    graph: Graph,
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
    /// and gemma3 graphs).
    pub fn new(model: &Model) -> crate::error::Result<Reference> {
        let (arch, c) = (model.arch(), &model.config);
        let gemma = match arch.name {
            "llama" => false,
            "gemma3" => true,
            other => {
                return Err(crate::error::EngineError::Unsupported(format!(
                    "the f32 referee runs llama and gemma3, not {other}"
                )))
            }
        };
        let score_scale = if gemma { super::gemma3::query_scale(c) as f64 } else { 1.0 / (c.head_dim as f64).sqrt() };
        let graph = Graph { gemma, embd_scale: (arch.embd_scale)(c), score_scale };
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
                q_norm: l.q_norm.clone(),
                k_norm: l.k_norm.clone(),
                post_attn_norm: l.post_attn_norm.clone(),
                post_ffn_norm: l.post_ffn_norm.clone(),
            })
            .collect();
        Ok(Reference {
            config: model.config.clone(),
            graph,
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
        if let Some(f) = self.graph.embd_scale {
            x.iter_mut().for_each(|v| *v = (*v as f64 * f as f64) as f32);
        }
        let post = |v: Vec<f32>, w: &Option<Vec<f32>>| match w {
            Some(w) => rms_norm(&v, w, c.rms_eps),
            None => v,
        };
        for (li, l) in self.layers.iter().enumerate() {
            let att = post(self.attention(seq, li, l, &x), &l.post_attn_norm);
            x.iter_mut().zip(&att).for_each(|(a, b)| *a += b);
            let h = rms_norm(&x, &l.ffn_norm, c.rms_eps);
            let (gate, up) = (l.w_gate.apply(&h), l.w_up.apply(&h));
            let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| glu(self.graph.gemma, *g, *u)).collect();
            let down = post(l.w_down.apply(&act), &l.post_ffn_norm);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            seq.layer_out[li] = x.clone();
        }
        seq.pos += 1;
        let h = rms_norm(&x, &self.output_norm, c.rms_eps);
        self.output.as_ref().unwrap_or(&self.embd).apply(&h)
    }

    /// Norm, projections, (per-head norms,) RoPE, causal GQA attention
    /// over the sequence's f32 cache (this token's key and value appended;
    /// a window layer sees its last `window` positions), output projection.
    fn attention(&self, seq: &mut RefSequence, li: usize, l: &RefLayer, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let (hd, kvd, group) = (c.head_dim, c.kv_dim(), c.group());
        let (base, window) = (c.layers[li].rope_base, c.layers[li].window);
        let h = rms_norm(x, &l.attn_norm, c.rms_eps);
        let (mut q, mut k, v) = (l.wq.apply(&h), l.wk.apply(&h), l.wv.apply(&h));
        let head_norm = |v: Vec<f32>, w: &Option<Vec<f32>>| match w {
            Some(w) => v.chunks_exact(hd).flat_map(|head| rms_norm(head, w, c.rms_eps)).collect(),
            None => v,
        };
        (q, k) = (head_norm(q, &l.q_norm), head_norm(k, &l.k_norm));
        rope(&mut q, hd, c.rope_dims, seq.pos, base, self.graph.gemma);
        rope(&mut k, hd, c.rope_dims, seq.pos, base, self.graph.gemma);
        seq.keys[li].extend_from_slice(&k);
        seq.values[li].extend_from_slice(&v);
        let (keys, values) = (&seq.keys[li], &seq.values[li]);
        let n_ctx = seq.pos + 1;
        let seen = window.map_or(0, |w| n_ctx.saturating_sub(w))..n_ctx;
        let mut out = vec![0f32; c.q_dim()];
        for head in 0..c.n_heads {
            let kv0 = (head / group) * hd;
            let qh = &q[head * hd..(head + 1) * hd];
            let scores: Vec<f64> = seen
                .clone()
                .map(|p| dot(qh, &keys[p * kvd + kv0..p * kvd + kv0 + hd]) * self.graph.score_scale)
                .collect();
            let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (i, o) in out[head * hd..(head + 1) * hd].iter_mut().enumerate() {
                let acc: f64 = seen.clone().zip(&w).map(|(p, w)| w * values[p * kvd + kv0 + i] as f64).sum();
                *o = (acc / sum) as f32;
            }
        }
        l.wo.apply(&out)
    }
}
