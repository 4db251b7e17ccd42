//! Graceful shutdown: in-flight calls finish, new ones are refused.

use std::time::Duration;

use idempotency_tests::{record_id, response, spawn_app, spawn_app_with, unique_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_call_finishes_after_the_shutdown_signal_and_new_calls_are_refused() {
    let mut app = spawn_app().await;
    let mut client = app.client.clone();
    let id = record_id(&unique_key("drain"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    // Hold the row lock so that the Complete below is still running in the
    // database when the signal arrives.
    let blocker = idempotency_tests::lock_record(&app.db, &id.key).await;
    let in_flight = tokio::spawn({
        let mut client = client.clone();
        let id = id.clone();
        async move { complete(&mut client, &id, t, response(201, "drained")).await }
    });
    idempotency_tests::wait_for_lock_wait(&app.db).await;

    app.server.signal_shutdown();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let new_connection =
        tonic::transport::Channel::from_shared(format!("http://{}", app.server.addr))
            .unwrap()
            .connect()
            .await;
    assert!(
        new_connection.is_err(),
        "a new connection was accepted after the signal"
    );
    assert!(!in_flight.is_finished(), "the call was cut short");
    blocker.rollback().await.unwrap();
    let finished = in_flight.await.unwrap();
    assert!(finished.is_ok(), "{finished:?}");
    tokio::time::timeout(Duration::from_secs(10), app.server.stop())
        .await
        .expect("the server stopped");
    let completed =
        sqlx::query_scalar::<_, String>("SELECT state FROM idempotency_records WHERE key = $1")
            .bind(&id.key)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(completed, "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_is_bounded_by_the_drain_timeout_even_when_a_call_is_stuck() {
    let mut app =
        spawn_app_with(|settings| settings.drain_timeout = Duration::from_millis(300)).await;
    let mut client = app.client.clone();
    let id = record_id(&unique_key("stuck"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    let blocker = idempotency_tests::lock_record(&app.db, &id.key).await;
    let _stuck =
        tokio::spawn(async move { complete(&mut client, &id, t, response(201, "stuck")).await });
    idempotency_tests::wait_for_lock_wait(&app.db).await;

    app.server.signal_shutdown();

    // The stuck statement would run until the 5 s statement timeout; the
    // server must stop well before, while the lock is still held.
    tokio::time::timeout(Duration::from_secs(4), app.server.stop())
        .await
        .expect("the server stopped within its drain timeout");
    blocker.rollback().await.unwrap();
}
