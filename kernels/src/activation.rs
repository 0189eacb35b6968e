//! Element-wise activations.

/// SwiGLU with the backend's implementation (AVX2: GGML's exact arithmetic).
pub fn silu_mul_be(be: crate::Backend, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: AVX2 backends are only chosen when AVX2 and FMA are present.
        return unsafe { crate::ggml_avx2::silu_mul(gate, up) };
    }
    let _ = be;
    crate::ggml_ref::silu_mul(gate, up)
}

/// SwiGLU: `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax of `x`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = vec![1.0, 2.0, 3.0, -50.0];
        let mut b: Vec<f32> = a.iter().map(|v| v + 1000.0).collect();
        softmax(&mut a);
        softmax(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-6);
        }
        assert!(a[2] > a[1] && a[1] > a[0]);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let mut g = vec![-2.0, 0.0, 3.0];
        silu_mul(&mut g, &[1.0, 5.0, 2.0]);
        assert!((g[0] - (-2.0 / (1.0 + 2f32.exp()))).abs() < 1e-6);
        assert_eq!(g[1], 0.0);
        assert!((g[2] - 2.0 * 3.0 / (1.0 + (-3f32).exp())).abs() < 1e-5);
    }
}
