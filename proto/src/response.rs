use std::collections::BTreeMap;

use crate::pb;

/// A response kept for replay: status, body and headers, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredResponse {
    /// e.g. an HTTP status.
    pub status_code: u32,
    /// The body as sent.
    pub body: Vec<u8>,
    /// Headers or metadata worth replaying. Sorted, so that equality and
    /// storage do not depend on arrival order.
    pub headers: BTreeMap<String, String>,
}

impl StoredResponse {
    /// A response with a status and a body, no headers.
    pub fn new(status_code: u32, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status_code,
            body: body.into(),
            headers: BTreeMap::new(),
        }
    }

    /// The same response with one more header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Bytes counted against the service's response limit
    /// (`--max-response-bytes`): body plus every header name and value.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum::<usize>()
    }

    /// The message for a request, leaving `self` as it is.
    pub fn to_pb(&self) -> pb::StoredResponse {
        self.clone().into()
    }

    /// The response a reply carried; a missing one reads as the default
    /// (status 0, no body, no headers).
    pub fn from_pb(response: Option<pb::StoredResponse>) -> Self {
        response.unwrap_or_default().into()
    }
}

impl From<pb::StoredResponse> for StoredResponse {
    fn from(response: pb::StoredResponse) -> Self {
        Self {
            status_code: response.status_code,
            body: response.body,
            headers: response.headers.into_iter().collect(),
        }
    }
}

impl From<StoredResponse> for pb::StoredResponse {
    fn from(response: StoredResponse) -> Self {
        Self {
            status_code: response.status_code,
            body: response.body,
            headers: response.headers.into_iter().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_counts_body_and_headers() {
        let response = StoredResponse::new(201, vec![0; 10]).with_header("ab", "cde");
        assert_eq!(response.size(), 15);
    }

    #[test]
    fn size_of_an_empty_response_is_zero() {
        assert_eq!(StoredResponse::new(204, Vec::new()).size(), 0);
    }

    #[test]
    fn protobuf_round_trip_keeps_every_byte() {
        let response = StoredResponse::new(402, "declined")
            .with_header("content-type", "text/plain")
            .with_header("x-request-id", "42");
        assert_eq!(StoredResponse::from_pb(Some(response.to_pb())), response);
    }

    #[test]
    fn a_missing_response_reads_as_the_default() {
        assert_eq!(StoredResponse::from_pb(None), StoredResponse::default());
    }
}
