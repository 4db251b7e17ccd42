//! A database that stops answering without closing anything (its host
//! vanished, its processes stopped): Postgres' own statement timeout never
//! fires, so the server bounds every statement itself.

use std::time::{Duration, Instant};

use idempotency_tests::{
    TestDb, assert_error, record_id, response, server_behind_proxy_with, test_settings, unique_key,
};
use tonic::Code;

use crate::support::*;

/// Far above what a statement may take here (a statement timeout of a
/// second, plus the server's margin, plus waiting for a connection), far
/// below a freeze that nothing bounds.
const BOUND: Duration = Duration::from_secs(10);

/// Runs `call`, asserting that it answers within [`BOUND`].
async fn within_bound<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let started = Instant::now();
    let answer = tokio::time::timeout(BOUND * 3, call)
        .await
        .unwrap_or_else(|_| panic!("{what} never answered"));
    assert!(
        started.elapsed() < BOUND,
        "{what} answered only after {:?}",
        started.elapsed()
    );
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_database_answers_unavailable_in_bounded_time_and_serves_again_after_it_thaws() {
    let db = TestDb::new().await;
    let mut settings = test_settings(&db);
    settings.database.statement_timeout = Duration::from_secs(1);
    settings.database.db_acquire_timeout = Duration::from_secs(1);
    let (server, proxy) = server_behind_proxy_with(&db, settings).await;
    let mut client = server.client.clone();
    // Connections open, kept by the batch workers and idle in the pool.
    let mut held = Vec::new();
    for _ in 0..3 {
        let id = record_id(&unique_key("frozen-held"));
        let fencing_token = token(&acquire(&mut client, &id, b"fp").await);
        held.push((id, fencing_token));
    }
    let done = record_id(&unique_key("frozen-done"));
    let done_token = token(&acquire(&mut client, &done, b"fp").await);
    complete(&mut client, &done, done_token, response(201, "{}"))
        .await
        .unwrap();

    proxy.freeze();

    // Kept connections, idle ones, then new ones (whose handshake hangs):
    // every call answers UNAVAILABLE in time.
    for (id, fencing_token) in &held {
        let acquired = within_bound(
            "Acquire",
            try_acquire(&mut client, &record_id(&unique_key("frozen-new")), b"fp"),
        )
        .await;
        assert_error(acquired, Code::Unavailable, "DATABASE_UNAVAILABLE");
        let completed = within_bound(
            "Complete",
            complete(&mut client, id, *fencing_token, response(201, "{}")),
        )
        .await;
        assert_error(completed, Code::Unavailable, "DATABASE_UNAVAILABLE");
        let read = within_bound("Get", get(&mut client, &done)).await;
        assert_error(read, Code::Unavailable, "DATABASE_UNAVAILABLE");
    }

    // The connections left in the middle of a statement were closed.
    wait_for_metric(
        &server,
        "idempotency_db_connections_abandoned_total",
        |closed| closed >= 1.0,
    )
    .await;

    proxy.thaw();

    // No connection left in the middle of a statement answers a later call.
    for _ in 0..10 {
        let id = record_id(&unique_key("frozen-after"));
        let outcome = within_bound("Acquire", try_acquire(&mut client, &id, b"fp")).await;
        let outcome = outcome.expect("Acquire after the thaw").outcome;
        let fencing_token = token(&outcome.expect("an outcome"));
        within_bound(
            "Complete",
            complete(&mut client, &id, fencing_token, response(201, "{}")),
        )
        .await
        .expect("Complete after the thaw");
        let record = within_bound("Get", get(&mut client, &done)).await;
        assert_eq!(
            record.expect("Get after the thaw").fencing_token,
            done_token
        );
    }
}
