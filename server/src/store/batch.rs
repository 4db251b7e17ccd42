//! Group commit: concurrent calls of one kind share a statement, and so a
//! transaction and a WAL flush. Each call still gets its answer only after
//! the statement holding its row committed.
//!
//! There is no waiting window: a lone call runs at once. When nothing is
//! queued or running, it runs in its caller's own task, with no hand-off to
//! a worker and back ([`Batcher::run`]); so does a caller's unit of calls
//! for distinct records that one statement can hold ([`Batcher::run_all`]).
//! Under load, calls queue while a statement runs, and the next statement takes them all. One
//! statement per kind runs at a time, so that batches grow with the load
//! (a statement's fixed cost, not its rows, is what a batch saves); a second
//! worker starts another only when the running one is slow (a slow disk, a
//! table lock), so one stuck statement does not hold up every call.
//!
//! A statement holds at most [`BatchSettings::max_size`] calls, each record
//! at most once, and no record that a running statement holds. The calls it
//! cannot hold are deferred: they go back to the front of the queue, in the
//! order they came, for whichever worker starts the next statement; a call
//! whose record a running statement holds waits for that one to end, so a
//! record's calls run in the order they came, and see what the ones before
//! did. A caller with several calls queues them as one unit
//! ([`Batcher::run_all`]), which a statement takes whole when they are for
//! distinct records and fit: they share a statement by construction, not
//! because their futures happened to be polled together.
//!
//! What statements need between them (for the store, a connection) is kept
//! while calls keep coming, in [`Kept`]: idle sessions on a stack that
//! batchers may share (the store's Acquire and Complete batchers share one).
//! A statement takes the session used last, and puts it back when it ends:
//! at low load one session (one Postgres backend) serves every statement of
//! every kind, as a hand-written service's one connection would. A session is
//! given back once its last statement ended [`KEEP_IDLE`] ago, or it was
//! kept [`KEEP_AT_MOST`]: both are checked whenever a worker looks for
//! calls, and while it waits (a session that a call put back in its own
//! task wakes a worker that had none to watch).
//!
//! A row that another session holds stalls a statement only briefly: the
//! store's statements wait for it at most `BATCH_ROW_WAIT` (100 ms), then
//! fail for their rows' sake ([`StoreError::concerns_rows`]: that lock wait
//! ran out, a serialization failure or deadlock). Every caller of such a
//! statement then runs its call alone, as a statement of its own that may
//! wait, so that only the calls of the held row wait long, on connections of
//! their own, while the worker takes the next batch. A call whose caller has
//! gone (its reply receiver dropped, e.g. past its deadline) is not run.
//!
//! The parts: callers push onto a [`Queue`], or at rest run their statement
//! themselves ([`Batcher::run`], [`Batcher::run_all`]); each [`Worker`] waits for calls, then for
//! its turn to run a statement ([`Running`]), takes a batch from what is
//! queued then, runs it, and answers each caller. No lock is held across an
//! await.

use std::{
    collections::{HashSet, VecDeque},
    future::Future,
    hash::BuildHasher,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    sync::{Notify, oneshot},
    time::Instant,
};

use super::{StoreError, StoreResult};
use crate::{domain::RecordId, join::join_in_order};

#[cfg(test)]
mod tests;

/// A call that can share a statement with others for different records.
pub trait Batchable: Send + Sync + 'static {
    /// The record it touches; a statement holds each record once.
    fn record(&self) -> &RecordId;
}

/// One kind of call as a batcher runs it: many calls as one statement, on a
/// kept session, or one call alone for its caller.
pub trait Statement: Send + Sync + 'static {
    type Input: Batchable;
    type Output: Send + 'static;
    /// What is kept between statements (for the store, a connection).
    type Session: Send + 'static;

    /// Runs one statement for `inputs`, which are for distinct records, and
    /// answers in the same order. It runs on `session`, a kept one, or when
    /// there is none opens one and leaves it there to be kept.
    /// A row another session holds it waits for only briefly (the store's:
    /// `BATCH_ROW_WAIT`), then fails for its rows' sake
    /// ([`StoreError::concerns_rows`]), and each of its calls runs alone.
    /// After an error the worker gives the session up.
    fn run(
        &self,
        session: &mut Option<Self::Session>,
        inputs: &[Arc<Self::Input>],
    ) -> impl Future<Output = StoreResult<Vec<Self::Output>>> + Send;

    /// Runs a call whose statement failed for its rows' sake, for its
    /// caller: waiting for its row if need be.
    fn run_alone(
        &self,
        input: Arc<Self::Input>,
    ) -> impl Future<Output = StoreResult<Self::Output>> + Send;
}

/// A kept session whose last statement ended this long ago is given back.
pub const KEEP_IDLE: Duration = Duration::from_secs(1);
/// A kept session is given back after this long even while busy, so that
/// the pool's own limits (a connection's lifetime) still apply.
pub const KEEP_AT_MOST: Duration = Duration::from_secs(30);

/// How batches form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// Most statements in flight at once, per kind of call.
    pub workers: usize,
    /// Most calls in one statement.
    pub max_size: usize,
    /// A worker with calls waiting starts a statement while another runs
    /// only once the latest running one has run this long.
    pub overlap_after: Duration,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self {
            workers: 2,
            max_size: 128,
            overlap_after: Duration::from_millis(20),
        }
    }
}

/// A queued call. Its input is shared, not copied: the caller may need it
/// again (to explain a miss, or for the next attempt), and a failed batch
/// re-runs each call alone.
struct Job<I, O> {
    input: Arc<I>,
    /// A hash, not a copy, of its record: a collision only defers a call
    /// to a later statement, which is always correct.
    record: u64,
    reply: oneshot::Sender<Reply<O>>,
}

type JobOf<S> = Job<<S as Statement>::Input, <S as Statement>::Output>;
type QueueOf<S> = Queue<<S as Statement>::Input, <S as Statement>::Output>;

impl<I, O> Job<I, O> {
    /// Whether its caller still waits for the answer.
    fn wanted(&self) -> bool {
        !self.reply.is_closed()
    }
}

/// What came of a call's statement for the call: told by a worker over
/// the call's channel, or handed back to a caller that ran it at rest.
enum Reply<O> {
    Done(StoreResult<O>),
    /// Run the call alone: its statement failed for its rows' sake.
    Alone,
}

impl<O> Reply<O> {
    /// The result of a reply known to be `Done`.
    fn into_done(self) -> StoreResult<O> {
        match self {
            Reply::Done(result) => result,
            Reply::Alone => unreachable!("checked to be done"),
        }
    }
}

/// Queues calls for a few workers that run them in batches.
pub struct Batcher<S: Statement> {
    name: &'static str,
    queue: Arc<QueueOf<S>>,
    statement: Arc<S>,
    /// Shared with the workers, for a statement at rest that runs in its
    /// caller's task.
    running: Arc<Running>,
    kept: Arc<Kept<S::Session>>,
    batch_size: metrics::Histogram,
    /// Most calls in one statement ([`BatchSettings::max_size`]).
    max_size: usize,
}

impl<S: Statement> Batcher<S> {
    /// Starts `settings.workers` workers running `statement`, which keep
    /// their sessions in `kept`: other batchers may share it, or
    /// `Arc::default()` gives them a stack of their own. `name` labels the
    /// metrics.
    pub fn spawn(
        name: &'static str,
        settings: BatchSettings,
        statement: S,
        kept: Arc<Kept<S::Session>>,
    ) -> Self {
        let queue = Arc::new(Queue::default());
        let statement = Arc::new(statement);
        let running = Arc::new(Running::default());
        let batch_size = crate::metrics::kept(
            || metrics::histogram!(crate::metrics::DB_BATCH_SIZE, "query" => name),
        );
        for _ in 0..settings.workers.max(1) {
            let worker = Worker {
                batch_size: batch_size.clone(),
                settings,
                queue: queue.clone(),
                running: running.clone(),
                statement: statement.clone(),
                kept: kept.clone(),
            };
            tokio::spawn(worker.work());
        }
        Self {
            name,
            queue,
            statement,
            running,
            kept,
            batch_size,
            max_size: settings.max_size.max(1),
        }
    }

    /// Runs `input` in the next batch that can hold it, or alone when its
    /// batch fails for its rows' sake, and returns its own answer.
    ///
    /// When the batcher is idle (nothing queued, no statement running) the
    /// call is a statement of its own at once, as a worker would run it,
    /// but in the caller's task: a worker's hand-off (queue, wake, reply
    /// channel, a second task's turn) cost a lone caller about 10 µs of the
    /// server's CPU and 17 µs of latency per pair (docs/performance.md). It
    /// takes the turn and holds its record as a worker's statement does, so
    /// calls that come meanwhile queue behind it and form the next batch;
    /// and like a worker's, its statement runs to its end even when the
    /// caller leaves ([`RunToEnd`]).
    pub async fn run(&self, input: Arc<S::Input>) -> StoreResult<S::Output> {
        let record = self.queue.record_of(&input);
        if let Some(idle) = self.idle_turn(&[record]) {
            let mut results = self.run_in_caller(vec![input], idle).await;
            return results.pop().expect("an answer per call");
        }
        let (job, answer) = self.queue.job(input.clone(), record);
        self.queue.push(vec![job]);
        self.answer(input, answer).await
    }

    /// A turn, and `records` held, when they are distinct, one statement
    /// can hold them, nothing is queued, no statement runs (so no record is
    /// held) and the batcher is open. Claimed under the queue's lock, so a
    /// worker that finds calls after it waits for the turn, and a call for
    /// one of its records waits for the statement. Allocates only when it
    /// claims: under load every call asks, and few find the batcher at rest.
    fn idle_turn(&self, records: &[u64]) -> Option<IdleTurn<S::Input, S::Output>> {
        if records.is_empty() || records.len() > self.max_size {
            return None;
        }
        if records.len() > 1 {
            // A record twice (or two whose hashes collide): the queue's
            // rules put its second call in a later statement.
            let mut distinct = Records::with_capacity_and_hasher(records.len(), Default::default());
            if !records.iter().all(|&record| distinct.insert(record)) {
                return None;
            }
        }
        let mut queued = lock(&self.queue.state);
        if queued.closed || !queued.units.is_empty() {
            return None;
        }
        // At most one statement: only when none runs.
        let turn = self.running.try_claim(Duration::ZERO, 1).ok()?;
        queued.held.extend(records);
        drop(queued);
        Some(IdleTurn {
            _held: HeldRecords {
                queue: self.queue.clone(),
                records: records.to_vec(),
            },
            _turn: turn,
        })
    }

    /// Runs `inputs`, which got an idle turn, as one statement on a kept
    /// session in the caller's task, as a worker would run them (see
    /// [`statement_replies`]); a call whose statement failed for its rows'
    /// sake then runs alone. Answers in input order.
    async fn run_in_caller(
        &self,
        inputs: Vec<Arc<S::Input>>,
        idle: IdleTurn<S::Input, S::Output>,
    ) -> Vec<StoreResult<S::Output>> {
        self.batch_size.record(inputs.len() as f64);
        let (statement, kept) = (self.statement.clone(), self.kept.clone());
        // Whether the caller still waits: a unit's calls that a failed
        // statement re-runs one by one are not run once it left, as a
        // worker skips the calls of callers gone. (One call is never re-run.)
        let (watch, presence) = match inputs.len() {
            1 => (None, None),
            _ => {
                let (watch, presence) = oneshot::channel::<()>();
                (Some(watch), Some(presence))
            }
        };
        // Boxed (in `RunToEnd`): the statement's future is large, and every
        // call's future would carry its size, also the calls that queue
        // (1,000 calls in flight took 37 instead of 21 MiB unboxed).
        let (inputs, replies) = RunToEnd::new(async move {
            // `presence` is dropped with the caller's future.
            let wanted = |_| watch.as_ref().is_none_or(|watch| !watch.is_closed());
            let replies = statement_replies(&*statement, &kept, &inputs, wanted).await;
            // Its records' later calls, and the next statement, may run.
            drop(idle);
            (inputs, replies)
        })
        .await;
        drop(presence);
        if replies.iter().all(|reply| matches!(reply, Reply::Done(_))) {
            return replies.into_iter().map(Reply::into_done).collect();
        }
        let answers = inputs
            .into_iter()
            .zip(replies)
            .map(|(input, reply)| async move {
                match reply {
                    Reply::Done(result) => result,
                    Reply::Alone => self.run_alone(input).await,
                }
            });
        // Boxed: rare, and a call's future stays small without it.
        Box::pin(join_in_order(answers)).await
    }

    /// Runs `inputs` as one unit: in one statement when they are for
    /// distinct records, no more than [`BatchSettings::max_size`], and for
    /// none a running statement holds (else in as few as those rules allow,
    /// in order). Answers in input order. At rest, such a unit runs in the
    /// caller's task, as a lone call does ([`Batcher::run`]).
    pub async fn run_all(&self, inputs: Vec<Arc<S::Input>>) -> Vec<StoreResult<S::Output>> {
        let records: Vec<u64> = inputs
            .iter()
            .map(|input| self.queue.record_of(input))
            .collect();
        if let Some(idle) = self.idle_turn(&records) {
            return self.run_in_caller(inputs, idle).await;
        }
        let (jobs, answers): (Vec<_>, Vec<_>) = inputs
            .iter()
            .zip(records)
            .map(|(input, record)| self.queue.job(input.clone(), record))
            .unzip();
        if !jobs.is_empty() {
            self.queue.push(jobs);
        }
        let answers = inputs
            .into_iter()
            .zip(answers)
            .map(|(input, answer)| self.answer(input, answer));
        join_in_order(answers).await
    }

    async fn answer(
        &self,
        input: Arc<S::Input>,
        answer: oneshot::Receiver<Reply<S::Output>>,
    ) -> StoreResult<S::Output> {
        match answer.await.map_err(|_| stopped())? {
            Reply::Done(result) => result,
            Reply::Alone => self.run_alone(input).await,
        }
    }

    /// Runs a call whose statement failed for its rows' sake alone.
    async fn run_alone(&self, input: Arc<S::Input>) -> StoreResult<S::Output> {
        metrics::counter!(crate::metrics::DB_CALLS_ALONE_TOTAL, "query" => self.name).increment(1);
        // Boxed: rare, and a call's future stays small without it.
        Box::pin(self.statement.run_alone(input)).await
    }
}

impl<S: Statement> Drop for Batcher<S> {
    /// Stops the workers; the sessions they kept go with the last of the
    /// batchers sharing them.
    fn drop(&mut self) {
        self.queue.close();
    }
}

fn stopped() -> StoreError {
    StoreError::Unavailable(Arc::new(sqlx::Error::PoolClosed))
}

/// A `std` lock: held only for a few steps, never across an await. A panic
/// while holding one leaves counts and a queue that are still whole.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Calls waiting for a worker, shared by a batcher's workers: in the order
/// they came, a unit at a time (a call, or the calls of one
/// [`Batcher::run_all`]), with the deferred ones back at the front.
struct Queue<I, O> {
    state: Mutex<Queued<I, O>>,
    /// Wakes a worker waiting for calls.
    arrived: Notify,
    /// Hashes a call's record to the `u64` that stands for it here. Keyed
    /// (seeded per process), and foldhash's stronger variant: records are
    /// the callers' to choose, and two that collide, of any namespaces,
    /// wait for each other's statements.
    hasher: foldhash::quality::RandomState,
}

/// Records by their hash ([`Queue::hasher`]): already spread, so a cheap
/// hasher serves.
type Records = HashSet<u64, foldhash::fast::RandomState>;

struct Queued<I, O> {
    units: VecDeque<Vec<Job<I, O>>>,
    /// The records of the statements running now: their calls wait.
    held: Records,
    /// The batcher was dropped: its workers stop.
    closed: bool,
}

impl<I, O> Default for Queue<I, O> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queued {
                units: VecDeque::new(),
                held: Records::default(),
                closed: false,
            }),
            arrived: Notify::new(),
            hasher: Default::default(),
        }
    }
}

impl<I: Batchable, O> Queue<I, O> {
    /// The hash that stands for `input`'s record here.
    fn record_of(&self, input: &I) -> u64 {
        self.hasher.hash_one(input.record())
    }

    /// A call for `input`, whose record hashes to `record`, and where its
    /// answer comes.
    fn job(&self, input: Arc<I>, record: u64) -> (Job<I, O>, oneshot::Receiver<Reply<O>>) {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            input,
            record,
            reply,
        };
        (job, answer)
    }
}

impl<I, O> Queue<I, O> {
    /// Queues `unit` and wakes the worker that went idle last: at low load
    /// one worker takes every statement, a task that ran a moment ago,
    /// instead of the workers taking turns (the connection it takes is the
    /// one used last in any case, see [`Kept`]). The others still take calls
    /// whenever it is busy.
    fn push(&self, unit: Vec<Job<I, O>>) {
        lock(&self.state).units.push_back(unit);
        self.arrived.notify_last();
    }

    fn close(&self) {
        lock(&self.state).closed = true;
        self.arrived.notify_waiters();
    }

    /// Waits until a queued call can be taken, one whose record no running
    /// statement holds (`true`), or the batcher is dropped (`false`).
    async fn ready(&self) -> bool {
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            // Registered before the check, so a push in between wakes it.
            arrived.as_mut().enable();
            {
                let queued = lock(&self.state);
                if queued.closed {
                    return false;
                }
                if queued.takeable() {
                    return true;
                }
            }
            arrived.await;
        }
    }

    /// The next statement's calls, taken in order: whole units up to the
    /// first that does not fit, of each what the statement can hold. What
    /// it cannot hold is deferred: back to the front of the queue, in
    /// order, and another worker woken for it. The records taken are held
    /// until the returned [`Taken`] is dropped.
    fn take(&self, max_size: usize) -> Taken<'_, I, O> {
        let mut queued = lock(&self.state);
        let Queued { units, held, .. } = &mut *queued;
        let mut batch = Batch::new(max_size, held);
        let mut deferred = Vec::new();
        while let Some(unit) = units.pop_front() {
            if !batch.fits(&unit) {
                units.push_front(unit);
                break;
            }
            let rest = batch.take(unit);
            if !rest.is_empty() {
                deferred.push(rest);
            }
        }
        let jobs = batch.jobs;
        for unit in deferred.into_iter().rev() {
            units.push_front(unit);
        }
        let records: Vec<u64> = jobs.iter().map(|job| job.record).collect();
        held.extend(&records);
        let more = !units.is_empty();
        drop(queued);
        if more {
            self.arrived.notify_last();
        }
        Taken {
            jobs,
            records,
            queue: self,
        }
    }

    /// A statement ended: its records' later calls may be taken, by any
    /// worker.
    fn release(&self, records: &[u64]) {
        let mut queued = lock(&self.state);
        for record in records {
            queued.held.remove(record);
        }
        let waiting = !queued.units.is_empty();
        drop(queued);
        if waiting && !records.is_empty() {
            self.arrived.notify_waiters();
        }
    }
}

impl<I, O> Queued<I, O> {
    /// Whether a worker would take a call now. (A call whose caller left
    /// counts: taking drops it.)
    fn takeable(&self) -> bool {
        self.units
            .iter()
            .flatten()
            .any(|job| !self.held.contains(&job.record))
    }
}

/// The calls of a statement, whose records are held (their later calls
/// wait) until it is dropped, also when its worker's task is.
struct Taken<'q, I, O> {
    jobs: Vec<Job<I, O>>,
    records: Vec<u64>,
    queue: &'q Queue<I, O>,
}

impl<I, O> Drop for Taken<'_, I, O> {
    fn drop(&mut self) {
        self.queue.release(&self.records);
    }
}

/// A claim at rest of a lone call or unit ([`Batcher::run`],
/// [`Batcher::run_all`]): its records are held (released first, as a
/// worker's [`Taken`] are) and its statement counts as running, until
/// dropped.
struct IdleTurn<I, O> {
    _held: HeldRecords<I, O>,
    _turn: Turn,
}

/// The records held by a statement run in its caller's task, until dropped.
struct HeldRecords<I, O> {
    queue: Arc<Queue<I, O>>,
    records: Vec<u64>,
}

impl<I, O> Drop for HeldRecords<I, O> {
    fn drop(&mut self) {
        self.queue.release(&self.records);
    }
}

/// A statement at rest (a lone call's, or a unit's), run in its caller's
/// task. When the caller's future is dropped before it ended (a deadline, a
/// client gone), it runs to its end in a task of its own, as a worker's
/// statement would: its turn, records and session stay held until Postgres
/// is done with it, so a retry of one of its records waits for it, its
/// session is kept, and no more statements run at once than the workers
/// allow.
struct RunToEnd<T: Send + 'static>(Option<Pin<Box<dyn Future<Output = T> + Send>>>);

impl<T: Send + 'static> RunToEnd<T> {
    fn new(statement: impl Future<Output = T> + Send + 'static) -> Self {
        Self(Some(Box::pin(statement)))
    }
}

impl<T: Send + 'static> Future for RunToEnd<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let statement = self.0.as_mut().expect("polled after it ended");
        let output = std::task::ready!(statement.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for RunToEnd<T> {
    fn drop(&mut self) {
        let Some(statement) = self.0.take() else {
            return;
        };
        // Outside a runtime (it is shutting down) the statement is dropped
        // with its guards: its session is closed, as any mid-statement.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(statement);
        }
    }
}

/// The statements of one batcher running now, and when the latest started:
/// the gate that lets a second one start only while the first is slow.
struct Running {
    state: Mutex<RunningState>,
    /// Signalled when a statement ends.
    ended: Notify,
}

struct RunningState {
    statements: usize,
    latest_start: Instant,
}

impl Default for Running {
    fn default() -> Self {
        Self {
            state: Mutex::new(RunningState {
                statements: 0,
                latest_start: Instant::now(),
            }),
            ended: Notify::new(),
        }
    }
}

impl Running {
    /// A turn to run a statement: at once when none runs, else once none
    /// runs or the latest started `overlap_after` ago, whichever comes
    /// first. Claiming is one step under the lock, so two waiting workers
    /// woken by the same end cannot both take the idle turn.
    /// At most `most` statements run at once: one at rest in its caller's
    /// task counts as one of the workers'.
    async fn claim(self: &Arc<Self>, overlap_after: Duration, most: usize) -> Turn {
        loop {
            // Created before the check, so an end between the two is not missed.
            let ended = self.ended.notified();
            match self.try_claim(overlap_after, most) {
                Ok(turn) => return turn,
                Err(Some(overlap_at)) => {
                    let _ = tokio::time::timeout_at(overlap_at, ended).await;
                }
                Err(None) => ended.await,
            }
        }
    }

    /// A turn now, or the time from which one may overlap the running ones
    /// (`None`: once one ends, `most` run). (A turn that then finds no calls
    /// counts as a start too: it only delays the next overlap.)
    fn try_claim(
        self: &Arc<Self>,
        overlap_after: Duration,
        most: usize,
    ) -> Result<Turn, Option<Instant>> {
        let mut state = lock(&self.state);
        let now = Instant::now();
        let overlap_at = state.latest_start + overlap_after;
        if state.statements >= most {
            return Err(None);
        }
        if state.statements > 0 && now < overlap_at {
            return Err(Some(overlap_at));
        }
        state.statements += 1;
        state.latest_start = now;
        Ok(Turn(self.clone()))
    }
}

/// Counts a statement as running until dropped.
struct Turn(Arc<Running>);

impl Drop for Turn {
    fn drop(&mut self) {
        lock(&self.0.state).statements -= 1;
        self.0.ended.notify_waiters();
    }
}

/// Sessions kept between statements: the idle ones, the one used last on
/// top. A statement takes one and puts it back when it succeeded, so at
/// most one per worker exists (a statement at rest in its caller's task
/// counts as one of theirs: [`Running::claim`]).
/// Sessions that are due (see [`Kept::expire`]) are given back: dropped,
/// outside the lock.
pub struct Kept<S> {
    idle: Mutex<Vec<KeptSession<S>>>,
    /// A worker found no session to watch (`expire` gave `None`): the next
    /// session put on the empty stack wakes the workers (`put_back`), which
    /// a call in its own task does not come back to watch as a worker does.
    unwatched: AtomicBool,
    put_back: Notify,
}

/// An idle session, since when it was opened, and when its last statement
/// ended.
struct KeptSession<S> {
    session: S,
    opened: Instant,
    used: Instant,
}

impl<S> KeptSession<S> {
    /// When it is to be given back: [`KEEP_IDLE`] after its last statement
    /// ended, or [`KEEP_AT_MOST`] after it was opened, whichever comes first.
    fn due(&self) -> Instant {
        (self.used + KEEP_IDLE).min(self.opened + KEEP_AT_MOST)
    }
}

impl<S> Default for Kept<S> {
    fn default() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            unwatched: AtomicBool::new(false),
            put_back: Notify::new(),
        }
    }
}

impl<S> Kept<S> {
    /// The idle session used last that is not due, and when it was opened;
    /// `None`: the statement opens one (from now). Due ones on top of it are
    /// given back.
    fn take(&self) -> Option<(S, Instant)> {
        let now = Instant::now();
        let mut due = Vec::new();
        let taken = {
            let mut idle = lock(&self.idle);
            loop {
                match idle.pop() {
                    Some(kept) if kept.due() <= now => due.push(kept),
                    taken => break taken,
                }
            }
        };
        drop(due); // Outside the lock: a connection goes back to its pool.
        taken.map(|kept| (kept.session, kept.opened))
    }

    /// `session`, opened at `opened`, after a statement that just ended.
    fn put(&self, session: S, opened: Instant) {
        let was_empty = {
            let mut idle = lock(&self.idle);
            let was_empty = idle.is_empty();
            idle.push(KeptSession {
                session,
                opened,
                used: Instant::now(),
            });
            was_empty
        };
        if was_empty && self.unwatched.swap(false, Ordering::AcqRel) {
            self.put_back.notify_waiters();
        }
    }

    /// Gives back the idle sessions that are due, and tells when the next
    /// one will be (`None`: none is idle).
    fn expire(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut idle = lock(&self.idle);
        let due: Vec<_> = idle.extract_if(.., |kept| kept.due() <= now).collect();
        let next = idle.iter().map(KeptSession::due).min();
        if next.is_none() {
            self.unwatched.store(true, Ordering::Release);
        }
        drop(idle);
        drop(due); // Outside the lock: a connection goes back to its pool.
        next
    }
}

/// The calls of the next statement, as they are taken: at most `max_size`,
/// each record at most once, none that a running statement holds.
struct Batch<'q, I, O> {
    jobs: Vec<Job<I, O>>,
    /// The records the batch holds or deferred a call of: a record's later
    /// calls are deferred too, so that they keep their order.
    records: Records,
    /// The records of the statements running now.
    held: &'q Records,
    max_size: usize,
}

impl<'q, I, O> Batch<'q, I, O> {
    fn new(max_size: usize, held: &'q Records) -> Self {
        Self {
            jobs: Vec::with_capacity(max_size),
            records: Records::default(),
            held,
            max_size,
        }
    }

    /// Whether a call for `record` could join: no call of it is here yet,
    /// and no running statement holds it.
    fn is_new(&self, record: u64) -> bool {
        !self.records.contains(&record) && !self.held.contains(&record)
    }

    /// Whether to take from `unit` at all: an empty batch takes from any
    /// unit; one with calls already takes a unit only when all of its
    /// records fit, so that a unit's calls share a statement when they can.
    fn fits(&self, unit: &[Job<I, O>]) -> bool {
        let room = self.max_size - self.jobs.len();
        if self.jobs.is_empty() || unit.len() <= room {
            return true;
        }
        let mut new = Records::default();
        let new_records = unit
            .iter()
            .filter(|job| job.wanted() && self.is_new(job.record))
            .filter(|job| new.insert(job.record))
            .count();
        new_records <= room
    }

    /// Takes what it can of `unit` and hands back the rest, deferred, in
    /// order. A call for a record already here, or held by a running
    /// statement, waits for a later statement, so that it sees what the one
    /// before did. A call whose caller left is dropped.
    fn take(&mut self, unit: Vec<Job<I, O>>) -> Vec<Job<I, O>> {
        let mut rest = Vec::new();
        for job in unit.into_iter().filter(Job::wanted) {
            let new_record = !self.held.contains(&job.record) && self.records.insert(job.record);
            if new_record && self.jobs.len() < self.max_size {
                self.jobs.push(job);
            } else {
                self.records.insert(job.record);
                rest.push(job);
            }
        }
        rest
    }
}

/// One of a batcher's workers: it runs one statement at a time, each on the
/// kept session used last (or one it opens), which it puts back after.
struct Worker<S: Statement> {
    /// Calls per statement (`idempotency_db_batch_size`).
    batch_size: metrics::Histogram,
    settings: BatchSettings,
    /// Shared by the batcher's workers, like `running`.
    queue: Arc<QueueOf<S>>,
    running: Arc<Running>,
    statement: Arc<S>,
    kept: Arc<Kept<S::Session>>,
}

impl<S: Statement> Worker<S> {
    async fn work(mut self) {
        let queue = self.queue.clone();
        while self.wait_for_calls().await {
            let _turn = self
                .running
                .claim(self.settings.overlap_after, self.settings.workers.max(1))
                .await;
            let mut taken = queue.take(self.settings.max_size.max(1));
            if taken.jobs.is_empty() {
                continue; // Another worker took them, or their callers left.
            }
            self.batch_size.record(taken.jobs.len() as f64);
            self.run_batch(std::mem::take(&mut taken.jobs)).await;
            // `taken` drops here: its records' later calls may run.
        }
        // The batcher was dropped: the kept sessions go with the last worker
        // sharing them.
    }

    /// Waits for calls it can take. Sessions kept too long, or idle since
    /// their last statement, are given back first, and while it waits: a
    /// worker comes here after every batch, so the one that put a session
    /// back last waits with a timer for it (and for those under it). `false`:
    /// the batcher was dropped.
    async fn wait_for_calls(&mut self) -> bool {
        loop {
            // Registered before the check, so a session put back in between
            // wakes it.
            let put_back = self.kept.put_back.notified();
            tokio::pin!(put_back);
            put_back.as_mut().enable();
            let Some(due) = self.kept.expire() else {
                tokio::select! {
                    open = self.queue.ready() => return open,
                    () = put_back => continue,
                }
            };
            if let Ok(open) = tokio::time::timeout_at(due, self.queue.ready()).await {
                return open;
            }
        }
    }

    /// Runs `jobs` as one statement and answers each caller.
    async fn run_batch(&mut self, jobs: Vec<JobOf<S>>) {
        let (inputs, replies): (Vec<_>, Vec<_>) =
            jobs.into_iter().map(|job| (job.input, job.reply)).unzip();
        let answers = statement_replies(&*self.statement, &self.kept, &inputs, |call| {
            !replies[call].is_closed()
        })
        .await;
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
    }
}

/// Runs `inputs` as one statement on a kept session and tells each call
/// what came of it, in input order. After a failure that may be one call's
/// fault, each call still `wanted` runs again as a statement of its own.
async fn statement_replies<S: Statement>(
    statement: &S,
    kept: &Kept<S::Session>,
    inputs: &[Arc<S::Input>],
    wanted: impl Fn(usize) -> bool,
) -> Vec<Reply<S::Output>> {
    let all = |reply: &dyn Fn() -> Reply<S::Output>| inputs.iter().map(|_| reply()).collect();
    match run_on_kept(statement, kept, inputs).await {
        Ok(outputs) if outputs.len() == inputs.len() => outputs
            .into_iter()
            .map(|output| Reply::Done(Ok(output)))
            .collect(),
        Ok(outputs) => {
            let error = StoreError::Corrupt(format!(
                "a statement of {} calls answered {} results",
                inputs.len(),
                outputs.len()
            ));
            all(&|| Reply::Done(Err(error.clone())))
        }
        // Not the database's health: one call's row may be to blame. Run
        // each alone so the error stays with the rows it concerns.
        Err(StoreError::Internal(_)) if inputs.len() > 1 => {
            run_each(statement, kept, inputs, wanted).await
        }
        // A row some call waits for, held by another session: each caller
        // runs its call alone, so only the calls of that row wait, on
        // connections of their own, and the next batch can start.
        Err(error) if error.concerns_rows() => all(&|| Reply::Alone),
        Err(error) => all(&|| Reply::Done(Err(error.clone()))),
    }
}

/// Runs each call still `wanted` as a statement of its own, on kept
/// sessions, after a statement for all of them failed. One no longer
/// wanted is told the batcher stopped (nobody hears it).
async fn run_each<S: Statement>(
    statement: &S,
    kept: &Kept<S::Session>,
    inputs: &[Arc<S::Input>],
    wanted: impl Fn(usize) -> bool,
) -> Vec<Reply<S::Output>> {
    let mut replies = Vec::with_capacity(inputs.len());
    for (call, input) in inputs.iter().enumerate() {
        if !wanted(call) {
            replies.push(Reply::Done(Err(stopped())));
            continue;
        }
        let result = run_on_kept(statement, kept, std::slice::from_ref(input))
            .await
            .and_then(|mut outputs| {
                outputs
                    .pop()
                    .ok_or_else(|| StoreError::Corrupt("no result".into()))
            });
        replies.push(match result {
            Err(error) if error.concerns_rows() => Reply::Alone,
            result => Reply::Done(result),
        });
    }
    replies
}

/// Runs one statement on the session used last, or on one it opens, and
/// keeps the session for the next. After an error the session is given
/// back (the store's pool checks a connection before anyone uses it
/// again); so it is when the caller's future is dropped mid-statement.
async fn run_on_kept<S: Statement>(
    statement: &S,
    kept: &Kept<S::Session>,
    inputs: &[Arc<S::Input>],
) -> StoreResult<Vec<S::Output>> {
    let (mut session, opened) = match kept.take() {
        Some((session, opened)) => (Some(session), opened),
        None => (None, Instant::now()),
    };
    let result = statement.run(&mut session, inputs).await;
    if result.is_ok()
        && let Some(session) = session
    {
        kept.put(session, opened);
    }
    result
}
