//! The vocabulary of the service: what a record is, its parts, its life.
//! Every type here holds only valid values; parsing lives beside each type.

mod fingerprint;
mod limits;
mod outcome;
mod record_id;
mod response;

pub use fingerprint::Fingerprint;
pub use limits::Limits;
pub use outcome::{AcquireOutcome, Record, RecordState};
pub use record_id::{RecordFilter, RecordId};
pub use response::{StoredResponse, ValidateResponse};

/// The number of an attempt on one key, unique across the key's lifetimes.
/// A lifetime (a new record, or the takeover of an expired one) starts at
/// `idempotency_lifetime_token()`, the database clock in microseconds times
/// 1024 (migration `20261201000001_fencing_tokens_per_lifetime.sql`); each
/// takeover within the lifetime (a released record, a lapsed lease) adds one.
/// So a key's later attempts hold larger tokens, unless the database clock
/// steps back by more than the gap between two lifetimes. A holder whose
/// token is no longer current must not complete.
pub type FencingToken = u64;

/// A point in time read from the database clock.
pub type Timestamp = chrono::DateTime<chrono::Utc>;

/// A request field that failed validation: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {description}")]
pub struct InvalidField {
    /// The field's path in the request, e.g. `id.key`.
    pub field: String,
    /// What is wrong, in words a caller can act on.
    pub description: String,
}

impl InvalidField {
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            description: description.into(),
        }
    }
}
