//! An Acquire alone in its statement reads its key first once more than
//! about a quarter of lone Acquires lately found their key (replays that
//! missed the replay cache, duplicates), reads it alone and inserts in a
//! second statement above 13/16, and inserts first otherwise. All
//! must answer alike: a new key is created, an existing one read and left
//! unwritten, a key another transaction creates meanwhile is read or asked
//! for again, and of concurrent callers of one key exactly one creates it.
//! The store on a real Postgres, in each mode.

use std::{sync::Arc, time::Duration};

use idempotency_server::{
    domain::{Fingerprint, RecordId, RecordState, StoredResponse},
    store::{AcquireAttempt, AcquireInput, FinishInput, LoneAcquire, Store},
};
use idempotency_tests::{TestDb, unique_key, wait_for_lock_wait};
use tokio::sync::Barrier;

fn input(key: &str) -> Arc<AcquireInput> {
    let id = RecordId::parse(
        "id",
        "read-first".into(),
        "POST /payments".into(),
        "user-1".into(),
        key.into(),
    )
    .unwrap();
    Arc::new(AcquireInput {
        id,
        fingerprint: Fingerprint::parse("fingerprint", vec![7; 32]).unwrap(),
        ttl: Duration::from_secs(3600),
        lease: Duration::from_secs(60),
    })
}

/// A store in `mode`, as a fresh one turns to it: a new one inserts first;
/// five lone Acquires of an existing key turn it to reading first, forty
/// to the plain read.
async fn store_in(db: &TestDb, mode: LoneAcquire, batching: bool) -> Store {
    let store = if batching {
        Store::with_batching(db.pool.clone(), Default::default())
    } else {
        Store::new(db.pool.clone())
    };
    assert_eq!(
        store.lone_acquire(),
        LoneAcquire::InsertFirst,
        "a new store inserts first"
    );
    let replays = match mode {
        LoneAcquire::InsertFirst => return store,
        LoneAcquire::ReadFirst => 5,
        LoneAcquire::ReadThenInsert => 40,
    };
    let existing = input(&unique_key("existing"));
    inserted(store.insert_or_read(existing.clone()).await.unwrap());
    for _ in 0..replays {
        existing_row(store.insert_or_read(existing.clone()).await.unwrap());
    }
    assert_eq!(store.lone_acquire(), mode, "after {replays} replays");
    store
}

/// `store.insert_or_read`, checking first that the store is in `mode`.
async fn acquire_in(store: &Store, mode: LoneAcquire, input: Arc<AcquireInput>) -> AcquireAttempt {
    assert_eq!(store.lone_acquire(), mode, "the store left {mode:?}");
    store.insert_or_read(input).await.unwrap()
}

fn inserted(attempt: AcquireAttempt) -> u64 {
    match attempt {
        AcquireAttempt::Inserted(row) => row.fencing_token(),
        other => panic!("expected the key created, got {other:?}"),
    }
}

fn existing_row(attempt: AcquireAttempt) -> idempotency_server::store::RecordRow {
    match attempt {
        AcquireAttempt::Existing(row) => row,
        other => panic!("expected the key read, got {other:?}"),
    }
}

/// The row's version: unchanged when a statement wrote nothing to it.
async fn row_version(db: &TestDb, key: &str) -> String {
    sqlx::query_scalar("SELECT xmin::text FROM idempotency_records WHERE key = $1")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn answers_alike(mode: LoneAcquire) {
    let db = TestDb::new().await;
    let store = store_in(&db, mode, false).await;

    // A new key is created, in progress, under the token returned.
    let key = unique_key("new");
    let token = inserted(acquire_in(&store, mode, input(&key)).await);
    let (state, stored_token): (String, i64) =
        sqlx::query_as("SELECT state, fencing_token FROM idempotency_records WHERE key = $1")
            .bind(&key)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), stored_token as u64),
        ("in_progress", token)
    );

    // In progress: read, not written.
    let version = row_version(&db, &key).await;
    let row = existing_row(acquire_in(&store, mode, input(&key)).await);
    assert_eq!(
        (row.state.as_str(), row.fencing_token as u64),
        ("in_progress", token)
    );
    assert_eq!(row_version(&db, &key).await, version, "{mode:?}");

    // Completed: read with its response, not written.
    let response = StoredResponse {
        status_code: 201,
        body: b"charged".to_vec(),
        headers: Default::default(),
    };
    let finish = Arc::new(FinishInput {
        id: input(&key).id.clone(),
        fencing_token: token,
        state: RecordState::Completed,
        response: response.clone(),
    });
    assert!(store.finish(finish).await.unwrap().is_some());
    let version = row_version(&db, &key).await;
    let row = existing_row(acquire_in(&store, mode, input(&key)).await);
    assert_eq!(row.state, "completed");
    assert_eq!(row.response().unwrap(), Some(response));
    assert_eq!(row_version(&db, &key).await, version, "{mode:?}");

    // Expired: read as it is (the engine then takes it over), not written.
    let expired = unique_key("expired");
    sqlx::query(
        "INSERT INTO idempotency_records
             (namespace, operation, subject, key, state, fingerprint, fencing_token,
              created_at, expires_at, completed_at, response_status, response_body,
              response_headers)
         VALUES ('read-first', 'POST /payments', 'user-1', $1, 'completed', '\\x07', 1,
                 now() - interval '1 day', now() - interval '1 minute', now(), 201, '', '{}')",
    )
    .bind(&expired)
    .execute(&db.pool)
    .await
    .unwrap();
    let version = row_version(&db, &expired).await;
    let row = existing_row(acquire_in(&store, mode, input(&expired)).await);
    assert!(row.is_expired(), "{row:?}");
    assert_eq!(row_version(&db, &expired).await, version, "{mode:?}");
}

#[tokio::test]
async fn inserting_first_creates_new_keys_and_reads_existing_ones_without_writing_them() {
    answers_alike(LoneAcquire::InsertFirst).await;
}

#[tokio::test]
async fn reading_first_creates_new_keys_and_reads_existing_ones_without_writing_them() {
    answers_alike(LoneAcquire::ReadFirst).await;
}

#[tokio::test]
async fn the_plain_read_creates_new_keys_and_reads_existing_ones_without_writing_them() {
    answers_alike(LoneAcquire::ReadThenInsert).await;
}

#[tokio::test]
async fn a_store_reads_after_replays_and_inserts_first_again_after_new_keys() {
    let db = TestDb::new().await;
    let store = store_in(&db, LoneAcquire::InsertFirst, true).await;
    let replayed = input(&unique_key("replayed"));
    inserted(store.insert_or_read(replayed.clone()).await.unwrap());
    for _ in 0..100 {
        existing_row(store.insert_or_read(replayed.clone()).await.unwrap());
    }
    assert_eq!(store.lone_acquire(), LoneAcquire::ReadThenInsert);

    // The mode each new key ran in, and what it left.
    let mut keys = Vec::new();
    let mut modes = Vec::new();
    for _ in 0..22 {
        let key = unique_key("new");
        modes.push(store.lone_acquire());
        inserted(store.insert_or_read(input(&key)).await.unwrap());
        keys.push(key);
    }
    let expected: Vec<_> = [LoneAcquire::ReadThenInsert; 4]
        .into_iter()
        .chain([LoneAcquire::ReadFirst; 18])
        .collect();
    assert_eq!(
        modes, expected,
        "four new keys turn it to reading first, about twenty more back"
    );
    assert_eq!(
        store.lone_acquire(),
        LoneAcquire::InsertFirst,
        "the 22nd new key turns it back"
    );

    // The keys created while reading are there, each once.
    let created: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_records WHERE key = ANY($1) AND state = 'in_progress'",
    )
    .bind(&keys)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(created, 22);
}

/// Another transaction creates the key after the statement's snapshot and
/// commits while the statement's insert waits for it.
async fn key_created_meanwhile(mode: LoneAcquire) -> AcquireAttempt {
    let db = TestDb::new().await;
    let store = store_in(&db, mode, false).await;
    let key = unique_key("meanwhile");
    let mut other = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_records
             (namespace, operation, subject, key, state, fingerprint, fencing_token,
              created_at, expires_at, lease_expires_at)
         VALUES ('read-first', 'POST /payments', 'user-1', $1, 'in_progress', '\\x07', 1,
                 now(), now() + interval '1 hour', now() + interval '1 minute')",
    )
    .bind(&key)
    .execute(&mut *other)
    .await
    .unwrap();

    let asking = tokio::spawn({
        let store = store.clone();
        let input = input(&key);
        async move { store.insert_or_read(input).await.unwrap() }
    });
    wait_for_lock_wait(&db).await;
    other.commit().await.unwrap();
    asking.await.unwrap()
}

#[tokio::test]
async fn reading_first_asks_again_for_a_key_created_after_its_read() {
    // Neither read (the snapshot is older) nor inserted (the key exists by
    // then): the engine asks again, and then reads it.
    let attempt = key_created_meanwhile(LoneAcquire::ReadFirst).await;
    assert!(matches!(attempt, AcquireAttempt::Raced), "{attempt:?}");
}

#[tokio::test]
async fn inserting_first_reads_a_key_created_while_it_waited() {
    let attempt = key_created_meanwhile(LoneAcquire::InsertFirst).await;
    let row = existing_row(attempt);
    assert_eq!(row.fencing_token, 1);
}

#[tokio::test]
async fn the_plain_read_then_insert_reads_a_key_created_while_the_insert_waited() {
    // The read finds nothing (the other transaction has not committed); the
    // insert waits for it, inserts nothing, and reads the key it committed.
    let attempt = key_created_meanwhile(LoneAcquire::ReadThenInsert).await;
    let row = existing_row(attempt);
    assert_eq!(row.fencing_token, 1);
}

/// Callers of one new key at once, each a lone statement on a connection
/// of its own (no batching), or sharing statements (batching): exactly one
/// creates it.
async fn one_creator(mode: LoneAcquire, batching: bool) {
    const CALLERS: usize = 32;
    let db = TestDb::new().await;
    let store = store_in(&db, mode, batching).await;
    let key = unique_key("race");
    let barrier = Arc::new(Barrier::new(CALLERS));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (store, barrier, input) = (store.clone(), barrier.clone(), input(&key));
            tokio::spawn(async move {
                barrier.wait().await;
                // A raced call asks again, as the engine does.
                loop {
                    match store.insert_or_read(input.clone()).await.unwrap() {
                        AcquireAttempt::Raced => continue,
                        attempt => return attempt,
                    }
                }
            })
        })
        .collect();
    let mut created = 0;
    for caller in callers {
        match caller.await.unwrap() {
            AcquireAttempt::Inserted(_) => created += 1,
            AcquireAttempt::Existing(row) => assert_eq!(row.state, "in_progress"),
            AcquireAttempt::Raced => unreachable!(),
        }
    }
    assert_eq!(created, 1, "{mode:?}, batching {batching}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_concurrent_lone_callers_of_a_new_key_one_creates_it_reading_first() {
    one_creator(LoneAcquire::ReadFirst, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_concurrent_lone_callers_of_a_new_key_one_creates_it_inserting_first() {
    one_creator(LoneAcquire::InsertFirst, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_concurrent_batched_callers_of_a_new_key_one_creates_it_reading_first() {
    one_creator(LoneAcquire::ReadFirst, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_concurrent_lone_callers_of_a_new_key_one_creates_it_with_the_plain_read() {
    one_creator(LoneAcquire::ReadThenInsert, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_concurrent_batched_callers_of_a_new_key_one_creates_it_with_the_plain_read() {
    one_creator(LoneAcquire::ReadThenInsert, true).await;
}
