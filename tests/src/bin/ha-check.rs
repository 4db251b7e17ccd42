//! `ha-check`: load on the service through a Postgres failover and a planned
//! switchover, then the checks of `make test-ha`, printed as figures.
//! scripts/test-ha.sh builds the cluster (etcd, Patroni, HAProxy, PgBouncer)
//! and runs this; it can be pointed at any servers by hand.
//!
//! ```text
//! ha-check wait-serving --health ADDR[,ADDR…] [--within 90s]
//! ha-check run --endpoints ADDR[,ADDR…] --health ADDR[,ADDR…] --verify ADDR
//!              [--event NAME=COMMAND]… [--before-each COMMAND]
//!              [--tasks 32] [--steady 5s]
//!              [--duplicates 20] [--recover-within 90s] [--lease 30s]
//! ```
//!
//! `run` keeps `--tasks` tasks busy, spread over the endpoints: Acquire, a
//! few milliseconds of "business logic", Complete. One call in
//! `--duplicates` percent reuses a key another task sent moments before, so
//! duplicates meet in flight. Every call is made on the generated stubs so
//! that each failed attempt's gRPC code is seen (the client crate folds the
//! transient codes into one error and gives up after its retry budget); the
//! retries are the client crate's: transient codes (UNAVAILABLE,
//! DEADLINE_EXCEEDED) again after a full-jitter backoff of 25 ms doubling
//! to 1 s, and a Complete again with the same token until it is answered.
//!
//! The phases: steady for `--steady`; then each `--event` in turn (the
//! command runs with `sh -c`, after `--before-each` has succeeded, e.g. a
//! wait for a synchronous standby; times count from the event's command
//! on), the load going on until calls and every
//! health check succeed again for 2 s (at most `--recover-within`), and
//! `--steady` more. Then the load stops, every Complete still being retried
//! is answered, and every acknowledged Complete is replayed through
//! `--verify` (a server with no replay cache, so the answer comes from the
//! database).
//!
//! It exits 1 when a check fails: an acknowledged Complete lost or replayed
//! with another response, a key completed twice with different responses,
//! the business logic run twice for one key under a live lease, a failed
//! call with a code the contract does not call retryable, a phase with no
//! acknowledged Complete, or no recovery in time.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    process::ExitCode,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use idempotency_client::pb::{
    self, acquire_response::Outcome, idempotency_service_client::IdempotencyServiceClient,
};
use tonic::{Code, transport::Channel};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// Codes the contract (docs/contract.md, "Across all RPCs") tells clients to
/// retry. Any other failed call fails the check.
const RETRYABLE: [Code; 2] = [Code::Unavailable, Code::DeadlineExceeded];
/// Deadline of one call attempt (the client crate's default is 10 s; shorter
/// here so that a call stuck on a dead connection shows in the figures).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Calls and health must succeed this long after an event for it to be over.
const QUIET: Duration = Duration::from_secs(2);
const NAMESPACE: &str = "ha-check";
const OPERATION: &str = "POST /payments";

#[derive(Debug, Clone)]
struct Options {
    endpoints: Vec<String>,
    health: Vec<String>,
    verify: Option<String>,
    events: Vec<(String, String)>,
    /// Run (and waited for) before each event, its time not counted.
    before_each: Option<String>,
    tasks: usize,
    steady: Duration,
    duplicates: u32,
    recover_within: Duration,
    lease: Duration,
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    let (number, unit) = value.split_at(
        value
            .find(|c: char| c.is_alphabetic())
            .unwrap_or(value.len()),
    );
    let number: f64 = number
        .parse()
        .map_err(|_| format!("not a duration: {value}"))?;
    let seconds = match unit {
        "ms" => number / 1000.0,
        "s" | "" => number,
        "m" => number * 60.0,
        _ => return Err(format!("not a duration: {value}")),
    };
    Ok(Duration::from_secs_f64(seconds))
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        endpoints: Vec::new(),
        health: Vec::new(),
        verify: None,
        events: Vec::new(),
        before_each: None,
        tasks: 32,
        steady: Duration::from_secs(5),
        duplicates: 20,
        recover_within: Duration::from_secs(90),
        lease: Duration::from_secs(30),
    };
    let list = |value: &str| value.split(',').map(str::to_owned).collect::<Vec<_>>();
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--endpoints" => options.endpoints = list(value),
            "--health" => options.health = list(value),
            "--verify" => options.verify = Some(value.clone()),
            "--event" => {
                let (name, command) = value
                    .split_once('=')
                    .ok_or_else(|| format!("--event takes NAME=COMMAND, not {value}"))?;
                options.events.push((name.to_owned(), command.to_owned()));
            }
            "--before-each" => options.before_each = Some(value.clone()),
            "--tasks" => options.tasks = value.parse().map_err(|_| "--tasks: a number")?,
            "--steady" => options.steady = parse_duration(value)?,
            "--duplicates" => {
                options.duplicates = value.parse().map_err(|_| "--duplicates: a percentage")?
            }
            "--recover-within" => options.recover_within = parse_duration(value)?,
            "--lease" => options.lease = parse_duration(value)?,
            "--within" => options.recover_within = parse_duration(value)?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        eprintln!("usage: ha-check wait-serving|run [flags] (see the source's header)");
        return ExitCode::from(2);
    };
    let options = match parse_options(rest) {
        Ok(options) => options,
        Err(error) => {
            eprintln!("ha-check: {error}");
            return ExitCode::from(2);
        }
    };
    match command.as_str() {
        "wait-serving" => wait_serving(&options).await,
        "run" => run(options).await,
        other => {
            eprintln!("ha-check: unknown command {other}");
            ExitCode::from(2)
        }
    }
}

fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("an address host:port")
        .connect_timeout(Duration::from_secs(1))
        .connect_lazy()
}

/// Waits until every health address answers SERVING.
async fn wait_serving(options: &Options) -> ExitCode {
    let started = Instant::now();
    for addr in &options.health {
        let mut health = HealthClient::new(channel(addr));
        loop {
            if check_health(&mut health).await == "SERVING" {
                break;
            }
            if started.elapsed() > options.recover_within {
                eprintln!(
                    "ha-check: {addr} not SERVING within {:?}",
                    options.recover_within
                );
                return ExitCode::FAILURE;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "ha-check: {} SERVING after {:.1} s",
        options.health.join(", "),
        started.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}

async fn check_health(health: &mut HealthClient<Channel>) -> &'static str {
    let call = health.check(HealthCheckRequest {
        service: String::new(),
    });
    match tokio::time::timeout(Duration::from_secs(1), call).await {
        Ok(Ok(answer)) => match answer.into_inner().status() {
            ServingStatus::Serving => "SERVING",
            ServingStatus::NotServing => "NOT_SERVING",
            _ => "UNKNOWN",
        },
        Ok(Err(_)) | Err(_) => "UNREACHABLE",
    }
}

/// One call attempt: which RPC, when, and its code (`Code::Ok` for success).
#[derive(Debug, Clone, Copy)]
struct Call {
    rpc: &'static str,
    start: Instant,
    end: Instant,
    code: Code,
}

/// One run of the business logic.
#[derive(Debug, Clone)]
struct Run {
    key: String,
    token: u64,
    acquired_at: Instant,
    start: Instant,
    end: Instant,
}

/// Everything the load saw, for the checks at the end.
#[derive(Default)]
struct Record {
    calls: Vec<Call>,
    runs: Vec<Run>,
    /// Acknowledged Completes: key, the response body, when answered.
    acks: Vec<(String, Vec<u8>, Instant)>,
    /// Replays the load itself got (duplicates): key, the body.
    replays: Vec<(String, Vec<u8>)>,
    /// Other outcomes by name (IN_PROGRESS, FAILED, lease lost…).
    outcomes: BTreeMap<&'static str, u64>,
    /// Health answers: address, when, what.
    health: Vec<(usize, Instant, &'static str)>,
}

struct Shared {
    record: Mutex<Record>,
    /// Keys just sent, for other tasks to send again.
    recent: Mutex<VecDeque<String>>,
    stop: AtomicBool,
    next_key: AtomicU64,
    run_id: String,
    lease: Duration,
}

impl Shared {
    fn note_call(&self, rpc: &'static str, start: Instant, code: Code) {
        let end = Instant::now();
        let mut record = self.record.lock().unwrap();
        record.calls.push(Call {
            rpc,
            start,
            end,
            code,
        });
    }

    fn note_outcome(&self, outcome: &'static str) {
        *self
            .record
            .lock()
            .unwrap()
            .outcomes
            .entry(outcome)
            .or_default() += 1;
    }

    /// A fresh key, or (`duplicates` percent of the time) one sent moments ago.
    fn pick_key(&self, duplicates: u32) -> String {
        let mut recent = self.recent.lock().unwrap();
        if !recent.is_empty() && fastrand::u32(0..100) < duplicates {
            return recent[fastrand::usize(0..recent.len())].clone();
        }
        let key = format!(
            "{}-{:08}",
            self.run_id,
            self.next_key.fetch_add(1, Ordering::Relaxed)
        );
        if recent.len() == 64 {
            recent.pop_front();
        }
        recent.push_back(key.clone());
        key
    }
}

fn record_id(key: &str) -> pb::RecordId {
    pb::RecordId {
        namespace: NAMESPACE.into(),
        operation: OPERATION.into(),
        subject: String::new(),
        key: key.into(),
    }
}

fn pb_duration(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: duration.as_secs() as i64,
        nanos: duration.subsec_nanos() as i32,
    }
}

fn backoff(retry: u32) -> Duration {
    let ceiling = Duration::from_millis(25)
        .saturating_mul(1 << retry.min(16))
        .min(Duration::from_secs(1));
    ceiling.mul_f64(fastrand::f64())
}

/// tonic enforces the `grpc-timeout` it sends as well, and reports its
/// expiry as CANCELLED, usually on the same tick as our own timeout: a call
/// that ran out of time is a deadline, as the client crate counts it.
fn timed_out_as_deadline(code: Code, start: Instant) -> Code {
    if code == Code::Cancelled && start.elapsed() >= ATTEMPT_TIMEOUT {
        Code::DeadlineExceeded
    } else {
        code
    }
}

fn acquire_request(key: &str, lease: Duration) -> pb::AcquireRequest {
    pb::AcquireRequest {
        id: Some(record_id(key)),
        fingerprint: b"ha-check request".to_vec(),
        ttl: Some(pb_duration(Duration::from_secs(3600))),
        lease: Some(pb_duration(lease)),
    }
}

/// Acquires `key`, retrying transient codes until answered; `None` when
/// the answer is a code that is not retried, or the load stopped first.
async fn acquire(
    shared: &Shared,
    client: &mut IdempotencyServiceClient<Channel>,
    key: &str,
) -> Option<Outcome> {
    for retry in 0.. {
        let start = Instant::now();
        let mut request = tonic::Request::new(acquire_request(key, shared.lease));
        request.set_timeout(ATTEMPT_TIMEOUT);
        let code = match tokio::time::timeout(ATTEMPT_TIMEOUT, client.acquire(request)).await {
            Ok(Ok(answer)) => {
                shared.note_call("Acquire", start, Code::Ok);
                return answer.into_inner().outcome;
            }
            Ok(Err(status)) => timed_out_as_deadline(status.code(), start),
            Err(_) => Code::DeadlineExceeded,
        };
        shared.note_call("Acquire", start, code);
        if !RETRYABLE.contains(&code) || shared.stop.load(Ordering::Relaxed) {
            return None;
        }
        tokio::time::sleep(backoff(retry)).await;
    }
    unreachable!()
}

/// Completes with the same token until answered (a transient failure may
/// have committed, and the repeat is answered as the first was).
async fn complete(
    shared: &Shared,
    client: &mut IdempotencyServiceClient<Channel>,
    key: &str,
    token: u64,
    body: Vec<u8>,
) {
    for retry in 0.. {
        let start = Instant::now();
        let mut request = tonic::Request::new(pb::CompleteRequest {
            id: Some(record_id(key)),
            fencing_token: token,
            response: Some(pb::StoredResponse {
                status_code: 201,
                body: body.clone(),
                headers: Default::default(),
            }),
        });
        request.set_timeout(ATTEMPT_TIMEOUT);
        let code = match tokio::time::timeout(ATTEMPT_TIMEOUT, client.complete(request)).await {
            Ok(Ok(_)) => Code::Ok,
            Ok(Err(status)) => timed_out_as_deadline(status.code(), start),
            Err(_) => Code::DeadlineExceeded,
        };
        shared.note_call("Complete", start, code);
        if code == Code::Ok {
            let now = Instant::now();
            shared
                .record
                .lock()
                .unwrap()
                .acks
                .push((key.to_owned(), body, now));
            return;
        }
        if !RETRYABLE.contains(&code) {
            shared.note_outcome(if code == Code::Aborted {
                "Complete ABORTED (lease lost)"
            } else {
                "Complete refused"
            });
            return;
        }
        tokio::time::sleep(backoff(retry)).await;
    }
}

async fn load_task(
    shared: Arc<Shared>,
    mut client: IdempotencyServiceClient<Channel>,
    task: usize,
    duplicates: u32,
) {
    while !shared.stop.load(Ordering::Relaxed) {
        let key = shared.pick_key(duplicates);
        let acquired_at = Instant::now();
        match acquire(&shared, &mut client, &key).await {
            Some(Outcome::Acquired(acquired)) => {
                let token = acquired.fencing_token;
                let start = Instant::now();
                // The business logic: a few milliseconds of a downstream call.
                tokio::time::sleep(Duration::from_millis(fastrand::u64(2..=6))).await;
                let end = Instant::now();
                shared.record.lock().unwrap().runs.push(Run {
                    key: key.clone(),
                    token,
                    acquired_at,
                    start,
                    end,
                });
                let body = format!("{key} ran with token {token} in task {task}").into_bytes();
                complete(&shared, &mut client, &key, token, body).await;
            }
            Some(Outcome::Completed(completed)) => {
                let body = completed.response.map(|r| r.body).unwrap_or_default();
                shared.record.lock().unwrap().replays.push((key, body));
            }
            Some(Outcome::InProgress(_)) => shared.note_outcome("Acquire IN_PROGRESS"),
            Some(Outcome::Failed(_)) => shared.note_outcome("Acquire FAILED"),
            Some(Outcome::FingerprintMismatch(_)) => {
                shared.note_outcome("Acquire FINGERPRINT_MISMATCH")
            }
            None => {}
        }
    }
}

async fn health_task(shared: Arc<Shared>, index: usize, addr: String) {
    let mut health = HealthClient::new(channel(&addr));
    let mut last = "";
    while !shared.stop.load(Ordering::Relaxed) {
        let status = check_health(&mut health).await;
        if status != last {
            last = status;
            let now = Instant::now();
            shared
                .record
                .lock()
                .unwrap()
                .health
                .push((index, now, status));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An event and when its phases began and ended.
#[derive(Debug, Clone)]
struct Event {
    name: String,
    at: Instant,
    /// How long its command ran.
    took: Duration,
    /// When calls and health had succeeded for [`QUIET`] (`None`: never).
    quiet_at: Option<Instant>,
}

/// Whether, at `now`, calls since `since` have succeeded for [`QUIET`]
/// after the last failure, and every health check answers SERVING.
fn settled(record: &Record, since: Instant, health_count: usize, now: Instant) -> bool {
    let last_failure = record
        .calls
        .iter()
        .filter(|call| call.end >= since && call.code != Code::Ok)
        .map(|call| call.end)
        .max()
        .unwrap_or(since);
    let succeeded_after = record
        .calls
        .iter()
        .any(|call| call.code == Code::Ok && call.start > last_failure);
    let mut latest: HashMap<usize, &str> = HashMap::new();
    for (index, _, status) in &record.health {
        latest.insert(*index, status);
    }
    let all_serving = (0..health_count).all(|index| latest.get(&index) == Some(&"SERVING"));
    succeeded_after && all_serving && now.duration_since(last_failure) >= QUIET
}

async fn run(options: Options) -> ExitCode {
    if options.endpoints.is_empty() {
        eprintln!("ha-check: --endpoints is required");
        return ExitCode::from(2);
    }
    let shared = Arc::new(Shared {
        record: Mutex::default(),
        recent: Mutex::default(),
        stop: AtomicBool::new(false),
        next_key: AtomicU64::new(0),
        run_id: format!("ha-{}-{:x}", std::process::id(), fastrand::u32(..)),
        lease: options.lease,
    });
    let channels: Vec<Channel> = options.endpoints.iter().map(|addr| channel(addr)).collect();
    let mut health_tasks = Vec::new();
    for (index, addr) in options.health.iter().enumerate() {
        health_tasks.push(tokio::spawn(health_task(
            shared.clone(),
            index,
            addr.clone(),
        )));
    }
    let load_started = Instant::now();
    let mut tasks = Vec::new();
    for task in 0..options.tasks {
        let client = IdempotencyServiceClient::new(channels[task % channels.len()].clone());
        tasks.push(tokio::spawn(load_task(
            shared.clone(),
            client,
            task,
            options.duplicates,
        )));
    }

    println!(
        "ha-check: {} tasks on {}; steady {:?}",
        options.tasks,
        options.endpoints.join(", "),
        options.steady
    );
    tokio::time::sleep(options.steady).await;
    let mut events = Vec::new();
    let mut command_failed = false;
    for (name, command) in &options.events {
        if let Some(before) = &options.before_each
            && let Err(error) = shell(before).await
        {
            eprintln!("ha-check: before {name}: `{before}` {error}");
            command_failed = true;
            break;
        }
        let at = Instant::now();
        println!(
            "ha-check: {name}: `{command}` at {:.1} s",
            at.duration_since(load_started).as_secs_f64()
        );
        let outcome = shell(command).await;
        let took = at.elapsed();
        if let Err(error) = outcome {
            eprintln!("ha-check: {name}: `{command}` {error}");
            command_failed = true;
        }
        let quiet_at = loop {
            let now = Instant::now();
            if settled(
                &shared.record.lock().unwrap(),
                at,
                options.health.len(),
                now,
            ) {
                break Some(now);
            }
            if now.duration_since(at) > options.recover_within {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        events.push(Event {
            name: name.clone(),
            at,
            took,
            quiet_at,
        });
        if quiet_at.is_none() {
            eprintln!(
                "ha-check: {name}: no recovery within {:?}",
                options.recover_within
            );
            break;
        }
        println!(
            "ha-check: {name}: settled after {:.1} s; steady {:?}",
            at.elapsed().as_secs_f64(),
            options.steady
        );
        tokio::time::sleep(options.steady).await;
    }
    let load_ended = Instant::now();
    shared.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a load task");
    }
    for task in health_tasks {
        task.await.expect("a health task");
    }
    let record = std::mem::take(&mut *shared.record.lock().unwrap());
    let verified = match &options.verify {
        Some(addr) => Some(verify(&record, addr, options.tasks).await),
        None => None,
    };
    let report = Report {
        record: &record,
        events: &events,
        load_started,
        load_ended,
        lease: options.lease,
        health: &options.health,
    };
    let mut pass = report.print(verified.as_ref());
    if command_failed {
        println!("  CHECK FAILED: an event's command failed (above)");
        pass = false;
    }
    if pass {
        println!("ha-check: PASS");
        ExitCode::SUCCESS
    } else {
        println!("ha-check: FAIL");
        ExitCode::FAILURE
    }
}

/// Runs `command` with `sh -c`, its output going to ours.
async fn shell(command: &str) -> Result<(), String> {
    let command = command.to_owned();
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(command)
            .status()
    })
    .await
    .expect("the command's thread");
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("failed: {status}")),
        Err(error) => Err(format!("could not run: {error}")),
    }
}

/// What replaying every acknowledged Complete found.
#[derive(Debug, Default)]
struct Verified {
    keys: usize,
    same: usize,
    different: usize,
    /// The key was free again: the Complete is gone.
    lost: usize,
    /// Another answer (IN_PROGRESS, FAILED), or no answer at all.
    other: usize,
    /// The keys that replayed with their acknowledged response.
    replayed: HashSet<String>,
}

/// A key and the response its acknowledged Complete stored.
type Expected = (String, Vec<u8>);

/// Acquires every acknowledged key through `addr` and compares the replay.
async fn verify(record: &Record, addr: &str, concurrency: usize) -> Verified {
    let mut expected: BTreeMap<&str, &[u8]> = BTreeMap::new();
    for (key, body, _) in &record.acks {
        expected.insert(key, body);
    }
    let queue: Arc<Mutex<Vec<Expected>>> = Arc::new(Mutex::new(
        expected
            .iter()
            .map(|(key, body)| (key.to_string(), body.to_vec()))
            .collect(),
    ));
    let result = Arc::new(Mutex::new(Verified {
        keys: expected.len(),
        ..Verified::default()
    }));
    let channel = channel(addr);
    let shared = Arc::new(Shared {
        record: Mutex::default(),
        recent: Mutex::default(),
        stop: AtomicBool::new(false),
        next_key: AtomicU64::new(0),
        run_id: String::new(),
        lease: Duration::from_secs(1),
    });
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (queue, result, shared) = (queue.clone(), result.clone(), shared.clone());
        let mut client = IdempotencyServiceClient::new(channel.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let Some((key, body)) = queue.lock().unwrap().pop() else {
                    return;
                };
                let outcome = acquire(&shared, &mut client, &key).await;
                let mut result = result.lock().unwrap();
                match outcome {
                    Some(Outcome::Completed(completed)) => {
                        if completed.response.map(|r| r.body) == Some(body) {
                            result.same += 1;
                            result.replayed.insert(key);
                        } else {
                            result.different += 1;
                        }
                    }
                    Some(Outcome::Acquired(_)) => result.lost += 1,
                    _ => result.other += 1,
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("a verifying task");
    }
    let failed_calls = shared
        .record
        .lock()
        .unwrap()
        .calls
        .iter()
        .filter(|c| c.code != Code::Ok)
        .count();
    if failed_calls > 0 {
        println!("ha-check: verification: {failed_calls} call(s) retried");
    }
    Arc::try_unwrap(result).unwrap().into_inner().unwrap()
}

struct Report<'a> {
    record: &'a Record,
    events: &'a [Event],
    load_started: Instant,
    load_ended: Instant,
    lease: Duration,
    health: &'a [String],
}

fn seconds(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64()
}

impl Report<'_> {
    /// Prints the figures; true when every check passed.
    fn print(&self, verified: Option<&Verified>) -> bool {
        let mut pass = true;
        let record = self.record;
        println!();
        println!("== figures ==");
        println!(
            "load: {:.1} s, {} calls, {} runs of the business logic, {} acknowledged Completes, {} replays to duplicates",
            seconds(self.load_started, self.load_ended),
            record.calls.len(),
            record.runs.len(),
            record.acks.len(),
            record.replays.len()
        );
        for (outcome, count) in &record.outcomes {
            println!("  {outcome}: {count}");
        }
        pass &= self.print_phases(verified);
        for event in self.events {
            pass &= self.print_event(event);
        }
        pass &= self.print_consistency();
        match verified {
            Some(v) => {
                println!(
                    "replayed afterwards (verifier, no replay cache): {} keys acknowledged, {} same response, {} different, {} LOST, {} other",
                    v.keys, v.same, v.different, v.lost, v.other
                );
                if v.same != v.keys {
                    println!(
                        "  CHECK FAILED: every acknowledged Complete must replay with its response"
                    );
                    pass = false;
                }
            }
            None => println!("replayed afterwards: not checked (no --verify)"),
        }
        pass
    }

    /// The phases: steady, then per event "during" (from the event until it
    /// settled) and "after" (until the next event or the end).
    fn phases(&self) -> Vec<(String, Instant, Instant)> {
        let mut starts = vec![("steady, before any event".to_owned(), self.load_started)];
        for event in self.events {
            starts.push((format!("during {}", event.name), event.at));
            if let Some(quiet_at) = event.quiet_at {
                starts.push((format!("after {}", event.name), quiet_at));
            }
        }
        let ends: Vec<Instant> = starts
            .iter()
            .skip(1)
            .map(|(_, at)| *at)
            .chain([self.load_ended])
            .collect();
        starts
            .into_iter()
            .zip(ends)
            .map(|((name, start), end)| (name, start, end))
            .collect()
    }

    /// Per phase: acknowledged Completes, and failed calls by RPC and code.
    /// Fails on a phase outside an event with nothing acknowledged, and on
    /// any failed call whose code is not retryable.
    fn print_phases(&self, verified: Option<&Verified>) -> bool {
        let mut pass = true;
        println!(
            "per phase (Completes acknowledged, and replayed afterwards with the same response; failed call attempts by RPC and gRPC code):"
        );
        let phases = self.phases();
        for (index, (name, start, end)) in phases.iter().enumerate() {
            let last = index + 1 == phases.len();
            let within = |at: Instant| at >= *start && (at < *end || last);
            let acks = self
                .record
                .acks
                .iter()
                .filter(|(_, _, at)| within(*at))
                .count();
            let replayed = match verified {
                Some(verified) => self
                    .record
                    .acks
                    .iter()
                    .filter(|(key, _, at)| within(*at) && verified.replayed.contains(key))
                    .count()
                    .to_string(),
                None => "-".to_owned(),
            };
            let mut codes: BTreeMap<String, usize> = BTreeMap::new();
            let mut forbidden = 0;
            for call in self
                .record
                .calls
                .iter()
                .filter(|c| c.code != Code::Ok && within(c.end))
            {
                *codes
                    .entry(format!("{} {:?}", call.rpc, call.code))
                    .or_default() += 1;
                forbidden += usize::from(!RETRYABLE.contains(&call.code));
            }
            let failed: usize = codes.values().sum();
            let detail = codes
                .iter()
                .map(|(code, count)| format!("{code} {count}"))
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "  {name:<28} {:>5.1} s {acks:>6} acknowledged {replayed:>6} replayed {failed:>5} failed{}",
                seconds(*start, *end),
                if detail.is_empty() {
                    String::new()
                } else {
                    format!(" ({detail})")
                }
            );
            if acks == 0 && !name.starts_with("during") {
                println!("  CHECK FAILED: no Complete acknowledged {name}");
                pass = false;
            }
            if forbidden > 0 {
                println!(
                    "  CHECK FAILED: {forbidden} call(s) failed with a code that is not retryable"
                );
                pass = false;
            }
        }
        pass
    }

    /// How long calls failed after `event`, and what health said.
    fn print_event(&self, event: &Event) -> bool {
        let end = self
            .events
            .iter()
            .find(|later| later.at > event.at)
            .map_or(self.load_ended, |later| later.at);
        let calls: Vec<&Call> = self
            .record
            .calls
            .iter()
            .filter(|call| call.end >= event.at && call.end < end)
            .collect();
        println!(
            "{} (times from the event's start; its command took {:.2} s):",
            event.name,
            event.took.as_secs_f64()
        );
        let failures: Vec<Instant> = calls
            .iter()
            .filter(|c| c.code != Code::Ok)
            .map(|c| c.end)
            .collect();
        match (failures.iter().min(), failures.iter().max()) {
            (Some(first), Some(last)) => {
                let recovered = calls
                    .iter()
                    .filter(|c| c.code == Code::Ok && c.start > *last)
                    .map(|c| c.end)
                    .min();
                println!(
                    "  calls failed from {:.2} s to {:.2} s; calls succeed again from {}",
                    seconds(event.at, *first),
                    seconds(event.at, *last),
                    recovered.map_or("never".to_owned(), |at| format!(
                        "{:.2} s",
                        seconds(event.at, at)
                    ))
                );
            }
            _ => println!("  no call failed"),
        }
        for (index, addr) in self.health.iter().enumerate() {
            println!(
                "  health of {addr}: {}",
                self.health_text(index, event.at, end)
            );
        }
        match event.quiet_at {
            Some(at) => {
                println!(
                    "  settled (calls and health good for {:?}) at {:.2} s",
                    QUIET,
                    seconds(event.at, at)
                );
                true
            }
            None => {
                println!("  CHECK FAILED: calls or health did not recover");
                false
            }
        }
    }

    /// What the health checks of server `index` answered between `from` and `to`.
    fn health_text(&self, index: usize, from: Instant, to: Instant) -> String {
        let answers: Vec<_> = self
            .record
            .health
            .iter()
            .filter(|(i, at, _)| *i == index && *at >= from && *at < to)
            .collect();
        let Some((_, down_at, status)) = answers.iter().find(|(_, _, status)| *status != "SERVING")
        else {
            return "stayed SERVING".to_owned();
        };
        let back = answers
            .iter()
            .find(|(_, at, status)| at > down_at && *status == "SERVING");
        format!(
            "{status} from {:.2} s, SERVING again from {}",
            seconds(from, *down_at),
            back.map_or("never".to_owned(), |(_, at, _)| format!(
                "{:.2} s",
                seconds(from, *at)
            ))
        )
    }

    /// Keys completed with two responses; logic run twice under a live lease.
    fn print_consistency(&self) -> bool {
        let mut pass = true;
        let mut answers: HashMap<&str, Vec<&[u8]>> = HashMap::new();
        for (key, body, _) in &self.record.acks {
            answers.entry(key).or_default().push(body);
        }
        for (key, body) in &self.record.replays {
            answers.entry(key).or_default().push(body);
        }
        let conflicting = answers
            .values()
            .filter(|bodies| bodies.iter().any(|body| *body != bodies[0]))
            .count();
        let mut runs: HashMap<&str, Vec<&Run>> = HashMap::new();
        for run in &self.record.runs {
            runs.entry(&run.key).or_default().push(run);
        }
        let mut twice = 0;
        let mut under_live_lease = 0;
        for key_runs in runs.values_mut().filter(|runs| runs.len() > 1) {
            twice += 1;
            key_runs.sort_by_key(|run| run.acquired_at);
            // A later run is legitimate only once the earlier lease has
            // passed (and then with a larger token); one that began while
            // the earlier still ran, or within its lease, ran twice under it.
            let overlapping = key_runs.windows(2).any(|pair| {
                pair[1].start < pair[0].end
                    || pair[1].start < pair[0].acquired_at + self.lease
                    || pair[1].token <= pair[0].token
            });
            under_live_lease += usize::from(overlapping);
        }
        println!(
            "keys answered with two different responses (acknowledged or replayed): {conflicting}"
        );
        println!(
            "keys whose business logic ran twice: {twice}, of which under a live lease: {under_live_lease}"
        );
        if conflicting > 0 || under_live_lease > 0 {
            println!(
                "  CHECK FAILED: a key answered twice differently, or run twice under a live lease"
            );
            pass = false;
        }
        pass
    }
}
