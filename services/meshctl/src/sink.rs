//! A small OTLP/gRPC trace receiver: keeps the spans it is sent in memory
//! and, when given a file, appends each export to it as one OTLP/JSON line.
//! `meshctl collect` runs it for machines without Jaeger; the tests run it
//! inside the test process.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use tokio::net::TcpListener;

use crate::trace::{from_otlp, to_otlp_json, Span};

#[derive(Default)]
struct Store {
    spans: Mutex<Vec<Span>>,
    file: Option<Mutex<std::fs::File>>,
}

struct Receiver(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = from_otlp(req.get_ref());
        if let Some(f) = &self.0.file {
            let line = to_otlp_json(&spans).to_string();
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            writeln!(f, "{line}").map_err(|e| tonic::Status::internal(format!("cannot write the trace file: {e}")))?;
        }
        self.0.spans.lock().unwrap_or_else(|e| e.into_inner()).extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// A running receiver; stops when dropped.
pub struct Sink {
    store: Arc<Store>,
    pub addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Sink {
    /// Listen on `addr` (port 0 picks one); append exports to `file` if given.
    pub async fn start(addr: SocketAddr, file: Option<PathBuf>) -> Result<Sink, String> {
        let file = match file {
            Some(p) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&p)
                    .map_err(|e| format!("cannot open {}: {e}", p.display()))?,
            )),
            None => None,
        };
        let store = Arc::new(Store { spans: Mutex::new(Vec::new()), file });
        let l = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let svc = TraceServiceServer::new(Receiver(store.clone())).max_decoding_message_size(64 << 20);
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(l), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Sink { store, addr, _stop: stop })
    }

    /// `http://<addr>`, for `--otlp-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.store.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The spans of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<Span> {
        self.store
            .spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    }

    /// Wait until `done` holds for the spans of `trace_id` (or `timeout`
    /// passes); returns them either way.
    pub async fn wait_trace(&self, trace_id: &str, timeout: Duration, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let until = Instant::now() + timeout;
        loop {
            let t = self.trace(trace_id);
            if done(&t) || Instant::now() >= until {
                return t;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
