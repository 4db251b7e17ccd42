//! Complete: idempotent with the same response, refused with another.

use idempotency_tests::{record_id, response, spawn_app, unique_key};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn complete_retried_identically_answers_the_same() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("retry"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    let stored = response(201, r#"{"id":"pay_1"}"#);

    let first = complete(&mut app.client, &id, t, stored.clone())
        .await
        .unwrap();
    let second = complete(&mut app.client, &id, t, stored).await.unwrap();

    assert_eq!(first, second);
}

#[tokio::test]
async fn complete_with_another_response_after_completion_is_a_failed_precondition() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("conflict"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    let stored = response(201, r#"{"id":"pay_1"}"#);
    complete(&mut app.client, &id, t, stored.clone())
        .await
        .unwrap();

    let mut other_header = stored.clone();
    other_header.headers.insert("x-extra".into(), "1".into());
    for other in [
        response(201, r#"{"id":"pay_2"}"#),
        response(200, r#"{"id":"pay_1"}"#),
        other_header,
    ] {
        let result = complete(&mut app.client, &id, t, other).await;
        assert_error(result, Code::FailedPrecondition, "RESPONSE_CONFLICT");
    }
    assert_eq!(
        get(&mut app.client, &id).await.unwrap().response,
        Some(stored)
    );
}

#[tokio::test]
async fn complete_fail_renew_and_get_on_an_unknown_key_are_not_found() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("nobody"));

    assert_error(
        complete(&mut app.client, &id, 1, response(201, "x")).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    assert_error(
        fail(&mut app.client, &id, 1, false, None).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    assert_error(
        fail(&mut app.client, &id, 1, true, None).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    assert_error(
        renew(&mut app.client, &id, 1, 10).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    assert_error(
        get(&mut app.client, &id).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    assert_eq!(app.db.row_count().await, 0);
}

#[tokio::test]
async fn get_shows_the_whole_record() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("get"));
    let t = token(&acquire(&mut app.client, &id, b"fingerprint").await);

    let held = get(&mut app.client, &id).await.unwrap();
    assert_eq!(
        held.state(),
        idempotency_client::pb::RecordState::InProgress
    );
    assert_eq!(held.id.as_ref(), Some(&id));
    assert_eq!(held.fingerprint, b"fingerprint");
    assert_eq!(held.fencing_token, t);
    assert!(
        held.lease_expires_at.is_some() && held.completed_at.is_none() && held.response.is_none()
    );

    let stored = response(201, "done");
    let completed_at = complete(&mut app.client, &id, t, stored.clone())
        .await
        .unwrap()
        .completed_at;
    let done = get(&mut app.client, &id).await.unwrap();
    assert_eq!(done.state(), idempotency_client::pb::RecordState::Completed);
    assert_eq!(done.completed_at, completed_at);
    assert_eq!(done.lease_expires_at, None);
    assert_eq!(done.response, Some(stored));
    assert_eq!(done.created_at, held.created_at);
}
