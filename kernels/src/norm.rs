//! RMSNorm, as llama.cpp computes it (sum of squares in f64).

/// `out = x / sqrt(mean(x²) + eps) * weight`, for each row of `x`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % d, 0);
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        // Squares in f32, summed in f64, as ggml does.
        let ss: f64 = xr.iter().map(|v| (v * v) as f64).sum();
        let scale = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn normalised_rows_have_unit_rms_before_weighting() {
        let mut rng = Rng::new(5);
        let d = 64;
        let x: Vec<f32> = rng.normal_vec(3 * d).iter().map(|v| v * 7.0 + 1.0).collect();
        let w = vec![1.0; d];
        let mut out = vec![f32::NAN; 3 * d];
        rms_norm(&x, &w, 1e-6, &mut out);
        for r in out.chunks(d) {
            let rms = (r.iter().map(|v| v * v).sum::<f32>() / d as f32).sqrt();
            assert!((rms - 1.0).abs() < 1e-3, "{rms}");
        }
        let w2: Vec<f32> = (0..d).map(|i| i as f32 / 10.0).collect();
        let mut out2 = vec![f32::NAN; 3 * d];
        rms_norm(&x, &w2, 1e-6, &mut out2);
        assert!((out2[5] - out[5] * 0.5).abs() < 1e-5);
    }
}
