//! The client crate against the secured server: TLS with a client
//! certificate and a token file, both re-read when they rotate, bearer
//! tokens on batch calls too, and typed errors that are never retried.

use std::time::Duration;

use idempotency_client::{
    AcquireRequest, Acquisition, Client, Error, RecordId, RetryPolicy, TlsFiles, TokenSource,
};
use idempotency_tests::{http_get, metric_value};

use crate::support::*;

fn request(namespace: &str, key: &str) -> AcquireRequest {
    AcquireRequest::new(
        RecordId::new(namespace, "POST /charges", key),
        b"fp".to_vec(),
    )
}

async fn acquires(client: &Client, namespace: &str, key: &str) -> Result<(), Error> {
    match client.acquire(&request(namespace, key)).await? {
        Acquisition::Proceed(mut lease) => {
            lease.release().await.ok();
            Ok(())
        }
        other => panic!("expected to proceed, got {other:?}"),
    }
}

/// A server whose connections last 500 ms, so a client reconnects (and
/// presents its certificate again) within a test.
async fn short_connections() -> Secured {
    Secured::start_with(|settings| {
        settings.security.max_connection_age = Duration::from_millis(500);
    })
    .await
}

#[tokio::test]
async fn a_client_certificate_rotated_on_disk_is_presented_on_the_next_connection() {
    let secured = short_connections().await;
    let dir = &secured.files.dir;
    let payments = secured.cert(PAYMENTS_SPIFFE);
    dir.write("client.crt", &payments.cert);
    dir.write("client.key", &payments.key);
    let client = Client::builder()
        .endpoint(format!("https://localhost:{}", secured.server.addr.port()))
        .tls_files(
            TlsFiles::new(dir.path("ca.crt"))
                .client_certificate(dir.path("client.crt"), dir.path("client.key")),
        )
        .retry(RetryPolicy::none())
        .connect()
        .await
        .expect("connecting over mTLS");
    acquires(&client, "payments", "client-mtls-0001")
        .await
        .unwrap();
    let refused = acquires(&client, "refunds", "client-mtls-0002")
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::PermissionDenied { reason: Some(reason), .. } if reason == "NAMESPACE_FORBIDDEN"),
        "{refused:?}"
    );

    // The pod's certificate is reissued for another identity.
    let refunds = secured.cert(REFUNDS_SPIFFE);
    dir.write("client.key", &refunds.key);
    dir.write("client.crt", &refunds.cert);
    let client_ref = &client;
    let mut n = 0;
    eventually("the rotated certificate being presented", || {
        n += 1;
        let key = format!("client-mtls-1{n:03}");
        async move { acquires(client_ref, "refunds", &key).await.is_ok() }
    })
    .await;
}

#[tokio::test]
async fn a_token_file_rotation_reaches_every_call_batches_included() {
    let secured = short_connections().await;
    let dir = &secured.files.dir;
    dir.write("token", secured.rsa.token(PAYMENTS_SA));
    let client = Client::builder()
        .endpoint(format!("https://127.0.0.1:{}", secured.server.addr.port()))
        .tls_files(TlsFiles::new(dir.path("ca.crt")))
        .bearer_token(TokenSource::file_refreshed_every(
            dir.path("token"),
            Duration::from_millis(50),
        ))
        .retry(RetryPolicy::none())
        .connect()
        .await
        .expect("connecting over TLS");

    // Concurrent calls share batch RPCs: each carries the token.
    let calls = (0..32).map(|n| {
        let client = client.clone();
        async move { acquires(&client, "payments", &format!("client-token-{n:04}")).await }
    });
    for result in futures_util::future::join_all(calls).await {
        result.expect("every call authenticated");
    }
    let page = http_get(secured.server.metrics_addr, "/metrics").await;
    let batches = metric_value(
        &page,
        r#"idempotency_batch_items_count{rpc="BatchAcquire"}"#,
    );
    assert!(
        batches.unwrap_or(0.0) > 0.0,
        "some calls went as BatchAcquire:\n{page}"
    );

    // The projected token is rotated to another service account's.
    dir.write("token", secured.rsa.token(REFUNDS_SA));
    let client_ref = &client;
    let mut n = 0;
    eventually("the rotated token being sent", || {
        n += 1;
        let key = format!("client-token-1{n:03}");
        async move { acquires(client_ref, "refunds", &key).await.is_ok() }
    })
    .await;
    let refused = acquires(&client, "payments", "client-token-2000")
        .await
        .unwrap_err();
    assert!(
        matches!(refused, Error::PermissionDenied { .. }),
        "{refused:?}"
    );
}

#[tokio::test]
async fn auth_errors_are_typed_and_never_retried() {
    let secured = short_connections().await;
    let client = Client::builder()
        .endpoint(format!("https://localhost:{}", secured.server.addr.port()))
        .tls_files(TlsFiles::new(secured.files.dir.path("ca.crt")))
        .bearer_token(TokenSource::fixed("no-such-token-123456"))
        .connect()
        .await
        .expect("connecting over TLS");
    let error = acquires(&client, "payments", "client-typed-0001")
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Unauthenticated { .. }), "{error:?}");
    let page = http_get(secured.server.metrics_addr, "/metrics").await;
    assert_eq!(
        metric_value(
            &page,
            r#"idempotency_auth_denied_total{reason="unknown_token"}"#
        ),
        Some(1.0),
        "sent once, not retried:\n{page}"
    );
    assert_eq!(secured.db.row_count().await, 0);
}
