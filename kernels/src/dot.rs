//! Dot products of quantized weight rows with quantized activation rows.
//!
//! Every function takes one weight row and `N` activation rows and returns
//! `N` dot products. The single-row case is the `N = 1` instance of the same
//! code, so a row's result is bit-identical whether it was computed alone or
//! beside others — which is what makes a batched sequence produce exactly the
//! tokens it produces alone.
//!
//! `scalar` is the reference; `avx2` and `avx512` are checked against it
//! bit for bit on random inputs.

use crate::quant::{BlockQ4_1, BlockQ8, BlockQ8_0, QK};

/// What a batch-1 kernel prefetches as it goes: the next tile's bytes,
/// `step` of them per block it computes, so the next tile streams in while
/// this one computes. (All of a tile's lines asked for at its start stalled
/// the kernel once rows were long: 60 lines for 4 rows of 1536 columns.)
#[derive(Clone, Copy)]
pub struct Ahead {
    at: *const i8,
    len: usize,
    step: usize,
}

impl Ahead {
    /// Nothing to prefetch.
    pub const NONE: Ahead = Ahead { at: std::ptr::null(), len: 0, step: 0 };

    /// `blocks[start..start + count]` (as much of it as there is), over
    /// the blocks of one row: `rows` blocks' bytes per step.
    pub fn tile<T>(blocks: &[T], start: usize, count: usize, rows: usize) -> Ahead {
        let end = (start + count).min(blocks.len());
        if start >= end {
            return Ahead::NONE;
        }
        let size = std::mem::size_of::<T>();
        Ahead { at: blocks[start..].as_ptr() as *const i8, len: (end - start) * size, step: rows * size }
    }

    /// Prefetch the bytes for block `i`: the lines of `at[i * step..][..step]`.
    #[inline(always)]
    fn block(self, i: usize) {
        let from = i * self.step;
        if from >= self.len {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let first = (self.at as usize + from) & !63;
            let last = self.at as usize + (from + self.step).min(self.len) - 1;
            for line in (first..=last).step_by(64) {
                // SAFETY: a prefetch is a hint and never faults; every line
                // holds bytes of the slice `tile` was given.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            }
        }
    }
}

/// Quantize activations with the fastest implementation the backend has.
pub fn quantize_q8(be: Backend, x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK);
    if be.has_avx2() {
        // SAFETY: the backend was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        return unsafe { avx2::quantize_q8(x, out) };
    }
    crate::quant::quantize_q8(x, out)
}

/// Which implementation runs. Picked once per process by [`Backend::detect`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Scalar,
    Avx2,
    /// AVX2 everywhere, and AVX-512 VNNI for the Q4_1 matrix products
    /// (bit-identical to AVX2).
    Avx512,
}

/// The environment variable that caps the kernels: `scalar`, `avx2`, or
/// `auto` (the default: the best this CPU has).
pub const KERNELS_ENV: &str = "PDMESH_KERNELS";

impl Backend {
    pub fn detect() -> Backend {
        let best = [Backend::Avx512, Backend::Avx2].into_iter().find(|b| b.runs_here()).unwrap_or(Backend::Scalar);
        match std::env::var(KERNELS_ENV).as_deref() {
            Ok("scalar") => Backend::Scalar,
            Ok("avx2") if best.has_avx2() => Backend::Avx2,
            _ => best,
        }
    }

    /// Whether this CPU can run this backend's routines.
    pub fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            match self {
                Backend::Scalar => true,
                Backend::Avx2 => avx2,
                Backend::Avx512 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Backend::Scalar
        }
    }

    /// Whether the AVX2 routines may run (every backend but the scalar one).
    pub fn has_avx2(self) -> bool {
        matches!(self, Backend::Avx2 | Backend::Avx512)
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "cpu-scalar",
            Backend::Avx2 => "cpu-avx2",
            Backend::Avx512 => "cpu-avx512-vnni",
        }
    }
}

pub mod scalar {
    use super::*;
    use crate::ggml_ref::{hsum8, lane_sums};
    use crate::quant::f16_to_f32;

    /// Lane-by-lane twin of [`super::avx2::dot_q4_1`] (bit-identical).
    pub fn dot_q4_1<const N: usize>(w: &[BlockQ4_1], xs: [&[BlockQ8]; N]) -> [f32; N] {
        let mut out = [0f32; N];
        for (n, x) in xs.iter().enumerate() {
            let mut acc = [0f32; 8];
            let mut summs = 0f32;
            for (b, y) in w.iter().zip(x.iter()) {
                let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
                let q = |e: usize| if e < QK / 2 { (b.qs[e] & 0x0F) as i32 } else { (b.qs[e - QK / 2] >> 4) as i32 };
                let lanes = lane_sums(q, &y.qs);
                let dd = d * y.d;
                for k in 0..8 {
                    acc[k] = dd.mul_add(lanes[k] as f32, acc[k]);
                }
                summs += m * y.s;
            }
            out[n] = hsum8(acc) + summs;
        }
        out
    }

    /// Lane-by-lane twin of [`super::avx2::dot_q8_0`] (bit-identical).
    pub fn dot_q8_0<const N: usize>(w: &[BlockQ8_0], xs: [&[BlockQ8]; N]) -> [f32; N] {
        let mut out = [0f32; N];
        for (n, x) in xs.iter().enumerate() {
            let mut acc = [0f32; 8];
            for (b, y) in w.iter().zip(x.iter()) {
                let lanes = lane_sums(|e| b.qs[e] as i32, &y.qs);
                let dd = f16_to_f32(b.d) * y.d;
                for k in 0..8 {
                    acc[k] = dd.mul_add(lanes[k] as f32, acc[k]);
                }
            }
            out[n] = hsum8(acc);
        }
        out
    }

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn h2f(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
    }

    use crate::ggml_avx2::hsum;

    /// `R` weight rows against `N` activation rows: `out[r][n]`. Each output
    /// is one FMA chain over the blocks in order, the same arithmetic as
    /// GGML's `ggml_vec_dot_q4_1_q8_1`; several rows and columns only add
    /// independent chains (instruction-level parallelism), never change one.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every `xs[n]` at least as long as each `w[r]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1<const R: usize, const N: usize>(w: [&[BlockQ4_1]; R], xs: [&[BlockQ8]; N]) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut summs = [[0f32; N]; R];
        let lowmask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let nb = w[0].len();
        for i in 0..nb {
            let mut q = [_mm256_setzero_si256(); R];
            let mut d = [0f32; R];
            let mut m = [0f32; R];
            for r in 0..R {
                let b = w[r].get_unchecked(i);
                d[r] = h2f(b.d);
                m[r] = h2f(b.m);
                let tmp = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
                q[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp), lowmask);
            }
            for n in 0..N {
                let y = xs[n].get_unchecked(i);
                let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
                for r in 0..R {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[r], yq), ones);
                    acc[r][n] = _mm256_fmadd_ps(_mm256_set1_ps(d[r] * y.d), _mm256_cvtepi32_ps(p), acc[r][n]);
                    summs[r][n] += m[r] * y.s;
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for n in 0..N {
                out[r][n] = hsum(acc[r][n]) + summs[r][n];
            }
        }
        out
    }

    /// Like [`dot_q4_1`] for Q8_0 weights (GGML's `ggml_vec_dot_q8_0_q8_0`).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every `xs[n]` at least as long as each `w[r]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0<const R: usize, const N: usize>(w: [&[BlockQ8_0]; R], xs: [&[BlockQ8]; N]) -> [[f32; N]; R] {
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let ones = _mm256_set1_epi16(1);
        let nb = w[0].len();
        for i in 0..nb {
            let mut wq = [_mm256_setzero_si256(); R];
            let mut ax = [_mm256_setzero_si256(); R];
            let mut d = [0f32; R];
            for r in 0..R {
                let b = w[r].get_unchecked(i);
                d[r] = h2f(b.d);
                wq[r] = _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i);
                ax[r] = _mm256_sign_epi8(wq[r], wq[r]);
            }
            for n in 0..N {
                let y = xs[n].get_unchecked(i);
                let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
                for r in 0..R {
                    let sy = _mm256_sign_epi8(yq, wq[r]);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[r], sy), ones);
                    acc[r][n] = _mm256_fmadd_ps(_mm256_set1_ps(d[r] * y.d), _mm256_cvtepi32_ps(p), acc[r][n]);
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for n in 0..N {
                out[r][n] = hsum(acc[r][n]);
            }
        }
        out
    }

    /// Four weight rows against one activation row (batch-1 decode), with
    /// the scales of all four rows converted and scaled at once and the
    /// rows unpacked in pairs, one row per 128-bit half: `lo[p]` holds rows
    /// `2p` and `2p + 1`'s lanes 0-3 (the low nibbles), `hi[p]` their lanes
    /// 4-7. Each lane is the same FMA chain as in [`dot_q4_1`], only kept in
    /// another register, so the results are bit-identical to it.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `xs[0]` at least as long as each `w[r]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_rows4(w: [&[BlockQ4_1]; 4], xs: [&[BlockQ8]; 1], ahead: Ahead) -> [[f32; 1]; 4] {
        let lowmask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        // Where each pair's two `d * y.d` sit in [d0 m0 d1 m1 d2 m2 d3 m3] * [yd ys ..].
        let pick = [_mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)];
        let mut lo = [_mm256_setzero_ps(); 2];
        let mut hi = [_mm256_setzero_ps(); 2];
        // Odd lanes: each row's running sum of m * y.s.
        let mut summs = _mm256_setzero_ps();
        let nb = w[0].len();
        for i in 0..nb {
            ahead.block(i);
            let b: [&BlockQ4_1; 4] = std::array::from_fn(|r| w[r].get_unchecked(i));
            let y = xs[0].get_unchecked(i);
            // d and m are a block's first four bytes.
            let word = |r: usize| (b[r] as *const BlockQ4_1 as *const i32).read_unaligned();
            let dm = _mm256_cvtph_ps(_mm_setr_epi32(word(0), word(1), word(2), word(3)));
            // y.d and y.s are adjacent f32s: [yd ys yd ys ..].
            let yds = _mm256_castpd_ps(_mm256_broadcast_sd(&*(y as *const BlockQ8 as *const f64)));
            let scaled = _mm256_mul_ps(dm, yds);
            summs = _mm256_add_ps(summs, scaled);
            let ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128(y.qs.as_ptr() as *const __m128i));
            let yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(y.qs.as_ptr().add(16) as *const __m128i));
            for p in 0..2 {
                let q = _mm256_loadu2_m128i(
                    b[2 * p + 1].qs.as_ptr() as *const __m128i,
                    b[2 * p].qs.as_ptr() as *const __m128i,
                );
                let ql = _mm256_and_si256(q, lowmask);
                let qh = _mm256_and_si256(_mm256_srli_epi16(q, 4), lowmask);
                let sc = _mm256_permutevar8x32_ps(scaled, pick[p]);
                let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(ql, ylo), ones);
                let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(qh, yhi), ones);
                lo[p] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(pl), lo[p]);
                hi[p] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(ph), hi[p]);
            }
        }
        let mut sm = [0f32; 8];
        _mm256_storeu_ps(sm.as_mut_ptr(), summs);
        let mut out = [[0f32; 1]; 4];
        for p in 0..2 {
            // [l4+l0 .. l7+l3] of both rows: `hsum`'s first step, lanes commuted.
            let t = _mm256_add_ps(hi[p], lo[p]);
            for (h, s) in [_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)].into_iter().enumerate() {
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                let r = 2 * p + h;
                out[r][0] = _mm_cvtss_f32(s) + sm[2 * r + 1];
            }
        }
        out
    }

    /// Four Q8_0 weight rows against one activation row, the four scales
    /// converted and scaled at once; otherwise [`dot_q8_0`] (bit-identical).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `xs[0]` at least as long as each `w[r]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_rows4(w: [&[BlockQ8_0]; 4], xs: [&[BlockQ8]; 1], ahead: Ahead) -> [[f32; 1]; 4] {
        let ones = _mm256_set1_epi16(1);
        let pick: [__m256i; 4] = std::array::from_fn(|r| _mm256_set1_epi32(r as i32));
        let mut acc = [_mm256_setzero_ps(); 4];
        let nb = w[0].len();
        for i in 0..nb {
            ahead.block(i);
            let b: [&BlockQ8_0; 4] = std::array::from_fn(|r| w[r].get_unchecked(i));
            let y = xs[0].get_unchecked(i);
            let d =
                _mm_cvtph_ps(_mm_setr_epi16(b[0].d as i16, b[1].d as i16, b[2].d as i16, b[3].d as i16, 0, 0, 0, 0));
            let scaled = _mm256_castps128_ps256(_mm_mul_ps(d, _mm_set1_ps(y.d)));
            let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
            for r in 0..4 {
                let wq = _mm256_loadu_si256(b[r].qs.as_ptr() as *const __m256i);
                let p =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(yq, wq)), ones);
                let sc = _mm256_permutevar8x32_ps(scaled, pick[r]);
                acc[r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), acc[r]);
            }
        }
        acc.map(|a| [hsum(a)])
    }

    /// Quantize 32-value blocks to [`BlockQ8`], bit-identical to
    /// [`crate::quant::quantize_q8`] (and to GGML's AVX2 `quantize_row_q8_1`).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `x.len() == out.len() * 32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
        let sign = _mm256_set1_ps(-0.0);
        for (i, b) in out.iter_mut().enumerate() {
            let p = x.as_ptr().add(i * QK);
            let v =
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
            let mut mx = _mm256_andnot_ps(sign, v[0]);
            for vv in &v[1..] {
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, *vv));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mul = _mm256_set1_ps(id);
            let mut sum = _mm256_setzero_si256();
            let mut ints = [0i32; QK];
            for (k, vv) in v.iter().enumerate() {
                let r = _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(*vv, mul),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                ));
                sum = _mm256_add_epi32(sum, r);
                _mm256_storeu_si256(ints.as_mut_ptr().add(k * 8) as *mut __m256i, r);
            }
            for (q, v) in b.qs.iter_mut().zip(ints.iter()) {
                *q = *v as i8;
            }
            let s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
            let total = _mm_cvtsi128_si32(s);
            b.d = h2f(_mm_extract_epi16(_mm_cvtps_ph(_mm_set1_ps(d), 0), 0) as u16);
            b.s = h2f(_mm_extract_epi16(_mm_cvtps_ph(_mm_set1_ps(d * total as f32), 0), 0) as u16);
        }
    }
}

/// AVX-512 with VNNI (`vpdpbusd`), where the CPU has it: the dot products
/// of two weight rows at once, one row in each 256-bit half. Each half
/// holds exactly the eight lanes of the AVX2 kernels (`vpdpbusd` sums the
/// same four byte products per lane as `maddubs` + `madd`, which cannot
/// saturate here), scaled and accumulated in the same order, so results
/// are bit-identical to AVX2 and the scalar twins; GGML itself uses
/// `vpdpbusd` in `mul_sum_us8_pairs_float` on such CPUs.
#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    use crate::ggml_avx2::hsum;

    /// A weight block the pair kernel takes.
    pub trait PairBlock {
        /// Whether blocks carry a minimum (`m * y.s` is added per block).
        const MIN: bool;
        /// Whether weights are signed (their signs move onto the activations).
        const SIGNED: bool;
        /// The block's f16 scale and, with [`Self::MIN`], its minimum, in
        /// the low and high half of a 32-bit word.
        fn scales(&self) -> i32;
        /// Two rows' weights as unsigned bytes, one row per 256-bit half
        /// (the order the AVX2 kernel multiplies them in), and with
        /// [`Self::SIGNED`] the bytes whose activations are negated.
        ///
        /// # Safety
        /// The CPU must support AVX-512 F and BW.
        unsafe fn weights(a: &Self, b: &Self) -> (__m512i, __mmask64);
    }

    impl PairBlock for BlockQ4_1 {
        const MIN: bool = true;
        const SIGNED: bool = false;
        #[inline(always)]
        fn scales(&self) -> i32 {
            // d then m: the block's first four bytes.
            i32::from(self.d) | (i32::from(self.m) << 16)
        }
        /// Low nibbles, then high nibbles, as [`avx2::dot_q4_1`] unpacks them.
        #[inline(always)]
        unsafe fn weights(a: &Self, b: &Self) -> (__m512i, __mmask64) {
            let ta = _mm_loadu_si128(a.qs.as_ptr() as *const __m128i);
            let tb = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
            let ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(ta, ta)), _mm256_set_m128i(tb, tb), 1);
            // 128-bit lanes 1 and 3 take the high nibbles.
            let q = _mm512_mask_blend_epi64(0b1100_1100, ab, _mm512_srli_epi16(ab, 4));
            (_mm512_and_si512(q, _mm512_set1_epi8(0x0F)), 0)
        }
    }

    impl PairBlock for BlockQ8_0 {
        const MIN: bool = false;
        const SIGNED: bool = true;
        #[inline(always)]
        fn scales(&self) -> i32 {
            i32::from(self.d)
        }
        /// |w|, and w's signs for the activations ([`avx2::dot_q8_0`]'s
        /// `sign_epi8` trick: where w is 0 the product is 0 either way).
        #[inline(always)]
        unsafe fn weights(a: &Self, b: &Self) -> (__m512i, __mmask64) {
            let wa = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let wb = _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i);
            let w = _mm512_inserti64x4(_mm512_castsi256_si512(wa), wb, 1);
            (_mm512_abs_epi8(w), _mm512_movepi8_mask(w))
        }
    }

    /// `R` weight rows (`R / 2` pairs; `R` 2 or 4) against `N` activation
    /// rows: `out[r][n]`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; every
    /// `xs[n]` at least as long as each `w[r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    pub unsafe fn dot_pairs<B: PairBlock, const R: usize, const N: usize>(
        w: [&[B]; R],
        xs: [&[BlockQ8]; N],
    ) -> [[f32; N]; R] {
        dot_pairs_ahead(w, xs, Ahead::NONE)
    }

    /// [`dot_pairs`], prefetching `ahead` as it goes (the same results).
    ///
    /// # Safety
    /// As [`dot_pairs`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_pairs_ahead<B: PairBlock, const R: usize, const N: usize>(
        w: [&[B]; R],
        xs: [&[BlockQ8]; N],
        ahead: Ahead,
    ) -> [[f32; N]; R] {
        debug_assert!(R == 2 || R == 4);
        // Only the first R / 2 entries of the pair arrays are used.
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        let mut summs = [_mm256_setzero_ps(); N];
        let zero = _mm512_setzero_si512();
        // Where each pair's two scales sit in [d0 m0 d1 m1 d2 m2 d3 m3].
        let pick_d = [
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
            _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
        ];
        let pick_m = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
        let nb = w[0].len();
        for i in 0..nb {
            ahead.block(i);
            let b: [&B; R] = std::array::from_fn(|r| w[r].get_unchecked(i));
            // One 32-bit load per row, one conversion for all rows' scales.
            let mut dm = [0i32; 4];
            for r in 0..R {
                dm[r] = b[r].scales();
            }
            let dm = _mm256_cvtph_ps(_mm_loadu_si128(dm.as_ptr() as *const __m128i));
            let m = _mm256_permutevar8x32_ps(dm, pick_m);
            let mut q = [zero; R];
            let mut neg = [0 as __mmask64; R];
            let mut dv = [_mm512_setzero_ps(); R];
            for p in 0..R / 2 {
                (q[p], neg[p]) = B::weights(b[2 * p], b[2 * p + 1]);
                dv[p] = _mm512_permutexvar_ps(pick_d[p], _mm512_castps256_ps512(dm));
            }
            for n in 0..N {
                let y = xs[n].get_unchecked(i);
                let yq = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.qs.as_ptr() as *const __m256i));
                let yd = _mm512_set1_ps(y.d);
                for p in 0..R / 2 {
                    let ys = if B::SIGNED { _mm512_mask_sub_epi8(yq, neg[p], zero, yq) } else { yq };
                    let lanes = _mm512_dpbusd_epi32(zero, q[p], ys);
                    acc[p][n] = _mm512_fmadd_ps(_mm512_mul_ps(dv[p], yd), _mm512_cvtepi32_ps(lanes), acc[p][n]);
                }
                if B::MIN {
                    // m * y.s, then the add: the scalar twin's two roundings.
                    summs[n] = _mm256_add_ps(summs[n], _mm256_mul_ps(m, _mm256_set1_ps(y.s)));
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for n in 0..N {
            let mut sm = [0f32; 8];
            _mm256_storeu_ps(sm.as_mut_ptr(), summs[n]);
            for p in 0..R / 2 {
                let lo = _mm512_castps512_ps256(acc[p][n]);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][n]), 1));
                // The AVX2 kernels add nothing for Q8_0: keep that (+0.0 could turn -0.0 into 0.0).
                out[2 * p][n] = if B::MIN { hsum(lo) + sm[2 * p] } else { hsum(lo) };
                out[2 * p + 1][n] = if B::MIN { hsum(hi) + sm[2 * p + 1] } else { hsum(hi) };
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_q4_1, quantize_q8, quantize_q8_0, BlockQ4_1, BlockQ8, BlockQ8_0};
    use crate::testutil::Rng;

    /// Says why and returns true where the CPU cannot run the AVX2 kernels.
    fn skipped_without_avx2() -> bool {
        let skip = !Backend::Avx2.runs_here();
        if skip {
            eprintln!("SKIPPED: this CPU has no AVX2/FMA/F16C; only the scalar reference runs");
        }
        skip
    }

    fn q4_1(w: &[f32]) -> Vec<BlockQ4_1> {
        let mut q = vec![BlockQ4_1::default(); w.len() / QK];
        quantize_q4_1(w, &mut q);
        q
    }

    fn q8_0(w: &[f32]) -> Vec<BlockQ8_0> {
        let mut q = vec![BlockQ8_0 { d: 0, qs: [0; QK] }; w.len() / QK];
        quantize_q8_0(w, &mut q);
        q
    }

    fn q8(x: &[f32]) -> Vec<BlockQ8> {
        let mut q = vec![BlockQ8::default(); x.len() / QK];
        quantize_q8(x, &mut q);
        q
    }

    #[test]
    fn avx2_is_bit_identical_to_scalar_on_random_rows() {
        if skipped_without_avx2() {
            return;
        }
        let mut rng = Rng::new(7);
        for nb in [1usize, 3, 18, 48] {
            let w: Vec<f32> = rng.normal_vec(nb * QK);
            let (w41, w80) = (q4_1(&w), q8_0(&w));
            let xs: Vec<Vec<BlockQ8>> = (0..4).map(|_| q8(&rng.normal_vec(nb * QK))).collect();
            let refs = [&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]];
            let s41 = scalar::dot_q4_1(&w41, refs);
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            let v41 = unsafe { avx2::dot_q4_1([&w41[..]], refs) }[0];
            let s80 = scalar::dot_q8_0(&w80, refs);
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            let v80 = unsafe { avx2::dot_q8_0([&w80[..]], refs) }[0];
            // Two rows at once give each row's single-row result exactly.
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            let two = unsafe { avx2::dot_q4_1([&w41[..], &w41[..]], refs) };
            assert_eq!(two[1].map(f32::to_bits), v41.map(f32::to_bits));
            for n in 0..4 {
                assert_eq!(s41[n].to_bits(), v41[n].to_bits(), "q4_1 nb={nb} {} vs {}", s41[n], v41[n]);
                assert_eq!(s80[n].to_bits(), v80[n].to_bits(), "q8_0 nb={nb} {} vs {}", s80[n], v80[n]);
                // The single-row path is bit-identical to the multi-row path.
                // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
                let one = unsafe { avx2::dot_q4_1([&w41[..]], [refs[n]]) }[0];
                assert_eq!(one[0].to_bits(), v41[n].to_bits());
                // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
                let four = unsafe { avx2::dot_q8_0([&w80[..], &w80[..], &w80[..], &w80[..]], [refs[n]]) };
                assert_eq!(four[3][0].to_bits(), v80[n].to_bits());
            }
            let xf = rng.normal_vec(nb * QK);
            let mut qs = vec![BlockQ8::default(); nb];
            let mut qv = vec![BlockQ8::default(); nb];
            crate::quant::quantize_q8(&xf, &mut qs);
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            unsafe { avx2::quantize_q8(&xf, &mut qv) };
            for (p, q) in qs.iter().zip(&qv) {
                assert_eq!((p.d.to_bits(), p.s.to_bits(), p.qs), (q.d.to_bits(), q.s.to_bits(), q.qs));
            }
        }
    }

    /// The four-row batch-1 kernels give each row's single-row bits.
    #[test]
    fn avx2_four_row_kernels_match_the_single_row_kernels() {
        if skipped_without_avx2() {
            return;
        }
        let mut rng = Rng::new(13);
        for nb in [1usize, 2, 18, 48] {
            let w: Vec<Vec<f32>> = (0..4).map(|_| rng.normal_vec(nb * QK)).collect();
            let w41: Vec<Vec<BlockQ4_1>> = w.iter().map(|w| q4_1(w)).collect();
            let w80: Vec<Vec<BlockQ8_0>> = w.iter().map(|w| q8_0(w)).collect();
            let x = q8(&rng.normal_vec(nb * QK));
            let xs = [&x[..]];
            // SAFETY: this test returned early unless the CPU has the instructions these kernels use.
            let (f41, f80) = unsafe {
                (
                    avx2::dot_q4_1_rows4(std::array::from_fn(|r| &w41[r][..]), xs, Ahead::NONE),
                    avx2::dot_q8_0_rows4(std::array::from_fn(|r| &w80[r][..]), xs, Ahead::NONE),
                )
            };
            for r in 0..4 {
                // SAFETY: as above.
                let (o41, o80) = unsafe { (avx2::dot_q4_1([&w41[r][..]], xs), avx2::dot_q8_0([&w80[r][..]], xs)) };
                assert_eq!(f41[r][0].to_bits(), o41[0][0].to_bits(), "q4_1 nb={nb} row {r}");
                assert_eq!(f80[r][0].to_bits(), o80[0][0].to_bits(), "q8_0 nb={nb} row {r}");
                assert_eq!(o41[0][0].to_bits(), scalar::dot_q4_1(&w41[r], xs)[0].to_bits());
            }
        }
    }

    #[test]
    fn quantized_dot_approximates_float_dot() {
        let mut rng = Rng::new(11);
        let nb = 18;
        let w = rng.normal_vec(nb * QK);
        let x = rng.normal_vec(nb * QK);
        let mut w41 = vec![Default::default(); nb];
        quantize_q4_1(&w, &mut w41);
        let mut wd = vec![0f32; nb * QK];
        crate::quant::dequantize_q4_1(&w41, &mut wd);
        let mut xq = vec![BlockQ8::default(); nb];
        quantize_q8(&x, &mut xq);
        let exact = scalar::dot_f32(&wd, &x);
        let got = scalar::dot_q4_1(&w41, [&xq[..]])[0];
        // 8-bit activations: error well under 2% of the vector norms' product.
        let scale = (wd.iter().map(|v| v * v).sum::<f32>() * x.iter().map(|v| v * v).sum::<f32>()).sqrt();
        assert!((exact - got).abs() < 0.02 * scale, "{exact} vs {got}");
    }
}
