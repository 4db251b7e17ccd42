//! A gRPC response as a [`StoredResponse`], and back.
//!
//! The encoding (a contract with every replica of the service that reads
//! the record, and visible to anyone who `Get`s it):
//!
//! - `status_code`: the HTTP status of the response, `200` for gRPC;
//! - `body`: the response body as sent, i.e. the length-prefixed message
//!   frame(s) (5 bytes of flag and length, then the message; compressed
//!   when the handler compressed it, with `grpc-encoding` among the headers);
//! - `headers`: the initial metadata under its own names (`content-type`,
//!   your metadata, and for a trailers-only error `grpc-status`,
//!   `grpc-message`, `grpc-status-details-bin`), and the trailers under
//!   `trailer:<name>` (e.g. `trailer:grpc-status`), a prefix no header name
//!   can hold. Binary (`-bin`) values are kept base64 as on the wire;
//!   repeated values are joined with `, `. Hop-by-hop headers and
//!   `idempotent-replayed` are left out.

use std::{
    collections::BTreeMap,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame};
use tonic::Code;

use super::IDEMPOTENT_REPLAYED;
use crate::StoredResponse;

/// The prefix of trailers among a stored response's headers.
pub const TRAILER_PREFIX: &str = "trailer:";

/// Headers that describe one connection or one transfer, not the answer.
const NOT_STORED: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "content-length",
    IDEMPOTENT_REPLAYED,
];

/// The gRPC code a response ends with: `grpc-status` in its trailers, or in
/// its headers for a trailers-only response; UNKNOWN when it has none (a
/// broken handler, whose answer is not worth keeping).
pub(crate) fn code_of(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Code {
    trailers
        .and_then(|trailers| trailers.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .map_or(Code::Unknown, |value| Code::from_bytes(value.as_bytes()))
}

/// The stored form of a response (see the module docs).
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    body: &Bytes,
    trailers: Option<&HeaderMap>,
) -> StoredResponse {
    let mut stored = BTreeMap::new();
    add_headers(&mut stored, "", headers);
    if let Some(trailers) = trailers {
        add_headers(&mut stored, TRAILER_PREFIX, trailers);
    }
    StoredResponse {
        status_code: u32::from(status.as_u16()),
        body: body.to_vec(),
        headers: stored,
    }
}

fn add_headers(stored: &mut BTreeMap<String, String>, prefix: &str, headers: &HeaderMap) {
    for name in headers.keys() {
        if NOT_STORED.contains(&name.as_str()) {
            continue;
        }
        let values: Vec<&str> = headers
            .get_all(name)
            .iter()
            .filter_map(|value| match value.to_str() {
                Ok(text) => Some(text),
                Err(_) => {
                    // gRPC metadata is ASCII (binary values travel base64).
                    tracing::warn!(header = %name, "a metadata value that is not ASCII is not stored");
                    None
                }
            })
            .collect();
        if !values.is_empty() {
            stored.insert(format!("{prefix}{name}"), values.join(", "));
        }
    }
}

/// The response a stored one replays as, with `idempotent-replayed: true`
/// in its initial metadata. A trailers-only error stays trailers-only.
pub(crate) fn replay(stored: StoredResponse) -> Response<tonic::body::Body> {
    let mut headers = HeaderMap::new();
    let mut trailers = HeaderMap::new();
    for (name, value) in stored.headers {
        let (target, name) = match name.strip_prefix(TRAILER_PREFIX) {
            Some(name) => (&mut trailers, name.to_owned()),
            None => (&mut headers, name),
        };
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            target.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let trailers = (!trailers.is_empty()).then_some(trailers);
    let mut response = Response::new(whole(Bytes::from(stored.body), trailers));
    *response.status_mut() = u16::try_from(stored.status_code)
        .ok()
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::OK);
    *response.headers_mut() = headers;
    response
}

/// A body of known bytes and trailers.
pub(crate) fn whole(data: Bytes, trailers: Option<HeaderMap>) -> tonic::body::Body {
    tonic::body::Body::new(Whole {
        data: (!data.is_empty()).then_some(data),
        trailers,
    })
}

struct Whole {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Body for Whole {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let frame = match this.data.take() {
            Some(data) => Some(Frame::data(data)),
            None => this.trailers.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    // No exact size hint: it would add a `content-length`, which gRPC
    // responses (and tonic's own) do not carry.
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[tokio::test]
    async fn a_response_with_trailers_is_stored_and_replayed_as_sent() {
        let headers = map(&[
            ("content-type", "application/grpc"),
            ("x-payment-id", "pay_1"),
            ("x-tag", "a"),
            ("x-tag", "b"),
            ("x-trace-bin", "AAEC"),
            ("content-length", "12"),
            ("connection", "keep-alive"),
        ]);
        let trailers = map(&[("grpc-status", "0"), ("x-done", "yes")]);
        let body = Bytes::from_static(b"\0\0\0\0\x02\x08\x01");

        let stored = encode(StatusCode::OK, &headers, &body, Some(&trailers));

        assert_eq!(stored.status_code, 200);
        assert_eq!(stored.body, body);
        let names: Vec<&str> = stored.headers.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "trailer:grpc-status",
                "trailer:x-done",
                "x-payment-id",
                "x-tag",
                "x-trace-bin"
            ]
        );
        assert_eq!(stored.headers["x-tag"], "a, b");

        let replayed = replay(stored);
        assert_eq!(replayed.status(), StatusCode::OK);
        assert_eq!(replayed.headers()["idempotent-replayed"], "true");
        assert_eq!(replayed.headers()["x-payment-id"], "pay_1");
        assert_eq!(replayed.headers()["x-trace-bin"], "AAEC");
        assert!(!replayed.headers().contains_key("grpc-status"));
        let collected = replayed.into_body().collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(collected.trailers().unwrap()["x-done"], "yes");
        assert_eq!(collected.to_bytes(), body);
    }

    #[tokio::test]
    async fn a_trailers_only_error_stays_trailers_only() {
        let headers = map(&[
            ("content-type", "application/grpc"),
            ("grpc-status", "3"),
            ("grpc-message", "amount%20must%20be%20positive"),
        ]);
        let stored = encode(StatusCode::OK, &headers, &Bytes::new(), None);
        assert_eq!(code_of(&headers, None), Code::InvalidArgument);

        let replayed = replay(stored);
        assert_eq!(replayed.headers()["grpc-status"], "3");
        assert_eq!(
            replayed.headers()["grpc-message"],
            "amount%20must%20be%20positive"
        );
        assert!(replayed.body().is_end_stream());
        let collected = replayed.into_body().collect().await.unwrap();
        assert!(collected.trailers().is_none());
    }

    #[test]
    fn the_code_is_read_from_trailers_then_headers_and_is_unknown_without_either() {
        let ok = map(&[("grpc-status", "0")]);
        let unavailable = map(&[("grpc-status", "14")]);
        assert_eq!(code_of(&ok, Some(&unavailable)), Code::Unavailable);
        assert_eq!(code_of(&ok, None), Code::Ok);
        assert_eq!(code_of(&HeaderMap::new(), None), Code::Unknown);
        assert_eq!(
            code_of(&HeaderMap::new(), Some(&HeaderMap::new())),
            Code::Unknown
        );
    }
}
