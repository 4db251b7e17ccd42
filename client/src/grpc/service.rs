//! The middleware itself: from a gRPC call to Acquire, the handler, and Complete.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::{Body, Frame, SizeHint};
use prost_reflect::MessageDescriptor;
use tokio::sync::oneshot;
use tonic::{Code, body::Body as TonicBody};
use tonic_types::ErrorDetails;
use tower::Service;

use super::{
    GrpcConfig,
    message::{self, Unreadable},
    status::{self, reason},
    stored,
};
use crate::{
    AcquireRequest, Acquisition, Client, Lease, OnUnavailable, RecordId, StoredResponse,
    fingerprint,
    middleware::{
        body::{Captured, Prefixed, capture, capture_with_trailers},
        key::{self, KeyHeader},
        outcome::{self, Completion, Refusal, release},
    },
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The service [`super::GrpcIdempotencyLayer`] wraps around yours.
#[derive(Debug, Clone)]
pub struct GrpcIdempotency<S> {
    inner: S,
    client: Client,
    config: Arc<GrpcConfig>,
}

impl<S> GrpcIdempotency<S> {
    pub(crate) fn new(inner: S, client: Client, config: Arc<GrpcConfig>) -> Self {
        Self {
            inner,
            client,
            config,
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for GrpcIdempotency<S>
where
    S: Service<Request<TonicBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    type Response = Response<TonicBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Call the instance that was made ready; leave a fresh clone behind.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        // The calls made for this request join the caller's trace (its
        // `traceparent` metadata), and so does the handler's task.
        let trace = crate::trace::from_headers(request.headers());
        let handled = handle(inner, self.client.clone(), self.config.clone(), request);
        match trace {
            Some(trace) => Box::pin(crate::trace::scope(trace, handled)),
            None => Box::pin(handled),
        }
    }
}

async fn handle<S, ReqBody, ResBody>(
    inner: S,
    client: Client,
    config: Arc<GrpcConfig>,
    request: Request<ReqBody>,
) -> Result<Response<TonicBody>, S::Error>
where
    S: Service<Request<TonicBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    let Some(input) = covered(&request, &config) else {
        return pass_through(inner, request.map(TonicBody::new)).await;
    };
    let key = match key::read(request.headers()) {
        KeyHeader::Present(key) => key,
        KeyHeader::Missing if !config.require_key => {
            return pass_through(inner, request.map(TonicBody::new)).await;
        }
        KeyHeader::Missing => {
            return Ok(status::bad_key(
                reason::MISSING,
                "this method requires idempotency-key metadata",
            ));
        }
        KeyHeader::Malformed(why) => return Ok(status::bad_key(reason::MALFORMED, why)),
    };
    let (parts, body) = request.into_parts();
    let (acquire, message) = match read_call(&parts, body, key, &input, &config).await {
        Ok(read) => read,
        Err(answer) => return Ok(answer),
    };
    let request = Request::from_parts(parts, stored::whole(message, None));
    // From here on the work runs in a task of its own (see `outcome::detached`).
    let work = acquire_and_execute(inner, client, config, acquire, request);
    match outcome::detached(work).await {
        Some(result) => result,
        None => Ok(status::plain(
            Code::Internal,
            reason::HANDLER_CANCELLED,
            "the handler was cancelled",
        )),
    }
}

/// The request type of the call when the layer covers it: a unary method of
/// the descriptor pool, in gRPC's protobuf encoding (`application/grpc` or
/// `application/grpc+proto`; not gRPC-Web, not JSON).
fn covered<B>(request: &Request<B>, config: &GrpcConfig) -> Option<MessageDescriptor> {
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)?
        .to_str()
        .ok()?;
    let mime = content_type.split(';').next()?.trim();
    let grpc = mime.eq_ignore_ascii_case("application/grpc")
        || mime.eq_ignore_ascii_case("application/grpc+proto");
    if !grpc {
        return None;
    }
    config.methods.input_of(request.uri().path()).cloned()
}

/// Reads the call's message (within `max_request_bytes`) and makes the
/// Acquire for it; hands back the message's body for the handler.
async fn read_call<B: Body<Data = Bytes>>(
    parts: &Parts,
    body: B,
    key: String,
    input: &MessageDescriptor,
    config: &GrpcConfig,
) -> Result<(AcquireRequest, Bytes), Response<TonicBody>> {
    let body = match capture(body, config.max_request_bytes).await {
        Ok(Captured::Whole(body)) => body,
        Ok(Captured::TooLarge { .. }) => {
            let limit = config.max_request_bytes;
            return Err(status::plain(
                Code::ResourceExhausted,
                reason::TOO_LARGE,
                &format!("the request is larger than {limit} bytes"),
            ));
        }
        Err(_) => return Err(undecodable("the request message could not be read")),
    };
    let fingerprint = message::unframe(&body)
        .and_then(|message| message::fingerprint(input, message, &config.excluded_pointers))
        .map_err(|unreadable| match unreadable {
            Unreadable::Compressed => status::plain(
                Code::Unimplemented,
                reason::COMPRESSED,
                "a compressed request message cannot be fingerprinted: send it uncompressed",
            ),
            Unreadable::Framing => undecodable("the request body is not one gRPC message"),
            Unreadable::Decode(why) => undecodable(&format!(
                "the request message is not a valid {}: {why}",
                input.full_name()
            )),
        })?;
    let acquire = AcquireRequest {
        id: RecordId {
            namespace: config.namespace.clone(),
            operation: operation(parts.uri.path()),
            subject: (config.subject)(parts).unwrap_or_default(),
            key,
        },
        fingerprint,
        ttl: config.ttl,
        lease: Some(config.lease),
    };
    Ok((acquire, body))
}

fn undecodable(message: &str) -> Response<TonicBody> {
    status::plain(Code::InvalidArgument, reason::UNDECODABLE, message)
}

/// The full method name (`/payments.v1.Payments/Charge`). The service allows
/// 128 printable ASCII characters: a longer name is kept distinct by its hash.
fn operation(path: &str) -> String {
    if path.len() <= 128 && path.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return path.to_owned();
    }
    let digest = fingerprint::bytes(path.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("#{hex}")
}

/// Acquires the key and answers: the handler's response, a replay, or a status.
async fn acquire_and_execute<S, ResBody>(
    inner: S,
    client: Client,
    config: Arc<GrpcConfig>,
    acquire: AcquireRequest,
    request: Request<TonicBody>,
) -> Result<Response<TonicBody>, S::Error>
where
    S: Service<Request<TonicBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    let lease = match client.acquire(&acquire).await {
        Ok(Acquisition::Proceed(lease)) => lease,
        Ok(Acquisition::InProgress { retry_after, .. }) => {
            return Ok(status::in_progress(retry_after));
        }
        Ok(Acquisition::Replay(stored) | Acquisition::Failed(stored)) => {
            return Ok(stored::replay(stored));
        }
        Ok(Acquisition::FingerprintMismatch) => return Ok(status::reused()),
        Err(error) if error.is_unavailable() => match config.on_unavailable {
            OnUnavailable::FailClosed => {
                tracing::warn!(%error, "idempotency service unavailable: answering UNAVAILABLE");
                return Ok(status::unavailable());
            }
            OnUnavailable::FailOpen => {
                crate::run::note_fail_open(&acquire.id, &error);
                return pass_through(inner, request).await;
            }
        },
        Err(error) => return Ok(refused(&acquire.id, error)),
    };
    execute(inner, request, lease, config).await
}

/// The answer when the service refused Acquire (it was reachable).
fn refused(id: &RecordId, error: crate::Error) -> Response<TonicBody> {
    match outcome::refusal(id, error) {
        Refusal::NotAuthorized => status::plain(
            Code::Internal,
            reason::NOT_AUTHORIZED,
            "this service may not use idempotency keys for this call; it was not processed",
        ),
        Refusal::InvalidScope(message) => {
            status::plain(Code::InvalidArgument, reason::INVALID_SCOPE, &message)
        }
        Refusal::Failed => status::plain(
            Code::Internal,
            reason::SERVICE_FAILED,
            "the idempotency service failed",
        ),
    }
}

/// Runs the handler holding `lease`, then stores its response or releases the key.
async fn execute<S, ResBody>(
    mut inner: S,
    request: Request<TonicBody>,
    mut lease: Lease,
    config: Arc<GrpcConfig>,
) -> Result<Response<TonicBody>, S::Error>
where
    S: Service<Request<TonicBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    if let Some(every) = config.renew_every {
        lease.keep_alive(every, config.lease);
    }
    let response = match inner.call(request).await {
        Ok(response) => response,
        Err(error) => {
            release(&mut lease).await;
            return Err(error);
        }
    };
    let (parts, body) = response.into_parts();
    Ok(
        match capture_with_trailers(body, config.max_stored_bytes).await {
            Ok((Captured::Whole(body), trailers)) => {
                let code = stored::code_of(&parts.headers, trailers.as_ref());
                if (config.store)(code) {
                    let response =
                        stored::encode(parts.status, &parts.headers, &body, trailers.as_ref());
                    store(&mut lease, &response, &config).await;
                } else {
                    release(&mut lease).await;
                }
                Response::from_parts(parts, stored::whole(body, trailers))
            }
            Ok((Captured::TooLarge { read, rest }, _)) => {
                // The code comes in the trailers, not read yet: the key is
                // settled once they have passed on to the caller.
                let (tx, code) = oneshot::channel();
                tokio::spawn(settle_unstorable(lease, code, config));
                let body = Watched {
                    body: Prefixed::new(read, rest),
                    code: Some(tx),
                };
                Response::from_parts(parts, TonicBody::new(body))
            }
            Err(error) => {
                // Like UNAVAILABLE: the handler failed to answer, so a retry may run it again.
                let error: BoxError = error.into();
                tracing::warn!(%error, "the handler's response body failed: released the key");
                release(&mut lease).await;
                status::plain(
                    Code::Internal,
                    reason::HANDLER_FAILED,
                    "the response could not be produced",
                )
            }
        },
    )
}

/// Stores a response, or a terminal error when it is too large to store.
async fn store(lease: &mut Lease, response: &StoredResponse, config: &GrpcConfig) {
    if response.size() > config.max_stored_bytes
        || outcome::complete(lease, response).await == Completion::Refused
    {
        store_unreplayable(lease, config).await;
    }
}

/// Settles the key of a response too large to store, once its code is known:
/// released when that code is not stored, else a terminal error. Without a
/// code (the caller went away, or the body failed) the handler ran all the
/// same, so retries get the terminal error rather than running it again.
async fn settle_unstorable(
    mut lease: Lease,
    code: oneshot::Receiver<Code>,
    config: Arc<GrpcConfig>,
) {
    match code.await {
        Ok(code) if !(config.store)(code) => release(&mut lease).await,
        _ => store_unreplayable(&mut lease, &config).await,
    }
}

/// The handler ran but its response is too large to store. Running it again
/// on a retry could repeat its effects, so retries get a terminal INTERNAL
/// instead: the call was processed once, its answer cannot be replayed.
async fn store_unreplayable(lease: &mut Lease, config: &GrpcConfig) {
    let limit = config.max_stored_bytes;
    tracing::warn!(key = %lease.id().key, limit, "response too large to store: retries get INTERNAL");
    let message = format!(
        "the call was processed, but its response exceeded {limit} bytes and cannot be replayed"
    );
    let answer = status::answer(status::status(
        Code::Internal,
        reason::NOT_REPLAYABLE,
        &message,
        ErrorDetails::new(),
    ));
    let error = stored::encode(answer.status(), answer.headers(), &Bytes::new(), None);
    if let Err(error) = lease.fail(&error).await {
        tracing::warn!(%error, key = %lease.id().key, "could not store the failure");
    }
}

async fn pass_through<S, ResBody>(
    mut inner: S,
    request: Request<TonicBody>,
) -> Result<Response<TonicBody>, S::Error>
where
    S: Service<Request<TonicBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    Ok(inner.call(request).await?.map(TonicBody::new))
}

/// A response body passed on as it comes, telling the code in its trailers.
struct Watched<B> {
    body: Prefixed<B>,
    code: Option<oneshot::Sender<Code>>,
}

impl<B: Body<Data = Bytes>> Body for Watched<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        // Both fields are Unpin (the body is boxed inside `Prefixed`).
        let this = self.get_mut();
        let frame = std::task::ready!(Pin::new(&mut this.body).poll_frame(cx));
        if let Some(Ok(trailers)) = frame.as_ref().map(|f| f.as_ref().map(Frame::trailers_ref))
            && let (Some(trailers), Some(tx)) = (trailers, this.code.take())
        {
            let _ = tx.send(stored::code_of(&http::HeaderMap::new(), Some(trailers)));
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::testing::{FORBIDDEN_NAMESPACE, FakeService};

    #[test]
    fn an_operation_is_printable_ascii_the_service_accepts() {
        assert_eq!(operation("/t.S/Do"), "/t.S/Do");
        let long = format!("/t.S/{}", "a".repeat(130));
        assert!(operation(&long).len() <= 128);
        assert_ne!(operation(&long), operation(&format!("{long}b")));
    }

    /// The layer in front of a handler that counts its runs, keeping its
    /// keys at an address where nothing listens (failing closed).
    fn layered_handler_without_a_service(
        config: GrpcConfig,
    ) -> (
        impl Service<
            Request<TonicBody>,
            Response = Response<TonicBody>,
            Error = std::convert::Infallible,
        >,
        Arc<AtomicUsize>,
    ) {
        let client = Client::builder()
            .endpoint("http://127.0.0.1:9")
            .connect_lazy()
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let handler = tower::service_fn({
            let ran = ran.clone();
            move |_: Request<TonicBody>| {
                ran.fetch_add(1, Ordering::Relaxed);
                async { Ok::<_, std::convert::Infallible>(Response::new(TonicBody::empty())) }
            }
        });
        (GrpcIdempotency::new(handler, client, Arc::new(config)), ran)
    }

    fn call(content_type: &str, body: &'static [u8]) -> Request<TonicBody> {
        Request::post("/t.S/Do")
            .header("content-type", content_type)
            .header("idempotency-key", "local-0123456789")
            .body(stored::whole(Bytes::from_static(body), None))
            .unwrap()
    }

    async fn answer_to(
        config: GrpcConfig,
        request: Request<TonicBody>,
    ) -> (Option<Code>, String, usize) {
        let (layered, ran) = layered_handler_without_a_service(config);
        let response = tower::ServiceExt::oneshot(layered, request).await.unwrap();
        let status = tonic::Status::from_header_map(response.headers());
        let reason = status.as_ref().map_or_else(String::new, |status| {
            let details = tonic_types::StatusExt::get_error_details(status);
            details
                .error_info()
                .map_or_else(String::new, |info| info.reason.clone())
        });
        (
            status.map(|s| s.code()),
            reason,
            ran.load(Ordering::Relaxed),
        )
    }

    #[tokio::test]
    async fn unreadable_calls_are_answered_before_the_key_is_taken_and_never_run() {
        let config = || GrpcConfig::new("shop", message::test_descriptor_set());
        let cases: [(GrpcConfig, &'static [u8], Code, &str); 4] = [
            (
                config(),
                b"\x01\0\0\0\x02\x08\x05",
                Code::Unimplemented,
                reason::COMPRESSED,
            ),
            (
                config(),
                b"\0\0\0\0\x09\x08\x05",
                Code::InvalidArgument,
                reason::UNDECODABLE,
            ),
            (
                config(),
                b"\0\0\0\0\x02\x0a\x05",
                Code::InvalidArgument,
                reason::UNDECODABLE,
            ),
            (
                config().max_request_bytes(6),
                b"\0\0\0\0\x02\x08\x05",
                Code::ResourceExhausted,
                reason::TOO_LARGE,
            ),
        ];
        for (config, body, code, why) in cases {
            let (answered, reason, ran) = answer_to(config, call("application/grpc", body)).await;
            assert_eq!(
                (answered, reason.as_str(), ran),
                (Some(code), why, 0),
                "{body:?}"
            );
        }
    }

    #[tokio::test]
    async fn grpc_web_and_json_pass_through_untouched() {
        for content_type in [
            "application/grpc-web",
            "application/grpc+json",
            "application/json",
        ] {
            let config = GrpcConfig::new("shop", message::test_descriptor_set());
            let request = call(content_type, b"\0\0\0\0\x02\x08\x05");
            let (answered, _, ran) = answer_to(config, request).await;
            // The handler ran, though the idempotency service is unreachable and failing closed.
            assert_eq!((answered, ran), (None, 1), "{content_type}");
        }
        let config = GrpcConfig::new("shop", message::test_descriptor_set());
        let request = call("application/grpc+proto", b"\0\0\0\0\x02\x08\x05");
        let (answered, reason, ran) = answer_to(config, request).await;
        assert_eq!(
            (answered, reason.as_str(), ran),
            (Some(Code::Unavailable), reason::UNAVAILABLE, 0)
        );
    }

    #[tokio::test]
    async fn a_refused_namespace_answers_internal_and_never_runs_the_handler_even_failing_open() {
        let service = FakeService::plain().await;
        let client = Client::builder()
            .endpoint(format!("http://{}", service.addr))
            .connect_lazy()
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let handler = tower::service_fn({
            let ran = ran.clone();
            move |_: Request<TonicBody>| {
                ran.fetch_add(1, Ordering::Relaxed);
                async { Ok::<_, std::convert::Infallible>(Response::new(TonicBody::empty())) }
            }
        });
        let config = GrpcConfig::new(FORBIDDEN_NAMESPACE, message::test_descriptor_set())
            .on_unavailable(OnUnavailable::FailOpen);
        let layered = GrpcIdempotency::new(handler, client, Arc::new(config));
        let request = Request::post("/t.S/Do")
            .header("content-type", "application/grpc")
            .header("idempotency-key", "refused-0123456789")
            .body(stored::whole(
                Bytes::from_static(b"\0\0\0\0\x02\x08\x05"),
                None,
            ))
            .unwrap();

        let response = tower::ServiceExt::oneshot(layered, request).await.unwrap();

        let status = tonic::Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::Internal);
        let details = tonic_types::StatusExt::get_error_details(&status);
        assert_eq!(details.error_info().unwrap().reason, reason::NOT_AUTHORIZED);
        assert_eq!(ran.load(Ordering::Relaxed), 0);
        assert_eq!(service.seen().len(), 1, "not retried");
    }
}
