//! Errors as `application/problem+json` (RFC 9457).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use super::body::ResponseBody;

/// How the layer's own problem responses name their problems: a `type` URI
/// per problem (`base` + the problem's name) and an optional
/// `Link: <…>; rel="describedby"` to their documentation.
#[derive(Debug, Clone)]
pub(crate) struct Problems {
    pub(crate) type_base: String,
    pub(crate) described_by: Option<HeaderValue>,
}

impl Default for Problems {
    fn default() -> Self {
        Self {
            // A URN: stable, and no claim on a web address we do not serve.
            type_base: "urn:idempotency:problem:".to_owned(),
            described_by: None,
        }
    }
}

impl Problems {
    /// The RFC 9457 problem document (`application/problem+json`).
    pub(crate) fn document(&self, status: StatusCode, kind: &str, detail: &str) -> String {
        serde_json::json!({
            "type": format!("{}{kind}", self.type_base),
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": detail,
        })
        .to_string()
    }

    /// A problem response with a stable `type` URI per problem.
    pub(crate) fn problem(
        &self,
        status: StatusCode,
        kind: &str,
        detail: &str,
    ) -> Response<ResponseBody> {
        let mut response = Response::new(super::body::full(Bytes::from(
            self.document(status, kind, detail),
        )));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(link) = &self.described_by {
            headers.insert(header::LINK, link.clone());
        }
        response
    }

    /// `409`: another request with this key is still being processed.
    pub(crate) fn in_progress(&self, retry_after: Duration) -> Response<ResponseBody> {
        let mut response = self.problem(
            StatusCode::CONFLICT,
            "request-in-progress",
            "a request with this Idempotency-Key is still being processed; retry later",
        );
        // Whole seconds, at least one.
        let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        response
    }

    /// `500`: the idempotency service refused this service's credentials or its
    /// use of the namespace. Not `503`: waiting does not mend a configuration.
    pub(crate) fn not_authorized(&self) -> Response<ResponseBody> {
        self.problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency-not-authorized",
            "this service may not use idempotency keys for this request; it was not processed",
        )
    }

    /// `503`: the idempotency service cannot be reached and the route fails closed.
    pub(crate) fn unavailable(&self) -> Response<ResponseBody> {
        let mut response = self.problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency-unavailable",
            "idempotency cannot be guaranteed right now; retry later with the same Idempotency-Key",
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }
}
