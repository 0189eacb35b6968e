//! AVX2 routines that reproduce llama.cpp's CPU arithmetic operation for
//! operation: GGML's `ggml_v_expf`, its softmax and SwiGLU, and the
//! summation orders of tinyBLAS and `ggml_vec_dot_f16`. With them a forward
//! pass matches llama.cpp's
//! (AVX2 build) bit for bit, so greedy decoding does not drift apart at
//! near-ties. Each has a plain twin in this crate; tests compare them.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

/// GGML's `ggml_v_expf` for 8 lanes (max error ~1.5 ULP).
#[inline]
#[target_feature(enable = "avx2,fma")]
///
/// # Safety
/// The CPU must support AVX2 and FMA.
pub unsafe fn expf8(x: __m256) -> __m256 {
    let r = _mm256_set1_ps(f32::from_bits(0x4B40_0000)); // 0x1.8p23
    let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3FB8_AA3B)), r); // 0x1.715476p+0
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(
        n,
        _mm256_set1_ps(f32::from_bits(0x35BF_BE8E)), // 0x1.7f7d1cp-20
        _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3F31_7200)), x), // 0x1.62e4p-1
    );
    let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0))));
    let c = _mm256_castps_si256(_mm256_cmp_ps(
        _mm256_andnot_ps(_mm256_set1_ps(-0.0), n),
        _mm256_set1_ps(126.0),
        _CMP_GT_OQ,
    ));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_set1_ps(f32::from_bits(0x3C07_2010)),
                b,
                _mm256_set1_ps(f32::from_bits(0x3D2B_9F17)),
            ), // 0x1.0e4020p-7, 0x1.573e2ep-5
            u,
            _mm256_fmadd_ps(
                _mm256_set1_ps(f32::from_bits(0x3E2A_AF33)),
                b,
                _mm256_set1_ps(f32::from_bits(0x3EFF_FEDB)),
            ), // 0x1.555e66p-3, 0x1.fffdb6p-2
        ),
        u,
        _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(0x3F7F_FFF6)), b), // 0x1.ffffecp-1
    );
    if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
        return _mm256_fmadd_ps(j, k, k);
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let d = _mm256_castps_si256(_mm256_cmp_ps(
        _mm256_andnot_ps(_mm256_set1_ps(-0.0), n),
        _mm256_set1_ps(192.0),
        _CMP_GT_OQ,
    ));
    _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(
            _mm256_castsi256_ps(d),
            _mm256_or_ps(
                _mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)),
            ),
        ),
    )
}

/// tinyBLAS's / GGML's horizontal sum order.
#[inline]
#[target_feature(enable = "avx2,fma")]
///
/// # Safety
/// The CPU must support AVX2 and FMA.
pub unsafe fn hsum(x: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `Σ a·b` as tinyBLAS computes one output: one 8-lane FMA chain, then
/// [`hsum`]. `a.len()` must be a multiple of 8.
#[target_feature(enable = "avx2,fma")]
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a.len()` must be a multiple of 8 and `b` at least as long.
pub unsafe fn dot_chain(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for l in (0..a.len()).step_by(8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(l)), _mm256_loadu_ps(b.as_ptr().add(l)), acc);
    }
    hsum(acc)
}

/// GGML's AVX2 `ggml_vec_dot_f16` reduction of four 8-lane accumulators
/// (`(a0+a2) + (a1+a3)`, then the 8 lanes pairwise with `hadd`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce4(acc: [__m256; 4]) -> f32 {
    let x0 = _mm256_add_ps(acc[0], acc[2]);
    let x1 = _mm256_add_ps(acc[1], acc[3]);
    let x0 = _mm256_add_ps(x0, x1);
    let t0 = _mm_add_ps(_mm256_castps256_ps128(x0), _mm256_extractf128_ps(x0, 1));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

/// `Σ a·b` as GGML's `ggml_vec_dot_f16` computes it (the path llama.cpp
/// takes for a single query token): four 8-lane FMA chains over 32-value
/// steps, then [`reduce4`]. `a.len()` must be a multiple of 32.
#[target_feature(enable = "avx2,fma")]
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a.len()` must be a multiple of 32 and `b` at least as long.
pub unsafe fn dot_vec4(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in (0..a.len()).step_by(32) {
        for (j, acc) in acc.iter_mut().enumerate() {
            let o = i + 8 * j;
            *acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(o)), _mm256_loadu_ps(b.as_ptr().add(o)), *acc);
        }
    }
    reduce4(acc)
}

/// [`crate::ggml_ref::dot_vec4_x16`] (an AVX-512 build's
/// `ggml_vec_dot_f16`) with each 16-lane accumulator held in two AVX2
/// registers: the same sums in the same order.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a.len()` must be a multiple of 64 and `b` at least as long.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_vec4_x16(a: &[f32], b: &[f32]) -> f32 {
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    for i in (0..a.len()).step_by(64) {
        for j in 0..4 {
            let o = i + 16 * j;
            lo[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(o)), _mm256_loadu_ps(b.as_ptr().add(o)), lo[j]);
            hi[j] =
                _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(o + 8)), _mm256_loadu_ps(b.as_ptr().add(o + 8)), hi[j]);
        }
    }
    let x_lo = _mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3]));
    let x_hi = _mm256_add_ps(_mm256_add_ps(hi[0], hi[2]), _mm256_add_ps(hi[1], hi[3]));
    let t3 = _mm256_add_ps(x_hi, x_lo);
    let t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    let t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)))
}

/// GGML's softmax of `x` (already scaled) in place: `ggml_v_expf` in groups
/// of 8 (`x.len()` a multiple of 8; pad with `-inf`), group sums added in
/// f64, then multiplied by `(f32)(1.0 / sum)`.
#[target_feature(enable = "avx2,fma")]
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x.len()` must be a multiple of 8.
pub unsafe fn softmax(x: &mut [f32]) {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    let m = _mm256_set1_ps(max);
    for i in (0..x.len()).step_by(8) {
        let p = x.as_mut_ptr().add(i);
        let v = expf8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
        _mm256_storeu_ps(p, v);
        sum += hsum(v) as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// GGML's `ggml_vec_swiglu_f32`: `gate = gate / (1 + exp(-gate)) * up`.
#[target_feature(enable = "avx2,fma")]
///
/// # Safety
/// The CPU must support AVX2 and FMA; `up` must be at least as long as `gate`.
pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len();
    let mut i = 0;
    while i + 8 <= n {
        let p = gate.as_mut_ptr().add(i);
        let x = _mm256_loadu_ps(p);
        let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_storeu_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
        i += 8;
    }
    while i < n {
        gate[i] = gate[i] / (1.0 + (-gate[i]).exp()) * up[i];
        i += 1;
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::rng::Rng;

    fn avx2() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    #[test]
    fn expf8_is_within_two_ulp_of_expf() {
        if !avx2() {
            eprintln!("SKIPPED: no AVX2/FMA on this CPU");
            return;
        }
        let xs: Vec<f32> = (0..4000).map(|i| -80.0 + i as f32 * 0.0413).collect();
        for c in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), expf8(_mm256_loadu_ps(c.as_ptr()))) };
            for (x, y) in c.iter().zip(out) {
                let want = x.exp();
                assert!((want - y).abs() <= want * 3e-7 + 1e-37, "exp({x}) = {want}, got {y}");
            }
        }
        let mut out = [1f32; 8];
        // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), expf8(_mm256_set1_ps(f32::NEG_INFINITY))) };
        assert_eq!(out, [0.0; 8]);
    }

    #[test]
    fn ggml_order_routines_match_plain_math() {
        if !avx2() {
            eprintln!("SKIPPED: no AVX2/FMA on this CPU");
            return;
        }
        let mut rng = Rng::new(77);
        let a = rng.normal_vec(64);
        let b = rng.normal_vec(64);
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
        assert!((unsafe { dot_chain(&a, &b) } - plain).abs() < 1e-4);
        // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
        assert!((unsafe { dot_vec4(&a, &b) } - plain).abs() < 1e-4);

        let mut s = rng.normal_vec(24);
        s.extend([f32::NEG_INFINITY; 8]);
        // The definitions, written out (activation.rs, above this module, has them too).
        let max = s[..24].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s[..24].iter().map(|v| (v - max).exp()).collect();
        let plain_sm: Vec<f32> = e.iter().map(|v| v / e.iter().sum::<f32>()).collect();
        // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
        unsafe { softmax(&mut s) };
        for (x, y) in s.iter().zip(&plain_sm[..24]) {
            assert!((x - y).abs() < 1e-6);
        }
        assert!(s[24..].iter().all(|v| *v == 0.0));

        let mut g = rng.normal_vec(21);
        let u = rng.normal_vec(21);
        let g2: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
        unsafe { silu_mul(&mut g, &u) };
        for (x, y) in g.iter().zip(&g2) {
            assert!((x - y).abs() < 1e-5);
        }
    }
}
