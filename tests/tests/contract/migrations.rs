//! Migrations across releases: during a rolling upgrade, and after a
//! rollback, a release serves a database that a newer one migrated.

use idempotency_tests::{TestDb, TestServer, record_id, unique_key};

use crate::support::*;

#[tokio::test]
async fn a_database_migrated_by_a_newer_release_is_migrated_and_served() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99991231000000, 'from a newer release', true, '\\x00', 0)",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    idempotency_server::db::migrate(&db.pool)
        .await
        .expect("a migration this binary does not know is no reason to refuse");
    let server = TestServer::start(&db).await;
    let mut client = server.client.clone();
    token(
        &acquire(
            &mut client,
            &record_id(&unique_key("after-rollback")),
            b"fp",
        )
        .await,
    );
}
