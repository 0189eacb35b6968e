//! Graceful drain, what every service does on SIGTERM (and what `meshctl`
//! and Kubernetes' preStop ask for):
//!
//! 1. out of service: `/health` and gRPC health say not ready, and the
//!    registration is drained (Consul maintenance mode; the file entry is
//!    removed), so routers stop picking this instance;
//! 2. `--drain-notice-ms` later (peers' watches have seen it; requests they
//!    routed meanwhile are still served), wait until no request is in
//!    flight — a decode hands its sequences over to other decode workers
//!    first (`Grpc::hand_over`), a prefill's transfers
//!    complete — for at most `--drain-timeout-s`;
//! 3. stop serving and deregister; the process exits 0. Work still running
//!    at the deadline is cut: its callers see the connection close, which
//!    they report as UNAVAILABLE (retriable), never a hang.
//!
//! [`InFlight`] counts the requests in flight: a tower layer over the gRPC
//! server that holds a count from a call until its response body is done
//! (streams included), for pdmesh's own methods (not health or reflection).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The drain flags of every service.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct DrainArgs {
    /// On SIGTERM, longest wait for in-flight requests to finish before
    /// the rest are cut (they fail as UNAVAILABLE, which callers retry).
    #[arg(long, env = "PDMESH_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// On SIGTERM, how long the instance keeps taking requests after it
    /// left discovery, while peers' watches catch up (their queries are
    /// 0.3 s apart).
    #[arg(long, env = "PDMESH_DRAIN_NOTICE_MS", default_value_t = 1000)]
    pub drain_notice_ms: u64,
}

impl Default for DrainArgs {
    fn default() -> DrainArgs {
        DrainArgs { drain_timeout_s: 30, drain_notice_ms: 1000 }
    }
}

impl DrainArgs {
    /// How long a supervisor waits for a SIGTERMed instance before SIGKILL:
    /// the notice, the drain timeout and a few seconds to close.
    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.drain_notice_ms) + Duration::from_secs(self.drain_timeout_s + 5)
    }

    /// The notice period: peers' watches catch up while requests they
    /// routed meanwhile are still served.
    pub async fn notice(&self) {
        tokio::time::sleep(Duration::from_millis(self.drain_notice_ms)).await;
    }

    /// Wait for `busy()` to reach 0, up to `--drain-timeout-s` after `t0`
    /// (when the drain began); the count left (0 = drained clean). `what`
    /// names the instance in the log lines.
    pub async fn wait_idle(&self, what: &str, t0: tokio::time::Instant, busy: impl Fn() -> usize) -> usize {
        let deadline = t0 + Duration::from_secs(self.drain_timeout_s);
        loop {
            let n = busy();
            if n == 0 {
                eprintln!("{what}: drained in {:.1} s", t0.elapsed().as_secs_f64());
                return 0;
            }
            if tokio::time::Instant::now() >= deadline {
                eprintln!("{what}: drain deadline passed with {n} request(s) in flight; cutting them");
                return n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Requests in flight on a server (see the module docs). Cheap to clone.
#[derive(Clone, Default, Debug)]
pub struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Count one request until the guard drops.
    pub fn enter(&self) -> InFlightGuard {
        self.0.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(self.0.clone())
    }
}

/// One request in flight.
pub struct InFlightGuard(Arc<AtomicUsize>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<S> tower::Layer<S> for InFlight {
    type Service = InFlightService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        InFlightService { inner, count: self.clone() }
    }
}

/// A service wrapped by [`InFlight`].
#[derive(Clone, Debug)]
pub struct InFlightService<S> {
    inner: S,
    count: InFlight,
}

/// A response body that holds its request's count until it is done or dropped.
pub struct Counted<B> {
    inner: B,
    _guard: Option<InFlightGuard>,
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = r {
            self._guard = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

type BoxFut<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B, RB> tower::Service<axum::http::Request<B>> for InFlightService<S>
where
    S: tower::Service<axum::http::Request<B>, Response = axum::http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = axum::http::Response<Counted<RB>>;
    type Error = S::Error;
    type Future = BoxFut<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        let guard = req.uri().path().starts_with("/pdmesh.").then(|| self.count.enter());
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map(|r| r.map(|inner| Counted { inner, _guard: guard })) })
    }
}
