//! Harness for the security tests: certificates made per test (rcgen), JWTs
//! signed with RS256 and ES256 keys, the files the server reads (written to
//! a directory of the test's own, so tests can rotate them), and clients
//! that connect over TLS with a certificate and a bearer token of their choice.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use idempotency_client::pb::idempotency_service_client::IdempotencyServiceClient;
use idempotency_server::settings::SecurityArgs;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use tonic::{
    metadata::MetadataValue,
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Certificate, Channel, ClientTlsConfig, Identity},
};

/// A directory removed when the test ends.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "idempotency-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `name` as a rotation would: a new file renamed over the old,
    /// so the server never reads half of it.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) {
        let staging = self.0.join(format!(".{name}.new"));
        std::fs::write(&staging, contents).unwrap();
        std::fs::rename(&staging, self.0.join(name)).unwrap();
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A PEM certificate chain and its key.
#[derive(Clone)]
pub struct CertAndKey {
    pub cert: String,
    pub key: String,
}

impl CertAndKey {
    pub fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert, &self.key)
    }
}

/// A certificate authority of the test's own.
pub struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Self { ca }
    }

    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    fn issue(&self, params: CertificateParams) -> CertAndKey {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        CertAndKey {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A server certificate for `localhost` and 127.0.0.1, with `label` as
    /// its common name (to tell two apart).
    pub fn server(&self, label: &str) -> CertAndKey {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        params.distinguished_name.push(DnType::CommonName, label);
        self.issue(params)
    }

    /// A client certificate naming `uri` (a SPIFFE id) and/or `dns`.
    pub fn client(&self, uri: Option<&str>, dns: Option<&str>) -> CertAndKey {
        let mut params =
            CertificateParams::new(dns.map(str::to_owned).into_iter().collect::<Vec<_>>()).unwrap();
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        params
            .distinguished_name
            .push(DnType::CommonName, "test client");
        self.issue(params)
    }
}

/// Signs JWTs with one key, and describes that key as a JWK.
pub struct JwtSigner {
    kid: String,
    algorithm: jsonwebtoken::Algorithm,
    key: jsonwebtoken::EncodingKey,
    jwk: serde_json::Value,
}

fn base64url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

impl JwtSigner {
    /// The RS256 key of `tests/fixtures` (RSA keys take long to generate).
    pub fn rs256(kid: &str) -> Self {
        let pem = fixture("jwt-rs256-key.pem");
        Self {
            kid: kid.to_owned(),
            algorithm: jsonwebtoken::Algorithm::RS256,
            key: jsonwebtoken::EncodingKey::from_rsa_pem(pem.as_bytes()).unwrap(),
            jwk: serde_json::json!({
                "kty": "RSA", "alg": "RS256", "use": "sig", "kid": kid,
                "n": fixture("jwt-rs256-n.txt").trim(), "e": "AQAB",
            }),
        }
    }

    /// A fresh P-256 key.
    pub fn es256(kid: &str) -> Self {
        let pair = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        // Uncompressed point: 0x04, then x and y.
        let point = pair.public_key_raw();
        Self {
            kid: kid.to_owned(),
            algorithm: jsonwebtoken::Algorithm::ES256,
            key: jsonwebtoken::EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap(),
            jwk: serde_json::json!({
                "kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": kid,
                "x": base64url(&point[1..33]), "y": base64url(&point[33..65]),
            }),
        }
    }

    pub fn jwk(&self) -> serde_json::Value {
        self.jwk.clone()
    }

    /// A token with these claims, signed with this key under its kid.
    pub fn sign(&self, claims: &serde_json::Value) -> String {
        let mut header = jsonwebtoken::Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.key).unwrap()
    }

    /// A token for `sub` as a Kubernetes projected service-account token
    /// would carry it: the test issuer and audience, valid for an hour.
    pub fn token(&self, sub: &str) -> String {
        self.sign(&claims(sub, ISSUER, AUDIENCE, 3600))
    }
}

pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
pub const AUDIENCE: &str = "idempotency";

/// JWT claims: `exp` is `valid_for` seconds from now (negative: expired).
pub fn claims(sub: &str, iss: &str, aud: &str, valid_for: i64) -> serde_json::Value {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    serde_json::json!({ "sub": sub, "iss": iss, "aud": [aud], "iat": now, "exp": now + valid_for })
}

/// A JWKS file's text holding these keys.
pub fn jwks(signers: &[&JwtSigner]) -> String {
    serde_json::json!({ "keys": signers.iter().map(|s| s.jwk()).collect::<Vec<_>>() }).to_string()
}

/// A static tokens file's text: (principal, token) pairs, stored hashed.
pub fn static_tokens(tokens: &[(&str, &str)]) -> String {
    use sha2::Digest;
    tokens
        .iter()
        .map(|(principal, token)| {
            format!(
                "[[token]]\nprincipal = \"{principal}\"\nsha256 = \"{}\"\n",
                hex::encode(sha2::Sha256::digest(token.as_bytes()))
            )
        })
        .collect()
}

/// A policy file's text: (principals, namespaces, role) grants.
pub fn policy(grants: &[(&[&str], &[&str], &str)]) -> String {
    grants
        .iter()
        .map(|(principals, namespaces, role)| {
            format!(
                "[[grant]]\nprincipals = {principals:?}\nnamespaces = {namespaces:?}\nrole = \"{role}\"\n\n"
            )
        })
        .collect()
}

/// Everything auth needs, written to files a test can rewrite: the server's
/// key pair from `pki` (which also signs client certificates), a JWKS, static
/// tokens and the policy.
pub struct SecurityFiles {
    pub dir: TempDir,
    pub pki: Pki,
}

impl SecurityFiles {
    pub fn new(policy_text: &str, jwks_text: &str, tokens_text: &str) -> Self {
        let dir = TempDir::new("security");
        let pki = Pki::new("service");
        let server = pki.server("first");
        dir.write("tls.crt", &server.cert);
        dir.write("tls.key", &server.key);
        dir.write("ca.crt", pki.ca_pem());
        dir.write("policy.toml", policy_text);
        dir.write("jwks.json", jwks_text);
        dir.write("tokens.toml", tokens_text);
        Self { dir, pki }
    }

    /// Turns on TLS with mTLS, JWTs and static tokens, all with these files,
    /// checked every 100 ms.
    pub fn apply(&self, security: &mut SecurityArgs) {
        security.tls_cert = Some(self.dir.path("tls.crt"));
        security.tls_key = Some(self.dir.path("tls.key"));
        security.tls_client_ca = Some(self.dir.path("ca.crt"));
        security.jwt_jwks = Some(self.dir.path("jwks.json"));
        security.jwt_issuer = Some(ISSUER.to_owned());
        security.jwt_audience = Some(AUDIENCE.to_owned());
        security.static_tokens = Some(self.dir.path("tokens.toml"));
        security.auth_policy = Some(self.dir.path("policy.toml"));
        security.reload_interval = Duration::from_millis(100);
    }
}

/// Adds `authorization: Bearer <token>` to every call when it holds one.
#[derive(Clone, Default)]
pub struct Bearer(pub Option<String>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            let value: MetadataValue<_> = format!("Bearer {token}").parse().unwrap();
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}

pub type SecureClient = IdempotencyServiceClient<InterceptedService<Channel, Bearer>>;

/// A TLS channel to `addr` trusting `ca`, presenting `identity` if given.
pub async fn tls_channel(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<&CertAndKey>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some(identity) = identity {
        tls = tls.identity(identity.identity());
    }
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

/// A client over TLS to `addr` trusting `ca`, with an optional client
/// certificate and bearer token.
pub async fn tls_client(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<&CertAndKey>,
    token: Option<&str>,
) -> SecureClient {
    let channel = tls_channel(addr, ca, identity)
        .await
        .expect("connecting over TLS");
    IdempotencyServiceClient::with_interceptor(channel, Bearer(token.map(str::to_owned)))
}
