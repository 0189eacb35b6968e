//! `meshctl up`: the whole mesh on this machine, supervised.

use std::time::Duration;

use crate::flags::Args;
use crate::jaeger::Jaeger;
use crate::process::write_prometheus_sd;
use crate::supervisor::{start_all, stop_all, Mesh};
use crate::{control, plan};

pub async fn run(a: Args) -> Result<(), String> {
    let mut ctx = plan::context(a).await?;
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
    let control = control::open(&mesh).await;
    if let Err(e) = &control {
        eprintln!("meshctl: no control endpoint ({e}); scale, drain and restart are unavailable");
    }
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
