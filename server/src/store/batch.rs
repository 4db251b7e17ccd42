//! Group commit: concurrent calls of one kind share a statement, and so a
//! transaction and a WAL flush. Each call still gets its answer only after
//! the statement holding its row committed.
//!
//! There is no waiting window: a lone call runs at once. Under load, calls
//! queue while a statement runs, and the next statement takes them all. One
//! statement per kind runs at a time, so that batches grow with the load
//! (a statement's fixed cost, not its rows, is what a batch saves); a second
//! worker starts another only when the running one is slow (a row lock, a
//! slow disk), so one stuck statement does not hold up every call.
//!
//! A worker keeps what its statements need between them (for the store, a
//! connection) while calls keep coming, and gives it back once it has
//! waited [`KEEP_IDLE`] for calls or kept it [`KEEP_AT_MOST`].

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

/// Runs one statement with the worker's kept session (`None`: get one) and
/// hands back the session worth keeping (`None`: it was given up, e.g. after
/// an error).
type Execute<I, O, S> = dyn Fn(
        Option<S>,
        Arc<[Arc<I>]>,
    ) -> Pin<Box<dyn Future<Output = (Option<S>, StoreResult<Vec<O>>)> + Send>>
    + Send
    + Sync;

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
    reply: oneshot::Sender<StoreResult<O>>,
}

/// Queues calls for a few workers that run them in batches.
pub struct Batcher<I, O> {
    queue: mpsc::Sender<Job<I, O>>,
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
    /// and answers in the same order, with the session `S` its worker kept.
    pub fn spawn<S, E, F>(name: &'static str, settings: BatchSettings, execute: E) -> Self
    where
        S: Send + 'static,
        E: Fn(Option<S>, Arc<[Arc<I>]>) -> F + Send + Sync + 'static,
        F: Future<Output = (Option<S>, StoreResult<Vec<O>>)> + Send + 'static,
    {
        let execute: Arc<Execute<I, O, S>> =
            Arc::new(move |session, inputs| Box::pin(execute(session, inputs)));
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
        Self { queue }
    }

    /// Runs `input` in the next batch and returns its own answer.
    pub async fn run(&self, input: Arc<I>) -> StoreResult<O> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Job { input, reply })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
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
        let _running = if !jobs.is_empty() {
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
        metrics::histogram!(crate::metrics::DB_BATCH_SIZE, "query" => name)
            .record(jobs.len() as f64);
        run_batch(&execute, &mut session, jobs).await;
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
    ) -> StoreResult<Vec<O>> {
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
        Ok(outputs) if outputs.len() == size => {
            for (reply, output) in replies.into_iter().zip(outputs) {
                let _ = reply.send(Ok(output));
            }
        }
        Ok(outputs) => {
            let error = StoreError::Corrupt(format!(
                "a batch of {size} answered {} results",
                outputs.len()
            ));
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
        // Not the database's health: one call's row may be to blame. Run
        // each alone so the error stays with the rows it concerns.
        Err(StoreError::Internal(_)) if size > 1 => {
            for (input, reply) in inputs.iter().zip(replies) {
                let result = kept
                    .run(execute, Arc::from([input.clone()]))
                    .await
                    .and_then(|mut outputs| {
                        outputs
                            .pop()
                            .ok_or_else(|| StoreError::Corrupt("no result".into()))
                    });
                let _ = reply.send(result);
            }
        }
        Err(error) => {
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
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
        let batcher = Batcher::spawn("test", settings, {
            let ended = ended.clone();
            move |kept: Option<Session>, inputs: Arc<[Arc<Call>]>| {
                let session = kept.unwrap_or_else(|| Session {
                    number: opened.fetch_add(1, Ordering::SeqCst) + 1,
                    ended: ended.clone(),
                });
                let answers = vec![session.number; inputs.len()];
                async move { (Some(session), Ok(answers)) }
            }
        });
        (batcher, ended)
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
