//! Every way of proving who you are names its principal, and every bad
//! credential is UNAUTHENTICATED with nothing written.

use idempotency_client::pb;
use idempotency_tests::security::{
    AUDIENCE, ISSUER, JwtSigner, Pki, claims, tls_channel, tls_client,
};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn certificates_jwts_and_static_tokens_each_name_their_principal() {
    let secured = Secured::start().await;
    let dns_only = secured.files.pki.client(None, Some("api.payments.svc"));
    let clients = [
        ("mTLS, SPIFFE id", secured.mtls(PAYMENTS_SPIFFE).await),
        (
            "mTLS, DNS name",
            tls_client(secured.server.addr, &secured.ca(), Some(&dns_only), None).await,
        ),
        (
            "JWT, RS256",
            secured.bearer(&secured.rsa.token(PAYMENTS_SA)).await,
        ),
        (
            "JWT, ES256",
            secured.bearer(&secured.ec.token(PAYMENTS_SA)).await,
        ),
        ("static token", secured.bearer(IMPORTER_TOKEN).await),
    ];
    for (n, (how, mut client)) in clients.into_iter().enumerate() {
        let outcome = acquire(&mut client, &id("payments", &format!("principal-key-{n}"))).await;
        assert!(
            matches!(outcome, Ok(pb::acquire_response::Outcome::Acquired(_))),
            "{how}: {outcome:?}"
        );
        // The same caller is refused outside its namespace: the principal
        // is the one the credential names, not "anyone who got in".
        refused(
            acquire(&mut client, &id("refunds", &format!("principal-key-{n}"))).await,
            Code::PermissionDenied,
            "NAMESPACE_FORBIDDEN",
        );
    }
    assert_eq!(secured.db.row_count().await, 5);
}

#[tokio::test]
async fn bad_credentials_are_unauthenticated_and_write_nothing() {
    let secured = Secured::start().await;
    let sub = PAYMENTS_SA;
    let impostor = JwtSigner::es256("ec-1");
    let unknown_kid = JwtSigner::es256("ec-9");
    let tokens = [
        (
            "expired",
            secured.rsa.sign(&claims(sub, ISSUER, AUDIENCE, -120)),
        ),
        (
            "wrong audience",
            secured.rsa.sign(&claims(sub, ISSUER, "someone-else", 3600)),
        ),
        (
            "wrong issuer",
            secured
                .rsa
                .sign(&claims(sub, "https://evil.example", AUDIENCE, 3600)),
        ),
        ("bad signature", impostor.token(sub)),
        ("unknown key id", unknown_kid.token(sub)),
        ("unknown static token", "not-a-known-token-1234".to_owned()),
        ("a JWT's hash", "aaaa.bbbb.cccc".to_owned()),
    ];
    let mut refusals = Vec::new();
    for (what, token) in &tokens {
        let mut client = secured.bearer(token).await;
        refusals.push((
            *what,
            acquire(&mut client, &id("payments", "unauth-key-0001")).await,
        ));
        // A bad token is refused even beside a good certificate.
        let mut client = tls_client(
            secured.server.addr,
            &secured.ca(),
            Some(&secured.cert(PAYMENTS_SPIFFE)),
            Some(token),
        )
        .await;
        refusals.push((
            *what,
            acquire(&mut client, &id("payments", "unauth-key-0002")).await,
        ));
    }
    let mut anonymous = secured.anonymous().await;
    refusals.push((
        "no credential",
        acquire(&mut anonymous, &id("payments", "unauth-key-0003")).await,
    ));
    let other_ca = Pki::new("other");
    let untrusted = other_ca.client(Some(PAYMENTS_SPIFFE), None);
    let mut client = tls_client(secured.server.addr, &secured.ca(), Some(&untrusted), None).await;
    refusals.push((
        "certificate of another CA",
        acquire(&mut client, &id("payments", "unauth-key-0004")).await,
    ));
    let nameless = secured.files.pki.client(None, None);
    let mut client = tls_client(secured.server.addr, &secured.ca(), Some(&nameless), None).await;
    refusals.push((
        "certificate without a SAN",
        acquire(&mut client, &id("payments", "unauth-key-0005")).await,
    ));

    for (what, result) in refusals {
        let status = result.expect_err(what);
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
        let info = tonic_types::StatusExt::get_details_error_info(&status).expect(what);
        assert_eq!(info.reason, "UNAUTHENTICATED", "{what}");
    }

    // A header that is not `Bearer <token>`.
    let channel = tls_channel(secured.server.addr, &secured.ca(), None)
        .await
        .unwrap();
    let mut basic = pb::idempotency_service_client::IdempotencyServiceClient::with_interceptor(
        channel,
        |mut request: tonic::Request<()>| {
            request
                .metadata_mut()
                .insert("authorization", "Basic dXNlcjpwYXNz".parse().unwrap());
            Ok(request)
        },
    );
    let status = basic
        .acquire(acquire_request(&id("payments", "unauth-key-0006")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    // Batch calls are refused whole.
    let status = anonymous
        .batch_acquire(pb::BatchAcquireRequest {
            requests: vec![acquire_request(&id("payments", "unauth-key-0007"))],
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    assert_eq!(secured.db.row_count().await, 0, "nothing was written");
}

#[tokio::test]
async fn a_plain_text_client_gets_no_answer_from_a_tls_port() {
    let secured = Secured::start().await;
    let mut plain = secured.server.client.clone();
    let status = plain
        .acquire(acquire_request(&id("payments", "plain-text-0001")))
        .await
        .unwrap_err();
    assert_ne!(status.code(), Code::Ok);
    assert_eq!(secured.db.row_count().await, 0);
}
