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
}
