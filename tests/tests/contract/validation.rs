//! Bad input: INVALID_ARGUMENT naming the field, and nothing written.

use idempotency_client::pb;
use idempotency_tests::{record_id, response, seconds, spawn_app, unique_key};
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::support::*;

/// Asserts INVALID_ARGUMENT with a BadRequest violation on `field`.
#[track_caller]
fn assert_invalid(result: Result<impl std::fmt::Debug, Status>, field: &str) {
    let status = assert_error(result, Code::InvalidArgument, "INVALID_ARGUMENT");
    let bad_request = status
        .get_details_bad_request()
        .expect("a BadRequest detail");
    let fields: Vec<_> = bad_request
        .field_violations
        .iter()
        .map(|v| v.field.as_str())
        .collect();
    assert_eq!(fields, [field], "{status:?}");
}

fn with_id(change: impl FnOnce(&mut pb::RecordId)) -> pb::AcquireRequest {
    let mut id = record_id("valid-key-123");
    change(&mut id);
    pb::AcquireRequest {
        id: Some(id),
        ..Default::default()
    }
}

#[tokio::test]
async fn invalid_acquires_name_the_field_and_write_nothing() {
    let mut app = spawn_app().await;
    let day = 24 * 3600;
    let cases: Vec<(&str, pb::AcquireRequest, &str)> = vec![
        ("no id", pb::AcquireRequest::default(), "id"),
        ("key of 7", with_id(|id| id.key = "k".repeat(7)), "id.key"),
        (
            "key of 129",
            with_id(|id| id.key = "k".repeat(129)),
            "id.key",
        ),
        (
            "key with a space",
            with_id(|id| id.key = "abcd efgh".into()),
            "id.key",
        ),
        (
            "key with a tab",
            with_id(|id| id.key = "abcd\tefgh".into()),
            "id.key",
        ),
        (
            "key with DEL",
            with_id(|id| id.key = "abcdefgh\u{7f}".into()),
            "id.key",
        ),
        (
            "key non-ASCII",
            with_id(|id| id.key = "clé-unique".into()),
            "id.key",
        ),
        (
            "empty namespace",
            with_id(|id| id.namespace = String::new()),
            "id.namespace",
        ),
        (
            "upper-case namespace",
            with_id(|id| id.namespace = "Payments".into()),
            "id.namespace",
        ),
        (
            "namespace of 64",
            with_id(|id| id.namespace = "n".repeat(64)),
            "id.namespace",
        ),
        (
            "empty operation",
            with_id(|id| id.operation = String::new()),
            "id.operation",
        ),
        (
            "operation of 129",
            with_id(|id| id.operation = "o".repeat(129)),
            "id.operation",
        ),
        (
            "operation with newline",
            with_id(|id| id.operation = "POST\n/x".into()),
            "id.operation",
        ),
        (
            "subject of 257 bytes",
            with_id(|id| id.subject = "s".repeat(257)),
            "id.subject",
        ),
        (
            "subject with NUL",
            with_id(|id| id.subject = "a\0b".into()),
            "id.subject",
        ),
        (
            "fingerprint of 65 bytes",
            pb::AcquireRequest {
                fingerprint: vec![7; 65],
                ..with_id(|_| {})
            },
            "fingerprint",
        ),
        (
            "ttl of 0",
            pb::AcquireRequest {
                ttl: Some(seconds(0)),
                ..with_id(|_| {})
            },
            "ttl",
        ),
        (
            "negative ttl",
            pb::AcquireRequest {
                ttl: Some(seconds(-5)),
                ..with_id(|_| {})
            },
            "ttl",
        ),
        (
            "ttl over 7 days",
            pb::AcquireRequest {
                ttl: Some(seconds(7 * day + 1)),
                ..with_id(|_| {})
            },
            "ttl",
        ),
        (
            "lease of 0",
            pb::AcquireRequest {
                lease: Some(seconds(0)),
                ..with_id(|_| {})
            },
            "lease",
        ),
        (
            "lease over 1 h",
            pb::AcquireRequest {
                lease: Some(seconds(3601)),
                ..with_id(|_| {})
            },
            "lease",
        ),
    ];

    for (case, request, field) in cases {
        let result = app.client.acquire(request).await;
        assert_invalid(result, field);
        assert_eq!(app.db.row_count().await, 0, "{case} wrote a row");
    }
}

#[tokio::test]
async fn the_bounds_themselves_are_accepted() {
    let mut app = spawn_app().await;
    let day = 24 * 3600;
    let cases = [
        with_id(|id| id.key = "k".repeat(8)),
        with_id(|id| id.key = "k".repeat(128)),
        with_id(|id| id.key = "!\"#$%&'()*+,-./~".into()),
        with_id(|id| {
            id.namespace = "n".repeat(63);
            id.subject = "ü".repeat(128);
        }),
        with_id(|id| id.operation = "o".repeat(128)),
        pb::AcquireRequest {
            ttl: Some(seconds(7 * day)),
            lease: Some(seconds(3600)),
            ..with_id(|id| id.key = "max-bounds".into())
        },
        pb::AcquireRequest {
            ttl: Some(seconds(1)),
            lease: Some(seconds(1)),
            ..with_id(|id| id.key = "min-bounds".into())
        },
    ];

    for request in cases {
        token(&acquire_request(&mut app.client, request).await);
    }
}

#[tokio::test]
async fn an_oversized_response_is_refused_naming_the_limit_and_the_record_stays_in_progress() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("big"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    let limit = 1024 * 1024;
    let mut too_big = response(201, "");
    let header_bytes: usize = too_big.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    too_big.body = vec![b'x'; limit - header_bytes + 1];

    let status = complete(&mut app.client, &id, t, too_big.clone()).await;

    let message = status.as_ref().unwrap_err().message().to_owned();
    assert_invalid(status, "response");
    assert!(message.contains(&limit.to_string()), "{message}");
    let failed = fail(&mut app.client, &id, t, false, Some(too_big.clone())).await;
    assert_invalid(failed, "error_response");
    assert_eq!(
        get(&mut app.client, &id).await.unwrap().state(),
        pb::RecordState::InProgress
    );

    // Exactly at the limit is fine.
    too_big.body.pop();
    complete(&mut app.client, &id, t, too_big).await.unwrap();
}

#[tokio::test]
async fn invalid_ids_and_fields_on_the_other_rpcs_are_named_too() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("others"));
    let t = token(&acquire(&mut app.client, &id, b"fp").await);
    let bad_id = record_id("short");

    assert_invalid(
        complete(&mut app.client, &bad_id, t, response(201, "x")).await,
        "id.key",
    );
    let no_response = app
        .client
        .complete(pb::CompleteRequest {
            id: Some(id.clone()),
            fencing_token: t,
            response: None,
        })
        .await;
    assert_invalid(no_response, "response");
    let nul_header = pb::StoredResponse {
        headers: [("x".to_string(), "a\0b".to_string())].into(),
        ..Default::default()
    };
    assert_invalid(
        complete(&mut app.client, &id, t, nul_header).await,
        "response.headers",
    );
    assert_invalid(
        fail(&mut app.client, &bad_id, t, true, None).await,
        "id.key",
    );
    assert_invalid(renew(&mut app.client, &bad_id, t, 10).await, "id.key");
    assert_invalid(renew(&mut app.client, &id, t, 0).await, "lease");
    assert_invalid(renew(&mut app.client, &id, t, 3601).await, "lease");
    assert_invalid(get(&mut app.client, &bad_id).await, "id.key");
    // 0 is a token left unset; above i64::MAX, one no Acquire returns.
    for bad_token in [0, u64::MAX] {
        assert_invalid(
            complete(&mut app.client, &id, bad_token, response(201, "x")).await,
            "fencing_token",
        );
        let failed = fail(&mut app.client, &id, bad_token, false, None).await;
        assert_invalid(failed, "fencing_token");
        assert_invalid(
            renew(&mut app.client, &id, bad_token, 10).await,
            "fencing_token",
        );
    }
    assert_eq!(
        get(&mut app.client, &id).await.unwrap().state(),
        pb::RecordState::InProgress
    );
}
