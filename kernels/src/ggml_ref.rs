//! Portable twins of [`crate::ggml_avx2`] and of the AVX2 dot products: the
//! same operations in the same order, lane by lane, so the scalar reference
//! gives bit-identical results to the AVX2 kernels (and so to llama.cpp's
//! AVX2 build) on any CPU. Slow; used where AVX2 is missing and by tests.

/// One lane of GGML's `ggml_v_expf` (AVX2 form).
pub fn expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000);
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r);
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x35BF_BE8E), (-n).mul_add(f32::from_bits(0x3F31_7200), x));
    let e = z.to_bits().wrapping_shl(23);
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let c = n.abs() > 126.0;
    let u = b * b;
    let j = f32::from_bits(0x3C07_2010)
        .mul_add(b, f32::from_bits(0x3D2B_9F17))
        .mul_add(u, f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB)))
        .mul_add(u, f32::from_bits(0x3F7F_FFF6) * b);
    if !c {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// One lane of GGML's `ggml_v_expf` in its AVX-512 form (the polynomial
/// carries the 1, and `scalef` scales by 2^n with one rounding).
#[inline(always)]
pub fn expf_x16(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000);
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r);
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x35BF_BE8E), (-n).mul_add(f32::from_bits(0x3F31_7200), x));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = f32::from_bits(0x3C07_2010)
        .mul_add(b, f32::from_bits(0x3D2B_9F17))
        .mul_add(u, f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB)))
        .mul_add(u, f32::from_bits(0x3F7F_FFF6).mul_add(b, 1.0));
    // j * 2^n, rounded once (exact in f64 before the conversion).
    (j as f64 * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

/// GCC's `_mm512_reduce_add_ps` of 16 lanes.
#[inline(always)]
pub fn reduce16(x: &[f32]) -> f32 {
    let t3: [f32; 8] = std::array::from_fn(|i| x[8 + i] + x[i]);
    let t6: [f32; 4] = std::array::from_fn(|i| t3[4 + i] + t3[i]);
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// tinyBLAS's / GGML's `hsum` of 8 lanes.
pub fn hsum8(l: [f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `ggml_vec_dot_f16`'s reduction of four 8-lane accumulators.
pub fn reduce4(acc: [[f32; 8]; 4]) -> f32 {
    let x: [f32; 8] = std::array::from_fn(|k| (acc[0][k] + acc[2][k]) + (acc[1][k] + acc[3][k]));
    let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
    (t[0] + t[1]) + (t[2] + t[3])
}

/// Twin of [`crate::ggml_avx2::dot_chain`].
pub fn dot_chain(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] = ca[k].mul_add(cb[k], acc[k]);
        }
    }
    hsum8(acc)
}

/// `ggml_vec_dot_f16` as an AVX-512 build of GGML computes it (16 lanes,
/// four accumulators, then `GGML_F32x16_REDUCE` and GCC's
/// `_mm512_reduce_add_ps`); `a.len()` a multiple of 64.
pub fn dot_vec4_x16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    for (ca, cb) in a.chunks_exact(64).zip(b.chunks_exact(64)) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for k in 0..16 {
                acc[k] = ca[16 * j + k].mul_add(cb[16 * j + k], acc[k]);
            }
        }
    }
    let x: [f32; 16] = std::array::from_fn(|k| (acc[0][k] + acc[2][k]) + (acc[1][k] + acc[3][k]));
    reduce16(&x)
}

/// Twin of [`crate::ggml_avx2::dot_vec4`].
pub fn dot_vec4(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    for (ca, cb) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for k in 0..8 {
                acc[k] = ca[8 * j + k].mul_add(cb[8 * j + k], acc[k]);
            }
        }
    }
    reduce4(acc)
}

/// Twin of [`crate::ggml_avx2::softmax`] (`x.len()` a multiple of 8).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for c in x.chunks_exact_mut(8) {
        for v in c.iter_mut() {
            *v = expf(*v - max);
        }
        sum += hsum8(c.try_into().expect("8 lanes")) as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Twin of [`crate::ggml_avx2::silu_mul`].
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let whole = gate.len() / 8 * 8;
    for (g, u) in gate[..whole].iter_mut().zip(up) {
        *g = *g / (1.0 + expf(0.0 - *g)) * u;
    }
    for (g, u) in gate[whole..].iter_mut().zip(&up[whole..]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Sum of `w[e] * y[e]` over the 4 elements of each of the 8 i32 lanes that
/// `maddubs` + `madd` produce from one 32-value block.
#[inline]
pub fn lane_sums(w: impl Fn(usize) -> i32, y: &[i8; 32]) -> [i32; 8] {
    std::array::from_fn(|m| (4 * m..4 * m + 4).map(|e| w(e) * y[e] as i32).sum())
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::ggml_avx2 as v;
    use crate::rng::Rng;
    use std::arch::x86_64::*;

    fn avx2() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    #[test]
    fn dot_vec4_x16_avx2_is_its_scalar_twin() {
        if !crate::Backend::Avx2.runs_here() {
            eprintln!("SKIPPED: no AVX2 here");
            return;
        }
        let mut rng = crate::rng::Rng::new(77);
        for n in [64usize, 256, 512] {
            let (a, b) = (rng.normal_vec(n), rng.normal_vec(n));
            // SAFETY: AVX2 and FMA checked above; lengths are multiples of 64.
            let v = unsafe { crate::ggml_avx2::dot_vec4_x16(&a, &b) };
            assert_eq!(v.to_bits(), super::dot_vec4_x16(&a, &b).to_bits(), "n={n}");
        }
    }

    #[test]
    fn scalar_twins_are_bit_identical_to_avx2() {
        if !avx2() {
            eprintln!("SKIPPED: no AVX2/FMA on this CPU to compare against");
            return;
        }
        let mut rng = Rng::new(99);
        let xs: Vec<f32> = (0..4096).map(|i| -100.0 + i as f32 * 0.05).chain([f32::NEG_INFINITY; 8]).collect();
        for c in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v::expf8(_mm256_loadu_ps(c.as_ptr()))) };
            for (x, y) in c.iter().zip(out) {
                assert_eq!(expf(*x).to_bits(), y.to_bits(), "expf({x})");
            }
        }
        for n in [32usize, 64, 96, 256] {
            let a = rng.normal_vec(n);
            let b = rng.normal_vec(n);
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            assert_eq!(dot_chain(&a, &b).to_bits(), unsafe { v::dot_chain(&a, &b) }.to_bits());
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            assert_eq!(dot_vec4(&a, &b).to_bits(), unsafe { v::dot_vec4(&a, &b) }.to_bits());
            let mut s1: Vec<f32> = a.iter().map(|x| x * 3.0).collect();
            s1[n - 3..].fill(f32::NEG_INFINITY);
            let mut s2 = s1.clone();
            softmax(&mut s1);
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            unsafe { v::softmax(&mut s2) };
            assert_eq!(s1, s2);
            let mut g1 = a.clone();
            g1.extend([0.5, -1.5, 2.0]);
            let mut u = b.clone();
            u.extend([1.0, 2.0, 3.0]);
            let mut g2 = g1.clone();
            silu_mul(&mut g1, &u);
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            unsafe { v::silu_mul(&mut g2, &u) };
            assert_eq!(g1, g2);
        }
    }
}
