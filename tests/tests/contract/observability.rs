//! Health, reflection and /metrics, as operators and tools see them.

use std::time::Duration;

use idempotency_tests::{
    TestDb, TestServer, http_get, record_id, spawn_app, test_settings, unique_key,
};
use tokio_stream::StreamExt;
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};

use crate::{outage::wait_for_health, support::*};

#[tokio::test]
async fn metrics_count_calls_by_rpc_and_outcome_with_help_text() {
    let mut app = spawn_app().await;
    let id = record_id(&unique_key("metrics"));
    token(&acquire(&mut app.client, &id, b"fp").await);
    acquire(&mut app.client, &id, b"fp").await;
    let _ = get(&mut app.client, &record_id(&unique_key("absent"))).await;

    let page = http_get(app.server.metrics_addr, "/metrics").await;

    assert!(
        page.starts_with("HTTP/1.0 200") || page.starts_with("HTTP/1.1 200"),
        "{page}"
    );
    for expected in [
        "# HELP idempotency_requests_total",
        "# TYPE idempotency_request_duration_seconds histogram",
        r#"idempotency_requests_total{rpc="Acquire",outcome="acquired",namespace="payments"}"#,
        r#"idempotency_requests_total{rpc="Acquire",outcome="in_progress",namespace="payments"}"#,
        r#"idempotency_requests_total{rpc="Get",outcome="not_found",namespace="payments"}"#,
        r#"idempotency_request_duration_seconds_bucket{rpc="Acquire",outcome="acquired",le="0.0001"}"#,
    ] {
        assert!(page.contains(expected), "missing {expected} in\n{page}");
    }
}

#[tokio::test]
async fn a_fresh_server_shows_its_fixed_counters_at_zero() {
    // Each test runs in its own process (nextest), so the recorder is fresh.
    let app = spawn_app().await;

    let page = http_get(app.server.metrics_addr, "/metrics").await;

    let value = |series: &str| idempotency_tests::metric_value(&page, series);
    for series in [
        r#"idempotency_request_timeouts_total{rpc="Acquire"}"#,
        r#"idempotency_request_timeouts_total{rpc="BatchComplete"}"#,
        r#"idempotency_admission_refused_total{reason="overloaded"}"#,
        r#"idempotency_admission_refused_total{reason="too_many_headers"}"#,
        r#"idempotency_grpc_connections_closed_total{reason="refused"}"#,
        "idempotency_grpc_calls_refused_total",
        r#"idempotency_db_calls_alone_total{query="acquire"}"#,
        "idempotency_db_connections_abandoned_total",
        "idempotency_db_connections_read_only_total",
        r#"idempotency_database_probes_total{result="timeout"}"#,
        r#"idempotency_reaper_runs_total{result="error"}"#,
        r#"idempotency_auth_denied_total{reason="namespace_forbidden"}"#,
    ] {
        assert_eq!(value(series), Some(0.0), "{series} in\n{page}");
    }
}

#[tokio::test]
async fn an_invalid_request_is_counted_under_a_label_no_namespace_can_take() {
    let mut app = spawn_app().await;
    let invalid = idempotency_client::pb::RecordId {
        namespace: "Not A Namespace".into(),
        ..record_id(&unique_key("invalid"))
    };
    try_acquire(&mut app.client, &invalid, b"fp")
        .await
        .expect_err("an invalid namespace is refused");

    let page = wait_for_metric(
        &app.server,
        r#"idempotency_requests_total{rpc="Acquire",outcome="invalid_argument",namespace="_invalid"}"#,
        |v| v == 1.0,
    )
    .await;

    assert!(!page.contains(r#"namespace="unknown""#), "{page}");
}

#[tokio::test]
async fn health_is_serving_for_the_server_and_the_api_while_the_database_answers() {
    let app = spawn_app().await;
    let mut health = HealthClient::new(TestServer::channel_to(app.server.addr).await);

    wait_for_health(&mut health, ServingStatus::Serving).await;
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_api_and_health() {
    use tonic_reflection::pb::{v1, v1alpha};
    let app = spawn_app().await;
    let channel = TestServer::channel_to(app.server.addr).await;

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
}

/// A server with the reaper and the table gauges on short intervals.
async fn observed_server(db: &TestDb, max_namespaces: usize) -> TestServer {
    let mut settings = test_settings(db);
    settings.reaper_enabled = true;
    settings.reaper.reaper_interval = Duration::from_millis(200);
    settings.stats_interval = Duration::from_millis(200);
    settings.metrics_max_namespaces = max_namespaces;
    TestServer::start_with(settings).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeovers_replays_and_mismatches_are_counted_by_namespace_with_a_cap() {
    let db = TestDb::new().await;
    let server = observed_server(&db, 2).await;
    let mut client = server.client.clone();
    let lapsed = record_id(&unique_key("lapsed"));
    let first = token(&acquire_leased(&mut client, &lapsed, b"fp", 1).await);
    let released = record_id(&unique_key("released"));
    let t = token(&acquire(&mut client, &released, b"fp").await);
    fail(&mut client, &released, t, true, None).await.unwrap();
    wait_past(1).await;

    let took_over = token(&acquire(&mut client, &lapsed, b"fp").await); // a takeover
    assert!(took_over > first);
    assert!(token(&acquire(&mut client, &released, b"fp").await) > t); // not a takeover
    complete(
        &mut client,
        &lapsed,
        took_over,
        idempotency_tests::response(201, "x"),
    )
    .await
    .unwrap();
    acquire(&mut client, &lapsed, b"fp").await; // a replay
    acquire(&mut client, &lapsed, b"other").await; // a mismatch
    for namespace in ["second", "third", "fourth"] {
        let id = idempotency_client::pb::RecordId {
            namespace: namespace.into(),
            ..record_id(&unique_key("ns"))
        };
        token(&acquire(&mut client, &id, b"").await);
    }

    let page = wait_for_metric(
        &server,
        r#"idempotency_lease_takeovers_total{namespace="payments"}"#,
        |v| v == 1.0,
    )
    .await;
    let value = |series: &str| idempotency_tests::metric_value(&page, series);
    assert_eq!(
        value(r#"idempotency_replays_total{namespace="payments"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"idempotency_fingerprint_mismatches_total{namespace="payments"}"#),
        Some(1.0)
    );
    // Two namespaces named (payments, second), the rest counted as _other.
    assert_eq!(
        value(r#"idempotency_requests_total{rpc="Acquire",outcome="acquired",namespace="second"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(r#"idempotency_requests_total{rpc="Acquire",outcome="acquired",namespace="_other"}"#),
        Some(2.0)
    );
    assert!(!page.contains(r#"namespace="third""#), "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_pool_and_reaper_gauges_are_published() {
    let db = TestDb::new().await;
    idempotency_tests::insert_records(&db.pool, "old", 50, 60).await;
    idempotency_tests::insert_records(&db.pool, "live", 7, -3600).await;
    let server = observed_server(&db, 200).await;
    // One call, so that the pool has been waited on (a Get writes nothing).
    let mut client = server.client.clone();
    let _ = get(&mut client, &record_id(&unique_key("pool-wait"))).await;

    // Background tasks publish at their own pace: wait until all have.
    let mut page = String::new();
    for _ in 0..100 {
        page = http_get(server.metrics_addr, "/metrics").await;
        let value = |series: &str| idempotency_tests::metric_value(&page, series);
        if value("idempotency_reaper_deleted_total") == Some(50.0)
            && value(r#"idempotency_records{state="completed"}"#) == Some(7.0)
            && value("idempotency_db_pool_max_connections").is_some()
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let value = |series: &str| idempotency_tests::metric_value(&page, series);
    assert_eq!(
        value("idempotency_reaper_deleted_total"),
        Some(50.0),
        "{page}"
    );
    assert_eq!(
        value(r#"idempotency_records{state="completed"}"#),
        Some(7.0),
        "{page}"
    );

    assert!(value("idempotency_table_bytes").unwrap() > 8192.0);
    assert_eq!(
        value(r#"idempotency_records{state="in_progress"}"#),
        Some(0.0)
    );
    assert!(value("idempotency_reaper_last_success_timestamp_seconds").unwrap() > 1.7e9);
    assert!(value(r#"idempotency_reaper_runs_total{result="success"}"#).unwrap() >= 1.0);
    assert_eq!(value("idempotency_db_pool_max_connections"), Some(16.0));
    assert!(value(r#"idempotency_db_pool_connections{state="idle"}"#).is_some());
    assert!(
        page.contains(r#"idempotency_db_query_duration_seconds_bucket{query="reap""#),
        "{page}"
    );
    assert!(
        page.contains("idempotency_db_pool_wait_seconds_bucket"),
        "{page}"
    );
    assert_eq!(db.row_count().await, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_page_passes_promtool_check_metrics() {
    let db = TestDb::new().await;
    idempotency_tests::insert_records(&db.pool, "old", 3, 60).await;
    let server = observed_server(&db, 200).await;
    let mut client = server.client.clone();
    // Exercise every kind of metric: calls of each outcome, the reaper, the gauges.
    let id = record_id(&unique_key("promtool"));
    let t = token(&acquire(&mut client, &id, b"fp").await);
    acquire(&mut client, &id, b"fp").await;
    acquire(&mut client, &id, b"other").await;
    complete(&mut client, &id, t, idempotency_tests::response(201, "x"))
        .await
        .unwrap();
    acquire(&mut client, &id, b"fp").await;
    let _ = get(&mut client, &record_id("short")).await;
    wait_for_metric(&server, "idempotency_reaper_deleted_total", |v| v == 3.0).await;
    let page = wait_for_metric(&server, "idempotency_table_bytes", |v| v > 0.0).await;
    let body = page.split_once("\r\n\r\n").expect("an HTTP answer").1;

    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool on PATH: `make test` installs it (scripts/install-deploy-tools.sh)");
    use std::io::Write;
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let output = promtool.wait_with_output().unwrap();

    assert!(
        output.status.success(),
        "promtool check metrics failed:\n{}{}\n--- page ---\n{body}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Text log lines written to a pipe (a file, a container's log collector)
/// carry no colour codes: they stay greppable and parse as plain text.
#[tokio::test]
async fn text_logs_to_a_pipe_carry_no_colour_codes() {
    use std::io::{BufRead, BufReader};
    let db = TestDb::new().await;
    let mut child = std::process::Command::new(idempotency_tests::process::idempotencyd())
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(["--log-format", "text", "--reaper-enabled", "false"])
        .env_clear()
        .env("DATABASE_URL", db.url().as_str())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("starting idempotencyd");
    let stdout = child.stdout.take().expect("piped stdout");
    let announced = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|line| line.contains("serving gRPC"))
    });
    let announced = tokio::time::timeout(Duration::from_secs(30), announced).await;
    let _ = child.kill();
    let _ = child.wait();
    let line = announced
        .expect("announced within 30 s")
        .unwrap()
        .expect("a line announcing the gRPC port");
    assert!(!line.contains('\u{1b}'), "colour codes in {line:?}");
    assert!(line.contains("addr=127.0.0.1:"), "{line}");
}
