use std::time::Duration;

use super::{FencingToken, Fingerprint, RecordId, StoredResponse, Timestamp};

/// Where a record is in its life; shared with the client. `as_str` and
/// `from_stored` give the spelling of the `state` column.
pub use idempotency_proto::RecordState;

/// Exactly one answer to an Acquire. Expected outcomes are values, not errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// The caller holds the key and must run its business logic.
    Acquired {
        fencing_token: FencingToken,
        lease_expires_at: Timestamp,
        expires_at: Timestamp,
        /// The previous holder's lease had passed: it crashed or was too slow.
        takeover: bool,
    },
    /// Another attempt holds a live lease.
    InProgress {
        lease_expires_at: Timestamp,
        retry_after: Duration,
    },
    /// A previous attempt completed; replay its response.
    Completed {
        response: StoredResponse,
        completed_at: Timestamp,
    },
    /// A previous attempt failed terminally; replay its error.
    Failed {
        error_response: StoredResponse,
        failed_at: Timestamp,
    },
    /// The key was first used with another request.
    FingerprintMismatch,
}

/// A live record as Get returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub id: RecordId,
    pub state: RecordState,
    pub fingerprint: Fingerprint,
    pub fencing_token: FencingToken,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
    pub lease_expires_at: Option<Timestamp>,
    pub completed_at: Option<Timestamp>,
    /// The stored response (completed) or error response (failed).
    pub response: Option<StoredResponse>,
}
