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

/// Monotonic number of an attempt on one record: 1, then +1 on every takeover.
/// A holder whose token is no longer current must not complete.
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
