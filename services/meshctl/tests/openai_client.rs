//! The official `openai` Python package (a client nobody here wrote)
//! against the gateway of a real mesh: chat and completions, streaming and
//! not, typed errors. CI installs the package (`.ci/run`).

mod common;

use std::process::Command;

#[test]
fn official_openai_client_gets_correct_answers() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let probe = Command::new("python3").args(["-c", "import openai"]).status().expect("python3");
    assert!(
        probe.success(),
        "the `openai` Python package is missing: python3 -m pip install openai (CI does this in .ci/run)"
    );
    let mesh = common::Mesh::up(&[]);
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/openai_client_check.py"))
        .args(["--base-url", &format!("http://{}/v1", mesh.gateway)])
        .args(["--golden", &format!("{root}/services/engine/tests/data/smollm2.golden.json")])
        .output()
        .expect("run the openai client check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai client check failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("\"checks\": \"passed\""), "{stdout}");
}
