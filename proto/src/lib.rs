//! The idempotency service's API, shared by the service (`idempotency-server`)
//! and its client (`idempotency-client`), so that each type exists once:
//!
//! - [`pb`]: the messages and stubs generated from
//!   `idempotency/v1/idempotency.proto` (the server trait with feature
//!   `server`, the client stub with feature `client`), and the encoded
//!   descriptors for gRPC reflection;
//! - [`StoredResponse`]: a response kept for replay, with the size rule the
//!   service's response limit counts;
//! - [`RecordState`]: where a record is in its life;
//! - [`reason`]: the `google.rpc.ErrorInfo` reasons (domain [`ERROR_DOMAIN`])
//!   that errors carry, for branching on something other than message text;
//! - [`trace`]: the W3C `traceparent` header clients send and the service reads.
//!
//! Nothing here touches the network or a database: the rules live in the
//! server, the conveniences of callers in the client.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod reason;
mod response;
mod state;
pub mod trace;

pub use reason::ERROR_DOMAIN;
pub use response::StoredResponse;
pub use state::RecordState;

/// Messages and stubs generated from `idempotency/v1/idempotency.proto`: the
/// server trait (`idempotency_service_server`) with feature `server`, the
/// client stub (`idempotency_service_client`) with feature `client`.
#[allow(missing_docs)]
pub mod pb {
    tonic::include_proto!("idempotency.v1");

    /// The encoded descriptors, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("idempotency_descriptor");
}
