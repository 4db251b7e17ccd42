//! Bounded under hostile input and a stalled database: messages refused by
//! their size and counts before they are decoded, calls shed at the memory
//! budget, and every call answered by its deadline.

use std::time::{Duration, Instant};

use idempotency_client::pb;
use idempotency_server::settings::Settings;
use idempotency_tests::{
    TestDb, TestServer, http_get, metric_value,
    raw::{self, Memory},
    record_id, response, server_behind_proxy_with, spawn_app, spawn_app_with, test_settings,
    unique_key,
};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest,
};

use crate::support::*;

/// RSS growth allowed for the hostile calls below, the test's own client
/// (which copies each message it sends) included. Decoded, the batches
/// alone would take ~330 MiB each.
const MAX_GROWTH_MIB: f64 = 96.0;

fn reason_of(status: &tonic::Status) -> String {
    tonic_types::StatusExt::get_details_error_info(status)
        .map(|info| info.reason)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_millions_of_empty_items_are_refused_before_decoding() {
    let app = spawn_app().await;
    let channel = TestServer::channel_to(app.server.addr).await;
    // Warm up the connection and the server's buffers.
    let _ = raw::call(channel.clone(), "BatchAcquire", raw::empty_batch_acquire(1)).await;
    let before = Memory::rss_mib();
    Memory::reset_peak();

    // 4 MiB of empty items: 2.09 million; and the most a BatchAcquire may
    // be (100 items of 8 KiB) filled with 409,600 empty items.
    let huge = raw::empty_batch_acquire((4 * 1024 * 1024 - 16) / 2);
    let largest = raw::empty_batch_acquire(100 * 8 * 1024 / 2);
    let mut calls = Vec::new();
    for message in [huge, largest] {
        for _ in 0..8 {
            calls.push(tokio::spawn(raw::call(
                channel.clone(),
                "BatchAcquire",
                message.clone(),
            )));
        }
    }
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    let growth = Memory::peak_mib() - before;
    println!("RSS before {before:.0} MiB, peak growth {growth:.1} MiB for 16 hostile batches");

    for answer in &answers[..8] {
        let status = answer.as_ref().unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
        assert_eq!(reason_of(status), "MESSAGE_TOO_LARGE");
    }
    for answer in &answers[8..] {
        let status = answer.as_ref().unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("409600 requests"), "{status:?}");
    }
    assert!(growth < MAX_GROWTH_MIB, "RSS grew {growth:.1} MiB");
    assert_eq!(app.db.row_count().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_with_more_headers_than_the_limit_is_refused_before_decoding() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("headers"));
    let fencing_token = token(&acquire(&mut app.client, &id, b"fp").await);
    let without_response = pb::CompleteRequest {
        id: Some(id.clone()),
        fencing_token,
        response: None,
    };
    let channel = TestServer::channel_to(app.server.addr).await;
    let before = Memory::rss_mib();
    Memory::reset_peak();

    // ~60,000 headers fit the message size limit of a Complete (1 MiB of
    // response and its framing); decoded they would take ~40 MiB each.
    let hostile = raw::complete_with_headers(&without_response, 60_000);
    let calls: Vec<_> = (0..8)
        .map(|_| tokio::spawn(raw::call(channel.clone(), "Complete", hostile.clone())))
        .collect();
    for call in calls {
        let status = call.await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("response.headers"), "{status:?}");
        assert!(status.message().contains("60000 headers"), "{status:?}");
    }
    let growth = Memory::peak_mib() - before;
    println!("RSS peak growth {growth:.1} MiB for 8 Completes of 60,000 headers");
    assert!(growth < MAX_GROWTH_MIB, "RSS grew {growth:.1} MiB");

    // The limit itself, through the decoded path: 128 pass, 129 do not.
    let with_headers = |count: usize| pb::CompleteRequest {
        id: Some(id.clone()),
        fencing_token,
        response: Some(pb::StoredResponse {
            status_code: 200,
            body: Vec::new(),
            headers: (0..count).map(|i| (format!("h{i}"), "v".into())).collect(),
        }),
    };
    let status = app.client.complete(with_headers(129)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("response.headers"), "{status:?}");
    app.client.complete(with_headers(128)).await.unwrap();
}

/// Health and reflection are not the API: admission does not know their
/// methods and charges them nothing, so their servers hold a request to a
/// small message's 8 KiB instead of tonic's 4 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_refuse_requests_longer_than_a_small_message() {
    let app = spawn_app_with(|settings| {
        settings.health_addr = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let long_name = "s".repeat(16 * 1024);
    let health_addr = app.server.health_addr.expect("a health port");

    for addr in [app.server.addr, health_addr] {
        let mut health = HealthClient::new(TestServer::channel_to(addr).await);
        let check = |service: &str| HealthCheckRequest {
            service: service.into(),
        };
        let status = health.check(check(&long_name)).await.unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange, "{addr}: {status:?}");
        let status = health.watch(check(&long_name)).await.unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange, "{addr}: {status:?}");
        // A service name it does not know, of an ordinary length: answered.
        let status = health.check(check("no.such.Service")).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound, "{addr}: {status:?}");
        health.check(check("liveness")).await.unwrap();
    }

    let mut reflection = ServerReflectionClient::new(TestServer::channel_to(app.server.addr).await);
    let symbol = |name: &str| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(name.into())),
    };
    // tonic-reflection ends the stream, without an answer, at a request it
    // cannot decode.
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([symbol(&long_name)]))
        .await
        .unwrap()
        .into_inner();
    let first = answers.next().await;
    assert!(
        matches!(first, None | Some(Err(_))),
        "an answer to a request over the limit: {first:?}"
    );
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([symbol(
            "idempotency.v1.IdempotencyService",
        )]))
        .await
        .unwrap()
        .into_inner();
    answers.next().await.unwrap().unwrap();
}

/// A server whose calls hang at a frozen database, with a memory budget
/// that holds four large Completes.
async fn frozen_with_small_budget(db: &TestDb) -> (TestServer, idempotency_tests::TcpProxy) {
    let settings = Settings {
        // The smallest budget the limits allow: two 4 MiB messages.
        max_in_flight_bytes: 8 * 1024 * 1024 + 10 * 1024,
        request_timeout: Duration::from_secs(3),
        ..test_settings(db)
    };
    server_behind_proxy_with(db, settings).await
}

async fn in_flight_bytes(server: &TestServer) -> f64 {
    let page = http_get(server.metrics_addr, "/metrics").await;
    metric_value(&page, "idempotency_in_flight_bytes").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_past_the_memory_budget_are_shed_at_once_and_served_again_once_it_drains() {
    let db = TestDb::new().await;
    let (server, proxy) = frozen_with_small_budget(&db).await;
    let mut client = server.client.clone();
    let mut requests = Vec::new();
    for i in 0..5 {
        let id = record_id(&unique_key(&format!("budget-{i}")));
        let fencing_token = token(&acquire(&mut client, &id, b"fp").await);
        requests.push(pb::CompleteRequest {
            id: Some(id),
            fencing_token,
            // ~2 MiB charged each: the message twice.
            response: Some(response(200, &"x".repeat(1_040_000))),
        });
    }
    proxy.freeze();
    let held: Vec<_> = requests
        .drain(..4)
        .map(|request| {
            let mut client = client.clone();
            tokio::spawn(async move { client.complete(request).await })
        })
        .collect();
    // Wait until the four are admitted and hang at the database.
    let mut charged = 0.0;
    for _ in 0..100 {
        charged = in_flight_bytes(&server).await;
        if charged >= 8_000_000.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(charged >= 8_000_000.0, "charged {charged}");

    let started = Instant::now();
    let shed = client.complete(requests[0].clone()).await;
    assert_error(shed, Code::Unavailable, "OVERLOADED");
    assert!(started.elapsed() < Duration::from_secs(2), "shed at once");
    let page = http_get(server.metrics_addr, "/metrics").await;
    assert_eq!(
        metric_value(
            &page,
            "idempotency_admission_refused_total{reason=\"overloaded\"}"
        ),
        Some(1.0)
    );

    proxy.thaw();
    for call in held {
        // Completed once the database answered, or timed out: never lost
        // silently, and the charge goes back either way.
        match call.await.unwrap() {
            Ok(_) => {}
            Err(status) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        }
    }
    let mut left = f64::MAX;
    for _ in 0..100 {
        left = in_flight_bytes(&server).await;
        if left == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0.0, "every charge is given back");
    let mut served = false;
    for _ in 0..50 {
        if client.complete(requests[0].clone()).await.is_ok() {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "the shed call is served once the budget drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_database_answers_by_the_deadline_and_the_server_recovers_by_itself() {
    let db = TestDb::new().await;
    let settings = Settings {
        request_timeout: Duration::from_secs(1),
        ..test_settings(&db)
    };
    let (server, proxy) = server_behind_proxy_with(&db, settings).await;
    let mut client = server.client.clone();
    let held = record_id(&unique_key("frozen-held"));
    let fencing_token = token(&acquire(&mut client, &held, b"fp").await);

    proxy.freeze();
    let started = Instant::now();
    let acquired = client
        .acquire(pb::AcquireRequest {
            id: Some(record_id(&unique_key("frozen-new"))),
            ..Default::default()
        })
        .await;
    let acquire_took = started.elapsed();
    assert_error(acquired, Code::Unavailable, "REQUEST_TIMEOUT");
    let started = Instant::now();
    let completed = client
        .complete(pb::CompleteRequest {
            id: Some(held.clone()),
            fencing_token,
            response: Some(response(200, "ok")),
        })
        .await;
    let complete_took = started.elapsed();
    assert_eq!(completed.unwrap_err().code(), Code::Unavailable);
    // The caller's own, shorter deadline applies instead.
    let mut request = tonic::Request::new(pb::GetRequest {
        id: Some(held.clone()),
    });
    request.set_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let status = client.get(request).await.unwrap_err();
    let get_took = started.elapsed();
    // tonic's client reports its own deadline as CANCELLED.
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    println!(
        "frozen: Acquire answered in {acquire_took:?}, Complete in {complete_took:?}, Get with \
         a 300 ms deadline in {get_took:?}"
    );
    // Bounded by the 1 s request timeout, with room for a loaded machine.
    for took in [acquire_took, complete_took, get_took] {
        assert!(took < Duration::from_secs(4), "{took:?}");
    }

    proxy.thaw();
    // Connections whose statements were abandoned are not used again: the
    // server works again by itself, within a few retries at most.
    let mut recovered = None;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        let id = record_id(&unique_key("thawed"));
        if let Ok(answer) = client
            .acquire(pb::AcquireRequest {
                id: Some(id),
                ..Default::default()
            })
            .await
        {
            recovered = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(recovered.is_some(), "the server recovers after the freeze");
}
