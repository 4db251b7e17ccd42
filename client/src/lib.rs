//! Client for the idempotency service: make a service idempotent with one
//! call ([`Client::run`]) or, for HTTP services, one layer
//! (`http::IdempotencyLayer`, feature `http`).
//!
//! - [`Client`]: typed calls (`acquire`, `get`) with per-call timeouts and
//!   retries of transient errors; [`ClientBuilder`] for several endpoints, TLS
//!   (`TlsFiles`, feature `tls`: certificates re-read when they rotate) and a
//!   bearer token ([`TokenSource`]) sent with every call;
//! - [`Acquisition`] and [`Lease`]: the outcome of Acquire and the right to
//!   run the business logic (`complete`, `fail`, `release`, `renew`, `keep_alive`);
//! - [`Client::run`] with [`RunOptions`]: the whole protocol in one call;
//! - [`fingerprint`]: canonical JSON (RFC 8785) and SHA-256;
//! - [`trace`]: a span per call and the W3C `traceparent` each call sends
//!   ([`trace::scope`] to join an incoming request's trace);
//! - [`pb`]: the generated protobuf types and stubs, for anything else.
//!
//! # Quickstart
//!
//! ```no_run
//! use idempotency_client::{AcquireRequest, Client, Failure, Ran, RecordId, RunError, RunOptions, StoredResponse, fingerprint};
//!
//! # async fn charge_card(_: &serde_json::Value) -> Result<String, String> { Ok("pay_1".into()) }
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::connect("http://idempotency:50051").await?;
//!
//! let body = serde_json::json!({"amount": 1000, "currency": "EUR", "meta": {"trace_id": "abc"}});
//! let request = AcquireRequest::new(
//!     RecordId::new("payments", "POST /payments", "3f2c9a1e-5b7d-4c1a-9e0f-2a6b8c4d1e7f").with_subject("user-42"),
//!     fingerprint::json(&body, &["/meta/trace_id"])?,
//! );
//! // A declined card is final: store the 402 so retries get it back. Other errors release the key.
//! let options = RunOptions::new(|error: &String| {
//!     if error.contains("declined") {
//!         Failure::Terminal(StoredResponse::new(402, error.clone()))
//!     } else {
//!         Failure::Retryable
//!     }
//! });
//!
//! match client.run(&request, &options, |_attempt| async {
//!     let payment = charge_card(&body).await?;
//!     Ok(StoredResponse::new(201, payment).with_header("content-type", "text/plain"))
//! }).await {
//!     Ok(Ran::Executed(response) | Ran::Replayed(response) | Ran::Unprotected(response)) => {
//!         println!("answer {} {:?}", response.status_code, response.body);
//!     }
//!     Err(RunError::InProgress { retry_after }) => println!("409, Retry-After: {retry_after:?}"),
//!     Err(RunError::FingerprintMismatch) => println!("422"),
//!     Err(other) => println!("error: {other}"),
//! }
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod balanced_endpoint;
mod batching;
mod client;
mod credentials;
mod error;
pub mod fingerprint;
mod lease;
mod run;
mod socket;
#[cfg(test)]
mod testing;
#[cfg(feature = "tls")]
mod tls;
pub mod trace;
mod transport;
mod types;

#[cfg(feature = "grpc")]
pub mod grpc;
#[cfg(feature = "http")]
pub mod http;
#[cfg(any(feature = "http", feature = "grpc"))]
mod middleware;

pub use batching::Batching;
pub use client::{Client, ClientBuilder, ClientOptions, RetryPolicy};
pub use credentials::{TOKEN_FILE_REFRESH, TokenSource};
pub use error::{Error, NAMESPACE_FORBIDDEN};
pub use lease::{Acquisition, Lease};
pub use run::{Attempt, Failure, OnUnavailable, Ran, RunError, RunOptions, UNSTORABLE_RESPONSE};
#[cfg(feature = "tls")]
pub use tls::TlsFiles;
pub use types::{AcquireRequest, Record, RecordId, RecordState, StoredResponse};

/// Generated protobuf messages and the gRPC client for `idempotency.v1`
/// (from the `idempotency-proto` crate, which the service shares).
pub use idempotency_proto::pb;
