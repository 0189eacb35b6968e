//! infra/ checked offline: the Kubernetes manifests against the Kubernetes
//! schemas (`kubernetes-validate --strict`, which scripts/test.sh
//! installs), and every pdmesh flag the manifests and the compose file pass
//! against the binaries' own `--help`, so a renamed flag cannot leave a
//! deployment file behind.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const K8S: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../infra/k8s/pdmesh.yaml");
const COMPOSE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../infra/compose.yaml");
const KINDS: [&str; 6] = ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"];

fn bin(name: &str) -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_meshctl")).with_file_name(name)
}

/// Every YAML document of `path`, as JSON (PyYAML comes with kubernetes-validate).
fn yaml_docs(path: &str) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump(list(yaml.safe_load_all(open(sys.argv[1]))), sys.stdout)",
            path,
        ])
        .output()
        .expect("python3");
    assert!(out.status.success(), "{path} is not YAML: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn help(bin: &Path, sub: &[&str]) -> String {
    let out = Command::new(bin).args(sub).arg("--help").output().unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `--flag` of each `--flag=value` or `--flag` argument.
fn flags(args: &[Value]) -> Vec<String> {
    args.iter()
        .filter_map(Value::as_str)
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_string())
        .collect()
}

fn assert_known(flags: &[String], help: &str, what: &str) {
    for f in flags {
        let known = help.lines().any(|l| l.trim_start().split([' ', ',']).any(|w| w == f));
        assert!(known, "{what} passes {f}, which its --help does not know");
    }
}

#[test]
fn the_kubernetes_manifests_validate_against_the_schemas() {
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "--quiet", "-k", "1.30.0", K8S])
        .output()
        .expect("kubernetes-validate is installed (scripts/test.sh installs it from PyPI)");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && !text.contains("ERROR"), "infra/k8s/pdmesh.yaml:\n{text}");
}

#[test]
fn each_kind_is_deployed_with_consul_health_and_a_drain_long_enough() {
    let docs = yaml_docs(K8S);
    let deployments: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Deployment").collect();
    for kind in KINDS {
        let d = deployments
            .iter()
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == kind)
            .unwrap_or_else(|| panic!("no Deployment for {kind}"));
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let name = format!("pdmesh-{kind}");
        assert_eq!(c["command"][0], name.as_str());
        let args = c["args"].as_array().unwrap();
        assert_known(&flags(args), &help(&bin(&name), &[]), &format!("the {kind} Deployment"));
        let has = |prefix: &str| args.iter().any(|a| a.as_str().is_some_and(|a| a.starts_with(prefix)));
        assert!(has("--discovery=consul://"), "{kind} registers with Consul");
        assert!(
            has("--listen=$(POD_IP):") && has("--http-listen=$(POD_IP):"),
            "{kind} binds its pod address, not 0.0.0.0"
        );
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health", "{kind}");
        assert!(
            c["resources"]["requests"]["cpu"].is_string() && c["resources"]["requests"]["memory"].is_string(),
            "{kind}"
        );
        // SIGTERM drains: the grace must cover the drain timeout, the notice and closing.
        let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        let timeout: u64 = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "PDMESH_DRAIN_TIMEOUT_S")
            .and_then(|e| e["value"].as_str()?.parse().ok())
            .unwrap_or(30);
        assert!(grace >= timeout + 1 + 5, "{kind}: grace {grace} s for a {timeout} s drain");
    }
    let broker = deployments.iter().find(|d| d["metadata"]["name"] == "pdmesh-kvbroker").unwrap();
    assert_eq!(broker["spec"]["strategy"]["type"], "Recreate", "never two brokers at once");
    let gw = deployments.iter().find(|d| d["metadata"]["name"] == "pdmesh-gateway").unwrap();
    assert!(
        gw["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"].is_object(),
        "the gateway leaves its Service first"
    );
}

#[test]
fn the_compose_file_runs_the_mesh_on_consul_with_known_flags() {
    let docs = yaml_docs(COMPOSE);
    let pdmesh = &docs[0]["services"]["pdmesh"];
    let cmd = pdmesh["command"].as_array().unwrap();
    assert_eq!(cmd[0], "up");
    assert_known(&flags(cmd), &help(&bin("meshctl"), &["up"]), "compose's meshctl up");
    assert!(cmd.iter().any(|a| a.as_str().is_some_and(|a| a.starts_with("--discovery=consul://"))), "{cmd:?}");
    let consul = &docs[0]["services"]["consul"];
    assert!(!consul["command"].to_string().contains("0.0.0.0"), "the dev agent binds loopback only");
    for p in consul["ports"].as_array().unwrap() {
        assert!(p.as_str().unwrap().starts_with("127.0.0.1:"), "published on loopback only: {p}");
    }
}
