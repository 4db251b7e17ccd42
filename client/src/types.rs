//! Domain types of the client, free of protobuf.

use std::time::{Duration, SystemTime};

// Shared with the service (the `idempotency-proto` crate), so both sides
// count a response's size and name a state alike.
pub use idempotency_proto::{RecordState, StoredResponse};

use crate::pb;

/// The scope of an idempotency key: unique per (namespace, operation, subject, key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordId {
    /// The calling service, `[a-z0-9][a-z0-9._-]*`, 1-63 characters.
    pub namespace: String,
    /// The route or operation, e.g. `POST /payments`.
    pub operation: String,
    /// On whose behalf (user, account, tenant); may be empty.
    pub subject: String,
    /// The client's idempotency key, 8-128 printable ASCII characters.
    pub key: String,
}

impl RecordId {
    /// An id without a subject; add one with [`RecordId::with_subject`].
    pub fn new(
        namespace: impl Into<String>,
        operation: impl Into<String>,
        key: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            operation: operation.into(),
            subject: String::new(),
            key: key.into(),
        }
    }

    /// The same id on behalf of `subject`.
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = subject.into();
        self
    }

    pub(crate) fn to_pb(&self) -> pb::RecordId {
        pb::RecordId {
            namespace: self.namespace.clone(),
            operation: self.operation.clone(),
            subject: self.subject.clone(),
            key: self.key.clone(),
        }
    }
}

/// What to reserve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireRequest {
    /// The record.
    pub id: RecordId,
    /// Hash of the canonical request (see [`crate::fingerprint`]); empty: do not check.
    pub fingerprint: Vec<u8>,
    /// Record lifetime; `None`: the server's default (24 h).
    pub ttl: Option<Duration>,
    /// Lease of this attempt; `None`: the server's default (60 s).
    pub lease: Option<Duration>,
}

impl AcquireRequest {
    /// A request with the server's default lifetime and lease.
    pub fn new(id: RecordId, fingerprint: impl Into<Vec<u8>>) -> Self {
        Self {
            id,
            fingerprint: fingerprint.into(),
            ttl: None,
            lease: None,
        }
    }

    /// Sets the record lifetime.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Sets the lease of this attempt.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    pub(crate) fn to_pb(&self) -> pb::AcquireRequest {
        pb::AcquireRequest {
            id: Some(self.id.to_pb()),
            fingerprint: self.fingerprint.clone(),
            ttl: self.ttl.map(duration_to_pb),
            lease: self.lease.map(duration_to_pb),
        }
    }
}

/// A record as [`crate::Client::get`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Where it is in its life.
    pub state: RecordState,
    /// The fingerprint it was created with.
    pub fingerprint: Vec<u8>,
    /// The current fencing token.
    pub fencing_token: u64,
    /// When it was created.
    pub created_at: SystemTime,
    /// When it expires.
    pub expires_at: SystemTime,
    /// When the current lease ends (in progress only).
    pub lease_expires_at: Option<SystemTime>,
    /// When it completed or failed.
    pub completed_at: Option<SystemTime>,
    /// The stored response or error response.
    pub response: Option<StoredResponse>,
}

pub(crate) fn duration_to_pb(duration: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(duration).unwrap_or(prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    })
}

pub(crate) fn duration_from_pb(duration: Option<prost_types::Duration>) -> Duration {
    duration
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or_default()
}

pub(crate) fn time_from_pb(timestamp: Option<prost_types::Timestamp>) -> SystemTime {
    timestamp
        .and_then(|t| SystemTime::try_from(t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}
