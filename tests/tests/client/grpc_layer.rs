//! The gRPC layer end to end: real server, real Postgres, the example's
//! tonic payments service behind the layer, and gRPC clients over 127.0.0.1.

use std::time::Duration;

use bytes::Bytes;
use idempotency_client::{
    OnUnavailable, RecordId, RecordState,
    grpc::{GrpcConfig, reason},
};
use idempotency_tests::{
    TestDb, TestServer,
    grpc_app::{DESCRIPTOR_SET, GrpcApp, call_raw, keyed, pb},
    unique_key,
};
use prost::{
    Message,
    encoding::{WireType, encode_key, encode_varint},
};
use tokio_stream::StreamExt;
use tonic::{Code, Status};
use tonic_reflection::pb::v1alpha::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest,
};
use tonic_types::StatusExt;

use crate::support::*;

const CHARGE: &str = "/payments.v1.Payments/Charge";

fn config() -> GrpcConfig {
    GrpcConfig::new("shop", DESCRIPTOR_SET)
}

async fn app(server: &TestServer, config: GrpcConfig, bank_delay: Duration) -> GrpcApp {
    GrpcApp::start(client_of(server), config, bank_delay).await
}

fn charge(amount: i64, currency: &str) -> pb::ChargeRequest {
    pb::ChargeRequest {
        amount,
        currency: currency.into(),
        ..Default::default()
    }
}

/// The `ErrorInfo` of a status the layer made: (domain, reason).
fn error_info(status: &Status) -> (String, String) {
    let details = status.get_error_details();
    let info = details.error_info().expect("an ErrorInfo");
    (info.domain.clone(), info.reason.clone())
}

fn record(key: &str, user: &str) -> RecordId {
    RecordId::new("shop", CHARGE, key).with_subject(user)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_duplicates_run_the_handler_once_and_all_get_its_reply() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config(), Duration::from_millis(800)).await;
    let key = unique_key("race");
    let channel = app.channel().await;

    let callers: Vec<_> = (0..64)
        .map(|_| {
            let mut payments = pb::payments_client::PaymentsClient::new(channel.clone());
            let key = key.clone();
            tokio::spawn(async move {
                let mut aborted = 0;
                loop {
                    let request = keyed(charge(1000, "EUR"), Some(&key), "alice");
                    match payments.charge(request).await {
                        Ok(reply) => return (reply.into_inner(), aborted),
                        Err(status) => {
                            assert_eq!(status.code(), Code::Aborted, "{status:?}");
                            let details = status.get_error_details();
                            assert!(details.retry_info().unwrap().retry_delay.is_some());
                            assert_eq!(
                                error_info(&status),
                                ("idempotency".into(), reason::IN_PROGRESS.into())
                            );
                            aborted += 1;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            })
        })
        .collect();
    let mut replies = Vec::new();
    let mut aborted = 0;
    for caller in callers {
        let (reply, times) = caller.await.unwrap();
        replies.push(reply);
        aborted += times;
    }

    assert_eq!(app.ledger.attempts(), 1, "the handler ran once");
    assert!(
        replies.iter().all(|reply| *reply == replies[0]),
        "{replies:?}"
    );
    assert_eq!(replies[0].payment_id, "pay_1");
    assert!(aborted >= 63, "the duplicates were told to wait: {aborted}");
}

#[tokio::test]
async fn a_replay_carries_idempotent_replayed_and_the_same_metadata_and_message() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config(), Duration::ZERO).await;
    let mut payments = app.client().await;
    let key = unique_key("replay");

    let first = payments
        .charge(keyed(charge(1000, "EUR"), Some(&key), "bob"))
        .await
        .unwrap();
    let again = payments
        .charge(keyed(charge(1000, "EUR"), Some(&key), "bob"))
        .await
        .unwrap();

    assert!(first.metadata().get("idempotent-replayed").is_none());
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again.metadata().get("x-payment-id").unwrap(), "pay_1");
    assert_eq!(first.metadata().get("x-payment-id").unwrap(), "pay_1");
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(again.get_ref().user, "bob");
    assert_eq!(app.ledger.attempts(), 1);
    // The key is scoped to the subject: another user's call with it runs.
    let other = payments
        .charge(keyed(charge(1000, "EUR"), Some(&key), "carol"))
        .await
        .unwrap();
    assert_eq!(other.get_ref().payment_id, "pay_2");
}

#[tokio::test]
async fn the_same_key_with_another_message_is_failed_precondition_with_its_reason() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config(), Duration::ZERO).await;
    let mut payments = app.client().await;
    let key = unique_key("reuse");
    payments
        .charge(keyed(charge(1000, "EUR"), Some(&key), "dave"))
        .await
        .unwrap();

    let status = payments
        .charge(keyed(charge(9999, "EUR"), Some(&key), "dave"))
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(
        error_info(&status),
        ("idempotency".into(), reason::REUSED.into())
    );
    assert_eq!(app.ledger.attempts(), 1);
}

#[tokio::test]
async fn unavailable_from_the_handler_releases_the_key_and_invalid_argument_is_stored_and_replayed()
{
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config(), Duration::ZERO).await;
    let mut payments = app.client().await;
    let (retried, refused) = (unique_key("unavailable"), unique_key("invalid"));

    for _ in 0..2 {
        let status = payments
            .charge(keyed(charge(1000, "XXX"), Some(&retried), "erin"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.metadata().get("idempotent-replayed").is_none());
    }
    assert_eq!(app.ledger.attempts(), 2, "released: the next attempt ran");
    let released = client_of(&server)
        .get(&record(&retried, "erin"))
        .await
        .unwrap();
    assert_eq!(released.unwrap().state, RecordState::Released);

    let first = payments
        .charge(keyed(charge(0, "EUR"), Some(&refused), "erin"))
        .await
        .unwrap_err();
    let replayed = payments
        .charge(keyed(charge(0, "EUR"), Some(&refused), "erin"))
        .await
        .unwrap_err();

    assert_eq!(first.code(), Code::InvalidArgument);
    assert_eq!(replayed.code(), Code::InvalidArgument);
    assert_eq!(replayed.message(), "amount must be positive");
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(
        app.ledger.attempts(),
        3,
        "stored: the handler did not run again"
    );
}

#[tokio::test]
async fn calls_without_a_key_pass_through_unless_required_and_malformed_keys_are_refused() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let open = app(&server, config(), Duration::ZERO).await;
    let mut payments = open.client().await;

    for expected in ["pay_1", "pay_2"] {
        let reply = payments
            .charge(keyed(charge(5, "EUR"), None, "frank"))
            .await
            .unwrap();
        assert_eq!(reply.get_ref().payment_id, expected);
    }

    let strict = app(&server, config().require_key(true), Duration::ZERO).await;
    let mut payments = strict.client().await;
    for (key, expected) in [
        (None, reason::MISSING),
        (Some("short"), reason::MALFORMED),
        (Some("has space in it"), reason::MALFORMED),
    ] {
        let status = payments
            .charge(keyed(charge(5, "EUR"), key, "frank"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{key:?}");
        assert_eq!(error_info(&status).1, expected);
        let details = status.get_error_details();
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations[0].field, "idempotency-key");
    }
    assert_eq!(strict.ledger.attempts(), 0);
}

#[tokio::test]
async fn streaming_and_unknown_methods_pass_through_untouched() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config().require_key(true), Duration::ZERO).await;
    let mut payments = app.client().await;
    let key = unique_key("stream");
    payments
        .charge(keyed(charge(7, "EUR"), Some(&key), "gina"))
        .await
        .unwrap();

    // A server-streaming method, twice under one key, without the key required.
    for _ in 0..2 {
        let mut stream = payments
            .watch(keyed(pb::WatchRequest {}, Some(&key), "gina"))
            .await
            .unwrap()
            .into_inner();
        let charge = stream.message().await.unwrap().unwrap();
        assert_eq!(charge.payment_id, "pay_1");
        assert!(stream.message().await.unwrap().is_none());
    }
    // A method the descriptor set does not hold: the server's own answer.
    let unknown = call_raw(
        app.channel().await,
        "/payments.v1.Payments/Refund",
        Bytes::new(),
        None,
        "gina",
    )
    .await
    .unwrap_err();
    assert_eq!(unknown.code(), Code::Unimplemented, "{unknown:?}");
    // Reflection (v1alpha, as `grpcurl list` asks it), a service outside the descriptor set.
    let mut reflection = ServerReflectionClient::new(app.channel().await);
    let list = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(keyed(tokio_stream::iter([list]), Some(&key), "gina"))
        .await
        .unwrap()
        .into_inner();
    let listed = format!("{:?}", answers.next().await.unwrap().unwrap());
    assert!(listed.contains("payments.v1.Payments"), "{listed}");

    let stored = client_of(&server)
        .get(&record(&key, "gina"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.state, RecordState::Completed);
    let other = RecordId::new("shop", "/payments.v1.Payments/Watch", key).with_subject("gina");
    assert_eq!(client_of(&server).get(&other).await.unwrap(), None);
}

/// Field `number` as a varint.
fn varint(number: u32, value: u64, out: &mut Vec<u8>) {
    encode_key(number, WireType::Varint, out);
    encode_varint(value, out);
}

/// Field `number` length-delimited.
fn delimited(number: u32, bytes: &[u8], out: &mut Vec<u8>) {
    encode_key(number, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

fn map_entry(key: &str, value: &str) -> Vec<u8> {
    let mut entry = Vec::new();
    delimited(1, key.as_bytes(), &mut entry);
    delimited(2, value.as_bytes(), &mut entry);
    entry
}

#[tokio::test]
async fn two_encodings_of_one_message_share_a_fingerprint_and_another_message_does_not() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config(), Duration::ZERO).await;
    let key = unique_key("encoding");
    // As prost encodes it: fields in order, item_ids packed, map entries a, b.
    let message = pb::ChargeRequest {
        amount: 1000,
        currency: "EUR".into(),
        metadata: [("a", "1"), ("b", "2"), ("trace_id", "t-1")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        item_ids: vec![7, 8],
    };
    let mut first = Vec::new();
    varint(1, 1000, &mut first);
    delimited(2, b"EUR", &mut first);
    for (k, v) in [("a", "1"), ("b", "2"), ("trace_id", "t-1")] {
        delimited(3, &map_entry(k, v), &mut first);
    }
    delimited(4, &[7, 8], &mut first);
    assert_eq!(
        pb::ChargeRequest::decode(first.as_slice()).unwrap(),
        message
    );
    // Another library's encoding: fields out of order, item_ids unpacked,
    // map entries reversed, an unknown field, and another (excluded) trace id.
    let mut second = Vec::new();
    varint(4, 7, &mut second);
    delimited(3, &map_entry("trace_id", "t-2"), &mut second);
    delimited(3, &map_entry("b", "2"), &mut second);
    varint(99, 1, &mut second);
    delimited(2, b"EUR", &mut second);
    varint(4, 8, &mut second);
    delimited(3, &map_entry("a", "1"), &mut second);
    varint(1, 1000, &mut second);

    let (_, reply) = call_raw(app.channel().await, CHARGE, first.into(), Some(&key), "hal")
        .await
        .unwrap();
    let (metadata, replayed) = call_raw(
        app.channel().await,
        CHARGE,
        second.into(),
        Some(&key),
        "hal",
    )
    .await
    .unwrap();

    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(replayed, reply);
    assert_eq!(app.ledger.attempts(), 1);

    // Another message (item_ids in another order) under the key: a mismatch.
    let mut other = message.clone();
    other.item_ids = vec![8, 7];
    let status = call_raw(
        app.channel().await,
        CHARGE,
        other.encode_to_vec().into(),
        Some(&key),
        "hal",
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
}

#[tokio::test]
async fn with_the_service_down_fail_closed_answers_unavailable_and_fail_open_runs_the_handler() {
    let closed = GrpcApp::start(client_of_nothing().await, config(), Duration::ZERO).await;
    let open = GrpcApp::start(
        client_of_nothing().await,
        config().on_unavailable(OnUnavailable::FailOpen),
        Duration::ZERO,
    )
    .await;
    let key = unique_key("down");

    let refused = closed
        .client()
        .await
        .charge(keyed(charge(1, "EUR"), Some(&key), "ivy"))
        .await
        .unwrap_err();
    let ran = open
        .client()
        .await
        .charge(keyed(charge(1, "EUR"), Some(&key), "ivy"))
        .await
        .unwrap();

    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(error_info(&refused).1, reason::UNAVAILABLE);
    assert!(refused.get_error_details().retry_info().is_some());
    assert_eq!(closed.ledger.attempts(), 0);
    assert_eq!(ran.get_ref().payment_id, "pay_1");
    assert_eq!(open.ledger.attempts(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_keeps_running_when_the_caller_hangs_up_and_its_reply_is_stored() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config(), Duration::from_millis(1500)).await;
    let key = unique_key("hangup");
    let mut payments = app.client().await;

    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        payments.charge(keyed(charge(42, "EUR"), Some(&key), "jo")),
    )
    .await;
    assert!(gave_up.is_err());
    let retry = payments
        .charge(keyed(charge(42, "EUR"), Some(&key), "jo"))
        .await
        .unwrap_err();
    assert_eq!(retry.code(), Code::Aborted, "{retry:?}");

    wait_for_state(
        &client_of(&server),
        &record(&key, "jo"),
        RecordState::Completed,
    )
    .await;
    let later = payments
        .charge(keyed(charge(42, "EUR"), Some(&key), "jo"))
        .await
        .unwrap();

    assert_eq!(later.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(later.get_ref().payment_id, "pay_1");
    assert_eq!(app.ledger.attempts(), 1);
}

#[tokio::test]
async fn a_reply_too_large_to_store_is_answered_once_and_retries_get_a_stored_internal() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config().max_stored_bytes(8), Duration::ZERO).await;
    let mut payments = app.client().await;
    let key = unique_key("large");

    let first = payments
        .charge(keyed(charge(1000, "EUR"), Some(&key), "kim"))
        .await
        .unwrap();
    wait_for_state(
        &client_of(&server),
        &record(&key, "kim"),
        RecordState::Failed,
    )
    .await;
    let retry = payments
        .charge(keyed(charge(1000, "EUR"), Some(&key), "kim"))
        .await
        .unwrap_err();

    assert_eq!(
        first.get_ref().payment_id,
        "pay_1",
        "the caller got the whole reply"
    );
    assert_eq!(retry.code(), Code::Internal, "{retry:?}");
    assert_eq!(error_info(&retry).1, reason::NOT_REPLAYABLE);
    assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(app.ledger.attempts(), 1, "the handler did not run again");
}

#[tokio::test]
async fn a_request_over_the_limit_is_resource_exhausted_and_never_runs() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let app = app(&server, config().max_request_bytes(32), Duration::ZERO).await;
    let mut request = charge(1000, "EUR");
    request.metadata.insert("note".into(), "x".repeat(64));

    let status = app
        .client()
        .await
        .charge(keyed(request, Some(&unique_key("big")), "lee"))
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(error_info(&status).1, reason::TOO_LARGE);
    assert_eq!(app.ledger.attempts(), 0);
}

#[test]
fn generated_code_of_the_example_is_up_to_date() {
    let out = env!("OUT_DIR");
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../client/examples/grpc_payments"
    );
    for file in ["payments.v1.rs", "payments_descriptor.bin"] {
        let generated = std::fs::read(format!("{out}/{file}")).unwrap();
        let committed = std::fs::read(format!("{example}/{file}")).unwrap();
        assert!(
            generated == committed,
            "{example}/{file} is out of date with payments.proto: cp {out}/{file} {example}/"
        );
    }
}
