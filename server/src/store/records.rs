//! The hot path's calls: Acquire's insert-or-read and takeover, and
//! Complete / terminal Fail. The first and the last take any number of
//! calls at once, so concurrent calls share one statement and one commit
//! (see [`batch`](super::batch)); their SQL is in [`statements`].

use std::sync::Arc;

use super::{
    AcquiredRow, Connection, Db, RecordRow, Store, StoreError, StoreResult,
    batch::{BatchSettings, Batchable, Batcher, Kept, Statement},
    replay_share::ReplayShare,
    statements::{self, RowWait},
};
use crate::{
    domain::{FencingToken, Fingerprint, RecordId, RecordState, StoredResponse, Timestamp},
    join::join_in_order,
    metrics::query,
};

/// One Acquire as the store sees it.
#[derive(Debug)]
pub struct AcquireInput {
    pub id: RecordId,
    pub fingerprint: Fingerprint,
    pub ttl: std::time::Duration,
    pub lease: std::time::Duration,
}

impl Batchable for AcquireInput {
    fn record(&self) -> &RecordId {
        &self.id
    }
}

/// What the insert-or-read statement found for one Acquire.
#[derive(Debug)]
pub enum AcquireAttempt {
    /// This statement created the record: the caller holds it with a new token.
    Inserted(AcquiredRow),
    /// The record exists, as read by the same statement.
    Existing(RecordRow),
    /// Another statement created the record after this one's snapshot was
    /// taken, so it was neither inserted nor seen: ask again.
    Raced,
}

/// One Complete or terminal Fail as the store sees it.
#[derive(Debug)]
pub struct FinishInput {
    pub id: RecordId,
    pub fencing_token: FencingToken,
    /// `Completed` or `Failed`.
    pub state: RecordState,
    pub response: StoredResponse,
}

impl Batchable for FinishInput {
    fn record(&self) -> &RecordId {
        &self.id
    }
}

impl Store {
    /// Creates the record, or reads it when it exists. One round trip, and
    /// no write at all when the record exists (a replay, a duplicate): only
    /// a new key costs a commit.
    pub async fn insert_or_read(&self, input: Arc<AcquireInput>) -> StoreResult<AcquireAttempt> {
        match &self.batchers {
            Some(batchers) => batchers.acquire.run(input).await,
            // Boxed: without batching the hot path is a statement per call
            // anyway, and the batched path's futures stay small.
            None => Box::pin(insert_or_read_alone(&self.db, &self.replays, input)).await,
        }
    }

    /// [`insert_or_read`](Self::insert_or_read) for each input, answered in
    /// input order. With batching, the inputs share one statement when they
    /// are for distinct records and no more than a batch holds.
    pub async fn insert_or_read_all(
        &self,
        inputs: Vec<Arc<AcquireInput>>,
    ) -> Vec<StoreResult<AcquireAttempt>> {
        match &self.batchers {
            Some(batchers) => batchers.acquire.run_all(inputs).await,
            None => {
                let each = inputs
                    .into_iter()
                    .map(|input| Box::pin(insert_or_read_alone(&self.db, &self.replays, input)));
                join_in_order(each).await
            }
        }
    }

    /// Moves the live in-progress record held with `fencing_token` to
    /// `completed` or `failed` with its response. `None`: no such record.
    pub async fn finish(&self, input: Arc<FinishInput>) -> StoreResult<Option<Timestamp>> {
        match &self.batchers {
            Some(batchers) => batchers.finish.run(input).await,
            None => Box::pin(finish_alone(&self.db, input)).await,
        }
    }

    /// [`finish`](Self::finish) for each input, answered in input order.
    /// With batching, the inputs share one statement when they are for
    /// distinct records and no more than a batch holds.
    pub async fn finish_all(
        &self,
        inputs: Vec<Arc<FinishInput>>,
    ) -> Vec<StoreResult<Option<Timestamp>>> {
        match &self.batchers {
            Some(batchers) => batchers.finish.run_all(inputs).await,
            None => {
                let each = inputs
                    .into_iter()
                    .map(|input| Box::pin(finish_alone(&self.db, input)));
                join_in_order(each).await
            }
        }
    }

    /// Takes over a record that expired, was released, or whose lease passed
    /// (when the fingerprints agree). `None`: it is no longer takeable.
    pub async fn take_over(&self, input: &AcquireInput) -> StoreResult<Option<AcquiredRow>> {
        let _timer = query::TAKE_OVER.timer();
        let mut connection = self.db.connection().await?;
        statements::take_over(&mut connection, input).await
    }
}

/// One insert-or-read on a connection of its own, that may wait for its row.
async fn insert_or_read_alone(
    db: &Db,
    replays: &ReplayShare,
    input: Arc<AcquireInput>,
) -> StoreResult<AcquireAttempt> {
    let _timer = query::ACQUIRE.timer();
    let mut connection = db.connection().await?;
    let attempts =
        statements::insert_or_read(&mut connection, &[input], RowWait::Full, replays).await?;
    single(attempts)
}

/// One finish on a connection of its own, that may wait for its row.
async fn finish_alone(db: &Db, input: Arc<FinishInput>) -> StoreResult<Option<Timestamp>> {
    let _timer = query::FINISH.timer();
    let mut connection = db.connection().await?;
    let finished = statements::finish(&mut connection, &[input], RowWait::Full).await?;
    single(finished)
}

fn single<T>(mut answers: Vec<T>) -> StoreResult<T> {
    answers
        .pop()
        .ok_or_else(|| StoreError::Corrupt("a statement answered no result".into()))
}

/// The batchers of Acquire and of Complete / terminal Fail.
pub(super) struct Batchers {
    acquire: Batcher<Acquires>,
    finish: Batcher<Finishes>,
}

impl Batchers {
    /// The two share their kept connections: at low load an Acquire and
    /// the Complete after it run on the same connection, and so the same
    /// Postgres backend, as a hand-written service's would (two backends
    /// taking turns, each idle while the other runs, cost about 20 µs more
    /// per pair at one caller, `docs/performance.md`).
    pub(super) fn spawn(db: &Db, settings: BatchSettings, replays: Arc<ReplayShare>) -> Self {
        let kept = Arc::new(Kept::default());
        let acquires = Acquires {
            db: db.clone(),
            replays,
        };
        Self {
            acquire: Batcher::spawn("acquire", settings, acquires, kept.clone()),
            finish: Batcher::spawn("finish", settings, Finishes(db.clone()), kept),
        }
    }
}

impl BatchSettings {
    /// Connections the batch workers may keep at once: one per worker, for
    /// Acquire and for Complete.
    pub fn kept_connections(&self) -> usize {
        2 * self.workers.max(1)
    }
}

/// Acquire's insert-or-read, for its batcher. Its statements wait for a
/// held row only [`statements::BATCH_ROW_WAIT`]; the time they take counts the wait for
/// a connection too, as every statement's does.
struct Acquires {
    db: Db,
    /// What lone calls found lately, the store's (see [`ReplayShare`]).
    replays: Arc<ReplayShare>,
}

impl Statement for Acquires {
    type Input = AcquireInput;
    type Output = AcquireAttempt;
    type Session = Connection;

    async fn run(
        &self,
        kept: &mut Option<Connection>,
        inputs: &[Arc<AcquireInput>],
    ) -> StoreResult<Vec<AcquireAttempt>> {
        let _timer = query::ACQUIRE.timer();
        let connection = self.db.kept(kept).await?;
        statements::insert_or_read(connection, inputs, RowWait::Brief, &self.replays).await
    }

    async fn run_alone(&self, input: Arc<AcquireInput>) -> StoreResult<AcquireAttempt> {
        insert_or_read_alone(&self.db, &self.replays, input).await
    }
}

/// Complete and terminal Fail, for their batcher (see [`Acquires`]).
struct Finishes(Db);

impl Statement for Finishes {
    type Input = FinishInput;
    type Output = Option<Timestamp>;
    type Session = Connection;

    async fn run(
        &self,
        kept: &mut Option<Connection>,
        inputs: &[Arc<FinishInput>],
    ) -> StoreResult<Vec<Option<Timestamp>>> {
        let _timer = query::FINISH.timer();
        let connection = self.0.kept(kept).await?;
        statements::finish(connection, inputs, RowWait::Brief).await
    }

    async fn run_alone(&self, input: Arc<FinishInput>) -> StoreResult<Option<Timestamp>> {
        finish_alone(&self.0, input).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::postgres::PgPoolOptions;

    use super::*;
    use crate::domain::StoredResponse;

    /// Every call in flight holds its store future, also while it queues
    /// for a batch: 1,000 calls in flight took 37 instead of 21 MiB when the
    /// statement a lone call runs in its own task was part of it, unboxed
    /// (`make bench`'s memory part; in a debug build 4.8 KB against 0.5 KB
    /// boxed). The statements' futures are boxed.
    #[tokio::test]
    async fn a_call_queued_for_a_batch_holds_a_small_future() {
        const MOST_BYTES: usize = 1024;
        let pool = PgPoolOptions::new()
            .connect_lazy("postgres://idem@127.0.0.1:1/idem")
            .unwrap();
        let store = Store::with_batching(pool, BatchSettings::default());
        let id = RecordId::parse(
            "id",
            "ns".into(),
            "POST /x".into(),
            "user".into(),
            "key-0001".into(),
        )
        .unwrap();

        let acquire = store.insert_or_read(Arc::new(AcquireInput {
            id: id.clone(),
            fingerprint: Fingerprint::parse("fingerprint", vec![1; 32]).unwrap(),
            ttl: Duration::from_secs(60),
            lease: Duration::from_secs(60),
        }));
        let finish = store.finish(Arc::new(FinishInput {
            id,
            fencing_token: 1,
            state: RecordState::Completed,
            response: StoredResponse::default(),
        }));

        let sizes = [size_of_val(&acquire), size_of_val(&finish)];
        assert!(sizes.iter().all(|&size| size <= MOST_BYTES), "{sizes:?}");
    }
}
