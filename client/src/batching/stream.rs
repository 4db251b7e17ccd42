//! Batches as messages of one `BatchStream` per client, instead of one
//! batch RPC each: what an RPC costs beyond its message is paid once per
//! stream (docs/contract.md, "BatchStream").
//!
//! One stream is open at a time, shared by the Acquire and Complete
//! batchers. A message is registered under an id before it is sent; a
//! reader task hands each answer to the message of its id. When the stream
//! ends, the messages left unanswered are told how:
//! - the server ended it with a status of its own (OK when idle, at its age
//!   or draining; or a refusal such as UNAUTHENTICATED): it answered every
//!   message it read, so those left were never run and go again on a new
//!   stream, or fail with the stream's refusal;
//! - it broke (the connection, a reset, DRAINING, SLOW_READER): they may or
//!   may not have run, and fail as a unary call that failed in flight
//!   (`UNAVAILABLE`), under the same retry rules.
//!
//! A server without the method (`UNIMPLEMENTED` at open) is remembered, and
//! batches go as unary batch RPCs from then on; so do they while the server
//! refuses new streams (`TOO_MANY_STREAMS`, `OVERLOADED`). A stream is
//! opened with the credential of the moment; when the token source gives
//! another, the next message opens a new stream, and the old one ends once
//! its messages are answered.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};
use tonic::codegen::tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Code, Status, metadata::AsciiMetadataValue, service::interceptor::InterceptedService};

use crate::{
    credentials::Credentials,
    pb::{
        self, batch_stream_request::Batch,
        idempotency_stream_service_client::IdempotencyStreamServiceClient,
    },
    trace::TraceContext,
    transport::Transport,
};

/// The stream stub: the same transport and credentials as every call.
pub(crate) type StreamStub =
    IdempotencyStreamServiceClient<InterceptedService<Transport, Credentials>>;

/// How often a message whose stream ended cleanly before reading it is sent
/// again on a new one before its batch goes as a unary RPC.
const ATTEMPTS: usize = 3;

/// Beyond its own deadline, how long a message waits for its answer before
/// it is given up as lost (the server answers by the deadline).
const ANSWER_MARGIN: Duration = Duration::from_secs(1);

/// Longest wait for a stream to open (the server answers at once, without
/// the database); past it, and after a refusal, batches go as RPCs for
/// [`AVOID_FOR`].
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// How long batches go as RPCs after a stream could not be opened.
const AVOID_FOR: Duration = Duration::from_secs(1);

/// What sending a batch on a stream came to.
pub(crate) enum Sent {
    /// The server's answer: the batch's reply or its error as a whole.
    Answer(pb::batch_stream_response::Result),
    /// No stream to send it on (the server has no such method, or refuses
    /// more streams now): send the batch as its unary RPC.
    Unary,
    /// The batch failed as a unary call would have: it may or may not have
    /// run when the stream broke, or the stream was refused.
    Failed(Status),
}

/// The client's streams: the one open now, and what was learned.
#[derive(Debug)]
pub(crate) struct Streams {
    stub: StreamStub,
    credentials: Credentials,
    /// The server has no `BatchStream`: never try again.
    unsupported: AtomicBool,
    /// A stream could not be opened lately: RPCs until then.
    avoid_until: Mutex<Option<Instant>>,
    next_id: AtomicU64,
    /// The stream messages go on; opened on first use, and again after it
    /// ended. Held while a stream opens, so that callers share one.
    open: tokio::sync::Mutex<Option<Arc<Open>>>,
}

impl Streams {
    pub(crate) fn new(stub: StreamStub, credentials: Credentials) -> Self {
        Self {
            stub,
            credentials,
            unsupported: AtomicBool::new(false),
            avoid_until: Mutex::new(None),
            next_id: AtomicU64::new(0),
            open: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether batches may go on streams (false once the server said it
    /// has no such method).
    pub(crate) fn usable(&self) -> bool {
        !self.unsupported.load(Ordering::Relaxed)
            && self
                .avoid_until
                .lock()
                .expect("no panics while held")
                .is_none_or(|until| Instant::now() >= until)
    }

    /// RPCs for a while: a stream could not be opened.
    fn avoid(&self) -> Sent {
        *self.avoid_until.lock().expect("no panics while held") = Some(Instant::now() + AVOID_FOR);
        Sent::Unary
    }

    /// Sends `batch` as a message with `timeout` as its deadline, in `trace`,
    /// and waits for its answer.
    pub(crate) async fn send(&self, batch: Batch, timeout: Duration, trace: TraceContext) -> Sent {
        // One deadline for every attempt, so that a resent message asks the
        // server for no more time than its caller has left.
        let deadline = Instant::now() + timeout;
        for _ in 0..ATTEMPTS {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Sent::Failed(Status::deadline_exceeded(
                    "the call's deadline passed before its batch was answered",
                ));
            }
            let open = match tokio::time::timeout(left.min(OPEN_TIMEOUT), self.stream()).await {
                Ok(Ok(open)) => open,
                Ok(Err(sent)) => return sent,
                // Nothing was sent: the batch goes as an RPC.
                Err(_) => return self.avoid(),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let message = pb::BatchStreamRequest {
                id,
                timeout: prost_types::Duration::try_from(left.max(Duration::from_millis(1))).ok(),
                traceparent: String::from_utf8_lossy(&trace.to_header()).into_owned(),
                batch: Some(batch.clone()),
            };
            let Some(answer) = open.send(id, message) else {
                continue; // It ended meanwhile; the message was never sent.
            };
            match tokio::time::timeout(left + ANSWER_MARGIN, answer).await {
                Ok(Ok(Heard::Answer(result))) => return Sent::Answer(result),
                // Ended cleanly before reading it: it never ran.
                Ok(Ok(Heard::NotRead(None))) => continue,
                Ok(Ok(Heard::NotRead(Some(refusal)))) => return Sent::Failed(refusal),
                Ok(Ok(Heard::Lost(status))) => return Sent::Failed(status),
                Ok(Err(_)) => return Sent::Failed(lost("its stream's reader went away")),
                // A stream that stops answering is not used again.
                Err(_) => {
                    open.forget(id);
                    open.retire();
                    return Sent::Failed(lost("no answer by its deadline"));
                }
            }
        }
        Sent::Unary
    }

    /// The open stream, or a new one.
    async fn stream(&self) -> Result<Arc<Open>, Sent> {
        let authorization = self.credentials.authorization().map_err(Sent::Failed)?;
        let mut open = self.open.lock().await;
        if let Some(stream) = open.as_ref()
            && stream.usable(&authorization)
        {
            return Ok(stream.clone());
        }
        // An old stream with messages in flight ends once they are answered.
        if let Some(old) = open.take() {
            old.retire();
        }
        let stream = self.open_new(authorization).await?;
        *open = Some(stream.clone());
        Ok(stream)
    }

    async fn open_new(&self, authorization: Option<AsciiMetadataValue>) -> Result<Arc<Open>, Sent> {
        let (sender, receiver) = mpsc::unbounded_channel();
        let opened = self
            .stub
            .clone()
            .max_decoding_message_size(usize::MAX)
            .batch_stream(UnboundedReceiverStream::new(receiver))
            .await;
        let answers = match opened {
            Ok(response) => response.into_inner(),
            Err(status) if status.code() == Code::Unimplemented => {
                tracing::info!(
                    "the idempotency service has no BatchStream; sending batches as RPCs"
                );
                self.unsupported.store(true, Ordering::Relaxed);
                return Err(Sent::Unary);
            }
            Err(status) if refuses_streams(&status) => return Err(self.avoid()),
            Err(status) => return Err(Sent::Failed(status)),
        };
        let open = Arc::new(Open {
            sender: Mutex::new(Some(sender)),
            pending: Mutex::new(Some(HashMap::new())),
            authorization,
        });
        tokio::spawn(read(answers, open.clone()));
        Ok(open)
    }
}

/// The last handle gone, the open stream is closed on our side: the server
/// answers what it read and ends it, instead of holding it until idle.
impl Drop for Streams {
    fn drop(&mut self) {
        if let Some(open) = self.open.get_mut().as_ref() {
            open.retire();
        }
    }
}

/// The server's refusal of one more stream, for now: batches go as RPCs.
fn refuses_streams(status: &Status) -> bool {
    use tonic_types::StatusExt;
    let reason = status
        .get_details_error_info()
        .map(|info| info.reason)
        .unwrap_or_default();
    matches!(reason.as_str(), "TOO_MANY_STREAMS" | "OVERLOADED")
}

fn lost(why: &str) -> Status {
    Status::unavailable(format!(
        "the stream carrying this batch broke ({why}); it may or may not have run"
    ))
}

/// What a message hears from its stream.
#[derive(Debug)]
enum Heard {
    Answer(pb::batch_stream_response::Result),
    /// The stream ended with a status of its own without reading it: send it
    /// again (`None`, the stream ended OK), or fail with the refusal.
    NotRead(Option<Status>),
    /// The stream broke with it in flight.
    Lost(Status),
}

/// An open stream.
#[derive(Debug)]
struct Open {
    /// `None` once retired: no more messages, the caller's side closed.
    sender: Mutex<Option<mpsc::UnboundedSender<pb::BatchStreamRequest>>>,
    /// The messages waiting for answers; `None` once the stream ended.
    pending: Mutex<Option<HashMap<u64, oneshot::Sender<Heard>>>>,
    /// The credential it was opened with.
    authorization: Option<AsciiMetadataValue>,
}

impl Open {
    /// Whether new messages may go on it: it has not ended, and was opened
    /// with the credential of the moment.
    fn usable(&self, authorization: &Option<AsciiMetadataValue>) -> bool {
        self.pending.lock().expect("no panics while held").is_some()
            && self.sender.lock().expect("no panics while held").is_some()
            && self.authorization == *authorization
    }

    /// Registers message `id` and sends it; `None` if the stream ended.
    fn send(&self, id: u64, message: pb::BatchStreamRequest) -> Option<oneshot::Receiver<Heard>> {
        let (answer, heard) = oneshot::channel();
        self.pending
            .lock()
            .expect("no panics while held")
            .as_mut()?
            .insert(id, answer);
        let sent = self
            .sender
            .lock()
            .expect("no panics while held")
            .as_ref()
            .is_some_and(|sender| sender.send(message).is_ok());
        if !sent {
            self.forget(id);
            return None;
        }
        Some(heard)
    }

    fn forget(&self, id: u64) {
        if let Some(pending) = self.pending.lock().expect("no panics while held").as_mut() {
            pending.remove(&id);
        }
    }

    /// Closes the caller's side: the server answers what it read, then ends
    /// the stream.
    fn retire(&self) {
        self.sender.lock().expect("no panics while held").take();
    }

    /// The stream ended with `status`: tells each message left.
    fn end(&self, status: &Status) {
        let Some(pending) = self.pending.lock().expect("no panics while held").take() else {
            return;
        };
        for (_, message) in pending {
            let _ = message.send(heard_at_end(status));
        }
    }
}

/// What a message left unanswered hears when its stream ends with `status`
/// (docs/contract.md, "Which messages ran").
fn heard_at_end(status: &Status) -> Heard {
    use tonic_types::StatusExt;
    let reason = status
        .get_details_error_info()
        .map(|info| info.reason)
        .unwrap_or_default();
    match (status.code(), reason.as_str()) {
        (Code::Ok, _) => Heard::NotRead(None),
        (_, "UNAUTHENTICATED" | "OVERLOADED" | "MESSAGE_TOO_LARGE" | "INVALID_ARGUMENT") => {
            Heard::NotRead(Some(status.clone()))
        }
        _ => Heard::Lost(lost(&format!("{}: {}", status.code(), status.message()))),
    }
}

/// Reads the stream's answers and hands each to its message, until the
/// stream ends.
async fn read(mut answers: tonic::Streaming<pb::BatchStreamResponse>, open: Arc<Open>) {
    let status = loop {
        match answers.message().await {
            Ok(Some(answer)) => {
                let waiting = open
                    .pending
                    .lock()
                    .expect("no panics while held")
                    .as_mut()
                    .and_then(|pending| pending.remove(&answer.id));
                if let (Some(message), Some(result)) = (waiting, answer.result) {
                    let _ = message.send(Heard::Answer(result));
                }
            }
            Ok(None) => break Status::ok(""),
            Err(status) => break status,
        }
    };
    // No more messages on it either.
    open.retire();
    open.end(&status);
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tonic_types::{ErrorDetails, StatusExt};

    use super::*;

    fn with_reason(code: Code, reason: &str) -> Status {
        let details = ErrorDetails::with_error_info(reason, "idempotency", HashMap::new());
        Status::with_error_details(code, "ended", details)
    }

    #[test]
    fn at_a_clean_end_unanswered_messages_never_ran_and_at_a_break_they_may_have() {
        assert!(matches!(
            heard_at_end(&Status::ok("")),
            Heard::NotRead(None)
        ));
        for (code, reason) in [
            (Code::Unauthenticated, "UNAUTHENTICATED"),
            (Code::Unavailable, "OVERLOADED"),
            (Code::OutOfRange, "MESSAGE_TOO_LARGE"),
            (Code::InvalidArgument, "INVALID_ARGUMENT"),
        ] {
            match heard_at_end(&with_reason(code, reason)) {
                Heard::NotRead(Some(status)) => assert_eq!(status.code(), code),
                _ => panic!("{reason}: the message was not read"),
            }
        }
        for status in [
            with_reason(Code::Unavailable, "DRAINING"),
            with_reason(Code::ResourceExhausted, "SLOW_READER"),
            Status::unknown("h2 protocol error: connection reset"),
            Status::cancelled("stream reset"),
        ] {
            match heard_at_end(&status) {
                Heard::Lost(lost) => assert_eq!(lost.code(), Code::Unavailable, "{status:?}"),
                _ => panic!("{status:?}: the message may have run"),
            }
        }
    }

    #[test]
    fn a_stream_takes_new_messages_until_it_ends_is_retired_or_the_credential_changes() {
        let token: AsciiMetadataValue = "Bearer one".parse().unwrap();
        let (sender, mut receiver) = mpsc::unbounded_channel();
        let open = Open {
            sender: Mutex::new(Some(sender)),
            pending: Mutex::new(Some(HashMap::new())),
            authorization: Some(token.clone()),
        };
        assert!(open.usable(&Some(token.clone())));
        assert!(!open.usable(&Some("Bearer two".parse().unwrap())));
        assert!(!open.usable(&None));

        let mut heard = open.send(7, pb::BatchStreamRequest::default()).unwrap();
        assert!(receiver.try_recv().is_ok(), "the message went out");
        open.retire();
        assert!(!open.usable(&Some(token.clone())));
        assert!(open.send(8, pb::BatchStreamRequest::default()).is_none());
        // Retired, it still hears the end for what it sent.
        open.end(&Status::ok(""));
        assert!(matches!(heard.try_recv(), Ok(Heard::NotRead(None))));
        assert!(open.send(9, pb::BatchStreamRequest::default()).is_none());
    }
}
