//! `idempotencyd admin`: get, purge, stuck and stats, as people and scripts read them.

use std::time::Duration;

use idempotency_client::pb::acquire_response::Outcome;
use idempotency_server::{
    admin::{self, Answer},
    settings::{AdminCommand, PurgeArgs},
};
use idempotency_tests::{TestDb, insert_records, record_id, response, spawn_app, unique_key};

use crate::support::*;

#[tokio::test]
async fn get_shows_a_record_for_people_and_for_scripts() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("admin-get"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    complete(&mut app.client, &id, t, response(201, "0123456789"))
        .await
        .unwrap();

    let text = run_admin(&app.db, AdminCommand::Get(id_args(&id)), false)
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(
        &run_admin(&app.db, AdminCommand::Get(id_args(&id)), true)
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
        &app.db,
        AdminCommand::Get(id_args(&record_id("no-such-key"))),
        false,
    )
    .await;
    assert!(matches!(missing, Err(admin::AdminError::NotFound)));
}

#[tokio::test]
async fn purge_frees_a_key_at_once() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("admin-purge"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    fail(&mut app.client, &id, t, false, Some(response(500, "bug")))
        .await
        .unwrap();

    let (purged, logs) = capture_logs(run_admin(
        &app.db,
        AdminCommand::Purge(purge_args(&id)),
        true,
    ))
    .await;

    let purged: serde_json::Value = serde_json::from_str(&purged.unwrap()).unwrap();
    assert_eq!(purged["purged"], true);
    assert_eq!(purged["deleted"], 1);
    let audit = audit_lines(&logs);
    assert_eq!(audit.len(), 1, "{logs:?}");
    assert_eq!(audit[0]["event"], "admin_purge");
    assert_eq!(audit[0]["outcome"], "purged");
    assert_eq!(audit[0]["operator"], "test-operator");
    assert_eq!(audit[0]["key"], id.key.as_str());
    assert_eq!(audit[0]["subject"], id.subject.as_str());
    assert_eq!(audit[0]["deleted"], 1);
    assert!(
        audit[0]["database"]
            .as_str()
            .unwrap()
            .ends_with(&app.db.name),
        "{audit:?}"
    );
    // The customer can retry: a fresh attempt, with a token the purged
    // attempt never had.
    let Outcome::Acquired(acquired) = acquire(&mut app.client, &id, b"fp").await else {
        panic!()
    };
    assert!(acquired.fencing_token > t);
    let again = run_admin(
        &app.db,
        AdminCommand::Purge(purge_args(&record_id("no-such-key"))),
        false,
    )
    .await;
    assert!(matches!(again, Err(admin::AdminError::NotFound)));
}

#[tokio::test]
async fn stuck_lists_lapsed_leases_older_than_asked_and_stats_counts_by_namespace() {
    let mut app = spawn_app().await;
    let lapsed = record_id(&unique_key("admin-stuck"));
    let live = record_id(&unique_key("admin-live"));
    token(&acquire_leased(&mut app.client, &lapsed, b"fp", 1).await);
    token(&acquire(&mut app.client, &live, b"fp").await);
    insert_records(&app.db.pool, "old", 4, 60).await;
    wait_past(1).await;

    let stuck: serde_json::Value = serde_json::from_str(
        &run_admin(
            &app.db,
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
        &app.db,
        AdminCommand::Stuck {
            older_than: Duration::from_secs(3600),
            limit: 10,
        },
        false,
    )
    .await
    .unwrap();
    let stats: serde_json::Value =
        serde_json::from_str(&run_admin(&app.db, AdminCommand::Stats, true).await.unwrap())
            .unwrap();
    let stats_text = run_admin(&app.db, AdminCommand::Stats, false)
        .await
        .unwrap();

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

/// `admin purge --namespace N [--operation O] [--subject S] [--key K]`.
fn purge_filter(namespace: &str) -> PurgeArgs {
    PurgeArgs {
        namespace: namespace.into(),
        operation: None,
        subject: None,
        key: None,
        yes: false,
        operator: Some("test-operator".into()),
    }
}

async fn count_in(db: &TestDb, namespace: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE namespace = $1")
        .bind(namespace)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn purging_a_namespace_asks_once_then_deletes_all_of_it_in_batches_and_audits() {
    let db = TestDb::new().await;
    // More than one batch (1000 rows), live and expired alike.
    insert_records(&db.pool, "decommissioned", 2400, -3600).await;
    insert_records(&db.pool, "decommissioned-old", 1, 60).await;
    sqlx::query(
        "UPDATE idempotency_records SET namespace = 'decommissioned', key = 'expired-key-1'
         WHERE namespace = 'decommissioned-old'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    insert_records(&db.pool, "kept", 3, -3600).await;

    let ((purged, questions), logs) = capture_logs(run_admin_answering(
        &db,
        AdminCommand::Purge(purge_filter("decommissioned")),
        true,
        Answer::Yes,
    ))
    .await;

    let purged: serde_json::Value = serde_json::from_str(&purged.unwrap()).unwrap();
    assert_eq!(
        questions,
        vec!["delete 2401 records of namespace decommissioned? type yes:".to_owned()]
    );
    assert_eq!(purged["deleted"], 2401);
    assert_eq!(purged["matched"], 2401);
    assert_eq!(purged["operation"], serde_json::Value::Null);
    assert_eq!(count_in(&db, "decommissioned").await, 0);
    assert_eq!(count_in(&db, "kept").await, 3);
    let audit = audit_lines(&logs);
    assert_eq!(audit.len(), 1, "{logs:?}");
    let line = audit[0].as_object().unwrap();
    assert_eq!(line["event"], "admin_purge");
    assert_eq!(line["outcome"], "purged");
    assert_eq!(line["operator"], "test-operator");
    assert_eq!(line["namespace"], "decommissioned");
    assert_eq!(line["matched"], 2401);
    assert_eq!(line["deleted"], 2401);
    // Parts left out of the filter are left out of the line.
    assert!(
        !line.contains_key("operation") && !line.contains_key("key"),
        "{line:?}"
    );
}

#[tokio::test]
async fn purge_with_yes_asks_nothing_and_deletes_only_what_the_parts_given_match() {
    let mut app = spawn_app().await;
    let mine = [unique_key("admin-mine-1"), unique_key("admin-mine-2")];
    for key in &mine {
        token(&acquire(&mut app.client, &record_id(key), b"fp").await);
    }
    let other_subject = idempotency_client::pb::RecordId {
        subject: "user-2".into(),
        ..record_id(&unique_key("admin-other"))
    };
    token(&acquire(&mut app.client, &other_subject, b"fp").await);

    let (purged, questions) = run_admin_answering(
        &app.db,
        AdminCommand::Purge(PurgeArgs {
            subject: Some("user-1".into()),
            yes: true,
            ..purge_filter("payments")
        }),
        true,
        Answer::No,
    )
    .await;
    // One match (a key in any operation and subject) needs no confirmation.
    let (single, single_questions) = run_admin_answering(
        &app.db,
        AdminCommand::Purge(PurgeArgs {
            key: Some(other_subject.key.clone()),
            ..purge_filter("payments")
        }),
        true,
        Answer::No,
    )
    .await;

    let purged: serde_json::Value = serde_json::from_str(&purged.unwrap()).unwrap();
    assert!(questions.is_empty(), "{questions:?}");
    assert_eq!(purged["deleted"], 2);
    assert_eq!(purged["subject"], "user-1");
    let single: serde_json::Value = serde_json::from_str(&single.unwrap()).unwrap();
    assert!(single_questions.is_empty(), "{single_questions:?}");
    assert_eq!(single["deleted"], 1);
    assert_eq!(app.db.row_count().await, 0);
    let nothing = run_admin(
        &app.db,
        AdminCommand::Purge(purge_filter("payments")),
        false,
    )
    .await;
    assert!(
        matches!(nothing, Err(admin::AdminError::NoMatch)),
        "{nothing:?}"
    );
}

#[tokio::test]
async fn purge_of_many_unconfirmed_deletes_nothing_and_audits_the_refusal() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "payments", 5, -3600).await;

    let ((no_terminal, _), logs) = capture_logs(run_admin_answering(
        &db,
        AdminCommand::Purge(purge_filter("payments")),
        false,
        Answer::NoTerminal,
    ))
    .await;
    let (said_no, questions) = run_admin_answering(
        &db,
        AdminCommand::Purge(PurgeArgs {
            operation: Some("POST /bulk".into()),
            ..purge_filter("payments")
        }),
        false,
        Answer::No,
    )
    .await;

    assert!(
        matches!(
            no_terminal,
            Err(admin::AdminError::NotConfirmed { matched: 5, .. })
        ),
        "{no_terminal:?}"
    );
    let message = no_terminal.unwrap_err().to_string();
    assert!(message.contains("--yes"), "{message}");
    assert!(
        matches!(
            said_no,
            Err(admin::AdminError::NotConfirmed { matched: 5, .. })
        ),
        "{said_no:?}"
    );
    assert_eq!(
        questions,
        vec![
            "delete 5 records of namespace payments, operation \"POST /bulk\"? type yes:"
                .to_owned()
        ]
    );
    assert_eq!(count_in(&db, "payments").await, 5);
    let audit = audit_lines(&logs);
    assert_eq!(audit.len(), 1, "{logs:?}");
    assert_eq!(audit[0]["outcome"], "refused");
    assert_eq!(audit[0]["matched"], 5);
    assert_eq!(audit[0]["deleted"], 0);
    assert!(
        audit[0]["reason"].as_str().unwrap().contains("terminal"),
        "{audit:?}"
    );
}

#[tokio::test]
async fn records_created_while_the_operator_is_asked_are_not_purged() {
    let db = TestDb::new().await;
    insert_records(&db.pool, "payments", 2, -3600).await;
    let options = db.connect_options();

    let (purged, _) = {
        let mut out = Vec::new();
        // Another writer creates a record of the namespace between the
        // count and the answer (from a thread of its own: the question is
        // asked synchronously).
        let mut confirm = |_: &str| {
            let options = options.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async move {
                    use sqlx::Connection;
                    let mut connection = sqlx::PgConnection::connect_with(&options).await.unwrap();
                    sqlx::query(
                        "INSERT INTO idempotency_records
                             (namespace, operation, subject, key, state, fingerprint, fencing_token,
                              created_at, expires_at, lease_expires_at)
                         VALUES ('payments', 'POST /late', '', 'late-key-1', 'in_progress', '', 1,
                                 now(), now() + interval '1 hour', now() + interval '1 minute')",
                    )
                    .execute(&mut connection)
                    .await
                    .unwrap();
                });
            })
            .join()
            .unwrap();
            Answer::Yes
        };
        let ran = admin::run(
            &db.pool,
            AdminCommand::Purge(purge_filter("payments")),
            true,
            &mut out,
            &mut confirm,
        )
        .await;
        (ran.map(|()| String::from_utf8(out).unwrap()), ())
    };

    let purged: serde_json::Value = serde_json::from_str(&purged.unwrap()).unwrap();
    assert_eq!(purged["deleted"], 2);
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_records")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, vec!["late-key-1".to_owned()]);
}
