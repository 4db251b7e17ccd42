//! One stream's life in a task of its own: read a message when fewer than
//! `max_in_flight` are in flight, serve it as its batch call, queue its
//! answer for the response body, and end the stream for one of [`End`]'s
//! reasons, answering what was read first where the reason allows.
//!
//! The answers are written by the response body as HTTP/2 takes them. A
//! message's slot and its memory charge (its reply's bytes included) are
//! held until then, so a caller that stops reading stops the server reading
//! its stream too, and one that leaves answers unread for `write_timeout`
//! loses the stream.

use std::{
    pin::Pin,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use bytes::Bytes;
use futures_util::{
    StreamExt as _,
    future::{BoxFuture, ready},
    stream::FuturesUnordered,
};
use http_body::Frame;
use metrics::Gauge;
use tokio::{
    sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch},
    time::{Duration, Instant},
};
use tonic::Status;

use super::{
    End, Shared,
    call::Origin,
    envelope::{self, Request},
    frames::{Frames, invalid},
    slots::Slot,
};
use crate::grpc::admission::Charge;
use crate::metrics::GRPC_STREAM_MESSAGES_IN_FLIGHT;

/// What the session hands the response body.
pub(super) enum Item {
    /// An answer, as a gRPC message, with what it holds until written.
    Answer(Bytes, Held),
    End(Status),
}

/// What a message holds from being read until its answer is written: its
/// place among the stream's messages in flight, and its call's charge to the
/// memory budget (its reply's bytes included).
pub(super) struct Held {
    _permit: OwnedSemaphorePermit,
    charge: Option<Charge>,
    gauge: Gauge,
}

impl Held {
    fn new(permit: OwnedSemaphorePermit) -> Self {
        let gauge = ::metrics::gauge!(GRPC_STREAM_MESSAGES_IN_FLIGHT);
        gauge.increment(1.0);
        Self {
            _permit: permit,
            charge: None,
            gauge,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}

/// A message being served: its answer, what it holds, and the status that
/// ends the stream when its credential no longer checked out.
type Serving = BoxFuture<'static, (Bytes, Held, Option<Status>)>;

/// Answers queued and not yet taken by the response body, and when the body
/// last took one (or the queue last became non-empty).
struct Unread {
    queued: AtomicUsize,
    touched_millis: AtomicU64,
    origin: Instant,
    /// Told each time the body takes an answer.
    taken: Notify,
}

impl Unread {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            queued: AtomicUsize::new(0),
            touched_millis: AtomicU64::new(0),
            origin: Instant::now(),
            taken: Notify::new(),
        })
    }

    fn touch(&self) {
        let millis = self.origin.elapsed().as_millis() as u64;
        self.touched_millis.store(millis, Ordering::Release);
    }

    fn queued(&self) {
        if self.queued.fetch_add(1, Ordering::AcqRel) == 0 {
            self.touch();
        }
    }

    fn taken(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
        self.touch();
        self.taken.notify_one();
    }

    /// Whether the answers waiting are past `write_timeout` now (false when
    /// none waits).
    fn overdue(&self, write_timeout: Duration) -> bool {
        self.overdue_at(write_timeout)
            .is_some_and(|at| at <= Instant::now())
    }

    /// When answers waiting since the last progress become overdue; `None`
    /// while none waits.
    fn overdue_at(&self, write_timeout: Duration) -> Option<Instant> {
        (self.queued.load(Ordering::Acquire) > 0).then(|| {
            let touched = Duration::from_millis(self.touched_millis.load(Ordering::Acquire));
            self.origin + touched + write_timeout
        })
    }
}

/// The queue between the session and the response body. The body owns it;
/// the session reaches it to discard what a slow reader left unread, and
/// sees it gone (`answers.closed()`) when the caller went away.
type Queue = Mutex<mpsc::Receiver<Item>>;

pub(super) struct Session {
    origin: Origin,
    frames: Frames,
    answers: mpsc::Sender<Item>,
    queue: Weak<Queue>,
    /// When it ends (`End::MaxAge`), counted from its opening.
    age: Duration,
    unread: Arc<Unread>,
    shared: Arc<Shared>,
    _slot: Slot,
}

impl Session {
    /// The session, and the response body that writes its answers.
    pub(super) fn new(
        origin: Origin,
        frames: Frames,
        shared: Arc<Shared>,
        slot: Slot,
        age: Duration,
    ) -> (Self, Answers) {
        // Room for every answer the permits allow, and the end.
        let (sender, receiver) = mpsc::channel(shared.settings.max_in_flight + 1);
        let unread = Unread::new();
        let queue = Arc::new(Mutex::new(receiver));
        let session = Self {
            origin,
            frames,
            answers: sender,
            queue: Arc::downgrade(&queue),
            age,
            unread: unread.clone(),
            shared,
            _slot: slot,
        };
        let answers = Answers {
            queue,
            unread,
            ended: false,
        };
        (session, answers)
    }

    pub(super) async fn run(mut self) {
        let settings = self.shared.settings;
        let permits = Arc::new(Semaphore::new(settings.max_in_flight));
        let mut in_flight: FuturesUnordered<Serving> = FuturesUnordered::new();
        let drained = drained(self.shared.draining.clone());
        tokio::pin!(drained);
        let age_at = Instant::now() + self.age;
        let mut idle_since = Instant::now();
        let mut drain_by: Option<Instant> = None;
        // Set: read no more, and end once what was read is answered.
        let mut ending: Option<End> = None;
        let end = loop {
            if in_flight.is_empty()
                && let Some(end) = ending.take()
            {
                break end;
            }
            let reading = ending.is_none();
            let overdue_at = self.unread.overdue_at(settings.write_timeout);
            tokio::select! {
                biased;
                () = self.answers.closed() => break End::Cancelled,
                Some((answer, held, unauthenticated)) = in_flight.next(), if !in_flight.is_empty() => {
                    self.unread.queued();
                    let _ = self.answers.try_send(Item::Answer(answer, held));
                    if let Some(status) = unauthenticated
                        && reading
                    {
                        ending = Some(End::Unauthenticated(status));
                    }
                    idle_since = Instant::now();
                }
                () = sleep_until(overdue_at), if overdue_at.is_some() => {
                    if self.unread.overdue(settings.write_timeout) {
                        break End::SlowReader;
                    }
                }
                () = sleep_until(drain_by), if drain_by.is_some() => break End::DrainTimeout,
                () = sleep_until(self.frames.started_at().map(|at| at + settings.write_timeout)),
                    if reading && self.frames.started_at().is_some() => {
                    ending = Some(End::BadMessage(invalid(format!(
                        "a message was not sent in full within {}",
                        humantime::format_duration(settings.write_timeout)
                    ))));
                }
                () = &mut drained, if drain_by.is_none() => {
                    drain_by = Some(Instant::now() + settings.drain_grace);
                    ending.get_or_insert(End::Draining);
                }
                () = tokio::time::sleep_until(age_at), if reading => ending = Some(End::MaxAge),
                () = tokio::time::sleep_until(idle_since + settings.idle_timeout),
                    if reading && in_flight.is_empty() => ending = Some(End::Idle),
                read = next(&mut self.frames, &permits), if reading => match read {
                    Ok(Some((permit, message, charge))) => match envelope::read(message) {
                        Ok(request) => in_flight.push(self.serve(request, Held::new(permit), charge)),
                        Err(error) => {
                            ending = Some(End::BadMessage(invalid(format!(
                                "a message is not a valid BatchStreamRequest: {error}"
                            ))));
                        }
                    },
                    Ok(None) => ending = Some(End::Closed),
                    Err(end) if end.answers_in_flight() => ending = Some(end),
                    Err(end) => break end,
                },
            }
        };
        let end = match end {
            End::SlowReader | End::Cancelled | End::DrainTimeout => end,
            // What was answered must still be written: a caller that stops
            // reading now is as slow a reader as one that stopped before.
            end => written_or_overdue(&self.answers, &self.unread, settings.write_timeout)
                .await
                .unwrap_or(end),
        };
        tracing::debug!(reason = end.label(), "BatchStream ended");
        if matches!(end, End::SlowReader) {
            self.discard_unread();
        }
        let _ = self.answers.try_send(Item::End(end.status(&settings)));
    }

    /// Drops the answers a slow reader left unread, and with them what they
    /// hold (their slots and charges): the caller that stopped
    /// reading gets only the stream's end.
    fn discard_unread(&self) {
        if let Some(queue) = self.queue.upgrade() {
            let mut queue = queue.lock().expect("no panics while held");
            while queue.try_recv().is_ok() {}
        }
    }

    /// Serves one message: its batch call, or its own error at once. The
    /// message's `charge` ends just before the call is admitted, which
    /// charges it in turn, as admission charges a unary call.
    fn serve(&self, request: Request, mut held: Held, charge: Charge) -> Serving {
        let id = request.id;
        let content = match request.content {
            Ok(content) => content,
            Err(status) => return Box::pin(ready((envelope::error(id, &status), held, None))),
        };
        let served = self.shared.calls.serve(id, content, &self.origin, charge);
        Box::pin(async move {
            let served = served.await;
            held.charge = served.charge;
            (served.answer, held, served.unauthenticated)
        })
    }
}

/// Waits until every queued answer was taken for writing (`None`), or one
/// waited `write_timeout` untaken (`SlowReader`), or the caller went away
/// (`Cancelled`).
async fn written_or_overdue(
    answers: &mpsc::Sender<Item>,
    unread: &Unread,
    write_timeout: Duration,
) -> Option<End> {
    while let Some(overdue_at) = unread.overdue_at(write_timeout) {
        tokio::select! {
            () = answers.closed() => return Some(End::Cancelled),
            // An answer taken: look again (a permit stored by `notify_one`
            // covers one taken between the check above and this wait).
            () = unread.taken.notified() => {}
            () = tokio::time::sleep_until(overdue_at) => {
                if unread.overdue(write_timeout) {
                    return Some(End::SlowReader);
                }
            }
        }
    }
    None
}

/// The next message once a slot for it is free.
async fn next(
    frames: &mut Frames,
    permits: &Arc<Semaphore>,
) -> Result<Option<(OwnedSemaphorePermit, Bytes, Charge)>, End> {
    let permit = permits
        .clone()
        .acquire_owned()
        .await
        .expect("the permits are never closed");
    Ok(frames
        .next()
        .await?
        .map(|(message, charge)| (permit, message, charge)))
}

/// Resolves once the server drains; never, if it cannot tell any more.
async fn drained(mut draining: watch::Receiver<bool>) {
    if draining.wait_for(|draining| *draining).await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// `age`, give or take a tenth at random, so that streams opened together
/// do not all end together.
pub(super) fn jittered(age: Duration) -> Duration {
    age.mul_f64(0.9 + 0.2 * fastrand::f64())
}

/// The response body: the session's answers as they come, then its status
/// as trailers.
pub(super) struct Answers {
    queue: Arc<Queue>,
    unread: Arc<Unread>,
    ended: bool,
}

impl http_body::Body for Answers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let polled = self
            .queue
            .lock()
            .expect("no panics while held")
            .poll_recv(cx);
        let item = std::task::ready!(polled);
        let status = match item {
            Some(Item::Answer(answer, held)) => {
                self.unread.taken();
                drop(held);
                return Poll::Ready(Some(Ok(Frame::data(answer))));
            }
            Some(Item::End(status)) => status,
            None => Status::internal("the stream's session ended without a status"),
        };
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        if let Err(status) = status.add_header(&mut trailers) {
            tracing::error!(%status, "a BatchStream status could not be written");
        }
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_tenth() {
        let age = Duration::from_secs(100);
        for _ in 0..1000 {
            let jittered = jittered(age);
            assert!(jittered >= Duration::from_secs(90) && jittered <= Duration::from_secs(110));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn answers_become_overdue_only_while_some_wait() {
        let unread = Unread::new();
        let timeout = Duration::from_secs(10);
        assert_eq!(unread.overdue_at(timeout), None);
        tokio::time::advance(Duration::from_secs(60)).await;
        unread.queued();
        let due = unread.overdue_at(timeout).unwrap();
        assert!(
            due >= Instant::now() + Duration::from_secs(9),
            "the clock starts when one waits"
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        unread.queued();
        assert_eq!(
            unread.overdue_at(timeout),
            Some(due),
            "a second does not restart it"
        );
        unread.taken();
        assert!(
            unread.overdue_at(timeout).unwrap() > due,
            "progress restarts it"
        );
        unread.taken();
        assert_eq!(unread.overdue_at(timeout), None);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(
            !unread.overdue(timeout),
            "nothing waits, nothing is overdue"
        );
    }
}
