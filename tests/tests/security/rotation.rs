//! Certificates, the policy, the JWKS and static tokens change on disk and
//! take effect without a restart; a broken policy keeps the last good one.

use idempotency_tests::{
    http_get, metric_value,
    security::{JwtSigner, Pki, jwks, policy, static_tokens, tls_channel},
};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn a_renewed_certificate_reaches_new_connections_while_open_ones_keep_working() {
    let secured = Secured::start().await;
    let mut open = secured.mtls(PAYMENTS_SPIFFE).await;
    acquired(&mut open, &id("payments", "rotation-key-01")).await;

    // The renewed certificate comes from another CA, so a client that
    // trusts only that CA tells which certificate the server presents.
    let renewed_ca = Pki::new("renewed");
    assert!(
        tls_channel(secured.server.addr, &renewed_ca.ca_pem(), None)
            .await
            .is_err(),
        "the server presents the first certificate"
    );
    let renewed = renewed_ca.server("renewed");
    secured.files.dir.write("tls.key", &renewed.key);
    secured.files.dir.write("tls.crt", &renewed.cert);

    let addr = secured.server.addr;
    let ca = renewed_ca.ca_pem();
    eventually("the renewed certificate reaching new connections", || {
        let ca = ca.clone();
        async move { tls_channel(addr, &ca, None).await.is_ok() }
    })
    .await;
    let mut renewed_client = idempotency_tests::security::tls_client(
        addr,
        &ca,
        Some(&secured.cert(PAYMENTS_SPIFFE)),
        None,
    )
    .await;
    acquired(&mut renewed_client, &id("payments", "rotation-key-02")).await;

    // The connection opened before the renewal still works.
    acquired(&mut open, &id("payments", "rotation-key-03")).await;
}

#[tokio::test]
async fn policy_changes_apply_without_a_restart_and_a_broken_policy_keeps_the_last_good() {
    let secured = Secured::start().await;
    let mut client = secured.mtls(PAYMENTS_SPIFFE).await;
    refused(
        acquire(&mut client, &id("refunds", "policy-key-0001")).await,
        Code::PermissionDenied,
        "NAMESPACE_FORBIDDEN",
    );

    // Grant payments' API refunds too.
    let widened = format!(
        "{}{}",
        default_policy(),
        policy(&[(&[PAYMENTS_SPIFFE], &["refunds"], "caller")])
    );
    secured.files.dir.write("policy.toml", &widened);
    let client_ref = &client;
    eventually("the widened policy taking effect", || {
        let mut client = client_ref.clone();
        async move {
            acquire(&mut client, &id("refunds", "policy-key-0002"))
                .await
                .is_ok()
        }
    })
    .await;

    // A broken edit: refused, reported, and the last good policy stays.
    secured
        .files
        .dir
        .write("policy.toml", "[[grant]]\nprincipals = [\"x\"\n");
    let metrics = secured.server.metrics_addr;
    eventually("the broken policy being reported", || async move {
        let page = http_get(metrics, "/metrics").await;
        metric_value(&page, r#"idempotency_config_file_valid{file="policy"}"#) == Some(0.0)
            && metric_value(
                &page,
                r#"idempotency_config_reloads_total{file="policy",result="error"}"#,
            ) == Some(1.0)
    })
    .await;
    acquired(&mut client_ref.clone(), &id("refunds", "policy-key-0003")).await;

    // A good edit again, this time taking refunds away.
    secured.files.dir.write("policy.toml", default_policy());
    eventually("the narrowed policy taking effect", || {
        let mut client = client_ref.clone();
        async move {
            acquire(&mut client, &id("refunds", "policy-key-0004"))
                .await
                .is_err_and(|status| status.code() == Code::PermissionDenied)
        }
    })
    .await;
    let page = http_get(metrics, "/metrics").await;
    assert_eq!(
        metric_value(&page, r#"idempotency_config_file_valid{file="policy"}"#),
        Some(1.0)
    );
    assert_eq!(
        metric_value(
            &page,
            r#"idempotency_config_reloads_total{file="policy",result="success"}"#
        ),
        Some(2.0),
        "{page}"
    );
}

#[tokio::test]
async fn jwks_and_static_token_changes_apply_without_a_restart() {
    let secured = Secured::start().await;

    // A key the JWKS does not hold yet (the cluster rotated its signing key).
    let next = JwtSigner::es256("ec-2");
    let mut client = secured.bearer(&next.token(PAYMENTS_SA)).await;
    refused(
        acquire(&mut client, &id("payments", "jwks-key-000001")).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    secured
        .files
        .dir
        .write("jwks.json", jwks(&[&secured.rsa, &secured.ec, &next]));
    let client_ref = &client;
    eventually("the new signing key being accepted", || {
        let mut client = client_ref.clone();
        async move {
            acquire(&mut client, &id("payments", "jwks-key-000002"))
                .await
                .is_ok()
        }
    })
    .await;

    // A static token added, then revoked.
    let mut newcomer = secured.bearer("newcomer-token-77aa00").await;
    refused(
        acquire(&mut newcomer, &id("payments", "token-key-00001")).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    let with_newcomer = format!(
        "{}{}",
        default_tokens(),
        static_tokens(&[("payments-importer", "newcomer-token-77aa00")])
    );
    secured.files.dir.write("tokens.toml", &with_newcomer);
    let newcomer_ref = &newcomer;
    eventually("the added token being accepted", || {
        let mut client = newcomer_ref.clone();
        async move {
            acquire(&mut client, &id("payments", "token-key-00002"))
                .await
                .is_ok()
        }
    })
    .await;
    secured.files.dir.write("tokens.toml", default_tokens());
    eventually("the revoked token being refused", || {
        let mut client = newcomer_ref.clone();
        async move {
            acquire(&mut client, &id("payments", "token-key-00003"))
                .await
                .is_err_and(|status| status.code() == Code::Unauthenticated)
        }
    })
    .await;
}
