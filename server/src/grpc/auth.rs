//! Authentication and authorization of calls, with auth on.
//!
//! - [`AuthLayer`] runs before every call but health's: it establishes the
//!   caller ([`Caller`], a request extension) or answers `UNAUTHENTICATED`,
//!   and lets reflection answer only principals the policy names;
//! - [`Authorizer`] is asked by each handler, for each call and batch item,
//!   whether the caller may touch the namespace of the id it names. It
//!   decides from the request alone, before anything is read, so a denial is
//!   the same whether or not the record exists.
//!
//! Every refusal is counted (`idempotency_auth_denied_total{reason}`) and
//! logged under the tracing target `audit`.

use std::{
    net::SocketAddr,
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::future::{Either, Ready, ready};
use tonic::{Code, Status, transport::server::TcpConnectInfo};

use super::status::{reason, with_reason};
use crate::{
    metrics,
    security::{
        Auth,
        credentials::Rejection,
        policy::Access,
        tls::{PeerIdentity, TlsConnectInfo},
    },
};

/// The authenticated principal of a call, and where it called from (a request extension).
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: Arc<str>,
    pub remote: Option<SocketAddr>,
}

const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";
const REFLECTION_PREFIX: &str = "/grpc.reflection.";

/// Authenticates every call except health checks (probes carry no credential).
#[derive(Debug, Clone)]
pub struct AuthLayer {
    auth: Option<Arc<Auth>>,
}

impl AuthLayer {
    /// `None`: auth is off and every call passes.
    pub fn new(auth: Option<Arc<Auth>>) -> Self {
        Self { auth }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Authenticated<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authenticated {
            inner,
            auth: self.auth.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Option<Arc<Auth>>,
}

/// The client's address, for the audit log.
pub(super) fn remote_addr(extensions: &http::Extensions) -> Option<SocketAddr> {
    extensions
        .get::<TlsConnectInfo>()
        .and_then(|info| info.remote_addr)
        .or_else(|| {
            extensions
                .get::<TcpConnectInfo>()
                .and_then(|info| info.remote_addr)
        })
}

/// An address as the audit log shows it.
fn shown(remote: Option<SocketAddr>) -> String {
    remote.map_or_else(|| "unknown".to_owned(), |addr| addr.to_string())
}

/// The method of a gRPC path (`/idempotency.v1.IdempotencyService/Acquire`
/// is `Acquire`), as the handlers name their RPCs in the audit log.
fn method(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

impl<S, B> tower::Service<http::Request<B>> for Authenticated<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let Some(auth) = &self.auth else {
            return Either::Right(self.inner.call(request));
        };
        let path = request.uri().path();
        if path.starts_with(HEALTH_PREFIX) {
            return Either::Right(self.inner.call(request));
        }
        let denied = match authenticate(auth, path, request.headers(), request.extensions()) {
            Err(status) => Some(status),
            Ok(caller) => {
                let refused = path.starts_with(REFLECTION_PREFIX)
                    && !auth.policy.current().names(&caller.principal);
                let denied = refused
                    .then(|| reflection_forbidden(method(path), caller.remote, &caller.principal));
                request.extensions_mut().insert(caller);
                denied
            }
        };
        match denied {
            Some(status) => Either::Left(ready(Ok(status.into_http()))),
            None => Either::Right(self.inner.call(request)),
        }
    }
}

/// Who calls `path`: the bearer token in `headers` or the client
/// certificate of the connection (`extensions`), checked against the
/// credentials as they are now. A refusal is counted and audited.
pub fn authenticate(
    auth: &Auth,
    path: &str,
    headers: &http::HeaderMap,
    extensions: &http::Extensions,
) -> Result<Caller, Status> {
    let peer: Option<&PeerIdentity> = extensions
        .get::<TlsConnectInfo>()
        .and_then(|info| info.peer.as_ref());
    let authorization = headers
        .get(http::header::AUTHORIZATION)
        .map(|value| value.as_bytes());
    let remote = remote_addr(extensions);
    match auth.credentials.authenticate(authorization, peer) {
        Ok(principal) => Ok(Caller { principal, remote }),
        Err(rejection) => Err(unauthenticated(method(path), remote, &rejection)),
    }
}

fn unauthenticated(rpc: &str, remote: Option<SocketAddr>, rejection: &Rejection) -> Status {
    metrics::auth_denied(rejection.reason());
    tracing::warn!(
        target: "audit",
        event = "auth_denied",
        reason = rejection.reason(),
        rpc,
        remote = shown(remote),
        detail = %rejection,
        "call refused: not authenticated"
    );
    with_reason(
        Code::Unauthenticated,
        rejection.to_string(),
        reason::UNAUTHENTICATED,
    )
}

fn reflection_forbidden(rpc: &str, remote: Option<SocketAddr>, principal: &str) -> Status {
    metrics::auth_denied("reflection_forbidden");
    tracing::warn!(
        target: "audit",
        event = "auth_denied",
        reason = "reflection_forbidden",
        rpc,
        remote = shown(remote),
        principal,
        "call refused: the policy names no grant for this principal"
    );
    with_reason(
        Code::PermissionDenied,
        format!("{principal} has no grant in the policy; reflection answers callers that do"),
        reason::NOT_GRANTED,
    )
}

/// Decides, per call and per batch item, whether the caller may touch a namespace.
#[derive(Debug, Clone, Default)]
pub struct Authorizer {
    auth: Option<Arc<Auth>>,
}

impl Authorizer {
    /// `None`: auth is off and everything is allowed.
    pub fn new(auth: Option<Arc<Auth>>) -> Self {
        Self { auth }
    }

    /// `Ok` when `caller` may do `access` on records of `namespace`.
    /// `namespace` is as sent, before any validation: an id the caller may
    /// not use is refused before it is looked at.
    pub fn check(
        &self,
        caller: Option<&Caller>,
        rpc: &'static str,
        namespace: &str,
        access: Access,
    ) -> Result<(), Status> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        // The layer puts a caller on every authenticated request; a handler
        // reached without one is refused rather than trusted.
        let Some(Caller { principal, remote }) = caller else {
            return Err(unauthenticated(rpc, None, &Rejection::NoCredential));
        };
        if auth.policy.current().allows(principal, namespace, access) {
            return Ok(());
        }
        metrics::auth_denied("namespace_forbidden");
        tracing::warn!(
            target: "audit",
            event = "auth_denied",
            reason = "namespace_forbidden",
            rpc,
            remote = shown(*remote),
            principal = &**principal,
            namespace,
            access = access.as_str(),
            "call refused: namespace not granted"
        );
        Err(with_reason(
            Code::PermissionDenied,
            format!(
                "{principal} may not {} records of namespace {namespace:?}",
                access.as_str()
            ),
            reason::NAMESPACE_FORBIDDEN,
        ))
    }
}
