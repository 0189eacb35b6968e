//! Scaled dot-product attention for one query position against a run of
//! cached keys and values (grouped-query: several query heads share one KV
//! head). The paged cache is gathered into contiguous f32 rows by the caller,
//! once per (sequence, layer, KV head), and reused by every query position
//! and every query head of the group.

use crate::activation::softmax;
use crate::dot::{self, Backend};
use crate::quant::round_f16;

/// `q` and `out` hold `group` heads of `head_dim` values; `keys` and `values`
/// hold `n_kv` rows of `head_dim` (positions `0..n_kv`, all visible).
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    be: Backend,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n_kv: usize,
    head_dim: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    assert!(n_kv > 0, "attention over an empty context");
    assert!(keys.len() >= n_kv * head_dim && values.len() >= n_kv * head_dim);
    assert_eq!(q.len(), out.len());
    scores.resize(n_kv, 0.0);
    let mut qh16 = [0f32; 256];
    assert!(head_dim <= qh16.len(), "head_dim above 256");
    for (qh, oh) in q.chunks_exact(head_dim).zip(out.chunks_exact_mut(head_dim)) {
        // llama.cpp multiplies the f16 cache with the query and the
        // probabilities rounded to f16; round the same way so logits agree.
        let qr = &mut qh16[..head_dim];
        qr.iter_mut().zip(qh).for_each(|(r, v)| *r = round_f16(*v));
        for (j, s) in scores.iter_mut().enumerate() {
            *s = dot::dot_f32(be, qr, &keys[j * head_dim..(j + 1) * head_dim]) * scale;
        }
        softmax(scores);
        scores.iter_mut().for_each(|p| *p = round_f16(*p));
        oh.fill(0.0);
        for (j, p) in scores.iter().enumerate() {
            dot::axpy(be, *p, &values[j * head_dim..(j + 1) * head_dim], oh);
        }
    }
}

/// Convert f16 bit patterns to f32 (hardware F16C where the CPU has it).
pub fn f16_to_f32_slice(src: &[half::f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}

/// Convert f32 to f16 (round to nearest even).
pub fn f32_to_f16_slice(src: &[f32], dst: &mut [half::f16]) {
    use half::slice::HalfFloatSliceExt;
    dst.convert_from_f32_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn matches_naive_attention() {
        let mut rng = Rng::new(21);
        let (group, hd, n) = (3, 64, 23);
        let q = rng.normal_vec(group * hd);
        let k = rng.normal_vec(n * hd);
        let v = rng.normal_vec(n * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        for be in [Backend::Scalar, Backend::detect()] {
            let mut out = vec![f32::NAN; group * hd];
            let mut scratch = Vec::new();
            attend_group(be, &q, &k, &v, n, hd, scale, &mut scratch, &mut out);
            for h in 0..group {
                let s: Vec<f64> = (0..n)
                    .map(|j| (0..hd).map(|d| (q[h * hd + d] * k[j * hd + d]) as f64).sum::<f64>() * scale as f64)
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 = (0..n).map(|j| e[j] / z * v[j * hd + d] as f64).sum();
                    let got = out[h * hd + d] as f64;
                    assert!((want - got).abs() < 1e-2, "{be:?} h={h} d={d}: {want} vs {got}");
                }
            }
        }
    }

    #[test]
    fn f16_roundtrip() {
        let x = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        let mut h = [half::f16::ZERO; 5];
        f32_to_f16_slice(&x, &mut h);
        let mut back = [f32::NAN; 5];
        f16_to_f32_slice(&h, &mut back);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 1e-3);
        }
    }
}
