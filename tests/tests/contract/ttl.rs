//! Lifetimes: an expired record acts as absent even before cleanup removes it.

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_tests::{TestDb, record_id, response, seconds, spawn_app, unique_key};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn an_expired_record_acts_as_absent_while_its_row_still_exists() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("expiring"));
    let request = pb::AcquireRequest {
        id: Some(id.clone()),
        fingerprint: b"first request".to_vec(),
        ttl: Some(seconds(1)),
        lease: Some(seconds(1)),
    };
    let t = token(&acquire_request(&mut app.client, request).await);
    complete(&mut app.client, &id, t, response(201, "first"))
        .await
        .unwrap();
    wait_past(1).await;

    assert_eq!(
        app.db.row_count().await,
        1,
        "cleanup has not run: the row is still there"
    );
    assert_error(
        get(&mut app.client, &id).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    let late = complete(&mut app.client, &id, t, response(201, "first")).await;
    assert_error(late, Code::NotFound, "RECORD_NOT_FOUND");

    // A fresh start: a new token (never the expired attempt's, whose holder
    // may still be running), and the old fingerprint no longer binds the key.
    let outcome = acquire(&mut app.client, &id, b"another request").await;

    let Outcome::Acquired(acquired) = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        acquired.fencing_token > t,
        "{} after {t}",
        acquired.fencing_token
    );
    let record = get(&mut app.client, &id).await.unwrap();
    assert_eq!(record.state(), pb::RecordState::InProgress);
    assert_eq!(record.fingerprint, b"another request");
    assert_eq!(record.response, None);
    assert_eq!(app.db.row_count().await, 1);
}

/// A holder that overran its lease on a record whose TTL was no longer than
/// the lease: the record expired with the lease, and the next Acquire started
/// a new lifetime. The old holder must still be refused, whether the expired
/// row was taken over (`purged: false`) or deleted first (`purged: true`).
async fn a_holder_that_outlived_its_record(purged: bool) {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("outlived"));
    let leased = |lease| pb::AcquireRequest {
        id: Some(id.clone()),
        fingerprint: b"fp".to_vec(),
        ttl: Some(seconds(1)),
        lease: Some(seconds(lease)),
    };
    let stale = token(&acquire_request(&mut app.client, leased(2)).await);
    wait_past(2).await;
    if purged {
        run_admin(
            &app.db,
            idempotency_server::settings::AdminCommand::Purge(purge_args(&id)),
            false,
        )
        .await
        .unwrap();
    }
    let current = token(&acquire_request(&mut app.client, leased(60)).await);
    assert_ne!(
        current, stale,
        "the next attempt got the stale holder's token"
    );

    let late = complete(&mut app.client, &id, stale, response(201, "stale"));
    assert_error(late.await, Code::Aborted, "STALE_FENCING_TOKEN");
    let late = renew(&mut app.client, &id, stale, 60);
    assert_error(late.await, Code::Aborted, "STALE_FENCING_TOKEN");
    let late = fail(&mut app.client, &id, stale, true, None);
    assert_error(late.await, Code::Aborted, "STALE_FENCING_TOKEN");
    complete(&mut app.client, &id, current, response(201, "current"))
        .await
        .unwrap();
    let record = get(&mut app.client, &id).await.unwrap();
    assert_eq!(record.response, Some(response(201, "current")));
}

#[tokio::test]
async fn a_holder_that_outlived_its_record_is_refused_after_a_takeover_of_the_row() {
    a_holder_that_outlived_its_record(false).await;
}

#[tokio::test]
async fn a_holder_that_outlived_its_record_is_refused_after_the_row_was_deleted() {
    a_holder_that_outlived_its_record(true).await;
}

/// A lifetime's first token is read off the clock when its row is written, not
/// when the statement began: a batched Acquire can wait seconds on another
/// key's insert before it writes this key, while a whole lifetime of this key
/// begins and is purged. (The insert computes it per row, above its sort, as
/// `EXPLAIN VERBOSE` shows.)
#[tokio::test]
async fn a_lifetime_token_is_taken_when_the_row_is_written() {
    let db = TestDb::new().await;
    let mut transaction = db.pool.begin().await.unwrap();
    let mut token = async || -> i64 {
        sqlx::query_scalar("SELECT idempotency_lifetime_token()")
            .fetch_one(&mut *transaction)
            .await
            .unwrap()
    };

    let first = token().await;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let second = token().await;

    assert!(second > first, "{second} after {first}, in one transaction");
}
