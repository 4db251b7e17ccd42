//! A server with TLS, mTLS, JWTs, static tokens and a policy all on, and
//! clients for the principals the tests use.

use std::time::Duration;

use idempotency_client::pb::{self, acquire_response::Outcome};
use idempotency_server::settings::Settings;
use idempotency_tests::{
    TestDb, TestServer,
    security::{
        CertAndKey, JwtSigner, SecureClient, SecurityFiles, policy, static_tokens, tls_client,
    },
    test_settings,
};
use tonic::{Code, Status};
use tonic_types::StatusExt;

pub const PAYMENTS_SPIFFE: &str = "spiffe://cluster.local/ns/payments/sa/api";
pub const REFUNDS_SPIFFE: &str = "spiffe://cluster.local/ns/refunds/sa/api";
pub const PAYMENTS_SA: &str = "system:serviceaccount:payments:api";
pub const REFUNDS_SA: &str = "system:serviceaccount:refunds:api";
pub const IMPORTER_TOKEN: &str = "importer-token-8f2a91c4d3";
pub const SUPPORT_TOKEN: &str = "support-token-1b7e44aa02";
pub const STRANGER_TOKEN: &str = "stranger-token-5c0d9e11f7";

/// Who may do what in these tests.
pub fn default_policy() -> String {
    policy(&[
        (
            &[
                PAYMENTS_SPIFFE,
                "system:serviceaccount:payments:*",
                "payments-importer",
                "api.payments.svc",
            ],
            &["payments"],
            "caller",
        ),
        (&[REFUNDS_SPIFFE, REFUNDS_SA], &["refunds"], "caller"),
        (&["support"], &["*"], "reader"),
    ])
}

pub fn default_tokens() -> String {
    static_tokens(&[
        ("payments-importer", IMPORTER_TOKEN),
        ("support", SUPPORT_TOKEN),
        // Authenticated, but named by no grant.
        ("stranger", STRANGER_TOKEN),
    ])
}

pub struct Secured {
    pub db: TestDb,
    pub server: TestServer,
    pub files: SecurityFiles,
    /// The RS256 key of the JWKS, kid "rsa-1".
    pub rsa: JwtSigner,
    /// The ES256 key of the JWKS, kid "ec-1".
    pub ec: JwtSigner,
}

impl Secured {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// [`Self::start`], with the settings changed by `adjust` first.
    pub async fn start_with(adjust: impl FnOnce(&mut Settings)) -> Self {
        let rsa = JwtSigner::rs256("rsa-1");
        let ec = JwtSigner::es256("ec-1");
        let files = SecurityFiles::new(
            &default_policy(),
            &idempotency_tests::security::jwks(&[&rsa, &ec]),
            &default_tokens(),
        );
        let db = TestDb::new().await;
        let mut settings = test_settings(&db);
        files.apply(&mut settings.security);
        adjust(&mut settings);
        let server = TestServer::start_with(settings).await;
        Self {
            db,
            server,
            files,
            rsa,
            ec,
        }
    }

    pub fn ca(&self) -> String {
        self.files.pki.ca_pem()
    }

    /// A client certificate of the service's CA.
    pub fn cert(&self, uri: &str) -> CertAndKey {
        self.files.pki.client(Some(uri), None)
    }

    /// A client presenting a certificate with this URI SAN.
    pub async fn mtls(&self, uri: &str) -> SecureClient {
        tls_client(self.server.addr, &self.ca(), Some(&self.cert(uri)), None).await
    }

    /// A client with a bearer token and no certificate.
    pub async fn bearer(&self, token: &str) -> SecureClient {
        tls_client(self.server.addr, &self.ca(), None, Some(token)).await
    }

    /// A client over TLS with no credential at all.
    pub async fn anonymous(&self) -> SecureClient {
        tls_client(self.server.addr, &self.ca(), None, None).await
    }
}

pub fn id(namespace: &str, key: &str) -> pb::RecordId {
    pb::RecordId {
        namespace: namespace.into(),
        operation: "POST /charges".into(),
        subject: "user-1".into(),
        key: key.into(),
    }
}

pub fn acquire_request(id: &pb::RecordId) -> pb::AcquireRequest {
    pb::AcquireRequest {
        id: Some(id.clone()),
        fingerprint: b"fp".to_vec(),
        ..Default::default()
    }
}

pub async fn acquire(client: &mut SecureClient, id: &pb::RecordId) -> Result<Outcome, Status> {
    client
        .acquire(acquire_request(id))
        .await
        .map(|response| response.into_inner().outcome.expect("an outcome"))
}

/// Acquires a new key and returns its fencing token.
pub async fn acquired(client: &mut SecureClient, id: &pb::RecordId) -> u64 {
    match acquire(client, id).await.expect("Acquire succeeds") {
        Outcome::Acquired(acquired) => acquired.fencing_token,
        other => panic!("expected ACQUIRED, got {other:?}"),
    }
}

pub async fn get(client: &mut SecureClient, id: &pb::RecordId) -> Result<pb::Record, Status> {
    client
        .get(pb::GetRequest {
            id: Some(id.clone()),
        })
        .await
        .map(|response| response.into_inner().record.expect("a record"))
}

pub fn response() -> pb::StoredResponse {
    pb::StoredResponse {
        status_code: 201,
        body: b"{\"forged\":true}".to_vec(),
        headers: Default::default(),
    }
}

/// Asserts the code and `ErrorInfo` reason of a refused call.
pub use idempotency_tests::assert_error as refused;

/// The code and reason of a `google.rpc.Status` in a batch item.
pub fn item_reason(status: &tonic_types::pb::Status) -> (i32, String) {
    let status = Status::with_details(
        Code::from_i32(status.code),
        status.message.clone(),
        prost::Message::encode_to_vec(status).into(),
    );
    let reason = status
        .get_details_error_info()
        .map(|info| info.reason)
        .unwrap_or_default();
    (status.code() as i32, reason)
}

/// Retries `check` until it holds: files are re-read every 100 ms.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not happen within 5 s");
}
