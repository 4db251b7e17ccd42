//! The `idempotency-key` contract for gRPC services as a tower layer
//! (feature `grpc`), for tonic servers or any `http::Request` service
//! speaking gRPC.
//!
//! ```no_run
//! use idempotency_client::{Client, grpc::{GrpcConfig, GrpcIdempotencyLayer}};
//!
//! # fn routes() -> tonic::service::Routes { unimplemented!() }
//! # async fn example(descriptor_set: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::builder().endpoint("http://idempotency:50051").connect_lazy()?;
//! // `descriptor_set`: the encoded FileDescriptorSet of your protos, e.g. from
//! // tonic-prost-build's `file_descriptor_set_path` (tonic-reflection serves it too).
//! let config = GrpcConfig::new("payments", descriptor_set)
//!     .require_key(true)
//!     .exclude_json_pointer("/metadata/traceId")
//!     .subject(|request| {
//!         request.headers.get("x-user-id").and_then(|v| v.to_str().ok()).map(str::to_owned)
//!     });
//! tonic::transport::Server::builder()
//!     .layer(GrpcIdempotencyLayer::new(client, config))
//!     .add_routes(routes())
//!     .serve("0.0.0.0:50052".parse()?)
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! It covers the **unary** methods of the services in [`GrpcConfig::new`]'s
//! descriptor set, called in gRPC's protobuf encoding (`content-type`
//! `application/grpc` or `application/grpc+proto`). Everything else passes
//! through untouched: methods not in the descriptor set, client- or
//! server-streaming methods (no single request and answer to store), and
//! other encodings (gRPC-Web, `application/grpc+json`). For a covered call:
//!
//! | Call | Answer |
//! |---|---|
//! | no `idempotency-key` metadata | passed through, or `INVALID_ARGUMENT` (`IDEMPOTENCY_KEY_MISSING`) when [`GrpcConfig::require_key`] |
//! | malformed key (not 8-128 printable ASCII, or sent twice) | `INVALID_ARGUMENT` (`IDEMPOTENCY_KEY_MALFORMED`), with a `BadRequest` field violation `idempotency-key` |
//! | a message that does not decode as the method's request type | `INVALID_ARGUMENT` (`REQUEST_MESSAGE_UNDECODABLE`) |
//! | a compressed request message | `UNIMPLEMENTED` (`REQUEST_MESSAGE_COMPRESSED`): it cannot be fingerprinted |
//! | request over [`GrpcConfig::max_request_bytes`] (4 MiB) | `RESOURCE_EXHAUSTED` (`REQUEST_TOO_LARGE`), the handler not run |
//! | first call | the handler runs; its response is stored when its code is (by default all but the six below), else the key is released: see [`GrpcConfig::store_when`] |
//! | duplicate while the first runs | `ABORTED` (`IDEMPOTENCY_KEY_IN_PROGRESS`) with a `RetryInfo` (the service's retry-after) |
//! | duplicate after it finished | the stored initial metadata, message and trailers, with `idempotent-replayed: true` in the initial metadata |
//! | same key, another request message | `FAILED_PRECONDITION` (`IDEMPOTENCY_KEY_REUSED`) |
//! | idempotency service unreachable | `UNAVAILABLE` (`IDEMPOTENCY_UNAVAILABLE`, fail closed, default) or the handler unprotected (fail open) |
//! | idempotency service refuses this service's credentials or namespace | `INTERNAL` (`IDEMPOTENCY_NOT_AUTHORIZED`), the handler not run, even failing open |
//!
//! Every status the layer makes carries a `google.rpc.ErrorInfo` with domain
//! `idempotency` and the reason in brackets above ([`reason`]), so clients
//! tell the layer's answers from the handler's. By default `UNAVAILABLE`,
//! `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL` and
//! `UNKNOWN` release the key (the handler runs again on a retry) and every
//! other code, `OK` included, is stored and replayed.
//!
//! **Why `FAILED_PRECONDITION` for a reused key:** the request is valid on
//! its own, so it is not `INVALID_ARGUMENT`; it conflicts with the state the
//! key is in (it already answers another request), and retrying it
//! unchanged never succeeds, so it is not `ABORTED` either, which clients
//! and meshes retry. A reused key is the caller's bug: send a new key for a
//! new request.
//!
//! The scope of a key: namespace = [`GrpcConfig::new`]'s name, operation =
//! the full method name (`/payments.v1.Payments/Charge`), subject =
//! [`GrpcConfig::subject`] of the call (from metadata, or the authenticated
//! peer from the request's extensions), so one user's key never answers
//! another's.
//!
//! Once a call holds the key, its handler runs in a task of its own and its
//! response is stored even if the caller goes away (hangs up, or its
//! deadline passes): the retry gets `ABORTED` and then the stored answer,
//! and the handler runs once. While it runs, the lease is renewed.
//!
//! # The fingerprint: a cross-language contract
//!
//! Two calls under one key are "the same request" when their messages mean
//! the same, however a client library encoded them. The fingerprint is
//!
//! ```text
//! SHA-256( RFC 8785 canonical JSON( proto3 JSON of the request message,
//!                                   without the excluded JSON pointers ) )
//! ```
//!
//! where the proto3 JSON is protobuf's standard JSON mapping with default
//! options (Go's `protojson.Marshal`, Java's `JsonFormat.printer()`,
//! Python's `MessageToJson` with `preserving_proto_field_name=False`):
//! fields under their `json_name` (lowerCamelCase), fields holding their
//! default value omitted (unless they have explicit presence, `optional`),
//! 64-bit integers as decimal strings, enums by name, bytes as padded
//! standard base64, well-known types in their JSON forms (a `Timestamp` as
//! RFC 3339), unknown fields dropped. The canonical form is this crate's
//! [`crate::fingerprint::json`]: object keys sorted, numbers in their
//! shortest form, no whitespace. So field order, map entry order, packed or
//! unpacked repeated fields, unknown fields and `1` versus `1.0` do not
//! change the fingerprint; any change of a value, of a repeated field's
//! order, or of the message type does. Excluded pointers
//! ([`GrpcConfig::exclude_json_pointer`]) use the JSON names
//! (`/metadata/traceId`). The method is part of the key's scope, not of the
//! fingerprint.
//!
//! # What is stored
//!
//! The response as a [`crate::StoredResponse`]: status `200`, the
//! response body as sent (the length-prefixed message), the initial
//! metadata under its own names and the trailers under `trailer:<name>`
//! (`trailer:grpc-status`, `trailer:grpc-message`,
//! `trailer:grpc-status-details-bin`, your trailing metadata); a
//! trailers-only error keeps `grpc-status` among its headers and replays
//! trailers-only. Hop-by-hop headers are left out. A message compressed by
//! the handler is stored compressed, with its `grpc-encoding`, so keep
//! response compression off behind this layer or accept replaying it.

mod config;
mod layer;
mod message;
mod service;
mod status;
mod stored;

pub use config::GrpcConfig;
pub use layer::GrpcIdempotencyLayer;
pub use service::GrpcIdempotency;
pub use status::{ERROR_DOMAIN, reason};
pub use stored::TRAILER_PREFIX;

/// The request metadata carrying the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set to `true` in the initial metadata of responses replayed from storage.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
