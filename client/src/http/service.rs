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
    body::{self, BoxError, Captured, Prefixed, ResponseBody},
    key::{self, KeyHeader},
    problem::{self, problem},
};
use crate::{
    AcquireRequest, Acquisition, Client, Error, Lease, OnUnavailable, RecordId, StoredResponse,
    fingerprint,
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
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Send,
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
        Box::pin(handle(
            inner,
            self.client.clone(),
            self.config.clone(),
            request,
        ))
    }
}

async fn handle<S, ReqBody, ResBody>(
    inner: S,
    client: Client,
    config: Arc<HttpConfig>,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Send,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError> + Send,
{
    if !config.methods.contains(request.method()) {
        return pass_through(inner, request).await;
    }
    let key = match key::read(request.headers()) {
        KeyHeader::Present(key) => key,
        KeyHeader::Missing if !config.require_key => return pass_through(inner, request).await,
        KeyHeader::Missing => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "this operation requires an Idempotency-Key header",
            ));
        }
        KeyHeader::Malformed(why) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "malformed-idempotency-key",
                why,
            ));
        }
    };

    let (parts, request_body) = request.into_parts();
    let bytes = match body::capture(request_body, config.max_body_bytes).await {
        Ok(Captured::Whole(bytes)) => bytes,
        Ok(Captured::TooLarge { .. }) => {
            return Ok(problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                &format!("the request body exceeds {} bytes", config.max_body_bytes),
            ));
        }
        Err(_) => {
            return Ok(problem(
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
        fingerprint: request_fingerprint(&parts, &bytes, &config),
        ttl: config.ttl,
        lease: Some(config.lease),
    };
    let request = Request::from_parts(parts, ReqBody::from(bytes));

    let lease = match client.acquire(&acquire).await {
        Ok(Acquisition::Proceed(lease)) => lease,
        Ok(Acquisition::InProgress { retry_after, .. }) => {
            return Ok(problem::in_progress(retry_after));
        }
        Ok(Acquisition::Replay(stored) | Acquisition::Failed(stored)) => return Ok(replay(stored)),
        Ok(Acquisition::FingerprintMismatch) => {
            return Ok(problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "this Idempotency-Key was already used with a different request",
            ));
        }
        Err(error) if error.is_unavailable() => match config.on_unavailable {
            OnUnavailable::FailClosed => {
                tracing::warn!(%error, "idempotency service unavailable: answering 503");
                return Ok(problem::unavailable());
            }
            OnUnavailable::FailOpen => {
                metrics::counter!("idempotency_client_fail_open_total", "namespace" => config.namespace.clone())
                    .increment(1);
                tracing::warn!(%error, operation = %acquire.id.operation,
                    "idempotency service unavailable: running unprotected (fail open)");
                return pass_through(inner, request).await;
            }
        },
        Err(Error::InvalidArgument { message, .. }) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-scope",
                &message,
            ));
        }
        Err(error) => {
            tracing::error!(%error, "idempotency service refused Acquire");
            return Ok(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "idempotency-error",
                "the idempotency service failed",
            ));
        }
    };

    // The handler runs in a task of its own so that it finishes, and its
    // response is stored, even when the client goes away mid-request: the
    // client's retry then gets 409 and later the stored answer, and the
    // handler runs once. A panic there drops the lease, which releases the key.
    let executed = tokio::spawn(execute(inner, request, lease, config));
    match executed.await {
        Ok(result) => result,
        Err(join_error) if join_error.is_panic() => {
            std::panic::resume_unwind(join_error.into_panic())
        }
        Err(_) => Ok(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler-cancelled",
            "the handler was cancelled",
        )),
    }
}

/// Runs the handler holding `lease`, then stores its response or releases the key.
async fn execute<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
    mut lease: Lease,
    config: Arc<HttpConfig>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
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
    match body::capture(response_body, config.max_stored_bytes).await {
        Ok(Captured::Whole(bytes)) => {
            if (config.store)(parts.status) {
                let stored = StoredResponse {
                    status_code: u32::from(parts.status.as_u16()),
                    body: bytes.to_vec(),
                    headers: replayable_headers(&parts.headers, &config),
                };
                match lease.complete(&stored).await {
                    Ok(()) => {}
                    Err(Error::LeaseLost) => tracing::error!(
                        key = %lease.id().key,
                        "lease lost before the response was stored: the handler may have run twice"
                    ),
                    Err(error) => {
                        tracing::warn!(%error, key = %lease.id().key, "response not stored")
                    }
                }
            } else {
                release(&mut lease).await;
            }
            Ok(Response::from_parts(parts, body::full(bytes)))
        }
        Ok(Captured::TooLarge { read, rest }) => {
            tracing::warn!(key = %lease.id().key, limit = config.max_stored_bytes,
                "response too large to store: released the key");
            release(&mut lease).await;
            Ok(Response::from_parts(
                parts,
                body::boxed(Prefixed::new(read, rest)),
            ))
        }
        Err(error) => {
            let error: BoxError = error.into();
            tracing::warn!(%error, "the handler's response body failed: released the key");
            release(&mut lease).await;
            Ok(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "handler-body-failed",
                "the response could not be produced",
            ))
        }
    }
}

async fn release(lease: &mut Lease) {
    if let Err(error) = lease.release().await {
        tracing::warn!(%error, key = %lease.id().key, "could not release the key");
    }
}

async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
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
    if operation.len() <= 128 {
        return operation;
    }
    // The service allows 128 characters: a long path is kept distinct by its hash.
    let digest = fingerprint::bytes(route.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{} #{hex}", parts.method)
}

/// Canonical JSON when the body is JSON (so key order and whitespace do not
/// matter), else the bytes as they are.
fn request_fingerprint(parts: &Parts, body: &[u8], config: &HttpConfig) -> Vec<u8> {
    let is_json = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(|mime| {
            let mime = mime.trim().to_ascii_lowercase();
            mime == "application/json" || mime.ends_with("+json")
        })
        .unwrap_or(false);
    if is_json {
        let excluded: Vec<&str> = config
            .excluded_pointers
            .iter()
            .map(String::as_str)
            .collect();
        if let Ok(fingerprint) = fingerprint::json_bytes(body, &excluded) {
            return fingerprint;
        }
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
            let values: Vec<&str> = headers
                .get_all(name)
                .iter()
                .filter_map(|value| value.to_str().ok())
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
