//! Client-side batching: concurrent calls of one client share batch RPCs,
//! each still gets its own answer or typed error, a cancelled call never
//! strands the calls queued behind it, and an older server without batch
//! RPCs is served call by call.

use std::{sync::Arc, time::Duration};

use idempotency_client::{
    AcquireRequest, Acquisition, Batching, Client, Error, RecordId, RetryPolicy, StoredResponse,
};
use idempotency_server::{
    domain::Limits,
    engine::Engine,
    grpc::{GrpcService, metrics::CallSeries, pb, service::IdempotencyServiceServer},
    metrics::NamespaceLabels,
    store::Store,
    telemetry::MetricsRecorder,
};
use idempotency_tests::{
    TestDb, TestServer, http_get, lock_record, metric_value, spawn_app, spawn_app_with, unique_key,
    wait_for_lock_wait,
};
use tokio::sync::Barrier;
use tonic::{Request, Response, Status};

use crate::support::{proceed, request};

const CALLERS: usize = 48;

/// One request of each kind on the wire at a time, so that concurrent calls
/// must queue and share batches.
/// No retries either, so that a call the batching lost shows as an error.
fn batching_client(addr: std::net::SocketAddr) -> Client {
    Client::builder()
        .endpoint(format!("http://{addr}"))
        .batching(Some(Batching {
            max_in_flight: 1,
            ..Batching::default()
        }))
        .retry(RetryPolicy::none())
        .connect_lazy()
        .unwrap()
}

/// Items the server received in batch calls of `rpc`, and how many such calls.
async fn batched(server: &TestServer, rpc: &str) -> (f64, f64) {
    let page = http_get(server.metrics_addr, "/metrics").await;
    let series = |suffix: &str| {
        metric_value(
            &page,
            &format!("idempotency_batch_items_{suffix}{{rpc=\"{rpc}\"}}"),
        )
        .unwrap_or(0.0)
    };
    (series("sum"), series("count"))
}

/// Runs `CALLERS` calls of `call` at the same moment and returns their results.
async fn all_at_once<T, F, Fut>(call: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(CALLERS));
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let barrier = barrier.clone();
            let call = call(caller);
            tokio::spawn(async move {
                barrier.wait().await;
                call.await
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("caller task"));
    }
    results
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_of_one_client_share_batches_and_one_holds_each_key() {
    let app = spawn_app().await;
    let client = batching_client(app.server.addr);
    let same = request("batched-same");
    let response = StoredResponse::new(201, "paid");

    // Everybody on one key: one holder, the rest told it is in progress.
    let outcomes = all_at_once(|_| {
        let (client, same) = (client.clone(), same.clone());
        async move { client.acquire(&same).await.expect("acquire") }
    })
    .await;
    let mut leases: Vec<_> = outcomes
        .into_iter()
        .filter_map(|outcome| match outcome {
            Acquisition::Proceed(lease) => Some(lease),
            Acquisition::InProgress { .. } => None,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(leases.len(), 1);
    leases[0].complete(&response).await.unwrap();

    // Everybody on a key of their own, then completing it: every one holds its
    // key, and every completion is stored.
    let requests: Vec<AcquireRequest> = (0..CALLERS).map(|_| request("batched-own")).collect();
    let completed = all_at_once(|caller| {
        let (client, request) = (client.clone(), requests[caller].clone());
        let response = StoredResponse::new(201, format!("caller {caller}"));
        async move {
            let mut lease = proceed(&client, &request).await;
            lease.complete(&response).await
        }
    })
    .await;
    assert!(completed.iter().all(Result::is_ok), "{completed:?}");
    for (caller, request) in requests.iter().enumerate() {
        match client.acquire(request).await.unwrap() {
            Acquisition::Replay(stored) => {
                assert_eq!(stored.body, format!("caller {caller}").into_bytes());
            }
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    // And they did travel in batches: fewer calls than items.
    for rpc in ["BatchAcquire", "BatchComplete"] {
        let (items, calls) = batched(&app.server, rpc).await;
        assert!(
            calls >= 1.0 && items > calls,
            "{rpc}: {items} items in {calls} calls"
        );
    }
}

#[tokio::test]
async fn calls_made_at_the_same_moment_leave_in_one_request_even_with_slots_free() {
    let app = spawn_app().await;
    // The default: four requests of a kind may be on the wire, so each of
    // the first four calls finds a slot free.
    let client = Client::builder()
        .endpoint(format!("http://{}", app.server.addr))
        .retry(RetryPolicy::none())
        .connect_lazy()
        .unwrap();
    const CALLS: usize = 24;
    let requests: Vec<AcquireRequest> = (0..CALLS).map(|_| request("same-moment")).collect();

    // Made in one poll of one task: the first leads, the others join it.
    let outcomes = futures_util::future::join_all(requests.iter().map(|r| client.acquire(r))).await;
    assert!(
        outcomes
            .iter()
            .all(|outcome| matches!(outcome, Ok(Acquisition::Proceed(_)))),
        "{outcomes:?}"
    );
    assert_eq!(
        batched(&app.server, "BatchAcquire").await,
        (CALLS as f64, 1.0),
        "all {CALLS} calls in one BatchAcquire, none alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_call_in_a_batch_fails_alone_with_its_typed_error() {
    let app = spawn_app().await;
    let client = batching_client(app.server.addr);

    let results = all_at_once(|caller| {
        let client = client.clone();
        let key = if caller % 2 == 0 {
            unique_key("batched-good")
        } else {
            "bad".to_owned()
        };
        let request = AcquireRequest::new(
            RecordId::new("payments", "POST /payments", key),
            b"f".to_vec(),
        );
        async move { client.acquire(&request).await }
    })
    .await;
    for (caller, result) in results.into_iter().enumerate() {
        match (caller % 2, result) {
            (0, Ok(Acquisition::Proceed(_))) => {}
            (1, Err(Error::InvalidArgument { field, .. })) => {
                assert_eq!(field.as_deref(), Some("id.key"));
            }
            (_, other) => panic!("caller {caller}: unexpected {other:?}"),
        }
    }
    let (items, calls) = batched(&app.server, "BatchAcquire").await;
    assert!(items > calls, "{items} items in {calls} calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_call_hands_its_place_to_the_calls_queued_behind_it() {
    let app = spawn_app().await;
    let client = batching_client(app.server.addr);
    let response = StoredResponse::new(201, "done");

    // The first Complete goes alone and hangs on a row lock.
    let stuck = request("batched-stuck");
    let mut stuck_lease = proceed(&client, &stuck).await;
    let _lock = lock_record(&app.db, &stuck.id.key).await;
    let leader = {
        let response = response.clone();
        tokio::spawn(async move { stuck_lease.complete(&response).await })
    };
    wait_for_lock_wait(&app.db).await;

    // Completes made meanwhile queue behind it.
    let mut followers = Vec::new();
    for n in 0..8 {
        let request = request(&format!("batched-follower-{n}"));
        let mut lease = proceed(&client, &request).await;
        let response = response.clone();
        followers.push(tokio::spawn(async move { lease.complete(&response).await }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(followers.iter().all(|follower| !follower.is_finished()));

    // The first caller gives up: the queued calls go on without it, at once
    // (well before the server's 5 s statement timeout would end the stuck one).
    leader.abort();
    for follower in followers {
        tokio::time::timeout(Duration::from_secs(3), follower)
            .await
            .expect("queued calls were sent after the first was cancelled")
            .unwrap()
            .expect("completed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_giving_up_does_not_take_down_the_calls_that_joined_its_batch() {
    let app = spawn_app().await;
    let client = batching_client(app.server.addr);
    let response = StoredResponse::new(201, "done");

    let mut leases = Vec::new();
    for n in 0..9 {
        let request = request(&format!("joined-{n}"));
        let lease = proceed(&client, &request).await;
        leases.push((request, lease));
    }
    // The first caller's record is locked, so the batch carrying all nine
    // Completes waits for the lock.
    let lock = lock_record(&app.db, &leases[0].0.id.key).await;
    let mut leases = leases.into_iter().map(|(_, lease)| lease);
    let mut first = leases.next().unwrap();
    let (gave_up, first_gave_up) = tokio::sync::oneshot::channel();
    let calls = {
        let response = response.clone();
        tokio::spawn(async move {
            // Made in one poll, so the other eight join the first's batch.
            let first = async {
                let outcome =
                    tokio::time::timeout(Duration::from_millis(200), first.complete(&response))
                        .await;
                let _ = gave_up.send(());
                outcome
            };
            let others = futures_util::future::join_all(leases.map(|mut lease| {
                let response = response.clone();
                async move { lease.complete(&response).await }
            }));
            tokio::join!(first, others).1
        })
    };
    wait_for_lock_wait(&app.db).await;
    first_gave_up.await.unwrap();
    drop(lock);

    let others = tokio::time::timeout(Duration::from_secs(5), calls)
        .await
        .expect("the calls that joined went on")
        .unwrap();
    assert_eq!(others.len(), 8);
    assert!(others.iter().all(Result::is_ok), "{others:?}");
}

/// The real service without the batch RPCs, as a server older than them.
struct WithoutBatches(GrpcService);

#[tonic::async_trait]
impl pb::idempotency_service_server::IdempotencyService for WithoutBatches {
    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        self.0.acquire(request).await
    }
    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        self.0.complete(request).await
    }
    async fn fail(
        &self,
        request: Request<pb::FailRequest>,
    ) -> Result<Response<pb::FailResponse>, Status> {
        self.0.fail(request).await
    }
    async fn renew(
        &self,
        request: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        self.0.renew(request).await
    }
    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        self.0.get(request).await
    }
    async fn batch_acquire(
        &self,
        _: Request<pb::BatchAcquireRequest>,
    ) -> Result<Response<pb::BatchAcquireResponse>, Status> {
        Err(Status::unimplemented("no batch RPCs in this version"))
    }
    async fn batch_complete(
        &self,
        _: Request<pb::BatchCompleteRequest>,
    ) -> Result<Response<pb::BatchCompleteResponse>, Status> {
        Err(Status::unimplemented("no batch RPCs in this version"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_without_batch_rpcs_is_served_call_by_call() {
    let db = TestDb::new().await;
    let engine = Engine::new(
        Store::new(idempotency_tests::server_pool(db.connect_options())),
        Limits::default(),
    );
    let service = WithoutBatches(GrpcService::new(
        engine,
        CallSeries::new(NamespaceLabels::new(10), &MetricsRecorder::install()),
        idempotency_server::grpc::auth::Authorizer::default(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdempotencyServiceServer::new(service))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = batching_client(addr);

    let requests: Vec<AcquireRequest> = (0..CALLERS).map(|_| request("old-server")).collect();
    let completed = all_at_once(|caller| {
        let (client, request) = (client.clone(), requests[caller].clone());
        async move {
            let Acquisition::Proceed(mut lease) = client.acquire(&request).await? else {
                panic!("a fresh key is acquired");
            };
            lease.complete(&StoredResponse::new(201, "ok")).await
        }
    })
    .await;
    assert!(completed.iter().all(Result::is_ok), "{completed:?}");
    assert_eq!(db.row_count().await, CALLERS as i64);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_taking_shorter_batches_gets_shorter_batches() {
    let app = spawn_app_with(|settings| settings.max_batch_items = 4).await;
    let client = batching_client(app.server.addr);

    // Batches the server refused as too long.
    let refused = || async {
        let page = http_get(app.server.metrics_addr, "/metrics").await;
        metric_value(
            &page,
            "idempotency_request_duration_seconds_count{rpc=\"BatchAcquire\",outcome=\"invalid_argument\"}",
        )
        .unwrap_or(0.0)
    };
    // Every call succeeds, before and after the client learns the limit.
    let mut refused_after_round = Vec::new();
    for round in 0..2 {
        let requests: Vec<AcquireRequest> = (0..CALLERS)
            .map(|_| request(&format!("short-batches-{round}")))
            .collect();
        let outcomes = all_at_once(|caller| {
            let (client, request) = (client.clone(), requests[caller].clone());
            async move { client.acquire(&request).await }
        })
        .await;
        for outcome in outcomes {
            assert!(
                matches!(outcome, Ok(Acquisition::Proceed(_))),
                "{outcome:?}"
            );
        }
        refused_after_round.push(refused().await);
    }
    // The client learned: each refusal at least halves the batch length,
    // from 64 to at most 4 in at most four refusals, whichever round met them.
    let refusals = refused_after_round[1];
    assert!(
        refused_after_round[0] >= 1.0 && refusals <= 4.0,
        "refusals after each round: {refused_after_round:?}"
    );
    // And batching went on within the limit.
    let (items, calls) = batched(&app.server, "BatchAcquire").await;
    assert!(
        calls >= 1.0 && items > calls,
        "{items} items in {calls} calls"
    );
}

/// A client kept across runtimes (a shared client in tests, a runtime
/// restarted): calls cut short by a runtime's shutdown give their place
/// back, so the client keeps working in the next runtime.
#[test]
fn a_client_outliving_a_runtime_keeps_working() {
    let main = tokio::runtime::Runtime::new().unwrap();
    let (db, server, client, stuck, followers) = main.block_on(async {
        let db = TestDb::new().await;
        let server = TestServer::start(&db).await;
        let client = batching_client(server.addr);
        let stuck = request("runtime-stuck");
        let stuck_lease = proceed(&client, &stuck).await;
        let mut followers = Vec::new();
        for n in 0..4 {
            let Acquisition::Proceed(lease) = client
                .acquire(&request(&format!("runtime-{n}")))
                .await
                .unwrap()
            else {
                panic!("acquired");
            };
            followers.push(lease);
        }
        (db, server, client, (stuck, stuck_lease), followers)
    });
    let (stuck, mut stuck_lease) = stuck;
    let lock = main.block_on(lock_record(&db, &stuck.id.key));

    // In a runtime of its own: one Complete goes alone and hangs on the
    // lock, the others queue behind it; then that runtime shuts down.
    let other = tokio::runtime::Runtime::new().unwrap();
    other.block_on(async {
        let response = StoredResponse::new(201, "done");
        tokio::spawn(async move { stuck_lease.complete(&StoredResponse::new(201, "x")).await });
        wait_for_lock_wait(&db).await;
        for mut lease in followers {
            let response = response.clone();
            tokio::spawn(async move { lease.complete(&response).await });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    });
    drop(other);

    main.block_on(async {
        drop(lock);
        let response = StoredResponse::new(201, "after");
        let request = request("runtime-after");
        let Acquisition::Proceed(mut lease) =
            tokio::time::timeout(Duration::from_secs(5), client.acquire(&request))
                .await
                .expect("the client is not stuck")
                .unwrap()
        else {
            panic!("acquired");
        };
        tokio::time::timeout(Duration::from_secs(5), lease.complete(&response))
            .await
            .expect("the client is not stuck")
            .unwrap();
        drop(server);
    });
}

#[tokio::test]
async fn a_caller_that_stops_polling_does_not_hold_up_the_calls_behind_it() {
    let app = spawn_app().await;
    let client = batching_client(app.server.addr);
    proceed(&client, &request("parked-warm-up")).await;

    // Polled once, so it leads the next batch, then left alone: as a future
    // in a `select!` loop, or in a `FuturesUnordered` nobody drives.
    let parked_request = request("parked");
    let mut parked = Box::pin(client.acquire(&parked_request));
    let pending =
        std::future::poll_fn(|cx| std::task::Poll::Ready(parked.as_mut().poll(cx).is_pending()))
            .await;
    assert!(pending);

    let other = tokio::time::timeout(Duration::from_secs(5), client.acquire(&request("other")))
        .await
        .expect("a call behind a parked one went ahead");
    assert!(matches!(other, Ok(Acquisition::Proceed(_))), "{other:?}");
    // The parked call was sent all the same; its answer waited for it.
    let parked = tokio::time::timeout(Duration::from_secs(5), parked)
        .await
        .unwrap();
    assert!(matches!(parked, Ok(Acquisition::Proceed(_))), "{parked:?}");
}

#[tokio::test]
async fn a_batch_over_the_servers_message_limit_is_resent_call_by_call() {
    let app = spawn_app().await;
    // `max_bytes` far above the server's 4 MiB message limit: eight
    // responses of 900 kB (each within the 1 MiB response limit) leave
    // together, 7 MB in one BatchComplete, which the server's transport
    // refuses as a whole (OUT_OF_RANGE).
    let client = Client::builder()
        .endpoint(format!("http://{}", app.server.addr))
        .batching(Some(Batching {
            max_bytes: 64 * 1024 * 1024,
            ..Batching::default()
        }))
        .retry(RetryPolicy::none())
        .connect_lazy()
        .unwrap();
    let requests: Vec<AcquireRequest> = (0..8).map(|_| request("over-limit")).collect();
    let mut leases = Vec::new();
    for request in &requests {
        leases.push(proceed(&client, request).await);
    }
    let response = StoredResponse::new(200, vec![b'x'; 900 * 1024]);

    // Made in one poll of one task, so that they share one batch.
    let results =
        futures_util::future::join_all(leases.iter_mut().map(|lease| lease.complete(&response)))
            .await;

    // Each call is its own: none was refused for the batch it rode in.
    for result in results {
        assert!(result.is_ok(), "{result:?}");
    }
    for request in &requests {
        let record = client.get(&request.id).await.unwrap().unwrap();
        assert_eq!(record.response.map(|r| r.body.len()), Some(900 * 1024));
    }
}

#[tokio::test]
async fn replays_too_large_to_share_a_reply_are_each_answered() {
    let app = spawn_app().await;
    let client = batching_client(app.server.addr);
    let large = StoredResponse::new(200, vec![b'x'; 1_000_000]);
    let request = request("large-replays");
    proceed(&client, &request)
        .await
        .complete(&large)
        .await
        .unwrap();

    // Eight at once: one batch, whose reply holds about four of them (the
    // server keeps a reply within its 4 MiB message limit); the others come
    // back to be sent alone.
    let outcomes = futures_util::future::join_all((0..8).map(|_| client.acquire(&request))).await;

    for outcome in outcomes {
        match outcome {
            Ok(Acquisition::Replay(response)) => assert_eq!(response, large),
            other => panic!("{other:?}"),
        }
    }
}
