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
    check_deployments(&yaml_docs(K8S), "infra/k8s/pdmesh.yaml");
}

/// Each kind's Deployment in `docs`: its binary, flags its --help knows,
/// Consul, its pod address, /health, resources, a grace that covers the
/// drain; the kvbroker replaced with Recreate, the gateway's preStop.
fn check_deployments(docs: &[Value], what: &str) {
    let deployments: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Deployment").collect();
    let of = |kind: &str| {
        deployments
            .iter()
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == kind)
            .copied()
            .unwrap_or_else(|| panic!("{what}: no Deployment for {kind}"))
    };
    for kind in KINDS {
        let d = of(kind);
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let name = format!("pdmesh-{kind}");
        assert_eq!(c["command"][0], name.as_str());
        let args = c["args"].as_array().unwrap();
        assert_known(&flags(args), &help(&bin(&name), &[]), &format!("{what}: the {kind} Deployment"));
        let has = |prefix: &str| args.iter().any(|a| a.as_str().is_some_and(|a| a.starts_with(prefix)));
        assert!(has("--discovery=consul://"), "{kind} registers with Consul");
        assert!(
            has("--listen=$(POD_IP):") && has("--http-listen=$(POD_IP):"),
            "{kind} binds its pod address, not 0.0.0.0"
        );
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health", "{kind}");
        // The ports the pod declares are the ones the binary binds; probes ask the admin one.
        let bound = |flag: &str| {
            args.iter()
                .filter_map(Value::as_str)
                .find_map(|a| a.strip_prefix(flag)?.rsplit(':').next()?.parse::<u64>().ok())
        };
        let ports = c["ports"].as_array().unwrap();
        let port = |name: &str| ports.iter().find(|p| p["name"] == name).and_then(|p| p["containerPort"].as_u64());
        assert_eq!(bound("--listen="), ports[0]["containerPort"].as_u64(), "{what}: {kind}'s service port");
        assert_eq!(bound("--http-listen="), port("admin"), "{what}: {kind}'s admin port");
        assert_eq!(c["readinessProbe"]["httpGet"]["port"], "admin", "{what}: {kind}");
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
    assert_eq!(of("kvbroker")["spec"]["strategy"]["type"], "Recreate", "{what}: never two brokers at once");
    assert!(
        of("gateway")["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"].is_object(),
        "{what}: the gateway leaves its Service first"
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

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../infra/helm/pdmesh");

/// Helm v4: PDMESH_HELM_BIN, else where scripts/gotool.sh helm builds it;
/// None (the test skipped) where neither is, unless PDMESH_REQUIRE_HELM.
fn helm_or_skip(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PDMESH_HELM_BIN").map(PathBuf::from).filter(|p| p.exists()).or_else(|| {
        let cache = std::env::var_os("PDMESH_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/pdmesh")))?;
        Some(cache.join("helm-v4.3.2/helm")).filter(|p| p.exists())
    });
    if found.is_none() {
        let why = "no Helm binary (run scripts/gotool.sh helm, or set PDMESH_HELM_BIN)";
        assert!(std::env::var_os("PDMESH_REQUIRE_HELM").is_none(), "{why}");
        pdmesh_testkit::skip(test, why);
    }
    found
}

/// `helm template` of the chart with `sets`, as JSON documents.
fn render(helm: &Path, sets: &[&str]) -> Vec<Value> {
    let mut cmd = Command::new(helm);
    cmd.args(["template", "pdmesh", CHART, "--namespace", "pdmesh"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "helm template {sets:?}: {}", String::from_utf8_lossy(&out.stderr));
    let file = std::env::temp_dir().join(format!("pdmesh-chart-{}-{}.yaml", std::process::id(), sets.len()));
    std::fs::write(&file, &out.stdout).unwrap();
    let docs = yaml_docs(file.to_str().unwrap()).into_iter().filter(|d| !d.is_null()).collect();
    let _ = std::fs::remove_file(&file);
    docs
}

/// The Helm chart (issue 42) lints, renders, validates against the
/// Kubernetes schemas, and cannot drift from the binaries: each kind's
/// flags, ports, probes and drain as for infra/k8s; the planner's advise
/// mode with flags `meshctl autoscale` knows and a policy that parses;
/// PDBs, a ServiceMonitor and KEDA's ScaledObjects when asked for.
#[test]
fn the_helm_chart_lints_renders_and_matches_the_binaries() {
    let Some(helm) = helm_or_skip("the_helm_chart_lints_renders_and_matches_the_binaries") else { return };
    let out = Command::new(&helm).args(["lint", "--strict", CHART]).output().unwrap();
    assert!(
        out.status.success(),
        "helm lint: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let plain = render(&helm, &[]);
    check_deployments(&plain, "the chart");
    // The core objects against the schemas (CRDs' objects are not in them).
    let file = std::env::temp_dir().join(format!("pdmesh-chart-{}.yaml", std::process::id()));
    let docs: Vec<String> = plain.iter().map(Value::to_string).collect();
    std::fs::write(&file, docs.join("\n---\n")).unwrap();
    let out =
        Command::new("kubernetes-validate").args(["--strict", "--quiet", "-k", "1.30.0"]).arg(&file).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && !text.contains("ERROR"), "the chart's objects:\n{text}");
    let _ = std::fs::remove_file(&file);
    // The planner in advise mode.
    let advisor =
        plain.iter().find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "pdmesh-autoscaler").unwrap();
    let c = &advisor["spec"]["template"]["spec"]["containers"][0];
    let args = c["args"].as_array().unwrap();
    assert_eq!((c["command"][0].as_str(), args[0].as_str()), (Some("meshctl"), Some("autoscale")));
    assert_known(&flags(args), &help(&bin("meshctl"), &["autoscale"]), "the chart's autoscaler");
    let policy = plain.iter().find(|d| d["kind"] == "ConfigMap").unwrap()["data"]["policy.toml"].as_str().unwrap();
    pdmesh_planner::Policy::parse(policy).unwrap_or_else(|e| panic!("the chart's policy: {e}"));
    let pdbs: Vec<&str> = plain
        .iter()
        .filter(|d| d["kind"] == "PodDisruptionBudget")
        .filter_map(|d| d["metadata"]["name"].as_str())
        .collect();
    assert_eq!(pdbs, ["pdmesh-gateway", "pdmesh-router"], "a PDB for each kind of 2 or more, never the kvbroker");
    // With KEDA and a ServiceMonitor: KEDA owns prefill's and decode's replicas.
    let full = render(&helm, &["keda.enabled=true", "serviceMonitor.enabled=true"]);
    check_deployments(&full, "the chart with KEDA");
    let scaled: Vec<&Value> = full.iter().filter(|d| d["kind"] == "ScaledObject").collect();
    assert_eq!(scaled.len(), 2);
    for s in scaled {
        let target = s["spec"]["scaleTargetRef"]["name"].as_str().unwrap();
        let d = full.iter().find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == target).unwrap();
        assert!(d["spec"]["replicas"].is_null(), "{target}: the Deployment leaves replicas to KEDA");
        assert!(s["spec"]["triggers"][0]["metadata"]["query"]
            .as_str()
            .unwrap()
            .contains("pdmesh_autoscaler_desired_replicas"));
    }
    assert_eq!(full.iter().filter(|d| d["kind"] == "ServiceMonitor").count(), 1);
    assert_eq!(full.iter().filter(|d| d["kind"] == "PodDisruptionBudget").count(), 4, "prefill and decode get theirs");
}
