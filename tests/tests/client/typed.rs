//! The typed client: outcomes as domain types, leases, retries, errors.

use std::time::Duration;

use idempotency_client::{
    Acquisition, ClientOptions, Error, RecordState, RetryPolicy, StoredResponse,
};
use idempotency_tests::{TestDb, spawn_app};

use crate::support::*;

#[tokio::test]
async fn outcomes_arrive_as_domain_types() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("typed");

    let mut lease = proceed(&client, &request).await;
    assert!(lease.fencing_token() > 0);
    assert!(lease.lease_expires_at() < lease.expires_at());
    assert!(matches!(
        client.acquire(&request).await.unwrap(),
        Acquisition::InProgress { .. }
    ));
    let other_body = idempotency_client::AcquireRequest {
        fingerprint: b"other".to_vec(),
        ..request.clone()
    };
    assert!(matches!(
        client.acquire(&other_body).await.unwrap(),
        Acquisition::FingerprintMismatch
    ));

    let response = StoredResponse::new(201, "created").with_header("location", "/payments/1");
    lease.complete(&response).await.unwrap();

    let Acquisition::Replay(replayed) = client.acquire(&request).await.unwrap() else {
        panic!()
    };
    assert_eq!(replayed, response);
    let record = client.get(&request.id).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.response, Some(response));
    assert_eq!(
        client
            .get(&super::support::request("absent").id)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn errors_are_typed_by_code_and_reason() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let mut bad = request("bad");
    bad.id.key = "short".into();

    let Err(Error::InvalidArgument { field, .. }) = client.acquire(&bad).await else {
        panic!()
    };
    assert_eq!(field.as_deref(), Some("id.key"));

    let request = request("lost").with_lease(Duration::from_secs(1));
    let mut first = proceed(&client, &request).await;
    tokio::time::sleep(Duration::from_millis(1150)).await;
    let mut second = proceed(&client, &request).await;
    assert!(matches!(
        first.complete(&StoredResponse::new(201, "")).await,
        Err(Error::LeaseLost)
    ));
    assert!(first.is_lost());
    second
        .complete(&StoredResponse::new(201, "mine"))
        .await
        .unwrap();
    assert!(matches!(
        second.renew(Duration::from_secs(5)).await,
        Err(Error::NotInProgress)
    ));
}

#[tokio::test]
async fn keep_alive_renews_a_slow_holder_until_it_completes() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("keepalive").with_lease(Duration::from_secs(1));
    let mut lease = proceed(&client, &request).await;

    lease.keep_alive(Duration::from_millis(300), Duration::from_secs(1));
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        // 2.5 s in, a 1 s lease would long have been taken over.
        assert!(matches!(
            client.acquire(&request).await.unwrap(),
            Acquisition::InProgress { .. }
        ));
    }

    lease
        .complete(&StoredResponse::new(200, "slow"))
        .await
        .unwrap();
    assert!(!lease.is_lost());
}

#[tokio::test]
async fn keep_alive_renews_at_least_three_times_a_lease() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("keepalive-often").with_lease(Duration::from_secs(3));
    let mut lease = proceed(&client, &request).await;
    let acquired_until = lease.lease_expires_at();

    // Asked to renew every 2.7 s, which a single missed renewal would turn
    // into a lost 3 s lease: the renewals come every second instead. The
    // first comes after 1 s; by 2.9 s a second one must have moved the lease.
    lease.keep_alive(Duration::from_millis(2700), Duration::from_secs(3));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after_first = lease_end(&client, &request).await;
    assert!(after_first > acquired_until, "no renewal within 1.5 s");
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let after_second = lease_end(&client, &request).await;
    assert!(
        after_second > after_first,
        "one renewal in 2.9 s: {after_first:?} then {after_second:?}"
    );

    lease
        .complete(&StoredResponse::new(200, "done"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_marks_the_lease_lost_once_it_passes_while_renewals_fail() {
    let db = TestDb::new().await;
    let (server, proxy) = idempotency_tests::server_behind_proxy(&db).await;
    let client = client_of(&server).with_options(ClientOptions {
        retry: RetryPolicy::none(),
        ..ClientOptions::default()
    });
    let request = request("keepalive-outage").with_lease(Duration::from_secs(1));
    let mut lease = proceed(&client, &request).await;
    lease.keep_alive(Duration::from_millis(200), Duration::from_secs(1));

    // Every renewal fails UNAVAILABLE from now on: retried, until the lease
    // has passed and another attempt may hold the key.
    proxy.cut().await;
    let mut waited = Duration::ZERO;
    while !lease.is_lost() && waited < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }
    assert!(lease.is_lost(), "still not lost after {waited:?}");
    assert!(
        std::time::SystemTime::now() >= lease.lease_expires_at(),
        "marked lost before the lease passed"
    );
    proxy.restore().await;
}

async fn lease_end(
    client: &idempotency_client::Client,
    request: &idempotency_client::AcquireRequest,
) -> std::time::SystemTime {
    let record = client.get(&request.id).await.unwrap().expect("the record");
    record.lease_expires_at.expect("in progress")
}

#[tokio::test]
async fn dropping_an_unfinished_lease_releases_the_key() {
    let app = spawn_app().await;
    let client = client_of(&app.server);
    let request = request("dropped");
    let lease = proceed(&client, &request).await;

    let dropped_token = lease.fencing_token();
    drop(lease);

    wait_for_state(&client, &request.id, RecordState::Released).await;
    let next = proceed(&client, &request).await;
    assert!(next.fencing_token() > dropped_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_outages_are_retried_within_the_policy() {
    let db = TestDb::new().await;
    let (server, proxy) = idempotency_tests::server_behind_proxy(&db).await;
    let patient = client_of(&server).with_options(ClientOptions {
        timeout: Duration::from_secs(2),
        retry: RetryPolicy {
            max_attempts: 50,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
            max_elapsed: Duration::from_secs(10),
        },
        ..ClientOptions::default()
    });
    let impatient = patient.clone().with_options(ClientOptions {
        retry: RetryPolicy::none(),
        ..ClientOptions::default()
    });
    let request = request("outage");
    proxy.cut().await;

    let Err(error) = impatient.acquire(&request).await else {
        panic!("the database is down")
    };
    assert!(
        matches!(error, Error::Unavailable { attempts: 1, .. }),
        "{error:?}"
    );
    let waiting = tokio::spawn({
        let request = request.clone();
        async move { patient.acquire(&request).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.restore().await;

    let outcome = waiting
        .await
        .unwrap()
        .expect("retried until the database was back");
    assert!(matches!(outcome, Acquisition::Proceed(_)));
}

#[tokio::test]
async fn an_unreachable_service_is_unavailable_after_bounded_retries() {
    let client = client_of_nothing().await;

    let result = client.acquire(&request("nowhere")).await;

    assert!(
        matches!(result, Err(Error::Unavailable { attempts: 2, .. })),
        "{result:?}"
    );
}
