//! One endpoint of a client with several: its channel, and the load the
//! balancer compares, so that an endpoint that went away stops drawing calls.

use std::{
    error::Error as StdError,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tonic::{
    body::Body,
    codegen::{Service, http},
    transport::Channel,
};

/// How long an endpoint whose call could not reach it (the connection
/// refused or lost) loses every draw against an endpoint not marked so.
/// The balancer (power of two choices) draws two endpoints and compares
/// their loads: with two endpoints it draws both every time, so a retry of
/// a refused call goes to the other one. Once the mark lapses, the next call
/// drawn to the endpoint marks it again before it goes, so that it alone
/// finds out whether the endpoint is back: an endpoint that came back gets
/// calls again about this long after its last failure, and one still gone
/// costs one call a retry this often.
pub(crate) const FAILED_ENDPOINT_AVOIDED_FOR: Duration = Duration::from_secs(2);

/// A balanced endpoint's channel. Its load is `true` while it is marked.
///
/// The channel connects lazily and hands its connection errors to the calls,
/// so it always looks ready; without the mark the balancer drew an endpoint
/// that went away as often as a live one, and a call whose every attempt
/// drew it failed although a live endpoint was there.
pub(crate) struct BalancedEndpoint {
    channel: Channel,
    mark: Arc<FailureMark>,
}

impl BalancedEndpoint {
    pub(crate) fn new(channel: Channel) -> Self {
        Self {
            channel,
            mark: Arc::default(),
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
        let sent = Instant::now();
        self.mark.renew_if_lapsed(sent);
        let response = self.channel.call(request);
        let mark = Arc::clone(&self.mark);
        Box::pin(async move {
            let result = response.await;
            match &result {
                // A gRPC error is an answer (Ok here, its status in the
                // trailers): the endpoint was reached.
                Ok(_) => mark.clear_if_set_by_then(sent),
                // A call that ran out of time reached the endpoint, or may
                // have: a slow database behind every endpoint is no reason
                // to avoid this one.
                Err(error) if timed_out(error) => {}
                Err(_) => mark.set(Instant::now()),
            }
            result
        })
    }
}

impl tower::load::Load for BalancedEndpoint {
    type Metric = bool;

    fn load(&self) -> bool {
        self.mark.is_fresh(Instant::now())
    }
}

/// When an endpoint's call last failed to reach it, if it did since the last
/// call that reached it.
#[derive(Default)]
struct FailureMark(Mutex<Option<Instant>>);

impl FailureMark {
    fn at(&self) -> MutexGuard<'_, Option<Instant>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn is_fresh(&self, now: Instant) -> bool {
        self.at()
            .is_some_and(|at| now.saturating_duration_since(at) < FAILED_ENDPOINT_AVOIDED_FOR)
    }

    fn renew_if_lapsed(&self, now: Instant) {
        let mut at = self.at();
        if at.is_some_and(|at| now.saturating_duration_since(at) >= FAILED_ENDPOINT_AVOIDED_FOR) {
            *at = Some(now);
        }
    }

    fn set(&self, now: Instant) {
        *self.at() = Some(now);
    }

    /// A call sent at `sent` reached the endpoint: a mark set before it was
    /// sent is stale; one set since (by a call sent later) stays.
    fn clear_if_set_by_then(&self, sent: Instant) {
        let mut at = self.at();
        if at.is_some_and(|at| at <= sent) {
            *at = None;
        }
    }
}

/// Whether the call ran out of its time (tonic's `TimeoutExpired`, somewhere
/// in the error's chain).
fn timed_out(error: &(dyn StdError + 'static)) -> bool {
    crate::error::causes(error).any(|cause| cause.is::<tonic::TimeoutExpired>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_lasts_its_while_and_a_call_after_it_renews_it() {
        let mark = FailureMark::default();
        let start = Instant::now();
        assert!(!mark.is_fresh(start));
        mark.set(start);
        assert!(mark.is_fresh(start + FAILED_ENDPOINT_AVOIDED_FOR / 2));
        assert!(!mark.is_fresh(start + FAILED_ENDPOINT_AVOIDED_FOR));

        // The first call after it lapses marks the endpoint again for the
        // others while it finds out.
        let probe = start + FAILED_ENDPOINT_AVOIDED_FOR;
        mark.renew_if_lapsed(probe);
        assert!(mark.is_fresh(probe + Duration::from_millis(1)));
        // A fresh mark is left as it is.
        mark.renew_if_lapsed(probe + Duration::from_millis(1));
        assert_eq!(*mark.at(), Some(probe));
    }

    #[test]
    fn a_call_that_reached_the_endpoint_clears_only_a_mark_set_before_it_was_sent() {
        let mark = FailureMark::default();
        let start = Instant::now();
        let (older_call, failure, probe) = (
            start,
            start + Duration::from_millis(10),
            start + Duration::from_millis(20),
        );
        mark.set(failure);
        mark.clear_if_set_by_then(older_call);
        assert!(
            mark.is_fresh(failure),
            "an older call's answer cleared a newer failure"
        );
        mark.clear_if_set_by_then(probe);
        assert!(!mark.is_fresh(probe));
    }

    #[test]
    fn a_timeout_is_told_from_other_transport_errors_down_the_chain() {
        #[derive(Debug)]
        struct Wrapped(Box<dyn StdError + Send + Sync>);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl StdError for Wrapped {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(self.0.as_ref())
            }
        }
        let timeout: Box<dyn StdError + Send + Sync> = tonic::TimeoutExpired(()).into();
        assert!(timed_out(&Wrapped(timeout)));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!timed_out(&Wrapped(Box::new(refused))));
    }
}
