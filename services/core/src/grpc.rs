//! The gRPC plumbing every service repeats: a health reporter, reflection
//! over all pdmesh packages, lazy channels to peers, deadlines read from
//! incoming requests, and telling a client call's own failures (broken
//! connection, its timeout) from statuses the peer sent.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

/// Whether `e` is the channel's own verdict (the connection to the peer
/// broke or never opened) rather than a status the worker sent: tonic
/// keeps the underlying error as the source only for the former. The
/// call's own timeout (the request's deadline) is not a transport failure.
pub fn is_transport(e: &tonic::Status) -> bool {
    std::error::Error::source(e).is_some() && !timed_out(e)
}

/// Whether the peer could not be reached or went away (the connection
/// broke or was refused, or it answered UNAVAILABLE), so that asking again
/// — the same service restarted, or another instance — may succeed.
pub fn peer_lost(e: &tonic::Status) -> bool {
    is_transport(e) || e.code() == tonic::Code::Unavailable && !timed_out(e)
}

/// A status in words for spans, logs and messages: "Unavailable: <its message>".
pub fn status_text(e: &tonic::Status) -> String {
    format!("{:?}: {}", e.code(), e.message())
}

/// Whether the call ended because its own timeout (set from the request's
/// deadline) expired.
pub fn timed_out(e: &tonic::Status) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.is::<tonic::TimeoutExpired>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Reflection for `service` (a full name such as `pdmesh.decode.v1.Decode`).
pub fn reflection(
    service: &'static str,
) -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    String,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pdmesh_proto::FILE_DESCRIPTOR_SET)
        .with_service_name(service)
        .build_v1()
        .map_err(|e| format!("reflection: {e}"))
}

/// A channel to `addr` (`host:port` or a URL) that connects on first use
/// and reconnects after failures. Connect attempts give up after 2 s so a
/// dead peer is an error, not a hang.
/// Under mesh TLS (`crate::tls::mesh`) the channel speaks TLS, presents
/// this process's certificate and checks the server's.
pub fn lazy_channel(addr: &str) -> Result<Channel, String> {
    let tls = crate::tls::mesh();
    let host = addr.split_once("://").map_or(addr, |(_, h)| h);
    let url = format!("{}://{host}", if tls.is_some() { "https" } else { "http" });
    let mut ep = Endpoint::from_shared(url.clone()).map_err(|e| format!("bad address {url}: {e}"))?;
    if let Some(t) = tls {
        ep = ep.tls_config(t.client()).map_err(|e| format!("TLS for {url}: {e}"))?;
    }
    Ok(ep
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONN_WINDOW))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect_lazy())
}

/// Lazily connecting channels by address, made once and shared: the one
/// channel cache of every client in the mesh.
#[derive(Default)]
pub struct Channels(std::sync::Mutex<std::collections::HashMap<String, Channel>>);

impl Channels {
    /// The cached channel to `addr`, or a new [`lazy_channel`].
    pub fn get(&self, addr: &str) -> Result<Channel, String> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let c = lazy_channel(addr)?;
        m.insert(addr.into(), c.clone());
        Ok(c)
    }
}

/// The deadline the caller set (`grpc-timeout` header), if any.
pub fn request_timeout<T>(req: &tonic::Request<T>) -> Option<Duration> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_header_is_parsed() {
        let mut r = tonic::Request::new(());
        r.metadata_mut().insert("grpc-timeout", "1500m".parse().unwrap());
        assert_eq!(request_timeout(&r), Some(Duration::from_millis(1500)));
        r.metadata_mut().insert("grpc-timeout", "3S".parse().unwrap());
        assert_eq!(request_timeout(&r), Some(Duration::from_secs(3)));
        r.metadata_mut().insert("grpc-timeout", "x".parse().unwrap());
        assert_eq!(request_timeout(&r), None);
        assert_eq!(request_timeout(&tonic::Request::new(())), None);
    }
}

/// A service's routes plus `grpc.health.v1` (reporting NOT_SERVING for
/// `service` until told otherwise) and reflection.
pub async fn standard_routes(
    routes: tonic::service::Routes,
    service: &'static str,
) -> Result<(tonic::service::Routes, Health), String> {
    let (reporter, health_svc) = tonic_health::server::health_reporter();
    let health = Health { reporter, service };
    health.set(false).await;
    Ok((routes.add_service(health_svc).add_service(reflection(service)?), health))
}

/// The gRPC health status of one service.
#[derive(Clone)]
pub struct Health {
    reporter: tonic_health::server::HealthReporter,
    service: &'static str,
}

impl Health {
    pub async fn set(&self, serving: bool) {
        use tonic_health::ServingStatus;
        let s = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
        self.reporter.set_service_status(self.service, s).await;
        // The empty name is "the server as a whole".
        self.reporter.set_service_status("", s).await;
    }
}

/// HTTP/2 flow-control windows: big enough that a KV stream or a burst of
/// token messages never waits for window updates.
const STREAM_WINDOW: u32 = 4 << 20;
const CONN_WINDOW: u32 = 16 << 20;

/// Serve `routes` on `listener` until `shutdown` resolves. Accepted
/// connections get TCP_NODELAY: without it, small messages (one token) wait
/// for the peer's delayed ACK, tens of milliseconds per hop.
pub async fn serve_routes(
    routes: tonic::service::Routes,
    listener: tokio::net::TcpListener,
    in_flight: crate::drain::InFlight,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    use tokio_stream::StreamExt;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        if let Ok(s) = &s {
            let _ = s.set_nodelay(true);
        }
        s
    });
    let mut server = tonic::transport::Server::builder();
    if let Some(t) = crate::tls::mesh() {
        server = server.tls_config(t.server())?;
    }
    server
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONN_WINDOW))
        .layer(crate::telemetry::ServerSpans)
        .layer(in_flight)
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
