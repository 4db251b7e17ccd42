//! One endpoint of a client with several: its channel, and the load the
//! balancer compares, so that an endpoint that went away stops drawing calls.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tonic::{
    body::Body,
    codegen::{Service, http},
    transport::Channel,
};

/// How long an endpoint whose call failed in transport (the connection
/// refused or lost, or any other error below gRPC) loses every draw against one that did not fail. The balancer
/// (power of two choices) compares two endpoints' loads: with two endpoints
/// it draws both every time, so a retry of a refused call goes to the other
/// one. Once the mark lapses the endpoint is drawn again, and its channel
/// reconnects on that call: an endpoint that came back gets calls again
/// within this long, and one still gone costs one call a retry this often.
pub(crate) const FAILED_ENDPOINT_AVOIDED_FOR: Duration = Duration::from_secs(2);

/// A balanced endpoint's channel. Its load is `true` while its last call
/// failed in transport less than [`FAILED_ENDPOINT_AVOIDED_FOR`] ago.
///
/// The channel connects lazily and hands its connection errors to the calls,
/// so it always looks ready; without this mark the balancer drew an endpoint
/// that went away as often as a live one, and a call whose every attempt
/// drew it failed although a live endpoint was there.
pub(crate) struct BalancedEndpoint {
    channel: Channel,
    failed_at: Arc<Mutex<Option<Instant>>>,
}

impl BalancedEndpoint {
    pub(crate) fn new(channel: Channel) -> Self {
        Self {
            channel,
            failed_at: Arc::default(),
        }
    }
}

type Request = http::Request<Body>;
type Response = http::Response<Body>;

impl Service<Request> for BalancedEndpoint {
    type Response = Response;
    type Error = tonic::transport::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.channel.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let response = self.channel.call(request);
        let failed_at = Arc::clone(&self.failed_at);
        Box::pin(async move {
            let result = response.await;
            // A gRPC error is an answer (Ok here, its status in the
            // trailers); only the transport's failures mark the endpoint.
            *failed_at
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) =
                result.is_err().then(Instant::now);
            result
        })
    }
}

impl tower::load::Load for BalancedEndpoint {
    type Metric = bool;

    fn load(&self) -> bool {
        let failed_at = *self
            .failed_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        failed_at.is_some_and(|at| at.elapsed() < FAILED_ENDPOINT_AVOIDED_FOR)
    }
}
