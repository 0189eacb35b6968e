//! `meshctl status`: the registry's live instances, their health and load.

use std::time::Duration;

use pdmesh_core::discovery::Discovery;
use pdmesh_core::http::{get, metric};
use serde_json::json;

pub const SERVICES: [&str; 6] = ["tokenizer", "kvbroker", "prefill", "decode", "router", "gateway"];

#[derive(clap::Args)]
pub struct Args {
    /// Where the mesh registers (default: the local file registry).
    #[command(flatten)]
    pub discovery: pdmesh_core::discovery::DiscoveryArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Load gauges worth showing, per service.
fn load_of(service: &str, metrics: &str) -> serde_json::Value {
    let names: &[&str] = match service {
        "decode" => &[
            "running",
            "queued",
            "awaiting_kv",
            "local_prefilling",
            "kv_blocks_used",
            "prefix_cached_blocks",
            "kv_blocks_total",
        ],
        "prefill" => {
            &["running", "queued", "queued_tokens", "expected_wait_seconds", "kv_blocks_used", "kv_blocks_total"]
        }
        "router" | "gateway" => &["in_flight"],
        _ => &[],
    };
    let mut o = serde_json::Map::new();
    for n in names {
        if let Some(v) = metric(metrics, &format!("pdmesh_{service}_{n}")) {
            o.insert((*n).into(), if v.fract() == 0.0 { json!(v as i64) } else { json!(v) });
        }
    }
    if matches!(service, "prefill" | "decode") {
        o.insert("steps".into(), step_costs(service, metrics));
    }
    serde_json::Value::Object(o)
}

/// A worker's step-time counters (`pdmesh_<kind>_step_*_seconds_total`):
/// two readings tell how its steps between them compared with its normal.
fn step_costs(service: &str, metrics: &str) -> serde_json::Value {
    let mut o = serde_json::Map::new();
    for n in ["wall", "judged", "normal", "cpu", "runq"] {
        if let Some(v) = metric(metrics, &format!("pdmesh_{service}_step_{n}_seconds_total")) {
            o.insert(format!("{n}_seconds"), json!(v));
        }
    }
    serde_json::Value::Object(o)
}

/// Every live instance with health and load, as JSON.
pub async fn collect(reg: &dyn Discovery) -> Result<Vec<serde_json::Value>, String> {
    let mut out = Vec::new();
    for s in SERVICES {
        for inst in reg.healthy(s).await.map_err(|e| e.to_string())? {
            let (health, load) = match &inst.http_addr {
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
                    if matches!(s, "prefill" | "decode") {
                        let h4 = h.clone();
                        let st = tokio::task::spawn_blocking(move || get(&h4, "/statusz", Duration::from_secs(2)))
                            .await
                            .ok()
                            .and_then(Result::ok);
                        let v: serde_json::Value =
                            st.and_then(|(_, b)| serde_json::from_str(&b).ok()).unwrap_or_default();
                        if let Some(t) = v["config"]["transport"].as_str() {
                            load["transport"] = json!(t);
                        }
                    }
                    (health, load)
                }
                None => ("unknown", json!({})),
            };
            out.push(json!({ "service": s, "id": inst.id, "grpc_addr": inst.grpc_addr, "http_addr": inst.http_addr, "health": health, "load": load }));
        }
    }
    Ok(out)
}

/// The running `meshctl up`'s view of its processes (running, restarting
/// after a backoff, left down after a crash loop), if one is registered.
async fn supervisor(reg: &dyn Discovery) -> Option<Vec<serde_json::Value>> {
    let up = reg.healthy("meshctl").await.ok()?.into_iter().next()?;
    let addr = up.http_addr?;
    let got = tokio::task::spawn_blocking(move || get(&addr, "/v1/processes", Duration::from_secs(2))).await.ok()?;
    match got {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

fn print_table(list: &[serde_json::Value]) {
    println!("{:<10} {:<14} {:<22} {:<22} {:<12} load", "SERVICE", "ID", "ADDR", "HTTP", "HEALTH");
    for i in list {
        let load = i["load"]
            .as_object()
            .map(|o| {
                o.iter().filter(|(_, v)| !v.is_object()).map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
            })
            .unwrap_or_default();
        println!(
            "{:<10} {:<14} {:<22} {:<22} {:<12} {}",
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
    if a.json {
        let v = json!({ "discovery": registry.describe(), "instances": list, "supervisor": procs });
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
    Ok(())
}
