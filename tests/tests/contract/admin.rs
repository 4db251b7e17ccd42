//! `idempotencyd admin`: get, purge, stuck and stats, as people and scripts read them.

use std::time::Duration;

use idempotency_client::pb::acquire_response::Outcome;
use idempotency_server::{admin, settings::AdminCommand};
use idempotency_tests::{TestDb, TestServer, insert_records, record_id, response, unique_key};

use crate::support::*;

#[tokio::test]
async fn get_shows_a_record_for_people_and_for_scripts() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let mut client = server.client.clone();
    let id = record_id(&unique_key("admin-get"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    complete(&mut client, &id, t, response(201, "0123456789"))
        .await
        .unwrap();

    let text = run_admin(&db, AdminCommand::Get(id_args(&id)), false)
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(
        &run_admin(&db, AdminCommand::Get(id_args(&id)), true)
            .await
            .unwrap(),
    )
    .unwrap();

    assert!(
        text.contains("state") && text.contains("completed"),
        "{text}"
    );
    assert_eq!(json["state"], "completed");
    assert_eq!(json["fencing_token"], t);
    assert_eq!(json["response_status"], 201);
    // 10 body bytes + content-type/application/json + location//payments/42
    assert_eq!(json["response_bytes"], 10 + 12 + 16 + 8 + 12);
    let missing = run_admin(
        &db,
        AdminCommand::Get(id_args(&record_id("no-such-key"))),
        false,
    )
    .await;
    assert!(matches!(missing, Err(admin::AdminError::NotFound)));
}

#[tokio::test]
async fn purge_frees_a_key_at_once() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let mut client = server.client.clone();
    let id = record_id(&unique_key("admin-purge"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    fail(&mut client, &id, t, false, Some(response(500, "bug")))
        .await
        .unwrap();

    run_admin(&db, AdminCommand::Purge(id_args(&id)), false)
        .await
        .unwrap();

    // The customer can retry: a fresh attempt, with a token the purged
    // attempt never had.
    let Outcome::Acquired(acquired) = acquire(&mut client, &id, b"fp").await else {
        panic!()
    };
    assert!(acquired.fencing_token > t);
    let again = run_admin(
        &db,
        AdminCommand::Purge(id_args(&record_id("no-such-key"))),
        false,
    )
    .await;
    assert!(matches!(again, Err(admin::AdminError::NotFound)));
}

#[tokio::test]
async fn stuck_lists_lapsed_leases_older_than_asked_and_stats_counts_by_namespace() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let mut client = server.client.clone();
    let lapsed = record_id(&unique_key("admin-stuck"));
    let live = record_id(&unique_key("admin-live"));
    token(&acquire_leased(&mut client, &lapsed, b"fp", 1).await);
    token(&acquire(&mut client, &live, b"fp").await);
    insert_records(&db.pool, "old", 4, 60).await;
    wait_past(1).await;

    let stuck: serde_json::Value = serde_json::from_str(
        &run_admin(
            &db,
            AdminCommand::Stuck {
                older_than: Duration::ZERO,
                limit: 10,
            },
            true,
        )
        .await
        .unwrap(),
    )
    .unwrap();
    let not_yet = run_admin(
        &db,
        AdminCommand::Stuck {
            older_than: Duration::from_secs(3600),
            limit: 10,
        },
        false,
    )
    .await
    .unwrap();
    let stats: serde_json::Value =
        serde_json::from_str(&run_admin(&db, AdminCommand::Stats, true).await.unwrap()).unwrap();
    let stats_text = run_admin(&db, AdminCommand::Stats, false).await.unwrap();

    let keys: Vec<_> = stuck
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys, vec![lapsed.key.clone()]);
    assert_eq!(not_yet.trim(), "(none)");
    let records = stats["records"].as_array().unwrap();
    let find = |namespace: &str| {
        records
            .iter()
            .find(|r| r["namespace"] == namespace)
            .unwrap()
            .clone()
    };
    assert_eq!(find("payments")["live"], 2);
    assert_eq!(find("old")["expired"], 4);
    assert!(stats["table_bytes"].as_i64().unwrap() > 0);
    assert!(
        stats_text.contains("table_bytes") && stats_text.contains("namespace=old"),
        "{stats_text}"
    );
}
