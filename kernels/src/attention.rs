//! Scaled dot-product attention for one query position against a run of
//! cached keys and values (grouped-query: several query heads share one KV
//! head). The paged cache is gathered by the caller once per (sequence,
//! layer, KV head) and reused by every query position and query head of the
//! group: keys as rows `[position][dim]`, values transposed `[dim][position]`
//! so both products run along contiguous memory, as llama.cpp's do.

use crate::dot::Backend;
#[cfg(target_arch = "x86_64")]
use crate::ggml_avx2;
use crate::ggml_ref;
use crate::quant::round_f16;

/// Positions of transposed values are padded to a multiple of this (with
/// zeros), the unit of llama.cpp's f16 dot product.
pub const VALUE_PAD: usize = 32;

/// Summation order of the attention dot products, following llama.cpp:
/// a step with several query tokens of a sequence goes through tinyBLAS
/// (`Gemm`), a single token through `ggml_vec_dot_f16` (`VecDot`). Only the
/// last bits of the result differ; matching them keeps greedy decoding on
/// llama.cpp's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SumOrder {
    Gemm,
    VecDot,
}

/// Gathered keys and values of one KV head.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// `[position][head_dim]`, at least `n_kv` rows.
    pub keys: &'a [f32],
    /// `[head_dim][stride]`; `stride` is a multiple of [`VALUE_PAD`] and
    /// positions from `n_kv` to `stride` hold zeros.
    pub values_t: &'a [f32],
    pub stride: usize,
    pub head_dim: usize,
}

/// `q` and `out` hold `group` heads of `head_dim` values; positions
/// `0..n_kv` of `kv` are visible.
pub fn attend_group(
    be: Backend,
    q: &[f32],
    kv: KvView<'_>,
    n_kv: usize,
    scale: f32,
    order: SumOrder,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (hd, stride) = (kv.head_dim, kv.stride);
    assert!(n_kv > 0, "attention over an empty context");
    assert!(n_kv <= stride && stride % VALUE_PAD == 0, "value stride must cover n_kv and be a multiple of {VALUE_PAD}");
    assert!(kv.keys.len() >= n_kv * hd && kv.values_t.len() >= hd * stride);
    assert_eq!(q.len(), out.len());
    let mut qh16 = [0f32; 256];
    assert!(hd <= qh16.len() && hd % 32 == 0, "head_dim must be a multiple of 32, at most 256");
    // llama.cpp's non-flash path multiplies the f16 cache by the query and
    // the probabilities rounded to f16; round the same way.
    let qr = &mut qh16[..hd];
    for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        qr.iter_mut().zip(qh).for_each(|(r, v)| *r = round_f16(*v));
        // Masked positions are -inf, so they come out of the softmax as 0.
        scores.clear();
        scores.resize(stride, f32::NEG_INFINITY);
        for (j, s) in scores[..n_kv].iter_mut().enumerate() {
            *s = dot_in_order(be, order, &kv.keys[j * hd..(j + 1) * hd], qr) * scale;
        }
        softmax_in_order(be, scores);
        scores.iter_mut().for_each(|p| *p = round_f16(*p));
        for (d, o) in oh.iter_mut().enumerate() {
            *o = dot_in_order(be, order, &kv.values_t[d * stride..(d + 1) * stride], scores);
        }
    }
}

fn dot_in_order(be: Backend, order: SumOrder, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: an AVX2 backend means AVX2+FMA; lengths are multiples of 32.
        return unsafe {
            match order {
                SumOrder::Gemm => ggml_avx2::dot_chain(a, b),
                SumOrder::VecDot => ggml_avx2::dot_vec4(a, b),
            }
        };
    }
    let _ = be;
    match order {
        SumOrder::Gemm => ggml_ref::dot_chain(a, b),
        SumOrder::VecDot => ggml_ref::dot_vec4(a, b),
    }
}

fn softmax_in_order(be: Backend, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: an AVX2 backend means AVX2+FMA; x.len() is a multiple of 32.
        return unsafe { ggml_avx2::softmax(x) };
    }
    let _ = be;
    ggml_ref::softmax(x)
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
        let stride = n.next_multiple_of(VALUE_PAD);
        let mut vt = vec![0f32; hd * stride];
        for j in 0..n {
            for d in 0..hd {
                vt[d * stride + j] = v[j * hd + d];
            }
        }
        let kv = KvView { keys: &k, values_t: &vt, stride, head_dim: hd };
        let scale = 1.0 / (hd as f32).sqrt();
        for be in [Backend::Scalar, Backend::detect()] {
            for order in [SumOrder::Gemm, SumOrder::VecDot] {
                let mut out = vec![f32::NAN; group * hd];
                let mut scratch = Vec::new();
                attend_group(be, &q, kv, n, scale, order, &mut scratch, &mut out);
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
                        // f16 rounding of q and of the probabilities.
                        assert!((want - got).abs() < 1e-2, "{be:?} {order:?} h={h} d={d}: {want} vs {got}");
                    }
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
