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
//! unary RPC if nothing joined. A lightly loaded caller pays one scheduler
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
    transport::{Stub, with_timeout},
};

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
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            max_in_flight: 4,
            max_items: 64,
            max_bytes: 1024 * 1024,
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

    /// The unary RPC, with `timeout` as its deadline.
    fn unary(
        &self,
        request: Self::Request,
        timeout: Duration,
    ) -> BoxFuture<ItemResult<Self::Response>>;

    /// The batch RPC: each item's answer, in the order of `requests`, or the
    /// error of the whole call.
    fn batch(
        &self,
        requests: Vec<Self::Request>,
        timeout: Duration,
    ) -> BoxFuture<Result<Vec<ItemResult<Self::Response>>, Status>>;
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
    pub(crate) async fn call(&self, request: &S::Request) -> ItemResult<S::Response> {
        let bytes = request.encoded_len();
        if bytes > self.settings.max_bytes / 4 || self.learned.unsupported() {
            return self.sender.unary(request.clone(), self.timeout).await;
        }
        let deadline = Instant::now() + self.timeout;
        let (reply, answer) = oneshot::channel();
        self.enqueue(Job {
            request: request.clone(),
            bytes,
            deadline,
            reply,
        });
        match answer.await {
            Ok(Reply::Answer(result)) => result,
            Ok(Reply::SendAlone) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let timeout = left.max(Duration::from_millis(1));
                self.sender.unary(request.clone(), timeout).await
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
                Ok(permit) => {
                    // One turn of the scheduler before sending: calls that
                    // are ready to run (typically the callers woken by the
                    // same reply) join this batch instead of each taking a
                    // permit alone. A lone caller loses microseconds.
                    tokio::task::yield_now().await;
                    permit
                }
                // All on the wire: what queues meanwhile goes together once
                // one is back.
                Err(_) => permits.clone().acquire_owned().await.expect("never closed"),
            };
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

/// Sends `batch` (alone as the unary RPC when it holds one call) and answers
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
        return send_one(&sender, job, timeout).await;
    }
    let (requests, replies): (Vec<S::Request>, Vec<_>) = batch
        .into_iter()
        .map(|job| (job.request, job.reply))
        .unzip();
    if learned.unsupported() {
        return send_alone(replies);
    }
    let count = requests.len();
    let result = sender.batch(requests, timeout).await;
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
        request, mut reply, ..
    } = job;
    tokio::select! {
        result = sender.unary(request, timeout) => {
            let _ = reply.send(Reply::Answer(result));
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
/// request: [`SendBatch`] is implemented for Acquire and Complete.
pub(crate) struct Grpc<R> {
    stub: Stub,
    kind: PhantomData<fn() -> R>,
}

impl<R> Grpc<R> {
    pub(crate) fn new(stub: Stub) -> Self {
        Self {
            stub,
            kind: PhantomData,
        }
    }
}

impl<R> Clone for Grpc<R> {
    fn clone(&self) -> Self {
        Self::new(self.stub.clone())
    }
}

/// `SendBatch` for a unary RPC and its batch form: the two differ only in
/// the names the proto gives them.
macro_rules! batch_rpc {
    ($request:ident => $response:ident, $unary:ident, $batch:ident($batch_request:ident), $result:ident) => {
        impl SendBatch for Grpc<pb::$request> {
            type Request = pb::$request;
            type Response = pb::$response;

            fn unary(
                &self,
                request: Self::Request,
                timeout: Duration,
            ) -> BoxFuture<ItemResult<Self::Response>> {
                let mut stub = self.stub.clone();
                Box::pin(async move {
                    stub.$unary(with_timeout(request, timeout))
                        .await
                        .map(tonic::Response::into_inner)
                })
            }

            fn batch(
                &self,
                requests: Vec<Self::Request>,
                timeout: Duration,
            ) -> BoxFuture<Result<Vec<ItemResult<Self::Response>>, Status>> {
                let mut stub = self.stub.clone();
                Box::pin(async move {
                    let response = stub
                        .$batch(with_timeout(pb::$batch_request { requests }, timeout))
                        .await?
                        .into_inner();
                    use pb::$result::Result as Item;
                    Ok(item_results(response.results.into_iter().map(|result| {
                        result.result.map(|item| match item {
                            Item::Response(response) => Ok(response),
                            Item::Error(status) => Err(status),
                        })
                    })))
                })
            }
        }
    };
}

batch_rpc!(AcquireRequest => AcquireResponse, acquire, batch_acquire(BatchAcquireRequest), batch_acquire_result);
batch_rpc!(CompleteRequest => CompleteResponse, complete, batch_complete(BatchCompleteRequest), batch_complete_result);

#[cfg(test)]
mod tests {
    //! The dispatcher on tokio's paused clock, with a fake network: a fake
    //! call takes exactly its delay, so the tests read what was sent when.

    use tokio::task::JoinHandle;
    use tonic_types::{ErrorDetails, StatusExt};

    use super::*;

    /// One RPC the fake received.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Sent {
        Unary(String),
        Batch(Vec<String>),
    }

    fn batch(requests: &[&str]) -> Sent {
        Sent::Batch(requests.iter().map(|&request| request.to_owned()).collect())
    }

    fn unary(request: &str) -> Sent {
        Sent::Unary(request.to_owned())
    }

    /// A network that answers each request after a delay (an hour for
    /// requests starting with `slow`), and records what it received. A
    /// request starting with `bad` fails as the unary call would; one
    /// starting with `big` does not fit in a batch's reply.
    #[derive(Clone)]
    struct Fake(Arc<FakeState>);

    struct FakeState {
        delay: Duration,
        /// Every batch fails with this code.
        batch_error: Option<Code>,
        /// Longer batches are refused as INVALID_ARGUMENT.
        longest_batch: usize,
        sent: Mutex<Vec<Sent>>,
        on_the_wire: AtomicUsize,
        most_on_the_wire: AtomicUsize,
    }

    impl Fake {
        fn new(delay: Duration) -> Self {
            Self::with(delay, None, usize::MAX)
        }

        fn with(delay: Duration, batch_error: Option<Code>, longest_batch: usize) -> Self {
            Self(Arc::new(FakeState {
                delay,
                batch_error,
                longest_batch,
                sent: Mutex::default(),
                on_the_wire: AtomicUsize::new(0),
                most_on_the_wire: AtomicUsize::new(0),
            }))
        }

        fn sent(&self) -> Vec<Sent> {
            self.0.sent.lock().unwrap().clone()
        }

        fn most_on_the_wire(&self) -> usize {
            self.0.most_on_the_wire.load(Ordering::SeqCst)
        }

        /// Records an RPC, counted on the wire until the guard drops.
        fn receive(&self, sent: Sent) -> OnTheWire {
            self.0.sent.lock().unwrap().push(sent);
            let now = self.0.on_the_wire.fetch_add(1, Ordering::SeqCst) + 1;
            self.0.most_on_the_wire.fetch_max(now, Ordering::SeqCst);
            OnTheWire(self.0.clone())
        }

        fn delay(&self, request: &str) -> Duration {
            if request.starts_with("slow") {
                Duration::from_secs(3600)
            } else {
                self.0.delay
            }
        }
    }

    struct OnTheWire(Arc<FakeState>);

    impl Drop for OnTheWire {
        fn drop(&mut self) {
            self.0.on_the_wire.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn answer_to(request: &str) -> ItemResult<String> {
        if request.starts_with("bad") {
            return Err(Status::invalid_argument(format!("{request} is refused")));
        }
        Ok(format!("answer to {request}"))
    }

    impl SendBatch for Fake {
        type Request = String;
        type Response = String;

        fn unary(&self, request: String, _: Duration) -> BoxFuture<ItemResult<String>> {
            let fake = self.clone();
            Box::pin(async move {
                let _on_the_wire = fake.receive(Sent::Unary(request.clone()));
                tokio::time::sleep(fake.delay(&request)).await;
                answer_to(&request)
            })
        }

        fn batch(
            &self,
            requests: Vec<String>,
            _: Duration,
        ) -> BoxFuture<Result<Vec<ItemResult<String>>, Status>> {
            let fake = self.clone();
            Box::pin(async move {
                let _on_the_wire = fake.receive(Sent::Batch(requests.clone()));
                let delay = requests.iter().map(|r| fake.delay(r)).max();
                tokio::time::sleep(delay.unwrap_or_default()).await;
                if let Some(code) = fake.0.batch_error {
                    return Err(Status::new(code, "the whole batch failed"));
                }
                if requests.len() > fake.0.longest_batch {
                    return Err(Status::invalid_argument("too many items"));
                }
                Ok(requests.iter().map(|r| batch_item(r)).collect())
            })
        }
    }

    fn batch_item(request: &str) -> ItemResult<String> {
        if request.starts_with("big") {
            let details = ErrorDetails::with_error_info("BATCH_REPLY_FULL", "idempotency", []);
            return Err(Status::with_error_details(
                Code::ResourceExhausted,
                "the reply is full",
                details,
            ));
        }
        answer_to(request).map(|answer| format!("{answer}, batched"))
    }

    const TIMEOUT: Duration = Duration::from_secs(10);
    const DELAY: Duration = Duration::from_millis(10);

    fn batcher(fake: &Fake, settings: Batching) -> Arc<Batcher<Fake>> {
        Arc::new(Batcher::new(fake.clone(), settings, TIMEOUT))
    }

    fn one_at_a_time() -> Batching {
        Batching {
            max_in_flight: 1,
            ..Batching::default()
        }
    }

    fn spawn_call(batcher: &Arc<Batcher<Fake>>, request: &str) -> JoinHandle<ItemResult<String>> {
        let (batcher, request) = (batcher.clone(), request.to_owned());
        tokio::spawn(async move { batcher.call(&request).await })
    }

    fn spawn_calls(
        batcher: &Arc<Batcher<Fake>>,
        requests: &[&str],
    ) -> Vec<JoinHandle<ItemResult<String>>> {
        requests
            .iter()
            .map(|request| spawn_call(batcher, request))
            .collect()
    }

    async fn answers(calls: Vec<JoinHandle<ItemResult<String>>>) -> Vec<ItemResult<String>> {
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.expect("caller task"));
        }
        answers
    }

    /// Lets every task that can run, run (the clock stands still meanwhile
    /// only if no timer is due within the millisecond).
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_call_goes_at_once_as_the_unary_rpc() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, Batching::default());
        let started = Instant::now();

        let answer = batcher.call(&"lone".to_owned()).await;

        assert_eq!(answer.unwrap(), "answer to lone");
        assert_eq!(started.elapsed(), DELAY, "no waiting window");
        assert_eq!(fake.sent(), [unary("lone")]);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_made_at_the_same_moment_leave_together_with_permits_free() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, Batching::default());

        let calls = spawn_calls(&batcher, &["a", "b", "c", "d"]);

        for (answer, request) in answers(calls).await.into_iter().zip(["a", "b", "c", "d"]) {
            assert_eq!(answer.unwrap(), format!("answer to {request}, batched"));
        }
        assert_eq!(fake.sent(), [batch(&["a", "b", "c", "d"])]);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_made_while_a_request_is_in_flight_go_together_in_the_next() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let next = spawn_calls(&batcher, &["b", "c", "d"]);
        settle().await;
        let last = spawn_calls(&batcher, &["e", "f"]);

        assert_eq!(first.await.unwrap().unwrap(), "answer to first");
        assert!(answers(next).await.into_iter().all(|answer| answer.is_ok()));
        assert!(answers(last).await.into_iter().all(|answer| answer.is_ok()));
        assert_eq!(
            fake.sent(),
            [unary("first"), batch(&["b", "c", "d", "e", "f"])]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_holds_at_most_max_items_calls() {
        let fake = Fake::new(DELAY);
        let settings = Batching {
            max_items: 3,
            ..Batching::default()
        };
        let batcher = batcher(&fake, settings);

        let calls = spawn_calls(&batcher, &["a", "b", "c", "d", "e", "f", "g"]);

        assert!(
            answers(calls)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        assert_eq!(
            fake.sent(),
            [batch(&["a", "b", "c"]), batch(&["d", "e", "f"]), unary("g")]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_holds_at_most_max_bytes_and_a_large_call_goes_alone() {
        let fake = Fake::new(DELAY);
        // Each small request encodes to 22 bytes: four fit in 100.
        let settings = Batching {
            max_bytes: 100,
            ..Batching::default()
        };
        let batcher = batcher(&fake, settings);
        let small: Vec<String> = (0..6).map(|n| format!("{n}").repeat(20)).collect();
        let large = "L".repeat(30);
        let small: Vec<&str> = small.iter().map(String::as_str).collect();

        let mut calls = spawn_calls(&batcher, &small[..3]);
        calls.push(spawn_call(&batcher, &large));
        calls.extend(spawn_calls(&batcher, &small[3..]));

        assert!(
            answers(calls)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        assert_eq!(
            fake.sent(),
            [unary(&large), batch(&small[..4]), batch(&small[4..])]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_max_in_flight_requests_are_on_the_wire() {
        let fake = Fake::new(DELAY);
        let settings = Batching {
            max_in_flight: 2,
            max_items: 2,
            ..Batching::default()
        };
        let batcher = batcher(&fake, settings);
        let requests: Vec<String> = (0..20).map(|n| format!("call-{n}")).collect();
        let requests: Vec<&str> = requests.iter().map(String::as_str).collect();
        let started = Instant::now();

        let calls = spawn_calls(&batcher, &requests);

        assert!(
            answers(calls)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        assert_eq!(fake.most_on_the_wire(), 2);
        assert_eq!(fake.sent().len(), 10, "{:?}", fake.sent());
        assert_eq!(started.elapsed(), 5 * DELAY, "ten batches, two at a time");
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_that_gives_up_while_queued_is_not_sent() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let gives_up = tokio::time::timeout(DELAY / 2, batcher.call(&"gives-up".to_owned())).await;
        let after = batcher.call(&"after".to_owned()).await;

        assert!(gives_up.is_err());
        assert_eq!(after.unwrap(), "answer to after");
        assert!(first.await.unwrap().is_ok());
        assert_eq!(fake.sent(), [unary("first"), unary("after")]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_call_whose_caller_leaves_is_cancelled_and_frees_its_permit() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, one_at_a_time());
        let stuck = spawn_call(&batcher, "slow");
        settle().await;
        let queued = spawn_calls(&batcher, &["a", "b"]);
        settle().await;
        let started = Instant::now();

        stuck.abort();

        assert!(
            answers(queued)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        assert_eq!(started.elapsed(), DELAY, "sent once the stuck call left");
        assert_eq!(fake.sent(), [unary("slow"), batch(&["a", "b"])]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_leaving_a_batch_does_not_take_down_the_others() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;
        let others = spawn_calls(&batcher, &["a", "b"]);
        let leaves = {
            let batcher = batcher.clone();
            tokio::spawn(async move {
                let request = "leaves".to_owned();
                tokio::time::timeout(DELAY + DELAY / 2, batcher.call(&request)).await
            })
        };
        let more = spawn_calls(&batcher, &["c"]);

        assert!(first.await.unwrap().is_ok());
        assert!(leaves.await.unwrap().is_err(), "left mid-batch");
        assert!(
            answers(others)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        assert!(answers(more).await.into_iter().all(|answer| answer.is_ok()));
        assert_eq!(
            fake.sent(),
            [unary("first"), batch(&["a", "b", "leaves", "c"])]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn each_caller_gets_its_own_answer_and_duplicates_keep_their_order() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let calls = spawn_calls(&batcher, &["key", "bad-key", "key", "other"]);

        assert!(first.await.unwrap().is_ok());
        let answers = answers(calls).await;
        assert_eq!(answers[0].as_deref().unwrap(), "answer to key, batched");
        let refused = answers[1].as_ref().unwrap_err();
        assert_eq!(
            (refused.code(), refused.message()),
            (Code::InvalidArgument, "bad-key is refused"),
            "the unary call's error"
        );
        assert_eq!(answers[2].as_deref().unwrap(), "answer to key, batched");
        assert_eq!(answers[3].as_deref().unwrap(), "answer to other, batched");
        assert_eq!(
            fake.sent(),
            [unary("first"), batch(&["key", "bad-key", "key", "other"])]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_of_the_whole_batch_reaches_every_caller() {
        let fake = Fake::with(DELAY, Some(Code::Unavailable), usize::MAX);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let calls = spawn_calls(&batcher, &["a", "b", "c"]);

        assert_eq!(first.await.unwrap().unwrap(), "answer to first");
        for answer in answers(calls).await {
            let status = answer.unwrap_err();
            assert_eq!(
                (status.code(), status.message()),
                (Code::Unavailable, "the whole batch failed")
            );
        }
        assert_eq!(fake.sent(), [unary("first"), batch(&["a", "b", "c"])]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_without_batch_rpcs_gets_every_call_alone_from_then_on() {
        let fake = Fake::with(DELAY, Some(Code::Unimplemented), usize::MAX);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let calls = spawn_calls(&batcher, &["a", "b"]);
        assert!(
            answers(calls)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        let later = spawn_calls(&batcher, &["c", "d"]);
        assert!(
            answers(later)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );

        assert!(first.await.unwrap().is_ok());
        assert_eq!(
            fake.sent(),
            [
                unary("first"),
                batch(&["a", "b"]),
                unary("a"),
                unary("b"),
                unary("c"),
                unary("d"),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_refused_as_too_long_is_resent_alone_and_the_next_are_shorter() {
        let fake = Fake::with(DELAY, None, 2);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let calls = spawn_calls(&batcher, &["a", "b", "c", "d"]);
        assert!(
            answers(calls)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );
        assert_eq!(batcher.learned.max_items.load(Ordering::Relaxed), 2);
        let again = spawn_call(&batcher, "first-again");
        settle().await;
        let later = spawn_calls(&batcher, &["e", "f", "g"]);
        assert!(
            answers(later)
                .await
                .into_iter()
                .all(|answer| answer.is_ok())
        );

        assert!(first.await.unwrap().is_ok());
        assert!(again.await.unwrap().is_ok());
        assert_eq!(
            fake.sent(),
            [
                unary("first"),
                batch(&["a", "b", "c", "d"]),
                unary("a"),
                unary("b"),
                unary("c"),
                unary("d"),
                unary("first-again"),
                batch(&["e", "f"]),
                unary("g"),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_item_the_full_reply_had_no_room_for_is_sent_again_alone() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, Batching::default());

        let calls = spawn_calls(&batcher, &["a", "big", "b"]);

        let answers: Vec<String> = answers(calls)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            answers,
            [
                "answer to a, batched",
                "answer to big",
                "answer to b, batched"
            ]
        );
        assert_eq!(fake.sent(), [batch(&["a", "big", "b"]), unary("big")]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_whose_deadline_passes_while_queued_is_told_so_and_not_sent() {
        let fake = Fake::new(TIMEOUT + DELAY);
        let batcher = batcher(&fake, one_at_a_time());
        let first = spawn_call(&batcher, "first");
        settle().await;

        let expired = batcher.call(&"expired".to_owned()).await;

        assert_eq!(expired.unwrap_err().code(), Code::DeadlineExceeded);
        assert!(first.await.unwrap().is_ok());
        assert_eq!(fake.sent(), [unary("first")]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_dispatcher_ends_when_the_batcher_is_dropped() {
        let fake = Fake::new(DELAY);
        let batcher = batcher(&fake, Batching::default());
        batcher.call(&"warm-up".to_owned()).await.unwrap();
        assert_eq!(
            Arc::strong_count(&fake.0),
            3,
            "the test's, the batcher's, the dispatcher's"
        );

        drop(batcher);
        settle().await;

        assert_eq!(Arc::strong_count(&fake.0), 1);
    }

    /// A client kept across runtimes (a shared client in tests, a runtime
    /// restarted): the calls a runtime carried end with it, and the next
    /// runtime's calls are sent by a dispatcher of their own.
    #[test]
    fn a_batcher_outliving_its_runtime_keeps_working() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap()
        };
        let fake = Fake::new(DELAY);
        // Made outside any runtime, as `Client::connect_lazy` may be.
        let batcher = batcher(&fake, one_at_a_time());

        let first = runtime();
        first.block_on(async {
            // One call on the wire for an hour, others queued behind it.
            drop(spawn_call(&batcher, "slow"));
            settle().await;
            drop(spawn_calls(&batcher, &["a", "b"]));
            settle().await;
        });
        drop(first);

        let second = runtime();
        let answers = second.block_on(async {
            let lone = batcher.call(&"lone".to_owned()).await;
            let calls = spawn_calls(&batcher, &["c", "d"]);
            (lone, answers(calls).await)
        });
        assert_eq!(answers.0.unwrap(), "answer to lone");
        assert!(answers.1.into_iter().all(|answer| answer.is_ok()));
        drop(second);
        drop(batcher);

        assert_eq!(
            fake.sent(),
            [unary("slow"), unary("lone"), batch(&["c", "d"])]
        );
        assert_eq!(Arc::strong_count(&fake.0), 1, "nothing left running");
    }
}
