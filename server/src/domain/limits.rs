use std::time::Duration;

use super::InvalidField;

/// The server's policy on lifetimes and sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub default_ttl: Duration,
    pub max_ttl: Duration,
    pub default_lease: Duration,
    pub max_lease: Duration,
    /// Largest stored response: body plus header names and values.
    pub max_response_bytes: usize,
    /// Most items in one BatchAcquire or BatchComplete.
    pub max_batch_items: usize,
    /// Most headers in one stored response.
    pub max_response_headers: usize,
}

/// See [`Limits::max_small_message_bytes`].
const SMALL_MESSAGE_BYTES: usize = 8 * 1024;

/// A header's framing in a protobuf map entry, beyond its name and value:
/// the entry's tag and length, and each string's tag and length.
const HEADER_FRAMING_BYTES: usize = 16;

/// Below a second a lease or lifetime is more likely a unit mistake than an intent.
const MIN_DURATION: Duration = Duration::from_secs(1);

/// The smallest gRPC message size limit: gRPC's customary 4 MiB, which
/// clients in every language accept by default.
const MIN_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The flags' defaults (`settings.rs`'s tests keep the two equal).
impl Default for Limits {
    fn default() -> Self {
        Self {
            default_ttl: Duration::from_secs(24 * 60 * 60),
            max_ttl: Duration::from_secs(7 * 24 * 60 * 60),
            default_lease: Duration::from_secs(60),
            max_lease: Duration::from_secs(60 * 60),
            max_response_bytes: 1024 * 1024,
            max_batch_items: 100,
            max_response_headers: 128,
        }
    }
}

impl Limits {
    /// Checks that the defaults lie within the maxima, so no request that
    /// leaves a duration out could be refused for it.
    pub fn check(&self) -> Result<(), InvalidField> {
        within("default_ttl", self.default_ttl, self.max_ttl)?;
        within("default_lease", self.default_lease, self.max_lease)?;
        if self.max_response_bytes == 0 {
            return Err(InvalidField::new(
                "max_response_bytes",
                "must be at least 1",
            ));
        }
        if self.max_batch_items == 0 {
            return Err(InvalidField::new("max_batch_items", "must be at least 1"));
        }
        Ok(())
    }

    /// The largest message of a call that names one record and carries no
    /// stored response (Acquire, Renew, Get): a valid one is under 1.2 KiB
    /// (the id's parts at their maxima, a 64-byte fingerprint, two
    /// durations); the rest leaves room for fields a newer client adds.
    pub const fn max_small_message_bytes(&self) -> usize {
        SMALL_MESSAGE_BYTES
    }

    /// The largest Complete or Fail message: a small message plus the
    /// largest stored response, with a map entry's framing for each header.
    pub fn max_finish_message_bytes(&self) -> usize {
        SMALL_MESSAGE_BYTES
            .saturating_add(self.max_response_bytes)
            .saturating_add(
                self.max_response_headers
                    .saturating_mul(HEADER_FRAMING_BYTES),
            )
    }

    /// The largest BatchAcquire message: the most items, each a small message.
    pub fn max_batch_acquire_message_bytes(&self) -> usize {
        self.max_batch_items
            .saturating_mul(SMALL_MESSAGE_BYTES)
            .min(self.max_message_bytes())
    }

    /// The largest gRPC message, read or written: the larger of 4 MiB and
    /// twice the largest stored response, so that a call carrying one stored
    /// response with its envelope always fits. Far larger requests are
    /// refused at the transport; the exact response limit is left to
    /// validation, so that the caller gets INVALID_ARGUMENT naming it.
    pub fn max_message_bytes(&self) -> usize {
        MIN_MESSAGE_BYTES.max(self.max_response_bytes.saturating_mul(2))
    }

    /// The record lifetime to use: the request's, or the default.
    pub fn ttl(&self, field: &str, requested: Option<Duration>) -> Result<Duration, InvalidField> {
        within(field, requested.unwrap_or(self.default_ttl), self.max_ttl)
    }

    /// The lease to use: the request's, or the default.
    pub fn lease(
        &self,
        field: &str,
        requested: Option<Duration>,
    ) -> Result<Duration, InvalidField> {
        within(
            field,
            requested.unwrap_or(self.default_lease),
            self.max_lease,
        )
    }
}

fn within(field: &str, value: Duration, max: Duration) -> Result<Duration, InvalidField> {
    if value < MIN_DURATION || value > max {
        return Err(InvalidField::new(
            field,
            format!(
                "must lie in [1s, {}], got {}",
                humantime::format_duration(max),
                humantime::format_duration(value)
            ),
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_apply_when_absent() {
        let limits = Limits::default();
        assert_eq!(limits.ttl("ttl", None).unwrap(), Duration::from_secs(86400));
        assert_eq!(
            limits.lease("lease", None).unwrap(),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn defaults_outside_the_maxima_are_refused() {
        assert!(Limits::default().check().is_ok());
        let limits = Limits {
            default_lease: Duration::from_secs(7200),
            ..Limits::default()
        };
        assert_eq!(limits.check().unwrap_err().field, "default_lease");
        let limits = Limits {
            default_ttl: Duration::from_millis(10),
            ..Limits::default()
        };
        assert_eq!(limits.check().unwrap_err().field, "default_ttl");
    }

    #[test]
    fn bounds_are_inclusive() {
        let limits = Limits::default();
        assert!(limits.ttl("ttl", Some(Duration::from_secs(1))).is_ok());
        assert!(limits.ttl("ttl", Some(limits.max_ttl)).is_ok());
        assert!(limits.ttl("ttl", Some(Duration::ZERO)).is_err());
        assert!(limits.ttl("ttl", Some(Duration::from_millis(999))).is_err());
        let over = limits.max_lease + Duration::from_secs(1);
        assert_eq!(
            limits.lease("lease", Some(over)).unwrap_err().field,
            "lease"
        );
    }
}
