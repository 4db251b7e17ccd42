//! TLS from certificate files that each new connection reads again, so that
//! rotated certificates (cert-manager, a SPIFFE helper) take effect without a
//! restart (feature `tls`).
//!
//! tonic's own TLS (`ClientTlsConfig`) reads its identity once. Here a
//! connector of this crate's does the TCP connect and the rustls handshake;
//! before each handshake it reads the CA, certificate and key files and, when
//! their contents changed, builds a new rustls config from them. Connections
//! already open keep the certificate they were made with; HTTP/2 connections
//! live long, but are made again after any failure or server GOAWAY, and a
//! server that limits connection age makes every connection pick up a rotation.

use std::{
    fmt,
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::{
    TlsConnector,
    client::TlsStream,
    rustls::{
        ClientConfig, RootCertStore,
        crypto::CryptoProvider,
        pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject},
    },
};
use tonic::{
    codegen::{Service, StdError, http},
    transport::Endpoint,
};

use crate::{
    Error, fingerprint,
    socket::{CoalescedWrites, TcpConnector},
};

/// Certificate files for TLS to the service, read again for each new
/// connection: the CA that signs the service's certificate and, for mutual
/// TLS, this client's certificate chain and private key (PEM; the key in
/// PKCS#8, PKCS#1 or SEC1). See [`ClientBuilder::tls_files`](crate::ClientBuilder::tls_files).
///
/// The files are read when the client is built (unusable files are an
/// [`Error::Config`] then), and again before each new connection's
/// handshake: when their contents changed, the new ones are used. Changed
/// files that are unusable (a certificate that does not match its key, as
/// when a rotation is half written) are not used: new connections keep the
/// last good ones, with a warning, until the files are whole again.
///
/// ```no_run
/// use idempotency_client::{Client, TlsFiles, TokenSource};
///
/// # fn example() -> Result<(), idempotency_client::Error> {
/// let client = Client::builder()
///     .endpoint("https://idempotency:50051")
///     .tls_files(
///         TlsFiles::new("/etc/idempotency/tls/ca.crt")
///             .client_certificate("/etc/idempotency/tls/tls.crt", "/etc/idempotency/tls/tls.key"),
///     )
///     .bearer_token(TokenSource::file("/var/run/secrets/tokens/idempotency"))
///     .connect_lazy()?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    ca: PathBuf,
    identity: Option<(PathBuf, PathBuf)>,
    server_name: Option<String>,
}

impl TlsFiles {
    /// Trust the certificates in `ca` (one or more, PEM) to sign the service's.
    pub fn new(ca: impl Into<PathBuf>) -> Self {
        Self {
            ca: ca.into(),
            identity: None,
            server_name: None,
        }
    }

    /// Present this certificate chain (PEM, leaf first) and its private key
    /// to the service (mutual TLS): the service knows the caller by the
    /// certificate's URI SAN (a SPIFFE id) or DNS SAN.
    pub fn client_certificate(
        mut self,
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.identity = Some((certificate.into(), key.into()));
        self
    }

    /// The name the service's certificate must carry, when it is not the
    /// endpoint's host (e.g. an endpoint given by IP address).
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }
}

/// The endpoint for `uri`, to be connected through a [`Connector`].
///
/// tonic refuses an `https://` endpoint that has no TLS settings of its own,
/// even through a connector that does TLS: the endpoint is given as
/// `http://` (with the port made explicit, 443 by default), and its origin
/// keeps `https://`, so requests still say `:scheme https`.
pub(crate) fn endpoint(uri: &str) -> Result<Endpoint, Error> {
    let invalid = |why: &str| Error::Config(format!("endpoint {uri:?}: {why}"));
    let parsed: http::Uri = uri.parse().map_err(|error| invalid(&format!("{error}")))?;
    if parsed.scheme_str() != Some("https") {
        return Err(invalid("TLS files need an https:// endpoint"));
    }
    let authority = parsed.authority().ok_or_else(|| invalid("no host"))?;
    let port = authority.port_u16().unwrap_or(443);
    let plain = format!("http://{}:{port}", authority.host());
    Ok(Endpoint::from_shared(plain)
        .map_err(|error| invalid(&format!("{error}")))?
        .origin(parsed))
}

/// Connects by TCP (no delay) and makes the TLS handshake with the current
/// files: SNI and the name checked from the endpoint's host (or
/// [`TlsFiles::server_name`]), ALPN `h2`. A request's frames go out as one
/// TLS record and one write ([`CoalescedWrites`]).
#[derive(Clone)]
pub(crate) struct Connector {
    files: Arc<Loader>,
    tcp: TcpConnector,
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connector")
            .field("files", &self.files.files)
            .finish()
    }
}

impl Connector {
    /// Reads the files once: unusable ones are a configuration error now.
    pub(crate) fn new(files: TlsFiles, tcp: TcpConnector) -> Result<Self, Error> {
        let provider = CryptoProvider::get_default()
            .cloned()
            .unwrap_or_else(|| Arc::new(tokio_rustls::rustls::crypto::ring::default_provider()));
        let contents = Contents::read(&files).map_err(Error::Config)?;
        let config = build(&files, &contents, &provider).map_err(Error::Config)?;
        Ok(Self {
            files: Arc::new(Loader {
                files,
                provider,
                current: Mutex::new(Loaded {
                    digest: contents.digest(),
                    config: Arc::new(config),
                }),
            }),
            tcp,
        })
    }
}

impl Service<http::Uri> for Connector {
    type Response = TokioIo<CoalescedWrites<TlsStream<TcpStream>>>;
    type Error = StdError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, StdError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (files, tcp) = (self.files.clone(), self.tcp.clone());
        Box::pin(async move {
            let host = uri.host().ok_or_else(|| format!("no host in {uri}"))?;
            // An IPv6 address comes in brackets.
            let host = host.trim_start_matches('[').trim_end_matches(']');
            // `endpoint` made the port explicit (443 by default).
            let port = uri.port_u16().unwrap_or(443);
            let name = files.files.server_name.as_deref().unwrap_or(host);
            let server_name = ServerName::try_from(name.to_owned())
                .map_err(|error| format!("server name {name:?}: {error}"))?;
            let config = files.config();
            let tcp = tcp.tcp(uri.clone()).await?;
            let tls = TlsConnector::from(config)
                .connect(server_name, tcp)
                .await
                .map_err(|error| format!("TLS handshake with {host}:{port}: {error}"))?;
            if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(format!("{host}:{port} did not negotiate HTTP/2 (ALPN h2)").into());
            }
            Ok(TokioIo::new(CoalescedWrites::new(tls)))
        })
    }
}

/// The files, and the rustls config built from their current contents.
struct Loader {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: Mutex<Loaded>,
}

struct Loaded {
    /// Digests of the contents the config was built from (not the key itself).
    digest: Vec<Vec<u8>>,
    config: Arc<ClientConfig>,
}

impl Loader {
    /// The config for a new connection: rebuilt when the files changed and
    /// are usable, else the last good one. Reading three small files per
    /// new connection costs little next to the handshake, and unlike a
    /// modification time it cannot miss a change.
    fn config(&self) -> Arc<ClientConfig> {
        let mut current = self.current.lock().expect("TLS files lock");
        let contents = match Contents::read(&self.files) {
            Ok(contents) => contents,
            Err(error) => {
                tracing::warn!(%error, "TLS files unreadable: new connections keep the last ones read");
                return current.config.clone();
            }
        };
        let digest = contents.digest();
        if digest != current.digest {
            match build(&self.files, &contents, &self.provider) {
                Ok(config) => {
                    tracing::info!(files = ?self.files, "TLS files changed: new connections use them");
                    *current = Loaded {
                        digest,
                        config: Arc::new(config),
                    };
                }
                Err(error) => tracing::warn!(%error,
                    "TLS files changed but are unusable: new connections keep the last good ones"),
            }
        }
        current.config.clone()
    }
}

/// What the files held.
struct Contents {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl Contents {
    fn read(files: &TlsFiles) -> Result<Self, String> {
        Ok(Self {
            ca: read(&files.ca)?,
            identity: match &files.identity {
                Some((certificate, key)) => Some((read(certificate)?, read(key)?)),
                None => None,
            },
        })
    }

    fn digest(&self) -> Vec<Vec<u8>> {
        let mut digest = vec![fingerprint::bytes(&self.ca)];
        if let Some((certificate, key)) = &self.identity {
            digest.extend([fingerprint::bytes(certificate), fingerprint::bytes(key)]);
        }
        digest
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|error| format!("reading {}: {error}", path.display()))
}

/// A rustls config from the files' contents; errors name the file.
fn build(
    files: &TlsFiles,
    contents: &Contents,
    provider: &Arc<CryptoProvider>,
) -> Result<ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(&contents.ca) {
        certificate
            .map_err(|error| error.to_string())
            .and_then(|certificate| roots.add(certificate).map_err(|error| error.to_string()))
            .map_err(|error| format!("CA file {}: {error}", files.ca.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("CA file {}: no certificate", files.ca.display()));
    }
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| error.to_string())?
        .with_root_certificates(roots);
    let mut config = match (&files.identity, &contents.identity) {
        (Some((certificate_path, key_path)), Some((certificate, key))) => {
            let chain = CertificateDer::pem_slice_iter(certificate)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| {
                    format!("certificate file {}: {error}", certificate_path.display())
                })?;
            if chain.is_empty() {
                return Err(format!(
                    "certificate file {}: no certificate",
                    certificate_path.display()
                ));
            }
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|error| format!("key file {}: {error}", key_path.display()))?;
            // Refuses a key that does not match the certificate.
            builder.with_client_auth_cert(chain, key).map_err(|error| {
                format!(
                    "certificate {} with key {}: {error}",
                    certificate_path.display(),
                    key_path.display()
                )
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        SanType,
    };
    use tokio_rustls::rustls::{ServerConfig, server::WebPkiClientVerifier};

    use super::*;
    use crate::{
        Client, RecordId, TokenSource,
        testing::{FakeService, TempDir},
    };

    /// A CA, the service's certificate (localhost, 127.0.0.1), and client
    /// certificates named by SPIFFE ids.
    struct Pki {
        ca: rcgen::Certificate,
        issuer: Issuer<'static, KeyPair>,
    }

    /// A certificate (PEM, and DER to compare with what the service saw) and its key.
    struct Leaf {
        pem: String,
        der: Vec<u8>,
        key: String,
    }

    impl Pki {
        fn new() -> Self {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate().unwrap();
            let ca = params.self_signed(&key).unwrap();
            Self {
                ca,
                issuer: Issuer::new(params, key),
            }
        }

        fn leaf(&self, sans: Vec<SanType>, usage: ExtendedKeyUsagePurpose) -> Leaf {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.subject_alt_names = sans;
            params.extended_key_usages = vec![usage];
            let key = KeyPair::generate().unwrap();
            let certificate = params.signed_by(&key, &self.issuer).unwrap();
            Leaf {
                pem: certificate.pem(),
                der: certificate.der().to_vec(),
                key: key.serialize_pem(),
            }
        }

        fn client(&self, spiffe_id: &str) -> Leaf {
            let uri = SanType::URI(spiffe_id.try_into().unwrap());
            self.leaf(vec![uri], ExtendedKeyUsagePurpose::ClientAuth)
        }

        /// The service's TLS: its certificate, and client certificates required.
        fn service_config(&self) -> Arc<ServerConfig> {
            let leaf = self.leaf(
                vec![
                    SanType::DnsName("localhost".try_into().unwrap()),
                    SanType::IpAddress([127, 0, 0, 1].into()),
                ],
                ExtendedKeyUsagePurpose::ServerAuth,
            );
            let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
            let mut roots = RootCertStore::empty();
            roots.add(self.ca.der().clone()).unwrap();
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .unwrap();
            let mut config = ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_client_cert_verifier(verifier)
                .with_single_cert(
                    vec![CertificateDer::from(leaf.der)],
                    PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap(),
                )
                .unwrap();
            config.alpn_protocols = vec![b"h2".to_vec()];
            Arc::new(config)
        }
    }

    /// The client certificate of the connection that carried the last call.
    fn last_peer(service: &FakeService) -> Vec<u8> {
        let seen = service.seen();
        let last = seen.last().expect("a call");
        assert_eq!(last.scheme.as_deref(), Some("https"), "{last:?}");
        assert_eq!(last.authorization.as_deref(), Some("Bearer the-token"));
        last.peer.clone().expect("a client certificate")
    }

    #[tokio::test]
    async fn a_new_connection_presents_the_client_certificate_on_disk_now() {
        let pki = Pki::new();
        let (first, second) = (
            pki.client("spiffe://test/ns/shop/sa/api"),
            pki.client("spiffe://test/ns/shop/sa/api"),
        );
        let dir = TempDir::new("tls-rotates");
        let ca = dir.replace("ca.pem", pki.ca.pem());
        let certificate = dir.replace("tls.crt", &first.pem);
        let key = dir.replace("tls.key", &first.key);
        let service = FakeService::tls(pki.service_config()).await;
        let client = Client::builder()
            .endpoint(format!("https://localhost:{}", service.addr.port()))
            .tls_files(TlsFiles::new(&ca).client_certificate(&certificate, &key))
            .bearer_token(TokenSource::fixed("the-token"))
            .connect()
            .await
            .unwrap();
        let id = RecordId::new("shop", "POST /pay", "key-0123456789");

        assert_eq!(client.get(&id).await.unwrap(), None);
        assert_eq!(last_peer(&service), first.der);

        // Half a rotation (the new certificate, the old key) is not used ...
        dir.replace("tls.crt", &second.pem);
        service.drop_connections();
        assert_eq!(client.get(&id).await.unwrap(), None);
        assert_eq!(service.connections_made(), 2);
        assert_eq!(last_peer(&service), first.der);
        // ... the whole of it is, from the next new connection on.
        dir.replace("tls.key", &second.key);
        assert_eq!(client.get(&id).await.unwrap(), None);
        assert_eq!(service.connections_made(), 2, "the open connection serves");
        assert_eq!(last_peer(&service), first.der);
        service.drop_connections();
        assert_eq!(client.get(&id).await.unwrap(), None);
        assert_eq!(service.connections_made(), 3);
        assert_eq!(last_peer(&service), second.der);
    }

    #[tokio::test]
    async fn several_endpoints_by_address_are_balanced_over_tls_files() {
        let pki = Pki::new();
        let client_certificate = pki.client("spiffe://test/ns/shop/sa/api");
        let dir = TempDir::new("tls-balanced");
        let files = TlsFiles::new(dir.replace("ca.pem", pki.ca.pem())).client_certificate(
            dir.replace("tls.crt", &client_certificate.pem),
            dir.replace("tls.key", &client_certificate.key),
        );
        let services = [
            FakeService::tls(pki.service_config()).await,
            FakeService::tls(pki.service_config()).await,
        ];
        let client = Client::builder()
            .endpoints(
                services
                    .iter()
                    .map(|service| format!("https://{}", service.addr)),
            )
            .tls_files(files)
            .bearer_token(TokenSource::fixed("the-token"))
            .connect_lazy()
            .unwrap();

        for n in 0..40 {
            let id = RecordId::new("shop", "POST /pay", format!("key-{n:010}"));
            assert_eq!(client.get(&id).await.unwrap(), None);
        }

        for service in &services {
            assert!(!service.seen().is_empty(), "each endpoint serves calls");
            assert_eq!(last_peer(service), client_certificate.der);
        }
    }

    #[test]
    fn unusable_files_and_plain_endpoints_are_configuration_errors() {
        let pki = Pki::new();
        let dir = TempDir::new("tls-config");
        let ca = dir.replace("ca.pem", pki.ca.pem());
        let (one, other) = (pki.client("spiffe://test/a"), pki.client("spiffe://test/b"));
        let mismatched = TlsFiles::new(&ca).client_certificate(
            dir.replace("tls.crt", &one.pem),
            dir.replace("tls.key", &other.key),
        );
        let refused = |files: TlsFiles, endpoint: &str| match Client::builder()
            .endpoint(endpoint)
            .tls_files(files)
            .connect_lazy()
        {
            Err(Error::Config(message)) => message,
            other => panic!("{other:?}"),
        };

        let missing = refused(TlsFiles::new(dir.0.join("absent.pem")), "https://localhost");
        let not_a_ca = refused(
            TlsFiles::new(dir.replace("empty.pem", "")),
            "https://localhost",
        );
        let mismatched = refused(mismatched, "https://localhost");
        let plain = refused(TlsFiles::new(&ca), "http://localhost:50051");

        assert!(missing.contains("absent.pem"), "{missing}");
        assert!(not_a_ca.contains("no certificate"), "{not_a_ca}");
        assert!(mismatched.contains("tls.key"), "{mismatched}");
        assert!(plain.contains("https://"), "{plain}");
    }

    #[test]
    fn an_https_endpoint_is_given_to_tonic_as_http_with_its_port_and_an_https_origin() {
        let endpoint = endpoint("https://idempotency.example").unwrap();
        assert_eq!(endpoint.uri(), "http://idempotency.example:443/");
    }
}
