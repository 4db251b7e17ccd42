//! The HTTP layer end to end: real server, real Postgres, an axum app and an
//! HTTP client over 127.0.0.1. The production races of the Idempotency-Key contract.

use std::time::Duration;

use http::StatusCode;
use idempotency_client::{OnUnavailable, RecordId, RecordState, http::HttpConfig};
use idempotency_tests::{
    TestDb, TestServer,
    http_app::{HttpAnswer, HttpClient, PaymentsApp},
    unique_key,
};

use crate::support::*;

const BANK_DELAY: Duration = Duration::from_millis(1500);

async fn app(server: &TestServer, config: HttpConfig) -> (PaymentsApp, HttpClient) {
    let app = PaymentsApp::start(client_of(server), config, BANK_DELAY).await;
    let http = HttpClient::new(app.addr);
    (app, http)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_timed_out_and_retries_gets_409_then_the_replayed_201_and_is_charged_once() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;
    let key = unique_key("timeout");
    let body = r#"{"amount":1000}"#;

    // The client gives up before the bank answers (a 504 at its gateway) ...
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        http.post("/payments", Some(&key), "alice", body),
    )
    .await;
    assert!(gave_up.is_err());
    // ... and retries at once, while the handler is still running.
    let retry = http.post("/payments", Some(&key), "alice", body).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    assert_eq!(retry.header("retry-after"), Some("1"));
    assert_eq!(
        retry.header("content-type"),
        Some("application/problem+json")
    );

    // Once the first attempt completed (the bank takes BANK_DELAY) ...
    let id = RecordId::new("shop", "POST /payments", key.clone()).with_subject("alice");
    wait_for_state(&client_of(&server), &id, RecordState::Completed).await;
    let later = http.post("/payments", Some(&key), "alice", body).await;

    assert_eq!(later.status, 201, "{later:?}");
    assert_eq!(later.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        later.body,
        r#"{"route":"/payments","user":"alice","call":1}"#
    );
    assert_eq!(later.header("location"), Some("/payments/alice-1"));
    assert_eq!(later.header("content-type"), Some("application/json"));
    assert_eq!(
        later.header("x-not-replayed"),
        None,
        "only allow-listed headers are stored"
    );
    assert_eq!(app.ledger.calls("/payments", "alice"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_click_charges_once() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;
    let key = unique_key("double");

    let clicks: Vec<_> = (0..10)
        .map(|_| {
            let http = http.clone();
            let key = key.clone();
            tokio::spawn(async move {
                http.post("/payments", Some(&key), "bob", r#"{"amount":5}"#)
                    .await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for click in clicks {
        statuses.push(click.await.unwrap().status);
    }

    statuses.sort();
    assert_eq!(statuses, [201, 409, 409, 409, 409, 409, 409, 409, 409, 409]);
    assert_eq!(app.ledger.calls("/payments", "bob"), 1);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422_but_the_same_body_rewritten_replays() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;
    let key = unique_key("body");
    let first = http
        .post(
            "/payments",
            Some(&key),
            "carol",
            r#"{"amount":1000,"currency":"EUR","meta":{"trace_id":"t1"}}"#,
        )
        .await;
    assert_eq!(first.status, 201);

    let other = http
        .post(
            "/payments",
            Some(&key),
            "carol",
            r#"{"amount":9999,"currency":"EUR"}"#,
        )
        .await;
    let rewritten = http
        .post(
            "/payments",
            Some(&key),
            "carol",
            "{ \"meta\": {\"trace_id\": \"t2\"},\n \"currency\": \"EUR\", \"amount\": 1000 }",
        )
        .await;

    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(
        other.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(rewritten.status, 201, "{rewritten:?}");
    assert_eq!(rewritten.header("idempotent-replayed"), Some("true"));
    assert_eq!(rewritten.body, first.body);
    assert_eq!(app.ledger.calls("/payments", "carol"), 1);
}

#[tokio::test]
async fn users_and_routes_never_share_a_key() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;
    let key = unique_key("shared");
    let body = r#"{"amount":1}"#;

    let dave = http.post("/payments", Some(&key), "dave", body).await;
    let erin = http.post("/payments", Some(&key), "erin", body).await;
    let refund = http.post("/refunds", Some(&key), "dave", body).await;

    assert_eq!((dave.status, erin.status, refund.status), (201, 201, 201));
    assert_eq!(erin.header("idempotent-replayed"), None);
    assert!(erin.body.contains(r#""user":"erin""#), "{erin:?}");
    assert!(refund.body.contains(r#""route":"/refunds""#), "{refund:?}");
    assert_eq!(app.ledger.calls("/payments", "dave"), 1);
    assert_eq!(app.ledger.calls("/payments", "erin"), 1);
    assert_eq!(app.ledger.calls("/refunds", "dave"), 1);
}

#[tokio::test]
async fn a_5xx_releases_the_key_for_a_retry_and_a_402_is_stored_and_replayed() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;
    let flaky = unique_key("bank-down");
    let declined = unique_key("declined");

    let first = http
        .post(
            "/payments",
            Some(&flaky),
            "frank",
            r#"{"outcome":"bank_down"}"#,
        )
        .await;
    let retry = http
        .post(
            "/payments",
            Some(&flaky),
            "frank",
            r#"{"outcome":"bank_down"}"#,
        )
        .await;
    assert_eq!((first.status, retry.status), (502, 502));
    assert_eq!(
        retry.header("idempotent-replayed"),
        None,
        "the handler ran again"
    );
    assert_eq!(app.ledger.calls("/payments", "frank"), 2);

    let first = http
        .post(
            "/payments",
            Some(&declined),
            "grace",
            r#"{"outcome":"declined"}"#,
        )
        .await;
    let retry = http
        .post(
            "/payments",
            Some(&declined),
            "grace",
            r#"{"outcome":"declined"}"#,
        )
        .await;
    assert_eq!((first.status, retry.status), (402, 402));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(app.ledger.calls("/payments", "grace"), 1);
}

#[tokio::test]
async fn an_unreachable_service_is_503_when_failing_closed_and_runs_the_handler_when_failing_open()
{
    let closed = PaymentsApp::start(
        client_of_nothing().await,
        HttpConfig::new("shop"),
        Duration::ZERO,
    )
    .await;
    let open = PaymentsApp::start(
        client_of_nothing().await,
        HttpConfig::new("likes").on_unavailable(OnUnavailable::FailOpen),
        Duration::ZERO,
    )
    .await;
    let key = unique_key("down");

    let refused = HttpClient::new(closed.addr)
        .post("/payments", Some(&key), "heidi", "{}")
        .await;
    let ran = HttpClient::new(open.addr)
        .post("/payments", Some(&key), "heidi", "{}")
        .await;

    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(refused.header("retry-after").is_some());
    assert_eq!(closed.ledger.calls("/payments", "heidi"), 0);
    assert_eq!(ran.status, 201, "{ran:?}");
    assert_eq!(open.ledger.calls("/payments", "heidi"), 1);
}

#[tokio::test]
async fn missing_malformed_and_oversized_requests_are_refused_before_the_handler() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (required, http) = app(
        &server,
        HttpConfig::new("shop").require_key(true).max_body_bytes(64),
    )
    .await;
    let (optional, lenient) = app(&server, HttpConfig::new("shop")).await;

    let missing = http.post("/payments", None, "ivan", "{}").await;
    let malformed = http.post("/payments", Some("short"), "ivan", "{}").await;
    let oversized = http
        .post(
            "/payments",
            Some(&unique_key("big")),
            "ivan",
            &"x".repeat(65),
        )
        .await;
    let unprotected = lenient.post("/payments", None, "ivan", "{}").await;

    assert_eq!(missing.status, 400, "{missing:?}");
    assert!(
        missing.body.contains("missing-idempotency-key"),
        "{missing:?}"
    );
    assert_eq!(malformed.status, 400, "{malformed:?}");
    assert!(
        malformed.body.contains("malformed-idempotency-key"),
        "{malformed:?}"
    );
    assert_eq!(oversized.status, 413, "{oversized:?}");
    assert_eq!(required.ledger.calls("/payments", "ivan"), 0);
    assert_eq!(
        unprotected.status, 201,
        "without a required key the request passes through"
    );
    assert_eq!(optional.ledger.calls("/payments", "ivan"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_its_lease_keeps_the_key_by_renewing() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let config =
        HttpConfig::new("shop").lease(Duration::from_secs(1), Some(Duration::from_millis(300)));
    // The handler takes 4 s; the second request comes 1.5 s after the key
    // was taken, well past the first lease second and well before the
    // handler ends.
    let app = PaymentsApp::start(client_of(&server), config, Duration::from_millis(4000)).await;
    let http = HttpClient::new(app.addr);
    let key = unique_key("slow");

    let first = tokio::spawn({
        let http = http.clone();
        let key = key.clone();
        async move { http.post("/payments", Some(&key), "judy", "{}").await }
    });
    let id = RecordId::new("shop", "POST /payments", key.clone()).with_subject("judy");
    wait_for_state(&client_of(&server), &id, RecordState::InProgress).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = http.post("/payments", Some(&key), "judy", "{}").await;

    assert_eq!(
        during.status, 409,
        "the lease was renewed past its first second: {during:?}"
    );
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(app.ledger.calls("/payments", "judy"), 1);
}

#[tokio::test]
async fn one_key_on_two_resources_of_a_route_is_a_mismatch_not_a_replay() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = PaymentsApp::start(client_of(&server), HttpConfig::new("shop"), Duration::ZERO).await;
    let http = HttpClient::new(app.addr);
    let key = unique_key("capture");

    let first = http
        .post("/payments/1/capture", Some(&key), "kim", "")
        .await;
    let other_resource = http
        .post("/payments/2/capture", Some(&key), "kim", "")
        .await;
    let other_query = http
        .post("/payments/1/capture?amount=5", Some(&key), "kim", "")
        .await;
    let same = http
        .post("/payments/1/capture", Some(&key), "kim", "")
        .await;

    assert_eq!(first.status, 201);
    assert_eq!(other_resource.status, 422, "{other_resource:?}");
    assert_eq!(other_query.status, 422, "{other_query:?}");
    assert_eq!(same.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.ledger.calls("/payments/{id}/capture", "kim"), 1);
}

#[tokio::test]
async fn a_response_too_large_to_store_is_never_run_twice() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let config = HttpConfig::new("shop").max_stored_bytes(1024);
    let app = PaymentsApp::start(client_of(&server), config, Duration::ZERO).await;
    let http = HttpClient::new(app.addr);
    let key = unique_key("huge");

    let first = http
        .post("/payments", Some(&key), "lee", r#"{"outcome":"huge"}"#)
        .await;
    let retry = http
        .post("/payments", Some(&key), "lee", r#"{"outcome":"huge"}"#)
        .await;

    assert_eq!(
        (first.status, first.body.len()),
        (201, 4096),
        "the first answer is whole"
    );
    assert_eq!(retry.status, 500, "{retry:?}");
    assert!(retry.body.contains("response-not-replayable"), "{retry:?}");
    assert_eq!(app.ledger.calls("/payments", "lee"), 1);
}

#[tokio::test]
async fn a_5xx_too_large_to_store_still_releases_the_key() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let config = HttpConfig::new("shop").max_stored_bytes(1024);
    let app = PaymentsApp::start(client_of(&server), config, Duration::ZERO).await;
    let http = HttpClient::new(app.addr);
    let key = unique_key("huge-bank-down");
    let body = r#"{"outcome":"huge_bank_down"}"#;

    let first = http.post("/payments", Some(&key), "mia", body).await;
    let retry = http.post("/payments", Some(&key), "mia", body).await;

    assert_eq!((first.status, first.body.len()), (502, 4096));
    assert_eq!((retry.status, retry.body.len()), (502, 4096), "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(
        app.ledger.calls("/payments", "mia"),
        2,
        "the retry ran again"
    );
}

/// Sends `{"status":code}` twice under one key for `user`; the two answers.
async fn twice(http: &HttpClient, user: &str, code: u16) -> (HttpAnswer, HttpAnswer) {
    let key = unique_key(&format!("status-{code}"));
    let body = format!(r#"{{"status":{code}}}"#);
    let first = http.post("/payments", Some(&key), user, &body).await;
    let retry = http.post("/payments", Some(&key), user, &body).await;
    (first, retry)
}

#[tokio::test]
async fn a_408_409_425_or_429_from_the_handler_releases_the_key_and_the_retry_runs_it_again() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;

    for code in [408, 409, 425, 429] {
        let user = format!("nina-{code}");
        let (first, retry) = twice(&http, &user, code).await;

        assert_eq!((first.status, retry.status), (code, code), "{retry:?}");
        assert_eq!(
            retry.header("idempotent-replayed"),
            None,
            "{code}: not stored"
        );
        assert_eq!(retry.body, format!(r#"{{"status":{code},"call":2}}"#));
        assert_eq!(app.ledger.calls("/payments", &user), 2, "{code}: ran again");
    }
}

#[tokio::test]
async fn a_400_404_or_422_from_the_handler_is_stored_and_replayed() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (app, http) = app(&server, HttpConfig::new("shop")).await;

    for code in [400, 404, 422] {
        let user = format!("omar-{code}");
        let (first, retry) = twice(&http, &user, code).await;

        assert_eq!((first.status, retry.status), (code, code), "{retry:?}");
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{code}");
        assert_eq!(retry.body, first.body);
        assert_eq!(app.ledger.calls("/payments", &user), 1, "{code}: ran once");
    }
}

#[tokio::test]
async fn a_storage_rule_of_ones_own_replaces_the_default() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    // Store 429 (released by default); release 404 (stored by default).
    let config = HttpConfig::new("shop").store_when(|status| {
        status == StatusCode::TOO_MANY_REQUESTS
            || (status != StatusCode::NOT_FOUND && HttpConfig::stores_by_default(status))
    });
    let (app, http) = app(&server, config).await;

    let (_, limited) = twice(&http, "pat", 429).await;
    let (_, missing) = twice(&http, "quinn", 404).await;

    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.ledger.calls("/payments", "pat"), 1);
    assert_eq!(missing.status, 404);
    assert_eq!(missing.header("idempotent-replayed"), None);
    assert_eq!(app.ledger.calls("/payments", "quinn"), 2);
}

#[tokio::test]
async fn problem_types_and_their_documentation_link_are_configurable() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let (_default_app, default) = app(&server, HttpConfig::new("shop")).await;
    let config = HttpConfig::new("shop")
        .max_stored_bytes(1024)
        .problem_type_base("https://docs.example.com/problems/")
        .problem_docs("https://docs.example.com/idempotency");
    let (_app, http) = app(&server, config).await;
    let key = unique_key("documented");
    let huge = r#"{"outcome":"huge"}"#;

    let plain = default.post("/payments", Some("short"), "rita", "{}").await;
    let malformed = http.post("/payments", Some("short"), "rita", "{}").await;
    http.post("/payments", Some(&key), "rita", huge).await;
    let unreplayable = http.post("/payments", Some(&key), "rita", huge).await;

    assert!(
        plain
            .body
            .contains(r#""type":"urn:idempotency:problem:malformed-idempotency-key""#),
        "{plain:?}"
    );
    assert_eq!(plain.header("link"), None);
    let link = Some(r#"<https://docs.example.com/idempotency>; rel="describedby""#);
    assert_eq!(malformed.status, 400);
    assert!(
        malformed
            .body
            .contains(r#""type":"https://docs.example.com/problems/malformed-idempotency-key""#),
        "{malformed:?}"
    );
    assert_eq!(malformed.header("link"), link);
    assert_eq!(unreplayable.status, 500, "{unreplayable:?}");
    assert!(
        unreplayable
            .body
            .contains(r#""type":"https://docs.example.com/problems/response-not-replayable""#),
        "{unreplayable:?}"
    );
    assert_eq!(unreplayable.header("link"), link, "stored with the problem");
}
