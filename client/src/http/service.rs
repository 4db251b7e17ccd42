//! The middleware itself: from an HTTP request to Acquire, the handler, and Complete.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, request::Parts};
use http_body::Body;
use tower::Service;

use super::{
    HttpConfig, IDEMPOTENT_REPLAYED,
    body::{self, BoxError, Captured, Prefixed, RequestBody, ResponseBody},
    key::{self, KeyHeader},
};
use crate::{
    AcquireRequest, Acquisition, Client, Error, Lease, OnUnavailable, RecordId, StoredResponse,
    fingerprint,
    middleware::outcome::{self, Completion, Refusal, release},
};

/// The service [`super::IdempotencyLayer`] wraps around yours.
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    client: Client,
    config: Arc<HttpConfig>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, client: Client, config: Arc<HttpConfig>) -> Self {
        Self {
            inner,
            client,
            config,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Call the instance that was made ready; leave a fresh clone behind.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        // The calls made on the request's behalf join its trace (`traceparent`).
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
    config: Arc<HttpConfig>,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    if !config.methods.contains(request.method()) {
        return pass_through(inner, request.map(RequestBody::boxed)).await;
    }
    let key = match key::read(request.headers()) {
        KeyHeader::Present(key) => key,
        KeyHeader::Missing if !config.require_key => {
            return pass_through(inner, request.map(RequestBody::boxed)).await;
        }
        KeyHeader::Missing => {
            return Ok(config.problems.problem(
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "this operation requires an Idempotency-Key header",
            ));
        }
        KeyHeader::Malformed(why) => {
            return Ok(config.problems.problem(
                StatusCode::BAD_REQUEST,
                "malformed-idempotency-key",
                why,
            ));
        }
    };
    let (acquire, request) = match read_request(request, key, &config).await {
        Ok(read) => read,
        Err(problem) => return Ok(problem),
    };

    // From here on the work runs in a task of its own, so that it finishes,
    // and its response is stored, even when the client goes away mid-request:
    // the client's retry then gets 409 and later the stored answer, and the
    // handler runs once (see `outcome::detached`).
    let work = acquire_and_execute(inner, client, config.clone(), acquire, request);
    match outcome::detached(work).await {
        Some(result) => result,
        None => Ok(config.problems.problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler-cancelled",
            "the handler was cancelled",
        )),
    }
}

/// Reads the request's body (within `max_body_bytes`) and makes the Acquire
/// for it; hands back the request, body and all, for the handler.
async fn read_request<ReqBody>(
    request: Request<ReqBody>,
    key: String,
    config: &HttpConfig,
) -> Result<(AcquireRequest, Request<RequestBody>), Response<ResponseBody>>
where
    ReqBody: Body<Data = Bytes>,
{
    let (parts, request_body) = request.into_parts();
    let bytes = match body::capture(request_body, config.max_body_bytes).await {
        Ok(Captured::Whole(bytes)) => bytes,
        Ok(Captured::TooLarge { .. }) => {
            return Err(config.problems.problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                &format!("the request body exceeds {} bytes", config.max_body_bytes),
            ));
        }
        Err(_) => {
            return Err(config.problems.problem(
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "the request body could not be read",
            ));
        }
    };
    let acquire = AcquireRequest {
        id: RecordId {
            namespace: config.namespace.clone(),
            operation: operation(&parts),
            subject: (config.subject)(&parts).unwrap_or_default(),
            key,
        },
        fingerprint: request_fingerprint(&parts, &bytes, config),
        ttl: config.ttl,
        lease: Some(config.lease),
    };
    Ok((
        acquire,
        Request::from_parts(parts, RequestBody::buffered(bytes)),
    ))
}

/// Acquires the key and answers: the handler's response, a replay, or a problem.
async fn acquire_and_execute<S, ResBody>(
    inner: S,
    client: Client,
    config: Arc<HttpConfig>,
    acquire: AcquireRequest,
    request: Request<RequestBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    let lease = match client.acquire(&acquire).await {
        Ok(Acquisition::Proceed(lease)) => lease,
        Ok(Acquisition::InProgress { retry_after, .. }) => {
            return Ok(config.problems.in_progress(retry_after));
        }
        Ok(Acquisition::Replay(stored) | Acquisition::Failed(stored)) => return Ok(replay(stored)),
        Ok(Acquisition::FingerprintMismatch) => {
            return Ok(config.problems.problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "this Idempotency-Key was already used with a different request",
            ));
        }
        Err(error) if error.is_unavailable() => match config.on_unavailable {
            OnUnavailable::FailClosed => {
                tracing::warn!(%error, "idempotency service unavailable: answering 503");
                return Ok(config.problems.unavailable());
            }
            OnUnavailable::FailOpen => {
                crate::run::note_fail_open(&acquire.id, &error);
                return pass_through(inner, request).await;
            }
        },
        Err(error) => return Ok(refused(&acquire.id, error, &config)),
    };
    execute(inner, request, lease, config).await
}

/// The answer when the service refused Acquire (it was reachable).
fn refused(id: &RecordId, error: Error, config: &HttpConfig) -> Response<ResponseBody> {
    // Credentials or namespace refused: never run the handler, even failing
    // open (see `outcome::Refusal`).
    match outcome::refusal(id, error) {
        Refusal::NotAuthorized => config.problems.not_authorized(),
        // The scope comes from the request (e.g. a subject too long): the client's fault.
        Refusal::InvalidScope(message) => config.problems.problem(
            StatusCode::BAD_REQUEST,
            "invalid-idempotency-scope",
            &message,
        ),
        Refusal::Failed => config.problems.problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency-error",
            "the idempotency service failed",
        ),
    }
}

/// Runs the handler holding `lease`, then stores its response or releases the key.
async fn execute<S, ResBody>(
    mut inner: S,
    request: Request<RequestBody>,
    mut lease: Lease,
    config: Arc<HttpConfig>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResBody>>,
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
    let (parts, response_body) = response.into_parts();
    Ok(
        match body::capture(response_body, config.max_stored_bytes).await {
            Ok(Captured::Whole(bytes)) => {
                store_or_release(&mut lease, &parts, &bytes, &config).await;
                Response::from_parts(parts, body::full(bytes))
            }
            Ok(Captured::TooLarge { read, rest }) => {
                // A response that would not be stored anyway (a 5xx) releases the
                // key whatever its size.
                if (config.store)(parts.status) {
                    store_unreplayable(&mut lease, &config).await;
                } else {
                    release(&mut lease).await;
                }
                Response::from_parts(parts, body::boxed(Prefixed::new(read, rest)))
            }
            Err(error) => {
                // Like a 5xx: the handler failed to answer, so a retry may run it again.
                let error: BoxError = error.into();
                tracing::warn!(%error, "the handler's response body failed: released the key");
                release(&mut lease).await;
                config.problems.problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "handler-body-failed",
                    "the response could not be produced",
                )
            }
        },
    )
}

/// Stores the handler's whole response for replay, or releases the key when
/// `config.store` says this status is not stored.
async fn store_or_release(
    lease: &mut Lease,
    parts: &http::response::Parts,
    bytes: &Bytes,
    config: &HttpConfig,
) {
    if !(config.store)(parts.status) {
        return release(lease).await;
    }
    let stored = StoredResponse {
        status_code: u32::from(parts.status.as_u16()),
        body: bytes.to_vec(),
        headers: replayable_headers(&parts.headers, config),
    };
    if stored.size() > config.max_stored_bytes {
        return store_unreplayable(lease, config).await;
    }
    // The service's own limit is lower than ours, or the message is over its
    // transport limit.
    if outcome::complete(lease, &stored).await == Completion::Refused {
        store_unreplayable(lease, config).await;
    }
}

/// The handler ran but its response is too large to store. Running it again
/// on a retry could repeat its effects, so retries get a terminal error
/// instead: the request was processed once, its answer cannot be replayed.
async fn store_unreplayable(lease: &mut Lease, config: &HttpConfig) {
    let limit = config.max_stored_bytes;
    tracing::warn!(key = %lease.id().key, limit, "response too large to store: retries get a 500");
    let body = config.problems.document(
        StatusCode::INTERNAL_SERVER_ERROR,
        "response-not-replayable",
        &format!(
            "the request was processed, but its response exceeded {limit} bytes and cannot be replayed"
        ),
    );
    let mut error =
        StoredResponse::new(500, body).with_header("content-type", "application/problem+json");
    if let Some(link) = config
        .problems
        .described_by
        .as_ref()
        .and_then(|l| l.to_str().ok())
    {
        error = error.with_header("link", link);
    }
    if let Err(error) = lease.fail(&error).await {
        tracing::warn!(%error, key = %lease.id().key, "could not store the failure");
    }
}

async fn pass_through<S, ResBody>(
    mut inner: S,
    request: Request<RequestBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    Ok(inner.call(request).await?.map(body::boxed))
}

/// Method and route template (`POST /payments/{id}`), so that every request
/// to one route shares a scope whatever its path parameters.
fn operation(parts: &Parts) -> String {
    let route = parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| parts.uri.path(), |matched| matched.as_str());
    let operation = format!("{} {route}", parts.method);
    if operation.len() <= 128 && operation.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return operation;
    }
    // The service allows 128 printable ASCII characters: a long path, or one
    // with other characters (`/café`, sent unencoded), is kept distinct by its hash.
    let digest = fingerprint::bytes(route.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{} #{hex}", parts.method)
}

/// What makes two requests "the same": the concrete path and query (the
/// operation holds only the route template, so `/payments/1/capture` and
/// `/payments/2/capture` share a scope and must differ here), and the body:
/// canonical JSON when it is JSON (so key order and whitespace do not
/// matter), else its bytes.
fn request_fingerprint(parts: &Parts, body: &[u8], config: &HttpConfig) -> Vec<u8> {
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |target| target.as_str());
    let mut input = fingerprint::bytes(target.as_bytes());
    input.extend(body_fingerprint(parts, body, config));
    fingerprint::bytes(&input)
}

fn body_fingerprint(parts: &Parts, body: &[u8], config: &HttpConfig) -> Vec<u8> {
    let is_json = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(|mime| {
            let mime = mime.trim();
            mime.eq_ignore_ascii_case("application/json")
                || mime
                    .get(mime.len().saturating_sub(5)..)
                    .is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"))
        })
        .unwrap_or(false);
    if is_json && let Ok(fingerprint) = fingerprint::json_body(body, &config.excluded_pointers) {
        return fingerprint;
    }
    fingerprint::bytes(body)
}

fn replayable_headers(
    headers: &http::HeaderMap,
    config: &HttpConfig,
) -> std::collections::BTreeMap<String, String> {
    config
        .replay_headers
        .iter()
        .filter_map(|name| {
            // UTF-8, not only ASCII: a `Location` may carry it unencoded.
            let values: Vec<&str> = headers
                .get_all(name)
                .iter()
                .filter_map(|value| match std::str::from_utf8(value.as_bytes()) {
                    Ok(text) => Some(text),
                    Err(_) => {
                        tracing::warn!(header = %name, "a header value that is not UTF-8 is not stored");
                        None
                    }
                })
                .collect();
            (!values.is_empty()).then(|| (name.as_str().to_owned(), values.join(", ")))
        })
        .collect()
}

fn replay(stored: StoredResponse) -> Response<ResponseBody> {
    let mut response = Response::new(body::full(Bytes::from(stored.body)));
    *response.status_mut() = u16::try_from(stored.status_code)
        .ok()
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::try_from(name),
            HeaderValue::try_from(value),
        ) {
            headers.insert(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operation_of(path: &[u8]) -> String {
        let uri = http::Uri::from_maybe_shared(Bytes::copy_from_slice(path)).unwrap();
        let (parts, ()) = Request::post(uri).body(()).unwrap().into_parts();
        operation(&parts)
    }

    #[test]
    fn an_operation_is_printable_ascii_the_service_accepts() {
        assert_eq!(operation_of(b"/payments"), "POST /payments");
        for path in [
            "/caf\u{e9}".as_bytes().to_vec(),
            format!("/{}", "a".repeat(130)).into_bytes(),
        ] {
            let operation = operation_of(&path);
            assert!(
                operation.len() <= 128 && operation.bytes().all(|b| (0x20..=0x7e).contains(&b)),
                "{operation}"
            );
        }
        // Distinct paths keep distinct operations.
        assert_ne!(
            operation_of("/caf\u{e9}".as_bytes()),
            operation_of("/caf\u{e8}".as_bytes())
        );
    }

    #[test]
    fn headers_are_replayed_as_the_handler_sent_them() {
        let mut sent = http::HeaderMap::new();
        sent.insert(
            "location",
            HeaderValue::from_bytes("/caf\u{e9}/1".as_bytes()).unwrap(),
        );
        sent.insert("content-encoding", HeaderValue::from_static("gzip"));
        sent.insert("x-other", HeaderValue::from_static("not replayed"));
        let stored = StoredResponse {
            status_code: 201,
            body: b"body".to_vec(),
            headers: replayable_headers(&sent, &crate::http::HttpConfig::new("shop")),
        };

        let replayed = replay(stored);
        assert_eq!(
            replayed.headers()["location"].as_bytes(),
            "/caf\u{e9}/1".as_bytes()
        );
        assert_eq!(replayed.headers()["content-encoding"], "gzip");
        assert!(!replayed.headers().contains_key("x-other"));
    }

    #[tokio::test]
    async fn a_refused_namespace_answers_500_and_never_runs_the_handler_even_failing_open() {
        use std::sync::atomic::{AtomicUsize, Ordering};

        use crate::testing::{FORBIDDEN_NAMESPACE, FakeService};
        let service = FakeService::plain().await;
        let client = Client::builder()
            .endpoint(format!("http://{}", service.addr))
            .connect_lazy()
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let handler = tower::service_fn({
            let ran = ran.clone();
            move |_: Request<RequestBody>| {
                ran.fetch_add(1, Ordering::Relaxed);
                async {
                    Ok::<_, std::convert::Infallible>(Response::new(axum::body::Body::from("ran")))
                }
            }
        });
        let config = HttpConfig::new(FORBIDDEN_NAMESPACE).on_unavailable(OnUnavailable::FailOpen);
        let layered = Idempotency::new(handler, client, Arc::new(config));
        let request = Request::post("/payments")
            .header("idempotency-key", "refused-0123456789")
            .body(axum::body::Body::from("{}"))
            .unwrap();

        let response = tower::ServiceExt::oneshot(layered, request).await.unwrap();

        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(ran.load(Ordering::Relaxed), 0);
        assert_eq!(service.seen().len(), 1, "not retried");
    }
}
