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

use std::{
    collections::HashSet,
    future::Future,
    hash::{BuildHasher, RandomState},
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::{Mutex, Notify, mpsc, oneshot},
    time::Instant,
};

use super::{StoreError, StoreResult};
use crate::domain::RecordId;

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

/// Runs one statement with the worker's kept session (`None`: get one) and
/// hands back the session worth keeping (`None`: it was given up, e.g. after
/// an error).
type Execute<I, O, S> = dyn Fn(
        Option<S>,
        Arc<[Arc<I>]>,
    ) -> Pin<Box<dyn Future<Output = (Option<S>, StoreResult<Vec<Part<O>>>)> + Send>>
    + Send
    + Sync;

/// Runs one call alone, as its own statement that may wait for its row.
type Alone<I, O> =
    dyn Fn(Arc<I>) -> Pin<Box<dyn Future<Output = StoreResult<O>> + Send>> + Send + Sync;

/// A worker that waited this long for calls gives its session back.
pub const KEEP_IDLE: Duration = Duration::from_secs(1);
/// A worker gives its session back after this long even while busy, so that
/// the pool's own limits (a connection's lifetime) still apply.
pub const KEEP_AT_MOST: Duration = Duration::from_secs(30);

/// A queued call. Its input is shared, not copied: the caller may need it
/// again (to explain a miss, or for the next attempt), and a failed batch
/// re-runs each call alone.
struct Job<I, O> {
    input: Arc<I>,
    reply: oneshot::Sender<Reply<O>>,
}

/// What a worker tells a caller.
enum Reply<O> {
    Done(StoreResult<O>),
    /// Run the call alone (see [`Part::Alone`]).
    Alone,
}

/// Queues calls for a few workers that run them in batches.
pub struct Batcher<I, O> {
    name: &'static str,
    queue: mpsc::Sender<Job<I, O>>,
    alone: Arc<Alone<I, O>>,
}

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

/// Statements of one batcher running now, when the latest started, and a
/// signal when one ends.
struct Running {
    statements: AtomicUsize,
    latest_start: std::sync::Mutex<Instant>,
    ended: Notify,
}

impl Default for Running {
    fn default() -> Self {
        Self {
            statements: AtomicUsize::new(0),
            latest_start: std::sync::Mutex::new(Instant::now()),
            ended: Notify::new(),
        }
    }
}

impl Running {
    /// Counts a new statement as running: at once when none runs, else once
    /// none runs or the latest started `overlap_after` ago, whichever comes
    /// first. Claiming is one atomic step, so two waiting workers woken by
    /// the same end cannot both take the idle turn.
    async fn claim(self: &Arc<Self>, overlap_after: Duration) -> RunningGuard {
        loop {
            // Created before the check, so an end between the two is not missed.
            let ended = self.ended.notified();
            if self
                .statements
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return self.started();
            }
            let overlap_at = *self.latest_start.lock().expect("running lock") + overlap_after;
            if Instant::now() >= overlap_at {
                self.statements.fetch_add(1, Ordering::AcqRel);
                return self.started();
            }
            let _ = tokio::time::timeout_at(overlap_at, ended).await;
        }
    }

    fn started(self: &Arc<Self>) -> RunningGuard {
        *self.latest_start.lock().expect("running lock") = Instant::now();
        RunningGuard(self.clone())
    }
}

/// Counts a statement as running until dropped.
struct RunningGuard(Arc<Running>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.statements.fetch_sub(1, Ordering::AcqRel);
        self.0.ended.notify_waiters();
    }
}

impl<I: Batchable, O: Send + 'static> Batcher<I, O> {
    /// Starts the workers. `execute` runs one statement for the inputs given
    /// and answers in the same order, with the session `S` its worker kept;
    /// it must not wait for rows other sessions hold. `alone` runs a call
    /// that a statement passed over, or whose statement failed for its
    /// rows' sake, for its caller: waiting for its row if need be.
    pub fn spawn<S, E, F, A, G>(
        name: &'static str,
        settings: BatchSettings,
        execute: E,
        alone: A,
    ) -> Self
    where
        S: Send + 'static,
        E: Fn(Option<S>, Arc<[Arc<I>]>) -> F + Send + Sync + 'static,
        F: Future<Output = (Option<S>, StoreResult<Vec<Part<O>>>)> + Send + 'static,
        A: Fn(Arc<I>) -> G + Send + Sync + 'static,
        G: Future<Output = StoreResult<O>> + Send + 'static,
    {
        let execute: Arc<Execute<I, O, S>> =
            Arc::new(move |session, inputs| Box::pin(execute(session, inputs)));
        let alone: Arc<Alone<I, O>> = Arc::new(move |input| Box::pin(alone(input)));
        let (queue, receiver) = mpsc::channel(settings.max_size.max(1) * 64);
        let receiver = Arc::new(Mutex::new(receiver));
        let running = Arc::new(Running::default());
        for _ in 0..settings.workers.max(1) {
            tokio::spawn(work(
                name,
                receiver.clone(),
                running.clone(),
                execute.clone(),
                settings,
            ));
        }
        Self { name, queue, alone }
    }

    /// Runs `input` in the next batch, or alone when the batch cannot do it
    /// without waiting, and returns its own answer.
    pub async fn run(&self, input: Arc<I>) -> StoreResult<O> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Job {
                input: input.clone(),
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        match answer.await.map_err(|_| stopped())? {
            Reply::Done(result) => result,
            Reply::Alone => {
                metrics::counter!(crate::metrics::DB_CALLS_ALONE_TOTAL, "query" => self.name)
                    .increment(1);
                (self.alone)(input).await
            }
        }
    }
}

fn stopped() -> StoreError {
    StoreError::Unavailable(Arc::new(sqlx::Error::PoolClosed))
}

/// A worker: take what is queued (one record at most once), run it, answer.
async fn work<I: Batchable, O, S>(
    name: &'static str,
    receiver: Arc<Mutex<mpsc::Receiver<Job<I, O>>>>,
    running: Arc<Running>,
    execute: Arc<Execute<I, O, S>>,
    settings: BatchSettings,
) {
    let max_size = settings.max_size.max(1);
    let mut deferred: Vec<Job<I, O>> = Vec::new();
    let mut session = Kept(None);
    let hasher = RandomState::new();
    let record_hash = |input: &I| hasher.hash_one(input.record());
    loop {
        let mut jobs = Vec::with_capacity(max_size);
        // Hashes, not copies, of the records in the batch: a collision only
        // defers a call to the next statement, which is always correct.
        let mut records = HashSet::new();
        // Calls for a record already in the batch wait for the next one, so
        // they see what the first did.
        for job in std::mem::take(&mut deferred) {
            if jobs.len() < max_size && records.insert(record_hash(&job.input)) {
                jobs.push(job);
            } else {
                deferred.push(job);
            }
        }
        let statement = if !jobs.is_empty() {
            running.claim(settings.overlap_after).await
        } else {
            // Waiting for the queue (another worker may be gathering from
            // it) or for calls: either way, a long wait gives the session back.
            let next = async {
                let mut queue = receiver.lock().await;
                let first = queue.recv().await;
                (queue, first)
            };
            tokio::pin!(next);
            let (mut queue, first) = match tokio::time::timeout(KEEP_IDLE, &mut next).await {
                Ok(next) => next,
                Err(_) => {
                    session.give_back();
                    next.await
                }
            };
            let Some(first) = first else {
                return; // The batcher was dropped.
            };
            // While another statement runs, let calls gather for the next
            // one (holding the queue, so no other worker splits them).
            let running = running.claim(settings.overlap_after).await;
            records.insert(record_hash(&first.input));
            jobs.push(first);
            while jobs.len() < max_size {
                let Ok(job) = queue.try_recv() else { break };
                if records.insert(record_hash(&job.input)) {
                    jobs.push(job);
                } else {
                    deferred.push(job);
                }
            }
            running
        };
        // Callers that left while their calls queued (or while this worker
        // waited for its turn) no longer want them run.
        jobs.retain(|job| !job.reply.is_closed());
        if jobs.is_empty() {
            continue;
        }
        metrics::histogram!(crate::metrics::DB_BATCH_SIZE, "query" => name)
            .record(jobs.len() as f64);
        run_batch(&execute, &mut session, jobs).await;
        drop(statement);
    }
}

/// The session a worker keeps between statements, and since when it has it.
struct Kept<S>(Option<(S, Instant)>);

impl<S> Kept<S> {
    /// Runs `inputs` as one statement on the kept session (a new one when
    /// none is kept, or the kept one is [`KEEP_AT_MOST`] old), and keeps
    /// what the statement hands back.
    async fn run<I, O>(
        &mut self,
        execute: &Arc<Execute<I, O, S>>,
        inputs: Arc<[Arc<I>]>,
    ) -> StoreResult<Vec<Part<O>>> {
        let (session, since) = match self.0.take() {
            Some((session, since)) if since.elapsed() < KEEP_AT_MOST => (Some(session), since),
            _ => (None, Instant::now()),
        };
        let (session, result) = execute(session, inputs).await;
        self.0 = session.map(|session| (session, since));
        result
    }

    fn give_back(&mut self) {
        self.0 = None;
    }
}

async fn run_batch<I, O, S>(
    execute: &Arc<Execute<I, O, S>>,
    kept: &mut Kept<S>,
    jobs: Vec<Job<I, O>>,
) {
    let (inputs, replies): (Vec<Arc<I>>, Vec<_>) =
        jobs.into_iter().map(|j| (j.input, j.reply)).unzip();
    let inputs: Arc<[Arc<I>]> = inputs.into();
    let size = inputs.len();
    match kept.run(execute, inputs.clone()).await {
        Ok(parts) if parts.len() == size => {
            for (reply, part) in replies.into_iter().zip(parts) {
                let _ = reply.send(match part {
                    Part::Done(output) => Reply::Done(Ok(output)),
                    Part::Alone => Reply::Alone,
                });
            }
        }
        Ok(parts) => {
            let error = StoreError::Corrupt(format!(
                "a batch of {size} answered {} results",
                parts.len()
            ));
            for reply in replies {
                let _ = reply.send(Reply::Done(Err(error.clone())));
            }
        }
        // Not the database's health: one call's row may be to blame. Run
        // each alone so the error stays with the rows it concerns.
        Err(StoreError::Internal(_)) if size > 1 => {
            for (input, reply) in inputs.iter().zip(replies) {
                if reply.is_closed() {
                    continue;
                }
                let result = kept
                    .run(execute, Arc::from([input.clone()]))
                    .await
                    .and_then(|mut parts| {
                        parts
                            .pop()
                            .ok_or_else(|| StoreError::Corrupt("no result".into()))
                    });
                let _ = reply.send(match result {
                    Ok(Part::Done(output)) => Reply::Done(Ok(output)),
                    Ok(Part::Alone) => Reply::Alone,
                    Err(error) if error.concerns_rows() => Reply::Alone,
                    Err(error) => Reply::Done(Err(error)),
                });
            }
        }
        // A row some call waits for, held by another session: each caller
        // runs its call alone, so only the calls of that row wait, on
        // connections of their own, and this worker takes the next batch.
        Err(error) if error.concerns_rows() => {
            for reply in replies {
                let _ = reply.send(Reply::Alone);
            }
        }
        Err(error) => {
            for reply in replies {
                let _ = reply.send(Reply::Done(Err(error.clone())));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    struct Call(RecordId);

    impl Batchable for Call {
        fn record(&self) -> &RecordId {
            &self.0
        }
    }

    fn call(key: &str) -> Arc<Call> {
        let id = RecordId::parse(
            "id",
            "ns".into(),
            "POST /x".into(),
            "user".into(),
            key.into(),
        )
        .unwrap();
        Arc::new(Call(id))
    }

    /// A numbered session that counts its own end.
    struct Session {
        number: usize,
        ended: Arc<AtomicUsize>,
    }

    impl Drop for Session {
        fn drop(&mut self) {
            self.ended.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// One worker whose statements answer each call with the number of the
    /// session they ran on, opening a new session when given none.
    fn batcher() -> (Batcher<Call, usize>, Arc<AtomicUsize>) {
        batcher_with(1)
    }

    fn batcher_with(workers: usize) -> (Batcher<Call, usize>, Arc<AtomicUsize>) {
        let opened = Arc::new(AtomicUsize::new(0));
        let ended = Arc::new(AtomicUsize::new(0));
        let settings = BatchSettings {
            workers,
            ..BatchSettings::default()
        };
        let batcher = Batcher::spawn(
            "test",
            settings,
            {
                let ended = ended.clone();
                move |kept: Option<Session>, inputs: Arc<[Arc<Call>]>| {
                    let session = kept.unwrap_or_else(|| Session {
                        number: opened.fetch_add(1, Ordering::SeqCst) + 1,
                        ended: ended.clone(),
                    });
                    let answers = vec![Part::Done(session.number); inputs.len()];
                    async move { (Some(session), Ok(answers)) }
                }
            },
            |_| async { unreachable!("no call runs alone") },
        );
        (batcher, ended)
    }

    /// What a scripted statement does with a batch.
    #[derive(Clone, Copy)]
    enum Script {
        /// Answers each call 1, passing over calls of keys ending in "-held".
        PassOverHeld,
        /// Fails whole, with this Postgres error code, when a call's key ends in "-held".
        FailWhenHeld(&'static str),
    }

    /// A Postgres error with only a code, as the store would see it.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "scripted"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    /// The keys of each statement run, and of each call run alone.
    #[derive(Default)]
    struct Runs {
        statements: std::sync::Mutex<Vec<Vec<String>>>,
        alone: std::sync::Mutex<Vec<String>>,
    }

    fn keys(inputs: &[Arc<Call>]) -> Vec<String> {
        inputs.iter().map(|call| call.0.key().to_owned()).collect()
    }

    /// One worker whose statements follow `script`, each waiting until
    /// `gate` lets it go; a call run alone answers 2.
    fn scripted(
        script: Script,
        gate: Arc<tokio::sync::Semaphore>,
    ) -> (Arc<Batcher<Call, usize>>, Arc<Runs>) {
        let runs = Arc::new(Runs::default());
        let settings = BatchSettings {
            workers: 1,
            ..BatchSettings::default()
        };
        let batcher = Batcher::spawn(
            "test",
            settings,
            {
                let runs = runs.clone();
                move |_: Option<()>, inputs: Arc<[Arc<Call>]>| {
                    let (runs, gate) = (runs.clone(), gate.clone());
                    async move {
                        gate.acquire().await.unwrap().forget();
                        runs.statements.lock().unwrap().push(keys(&inputs));
                        let held = |call: &Arc<Call>| call.0.key().ends_with("-held");
                        let result = match script {
                            Script::PassOverHeld => Ok(inputs
                                .iter()
                                .map(|call| {
                                    if held(call) {
                                        Part::Alone
                                    } else {
                                        Part::Done(1)
                                    }
                                })
                                .collect()),
                            Script::FailWhenHeld(code) if inputs.iter().any(held) => {
                                Err(sqlx::Error::Database(Box::new(Coded(code))).into())
                            }
                            Script::FailWhenHeld(_) => Ok(vec![Part::Done(1); inputs.len()]),
                        };
                        (None, result)
                    }
                }
            },
            {
                let runs = runs.clone();
                move |call: Arc<Call>| {
                    runs.alone.lock().unwrap().push(call.0.key().to_owned());
                    async { Ok(2) }
                }
            },
        );
        (Arc::new(batcher), runs)
    }

    /// Queues a call for each key while the worker's statement for another
    /// call waits at the gate, so that they share the next statement, and
    /// returns their answers in order.
    async fn run_all(
        batcher: &Arc<Batcher<Call, usize>>,
        gate: &tokio::sync::Semaphore,
        keys: &[&str],
    ) -> Vec<StoreResult<usize>> {
        let run = |key: &str| {
            let (batcher, call) = (batcher.clone(), call(key));
            tokio::spawn(async move { batcher.run(call).await })
        };
        let first = run("key-0000");
        tokio::time::sleep(Duration::from_millis(1)).await;
        let calls: Vec<_> = keys.iter().map(|key| run(key)).collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap(), 1);
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.unwrap());
        }
        answers
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_its_statement_passed_over_runs_alone_and_only_it() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (batcher, runs) = scripted(Script::PassOverHeld, gate.clone());

        let answers = run_all(&batcher, &gate, &["key-0001", "key-0002-held", "key-0003"]).await;

        let answers: Vec<usize> = answers.into_iter().map(Result::unwrap).collect();
        assert_eq!(answers, [1, 2, 1]);
        assert_eq!(*runs.alone.lock().unwrap(), ["key-0002-held"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_failing_for_its_rows_runs_every_call_alone() {
        for code in ["55P03", "40001", "40P01"] {
            let gate = Arc::new(tokio::sync::Semaphore::new(0));
            let (batcher, runs) = scripted(Script::FailWhenHeld(code), gate.clone());

            let answers =
                run_all(&batcher, &gate, &["key-0001", "key-0002-held", "key-0003"]).await;

            let answers: Vec<usize> = answers.into_iter().map(Result::unwrap).collect();
            assert_eq!(answers, [2, 2, 2], "{code}");
            let mut alone = runs.alone.lock().unwrap().clone();
            alone.sort();
            assert_eq!(alone, ["key-0001", "key-0002-held", "key-0003"], "{code}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_failing_for_the_database_fails_every_call_and_runs_none_alone() {
        // 57014: the statement timeout, which says nothing about one row.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (batcher, runs) = scripted(Script::FailWhenHeld("57014"), gate.clone());

        let answers = run_all(&batcher, &gate, &["key-0001", "key-0002-held"]).await;

        assert!(
            answers
                .iter()
                .all(|answer| matches!(answer, Err(StoreError::Unavailable(_)))),
            "{answers:?}"
        );
        assert!(runs.alone.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_whose_caller_left_while_it_queued_is_not_run() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (batcher, runs) = scripted(Script::PassOverHeld, gate.clone());
        // The first statement waits at the gate; the next calls queue.
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.run(call("key-0001")).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        let left = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.run(call("key-0002")).await }
        });
        let stays = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.run(call("key-0003")).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        left.abort();
        tokio::time::sleep(Duration::from_millis(1)).await;

        gate.add_permits(2);

        assert_eq!(first.await.unwrap().unwrap(), 1);
        assert_eq!(stays.await.unwrap().unwrap(), 1);
        assert_eq!(
            *runs.statements.lock().unwrap(),
            [vec!["key-0001".to_owned()], vec!["key-0003".to_owned()]]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_whose_callers_all_left_runs_no_statement() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (batcher, runs) = scripted(Script::PassOverHeld, gate.clone());
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.run(call("key-0001")).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        let left = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.run(call("key-0002")).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        left.abort();
        tokio::time::sleep(Duration::from_millis(1)).await;

        gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap(), 1);
        tokio::time::sleep(Duration::from_millis(10)).await;

        assert_eq!(runs.statements.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_keeps_its_session_between_statements() {
        let (batcher, ended) = batcher();
        for key in ["key-0001", "key-0002", "key-0003"] {
            assert_eq!(batcher.run(call(key)).await.unwrap(), 1);
            tokio::time::sleep(KEEP_IDLE / 2).await;
        }
        assert_eq!(ended.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_gives_its_session_back_once_idle() {
        let (batcher, ended) = batcher();
        assert_eq!(batcher.run(call("key-0001")).await.unwrap(), 1);
        tokio::time::sleep(KEEP_IDLE * 2).await;
        // Given back while waiting, not only when the next call comes.
        assert_eq!(ended.load(Ordering::SeqCst), 1);
        assert_eq!(batcher.run(call("key-0002")).await.unwrap(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_waiting_for_the_queue_gives_its_session_back_too() {
        // With two workers, the one that ran the statement then waits for
        // the queue, which the other holds while it waits for calls.
        let (batcher, ended) = batcher_with(2);
        // Both workers waiting: one for calls, holding the queue, the other
        // for the queue.
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(batcher.run(call("key-0001")).await.unwrap(), 1);
        tokio::time::sleep(KEEP_IDLE * 2).await;
        assert_eq!(ended.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_worker_still_renews_its_session() {
        let (batcher, ended) = batcher();
        let mut numbers = Vec::new();
        let mut elapsed = Duration::ZERO;
        while elapsed <= KEEP_AT_MOST + KEEP_IDLE {
            numbers.push(
                batcher
                    .run(call(&format!("key-{:08}", elapsed.as_millis())))
                    .await
                    .unwrap(),
            );
            tokio::time::sleep(KEEP_IDLE / 2).await;
            elapsed += KEEP_IDLE / 2;
        }
        assert_eq!(numbers.first(), Some(&1));
        assert_eq!(numbers.last(), Some(&2));
        assert_eq!(ended.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_batcher_ends_its_workers_session() {
        let (batcher, ended) = batcher();
        batcher.run(call("key-0001")).await.unwrap();
        drop(batcher);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(ended.load(Ordering::SeqCst), 1);
    }
}
