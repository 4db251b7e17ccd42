//! BatchAcquire and BatchComplete: each item is answered exactly as its unary
//! call would be, in order, and a bad item fails alone.

use std::sync::Arc;

use idempotency_client::pb::{
    self, acquire_response::Outcome, batch_acquire_result, batch_complete_result,
};
use idempotency_tests::{
    TestDb, TestServer, http_get, metric_value, record_id, response, spawn_app, spawn_app_with,
    unique_key,
};
use prost::Message;
use tokio::sync::Barrier;
use tonic::{Code, Status, codegen::Bytes};
use tonic_types::StatusExt;

use crate::support::*;

pub(crate) fn acquire_item(id: &pb::RecordId, fingerprint: &[u8]) -> pb::AcquireRequest {
    pb::AcquireRequest {
        id: Some(id.clone()),
        fingerprint: fingerprint.to_vec(),
        ..Default::default()
    }
}

pub(crate) fn complete_item(id: &pb::RecordId, fencing_token: u64) -> pb::CompleteRequest {
    pb::CompleteRequest {
        id: Some(id.clone()),
        fencing_token,
        response: Some(response(201, "{\"id\":1}")),
    }
}

/// An item's `google.rpc.Status` as the `tonic::Status` a unary call carries.
fn as_status(status: tonic_types::pb::Status) -> Status {
    Status::with_details(
        Code::from_i32(status.code),
        status.message.clone(),
        Bytes::from(status.encode_to_vec()),
    )
}

pub(crate) async fn batch_acquire(
    client: &mut Client,
    requests: Vec<pb::AcquireRequest>,
) -> Vec<Result<Outcome, Status>> {
    let results = client
        .batch_acquire(pb::BatchAcquireRequest { requests })
        .await
        .expect("BatchAcquire succeeds")
        .into_inner()
        .results;
    results
        .into_iter()
        .map(|result| match result.result.expect("every item answered") {
            batch_acquire_result::Result::Response(response) => {
                Ok(response.outcome.expect("an outcome"))
            }
            batch_acquire_result::Result::Error(status) => Err(as_status(status)),
        })
        .collect()
}

pub(crate) async fn batch_complete(
    client: &mut Client,
    requests: Vec<pb::CompleteRequest>,
) -> Vec<Result<pb::CompleteResponse, Status>> {
    let results = client
        .batch_complete(pb::BatchCompleteRequest { requests })
        .await
        .expect("BatchComplete succeeds")
        .into_inner()
        .results;
    results
        .into_iter()
        .map(|result| match result.result.expect("every item answered") {
            batch_complete_result::Result::Response(response) => Ok(response),
            batch_complete_result::Result::Error(status) => Err(as_status(status)),
        })
        .collect()
}

#[tokio::test]
async fn batch_acquire_answers_every_item_as_the_unary_call_in_order() {
    let app = spawn_app().await;
    every_item_answered_as_the_unary_call(&app.db, &app.server).await;
}

#[tokio::test]
async fn batch_acquire_keeps_the_order_of_a_records_items_without_group_commit_too() {
    let app = spawn_app_with(|settings| settings.batching = false).await;
    every_item_answered_as_the_unary_call(&app.db, &app.server).await;
}

async fn every_item_answered_as_the_unary_call(db: &TestDb, server: &TestServer) {
    let mut client = server.client.clone();

    let done = record_id(&unique_key("batch-done"));
    let done_token = token(&acquire(&mut client, &done, b"fp").await);
    complete(&mut client, &done, done_token, response(201, "{\"id\":1}"))
        .await
        .unwrap();
    let fresh = record_id(&unique_key("batch-fresh"));
    // Records sent twice each, so that running a record's items at the same
    // time would show (the second item overtaking the first) often.
    let twice: Vec<_> = (0..8)
        .map(|_| record_id(&unique_key("batch-twice")))
        .collect();
    let mut bad = record_id(&unique_key("batch-bad"));
    bad.key = "short".into();

    let mut requests = vec![
        acquire_item(&fresh, b"fp"),
        acquire_item(&done, b"fp"),
        acquire_item(&bad, b"fp"),
        acquire_item(&done, b"other"),
    ];
    requests.extend(twice.iter().map(|id| acquire_item(id, b"fp")));
    requests.extend(twice.iter().map(|id| acquire_item(id, b"fp")));
    let results = batch_acquire(&mut client, requests).await;

    assert_eq!(results.len(), 4 + 2 * twice.len());
    token(results[0].as_ref().unwrap()); // ACQUIRED
    match results[1].as_ref().unwrap() {
        Outcome::Completed(completed) => {
            assert_eq!(completed.response, Some(response(201, "{\"id\":1}")));
        }
        other => panic!("expected COMPLETED, got {other:?}"),
    }
    // The bad item fails alone, with the unary call's code, reason and field.
    let status = assert_error(
        results[2].clone().map(drop),
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
    );
    let field = status.get_details_bad_request().unwrap().field_violations[0]
        .field
        .clone();
    assert_eq!(field, "id.key");
    assert!(matches!(
        results[3].as_ref().unwrap(),
        Outcome::FingerprintMismatch(_)
    ));
    // The same record twice in one batch: the first holds it, the second
    // sees the first's attempt, as two unary calls one after the other would.
    for (first, second) in results[4..4 + twice.len()]
        .iter()
        .zip(&results[4 + twice.len()..])
    {
        token(first.as_ref().unwrap()); // ACQUIRED
        assert!(
            matches!(second.as_ref().unwrap(), Outcome::InProgress(_)),
            "{second:?}"
        );
    }
    // Nothing was written for the bad item; the good ones are there:
    // `done`, `fresh` and the eight `twice` records.
    assert!(get(&mut client, &fresh).await.is_ok());
    assert_eq!(db.row_count().await, 2 + twice.len() as i64);
}

/// A batch's items reach the store together by construction, not because
/// they happen to queue for the same statement: a BatchAcquire of new keys
/// is one insert of them all.
#[tokio::test]
async fn a_batch_acquire_of_new_keys_is_one_statement() {
    const KEYS: usize = 50;
    let mut app = spawn_app().await;
    let requests = (0..KEYS)
        .map(|_| acquire_item(&record_id(&unique_key("one-statement")), b"fp"))
        .collect();

    let results = batch_acquire(&mut app.client, requests).await;

    assert!(
        results
            .iter()
            .all(|result| matches!(result, Ok(Outcome::Acquired(_)))),
        "{results:?}"
    );
    let page = http_get(app.server.metrics_addr, "/metrics").await;
    let statements = metric_value(&page, r#"idempotency_db_batch_size_count{query="acquire"}"#);
    let items = metric_value(&page, r#"idempotency_db_batch_size_sum{query="acquire"}"#);
    assert_eq!(
        (statements, items),
        (Some(1.0), Some(KEYS as f64)),
        "(statements, items in them)"
    );
}

#[tokio::test]
async fn batch_complete_answers_every_item_as_the_unary_call() {
    let mut app = spawn_app().await;

    let first = record_id(&unique_key("bc-first"));
    let second = record_id(&unique_key("bc-second"));
    let first_token = token(&acquire(&mut app.client, &first, b"fp").await);
    let second_token = token(&acquire(&mut app.client, &second, b"fp").await);
    let never = record_id(&unique_key("bc-never"));

    let results = batch_complete(
        &mut app.client,
        vec![
            complete_item(&first, first_token),
            complete_item(&second, second_token + 1),
            complete_item(&never, 1),
            complete_item(&second, 0),
        ],
    )
    .await;

    assert!(results[0].as_ref().unwrap().completed_at.is_some());
    assert_error(results[1].clone(), Code::Aborted, "STALE_FENCING_TOKEN");
    assert_error(results[2].clone(), Code::NotFound, "RECORD_NOT_FOUND");
    assert_error(
        results[3].clone(),
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
    );
    // The stale item changed nothing: the attempt still holds the key.
    let record = get(&mut app.client, &second).await.unwrap();
    assert_eq!(record.state, pb::RecordState::InProgress as i32);
    match acquire(&mut app.client, &first, b"fp").await {
        Outcome::Completed(_) => {}
        other => panic!("expected COMPLETED, got {other:?}"),
    }
}

#[tokio::test]
async fn an_empty_or_oversized_batch_is_refused_whole_and_writes_nothing() {
    let app = spawn_app().await;
    let mut client = app.client.clone();

    let empty = client
        .batch_acquire(pb::BatchAcquireRequest { requests: vec![] })
        .await;
    let status = assert_error(empty, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert_eq!(
        status.get_details_bad_request().unwrap().field_violations[0].field,
        "requests"
    );

    let max = idempotency_server::domain::Limits::default().max_batch_items;
    let ids: Vec<_> = (0..=max)
        .map(|_| record_id(&unique_key("oversized")))
        .collect();
    let oversized = client
        .batch_acquire(pb::BatchAcquireRequest {
            requests: ids.iter().map(|id| acquire_item(id, b"fp")).collect(),
        })
        .await;
    let status = assert_error(oversized, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert!(status.message().contains(&max.to_string()), "{status:?}");
    assert_eq!(app.db.row_count().await, 0);
    // An oversized BatchComplete whose first item could complete a held
    // record: refused whole, the record stays in progress.
    let held = record_id(&unique_key("oversized-held"));
    let held_token = token(&acquire(&mut client, &held, b"fp").await);
    let completes = client
        .batch_complete(pb::BatchCompleteRequest {
            requests: std::iter::once(complete_item(&held, held_token))
                .chain(ids[..max].iter().map(|id| complete_item(id, 1)))
                .collect(),
        })
        .await;
    assert_error(completes, Code::InvalidArgument, "INVALID_ARGUMENT");
    let record = get(&mut client, &held).await.unwrap();
    assert_eq!(record.state, pb::RecordState::InProgress as i32);
    assert_eq!(app.db.row_count().await, 1);

    // At the limit it is accepted.
    let results = batch_acquire(
        &mut client,
        ids[..max]
            .iter()
            .map(|id| acquire_item(id, b"fp"))
            .collect(),
    )
    .await;
    assert!(
        results
            .iter()
            .all(|result| matches!(result, Ok(Outcome::Acquired(_))))
    );
}

/// Many batches, each holding every key, sent at the same moment over
/// several connections: exactly one item in all of them acquires each key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_batches_over_the_same_keys_give_exactly_one_holder_per_key() {
    const BATCHES: usize = 32;
    const KEYS: usize = 20;
    let app = spawn_app().await;
    let ids: Arc<Vec<pb::RecordId>> = Arc::new(
        (0..KEYS)
            .map(|_| record_id(&unique_key("batch-race")))
            .collect(),
    );
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(app.server.new_client().await);
    }
    let barrier = Arc::new(Barrier::new(BATCHES));
    let tasks: Vec<_> = (0..BATCHES)
        .map(|batch| {
            let mut client = clients[batch % clients.len()].clone();
            let (barrier, ids) = (barrier.clone(), ids.clone());
            tokio::spawn(async move {
                // Each batch in its own order, so rows meet in every order.
                let mut order: Vec<usize> = (0..KEYS).collect();
                order.rotate_left(batch % KEYS);
                if batch % 2 == 1 {
                    order.reverse();
                }
                let requests = order
                    .iter()
                    .map(|&i| acquire_item(&ids[i], b"fp"))
                    .collect();
                barrier.wait().await;
                let results = batch_acquire(&mut client, requests).await;
                order.into_iter().zip(results).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut holders = vec![Vec::new(); KEYS];
    for task in tasks {
        for (key, result) in task.await.unwrap() {
            match result.expect("no item fails") {
                Outcome::Acquired(acquired) => holders[key].push(acquired.fencing_token),
                Outcome::InProgress(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let mut client = app.server.client.clone();
    for (key, tokens) in holders.iter().enumerate() {
        assert_eq!(
            tokens.len(),
            1,
            "key {key} had holders with tokens {tokens:?}"
        );
        // The one holder holds the record's current token.
        let record = get(&mut client, &ids[key]).await.unwrap();
        assert_eq!(record.fencing_token, tokens[0]);
    }
}

/// A batched insert counts a new key's lease from the statement's start, and
/// may then wait for another of its keys. Answering with a lease that has
/// already passed would let a second caller take the key over at once, and
/// both would run the business logic.
///
/// Since a batch statement no longer waits for a held key (the key's call
/// runs alone, see `isolation.rs`), `fresh` is inserted at once, and its
/// lease passes while the BatchAcquire handler waits for `blocked`'s answer
/// to reply: the handler renews such leases before replying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_acquire_that_waited_past_its_lease_is_answered_with_a_live_one() {
    // One statement at a time, so the calls queued behind a stuck one share
    // the next statement.
    let app = spawn_app_with(|settings| settings.batch_workers = 1).await;
    let mut client = app.client.clone();
    let first_blocked = record_id(&unique_key("batch-blocked-first"));
    let blocked = record_id(&unique_key("batch-blocked"));
    let fresh = record_id(&unique_key("batch-fresh-leased"));
    acquire(&mut client, &first_blocked, b"fp").await;
    acquire(&mut client, &blocked, b"fp").await;

    let first_writer = idempotency_tests::hold_write(&app.db, &first_blocked.key).await;
    let writer = idempotency_tests::hold_write(&app.db, &blocked.key).await;
    let stuck = tokio::spawn({
        let (mut client, id) = (client.clone(), first_blocked.clone());
        async move { acquire(&mut client, &id, b"fp").await }
    });
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    let fresh_request = pb::AcquireRequest {
        lease: Some(idempotency_tests::seconds(1)),
        ..acquire_item(&fresh, b"fp")
    };
    let batch = tokio::spawn({
        let mut client = client.clone();
        let requests = vec![fresh_request.clone(), acquire_item(&blocked, b"fp")];
        async move { batch_acquire(&mut client, requests).await }
    });
    // Both items queue behind the stuck statement, then run in one that
    // inserts `fresh` and waits for `blocked` longer than `fresh`'s lease.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    first_writer.rollback().await.unwrap();
    stuck.await.unwrap();
    idempotency_tests::wait_for_lock_wait(&app.db).await;
    tokio::time::sleep(std::time::Duration::from_millis(1300)).await;
    assert!(!batch.is_finished(), "the batch did not wait for `blocked`");
    writer.rollback().await.unwrap();

    let results = batch.await.unwrap();
    let holder_token = token(results[0].as_ref().unwrap());
    assert!(matches!(
        results[1].as_ref().unwrap(),
        Outcome::InProgress(_)
    ));
    // A second caller right after finds the key held, not free to take over.
    let second = acquire_request(&mut client, fresh_request).await;
    assert!(matches!(second, Outcome::InProgress(_)), "{second:?}");
    complete(&mut client, &fresh, holder_token, response(201, "{}"))
        .await
        .expect("the holder's token still holds the record");
    // Renewed once, when its statement's answer came: not a second time
    // when the batch replied, as the renewal had just written the lease.
    let page = http_get(app.server.metrics_addr, "/metrics").await;
    let renewals = metric_value(
        &page,
        r#"idempotency_db_query_duration_seconds_count{query="renew"}"#,
    );
    assert_eq!(renewals, Some(1.0));
}

#[tokio::test]
async fn a_batch_reply_stays_within_the_message_limit_and_what_does_not_fit_is_sent_alone() {
    let app = spawn_app().await;
    // A stub with gRPC's default 4 MiB receive limit, as clients in most
    // languages have, which is also the server's message limit.
    let mut client = app.server.client.clone();
    let large = pb::StoredResponse {
        status_code: 200,
        body: vec![b'x'; 1_000_000],
        ..Default::default()
    };
    let id = record_id(&unique_key("large-replay"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    complete(&mut client, &id, t, large.clone()).await.unwrap();
    let fresh = [
        record_id(&unique_key("fresh")),
        record_id(&unique_key("fresh")),
    ];

    // Eight replays of a 1 MB response (8 MB of answers) and two new keys.
    let mut requests: Vec<_> = fresh.iter().map(|id| acquire_item(id, b"fp")).collect();
    requests.extend((0..8).map(|_| acquire_item(&id, b"fp")));
    let outcomes = batch_acquire(&mut client, requests).await;

    for fresh in &outcomes[..2] {
        assert!(matches!(fresh, Ok(Outcome::Acquired(_))), "{fresh:?}");
    }
    // Items of one record run in order, so the first four replays fill the
    // reply (4 MiB less room for errors) and the last four are sent back.
    for (item, outcome) in outcomes.into_iter().skip(2).enumerate() {
        if item < 4 {
            match outcome {
                Ok(Outcome::Completed(completed)) => {
                    assert_eq!(completed.response.as_ref(), Some(&large));
                }
                other => panic!("replay {item}: {other:?}"),
            }
        } else {
            assert_error(outcome, Code::ResourceExhausted, "BATCH_REPLY_FULL");
        }
    }
    // Alone, a deferred item is answered.
    match acquire(&mut client, &id, b"fp").await {
        Outcome::Completed(completed) => assert_eq!(completed.response, Some(large)),
        other => panic!("{other:?}"),
    }
}

/// An ACQUIRED answer is never dropped from a full reply: its caller would
/// never learn its token, and a resend would find the key held (IN_PROGRESS)
/// until the lease passed. Replays, safe to send again, are dropped instead.
#[tokio::test]
async fn a_full_batch_reply_still_holds_every_acquired_item() {
    // The server's reply budget: its 4 MiB message limit less 64 KiB of
    // room for errors, and 16 bytes of framing per answer.
    const BUDGET: usize = 4 * 1024 * 1024 - 64 * 1024;
    const FRAMING: usize = 16;
    // Four replays leave about this much of the budget, which the new
    // keys' answers after them overrun many times over.
    const LEFT: usize = 1_000;
    const FRESH: usize = 90;
    let app = spawn_app().await;
    let mut client = app.server.client.clone();
    let answer = |body: usize| {
        pb::AcquireResponse {
            outcome: Some(Outcome::Completed(pb::Completed {
                response: Some(pb::StoredResponse {
                    status_code: 200,
                    body: vec![b'x'; body],
                    ..Default::default()
                }),
                completed_at: Some(prost_types::Timestamp {
                    seconds: 4_000_000_000,
                    nanos: 999_999_999,
                }),
            })),
        }
        .encoded_len()
    };
    let envelope = answer(1_000_000) - 1_000_000;
    let body = (BUDGET - LEFT) / 4 - FRAMING - envelope;
    let large = pb::StoredResponse {
        status_code: 200,
        body: vec![b'x'; body],
        ..Default::default()
    };
    let id = record_id(&unique_key("large-replay"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    complete(&mut client, &id, t, large.clone()).await.unwrap();

    // Eight replays of it, then the new keys.
    let mut requests: Vec<_> = (0..8).map(|_| acquire_item(&id, b"fp")).collect();
    requests.extend((0..FRESH).map(|_| acquire_item(&record_id(&unique_key("fresh")), b"fp")));
    let outcomes = batch_acquire(&mut client, requests).await;

    for (item, outcome) in outcomes[..8].iter().enumerate() {
        if item < 4 {
            assert!(
                matches!(outcome, Ok(Outcome::Completed(_))),
                "replay {item}"
            );
        } else {
            let outcome = outcome.as_ref().map(|_| ()).map_err(Clone::clone);
            assert_error(outcome, Code::ResourceExhausted, "BATCH_REPLY_FULL");
        }
    }
    for (item, outcome) in outcomes[8..].iter().enumerate() {
        assert!(
            matches!(outcome, Ok(Outcome::Acquired(_))),
            "new key {item}: {outcome:?}"
        );
    }
}
