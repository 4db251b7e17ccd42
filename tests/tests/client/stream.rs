//! The client's batches on a `BatchStream`: lone and concurrent calls go as
//! messages of one stream, a stream the server ends cleanly is replaced
//! without failing a call, and one that breaks fails its calls as a unary
//! call that failed in flight.

use std::time::Duration;

use idempotency_client::{Acquisition, Batching, Client, Error, RetryPolicy, StoredResponse};
use idempotency_tests::{TestServer, http_get, lock_record, metric_value, spawn_app_with};

use crate::support::{proceed, request};

fn client(server: &TestServer, batching: Batching) -> Client {
    Client::builder()
        .endpoint(format!("http://{}", server.addr))
        .batching(Some(batching))
        .retry(RetryPolicy::none())
        .connect_lazy()
        .unwrap()
}

async fn metric(server: &TestServer, series: &str) -> f64 {
    let page = http_get(server.metrics_addr, "/metrics").await;
    metric_value(&page, series).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lone_and_concurrent_calls_go_as_messages_of_one_stream() {
    let app = spawn_app_with(|_| {}).await;
    let client = client(&app.server, Batching::default());
    // A lone call: a batch of one on the stream, not the unary RPC.
    let mut lease = proceed(&client, &request("stream-lone")).await;
    lease
        .complete(&StoredResponse::new(201, "ok"))
        .await
        .unwrap();
    assert_eq!(
        metric(
            &app.server,
            "idempotency_batch_items_count{rpc=\"BatchAcquire\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&app.server, "idempotency_grpc_streams_open").await,
        1.0
    );

    let calls: Vec<_> = (0..32)
        .map(|n| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut lease = proceed(&client, &request("stream-many")).await;
                lease
                    .complete(&StoredResponse::new(201, format!("{n}")))
                    .await
            })
        })
        .collect();
    for call in calls {
        call.await.unwrap().expect("completed");
    }
    assert_eq!(
        metric(
            &app.server,
            "idempotency_requests_total{rpc=\"Complete\",outcome=\"ok\",namespace=\"payments\"}"
        )
        .await,
        33.0
    );
    // Still the one stream: the concurrent calls opened no other.
    assert_eq!(
        metric(&app.server, "idempotency_grpc_streams_open").await,
        1.0
    );
    assert_eq!(
        metric(
            &app.server,
            "idempotency_grpc_streams_ended_total{reason=\"cancelled\"}"
        )
        .await,
        0.0
    );
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_the_server_ends_cleanly_are_replaced_without_failing_a_call() {
    let app = spawn_app_with(|settings| {
        // Under the server's floor of a second: streams end at about 1 s.
        settings.streams.stream_max_age = Duration::from_millis(300);
        settings.streams.stream_idle_timeout = Duration::from_millis(200);
    })
    .await;
    // No retries: a call the stream's end lost would show as an error.
    let client = client(&app.server, Batching::default());
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let until = tokio::time::Instant::now() + Duration::from_millis(2600);
                let mut calls = 0;
                while tokio::time::Instant::now() < until {
                    let mut lease = proceed(&client, &request("stream-aged")).await;
                    lease
                        .complete(&StoredResponse::new(201, "ok"))
                        .await
                        .unwrap();
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    let mut calls = 0;
    for worker in workers {
        calls += worker.await.unwrap();
    }
    assert!(calls > 8, "{calls}");
    assert!(
        metric(
            &app.server,
            "idempotency_grpc_streams_ended_total{reason=\"max_age\"}"
        )
        .await
            >= 2.0
    );
    // Idle, the stream ends; the next call opens another.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        metric(&app.server, "idempotency_grpc_streams_open").await,
        0.0
    );
    proceed(&client, &request("stream-after-idle")).await;
    assert_eq!(
        metric(&app.server, "idempotency_grpc_streams_open").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_on_a_stream_that_breaks_fails_as_unavailable_not_hanging() {
    let mut app = spawn_app_with(|settings| settings.drain_timeout = Duration::from_secs(2)).await;
    let client = client(&app.server, Batching::default());
    let held = request("stream-broken");
    let mut lease = proceed(&client, &held).await;
    let lock = lock_record(&app.db, &held.id.key).await;
    let completing =
        tokio::spawn(async move { lease.complete(&StoredResponse::new(201, "late")).await });
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    // The server drains; the Complete cannot finish within the stream's grace.
    app.server.signal_shutdown();
    let result = tokio::time::timeout(Duration::from_secs(10), completing)
        .await
        .expect("the call ended")
        .unwrap();
    assert!(
        matches!(result, Err(Error::Unavailable { .. })),
        "{result:?}"
    );
    drop(lock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_streams_off_batches_go_as_rpcs() {
    let app = spawn_app_with(|_| {}).await;
    let client = client(
        &app.server,
        Batching {
            stream: false,
            ..Batching::default()
        },
    );
    let outcomes = futures_util::future::join_all(
        (0..8)
            .map(|_| request("stream-off"))
            .collect::<Vec<_>>()
            .iter()
            .map(|r| client.acquire(r)),
    )
    .await;
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Ok(Acquisition::Proceed(_))))
    );
    assert_eq!(
        metric(&app.server, "idempotency_grpc_streams_open").await,
        0.0
    );
    assert!(
        metric(
            &app.server,
            "idempotency_batch_items_count{rpc=\"BatchAcquire\"}"
        )
        .await
            >= 1.0
    );
}
