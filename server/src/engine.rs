//! The rules: acquire, complete, fail, renew, get; leases and fencing.
//! The store runs one guarded statement per call; when it matches no row,
//! the engine reads the record and explains why, in this order: absent or
//! expired (not found), stale token (aborted), then the record's state.

use std::{sync::Arc, time::Duration};

use crate::{
    domain::{
        AcquireOutcome, FencingToken, Fingerprint, Limits, Record, RecordId, RecordState,
        StoredResponse, Timestamp, ValidateResponse,
    },
    error::Error,
    replay_cache::ReplayCache,
    store::{AcquireAttempt, AcquireInput, AcquiredRow, FinishInput, RecordRow, Store, StoreError},
};

/// Longest `retry_after` hint: most attempts finish long before their lease ends.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How often a guarded statement is re-run when the record changed between
/// the statement and the read that explains it (cleanup, a lease passing).
/// Each retry needs another such change inside one round trip.
const ATTEMPTS: usize = 3;

/// What Acquire asks for, already parsed.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub id: RecordId,
    pub fingerprint: Fingerprint,
    pub ttl: Option<Duration>,
    pub lease: Option<Duration>,
}

/// How an attempt ends without success.
#[derive(Debug, Clone)]
pub enum Failure {
    /// Give the key back for another attempt.
    Retryable,
    /// Store this error response for replay.
    Terminal(StoredResponse),
}

/// The lease after a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTimes {
    pub lease_expires_at: Timestamp,
    pub expires_at: Timestamp,
}

#[derive(Debug, Clone)]
pub struct Engine {
    store: Store,
    limits: Limits,
    replays: Option<ReplayCache>,
}

impl Engine {
    pub fn new(store: Store, limits: Limits) -> Self {
        Self {
            store,
            limits,
            replays: None,
        }
    }

    /// Answers Acquires of finished records from memory when it can.
    pub fn with_replay_cache(mut self, cache: ReplayCache) -> Self {
        self.replays = Some(cache);
        self
    }

    /// The server's policy on lifetimes and sizes.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub async fn acquire(&self, request: AcquireRequest) -> Result<AcquireOutcome, Error> {
        let ttl = self.limits.ttl("ttl", request.ttl)?;
        let lease = self.limits.lease("lease", request.lease)?;
        let AcquireRequest {
            id, fingerprint, ..
        } = request;
        if let Some(outcome) = self
            .replays
            .as_ref()
            .and_then(|cache| cache.lookup(&id, &fingerprint))
        {
            return Ok(outcome);
        }
        let input = Arc::new(AcquireInput {
            id,
            fingerprint,
            ttl,
            lease,
        });
        for _ in 0..ATTEMPTS {
            // One round trip: a new key is created, an existing one read.
            let sent = std::time::Instant::now();
            let row = match self.store.insert_or_read(input.clone()).await? {
                AcquireAttempt::Inserted(row) if still_fresh(&input, sent) => {
                    return Ok(acquired(row));
                }
                AcquireAttempt::Inserted(row) => {
                    match Box::pin(self.renewed(&input, row, sent)).await? {
                        Some(row) => return Ok(acquired(row)),
                        // The lease passed and another caller took the key over.
                        None => continue,
                    }
                }
                AcquireAttempt::Existing(row) => row,
                AcquireAttempt::Raced => continue,
            };
            // An expired record acts as absent, whatever its fingerprint.
            if !row.is_expired() {
                // The fingerprint wins over every state.
                if row.fingerprint().conflicts_with(&input.fingerprint) {
                    return Ok(AcquireOutcome::FingerprintMismatch);
                }
                match row.state()? {
                    RecordState::InProgress if row.lease_is_live() => {
                        return Ok(in_progress(&row));
                    }
                    RecordState::Completed => {
                        let outcome = AcquireOutcome::Completed {
                            response: stored_response(&row)?,
                            completed_at: finished_at(&row)?,
                        };
                        return Ok(self.remember(&input.id, &row, sent, outcome));
                    }
                    RecordState::Failed => {
                        let outcome = AcquireOutcome::Failed {
                            error_response: stored_response(&row)?,
                            failed_at: finished_at(&row)?,
                        };
                        return Ok(self.remember(&input.id, &row, sent, outcome));
                    }
                    // The lease passed or the key was released: take it over below.
                    RecordState::InProgress | RecordState::Released => {}
                }
            }
            // Expired, released, or a lapsed lease: a second round trip, rare.
            // Boxed, like every rare statement here: a future holds room for
            // each of its awaits, and the common path's futures are moved
            // about per item of every batch RPC.
            let sent = std::time::Instant::now();
            if let Some(row) = Box::pin(self.store.take_over(&input)).await? {
                if still_fresh(&input, sent) {
                    return Ok(acquired(row));
                }
                if let Some(row) = Box::pin(self.renewed(&input, row, sent)).await? {
                    return Ok(acquired(row));
                }
            }
            // Someone else took it over, or it changed: look again.
        }
        Err(settle_failure("acquire"))
    }

    /// Renews a lease that a slow statement wrote (see [`still_fresh`]) under
    /// the token just written; `None` when that token no longer holds the record.
    async fn renewed(
        &self,
        input: &AcquireInput,
        mut row: AcquiredRow,
        sent: std::time::Instant,
    ) -> Result<Option<AcquiredRow>, Error> {
        let took = sent.elapsed();
        tracing::warn!(
            key = %input.id.key(),
            took_ms = took.as_millis() as u64,
            lease_ms = input.lease.as_millis() as u64,
            "an Acquire's statement took half its lease or more; renewing before answering"
        );
        let renewed = Box::pin(
            self.store
                .renew(&input.id, row.fencing_token(), input.lease),
        )
        .await?;
        Ok(renewed.map(|(lease_expires_at, expires_at)| {
            row.lease_expires_at = lease_expires_at;
            row.expires_at = expires_at;
            row
        }))
    }

    pub async fn complete(
        &self,
        id: RecordId,
        fencing_token: FencingToken,
        response: StoredResponse,
    ) -> Result<Timestamp, Error> {
        response.validate("response", &self.limits)?;
        self.finish(id, fencing_token, RecordState::Completed, response)
            .await
    }

    pub async fn fail(
        &self,
        id: RecordId,
        fencing_token: FencingToken,
        failure: Failure,
    ) -> Result<RecordState, Error> {
        match failure {
            Failure::Terminal(error_response) => {
                error_response.validate("error_response", &self.limits)?;
                self.finish(id, fencing_token, RecordState::Failed, error_response)
                    .await?;
                Ok(RecordState::Failed)
            }
            Failure::Retryable => {
                for _ in 0..ATTEMPTS {
                    if self.store.release(&id, fencing_token).await? {
                        return Ok(RecordState::Released);
                    }
                    let row = self.current_holder(&id, fencing_token).await?;
                    match row.state()? {
                        // A repeated release.
                        RecordState::Released => return Ok(RecordState::Released),
                        state @ (RecordState::Completed | RecordState::Failed) => {
                            return Err(Error::NotInProgress {
                                state: state.as_str(),
                            });
                        }
                        RecordState::InProgress => continue,
                    }
                }
                Err(settle_failure("release"))
            }
        }
    }

    pub async fn renew(
        &self,
        id: &RecordId,
        fencing_token: FencingToken,
        lease: Option<Duration>,
    ) -> Result<LeaseTimes, Error> {
        let lease = self.limits.lease("lease", lease)?;
        for _ in 0..ATTEMPTS {
            if let Some((lease_expires_at, expires_at)) =
                self.store.renew(id, fencing_token, lease).await?
            {
                return Ok(LeaseTimes {
                    lease_expires_at,
                    expires_at,
                });
            }
            let row = self.current_holder(id, fencing_token).await?;
            match row.state()? {
                RecordState::InProgress => continue,
                state => {
                    return Err(Error::NotInProgress {
                        state: state.as_str(),
                    });
                }
            }
        }
        Err(settle_failure("renew"))
    }

    pub async fn get(&self, id: &RecordId) -> Result<Record, Error> {
        let row = self
            .store
            .read(id)
            .await?
            .filter(|row| !row.is_expired())
            .ok_or(Error::NotFound)?;
        let state = row.state()?;
        Ok(Record {
            id: id.clone(),
            state,
            fingerprint: row.fingerprint(),
            fencing_token: row.fencing_token(),
            created_at: row.created_at,
            expires_at: row.expires_at,
            lease_expires_at: row.lease_expires_at,
            completed_at: row.completed_at,
            response: row.response()?,
        })
    }

    /// Completes or terminally fails; a repeat with the identical response is OK.
    async fn finish(
        &self,
        id: RecordId,
        fencing_token: FencingToken,
        target: RecordState,
        response: StoredResponse,
    ) -> Result<Timestamp, Error> {
        let input = Arc::new(FinishInput {
            id,
            fencing_token,
            state: target,
            response,
        });
        for _ in 0..ATTEMPTS {
            if let Some(at) = self.store.finish(input.clone()).await? {
                return Ok(at);
            }
            // Rare: boxed (see `acquire`).
            let row = Box::pin(self.current_holder(&input.id, fencing_token)).await?;
            let state = row.state()?;
            match state {
                RecordState::InProgress => continue,
                RecordState::Released => {
                    return Err(Error::NotInProgress {
                        state: state.as_str(),
                    });
                }
                RecordState::Completed | RecordState::Failed => {
                    if state == target && row.response()?.as_ref() == Some(&input.response) {
                        return finished_at(&row); // A retry of the same call.
                    }
                    return Err(Error::ResponseConflict {
                        state: state.as_str(),
                    });
                }
            }
        }
        Err(settle_failure("finish"))
    }

    /// Reads the live record and checks that `fencing_token` is its current one.
    async fn current_holder(
        &self,
        id: &RecordId,
        fencing_token: FencingToken,
    ) -> Result<RecordRow, Error> {
        let row = self
            .store
            .read(id)
            .await?
            .filter(|row| !row.is_expired())
            .ok_or(Error::NotFound)?;
        if row.fencing_token() != fencing_token {
            return Err(Error::StaleToken {
                given: fencing_token,
                current: row.fencing_token(),
            });
        }
        Ok(row)
    }
}

/// A lease a statement wrote is counted from the statement's start. One that
/// took long (a batched insert waits for any of its keys another transaction
/// is writing; a commit can stall) may answer with a lease that has passed,
/// or nearly, and the key is then free to take over while this caller runs.
/// Fresh while under half the lease has gone since the statement was sent.
fn still_fresh(input: &AcquireInput, sent: std::time::Instant) -> bool {
    sent.elapsed() < input.lease / 2
}

fn acquired(row: AcquiredRow) -> AcquireOutcome {
    AcquireOutcome::Acquired {
        fencing_token: row.fencing_token(),
        lease_expires_at: row.lease_expires_at,
        expires_at: row.expires_at,
        takeover: row.took_over_lapsed_lease(),
    }
}

fn in_progress(row: &RecordRow) -> AcquireOutcome {
    let lease_expires_at = row.lease_expires_at.unwrap_or(row.db_now);
    let remaining = (lease_expires_at - row.db_now).to_std().unwrap_or_default();
    AcquireOutcome::InProgress {
        lease_expires_at,
        retry_after: remaining.min(MAX_RETRY_AFTER),
    }
}

impl Engine {
    /// Keeps a finished record's outcome for later Acquires, and returns it.
    fn remember(
        &self,
        id: &RecordId,
        row: &RecordRow,
        sent: std::time::Instant,
        outcome: AcquireOutcome,
    ) -> AcquireOutcome {
        if let Some(cache) = &self.replays {
            cache.remember(
                id,
                row.fingerprint(),
                &outcome,
                (row.db_now, sent),
                row.expires_at,
            );
        }
        outcome
    }
}

fn stored_response(row: &RecordRow) -> Result<StoredResponse, Error> {
    row.response()?
        .ok_or_else(|| StoreError::Corrupt("finished record without a response".into()).into())
}

fn finished_at(row: &RecordRow) -> Result<Timestamp, Error> {
    row.completed_at
        .ok_or_else(|| StoreError::Corrupt("finished record without completed_at".into()).into())
}

/// The record kept changing under us: a retry will settle it.
fn settle_failure(what: &'static str) -> Error {
    Error::Contention(what)
}
