//! Test harness for pdmesh services: start any service's `serve` on
//! `127.0.0.1:0` in this process, wait on its gRPC health with a deadline
//! (never a bare sleep), stop it, and talk plain HTTP to admin endpoints.
//!
//! ```no_run
//! # async fn f() {
//! let svc = pdmesh_testkit::spawn(|listener, stop| async move {
//!     // e.g. pdmesh_kvbroker::serve(config, listener, stop).await
//!     let _ = (listener, stop);
//!     Ok::<(), std::convert::Infallible>(())
//! })
//! .await;
//! pdmesh_testkit::wait_healthy(&svc.url, "pdmesh.kvbroker.v1.KvBroker").await;
//! svc.stop().await;
//! # }
//! ```

pub mod consul;
pub mod fake;

use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use pdmesh_core::serve::Shutdown;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic_health::pb::health_check_response::ServingStatus;

/// How long a service may take to become healthy in tests.
pub const READY_DEADLINE: Duration = Duration::from_secs(60);

/// A service running inside the test process.
pub struct Running {
    pub addr: SocketAddr,
    /// `http://addr`, for gRPC clients.
    pub url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Running {
    /// Ask the service to shut down and wait until its `serve` returned.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("service task panicked");
    }
}

/// Bind `127.0.0.1:0` and run `serve(listener, shutdown)` on it. A `serve`
/// that returns an error fails the test (the task panics, `stop` reports it).
pub async fn spawn<F, Fut, E>(serve: F) -> Running
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Debug,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let fut = serve(
        listener,
        Box::pin(async {
            let _ = stopped.await;
        }),
    );
    let task = tokio::spawn(async move {
        fut.await.expect("service failed");
    });
    Running { addr, url: format!("http://{addr}"), stop, task }
}

/// Wait until `service` reports SERVING on the standard gRPC health API.
pub async fn wait_healthy(url: &str, service: &str) {
    let ok = eventually_async(READY_DEADLINE, || async {
        let Ok(ch) = tonic::transport::Channel::from_shared(url.to_string()).expect("url").connect().await else {
            return false;
        };
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
        let req = tonic_health::pb::HealthCheckRequest { service: service.into() };
        matches!(h.check(req).await, Ok(r) if r.get_ref().status == ServingStatus::Serving as i32)
    })
    .await;
    assert!(ok, "{service} at {url} did not become healthy within {READY_DEADLINE:?}");
}

/// Poll `check` every 10 ms until it is true or `deadline` passes; returns
/// whether it became true.
pub async fn eventually_async<F, Fut>(deadline: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A plain blocking HTTP/1.1 GET (what a Consul check or curl does):
/// status code and body. Call it from `spawn_blocking` in async tests.
/// `GET` asking for OpenMetrics (histograms carry trace-id exemplars).
pub fn http_get_openmetrics(addr: &str, path: &str) -> (u16, String) {
    pdmesh_core::http::get_openmetrics(addr, path, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("GET http://{addr}{path} (OpenMetrics): {e}"))
}

pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    pdmesh_core::http::get(addr, path, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("GET http://{addr}{path}: {e}"))
}

/// Record that the test `name` could not run here and why: printed, and
/// appended to the file `$PDMESH_SKIPPED` names (scripts/test.sh counts
/// those lines as skipped, not passed). Return from the test after it.
pub fn skip(name: &str, why: &str) {
    eprintln!("SKIPPED: {name}: {why}");
    if let Some(f) = std::env::var_os("PDMESH_SKIPPED") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(f) {
            let _ = writeln!(f, "{name}: {why}");
        }
    }
}
