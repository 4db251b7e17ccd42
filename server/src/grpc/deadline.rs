//! Every call of the service answers in bounded time: by the caller's
//! deadline (`grpc-timeout`) or `--request-timeout`, whichever comes first.
//! The bound covers everything behind the call: reading its message,
//! queueing for a batch, waiting for a connection, the statement itself.
//! At the deadline the call's future is dropped; the store closes a
//! connection whose statement it abandoned, rather than reusing it.
//!
//! Health and reflection are not bounded: a health probe has its own
//! timeout, and reflection is a stream that lives as long as the client.

use std::{
    task::{Context, Poll},
    time::Duration,
};

use futures_util::future::BoxFuture;
use tonic::{Code, body::Body};

use super::status::{reason, with_reason};
use crate::metrics;
use crate::metrics::RPCS;

const SERVICE_PREFIX: &str = "/idempotency.v1.IdempotencyService/";

/// Bounds every call of the service (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer {
    request_timeout: Duration,
}

impl DeadlineLayer {
    pub fn new(request_timeout: Duration) -> Self {
        Self { request_timeout }
    }
}

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Bounded {
            inner,
            request_timeout: self.request_timeout,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Bounded<S> {
    inner: S,
    request_timeout: Duration,
}

impl<S, B> tower::Service<http::Request<B>> for Bounded<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>> + Send,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let Some(rpc) = rpc_of(request.uri().path()) else {
            return Box::pin(self.inner.call(request));
        };
        let callers = request
            .headers()
            .get("grpc-timeout")
            .and_then(|value| grpc_timeout(value.as_bytes()));
        let deadline = Deadline::of(callers, self.request_timeout);
        let call = self.inner.call(request);
        Box::pin(async move {
            match tokio::time::timeout(deadline.timeout, call).await {
                Ok(answer) => answer,
                Err(_) => Ok(deadline.expired(rpc).into_http()),
            }
        })
    }
}

/// A call's time: the caller's own deadline, or `--request-timeout` when the
/// caller set none or a longer one.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadline {
    pub timeout: Duration,
    callers_own: bool,
}

impl Deadline {
    pub(super) fn of(callers: Option<Duration>, request_timeout: Duration) -> Self {
        match callers {
            Some(callers) if callers <= request_timeout => Self {
                timeout: callers,
                callers_own: true,
            },
            _ => Self {
                timeout: request_timeout,
                callers_own: false,
            },
        }
    }

    /// The answer of `rpc` at the deadline, counted.
    pub(super) fn expired(self, rpc: &'static str) -> tonic::Status {
        ::metrics::counter!(metrics::REQUEST_TIMEOUTS_TOTAL, "rpc" => rpc).increment(1);
        expired(self.timeout, self.callers_own)
    }
}

/// The service's RPC a path names, as a metric label: a static name, so
/// that no call pays an allocation for a label only a timeout uses.
pub(super) fn rpc_of(path: &str) -> Option<&'static str> {
    let method = path.strip_prefix(SERVICE_PREFIX)?;
    Some(
        RPCS.into_iter()
            .find(|rpc| *rpc == method)
            .unwrap_or("unknown"),
    )
}

/// The answer at the deadline. The caller's own deadline gives
/// DEADLINE_EXCEEDED (it has stopped waiting); the server's bound gives
/// UNAVAILABLE, worth a retry with backoff.
fn expired(timeout: Duration, callers_own: bool) -> tonic::Status {
    let after = humantime::format_duration(timeout);
    if callers_own {
        with_reason(
            Code::DeadlineExceeded,
            format!("no answer within the call's deadline ({after})"),
            reason::REQUEST_TIMEOUT,
        )
    } else {
        with_reason(
            Code::Unavailable,
            format!(
                "no answer within {after} (--request-timeout): the database is slow or \
                 unreachable; retry with backoff"
            ),
            reason::REQUEST_TIMEOUT,
        )
    }
}

/// A `grpc-timeout` header's value: at most 8 digits and a unit (gRPC over
/// HTTP/2 spec). Anything else is ignored, as if absent.
fn grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let amount: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_per_the_spec() {
        assert_eq!(grpc_timeout(b"1S"), Some(Duration::from_secs(1)));
        assert_eq!(grpc_timeout(b"250m"), Some(Duration::from_millis(250)));
        assert_eq!(
            grpc_timeout(b"99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        assert_eq!(grpc_timeout(b"5u"), Some(Duration::from_micros(5)));
        assert_eq!(grpc_timeout(b"5n"), Some(Duration::from_nanos(5)));
        for bad in [&b""[..], b"S", b"123456789S", b"1x", b"-1S", b"1.5S"] {
            assert_eq!(
                grpc_timeout(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn the_callers_deadline_exceeds_and_the_servers_is_unavailable() {
        assert_eq!(
            expired(Duration::from_secs(1), true).code(),
            Code::DeadlineExceeded
        );
        let server = expired(Duration::from_secs(10), false);
        assert_eq!(server.code(), Code::Unavailable);
        assert!(server.message().contains("--request-timeout"), "{server:?}");
    }
}
