//! OpenTelemetry export (feature `otel`, flag `--otlp-endpoint`): each
//! call's span (see [`crate::grpc::trace`]) goes to an OTLP collector over
//! gRPC, as a child of the caller's span when its `traceparent` names one,
//! so the server's spans join the caller's trace. Spans are batched and sent
//! from a background thread; the SDK's parent-based sampler keeps a call
//! whose caller sampled it (flag `01`) or sent no `traceparent`.

use idempotency_proto::trace::{TraceContext, TraceId};
use opentelemetry::{
    Context,
    trace::{SpanContext, TraceContextExt, TraceFlags, TraceState, TracerProvider},
};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::{Resource, trace::SdkTracerProvider};
use tracing::Subscriber;
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::registry::LookupSpan;

/// The service name spans are exported under.
const SERVICE_NAME: &str = "idempotencyd";

/// The running exporter: sends the spans still buffered when dropped.
pub struct Exporter(SdkTracerProvider);

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(error) = self.0.shutdown() {
            eprintln!("exporting the last spans: {error}");
        }
    }
}

/// The tracing layer that exports spans to `endpoint`, and its exporter.
/// Call within the Tokio runtime: the gRPC client runs on it.
pub fn layer<S>(
    endpoint: &url::Url,
) -> Result<
    (
        OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>,
        Exporter,
    ),
    opentelemetry_otlp::ExporterBuildError,
>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let exporter = SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.as_str())
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(SERVICE_NAME).build())
        .build();
    let tracer = provider.tracer(SERVICE_NAME);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        // No busy/idle attributes: they cost two clock reads at every poll.
        .with_tracked_inactivity(false);
    Ok((layer, Exporter(provider)))
}

/// Makes `span` a child of the caller's span (`remote`), and returns the
/// trace id it is exported under; `None` when export is off (no layer).
pub(crate) fn join(span: &tracing::Span, remote: Option<TraceContext>) -> Option<TraceId> {
    if let Some(remote) = remote {
        let parent = SpanContext::new(
            opentelemetry::trace::TraceId::from_bytes(remote.trace_id().to_bytes()),
            opentelemetry::trace::SpanId::from_bytes(remote.parent_id().to_bytes()),
            TraceFlags::new(remote.flags()),
            true,
            TraceState::default(),
        );
        // Fails only when export is off (no layer) or the span is disabled.
        span.set_parent(Context::new().with_remote_span_context(parent))
            .ok()?;
    }
    let context = span.context();
    let exported = context.span().span_context().trace_id();
    TraceId::from_bytes(exported.to_bytes())
}
