//! pdmesh router: the public `pdmesh.router.v1.Router/Generate`. Tokenizes
//! through the tokenizer service, picks the least busy prefill and decode
//! workers from discovery, dispatches to both at once (the decode reserves
//! KV blocks and opens the transfer ticket, the prefill fills them), streams
//! detokenized deltas, and ends every request with a finish or one clear
//! status — cancelling the transfer so both workers free their blocks.

pub mod config;
mod dispatch;
mod error;
mod flow;
mod load;
pub mod pick;
mod relay;
pub mod server;
mod stall;
pub mod state;
pub mod stop;
mod validate;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_core::admin::AdminState;
use pdmesh_core::metrics::{Format, Text};
use pdmesh_core::peers::Peers;
use pdmesh_core::serve::{serve_grpc, Admin, Grpc, ServeError};
use pdmesh_core::vocab::metric;
use pdmesh_proto::router::v1 as pb;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::state::{Metrics, Router};

fn render(m: &Metrics, f: Format) -> String {
    let mut t = Text::new(f);
    t.gauge(metric::router::IN_FLIGHT, "Requests being served.", m.in_flight.load(Ordering::Relaxed) as f64)
        .histogram(metric::router::TTFT_SECONDS, "Time from request arrival to the first token.", &m.ttft)
        .histogram(metric::router::INTER_TOKEN_SECONDS, "Gap between consecutive tokens of a request.", &m.itl)
        .histogram(metric::router::REQUEST_SECONDS, "Time from request arrival to its end.", &m.e2e)
        .counter(
            metric::router::PROMPT_TOKENS_TOTAL,
            "Prompt tokens of finished requests.",
            m.prompt_tokens.load(Ordering::Relaxed),
        )
        .counter(
            metric::router::COMPLETION_TOKENS_TOTAL,
            "Tokens generated for finished requests.",
            m.completion_tokens.load(Ordering::Relaxed),
        );
    t.counter(
        metric::router::CACHED_TOKENS_TOTAL,
        "Prompt tokens of finished requests whose KV came from a worker's prefix cache.",
        m.cached_tokens.load(Ordering::Relaxed),
    )
    .counter(
        metric::router::ROUTE_OVERLAP_TOKENS_TOTAL,
        "Prompt tokens the chosen prefill workers were expected to hold in their prefix caches.",
        m.route_overlap_tokens.load(Ordering::Relaxed),
    );
    t.labelled(
        metric::router::PREFILL_PICKS_TOTAL,
        "counter",
        "Prefill workers picked, by the policy branch taken.",
        "branch",
        &m.routes.counts(),
    );
    t.labelled(
        metric::router::PREFILL_MODE_TOTAL,
        "counter",
        "Requests by where their prompt was prefilled: local (by the decode worker) or remote (by a prefill worker).",
        "mode",
        &m.mode_counts(),
    );
    // The retry and migration counters: (name, help, value).
    let counters: [(&str, &str, &AtomicU64); 6] = [
        (metric::router::PREFILL_RETRIES_TOTAL, "Requests dispatched again because their prefill failed before the first token.", &m.prefill_retries),
        (metric::router::DECODE_RETRIES_TOTAL, "Requests dispatched again because their decode worker died or broke before the first token.", &m.decode_retries),
        (metric::router::MIGRATIONS_TOTAL, "Requests moved to another decode worker after tokens had reached the caller.", &m.migrations),
        (metric::router::HANDOVERS_TOTAL, "Migrations off a draining decode worker that ship the sequence's KV along (no replay), admitted by the next decode worker.", &m.handovers),
        (metric::router::HANDOVER_FALLBACKS_TOTAL, "Migrations off a draining decode worker that replayed the tokens instead: the KV shipment or its receiver failed.", &m.handover_fallbacks),
        (metric::router::KV_CORRUPT_RETRIES_TOTAL, "Dispatches repeated because the prompt's KV failed its checksum at the decode worker (transferred again, then prefilled there).", &m.kv_corrupt_retries),
    ];
    for (name, help, value) in counters {
        t.counter(name, help, value.load(Ordering::Relaxed));
    }
    m.outcomes.render(&mut t, metric::router::REQUESTS_TOTAL, "Finished requests by outcome.");
    let by_kind = |v: &[AtomicU64; 2]| -> Vec<(&str, f64)> {
        stall::Kind::ALL.iter().map(|k| (k.label(), v[*k as usize].load(Ordering::Relaxed) as f64)).collect()
    };
    let families: [(&str, &str, &str, &[AtomicU64; 2]); 3] = [
        (metric::router::STALLS_TOTAL, "counter", "Calls moved off a worker that stopped making progress (no load answer, or its engine loop stuck, past the patience).", &m.stalls),
        (metric::router::EJECTIONS_TOTAL, "counter", "Strikes that left a worker out of picking: a stalled or lost call.", &m.ejections),
        (metric::router::WORKERS_OUT, "gauge", "Workers out of picking now: ejected, on probation or silent (details in /statusz runtime.workers_out).", &m.workers_out),
    ];
    for (name, kind, help, v) in families {
        t.labelled(name, kind, help, "kind", &by_kind(v));
    }
    t.finish()
}

/// Keep /statusz `runtime.workers_out` (which workers this router leaves
/// out of picking, and why) and its gauge current.
async fn report_outliers(router: Arc<Router>, admin: AdminState) {
    let m = router.metrics.clone();
    pdmesh_core::outlier::publish(router.loads.outliers.clone(), admin, move |r| {
        for k in stall::Kind::ALL {
            let n = r.iter().filter(|w| w["kind"] == k.label()).count();
            m.workers_out[k as usize].store(n as u64, Ordering::Relaxed);
        }
    })
    .await
}

/// Serve the router on `listener` until `shutdown` resolves. Healthy once
/// at least one tokenizer, prefill and decode worker is live.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let policy = config.policy().map_err(ServeError::Setup)?;
    let knobs = config.outlier_knobs().map_err(ServeError::Setup)?;
    let metrics = Arc::new(Metrics::default());
    let m2 = metrics.clone();
    let admin = AdminState::new("router", serde_json::json!({ "config": config }), Arc::new(move |f| render(&m2, f)));
    let admin = Admin::start(&config.common, admin).await?;
    let c = &config.common;
    let router = Arc::new(Router {
        tokenizer: Peers::resolve(c, "tokenizer", &config.tokenizer_addr).map_err(ServeError::Setup)?,
        prefill: Peers::resolve(c, "prefill", &config.prefill_addr).map_err(ServeError::Setup)?,
        decode: Peers::resolve(c, "decode", &config.decode_addr).map_err(ServeError::Setup)?,
        broker: Peers::resolve(c, "kvbroker", &config.kvbroker_addr).map_err(ServeError::Setup)?,
        timeout: Duration::from_secs(config.request_timeout_s.max(1)),
        retries: config.retries,
        max_migrations: config.max_migrations,
        worker_wait: Duration::from_millis(config.worker_wait_ms),
        max_stop: config.max_stop,
        max_in_flight: config.max_in_flight.max(1),
        policy,
        max_local_prefill: config.max_local_prefill,
        metrics,
        loads: Arc::new(load::Loads::new(knobs)),
        info: Default::default(),
        next_id: Default::default(),
        next_ticket: Default::default(),
    });
    let workers = [router.prefill.clone(), router.decode.clone()];
    let poll = load::poll_loads(router.loads.clone(), workers, Duration::from_millis(250));
    let _poller = state::AbortOnDrop(tokio::spawn(poll));
    let _report = state::AbortOnDrop(tokio::spawn(report_outliers(router.clone(), admin.state.clone())));
    let routes = tonic::service::Routes::new(pb::router_server::RouterServer::new(server::Service(router.clone())));
    let grpc = Grpc { service: "router", name: "pdmesh.router.v1.Router", routes, hand_over: None };
    // Ready once every kind of worker is reachable.
    let ready = async move {
        loop {
            let all = [&router.tokenizer, &router.prefill, &router.decode, &router.broker]
                .iter()
                .all(|p| !p.instances().is_empty());
            if all {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    serve_grpc(admin, &config.common, grpc, listener, shutdown, ready).await
}
