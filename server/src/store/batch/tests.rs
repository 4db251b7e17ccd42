//! The batcher on tokio's paused clock, with a fake statement in memory:
//! time moves only when every task waits, so each test's timeline is exact.

use std::sync::{
    Mutex,
    atomic::{AtomicUsize, Ordering},
};

use futures_util::future::join_all;

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

fn keys(inputs: &[Arc<Call>]) -> Vec<String> {
    inputs.iter().map(|call| call.0.key().to_owned()).collect()
}

/// Where a call ran: the number of its statement (counted from 1 in the
/// order they started) and of the session it ran on; 0 for both alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ran {
    statement: usize,
    session: usize,
}

const ALONE: Ran = Ran {
    statement: 0,
    session: 0,
};

/// What the fake statement does with the calls it is given.
#[derive(Clone, Copy)]
enum Script {
    /// Answers every call.
    Answer,
    /// Fails whole, with this Postgres error code, when a call's key ends
    /// in "-held"; answers every call otherwise.
    FailWhenHeld(&'static str),
    /// Answers no call at all.
    AnswerNothing,
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

/// A statement in memory that takes `takes` on the paused clock (a hundred
/// times that with a call whose key ends in "-stuck") and notes what it ran.
struct Fake {
    script: Script,
    takes: Duration,
    opened: AtomicUsize,
    ended: Arc<AtomicUsize>,
    /// When each statement started, and the keys of its calls.
    statements: Mutex<Vec<(Instant, Vec<String>)>>,
    /// Keys of the calls run alone.
    alone: Mutex<Vec<String>>,
    /// The task each statement ran in.
    tasks: Mutex<Vec<Option<tokio::task::Id>>>,
}

impl Fake {
    fn new(script: Script, takes: Duration) -> Arc<Self> {
        Arc::new(Self {
            script,
            takes,
            opened: AtomicUsize::new(0),
            ended: Arc::new(AtomicUsize::new(0)),
            statements: Mutex::default(),
            alone: Mutex::default(),
            tasks: Mutex::default(),
        })
    }

    fn tasks(&self) -> Vec<Option<tokio::task::Id>> {
        self.tasks.lock().unwrap().clone()
    }

    fn statements(&self) -> Vec<Vec<String>> {
        let statements = self.statements.lock().unwrap();
        statements.iter().map(|(_, keys)| keys.clone()).collect()
    }

    fn starts(&self) -> Vec<Instant> {
        let statements = self.statements.lock().unwrap();
        statements.iter().map(|(start, _)| *start).collect()
    }

    fn alone(&self) -> Vec<String> {
        let mut alone = self.alone.lock().unwrap().clone();
        alone.sort();
        alone
    }

    fn ended(&self) -> usize {
        self.ended.load(Ordering::SeqCst)
    }

    fn answers(&self, inputs: &[Arc<Call>], ran: Ran) -> StoreResult<Vec<Ran>> {
        let held = |call: &Arc<Call>| call.0.key().ends_with("-held");
        match self.script {
            Script::FailWhenHeld(code) if inputs.iter().any(held) => {
                Err(sqlx::Error::Database(Box::new(Coded(code))).into())
            }
            Script::Answer | Script::FailWhenHeld(_) => Ok(vec![ran; inputs.len()]),
            Script::AnswerNothing => Ok(Vec::new()),
        }
    }

    fn takes(&self, inputs: &[Arc<Call>]) -> Duration {
        let stuck = inputs.iter().any(|call| call.0.key().ends_with("-stuck"));
        if stuck { 100 * self.takes } else { self.takes }
    }
}

impl Statement for Arc<Fake> {
    type Input = Call;
    type Output = Ran;
    type Session = Session;

    async fn run(
        &self,
        session: &mut Option<Session>,
        inputs: &[Arc<Call>],
    ) -> StoreResult<Vec<Ran>> {
        let session = session.get_or_insert_with(|| Session {
            number: self.opened.fetch_add(1, Ordering::SeqCst) + 1,
            ended: self.ended.clone(),
        });
        let statement = {
            let mut statements = self.statements.lock().unwrap();
            statements.push((Instant::now(), keys(inputs)));
            statements.len()
        };
        self.tasks.lock().unwrap().push(tokio::task::try_id());
        tokio::time::sleep(self.takes(inputs)).await;
        let ran = Ran {
            statement,
            session: session.number,
        };
        self.answers(inputs, ran)
    }

    async fn run_alone(&self, input: Arc<Call>) -> StoreResult<Ran> {
        self.alone.lock().unwrap().push(input.0.key().to_owned());
        Ok(ALONE)
    }
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

const TAKES: Duration = Duration::from_millis(10);
const OVERLAP: Duration = Duration::from_millis(20);
const MS: Duration = Duration::from_millis(1);

fn settings(workers: usize) -> BatchSettings {
    BatchSettings {
        workers,
        max_size: 64,
        overlap_after: OVERLAP,
    }
}

type Tested = Arc<Batcher<Arc<Fake>>>;

fn spawn(fake: &Arc<Fake>, settings: BatchSettings) -> Tested {
    Arc::new(Batcher::spawn(
        "test",
        settings,
        fake.clone(),
        Arc::default(),
    ))
}

/// One worker running `script`, each statement taking [`TAKES`].
fn one_worker(script: Script) -> (Tested, Arc<Fake>) {
    let fake = Fake::new(script, TAKES);
    (spawn(&fake, settings(1)), fake)
}

/// Runs a call for `key` in a task of its own, which a test may abort.
fn run_in_task(batcher: &Tested, key: &'static str) -> tokio::task::JoinHandle<StoreResult<Ran>> {
    let batcher = batcher.clone();
    tokio::spawn(async move { batcher.run(call(key)).await })
}

/// Runs a call for `first` and, once its statement runs, calls for `keys`,
/// which so queue behind it; returns the answers to `keys`, in order.
async fn run_behind_first(batcher: &Tested, first: &str, keys: &[&str]) -> Vec<StoreResult<Ran>> {
    let (first, rest) = tokio::join!(batcher.run(call(first)), async {
        tokio::time::sleep(MS).await;
        join_all(keys.iter().map(|key| batcher.run(call(key)))).await
    });
    first.unwrap();
    rest
}

fn statement_numbers(answers: Vec<StoreResult<Ran>>) -> Vec<usize> {
    answers
        .into_iter()
        .map(|answer| answer.unwrap().statement)
        .collect()
}

// Batch formation.

#[tokio::test(start_paused = true)]
async fn a_lone_call_runs_at_once() {
    let fake = Fake::new(Script::Answer, Duration::ZERO);
    let batcher = spawn(&fake, settings(2));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let asked = Instant::now();

    let ran = batcher.run(call("key-0001")).await.unwrap();

    assert_eq!(asked.elapsed(), Duration::ZERO);
    assert_eq!(ran.statement, 1);
    assert_eq!(fake.statements(), [["key-0001"]]);
}

#[tokio::test(start_paused = true)]
async fn a_call_at_rest_runs_in_its_callers_task_and_the_calls_behind_it_in_a_worker() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(&fake, settings(2));
    let run = |key| run_in_task(&batcher, key);

    let first = run("key-0001");
    tokio::time::sleep(MS).await;
    let behind = [run("key-0002"), run("key-0003")];
    let first_task = first.id();
    let behind_tasks = behind.each_ref().map(|task| task.id());
    first.await.unwrap().unwrap();
    for task in behind {
        assert_eq!(task.await.unwrap().unwrap().statement, 2);
    }

    assert_ran_at_rest_then_in_a_worker(&fake, first_task, &behind_tasks);
    assert_eq!(
        fake.statements(),
        [vec!["key-0001"], vec!["key-0002", "key-0003"]]
    );
}

/// The first statement ran in its caller's task (`at_rest`), the second in
/// a worker: none of the `behind` callers' tasks.
fn assert_ran_at_rest_then_in_a_worker(
    fake: &Fake,
    at_rest: tokio::task::Id,
    behind: &[tokio::task::Id],
) {
    let tasks = fake.tasks();
    assert_eq!(tasks[0], Some(at_rest), "no hand-off at rest");
    let worker = tasks[1].expect("statements run in tasks");
    assert!(
        worker != at_rest && !behind.contains(&worker),
        "a queued batch runs in a worker"
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_at_rest_whose_caller_left_runs_to_its_end_holding_its_record_and_session() {
    let (batcher, fake) = one_worker(Script::Answer);
    let start = Instant::now();
    let left = run_in_task(&batcher, "key-0001");
    tokio::time::sleep(MS).await;
    left.abort();
    let _ = left.await;

    // The same key waits for the statement's end, as behind a worker's,
    // and runs on the session it kept.
    let ran = batcher.run(call("key-0001")).await.unwrap();
    assert_eq!(start.elapsed(), 2 * TAKES);
    assert_eq!(
        ran,
        Ran {
            statement: 2,
            session: 1
        }
    );
    assert_eq!(fake.ended(), 0);
}

/// Runs `keys` as one unit in a task of its own, which a test may abort.
fn run_all_in_task(
    batcher: &Tested,
    keys: &'static [&'static str],
) -> tokio::task::JoinHandle<Vec<StoreResult<Ran>>> {
    let batcher = batcher.clone();
    tokio::spawn(async move {
        batcher
            .run_all(keys.iter().map(|key| call(key)).collect())
            .await
    })
}

#[tokio::test(start_paused = true)]
async fn a_unit_at_rest_runs_as_one_statement_in_its_callers_task() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(&fake, settings(2));

    let unit = run_all_in_task(&batcher, &["key-0001", "key-0002", "key-0003"]);
    tokio::time::sleep(MS).await;
    let behind = [
        run_in_task(&batcher, "key-0004"),
        run_in_task(&batcher, "key-0002"),
    ];
    let unit_task = unit.id();
    let behind_tasks = behind.each_ref().map(|task| task.id());
    assert_eq!(statement_numbers(unit.await.unwrap()), [1, 1, 1]);
    for task in behind {
        assert_eq!(task.await.unwrap().unwrap().statement, 2);
    }

    assert_ran_at_rest_then_in_a_worker(&fake, unit_task, &behind_tasks);
    // The calls behind it waited for its turn (it ended before a second
    // statement could overlap it), then went together.
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0001", "key-0002", "key-0003"],
            vec!["key-0004", "key-0002"]
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_unit_at_rest_that_one_statement_cannot_hold_goes_to_the_workers() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(
        &fake,
        BatchSettings {
            max_size: 2,
            ..settings(1)
        },
    );
    let fits = batcher
        .run_all(["key-0006", "key-0007"].map(call).to_vec())
        .await;
    let repeated = batcher
        .run_all(["key-0001", "key-0002", "key-0001"].map(call).to_vec())
        .await;
    let too_many = batcher
        .run_all(["key-0003", "key-0004", "key-0005"].map(call).to_vec())
        .await;

    assert_eq!(statement_numbers(fits), [1, 1]);
    assert_eq!(statement_numbers(repeated), [2, 2, 3]);
    assert_eq!(statement_numbers(too_many), [4, 4, 5]);
    // The test's own future is no task: a statement run in it has no id.
    let tasks = fake.tasks();
    assert_eq!(
        tasks[0], None,
        "a unit of max_size runs at rest, in its caller"
    );
    assert!(
        tasks[1..].iter().all(Option::is_some),
        "the others in a worker"
    );
}

#[tokio::test(start_paused = true)]
async fn a_unit_at_rest_whose_caller_left_runs_to_its_end_holding_its_records_and_session() {
    let (batcher, fake) = one_worker(Script::Answer);
    let start = Instant::now();
    let left = run_all_in_task(&batcher, &["key-0001", "key-0002"]);
    let left_task = left.id();
    tokio::time::sleep(MS).await;
    left.abort();
    let _ = left.await;

    let ran = batcher.run(call("key-0002")).await.unwrap();
    assert_eq!(fake.tasks()[0], Some(left_task), "it ran at rest");
    assert_eq!(start.elapsed(), 2 * TAKES);
    assert_eq!(
        ran,
        Ran {
            statement: 2,
            session: 1
        }
    );
    assert_eq!(fake.ended(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slow_unit_at_rest_holds_every_record_from_an_overlapping_statement() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(&fake, settings(2));
    let start = Instant::now();

    let unit = run_all_in_task(&batcher, &["key-0001-stuck", "key-0002"]);
    tokio::time::sleep(MS).await;
    let other = run_in_task(&batcher, "key-0003");
    let same = run_in_task(&batcher, "key-0002");
    assert_eq!(statement_numbers(unit.await.unwrap()), [1, 1]);
    assert_eq!(other.await.unwrap().unwrap().statement, 2);
    assert_eq!(same.await.unwrap().unwrap().statement, 3);

    let starts: Vec<Duration> = fake.starts().iter().map(|at| *at - start).collect();
    assert_eq!(starts, [Duration::ZERO, OVERLAP, 100 * TAKES]);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0001-stuck", "key-0002"],
            vec!["key-0003"],
            vec!["key-0002"]
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_unit_at_rest_failing_for_a_bug_runs_each_call_again_in_its_caller() {
    // 42P01: undefined table, neither the database's health nor a row lock.
    let (batcher, fake) = one_worker(Script::FailWhenHeld("42P01"));

    let answers = batcher
        .run_all(["key-0001", "key-0002-held", "key-0003"].map(call).to_vec())
        .await;

    assert!(answers[0].is_ok() && answers[2].is_ok(), "{answers:?}");
    assert!(
        matches!(answers[1], Err(StoreError::Internal(_))),
        "{answers:?}"
    );
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0001", "key-0002-held", "key-0003"],
            vec!["key-0001"],
            vec!["key-0002-held"],
            vec!["key-0003"],
        ]
    );
    assert!(
        fake.tasks().iter().all(Option::is_none),
        "all in its caller"
    );
    assert!(fake.alone().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_unit_at_rest_whose_caller_left_runs_none_of_its_calls_again() {
    let (batcher, fake) = one_worker(Script::FailWhenHeld("42P01"));
    let left = run_all_in_task(&batcher, &["key-0001", "key-0002-held", "key-0003"]);
    tokio::time::sleep(MS).await;
    left.abort();
    let _ = left.await;

    // Its records are released once its statement ended.
    let ran = batcher.run(call("key-0001")).await.unwrap();
    assert_eq!(ran.statement, 2);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0001", "key-0002-held", "key-0003"],
            vec!["key-0001"]
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_unit_at_rest_answered_with_too_few_results_fails_its_calls() {
    let (batcher, _fake) = one_worker(Script::AnswerNothing);

    let answers = batcher
        .run_all(["key-0001", "key-0002"].map(call).to_vec())
        .await;

    assert!(
        answers
            .iter()
            .all(|answer| matches!(answer, Err(StoreError::Corrupt(_)))),
        "{answers:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn no_more_statements_run_at_once_than_there_are_workers_with_a_call_at_rest_among_them() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(&fake, settings(2));
    let run = |key| run_in_task(&batcher, key);
    let start = Instant::now();

    // A stuck call at rest, then a stuck one that overlaps it, then one
    // more that a third statement would take.
    let calls = [
        run("key-0001-stuck"),
        {
            tokio::time::sleep(MS).await;
            run("key-0002-stuck")
        },
        {
            tokio::time::sleep(OVERLAP + MS).await;
            run("key-0003")
        },
    ];
    for call in calls {
        call.await.unwrap().unwrap();
    }

    let starts: Vec<Duration> = fake.starts().iter().map(|at| *at - start).collect();
    assert_eq!(starts[..2], [Duration::ZERO, OVERLAP]);
    assert_eq!(
        starts[2],
        100 * TAKES,
        "the third waits for the first to end"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lone_call_does_not_pass_calls_queued_before_it() {
    let (batcher, fake) = one_worker(Script::Answer);

    // The unit is queued (a record twice keeps it from running at rest),
    // its worker not yet run, when the lone call comes.
    let (unit, lone) = tokio::join!(
        batcher.run_all(["key-0001", "key-0002", "key-0001"].map(call).to_vec()),
        batcher.run(call("key-0001")),
    );

    assert_eq!(statement_numbers(unit), [1, 1, 2]);
    assert_eq!(lone.unwrap().statement, 3);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0001", "key-0002"],
            vec!["key-0001"],
            vec!["key-0001"]
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_slow_call_at_rest_holds_its_record_from_an_overlapping_statement() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(&fake, settings(2));

    let answers =
        run_behind_first(&batcher, "key-0001-stuck", &["key-0001-stuck", "key-0002"]).await;

    assert_eq!(statement_numbers(answers), [3, 2]);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0001-stuck"],
            vec!["key-0002"],
            vec!["key-0001-stuck"]
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn calls_queued_while_a_statement_runs_share_the_next_one() {
    let (batcher, fake) = one_worker(Script::Answer);

    let answers =
        run_behind_first(&batcher, "key-0000", &["key-0001", "key-0002", "key-0003"]).await;

    assert_eq!(statement_numbers(answers), [2, 2, 2]);
    assert_eq!(
        fake.statements(),
        [vec!["key-0000"], vec!["key-0001", "key-0002", "key-0003"]]
    );
}

#[tokio::test(start_paused = true)]
async fn a_statement_holds_at_most_max_size_calls() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(
        &fake,
        BatchSettings {
            max_size: 2,
            ..settings(1)
        },
    );

    let keys = ["key-0001", "key-0002", "key-0003", "key-0004", "key-0005"];
    let answers = run_behind_first(&batcher, "key-0000", &keys).await;

    assert_eq!(statement_numbers(answers), [2, 2, 3, 3, 4]);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0000"],
            vec!["key-0001", "key-0002"],
            vec!["key-0003", "key-0004"],
            vec!["key-0005"],
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_record_is_once_in_a_statement_and_its_next_calls_follow_in_order() {
    let (batcher, fake) = one_worker(Script::Answer);

    let keys = ["key-aaaa", "key-bbbb", "key-aaaa", "key-cccc", "key-aaaa"];
    let answers = run_behind_first(&batcher, "key-0000", &keys).await;

    assert_eq!(statement_numbers(answers), [2, 2, 3, 2, 4]);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0000"],
            vec!["key-aaaa", "key-bbbb", "key-cccc"],
            vec!["key-aaaa"],
            vec!["key-aaaa"],
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn run_all_of_distinct_records_is_one_statement_while_single_calls_queue() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(
        &fake,
        BatchSettings {
            max_size: 4,
            ..settings(1)
        },
    );
    let group = ["key-g001", "key-g002", "key-g003"];
    let single = |key: &'static str| batcher.run(call(key));

    // While a statement runs, three single calls queue, then the group,
    // which no longer fits beside them in a statement of four.
    let (first, singles, grouped) = tokio::join!(
        single("key-0000"),
        async {
            tokio::time::sleep(MS).await;
            join_all([single("key-s001"), single("key-s002"), single("key-s003")]).await
        },
        async {
            tokio::time::sleep(MS).await;
            tokio::task::yield_now().await;
            batcher
                .run_all(group.iter().map(|key| call(key)).collect())
                .await
        }
    );
    first.unwrap();

    assert_eq!(statement_numbers(grouped), [3, 3, 3]);
    assert_eq!(statement_numbers(singles), [2, 2, 2]);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0000"],
            vec!["key-s001", "key-s002", "key-s003"],
            vec!["key-g001", "key-g002", "key-g003"],
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn run_all_shares_a_statement_with_single_calls_when_it_fits() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(
        &fake,
        BatchSettings {
            max_size: 4,
            ..settings(1)
        },
    );

    // While a statement runs, a single call, the group, and another single call queue.
    let (first, before, grouped, after) = tokio::join!(
        batcher.run(call("key-0000")),
        async {
            tokio::time::sleep(MS).await;
            batcher.run(call("key-s001")).await
        },
        async {
            tokio::time::sleep(MS).await;
            tokio::task::yield_now().await;
            let group = ["key-g001", "key-g002"];
            batcher
                .run_all(group.iter().map(|key| call(key)).collect())
                .await
        },
        async {
            tokio::time::sleep(MS).await;
            for _ in 0..2 {
                tokio::task::yield_now().await;
            }
            batcher.run(call("key-s002")).await
        },
    );
    first.unwrap();

    assert_eq!(statement_numbers(grouped), [2, 2]);
    assert_eq!(before.unwrap().statement, 2);
    assert_eq!(after.unwrap().statement, 2);
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0000"],
            vec!["key-s001", "key-g001", "key-g002", "key-s002"],
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn run_all_answers_in_input_order_and_defers_a_repeated_record() {
    let (batcher, fake) = one_worker(Script::Answer);

    let group = ["key-aaaa", "key-bbbb", "key-aaaa"];
    let answers = batcher
        .run_all(group.iter().map(|key| call(key)).collect())
        .await;

    assert_eq!(statement_numbers(answers), [1, 1, 2]);
    assert_eq!(
        fake.statements(),
        [vec!["key-aaaa", "key-bbbb"], vec!["key-aaaa"]]
    );
}

#[tokio::test(start_paused = true)]
async fn run_all_larger_than_max_size_is_split_in_order() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(
        &fake,
        BatchSettings {
            max_size: 2,
            ..settings(1)
        },
    );

    let group = ["key-0001", "key-0002", "key-0003"];
    let answers = batcher
        .run_all(group.iter().map(|key| call(key)).collect())
        .await;

    assert_eq!(statement_numbers(answers), [1, 1, 2]);
}

// The overlap gate.

#[tokio::test(start_paused = true)]
async fn a_second_turn_comes_once_the_first_ran_overlap_after() {
    let running = Arc::new(Running::default());
    let start = Instant::now();

    let _first = running.claim(OVERLAP, 8).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    let _second = running.claim(OVERLAP, 8).await;

    assert_eq!(start.elapsed(), OVERLAP);
}

#[tokio::test(start_paused = true)]
async fn a_second_turn_comes_when_the_first_ends() {
    let running = Arc::new(Running::default());
    let start = Instant::now();
    let first = running.claim(OVERLAP, 8).await;
    let second = tokio::spawn({
        let running = running.clone();
        async move {
            let _turn = running.claim(OVERLAP, 8).await;
            Instant::now()
        }
    });

    tokio::time::sleep(OVERLAP / 4).await;
    drop(first);

    assert_eq!(second.await.unwrap() - start, OVERLAP / 4);
}

#[tokio::test(start_paused = true)]
async fn two_waiters_cannot_both_take_the_idle_turn() {
    let running = Arc::new(Running::default());
    let start = Instant::now();
    let first = running.claim(OVERLAP, 8).await;
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let running = running.clone();
            tokio::spawn(async move {
                let _turn = running.claim(OVERLAP, 8).await;
                let claimed = Instant::now();
                tokio::time::sleep(Duration::from_secs(1)).await;
                claimed
            })
        })
        .collect();

    tokio::time::sleep(5 * MS).await;
    drop(first);

    let mut claimed = Vec::new();
    for waiter in waiters {
        claimed.push(waiter.await.unwrap() - start);
    }
    claimed.sort();
    // One takes the idle turn when the first ends; the other overlaps it
    // only once it ran overlap_after.
    assert_eq!(claimed, [5 * MS, 5 * MS + OVERLAP]);
}

#[tokio::test(start_paused = true)]
async fn a_second_worker_starts_a_statement_only_once_the_first_is_slow() {
    // Statements take longer than overlap_after.
    let fake = Fake::new(Script::Answer, 3 * OVERLAP);
    let batcher = spawn(&fake, settings(2));
    let start = Instant::now();

    run_behind_first(&batcher, "key-0000", &["key-0001"]).await;

    let starts: Vec<Duration> = fake.starts().iter().map(|at| *at - start).collect();
    assert_eq!(starts, [Duration::ZERO, OVERLAP]);
}

#[tokio::test(start_paused = true)]
async fn a_second_worker_waits_for_a_statement_that_is_not_slow() {
    // Statements end before overlap_after.
    let fake = Fake::new(Script::Answer, OVERLAP / 2);
    let batcher = spawn(&fake, settings(2));
    let start = Instant::now();

    run_behind_first(&batcher, "key-0000", &["key-0001"]).await;

    let starts: Vec<Duration> = fake.starts().iter().map(|at| *at - start).collect();
    assert_eq!(starts, [Duration::ZERO, OVERLAP / 2]);
}

#[tokio::test(start_paused = true)]
async fn a_run_alls_overflow_runs_on_another_worker_while_the_first_statement_is_stuck() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(
        &fake,
        BatchSettings {
            max_size: 2,
            ..settings(2)
        },
    );
    let start = Instant::now();

    let group = ["key-0001-stuck", "key-0002", "key-0003", "key-0004"];
    let answers: Vec<Ran> = batcher
        .run_all(group.iter().map(|key| call(key)).collect())
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

    let statements: Vec<usize> = answers.iter().map(|ran| ran.statement).collect();
    assert_eq!(statements, [1, 1, 2, 2]);
    // The second worker, on its own session, once the first ran overlap_after.
    assert_eq!((answers[0].session, answers[2].session), (1, 2));
    let starts: Vec<Duration> = fake.starts().iter().map(|at| *at - start).collect();
    assert_eq!(starts, [Duration::ZERO, OVERLAP]);
}

#[tokio::test(start_paused = true)]
async fn a_records_next_call_waits_for_the_running_statement_holding_it_while_others_go_ahead() {
    let fake = Fake::new(Script::Answer, TAKES);
    let batcher = spawn(&fake, settings(2));
    let start = Instant::now();

    let (twice, other) = tokio::join!(
        batcher.run_all(vec![call("key-0001-stuck"), call("key-0001-stuck")]),
        async {
            tokio::time::sleep(MS).await;
            batcher.run(call("key-0002")).await
        }
    );

    assert_eq!(statement_numbers(twice), [1, 3]);
    assert_eq!(other.unwrap().statement, 2);
    let starts: Vec<Duration> = fake.starts().iter().map(|at| *at - start).collect();
    // The record's second call waits for its first statement to end; the
    // other call behind it does not.
    assert_eq!(starts, [Duration::ZERO, OVERLAP, 100 * TAKES]);
}

// Calls that run alone.

#[tokio::test(start_paused = true)]
async fn a_run_all_whose_statement_failed_for_its_rows_runs_each_call_alone_in_its_place() {
    let (batcher, fake) = one_worker(Script::FailWhenHeld("55P03"));

    let group = ["key-0001", "key-0002-held", "key-0003"];
    let answers = batcher
        .run_all(group.iter().map(|key| call(key)).collect())
        .await;

    let answers: Vec<Ran> = answers.into_iter().map(Result::unwrap).collect();
    assert_eq!(answers, [ALONE, ALONE, ALONE]);
    assert_eq!(fake.alone(), group);
    assert_eq!(fake.tasks(), [None], "at rest, in its caller");
}

#[tokio::test(start_paused = true)]
async fn a_queued_run_all_whose_statement_failed_for_its_rows_runs_each_call_alone() {
    let (batcher, fake) = one_worker(Script::FailWhenHeld("55P03"));

    let group = ["key-0001", "key-0002-held", "key-0003"];
    let (first, answers) = tokio::join!(batcher.run(call("key-0000")), async {
        tokio::time::sleep(MS).await;
        batcher
            .run_all(group.iter().map(|key| call(key)).collect())
            .await
    });
    first.unwrap();

    let answers: Vec<Ran> = answers.into_iter().map(Result::unwrap).collect();
    assert_eq!(answers, [ALONE, ALONE, ALONE]);
    assert_eq!(fake.alone(), group);
    assert!(fake.tasks()[1].is_some(), "queued, in a worker");
}

#[tokio::test(start_paused = true)]
async fn a_statement_failing_for_its_rows_runs_every_call_alone() {
    for code in ["55P03", "40001", "40P01"] {
        let (batcher, fake) = one_worker(Script::FailWhenHeld(code));

        let answers = run_behind_first(
            &batcher,
            "key-0000",
            &["key-0001", "key-0002-held", "key-0003"],
        )
        .await;

        let answers: Vec<Ran> = answers.into_iter().map(Result::unwrap).collect();
        assert_eq!(answers, [ALONE, ALONE, ALONE], "{code}");
        assert_eq!(
            fake.alone(),
            ["key-0001", "key-0002-held", "key-0003"],
            "{code}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_lone_call_whose_statement_failed_for_its_row_runs_alone() {
    let (batcher, fake) = one_worker(Script::FailWhenHeld("55P03"));

    let ran = batcher.run(call("key-0001-held")).await.unwrap();

    assert_eq!(ran, ALONE);
    assert_eq!(fake.alone(), ["key-0001-held"]);
    assert_eq!(
        fake.ended(),
        1,
        "the session of a failed statement is given up"
    );
}

#[tokio::test(start_paused = true)]
async fn a_statement_failing_for_the_database_fails_every_call_and_runs_none_alone() {
    // 57014: the statement timeout, which says nothing about one row.
    let (batcher, fake) = one_worker(Script::FailWhenHeld("57014"));

    let answers = run_behind_first(&batcher, "key-0000", &["key-0001", "key-0002-held"]).await;

    assert!(
        answers
            .iter()
            .all(|answer| matches!(answer, Err(StoreError::Unavailable(_)))),
        "{answers:?}"
    );
    assert!(fake.alone().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_statement_failing_for_a_bug_runs_each_call_again_on_its_own() {
    // 42P01: undefined table, neither the database's health nor a row lock.
    let (batcher, fake) = one_worker(Script::FailWhenHeld("42P01"));

    let answers = run_behind_first(
        &batcher,
        "key-0000",
        &["key-0001", "key-0002-held", "key-0003"],
    )
    .await;

    assert!(answers[0].is_ok() && answers[2].is_ok(), "{answers:?}");
    assert!(
        matches!(answers[1], Err(StoreError::Internal(_))),
        "{answers:?}"
    );
    assert_eq!(
        fake.statements(),
        [
            vec!["key-0000"],
            vec!["key-0001", "key-0002-held", "key-0003"],
            vec!["key-0001"],
            vec!["key-0002-held"],
            vec!["key-0003"],
        ]
    );
    assert!(fake.alone().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_batch_answering_too_few_results_fails_its_calls() {
    let (batcher, _fake) = one_worker(Script::AnswerNothing);

    let (first, behind) = tokio::join!(batcher.run(call("key-0000")), async {
        tokio::time::sleep(MS).await;
        join_all(["key-0001", "key-0002"].map(|key| batcher.run(call(key)))).await
    });

    assert!(matches!(first, Err(StoreError::Corrupt(_))), "{first:?}");
    assert!(
        behind
            .iter()
            .all(|answer| matches!(answer, Err(StoreError::Corrupt(_)))),
        "{behind:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_statement_answering_too_few_results_fails_its_calls() {
    let (batcher, _fake) = one_worker(Script::AnswerNothing);

    let answer = batcher.run(call("key-0001")).await;

    assert!(matches!(answer, Err(StoreError::Corrupt(_))), "{answer:?}");
}

// Callers that left.

#[tokio::test(start_paused = true)]
async fn a_call_whose_caller_left_while_it_queued_is_not_run() {
    let (batcher, fake) = one_worker(Script::Answer);
    let run = |key| run_in_task(&batcher, key);
    // The first statement runs; the next calls queue.
    let first = run("key-0001");
    tokio::time::sleep(MS).await;
    let left = run("key-0002");
    let stays = run("key-0003");
    tokio::time::sleep(MS).await;

    left.abort();

    first.await.unwrap().unwrap();
    stays.await.unwrap().unwrap();
    assert_eq!(fake.statements(), [["key-0001"], ["key-0003"]]);
}

#[tokio::test(start_paused = true)]
async fn a_batch_whose_callers_all_left_runs_no_statement() {
    let (batcher, fake) = one_worker(Script::Answer);
    let first = run_in_task(&batcher, "key-0001");
    tokio::time::sleep(MS).await;
    let left = run_in_task(&batcher, "key-0002");
    tokio::time::sleep(MS).await;

    left.abort();

    first.await.unwrap().unwrap();
    tokio::time::sleep(TAKES * 10).await;
    assert_eq!(fake.statements().len(), 1);
}

// The kept session.

#[tokio::test(start_paused = true)]
async fn a_worker_keeps_its_session_between_statements() {
    let (batcher, fake) = one_worker(Script::Answer);
    for key in ["key-0001", "key-0002", "key-0003"] {
        assert_eq!(batcher.run(call(key)).await.unwrap().session, 1);
        tokio::time::sleep(KEEP_IDLE / 2).await;
    }
    assert_eq!(fake.ended(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_worker_gives_its_session_back_once_idle() {
    let (batcher, fake) = one_worker(Script::Answer);
    assert_eq!(batcher.run(call("key-0001")).await.unwrap().session, 1);
    tokio::time::sleep(KEEP_IDLE * 2).await;
    // Given back while waiting, not only when the next call comes.
    assert_eq!(fake.ended(), 1);
    assert_eq!(batcher.run(call("key-0002")).await.unwrap().session, 2);
}

#[tokio::test(start_paused = true)]
async fn every_idle_worker_gives_its_session_back() {
    // Slow statements, so that the second overlaps the first and each
    // worker opens a session.
    let fake = Fake::new(Script::Answer, 3 * OVERLAP);
    let batcher = spawn(&fake, settings(2));
    run_behind_first(&batcher, "key-0000", &["key-0001"]).await;
    assert_eq!(fake.opened.load(Ordering::SeqCst), 2);
    assert_eq!(fake.ended(), 0);

    tokio::time::sleep(KEEP_IDLE * 2).await;

    assert_eq!(fake.ended(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_worker_woken_for_nothing_still_gives_its_session_back_once_idle() {
    let (batcher, fake) = one_worker(Script::Answer);
    let start = Instant::now();
    batcher.run(call("key-0001")).await.unwrap();

    // Wakes that find nothing to run (as when another worker took the
    // calls): calls whose callers left before the worker looked.
    for wake in 1..=4 {
        tokio::time::sleep_until(start + wake * KEEP_IDLE / 4).await;
        let input = call("key-0002");
        let record = batcher.queue.record_of(&input);
        let (job, answer) = batcher.queue.job(input, record);
        drop(answer);
        batcher.queue.push(vec![job]);
    }
    tokio::time::sleep_until(start + TAKES + KEEP_IDLE + MS).await;

    // Idle counts from the end of the last statement, not from a wake.
    assert_eq!(fake.statements().len(), 1);
    assert_eq!(fake.ended(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_busy_worker_gives_its_session_back_at_keep_at_most_while_it_waits() {
    let (batcher, fake) = one_worker(Script::Answer);
    let start = Instant::now();
    let mut at = Duration::ZERO;
    while at < KEEP_AT_MOST {
        tokio::time::sleep_until(start + at).await;
        let key = format!("key-{:08}", at.as_millis());
        assert_eq!(batcher.run(call(&key)).await.unwrap().session, 1);
        at += KEEP_IDLE / 2;
    }

    // Its last statement ended under KEEP_IDLE ago.
    tokio::time::sleep_until(start + KEEP_AT_MOST + MS).await;

    assert_eq!(fake.ended(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_busy_worker_still_renews_its_session() {
    let (batcher, fake) = one_worker(Script::Answer);
    let mut sessions = Vec::new();
    let mut elapsed = Duration::ZERO;
    while elapsed <= KEEP_AT_MOST + KEEP_IDLE {
        let key = format!("key-{:08}", elapsed.as_millis());
        sessions.push(batcher.run(call(&key)).await.unwrap().session);
        tokio::time::sleep(KEEP_IDLE / 2).await;
        elapsed += KEEP_IDLE / 2;
    }
    assert_eq!(sessions.first(), Some(&1));
    assert_eq!(sessions.last(), Some(&2));
    assert_eq!(fake.ended(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_statement_gives_its_session_up() {
    let (batcher, fake) = one_worker(Script::FailWhenHeld("57014"));
    batcher.run(call("key-0001-held")).await.unwrap_err();
    assert_eq!(fake.ended(), 1);
    assert_eq!(batcher.run(call("key-0002")).await.unwrap().session, 2);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_batcher_ends_its_workers_session() {
    let (batcher, fake) = one_worker(Script::Answer);
    batcher.run(call("key-0001")).await.unwrap();
    drop(batcher);
    tokio::time::sleep(MS).await;
    assert_eq!(fake.ended(), 1);
}

// Sessions shared by batchers.

/// Two batchers of one worker each, sharing their kept sessions, as the
/// store's Acquire and Complete batchers do; one fake counts the sessions.
fn two_sharing(fake: &Arc<Fake>) -> (Tested, Tested) {
    let kept = Arc::new(Kept::default());
    let batcher = |name| {
        Arc::new(Batcher::spawn(
            name,
            settings(1),
            fake.clone(),
            kept.clone(),
        ))
    };
    (batcher("first"), batcher("second"))
}

#[tokio::test(start_paused = true)]
async fn batchers_sharing_kept_sessions_run_one_after_another_on_the_same_one() {
    let fake = Fake::new(Script::Answer, TAKES);
    let (acquires, completes) = two_sharing(&fake);
    for key in ["key-0001", "key-0002", "key-0003"] {
        assert_eq!(acquires.run(call(key)).await.unwrap().session, 1);
        assert_eq!(completes.run(call(key)).await.unwrap().session, 1);
    }
    assert_eq!(fake.opened.load(Ordering::SeqCst), 1);
    assert_eq!(fake.ended(), 0);
}

#[tokio::test(start_paused = true)]
async fn statements_at_once_run_on_sessions_of_their_own_and_the_next_takes_the_one_used_last() {
    let fake = Fake::new(Script::Answer, TAKES);
    let (acquires, completes) = two_sharing(&fake);
    let (first, second) = tokio::join!(acquires.run(call("key-0001")), async {
        tokio::time::sleep(MS).await;
        completes.run(call("key-0002")).await
    });
    assert_eq!((first.unwrap().session, second.unwrap().session), (1, 2));

    // Session 2's statement ended last.
    assert_eq!(acquires.run(call("key-0003")).await.unwrap().session, 2);
    assert_eq!(fake.opened.load(Ordering::SeqCst), 2);

    // Both are given back once idle, whichever batcher's worker waits.
    tokio::time::sleep(KEEP_IDLE * 2).await;
    assert_eq!(fake.ended(), 2);
    assert_eq!(completes.run(call("key-0004")).await.unwrap().session, 3);
}

#[tokio::test(start_paused = true)]
async fn a_session_due_when_taken_is_given_back_and_a_new_one_opened() {
    let fake = Fake::new(Script::Answer, TAKES);
    let (acquires, completes) = two_sharing(&fake);
    let start = Instant::now();
    // Session 1 serves both batchers, never idle for KEEP_IDLE, until it
    // is KEEP_AT_MOST old.
    let mut at = Duration::ZERO;
    let mut sessions = Vec::new();
    while at <= KEEP_AT_MOST {
        tokio::time::sleep_until(start + at).await;
        let key = format!("key-{:08}", at.as_millis());
        sessions.push(acquires.run(call(&key)).await.unwrap().session);
        sessions.push(completes.run(call(&key)).await.unwrap().session);
        at += KEEP_IDLE / 2;
    }
    assert_eq!(sessions.first(), Some(&1));
    assert_eq!(sessions.last(), Some(&2));
    assert_eq!(fake.ended(), 1);
}

// The kept sessions' stack alone.

fn session(number: usize, ended: &Arc<AtomicUsize>) -> Session {
    Session {
        number,
        ended: ended.clone(),
    }
}

#[tokio::test(start_paused = true)]
async fn the_session_used_last_is_taken_first() {
    let (kept, ended) = (Kept::default(), Arc::new(AtomicUsize::new(0)));
    kept.put(session(1, &ended), Instant::now());
    tokio::time::advance(MS).await;
    kept.put(session(2, &ended), Instant::now());

    let (taken, _) = kept.take().unwrap();
    assert_eq!(taken.number, 2);
    let (taken, _) = kept.take().unwrap();
    assert_eq!(taken.number, 1);
    assert!(kept.take().is_none());
}

#[tokio::test(start_paused = true)]
async fn sessions_due_on_top_are_given_back_and_the_one_under_them_taken() {
    let (kept, ended) = (Kept::default(), Arc::new(AtomicUsize::new(0)));
    let start = Instant::now();
    tokio::time::advance(KEEP_AT_MOST).await;
    kept.put(session(1, &ended), Instant::now());
    // Used last, but opened KEEP_AT_MOST ago.
    kept.put(session(2, &ended), start);

    let (taken, opened) = kept.take().unwrap();

    assert_eq!((taken.number, opened), (1, start + KEEP_AT_MOST));
    assert_eq!(ended.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn expire_gives_back_the_idle_sessions_that_are_due_and_tells_the_next_due() {
    let (kept, ended) = (Kept::default(), Arc::new(AtomicUsize::new(0)));
    let start = Instant::now();
    kept.put(session(1, &ended), start);
    tokio::time::advance(KEEP_IDLE / 2).await;
    kept.put(session(2, &ended), Instant::now());
    assert_eq!(kept.expire(), Some(start + KEEP_IDLE));

    tokio::time::advance(KEEP_IDLE / 2).await;
    assert_eq!(kept.expire(), Some(start + KEEP_IDLE * 3 / 2));
    assert_eq!(ended.load(Ordering::SeqCst), 1);
    assert_eq!(kept.take().unwrap().0.number, 2);
    assert_eq!(kept.expire(), None);
}
