//! BatchStream (`idempotency.v1.IdempotencyStreamService`): batches as
//! messages of one long-lived call.
//!
//! [`StreamLayer`] sits outermost on the gRPC port and answers the stream's
//! path itself; every other call passes through. Each message of a stream
//! is served as the unary BatchAcquire or BatchComplete call it stands for,
//! with the stream's credential and the message's own deadline and trace
//! context: the same checks in the same order as the layers below apply to
//! a unary call (the call limit, the span, auth, the deadline, admission),
//! then the service's handler, called directly. So a message is answered as
//! the unary call would be, without an HTTP request and codec of its own.
//!
//! - [`frames`]: the stream's messages, each charged to the memory budget
//!   before it is read;
//! - [`envelope`]: a message's id, deadline, trace context and batch, and its
//!   answer, without decoding the batch;
//! - [`call`]: one message served as its batch call;
//! - [`slots`]: how many streams may be open, per server, connection and principal;
//! - [`session`]: one stream's life: reading, serving, answering, ending.

mod call;
mod envelope;
mod frames;
mod session;
mod slots;

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures_util::future::{Either, Ready, ready};
use tokio::sync::watch;
use tonic::{Code, Status, body::Body};

use super::{
    admission::MemoryBudget,
    auth::{authenticate, remote_addr},
    status::{reason, with_reason},
};
use crate::{
    domain::Limits,
    metrics::{GRPC_STREAMS_ENDED_TOTAL, GRPC_STREAMS_REFUSED_TOTAL},
    security::tls::TlsConnectInfo,
};
pub use call::Calls;
pub use slots::SlotLimits;

/// Why a stream is refused at open, as `idempotency_grpc_streams_refused_total` labels it.
const REFUSALS: [&str; 4] = [
    "overloaded",
    "too_many_streams",
    "unauthenticated",
    "bad_message",
];

/// The stream's path.
pub const PATH: &str = "/idempotency.v1.IdempotencyStreamService/BatchStream";

/// The least a stream lives, even on a connection at its age: one that
/// ended before reading a message would only send its caller to open
/// another.
const MIN_AGE: Duration = Duration::from_secs(1);

/// A stream message's envelope beyond its batch (id, deadline, trace context).
const ENVELOPE_BYTES: usize = 1024;

/// How streams are served (`settings::StreamArgs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSettings {
    pub slots: SlotLimits,
    /// Messages of one stream in flight, their unwritten answers included.
    pub max_in_flight: usize,
    pub idle_timeout: Duration,
    /// Before jitter of a tenth either way.
    pub max_age: Duration,
    /// `--max-connection-age`: a stream ends by its connection's age too
    /// (counted from the TLS handshake; over plain text, from the stream's
    /// opening), so that a client certificate is proven again by then.
    pub max_connection_age: Duration,
    /// How long answers may wait unread before the stream ends (SLOW_READER).
    pub write_timeout: Duration,
    /// Once the server drains, how long the messages read have to be answered.
    pub drain_grace: Duration,
}

/// Tells the streams that the server is draining.
#[derive(Debug)]
pub struct Drain(watch::Sender<bool>);

impl Drain {
    pub fn start(&self) {
        self.0.send_replace(true);
    }
}

/// Serves [`PATH`] (see the module docs).
#[derive(Debug, Clone)]
pub struct StreamLayer {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    settings: StreamSettings,
    slots: Arc<slots::Slots>,
    calls: Arc<Calls>,
    budget: Arc<MemoryBudget>,
    max_message_bytes: usize,
    draining: watch::Receiver<bool>,
}

impl StreamLayer {
    /// The layer, and the handle that starts its streams' drain. `calls`
    /// serves the messages.
    pub fn new(
        settings: StreamSettings,
        limits: &Limits,
        budget: Arc<MemoryBudget>,
        calls: Calls,
    ) -> (Self, Drain) {
        let (drain, draining) = watch::channel(false);
        // Registered once, and exported from the start.
        ::metrics::gauge!(crate::metrics::GRPC_STREAM_MESSAGES_IN_FLIGHT).increment(0.0);
        for reason in REFUSALS {
            ::metrics::counter!(GRPC_STREAMS_REFUSED_TOTAL, "reason" => reason).increment(0);
        }
        for reason in End::LABELS {
            ::metrics::counter!(GRPC_STREAMS_ENDED_TOTAL, "reason" => reason).increment(0);
        }
        let max_batch = limits
            .max_batch_acquire_message_bytes()
            .max(limits.max_message_bytes());
        let shared = Shared {
            settings,
            slots: slots::Slots::new(settings.slots),
            calls: Arc::new(calls),
            budget,
            max_message_bytes: max_batch + ENVELOPE_BYTES,
            draining,
        };
        let layer = Self {
            shared: Arc::new(shared),
        };
        (layer, Drain(drain))
    }
}

impl<S> tower::Layer<S> for StreamLayer {
    type Service = Streams<S>;

    fn layer(&self, inner: S) -> Streams<S> {
        Streams {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// Answers [`PATH`]; every other call goes to `inner`.
#[derive(Debug, Clone)]
pub struct Streams<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> tower::Service<http::Request<Body>> for Streams<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<http::Response<Body>, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() != PATH {
            return Either::Left(self.inner.call(request));
        }
        Either::Right(ready(Ok(open(&self.shared, request))))
    }
}

/// Opens a stream: checks who calls and whether a slot is free, then serves
/// it in a task of its own, answering through the response's body.
fn open(shared: &Arc<Shared>, request: http::Request<Body>) -> http::Response<Body> {
    let (parts, body) = request.into_parts();
    if !is_grpc(&parts.headers) {
        return refused(
            "bad_message",
            frames::invalid("BatchStream takes content-type application/grpc".into()),
        );
    }
    if compressed(&parts.headers) {
        return refused(
            "bad_message",
            frames::invalid(
                "BatchStream messages are not accepted compressed (grpc-encoding); send them \
                 uncompressed"
                    .into(),
            ),
        );
    }
    let caller = match &shared.calls.auth {
        None => None,
        Some(auth) => match authenticate(auth, PATH, &parts.headers, &parts.extensions) {
            Ok(caller) => Some(caller),
            Err(status) => return refused("unauthenticated", status),
        },
    };
    let connection = remote_addr(&parts.extensions);
    let slot = match shared
        .slots
        .open(connection, caller.map(|caller| caller.principal))
    {
        Ok(slot) => slot,
        Err(refusal) => return refused(refusal.reason, refusal.status),
    };
    let age = session::jittered(shared.settings.max_age)
        .min(connection_left(
            &parts.extensions,
            shared.settings.max_connection_age,
        ))
        .max(MIN_AGE);
    let frames = frames::Frames::new(body, shared.max_message_bytes, shared.budget.clone());
    let origin = call::Origin {
        headers: parts.headers,
        extensions: parts.extensions,
    };
    let (session, answers) = session::Session::new(origin, frames, shared.clone(), slot, age);
    tokio::spawn(session.run());
    let mut response = http::Response::new(Body::new(answers));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// What is left of the connection's life: from its TLS handshake, or the
/// whole of it over plain text, where no identity is proven at connection.
fn connection_left(extensions: &http::Extensions, max_connection_age: Duration) -> Duration {
    extensions
        .get::<TlsConnectInfo>()
        .map_or(max_connection_age, |tls| {
            max_connection_age.saturating_sub(tls.handshaken.elapsed())
        })
}

fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value == "application/grpc"
                || value.starts_with("application/grpc+proto")
                || value.starts_with("application/grpc;")
        })
}

fn compressed(headers: &http::HeaderMap) -> bool {
    headers
        .get("grpc-encoding")
        .is_some_and(|encoding| encoding != "identity")
}

fn refused(reason: &'static str, status: Status) -> http::Response<Body> {
    ::metrics::counter!(GRPC_STREAMS_REFUSED_TOTAL, "reason" => reason).increment(1);
    status.into_http()
}

/// Why a stream ended.
#[derive(Debug)]
pub(super) enum End {
    /// The caller closed its side.
    Closed,
    Idle,
    MaxAge,
    /// The server is draining, and every message read was answered.
    Draining,
    /// The server is draining, and the grace ran out first.
    DrainTimeout,
    /// A message's credential no longer checked out.
    Unauthenticated(Status),
    SlowReader,
    /// The next message would carry the calls past the memory budget.
    Overloaded(Status),
    /// Too large, compressed, cut off or not protobuf.
    BadMessage(Status),
    /// The caller reset the stream or its connection broke.
    Cancelled,
}

impl End {
    /// Whether the messages in flight are answered first.
    fn answers_in_flight(&self) -> bool {
        !matches!(
            self,
            Self::DrainTimeout | Self::SlowReader | Self::Cancelled
        )
    }

    const LABELS: [&'static str; 10] = [
        "closed",
        "idle",
        "max_age",
        "draining",
        "drain_timeout",
        "unauthenticated",
        "slow_reader",
        "overloaded",
        "bad_message",
        "cancelled",
    ];

    fn label(&self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Idle => "idle",
            Self::MaxAge => "max_age",
            Self::Draining => "draining",
            Self::DrainTimeout => "drain_timeout",
            Self::Unauthenticated(_) => "unauthenticated",
            Self::SlowReader => "slow_reader",
            Self::Overloaded(_) => "overloaded",
            Self::BadMessage(_) => "bad_message",
            Self::Cancelled => "cancelled",
        }
    }

    /// The stream's final status.
    fn status(self, settings: &StreamSettings) -> Status {
        ::metrics::counter!(GRPC_STREAMS_ENDED_TOTAL, "reason" => self.label()).increment(1);
        match self {
            Self::Closed => Status::ok(""),
            // Nobody reads it; never OK, which would say what was not
            // answered did not run.
            Self::Cancelled => Status::cancelled("the caller went away"),
            Self::Idle => Status::ok("the stream was idle; open another when needed"),
            Self::MaxAge => Status::ok("the stream reached its age; open another"),
            Self::Draining => Status::ok("the server is draining; open another stream"),
            Self::DrainTimeout => with_reason(
                Code::Unavailable,
                format!(
                    "the server stopped before every message read was answered (in {}); those \
                     unanswered may or may not have run: send them again on a new stream",
                    humantime::format_duration(settings.drain_grace)
                ),
                reason::DRAINING,
            ),
            Self::SlowReader => with_reason(
                Code::ResourceExhausted,
                format!(
                    "answers went unread for {}; the stream ended",
                    humantime::format_duration(settings.write_timeout)
                ),
                reason::SLOW_READER,
            ),
            Self::Unauthenticated(status) | Self::Overloaded(status) | Self::BadMessage(status) => {
                status
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_end_has_a_label_registered_at_start() {
        let ends = [
            End::Closed,
            End::Idle,
            End::MaxAge,
            End::Draining,
            End::DrainTimeout,
            End::Unauthenticated(Status::unauthenticated("")),
            End::SlowReader,
            End::Overloaded(Status::unavailable("")),
            End::BadMessage(Status::invalid_argument("")),
            End::Cancelled,
        ];
        let labels: Vec<_> = ends.iter().map(End::label).collect();
        assert_eq!(labels, End::LABELS);
    }
}
