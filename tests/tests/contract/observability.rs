//! Health, reflection and /metrics, as operators and tools see them.

use std::net::SocketAddr;

use idempotency_client::pb;
use idempotency_tests::{TestDb, TestServer, record_id, server_pool, test_config, unique_key};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};

use crate::{outage::wait_for_health, support::*};

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}

#[tokio::test]
async fn metrics_count_calls_by_rpc_and_outcome_with_help_text() {
    let db = TestDb::new().await;
    let config = idempotency_server::startup::ServerConfig {
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..test_config()
    };
    let server = TestServer::start_with(config, server_pool(db.connect_options())).await;
    let mut client = server.client.clone();
    let id = record_id(&unique_key("metrics"));
    token(&acquire(&mut client, &id, b"fp").await);
    acquire(&mut client, &id, b"fp").await;
    let _ = get(&mut client, &record_id(&unique_key("absent"))).await;

    let page = http_get(server.metrics_addr.unwrap(), "/metrics").await;

    assert!(
        page.starts_with("HTTP/1.0 200") || page.starts_with("HTTP/1.1 200"),
        "{page}"
    );
    for expected in [
        "# HELP idempotency_requests_total",
        "# TYPE idempotency_request_duration_seconds histogram",
        r#"idempotency_requests_total{rpc="Acquire",outcome="acquired"}"#,
        r#"idempotency_requests_total{rpc="Acquire",outcome="in_progress"}"#,
        r#"idempotency_requests_total{rpc="Get",outcome="not_found"}"#,
        r#"idempotency_request_duration_seconds_bucket{rpc="Acquire",outcome="acquired",le="0.0001"}"#,
    ] {
        assert!(page.contains(expected), "missing {expected} in\n{page}");
    }
}

#[tokio::test]
async fn health_is_serving_for_the_server_and_the_api_while_the_database_answers() {
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let mut health = HealthClient::new(TestServer::channel_to(server.addr).await);

    wait_for_health(&mut health, ServingStatus::Serving).await;
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_api_and_health() {
    use tonic_reflection::pb::{v1, v1alpha};
    let db = TestDb::new().await;
    let server = TestServer::start(&db).await;
    let channel = TestServer::channel_to(server.addr).await;

    let mut client_v1 = v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut responses = client_v1
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let listed = format!("{:?}", responses.next().await.unwrap().unwrap());
    assert!(
        listed.contains("idempotency.v1.IdempotencyService"),
        "{listed}"
    );
    assert!(listed.contains("grpc.health.v1.Health"), "{listed}");

    let mut client_v1alpha =
        v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol(
                "idempotency.v1.IdempotencyService".into(),
            ),
        ),
    };
    let mut responses = client_v1alpha
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = responses.next().await.unwrap().unwrap();
    assert!(
        matches!(
            answer.message_response,
            Some(v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(_))
        ),
        "{answer:?}"
    );
    let _ = pb::RecordState::Completed; // The client crate and the server agree on the package.
}
