//! `meshctl up`: the whole mesh on this machine, supervised.

use std::time::Duration;

use crate::flags::Args;
use crate::jaeger::Jaeger;
use crate::process::write_prometheus_sd;
use crate::supervisor::{start_all, stop_all, Mesh};
use crate::{control, plan};

pub async fn run(a: Args) -> Result<(), String> {
    let policy = a.autoscale.as_deref().map(pdmesh_planner::Policy::load).transpose()?;
    let mut ctx = plan::context(a).await?;
    if policy.is_some() && ctx.pools.len() > 1 {
        return Err(format!("--autoscale scales a mesh of one model; this one serves {}", ctx.pools.len()));
    }
    // Jaeger first, so every service exports to it from its first span.
    let jaeger = match ctx.a.jaeger.jaeger {
        true => Some(Jaeger::start(&ctx.a.jaeger, &ctx.a.cache.dir(), ctx.log_dir())?),
        false => None,
    };
    if let Some(j) = &jaeger {
        ctx.a.telemetry.otlp_endpoint = Some(j.otlp.clone());
    }
    let mut svcs = ctx.plan()?;
    let mut stop = Box::pin(pdmesh_core::signal::shutdown_signal());
    let started = start_all(&mut svcs, Duration::from_secs(ctx.a.ready_timeout_s), &mut stop).await;
    let started = started.and_then(|_| ctx.a.prometheus_sd.as_ref().map_or(Ok(()), |f| write_prometheus_sd(f, &svcs)));
    if let Err(e) = started {
        stop_all(&mut svcs, Duration::from_secs(5)).await;
        return Err(e);
    }
    if let Some(f) = &ctx.a.prometheus_sd {
        eprintln!("meshctl: Prometheus targets in {}", f.display());
    }
    let mut mesh = Mesh::new(ctx, svcs);
    let autoscaler = policy.as_ref().map(|_| crate::autoscale::Shared::default());
    let control = control::open(&mesh, autoscaler.clone()).await;
    if let Err(e) = &control {
        eprintln!("meshctl: no control endpoint ({e}); scale, drain, restart and autoscale are unavailable");
    }
    let _scaler = match (policy, &control, autoscaler) {
        (Some(p), Ok(c), Some(state)) => {
            let reg = mesh.ctx.a.discovery.open(&mesh.ctx.locator).map_err(|e| e.to_string())?;
            eprintln!("meshctl: autoscaling every {} s", p.timing.interval_s);
            Some(crate::autoscale::start(p, reg, state, c.tx.clone()))
        }
        _ => None,
    };
    println!("pdmesh is up: http://{}/v1 (discovery {}); Ctrl-C stops it", mesh.ctx.a.gateway_addr, mesh.ctx.locator);
    if let Some(j) = &jaeger {
        println!("traces: {} (Jaeger UI; search service pdmesh-gateway)", j.ui);
    }
    mesh.supervise(control.ok(), &mut stop).await;
    eprintln!("meshctl: stopping (gateway first)");
    let grace = mesh.ctx.a.drain.grace();
    stop_all(&mut mesh.svcs, grace).await;
    Ok(())
}
