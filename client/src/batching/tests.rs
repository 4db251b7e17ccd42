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

    fn unary(
        &self,
        request: String,
        _: Duration,
        _: TraceContext,
    ) -> BoxFuture<ItemResult<String>> {
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
        _: TraceContext,
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
    tokio::spawn(async move { batcher.call(&request, TraceContext::random()).await })
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

    let answer = batcher
        .call(&"lone".to_owned(), TraceContext::random())
        .await;

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

    let gives_up = tokio::time::timeout(
        DELAY / 2,
        batcher.call(&"gives-up".to_owned(), TraceContext::random()),
    )
    .await;
    let after = batcher
        .call(&"after".to_owned(), TraceContext::random())
        .await;

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
            tokio::time::timeout(
                DELAY + DELAY / 2,
                batcher.call(&request, TraceContext::random()),
            )
            .await
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

    let expired = batcher
        .call(&"expired".to_owned(), TraceContext::random())
        .await;

    assert_eq!(expired.unwrap_err().code(), Code::DeadlineExceeded);
    assert!(first.await.unwrap().is_ok());
    assert_eq!(fake.sent(), [unary("first")]);
}

#[tokio::test(start_paused = true)]
async fn the_dispatcher_ends_when_the_batcher_is_dropped() {
    let fake = Fake::new(DELAY);
    let batcher = batcher(&fake, Batching::default());
    batcher
        .call(&"warm-up".to_owned(), TraceContext::random())
        .await
        .unwrap();
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
        let lone = batcher
            .call(&"lone".to_owned(), TraceContext::random())
            .await;
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
