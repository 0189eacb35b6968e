//! The front door's connections: an HTTP/1.1 accept loop with the bounds
//! a public listener needs. A cap on open connections (one over it gets a
//! 503 and is closed at once), a time limit on a request's headers which
//! also closes keep-alive connections idle that long (hyper's header read
//! timer runs whenever the connection waits for a request), and TCP_NODELAY
//! (SSE chunks are small). Request bodies have their own limit (see
//! `read_body` in lib.rs). On stop, idle connections close and busy ones
//! finish their response first.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::Service;

/// Bounds on the front door's connections (flags of the gateway).
#[derive(clap::Args, Clone, Debug, serde::Serialize)]
pub struct FrontArgs {
    /// Most client connections open at once; one more is answered 503
    /// and closed.
    #[arg(long, env = "PDMESH_GATEWAY_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers; a keep-alive
    /// connection waiting this long for its next request is closed too.
    #[arg(long, env = "PDMESH_GATEWAY_HEADER_TIMEOUT_S", default_value_t = 15.0)]
    pub header_timeout_s: f64,
    /// Seconds a client has to send a request's body once its headers
    /// arrived (408 after).
    #[arg(long, env = "PDMESH_GATEWAY_BODY_TIMEOUT_S", default_value_t = 30.0)]
    pub body_timeout_s: f64,
}

impl FrontArgs {
    /// Checked at start: a zero cap or a non-positive time would refuse everything.
    pub fn check(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        for (flag, v) in [("--header-timeout-s", self.header_timeout_s), ("--body-timeout-s", self.body_timeout_s)] {
            if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                return Err(format!("{flag} must be a number of seconds in (0, 86400], got {v}"));
            }
        }
        Ok(())
    }

    pub fn body_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.body_timeout_s)
    }
}

/// Connection counts, for the gateway's metrics.
#[derive(Default)]
pub struct ConnStats {
    pub open: AtomicU64,
    pub refused: AtomicU64,
}

/// What a connection over the cap is told before it is closed.
fn full_response() -> String {
    pdmesh_core::refusal::unavailable(
        "the gateway has too many open connections; retry shortly",
        "too_many_connections",
        1,
    )
}

/// Serve `app` on `listener` until `stop` resolves; then stop accepting
/// and return once every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    args: FrontArgs,
    stats: Arc<ConnStats>,
    stop: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(args.max_connections));
    let (closing, closed) = watch::channel(false);
    let header_timeout = Duration::from_secs_f64(args.header_timeout_s);
    tokio::pin!(stop);
    loop {
        let (tcp, _) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                // Out of descriptors and the like: wait a moment rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = tcp.set_nodelay(true);
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(refuse(tcp));
            continue;
        };
        stats.open.fetch_add(1, Ordering::Relaxed);
        let (app, stats, closed) = (app.clone(), stats.clone(), closed.clone());
        tokio::spawn(async move {
            connection(tcp, app, header_timeout, closed).await;
            stats.open.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
    drop(listener);
    let _ = closing.send(true);
    // Every slot back: every connection closed.
    let _ = slots.acquire_many(args.max_connections as u32).await;
    Ok(())
}

/// Tell a connection over the cap why, and close it.
async fn refuse(tcp: TcpStream) {
    pdmesh_core::refusal::answer_and_close(tcp, &full_response()).await;
}

/// One client connection, HTTP/1.1 with keep-alive.
async fn connection(tcp: TcpStream, app: axum::Router, header_timeout: Duration, mut closing: watch::Receiver<bool>) {
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let mut app = app.clone();
        async move { Ok::<_, Infallible>(app.call(req).await.unwrap_or_else(|e| match e {})) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let conn = builder.serve_connection(TokioIo::new(tcp), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = closing.wait_for(|c| *c) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_names_the_cap() {
        let full = full_response();
        let body = full.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[test]
    fn bad_bounds_are_refused_at_start() {
        let ok = FrontArgs { max_connections: 10, header_timeout_s: 15.0, body_timeout_s: 30.0 };
        assert!(ok.check().is_ok());
        assert!(FrontArgs { max_connections: 0, ..ok.clone() }.check().is_err());
        assert!(FrontArgs { header_timeout_s: 0.0, ..ok.clone() }.check().is_err());
        assert!(FrontArgs { body_timeout_s: f64::NAN, ..ok }.check().is_err());
    }
}
