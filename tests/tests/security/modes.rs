//! Health for probes, reflection under the policy, settings refused at
//! start, the metrics and the audit log.

use idempotency_server::{
    settings::{SecurityArgs, Settings},
    startup::{Application, StartupError},
};
use idempotency_tests::{
    TestDb, TestServer, http_get, metric_value, security::SecurityFiles, spawn_app, spawn_app_with,
    test_settings,
};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest,
};

use crate::support::*;

async fn wait_serving<T>(mut health: HealthClient<T>)
where
    T: tonic::client::GrpcService<tonic::body::Body> + Clone,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    for _ in 0..100 {
        if let Ok(response) = health.check(HealthCheckRequest::default()).await
            && response.into_inner().status == ServingStatus::Serving as i32
        {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("health never turned SERVING");
}

async fn list_services<T>(client: &mut ServerReflectionClient<T>) -> Result<(), tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::once(request))
        .await?
        .into_inner();
    answers.next().await.expect("one answer")?;
    Ok(())
}

#[tokio::test]
async fn health_needs_no_credential_and_reflection_follows_the_policy() {
    let secured = Secured::start_with(|settings| {
        settings.health_addr = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let channel =
        idempotency_tests::security::tls_channel(secured.server.addr, &secured.ca(), None)
            .await
            .unwrap();
    wait_serving(HealthClient::new(channel.clone())).await;
    // The probes' port: plain text, no credential.
    let health_addr = secured.server.health_addr.expect("a health address");
    wait_serving(HealthClient::new(TestServer::channel_to(health_addr).await)).await;
    let mut liveness = HealthClient::new(TestServer::channel_to(health_addr).await);
    let live = liveness
        .check(HealthCheckRequest {
            service: "liveness".into(),
        })
        .await
        .unwrap();
    assert_eq!(live.into_inner().status, ServingStatus::Serving as i32);

    let mut anonymous = ServerReflectionClient::new(channel.clone());
    let status = list_services(&mut anonymous).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    let granted = idempotency_tests::security::tls_channel(
        secured.server.addr,
        &secured.ca(),
        Some(&secured.cert(PAYMENTS_SPIFFE)),
    )
    .await
    .unwrap();
    list_services(&mut ServerReflectionClient::new(granted))
        .await
        .expect("a caller the policy names may use reflection");

    let mut stranger = ServerReflectionClient::with_interceptor(
        channel,
        idempotency_tests::security::Bearer(Some(STRANGER_TOKEN.into())),
    );
    let status = list_services(&mut stranger).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
}

#[tokio::test]
async fn reflection_can_be_turned_off() {
    let app = spawn_app_with(|settings| settings.reflection = false).await;
    let mut client = ServerReflectionClient::new(TestServer::channel_to(app.server.addr).await);
    let status = list_services(&mut client).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
}

async fn refused_at_start(db: &TestDb, security: SecurityArgs) -> String {
    let settings = Settings {
        security,
        ..test_settings(db)
    };
    match Application::build(settings).await {
        Err(error @ StartupError::Security(_)) => error.to_string(),
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("started with settings it should refuse"),
    }
}

#[tokio::test]
async fn security_settings_that_cannot_work_are_refused_at_start() {
    let db = TestDb::new().await;
    let files = SecurityFiles::new(&default_policy(), "{\"keys\": []}", &default_tokens());
    let mut all = test_settings(&db).security;
    files.apply(&mut all);

    let error = refused_at_start(
        &db,
        SecurityArgs {
            auth_policy: None,
            ..all.clone()
        },
    )
    .await;
    assert!(error.contains("--auth-policy"), "{error}");
    let error = refused_at_start(
        &db,
        SecurityArgs {
            jwt_jwks: None,
            static_tokens: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            ..all.clone()
        },
    )
    .await;
    assert!(error.contains("needs a way to authenticate"), "{error}");
    let error = refused_at_start(&db, all.clone()).await;
    assert!(
        error.contains("jwks.json") && error.contains("no signing key"),
        "{error}"
    );

    files.dir.write("jwks.json", "{\"keys\": []}");
    files.dir.write(
        "policy.toml",
        "[[grant]]\nprincipals = [\"a\"]\nnamespaces = [\"b\"]\nrole = \"owner\"\n",
    );
    let error = refused_at_start(
        &db,
        SecurityArgs {
            jwt_jwks: None,
            ..all.clone()
        },
    )
    .await;
    assert!(
        error.contains("policy.toml") && error.contains("line 4"),
        "{error}"
    );

    let mut missing = all.clone();
    missing.jwt_jwks = None;
    missing.auth_policy = Some(files.dir.path("policy.toml"));
    files.dir.write("policy.toml", default_policy());
    missing.tls_cert = Some(files.dir.path("no-such.crt"));
    let error = refused_at_start(&db, missing).await;
    assert!(error.contains("no-such.crt"), "{error}");

    let mut mismatched = all.clone();
    mismatched.jwt_jwks = None;
    files.dir.write("other.key", files.pki.server("other").key);
    mismatched.tls_key = Some(files.dir.path("other.key"));
    let error = refused_at_start(&db, mismatched).await;
    assert!(error.contains("does not fit the certificate"), "{error}");
}

#[tokio::test]
async fn an_open_server_says_so_in_its_metrics() {
    let app = spawn_app().await;
    let page = http_get(app.server.metrics_addr, "/metrics").await;
    assert_eq!(
        metric_value(&page, r#"idempotency_auth_mode{mode="none"}"#),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        metric_value(&page, r#"idempotency_auth_mode{mode="auth"}"#),
        Some(0.0)
    );
}

#[tokio::test]
async fn every_denial_is_counted_and_audited_without_the_credential() {
    let ((page, bad_token), events) = idempotency_tests::capture_logs(async {
        let secured = Secured::start().await;
        let bad_token = secured.rsa.sign(&idempotency_tests::security::claims(
            PAYMENTS_SA,
            idempotency_tests::security::ISSUER,
            "someone-else",
            3600,
        ));
        let mut bad = secured.bearer(&bad_token).await;
        let _ = acquire(&mut bad, &id("payments", "audit-key-00001"))
            .await
            .unwrap_err();
        let mut anonymous = secured.anonymous().await;
        let _ = get(&mut anonymous, &id("payments", "audit-key-00001"))
            .await
            .unwrap_err();
        let mut stranger = secured.mtls(PAYMENTS_SPIFFE).await;
        let _ = get(&mut stranger, &id("refunds", "audit-key-00002"))
            .await
            .unwrap_err();

        let page = http_get(secured.server.metrics_addr, "/metrics").await;
        (page, bad_token)
    })
    .await;
    assert_eq!(
        metric_value(&page, r#"idempotency_auth_mode{mode="auth"}"#),
        Some(1.0),
        "{page}"
    );
    for reason in ["invalid_token", "no_credential", "namespace_forbidden"] {
        let series = format!(r#"idempotency_auth_denied_total{{reason="{reason}"}}"#);
        assert_eq!(
            metric_value(&page, &series),
            Some(1.0),
            "{series} in\n{page}"
        );
    }
    assert!(
        !page.contains(PAYMENTS_SPIFFE),
        "no principal in a metric label"
    );

    let log = events
        .iter()
        .map(serde_json::Value::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    let lines: Vec<&serde_json::Value> = events
        .iter()
        .filter(|event| event["target"] == "audit")
        .collect();
    assert_eq!(lines.len(), 3, "{log}");
    assert!(
        lines.iter().all(|line| line["event"] == "auth_denied"),
        "{log}"
    );
    assert_eq!(lines[0]["reason"], "invalid_token");
    assert_eq!(lines[0]["rpc"], "Acquire", "{log}");
    assert_eq!(lines[2]["rpc"], "Get", "{log}");
    for line in &lines {
        let remote = line["remote"].as_str().unwrap();
        assert!(remote.starts_with("127.0.0.1:"), "{log}");
    }
    assert_eq!(lines[1]["reason"], "no_credential");
    assert_eq!(lines[2]["reason"], "namespace_forbidden");
    assert_eq!(lines[2]["principal"], PAYMENTS_SPIFFE);
    assert_eq!(lines[2]["namespace"], "refunds");
    assert!(!log.contains(&bad_token), "a token never reaches the log");
    let signature = bad_token.rsplit('.').next().unwrap();
    assert!(!log.contains(signature));
}
