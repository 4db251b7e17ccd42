//! One stream message as the unary batch call it stands for: the stream's
//! metadata and connection, the message's deadline, trace context and
//! batch, through the same layers and handler as a call of its own.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt as _;
use tonic::{Status, body::Body};
use tower::ServiceExt as _;

use super::envelope::Content;

/// What every message of a stream shares: the stream's metadata, less what
/// each message sets for itself, and its connection's extensions (the peer's
/// address and certificate).
pub(super) struct Template {
    headers: HeaderMap,
    extensions: http::Extensions,
}

/// Headers each message sets for itself or that describe the stream's body.
const PER_MESSAGE: [&str; 6] = [
    "grpc-timeout",
    "traceparent",
    "tracestate",
    "grpc-encoding",
    "grpc-accept-encoding",
    "content-length",
];

impl Template {
    pub(super) fn new(mut headers: HeaderMap, extensions: http::Extensions) -> Self {
        for name in PER_MESSAGE {
            headers.remove(name);
        }
        Self {
            headers,
            extensions,
        }
    }

    /// The unary call for `content`.
    pub(super) fn request(&self, content: Content) -> http::Request<Body> {
        let mut headers = self.headers.clone();
        if let Some(timeout) = content.timeout {
            headers.insert("grpc-timeout", grpc_timeout(timeout));
        }
        if !content.traceparent.is_empty()
            && let Ok(value) = HeaderValue::from_str(&content.traceparent)
        {
            headers.insert("traceparent", value);
        }
        let mut framed = BytesMut::with_capacity(5 + content.batch.len());
        framed.put_u8(0);
        framed.put_u32(content.batch.len() as u32);
        framed.put_slice(&content.batch);
        let mut request = http::Request::new(Body::new(http_body_util::Full::new(framed.freeze())));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = http::Uri::from_static(content.kind.path());
        *request.version_mut() = http::Version::HTTP_2;
        *request.headers_mut() = headers;
        *request.extensions_mut() = self.extensions.clone();
        request
    }
}

/// A `grpc-timeout` value: whole milliseconds, rounded up, in at most the
/// eight digits the header allows (past them, the server's bound applies).
fn grpc_timeout(timeout: Duration) -> HeaderValue {
    let millis = timeout.as_nanos().div_ceil(1_000_000).min(99_999_999);
    HeaderValue::from_str(&format!("{millis}m")).expect("digits and a unit")
}

/// A unary call's reply: the encoded message, or the status it failed with.
/// `held` keeps what the call charged to the memory budget (its body) until
/// the answer is written.
pub(super) struct Reply {
    pub result: Result<Bytes, Status>,
    pub held: Option<Body>,
}

/// Sends `request` through `inner` and reads its reply.
pub(super) async fn call<S>(inner: S, request: http::Request<Body>) -> Reply
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Error: std::fmt::Display,
{
    let response = match inner.oneshot(request).await {
        Ok(response) => response,
        Err(error) => {
            tracing::error!(%error, "a BatchStream message's call failed");
            return Reply {
                result: Err(Status::internal(
                    "the call failed; the cause is in the server's log",
                )),
                held: None,
            };
        }
    };
    let (parts, mut body) = response.into_parts();
    // Trailers-only: refused before the handler (admission, auth, the call limit).
    if let Some(status) = Status::from_header_map(&parts.headers) {
        return Reply {
            result: Err(status),
            held: Some(body),
        };
    }
    let mut data = BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => match frame.into_data() {
                Ok(chunk) => data.extend_from_slice(&chunk),
                Err(frame) => trailers = frame.into_trailers().ok(),
            },
            Err(status) => {
                trailers = None;
                data.clear();
                tracing::warn!(%status, "a BatchStream message's reply broke off");
                break;
            }
        }
    }
    let status = trailers
        .as_ref()
        .and_then(Status::from_header_map)
        .unwrap_or_else(|| Status::internal("the reply ended without a status"));
    let result = if status.code() == tonic::Code::Ok {
        message(data.freeze())
    } else {
        Err(status)
    };
    Reply {
        result,
        held: Some(body),
    }
}

/// The one uncompressed message of a unary reply.
fn message(mut data: Bytes) -> Result<Bytes, Status> {
    let complete = data.len() >= 5
        && data[0] == 0
        && u32::from_be_bytes(data[1..5].try_into().expect("four bytes")) as usize
            == data.len() - 5;
    if !complete {
        return Err(Status::internal(
            "the reply was not one uncompressed message",
        ));
    }
    Ok(data.split_off(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_whole_milliseconds_rounded_up_within_eight_digits() {
        assert_eq!(grpc_timeout(Duration::from_micros(1)), "1m");
        assert_eq!(grpc_timeout(Duration::from_millis(1500)), "1500m");
        assert_eq!(grpc_timeout(Duration::from_secs(10_000_000)), "99999999m");
    }

    #[test]
    fn a_reply_is_one_uncompressed_message() {
        assert_eq!(
            message(Bytes::from_static(&[0, 0, 0, 0, 2, 7, 8])).unwrap(),
            &[7, 8][..]
        );
        for broken in [&[0, 0, 0, 0, 3, 7, 8][..], &[1, 0, 0, 0, 2, 7, 8], &[0, 0]] {
            assert!(message(Bytes::copy_from_slice(broken)).is_err());
        }
    }
}
