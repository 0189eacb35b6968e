//! Tracing: OpenTelemetry spans exported over OTLP/gRPC, and W3C trace
//! context carried through gRPC metadata and HTTP headers.
//!
//! Services write ordinary `tracing` spans; `tracing-opentelemetry` turns
//! them into OpenTelemetry spans. Nothing is exported (and spans cost next to
//! nothing) unless an endpoint is configured: `--otlp-endpoint` or the
//! standard `OTEL_EXPORTER_OTLP_ENDPOINT`.
//!
//! Every span carries `service.name` (`pdmesh-<service>`), the instance id,
//! the version and a hash of the effective configuration, both as resource
//! attributes and as span attributes (some backends drop resources).
//!
//! Prompts and outputs never go on spans: only sizes, counts and ids.

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanProcessor};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer as _;

use crate::vocab::{attr, span};

/// Tracing flags every service shares.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct TelemetryArgs {
    /// OTLP/gRPC endpoint to export spans to, e.g. `http://127.0.0.1:4317` (tracing is off when unset).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Fraction of new traces to record, 0.0 to 1.0; a caller's sampled flag is followed.
    #[arg(long, env = "PDMESH_TRACE_SAMPLE_RATIO", default_value_t = 1.0)]
    pub trace_sample_ratio: f64,
    /// Longest a finished span waits before it is exported, in milliseconds.
    #[arg(long, env = "PDMESH_TRACE_EXPORT_DELAY_MS", default_value_t = 1000)]
    pub trace_export_delay_ms: u64,
}

impl Default for TelemetryArgs {
    fn default() -> Self {
        TelemetryArgs { otlp_endpoint: None, trace_sample_ratio: 1.0, trace_export_delay_ms: 1000 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--trace-sample-ratio must be between 0 and 1, got {0}")]
    Ratio(f64),
    #[error("OTLP exporter for {endpoint}: {source}")]
    Exporter { endpoint: String, source: opentelemetry_otlp::ExporterBuildError },
    #[error("a tracing subscriber is already installed in this process")]
    AlreadyInstalled,
}

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Who this process is, stamped on every span.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Short service name: `router`, `decode`, ...
    pub service: String,
    pub instance_id: String,
    /// Effective configuration as shown on /statusz; hashed, not exported.
    pub config: serde_json::Value,
    /// The model pool it serves (`--pool`), if any.
    pub model: Option<String>,
}

impl Identity {
    fn attributes(&self) -> Vec<KeyValue> {
        let mut v = vec![
            KeyValue::new(attr::SERVICE_NAME, format!("pdmesh-{}", self.service)),
            KeyValue::new(attr::SERVICE_INSTANCE_ID, self.instance_id.clone()),
            KeyValue::new(attr::SERVICE_VERSION, env!("CARGO_PKG_VERSION")),
            KeyValue::new(attr::CONFIG_HASH, config_hash(&self.config)),
        ];
        v.extend(self.model.clone().map(|m| KeyValue::new(attr::MODEL, m)));
        v
    }
}

/// First 16 hex digits of a stable hash of the configuration's JSON text.
pub fn config_hash(config: &serde_json::Value) -> String {
    // FNV-1a 64: stable across builds and platforms, no extra dependency.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in config.to_string().bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Repeats the identity attributes on every span at its start.
#[derive(Debug)]
struct Stamp(Vec<KeyValue>);

impl SpanProcessor for Stamp {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, _cx: &Context) {
        use opentelemetry::trace::Span as _;
        for kv in &self.0 {
            span.set_attribute(kv.clone());
        }
    }
    fn on_end(&self, _span: opentelemetry_sdk::trace::SpanData) {}
    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }
}

/// Install the exporter when an endpoint is configured; returns whether
/// tracing is on. Call inside the tokio runtime (the exporter's channel
/// lives there) and once per process.
pub fn init(args: &TelemetryArgs, id: &Identity) -> Result<bool, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    if !(0.0..=1.0).contains(&args.trace_sample_ratio) {
        return Err(TelemetryError::Ratio(args.trace_sample_ratio));
    }
    let Some(endpoint) = args.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) else {
        return Ok(false);
    };
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.into(), source })?;
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(args.trace_export_delay_ms.max(1)))
                .with_max_queue_size(65_536)
                .with_max_export_batch_size(2048)
                .build(),
        )
        .build();
    let attrs = id.attributes();
    let provider = SdkTracerProvider::builder()
        .with_resource(Resource::builder_empty().with_attributes(attrs.clone()).build())
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(args.trace_sample_ratio))))
        .with_span_processor(Stamp(attrs))
        .with_span_processor(batch)
        .build();
    let tracer = provider.tracer(format!("pdmesh-{}", id.service));
    // Only pdmesh's own spans: the libraries underneath (h2, tower, tonic)
    // have trace-level spans of their own that would drown the picture.
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_level(false)
        .with_target(false)
        .with_location(false)
        .with_threads(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| m.target().starts_with("pdmesh")));
    let subscriber = tracing_subscriber::registry().with(layer);
    tracing::subscriber::set_global_default(subscriber).map_err(|_| TelemetryError::AlreadyInstalled)?;
    let _ = PROVIDER.set(provider);
    Ok(true)
}

/// Export what is still buffered; call once when the process stops.
pub async fn shutdown() {
    if let Some(p) = PROVIDER.get() {
        let p = p.clone();
        let _ = tokio::task::spawn_blocking(move || p.shutdown()).await;
    }
}

/// Whether spans are being exported by this process.
pub fn enabled() -> bool {
    PROVIDER.get().is_some()
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);
impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (tonic::metadata::MetadataKey::from_bytes(key.as_bytes()), value.parse()) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);
impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The trace context a caller sent in HTTP headers (`traceparent`).
pub fn extract_http(headers: &axum::http::HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// Put `span`'s context into outgoing gRPC metadata.
pub fn inject(span: &tracing::Span, md: &mut tonic::metadata::MetadataMap) {
    if !enabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut MetadataInjector(md));
}

/// Hex trace id of `span` (None when not traced or not sampled).
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    if !enabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    (sc.is_valid() && sc.is_sampled()).then(|| sc.trace_id().to_string())
}

/// The span context of `span`, to link to from another span.
pub fn span_context(span: &tracing::Span) -> Option<opentelemetry::trace::SpanContext> {
    if !enabled() {
        return None;
    }
    let sc = span.context().span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// An RPC span named after the method (`pdmesh.router.v1.Router/Generate`).
fn rpc_span(method: &str, kind: &'static str) -> tracing::Span {
    let (service, rpc) = method.split_once('/').unwrap_or((method, ""));
    tracing::info_span!(
        span::GRPC,
        otel.name = method,
        otel.kind = kind,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = rpc,
        { attr::RPC_STATUS_CODE } = tracing::field::Empty,
    )
}

/// The tower layer every gRPC server runs under (added once, in
/// [`crate::grpc::serve_routes`]): each per-request RPC
/// ([`crate::vocab::rpc::TRACED`]) is handled inside a server span named
/// after its method, continuing the caller's trace from the request's
/// metadata. Handlers take it as `tracing::Span::current()`, and record
/// their status on it ([`finish`], [`record_status`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct ServerSpans;

impl<S> tower::Layer<S> for ServerSpans {
    type Service = ServerSpansService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        ServerSpansService { inner }
    }
}

/// A service wrapped by [`ServerSpans`].
#[derive(Clone, Debug)]
pub struct ServerSpansService<S> {
    inner: S,
}

impl<S, B> tower::Service<axum::http::Request<B>> for ServerSpansService<S>
where
    S: tower::Service<axum::http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tracing::instrument::Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        use tracing::Instrument;
        let span = server_span_for(req.uri().path(), req.headers());
        self.inner.call(req).instrument(span)
    }
}

/// The server span of a request to `path` (`/pdmesh.x.v1.Svc/Method`), or
/// no span for methods not in [`crate::vocab::rpc::TRACED`].
fn server_span_for(path: &str, headers: &axum::http::HeaderMap) -> tracing::Span {
    let method = path.trim_start_matches('/');
    if !crate::vocab::rpc::TRACED.contains(&method) {
        return tracing::Span::none();
    }
    let span = rpc_span(method, "server");
    if enabled() {
        let _ = span.set_parent(extract_http(headers));
    }
    span
}

/// A gRPC client span (child of the current span) and a request carrying its context.
pub fn client_request<T>(method: &'static str, msg: T) -> (tonic::Request<T>, tracing::Span) {
    let span = rpc_span(method, "client");
    let mut req = tonic::Request::new(msg);
    inject(&span, req.metadata_mut());
    (req, span)
}

/// Record a gRPC outcome on an RPC span (status code; error status and message on failure).
pub fn record_status(span: &tracing::Span, status: Option<&tonic::Status>) {
    match status {
        None => {
            span.record(attr::RPC_STATUS_CODE, 0i64);
        }
        Some(s) => {
            span.record(attr::RPC_STATUS_CODE, s.code() as i64);
            mark_error(span, s.message());
        }
    }
}

/// Mark a span as failed with a short message (no prompt or output text).
pub fn mark_error(span: &tracing::Span, message: &str) {
    span.set_status(opentelemetry::trace::Status::error(message.to_string()));
}

/// Record the outcome of an RPC on its span and pass the result through.
pub fn finish<T>(span: &tracing::Span, r: Result<T, tonic::Status>) -> Result<T, tonic::Status> {
    record_status(span, r.as_ref().err());
    r
}

/// A span event's attribute (`SpanExt::add_event`).
pub use opentelemetry::KeyValue;
/// Set attributes, links and parents on `tracing` spans (re-exported so
/// services need not depend on `tracing-opentelemetry` themselves).
pub use tracing_opentelemetry::OpenTelemetrySpanExt as SpanExt;

/// A span that ends when this guard is dropped. `tracing-opentelemetry`
/// takes a span's end time from its last exit, so a span that was entered
/// (e.g. an instrumented call) and then kept open for a stream would end
/// too early; this guard enters and leaves it once more when dropped.
pub struct Held(pub tracing::Span);

impl Held {
    pub fn span(&self) -> &tracing::Span {
        &self.0
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _last = self.0.enter();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_ratio_is_refused_even_without_an_endpoint() {
        let id =
            Identity { service: "t".into(), instance_id: "t-1".into(), config: serde_json::json!({}), model: None };
        let bad = TelemetryArgs { trace_sample_ratio: 1.5, ..Default::default() };
        assert!(matches!(init(&bad, &id), Err(TelemetryError::Ratio(_))));
        assert!(!init(&TelemetryArgs::default(), &id).unwrap(), "off without an endpoint");
        assert!(!enabled());
    }

    #[test]
    fn the_config_hash_is_stable_and_sensitive() {
        let a = config_hash(&serde_json::json!({ "threads": 2, "kv_blocks": 2048 }));
        assert_eq!(a, config_hash(&serde_json::json!({ "threads": 2, "kv_blocks": 2048 })));
        assert_ne!(a, config_hash(&serde_json::json!({ "threads": 1, "kv_blocks": 2048 })));
        assert_eq!(a.len(), 16);
    }
}
