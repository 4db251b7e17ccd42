//! The HTTP `Idempotency-Key` contract as a tower layer (feature `http`),
//! for axum, hyper, or any `http::Request` / `http::Response` service.
//!
//! The layer takes requests with any body (`http_body::Body` of `Bytes`:
//! hyper's `Incoming`, axum's `Body`) and hands your service
//! `Request<`[`RequestBody`]`>`: the bytes it buffered for the fingerprint,
//! or the original body when it did not read it. axum's routers accept it
//! as they are; a plain hyper service is written for it (below).
//!
//! For the routes it wraps and the methods it covers (POST and PATCH by default):
//!
//! | Request | Answer |
//! |---|---|
//! | no `Idempotency-Key` | passed through, or `400` when [`HttpConfig::require_key`] |
//! | malformed key, or a body that is not readable | `400` (`application/problem+json`) |
//! | body over [`HttpConfig::max_body_bytes`] | `413` |
//! | first request | the handler runs; its response is stored (by default 2xx and 4xx) or the key released (by default 5xx and 408, 409, 425, 429: see [`HttpConfig::store_when`]) |
//! | duplicate while the first runs | `409` with `Retry-After` |
//! | duplicate after it finished | the stored status, allow-listed headers and body, with `Idempotent-Replayed: true` |
//! | same key, another body | `422` |
//! | idempotency service unreachable | `503` (fail closed, default) or the handler unprotected (fail open) |
//! | idempotency service refuses this service's credentials or namespace (UNAUTHENTICATED, PERMISSION_DENIED) | `500`, the handler not run, even failing open |
//!
//! The layer's own problem documents have a `type` URI per problem,
//! `urn:idempotency:problem:<name>` unless [`HttpConfig::problem_type_base`]
//! says otherwise, and with [`HttpConfig::problem_docs`] a
//! `Link: <…>; rel="describedby"` header to their documentation.
//!
//! The scope of a key: namespace = [`HttpConfig::new`]'s service name,
//! operation = method + route template (axum's `MatchedPath`, else the
//! path), subject = [`HttpConfig::subject`] of the request (e.g. the
//! authenticated user), so one user's key never answers another's.
//!
//! Once a request holds the key, its handler runs in a task of its own and
//! its response is stored even if the client goes away: a client that timed
//! out and retries gets `409` and then the stored response, and the handler
//! runs once.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idempotency_client::{Client, http::{HttpConfig, IdempotencyLayer}};
//!
//! # async fn create_payment() -> &'static str { "ok" }
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::builder().endpoint("http://idempotency:50051").connect_lazy()?;
//! let config = HttpConfig::new("payments")
//!     .require_key(true)
//!     .exclude_json_pointer("/meta/trace_id")
//!     .subject(|request| {
//!         request.headers.get("x-user-id").and_then(|v| v.to_str().ok()).map(str::to_owned)
//!     });
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .layer(IdempotencyLayer::new(client, config));
//! # Ok(())
//! # }
//! ```
//!
//! On plain hyper, through hyper-util's `TowerToHyperService`:
//!
//! ```no_run
//! use std::convert::Infallible;
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use hyper::body::Bytes;
//! use hyper_util::{rt::TokioIo, service::TowerToHyperService};
//! use idempotency_client::{Client, http::{HttpConfig, IdempotencyLayer, RequestBody}};
//! use tower::{Layer, service_fn};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::builder().endpoint("http://idempotency:50051").connect_lazy()?;
//! let charge = service_fn(|request: Request<RequestBody>| async move {
//!     let body = request.into_body().collect().await?.to_bytes();
//!     Ok::<_, idempotency_client::http::BoxError>(Response::new(Full::new(body)))
//! });
//! let service = IdempotencyLayer::new(client, HttpConfig::new("payments")).layer(charge);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! loop {
//!     let (stream, _) = listener.accept().await?;
//!     let service = TowerToHyperService::new(service.clone());
//!     tokio::spawn(hyper::server::conn::http1::Builder::new()
//!         .serve_connection(TokioIo::new(stream), service));
//! }
//! # }
//! ```

mod body;
mod config;
mod layer;
mod problem;
mod service;

// Shared with the gRPC layer.
use crate::middleware::key;

pub use body::{BoxError, RequestBody, ResponseBody};
pub use config::HttpConfig;
pub use layer::IdempotencyLayer;
pub use service::Idempotency;

/// The request header carrying the key (IETF draft `Idempotency-Key`).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set to `true` on responses replayed from storage.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
