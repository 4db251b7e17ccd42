//! Client-side batching: Acquires (and Completes) made concurrently through
//! one [`Client`](crate::Client) travel together in one `BatchAcquire`
//! (`BatchComplete`) call. Each call still gets its own answer or error, the
//! one its unary call would have got.
//!
//! One dispatcher task per kind of call, shaped like the server's batcher
//! (`server/src/store/batch.rs`): a caller puts its call on the dispatcher's
//! queue and awaits its answer. There is no timed window. When fewer than
//! `max_in_flight` requests of its kind are on the wire, the dispatcher lets
//! the scheduler run once (so calls that are ready to run, typically those
//! woken by the same reply, join it) and sends what has queued, alone as the
//! unary RPC if nothing joined (or as a batch of one on the client's
//! `BatchStream`, [`stream`], where it has one). A lightly loaded caller pays one scheduler
//! turn, microseconds. Calls made while `max_in_flight` are on the wire queue
//! up; when one finishes, the dispatcher sends everything queued (up to
//! `max_items` and `max_bytes`) as one batch. Under load this turns many small
//! HTTP/2 messages into few large ones, and the server puts a batch's items
//! in shared database statements.
//!
//! Requests are sent from tasks, never from a caller's future: a caller that
//! stops polling (a future parked in a `select!` loop or an undriven
//! `FuturesUnordered`) holds up nobody else. A caller that goes away is not
//! sent, its lone request is cancelled, or its answer in a batch is dropped.
//!
//! The dispatcher runs on the runtime of the call that started it and ends
//! when the last handle of its client is dropped (its queue closes). A
//! client may outlive that runtime: the calls the runtime carried when it
//! shut down fail (as unavailable, so they are retried), and the next call
//! starts a dispatcher on its own runtime.

use std::{
    future::Future,
    marker::PhantomData,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use prost::Message;
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot},
    time::Instant,
};
use tonic::{Code, Status, codegen::Bytes};

use crate::{
    pb,
    trace::TraceContext,
    transport::{Stub, with_timeout},
};
use stream::{Sent, Streams};

/// How concurrent calls of one [`Client`](crate::Client) are batched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batching {
    /// Requests of one kind (Acquire or Complete) on the wire at once; calls
    /// beyond them wait and go together in the next batch.
    pub max_in_flight: usize,
    /// Most calls in one batch (the server refuses more than 100 by default).
    pub max_items: usize,
    /// Most encoded bytes in one batch; a call larger than a quarter of this
    /// (a big response to store) always travels alone. Keep it below the
    /// server's message limit (4 MiB, or twice `--max-response-bytes`):
    /// a batch over it is refused as a whole and its calls resent alone.
    pub max_bytes: usize,
    /// Send batches, and lone calls, as messages of one `BatchStream` per
    /// client instead of an RPC each, where the server has it (else, and
    /// with several endpoints, as RPCs). See [`stream`].
    pub stream: bool,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            max_in_flight: 4,
            max_items: 64,
            max_bytes: 1024 * 1024,
            stream: true,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type ItemResult<R> = Result<R, Status>;

/// Sends one kind of call, alone (its unary RPC) or several at once (its
/// batch RPC): the gRPC stub ([`Grpc`]), or a fake in tests.
pub(crate) trait SendBatch: Clone + Send + Sync + 'static {
    /// The unary call's request.
    type Request: Message + Clone + Send + 'static;
    /// The unary call's response.
    type Response: Send + 'static;

    /// The unary RPC, with `timeout` as its deadline, in `trace`.
    fn unary(
        &self,
        request: Self::Request,
        timeout: Duration,
        trace: TraceContext,
    ) -> BoxFuture<ItemResult<Self::Response>>;

    /// The batch RPC: each item's answer, in the order of `requests`, or the
    /// error of the whole call. `trace`: the first item's (one RPC carries
    /// one `traceparent`).
    fn batch(
        &self,
        requests: Vec<Self::Request>,
        timeout: Duration,
        trace: TraceContext,
    ) -> BoxFuture<Result<Vec<ItemResult<Self::Response>>, Status>>;

    /// Whether a lone call goes as a batch of one too: over a stream, a
    /// batch costs no more than the unary RPC.
    fn lone_as_batch(&self) -> bool {
        false
    }
}

/// What a queued call hears back.
enum Reply<T> {
    /// Its own answer, from the batch.
    Answer(ItemResult<T>),
    /// The server refused the batch as such (it has no batch RPCs, or takes
    /// shorter ones), or had no room for this call's answer in its reply: the
    /// caller, which still holds its request, sends it alone.
    SendAlone,
}

type ReplySender<T> = oneshot::Sender<Reply<T>>;

/// A queued call.
struct Job<S: SendBatch> {
    request: S::Request,
    bytes: usize,
    /// The caller's deadline, counted from when it queued: the batch carries
    /// the latest of its items', so the server gives up when all have.
    deadline: Instant,
    /// The caller's trace context.
    trace: TraceContext,
    reply: ReplySender<S::Response>,
}

/// What the dispatchers of one kind of call learn about the server; kept by
/// the [`Batcher`], so that a dispatcher started again knows it too.
#[derive(Debug)]
struct Learned {
    /// Set when the server does not know the batch RPC (an older version):
    /// from then on every call goes alone.
    unsupported: AtomicBool,
    /// Most calls per batch: `settings.max_items`, halved each time the
    /// server refuses a batch as too long (its limit is lower).
    max_items: AtomicUsize,
}

impl Learned {
    fn unsupported(&self) -> bool {
        self.unsupported.load(Ordering::Relaxed)
    }
}

/// The batcher of one kind of call: the handle callers queue on. Its
/// dispatcher ends when it is dropped.
pub(crate) struct Batcher<S: SendBatch> {
    sender: S,
    settings: Batching,
    timeout: Duration,
    learned: Arc<Learned>,
    /// The running dispatcher's queue; `None` before the first call.
    queue: Mutex<Option<mpsc::UnboundedSender<Job<S>>>>,
}

impl<S: SendBatch> std::fmt::Debug for Batcher<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<S: SendBatch> Batcher<S> {
    /// A batcher sending through `sender`. Needs no runtime: its dispatcher
    /// starts with the first call.
    pub(crate) fn new(sender: S, settings: Batching, timeout: Duration) -> Self {
        let settings = Batching {
            max_in_flight: settings.max_in_flight.max(1),
            max_items: settings.max_items.max(1),
            max_bytes: settings.max_bytes.max(1),
            stream: settings.stream,
        };
        Self {
            learned: Arc::new(Learned {
                unsupported: AtomicBool::new(false),
                max_items: AtomicUsize::new(settings.max_items),
            }),
            sender,
            settings,
            timeout,
            queue: Mutex::new(None),
        }
    }

    /// Sends `request` alone or in a batch, and returns its own answer.
    ///
    /// It has no deadline of its own: its caller (`Client::attempts`) bounds
    /// the whole call with the client's timeout. The request carries that
    /// timeout, counted from now, as its deadline; a batch carries the latest
    /// deadline of its calls.
    pub(crate) async fn call(
        &self,
        request: &S::Request,
        trace: TraceContext,
    ) -> ItemResult<S::Response> {
        let bytes = request.encoded_len();
        if bytes > self.settings.max_bytes / 4 || self.learned.unsupported() {
            return self
                .sender
                .unary(request.clone(), self.timeout, trace)
                .await;
        }
        let deadline = Instant::now() + self.timeout;
        let (reply, answer) = oneshot::channel();
        self.enqueue(Job {
            request: request.clone(),
            bytes,
            deadline,
            trace,
            reply,
        });
        match answer.await {
            Ok(Reply::Answer(result)) => result,
            Ok(Reply::SendAlone) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let timeout = left.max(Duration::from_millis(1));
                self.sender.unary(request.clone(), timeout, trace).await
            }
            Err(_) => Err(Status::unavailable(
                "the batch carrying this call was dropped",
            )),
        }
    }

    /// Puts `job` on the dispatcher's queue, starting a dispatcher on the
    /// caller's runtime when there is none yet, or when the last one's
    /// runtime shut down (dropping it closed its queue).
    fn enqueue(&self, job: Job<S>) {
        let mut queue = self.queue.lock().expect("batcher lock");
        let job = match queue.as_ref() {
            Some(queue) => match queue.send(job) {
                Ok(()) => return,
                Err(mpsc::error::SendError(job)) => job,
            },
            None => job,
        };
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(
            Dispatcher {
                sender: self.sender.clone(),
                settings: self.settings.clone(),
                learned: self.learned.clone(),
                queue: receiver,
                held: None,
            }
            .run(),
        );
        // Fails only when the runtime is shutting down and dropped the new
        // dispatcher at once: the caller then hears that its call was dropped.
        let _ = sender.send(job);
        *queue = Some(sender);
    }
}

/// The task that takes calls off the queue and sends them, alone or in batches.
struct Dispatcher<S: SendBatch> {
    sender: S,
    settings: Batching,
    learned: Arc<Learned>,
    queue: mpsc::UnboundedReceiver<Job<S>>,
    /// A call taken off the queue that did not fit in the last batch (by its
    /// bytes), or waiting for a permit: the first of the next.
    held: Option<Job<S>>,
}

impl<S: SendBatch> Dispatcher<S> {
    /// Waits for a call, then for a permit (one of `max_in_flight`), and
    /// sends what has queued by then from a task of its own; until every
    /// handle of the batcher is gone.
    async fn run(mut self) {
        let permits = Arc::new(Semaphore::new(self.settings.max_in_flight));
        loop {
            if self.held.is_none() {
                let Some(job) = self.queue.recv().await else {
                    return; // The client was dropped.
                };
                self.held = Some(job);
            }
            let permit = match permits.clone().try_acquire_owned() {
                Ok(permit) => permit,
                // All on the wire: what queues meanwhile goes together once
                // one is back.
                Err(_) => permits.clone().acquire_owned().await.expect("never closed"),
            };
            // One turn of the scheduler before sending: calls that are ready
            // to run (typically the callers woken by the same reply) join
            // this batch instead of each taking a permit alone. Needed after
            // waiting for a permit too: the reply that frees one wakes its
            // callers first, but the scheduler may run this task (woken
            // last) before them. A lone caller loses microseconds.
            tokio::task::yield_now().await;
            let batch = self.take_batch();
            if !batch.is_empty() {
                let (sender, learned) = (self.sender.clone(), self.learned.clone());
                tokio::spawn(send(sender, learned, batch, permit));
            }
        }
    }

    /// The next batch: the held call and what is queued, in order, up to
    /// `max_items` calls and `max_bytes` (at least one call).
    fn take_batch(&mut self) -> Vec<Job<S>> {
        let max_items = self.learned.max_items.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut batch = Vec::new();
        let mut bytes = 0;
        while batch.len() < max_items {
            let Some(job) = self.held.take().or_else(|| self.queue.try_recv().ok()) else {
                break;
            };
            // Calls whose caller went away, or whose deadline passed while
            // they waited, are not sent; the latter are told so.
            if job.reply.is_closed() {
                continue;
            }
            if job.deadline <= now {
                let _ = job.reply.send(Reply::Answer(Err(Status::deadline_exceeded(
                    "the call's deadline passed while it waited for a batch",
                ))));
                continue;
            }
            if !batch.is_empty() && bytes + job.bytes > self.settings.max_bytes {
                self.held = Some(job);
                break;
            }
            bytes += job.bytes;
            batch.push(job);
        }
        batch
    }
}

/// Sends `batch` (alone as the unary RPC when it holds one call and there is
/// no stream to send it on) and answers
/// each of its callers; `permit` is given back when done.
async fn send<S: SendBatch>(
    sender: S,
    learned: Arc<Learned>,
    mut batch: Vec<Job<S>>,
    _permit: OwnedSemaphorePermit,
) {
    let timeout = batch_timeout(&batch);
    if batch.len() == 1
        && !learned.unsupported()
        && let Some(job) = batch.pop()
    {
        if sender.lone_as_batch() {
            return send_one_as_batch(&sender, &learned, job, timeout).await;
        }
        return send_one(&sender, job, timeout).await;
    }
    let trace = batch[0].trace;
    let (requests, replies): (Vec<S::Request>, Vec<_>) = batch
        .into_iter()
        .map(|job| (job.request, job.reply))
        .unzip();
    if learned.unsupported() {
        return send_alone(replies);
    }
    let count = requests.len();
    let result = sender.batch(requests, timeout, trace).await;
    answer(&learned, replies, count, result);
}

/// What is left of the latest deadline in the batch: the server works for as
/// long as any of its callers waits (each caller stops waiting at its own
/// deadline), so one nearly expired call does not fail the calls that queued
/// after it.
fn batch_timeout<S: SendBatch>(batch: &[Job<S>]) -> Duration {
    batch
        .iter()
        .map(|job| job.deadline)
        .max()
        .map_or(Duration::ZERO, |deadline| {
            deadline.saturating_duration_since(Instant::now())
        })
        .max(Duration::from_millis(1))
}

/// Sends a call alone: if its caller goes away, the call is cancelled, and
/// the permit goes on to the calls queued behind it.
async fn send_one<S: SendBatch>(sender: &S, job: Job<S>, timeout: Duration) {
    let Job {
        request,
        mut reply,
        trace,
        ..
    } = job;
    tokio::select! {
        result = sender.unary(request, timeout, trace) => {
            let _ = reply.send(Reply::Answer(result));
        }
        () = reply.closed() => {}
    }
}

/// Sends a call alone as a batch of one (on a stream, where that costs no
/// more than its unary RPC). If its caller goes away, the permit goes on to
/// the calls queued behind it, as [`send_one`]'s does; the server, which got
/// the message, still runs it, as it runs a batch's items whose callers left.
async fn send_one_as_batch<S: SendBatch>(
    sender: &S,
    learned: &Learned,
    job: Job<S>,
    timeout: Duration,
) {
    let Job {
        request,
        mut reply,
        trace,
        ..
    } = job;
    tokio::select! {
        result = sender.batch(vec![request], timeout, trace) => {
            answer(learned, vec![reply], 1, result);
        }
        () = reply.closed() => {}
    }
}

/// Answers each caller of a batch of `count` from the batch RPC's `result`.
fn answer<T>(
    learned: &Learned,
    replies: Vec<ReplySender<T>>,
    count: usize,
    result: Result<Vec<ItemResult<T>>, Status>,
) {
    match result {
        Ok(results) if results.len() == count => {
            for (reply, result) in replies.into_iter().zip(results) {
                let answer = match result {
                    // The batch's reply was full (large stored responses):
                    // this call fits alone.
                    Err(status) if is_reply_full(&status) => Reply::SendAlone,
                    result => Reply::Answer(result),
                };
                let _ = reply.send(answer);
            }
        }
        Ok(results) => {
            let status = Status::internal(format!(
                "a batch of {count} calls was answered with {} results",
                results.len()
            ));
            answer_all(replies, &status);
        }
        Err(status) if status.code() == Code::Unimplemented => {
            tracing::info!("the idempotency service has no batch RPCs; sending calls alone");
            learned.unsupported.store(true, Ordering::Relaxed);
            send_alone(replies);
        }
        // The batch is longer than the server takes (more calls, or more
        // bytes than its message limit, OUT_OF_RANGE, with `max_bytes`
        // set above it): smaller ones from now on. Not the calls' own
        // refusal, so each is sent again alone and answered for itself.
        Err(status) if matches!(status.code(), Code::InvalidArgument | Code::OutOfRange) => {
            let halved = (count / 2).max(1);
            learned.max_items.fetch_min(halved, Ordering::Relaxed);
            tracing::info!(
                max_items = halved,
                "the idempotency service refused a batch of {count}; sending fewer calls per batch"
            );
            send_alone(replies);
        }
        Err(status) => answer_all(replies, &status),
    }
}

/// The server's answer to a batch item that did not fit in the reply.
fn is_reply_full(status: &Status) -> bool {
    use tonic_types::StatusExt;
    status.code() == Code::ResourceExhausted
        && status
            .get_details_error_info()
            .is_some_and(|info| info.reason == "BATCH_REPLY_FULL")
}

fn answer_all<T>(replies: Vec<ReplySender<T>>, status: &Status) {
    for reply in replies {
        let _ = reply.send(Reply::Answer(Err(status.clone())));
    }
}

/// Hands each call back to its caller, to send alone.
fn send_alone<T>(replies: Vec<ReplySender<T>>) {
    for reply in replies {
        let _ = reply.send(Reply::SendAlone);
    }
}

/// A failed item's `google.rpc.Status`, as the status the unary call would
/// have failed with (its details keep ErrorInfo and BadRequest).
pub(crate) fn item_status(status: tonic_types::pb::Status) -> Status {
    let code = Code::from_i32(status.code);
    let message = status.message.clone();
    Status::with_details(code, message, Bytes::from(status.encode_to_vec()))
}

/// Each item's answer from a batch reply: its response, or its error as the
/// unary call would have failed with it.
fn item_results<T>(
    results: impl Iterator<Item = Option<Result<T, tonic_types::pb::Status>>>,
) -> Vec<ItemResult<T>> {
    results
        .map(|result| match result {
            Some(Ok(response)) => Ok(response),
            Some(Err(status)) => Err(item_status(status)),
            None => Err(Status::internal("a batch item was answered with nothing")),
        })
        .collect()
}

/// The gRPC stub as the sender of one kind of call, `R` being its unary
/// request: [`SendBatch`] is implemented for Acquire and Complete. Batches
/// go on the client's stream when it has one.
pub(crate) struct Grpc<R> {
    stub: Stub,
    streams: Option<Arc<Streams>>,
    kind: PhantomData<fn() -> R>,
}

impl<R> Grpc<R> {
    pub(crate) fn new(stub: Stub) -> Self {
        Self::with_streams(stub, None)
    }

    pub(crate) fn with_streams(stub: Stub, streams: Option<Arc<Streams>>) -> Self {
        Self {
            stub,
            streams,
            kind: PhantomData,
        }
    }

    /// The streams, while the server may have them.
    fn usable_streams(&self) -> Option<Arc<Streams>> {
        self.streams.clone().filter(|streams| streams.usable())
    }
}

impl<R> Clone for Grpc<R> {
    fn clone(&self) -> Self {
        Self::with_streams(self.stub.clone(), self.streams.clone())
    }
}

/// `SendBatch` for a unary RPC and its batch form: the two differ only in
/// the names the proto gives them.
macro_rules! batch_rpc {
    ($request:ident => $response:ident, $unary:ident, $batch:ident($batch_request:ident), $result:ident, $kind:ident) => {
        impl SendBatch for Grpc<pb::$request> {
            type Request = pb::$request;
            type Response = pb::$response;

            fn unary(
                &self,
                request: Self::Request,
                timeout: Duration,
                trace: TraceContext,
            ) -> BoxFuture<ItemResult<Self::Response>> {
                let mut stub = self.stub.clone();
                Box::pin(async move {
                    stub.$unary(with_timeout(request, timeout, &trace))
                        .await
                        .map(tonic::Response::into_inner)
                })
            }

            fn batch(
                &self,
                requests: Vec<Self::Request>,
                timeout: Duration,
                trace: TraceContext,
            ) -> BoxFuture<Result<Vec<ItemResult<Self::Response>>, Status>> {
                let mut stub = self.stub.clone();
                let streams = self.usable_streams();
                Box::pin(async move {
                    let batch = pb::$batch_request { requests };
                    let sent = match &streams {
                        Some(streams) => {
                            let message = pb::batch_stream_request::Batch::$kind(batch.clone());
                            streams.send(message, timeout, trace).await
                        }
                        None => Sent::Unary,
                    };
                    use pb::batch_stream_response::Result as Answer;
                    let response = match sent {
                        Sent::Answer(Answer::$kind(response)) => response,
                        Sent::Answer(Answer::Error(status)) => return Err(item_status(status)),
                        Sent::Answer(_) => {
                            return Err(Status::internal("a batch was answered as another kind"));
                        }
                        Sent::Failed(status) => return Err(status),
                        // No stream after all: a lone call goes as its
                        // unary RPC, as it would have without streams.
                        Sent::Unary if batch.requests.len() == 1 => {
                            let request = batch.requests.into_iter().next().expect("one");
                            let result = stub
                                .$unary(with_timeout(request, timeout, &trace))
                                .await
                                .map(tonic::Response::into_inner);
                            return Ok(vec![result]);
                        }
                        Sent::Unary => stub
                            .$batch(with_timeout(batch, timeout, &trace))
                            .await?
                            .into_inner(),
                    };
                    use pb::$result::Result as Item;
                    Ok(item_results(response.results.into_iter().map(|result| {
                        result.result.map(|item| match item {
                            Item::Response(response) => Ok(response),
                            Item::Error(status) => Err(status),
                        })
                    })))
                })
            }

            fn lone_as_batch(&self) -> bool {
                self.usable_streams().is_some()
            }
        }
    };
}

batch_rpc!(AcquireRequest => AcquireResponse, acquire, batch_acquire(BatchAcquireRequest), batch_acquire_result, Acquire);
batch_rpc!(CompleteRequest => CompleteResponse, complete, batch_complete(BatchCompleteRequest), batch_complete_result, Complete);

pub(crate) mod stream;
#[cfg(test)]
mod tests;
