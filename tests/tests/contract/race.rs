//! Concurrent duplicates never both run the business logic. Real concurrency:
//! a multi-thread runtime, several HTTP/2 connections, tasks released together.
//! Each race runs against one server, and against two replicas on one
//! database with the callers' connections spread over both.

use std::sync::Arc;

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_tests::{record_id, response, spawn_app, unique_key};
use tokio::sync::Barrier;

use crate::{replicas::Replicas, support::*};

const CALLERS: usize = 64;
const CONNECTIONS: usize = 8;

/// Sends `CALLERS` Acquires for `id` at the same moment and returns every outcome.
async fn acquire_all_at_once(
    clients: &[Client],
    id: &pb::RecordId,
    fingerprint: &'static [u8],
) -> Vec<Outcome> {
    let barrier = Arc::new(Barrier::new(CALLERS));
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let mut client = clients[caller % clients.len()].clone();
            let barrier = barrier.clone();
            let id = id.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                acquire(&mut client, &id, fingerprint).await
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(CALLERS);
    for task in tasks {
        outcomes.push(task.await.expect("caller task"));
    }
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_acquires_give_exactly_one_holder_then_identical_replays() {
    one_holder_then_identical_replays(&Replicas::start(1, &[]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_acquires_give_exactly_one_holder_without_batching_too() {
    one_holder_then_identical_replays(&Replicas::start(1, &["--batching", "false"]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_acquires_over_two_replicas_give_exactly_one_holder_then_identical_replays()
 {
    one_holder_then_identical_replays(&Replicas::start(2, &[]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_acquires_over_two_replicas_give_exactly_one_holder_without_batching_too()
 {
    one_holder_then_identical_replays(&Replicas::start(2, &["--batching", "false"]).await).await;
}

/// Without the replay cache each round's replays read the key in Postgres,
/// which turns the server's lone Acquires to reading the key alone, and
/// inserting it only when absent (so do the callers told a key is in
/// progress): the rounds after the first race on those statements, each
/// caller alone in its statement. (From outside the server cannot tell
/// which statements ran: `read_first.rs` asserts the turn on the store
/// itself, and races each mode there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_acquires_give_exactly_one_holder_once_replays_turned_the_server_to_reading_first()
 {
    let flags = ["--replay-cache-bytes", "0", "--batching", "false"];
    one_holder_then_identical_replays(&Replicas::start(1, &flags).await).await;
}

/// Rounds of `CALLERS` racing on a new key: one holder, every other caller
/// told it is in progress; once it completes, every caller, on any
/// replica, replays its response (from the database or a replay cache).
async fn one_holder_then_identical_replays(replicas: &Replicas) {
    let clients = replicas.clients(CONNECTIONS).await;

    for round in 0..20 {
        let id = record_id(&unique_key(&format!("race{round}")));

        let outcomes = acquire_all_at_once(&clients, &id, b"same request").await;

        let acquired: Vec<_> = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Acquired(_)))
            .collect();
        let in_progress = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::InProgress(_)))
            .count();
        assert_eq!(acquired.len(), 1, "round {round}: {outcomes:?}");
        assert_eq!(in_progress, CALLERS - 1, "round {round}: {outcomes:?}");
        let holder = token(acquired[0]);

        let stored = response(201, &format!(r#"{{"payment":"{round}"}}"#));
        // The holder completes on the replica of this round, whichever.
        let mut completer = clients[round % clients.len()].clone();
        complete(&mut completer, &id, holder, stored.clone())
            .await
            .unwrap();

        let replays = acquire_all_at_once(&clients, &id, b"same request").await;

        for outcome in &replays {
            let Outcome::Completed(completed) = outcome else {
                panic!("round {round}: {outcome:?}")
            };
            assert_eq!(completed.response.as_ref(), Some(&stored), "round {round}");
        }
    }
    // Each replica answered its share of the callers: all but one of them
    // in every round were told the key is in progress.
    let share = CALLERS / replicas.len();
    for replica in 0..replicas.len() {
        let page = replicas.metrics(replica).await;
        let in_progress = idempotency_tests::metric_value(
            &page,
            r#"idempotency_requests_total{rpc="Acquire",outcome="in_progress",namespace="payments"}"#,
        );
        assert!(
            in_progress >= Some((20 * (share - 1)) as f64),
            "replica {replica}: {in_progress:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_takeovers_of_a_lapsed_lease_give_exactly_one_new_holder() {
    takeovers_give_one_new_holder(&Replicas::start(1, &[]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_takeovers_over_two_replicas_of_a_lapsed_lease_give_exactly_one_new_holder() {
    takeovers_give_one_new_holder(&Replicas::start(2, &[]).await).await;
}

/// Leases taken on the first replica lapse; `CALLERS`, spread over every
/// replica, race to take each over: one wins, with a newer token.
async fn takeovers_give_one_new_holder(replicas: &Replicas) {
    let clients = replicas.clients(CONNECTIONS).await;
    let ids: Vec<_> = (0..5)
        .map(|n| record_id(&unique_key(&format!("lapsed{n}"))))
        .collect();
    let mut lapsed = Vec::new();
    for id in &ids {
        lapsed.push(token(
            &acquire_leased(&mut clients[0].clone(), id, b"fp", 1).await,
        ));
    }
    wait_past(1).await;

    for (id, lapsed) in ids.iter().zip(lapsed) {
        let outcomes = acquire_all_at_once(&clients, id, b"fp").await;

        let tokens: Vec<u64> = outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Acquired(a) => Some(a.fencing_token),
                _ => None,
            })
            .collect();
        assert_eq!(tokens.len(), 1, "{outcomes:?}");
        assert!(tokens[0] > lapsed, "{tokens:?} after {lapsed}");
        let mut client = clients[0].clone();
        assert_eq!(get(&mut client, id).await.unwrap().fencing_token, tokens[0]);
        let in_progress = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::InProgress(_)))
            .count();
        assert_eq!(in_progress, CALLERS - 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_batches_with_many_keys_and_duplicates_give_exactly_one_holder_per_key() {
    full_batches_give_one_holder_per_key(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_batches_on_two_replicas_with_many_keys_and_duplicates_give_exactly_one_holder_per_key()
 {
    full_batches_give_one_holder_per_key(2).await;
}

/// `KEYS` new keys, `DUPLICATES` callers each, spread over `count` replicas
/// each with one statement worker: batches of several calls, duplicates
/// among them, and one holder per key.
async fn full_batches_give_one_holder_per_key(count: usize) {
    const KEYS: usize = 16;
    const DUPLICATES: usize = 8;
    // One worker: while its statement runs, every other call queues, so
    // batches fill up and carry duplicates of the same keys.
    let replicas =
        Replicas::start(count, &["--batch-workers", "1", "--batch-max-size", "64"]).await;
    let clients = replicas.clients(CONNECTIONS).await;
    let ids: Vec<_> = (0..KEYS)
        .map(|n| record_id(&unique_key(&format!("batch{n}"))))
        .collect();
    let barrier = Arc::new(Barrier::new(KEYS * DUPLICATES));

    let tasks: Vec<_> = (0..KEYS * DUPLICATES)
        .map(|caller| {
            let mut client = clients[caller % clients.len()].clone();
            let id = ids[caller % KEYS].clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                (id.key.clone(), acquire(&mut client, &id, b"same").await)
            })
        })
        .collect();
    let mut acquired = std::collections::HashMap::<String, Vec<u64>>::new();
    for task in tasks {
        let (key, outcome) = task.await.unwrap();
        match outcome {
            Outcome::Acquired(a) => acquired.entry(key).or_default().push(a.fencing_token),
            Outcome::InProgress(_) => {}
            other => panic!("{other:?}"),
        }
    }

    assert_eq!(acquired.len(), KEYS, "{acquired:?}");
    assert!(
        acquired.values().all(|tokens| tokens.len() == 1),
        "{acquired:?}"
    );
    // Each holder holds its record's current token: nobody took it over.
    let mut client = clients[0].clone();
    for id in &ids {
        let record = get(&mut client, id).await.unwrap();
        assert_eq!(acquired[&id.key], [record.fencing_token], "{}", id.key);
    }
    // Every replica's statements carried several calls each.
    for replica in 0..replicas.len() {
        let page = replicas.metrics(replica).await;
        let value = |series: &str| idempotency_tests::metric_value(&page, series).unwrap_or(0.0);
        let (sum, statements) = (
            value(r#"idempotency_db_batch_size_sum{query="acquire"}"#),
            value(r#"idempotency_db_batch_size_count{query="acquire"}"#),
        );
        assert!(
            statements > 0.0 && sum / statements > 1.5,
            "replica {replica}'s statements did not batch: {sum} calls in {statements}"
        );
    }
}

/// Group commit runs one statement per kind at a time; a call waiting on a
/// row lock must not hold up every other call. The shared statement passes
/// its row over, and the call waits alone (see `isolation.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_stuck_on_a_row_lock_does_not_hold_up_other_calls() {
    let app = spawn_app().await;
    let mut client = app.client.clone();

    let stuck = record_id(&unique_key("stuck"));
    let stuck_token = token(&acquire(&mut client, &stuck, b"fp").await);
    let lock = idempotency_tests::lock_record(&app.db, &stuck.key).await;
    let stuck_complete = {
        let (mut client, stuck) = (client.clone(), stuck.clone());
        tokio::spawn(async move {
            complete(&mut client, &stuck, stuck_token, response(201, "{}")).await
        })
    };
    idempotency_tests::wait_for_lock_wait(&app.db).await;

    // Completes of other records go through while that one waits.
    for n in 0..3 {
        let id = record_id(&unique_key(&format!("free-{n}")));
        let fencing_token = token(&acquire(&mut client, &id, b"fp").await);
        tokio::time::timeout(
            std::time::Duration::from_secs(3),
            complete(&mut client, &id, fencing_token, response(201, "{}")),
        )
        .await
        .expect("not held up by the stuck statement")
        .expect("completed");
    }
    assert!(!stuck_complete.is_finished());
    // Its shared statement gave up on the row after BATCH_ROW_WAIT and the
    // call waits alone: also a call alone in its statement (the single-row
    // form) sets the short lock wait before it waits.
    wait_for_metric(
        &app.server,
        r#"idempotency_db_calls_alone_total{query="finish"}"#,
        |v| v == 1.0,
    )
    .await;
    drop(lock);
    stuck_complete
        .await
        .unwrap()
        .expect("completes once the lock is gone");
}

/// The same for a lone Acquire whose key another transaction is writing:
/// its statement waits for the writer only briefly, then the call waits
/// alone while Acquires of other keys go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_acquire_of_a_key_being_written_waits_alone() {
    let app = spawn_app().await;
    let mut client = app.client.clone();
    let busy = record_id(&unique_key("busy"));
    acquire(&mut client, &busy, b"fp").await;
    let writer = idempotency_tests::hold_write(&app.db, &busy.key).await;
    let waiting = {
        let (mut client, busy) = (client.clone(), busy.clone());
        tokio::spawn(async move { acquire(&mut client, &busy, b"fp").await })
    };
    wait_for_metric(
        &app.server,
        r#"idempotency_db_calls_alone_total{query="acquire"}"#,
        |v| v == 1.0,
    )
    .await;
    for n in 0..3 {
        let id = record_id(&unique_key(&format!("fresh-{n}")));
        let outcome = tokio::time::timeout(
            std::time::Duration::from_secs(3),
            acquire(&mut client, &id, b"fp"),
        )
        .await
        .expect("not held up by the waiting Acquire");
        assert!(matches!(outcome, Outcome::Acquired(_)), "{outcome:?}");
    }
    assert!(!waiting.is_finished());
    writer.rollback().await.unwrap();
    let outcome = waiting.await.unwrap();
    assert!(matches!(outcome, Outcome::InProgress(_)), "{outcome:?}");
}
