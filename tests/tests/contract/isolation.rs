//! Group commit keeps failures with the rows they concern: a row that another
//! session holds makes only its own call wait (or fail), while the calls that
//! shared its statement, or its BatchComplete, commit and answer.

use std::time::Duration;

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_tests::{
    TestDb, TestServer, assert_error, hold_write, lock_record, record_id, response, spawn_app,
    test_settings, unique_key,
};
use tonic::Code;

use crate::{
    batch::{acquire_item, batch_acquire, batch_complete, complete_item},
    support::*,
};

/// Longer than any statement here takes unless it waits for a held row.
const PATIENCE: Duration = Duration::from_secs(20);

/// Acquires `count` new keys (labelled `label`), one call each.
async fn acquired(client: &mut Client, label: &str, count: usize) -> Vec<(pb::RecordId, u64)> {
    let mut held = Vec::new();
    for _ in 0..count {
        let id = record_id(&unique_key(label));
        let fencing_token = token(&acquire(client, &id, b"fp").await);
        held.push((id, fencing_token));
    }
    held
}

/// How many of `ids` have a row in `state`, as the test's own session sees them.
async fn count_in_state(db: &TestDb, ids: &[pb::RecordId], state: &str) -> usize {
    let keys: Vec<&str> = ids.iter().map(|id| id.key.as_str()).collect();
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_records WHERE key = ANY($1) AND state = $2",
    )
    .bind(&keys)
    .bind(state)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    usize::try_from(count).unwrap()
}

/// Waits (up to [`PATIENCE`]) until all of `ids` are in `state`.
async fn wait_for_state(db: &TestDb, ids: &[pb::RecordId], state: &str) {
    let started = std::time::Instant::now();
    loop {
        let count = count_in_state(db, ids, state).await;
        if count == ids.len() {
            return;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "only {count} of {} records became {state}",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A server whose statements time out after a second.
async fn server_with_short_statement_timeout(db: &TestDb) -> TestServer {
    let mut settings = test_settings(db);
    settings.database.statement_timeout = Duration::from_secs(1);
    TestServer::start_with(settings).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_complete_with_a_locked_row_finishes_the_other_thirty_while_the_lock_is_held() {
    let app = spawn_app().await;
    let mut client = app.client.clone();
    let held = acquired(&mut client, "iso-batch", 31).await;
    let (locked, _) = held[17].clone();
    let others: Vec<pb::RecordId> = held
        .iter()
        .map(|(id, _)| id.clone())
        .filter(|id| id.key != locked.key)
        .collect();
    let lock = lock_record(&app.db, &locked.key).await;

    let batch = tokio::spawn({
        let mut client = client.clone();
        let items = held.iter().map(|(id, t)| complete_item(id, *t)).collect();
        async move { batch_complete(&mut client, items).await }
    });

    // The thirty commit while the lock is held; the locked one waits for it.
    wait_for_state(&app.db, &others, "completed").await;
    assert_eq!(
        count_in_state(&app.db, std::slice::from_ref(&locked), "in_progress").await,
        1
    );
    assert!(!batch.is_finished(), "the locked item did not wait");
    lock.rollback().await.unwrap();
    let results = batch.await.unwrap();
    assert_eq!(results.len(), 31);
    for (result, (id, _)) in results.iter().zip(&held) {
        assert!(result.is_ok(), "{}: {result:?}", id.key);
    }
    wait_for_state(&app.db, std::slice::from_ref(&locked), "completed").await;
    wait_for_metric(
        &app.server,
        r#"idempotency_db_calls_alone_total{query="finish"}"#,
        |alone| alone >= 1.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_complete_item_locked_past_the_statement_timeout_fails_alone() {
    let db = TestDb::new().await;
    let server = server_with_short_statement_timeout(&db).await;
    let mut client = server.client.clone();
    let held = acquired(&mut client, "iso-timeout", 31).await;
    let (locked, locked_token) = held[3].clone();
    let lock = lock_record(&db, &locked.key).await;

    // The lock outlives the call.
    let results = batch_complete(
        &mut client,
        held.iter().map(|(id, t)| complete_item(id, *t)).collect(),
    )
    .await;

    for (result, (id, _)) in results.into_iter().zip(&held) {
        if id.key == locked.key {
            assert_error(result, Code::Unavailable, "DATABASE_UNAVAILABLE");
        } else {
            assert!(result.is_ok(), "{}: {result:?}", id.key);
        }
    }
    lock.rollback().await.unwrap();
    complete(&mut client, &locked, locked_token, response(201, "{}"))
        .await
        .expect("completes once the lock is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_unary_completes_succeed_beside_one_on_a_row_locked_past_the_statement_timeout() {
    let db = TestDb::new().await;
    let server = server_with_short_statement_timeout(&db).await;
    let mut client = server.client.clone();
    let held = acquired(&mut client, "iso-unary", 31).await;
    let (locked, _) = held[0].clone();
    let lock = lock_record(&db, &locked.key).await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(server.new_client().await);
    }

    // All at once, so that they queue for the same statements as the locked one.
    let calls: Vec<_> = held
        .iter()
        .enumerate()
        .map(|(n, (id, fencing_token))| {
            let (mut client, id, fencing_token) =
                (clients[n % 4].clone(), id.clone(), *fencing_token);
            tokio::spawn(async move {
                complete(&mut client, &id, fencing_token, response(201, "{}")).await
            })
        })
        .collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await.unwrap());
    }
    // Still held: the locked call ran out of time waiting, alone.
    lock.rollback().await.unwrap();

    let mut results = results.into_iter();
    assert_error(
        results.next().unwrap(),
        Code::Unavailable,
        "DATABASE_UNAVAILABLE",
    );
    for (result, (id, _)) in results.zip(&held[1..]) {
        assert!(result.is_ok(), "{}: {result:?}", id.key);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_acquire_with_a_key_being_written_inserts_the_other_thirty_while_it_waits() {
    let app = spawn_app().await;
    let mut client = app.client.clone();
    let (busy, busy_token) = acquired(&mut client, "iso-acquire-busy", 1).await.remove(0);
    let fresh: Vec<pb::RecordId> = (0..30)
        .map(|_| record_id(&unique_key("iso-acquire-new")))
        .collect();
    // An uncommitted write of the key: an insert of it waits for the writer
    // to end, where a row lock alone would not hold it up.
    let writer = hold_write(&app.db, &busy.key).await;

    let batch = tokio::spawn({
        let mut client = client.clone();
        let mut items: Vec<pb::AcquireRequest> =
            fresh.iter().map(|id| acquire_item(id, b"fp")).collect();
        items.insert(12, acquire_item(&busy, b"fp"));
        async move { batch_acquire(&mut client, items).await }
    });

    // The thirty new keys commit while the write is held.
    wait_for_state(&app.db, &fresh, "in_progress").await;
    assert!(!batch.is_finished(), "the busy key's item did not wait");
    writer.rollback().await.unwrap();
    let mut results = batch.await.unwrap();
    let busy_result = results.remove(12);
    assert!(
        matches!(busy_result, Ok(Outcome::InProgress(_))),
        "{busy_result:?}"
    );
    for (result, id) in results.iter().zip(&fresh) {
        assert!(
            matches!(result, Ok(Outcome::Acquired(_))),
            "{}: {result:?}",
            id.key
        );
    }
    complete(&mut client, &busy, busy_token, response(201, "{}"))
        .await
        .expect("the busy key's holder still holds it");
}
