//! Dot products of K-quant and 5-bit weight rows with quantized
//! activations: K-quants against [`BlockQ8K`] (256 values a block), Q5_0
//! and Q5_1 against [`BlockQ8`] (32), as GGML pairs them.
//!
//! As in [`crate::dot`], every function takes one weight row and `N`
//! activation rows, so a row's result is the same alone or batched. The
//! scalar functions are lane-by-lane twins of the AVX2 ones (the integer
//! lanes, then one FMA chain per lane in block order, the reduction of
//! GGML's `hsum_float_8`), so the two give the same bits; the AVX2 ones
//! follow GGML's `ggml_vec_dot_q4_K_q8_K`, `..._q6_K_q8_K` and
//! `..._q5_0_q8_0`. Q2_K, Q3_K, Q5_K and Q5_1 have only the scalar path.

use crate::ggml_ref::{hsum8, lane_sums};
use crate::kquant::*;
use crate::quant::{f16_to_f32, BlockQ8};

pub mod scalar {
    use super::*;

    /// One Q4_K block against one Q8_K block in whole integers, for each
    /// 64-value pair of sub-blocks: the scaled sum of products, and the
    /// mins against the 16-value sums.
    fn q4k_pair_ints(b: &BlockQ4K, y: &BlockQ8K) -> [(i32, i32); 4] {
        std::array::from_fn(|j| {
            let q = &b.qs[j * 32..(j + 1) * 32];
            let (s1, m1) = scale_min_k4(2 * j, &b.scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, &b.scales);
            let (lo, hi): (i32, i32) = (0..32)
                .map(|l| {
                    ((q[l] & 0xF) as i32 * y.qs[j * 64 + l] as i32, (q[l] >> 4) as i32 * y.qs[j * 64 + 32 + l] as i32)
                })
                .fold((0, 0), |(a, b), (x, z)| (a + x, b + z));
            let sumi = s1 as i32 * lo + s2 as i32 * hi;
            let summ = m1 as i32 * (y.bsums[4 * j] as i32 + y.bsums[4 * j + 1] as i32)
                + m2 as i32 * (y.bsums[4 * j + 2] as i32 + y.bsums[4 * j + 3] as i32);
            (sumi, summ)
        })
    }

    /// Twin of [`super::avx2::dot_q4_k`]. llama.cpp's x86 build repacks
    /// Q4_K matrices and carries two FMA chains, one for the scales and
    /// one for the mins, subtracted at the end; its 4-row GEMM
    /// (`ggml_gemm_q4_K_8x8_q8_K`, a batch's rows in whole fours) adds to
    /// them per pair of sub-blocks (`PAIRS`), its GEMV (the rows left over)
    /// per block.
    pub fn dot_q4_k<const PAIRS: bool, const N: usize>(w: &[BlockQ4K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        std::array::from_fn(|n| {
            let (mut acc, mut accm) = (0f32, 0f32);
            for (b, y) in w.iter().zip(xs[n]) {
                let (d, dmin) = (f16_to_f32(b.d) * y.d, f16_to_f32(b.dmin) * y.d);
                let pairs = q4k_pair_ints(b, y);
                if PAIRS {
                    for (sumi, summ) in pairs {
                        acc = (sumi as f32).mul_add(d, acc);
                        accm = (summ as f32).mul_add(dmin, accm);
                    }
                } else {
                    let (sumi, summ) = pairs.iter().fold((0, 0), |(a, b), (x, z)| (a + x, b + z));
                    acc = (sumi as f32).mul_add(d, acc);
                    accm = (summ as f32).mul_add(dmin, accm);
                }
            }
            acc - accm
        })
    }

    /// The eight integer lanes of one Q6_K block against one Q8_K block, as
    /// GGML's AVX2 kernel forms them: the unsigned 6-bit values' products
    /// by lane (bytes 4k..4k+4 of each 32), less the offset 32 taken from
    /// the 16-value sums by lane (sub-blocks 2k and 2k+1).
    fn q6k_lanes(b: &BlockQ6K, y: &BlockQ8K) -> [i32; 8] {
        let mut sumi = [0i32; 8];
        for c in 0..8 {
            // 32 values at c * 32: sub-blocks 2c and 2c + 1 (16 each).
            let yq: &[i8; 32] = y.qs[c * 32..(c + 1) * 32].try_into().expect("32 values");
            let lanes = lane_sums(|e| q6k_value(b, c * 32 + e) + 32, yq);
            for k in 0..8 {
                sumi[k] += b.scales[2 * c + k / 4] as i32 * lanes[k];
            }
        }
        for (k, s) in sumi.iter_mut().enumerate() {
            let off =
                y.bsums[2 * k] as i32 * b.scales[2 * k] as i32 + y.bsums[2 * k + 1] as i32 * b.scales[2 * k + 1] as i32;
            *s -= off << 5;
        }
        sumi
    }

    /// Q6_K as llama.cpp's tiled K-quant GEMM computes it
    /// (`ggml-cpu/tiled`, batches of 8 rows or more): each block's integer
    /// sum scaled by the weight's d, then one FMA chain by the
    /// activation's d. The integer sum is the vec_dot's lanes added.
    pub fn dot_q6_k_tiled<const N: usize>(w: &[BlockQ6K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        std::array::from_fn(|n| {
            let mut acc = 0f32;
            for (b, y) in w.iter().zip(xs[n]) {
                let sumi: i32 = q6k_lanes(b, y).iter().sum();
                acc = (sumi as f32 * f16_to_f32(b.d)).mul_add(y.d, acc);
            }
            acc
        })
    }

    /// Twin of [`super::avx2::dot_q6_k`].
    pub fn dot_q6_k<const N: usize>(w: &[BlockQ6K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        std::array::from_fn(|n| {
            let mut acc = [0f32; 8];
            for (b, y) in w.iter().zip(xs[n]) {
                let d = y.d * f16_to_f32(b.d);
                let sumi = q6k_lanes(b, y);
                for k in 0..8 {
                    acc[k] = d.mul_add(sumi[k] as f32, acc[k]);
                }
            }
            hsum8(acc)
        })
    }

    /// Twin of [`super::avx2::dot_q5_0`].
    pub fn dot_q5_0<const N: usize>(w: &[BlockQ5_0], xs: [&[BlockQ8]; N]) -> [f32; N] {
        std::array::from_fn(|n| {
            let mut acc = [0f32; 8];
            for (b, y) in w.iter().zip(xs[n]) {
                let lanes = lane_sums(|e| q5_value(&b.qs, b.qh, e) - 16, &y.qs);
                let d = f16_to_f32(b.d) * y.d;
                for k in 0..8 {
                    acc[k] = d.mul_add(lanes[k] as f32, acc[k]);
                }
            }
            hsum8(acc)
        })
    }

    /// Q5_1 against 8-bit activations (`m * y.s` for the offset, as Q4_1).
    pub fn dot_q5_1<const N: usize>(w: &[BlockQ5_1], xs: [&[BlockQ8]; N]) -> [f32; N] {
        std::array::from_fn(|n| {
            let (mut acc, mut summs) = ([0f32; 8], 0f32);
            for (b, y) in w.iter().zip(xs[n]) {
                let lanes = lane_sums(|e| q5_value(&b.qs, b.qh, e), &y.qs);
                let d = f16_to_f32(b.d) * y.d;
                for k in 0..8 {
                    acc[k] = d.mul_add(lanes[k] as f32, acc[k]);
                }
                summs += f16_to_f32(b.m) * y.s;
            }
            hsum8(acc) + summs
        })
    }

    /// A K-quant block's dot product from its per-16-value integer sums:
    /// `d * Σ sc_j q·y - dmin * Σ m_j bsum_j`, blocks summed in order.
    fn k_dot<B, const N: usize>(
        w: &[B],
        xs: [&[BlockQ8K]; N],
        scales: impl Fn(&B, &BlockQ8K) -> (f32, f32, i32, i32),
    ) -> [f32; N] {
        std::array::from_fn(|n| {
            let mut sum = 0f32;
            for (b, y) in w.iter().zip(xs[n]) {
                let (d, dmin, sumi, summ) = scales(b, y);
                sum += y.d * (d * sumi as f32 - dmin * summ as f32);
            }
            sum
        })
    }

    /// Sum of `value(e) * y[e]` over the 16 values of sub-block `j`.
    fn sub16(y: &BlockQ8K, j: usize, value: impl Fn(usize) -> i32) -> i32 {
        (16 * j..16 * j + 16).map(|e| value(e) * y.qs[e] as i32).sum()
    }

    pub fn dot_q2_k<const N: usize>(w: &[BlockQ2K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        k_dot(w, xs, |b, y| {
            let q = |e: usize| ((b.qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3) as i32;
            let sumi = (0..16).map(|j| (b.scales[j] & 0xF) as i32 * sub16(y, j, q)).sum();
            let summ = (0..16).map(|j| (b.scales[j] >> 4) as i32 * y.bsums[j] as i32).sum();
            (f16_to_f32(b.d), f16_to_f32(b.dmin), sumi, summ)
        })
    }

    pub fn dot_q3_k<const N: usize>(w: &[BlockQ3K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        k_dot(w, xs, |b, y| {
            let sc = q3k_scales(&b.scales);
            let q = |e: usize| {
                let lo = ((b.qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3) as i32;
                let bit = 1u8 << (e / 32);
                lo - if b.hmask[e % 32] & bit != 0 { 0 } else { 4 }
            };
            let sumi = (0..16).map(|j| (sc[j] as i32 - 32) * sub16(y, j, q)).sum();
            (f16_to_f32(b.d), 0.0, sumi, 0)
        })
    }

    pub fn dot_q5_k<const N: usize>(w: &[BlockQ5K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        k_dot(w, xs, |b, y| {
            let q = |e: usize| {
                let (j, l) = (e / 64, e % 32);
                let low = if (e % 64) < 32 { b.qs[j * 32 + l] & 0xF } else { b.qs[j * 32 + l] >> 4 };
                let high = (b.qh[l] >> (e / 32)) & 1;
                (low | (high << 4)) as i32
            };
            let mut sumi = 0;
            let mut summ = 0;
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &b.scales);
                sumi += sc as i32 * (sub16(y, 2 * j, q) + sub16(y, 2 * j + 1, q));
                summ += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
            }
            (f16_to_f32(b.d), f16_to_f32(b.dmin), sumi, summ)
        })
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::ggml_avx2::hsum;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn h2f(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
    }

    /// Q4_K's 8 scales then 8 mins as 16 bytes (GGML's `utmp` shuffle).
    #[inline(always)]
    unsafe fn q4k_scales_mins(s: &[u8; K_SCALE_SIZE]) -> __m128i {
        let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
        let (k1, k2, k3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
        let (u0, u1, u2) = (w(0), w(1), w(2));
        let t3 = ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4);
        let t1 = (u2 & k2) | (((u0 >> 6) & k3) << 4);
        let t2 = u1 & k1;
        let t0 = u0 & k1;
        _mm_set_epi32(t3 as i32, t2 as i32, t1 as i32, t0 as i32)
    }

    /// Sum of the eight i32 lanes (exact).
    #[inline(always)]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)))
    }

    /// One Q4_K row against `N` Q8_K rows, in the order of llama.cpp's
    /// repacked Q4_K products (see [`super::scalar::dot_q4_k`]).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every `xs[n]` at least as long as `w`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k<const PAIRS: bool, const N: usize>(w: &[BlockQ4K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        if N == 4 {
            let v = dot_q4_k_x4::<PAIRS>(w, std::array::from_fn(|n| xs[n]));
            return std::array::from_fn(|n| v[n]);
        }
        let m4 = _mm256_set1_epi8(0xF);
        let mut acc = [0f32; N];
        let mut accm = [0f32; N];
        // Broadcast of scale j as 16-bit pairs.
        let shuffle: [__m256i; 8] =
            std::array::from_fn(|j| _mm256_set1_epi16((2 * j as i16) | ((2 * j as i16 + 1) << 8)));
        for (i, b) in w.iter().enumerate() {
            let ms = _mm256_cvtepu8_epi16(q4k_scales_mins(&b.scales));
            let mins = _mm256_extracti128_si256(ms, 1);
            let sc128 = _mm256_castsi256_si128(ms);
            let scales = _mm256_set_m128i(sc128, sc128);
            let sl: [__m256i; 8] = std::array::from_fn(|j| _mm256_shuffle_epi8(scales, shuffle[j]));
            let mut ql = [_mm256_setzero_si256(); 4];
            let mut qh = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let bits = _mm256_loadu_si256(b.qs.as_ptr().add(32 * j) as *const __m256i);
                ql[j] = _mm256_and_si256(bits, m4);
                qh[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            }
            let (xd, xdmin) = (h2f(b.d), h2f(b.dmin));
            for n in 0..N {
                let y = xs[n].get_unchecked(i);
                let q8sums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1));
                // Lane j: the mins of sub-block pair j against its sums.
                let prod = _mm_madd_epi16(mins, q8s);
                let mut pm = [0i32; 4];
                _mm_storeu_si128(pm.as_mut_ptr() as *mut __m128i, prod);
                let (d, dmin) = (xd * y.d, xdmin * y.d);
                let p: [__m256i; 4] = std::array::from_fn(|j| {
                    let q8l = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j) as *const __m256i);
                    let q8h = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j + 32) as *const __m256i);
                    let pl = _mm256_madd_epi16(sl[2 * j], _mm256_maddubs_epi16(ql[j], q8l));
                    let ph = _mm256_madd_epi16(sl[2 * j + 1], _mm256_maddubs_epi16(qh[j], q8h));
                    _mm256_add_epi32(pl, ph)
                });
                if PAIRS {
                    // The four pairs' sums at once (exact integers), then
                    // the FMA chains in pair order.
                    let t = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                    let sums = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                    let mut pair = [0i32; 4];
                    _mm_storeu_si128(pair.as_mut_ptr() as *mut __m128i, sums);
                    for j in 0..4 {
                        acc[n] = (pair[j] as f32).mul_add(d, acc[n]);
                        accm[n] = (pm[j] as f32).mul_add(dmin, accm[n]);
                    }
                } else {
                    let all = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
                    acc[n] = (hsum_i32(all) as f32).mul_add(d, acc[n]);
                    accm[n] = (pm.iter().sum::<i32>() as f32).mul_add(dmin, accm[n]);
                }
            }
        }
        std::array::from_fn(|n| acc[n] - accm[n])
    }

    /// [`dot_q4_k`] against four Q8_K rows with the float work of the four
    /// done at once: each lane of a 128-bit register is one column's FMA
    /// chain, with the same operands in the same order as there (the
    /// integer sums are exact whichever way they are added up).
    ///
    /// # Safety
    /// As [`dot_q4_k`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4_k_x4<const PAIRS: bool>(w: &[BlockQ4K], xs: [&[BlockQ8K]; 4]) -> [f32; 4] {
        let m4 = _mm256_set1_epi8(0xF);
        let (mut acc, mut accm) = (_mm_setzero_ps(), _mm_setzero_ps());
        let shuffle: [__m256i; 8] =
            std::array::from_fn(|j| _mm256_set1_epi16((2 * j as i16) | ((2 * j as i16 + 1) << 8)));
        for (i, b) in w.iter().enumerate() {
            let ys: [&BlockQ8K; 4] = std::array::from_fn(|n| xs[n].get_unchecked(i));
            let ms = _mm256_cvtepu8_epi16(q4k_scales_mins(&b.scales));
            let mins = _mm256_extracti128_si256(ms, 1);
            let sc128 = _mm256_castsi256_si128(ms);
            let scales = _mm256_set_m128i(sc128, sc128);
            let yd = _mm_setr_ps(ys[0].d, ys[1].d, ys[2].d, ys[3].d);
            let d = _mm_mul_ps(_mm_set1_ps(h2f(b.d)), yd);
            let dmin = _mm_mul_ps(_mm_set1_ps(h2f(b.dmin)), yd);
            // pm[n] lane j: the mins of sub-block pair j against column n's sums.
            let pm: [__m128i; 4] = std::array::from_fn(|n| {
                let q8sums = _mm256_loadu_si256(ys[n].bsums.as_ptr() as *const __m256i);
                let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1));
                _mm_madd_epi16(mins, q8s)
            });
            // Transposed: pmt[j] lane n.
            let (a, c) = (_mm_unpacklo_epi32(pm[0], pm[1]), _mm_unpacklo_epi32(pm[2], pm[3]));
            let (e, f) = (_mm_unpackhi_epi32(pm[0], pm[1]), _mm_unpackhi_epi32(pm[2], pm[3]));
            let pmt = [
                _mm_unpacklo_epi64(a, c),
                _mm_unpackhi_epi64(a, c),
                _mm_unpacklo_epi64(e, f),
                _mm_unpackhi_epi64(e, f),
            ];
            // Lane n of the result: the sum of column n's eight lanes.
            let lanes4 = |p: [__m256i; 4]| {
                let t = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1))
            };
            let mut all = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let bits = _mm256_loadu_si256(b.qs.as_ptr().add(32 * j) as *const __m256i);
                let ql = _mm256_and_si256(bits, m4);
                let qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                let (sl, sh) =
                    (_mm256_shuffle_epi8(scales, shuffle[2 * j]), _mm256_shuffle_epi8(scales, shuffle[2 * j + 1]));
                let p: [__m256i; 4] = std::array::from_fn(|n| {
                    let q8l = _mm256_loadu_si256(ys[n].qs.as_ptr().add(64 * j) as *const __m256i);
                    let q8h = _mm256_loadu_si256(ys[n].qs.as_ptr().add(64 * j + 32) as *const __m256i);
                    let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, q8l));
                    let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, q8h));
                    _mm256_add_epi32(pl, ph)
                });
                if PAIRS {
                    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(lanes4(p)), d, acc);
                    accm = _mm_fmadd_ps(_mm_cvtepi32_ps(pmt[j]), dmin, accm);
                } else {
                    for n in 0..4 {
                        all[n] = _mm256_add_epi32(all[n], p[n]);
                    }
                }
            }
            if !PAIRS {
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(lanes4(all)), d, acc);
                let pms = _mm_add_epi32(_mm_add_epi32(pmt[0], pmt[1]), _mm_add_epi32(pmt[2], pmt[3]));
                accm = _mm_fmadd_ps(_mm_cvtepi32_ps(pms), dmin, accm);
            }
        }
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, accm));
        out
    }

    /// One Q6_K row against `N` Q8_K rows (GGML's `ggml_vec_dot_q6_K_q8_K`,
    /// which takes the offset 32 out through the 16-value sums).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every `xs[n]` at least as long as `w`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k<const N: usize>(w: &[BlockQ6K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        dot_q6_k_as::<false, N>(w, xs)
    }

    /// One Q6_K row against `N` Q8_K rows in the order of llama.cpp's tiled
    /// GEMM (twin of [`super::scalar::dot_q6_k_tiled`]).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every `xs[n]` at least as long as `w`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k_tiled<const N: usize>(w: &[BlockQ6K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        dot_q6_k_as::<true, N>(w, xs)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q6_k_as<const TILED: bool, const N: usize>(w: &[BlockQ6K], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut tiled = [0f32; N];
        let m4 = _mm256_set1_epi8(0xF);
        let m2 = _mm256_set1_epi8(3);
        let mut acc = [_mm256_setzero_ps(); N];
        for (i, b) in w.iter().enumerate() {
            let scales = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
            let scales_16 = _mm256_cvtepi8_epi16(scales);
            // Eight 32-value groups: unsigned 6-bit values and their scales as i16.
            let mut q = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for j in 0..2 {
                let b1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * j) as *const __m256i);
                let b2 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * j + 32) as *const __m256i);
                let bh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * j) as *const __m256i);
                let h = |s: i32| match s {
                    0 => _mm256_slli_epi16(_mm256_and_si256(bh, m2), 4),
                    2 => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m2), 4),
                    4 => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m2), 4),
                    _ => _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m2), 4),
                };
                q[4 * j] = _mm256_or_si256(_mm256_and_si256(b1, m4), h(0));
                q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m4), h(2));
                q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), h(4));
                q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), h(6));
                for t in 0..4 {
                    let is = (4 * j + t) as i8;
                    let shuf = _mm_setr_epi8(
                        2 * is,
                        2 * is,
                        2 * is,
                        2 * is,
                        2 * is,
                        2 * is,
                        2 * is,
                        2 * is,
                        2 * is + 1,
                        2 * is + 1,
                        2 * is + 1,
                        2 * is + 1,
                        2 * is + 1,
                        2 * is + 1,
                        2 * is + 1,
                        2 * is + 1,
                    );
                    sc[4 * j + t] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuf));
                }
            }
            let xd = h2f(b.d);
            for n in 0..N {
                let y = xs[n].get_unchecked(i);
                let d = y.d * xd;
                let mut sumi = _mm256_setzero_si256();
                for j in 0..2 {
                    let p: [__m256i; 4] = std::array::from_fn(|t| {
                        let g = 4 * j + t;
                        let q8 = _mm256_loadu_si256(y.qs.as_ptr().add(32 * g) as *const __m256i);
                        _mm256_madd_epi16(sc[g], _mm256_maddubs_epi16(q[g], q8))
                    });
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
                }
                // The offset 32, from the 16-value sums (GGML's `q8sclsub`).
                let q8sums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                let sub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
                sumi = _mm256_sub_epi32(sumi, sub);
                if TILED {
                    tiled[n] = (hsum_i32(sumi) as f32 * xd).mul_add(y.d, tiled[n]);
                } else {
                    acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[n]);
                }
            }
        }
        if TILED {
            return tiled;
        }
        acc.map(|a| hsum(a))
    }

    /// One Q5_0 row against `N` 8-bit rows (GGML's `ggml_vec_dot_q5_0_q8_0`).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every `xs[n]` at least as long as `w`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_0<const N: usize>(w: &[BlockQ5_0], xs: [&[BlockQ8]; N]) -> [f32; N] {
        let ones = _mm256_set1_epi16(1);
        let lowmask = _mm256_set1_epi8(0x0F);
        // Byte e of the 32 takes bit e of qh: byte e/8 of the word, bit e%8.
        let spread = _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303);
        let bitmask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfeu64 as i64);
        let f0 = _mm256_set1_epi8(0xF0u8 as i8);
        let mut acc = [_mm256_setzero_ps(); N];
        for (i, b) in w.iter().enumerate() {
            let tmp = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
            let mut qx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp), lowmask);
            // GGML's bytes_from_bits_32: 0xFF where the bit is set.
            let h = _mm256_shuffle_epi8(_mm256_set1_epi32(i32::from_le_bytes(b.qh)), spread);
            let bits = _mm256_cmpeq_epi8(_mm256_or_si256(h, bitmask), _mm256_set1_epi64x(-1));
            qx = _mm256_or_si256(qx, _mm256_andnot_si256(bits, f0));
            let ax = _mm256_sign_epi8(qx, qx);
            let xd = h2f(b.d);
            for n in 0..N {
                let y = xs[n].get_unchecked(i);
                let qy = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(qy, qx)), ones);
                acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(xd * y.d), _mm256_cvtepi32_ps(p), acc[n]);
            }
        }
        acc.map(|a| hsum(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::testutil::random_blocks;

    fn q8k(rng: &mut Rng, nb: usize) -> Vec<BlockQ8K> {
        let mut q = vec![BlockQ8K::default(); nb];
        quantize_q8_k(&rng.normal_vec(nb * QK_K), &mut q);
        q
    }

    fn q8(rng: &mut Rng, nb: usize) -> Vec<BlockQ8> {
        let mut q = vec![BlockQ8::default(); nb];
        crate::quant::quantize_q8(&rng.normal_vec(nb * 32), &mut q);
        q
    }

    /// Every scalar dot product is within rounding of the dot product of
    /// the dequantized weights with the dequantized activations.
    #[test]
    fn scalar_dots_match_the_dequantized_product() {
        let mut rng = Rng::new(31);
        let nb = 3;
        let xk = q8k(&mut rng, nb);
        let xf: Vec<f32> = xk.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect();
        let close = |name: &str, got: f32, w: &[f32], x: &[f32]| {
            let want: f64 = w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = w.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            assert!((got as f64 - want).abs() <= 1e-5 * mag + 1e-6, "{name}: {got} vs {want}");
        };
        let mut wf = vec![0f32; nb * QK_K];
        let w: Vec<BlockQ2K> = random_blocks(&mut rng, nb, &[80, 82]);
        dequantize_q2_k(&w, &mut wf);
        close("q2_k", scalar::dot_q2_k(&w, [&xk])[0], &wf, &xf);
        let w: Vec<BlockQ3K> = random_blocks(&mut rng, nb, &[108]);
        dequantize_q3_k(&w, &mut wf);
        close("q3_k", scalar::dot_q3_k(&w, [&xk])[0], &wf, &xf);
        let w: Vec<BlockQ4K> = random_blocks(&mut rng, nb, &[0, 2]);
        dequantize_q4_k(&w, &mut wf);
        close("q4_k", scalar::dot_q4_k::<false, 1>(&w, [&xk])[0], &wf, &xf);
        let w: Vec<BlockQ5K> = random_blocks(&mut rng, nb, &[0, 2]);
        dequantize_q5_k(&w, &mut wf);
        close("q5_k", scalar::dot_q5_k(&w, [&xk])[0], &wf, &xf);
        let w: Vec<BlockQ6K> = random_blocks(&mut rng, nb, &[208]);
        dequantize_q6_k(&w, &mut wf);
        close("q6_k", scalar::dot_q6_k(&w, [&xk])[0], &wf, &xf);
        let nb = 8;
        let x8 = q8(&mut rng, nb);
        let xf: Vec<f32> = x8.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect();
        let mut wf = vec![0f32; nb * 32];
        let w: Vec<BlockQ5_0> = random_blocks(&mut rng, nb, &[0]);
        dequantize_q5_0(&w, &mut wf);
        close("q5_0", scalar::dot_q5_0(&w, [&x8])[0], &wf, &xf);
        let w: Vec<BlockQ5_1> = random_blocks(&mut rng, nb, &[0, 2]);
        dequantize_q5_1(&w, &mut wf);
        // Q5_1's offset term uses y.s, the f16-rounded d * Σq.
        let off: f32 = w.iter().zip(&x8).map(|(b, y)| f16_to_f32(b.m) * y.s).sum();
        let plain: Vec<f32> =
            w.iter().zip(wf.chunks(32)).flat_map(|(b, c)| c.iter().map(move |v| v - f16_to_f32(b.m))).collect();
        close("q5_1", scalar::dot_q5_1(&w, [&x8])[0] - off, &plain, &xf);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_k_dots_are_bit_identical_to_scalar() {
        if !crate::Backend::Avx2.runs_here() {
            eprintln!("SKIPPED: this CPU has no AVX2/FMA/F16C; only the scalar reference runs");
            return;
        }
        let mut rng = Rng::new(41);
        for nb in [1usize, 4, 8] {
            let xs: Vec<Vec<BlockQ8K>> = (0..3).map(|_| q8k(&mut rng, nb)).collect();
            let refs = [&xs[0][..], &xs[1][..], &xs[2][..]];
            let w4: Vec<BlockQ4K> = random_blocks(&mut rng, nb, &[0, 2]);
            let w6: Vec<BlockQ6K> = random_blocks(&mut rng, nb, &[208]);
            // SAFETY: AVX2, FMA and F16C were checked above.
            let (a4, a6) = unsafe { (avx2::dot_q4_k::<false, 3>(&w4, refs), avx2::dot_q6_k(&w6, refs)) };
            assert_eq!(a4.map(f32::to_bits), scalar::dot_q4_k::<false, 3>(&w4, refs).map(f32::to_bits), "q4_k nb={nb}");
            // SAFETY: as above.
            let t6 = unsafe { avx2::dot_q6_k_tiled(&w6, refs) };
            assert_eq!(t6.map(f32::to_bits), scalar::dot_q6_k_tiled(&w6, refs).map(f32::to_bits), "q6_k tiled");
            // SAFETY: as above.
            let p4 = unsafe { avx2::dot_q4_k::<true, 3>(&w4, refs) };
            assert_eq!(p4.map(f32::to_bits), scalar::dot_q4_k::<true, 3>(&w4, refs).map(f32::to_bits), "q4_k pairs");
            assert_eq!(a6.map(f32::to_bits), scalar::dot_q6_k(&w6, refs).map(f32::to_bits), "q6_k nb={nb}");
            // Four columns take their own kernel (the float work of the four at once).
            let refs4 = [refs[0], refs[1], refs[2], refs[0]];
            // SAFETY: as above.
            let (f4, q4) = unsafe { (avx2::dot_q4_k::<false, 4>(&w4, refs4), avx2::dot_q4_k::<true, 4>(&w4, refs4)) };
            assert_eq!(f4.map(f32::to_bits), scalar::dot_q4_k::<false, 4>(&w4, refs4).map(f32::to_bits), "q4_k x4");
            assert_eq!(
                q4.map(f32::to_bits),
                scalar::dot_q4_k::<true, 4>(&w4, refs4).map(f32::to_bits),
                "q4_k x4 pairs"
            );
            // SAFETY: as above.
            let one = unsafe { avx2::dot_q4_k::<false, 1>(&w4, [refs[2]]) };
            assert_eq!(one[0].to_bits(), a4[2].to_bits());
            let ys: Vec<Vec<BlockQ8>> = (0..3).map(|_| q8(&mut rng, nb * 8)).collect();
            let yr = [&ys[0][..], &ys[1][..], &ys[2][..]];
            let w5: Vec<BlockQ5_0> = random_blocks(&mut rng, nb * 8, &[0]);
            // SAFETY: as above.
            let a5 = unsafe { avx2::dot_q5_0(&w5, yr) };
            assert_eq!(a5.map(f32::to_bits), scalar::dot_q5_0(&w5, yr).map(f32::to_bits), "q5_0 nb={nb}");
        }
    }
}
