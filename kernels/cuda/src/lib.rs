//! pdmesh's CUDA kernels: the sources (`kernels/cuda/*.cu`, each compiled
//! with `common.cuh` in front of it) and their compilation to PTX with
//! NVRTC, through cudarc's dynamic loading — so this crate builds and
//! loads on machines without CUDA, and only a call that needs NVRTC or a
//! GPU finds out.
//!
//! NVRTC needs no GPU and no driver: the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12` ships `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`.
//! Point `PDMESH_NVRTC_LIB` at that file, or put its folder on
//! `LD_LIBRARY_PATH`.

pub mod error;
pub mod gemm;
pub mod gpu;

use std::sync::OnceLock;

pub use cudarc::nvrtc::Ptx;

/// One kernel source file.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub file: &'static str,
    pub code: &'static str,
}

/// Block formats, f16 conversion and reductions every source uses.
pub const COMMON: &str = include_str!("../common.cuh");

macro_rules! source {
    ($f:literal) => {
        Source { file: $f, code: include_str!(concat!("../", $f)) }
    };
}

/// Every kernel source, in the order a forward pass uses them.
pub const SOURCES: [Source; 10] = [
    source!("embed.cu"),
    source!("dequant.cu"),
    source!("norm.cu"),
    source!("quantize.cu"),
    source!("matvec.cu"),
    source!("rope.cu"),
    source!("kv.cu"),
    source!("attention.cu"),
    source!("activation.cu"),
    source!("sample.cu"),
];

/// What the kernels are compiled for: PTX for sm_80 (A100) and sm_90
/// (H100/H200). They need sm_61 or later (`dp4a`).
pub const ARCHS: [&str; 2] = ["compute_80", "compute_90"];

/// Where the NVRTC library is, if not on the loader's path.
pub const NVRTC_ENV: &str = "PDMESH_NVRTC_LIB";

impl Source {
    /// The text NVRTC compiles: `common.cuh`, then this file (with `#line`
    /// so errors name the file and line).
    pub fn full(&self) -> String {
        format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}", self.file, self.code)
    }

    /// The kernels (`extern "C" __global__`) this file defines.
    pub fn kernels(&self) -> Vec<&'static str> {
        let code: &'static str = self.code;
        code.split("extern \"C\" __global__ void ")
            .skip(1)
            .filter_map(|rest| rest.split('(').next())
            .map(str::trim)
            .collect()
    }
}

/// Make NVRTC loadable: the file `$PDMESH_NVRTC_LIB` if set (loaded once
/// and kept, so cudarc's own lookup by soname finds it), else whatever the
/// loader's path holds. An error says how to get it.
pub fn nvrtc() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        if let Some(path) = std::env::var_os(NVRTC_ENV) {
            // SAFETY: loading NVRTC runs its initialisers, which have no
            // preconditions; the library stays loaded for the process.
            let lib = unsafe { libloading::Library::new(&path) }
                .map_err(|e| format!("{NVRTC_ENV}={}: cannot load it: {e}", path.to_string_lossy()))?;
            std::mem::forget(lib);
        }
        // SAFETY: only probes whether the library can be opened.
        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(format!(
                "NVRTC (libnvrtc.so.12) is not on this machine's loader path: `pip install nvidia-cuda-nvrtc-cu12`, then set {NVRTC_ENV} to its nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
            ))
        }
    })
    .clone()
}

/// Compile one source to PTX for `arch` (`compute_80`, `compute_90`, ...).
pub fn compile(src: &Source, arch: &'static str) -> Result<Ptx, String> {
    nvrtc()?;
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        name: Some(src.file.to_string()),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src.full(), opts).map_err(|e| format!("{} for {arch}: {e:?}", src.file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_defines_kernels() {
        let names: Vec<&str> = SOURCES.iter().flat_map(|s| s.kernels()).collect();
        assert_eq!(names.len(), 30, "{names:?}");
        for k in [
            "matvec_q4_1",
            "matvec_q8_0",
            "matvec_q4_k",
            "matvec_q6_k",
            "dequant_q5_0_f16",
            "attention",
            "rms_norm",
            "rope",
            "argmax",
            "sample_temperature",
        ] {
            assert!(names.contains(&k), "{k} missing from {names:?}");
        }
    }

    /// CI installs NVRTC from PyPI and sets PDMESH_REQUIRE_NVRTC, so there a
    /// missing NVRTC fails; elsewhere it is a skip, printed and counted.
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
        if let Err(why) = nvrtc() {
            assert!(std::env::var_os("PDMESH_REQUIRE_NVRTC").is_none(), "{why}");
            pdmesh_testkit::skip("every_kernel_compiles_with_nvrtc_for_sm80_and_sm90", &why);
            return;
        }
        let mut n = 0;
        for arch in ARCHS {
            for s in &SOURCES {
                let ptx = compile(s, arch).unwrap_or_else(|e| panic!("{e}"));
                let text = ptx.to_src();
                for k in s.kernels() {
                    assert!(text.contains(&format!(".entry {k}(")), "{}: no entry {k} in the PTX for {arch}", s.file);
                    n += 1;
                }
            }
        }
        eprintln!(
            "NVRTC compiled {} kernels from {} files for {}",
            n / ARCHS.len(),
            SOURCES.len(),
            ARCHS.join(" and ")
        );
    }
}
