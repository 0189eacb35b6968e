//! `meshctl status`: the registry's live instances, their health and load.

use std::time::Duration;

use pdmesh_core::discovery::{pooled_kind, Discovery};
use pdmesh_core::http::{get, metric};
use serde_json::json;

pub const SERVICES: [&str; 6] = ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"];

/// Meta of the `meshctl` registration: the model pools of a mesh of several models, comma-separated.
pub const META_POOLS: &str = "pools";

#[derive(clap::Args)]
pub struct Args {
    /// Where the mesh registers (default: the local file registry).
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Load gauges worth showing, per service: (JSON key, family).
fn load_gauges(service: &str) -> Vec<(&'static str, &'static str)> {
    use pdmesh_core::vocab::metric::{decode as d, gateway, prefill as p, router};
    match service {
        "decode" => vec![
            ("running", d::RUNNING),
            ("queued", d::QUEUED),
            ("awaiting_kv", d::AWAITING_KV),
            ("local_prefilling", d::LOCAL_PREFILLING),
            ("kv_blocks_used", d::KV_BLOCKS_USED),
            ("prefix_cached_blocks", d::WORKER.prefix_cached_blocks),
            ("kv_blocks_total", d::KV_BLOCKS_TOTAL),
        ],
        "prefill" => vec![
            ("running", p::RUNNING),
            ("queued", p::QUEUED),
            ("queued_tokens", p::QUEUED_TOKENS),
            ("expected_wait_seconds", p::EXPECTED_WAIT_SECONDS),
            ("kv_blocks_used", p::KV_BLOCKS_USED),
            ("kv_blocks_total", p::KV_BLOCKS_TOTAL),
        ],
        "router" => vec![("in_flight", router::IN_FLIGHT)],
        "gateway" => vec![("in_flight", gateway::IN_FLIGHT)],
        _ => vec![],
    }
}

fn load_of(service: &str, metrics: &str) -> serde_json::Value {
    let mut o = serde_json::Map::new();
    for (key, family) in load_gauges(service) {
        if let Some(v) = metric(metrics, family) {
            o.insert(key.into(), if v.fract() == 0.0 { json!(v as i64) } else { json!(v) });
        }
    }
    let worker = match service {
        "prefill" => Some(pdmesh_core::vocab::metric::prefill::WORKER),
        "decode" => Some(pdmesh_core::vocab::metric::decode::WORKER),
        _ => None,
    };
    if let Some(w) = worker {
        o.insert("steps".into(), step_costs(&w, metrics));
    }
    serde_json::Value::Object(o)
}

/// A worker's step-time counters: two readings tell how its steps between
/// them compared with its normal.
fn step_costs(w: &pdmesh_core::vocab::metric::Worker, metrics: &str) -> serde_json::Value {
    let counters = [
        ("wall_seconds", w.step_wall_seconds_total),
        ("judged_seconds", w.step_judged_seconds_total),
        ("normal_seconds", w.step_normal_seconds_total),
        ("cpu_seconds", w.step_cpu_seconds_total),
        ("runq_seconds", w.step_runq_seconds_total),
    ];
    let mut o = serde_json::Map::new();
    for (key, family) in counters {
        if let Some(v) = metric(metrics, family) {
            o.insert(key.into(), json!(v));
        }
    }
    serde_json::Value::Object(o)
}

/// The model pools of the mesh `reg` holds, as its `meshctl up` announced
/// them (a mesh of one model: just None).
async fn pools(reg: &dyn Discovery) -> Vec<Option<String>> {
    let up = reg.healthy("meshctl").await.ok().and_then(|l| l.into_iter().next());
    match up.and_then(|u| u.meta.get(META_POOLS).cloned()) {
        Some(p) => p.split(',').map(|p| Some(p.to_string())).collect(),
        None => vec![None],
    }
}

/// Every live instance with health and load, as JSON: `service` is its
/// kind, `model` its pool (a mesh of several models).
pub async fn collect(reg: &dyn Discovery) -> Result<Vec<serde_json::Value>, String> {
    let mut out = Vec::new();
    let pools = pools(reg).await;
    for s in SERVICES {
        let kinds: Vec<(String, Option<String>)> = match s {
            "gateway" => vec![(s.to_string(), None)],
            _ => pools.iter().map(|p| (pooled_kind(s, p.as_deref()), p.clone())).collect(),
        };
        for (kind, pool) in kinds {
            out.extend(collect_kind(reg, s, &kind, pool).await?);
        }
    }
    Ok(out)
}

/// The live instances of one kind (`decode@gemma3-270m`), `s` its service.
async fn collect_kind(
    reg: &dyn Discovery,
    s: &str,
    kind: &str,
    pool: Option<String>,
) -> Result<Vec<serde_json::Value>, String> {
    let mut out = Vec::new();
    for inst in reg.healthy(kind).await.map_err(|e| e.to_string())? {
        let (health, load, left_out) = match &inst.http_addr {
            Some(h) => {
                let h2 = h.clone();
                let health = tokio::task::spawn_blocking(move || get(&h2, "/health", Duration::from_secs(2)))
                    .await
                    .ok()
                    .and_then(Result::ok);
                let h3 = h.clone();
                let m = tokio::task::spawn_blocking(move || get(&h3, "/metrics", Duration::from_secs(2)))
                    .await
                    .ok()
                    .and_then(Result::ok);
                let health = match health {
                    Some((200, _)) => "healthy",
                    Some(_) => "not ready",
                    None => "unreachable",
                };
                let mut load = m.map(|(_, body)| load_of(s, &body)).unwrap_or(json!({}));
                let mut left_out = json!(null);
                if matches!(s, "prefill" | "decode" | "router" | "gateway") {
                    let h4 = h.clone();
                    let st = tokio::task::spawn_blocking(move || get(&h4, "/statusz", Duration::from_secs(2)))
                        .await
                        .ok()
                        .and_then(Result::ok);
                    let v: serde_json::Value = st.and_then(|(_, b)| serde_json::from_str(&b).ok()).unwrap_or_default();
                    if let Some(t) = v["config"]["transport"].as_str() {
                        load["transport"] = json!(t);
                    }
                    // A router's own evidence: the workers it leaves out of picking, and why.
                    left_out = v["runtime"]["workers_out"].clone();
                }
                (health, load, left_out)
            }
            None => ("unknown", json!({}), json!(null)),
        };
        let mut v = json!({ "service": s, "id": inst.id, "grpc_addr": inst.grpc_addr, "http_addr": inst.http_addr, "health": health, "load": load });
        if left_out.as_array().is_some_and(|a| !a.is_empty()) {
            v["workers_out"] = left_out;
        }
        if let Some(p) = &pool {
            v["model"] = json!(p);
        }
        out.push(v);
    }
    Ok(out)
}

/// The running `meshctl up`'s view of its processes (running, restarting
/// after a backoff, left down after a crash loop), if one is registered.
async fn supervisor(reg: &dyn Discovery) -> Option<Vec<serde_json::Value>> {
    from_meshctl(reg, "/v1/processes").await
}

/// A JSON document from the running `meshctl up`'s control endpoint.
async fn from_meshctl<T: serde::de::DeserializeOwned>(reg: &dyn Discovery, path: &'static str) -> Option<T> {
    let up = reg.healthy("meshctl").await.ok()?.into_iter().next()?;
    let addr = up.http_addr?;
    let got = tokio::task::spawn_blocking(move || get(&addr, path, Duration::from_secs(2))).await.ok()?;
    match got {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

fn print_table(list: &[serde_json::Value]) {
    // Ids of a mesh of several models carry their pool: `decode@gemma3-270m-0`.
    let w = list.iter().filter_map(|i| i["id"].as_str()).map(str::len).max().unwrap_or(0).max(14);
    println!("{:<10} {:<w$} {:<22} {:<22} {:<12} load", "SERVICE", "ID", "ADDR", "HTTP", "HEALTH");
    for i in list {
        let load = i["load"]
            .as_object()
            .map(|o| {
                o.iter().filter(|(_, v)| !v.is_object()).map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
            })
            .unwrap_or_default();
        println!(
            "{:<10} {:<w$} {:<22} {:<22} {:<12} {}",
            i["service"].as_str().unwrap_or(""),
            i["id"].as_str().unwrap_or(""),
            i["grpc_addr"].as_str().unwrap_or(""),
            i["http_addr"].as_str().unwrap_or("-"),
            i["health"].as_str().unwrap_or(""),
            load
        );
    }
}

pub async fn run(a: Args) -> Result<(), String> {
    let registry = a.discovery.open_or_default()?;
    let list = collect(&*registry).await?;
    let procs = supervisor(&*registry).await;
    let autoscaler: Option<serde_json::Value> = from_meshctl(&*registry, "/v1/autoscaler").await;
    if a.json {
        let v = json!({ "discovery": registry.describe(), "instances": list, "supervisor": procs, "autoscaler": autoscaler });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    if list.is_empty() {
        println!("no live instances in {}", registry.describe());
    } else {
        print_table(&list);
    }
    // What the supervisor holds that is not simply running: crash loops, backoffs, drains.
    for p in procs.iter().flatten().filter(|p| p["state"] != "running") {
        println!(
            "meshctl up: {} {} (restarts {}, last exit: {})",
            p["name"].as_str().unwrap_or(""),
            p["state"].as_str().unwrap_or(""),
            p["restarts"],
            p["last_exit"].as_str().unwrap_or("-")
        );
    }
    // Workers a router routes around on its own evidence, whatever discovery says.
    for r in &list {
        for w in r["workers_out"].as_array().into_iter().flatten() {
            println!(
                "{} by {}: {} {}: {}",
                w["standing"].as_str().unwrap_or(""),
                r["id"].as_str().unwrap_or(""),
                w["kind"].as_str().unwrap_or(""),
                w["worker"].as_str().unwrap_or(""),
                w["why"].as_str().unwrap_or("")
            );
        }
    }
    // The autoscaler's view: each kind's desired replicas and why.
    for k in autoscaler.iter().flat_map(|a| a["kinds"].as_array().cloned().unwrap_or_default()) {
        println!(
            "autoscale: {} wants {}: {}",
            k["kind"].as_str().unwrap_or(""),
            k["desired"],
            k["reason"].as_str().unwrap_or("")
        );
    }
    Ok(())
}
