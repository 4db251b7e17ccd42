//! The gRPC surface: thin adapters from protobuf to the engine and back.
//!
//! - [`connections`]: how many clients may connect, how soon they must greet,
//!   and the HTTP/2 limits each connection is served with; [`call_limit`]:
//!   how many calls may be in flight across them all;
//! - [`deadline`]: every call answers by its deadline or --request-timeout;
//! - [`admission`]: what a call may cost, refused before it is decoded
//!   (message sizes, item and header counts, the memory budget), with
//!   [`wire`] counting fields without decoding;
//! - [`auth`]: who is calling ([`auth::AuthLayer`]) and whether they may touch
//!   a namespace ([`auth::Authorizer`]), with auth on;
//! - [`service`]: one method per RPC: convert, call the engine, convert back;
//! - [`convert`]: protobuf <-> domain types, with field paths for errors;
//! - [`status`]: the one place engine errors become `tonic::Status`;
//! - [`metrics`]: per-call count and duration, recorded even when a call is cancelled;
//! - [`trace`]: each call in a span with the caller's trace id (W3C
//!   `traceparent`), and the `--log-calls` line.

pub mod admission;
pub mod auth;
pub mod call_limit;
pub mod connections;
pub mod convert;
pub mod deadline;
pub mod metrics;
pub mod service;
pub mod status;
pub mod stream;
pub mod trace;
pub mod wire;
pub mod write_hold;

/// Messages and the server trait generated from `proto/idempotency/v1/idempotency.proto`
/// (the `idempotency-proto` crate, shared with the client), with the encoded
/// descriptors reflection serves.
pub use idempotency_proto::pb;

pub use service::GrpcService;
