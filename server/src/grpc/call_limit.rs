//! A cap on calls in flight across every connection of the gRPC port.
//!
//! MAX_CONCURRENT_STREAMS bounds the calls of one connection; this bounds
//! them all. Each open call costs the server about 9 KiB before a byte of
//! its request arrives (bench/connections.py), so without it a thousand
//! connections of a hundred calls each would hold some 900 MiB.
//!
//! A call holds a permit until its answer's headers are ready (a streaming
//! answer, like health's `Watch`, gives it back then). A call beyond the cap
//! is answered `UNAVAILABLE`, reason `OVERLOADED`, at once and before its
//! request is read, so it costs next to nothing: the caller retries with
//! backoff, or on another replica.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::future::{BoxFuture, Either, Ready, ready};
use metrics::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Code, Status};

use super::status::{reason, with_reason};
use crate::metrics::{GRPC_CALLS_IN_FLIGHT, GRPC_CALLS_REFUSED_TOTAL};

/// Applies [`CallLimit`] with one set of permits shared by every connection
/// (and by BatchStream's messages, each a call: [`Self::enter`]).
#[derive(Debug, Clone)]
pub struct CallLimitLayer {
    permits: Arc<Semaphore>,
    max: usize,
    in_flight: Gauge,
}

impl CallLimitLayer {
    pub fn new(max: usize) -> Self {
        // Registered once, not per call, and exported from the start, not
        // from the first call on.
        let in_flight = metrics::gauge!(GRPC_CALLS_IN_FLIGHT);
        in_flight.increment(0.0);
        Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
            in_flight,
        }
    }

    /// A call's permit, or its answer when the cap is reached (counted).
    pub(crate) fn enter(&self) -> Result<InFlight, Status> {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            metrics::counter!(GRPC_CALLS_REFUSED_TOTAL).increment(1);
            return Err(with_reason(
                Code::Unavailable,
                format!(
                    "the server has {} calls in flight, its limit; retry with backoff",
                    self.max
                ),
                reason::OVERLOADED,
            ));
        };
        self.in_flight.increment(1.0);
        Ok(InFlight {
            _permit: permit,
            gauge: self.in_flight.clone(),
        })
    }
}

impl<S> tower::Layer<S> for CallLimitLayer {
    type Service = CallLimit<S>;

    fn layer(&self, inner: S) -> CallLimit<S> {
        CallLimit {
            inner,
            limit: self.clone(),
        }
    }
}

/// Answers calls beyond the cap `UNAVAILABLE` at once.
#[derive(Debug, Clone)]
pub struct CallLimit<S> {
    inner: S,
    limit: CallLimitLayer,
}

impl<S, B> tower::Service<http::Request<B>> for CallLimit<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<
        Ready<Result<S::Response, S::Error>>,
        BoxFuture<'static, Result<S::Response, S::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let in_flight = match self.limit.enter() {
            Ok(in_flight) => in_flight,
            Err(status) => return Either::Left(ready(Ok(status.into_http()))),
        };
        let call = self.inner.call(request);
        Either::Right(Box::pin(async move {
            let answer = call.await;
            drop(in_flight);
            answer
        }))
    }
}

/// A call's permit, given back when its answer is ready or it is cancelled.
pub(crate) struct InFlight {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}
