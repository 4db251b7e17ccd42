//! The hot path looks records up by key; it never reads the whole table,
//! not even on a new table without statistics, where a plan cached by a
//! prepared statement would otherwise scan the table until the next ANALYZE.

use std::sync::Arc;

use idempotency_tests::{record_id, response, spawn_app, unique_key};
use tokio::sync::Barrier;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_table_is_read_by_key_never_scanned() {
    let app = spawn_app().await;
    // The gauges count a small table's rows exactly, which no index can
    // answer: let their first run (the next is an hour later) see it empty.
    wait_for_metric(
        &app.server,
        "idempotency_db_query_duration_seconds_count{query=\"table_stats\"}",
        |runs| runs >= 1.0,
    )
    .await;
    // A table a few minutes old: some rows, not yet analyzed. On it the
    // planner once preferred reading every row through the `expires_at`
    // index to a key lookup per row, for every Complete.
    const YOUNG_ROWS: i64 = 300;
    sqlx::query(
        "INSERT INTO idempotency_records
           (namespace, operation, subject, key, state, fingerprint, fencing_token,
            created_at, expires_at, lease_expires_at)
         SELECT 'seed', 'POST /seed', 'seed', 'seed-key-' || i, 'in_progress', '', 1,
                now(), now() + interval '1 day', now() + interval '1 minute'
         FROM generate_series(1, $1) AS i",
    )
    .bind(YOUNG_ROWS)
    .execute(&app.db.pool)
    .await
    .unwrap();
    // Young for the whole test: no statistics arrive midway.
    sqlx::query("ALTER TABLE idempotency_records SET (autovacuum_enabled = false)")
        .execute(&app.db.pool)
        .await
        .unwrap();
    let barrier = Arc::new(Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (mut client, barrier) = (app.server.client.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                // Enough rounds that the prepared statements switch to
                // their generic plans (after five executions).
                for _ in 0..10 {
                    let id = record_id(&unique_key("plan"));
                    let t = token(&acquire(&mut client, &id, b"fp").await);
                    complete(&mut client, &id, t, response(201, "{}"))
                        .await
                        .unwrap();
                    assert!(matches!(
                        acquire(&mut client, &id, b"fp").await,
                        idempotency_client::pb::acquire_response::Outcome::Completed(_)
                    ));
                    renew(&mut client, &id, t, 5).await.unwrap_err();
                    get(&mut client, &id).await.unwrap();
                    // A released key, taken over by the next Acquire.
                    let id = record_id(&unique_key("plan-retry"));
                    let t = token(&acquire(&mut client, &id, b"fp").await);
                    fail(&mut client, &id, t, true, None).await.unwrap();
                    assert_eq!(token(&acquire(&mut client, &id, b"fp").await), t + 1);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    // The server's connections report their statistics as they exit: wait
    // until none of them is left.
    app.server.stop().await;
    let mut exited = false;
    for _ in 0..100 {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1",
        )
        .bind(idempotency_server::db::APPLICATION_NAME)
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        if open == 0 {
            exited = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        exited,
        "the server's connections were still open after 10 s"
    );
    // Rows read by sequential scans: the migration's index builds scan the
    // table too, but while it is empty.
    let (seq_rows, index_scans): (i64, i64) = sqlx::query_as(
        "SELECT seq_tup_read, coalesce(idx_scan, 0) FROM pg_stat_user_tables
         WHERE relname = 'idempotency_records'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert!(index_scans > 0, "the statistics were not reported");
    assert_eq!(
        seq_rows, 0,
        "statements scanned the table ({index_scans} index scans)"
    );
    // The gauges read the oldest expiry through the `expires_at` index, a
    // row or so per run; a statement scanning the table through it reads
    // every row, each time.
    let expires_index_rows: i64 = sqlx::query_scalar(
        "SELECT idx_tup_read FROM pg_stat_user_indexes
         WHERE indexrelname = 'idempotency_records_expires_at_idx'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert!(
        expires_index_rows < YOUNG_ROWS,
        "statements read {expires_index_rows} rows through the expires_at index"
    );
}
