//! The kvbroker client: a live broker, calls that survive its restart,
//! and a worker's registration kept alive.

use std::time::Duration;

use pdmesh_core::peers::Peers;
use pdmesh_proto::kvbroker::v1 as kpb;
use tonic::Status;

use crate::alive::LoopAlive;

pub type BrokerClient = kpb::kv_broker_client::KvBrokerClient<tonic::transport::Channel>;

/// A client of a live kvbroker (waits up to `timeout` for one to appear).
pub async fn broker(peers: &Peers, timeout: Duration) -> Result<BrokerClient, Status> {
    let (_, ch) = peers.first(timeout).await.map_err(Status::unavailable)?;
    Ok(kpb::kv_broker_client::KvBrokerClient::new(ch))
}

/// Pause before asking a kvbroker again after losing one.
pub const BROKER_RETRY: Duration = Duration::from_millis(200);

/// Run `call` (given a client and the time left) at a live kvbroker. While
/// the broker cannot be reached — killed, restarting — ask again, the
/// restarted one or another, until `patience` has passed. The answer, and
/// the client that gave it.
pub async fn at_broker<T, Fut>(
    peers: &Peers,
    patience: Duration,
    mut call: impl FnMut(BrokerClient, Duration) -> Fut,
) -> Result<(T, BrokerClient), Status>
where
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let until = tokio::time::Instant::now() + patience;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let r = match broker(peers, left.min(Duration::from_secs(2))).await {
            Ok(c) => call(c.clone(), left).await.map(|t| (t, c)),
            Err(e) => Err(e),
        };
        match r {
            Err(e) if pdmesh_core::grpc::peer_lost(&e) && left > BROKER_RETRY * 2 => {
                tokio::time::sleep(BROKER_RETRY).await
            }
            r => return r,
        }
    }
}

/// How often a worker registers its transfer endpoint again: a kvbroker
/// that restarted knows every worker again within this period.
pub const REGISTER_EVERY: Duration = Duration::from_secs(2);

/// Keep `agent` registered at the broker: now, and again every `every`
/// (a restarted broker learns it again). Returns once the first
/// registration succeeded; `ready` is told each outcome.
pub async fn keep_registered(
    peers: Peers,
    agent: kpb::Agent,
    every: Duration,
    ready: tokio::sync::watch::Sender<bool>,
) {
    let mut first = true;
    loop {
        let ok = match broker(&peers, every).await {
            Ok(mut c) => {
                let mut req = tonic::Request::new(kpb::RegisterAgentRequest { agent: Some(agent.clone()) });
                req.set_timeout(Duration::from_secs(2));
                c.register_agent(req).await.is_ok()
            }
            Err(_) => false,
        };
        if ok != *ready.borrow() || first {
            let _ = ready.send(ok);
        }
        first = false;
        tokio::time::sleep(if ok { every } else { Duration::from_millis(200) }).await;
        if ready.is_closed() {
            return;
        }
    }
}

/// A worker's transfer endpoint and the kvbroker(s) it registers it with.
pub struct BrokerLink {
    pub agent: kpb::Agent,
    pub broker: Peers,
    /// The engine loop: if it stops, the worker leaves service and exits
    /// with an error, so that its supervisor starts a fresh one.
    pub engine: LoopAlive,
    /// Out of service while the engine loop has made no progress this
    /// long (`--unhealthy-after-stall-s`; zero: never).
    pub unhealthy_after: std::time::Duration,
}
