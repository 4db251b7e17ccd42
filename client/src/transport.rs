//! What every call goes through: the stub over one transport, with the
//! [`Credentials`] interceptor around it.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use tonic::{
    body::Body,
    codegen::{Service, StdError, http},
    service::interceptor::InterceptedService,
    transport::Channel,
};

use crate::{
    credentials::Credentials, pb::idempotency_service_client::IdempotencyServiceClient,
    trace::TraceContext,
};

/// The stub every call of a [`Client`](crate::Client) uses, unary or batch:
/// one type, so that no call can go out without the credentials.
pub(crate) type Stub = IdempotencyServiceClient<InterceptedService<Transport, Credentials>>;

pub(crate) fn stub(transport: Transport, credentials: Credentials) -> Stub {
    IdempotencyServiceClient::with_interceptor(transport, credentials)
}

/// A request carrying its deadline, so the server gives up when the caller
/// does, and its trace context (`traceparent`).
pub(crate) fn with_timeout<T>(
    message: T,
    timeout: Duration,
    trace: &TraceContext,
) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    crate::trace::inject(&mut request, trace);
    request
}

/// A tonic channel (one endpoint, or tonic's own balancing), or with the
/// `tls` feature the balancer over channels that connect through
/// [`TlsFiles`](crate::TlsFiles): tonic's balancer connects only through
/// its own connector.
#[derive(Clone)]
pub(crate) enum Transport {
    Channel(Channel),
    #[cfg(feature = "tls")]
    Balanced(crate::tls::Balanced),
}

type Request = http::Request<Body>;
type ChannelFuture = <Channel as Service<Request>>::Future;
#[cfg(feature = "tls")]
type BalancedFuture = <crate::tls::Balanced as Service<Request>>::Future;

impl Service<Request> for Transport {
    type Response = http::Response<Body>;
    type Error = StdError;
    type Future = TransportFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        match self {
            Transport::Channel(channel) => channel.poll_ready(cx).map_err(Into::into),
            #[cfg(feature = "tls")]
            Transport::Balanced(balanced) => balanced.poll_ready(cx),
        }
    }

    fn call(&mut self, request: Request) -> TransportFuture {
        match self {
            Transport::Channel(channel) => TransportFuture::Channel(channel.call(request)),
            #[cfg(feature = "tls")]
            Transport::Balanced(balanced) => TransportFuture::Balanced(balanced.call(request)),
        }
    }
}

/// The response future of [`Transport`]: no allocation of its own.
pub(crate) enum TransportFuture {
    Channel(ChannelFuture),
    #[cfg(feature = "tls")]
    Balanced(BalancedFuture),
}

impl Future for TransportFuture {
    type Output = Result<http::Response<Body>, StdError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            TransportFuture::Channel(future) => Pin::new(future).poll(cx).map_err(Into::into),
            #[cfg(feature = "tls")]
            TransportFuture::Balanced(future) => Pin::new(future).poll(cx),
        }
    }
}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transport::Channel(channel) => f.debug_tuple("Channel").field(channel).finish(),
            #[cfg(feature = "tls")]
            Transport::Balanced(_) => f.write_str("Balanced"),
        }
    }
}
