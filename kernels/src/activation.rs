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

/// GGML's tanh-approximated GELU of one value.
fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044715;
    // GCC contracts GGML's `1.0f + GELU_COEF_A*x*x` into an FMA.
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// GGML's table of GELU over every f16 input, rounded to f16 (the CPU
/// backend's `ggml_table_gelu_f16`), as f32.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX).map(|bits| crate::quant::round_f16(gelu(half::f16::from_bits(bits).to_f32()))).collect()
    })
}

/// GeGLU as GGML's CPU backend computes it: `gate[i] = gelu(gate[i]) *
/// up[i]`, GELU read from the f16 table at the input rounded to f16 (0
/// below -10, the identity above 10).
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    let table = gelu_table();
    for (g, u) in gate.iter_mut().zip(up) {
        *g = if *g <= -10.0 {
            0.0
        } else if *g >= 10.0 {
            *g * u
        } else {
            table[half::f16::from_f32(*g).to_bits() as usize] * u
        };
    }
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
    fn gelu_mul_is_gelu_within_f16_rounding() {
        let xs = [-12.0f32, -3.0, -0.5, 0.0, 0.25, 1.0, 2.5, 11.0];
        let mut g = xs.to_vec();
        gelu_mul(&mut g, &[2.0; 8]);
        for (x, got) in xs.iter().zip(&g) {
            let exact = 2.0 * 0.5 * x * (1.0 + libm_erf_free_gelu(*x));
            assert!((got - exact).abs() <= 2e-3 * exact.abs().max(1.0), "{x}: {got} vs {exact}");
        }
        assert_eq!(g[0], 0.0);
        assert_eq!(g[7], 22.0);
    }

    /// tanh(√(2/π)(x + 0.044715x³)) in f64.
    fn libm_erf_free_gelu(x: f32) -> f32 {
        let x = x as f64;
        ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh() as f32
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
