//! The typed client: connection set-up, per-call timeouts, and retries of
//! transient errors with exponential backoff and jitter. Each call runs in
//! its span and sends its trace context ([`crate::trace`]).

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use tonic::{
    Response, Status,
    transport::{Channel, Endpoint},
};
use tracing::Instrument;

use crate::{
    batching::{
        Batcher, Batching, Grpc, SendBatch,
        stream::{StreamStub, Streams},
    },
    credentials::{Credentials, TokenSource},
    error::{Error, is_dropped_connection, is_transient},
    lease::{Acquisition, Lease},
    pb,
    socket::TcpConnector,
    trace::{self, TraceContext},
    transport::{Stub, Transport, with_timeout},
    types::{
        AcquireRequest, Record, RecordId, RecordState, StoredResponse, duration_from_pb,
        duration_to_pb, time_from_pb,
    },
};

/// The span of one call of the service on `id`: its namespace and
/// operation, never its subject, key or response (they may be personal
/// data); `trace_id` is filled in by [`trace::for_call`].
macro_rules! call_span {
    ($name:literal, $id:expr) => {
        tracing::info_span!(
            $name,
            namespace = %$id.namespace,
            operation = %$id.operation,
            trace_id = tracing::field::Empty,
        )
    };
}

/// How transient errors (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, a reset
/// connection, a connection that dropped before the call went out) are
/// retried. Safe because every RPC of the service is idempotent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Calls at most, the first included. 1 disables retries.
    pub max_attempts: u32,
    /// Backoff ceiling before the second call; doubles per attempt.
    pub initial_backoff: Duration,
    /// Largest backoff ceiling.
    pub max_backoff: Duration,
    /// No new attempt starts after this much time since the first.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(25),
            max_backoff: Duration::from_secs(1),
            max_elapsed: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// One call, no retries.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// "Full jitter": a uniform pick below the exponential ceiling, so that
    /// many callers failing together do not retry together.
    fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .initial_backoff
            .saturating_mul(1u32 << retry.min(16))
            .min(self.max_backoff);
        ceiling.mul_f64(fastrand::f64())
    }
}

/// Settings of a [`Client`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Deadline of each call attempt, also sent as `grpc-timeout`. Keep it
    /// above the server's usual worst case: a statement's pool wait plus its
    /// statement timeout, 7 s by default (an Acquire taking over an abandoned
    /// key runs two or three statements, each so bounded). An Acquire that
    /// timed out here may still commit there, and its retry would then find
    /// its own attempt in progress until the lease passes. A call that runs
    /// out of time fails as [`Error::Unavailable`]; it is sent again only
    /// while [`RetryPolicy::max_elapsed`] allows, which with the defaults
    /// (10 s here, 5 s there) it never does.
    pub timeout: Duration,
    /// Retries of transient errors.
    pub retry: RetryPolicy,
    /// How concurrent Acquires and Completes share calls; `None`: each call
    /// is its own RPC.
    pub batching: Option<Batching>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            batching: Some(Batching::default()),
        }
    }
}

/// A handle to the idempotency service. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    // Shared, so that a clone (one per Lease) is a pointer, not a channel.
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    stub: Stub,
    /// The stream stub on the same transport and credentials; `None` with
    /// several endpoints, whose balancer spreads calls, not streams.
    stream_stub: Option<(StreamStub, Credentials)>,
    /// The client's streams, shared with the clients `with_options` makes
    /// of it (one stream per connection, not one per options).
    streams: Option<Arc<Streams>>,
    options: ClientOptions,
    acquires: Option<Batcher<Grpc<pb::AcquireRequest>>>,
    completes: Option<Batcher<Grpc<pb::CompleteRequest>>>,
}

impl Inner {
    fn new(
        channel_stub: Stub,
        stream_stub: Option<(StreamStub, Credentials)>,
        shared: Option<Arc<Streams>>,
        options: ClientOptions,
    ) -> Self {
        // Batch replies carry up to 100 stored responses: no 4 MiB cap.
        let stub = channel_stub.max_decoding_message_size(usize::MAX);
        let batching = options.batching.as_ref();
        // One stream set, shared by both kinds of call.
        let streams = stream_stub.as_ref().map(|(stub, credentials)| {
            shared.unwrap_or_else(|| Arc::new(Streams::new(stub.clone(), credentials.clone())))
        });
        let used = streams
            .clone()
            .filter(|_| batching.is_some_and(|b| b.stream));
        Self {
            acquires: batching.map(|b| batcher(&stub, &used, b, options.timeout)),
            completes: batching.map(|b| batcher(&stub, &used, b, options.timeout)),
            stub,
            stream_stub,
            streams,
            options,
        }
    }
}

/// The batcher of one kind of call, sending through `stub`, or `streams`.
fn batcher<R>(
    stub: &Stub,
    streams: &Option<Arc<Streams>>,
    batching: &Batching,
    timeout: Duration,
) -> Batcher<Grpc<R>>
where
    Grpc<R>: SendBatch<Request = R>,
{
    let sender = Grpc::with_streams(stub.clone(), streams.clone());
    Batcher::new(sender, batching.clone(), timeout)
}

impl Client {
    /// Connects to one endpoint, e.g. `http://idempotency:50051`, with default options.
    pub async fn connect(endpoint: impl Into<String>) -> Result<Self, Error> {
        ClientBuilder::new().endpoint(endpoint).connect().await
    }

    /// Starts a [`ClientBuilder`] for several endpoints, TLS, or other options.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::new()
    }

    /// Wraps a channel you built yourself (no bearer token).
    pub fn from_channel(channel: Channel) -> Self {
        Self::new(
            Transport::Channel(channel),
            Credentials::default(),
            ClientOptions::default(),
        )
    }

    fn new(transport: Transport, credentials: Credentials, options: ClientOptions) -> Self {
        let stream_stub = matches!(transport, Transport::Channel(_)).then(|| {
            let stub = crate::transport::stream_stub(transport.clone(), credentials.clone());
            (stub, credentials.clone())
        });
        Self {
            inner: Arc::new(Inner::new(
                crate::transport::stub(transport, credentials),
                stream_stub,
                None,
                options,
            )),
        }
    }

    /// The same connection with other options.
    pub fn with_options(self, options: ClientOptions) -> Self {
        let inner = &self.inner;
        Self {
            inner: Arc::new(Inner::new(
                inner.stub.clone(),
                inner.stream_stub.clone(),
                inner.streams.clone(),
                options,
            )),
        }
    }

    /// The options in force.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// Reserves a key, or tells why not to run the business logic now.
    pub async fn acquire(&self, request: &AcquireRequest) -> Result<Acquisition, Error> {
        let span = call_span!("idempotency.acquire", request.id);
        let context = trace::for_call(&span);
        let response = self
            .batched(self.inner.acquires.as_ref(), request.to_pb(), context)
            .instrument(span)
            .await?;
        use pb::acquire_response::Outcome;
        Ok(match response.outcome {
            Some(Outcome::Acquired(acquired)) => Acquisition::Proceed(Lease::new(
                self.clone(),
                request.id.clone(),
                acquired.fencing_token,
                (
                    time_from_pb(acquired.lease_expires_at),
                    time_from_pb(acquired.expires_at),
                ),
                trace::current(),
            )),
            Some(Outcome::InProgress(in_progress)) => Acquisition::InProgress {
                retry_after: duration_from_pb(in_progress.retry_after),
                lease_expires_at: time_from_pb(in_progress.lease_expires_at),
            },
            Some(Outcome::Completed(completed)) => {
                Acquisition::Replay(StoredResponse::from_pb(completed.response))
            }
            Some(Outcome::Failed(failed)) => {
                Acquisition::Failed(StoredResponse::from_pb(failed.error_response))
            }
            Some(Outcome::FingerprintMismatch(_)) => Acquisition::FingerprintMismatch,
            None => return Err(Error::Internal("Acquire answered no outcome".into())),
        })
    }

    /// Reads a record; `None` when no live record has this id.
    pub async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let message = pb::GetRequest {
            id: Some(id.to_pb()),
        };
        let span = call_span!("idempotency.get", id);
        let context = trace::for_call(&span);
        let record = match self
            .call(|mut stub, timeout| {
                let message = with_timeout(message.clone(), timeout, &context);
                async move { stub.get(message).await }
            })
            .instrument(span)
            .await
        {
            Ok(response) => response.record.unwrap_or_default(),
            Err(Error::NotFound) => return Ok(None),
            Err(error) => return Err(error),
        };
        let state = RecordState::from_pb(record.state)
            .ok_or_else(|| Error::Internal(format!("unknown record state {}", record.state)))?;
        Ok(Some(Record {
            state,
            fingerprint: record.fingerprint,
            fencing_token: record.fencing_token,
            created_at: time_from_pb(record.created_at),
            expires_at: time_from_pb(record.expires_at),
            lease_expires_at: record.lease_expires_at.map(|t| time_from_pb(Some(t))),
            completed_at: record.completed_at.map(|t| time_from_pb(Some(t))),
            response: record.response.map(|r| StoredResponse::from_pb(Some(r))),
        }))
    }

    pub(crate) async fn complete(
        &self,
        id: &RecordId,
        fencing_token: u64,
        response: &StoredResponse,
    ) -> Result<(), Error> {
        let message = pb::CompleteRequest {
            id: Some(id.to_pb()),
            fencing_token,
            response: Some(response.to_pb()),
        };
        let span = call_span!("idempotency.complete", id);
        let context = trace::for_call(&span);
        self.batched(self.inner.completes.as_ref(), message, context)
            .instrument(span)
            .await
            .map(drop)
    }

    pub(crate) async fn fail(
        &self,
        id: &RecordId,
        fencing_token: u64,
        error_response: Option<&StoredResponse>,
    ) -> Result<(), Error> {
        let message = pb::FailRequest {
            id: Some(id.to_pb()),
            fencing_token,
            retryable: error_response.is_none(),
            error_response: error_response.map(StoredResponse::to_pb),
        };
        let span = call_span!("idempotency.fail", id);
        let context = trace::for_call(&span);
        self.call(|mut stub, timeout| {
            let message = with_timeout(message.clone(), timeout, &context);
            async move { stub.fail(message).await }
        })
        .instrument(span)
        .await
        .map(drop)
    }

    pub(crate) async fn renew(
        &self,
        id: &RecordId,
        fencing_token: u64,
        lease: Duration,
    ) -> Result<pb::RenewResponse, Error> {
        let message = pb::RenewRequest {
            id: Some(id.to_pb()),
            fencing_token,
            lease: Some(duration_to_pb(lease)),
        };
        let span = call_span!("idempotency.renew", id);
        let context = trace::for_call(&span);
        self.call(|mut stub, timeout| {
            let message = with_timeout(message.clone(), timeout, &context);
            async move { stub.renew(message).await }
        })
        .instrument(span)
        .await
    }

    /// Makes a call through its batcher when batching is on, else alone.
    async fn batched<R: Clone>(
        &self,
        batcher: Option<&Batcher<Grpc<R>>>,
        message: R,
        context: TraceContext,
    ) -> Result<<Grpc<R> as SendBatch>::Response, Error>
    where
        Grpc<R>: SendBatch<Request = R>,
    {
        match batcher {
            Some(batcher) => self.attempts(|_, _| batcher.call(&message, context)).await,
            None => {
                self.attempts(|stub, timeout| {
                    Grpc::new(stub).unary(message.clone(), timeout, context)
                })
                .await
            }
        }
    }

    /// Makes one unary call with the per-attempt deadline, retrying transient errors.
    async fn call<T, F, Fut>(&self, mut attempt: F) -> Result<T, Error>
    where
        F: FnMut(Stub, Duration) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        self.attempts(|stub, timeout| {
            let call = attempt(stub, timeout);
            async move { call.await.map(Response::into_inner) }
        })
        .await
    }

    /// Runs attempts with the per-attempt deadline, retrying transient errors.
    async fn attempts<T, F, Fut>(&self, mut attempt: F) -> Result<T, Error>
    where
        F: FnMut(Stub, Duration) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let options = &self.inner.options;
        let policy = &options.retry;
        let started = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let attempt_started = tokio::time::Instant::now();
            let status = match tokio::time::timeout(
                options.timeout,
                attempt(self.inner.stub.clone(), options.timeout),
            )
            .await
            {
                Ok(Ok(response)) => return Ok(response),
                // tonic's channel enforces the `grpc-timeout` it sends as
                // well, and reports its expiry as CANCELLED ("Timeout
                // expired"); it usually fires on the same tick as ours, and
                // first. A call that ran out of time is a deadline, retried
                // and counted as unavailable like one, whichever timer won.
                Ok(Err(status))
                    if status.code() == tonic::Code::Cancelled
                        && attempt_started.elapsed() >= options.timeout =>
                {
                    Status::deadline_exceeded(format!(
                        "the call exceeded the client's timeout ({})",
                        status.message()
                    ))
                }
                Ok(Err(status)) if is_dropped_connection(&status) => Status::unavailable(format!(
                    "the connection closed before the call went out ({})",
                    status.message()
                )),
                Ok(Err(status)) => status,
                Err(_) => Status::deadline_exceeded("the call exceeded the client's timeout"),
            };
            let pause = policy.backoff(attempts - 1);
            let may_retry = is_transient(status.code())
                && attempts < policy.max_attempts
                && started.elapsed() + pause < policy.max_elapsed;
            if !may_retry {
                return Err(Error::from_status(status, attempts));
            }
            tracing::debug!(code = ?status.code(), attempts, ?pause, "retrying the idempotency service");
            tokio::time::sleep(pause).await;
        }
    }
}

/// Builds a [`Client`]: one or several endpoints (balanced), timeouts, TLS,
/// credentials, retries.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    endpoints: Vec<String>,
    options: ClientOptions,
    connect_timeout: Duration,
    token: Option<TokenSource>,
    #[cfg(feature = "tls")]
    tls: Option<tonic::transport::ClientTlsConfig>,
    #[cfg(feature = "tls")]
    tls_files: Option<crate::TlsFiles>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientBuilder {
    /// No endpoints yet, default options.
    pub fn new() -> Self {
        Self {
            endpoints: Vec::new(),
            options: ClientOptions::default(),
            connect_timeout: Duration::from_secs(2),
            token: None,
            #[cfg(feature = "tls")]
            tls: None,
            #[cfg(feature = "tls")]
            tls_files: None,
        }
    }

    /// Adds an endpoint, e.g. `http://idempotency:50051` (`https://` with the `tls` feature).
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoints.push(endpoint.into());
        self
    }

    /// Adds several endpoints; calls are balanced across them. For 2 s after
    /// a call could not reach an endpoint (the connection refused or lost),
    /// each attempt that draws it beside another endpoint takes the other (the
    /// balancer draws two at a time: with two endpoints, a retry always goes
    /// to the other one); then the next call drawn to it tries it again.
    pub fn endpoints<I, S>(mut self, endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.endpoints.extend(endpoints.into_iter().map(Into::into));
        self
    }

    /// Deadline of each call attempt (default 10 s; see [`ClientOptions::timeout`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = timeout;
        self
    }

    /// How long establishing a connection may take (default 2 s), the TLS
    /// handshake included.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Retries of transient errors.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.options.retry = retry;
        self
    }

    /// How concurrent calls share RPCs (default: [`Batching::default`]);
    /// `None` sends every call as its own RPC.
    pub fn batching(mut self, batching: Option<Batching>) -> Self {
        self.options.batching = batching;
        self
    }

    /// Sends `authorization: Bearer <token>` from `token` with every RPC of
    /// the client: unary calls, the batch RPCs, lease renewals and releases.
    /// A call for which `token` has no token fails with
    /// [`Error::Unauthenticated`] without being sent. Send tokens over TLS
    /// only: over `http://` anyone on the path can read them.
    pub fn bearer_token(mut self, token: TokenSource) -> Self {
        self.token = Some(token);
        self
    }

    /// TLS settings, e.g. `ClientTlsConfig::new().with_webpki_roots()` or
    /// your own CA. Read once: for certificates rotated on disk, use
    /// [`Self::tls_files`] instead (not both).
    #[cfg(feature = "tls")]
    pub fn tls(mut self, tls: tonic::transport::ClientTlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// TLS from certificate files read again for each new connection, so
    /// that rotated certificates take effect without a restart: the CA of
    /// the service and, for mutual TLS, this client's certificate and key
    /// (see [`crate::TlsFiles`]). Endpoints are `https://` (port 443 unless
    /// given). Files that cannot be used when the client is built are an
    /// [`Error::Config`] from [`Self::connect`] and [`Self::connect_lazy`].
    #[cfg(feature = "tls")]
    pub fn tls_files(mut self, files: crate::TlsFiles) -> Self {
        self.tls_files = Some(files);
        self
    }

    fn build_endpoints(&self) -> Result<Vec<Endpoint>, Error> {
        if self.endpoints.is_empty() {
            return Err(Error::Config("no endpoint given".into()));
        }
        #[cfg(feature = "tls")]
        if self.tls.is_some() && self.tls_files.is_some() {
            return Err(Error::Config(
                "both `tls` and `tls_files` given: choose one".into(),
            ));
        }
        self.endpoints
            .iter()
            .map(|uri| {
                #[cfg(feature = "tls")]
                let endpoint = match &self.tls_files {
                    Some(_) => crate::tls::endpoint(uri)?,
                    None => Endpoint::from_shared(uri.clone())
                        .map_err(|error| Error::Config(format!("endpoint {uri:?}: {error}")))?,
                };
                #[cfg(not(feature = "tls"))]
                let endpoint = Endpoint::from_shared(uri.clone())
                    .map_err(|error| Error::Config(format!("endpoint {uri:?}: {error}")))?;
                let endpoint = endpoint
                    .connect_timeout(self.connect_timeout)
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(30))
                    .keep_alive_while_idle(true);
                #[cfg(feature = "tls")]
                let endpoint = match &self.tls {
                    Some(tls) => endpoint
                        .tls_config(tls.clone())
                        .map_err(|error| Error::Config(format!("TLS for {uri:?}: {error}")))?,
                    None => endpoint,
                };
                Ok(endpoint)
            })
            .collect()
    }

    /// The connector of [`Self::tls_files`], with the files read once.
    #[cfg(feature = "tls")]
    fn tls_connector(&self) -> Result<Option<crate::tls::Connector>, Error> {
        self.tls_files
            .clone()
            .map(|files| crate::tls::Connector::new(files, self.tcp_connector()))
            .transpose()
    }

    /// TCP to the endpoints, as tonic's own connector with these options.
    fn tcp_connector(&self) -> TcpConnector {
        TcpConnector::new(self.connect_timeout)
    }

    fn client(self, transport: Transport) -> Client {
        Client::new(transport, Credentials::new(self.token), self.options)
    }

    /// A client that connects on first use: building it never fails for an
    /// unreachable service, so a fail-open caller can start without one.
    pub fn connect_lazy(self) -> Result<Client, Error> {
        let endpoints = self.build_endpoints()?;
        #[cfg(feature = "tls")]
        if let Some(connector) = self.tls_connector()? {
            let transport = crate::transport::lazy(endpoints, connector);
            return Ok(self.client(transport));
        }
        let transport = crate::transport::lazy(endpoints, self.tcp_connector());
        Ok(self.client(transport))
    }

    /// A client whose (single) endpoint answered; with several endpoints
    /// this is [`Self::connect_lazy`], since the balancer connects on its own.
    pub async fn connect(self) -> Result<Client, Error> {
        let mut endpoints = self.build_endpoints()?;
        if endpoints.len() > 1 {
            return self.connect_lazy();
        }
        let endpoint = endpoints.remove(0);
        #[cfg(feature = "tls")]
        let connected = match self.tls_connector()? {
            Some(connector) => endpoint.connect_with_connector(connector).await,
            None => endpoint.connect_with_connector(self.tcp_connector()).await,
        };
        #[cfg(not(feature = "tls"))]
        let connected = endpoint.connect_with_connector(self.tcp_connector()).await;
        let channel = connected.map_err(|error| Error::Unavailable {
            attempts: 1,
            message: format!("connecting: {}", error_chain(&error)),
        })?;
        Ok(self.client(Transport::Channel(channel)))
    }
}

/// An error and its sources: tonic's connection errors say only "transport
/// error" at the top.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    crate::error::causes(error)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_under_its_doubling_ceiling() {
        let policy = RetryPolicy::default();
        for retry in 0..10 {
            let ceiling = (policy.initial_backoff * 2u32.pow(retry)).min(policy.max_backoff);
            for _ in 0..100 {
                assert!(policy.backoff(retry) <= ceiling);
            }
        }
    }

    #[test]
    fn a_builder_without_endpoints_is_a_config_error() {
        assert!(matches!(
            ClientBuilder::new().connect_lazy(),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            ClientBuilder::new().endpoint("not a uri").connect_lazy(),
            Err(Error::Config(_))
        ));
    }
}
