//! Client for the idempotency service.
//!
//! [`pb`] holds the stubs generated from `proto/idempotency/v1/idempotency.proto`,
//! the contract; every message and field is documented there.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// Generated protobuf messages and the gRPC client for `idempotency.v1`.
#[allow(missing_docs)]
pub mod pb {
    tonic::include_proto!("idempotency.v1");
}
