//! The K-quants (Q2_K .. Q6_K, 256-value super-blocks) and the 5-bit
//! 32-value formats (Q5_0, Q5_1), bit-compatible with GGML's on-disk
//! layout, with their scalar dequantizers and the 8-bit activation blocks
//! (`BlockQ8K`) the K-quant dot products take.
//!
//! Each dequantizer is checked bit for bit against the `gguf` package's
//! NumPy dequantizer (`kernels/tests/data/kquant_vectors.bin`, made by
//! `scripts/kquant_vectors.py`); each dot product in `kdot.rs`
//! against these.

use crate::quant::f16_to_f32;

/// Values per K-quant super-block (GGML's QK_K).
pub const QK_K: usize = 256;
/// Bytes of packed sub-block scales and mins in Q4_K and Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// GGML `block_q2_K`: 16 sub-blocks of 16, 2-bit values, 4-bit scale and
/// min per sub-block (`scales[i]`: low nibble scale, high nibble min).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: u16,
    pub dmin: u16,
}

/// GGML `block_q3_K`: 3-bit values (2 low bits in `qs`, the high bit in
/// `hmask`), 6-bit signed scales packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: u16,
}

/// GGML `block_q4_K`: 8 sub-blocks of 32, 4-bit values, 6-bit scales and
/// mins packed in 12 bytes: `x = d * sc * q - dmin * m`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

/// GGML `block_q5_K`: as Q4_K with a fifth bit per value in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5K {
    pub d: u16,
    pub dmin: u16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// GGML `block_q6_K`: 16 sub-blocks of 16, 6-bit values (4 low bits in
/// `ql`, 2 high in `qh`) offset by 32, 8-bit signed scales.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: u16,
}

/// GGML `block_q5_0`: `x = d * (q - 16)`, q 5 bits (high bits in `qh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ5_0 {
    pub d: u16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// GGML `block_q5_1`: `x = d * q + m`, q 5 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ5_1 {
    pub d: u16,
    pub m: u16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// GGML `block_q8_K`: activations for the K-quant dot products, `x ≈ d * q`
/// with an f32 scale, and the sums of each 16 values (for the mins).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] }
    }
}

/// GGML's `nearest_int`: round half to even through the 1.5 * 2^23 trick
/// (valid for |x| < 2^22).
#[inline]
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantize `x` (length a multiple of 256) into Q8_K blocks, bit for bit
/// as GGML's `quantize_row_q8_K_ref` (the x86 build's only one): the scale
/// comes from the value of largest magnitude, signed.
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(x.len(), out.len() * QK_K);
    for (chunk, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut max, mut amax) = (0f32, 0f32);
        for v in chunk {
            if v.abs() > amax {
                amax = v.abs();
                max = *v;
            }
        }
        if amax == 0.0 {
            *b = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, v) in b.qs.iter_mut().zip(chunk) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (j, s) in b.bsums.iter_mut().enumerate() {
            *s = b.qs[j * 16..(j + 1) * 16].iter().map(|q| *q as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
}

/// Scale and min of sub-block `j` (0..8) from Q4_K/Q5_K's 12 packed bytes.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q3_K's 16 signed 6-bit scales unpacked (before the -32 offset).
pub fn q3k_scales(packed: &[u8; 12]) -> [i8; 16] {
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let aux = [
        (a0 & k2) | ((tmp & k1) << 4),
        (a1 & k2) | (((tmp >> 2) & k1) << 4),
        ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
        ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
    ];
    std::array::from_fn(|i| aux[i / 4].to_le_bytes()[i % 4] as i8)
}

pub fn dequantize_q2_k(blocks: &[BlockQ2K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        let mut is = 0;
        for n in 0..2 {
            let q = &b.qs[n * 32..(n + 1) * 32];
            for j in 0..4 {
                let shift = 2 * j;
                for half in 0..2 {
                    let sc = b.scales[is];
                    is += 1;
                    let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                    for l in 0..16 {
                        let v = ((q[l + 16 * half] >> shift) & 3) as f32;
                        y[n * 128 + j * 32 + half * 16 + l] = dl * v - ml;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q3_k(blocks: &[BlockQ3K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let scales = q3k_scales(&b.scales);
        let mut is = 0;
        let mut m = 1u8;
        for n in 0..2 {
            let q = &b.qs[n * 32..(n + 1) * 32];
            for j in 0..4 {
                let shift = 2 * j;
                for half in 0..2 {
                    let dl = d * (scales[is] as i32 - 32) as f32;
                    is += 1;
                    for l in 0..16 {
                        let e = l + 16 * half;
                        let lo = ((q[e] >> shift) & 3) as i32;
                        let v = lo - if b.hmask[e] & m != 0 { 0 } else { 4 };
                        y[n * 128 + j * 32 + half * 16 + l] = dl * v as f32;
                    }
                }
                m <<= 1;
            }
        }
    }
}

pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        for j in 0..4 {
            let q = &b.qs[j * 32..(j + 1) * 32];
            let (s1, m1) = scale_min_k4(2 * j, &b.scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * s1 as f32, min * m1 as f32);
            let (d2, m2) = (d * s2 as f32, min * m2 as f32);
            for l in 0..32 {
                y[j * 64 + l] = d1 * (q[l] & 0xF) as f32 - m1;
                y[j * 64 + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5_k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
        for j in 0..4 {
            let ql = &b.qs[j * 32..(j + 1) * 32];
            let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
            let (s1, m1) = scale_min_k4(2 * j, &b.scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * s1 as f32, min * m1 as f32);
            let (d2, m2) = (d * s2 as f32, min * m2 as f32);
            for l in 0..32 {
                let hi1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let hi2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[j * 64 + l] = d1 * ((ql[l] & 0xF) + hi1) as f32 - m1;
                y[j * 64 + 32 + l] = d2 * ((ql[l] >> 4) + hi2) as f32 - m2;
            }
        }
    }
}

/// Q6_K value `e` (0..256) of a block, offset removed (-32..32).
#[inline]
pub fn q6k_value(b: &BlockQ6K, e: usize) -> i32 {
    let (n, r) = (e / 128, e % 128);
    let (quarter, l) = (r / 32, r % 32);
    let ql = b.ql[n * 64 + l + 32 * (quarter & 1)];
    let low = if quarter < 2 { ql & 0xF } else { ql >> 4 };
    let high = (b.qh[n * 32 + l] >> (2 * quarter)) & 3;
    (low | (high << 4)) as i32 - 32
}

pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        for (e, v) in y.iter_mut().enumerate() {
            *v = d * b.scales[e / 16] as f32 * q6k_value(b, e) as f32;
        }
    }
}

/// Q5_0/Q5_1 value `e` (0..32) before any offset (0..32).
#[inline]
pub fn q5_value(qs: &[u8; 16], qh: [u8; 4], e: usize) -> i32 {
    let h = u32::from_le_bytes(qh);
    let lo = if e < 16 { qs[e] & 0xF } else { qs[e - 16] >> 4 };
    (lo as u32 | (((h >> e) & 1) << 4)) as i32
}

pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_to_f32(b.d);
        for (e, v) in y.iter_mut().enumerate() {
            *v = (q5_value(&b.qs, b.qh, e) - 16) as f32 * d;
        }
    }
}

/// Q5_0 blocks as Q8_0 blocks of the same values (`q - 16`) and scale:
/// the Q8_0 dot products of them are the Q5_0 dot products, bit for bit.
pub fn widen_q5_0(blocks: &[BlockQ5_0], out: &mut [crate::quant::BlockQ8_0]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Backend::Avx2.runs_here() {
        // SAFETY: AVX2 checked; `out` is at least as long (zip below otherwise).
        return unsafe { widen_q5_0_avx2(blocks, out) };
    }
    for (b, o) in blocks.iter().zip(out.iter_mut()) {
        o.d = b.d;
        let h = u32::from_le_bytes(b.qh);
        for j in 0..16 {
            o.qs[j] = ((b.qs[j] & 0xF) as u32 | ((h >> j) & 1) << 4) as i8 - 16;
            o.qs[j + 16] = ((b.qs[j] >> 4) as u32 | ((h >> (j + 16)) & 1) << 4) as i8 - 16;
        }
    }
}

/// [`widen_q5_0`] with GGML's `bytes_from_bits_32` (as `dot_q5_0` unpacks).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_q5_0_avx2(blocks: &[BlockQ5_0], out: &mut [crate::quant::BlockQ8_0]) {
    use std::arch::x86_64::*;
    let lowmask = _mm256_set1_epi8(0x0F);
    let spread = _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303);
    let bitmask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfeu64 as i64);
    let f0 = _mm256_set1_epi8(0xF0u8 as i8);
    for (b, o) in blocks.iter().zip(out.iter_mut()) {
        let tmp = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
        let qx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp), lowmask);
        let h = _mm256_shuffle_epi8(_mm256_set1_epi32(i32::from_le_bytes(b.qh)), spread);
        let bits = _mm256_cmpeq_epi8(_mm256_or_si256(h, bitmask), _mm256_set1_epi64x(-1));
        let q = _mm256_or_si256(qx, _mm256_andnot_si256(bits, f0));
        o.d = b.d;
        _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, q);
    }
}

pub fn dequantize_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
        for (e, v) in y.iter_mut().enumerate() {
            *v = q5_value(&b.qs, b.qh, e) as f32 * d + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        use std::mem::size_of;
        assert_eq!(size_of::<BlockQ2K>(), 84);
        assert_eq!(size_of::<BlockQ3K>(), 110);
        assert_eq!(size_of::<BlockQ4K>(), 144);
        assert_eq!(size_of::<BlockQ5K>(), 176);
        assert_eq!(size_of::<BlockQ6K>(), 210);
        assert_eq!(size_of::<BlockQ5_0>(), 22);
        assert_eq!(size_of::<BlockQ5_1>(), 24);
        assert_eq!(size_of::<BlockQ8K>(), 292);
    }

    #[test]
    fn widened_q5_0_holds_the_same_values() {
        let mut rng = crate::rng::Rng::new(3);
        let blocks: Vec<BlockQ5_0> = crate::testutil::random_blocks(&mut rng, 9, &[0]);
        let mut wide = vec![crate::quant::BlockQ8_0 { d: 0, qs: [0; 32] }; 9];
        widen_q5_0(&blocks, &mut wide);
        let (mut a, mut b) = (vec![0f32; 9 * 32], vec![0f32; 9 * 32]);
        dequantize_q5_0(&blocks, &mut a);
        crate::quant::dequantize_q8_0(&wide, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn q8_k_round_trips_within_half_a_step_and_sums_match() {
        let mut rng = crate::rng::Rng::new(21);
        let x = rng.normal_vec(2 * QK_K);
        let mut q = vec![BlockQ8K::default(); 2];
        quantize_q8_k(&x, &mut q);
        for (i, v) in x.iter().enumerate() {
            let b = &q[i / QK_K];
            assert!((b.qs[i % QK_K] as f32 * b.d - v).abs() <= b.d.abs() * 0.5 + 1e-6);
        }
        for b in &q {
            for j in 0..16 {
                assert_eq!(b.bsums[j] as i32, b.qs[16 * j..16 * j + 16].iter().map(|v| *v as i32).sum::<i32>());
            }
        }
        let mut z = vec![BlockQ8K::default(); 1];
        quantize_q8_k(&[0.0; QK_K], &mut z);
        assert_eq!(z[0].d, 0.0);
    }
}
