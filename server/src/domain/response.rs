//! The checks a stored response must pass before the store keeps it. The type
//! itself, and its size rule, are shared with the client
//! (`idempotency_proto::StoredResponse`).

use super::{InvalidField, Limits};

pub use idempotency_proto::StoredResponse;

/// The server's checks of a [`StoredResponse`] (a trait, as the type is the
/// shared crate's): what Postgres cannot hold and what [`Limits`] forbid.
pub trait ValidateResponse {
    /// Checks what the store cannot hold and what the limits forbid; errors
    /// name `field` (e.g. `response`, `error_response.headers`).
    fn validate(&self, field: &str, limits: &Limits) -> Result<(), InvalidField>;
}

impl ValidateResponse for StoredResponse {
    fn validate(&self, field: &str, limits: &Limits) -> Result<(), InvalidField> {
        let max_bytes = limits.max_response_bytes;
        // Stored in a Postgres integer column.
        if i32::try_from(self.status_code).is_err() {
            return Err(InvalidField::new(
                format!("{field}.status_code"),
                format!("must be at most {}", i32::MAX),
            ));
        }
        if self.headers.len() > limits.max_response_headers {
            return Err(InvalidField::new(
                format!("{field}.headers"),
                format!(
                    "has {} headers; the limit is {}",
                    self.headers.len(),
                    limits.max_response_headers
                ),
            ));
        }
        // Postgres jsonb cannot hold NUL; refusing it here keeps it a client error.
        if self
            .headers
            .iter()
            .any(|(name, value)| name.contains('\0') || value.contains('\0'))
        {
            return Err(InvalidField::new(
                format!("{field}.headers"),
                "header names and values must not contain NUL",
            ));
        }
        let size = self.size();
        if size > max_bytes {
            return Err(InvalidField::new(
                field,
                format!("is {size} bytes (body plus headers); the limit is {max_bytes} bytes"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn limits(max_response_bytes: usize, max_response_headers: usize) -> Limits {
        Limits {
            max_response_bytes,
            max_response_headers,
            ..Limits::default()
        }
    }

    #[test]
    fn size_counts_body_and_headers() {
        let response = StoredResponse {
            status_code: 201,
            body: vec![0; 10],
            headers: BTreeMap::from([("ab".into(), "cde".into())]),
        };
        assert_eq!(response.size(), 15);
        assert!(response.validate("response", &limits(15, 1)).is_ok());
        let error = response.validate("response", &limits(14, 1)).unwrap_err();
        assert_eq!(error.field, "response");
        assert!(
            error.description.contains("14 bytes"),
            "{}",
            error.description
        );
    }

    #[test]
    fn nul_in_headers_is_refused() {
        let response = StoredResponse {
            headers: BTreeMap::from([("a".into(), "b\0".into())]),
            ..Default::default()
        };
        assert_eq!(
            response
                .validate("response", &limits(100, 1))
                .unwrap_err()
                .field,
            "response.headers"
        );
    }

    #[test]
    fn more_headers_than_the_limit_are_refused() {
        let response = StoredResponse {
            headers: (0..3).map(|i| (format!("h{i}"), String::new())).collect(),
            ..Default::default()
        };
        assert!(response.validate("response", &limits(100, 3)).is_ok());
        let error = response.validate("response", &limits(100, 2)).unwrap_err();
        assert_eq!(error.field, "response.headers");
        assert!(
            error.description.contains("limit is 2"),
            "{}",
            error.description
        );
    }
}
