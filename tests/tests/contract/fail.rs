//! Fail: retryable releases the key, terminal stores the error.

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_tests::{record_id, response, spawn_app, unique_key};
use tonic::Code;

use crate::{replicas::Replicas, support::*};

#[tokio::test]
async fn a_retryable_failure_releases_the_key_to_the_next_attempt_with_the_next_token() {
    retryable_failure_releases_the_key(&Replicas::start(1, &[]).await).await;
}

#[tokio::test]
async fn a_key_released_on_one_replica_is_taken_on_another_with_the_next_token() {
    retryable_failure_releases_the_key(&Replicas::start(2, &[]).await).await;
}

/// Acquired and released on the first replica, taken on the last.
async fn retryable_failure_releases_the_key(replicas: &Replicas) {
    let mut each = replicas.each().await;
    let last = each.len() - 1;
    let id = record_id(&unique_key("retryable"));
    let first = token(&acquire(&mut each[0], &id, b"fp").await);

    let released = fail(&mut each[0], &id, first, true, None).await.unwrap();

    assert_eq!(released.state(), pb::RecordState::Released);
    for client in &mut each {
        assert_eq!(
            get(client, &id).await.unwrap().state(),
            pb::RecordState::Released
        );
        // Repeating the same Fail is fine.
        assert_eq!(
            fail(client, &id, first, true, None).await.unwrap().state(),
            pb::RecordState::Released
        );
    }
    assert_eq!(
        token(&acquire(&mut each[last], &id, b"fp").await),
        first + 1
    );
    // The released attempt cannot come back, through any replica.
    for client in &mut each {
        assert_error(
            complete(client, &id, first, response(201, "late")).await,
            Code::Aborted,
            "STALE_FENCING_TOKEN",
        );
    }
}

#[tokio::test]
async fn a_terminal_failure_is_replayed_and_can_be_repeated_but_not_changed() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("terminal"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    let error = response(422, r#"{"error":"insufficient funds"}"#);

    let failed = fail(&mut app.client, &id, t, false, Some(error.clone()))
        .await
        .unwrap();

    assert_eq!(failed.state(), pb::RecordState::Failed);
    let Outcome::Failed(replay) = acquire(&mut app.client, &id, b"fp").await else {
        panic!()
    };
    assert_eq!(replay.error_response, Some(error.clone()));
    assert_eq!(
        fail(&mut app.client, &id, t, false, Some(error))
            .await
            .unwrap()
            .state(),
        pb::RecordState::Failed
    );
    let other = fail(&mut app.client, &id, t, false, Some(response(500, "other"))).await;
    assert_error(other, Code::FailedPrecondition, "RESPONSE_CONFLICT");
    let completion = complete(&mut app.client, &id, t, response(201, "too late")).await;
    assert_error(completion, Code::FailedPrecondition, "RESPONSE_CONFLICT");
    let release = fail(&mut app.client, &id, t, true, None).await;
    assert_error(release, Code::FailedPrecondition, "NOT_IN_PROGRESS");
}

#[tokio::test]
async fn a_terminal_failure_without_an_error_response_stores_an_empty_one() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("bare"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);

    fail(&mut app.client, &id, t, false, None).await.unwrap();

    let Outcome::Failed(replay) = acquire(&mut app.client, &id, b"fp").await else {
        panic!()
    };
    assert_eq!(replay.error_response, Some(pb::StoredResponse::default()));
}

#[tokio::test]
async fn fail_with_a_stale_token_or_on_an_unknown_key_is_refused() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("stale"));
    let stale = token(&acquire_leased(&mut app.client, &id, b"fp", 1).await);
    wait_past(1).await;
    assert!(token(&acquire(&mut app.client, &id, b"fp").await) > stale);

    assert_error(
        fail(&mut app.client, &id, stale, true, None).await,
        Code::Aborted,
        "STALE_FENCING_TOKEN",
    );
    assert_error(
        fail(&mut app.client, &id, stale, false, None).await,
        Code::Aborted,
        "STALE_FENCING_TOKEN",
    );
    let unknown = record_id(&unique_key("unknown"));
    assert_error(
        fail(&mut app.client, &unknown, 1, true, None).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    assert_eq!(
        get(&mut app.client, &id).await.unwrap().state(),
        pb::RecordState::InProgress
    );
}
