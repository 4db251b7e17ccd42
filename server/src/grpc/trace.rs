//! Each call of the service runs in a `tracing` span named `rpc`, carrying
//! the call's trace id: the W3C `traceparent` metadata the caller sent
//! ([`TraceContext::parse`]; an invalid one is ignored), else a new one.
//! Every line logged while serving the call carries it (the JSON log puts
//! `trace_id` first on the line, see [`crate::telemetry`]); with
//! `--log-calls`, one line per call tells its RPC, gRPC code, outcome and
//! duration. With the `otel` feature and `--otlp-endpoint`, the span is
//! exported as a child of the caller's span.
//!
//! The span's fields: `rpc`, `trace_id`, `parent_span_id` (the caller's
//! span, when it sent one), and, filled in while the call runs (by
//! [`super::metrics::CallMetrics`]), `namespace` and a unary call's
//! `outcome`. Health and reflection calls run without a span.

use std::{
    task::{Context, Poll},
    time::Instant,
};

use futures_util::future::BoxFuture;
use idempotency_proto::trace::{TRACEPARENT, TraceContext, TraceId};
use tonic::body::Body;
use tracing::{Instrument, field};

use super::deadline::rpc_of;

/// The log target of the per-call lines (`--log-calls`).
pub const CALLS_TARGET: &str = "idempotency_server::calls";

/// Puts each call of the service in its span (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct TraceLayer {
    log_calls: bool,
}

impl TraceLayer {
    /// `log_calls`: one log line per call (`--log-calls`).
    pub fn new(log_calls: bool) -> Self {
        Self { log_calls }
    }
}

impl<S> tower::Layer<S> for TraceLayer {
    type Service = Traced<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Traced {
            inner,
            log_calls: self.log_calls,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Traced<S> {
    inner: S,
    log_calls: bool,
}

impl<S, B> tower::Service<http::Request<B>> for Traced<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>> + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let Some(rpc) = rpc_of(request.uri().path()) else {
            return Box::pin(self.inner.call(request));
        };
        let remote = request
            .headers()
            .get(TRACEPARENT)
            .and_then(|value| TraceContext::parse(value.as_bytes()));
        let span = call_span(rpc, remote);
        let call = span.in_scope(|| self.inner.call(request));
        if !self.log_calls {
            return Box::pin(call.instrument(span));
        }
        let started = Instant::now();
        Box::pin(
            async move {
                let answer = call.await;
                log_call(rpc, &answer, started);
                answer
            }
            .instrument(span),
        )
    }
}

/// The span of one call, in the caller's trace when `remote` names one.
///
/// Its level is ERROR so that it exists whenever any line is logged (a
/// span's level only decides when it is enabled): at `--log-level warn` a
/// call's warnings still carry its trace id.
pub(super) fn call_span(rpc: &'static str, remote: Option<TraceContext>) -> tracing::Span {
    let span = tracing::error_span!(
        "rpc",
        rpc,
        trace_id = field::Empty,
        parent_span_id = field::Empty,
        namespace = field::Empty,
        outcome = field::Empty,
    );
    if let Some(remote) = remote {
        span.record("parent_span_id", field::display(remote.parent_id()));
    }
    let trace_id = exported_trace_id(&span, remote)
        .or(remote.map(|remote| remote.trace_id()))
        .unwrap_or_else(TraceId::random);
    span.record("trace_id", field::display(trace_id));
    span
}

/// With OpenTelemetry export on, the span joins the caller's trace (or
/// starts one), and its trace id is the exported one.
#[cfg(feature = "otel")]
fn exported_trace_id(span: &tracing::Span, remote: Option<TraceContext>) -> Option<TraceId> {
    crate::otel::join(span, remote)
}

#[cfg(not(feature = "otel"))]
fn exported_trace_id(_: &tracing::Span, _: Option<TraceContext>) -> Option<TraceId> {
    None
}

/// The `--log-calls` line of a call answered by the HTTP response `answer`.
fn log_call<E>(rpc: &'static str, answer: &Result<http::Response<Body>, E>, started: Instant) {
    log_code(rpc, answer.as_ref().ok().map(grpc_code), started);
}

/// The `--log-calls` line: the RPC, its gRPC code (`None`: the call failed
/// in transport) and how long it took (the span adds the trace id,
/// namespace and outcome).
pub(super) fn log_code(rpc: &'static str, code: Option<tonic::Code>, started: Instant) {
    let duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    match code {
        Some(code) => tracing::info!(
            target: CALLS_TARGET,
            rpc,
            grpc_code = code as i32,
            code = ?code,
            duration_ms,
            "call"
        ),
        None => tracing::info!(
            target: CALLS_TARGET,
            rpc,
            grpc_code = tonic::Code::Internal as i32,
            code = ?tonic::Code::Internal,
            duration_ms,
            "call failed in transport"
        ),
    }
}

/// The call's gRPC code: a unary call's error comes as a trailers-only
/// response (`grpc-status` in the headers); a response without one is a
/// message, followed by `grpc-status: 0`.
fn grpc_code(response: &http::Response<Body>) -> tonic::Code {
    response
        .headers()
        .get("grpc-status")
        .map_or(tonic::Code::Ok, |status| {
            tonic::Code::from_bytes(status.as_bytes())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grpc_code_is_read_from_a_trailers_only_response() {
        let ok = http::Response::new(Body::empty());
        assert_eq!(grpc_code(&ok), tonic::Code::Ok);
        let refused = tonic::Status::not_found("gone").into_http::<Body>();
        assert_eq!(grpc_code(&refused), tonic::Code::NotFound);
    }

    #[test]
    fn a_call_span_carries_the_callers_trace_or_a_new_one() {
        let remote =
            TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let lines = capture_json(|| {
            call_span("Get", Some(remote)).in_scope(|| tracing::warn!("inside"));
            call_span("Get", None).in_scope(|| tracing::warn!("inside"));
        });
        let [joined, fresh] = lines.as_slice() else {
            panic!("two lines: {lines:?}")
        };
        assert_eq!(
            joined["span"]["trace_id"],
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(joined["span"]["parent_span_id"], "00f067aa0ba902b7");
        assert_eq!(joined["span"]["rpc"], "Get");
        let fresh_id = fresh["span"]["trace_id"].as_str().unwrap();
        assert!(
            TraceContext::parse(format!("00-{fresh_id}-00f067aa0ba902b7-01")).is_some(),
            "{fresh_id}"
        );
        assert_ne!(fresh_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(fresh["span"].get("parent_span_id").is_none(), "{fresh}");
    }

    /// The JSON lines `f` logs, at level WARN, through the span fields'
    /// JSON formatter the server uses.
    fn capture_json(f: impl FnOnce()) -> Vec<serde_json::Value> {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter("warn")
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// With the `otel` feature, a call span is exported to the collector
    /// as the child of the caller's span: same trace id, the caller's span
    /// as parent.
    #[cfg(feature = "otel")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_exported_span_joins_the_callers_trace() {
        use opentelemetry_proto::tonic::collector::trace::v1::{
            ExportTraceServiceRequest, ExportTraceServiceResponse,
            trace_service_server::{TraceService, TraceServiceServer},
        };
        use tokio::sync::mpsc;
        use tracing_subscriber::layer::SubscriberExt;

        struct Collector(mpsc::UnboundedSender<ExportTraceServiceRequest>);
        #[tonic::async_trait]
        impl TraceService for Collector {
            async fn export(
                &self,
                request: tonic::Request<ExportTraceServiceRequest>,
            ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
                let _ = self.0.send(request.into_inner());
                Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
            }
        }

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint: url::Url = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let (sent, mut received) = mpsc::unbounded_channel();
        let collector = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(Collector(sent)))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );

        let remote =
            TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let (layer, exporter) = crate::otel::layer(&endpoint).expect("exporter");
        let subscriber = tracing_subscriber::registry().with(layer);
        let logged_trace_id = tracing::subscriber::with_default(subscriber, || {
            let span = call_span("Acquire", Some(remote));
            span.in_scope(|| tracing::info!("inside"));
            crate::otel::join(&span, None)
        });
        // Shutting the exporter down sends what it buffered; it blocks, and
        // the export runs on this runtime.
        tokio::task::spawn_blocking(move || drop(exporter))
            .await
            .unwrap();

        let request = tokio::time::timeout(std::time::Duration::from_secs(10), received.recv())
            .await
            .expect("the collector received spans")
            .unwrap();
        let spans: Vec<_> = request
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .flat_map(|scope| &scope.spans)
            .collect();
        let span = spans
            .iter()
            .find(|span| span.name == "rpc")
            .expect("the call's span");
        assert_eq!(span.trace_id, remote.trace_id().to_bytes());
        assert_eq!(span.parent_span_id, remote.parent_id().to_bytes());
        assert_eq!(logged_trace_id, Some(remote.trace_id()));
        collector.abort();
    }
}
