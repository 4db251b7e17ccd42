//! The database goes away under a running server, then comes back.

use std::time::Duration;

use idempotency_client::pb;
use idempotency_server::startup::{Application, StartupError};
use idempotency_tests::{
    TestApp, TestDb, TestServer, database_url, record_id, response, spawn_app, spawn_app_with,
    test_settings, unique_key,
};
use tonic::{Code, transport::Channel};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::support::*;

pub async fn health_status(health: &mut HealthClient<Channel>, service: &str) -> ServingStatus {
    let request = HealthCheckRequest {
        service: service.into(),
    };
    health
        .check(request)
        .await
        .expect("health check")
        .into_inner()
        .status()
}

/// Polls the health service until it reports `expected` for the server and the API.
pub async fn wait_for_health(health: &mut HealthClient<Channel>, expected: ServingStatus) {
    for _ in 0..100 {
        if health_status(health, "").await == expected
            && health_status(health, "idempotency.v1.IdempotencyService").await == expected
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("health never became {expected:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_database_is_down_calls_are_unavailable_and_health_is_not_serving_then_both_recover()
 {
    let db = TestDb::new().await;
    let (server, proxy) = idempotency_tests::server_behind_proxy(&db).await;
    let mut client = server.client.clone();
    let mut health = HealthClient::new(TestServer::channel_to(server.addr).await);
    wait_for_health(&mut health, ServingStatus::Serving).await;
    let id = record_id(&unique_key("outage"));
    let t = token(&acquire(&mut client, &id, b"fp").await);

    proxy.cut().await;

    let acquire_down = client
        .acquire(pb::AcquireRequest {
            id: Some(id.clone()),
            ..Default::default()
        })
        .await;
    assert_error(acquire_down, Code::Unavailable, "DATABASE_UNAVAILABLE");
    let complete_down = complete(&mut client, &id, t, response(201, "paid")).await;
    let status = assert_error(complete_down, Code::Unavailable, "DATABASE_UNAVAILABLE");
    assert!(
        !status.message().to_lowercase().contains("select"),
        "no SQL in {status:?}"
    );
    wait_for_health(&mut health, ServingStatus::NotServing).await;
    // Liveness stays SERVING: an outage must not get replicas restarted.
    assert_eq!(
        health_status(&mut health, "liveness").await,
        ServingStatus::Serving
    );

    proxy.restore().await;

    wait_for_health(&mut health, ServingStatus::Serving).await;
    // Pooled connections that died with the outage fail once each (UNAVAILABLE,
    // which clients retry); within a few retries the same server answers again.
    let mut completed = None;
    for _ in 0..20 {
        match complete(&mut client, &id, t, response(201, "paid")).await {
            Ok(done) => {
                completed = Some(done);
                break;
            }
            Err(status) if status.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
    assert!(completed.is_some(), "the server never recovered");
    assert!(matches!(
        acquire(&mut client, &id, b"fp").await,
        pb::acquire_response::Outcome::Completed(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_unavailable_instead_of_hanging() {
    let app = spawn_app_with(|settings| {
        settings.database.db_max_connections = 1;
        settings.database.db_acquire_timeout = Duration::from_millis(300);
        // Probes get 500 ms to answer: a loaded CI machine is not an outage.
        settings.health_check_interval = Duration::from_secs(1);
        // Without batching: its workers each keep a connection, which a pool
        // of one cannot spare (the server refuses to start so configured).
        settings.batching = false;
    })
    .await;
    let mut client = app.client.clone();
    let id = record_id(&unique_key("exhausted"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    // A Complete stuck behind a row lock holds the only connection.
    let blocker = idempotency_tests::lock_record(&app.db, &id.key).await;
    let stuck = tokio::spawn({
        let mut client = client.clone();
        let id = id.clone();
        async move { complete(&mut client, &id, t, response(201, "stuck")).await }
    });
    idempotency_tests::wait_for_lock_wait(&app.db).await;

    let other = try_acquire(&mut client, &record_id(&unique_key("other")), b"").await;

    assert_error(other, Code::Unavailable, "DATABASE_UNAVAILABLE");
    // A busy pool is not a database outage: the replica stays in rotation
    // (the health probe, every second, has a connection of its own).
    let mut health = HealthClient::new(TestServer::channel_to(app.server.addr).await);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(health_status(&mut health, "").await, ServingStatus::Serving);
    blocker.rollback().await.unwrap();
    assert!(stuck.await.unwrap().is_ok());
}

#[tokio::test]
async fn a_pool_too_small_for_the_batch_workers_is_refused_at_startup() {
    let db = TestDb::new().await;
    let mut settings = test_settings(&db);
    assert!(settings.batching, "batching is on");
    let workers = settings.batch_workers;
    settings.database.db_max_connections = u32::try_from(2 * workers).unwrap();
    let refused = Application::build(settings)
        .await
        .err()
        .expect("a pool the batch workers would fill is refused");
    let StartupError::Settings(invalid) = refused else {
        panic!("expected a settings error, got {refused:?}");
    };
    assert_eq!(invalid.field, "db_max_connections", "{invalid:?}");

    let mut settings = test_settings(&db);
    settings.database.db_max_connections = u32::try_from(2 * workers + 1).unwrap();
    assert!(Application::build(settings).await.is_ok());
}

/// Postgres ends the server's connections (a failover, an operator's
/// `pg_terminate_backend`) while the batch workers keep theirs. Each ended
/// connection fails at most one call, with UNAVAILABLE, and is not used
/// again: the calls right after it, with no pause that would let a worker
/// give its connection back for being idle, succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_postgres_ended_fail_one_call_each_and_are_not_used_again() {
    let mut app = spawn_app().await;
    // The server now keeps the connection its calls used (the batch
    // workers share their kept connections).
    let id = record_id(&unique_key("ended"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    complete(&mut app.client, &id, t, response(201, "paid"))
        .await
        .expect("completed");

    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                               WHERE datname = current_database() AND application_name = $1) t",
    )
    .bind(idempotency_server::db::APPLICATION_NAME)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    // At least the kept one, which is all the test needs: the count is
    // two on a quiet machine, and was one once in `make test` (the two
    // kinds of call kept one connection between them).
    assert!(
        ended >= 1,
        "the server had {ended} connections, expected the kept one"
    );

    let mut failures = 0;
    let mut answered = 0;
    while answered < 5 {
        let id = record_id(&unique_key("after"));
        match try_acquire(&mut app.client, &id, b"fp").await {
            Ok(_) => answered += 1,
            Err(status) if status.code() == Code::Unavailable => failures += 1,
            Err(status) => panic!("{status:?}"),
        }
        assert!(
            failures <= ended,
            "{failures} calls failed after Postgres ended {ended} connections: a dead connection is reused"
        );
    }
}

#[tokio::test]
async fn a_database_the_service_may_not_use_answers_unavailable_not_internal() {
    let db = TestDb::new().await;
    // The cluster's role without a database (3D000), and a role the cluster
    // does not know (28000): how a dropped database or a rotated password
    // shows, until an operator mends it.
    let mut missing_database = db.url();
    missing_database.set_path("no_such_database");
    let mut unknown_role = db.url();
    unknown_role.set_username("no_such_role").unwrap();
    for url in [missing_database, unknown_role] {
        let mut settings = test_settings(&db);
        settings.database.database_url = Some(database_url(&url));
        settings.database.db_acquire_timeout = Duration::from_secs(2);
        let server = TestServer::start_with(settings).await;
        let mut client = server.client.clone();

        let refused = try_acquire(&mut client, &record_id(&unique_key("refused")), b"").await;

        assert_error(refused, Code::Unavailable, "DATABASE_UNAVAILABLE");
        server.stop().await;
    }
}

/// `count` Acquires of new keys at once; their results.
async fn acquire_new_keys(
    app: &TestApp,
    count: usize,
) -> Vec<Result<pb::AcquireResponse, tonic::Status>> {
    let calls = (0..count).map(|_| {
        let mut client = app.client.clone();
        async move { try_acquire(&mut client, &record_id(&unique_key("standby")), b"fp").await }
    });
    futures_util::future::join_all(calls).await
}

/// How a failover looks to a server whose database URL now leads to a
/// standby: sessions that may read but not write. Every Acquire on one is
/// refused (SQLSTATE 25006); the connection must not stay in the pool, or it
/// refuses writes long after the database URL leads to a writable primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_is_not_serving_and_no_read_only_connection_outlives_it() {
    let app = spawn_app_with(|settings| {
        settings.health_check_interval = Duration::from_secs(1);
    })
    .await;
    let mut health = HealthClient::new(TestServer::channel_to(app.server.addr).await);
    wait_for_health(&mut health, ServingStatus::Serving).await;
    assert_eq!(acquire_new_keys(&app, 1).await.len(), 1);
    let admin = &app.db.pool;
    let set_read_only = |on: bool| {
        let sql = if on {
            format!(
                "ALTER DATABASE {} SET default_transaction_read_only = on",
                app.db.name
            )
        } else {
            format!(
                "ALTER DATABASE {} RESET default_transaction_read_only",
                app.db.name
            )
        };
        // Explicitly read-write: the admin pool may open a session after
        // the database turned read-only, and on such a session even the
        // RESET is refused (SQLSTATE 25006).
        async move {
            let mut tx = admin.begin().await.unwrap();
            sqlx::query("SET TRANSACTION READ WRITE")
                .execute(&mut *tx)
                .await
                .unwrap();
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
    };

    // The failover: the server's sessions end, new ones are read-only.
    set_read_only(true).await;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'idempotencyd'",
    )
    .execute(admin)
    .await
    .unwrap();
    wait_for_health(&mut health, ServingStatus::NotServing).await;
    let rows = app.db.row_count().await;
    // Enough calls at once to open several read-only connections.
    for _ in 0..3 {
        for result in acquire_new_keys(&app, 8).await {
            assert_error(result, Code::Unavailable, "DATABASE_UNAVAILABLE");
        }
    }
    assert_eq!(
        app.db.row_count().await,
        rows,
        "a refused call wrote nothing"
    );
    wait_for_metric(
        &app.server,
        "idempotency_db_connections_read_only_total",
        |closed| closed >= 1.0,
    )
    .await;

    // The primary is writable again (the new one, in a real failover).
    set_read_only(false).await;
    wait_for_health(&mut health, ServingStatus::Serving).await;
    for _ in 0..3 {
        for result in acquire_new_keys(&app, 8).await {
            assert!(
                result.is_ok(),
                "a read-only connection was reused: {result:?}"
            );
        }
    }
}

/// HAProxy with no primary to route to (mid-failover) accepts a connection,
/// reads the client's first message and closes it. sqlx reads that as a
/// protocol error in the TLS negotiation; the call must still be one the
/// client retries.
#[tokio::test]
async fn a_database_address_that_accepts_and_closes_connections_answers_unavailable_not_internal() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut first = [0u8; 8];
                let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut first).await;
            });
        }
    });
    let mut settings = idempotency_tests::settings_for(&format!("postgres://idem@{addr}/idem"));
    settings.database.db_acquire_timeout = Duration::from_millis(500);
    let server = TestServer::start_with(settings).await;
    let mut client = server.client.clone();

    let refused = try_acquire(&mut client, &record_id(&unique_key("no-primary")), b"").await;

    assert_error(refused, Code::Unavailable, "DATABASE_UNAVAILABLE");
    server.stop().await;
}
