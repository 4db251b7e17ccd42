//! Lifetimes: an expired record acts as absent even before cleanup removes it.

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_tests::{TestDb, TestServer, record_id, response, seconds, unique_key};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn an_expired_record_acts_as_absent_while_its_row_still_exists() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let mut client = server.client.clone();
    let id = record_id(&unique_key("expiring"));
    let request = pb::AcquireRequest {
        id: Some(id.clone()),
        fingerprint: b"first request".to_vec(),
        ttl: Some(seconds(1)),
        lease: Some(seconds(1)),
    };
    let t = token(&acquire_request(&mut client, request).await);
    complete(&mut client, &id, t, response(201, "first"))
        .await
        .unwrap();
    wait_past(1).await;

    assert_eq!(
        db.row_count().await,
        1,
        "cleanup has not run: the row is still there"
    );
    assert_error(
        get(&mut client, &id).await,
        Code::NotFound,
        "RECORD_NOT_FOUND",
    );
    let late = complete(&mut client, &id, t, response(201, "first")).await;
    assert_error(late, Code::NotFound, "RECORD_NOT_FOUND");

    // A fresh start: token 1, and the old fingerprint no longer binds the key.
    let outcome = acquire(&mut client, &id, b"another request").await;

    let Outcome::Acquired(acquired) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(acquired.fencing_token, 1);
    let record = get(&mut client, &id).await.unwrap();
    assert_eq!(record.state(), pb::RecordState::InProgress);
    assert_eq!(record.fingerprint, b"another request");
    assert_eq!(record.response, None);
    assert_eq!(db.row_count().await, 1);
}
