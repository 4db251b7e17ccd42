//! Trace context: every call of the service carries a W3C `traceparent`
//! (gRPC metadata), so the service's log lines for the call carry the
//! caller's trace id, and with OpenTelemetry export its spans join the
//! caller's trace. Each call also runs in a `tracing` span of its own
//! (`idempotency.acquire`, `.complete`, `.fail`, `.renew`, `.get`; fields
//! `namespace`, `operation`, `trace_id`, never the subject, key or response).
//!
//! Which trace a call joins, first that applies:
//! 1. the context set for the running task with [`scope`] (the HTTP layer
//!    sets the one of the request it serves, from its `traceparent`
//!    header); it is sent as it came, the caller's span as the parent;
//! 2. with the `otel` feature, the current `tracing` span's OpenTelemetry
//!    context (tracing-opentelemetry): the call's own span is the parent;
//! 3. else a new random trace, one per call.
//!
//! A [`Lease`](crate::Lease) keeps the context its Acquire had from
//! [`scope`], so its Complete, Fail, Renew and background renewals join the
//! same trace wherever they run. Concurrent calls that the client batches
//! into one `BatchAcquire` (`BatchComplete`) each keep their span; the batch
//! RPC carries the `traceparent` of its first call.
//!
//! [`scope`] is a Tokio task-local: tasks the scoped future spawns do not
//! inherit it (wrap their futures in [`scope`] too).

use std::future::Future;

pub use idempotency_proto::trace::{SpanId, TRACEPARENT, TraceContext, TraceId};
use tonic::{codegen::http::HeaderMap, metadata::AsciiMetadataValue};

tokio::task_local! {
    static CURRENT: TraceContext;
}

/// Runs `future` with `context` as the trace of every call of the service
/// it makes (unless a nested [`scope`] sets another).
///
/// ```
/// use idempotency_client::trace::{self, TraceContext};
/// # async fn handle() {}
/// # async fn example() {
/// let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// if let Some(context) = TraceContext::parse(incoming) {
///     trace::scope(context, handle()).await;
/// }
/// # }
/// ```
pub async fn scope<F: Future>(context: TraceContext, future: F) -> F::Output {
    CURRENT.scope(context, future).await
}

/// The context [`scope`] set for the running task, if any.
pub fn current() -> Option<TraceContext> {
    CURRENT.try_with(|context| *context).ok()
}

/// The context of an incoming request's valid `traceparent` header, if any:
/// what the HTTP layer (and a gRPC server layer, from metadata) extract.
#[cfg_attr(not(feature = "http"), allow(dead_code))]
pub(crate) fn from_headers(headers: &HeaderMap) -> Option<TraceContext> {
    headers
        .get(TRACEPARENT)
        .and_then(|value| TraceContext::parse(value.as_bytes()))
}

/// Runs `future` in the trace of `headers`' `traceparent` when it carries a
/// valid one, else as it is (an invalid header is ignored). For the layers
/// that serve a request and call the service on its behalf: the gRPC server
/// layer (tonic requests are `http::Request`s; their metadata, headers).
#[allow(dead_code)]
pub(crate) async fn within_request<F: Future>(headers: &HeaderMap, future: F) -> F::Output {
    within(from_headers(headers), future).await
}

/// Runs `future` in `context` when one is given and none is set already.
pub(crate) async fn within<F: Future>(context: Option<TraceContext>, future: F) -> F::Output {
    match context.filter(|_| current().is_none()) {
        Some(context) => scope(context, future).await,
        None => future.await,
    }
}

/// The context a call sends (see the module docs), resolved within the
/// call's span, whose `trace_id` field it fills in.
pub(crate) fn for_call(span: &tracing::Span) -> TraceContext {
    let context = current()
        .or_else(|| span.in_scope(from_tracing))
        .unwrap_or_else(TraceContext::random);
    span.record("trace_id", tracing::field::display(context.trace_id()));
    context
}

/// The current `tracing` span's OpenTelemetry context, when it is valid.
#[cfg(feature = "otel")]
fn from_tracing() -> Option<TraceContext> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    if !span_context.is_valid() {
        return None;
    }
    Some(TraceContext::new(
        TraceId::from_bytes(span_context.trace_id().to_bytes())?,
        SpanId::from_bytes(span_context.span_id().to_bytes())?,
        span_context.is_sampled(),
    ))
}

#[cfg(not(feature = "otel"))]
fn from_tracing() -> Option<TraceContext> {
    None
}

/// Puts `context` on `request` as its `traceparent` metadata.
pub(crate) fn inject<T>(request: &mut tonic::Request<T>, context: &TraceContext) {
    let header = context.to_header();
    // Always ASCII: hex digits and dashes.
    if let Ok(value) = AsciiMetadataValue::try_from(&header[..]) {
        request.metadata_mut().insert(TRACEPARENT, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INCOMING: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[tokio::test]
    async fn a_scope_sets_the_context_and_the_innermost_wins() {
        let outer = TraceContext::parse(INCOMING).unwrap();
        let inner = TraceContext::random();
        assert_eq!(current(), None);
        scope(outer, async {
            assert_eq!(current(), Some(outer));
            scope(inner, async { assert_eq!(current(), Some(inner)) }).await;
            // `within` does not replace a context already set.
            within(Some(inner), async { assert_eq!(current(), Some(outer)) }).await;
        })
        .await;
        assert_eq!(current(), None);
    }

    #[tokio::test]
    async fn a_call_sends_the_scoped_context_else_a_new_one_each_time() {
        let span = tracing::Span::none();
        let (first, second) = (for_call(&span), for_call(&span));
        assert_ne!(first.trace_id(), second.trace_id());
        let incoming = TraceContext::parse(INCOMING).unwrap();
        scope(incoming, async { assert_eq!(for_call(&span), incoming) }).await;
    }

    #[tokio::test]
    async fn a_request_header_is_used_when_valid_and_ignored_otherwise() {
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, INCOMING.parse().unwrap());
        let seen = within_request(&headers, async { current() }).await;
        assert_eq!(seen.map(|c| c.to_string()).as_deref(), Some(INCOMING));
        headers.insert(TRACEPARENT, INCOMING.to_uppercase().parse().unwrap());
        assert_eq!(within_request(&headers, async { current() }).await, None);
    }

    #[test]
    fn the_context_is_injected_as_traceparent_metadata() {
        let context = TraceContext::parse(INCOMING).unwrap();
        let mut request = tonic::Request::new(());
        inject(&mut request, &context);
        assert_eq!(
            request
                .metadata()
                .get(TRACEPARENT)
                .unwrap()
                .to_str()
                .unwrap(),
            INCOMING
        );
    }

    /// Every RPC of the client carries a `traceparent`: the scope's
    /// within [`scope`] (a lease's later calls too, even from tasks), one of
    /// the scoped calls' for a batch, and a new trace per call outside.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_rpc_carries_the_scoped_trace_or_a_new_one() {
        use std::time::Duration;

        use crate::{
            AcquireRequest, Acquisition, Client, RecordId, StoredResponse, testing::FakeService,
        };

        let service = FakeService::plain().await;
        let client = Client::builder()
            .endpoint(format!("http://{}", service.addr))
            .connect_lazy()
            .unwrap();
        let request = |key: &str| {
            AcquireRequest::new(
                RecordId::new("shop", "POST /pay", format!("key-{key}")),
                b"f".to_vec(),
            )
        };
        let incoming = TraceContext::parse(INCOMING).unwrap();
        scope(incoming, async {
            let Acquisition::Proceed(mut lease) = client.acquire(&request("alone")).await.unwrap()
            else {
                panic!("the fake service grants every Acquire");
            };
            lease.renew(Duration::from_secs(60)).await.unwrap();
            lease
                .complete(&StoredResponse::new(201, "done"))
                .await
                .unwrap();
            // Concurrent Acquires travel as one BatchAcquire, sent from the
            // batcher's task; their leases, dropped, are released from tasks.
            let together = (0..8).map(|n| {
                let request = request(&format!("together-{n}"));
                let client = client.clone();
                async move { client.acquire(&request).await.map(drop) }
            });
            for result in futures_join_all(together).await {
                result.unwrap();
            }
            assert_eq!(client.get(&request("get").id).await.unwrap(), None);
        })
        .await;
        // The 8 dropped leases are released (Fail) from tasks of their own.
        service.wait_for_count("Fail", 8).await;
        let scoped = service.seen();
        for rpc in [
            "Acquire",
            "Renew",
            "Complete",
            "BatchAcquire",
            "Get",
            "Fail",
        ] {
            assert!(
                scoped.iter().any(|call| call.rpc == rpc),
                "no {rpc} in {scoped:?}"
            );
        }
        for call in &scoped {
            assert_eq!(call.traceparent.as_deref(), Some(INCOMING), "{call:?}");
        }

        // Outside a scope: a valid, new trace per call.
        client.get(&request("get").id).await.unwrap();
        client.get(&request("get").id).await.unwrap();
        let fresh: Vec<TraceContext> = service.seen()[scoped.len()..]
            .iter()
            .map(|call| TraceContext::parse(call.traceparent.as_deref().unwrap()).unwrap())
            .collect();
        assert_eq!(fresh.len(), 2);
        assert_ne!(fresh[0].trace_id(), fresh[1].trace_id());
        assert_ne!(fresh[0].trace_id(), incoming.trace_id());
    }

    /// Runs the futures concurrently on this task, in order of their answers.
    async fn futures_join_all<F: Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
        let handles: Vec<_> = futures.map(|future| Box::pin(future)).collect();
        let mut outputs = Vec::new();
        let mut pending: Vec<_> = handles.into_iter().map(Some).collect();
        std::future::poll_fn(|cx| {
            for slot in pending.iter_mut() {
                if let Some(future) = slot
                    && let std::task::Poll::Ready(output) = future.as_mut().poll(cx)
                {
                    outputs.push(output);
                    *slot = None;
                }
            }
            if pending.iter().all(Option::is_none) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        outputs
    }

    /// With the `otel` feature and no scope, a call joins the current
    /// span's OpenTelemetry trace, its own span as the parent.
    #[cfg(feature = "otel")]
    #[test]
    fn with_otel_a_call_joins_the_current_spans_trace() {
        use opentelemetry::trace::{TraceContextExt, TracerProvider};
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        use tracing_subscriber::layer::SubscriberExt;

        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let _guard = tracing::subscriber::set_default(subscriber);
        let handler = tracing::info_span!("handler");
        let call = handler
            .in_scope(|| tracing::info_span!("idempotency.get", trace_id = tracing::field::Empty));
        let context = for_call(&call);
        let handlers = handler.context().span().span_context().clone();
        let calls = call.context().span().span_context().clone();
        assert_eq!(
            context.trace_id().to_bytes(),
            handlers.trace_id().to_bytes()
        );
        assert_eq!(context.parent_id().to_bytes(), calls.span_id().to_bytes());
        assert!(context.is_sampled());
    }
}
