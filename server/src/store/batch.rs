//! Group commit: concurrent calls of one kind share a statement, and so a
//! transaction and a WAL flush. Each call still gets its answer only after
//! the statement holding its row committed.
//!
//! There is no waiting window: a lone call runs at once. Under load, calls
//! queue while a statement runs, and the next statement takes them all. One
//! statement per kind runs at a time, so that batches grow with the load
//! (a statement's fixed cost, not its rows, is what a batch saves); a second
//! worker starts another only when the running one is slow (a slow disk, a
//! table lock), so one stuck statement does not hold up every call.
//!
//! A statement holds at most [`BatchSettings::max_size`] calls and each
//! record at most once; the calls it cannot hold go to the worker's next
//! statement, in the order they came. A caller with several calls queues
//! them as one unit ([`Batcher::run_all`]), which a statement takes whole
//! when they are for distinct records and fit: they share a statement by
//! construction, not because their futures happened to be polled together.
//!
//! A worker keeps what its statements need between them (for the store, a
//! connection) while calls keep coming, and gives it back once it has
//! waited [`KEEP_IDLE`] for calls or kept it [`KEEP_AT_MOST`].
//!
//! A worker never waits on a row that another session holds: its statement
//! passes such a call over ([`Part::Alone`]), or fails as a whole for its
//! rows' sake ([`StoreError::concerns_rows`]: a short lock wait ran out, a
//! serialization failure or deadlock). Either way the caller then runs its
//! own call alone, as a statement of its own that may wait, while the other
//! calls of the batch are answered at once (or run again alone too, when the
//! whole statement failed). A call whose caller has gone (its reply
//! receiver dropped, e.g. past its deadline) is not run.
//!
//! The parts: callers push onto a [`Queue`]; each [`Worker`] waits for
//! calls, then for its turn to run a statement ([`Running`]), takes a batch
//! from what is queued then, runs it, and answers each caller. No lock is
//! held across an await.

use std::{
    collections::{HashSet, VecDeque},
    future::Future,
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use futures_util::future::join_all;
use tokio::{
    sync::{Notify, oneshot},
    time::Instant,
};

use super::{StoreError, StoreResult};
use crate::domain::RecordId;

#[cfg(test)]
mod tests;

/// A call that can share a statement with others for different records.
pub trait Batchable: Send + Sync + 'static {
    /// The record it touches; a statement holds each record once.
    fn record(&self) -> &RecordId;
}

/// One call's share of a batch statement's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part<O> {
    /// The statement did the call's work: here is its answer.
    Done(O),
    /// The statement passed the call over (its row was held by another
    /// session): its caller runs it alone.
    Alone,
}

/// One kind of call as a batcher runs it: many calls as one statement, on a
/// session a worker keeps, or one call alone for its caller.
pub trait Statement: Send + Sync + 'static {
    type Input: Batchable;
    type Output: Send + 'static;
    /// What a worker keeps between its statements (for the store, a
    /// connection).
    type Session: Send + 'static;

    /// Runs one statement for `inputs` and answers in the same order. It
    /// runs on `session`, the worker's kept one, or when there is none opens
    /// one and leaves it there to be kept. It must not wait for rows other
    /// sessions hold. After an error the worker gives the session up.
    fn run(
        &self,
        session: &mut Option<Self::Session>,
        inputs: &[Arc<Self::Input>],
    ) -> impl Future<Output = StoreResult<Vec<Part<Self::Output>>>> + Send;

    /// Runs a call that a statement passed over, or whose statement failed
    /// for its rows' sake, for its caller: waiting for its row if need be.
    fn run_alone(
        &self,
        input: Arc<Self::Input>,
    ) -> impl Future<Output = StoreResult<Self::Output>> + Send;
}

/// A worker that waited this long for calls gives its session back.
pub const KEEP_IDLE: Duration = Duration::from_secs(1);
/// A worker gives its session back after this long even while busy, so that
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
            max_size: 64,
            overlap_after: Duration::from_millis(20),
        }
    }
}

/// A queued call. Its input is shared, not copied: the caller may need it
/// again (to explain a miss, or for the next attempt), and a failed batch
/// re-runs each call alone.
struct Job<I, O> {
    input: Arc<I>,
    reply: oneshot::Sender<Reply<O>>,
}

type JobOf<S> = Job<<S as Statement>::Input, <S as Statement>::Output>;

impl<I, O> Job<I, O> {
    fn new(input: Arc<I>) -> (Self, oneshot::Receiver<Reply<O>>) {
        let (reply, answer) = oneshot::channel();
        (Self { input, reply }, answer)
    }

    /// Whether its caller still waits for the answer.
    fn wanted(&self) -> bool {
        !self.reply.is_closed()
    }
}

/// What a worker tells a caller.
enum Reply<O> {
    Done(StoreResult<O>),
    /// Run the call alone (see [`Part::Alone`]).
    Alone,
}

impl<O> From<Part<O>> for Reply<O> {
    fn from(part: Part<O>) -> Self {
        match part {
            Part::Done(output) => Self::Done(Ok(output)),
            Part::Alone => Self::Alone,
        }
    }
}

/// Queues calls for a few workers that run them in batches.
pub struct Batcher<S: Statement> {
    name: &'static str,
    queue: Arc<Queue<JobOf<S>>>,
    statement: Arc<S>,
}

impl<S: Statement> Batcher<S> {
    /// Starts `settings.workers` workers running `statement`. `name` labels
    /// the metrics.
    pub fn spawn(name: &'static str, settings: BatchSettings, statement: S) -> Self {
        let queue = Arc::new(Queue::default());
        let statement = Arc::new(statement);
        let running = Arc::new(Running::default());
        for _ in 0..settings.workers.max(1) {
            let worker = Worker {
                name,
                settings,
                queue: queue.clone(),
                running: running.clone(),
                statement: statement.clone(),
                deferred: VecDeque::new(),
                kept: Kept::default(),
                hasher: RandomState::new(),
            };
            tokio::spawn(worker.work());
        }
        Self {
            name,
            queue,
            statement,
        }
    }

    /// Runs `input` in the next batch, or alone when the batch cannot do it
    /// without waiting, and returns its own answer.
    pub async fn run(&self, input: Arc<S::Input>) -> StoreResult<S::Output> {
        let (job, answer) = Job::new(input.clone());
        self.queue.push(vec![job]);
        self.answer(input, answer).await
    }

    /// Runs `inputs` as one unit: in one statement when they are for
    /// distinct records and no more than [`BatchSettings::max_size`] (else
    /// in as few as those rules allow, in order). Answers in input order.
    pub async fn run_all(&self, inputs: Vec<Arc<S::Input>>) -> Vec<StoreResult<S::Output>> {
        let (jobs, answers): (Vec<_>, Vec<_>) =
            inputs.iter().map(|input| Job::new(input.clone())).unzip();
        if !jobs.is_empty() {
            self.queue.push(jobs);
        }
        let answers = inputs
            .into_iter()
            .zip(answers)
            .map(|(input, answer)| self.answer(input, answer));
        join_all(answers).await
    }

    async fn answer(
        &self,
        input: Arc<S::Input>,
        answer: oneshot::Receiver<Reply<S::Output>>,
    ) -> StoreResult<S::Output> {
        match answer.await.map_err(|_| stopped())? {
            Reply::Done(result) => result,
            Reply::Alone => {
                metrics::counter!(crate::metrics::DB_CALLS_ALONE_TOTAL, "query" => self.name)
                    .increment(1);
                // Boxed: rare, and a call's future stays small without it.
                Box::pin(self.statement.run_alone(input)).await
            }
        }
    }
}

impl<S: Statement> Drop for Batcher<S> {
    /// Stops the workers; each gives back its session.
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

/// Calls waiting for a worker, in the order they came, a unit at a time: a
/// call, or the calls of one [`Batcher::run_all`].
struct Queue<J> {
    state: Mutex<Queued<J>>,
    /// Wakes a worker waiting for calls.
    arrived: Notify,
}

struct Queued<J> {
    units: VecDeque<Vec<J>>,
    /// The batcher was dropped: its workers stop.
    closed: bool,
}

impl<J> Default for Queue<J> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queued {
                units: VecDeque::new(),
                closed: false,
            }),
            arrived: Notify::new(),
        }
    }
}

impl<J> Queue<J> {
    fn push(&self, unit: Vec<J>) {
        lock(&self.state).units.push_back(unit);
        self.arrived.notify_one();
    }

    fn close(&self) {
        lock(&self.state).closed = true;
        self.arrived.notify_waiters();
    }

    /// Waits until calls are queued (`true`) or the batcher is dropped
    /// (`false`).
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
                if !queued.units.is_empty() {
                    return true;
                }
            }
            arrived.await;
        }
    }

    /// Runs `take` on the queued units, under the lock.
    fn take<T>(&self, take: impl FnOnce(&mut VecDeque<Vec<J>>) -> T) -> T {
        take(&mut lock(&self.state).units)
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
    async fn claim(self: &Arc<Self>, overlap_after: Duration) -> Turn {
        loop {
            // Created before the check, so an end between the two is not missed.
            let ended = self.ended.notified();
            match self.try_claim(overlap_after) {
                Ok(turn) => return turn,
                Err(overlap_at) => {
                    let _ = tokio::time::timeout_at(overlap_at, ended).await;
                }
            }
        }
    }

    /// A turn now, or the time from which one may overlap the running ones.
    /// (A turn that then finds no calls counts as a start too: it only
    /// delays the next overlap.)
    fn try_claim(self: &Arc<Self>, overlap_after: Duration) -> Result<Turn, Instant> {
        let mut state = lock(&self.state);
        let now = Instant::now();
        let overlap_at = state.latest_start + overlap_after;
        if state.statements > 0 && now < overlap_at {
            return Err(overlap_at);
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

/// The session a worker keeps between statements, and since when.
struct Kept<S> {
    session: Option<S>,
    since: Instant,
}

impl<S> Default for Kept<S> {
    fn default() -> Self {
        Self {
            session: None,
            since: Instant::now(),
        }
    }
}

impl<S> Kept<S> {
    /// The session for the next statement: the kept one unless it is
    /// [`KEEP_AT_MOST`] old, else none, and the one the statement opens is
    /// kept from now.
    fn for_statement(&mut self) -> &mut Option<S> {
        if self.since.elapsed() >= KEEP_AT_MOST {
            self.session = None;
        }
        if self.session.is_none() {
            self.since = Instant::now();
        }
        &mut self.session
    }

    fn give_back(&mut self) {
        self.session = None;
    }
}

/// The calls of the next statement, as they are taken: at most `max_size`,
/// each record at most once.
struct Batch<'h, I, O> {
    jobs: Vec<Job<I, O>>,
    /// Hashes, not copies, of the records the batch holds or passed over: a
    /// collision only defers a call to the next statement, which is always
    /// correct.
    records: HashSet<u64>,
    max_size: usize,
    hasher: &'h RandomState,
}

impl<'h, I: Batchable, O> Batch<'h, I, O> {
    fn new(max_size: usize, hasher: &'h RandomState) -> Self {
        Self {
            jobs: Vec::with_capacity(max_size),
            records: HashSet::new(),
            max_size,
            hasher,
        }
    }

    fn record(&self, job: &Job<I, O>) -> u64 {
        self.hasher.hash_one(job.input.record())
    }

    /// Whether to take from `unit` at all: an empty batch takes from any
    /// unit; one with calls already takes a unit only when all of its
    /// records fit, so that a unit's calls share a statement when they can.
    fn fits(&self, unit: &[Job<I, O>]) -> bool {
        let room = self.max_size - self.jobs.len();
        if self.jobs.is_empty() || unit.len() <= room {
            return true;
        }
        let mut new = HashSet::new();
        let new_records = unit
            .iter()
            .filter(|job| job.wanted())
            .map(|job| self.record(job))
            .filter(|record| !self.records.contains(record) && new.insert(*record))
            .count();
        new_records <= room
    }

    /// Takes what it can of `unit` and hands back the rest, in order. A call
    /// for a record already here (or passed over) waits for the next
    /// statement, so that it sees what the one before did. A call whose
    /// caller left is dropped.
    fn take(&mut self, unit: Vec<Job<I, O>>) -> Vec<Job<I, O>> {
        let mut rest = Vec::new();
        for job in unit.into_iter().filter(Job::wanted) {
            let new_record = self.records.insert(self.record(&job));
            if new_record && self.jobs.len() < self.max_size {
                self.jobs.push(job);
            } else {
                rest.push(job);
            }
        }
        rest
    }
}

/// One of a batcher's workers: it runs one statement at a time, with the
/// session it keeps between them.
struct Worker<S: Statement> {
    name: &'static str,
    settings: BatchSettings,
    queue: Arc<Queue<JobOf<S>>>,
    /// Shared by the batcher's workers.
    running: Arc<Running>,
    statement: Arc<S>,
    /// Calls its statements could not hold, for its next one, in order.
    deferred: VecDeque<Vec<JobOf<S>>>,
    kept: Kept<S::Session>,
    hasher: RandomState,
}

impl<S: Statement> Worker<S> {
    async fn work(mut self) {
        while self.wait_for_calls().await {
            let _turn = self.running.claim(self.settings.overlap_after).await;
            let jobs = self.take_batch();
            if jobs.is_empty() {
                continue; // Another worker took them, or their callers left.
            }
            metrics::histogram!(crate::metrics::DB_BATCH_SIZE, "query" => self.name)
                .record(jobs.len() as f64);
            self.run_batch(jobs).await;
        }
        // The batcher was dropped: the kept session goes with the worker.
    }

    /// Waits for calls: deferred ones, or queued ones. A long wait gives the
    /// session back. `false`: the batcher was dropped.
    async fn wait_for_calls(&mut self) -> bool {
        if !self.deferred.is_empty() {
            return true;
        }
        match tokio::time::timeout(KEEP_IDLE, self.queue.ready()).await {
            Ok(open) => open,
            Err(_) => {
                self.kept.give_back();
                self.queue.ready().await
            }
        }
    }

    /// The next statement's calls: deferred ones first, then queued ones,
    /// up to the first unit that does not fit. What it cannot hold is
    /// deferred to the next, in order.
    fn take_batch(&mut self) -> Vec<JobOf<S>> {
        let mut batch = Batch::new(self.settings.max_size.max(1), &self.hasher);
        let mut later = VecDeque::new();
        let mut earlier = std::mem::take(&mut self.deferred);
        while let Some(unit) = earlier.pop_front() {
            if !batch.fits(&unit) {
                earlier.push_front(unit);
                break;
            }
            later.push_back(batch.take(unit));
        }
        if earlier.is_empty() {
            self.queue.take(|units| {
                while let Some(unit) = units.pop_front() {
                    if !batch.fits(&unit) {
                        units.push_front(unit);
                        break;
                    }
                    later.push_back(batch.take(unit));
                }
            });
        }
        later.append(&mut earlier);
        later.retain(|unit| !unit.is_empty());
        self.deferred = later;
        batch.jobs
    }

    /// Runs `jobs` as one statement and answers each caller.
    async fn run_batch(&mut self, jobs: Vec<JobOf<S>>) {
        let (inputs, replies): (Vec<_>, Vec<_>) =
            jobs.into_iter().map(|job| (job.input, job.reply)).unzip();
        match self.run_statement(&inputs).await {
            Ok(parts) if parts.len() == inputs.len() => {
                for (reply, part) in replies.into_iter().zip(parts) {
                    let _ = reply.send(part.into());
                }
            }
            Ok(parts) => {
                let error = StoreError::Corrupt(format!(
                    "a batch of {} answered {} results",
                    inputs.len(),
                    parts.len()
                ));
                answer_all(replies, || Reply::Done(Err(error.clone())));
            }
            // Not the database's health: one call's row may be to blame. Run
            // each alone so the error stays with the rows it concerns.
            Err(StoreError::Internal(_)) if inputs.len() > 1 => {
                self.run_each(&inputs, replies).await;
            }
            // A row some call waits for, held by another session: each caller
            // runs its call alone, so only the calls of that row wait, on
            // connections of their own, and this worker takes the next batch.
            Err(error) if error.concerns_rows() => answer_all(replies, || Reply::Alone),
            Err(error) => answer_all(replies, || Reply::Done(Err(error.clone()))),
        }
    }

    /// Runs each call as a statement of its own, on this worker's session,
    /// after a statement for all of them failed.
    async fn run_each(
        &mut self,
        inputs: &[Arc<S::Input>],
        replies: Vec<oneshot::Sender<Reply<S::Output>>>,
    ) {
        for (input, reply) in inputs.iter().zip(replies) {
            if reply.is_closed() {
                continue;
            }
            let result = self
                .run_statement(std::slice::from_ref(input))
                .await
                .and_then(|mut parts| {
                    parts
                        .pop()
                        .ok_or_else(|| StoreError::Corrupt("no result".into()))
                });
            let _ = reply.send(match result {
                Ok(part) => part.into(),
                Err(error) if error.concerns_rows() => Reply::Alone,
                Err(error) => Reply::Done(Err(error)),
            });
        }
    }

    /// Runs one statement on the kept session. After an error the session
    /// is given back (the store's pool checks a connection before anyone
    /// uses it again).
    async fn run_statement(
        &mut self,
        inputs: &[Arc<S::Input>],
    ) -> StoreResult<Vec<Part<S::Output>>> {
        let result = self.statement.run(self.kept.for_statement(), inputs).await;
        if result.is_err() {
            self.kept.give_back();
        }
        result
    }
}

fn answer_all<O>(replies: Vec<oneshot::Sender<Reply<O>>>, reply: impl Fn() -> Reply<O>) {
    for sender in replies {
        let _ = sender.send(reply());
    }
}
