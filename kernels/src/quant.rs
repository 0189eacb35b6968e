//! Block-quantized formats, bit-compatible with GGML's on-disk layout.
//!
//! Weights stay in the file's format (`Q4_1`, `Q8_0`); activations are
//! quantized per 32-value block to 8 bits (`BlockQ8`, like GGML's `q8_1`) so
//! dot products run in integer SIMD, as llama.cpp does on CPU.

use half::f16;

/// Values per quantization block (GGML's QK4_1 = QK8_0 = 32).
pub const QK: usize = 32;

/// GGML `block_q4_1`: `x = d * q + m`, q in 0..16; element i < 16 is the low
/// nibble of `qs[i]`, element i >= 16 the high nibble of `qs[i - 16]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; QK / 2],
}

/// GGML `block_q8_0`: `x = d * q`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; QK],
}

/// Quantized activations: `x ≈ d * q`, with `s = d * Σq` kept for the
/// offset term of `Q4_1` products.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        BlockQ8 { d: 0.0, s: 0.0, qs: [0; QK] }
    }
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Quantize `x` (length a multiple of 32) into `out` (len / 32 blocks).
///
/// Mirrors GGML's `quantize_row_q8_1` bit for bit where it matters for
/// agreement with llama.cpp: scale `127 / amax`, round half to even, and the
/// block scale `d` (and `s = d * Σq`) rounded through f16 as GGML stores them.
pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (chunk, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(chunk) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        b.d = round_f16(d);
        b.s = round_f16(d * sum as f32);
    }
}

/// `x` rounded to the nearest f16 and back.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Dequantize Q4_1 blocks into f32 (reference and for tests).
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        let m = f16_to_f32(b.m);
        for i in 0..QK / 2 {
            o[i] = (b.qs[i] & 0x0F) as f32 * d + m;
            o[i + QK / 2] = (b.qs[i] >> 4) as f32 * d + m;
        }
    }
}

/// Dequantize Q8_0 blocks into f32 (embedding lookups, tests).
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for (v, q) in o.iter_mut().zip(b.qs.iter()) {
            *v = *q as f32 * d;
        }
    }
}

/// Quantize f32 to Q4_1 (for tests and synthetic weights).
pub fn quantize_q4_1(x: &[f32], out: &mut [BlockQ4_1]) {
    for (chunk, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let min = chunk.iter().cloned().fold(f32::INFINITY, f32::min);
        let max = chunk.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f16::from_f32(d).to_bits();
        b.m = f16::from_f32(min).to_bits();
        for i in 0..QK / 2 {
            let lo = (((chunk[i] - min) * id).round() as i32).clamp(0, 15) as u8;
            let hi = (((chunk[i + QK / 2] - min) * id).round() as i32).clamp(0, 15) as u8;
            b.qs[i] = lo | (hi << 4);
        }
    }
}

/// Quantize f32 to Q8_0 (for tests and synthetic weights).
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (chunk, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f16::from_f32(d).to_bits();
        for (q, v) in b.qs.iter_mut().zip(chunk) {
            *q = (v * id).round() as i8;
        }
    }
}

/// Reinterpret raw little-endian bytes (from a GGUF file) as blocks.
/// Returns `None` when the length is not a whole number of blocks or the
/// pointer is misaligned for the block type.
pub fn cast_blocks<T: Copy>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return None;
    }
    // SAFETY: length and alignment checked; T is plain old data (integers).
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(std::mem::size_of::<BlockQ4_1>(), 20);
        assert_eq!(std::mem::size_of::<BlockQ8_0>(), 34);
    }

    #[test]
    fn q8_roundtrip_is_close() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.31).collect();
        let mut q = vec![BlockQ8::default(); 2];
        quantize_q8(&x, &mut q);
        for (i, v) in x.iter().enumerate() {
            let b = &q[i / QK];
            let back = b.qs[i % QK] as f32 * b.d;
            // Half a step, plus the f16 rounding of the scale over 127 steps.
            assert!((back - v).abs() <= b.d * 0.5 + 127.0 * b.d / 1024.0 + 1e-6);
        }
    }
}
