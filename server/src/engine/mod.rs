//! The rules: acquire, complete, fail, renew, get; leases and fencing.
//! [`rules`] holds the decisions as pure functions with their tests; this
//! file is the shell that runs the statements around them, and [`batch`]
//! runs a batch RPC's items together.
//!
//! Requests arrive parsed and within the [`Limits`]: the grpc layer checks
//! them and names the fields. The store runs one guarded statement per
//! call; when it matches no row, the engine reads the record and explains
//! why, in this order: absent or expired (not found), stale token
//! (aborted), then the record's state.

mod batch;
mod rules;

use std::{sync::Arc, time::Duration, time::Instant};

use self::rules::{
    Decision, Miss, acquired, decide, finish_miss, lease_times, release_miss, renew_miss,
    still_fresh,
};
use crate::{
    domain::{
        AcquireOutcome, FencingToken, Fingerprint, Limits, Record, RecordId, RecordState,
        StoredResponse, Timestamp,
    },
    error::Error,
    replay_cache::ReplayCache,
    store::{
        AcquireAttempt, AcquireInput, AcquiredRow, FinishInput, RecordRow, Store, StoreResult,
    },
};

/// How often a guarded statement is run when the record changed between
/// the statement and the read that explains it (cleanup, a lease passing).
/// Each retry needs another such change inside one round trip.
const ATTEMPTS: usize = 3;

/// What Acquire asks for, parsed and within the limits.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub id: RecordId,
    pub fingerprint: Fingerprint,
    pub ttl: Duration,
    pub lease: Duration,
}

/// What Complete asks for, parsed and within the limits.
#[derive(Debug, Clone)]
pub struct CompleteRequest {
    pub id: RecordId,
    pub fencing_token: FencingToken,
    pub response: StoredResponse,
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

/// An Acquire's answer before it is sent: a record the caller holds keeps
/// its row, so that a batch can renew the lease before replying.
enum Answer {
    Held(Held),
    Outcome(AcquireOutcome),
}

impl Answer {
    fn into_outcome(self) -> AcquireOutcome {
        match self {
            Self::Held(held) => acquired(held.row),
            Self::Outcome(outcome) => outcome,
        }
    }
}

/// A record this caller holds: its row, and when the statement that last
/// wrote its lease (the insert, the takeover, or a renewal) was sent. A
/// lease is counted from there, so it is renewed only once half of it
/// passed since that write, however many times it is looked at.
struct Held {
    row: AcquiredRow,
    written: Instant,
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

    /// The server's policy on lifetimes and sizes, which the grpc layer
    /// checks requests against before they reach the engine.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub async fn acquire(&self, request: AcquireRequest) -> Result<AcquireOutcome, Error> {
        if let Some(outcome) = self.replayed(&request.id, &request.fingerprint) {
            return Ok(outcome);
        }
        let input = Arc::new(acquire_input(request));
        // One round trip: a new key is created, an existing one read.
        let sent = Instant::now();
        let found = self.store.insert_or_read(input.clone()).await;
        Ok(self.settle(&input, found, sent).await?.into_outcome())
    }

    /// Decides on what an Acquire's statement found and acts on it, running
    /// the statement again while the record changes under it.
    async fn settle(
        &self,
        input: &Arc<AcquireInput>,
        found: StoreResult<AcquireAttempt>,
        sent: Instant,
    ) -> Result<Answer, Error> {
        let mut first = Some((found, sent));
        for _ in 0..ATTEMPTS {
            let (found, sent) = match first.take() {
                Some(first) => first,
                None => {
                    let sent = Instant::now();
                    // Rare: boxed (see `act`).
                    let found = Box::pin(self.store.insert_or_read(input.clone())).await;
                    (found, sent)
                }
            };
            if let Some(answer) = self.act(input, found?, sent).await? {
                return Ok(answer);
            }
        }
        Err(settle_failure("acquire"))
    }

    /// `None`: the record changed under this attempt; ask again.
    async fn act(
        &self,
        input: &AcquireInput,
        found: AcquireAttempt,
        sent: Instant,
    ) -> Result<Option<Answer>, Error> {
        let row = match found {
            AcquireAttempt::Inserted(row) => {
                let held = Held { row, written: sent };
                return Ok(self.hold(input, held).await?.map(Answer::Held));
            }
            AcquireAttempt::Raced => return Ok(None),
            AcquireAttempt::Existing(row) => row,
        };
        match decide(&row, &input.fingerprint)? {
            Decision::Answer(outcome) => Ok(Some(Answer::Outcome(
                self.remember(&input.id, &row, sent, outcome),
            ))),
            Decision::TakeOver => {
                // A second round trip, rare. Boxed, like every rare
                // statement here: a future holds room for each of its
                // awaits, and the common path's futures are moved about per
                // item of every batch RPC.
                let sent = Instant::now();
                let Some(row) = Box::pin(self.store.take_over(input)).await? else {
                    // Someone else took it over, or it changed: look again.
                    return Ok(None);
                };
                let held = Held { row, written: sent };
                Ok(self.hold(input, held).await?.map(Answer::Held))
            }
        }
    }

    /// Holds a record a statement wrote for this caller: as written while
    /// its lease is fresh (see [`still_fresh`]: under half of it passed since
    /// the last write), else renewed under the token just written, and then
    /// written again. `None`: that token no longer holds the record (the
    /// lease passed and another caller took the key over).
    async fn hold(&self, input: &AcquireInput, held: Held) -> Result<Option<Held>, Error> {
        let Held { mut row, written } = held;
        let took = written.elapsed();
        if still_fresh(input.lease, took) {
            return Ok(Some(Held { row, written }));
        }
        tracing::warn!(
            key = %input.id.key(),
            took_ms = took.as_millis() as u64,
            lease_ms = input.lease.as_millis() as u64,
            "half an Acquire's lease or more passed since the statement that wrote it \
             was sent; renewing before answering"
        );
        let sent = Instant::now();
        let renewed = Box::pin(
            self.store
                .renew(&input.id, row.fencing_token(), input.lease),
        )
        .await?;
        Ok(renewed.map(|(lease_expires_at, expires_at)| {
            row.lease_expires_at = lease_expires_at;
            row.expires_at = expires_at;
            Held { row, written: sent }
        }))
    }

    pub async fn complete(&self, request: CompleteRequest) -> Result<Timestamp, Error> {
        let input = Arc::new(finish_input(request, RecordState::Completed));
        let found = self.store.finish(input.clone()).await;
        self.finished(&input, found).await
    }

    pub async fn fail(
        &self,
        id: RecordId,
        fencing_token: FencingToken,
        failure: Failure,
    ) -> Result<RecordState, Error> {
        match failure {
            Failure::Terminal(response) => {
                let request = CompleteRequest {
                    id,
                    fencing_token,
                    response,
                };
                let input = Arc::new(finish_input(request, RecordState::Failed));
                let found = self.store.finish(input.clone()).await;
                self.finished(&input, found).await?;
                Ok(RecordState::Failed)
            }
            Failure::Retryable => self.release(&id, fencing_token).await,
        }
    }

    /// A Complete's or terminal Fail's answer, from what its statement
    /// returned: a miss is explained (see [`rules::finish_miss`]), and the
    /// statement run again while the record changes under it.
    async fn finished(
        &self,
        input: &Arc<FinishInput>,
        found: StoreResult<Option<Timestamp>>,
    ) -> Result<Timestamp, Error> {
        let mut first = Some(found);
        for _ in 0..ATTEMPTS {
            let found = match first.take() {
                Some(found) => found,
                None => Box::pin(self.store.finish(input.clone())).await,
            };
            if let Some(at) = found? {
                return Ok(at);
            }
            // Rare: boxed (see `act`).
            let row = Box::pin(self.store.read(&input.id)).await?;
            if let Miss::Answer(at) = finish_miss(row.as_ref(), input)? {
                return Ok(at); // A retry of the same call.
            }
        }
        Err(settle_failure("finish"))
    }

    async fn release(
        &self,
        id: &RecordId,
        fencing_token: FencingToken,
    ) -> Result<RecordState, Error> {
        for _ in 0..ATTEMPTS {
            if self.store.release(id, fencing_token).await? {
                return Ok(RecordState::Released);
            }
            let row = self.store.read(id).await?;
            if let Miss::Answer(state) = release_miss(row.as_ref(), fencing_token)? {
                return Ok(state);
            }
        }
        Err(settle_failure("release"))
    }

    /// Extends the lease held with `fencing_token` by `lease` (within the limits).
    pub async fn renew(
        &self,
        id: &RecordId,
        fencing_token: FencingToken,
        lease: Duration,
    ) -> Result<LeaseTimes, Error> {
        for _ in 0..ATTEMPTS {
            if let Some(times) = self.store.renew(id, fencing_token, lease).await? {
                return Ok(lease_times(times));
            }
            let row = self.store.read(id).await?;
            if let Miss::Answer(times) = renew_miss(row.as_ref(), fencing_token)? {
                return Ok(times);
            }
        }
        Err(settle_failure("renew"))
    }

    pub async fn get(&self, id: &RecordId) -> Result<Record, Error> {
        let row = self.store.read(id).await?;
        rules::record(id, row.as_ref())
    }

    /// A finished record's outcome from the replay cache, if it holds one.
    fn replayed(&self, id: &RecordId, fingerprint: &Fingerprint) -> Option<AcquireOutcome> {
        self.replays
            .as_ref()
            .and_then(|cache| cache.lookup(id, fingerprint))
    }

    /// Keeps a finished record's outcome for later Acquires, and returns it.
    fn remember(
        &self,
        id: &RecordId,
        row: &RecordRow,
        sent: Instant,
        outcome: AcquireOutcome,
    ) -> AcquireOutcome {
        let finished = matches!(
            outcome,
            AcquireOutcome::Completed { .. } | AcquireOutcome::Failed { .. }
        );
        if let Some(cache) = self.replays.as_ref().filter(|_| finished) {
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

fn acquire_input(request: AcquireRequest) -> AcquireInput {
    let AcquireRequest {
        id,
        fingerprint,
        ttl,
        lease,
    } = request;
    AcquireInput {
        id,
        fingerprint,
        ttl,
        lease,
    }
}

/// `state`: `Completed` or `Failed`.
fn finish_input(request: CompleteRequest, state: RecordState) -> FinishInput {
    let CompleteRequest {
        id,
        fencing_token,
        response,
    } = request;
    FinishInput {
        id,
        fencing_token,
        state,
        response,
    }
}

/// The record kept changing under us: a retry will settle it.
fn settle_failure(what: &'static str) -> Error {
    Error::Contention(what)
}
