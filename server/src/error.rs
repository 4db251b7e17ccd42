//! The errors the engine answers with. Expected outcomes (in progress, replay,
//! mismatch) are values of [`crate::domain::AcquireOutcome`], not errors.
//! `grpc::status` maps each variant to a gRPC code in one place.

use crate::{domain::InvalidField, store::StoreError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is malformed or out of range (found by the grpc
    /// layer, before the engine runs); nothing was written.
    #[error(transparent)]
    InvalidArgument(#[from] InvalidField),
    /// No live record has this id.
    #[error("no live record has this id")]
    NotFound,
    /// The fencing token is not the record's current one.
    #[error(
        "fencing token {given} is not current (current is {current}): another attempt took the key over"
    )]
    StaleToken { given: u64, current: u64 },
    /// The record is already finished with another response.
    #[error("the record is already {state} with a different response")]
    ResponseConflict { state: &'static str },
    /// The operation needs an in-progress record.
    #[error("the record is {state}, not in progress")]
    NotInProgress { state: &'static str },
    /// The record changed between every statement and the read explaining it.
    #[error("{0}: the record changed on every attempt")]
    Contention(&'static str),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}
