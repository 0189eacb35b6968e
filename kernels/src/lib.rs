//! pdmesh compute kernels.
//!
//! The CPU implementation is the reference every other backend is checked
//! against: each SIMD kernel has a scalar twin and a test on random inputs.
//! The CUDA kernels live in `kernels/cuda` (crate `pdmesh-cuda`) and are
//! checked against these; a machine without a GPU runs everything here.
//!
//! Entry points used by the engine: [`matmul::matmul`] over GGML-quantized
//! weights ([`quant`]), [`norm::rms_norm`], [`rope::rope_row`],
//! [`attention::attend_group`], [`activation::silu_mul`], and the fork-join
//! [`pool::Pool`] they run on.

pub mod activation;
pub mod attention;
pub mod dot;
pub mod formats;
#[cfg(target_arch = "x86_64")]
pub mod ggml_avx2;
pub mod ggml_ref;
pub mod kdot;
pub mod kquant;
pub mod matmul;
pub mod norm;
pub mod pool;
pub mod quant;
pub mod rng;
pub mod rope;

pub use dot::Backend;

#[cfg(test)]
pub(crate) mod testutil {
    pub use crate::rng::Rng;

    /// Random blocks of any plain-old-data block type: random bytes, with
    /// every f16 scale set to a small finite value.
    pub fn random_blocks<T: Copy>(rng: &mut Rng, n: usize, f16_at: &[usize]) -> Vec<T> {
        let size = std::mem::size_of::<T>();
        let mut bytes: Vec<u8> = (0..n * size).map(|_| (rng.next_u64() >> 56) as u8).collect();
        for b in 0..n {
            for &at in f16_at {
                let v = half::f16::from_f32(rng.normal() * 0.01).to_bits().to_le_bytes();
                bytes[b * size + at..b * size + at + 2].copy_from_slice(&v);
            }
        }
        // SAFETY: T is a repr(C) block of integers; every bit pattern is valid.
        (0..n).map(|b| unsafe { std::ptr::read_unaligned(bytes[b * size..].as_ptr() as *const T) }).collect()
    }
}
