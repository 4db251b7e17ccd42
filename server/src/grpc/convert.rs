//! Protobuf <-> domain. Parsing names every field by its path in the request.

use std::time::Duration;

use super::pb;
use crate::{
    domain::{
        AcquireOutcome, Fingerprint, InvalidField, Record, RecordId, RecordState, StoredResponse,
        Timestamp,
    },
    engine::{AcquireRequest, Failure, LeaseTimes},
};

pub fn record_id(id: Option<pb::RecordId>) -> Result<RecordId, InvalidField> {
    let id = id.ok_or_else(|| InvalidField::new("id", "is required"))?;
    RecordId::parse("id", id.namespace, id.operation, id.subject, id.key)
}

fn duration(
    field: &str,
    value: Option<prost_types::Duration>,
) -> Result<Option<Duration>, InvalidField> {
    value
        .map(|value| {
            Duration::try_from(value)
                .map_err(|_| InvalidField::new(field, "must be a positive duration"))
        })
        .transpose()
}

pub fn acquire_request(request: pb::AcquireRequest) -> Result<AcquireRequest, InvalidField> {
    Ok(AcquireRequest {
        id: record_id(request.id)?,
        fingerprint: Fingerprint::parse("fingerprint", request.fingerprint)?,
        ttl: duration("ttl", request.ttl)?,
        lease: duration("lease", request.lease)?,
    })
}

/// Tokens start at 1: 0 is the protobuf default of a field left unset. They
/// are stored as `bigint`, so no token Acquire returned is above `i64::MAX`.
pub fn fencing_token(token: u64) -> Result<u64, InvalidField> {
    if token == 0 {
        return Err(InvalidField::new(
            "fencing_token",
            "is required: the token Acquire returned (1 or more)",
        ));
    }
    if i64::try_from(token).is_err() {
        return Err(InvalidField::new(
            "fencing_token",
            format!("is not a token Acquire returned (at most {})", i64::MAX),
        ));
    }
    Ok(token)
}

pub fn lease(value: Option<prost_types::Duration>) -> Result<Option<Duration>, InvalidField> {
    duration("lease", value)
}

pub fn stored_response(
    field: &str,
    response: Option<pb::StoredResponse>,
) -> Result<StoredResponse, InvalidField> {
    let response = response.ok_or_else(|| InvalidField::new(field, "is required"))?;
    Ok(from_pb_response(response))
}

fn from_pb_response(response: pb::StoredResponse) -> StoredResponse {
    StoredResponse {
        status_code: response.status_code,
        body: response.body,
        headers: response.headers.into_iter().collect(),
    }
}

pub fn failure(retryable: bool, error_response: Option<pb::StoredResponse>) -> Failure {
    if retryable {
        Failure::Retryable
    } else {
        Failure::Terminal(error_response.map(from_pb_response).unwrap_or_default())
    }
}

pub fn timestamp(at: Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        // Always below 1e9 for a valid DateTime; leap seconds never come from Postgres.
        nanos: at.timestamp_subsec_nanos() as i32,
    }
}

fn pb_duration(duration: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(duration).unwrap_or(prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    })
}

fn pb_response(response: StoredResponse) -> pb::StoredResponse {
    pb::StoredResponse {
        status_code: response.status_code,
        body: response.body,
        headers: response.headers.into_iter().collect(),
    }
}

pub fn acquire_response(outcome: AcquireOutcome) -> pb::AcquireResponse {
    use pb::acquire_response::Outcome;
    let outcome = match outcome {
        AcquireOutcome::Acquired {
            fencing_token,
            lease_expires_at,
            expires_at,
            takeover: _,
        } => Outcome::Acquired(pb::Acquired {
            fencing_token,
            lease_expires_at: Some(timestamp(lease_expires_at)),
            expires_at: Some(timestamp(expires_at)),
        }),
        AcquireOutcome::InProgress {
            lease_expires_at,
            retry_after,
        } => Outcome::InProgress(pb::InProgress {
            lease_expires_at: Some(timestamp(lease_expires_at)),
            retry_after: Some(pb_duration(retry_after)),
        }),
        AcquireOutcome::Completed {
            response,
            completed_at,
        } => Outcome::Completed(pb::Completed {
            response: Some(pb_response(response)),
            completed_at: Some(timestamp(completed_at)),
        }),
        AcquireOutcome::Failed {
            error_response,
            failed_at,
        } => Outcome::Failed(pb::Failed {
            error_response: Some(pb_response(error_response)),
            failed_at: Some(timestamp(failed_at)),
        }),
        AcquireOutcome::FingerprintMismatch => {
            Outcome::FingerprintMismatch(pb::FingerprintMismatch {})
        }
    };
    pb::AcquireResponse {
        outcome: Some(outcome),
    }
}

pub fn record_state(state: RecordState) -> pb::RecordState {
    match state {
        RecordState::InProgress => pb::RecordState::InProgress,
        RecordState::Completed => pb::RecordState::Completed,
        RecordState::Failed => pb::RecordState::Failed,
        RecordState::Released => pb::RecordState::Released,
    }
}

pub fn renew_response(lease: LeaseTimes) -> pb::RenewResponse {
    pb::RenewResponse {
        lease_expires_at: Some(timestamp(lease.lease_expires_at)),
        expires_at: Some(timestamp(lease.expires_at)),
    }
}

pub fn record(record: Record) -> pb::Record {
    pb::Record {
        id: Some(pb::RecordId {
            namespace: record.id.namespace().to_owned(),
            operation: record.id.operation().to_owned(),
            subject: record.id.subject().to_owned(),
            key: record.id.key().to_owned(),
        }),
        state: record_state(record.state).into(),
        fingerprint: record.fingerprint.into_bytes(),
        fencing_token: record.fencing_token,
        created_at: Some(timestamp(record.created_at)),
        expires_at: Some(timestamp(record.expires_at)),
        lease_expires_at: record.lease_expires_at.map(timestamp),
        completed_at: record.completed_at.map(timestamp),
        response: record.response.map(pb_response),
    }
}
