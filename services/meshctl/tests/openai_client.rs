//! The official `openai` Python package (a client nobody here wrote)
//! against the gateway of a real mesh: chat and completions, streaming and
//! not, typed errors; API keys (the client's key, a wrong one, none, a
//! key's limits, revocation by editing the keys file). CI installs the
//! package (`.ci/run`).
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

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
    let dir = std::env::temp_dir().join(format!("pdmesh-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    // The limited key is given as its digest: the file need not hold secrets.
    let limited_key = "limited-key-0";
    let digest = sha256_hex(limited_key);
    std::fs::write(
        &keys,
        format!("# keys of the test\nci-key-7f3 name=ci concurrency=2\nsha256:{digest} name=limited rpm=1\n"),
    )
    .unwrap();
    let mesh = common::Mesh::up(&["--api-keys-file", keys.to_str().unwrap()]);
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/openai_client_check.py"))
        .args(["--base-url", &format!("http://{}/v1", mesh.gateway)])
        .args(["--api-key", "ci-key-7f3", "--limited-key", limited_key, "--keys-file", keys.to_str().unwrap()])
        .args(["--golden", &format!("{root}/services/engine/tests/data/smollm2.golden.json")])
        .output()
        .expect("run the openai client check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai client check failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("\"checks\": \"passed\""), "{stdout}");
    eprintln!("{stdout}");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refused = rt.block_on(mesh.gauge("gateway", "pdmesh_gateway_auth_refused_total{reason=\"invalid_key\"}"));
    assert!(refused >= 2.0, "the wrong key and the revoked one are counted: {refused}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn sha256_hex(s: &str) -> String {
    let out = Command::new("python3")
        .args(["-c", &format!("import hashlib; print(hashlib.sha256({s:?}.encode()).hexdigest())")])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}
