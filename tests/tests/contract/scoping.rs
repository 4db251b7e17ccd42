//! A key is unique per (namespace, operation, subject, key).

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_tests::{record_id, response, spawn_app, unique_key};

use crate::support::*;

#[tokio::test]
async fn the_same_key_under_another_namespace_operation_or_subject_is_independent() {
    let mut app = spawn_app().await;
    let original = record_id(&unique_key("shared"));
    let t = token(&acquire(&mut app.client, &original, b"fp").await);
    complete(&mut app.client, &original, t, response(201, "payment"))
        .await
        .unwrap();

    let others = [
        pb::RecordId {
            namespace: "refunds".into(),
            ..original.clone()
        },
        pb::RecordId {
            operation: "POST /refunds".into(),
            ..original.clone()
        },
        pb::RecordId {
            subject: "user-2".into(),
            ..original.clone()
        },
        pb::RecordId {
            subject: String::new(),
            ..original.clone()
        },
        // Keys are case-sensitive.
        pb::RecordId {
            key: original.key.to_uppercase(),
            ..original.clone()
        },
    ];
    for other in &others {
        let outcome = acquire(&mut app.client, other, b"fp").await;
        assert!(
            matches!(outcome, Outcome::Acquired(_)),
            "{other:?}: {outcome:?}"
        );
    }

    // The original is untouched by all of them.
    let Outcome::Completed(replay) = acquire(&mut app.client, &original, b"fp").await else {
        panic!()
    };
    assert_eq!(replay.response, Some(response(201, "payment")));
    assert_eq!(app.db.row_count().await, 1 + others.len() as i64);
}
