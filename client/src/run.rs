//! The one-call API: acquire, run the business logic once, store its
//! outcome, and answer duplicates with the stored response.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant},
};

use crate::{AcquireRequest, Acquisition, Client, Error, Lease, RecordId, StoredResponse};

/// What to do with a business error: give the key back, or store the error for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Transient (a timeout downstream, a 5xx): release the key so a retry runs again.
    Retryable,
    /// Final (card declined, validation): store this response; retries get it back.
    Terminal(StoredResponse),
}

/// What to do when the idempotency service itself cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnUnavailable {
    /// Refuse: the caller gets [`RunError::Service`] to map to 503. The default.
    #[default]
    FailClosed,
    /// Run the business logic without idempotency (counted in
    /// `idempotency_client_fail_open_total` and logged). For operations
    /// where a rare duplicate is harmless: likes, notifications. Only when
    /// the service is unreachable ([`Error::is_unavailable`]): when it
    /// answers [`Error::Unauthenticated`] or [`Error::PermissionDenied`],
    /// the caller gets [`RunError::Service`], whatever this policy.
    FailOpen,
}

/// How [`Client::run`] behaves.
pub struct RunOptions<E> {
    on_unavailable: OnUnavailable,
    wait_in_progress: Option<Duration>,
    keep_alive: Option<(Duration, Duration)>,
    classify: Arc<dyn Fn(&E) -> Failure + Send + Sync>,
}

impl<E> Clone for RunOptions<E> {
    fn clone(&self) -> Self {
        Self {
            on_unavailable: self.on_unavailable,
            wait_in_progress: self.wait_in_progress,
            keep_alive: self.keep_alive,
            classify: self.classify.clone(),
        }
    }
}

impl<E> fmt::Debug for RunOptions<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunOptions")
            .field("on_unavailable", &self.on_unavailable)
            .field("wait_in_progress", &self.wait_in_progress)
            .field("keep_alive", &self.keep_alive)
            .finish_non_exhaustive()
    }
}

impl<E> Default for RunOptions<E> {
    /// Fail closed, answer "in progress" at once, no background renewal, and
    /// every business error releases the key.
    fn default() -> Self {
        Self::new(|_| Failure::Retryable)
    }
}

impl<E> RunOptions<E> {
    /// Options whose `classify` decides, per business error, whether to
    /// release the key or store the error.
    pub fn new(classify: impl Fn(&E) -> Failure + Send + Sync + 'static) -> Self {
        Self {
            on_unavailable: OnUnavailable::FailClosed,
            wait_in_progress: None,
            keep_alive: None,
            classify: Arc::new(classify),
        }
    }

    /// Fail open or closed when the service cannot be reached.
    pub fn on_unavailable(mut self, policy: OnUnavailable) -> Self {
        self.on_unavailable = policy;
        self
    }

    /// While another attempt is in progress, wait (honouring its
    /// `retry_after`) up to `deadline` for its outcome instead of returning at once.
    pub fn wait_in_progress(mut self, deadline: Duration) -> Self {
        self.wait_in_progress = Some(deadline);
        self
    }

    /// Renew the lease to `lease` every `every` (at most a third of `lease`)
    /// while the logic runs; see [`crate::Lease::keep_alive`].
    pub fn keep_alive(mut self, every: Duration, lease: Duration) -> Self {
        self.keep_alive = Some((every, lease));
        self
    }
}

/// What the business logic is told about its attempt.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The fencing token to pass to storage that checks it; `None` when
    /// running without idempotency (fail open).
    pub fencing_token: Option<u64>,
    /// Turns true when background renewal learns the lease was taken over.
    pub lease_lost: Arc<AtomicBool>,
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ran {
    /// The logic ran now and its response is stored.
    Executed(StoredResponse),
    /// An earlier attempt's stored response; the logic did not run.
    Replayed(StoredResponse),
    /// The service was unreachable and the options fail open: the logic ran unprotected.
    Unprotected(StoredResponse),
}

impl Ran {
    /// The response to answer with, however it was obtained.
    pub fn response(&self) -> &StoredResponse {
        match self {
            Ran::Executed(response) | Ran::Replayed(response) | Ran::Unprotected(response) => {
                response
            }
        }
    }

    /// The response, owned.
    pub fn into_response(self) -> StoredResponse {
        match self {
            Ran::Executed(response) | Ran::Replayed(response) | Ran::Unprotected(response) => {
                response
            }
        }
    }
}

/// Why [`Client::run`] did not produce a response.
#[derive(Debug, thiserror::Error)]
pub enum RunError<E> {
    /// The business logic failed now; the key was released or the error stored, as classified.
    #[error("the operation failed")]
    Business(E),
    /// An earlier attempt failed terminally: answer with its stored error.
    #[error("an earlier attempt failed (status {})", .0.status_code)]
    PreviouslyFailed(StoredResponse),
    /// Another attempt is running (HTTP 409 with Retry-After).
    #[error("another attempt is in progress; retry after {retry_after:?}")]
    InProgress {
        /// When to retry.
        retry_after: Duration,
    },
    /// The key was used with another request (HTTP 422).
    #[error("the idempotency key was used with a different request")]
    FingerprintMismatch,
    /// The logic ran, but another attempt took the key over before its
    /// response was stored: the logic may have run twice.
    #[error("the lease was lost before the response was stored; the operation may have run twice")]
    LeaseLost {
        /// What this attempt produced.
        response: StoredResponse,
    },
    /// The logic ran, but its response could not be stored. When the service
    /// refused the response itself (too large, a status code out of range),
    /// a terminal failure is stored in its place (status 500, see
    /// [`UNSTORABLE_RESPONSE`]), so that retries get
    /// [`RunError::PreviouslyFailed`] instead of running the logic again once
    /// the lease passes. Otherwise (the service unreachable) the key stays in
    /// progress until its lease passes.
    #[error("the operation ran but its response could not be stored")]
    NotStored {
        /// What this attempt produced.
        response: StoredResponse,
        /// Why storing failed.
        #[source]
        error: Error,
    },
    /// The service refused or could not be reached (fail closed).
    #[error(transparent)]
    Service(Error),
}

impl Client {
    /// Runs `work` at most once per key: acquires, runs it on `Proceed`, stores
    /// its response (or its error, as `options` classify it), and answers a
    /// duplicate with the stored response without running `work`.
    ///
    /// A panic in `work`, or dropping this future while `work` runs, releases
    /// the key (best effort) so that a retry can run instead of waiting for
    /// the lease. Once `work` returned, the key is never released: its
    /// effects happened. Dropped while Acquire itself is in flight, the key
    /// may stay in progress until its lease passes (nothing is known to release).
    pub async fn run<E, F, Fut>(
        &self,
        request: &AcquireRequest,
        options: &RunOptions<E>,
        work: F,
    ) -> Result<Ran, RunError<E>>
    where
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<StoredResponse, E>>,
    {
        let acquisition = match self
            .acquire_waiting(request, options.wait_in_progress)
            .await
        {
            Ok(acquisition) => acquisition,
            Err(error)
                if error.is_unavailable() && options.on_unavailable == OnUnavailable::FailOpen =>
            {
                note_fail_open(&request.id, &error);
                return run_unprotected(work).await;
            }
            Err(error) => return Err(RunError::Service(error)),
        };
        let mut lease = match lease_or_answer(acquisition) {
            Ok(lease) => lease,
            Err(answer) => return answer,
        };
        if let Some((every, duration)) = options.keep_alive {
            lease.keep_alive(every, duration);
        }
        let attempt = Attempt {
            fencing_token: Some(lease.fencing_token()),
            lease_lost: lease.lost_flag(),
        };
        // A panic unwinds through here and drops `lease`, which releases the key.
        match work(attempt).await {
            Ok(response) => store_response(&mut lease, response).await,
            Err(business) => {
                store_failure(&mut lease, options, &business).await;
                Err(RunError::Business(business))
            }
        }
    }

    /// Acquires; while another attempt is in progress and `wait` allows,
    /// sleeps for its `retry_after` (with jitter) and asks again.
    pub async fn acquire_waiting(
        &self,
        request: &AcquireRequest,
        wait: Option<Duration>,
    ) -> Result<Acquisition, Error> {
        let deadline = wait.map(|wait| Instant::now() + wait);
        loop {
            let acquisition = self.acquire(request).await?;
            let Acquisition::InProgress { retry_after, .. } = &acquisition else {
                return Ok(acquisition);
            };
            // Jitter of +-20 % keeps waiting duplicates from arriving together.
            let pause = (*retry_after)
                .max(Duration::from_millis(10))
                .mul_f64(0.8 + 0.4 * fastrand::f64());
            match deadline {
                Some(deadline) if Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await
                }
                _ => return Ok(acquisition),
            }
        }
    }
}

/// Runs `work` without a lease (fail open).
async fn run_unprotected<E, F, Fut>(work: F) -> Result<Ran, RunError<E>>
where
    F: FnOnce(Attempt) -> Fut,
    Fut: Future<Output = Result<StoredResponse, E>>,
{
    let attempt = Attempt {
        fencing_token: None,
        lease_lost: Arc::default(),
    };
    work(attempt)
        .await
        .map(Ran::Unprotected)
        .map_err(RunError::Business)
}

/// The lease to run the business logic with, or the answer to give without
/// running it.
fn lease_or_answer<E>(acquisition: Acquisition) -> Result<Lease, Result<Ran, RunError<E>>> {
    match acquisition {
        Acquisition::Proceed(lease) => Ok(lease),
        Acquisition::InProgress { retry_after, .. } => {
            Err(Err(RunError::InProgress { retry_after }))
        }
        Acquisition::Replay(response) => Err(Ok(Ran::Replayed(response))),
        Acquisition::Failed(response) => Err(Err(RunError::PreviouslyFailed(response))),
        Acquisition::FingerprintMismatch => Err(Err(RunError::FingerprintMismatch)),
    }
}

/// Completes the lease with the business logic's response.
async fn store_response<E>(
    lease: &mut Lease,
    response: StoredResponse,
) -> Result<Ran, RunError<E>> {
    match lease.complete(&response).await {
        Ok(()) => Ok(Ran::Executed(response)),
        Err(Error::LeaseLost) => Err(RunError::LeaseLost { response }),
        Err(error) => {
            if error.is_refusal() {
                fail_unstorable(lease, &error).await;
            }
            Err(RunError::NotStored { response, error })
        }
    }
}

/// Releases the key, or stores the business error for replay, as `options`
/// classify it.
async fn store_failure<E>(lease: &mut Lease, options: &RunOptions<E>, business: &E) {
    let stored = match (options.classify)(business) {
        Failure::Retryable => lease.release().await,
        Failure::Terminal(error_response) => lease.fail(&error_response).await,
    };
    if let Err(error) = stored {
        tracing::warn!(%error, key = %lease.id().key, "could not record the failure");
    }
}

/// Counts and logs a call that runs without idempotency because the service
/// is unreachable (fail open).
pub(crate) fn note_fail_open(id: &RecordId, error: &Error) {
    metrics::counter!("idempotency_client_fail_open_total", "namespace" => id.namespace.clone())
        .increment(1);
    tracing::warn!(%error, namespace = %id.namespace, operation = %id.operation,
        "idempotency service unavailable: running without idempotency (fail open)");
}

/// The body of the terminal failure stored when the service refuses a
/// response that `run`'s logic produced (see [`RunError::NotStored`]).
pub const UNSTORABLE_RESPONSE: &str =
    "the operation ran, but the idempotency service refused to store its response";

/// Stores a terminal failure in place of a response the service refused, so
/// that a retry after the lease passes does not run the logic again.
async fn fail_unstorable(lease: &mut Lease, refusal: &Error) {
    tracing::error!(%refusal, key = %lease.id().key,
        "the service refused the response: storing a failure so retries do not run again");
    let failure = StoredResponse::new(500, UNSTORABLE_RESPONSE);
    if let Err(error) = lease.fail(&failure).await {
        tracing::warn!(%error, key = %lease.id().key, "could not store the failure either");
    }
}
