//! Test helpers: a fake idempotency service over HTTP/2 (plain, or TLS with
//! client certificates) that records what each call carried, and a
//! temporary directory.
// Connections and client certificates matter to the TLS tests only.
#![cfg_attr(not(feature = "tls"), allow(dead_code))]

use std::{
    convert::Infallible,
    future::{Ready, ready},
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    task::JoinHandle,
};
use tonic::{
    Code, Status,
    body::Body,
    codegen::http,
    server::{Grpc, UnaryService},
};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{NAMESPACE_FORBIDDEN, pb};

/// The token the fake service rejects as expired.
pub(crate) const EXPIRED_TOKEN: &str = "expired-token";
/// The namespace the fake service forbids.
pub(crate) const FORBIDDEN_NAMESPACE: &str = "forbidden";

/// What one call carried.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// The RPC's name (`Acquire`, `BatchAcquire`, ...).
    pub(crate) rpc: String,
    pub(crate) scheme: Option<String>,
    pub(crate) authorization: Option<String>,
    /// The client certificate of the call's connection (DER), under TLS.
    pub(crate) peer: Option<Vec<u8>>,
    /// Its `traceparent` metadata.
    pub(crate) traceparent: Option<String>,
}

#[cfg(feature = "tls")]
type TlsConfig = Arc<tokio_rustls::rustls::ServerConfig>;
#[cfg(not(feature = "tls"))]
type TlsConfig = Infallible;

/// An idempotency service that grants every Acquire (fencing token 1),
/// accepts every Renew, Complete and Fail, knows no record (`Get`), answers
/// UNAUTHENTICATED to [`EXPIRED_TOKEN`] and PERMISSION_DENIED
/// (`NAMESPACE_FORBIDDEN`) to [`FORBIDDEN_NAMESPACE`], in batches item by item.
pub(crate) struct FakeService {
    pub(crate) addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    made: Arc<AtomicUsize>,
    acceptor: JoinHandle<()>,
}

impl FakeService {
    pub(crate) async fn plain() -> Self {
        Self::start(None).await
    }

    #[cfg(feature = "tls")]
    pub(crate) async fn tls(config: TlsConfig) -> Self {
        Self::start(Some(config)).await
    }

    async fn start(tls: Option<TlsConfig>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::<Mutex<Vec<Seen>>>::default();
        let connections = Arc::<Mutex<Vec<JoinHandle<()>>>>::default();
        let made = Arc::<AtomicUsize>::default();
        let acceptor = tokio::spawn({
            let (seen, connections, made) = (seen.clone(), connections.clone(), made.clone());
            async move {
                loop {
                    let Ok((tcp, _)) = listener.accept().await else {
                        return;
                    };
                    let connection = match &tls {
                        None => serve(tcp, None, seen.clone()),
                        #[cfg(feature = "tls")]
                        Some(config) => {
                            let acceptor = tokio_rustls::TlsAcceptor::from(config.clone());
                            let Ok(stream) = acceptor.accept(tcp).await else {
                                continue;
                            };
                            let peer = stream
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|chain| chain.first())
                                .map(|certificate| certificate.to_vec());
                            serve(stream, peer, seen.clone())
                        }
                        #[cfg(not(feature = "tls"))]
                        Some(never) => match *never {},
                    };
                    connections.lock().unwrap().push(connection);
                    made.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self {
            addr,
            seen,
            connections,
            made,
            acceptor,
        }
    }

    /// Every call so far.
    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits (at most 5 s) until a call to `rpc` was seen.
    pub(crate) async fn wait_for(&self, rpc: &str) {
        self.wait_for_count(rpc, 1).await;
    }

    /// Waits (up to 5 s) until at least `count` calls of `rpc` were seen.
    pub(crate) async fn wait_for_count(&self, rpc: &str, count: usize) {
        for _ in 0..500 {
            if self.seen().iter().filter(|seen| seen.rpc == rpc).count() >= count {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {count} {rpc} calls seen: {:?}", self.seen());
    }

    /// Connections made so far.
    pub(crate) fn connections_made(&self) -> usize {
        self.made.load(Ordering::Relaxed)
    }

    /// Closes every open connection, so that the next call makes a new one.
    pub(crate) fn drop_connections(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

impl Drop for FakeService {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.drop_connections();
    }
}

fn serve<I>(io: I, peer: Option<Vec<u8>>, seen: Arc<Mutex<Vec<Seen>>>) -> JoinHandle<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let service =
            hyper::service::service_fn(move |request| answer(request, peer.clone(), seen.clone()));
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(io), service)
            .await;
    })
}

/// Records the call, then answers it as [`FakeService`] says.
async fn answer(
    request: http::Request<Incoming>,
    peer: Option<Vec<u8>>,
    seen: Arc<Mutex<Vec<Seen>>>,
) -> Result<http::Response<Body>, Infallible> {
    let rpc = request.uri().path().rsplit('/').next().unwrap_or_default();
    let rpc = rpc.to_owned();
    // A server of before BatchStream: clients send batches as RPCs (the
    // client's probe for the stream is not a call the tests count).
    if rpc == "BatchStream" {
        return Ok(Status::unimplemented("no BatchStream in this version").into_http());
    }
    let authorization = request
        .headers()
        .get("authorization")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    seen.lock().unwrap().push(Seen {
        rpc: rpc.clone(),
        scheme: request.uri().scheme_str().map(str::to_owned),
        authorization: authorization.clone(),
        peer,
        traceparent: request
            .headers()
            .get("traceparent")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned),
    });
    if authorization.as_deref() == Some(&format!("Bearer {EXPIRED_TOKEN}")) {
        return Ok(Status::unauthenticated("the token has expired").into_http());
    }
    Ok(route(&rpc, request).await)
}

/// The answer to one call of `rpc`.
async fn route(rpc: &str, request: http::Request<Incoming>) -> http::Response<Body> {
    match rpc {
        "Acquire" => unary(request, acquire).await,
        "BatchAcquire" => unary(request, batch_acquire).await,
        "Renew" => unary(request, renew).await,
        "Complete" => {
            unary(request, |_: pb::CompleteRequest| {
                Ok(pb::CompleteResponse::default())
            })
            .await
        }
        "Fail" => {
            unary(
                request,
                |_: pb::FailRequest| Ok(pb::FailResponse::default()),
            )
            .await
        }
        _ => Status::not_found("no live record has this id").into_http(),
    }
}

fn acquire(acquire: pb::AcquireRequest) -> Result<pb::AcquireResponse, Status> {
    forbid(&acquire)?;
    Ok(acquired())
}

/// Each item as [`acquire`] answers it.
fn batch_acquire(batch: pb::BatchAcquireRequest) -> Result<pb::BatchAcquireResponse, Status> {
    use pb::batch_acquire_result::Result as Item;
    let results = batch.requests.iter().map(|acquire| match forbid(acquire) {
        Ok(()) => Item::Response(acquired()),
        Err(status) => Item::Error(
            <tonic_types::pb::Status as prost::Message>::decode(status.details()).unwrap(),
        ),
    });
    Ok(pb::BatchAcquireResponse {
        results: results
            .map(|result| pb::BatchAcquireResult {
                result: Some(result),
            })
            .collect(),
    })
}

fn renew(_: pb::RenewRequest) -> Result<pb::RenewResponse, Status> {
    Ok(pb::RenewResponse {
        lease_expires_at: Some(in_(Duration::from_secs(60))),
        expires_at: Some(in_(Duration::from_secs(86_400))),
    })
}

fn forbid(acquire: &pb::AcquireRequest) -> Result<(), Status> {
    let namespace = acquire.id.as_ref().map(|id| id.namespace.as_str());
    if namespace != Some(FORBIDDEN_NAMESPACE) {
        return Ok(());
    }
    Err(Status::with_error_details(
        Code::PermissionDenied,
        "namespace \"forbidden\" is not allowed for this caller",
        ErrorDetails::with_error_info(NAMESPACE_FORBIDDEN, "idempotency", []),
    ))
}

fn acquired() -> pb::AcquireResponse {
    pb::AcquireResponse {
        outcome: Some(pb::acquire_response::Outcome::Acquired(pb::Acquired {
            fencing_token: 1,
            lease_expires_at: Some(in_(Duration::from_secs(60))),
            expires_at: Some(in_(Duration::from_secs(86_400))),
        })),
    }
}

fn in_(duration: Duration) -> prost_types::Timestamp {
    (SystemTime::now() + duration).into()
}

/// Answers a unary call with `answer(request)`, through tonic's server codec.
async fn unary<Req, Resp>(
    request: http::Request<Incoming>,
    answer: fn(Req) -> Result<Resp, Status>,
) -> http::Response<Body>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
{
    Grpc::new(tonic_prost::ProstCodec::<Resp, Req>::default())
        .unary(Answer(answer), request)
        .await
}

struct Answer<Req, Resp>(fn(Req) -> Result<Resp, Status>);

impl<Req, Resp> UnaryService<Req> for Answer<Req, Resp> {
    type Response = Resp;
    type Future = Ready<Result<tonic::Response<Resp>, Status>>;

    fn call(&mut self, request: tonic::Request<Req>) -> Self::Future {
        ready((self.0)(request.into_inner()).map(tonic::Response::new))
    }
}

/// A directory removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "idempotency-client-{name}-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    /// Writes `contents` to `name` the way rotations do it: a new file
    /// renamed over the old one.
    pub(crate) fn replace(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.0.join(name);
        let next = self.0.join(format!("{name}.next"));
        std::fs::write(&next, contents).unwrap();
        std::fs::rename(&next, &path).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
