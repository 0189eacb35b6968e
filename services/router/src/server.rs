//! The router's tonic face: `Router/Generate` validates a request, holds
//! the router's in-flight bound, and hands the request to its flow
//! ([`crate::flow`]) on a task of its own, streaming what it sends.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pdmesh_core::metrics::Outcome;
use pdmesh_core::telemetry::{self, SpanExt};
use pdmesh_core::vocab::attr;
use pdmesh_proto::router::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::Error;
use crate::state::Router;
use crate::validate::validate;

type DeltaStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

pub struct Service(pub Arc<Router>);

#[tonic::async_trait]
impl pb::router_server::Router for Service {
    type GenerateStream = DeltaStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<DeltaStream>, Status> {
        let router = self.0.clone();
        let span = tracing::Span::current();
        let deadline =
            pdmesh_core::grpc::request_timeout(&req).map(|t| t.min(router.timeout)).unwrap_or(router.timeout);
        let (input, job) = match validate(req.into_inner(), router.max_stop, || router.fresh_request_id()) {
            Ok(j) => j,
            Err(e) => {
                router.metrics.outcomes.inc(Outcome::of_code(e.code()));
                telemetry::record_status(&span, Some(&e));
                return Err(e);
            }
        };
        span.set_attribute(attr::REQUEST_ID, job.request_id.clone());
        span.set_attribute(attr::MAX_TOKENS, job.max_tokens as i64);
        let trace_id = telemetry::trace_id(&span);
        if router.metrics.in_flight.fetch_add(1, Ordering::Relaxed) >= router.max_in_flight {
            router.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
            let e = Status::from(Error::Busy { limit: router.max_in_flight });
            router.metrics.outcomes.inc(Outcome::of_code(e.code()));
            telemetry::record_status(&span, Some(&e));
            return Err(e);
        }
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(router.serve(input, job, deadline, tx).instrument(span));
        let mut resp = Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)) as DeltaStream);
        if let Some(id) = trace_id.and_then(|t| t.parse().ok()) {
            resp.metadata_mut().insert("x-pdmesh-trace-id", id);
        }
        Ok(resp)
    }
}
