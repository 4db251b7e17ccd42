//! Client-side batching: Acquires (and Completes) made concurrently through
//! one [`Client`](crate::Client) travel together in one `BatchAcquire`
//! (`BatchComplete`) call. Each call still gets its own answer or error.
//!
//! There is no timed window. A call that finds fewer than `max_in_flight`
//! requests of its kind on the wire leads the next one: a task it starts lets
//! the scheduler run once (so calls that are ready to run, typically those
//! woken by the same reply, join it) and sends what has queued, alone as the
//! unary RPC if nothing joined. A lightly loaded caller pays a task and one
//! scheduler turn, microseconds. The caller's own future only waits for its
//! answer, so a caller that stops polling holds up nobody else. Calls made while `max_in_flight` are on the wire queue up;
//! whichever request finishes first sends everything queued (up to
//! `max_items`) as one batch. Under load this turns many small
//! HTTP/2 messages into few large ones, and the server puts a batch's items
//! in shared database statements.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use prost::Message;
use tonic::{Code, Status, codegen::Bytes};

use crate::{client::with_timeout, pb, transport::Stub};

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

/// A unary RPC with a batch form.
pub(crate) trait BatchRpc: Message + Clone + Sized + 'static {
    type Response: Send + 'static;
    fn unary(stub: Stub, request: Self, timeout: Duration)
    -> BoxFuture<ItemResult<Self::Response>>;
    fn batch(
        stub: Stub,
        requests: Vec<Self>,
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

type ReplySender<R> = tokio::sync::oneshot::Sender<Reply<<R as BatchRpc>::Response>>;

struct Queued<R: BatchRpc> {
    request: R,
    bytes: usize,
    /// The caller's deadline, counted from when it queued: the batch carries
    /// the latest of its items', so the server gives up when all have.
    deadline: Instant,
    reply: ReplySender<R>,
}

struct State<R: BatchRpc> {
    queue: Vec<Queued<R>>,
    in_flight: usize,
    /// A call holds a slot and lets others queue before it sends them.
    gathering: bool,
}

/// The batcher of one kind of call.
pub(crate) struct Batcher<R: BatchRpc> {
    stub: Stub,
    settings: Batching,
    timeout: Duration,
    state: Mutex<State<R>>,
    /// Set when the server does not know the batch RPC (an older version):
    /// from then on every call goes alone.
    unsupported: AtomicBool,
    /// Most calls per batch: `settings.max_items`, halved each time the
    /// server refuses a batch as too long (its limit is lower).
    max_items: AtomicUsize,
}

impl<R: BatchRpc> std::fmt::Debug for Batcher<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<R: BatchRpc + Send> Batcher<R> {
    pub(crate) fn new(stub: Stub, settings: Batching, timeout: Duration) -> Arc<Self> {
        let settings = Batching {
            max_in_flight: settings.max_in_flight.max(1),
            max_items: settings.max_items.max(1),
            max_bytes: settings.max_bytes.max(1),
        };
        Arc::new(Self {
            max_items: AtomicUsize::new(settings.max_items),
            stub,
            settings,
            timeout,
            state: Mutex::new(State {
                queue: Vec::new(),
                in_flight: 0,
                gathering: false,
            }),
            unsupported: AtomicBool::new(false),
        })
    }

    /// Sends `request` alone or in a batch, and returns its own answer.
    pub(crate) async fn call(self: &Arc<Self>, request: &R) -> ItemResult<R::Response> {
        let bytes = request.encoded_len();
        if bytes > self.settings.max_bytes / 4 || self.unsupported.load(Ordering::Relaxed) {
            return self.alone(request, self.timeout).await;
        }
        let deadline = Instant::now() + self.timeout;
        let (reply, answer) = tokio::sync::oneshot::channel();
        let leads = {
            let mut state = self.state.lock().expect("batcher lock");
            state.queue.push(Queued {
                request: request.clone(),
                bytes,
                deadline,
                reply,
            });
            // A free slot, and no other call gathering a batch for it: this
            // call leads the next batch.
            let leads = state.in_flight < self.settings.max_in_flight && !state.gathering;
            if leads {
                state.in_flight += 1;
                state.gathering = true;
            }
            leads
        };
        if leads {
            // A task of its own gathers and sends the batch, never this
            // caller's future: other calls queue behind the batch, and must
            // not wait for a caller that stopped polling (a future parked in
            // a `select!` loop or an undriven `FuturesUnordered`) or went away.
            let slot = Slot(self.clone());
            tokio::spawn(async move {
                // One turn of the scheduler before sending: calls that are
                // ready to run (typically the callers woken by the same reply)
                // join this batch instead of each taking a slot alone. A lone
                // caller loses microseconds. What queues after this waits for
                // a slot; this one, once free, sends it.
                tokio::task::yield_now().await;
                slot.0.clone().drain_with(slot).await;
            });
        }
        match answer.await {
            Ok(Reply::Answer(result)) => result,
            Ok(Reply::SendAlone) => {
                let left = deadline.saturating_duration_since(Instant::now());
                self.alone(request, left.max(Duration::from_millis(1)))
                    .await
            }
            Err(_) => Err(Status::unavailable(
                "the batch carrying this call was dropped",
            )),
        }
    }

    async fn alone(&self, request: &R, timeout: Duration) -> ItemResult<R::Response> {
        R::unary(self.stub.clone(), request.clone(), timeout).await
    }

    /// Sends what is queued, batch after batch, until the queue is empty;
    /// then gives its slot back.
    async fn drain(mut handoff: Handoff<R>) {
        let Some(batcher) = handoff.0.take() else {
            return;
        };
        batcher.drain_with(Slot(batcher.clone())).await;
    }

    async fn drain_with(&self, _slot: Slot<R>) {
        loop {
            let batch = self.take_batch();
            if batch.is_empty() {
                return;
            }
            self.send(batch).await;
        }
    }

    fn take_batch(&self) -> Vec<Queued<R>> {
        let mut state = self.state.lock().expect("batcher lock");
        state.gathering = false;
        // Calls whose caller went away, or whose deadline passed while they
        // waited, are not sent; the latter are told so.
        let now = Instant::now();
        state.queue.retain(|queued| !queued.reply.is_closed());
        for expired in state.queue.extract_if(.., |queued| queued.deadline <= now) {
            let _ = expired
                .reply
                .send(Reply::Answer(Err(Status::deadline_exceeded(
                    "the call's deadline passed while it waited for a batch",
                ))));
        }
        let max_items = self.max_items.load(Ordering::Relaxed);
        let mut bytes = 0;
        let mut count = 0;
        for queued in &state.queue {
            if count == max_items || (count > 0 && bytes + queued.bytes > self.settings.max_bytes) {
                break;
            }
            bytes += queued.bytes;
            count += 1;
        }
        state.queue.drain(..count).collect()
    }

    async fn send(&self, mut batch: Vec<Queued<R>>) {
        // What is left of the latest deadline in the batch: the server works
        // for as long as any of its callers waits (each caller stops waiting
        // at its own deadline), so one nearly expired call does not fail the
        // calls that queued after it.
        let timeout = batch
            .iter()
            .map(|queued| queued.deadline)
            .max()
            .map_or(self.timeout, |deadline| {
                deadline.saturating_duration_since(Instant::now())
            })
            .max(Duration::from_millis(1));
        if batch.len() == 1
            && !self.unsupported.load(Ordering::Relaxed)
            && let Some(Queued {
                request, mut reply, ..
            }) = batch.pop()
        {
            // Alone: if its caller goes away, the call is cancelled, and the
            // slot goes on to the calls queued behind it.
            tokio::select! {
                result = R::unary(self.stub.clone(), request, timeout) => {
                    let _ = reply.send(Reply::Answer(result));
                }
                () = reply.closed() => {}
            }
            return;
        }
        let (requests, replies): (Vec<R>, Vec<_>) = batch
            .into_iter()
            .map(|queued| (queued.request, queued.reply))
            .unzip();
        if self.unsupported.load(Ordering::Relaxed) {
            return send_alone(replies);
        }
        let count = requests.len();
        match R::batch(self.stub.clone(), requests, timeout).await {
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
                self.unsupported.store(true, Ordering::Relaxed);
                send_alone(replies);
            }
            // The batch is longer than the server takes (more calls, or more
            // bytes than its message limit, OUT_OF_RANGE, with `max_bytes`
            // set above it): smaller ones from now on. Not the calls' own
            // refusal, so each is sent again alone and answered for itself.
            Err(status) if matches!(status.code(), Code::InvalidArgument | Code::OutOfRange) => {
                let halved = (count / 2).max(1);
                self.max_items.fetch_min(halved, Ordering::Relaxed);
                tracing::info!(
                    max_items = halved,
                    "the idempotency service refused a batch of {count}; sending fewer calls per batch"
                );
                send_alone(replies);
            }
            Err(status) => answer_all(replies, &status),
        }
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

fn answer_all<T>(replies: Vec<tokio::sync::oneshot::Sender<Reply<T>>>, status: &Status) {
    for reply in replies {
        let _ = reply.send(Reply::Answer(Err(status.clone())));
    }
}

/// Hands each call back to its caller, to send alone.
fn send_alone<T>(replies: Vec<tokio::sync::oneshot::Sender<Reply<T>>>) {
    for reply in replies {
        let _ = reply.send(Reply::SendAlone);
    }
}

/// A slot passed to a drain task that has not started. Dropped unpolled (a
/// runtime shutting down drops new tasks), it gives the slot back without
/// trying to hand it over again.
struct Handoff<R: BatchRpc + Send>(Option<Arc<Batcher<R>>>);

impl<R: BatchRpc + Send> Drop for Handoff<R> {
    fn drop(&mut self) {
        if let Some(batcher) = self.0.take() {
            release_slot(&mut batcher.state.lock().expect("batcher lock"));
        }
    }
}

fn release_slot<R: BatchRpc>(state: &mut State<R>) {
    state.in_flight -= 1;
    // Nobody left to send the queued calls: their senders drop with the
    // queue and their callers see an error (and retry).
    if state.in_flight == 0 {
        state.queue.clear();
        state.gathering = false;
    }
}

/// A request slot on the wire. Given back on drop, even when the caller's
/// future is cancelled; calls queued meanwhile are handed to a drain task
/// that inherits the slot, so none waits for a slot nobody will free.
struct Slot<R: BatchRpc + Send>(Arc<Batcher<R>>);

impl<R: BatchRpc + Send> Drop for Slot<R> {
    fn drop(&mut self) {
        let batcher = &self.0;
        let mut state = batcher.state.lock().expect("batcher lock");
        if !state.queue.is_empty()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            drop(state);
            runtime.spawn(Batcher::drain(Handoff(Some(batcher.clone()))));
            return;
        }
        // Nothing queued, or no runtime to drain with (shutting down).
        release_slot(&mut state);
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

/// `BatchRpc` for a unary RPC and its batch form: the two differ only in
/// the names the proto gives them.
macro_rules! batch_rpc {
    ($request:ident => $response:ident, $unary:ident, $batch:ident($batch_request:ident), $result:ident) => {
        impl BatchRpc for pb::$request {
            type Response = pb::$response;

            fn unary(
                mut stub: Stub,
                request: Self,
                timeout: Duration,
            ) -> BoxFuture<ItemResult<Self::Response>> {
                Box::pin(async move {
                    stub.$unary(with_timeout(request, timeout))
                        .await
                        .map(tonic::Response::into_inner)
                })
            }

            fn batch(
                mut stub: Stub,
                requests: Vec<Self>,
                timeout: Duration,
            ) -> BoxFuture<Result<Vec<ItemResult<Self::Response>>, Status>> {
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
