//! The `pdmesh-engine` binary as a user runs it.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{golden, ids, model_path};

fn cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pdmesh-engine"))
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

#[test]
fn tokenize_prints_golden_ids() {
    let m = model_path();
    let g = &golden()[1];
    let prompt = g["prompt"].as_str().unwrap();
    let raw = json(&cli().args(["tokenize", "--model"]).arg(&m).args(["--text", prompt]).output().unwrap());
    assert_eq!(ids(&raw["ids"]), ids(&g["raw_ids"]));
    let chat = json(&cli().args(["tokenize", "--chat", "--model"]).arg(&m).args(["--text", prompt]).output().unwrap());
    assert_eq!(ids(&chat["ids"]), ids(&g["chat_ids"]));
}

#[test]
fn generate_prints_ids_and_text_and_stops_at_eos() {
    let m = model_path();
    let out = json(
        &cli()
            .args(["generate", "--chat", "--max-tokens", "40", "--temperature", "0", "--model"])
            .arg(&m)
            .args(["--text", "Translate to French: Good morning, my friend."])
            .output()
            .unwrap(),
    );
    let got = ids(&out["ids"]);
    assert!(!got.is_empty() && got.len() <= 40);
    // Greedy stops at EOS (id 2) unless told otherwise; EOS is the last id.
    if out["finish_reason"] == "stop" {
        assert_eq!(*got.last().unwrap(), 2);
        assert!(!got[..got.len() - 1].contains(&2));
    }
    assert!(!out["text"].as_str().unwrap().is_empty());
    let ignore = json(
        &cli()
            .args(["generate", "--chat", "--max-tokens", "20", "--ignore-eos", "--model"])
            .arg(&m)
            .args(["--text", "Translate to French: Good morning, my friend."])
            .output()
            .unwrap(),
    );
    assert_eq!(ids(&ignore["ids"]).len(), 20);
    assert_eq!(ignore["finish_reason"], "length");
}

fn fails_with(args: &[&str], needle: &str) {
    let out = cli().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(err.contains(needle), "{args:?}: stderr {err:?} lacks {needle:?}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let m = model_path();
    let m = m.to_str().unwrap();
    fails_with(&["generate", "--model", m, "--text", "hi", "--max-tokens", "0"], "max_tokens must be at least 1");
    fails_with(&["generate", "--model", m, "--text", "hi", "--temperature", "9"], "temperature");
    fails_with(&["generate", "--model", "/nonexistent/x.gguf", "--text", "hi"], "cannot read model file");
    fails_with(&["tokenize", "--model", "/etc/hostname", "--text", "hi"], "not a GGUF file");
    let long = "hello ".repeat(9000);
    fails_with(&["generate", "--model", m, "--text", &long], "context holds");
    fails_with(&["generate", "--model", m, "--text", ""], "prompt is empty");

    // Invalid UTF-8 in an argument.
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"caf\xe9");
    let out = cli().args(["tokenize", "--model", m, "--text"]).arg(bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("invalid UTF-8"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
