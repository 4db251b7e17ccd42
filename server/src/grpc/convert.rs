//! Protobuf <-> domain. Parsing names every field by its path in the request,
//! and applies the limits, so the engine takes requests already within them.

use std::time::Duration;

use super::pb;
use crate::{
    domain::{
        AcquireOutcome, Fingerprint, InvalidField, Limits, Record, RecordId, RecordState,
        StoredResponse, Timestamp, ValidateResponse,
    },
    engine::{AcquireRequest, Failure, LeaseTimes},
};

pub fn record_id(id: Option<pb::RecordId>) -> Result<RecordId, InvalidField> {
    let id = id.ok_or_else(|| InvalidField::new("id", "is required"))?;
    RecordId::parse("id", id.namespace, id.operation, id.subject, id.key)
}

/// The range of `google.protobuf.Duration.seconds` (about ±10,000 years).
const DURATION_MAX_SECONDS: i64 = 315_576_000_000;
const DURATION_MAX_NANOS: i32 = 999_999_999;

/// A `google.protobuf.Duration` as its spec defines it, checked before any
/// arithmetic: seconds within ±315,576,000,000, nanos within ±999,999,999
/// and of the same sign as seconds. Then it must be positive; the limits
/// decide the rest.
fn duration(
    field: &str,
    value: Option<prost_types::Duration>,
) -> Result<Option<Duration>, InvalidField> {
    let Some(prost_types::Duration { seconds, nanos }) = value else {
        return Ok(None);
    };
    let signs_agree = seconds == 0 || nanos == 0 || (seconds > 0) == (nanos > 0);
    if !(-DURATION_MAX_SECONDS..=DURATION_MAX_SECONDS).contains(&seconds)
        || !(-DURATION_MAX_NANOS..=DURATION_MAX_NANOS).contains(&nanos)
        || !signs_agree
    {
        return Err(InvalidField::new(
            field,
            format!(
                "is not a valid google.protobuf.Duration (seconds {seconds}, nanos {nanos}): \
                 seconds must lie within ±{DURATION_MAX_SECONDS}, nanos within \
                 ±{DURATION_MAX_NANOS} and have the sign of seconds"
            ),
        ));
    }
    if seconds < 0 || nanos < 0 {
        return Err(InvalidField::new(
            field,
            format!("must be positive, got {seconds} s {nanos} ns"),
        ));
    }
    // Both are non-negative and in range now: no conversion can fail.
    Ok(Some(
        Duration::from_secs(seconds.unsigned_abs())
            + Duration::from_nanos(nanos.unsigned_abs().into()),
    ))
}

/// An Acquire's fields, parsed; [`Self::within`] applies the limits. Two
/// steps, so that a call whose fields parse is counted under its namespace
/// even when the limits refuse it.
#[derive(Debug, Clone)]
pub struct AcquireFields {
    pub id: RecordId,
    fingerprint: Fingerprint,
    ttl: Option<Duration>,
    lease: Option<Duration>,
}

pub fn acquire_request(request: pb::AcquireRequest) -> Result<AcquireFields, InvalidField> {
    Ok(AcquireFields {
        id: record_id(request.id)?,
        fingerprint: Fingerprint::parse("fingerprint", request.fingerprint)?,
        ttl: duration("ttl", request.ttl)?,
        lease: duration("lease", request.lease)?,
    })
}

impl AcquireFields {
    /// The request with the lifetime and lease to use: those given, or the
    /// defaults, within the limits.
    pub fn within(self, limits: &Limits) -> Result<AcquireRequest, InvalidField> {
        Ok(AcquireRequest {
            ttl: limits.ttl("ttl", self.ttl)?,
            lease: limits.lease("lease", self.lease)?,
            id: self.id,
            fingerprint: self.fingerprint,
        })
    }
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

/// A Renew's lease: the one given, or the default, within the limits.
pub fn lease(
    value: Option<prost_types::Duration>,
    limits: &Limits,
) -> Result<Duration, InvalidField> {
    limits.lease("lease", duration("lease", value)?)
}

/// A response to store, within the limits.
pub fn stored_response(
    field: &str,
    response: Option<pb::StoredResponse>,
    limits: &Limits,
) -> Result<StoredResponse, InvalidField> {
    let response = response.ok_or_else(|| InvalidField::new(field, "is required"))?;
    let response = StoredResponse::from(response);
    response.validate(field, limits)?;
    Ok(response)
}

/// A Fail's outcome; a terminal one's error response within the limits.
pub fn failure(
    retryable: bool,
    error_response: Option<pb::StoredResponse>,
    limits: &Limits,
) -> Result<Failure, InvalidField> {
    if retryable {
        return Ok(Failure::Retryable);
    }
    let response = error_response.map(StoredResponse::from).unwrap_or_default();
    response.validate("error_response", limits)?;
    Ok(Failure::Terminal(response))
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
            response: Some(response.into()),
            completed_at: Some(timestamp(completed_at)),
        }),
        AcquireOutcome::Failed {
            error_response,
            failed_at,
        } => Outcome::Failed(pb::Failed {
            error_response: Some(error_response.into()),
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
    state.into()
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
        response: record.response.map(pb::StoredResponse::from),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use prost::Message;

    use super::*;
    use crate::{domain::Limits, grpc::wire};

    fn pb_duration(seconds: i64, nanos: i32) -> Option<prost_types::Duration> {
        Some(prost_types::Duration { seconds, nanos })
    }

    #[test]
    fn durations_outside_the_protobuf_spec_are_refused_naming_the_field() {
        for (seconds, nanos) in [
            (i64::MIN, 0),
            (i64::MAX, 0),
            (DURATION_MAX_SECONDS + 1, 0),
            (5, -1),
            (-5, 1),
            (0, 1_000_000_000),
            (0, i32::MIN),
        ] {
            let error = duration("ttl", pb_duration(seconds, nanos)).unwrap_err();
            assert_eq!(error.field, "ttl");
            assert!(
                error.description.contains("google.protobuf.Duration"),
                "{seconds} {nanos}: {}",
                error.description
            );
        }
        let negative = duration("lease", pb_duration(-5, -1)).unwrap_err();
        assert!(negative.description.contains("positive"), "{negative:?}");
    }

    #[test]
    fn valid_durations_convert_exactly() {
        assert_eq!(duration("ttl", None).unwrap(), None);
        assert_eq!(
            duration("ttl", pb_duration(5, 250_000_000)).unwrap(),
            Some(Duration::from_millis(5250))
        );
        assert_eq!(
            duration("ttl", pb_duration(DURATION_MAX_SECONDS, DURATION_MAX_NANOS)).unwrap(),
            Some(Duration::new(
                DURATION_MAX_SECONDS as u64,
                DURATION_MAX_NANOS as u32
            ))
        );
        assert_eq!(
            duration("ttl", pb_duration(0, 0)).unwrap(),
            Some(Duration::ZERO)
        );
    }

    /// Everything a request goes through before the engine touches the
    /// database: decoding, conversion, and the limits' checks.
    fn validate_everything(bytes: &[u8]) {
        let limits = Limits::default();
        let _ = wire::count(bytes, &[1]);
        let _ = wire::count(bytes, &[1, 3, 3]);
        if let Ok(request) = pb::AcquireRequest::decode(bytes)
            && let Ok(request) = acquire_request(request)
        {
            let _ = request.within(&limits);
        }
        if let Ok(request) = pb::CompleteRequest::decode(bytes) {
            let _ = record_id(request.id);
            let _ = fencing_token(request.fencing_token);
            let _ = stored_response("response", request.response, &limits);
        }
        if let Ok(request) = pb::FailRequest::decode(bytes) {
            let _ = failure(request.retryable, request.error_response, &limits);
        }
        if let Ok(request) = pb::RenewRequest::decode(bytes) {
            let _ = lease(request.lease, &limits);
        }
        if let Ok(request) = pb::BatchAcquireRequest::decode(bytes) {
            for item in request.requests {
                let _ = acquire_request(item);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        #[test]
        fn no_duration_panics_and_only_spec_valid_positive_ones_pass(
            seconds in any::<i64>(),
            nanos in any::<i32>(),
        ) {
            let result = duration("ttl", pb_duration(seconds, nanos));
            let valid = (0..=DURATION_MAX_SECONDS).contains(&seconds)
                && (0..=DURATION_MAX_NANOS).contains(&nanos);
            prop_assert_eq!(result.is_ok(), valid);
            let limits = Limits::default();
            if let Ok(value) = result {
                let _ = limits.ttl("ttl", value);
                let _ = limits.lease("lease", value);
            }
        }

        #[test]
        fn no_bytes_panic_a_decoder_or_validator(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            validate_everything(&bytes);
        }

        #[test]
        fn no_mutated_valid_request_panics(
            seconds in any::<i64>(),
            nanos in any::<i32>(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        ) {
            // Valid requests with hostile durations, then with a few bytes
            // changed, reach deeper than random bytes do.
            let request = pb::AcquireRequest {
                id: Some(pb::RecordId {
                    namespace: "payments".into(),
                    operation: "POST /v1/payments".into(),
                    subject: "user-1".into(),
                    key: "key-00000001".into(),
                }),
                fingerprint: vec![7; 32],
                ttl: pb_duration(seconds, nanos),
                lease: pb_duration(nanos.into(), 0),
            };
            let mut bytes = request.encode_to_vec();
            for (index, value) in flips {
                let at = index.index(bytes.len());
                bytes[at] = value;
            }
            validate_everything(&bytes);
        }
    }
}
