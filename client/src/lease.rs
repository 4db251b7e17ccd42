//! The outcome of Acquire, and the lease an attempt holds.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use tokio::task::JoinHandle;

use crate::{
    Client, Error, RecordId, StoredResponse,
    trace::{TraceContext, within},
    types::time_from_pb,
};

/// Longest a lease is kept alive by [`Lease::keep_alive`].
pub const MAX_KEEP_ALIVE: Duration = Duration::from_secs(60 * 60);

/// What Acquire answered.
#[derive(Debug)]
#[must_use = "an Acquisition says whether to run the business logic"]
pub enum Acquisition {
    /// You hold the key: run the business logic, then complete or fail the lease.
    Proceed(Lease),
    /// Another attempt holds a live lease: answer "in progress, retry later".
    InProgress {
        /// When to retry (the remaining lease, at most a second).
        retry_after: Duration,
        /// When the other attempt's lease ends, unless renewed.
        lease_expires_at: SystemTime,
    },
    /// A previous attempt completed: answer with its response.
    Replay(StoredResponse),
    /// A previous attempt failed terminally: answer with its error.
    Failed(StoredResponse),
    /// The key was first used with another request: a client bug (HTTP 422).
    FingerprintMismatch,
}

/// The right to run the business logic for one key, identified by a fencing
/// token. Pass the token along to storage that can check it, so that a
/// holder whose lease was taken over cannot write.
///
/// Dropping a lease that was neither completed nor failed releases the key
/// (a retryable Fail, best effort, on the current Tokio runtime), so a
/// panic or a cancelled request does not wedge the key until its lease ends.
#[derive(Debug)]
pub struct Lease {
    client: Client,
    id: RecordId,
    fencing_token: u64,
    lease_expires_at: SystemTime,
    expires_at: SystemTime,
    finished: bool,
    keep_alive: Option<JoinHandle<()>>,
    lost: Arc<AtomicBool>,
    /// The trace context its Acquire ran in ([`crate::trace::scope`]): its
    /// later calls, background ones included, join the same trace.
    trace: Option<TraceContext>,
}

impl Lease {
    pub(crate) fn new(
        client: Client,
        id: RecordId,
        fencing_token: u64,
        (lease_expires_at, expires_at): (SystemTime, SystemTime),
        trace: Option<TraceContext>,
    ) -> Self {
        Self {
            client,
            id,
            fencing_token,
            lease_expires_at,
            expires_at,
            finished: false,
            keep_alive: None,
            lost: Arc::default(),
            trace,
        }
    }

    /// The record this lease is on.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// This attempt's token: later attempts on the key get larger ones.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// When the lease ends, as of the last Acquire or [`Lease::renew`].
    pub fn lease_expires_at(&self) -> SystemTime {
        self.lease_expires_at
    }

    /// When the record expires.
    pub fn expires_at(&self) -> SystemTime {
        self.expires_at
    }

    /// True once the background renewal learnt that another attempt took the key over.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// A flag that turns true when the lease is known lost; share it with the business logic.
    pub fn lost_flag(&self) -> Arc<AtomicBool> {
        self.lost.clone()
    }

    /// Extends the lease to `lease` from now.
    pub async fn renew(&mut self, lease: Duration) -> Result<(), Error> {
        let renewal = self.client.renew(&self.id, self.fencing_token, lease);
        let renewed = self.note_loss(within(self.trace, renewal).await)?;
        self.lease_expires_at = time_from_pb(renewed.lease_expires_at);
        self.expires_at = time_from_pb(renewed.expires_at);
        Ok(())
    }

    /// Renews the lease to `lease` every `every` in the background until the
    /// lease is completed, failed or dropped, for at most an hour
    /// (so a hung operation cannot hold its key forever). `every` is clamped
    /// to at most a third of `lease` (zero means a third), so one or two
    /// missed renewals do not lose it.
    /// The first renewal comes within a third of what is left of the lease held
    /// now, which may be shorter than `lease` (this machine's clock against the
    /// database's: a skew under two thirds of that is harmless).
    /// Renewal stops, and [`Lease::is_lost`] turns true, when the service
    /// answers that the lease is gone or refuses the renewal outright, or
    /// when renewals kept failing until the lease passed; any other error
    /// (unreachable, internal) is retried at the next tick.
    pub fn keep_alive(&mut self, every: Duration, lease: Duration) {
        self.stop_keep_alive();
        let third = lease / 3;
        let every = if every.is_zero() {
            third
        } else {
            every.min(third)
        }
        .max(Duration::from_millis(10));
        let held = self
            .lease_expires_at
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        let first = every.min(held / 3);
        let client = self.client.clone();
        let id = self.id.clone();
        let token = self.fencing_token;
        let lost = self.lost.clone();
        let trace = self.trace;
        self.keep_alive = Some(tokio::spawn(within(trace, async move {
            let started = tokio::time::Instant::now();
            // When the lease ends by this machine's monotonic clock: from the
            // clock skew only until the first renewal, then from the time
            // each successful renewal was sent.
            let mut held_until = started + held;
            let mut ticker = tokio::time::interval_at(started + first, every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                if started.elapsed() > MAX_KEEP_ALIVE {
                    tracing::warn!(key = %id.key, "stopped renewing a lease held longer than {MAX_KEEP_ALIVE:?}");
                    return;
                }
                let sent = tokio::time::Instant::now();
                match client.renew(&id, token, lease).await {
                    Ok(_) => held_until = sent + lease,
                    Err(error) if renewal_cannot_succeed(&error) => {
                        tracing::warn!(key = %id.key, %error, "lease lost while renewing");
                        lost.store(true, Ordering::Relaxed);
                        return;
                    }
                    // Past the lease (this machine's clock), another attempt
                    // may hold the key: the logic must hear of it.
                    Err(error) if tokio::time::Instant::now() >= held_until => {
                        tracing::warn!(key = %id.key, %error, "lease passed while renewals failed");
                        lost.store(true, Ordering::Relaxed);
                        return;
                    }
                    // The next tick tries again while the lease lasts.
                    Err(error) if error.is_unavailable() => {
                        tracing::debug!(%error, "renewal failed; retrying");
                    }
                    Err(error) => {
                        tracing::warn!(key = %id.key, %error, "renewal failed; retrying");
                    }
                }
            }
        })));
    }

    /// Stores the response; later Acquires replay it. [`Error::LeaseLost`]
    /// means another attempt took over: the business logic may have run twice.
    ///
    /// From the first call on, the lease is never released on drop: the work
    /// is done, and running it again on a retry would be worse than letting
    /// the lease pass. Call again to retry after an error.
    pub async fn complete(&mut self, response: &StoredResponse) -> Result<(), Error> {
        self.finishing();
        let completion = self.client.complete(&self.id, self.fencing_token, response);
        let result = within(self.trace, completion).await;
        self.note_loss(result)
    }

    /// Fails terminally, storing `error_response`; later Acquires get it as
    /// [`Acquisition::Failed`]. Never released on drop afterwards.
    pub async fn fail(&mut self, error_response: &StoredResponse) -> Result<(), Error> {
        self.finishing();
        let failure = self
            .client
            .fail(&self.id, self.fencing_token, Some(error_response));
        let result = within(self.trace, failure).await;
        self.note_loss(result)
    }

    /// Releases the key (a retryable failure): the next Acquire takes it over.
    pub async fn release(&mut self) -> Result<(), Error> {
        self.finishing();
        let release = self.client.fail(&self.id, self.fencing_token, None);
        let result = within(self.trace, release).await;
        self.note_loss(result)
    }

    /// The attempt is ending: stop renewing, and do not release on drop.
    fn finishing(&mut self) {
        self.finished = true;
        self.stop_keep_alive();
    }

    fn note_loss<T>(&self, result: Result<T, Error>) -> Result<T, Error> {
        if matches!(result, Err(Error::LeaseLost)) {
            self.lost.store(true, Ordering::Relaxed);
        }
        result
    }

    fn stop_keep_alive(&mut self) {
        if let Some(task) = self.keep_alive.take() {
            task.abort();
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_keep_alive();
        if self.finished {
            return;
        }
        // Cannot await in drop: hand the release to the runtime, if there is one.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        let id = self.id.clone();
        let token = self.fencing_token;
        tracing::debug!(key = %id.key, token, "releasing an abandoned lease");
        runtime.spawn(within(self.trace, async move {
            if let Err(error) = client.fail(&id, token, None).await {
                tracing::warn!(key = %id.key, %error, "could not release an abandoned lease");
            }
        }));
    }
}

/// Whether a renewal's error means the lease is gone for good: another
/// attempt holds the key, the record is finished or gone, or the request
/// itself is refused. Anything else (the service unreachable, one internal
/// error) may pass, and renewing stops only when the lease is known lost.
fn renewal_cannot_succeed(error: &Error) -> bool {
    matches!(
        error,
        Error::LeaseLost
            | Error::NotInProgress
            | Error::NotFound
            | Error::ResponseConflict
            | Error::InvalidArgument { .. }
            | Error::Config(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_gives_up_only_when_the_lease_is_known_lost() {
        let unavailable = Error::Unavailable {
            attempts: 3,
            message: "connection refused".into(),
        };
        let internal = Error::Internal("deadlock detected".into());
        let cancelled = Error::Unexpected(Box::new(tonic::Status::cancelled("cancelled")));
        for error in [unavailable, internal, cancelled] {
            assert!(!renewal_cannot_succeed(&error), "{error}");
        }
        let refused = Error::InvalidArgument {
            field: Some("lease".into()),
            message: "must lie in [1s, 1h]".into(),
        };
        for error in [
            Error::LeaseLost,
            Error::NotInProgress,
            Error::NotFound,
            refused,
        ] {
            assert!(renewal_cannot_succeed(&error), "{error}");
        }
    }
}
