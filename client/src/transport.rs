//! What every call goes through: the stub over one transport, with the
//! [`Credentials`] interceptor around it.

use std::{
    collections::VecDeque,
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll, Waker},
    time::Duration,
};

use tonic::{
    Status,
    body::Body,
    codegen::{Body as _, Bytes, Service, StdError, http},
    service::interceptor::InterceptedService,
    transport::{Channel, Endpoint},
};

use crate::{
    balanced_endpoint::BalancedEndpoint,
    batching::stream::StreamStub,
    credentials::Credentials,
    pb::{
        idempotency_service_client::IdempotencyServiceClient,
        idempotency_stream_service_client::IdempotencyStreamServiceClient,
    },
    trace::TraceContext,
};

/// The stub every call of a [`Client`](crate::Client) uses, unary or batch:
/// one type, so that no call can go out without the credentials.
pub(crate) type Stub = IdempotencyServiceClient<InterceptedService<Transport, Credentials>>;

pub(crate) fn stub(transport: Transport, credentials: Credentials) -> Stub {
    IdempotencyServiceClient::with_interceptor(transport, credentials)
}

/// The `BatchStream` stub on the same transport and credentials.
pub(crate) fn stream_stub(transport: Transport, credentials: Credentials) -> StreamStub {
    IdempotencyStreamServiceClient::with_interceptor(transport, credentials)
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

/// A tonic channel to one endpoint, or a balancer over channels to several:
/// both connect through this crate's connectors ([`crate::socket`], and
/// [`TlsFiles`](crate::TlsFiles)'s), which tonic's own balancer cannot use.
#[derive(Clone)]
pub(crate) enum Transport {
    Channel(Channel),
    Balanced(Balanced),
}

/// The balancer over several endpoints.
pub(crate) type Balanced = tower::buffer::Buffer<
    Request,
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, StdError>> + Send>>,
>;

/// Channels through `connector`: one, or a balancer over several.
pub(crate) fn lazy<C>(mut endpoints: Vec<Endpoint>, connector: C) -> Transport
where
    C: Service<http::Uri> + Clone + Send + 'static,
    C::Response: hyper::rt::Read + hyper::rt::Write + Send + Unpin,
    C::Future: Send,
    StdError: From<C::Error> + Send,
{
    if endpoints.len() == 1 {
        return Transport::Channel(endpoints.remove(0).connect_with_connector_lazy(connector));
    }
    // What `Channel::balance_list` builds (power of two choices, over lazy
    // connections whose errors reach the calls, so none is dropped from the
    // set), but over connections made through this connector, and with an
    // endpoint whose calls fail in transport avoided for a while.
    let channels: Vec<_> = endpoints
        .iter()
        .map(|endpoint| {
            BalancedEndpoint::new(endpoint.connect_with_connector_lazy(connector.clone()))
        })
        .collect();
    let balance: tower::balance::p2c::Balance<_, Request> =
        tower::balance::p2c::Balance::new(tower::discover::ServiceList::new(channels));
    Transport::Balanced(tower::buffer::Buffer::new(
        tower::util::BoxService::new(balance),
        1024,
    ))
}

type Request = http::Request<Body>;
type ChannelFuture = <Channel as Service<Request>>::Future;
type BalancedFuture = <Balanced as Service<Request>>::Future;

impl Service<Request> for Transport {
    type Response = http::Response<Body>;
    type Error = StdError;
    type Future = TransportFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        match self {
            Transport::Channel(channel) => channel.poll_ready(cx).map_err(Into::into),
            Transport::Balanced(balanced) => balanced.poll_ready(cx),
        }
    }

    fn call(&mut self, request: Request) -> TransportFuture {
        let request = request.map(ReadAhead::body);
        match self {
            Transport::Channel(channel) => TransportFuture::Channel(channel.call(request)),
            Transport::Balanced(balanced) => TransportFuture::Balanced(balanced.call(request)),
        }
    }
}

/// The response future of [`Transport`]: no allocation of its own.
pub(crate) enum TransportFuture {
    Channel(ChannelFuture),
    Balanced(BalancedFuture),
}

impl Future for TransportFuture {
    type Output = Result<http::Response<Body>, StdError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            TransportFuture::Channel(future) => Pin::new(future).poll(cx).map_err(Into::into),
            TransportFuture::Balanced(future) => Pin::new(future).poll(cx),
        }
    }
}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transport::Channel(channel) => f.debug_tuple("Channel").field(channel).finish(),
            Transport::Balanced(_) => f.write_str("Balanced"),
        }
    }
}

/// A request body read ahead as far as it is ready when the call starts.
///
/// A unary request's body is ready at once, but tonic's encoder says it has
/// ended only when polled after its message. hyper then sends the message
/// and, a turn later, an empty DATA frame to end the stream: two or three
/// writes on the socket for one request, each of which wakes the server.
/// Read ahead, the body knows it has ended with its message, and hyper sends
/// the message with END_STREAM. (A body that is not ready is read on as it
/// comes: the frames read ahead go first.)
struct ReadAhead {
    ready: VecDeque<Result<http_body::Frame<Bytes>, Status>>,
    /// The rest; `None` once it ended.
    rest: Option<Body>,
}

impl ReadAhead {
    /// Frames at most this many ahead (a unary request has one).
    const MAX_FRAMES: usize = 4;

    fn body(body: Body) -> Body {
        let mut cx = Context::from_waker(Waker::noop());
        let mut ready = VecDeque::new();
        let mut rest = Some(body);
        while ready.len() < Self::MAX_FRAMES
            && let Some(body) = rest.as_mut()
        {
            match Pin::new(body).poll_frame(&mut cx) {
                Poll::Ready(Some(frame)) => ready.push_back(frame),
                Poll::Ready(None) => rest = None,
                // Polled again by hyper, with its waker, when it sends.
                Poll::Pending => break,
            }
        }
        Body::new(ReadAhead { ready, rest })
    }
}

impl http_body::Body for ReadAhead {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        if let Some(frame) = self.ready.pop_front() {
            return Poll::Ready(Some(frame));
        }
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(rest).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.rest = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_empty() && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }
}
