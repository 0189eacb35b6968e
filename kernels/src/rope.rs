//! Rotary position embedding, GGML "normal" mode: adjacent pairs
//! `(x[2i], x[2i+1])` rotate by `pos * base^(-2i/dims)`. This is the mode
//! llama.cpp uses for the `llama` architecture, whose GGUF converter permutes
//! the Q and K weights to match it.

/// Rotate every head of one row in place. `row` holds `n_heads * head_dim`
/// values; the first `dims` of each head rotate.
pub fn rope_row(row: &mut [f32], head_dim: usize, dims: usize, pos: usize, base: f32) {
    let theta_scale = base.powf(-2.0 / dims as f32);
    for head in row.chunks_exact_mut(head_dim) {
        // Same recurrence as ggml (theta *= theta_scale) so angles agree.
        let mut theta = pos as f32;
        for i in 0..dims / 2 {
            let (s, c) = theta.sin_cos();
            let x0 = head[2 * i];
            let x1 = head[2 * i + 1];
            // GCC contracts ggml's `x0*c - x1*s` and `x0*s + x1*c` into
            // these FMAs; doing the same keeps q and k bit-identical.
            head[2 * i] = x0.mul_add(c, -(x1 * s));
            head[2 * i + 1] = x0.mul_add(s, x1 * c);
            theta *= theta_scale;
        }
    }
}

/// RoPE in GGML's NEOX mode: `(x[i], x[i + dims/2])` rotate by
/// `pos * base^(-2i/dims)` (Gemma, Qwen and others), the same angles and
/// arithmetic as [`rope_row`] otherwise.
pub fn rope_row_neox(row: &mut [f32], head_dim: usize, dims: usize, pos: usize, base: f32) {
    let theta_scale = base.powf(-2.0 / dims as f32);
    let half = dims / 2;
    for head in row.chunks_exact_mut(head_dim) {
        let mut theta = pos as f32;
        for i in 0..half {
            let (s, c) = theta.sin_cos();
            let x0 = head[i];
            let x1 = head[i + half];
            head[i] = x0.mul_add(c, -(x1 * s));
            head[i + half] = x0.mul_add(s, x1 * c);
            theta *= theta_scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn rotation_keeps_norms_and_relative_angles() {
        let mut rng = Rng::new(9);
        let a = rng.normal_vec(64);
        let b = rng.normal_vec(64);
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
        // q at position p and k at position p-3 score the same for any p.
        let score = |p: usize| {
            let mut q = a.clone();
            let mut k = b.clone();
            rope_row(&mut q, 64, 64, p, 10000.0);
            rope_row(&mut k, 64, 64, p - 3, 10000.0);
            dot(&q, &k)
        };
        assert!((score(3) - score(40)).abs() < 1e-3);
        let mut q = a.clone();
        rope_row(&mut q, 64, 64, 17, 10000.0);
        assert!((dot(&q, &q) - dot(&a, &a)).abs() < 1e-3);
        // NEOX pairs are the normal pairs of a permuted row.
        let perm = |v: &[f32]| -> Vec<f32> { (0..32).flat_map(|i| [v[i], v[i + 32]]).collect() };
        let mut n = a.clone();
        rope_row_neox(&mut n, 64, 64, 23, 10000.0);
        let mut p = perm(&a);
        rope_row(&mut p, 64, 64, 23, 10000.0);
        assert_eq!(perm(&n), p);
        // Position 0 is the identity.
        let mut z = a.clone();
        rope_row(&mut z, 64, 64, 0, 10000.0);
        assert_eq!(z, a);
    }
}
