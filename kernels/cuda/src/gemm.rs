//! The f16 tensor-core path of the matrix products, through cuBLAS.
//!
//! Weights are dequantized once into f16 in VRAM (`dequant.cu`); a step
//! with enough rows (prefill, large decode batches) casts its activations
//! to f16 and runs `cublasGemmEx` with f32 accumulation, where the dp4a
//! matvec would read every weight once per 8 rows. cuBLAS is loaded at run
//! time like NVRTC (`libcublas.so` on the loader's path); without it the
//! matvec is the only path and `/statusz` says why.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::error::{fits, GpuError, GpuErrorKind};

/// Bytes of cuBLAS workspace, owned here so that a graph capture never
/// makes cuBLAS allocate (NVIDIA's advice for GEMMs inside CUDA graphs).
const WORKSPACE_BYTES: usize = 32 << 20;

/// How one step's matrix products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProductPath {
    /// Q8 activations and the dp4a matvec (8 rows a launch).
    Matvec,
    /// f16 activations and cuBLAS's GEMM over the f16 weights.
    Gemm,
}

impl ProductPath {
    pub fn name(self) -> &'static str {
        match self {
            ProductPath::Matvec => "matvec",
            ProductPath::Gemm => "gemm",
        }
    }
}

/// The path for a step of `rows` rows: the GEMM from `gemm_min_rows` rows
/// up (0 turns it off), when the f16 weights and cuBLAS are there.
pub fn product_path(rows: usize, gemm_min_rows: u32, gemm_ready: bool) -> ProductPath {
    if gemm_ready && gemm_min_rows > 0 && rows >= gemm_min_rows as usize {
        ProductPath::Gemm
    } else {
        ProductPath::Matvec
    }
}

/// cuBLAS's column-major GEMM arguments, `C = op(A) · op(B)`, for the
/// row-major linear layer `y[t][r] = Σ_k W[r][k] · x[t][k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// `op(A)` is A transposed.
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl GemmShape {
    /// Row-major W (`rows x cols`) is column-major `cols x rows` with
    /// leading dimension `cols`: transposed, it is A (`rows x cols`).
    /// Row-major x (`n_tok x cols`) is column-major B (`cols x n_tok`).
    /// C (`rows x n_tok`, column-major, ld `rows`) is row-major y (`n_tok x rows`).
    pub fn linear(rows: usize, cols: usize, n_tok: usize) -> GemmShape {
        GemmShape { transa: true, transb: false, m: rows, n: n_tok, k: cols, lda: cols, ldb: cols, ldc: rows }
    }
}

/// The class of a cuBLAS failure.
pub fn classify(status: sys::cublasStatus_t) -> GpuErrorKind {
    use sys::cublasStatus_t as S;
    match status {
        S::CUBLAS_STATUS_ALLOC_FAILED => GpuErrorKind::OutOfMemory,
        S::CUBLAS_STATUS_EXECUTION_FAILED => GpuErrorKind::DeviceLost,
        S::CUBLAS_STATUS_NOT_INITIALIZED
        | S::CUBLAS_STATUS_ARCH_MISMATCH
        | S::CUBLAS_STATUS_NOT_SUPPORTED
        | S::CUBLAS_STATUS_LICENSE_ERROR => GpuErrorKind::Unavailable,
        _ => GpuErrorKind::Invalid,
    }
}

fn blas_err(what: &str) -> impl Fn(CublasError) -> GpuError + '_ {
    move |e| GpuError { kind: classify(e.0), what: format!("{what}: {:?}", e.0) }
}

/// A cuBLAS handle on the GPU's stream, with its own workspace.
pub struct Blas {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
}

impl Blas {
    /// A handle on `stream`, or why there is none (no cuBLAS library).
    pub fn open(stream: &Arc<CudaStream>) -> Result<Blas, GpuError> {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::unavailable(
                "cuBLAS (libcublas.so) is not on the loader path: the matrix products use the dp4a matvec only",
            ));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err("creating a cuBLAS handle"))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| GpuError::driver("allocating cuBLAS's workspace", e))?;
        {
            let (ptr, _sync) = workspace.device_ptr(stream);
            // SAFETY: the workspace is ours, on the handle's stream, and
            // lives as long as the handle (both in this struct).
            unsafe { sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut c_void, WORKSPACE_BYTES) }
                .result()
                .map_err(blas_err("setting cuBLAS's workspace"))?;
        }
        Ok(Blas { blas, _workspace: workspace })
    }

    /// `y = x · Wᵀ` in f16 with f32 accumulation: `w` is `rows x cols`
    /// f16 (row-major), `x` is `n_tok x cols` f16, `y` is `n_tok x rows` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f16(
        &self,
        stream: &Arc<CudaStream>,
        w: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> Result<(), GpuError> {
        fits("gemm_f16", "weights", w.len(), rows * cols)?;
        fits("gemm_f16", "x", x.len(), n_tok * cols)?;
        fits("gemm_f16", "y", y.len(), n_tok * rows)?;
        let g = GemmShape::linear(rows, cols, n_tok);
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| GpuError::invalid(format!("gemm_f16: {v} does not fit an int")));
        let (m, n, k, lda, ldb, ldc) = (dim(g.m)?, dim(g.n)?, dim(g.k)?, dim(g.lda)?, dim(g.ldb)?, dim(g.ldc)?);
        let op = |t: bool| if t { sys::cublasOperation_t::CUBLAS_OP_T } else { sys::cublasOperation_t::CUBLAS_OP_N };
        let (alpha, beta) = (1f32, 0f32);
        let (wp, _a) = w.device_ptr(stream);
        let (xp, _b) = x.device_ptr(stream);
        let (yp, _c) = y.device_ptr_mut(stream);
        // SAFETY: checked above: A, B and C hold the m·k, k·n and m·n values
        // the shape names, all on the handle's stream; alpha and beta are
        // host values read when the call is enqueued.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(g.transa),
                op(g.transb),
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                wp as *const c_void,
                sys::cudaDataType::CUDA_R_16F,
                lda,
                xp as *const c_void,
                sys::cudaDataType::CUDA_R_16F,
                ldb,
                (&beta as *const f32).cast(),
                yp as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(blas_err("gemm_f16"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's GEMM as its documentation defines it, column-major.
    fn colmajor_gemm(g: &GemmShape, a: &[f32], b: &[f32]) -> Vec<f32> {
        let at = |i: usize, p: usize| if g.transa { a[i * g.lda + p] } else { a[p * g.lda + i] };
        let bt = |p: usize, j: usize| if g.transb { b[p * g.ldb + j] } else { b[j * g.ldb + p] };
        let mut c = vec![0f32; g.ldc * g.n];
        for j in 0..g.n {
            for i in 0..g.m {
                c[j * g.ldc + i] = (0..g.k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn the_linear_shape_computes_x_times_w_transposed_row_major() {
        let (rows, cols, n_tok) = (5, 7, 3);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let x: Vec<f32> = (0..n_tok * cols).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
        let got = colmajor_gemm(&GemmShape::linear(rows, cols, n_tok), &w, &x);
        for t in 0..n_tok {
            for r in 0..rows {
                let want: f32 = (0..cols).map(|k| w[r * cols + k] * x[t * cols + k]).sum();
                assert_eq!(got[t * rows + r], want, "y[{t}][{r}]");
            }
        }
    }

    #[test]
    fn steps_take_the_gemm_from_the_knobs_row_count_when_it_is_ready() {
        assert_eq!(product_path(8, 9, true), ProductPath::Matvec);
        assert_eq!(product_path(9, 9, true), ProductPath::Gemm);
        assert_eq!(product_path(512, 9, false), ProductPath::Matvec, "no cuBLAS or no f16 weights");
        assert_eq!(product_path(512, 0, true), ProductPath::Matvec, "0 turns the GEMM off");
    }

    #[test]
    fn cublas_failures_are_classified() {
        use sys::cublasStatus_t as S;
        assert_eq!(classify(S::CUBLAS_STATUS_ALLOC_FAILED), GpuErrorKind::OutOfMemory);
        assert_eq!(classify(S::CUBLAS_STATUS_EXECUTION_FAILED), GpuErrorKind::DeviceLost);
        assert_eq!(classify(S::CUBLAS_STATUS_NOT_INITIALIZED), GpuErrorKind::Unavailable);
        assert_eq!(classify(S::CUBLAS_STATUS_INVALID_VALUE), GpuErrorKind::Invalid);
    }
}
