//! Short forms of the calls the tests make over and over.

pub use idempotency_tests::{assert_error, capture_logs};

use idempotency_client::pb::{
    self, acquire_response::Outcome, idempotency_service_client::IdempotencyServiceClient,
};
use tonic::{Status, transport::Channel};

pub type Client = IdempotencyServiceClient<Channel>;

pub async fn acquire_request(client: &mut Client, request: pb::AcquireRequest) -> Outcome {
    client
        .acquire(request)
        .await
        .expect("Acquire succeeds")
        .into_inner()
        .outcome
        .expect("Acquire answers with an outcome")
}

pub async fn acquire(client: &mut Client, id: &pb::RecordId, fingerprint: &[u8]) -> Outcome {
    acquire_request(
        client,
        pb::AcquireRequest {
            id: Some(id.clone()),
            fingerprint: fingerprint.to_vec(),
            ..Default::default()
        },
    )
    .await
}

/// Acquires with a lease of `lease_seconds`.
pub async fn acquire_leased(
    client: &mut Client,
    id: &pb::RecordId,
    fingerprint: &[u8],
    lease_seconds: i64,
) -> Outcome {
    acquire_request(
        client,
        pb::AcquireRequest {
            id: Some(id.clone()),
            fingerprint: fingerprint.to_vec(),
            lease: Some(idempotency_tests::seconds(lease_seconds)),
            ..Default::default()
        },
    )
    .await
}

/// The fencing token of an ACQUIRED outcome; anything else fails the test.
pub fn token(outcome: &Outcome) -> u64 {
    match outcome {
        Outcome::Acquired(acquired) => acquired.fencing_token,
        other => panic!("expected ACQUIRED, got {other:?}"),
    }
}

pub async fn complete(
    client: &mut Client,
    id: &pb::RecordId,
    fencing_token: u64,
    response: pb::StoredResponse,
) -> Result<pb::CompleteResponse, Status> {
    client
        .complete(pb::CompleteRequest {
            id: Some(id.clone()),
            fencing_token,
            response: Some(response),
        })
        .await
        .map(tonic::Response::into_inner)
}

pub async fn fail(
    client: &mut Client,
    id: &pb::RecordId,
    fencing_token: u64,
    retryable: bool,
    error_response: Option<pb::StoredResponse>,
) -> Result<pb::FailResponse, Status> {
    client
        .fail(pb::FailRequest {
            id: Some(id.clone()),
            fencing_token,
            retryable,
            error_response,
        })
        .await
        .map(tonic::Response::into_inner)
}

pub async fn renew(
    client: &mut Client,
    id: &pb::RecordId,
    fencing_token: u64,
    lease_seconds: i64,
) -> Result<pb::RenewResponse, Status> {
    client
        .renew(pb::RenewRequest {
            id: Some(id.clone()),
            fencing_token,
            lease: Some(idempotency_tests::seconds(lease_seconds)),
        })
        .await
        .map(tonic::Response::into_inner)
}

pub async fn get(client: &mut Client, id: &pb::RecordId) -> Result<pb::Record, Status> {
    client
        .get(pb::GetRequest {
            id: Some(id.clone()),
        })
        .await
        .map(|response| {
            response
                .into_inner()
                .record
                .expect("Get answers with a record")
        })
}

/// Waits out a lease (or ttl) of `seconds`, with margin for the database clock.
pub async fn wait_past(seconds: u64) {
    tokio::time::sleep(std::time::Duration::from_millis(seconds * 1000 + 150)).await;
}

/// An Acquire whose error the test inspects.
pub async fn try_acquire(
    client: &mut Client,
    id: &pb::RecordId,
    fingerprint: &[u8],
) -> Result<pb::AcquireResponse, Status> {
    client
        .acquire(pb::AcquireRequest {
            id: Some(id.clone()),
            fingerprint: fingerprint.to_vec(),
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The admin CLI's id arguments for `id`.
pub fn id_args(id: &pb::RecordId) -> idempotency_server::settings::RecordIdArgs {
    idempotency_server::settings::RecordIdArgs {
        namespace: id.namespace.clone(),
        operation: id.operation.clone(),
        subject: id.subject.clone(),
        key: id.key.clone(),
    }
}

/// The admin CLI's arguments to purge the one record `id`.
pub fn purge_args(id: &pb::RecordId) -> idempotency_server::settings::PurgeArgs {
    idempotency_server::settings::PurgeArgs {
        namespace: id.namespace.clone(),
        operation: Some(id.operation.clone()),
        subject: Some(id.subject.clone()),
        key: Some(id.key.clone()),
        yes: false,
        operator: Some("test-operator".into()),
    }
}

/// Runs an admin CLI command against `db` and returns what it printed. A
/// purge of more than one record finds no terminal to confirm it on.
pub async fn run_admin(
    db: &idempotency_tests::TestDb,
    command: idempotency_server::settings::AdminCommand,
    json: bool,
) -> Result<String, idempotency_server::admin::AdminError> {
    let (printed, _questions) = run_admin_answering(
        db,
        command,
        json,
        idempotency_server::admin::Answer::NoTerminal,
    )
    .await;
    printed
}

/// Runs an admin CLI command, answering `answer` to any question it asks;
/// returns what it printed and the questions.
pub async fn run_admin_answering(
    db: &idempotency_tests::TestDb,
    command: idempotency_server::settings::AdminCommand,
    json: bool,
    answer: idempotency_server::admin::Answer,
) -> (
    Result<String, idempotency_server::admin::AdminError>,
    Vec<String>,
) {
    let mut out = Vec::new();
    let mut questions = Vec::new();
    let mut confirm = |question: &str| {
        questions.push(question.to_owned());
        answer
    };
    let ran = idempotency_server::admin::run(&db.pool, command, json, &mut out, &mut confirm).await;
    (ran.map(|()| String::from_utf8(out).unwrap()), questions)
}

/// The audit lines among captured log events.
pub fn audit_lines(events: &[serde_json::Value]) -> Vec<serde_json::Value> {
    events
        .iter()
        .filter(|event| event["target"] == "audit")
        .cloned()
        .collect()
}

/// Polls /metrics until `series` has a value satisfying `expected`.
pub async fn wait_for_metric(
    server: &idempotency_tests::TestServer,
    series: &str,
    expected: impl Fn(f64) -> bool,
) -> String {
    for _ in 0..100 {
        let page = idempotency_tests::http_get(server.metrics_addr, "/metrics").await;
        if idempotency_tests::metric_value(&page, series).is_some_and(&expected) {
            return page;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let page = idempotency_tests::http_get(server.metrics_addr, "/metrics").await;
    panic!("{series} never reached the expected value in\n{page}");
}
