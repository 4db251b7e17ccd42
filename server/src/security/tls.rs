//! TLS on the gRPC port, with the key pair and client CA re-read from disk.
//!
//! Each connection's handshake uses the configuration in force when it was
//! accepted, so a renewed certificate reaches new connections at the next
//! check while open ones keep theirs.
//!
//! Client certificates are asked for but checked after the handshake, not in
//! it: the handshake still proves the client holds the certificate's key,
//! and a certificate of an unknown CA then gets a gRPC `UNAUTHENTICATED`
//! that says why, instead of a connection reset that looks like an outage.

use std::{
    convert::Infallible,
    io,
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use rustls::{
    DistinguishedName, ServerConfig, SignatureScheme,
    client::danger::HandshakeSignatureValid,
    pki_types::{CertificateDer, PrivateKeyDer, UnixTime, pem::PemObject},
    server::{
        WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tonic::transport::server::Connected;

use super::watch::{FileError, Watched};
use crate::grpc::connections::{self, Connection, Gate};

/// Handshaken connections waiting for the server to take them.
const ACCEPTED_QUEUE: usize = 64;

/// The files TLS is served from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA certificates that client certificates are verified against; `None`: no mTLS.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    pub fn paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.cert.clone(), self.key.clone()];
        paths.extend(self.client_ca.clone());
        paths
    }
}

/// Who a client certificate says the caller is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerIdentity {
    /// The certificate chains to the client CA: its URI SAN, else its DNS SAN.
    Verified(Arc<str>),
    /// A certificate was presented but is not accepted, and why.
    Rejected(String),
}

/// What the gRPC handlers learn about a TLS connection (a request extension).
#[derive(Debug, Clone)]
pub struct TlsConnectInfo {
    pub remote_addr: Option<SocketAddr>,
    /// `None`: no client certificate, or mTLS is off.
    pub peer: Option<PeerIdentity>,
    /// When the handshake finished: a BatchStream ends by the connection's
    /// --max-connection-age, so that the peer's identity is proven again
    /// on the next connection by then.
    pub handshaken: std::time::Instant,
}

/// One version of the TLS files, ready to serve.
pub struct TlsState {
    server: Arc<ServerConfig>,
    /// Checks client certificates after the handshake; `None` without mTLS.
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// Unix time at which the served certificate expires.
    pub not_after: i64,
}

impl std::fmt::Debug for TlsState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsState")
            .field("mtls", &self.client_verifier.is_some())
            .field("not_after", &self.not_after)
            .finish()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certificates(
    pem: &[u8],
    path: &std::path::Path,
) -> Result<Vec<CertificateDer<'static>>, FileError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| FileError::new(path, format!("not PEM certificates: {error}")))?;
    if certs.is_empty() {
        return Err(FileError::new(path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// Unix time at which a certificate expires.
fn not_after(cert: &CertificateDer<'_>) -> Option<i64> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some(parsed.validity().not_after.timestamp())
}

/// The caller a verified certificate names: its first URI SAN (a SPIFFE id),
/// else its first DNS SAN.
fn principal_of(cert: &CertificateDer<'_>) -> Option<Arc<str>> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let names = parsed.subject_alternative_name().ok()??.value;
    let uri = names.general_names.iter().find_map(|name| match name {
        GeneralName::URI(uri) if !uri.is_empty() => Some(*uri),
        _ => None,
    });
    let dns = || {
        names.general_names.iter().find_map(|name| match name {
            GeneralName::DNSName(dns) if !dns.is_empty() => Some(*dns),
            _ => None,
        })
    };
    uri.or_else(dns).map(Arc::from)
}

/// Parses cert, key and optional client CA (in [`TlsFiles::paths`] order).
pub fn parse(contents: &[Vec<u8>], paths: &[PathBuf]) -> Result<TlsState, FileError> {
    let chain = certificates(&contents[0], &paths[0])?;
    let key = PrivateKeyDer::from_pem_slice(&contents[1]).map_err(|error| {
        FileError::new(
            &paths[1],
            format!("not a PEM private key (PKCS#8, PKCS#1 or SEC1): {error}"),
        )
    })?;
    let provider = provider();
    let client_verifier = match (contents.get(2), paths.get(2)) {
        (Some(pem), Some(path)) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in certificates(pem, path)? {
                roots
                    .add(ca)
                    .map_err(|error| FileError::new(path, format!("unusable CA: {error}")))?;
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|error| FileError::new(path, error.to_string()))?;
            Some(verifier)
        }
        _ => None,
    };
    let handshake_verifier: Arc<dyn ClientCertVerifier> = match &client_verifier {
        Some(verifier) => Arc::new(CheckedAfterHandshake(verifier.clone())),
        None => WebPkiClientVerifier::no_client_auth(),
    };
    let expires = not_after(&chain[0]).unwrap_or(0);
    let mut server = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| FileError::new(&paths[0], error.to_string()))?
        .with_client_cert_verifier(handshake_verifier)
        .with_single_cert(chain, key)
        .map_err(|error| {
            FileError::new(
                &paths[1],
                format!(
                    "does not fit the certificate in {}: {error}",
                    paths[0].display()
                ),
            )
        })?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsState {
        server: Arc::new(server),
        client_verifier,
        not_after: expires,
    })
}

impl TlsState {
    /// The identity a connection's client certificate chain proves, if any.
    fn peer_identity(&self, chain: Option<&[CertificateDer<'_>]>) -> Option<PeerIdentity> {
        let verifier = self.client_verifier.as_ref()?;
        let (end_entity, intermediates) = chain?.split_first()?;
        Some(
            match verifier.verify_client_cert(end_entity, intermediates, UnixTime::now()) {
                Err(error) => {
                    PeerIdentity::Rejected(format!("client certificate not accepted: {error}"))
                }
                Ok(_) => match principal_of(end_entity) {
                    Some(principal) => PeerIdentity::Verified(principal),
                    None => PeerIdentity::Rejected(
                        "client certificate names no URI or DNS subject alternative name".into(),
                    ),
                },
            },
        )
    }
}

/// Asks for a client certificate and checks the handshake's signature with
/// it (proof that the client holds its key), but leaves the chain to
/// [`TlsState::peer_identity`] after the handshake.
#[derive(Debug)]
struct CheckedAfterHandshake(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for CheckedAfterHandshake {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        // Callers with a bearer token need no certificate.
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A TLS connection as the gRPC server sees it.
pub struct TlsConnection {
    stream: TlsStream<TcpStream>,
    info: TlsConnectInfo,
}

impl Connected for TlsConnection {
    type ConnectInfo = TlsConnectInfo;

    fn connect_info(&self) -> TlsConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Handshaken connections, for `Server::serve_with_incoming_shutdown`.
/// Handshakes run in tasks of their own, so a slow client holds up no other;
/// dropping the stream stops accepting.
pub struct TlsIncoming {
    accepted: mpsc::Receiver<Connection<TlsConnection>>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl futures_util::Stream for TlsIncoming {
    type Item = Result<Connection<TlsConnection>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.accepted.poll_recv(cx).map(|next| next.map(Ok))
    }
}

/// Accepts TCP connections on `listener` that `gate` admits and hands them
/// over once their handshake, with the TLS files in force at that moment,
/// succeeded before the admission's deadline.
pub fn incoming(listener: TcpListener, tls: Arc<Watched<TlsState>>, gate: Gate) -> TlsIncoming {
    let (sender, accepted) = mpsc::channel(ACCEPTED_QUEUE);
    let acceptor = tokio::spawn(async move {
        loop {
            let (tcp, remote_addr) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Refused before the handshake, which costs the most.
            let Some(admission) = gate.admit() else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let state = tls.current();
            let sender = sender.clone();
            tokio::spawn(async move {
                let handshake = TlsAcceptor::from(state.server.clone()).accept(tcp);
                let stream = match tokio::time::timeout_at(admission.deadline(), handshake).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::debug!(%remote_addr, %error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%remote_addr, "TLS handshake timed out");
                        connections::closed("handshake_timeout");
                        return;
                    }
                };
                let peer = state.peer_identity(stream.get_ref().1.peer_certificates());
                let info = TlsConnectInfo {
                    remote_addr: Some(remote_addr),
                    peer,
                    handshaken: std::time::Instant::now(),
                };
                let connection = admission.connection(TlsConnection { stream, info });
                let _ = sender.send(connection).await;
            });
        }
    });
    TlsIncoming { accepted, acceptor }
}
