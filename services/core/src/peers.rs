//! The instances of another service this one talks to: either fixed
//! addresses from flags, or followed through discovery (new instances are
//! used within a poll period, dead ones dropped). Channels are cached per
//! address and connect lazily.

use std::sync::Arc;
use std::time::Duration;

use tonic::transport::Channel;

use crate::args::CommonArgs;
use crate::discovery::{watch, Discovery, Instance};
use crate::grpc::Channels;

/// Shortest gap between two discovery queries of a peer set: the file
/// registry is re-read at this period; Consul's blocking queries return as
/// soon as the set changes, and no sooner than this after the last one.
pub const POLL: Duration = Duration::from_millis(300);

#[derive(Clone)]
pub struct Peers {
    service: String,
    rx: tokio::sync::watch::Receiver<Vec<Instance>>,
    // Keeps a fixed set's sender alive.
    _fixed: Option<Arc<tokio::sync::watch::Sender<Vec<Instance>>>>,
    channels: Arc<Channels>,
}

impl Peers {
    /// Instances of `service` at fixed addresses.
    pub fn fixed(service: &str, addrs: &[String]) -> Peers {
        let list = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| Instance {
                service: service.into(),
                id: format!("{service}-{i}"),
                grpc_addr: a.clone(),
                http_addr: None,
                meta: Default::default(),
            })
            .collect();
        let (tx, rx) = tokio::sync::watch::channel(list);
        Peers { service: service.into(), rx, _fixed: Some(Arc::new(tx)), channels: Default::default() }
    }

    /// Instances of `service` as discovery sees them.
    pub fn discovered(d: Arc<dyn Discovery>, service: &str) -> Peers {
        Peers { service: service.into(), rx: watch(d, service, POLL), _fixed: None, channels: Default::default() }
    }

    /// Fixed addresses when given, else discovery as `common` configures
    /// it; an error when neither is configured.
    pub fn resolve(common: &CommonArgs, service: &str, addrs: &[String]) -> Result<Peers, String> {
        if !addrs.is_empty() {
            return Ok(Peers::fixed(service, addrs));
        }
        match common.open_discovery()? {
            Some(d) => Ok(Peers::discovered(d, service)),
            None => Err(format!("no address for the {service} service: give --{service}-addr or --discovery")),
        }
    }

    pub fn service(&self) -> &str {
        &self.service
    }

    /// The live instances now.
    pub fn instances(&self) -> Vec<Instance> {
        self.rx.borrow().clone()
    }

    /// Wait up to `timeout` for at least one instance.
    pub async fn wait_any(&self, timeout: Duration) -> Option<Vec<Instance>> {
        let mut rx = self.rx.clone();
        let r = tokio::time::timeout(timeout, rx.wait_for(|l| !l.is_empty())).await;
        match r {
            Ok(Ok(l)) => Some(l.clone()),
            _ => None,
        }
    }

    /// A (cached, lazily connecting) channel to `inst`.
    pub fn channel(&self, inst: &Instance) -> Result<Channel, String> {
        self.channels.get(&inst.grpc_addr)
    }

    /// A channel to the instance at `grpc_addr`, announced or not (one
    /// that left discovery to drain still answers its callers).
    pub fn channel_to(&self, grpc_addr: &str) -> Result<Channel, String> {
        self.channels.get(grpc_addr)
    }

    /// The first live instance and a channel to it, waiting up to `timeout`.
    pub async fn first(&self, timeout: Duration) -> Result<(Instance, Channel), String> {
        let list = self.wait_any(timeout).await.ok_or_else(|| format!("no live {} instance", self.service))?;
        let inst = list[0].clone();
        let ch = self.channel(&inst)?;
        Ok((inst, ch))
    }
}
