//! pdmesh KV-transfer broker: the control plane of KV moves between prefill
//! and decode workers — agent registry, transfer tickets with leases, and
//! fan-out of every state change to whoever watches a ticket, so an abort on
//! either side frees blocks on both. Data never passes through it.

pub mod caller;
pub mod config;
pub mod error;
pub mod server;
pub mod tickets;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_core::admin::AdminState;
use pdmesh_core::metrics::{Format, Text};
use pdmesh_core::serve::{serve_grpc, Admin, Grpc, ServeError};
use pdmesh_core::vocab::metric;
use pdmesh_proto::kvbroker::v1 as pb;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::tickets::Tickets;

fn render_metrics(t: &Tickets, expired_total: u64, f: Format) -> String {
    let counts = t.count_by_state();
    let states: Vec<(String, f64)> = [
        pb::TicketState::Unspecified,
        pb::TicketState::Open,
        pb::TicketState::Claimed,
        pb::TicketState::Writing,
        pb::TicketState::Done,
        pb::TicketState::Failed,
        pb::TicketState::Cancelled,
        pb::TicketState::Expired,
    ]
    .into_iter()
    .map(|st| {
        let name = st.as_str_name().trim_start_matches("TICKET_STATE_").to_lowercase();
        let name = if name == "unspecified" { "expected".to_string() } else { name };
        (name, counts.get(&st).copied().unwrap_or(0) as f64)
    })
    .collect();
    let states: Vec<(&str, f64)> = states.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    let mut m = Text::new(f);
    m.labelled(metric::kvbroker::TICKETS, "gauge", "Tickets held by the broker, by state.", "state", &states).counter(
        metric::kvbroker::LEASE_EXPIRIES_TOTAL,
        "Tickets ended by lease expiry.",
        expired_total,
    );
    m.finish()
}

/// Serve the broker on `listener` until `shutdown` resolves.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let table = Tickets::new(Duration::from_secs(config.retention_s), config.max_tickets)
        .with_max_per_worker(config.max_tickets_per_worker);
    let tickets = Arc::new(Mutex::new(table));
    let expired_total = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (t2, e2) = (tickets.clone(), expired_total.clone());
    let admin = AdminState::new(
        "kvbroker",
        serde_json::to_value(&config).unwrap_or_default(),
        Arc::new(move |f| {
            let t = t2.lock().unwrap_or_else(|e| e.into_inner());
            render_metrics(&t, e2.load(std::sync::atomic::Ordering::Relaxed), f)
        }),
    );
    let admin = Admin::start(&config.common, admin).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Lease clock.
    let (t3, e3, mut rx) = (tickets.clone(), expired_total.clone(), stop_rx.clone());
    let tick = Duration::from_millis(config.tick_ms.max(1));
    tokio::spawn(async move {
        let mut every = tokio::time::interval(tick);
        loop {
            tokio::select! {
                _ = every.tick() => {
                    let n = t3.lock().unwrap_or_else(|e| e.into_inner()).tick(server::now_ms()).len();
                    e3.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                }
                _ = rx.wait_for(|s| *s) => return,
            }
        }
    });
    let broker = server::Broker {
        tickets,
        agents: Mutex::new(Default::default()),
        max_lease_ms: config.max_lease_ms,
        max_agents: config.max_agents.max(1),
        agent_ttl_ms: config.agent_ttl_s.saturating_mul(1000),
    };
    let routes = tonic::service::Routes::new(pb::kv_broker_server::KvBrokerServer::new(broker));
    let grpc = Grpc { service: "kvbroker", name: "pdmesh.kvbroker.v1.KvBroker", routes, hand_over: None };
    let r = serve_grpc(admin, &config.common, grpc, listener, shutdown, std::future::ready(())).await;
    let _ = stop_tx.send(true);
    r
}
