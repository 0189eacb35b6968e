//! What every service does around its gRPC server: start the HTTP admin
//! endpoints, announce itself in the registry once ready, withdraw on
//! shutdown, and the `main` wrapper (bind, serve until a signal, exit code).

use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::admin::{serve_admin, AdminState};
use crate::args::CommonArgs;
use crate::discovery::{DiscoveryError, Instance, Registration};

/// Why a service could not start, or stopped serving: the one start-up
/// error type of every service binary (request errors have their own).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("discovery: {0}")]
    Discovery(#[from] DiscoveryError),
    #[error("tracing: {0}")]
    Telemetry(#[from] crate::telemetry::TelemetryError),
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("HTTP server: {0}")]
    Http(#[from] std::io::Error),
    /// Bad configuration or a component that failed to load (the model,
    /// the NIXL library, reflection): the message says which.
    #[error("{0}")]
    Setup(String),
}

/// The running admin server (if `--http-listen` was given).
pub struct Admin {
    pub state: AdminState,
    http_addr: Option<SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Admin {
    /// Start /health, /metrics and /statusz on `--http-listen`, if set.
    pub async fn start(common: &CommonArgs, state: AdminState) -> Result<Admin, ServeError> {
        crate::faults::enable(common.enable_fault_injection);
        let me = format!("{}/{}", state.service(), common.instance_id(state.service()));
        if common.tls.install(&me).map_err(ServeError::Setup)? {
            eprintln!("pdmesh-{}: mutual TLS on gRPC as {me}", state.service());
        }
        let id = crate::telemetry::Identity {
            service: state.service().to_string(),
            instance_id: common.instance_id(state.service()),
            config: state.config().clone(),
            model: common.pool.clone(),
        };
        if crate::telemetry::init(&common.telemetry, &id)? {
            eprintln!(
                "pdmesh-{}: exporting traces to {} (sample ratio {})",
                id.service,
                common.telemetry.otlp_endpoint.as_deref().unwrap_or_default(),
                common.telemetry.trace_sample_ratio
            );
        }
        let Some(addr) = common.http_listen else {
            return Ok(Admin { state, http_addr: None, stop: None });
        };
        let l = TcpListener::bind(addr).await.map_err(|e| ServeError::Listen { addr, source: e })?;
        let bound = l.local_addr().map_err(|e| ServeError::Listen { addr, source: e })?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_admin(l, state.clone(), async {
            let _ = stopped.await;
        }));
        Ok(Admin { state, http_addr: Some(bound), stop: Some(stop) })
    }

    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// How this instance is announced: its addresses and the meta
    /// operators filter on (version, config hash, role, KV transport).
    fn instance(&self, service: &str, common: &CommonArgs, grpc_addr: SocketAddr) -> Instance {
        let config = self.state.config();
        let mut meta = std::collections::BTreeMap::new();
        meta.insert("version".to_string(), env!("CARGO_PKG_VERSION").to_string());
        meta.insert("config_hash".to_string(), crate::telemetry::config_hash(config));
        meta.insert("role".to_string(), service.to_string());
        if let Some(p) = &common.pool {
            meta.insert(crate::discovery::META_MODEL.to_string(), p.clone());
        }
        if let Some(t) = config["transport"].as_str() {
            meta.insert("kv_transport".to_string(), t.to_string());
        }
        Instance {
            service: service.into(),
            id: common.instance_id(service),
            grpc_addr: common.advertise_addr.clone().unwrap_or_else(|| grpc_addr.to_string()),
            http_addr: self.http_addr.map(|a| a.to_string()),
            meta,
        }
    }

    /// Announce `service` at `grpc_addr` (if discovery is configured), then
    /// mark it ready. The returned guard withdraws it.
    pub async fn announce(
        &self,
        service: &str,
        common: &CommonArgs,
        grpc_addr: SocketAddr,
    ) -> Result<Announced, ServeError> {
        // Registered first, then /health 200: whoever waits on /health
        // (meshctl, Kubernetes) finds the instance in discovery already.
        let registration = match common.open_discovery().map_err(ServeError::Setup)? {
            Some(d) => Some(d.register(self.instance(service, common, grpc_addr)).await?),
            None => None,
        };
        self.state.set_ready(true);
        Ok(Announced { registration })
    }

    /// Take the instance out of service (see [`crate::drain`]): not ready,
    /// gRPC health NOT_SERVING, the registration drained; then, if peers
    /// found it through discovery, give them `--drain-notice-ms` to notice.
    pub async fn leave(&self, announced: &mut Announced, health: Option<&crate::grpc::Health>, common: &CommonArgs) {
        self.state.set_ready(false);
        if let Some(h) = health {
            h.set(false).await;
        }
        let what = format!("pdmesh-{}", self.state.service());
        eprintln!("{what}: draining: out of service; up to {} s for the work in flight", common.drain.drain_timeout_s);
        if let Some(r) = announced.registration.as_mut() {
            if let Err(e) = r.drain().await {
                eprintln!("{what}: drain: {e}");
            }
            common.drain.notice().await;
        }
    }

    /// [`Admin::leave`], then `hand_over` (see [`Grpc::hand_over`]), then
    /// wait for `busy()` to reach 0 (up to `--drain-timeout-s`). Returns
    /// the requests still in flight (0 = clean).
    pub async fn drain(
        &self,
        announced: &mut Announced,
        health: Option<&crate::grpc::Health>,
        common: &CommonArgs,
        hand_over: Option<Box<dyn FnOnce() + Send>>,
        busy: impl Fn() -> usize,
    ) -> usize {
        let t0 = tokio::time::Instant::now();
        self.leave(announced, health, common).await;
        if let Some(h) = hand_over {
            h();
        }
        common.drain.wait_idle(&format!("pdmesh-{}", self.state.service()), t0, busy).await
    }

    /// Not ready any more; withdraw from discovery and stop the admin server.
    pub async fn shut_down(mut self, announced: Announced) -> Result<(), ServeError> {
        self.state.set_ready(false);
        let r = match announced.registration {
            Some(reg) => reg.deregister().await,
            None => Ok(()),
        };
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        r?;
        Ok(())
    }
}

/// Proof of announcement; hand it back to [`Admin::shut_down`].
pub struct Announced {
    registration: Option<Registration>,
}

impl Announced {
    /// Nothing was announced (the service stopped before it was ready).
    pub fn none() -> Announced {
        Announced { registration: None }
    }
}

pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The gRPC side of a service: its routes and names.
pub struct Grpc {
    /// Short name in the registry: `router`, `tokenizer`, ...
    pub service: &'static str,
    /// Full gRPC name for health and reflection: `pdmesh.router.v1.Router`.
    pub name: &'static str,
    pub routes: tonic::service::Routes,
    /// Called once on drain, after the notice (peers no longer pick this
    /// instance): hand the work in flight to other instances instead of
    /// waiting for it (a decode worker ends its streams so that routers
    /// migrate them). None: wait for the work to finish.
    pub hand_over: Option<Box<dyn FnOnce() + Send>>,
}

/// How long a drained server may take to close its connections before the
/// process exits regardless.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Serve `grpc` (plus health and reflection) on `listener` until
/// `shutdown`. Once `ready` resolves, gRPC health turns SERVING and the
/// instance is announced; on `shutdown` it drains ([`crate::drain`]), then
/// withdraws and stops the admin server.
pub async fn serve_grpc(
    admin: Admin,
    common: &CommonArgs,
    grpc: Grpc,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    ready: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let (routes, health) = crate::grpc::standard_routes(grpc.routes, grpc.name).await.map_err(ServeError::Setup)?;
    let grpc_addr = listener.local_addr().map_err(|e| ServeError::Setup(format!("local address: {e}")))?;
    let in_flight = crate::drain::InFlight::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = crate::grpc::serve_routes(routes, listener, in_flight.clone(), async {
        let _ = stopped.await;
    });
    tokio::pin!(server);
    tokio::pin!(shutdown);
    let (mut announced, signalled) = tokio::select! {
        r = &mut server => {
            admin.shut_down(Announced::none()).await?;
            return Ok(r?);
        }
        _ = &mut shutdown => (Announced::none(), true),
        _ = ready => {
            health.set(true).await;
            (admin.announce(grpc.service, common, grpc_addr).await?, false)
        }
    };
    if !signalled {
        tokio::select! {
            r = &mut server => {
                admin.shut_down(announced).await?;
                return Ok(r?);
            }
            _ = &mut shutdown => {}
        }
        admin.drain(&mut announced, Some(&health), common, grpc.hand_over, || in_flight.get()).await;
    }
    let _ = stop.send(());
    let r = tokio::time::timeout(CLOSE_GRACE, &mut server).await.unwrap_or(Ok(()));
    admin.shut_down(announced).await?;
    Ok(r?)
}

/// A service binary's `main`: bind `listen`, run `serve` until Ctrl-C or
/// SIGTERM, print errors as one line, return the exit code.
pub async fn run_main<F, Fut, E>(name: &str, listen: SocketAddr, serve: F) -> ExitCode
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    run_main_on(name, Listen::Addr(listen), serve).await
}

/// Where a service's main port comes from.
#[derive(Clone, Copy, Debug)]
pub enum Listen {
    /// Bind this address.
    Addr(SocketAddr),
    /// A listening socket inherited as this file descriptor (a supervisor
    /// such as `meshctl up` bound it and shares it between the old and the
    /// new process during a restart, so no connection is refused or reset).
    Fd(i32),
}

impl Listen {
    fn open(self) -> std::io::Result<TcpListener> {
        match self {
            Listen::Addr(a) => {
                // std's bind, as tokio's: SO_REUSEADDR, no SO_REUSEPORT.
                let l = std::net::TcpListener::bind(a)?;
                l.set_nonblocking(true)?;
                TcpListener::from_std(l)
            }
            Listen::Fd(fd) => {
                use std::os::fd::FromRawFd;
                // SAFETY: the flag that names `fd` says the parent passed a
                // listening socket there for this process to own; nothing
                // else in the process uses it. A wrong fd fails below.
                let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
                l.local_addr()
                    .map_err(|e| std::io::Error::other(format!("file descriptor {fd} is no listening socket: {e}")))?;
                l.set_nonblocking(true)?;
                TcpListener::from_std(l)
            }
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Addr(a) => write!(f, "{a}"),
            Listen::Fd(fd) => write!(f, "file descriptor {fd}"),
        }
    }
}

/// [`run_main`] on a listener from `listen` (an address or an inherited socket).
pub async fn run_main_on<F, Fut, E>(name: &str, listen: Listen, serve: F) -> ExitCode
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    let listener = match listen.open() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {listen}: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("{name}: listening on {}", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    let result = serve(listener, Box::pin(crate::signal::shutdown_signal())).await;
    crate::telemetry::shutdown().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
