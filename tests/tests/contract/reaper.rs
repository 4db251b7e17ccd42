//! Cleanup: expired records are deleted in batches by one replica at a time,
//! and nothing depends on it for correctness.

use std::time::Duration;

use idempotency_server::{
    maintenance,
    store::reaper::{self, ReapLimits, ReapReport},
    telemetry,
};
use idempotency_tests::{TestDb, insert_records, metric_value};

fn limits(batch_size: u32) -> ReapLimits {
    ReapLimits {
        batch_size,
        batch_pause: Duration::from_millis(20),
        max_per_run: 1_000_000,
    }
}

async fn count(db: &TestDb, namespace: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE namespace = $1")
        .bind(namespace)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn thousands_of_expired_records_are_deleted_in_batches_and_live_ones_stay() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "expired", 5000, 60).await;
    insert_records(&db.pool, "live", 300, -3600).await;

    let report = reaper::reap_once(&db.pool, &limits(700)).await.unwrap();

    let ReapReport::Reaped {
        deleted, batches, ..
    } = report
    else {
        panic!("{report:?}")
    };
    assert_eq!(deleted, 5000);
    assert_eq!(batches, 8, "5000 rows in batches of 700");
    assert_eq!(count(&db, "expired").await, 0);
    assert_eq!(count(&db, "live").await, 300);
}

#[tokio::test]
async fn a_run_stops_at_its_cap_and_the_next_run_continues() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "expired", 1000, 60).await;
    let capped = ReapLimits {
        max_per_run: 600,
        ..limits(250)
    };

    let first = reaper::reap_once(&db.pool, &capped).await.unwrap();
    let second = reaper::reap_once(&db.pool, &capped).await.unwrap();

    assert!(
        matches!(first, ReapReport::Reaped { deleted: 600, .. }),
        "{first:?}"
    );
    assert!(
        matches!(second, ReapReport::Reaped { deleted: 400, .. }),
        "{second:?}"
    );
    assert_eq!(count(&db, "expired").await, 0);
}

#[tokio::test]
async fn a_run_stopped_at_its_cap_is_followed_at_once_not_an_interval_later() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "expired", 1000, 60).await;
    let settings = maintenance::ReaperSettings {
        interval: Duration::from_secs(3600),
        limits: ReapLimits {
            max_per_run: 300,
            batch_pause: Duration::from_millis(1),
            ..limits(100)
        },
    };

    // Four runs (300, 300, 300, 100) clear the backlog; with an hour between
    // runs that is only possible if a capped run is followed at once.
    let reaper = tokio::spawn(maintenance::run_reaper(db.pool.clone(), settings));
    let cleared = tokio::time::timeout(Duration::from_secs(30), async {
        while count(&db, "expired").await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    reaper.abort();

    assert!(
        cleared.is_ok(),
        "{} expired rows left: the next run waited for the interval",
        count(&db, "expired").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reapers_at_once_never_both_work_and_metrics_say_so() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "expired", 3000, 60).await;
    let metrics = telemetry::metrics_handle();
    let before = metrics.render();
    let counter = |page: &str, series: &str| metric_value(page, series).unwrap_or(0.0);
    // Small batches with pauses keep the first run going while the second starts.
    let slow = ReapLimits {
        batch_pause: Duration::from_millis(100),
        ..limits(300)
    };

    let (first, second) = tokio::join!(maintenance::reap(&db.pool, &slow), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        maintenance::reap(&db.pool, &slow).await
    });

    let reports = [first.unwrap(), second.unwrap()];
    let worked: Vec<_> = reports
        .iter()
        .filter(|r| matches!(r, ReapReport::Reaped { .. }))
        .collect();
    let skipped = reports
        .iter()
        .filter(|r| matches!(r, ReapReport::Skipped))
        .count();
    assert_eq!((worked.len(), skipped), (1, 1), "{reports:?}");
    assert!(matches!(
        worked[0],
        ReapReport::Reaped { deleted: 3000, .. }
    ));
    let after = metrics.render();
    let delta = |series: &str| counter(&after, series) - counter(&before, series);
    assert_eq!(delta("idempotency_reaper_deleted_total"), 3000.0);
    assert_eq!(
        delta(r#"idempotency_reaper_runs_total{result="success"}"#),
        1.0
    );
    assert_eq!(
        delta(r#"idempotency_reaper_runs_total{result="skipped"}"#),
        1.0
    );
    assert!(
        metric_value(&after, "idempotency_reaper_last_success_timestamp_seconds").unwrap() > 1.7e9
    );
}

/// Advisory locks held in this test's database.
async fn advisory_locks(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks
         WHERE locktype = 'advisory'
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_cut_short_run_releases_its_lock() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "expired", 2000, 60).await;
    let slow = ReapLimits {
        batch_pause: Duration::from_secs(10),
        ..limits(100)
    };

    // Abandon a run mid-way, as a shutdown would.
    let abandoned = tokio::time::timeout(
        Duration::from_millis(500),
        reaper::reap_once(&db.pool, &slow),
    )
    .await;
    assert!(abandoned.is_err());

    // Its session ended with it, so the lock is free for the next run. The
    // backend releases it as it exits, just after the socket closes: a run
    // started in that instant may still see it held, so wait (bounded) for
    // the lock to go, as the next scheduled run, an interval later, would.
    let released = tokio::time::timeout(Duration::from_secs(10), async {
        while advisory_locks(&db).await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(released.is_ok(), "the abandoned run still holds the lock");
    let next = reaper::reap_once(&db.pool, &limits(1000)).await.unwrap();
    assert!(matches!(next, ReapReport::Reaped { .. }), "{next:?}");
    assert_eq!(count(&db, "expired").await, 0);
}

#[tokio::test]
async fn rows_deleted_before_a_run_fails_are_still_counted() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "expired", 3000, 60).await;
    let metrics = telemetry::metrics_handle();
    let before = metrics.render();
    let slow = ReapLimits {
        batch_pause: Duration::from_secs(2),
        ..limits(1000)
    };
    let run = tokio::spawn({
        let pool = db.pool.clone();
        async move { maintenance::reap(&pool, &slow).await }
    });
    while count(&db, "expired").await > 2000 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The first batch is done; the run's session ends during the pause, so
    // its next batch fails.
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_locks
         WHERE locktype = 'advisory' AND pid <> pg_backend_pid()
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let failed = run.await.unwrap();

    assert!(failed.is_err(), "{failed:?}");
    let after = metrics.render();
    let delta = |series: &str| {
        metric_value(&after, series).unwrap_or(0.0) - metric_value(&before, series).unwrap_or(0.0)
    };
    assert_eq!(delta("idempotency_reaper_deleted_total"), 1000.0);
    assert_eq!(
        delta(r#"idempotency_reaper_runs_total{result="error"}"#),
        1.0
    );
}

#[tokio::test]
async fn a_database_host_that_stops_answering_fails_the_run_within_the_acquire_timeout() {
    // Accepts connections and never answers, like a host that went away
    // behind a load balancer: no refusal, no reset.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let options = sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(silent.local_addr().unwrap().port())
        .username("postgres");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(options);
    let held = tokio::spawn(async move {
        let mut accepted = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            accepted.push(socket);
        }
    });

    let run = tokio::time::timeout(
        Duration::from_secs(20),
        reaper::reap_once(&pool, &limits(1000)),
    )
    .await
    .expect("the run ended instead of waiting on the silent host");

    let error = run.unwrap_err();
    assert!(
        matches!(error, idempotency_server::store::StoreError::Unavailable(_)),
        "{error:?}"
    );
    held.abort();
}
